//! JSON Schema errors worded for a dead letter: where and what, never the
//! value.

/// One schema failure, naming where in the data and which rule, never the
/// value: jsonschema's own text quotes the failing value (a card number, or a
/// whole double-encoded payload), and this reason goes to logs, the
/// dead-letter table's reason, the dead-letter topic's header and the console
/// (R16). A `required` failure names the property, which comes from the schema.
pub fn schema_failure(e: &jsonschema::ValidationError<'_>) -> String {
    let at = keyless_path(&e.instance_path().to_string(), &e.evaluation_path().to_string());
    let rule = match e.kind() {
        jsonschema::error::ValidationErrorKind::Required { property } => {
            format!("required property {property} is missing")
        }
        kind => format!("fails \"{}\"", kind.keyword()),
    };
    format!("{at} {rule} (schema {})", e.schema_path())
}

/// Instance path `instance` of a schema failure with every token that is
/// data shown as `*`: a map's keys (`additionalProperties`,
/// `patternProperties`) are the data's own, an answer's or an event's, and
/// may be a card number. Walks the evaluation path (`$ref`s followed)
/// beside it, so a token is shown only where the schema names it
/// (`properties/NAME`) or it is an array index of a few digits. Where the
/// two paths do not step in lockstep (an evaluation path with a step too
/// many, seen under nested `$ref`s), no token is shown.
pub(super) fn keyless_path(instance: &str, schema: &str) -> String {
    /// How the evaluation path steps into the instance.
    enum Step<'s> {
        /// A property the schema declares.
        Name(&'s str),
        /// A key of the data's own.
        Key,
        /// An array's item.
        Index,
    }
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    let mut steps = Vec::new();
    let mut keywords = schema.split('/').skip(1).peekable();
    while let Some(keyword) = keywords.next() {
        match keyword {
            "properties" => steps.push(Step::Name(keywords.next().unwrap_or_default())),
            "patternProperties" => {
                keywords.next();
                steps.push(Step::Key);
            }
            "additionalProperties" | "unevaluatedProperties" => steps.push(Step::Key),
            "items" | "prefixItems" => {
                // An array form (`items/0`, `prefixItems/0`) names its position.
                if keywords.peek().is_some_and(|k| digits(k)) {
                    keywords.next();
                }
                steps.push(Step::Index);
            }
            "additionalItems" | "unevaluatedItems" | "contains" => steps.push(Step::Index),
            // Keywords whose next token is the schema's, not the data's.
            "$defs" | "definitions" | "dependentSchemas" | "dependencies" | "allOf" | "anyOf" | "oneOf" => {
                keywords.next();
            }
            _ => {}
        }
    }
    // A failure of the object or array itself (`additionalProperties:
    // false`, `contains`) ends with its keyword's step, for no token.
    let own = [
        "additionalProperties",
        "unevaluatedProperties",
        "items",
        "prefixItems",
        "additionalItems",
        "unevaluatedItems",
        "contains",
    ];
    if schema.rsplit('/').next().is_some_and(|k| own.contains(&k)) {
        steps.pop();
    }
    let tokens: Vec<&str> = instance.split('/').skip(1).collect();
    let lockstep = steps.len() == tokens.len();
    let shown = tokens.iter().enumerate().map(|(n, t)| match steps.get(n) {
        Some(Step::Name(name)) if lockstep && t == name => (*t).to_owned(),
        // An index of a few digits: a card number is not one.
        Some(Step::Index) if lockstep && digits(t) && t.len() <= 9 => (*t).to_owned(),
        _ => "*".to_owned(),
    });
    let out: String = shown.map(|t| format!("/{t}")).collect();
    if out.is_empty() { "/".to_owned() } else { out }
}
