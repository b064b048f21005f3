//! Route templates: strings and JSON documents rendered from an input event.
//!
//! Templates are [minijinja](https://docs.rs/minijinja) with **strict**
//! undefined handling, so a template that references a field the event does
//! not have is a permanent error that names the field (the record is
//! dead-lettered with that reason) instead of rendering an empty string into an
//! idempotency key or a URL.
//!
//! JSON templates (request bodies, emitted event data) are JSON documents whose
//! string leaves are templates. A leaf that is exactly one expression, such as
//! `"{{ data.amount }}"`, keeps the JSON type of its value (a number stays a
//! number); any other string leaf renders to a string.

use std::collections::BTreeMap;
use std::sync::Arc;

use minijinja::{Environment, ErrorKind, UndefinedBehavior};
use serde_json::{Map, Value};

/// An error while compiling a template from configuration.
#[derive(Debug, thiserror::Error)]
#[error("{location}: invalid template: {message}")]
pub struct CompileError {
    /// Configuration key of the template.
    pub location: String,
    /// What minijinja said.
    pub message: String,
}

/// An error while rendering a template for one event: always permanent for
/// that event (rendering again gives the same result).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RenderError(pub String);

/// The compiled templates of one configuration. Cheap to clone.
#[derive(Clone)]
pub struct Templates {
    env: Arc<Environment<'static>>,
}

impl std::fmt::Debug for Templates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Templates").finish_non_exhaustive()
    }
}

/// A handle to one compiled string template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextTemplate {
    name: String,
}

/// A JSON document with templated string leaves.
#[derive(Debug, Clone, PartialEq)]
pub enum JsonTemplate {
    /// A literal that needs no rendering (numbers, booleans, null).
    Literal(Value),
    /// A string leaf rendered as text.
    Text(TextTemplate),
    /// A single-expression leaf whose value keeps its JSON type.
    Expr(TextTemplate),
    /// An array of templates.
    Array(Vec<JsonTemplate>),
    /// An object of templates.
    Object(Vec<(String, JsonTemplate)>),
}

/// Collects templates while configuration is compiled, then freezes them.
pub struct TemplateBuilder {
    env: Environment<'static>,
    errors: Vec<CompileError>,
}

impl Default for TemplateBuilder {
    fn default() -> Self {
        let mut env = Environment::new();
        env.set_undefined_behavior(UndefinedBehavior::Strict);
        // Templates build keys and URLs, not HTML: never escape.
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        TemplateBuilder { env, errors: Vec::new() }
    }
}

impl TemplateBuilder {
    /// Compile a string template found at configuration key `location`.
    pub fn text(&mut self, location: &str, source: &str) -> TextTemplate {
        let name = location.to_owned();
        if let Err(e) = self.env.add_template_owned(name.clone(), source.to_owned()) {
            self.errors.push(CompileError { location: location.to_owned(), message: e.to_string() });
        }
        TextTemplate { name }
    }

    /// Compile a JSON template found at configuration key `location`.
    pub fn json(&mut self, location: &str, doc: &Value) -> JsonTemplate {
        match doc {
            Value::String(s) => match single_expression(s) {
                Some(expr) => JsonTemplate::Expr(self.text(location, &format!("{{{{ ({expr}) | tojson }}}}"))),
                None if s.contains("{{") || s.contains("{%") => JsonTemplate::Text(self.text(location, s)),
                None => JsonTemplate::Literal(doc.clone()),
            },
            Value::Array(items) => JsonTemplate::Array(
                items.iter().enumerate().map(|(i, v)| self.json(&format!("{location}[{i}]"), v)).collect(),
            ),
            Value::Object(map) => JsonTemplate::Object(
                map.iter().map(|(k, v)| (k.clone(), self.json(&format!("{location}.{k}"), v))).collect(),
            ),
            other => JsonTemplate::Literal(other.clone()),
        }
    }

    /// Freeze the templates, or return every compile error at once.
    pub fn finish(self) -> Result<Templates, Vec<CompileError>> {
        if self.errors.is_empty() { Ok(Templates { env: Arc::new(self.env) }) } else { Err(self.errors) }
    }
}

/// `"{{ expr }}"` (and nothing else) → `Some("expr")`.
fn single_expression(s: &str) -> Option<&str> {
    let inner = s.trim().strip_prefix("{{")?.strip_suffix("}}")?;
    if inner.contains("{{") || inner.contains("}}") {
        return None;
    }
    Some(inner.trim())
}

impl Templates {
    /// Render a string template against `ctx`.
    pub fn render(&self, t: &TextTemplate, ctx: &Context) -> Result<String, RenderError> {
        let tmpl = self.env.get_template(&t.name).map_err(|e| RenderError(format!("{}: {e}", t.name)))?;
        tmpl.render(&ctx.engine).map_err(|e| {
            if e.kind() == ErrorKind::UndefinedError {
                let mut missing: Vec<String> = tmpl
                    .undeclared_variables(true)
                    .into_iter()
                    .filter(|path| lookup(&ctx.json, path).is_none())
                    .collect();
                missing.sort();
                if !missing.is_empty() {
                    return RenderError(format!(
                        "template {} references {}, which this event does not have",
                        t.name,
                        missing.join(", ")
                    ));
                }
            }
            RenderError(format!("template {} failed: {e}", t.name))
        })
    }

    /// Render a JSON template against `ctx`.
    pub fn render_json(&self, t: &JsonTemplate, ctx: &Context) -> Result<Value, RenderError> {
        Ok(match t {
            JsonTemplate::Literal(v) => v.clone(),
            JsonTemplate::Text(t) => Value::String(self.render(t, ctx)?),
            JsonTemplate::Expr(t) => {
                let text = self.render(t, ctx)?;
                serde_json::from_str(&text)
                    .map_err(|e| RenderError(format!("template {} produced invalid JSON: {e}", t.name)))?
            }
            JsonTemplate::Array(items) => {
                Value::Array(items.iter().map(|i| self.render_json(i, ctx)).collect::<Result<_, _>>()?)
            }
            JsonTemplate::Object(fields) => {
                let mut map = Map::with_capacity(fields.len());
                for (k, v) in fields {
                    map.insert(k.clone(), self.render_json(v, ctx)?);
                }
                Value::Object(map)
            }
        })
    }
}

/// Follow a dotted path (`data.order.id`) through a JSON value. Paths through
/// a null count as missing, like strict undefined does.
fn lookup<'a>(ctx: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(ctx, |v, part| match v {
        Value::Object(m) => m.get(part),
        Value::Array(a) => part.parse::<usize>().ok().and_then(|i| a.get(i)),
        _ => None,
    })
}

/// What templates render against: an event's context as JSON (for error
/// messages that name a missing field) and as the template engine's value.
/// Built once per event: the engine converts a JSON context on every render,
/// and a route renders several templates per event (path, body fields, keys,
/// headers) — in a profile, that conversion was about a quarter of the
/// template time.
#[derive(Debug, Clone)]
pub struct Context {
    json: Value,
    engine: minijinja::Value,
}

impl Context {
    /// The context as JSON.
    pub fn json(&self) -> &Value {
        &self.json
    }
}

impl From<Value> for Context {
    fn from(json: Value) -> Context {
        let engine = minijinja::Value::from_serialize(&json);
        Context { json, engine }
    }
}

/// Build a template context, leaving out absent optional fields so strict
/// mode reports them as missing.
pub fn context(fields: BTreeMap<&str, Option<Value>>) -> Value {
    Value::Object(fields.into_iter().filter_map(|(k, v)| v.map(|v| (k.to_owned(), v))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ctx() -> Value {
        json!({"id": "evt-1", "data": {"order_id": "o-1", "amount": 1250, "tags": ["a"]}})
    }

    #[test]
    fn text_templates_render_event_fields() {
        let mut b = TemplateBuilder::default();
        let t = b.text("k", "capture:{{ data.order_id }}:{{ id }}");
        let ts = b.finish().unwrap();
        assert_eq!(ts.render(&t, &ctx().into()).unwrap(), "capture:o-1:evt-1");
    }

    #[test]
    fn a_missing_field_is_an_error_that_names_the_field() {
        let mut b = TemplateBuilder::default();
        let t = b.text("routes[0].actions[0].path", "/pay/{{ data.customer_id }}");
        let ts = b.finish().unwrap();
        let err = ts.render(&t, &ctx().into()).unwrap_err();
        assert!(err.0.contains("data.customer_id"), "{err}");
        assert!(err.0.contains("routes[0].actions[0].path"), "{err}");
    }

    #[test]
    fn single_expression_leaves_keep_their_json_type() {
        let mut b = TemplateBuilder::default();
        let t = b.json(
            "body",
            &json!({"amount": "{{ data.amount }}", "ref": "order {{ data.order_id }}", "tags": "{{ data.tags }}", "fixed": 3}),
        );
        let ts = b.finish().unwrap();
        assert_eq!(
            ts.render_json(&t, &ctx().into()).unwrap(),
            json!({"amount": 1250, "ref": "order o-1", "tags": ["a"], "fixed": 3})
        );
    }

    #[test]
    fn strings_with_quotes_render_to_valid_json() {
        let mut b = TemplateBuilder::default();
        let t = b.json("body", &json!({"note": "{{ data.note }}"}));
        let ts = b.finish().unwrap();
        let c = json!({"data": {"note": "say \"hi\"\n"}});
        assert_eq!(ts.render_json(&t, &c.into()).unwrap(), json!({"note": "say \"hi\"\n"}));
    }

    #[test]
    fn compile_errors_name_their_location() {
        let mut b = TemplateBuilder::default();
        b.text("routes[1].actions[0].idempotency_key", "{{ data.x ");
        let errs = b.finish().unwrap_err();
        assert_eq!(errs.len(), 1);
        assert!(errs[0].to_string().starts_with("routes[1].actions[0].idempotency_key"), "{}", errs[0]);
    }

    #[test]
    fn urls_are_not_html_escaped() {
        let mut b = TemplateBuilder::default();
        let t = b.text("p", "/a?x={{ data.q }}");
        let ts = b.finish().unwrap();
        assert_eq!(ts.render(&t, &json!({"data": {"q": "a&b<c>"}}).into()).unwrap(), "/a?x=a&b<c>");
    }
}
