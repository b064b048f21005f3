//! JSON Schema validators built from a registered schema and the schemas it
//! refers to by name; nothing is fetched from elsewhere.

use std::collections::HashMap;

use serde_json::Value;

/// A validator of JSON Schema `schema`, the schemas it refers to
/// (`imports`, by reference name) in its registry, read as Confluent's
/// Python serializer reads them: a reference's name is the `$ref` that
/// reaches it, and `$ref`s inside it resolve against that name (its own
/// top-level `$id` is set aside, as `referencing` looks resources up by
/// the name they were registered under); one without `$schema` is read in
/// the schema's draft. A relative name is also found against the schema's
/// own `$id`. Nothing is fetched ([`NoFetch`]).
pub(crate) fn json_validator(schema: &str, imports: HashMap<String, String>) -> Result<jsonschema::Validator, String> {
    use jsonschema::Draft;
    let doc: Value = serde_json::from_str(schema).map_err(|e| e.to_string())?;
    if imports.is_empty() {
        return options().build(&doc).map_err(|e| e.to_string());
    }
    let draft = match Draft::default().detect(&doc) {
        Draft::Unknown => Draft::default(),
        known => known,
    };
    let base = doc.get("$id").and_then(Value::as_str).and_then(|id| jsonschema::uri::from_str(id).ok());
    let mut imports: Vec<(String, String)> = imports.into_iter().collect();
    imports.sort_unstable();
    let (mut aliases, mut named) = (Vec::new(), Vec::with_capacity(imports.len()));
    for (name, text) in imports {
        let mut contents: Value = serde_json::from_str(&text)
            .map_err(|e| format!("the schema it refers to as {name:?} is not JSON ({e})"))?;
        let draft = draft.detect(&contents);
        if let Some(top) = contents.as_object_mut() {
            top.remove(draft.id_keyword());
        }
        let resource = draft.create_resource(contents);
        if let Some(at) = base.as_ref().and_then(|b| jsonschema::uri::resolve_against(&b.borrow(), &name).ok()) {
            aliases.push((at.to_string(), resource.clone()));
        }
        named.push((name, resource));
    }
    // Added later, a name wins over another's alias at the same address.
    let registry = jsonschema::Registry::new()
        .retriever(NoFetch)
        .extend(aliases.into_iter().chain(named))
        .and_then(jsonschema::RegistryBuilder::prepare)
        .map_err(|e| format!("the schemas it refers to: {e}"))?;
    options().with_registry(&registry).build(&doc).map_err(|e| e.to_string())
}

/// Most backtracking steps a `pattern` may take on one string. Patterns
/// keep the backtracking engine (a schema Confluent's validators take may
/// use lookarounds and backreferences), but its default of 1 000 000 steps
/// a match let a value of tens of thousands of strings, each just under
/// it, hold a worker thread for minutes; past this a string does not match.
pub(crate) const PATTERN_BACKTRACK_LIMIT: usize = 10_000;

/// How every validator is built: nothing fetched, patterns bounded.
pub(crate) fn options() -> jsonschema::ValidationOptions<'static> {
    jsonschema::options()
        .with_retriever(NoFetch)
        .with_pattern_options(jsonschema::PatternOptions::fancy_regex().backtrack_limit(PATTERN_BACKTRACK_LIMIT))
}

/// What a JSON Schema `$ref` no reference names gets: no schema is fetched
/// from a URL or a file (Confluent's Python serializer would fetch a URL;
/// a relay that did would let a registry entry make it call anywhere).
pub(crate) struct NoFetch;

impl jsonschema::Retrieve for NoFetch {
    fn retrieve(&self, _uri: &jsonschema::Uri<String>) -> Result<Value, Box<dyn std::error::Error + Send + Sync>> {
        Err("relay fetches no schema: a $ref reaches only the schema's references, by their names (register the \
             schema it names and list it among the references)"
            .into())
    }
}
