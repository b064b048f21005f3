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
    check_unfolded_size(&doc, &imports)?;
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

/// Most subschemas a schema may apply to one value once its `$ref`s are
/// followed. The validator walks every branch of an `anyOf` or `oneOf` for a
/// value that matches none, and builds an error for each: a 2 KB schema of
/// thirty levels, each an `anyOf` of two `$ref`s to the level below, unfolds
/// to 2^30 subschemas, and one 6-byte record would hold a worker and exhaust
/// memory, on every member the partition goes to.
pub(crate) const MAX_UNFOLDED_SUBSCHEMAS: u64 = 100_000;

/// What a `$ref` back into its own chain counts for: the validator follows
/// it once per level of the value, and values are at most this deep. Two
/// branches of one `anyOf`, `oneOf`, `allOf` or `if`/`then`/`else` that both
/// come back double the work at every level of the value: such a schema is
/// refused whatever its size.
const CYCLE_COST: u64 = 128;

/// Refuse a schema that unfolds to more than [`MAX_UNFOLDED_SUBSCHEMAS`].
fn check_unfolded_size(doc: &Value, imports: &HashMap<String, String>) -> Result<(), String> {
    let imported: HashMap<&str, Value> =
        imports.iter().filter_map(|(name, text)| Some((name.as_str(), serde_json::from_str(text).ok()?))).collect();
    let mut unfold = Unfold { imported: &imported, known: HashMap::new(), open: Vec::new(), cycles: 0 };
    let size = unfold.size(doc, doc);
    if size > MAX_UNFOLDED_SUBSCHEMAS {
        return Err(format!(
            "the schema unfolds to over {MAX_UNFOLDED_SUBSCHEMAS} subschemas once its $refs are followed (nested \
             anyOf/oneOf/allOf branches that refer to each other): validating a value against it could take \
             exponential time and memory, so relay does not use it"
        ));
    }
    Ok(())
}

/// The unfolded size of a schema: each subschema counted once per path that
/// reaches it, `$ref` targets measured once and remembered.
struct Unfold<'a> {
    imported: &'a HashMap<&'a str, Value>,
    /// Sizes of `$ref` targets, and the `$ref`s back into their own chain
    /// inside them, by document and place.
    known: HashMap<String, (u64, u64)>,
    /// The `$ref`s being measured, to find a chain that comes back.
    open: Vec<String>,
    /// `$ref`s back into their own chain met so far.
    cycles: u64,
}

impl<'a> Unfold<'a> {
    /// Keywords whose value is one subschema, an array of them, or a map of them.
    const ONE: [&'static str; 8] = [
        "not",
        "items",
        "additionalItems",
        "additionalProperties",
        "contains",
        "propertyNames",
        "unevaluatedItems",
        "unevaluatedProperties",
    ];
    const MAP: [&'static str; 4] = ["properties", "patternProperties", "dependentSchemas", "dependencies"];

    fn size(&mut self, node: &'a Value, doc: &'a Value) -> u64 {
        let Value::Object(map) = node else { return 1 };
        let mut total: u64 = 1;
        let add = |n: u64, total: &mut u64| *total = total.saturating_add(n);
        if let Some(Value::String(r)) = map.get("$ref") {
            let n = self.reference(r, doc);
            add(n, &mut total);
        }
        for key in Self::ONE {
            match map.get(key) {
                Some(v @ Value::Object(_)) => add(self.size(v, doc), &mut total),
                Some(Value::Array(items)) => items.iter().for_each(|v| add(self.size(v, doc), &mut total)),
                _ => {}
            }
        }
        // Branches applied to the same place of the value: two that both
        // come back into their chain make the work exponential in its depth.
        let mut recursing = 0;
        let branches = ["allOf", "anyOf", "oneOf"].iter().filter_map(|k| map.get(*k)).filter_map(Value::as_array);
        let conditional = ["if", "then", "else"].iter().filter_map(|k| map.get(*k));
        for v in branches.flatten().chain(conditional) {
            let before = self.cycles;
            add(self.size(v, doc), &mut total);
            recursing += u32::from(self.cycles > before);
        }
        if recursing >= 2 {
            return u64::MAX;
        }
        if let Some(Value::Array(items)) = map.get("prefixItems") {
            items.iter().for_each(|v| add(self.size(v, doc), &mut total));
        }
        for key in Self::MAP {
            if let Some(Value::Object(members)) = map.get(key) {
                members.values().for_each(|v| add(self.size(v, doc), &mut total));
            }
        }
        total
    }

    /// The size of what `$ref` `r` (in `doc`) reaches: a JSON pointer in
    /// this schema or in one it refers to by name. 1 where it reaches
    /// nothing so written (an anchor, an `$id` inside the schema): the
    /// validator resolves those, and this measure does not follow them.
    fn reference(&mut self, r: &str, doc: &'a Value) -> u64 {
        let (name, pointer) = r.split_once('#').unwrap_or((r, ""));
        let target_doc = if name.is_empty() {
            doc
        } else {
            match self.imported.get(name) {
                Some(d) => d,
                None => return 1,
            }
        };
        // By document and place: two documents may have the same pointer.
        let key = format!("{:p}#{pointer}", target_doc);
        if let Some(&(n, cycles)) = self.known.get(&key) {
            self.cycles += cycles;
            return n;
        }
        if self.open.contains(&key) {
            self.cycles += 1;
            return CYCLE_COST;
        }
        let Some(target) = target_doc.pointer(pointer) else { return 1 };
        self.open.push(key.clone());
        let before = self.cycles;
        let n = self.size(target, target_doc);
        self.open.pop();
        self.known.insert(key, (n, self.cycles - before));
        n
    }
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
