//! Route templates: strings and JSON documents rendered from an input event.
//!
//! Templates are [minijinja](https://docs.rs/minijinja) with **strict**
//! undefined handling, so a template that references a field the event does
//! not have is a permanent error that names the field (the record is
//! dead-lettered with that reason) instead of rendering an empty string into an
//! idempotency key or a URL.
//!
//! Strict undefined alone lets a JSON `null` through (minijinja prints it as
//! `none`), so every interpolated value also goes through [`Templates`]'s
//! formatter, which knows what each template builds ([`Kind`]):
//!
//! * anywhere text is rendered, a `null` is an error naming the field
//!   (`capture:{{ data.order_id }}` must never become `capture:none`, one key
//!   shared by every such event);
//! * in keys and ids ([`Kind::Key`]) and paths ([`Kind::Path`]) an empty
//!   string is an error too (`/orders//capture`, a key shared by every event
//!   with the field empty);
//! * in paths every value is percent-encoded as a path segment, so event data
//!   cannot add segments, a query or a fragment (`acct-2/captures#`), and a
//!   value of `.` or `..` is an error (URL parsers resolve even `%2E%2E`);
//!   a route that wants a value raw says so with `{{ value | safe }}` (and
//!   only so: `tojson` and `escape` give plain text here, still encoded);
//! * a key or path template checks every field it reads, not only what it
//!   prints: `{{ 'capture:' ~ data.order_id }}` or `| string` would turn a
//!   null into `capture:none`, so a null or blank field it reads is an
//!   error naming the field;
//! * keys, paths and headers never carry a control character (an HTTP
//!   header cannot), and a key is at most [`MAX_KEY_BYTES`] long.
//!
//! A call's `on_success` may also read the provider's answer (`response`:
//! its status, headers and body). Such a template cannot be rendered with
//! the event: it is kept as a [`Deferred`], its source with the event fields
//! it reads, in the intent, and rendered by [`render_deferred`] when the call
//! succeeds. Anywhere else, reading `response` is a configuration error.
//!
//! JSON templates (request bodies, emitted event data) are JSON documents whose
//! string leaves are templates. A leaf that is exactly one expression, such as
//! `"{{ data.amount }}"`, keeps the JSON type of its value (a number stays a
//! number, a `null` stays `null`); any other string leaf renders to a string.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use minijinja::{Environment, Error, ErrorKind, Output, State, UndefinedBehavior};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use serde_json::{Map, Value};

use crate::limits::{MAX_KEY_BYTES, control_char, is_blank};
use crate::sabotage::{Sabotage, Sabotaged};

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

/// The name under which a call's `on_success` templates read the provider's answer.
pub const ANSWER: &str = "response";

/// The compiled templates of one configuration. Cheap to clone.
#[derive(Clone)]
pub struct Templates {
    env: Arc<Environment<'static>>,
    /// Per template: what it builds and, for keys and paths, every field it reads.
    reads: Arc<HashMap<String, (Kind, Vec<String>)>>,
    /// The templates that read the provider's answer ([`ANSWER`]).
    answer_reads: Arc<HashSet<String>>,
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

/// What a text template builds, which decides what its values may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Free text (subjects, strings in JSON documents): no `null`.
    Text,
    /// An HTTP header value: no `null`, no control character but tab.
    Header,
    /// An idempotency key, ordering key, record key or id: no `null`, no empty value.
    Key,
    /// A request path: no `null`, no empty value, values percent-encoded.
    Path,
}

/// Everything but RFC 3986's unreserved characters is encoded in a path
/// segment, `/`, `?` and `#` among them.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// The formatter's error texts, told apart again in [`Templates::render`].
const NULL_VALUE: &str = "a null value where a value is needed";
const EMPTY_VALUE: &str = "an empty value where a key, id or path needs one";
const DOT_VALUE: &str = "a path value of . or .., which would move up the request path";

/// Collects templates while configuration is compiled, then freezes them.
pub struct TemplateBuilder {
    env: Environment<'static>,
    kinds: HashMap<String, Kind>,
    errors: Vec<CompileError>,
    /// Whether templates compiled now may read the provider's answer.
    answer_allowed: bool,
    answer_reads: HashSet<String>,
    /// Deliberately wrong behaviour put back, for tests that prove the
    /// checks catch it. Never set outside them.
    sabotage: Sabotaged,
}

impl Default for TemplateBuilder {
    fn default() -> Self {
        let mut env = Environment::new();
        env.set_undefined_behavior(UndefinedBehavior::Strict);
        // Templates build keys and URLs, not HTML: never escape.
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        TemplateBuilder {
            env,
            kinds: HashMap::new(),
            errors: Vec::new(),
            answer_allowed: false,
            answer_reads: HashSet::new(),
            sabotage: Sabotaged::default(),
        }
    }
}

impl TemplateBuilder {
    /// The same builder with the defects of `sabotage` put back (null and
    /// empty values let through, say): only for tests that prove the checks
    /// catch them, only with the `sabotage` feature.
    #[cfg(feature = "sabotage")]
    pub fn sabotaged(mut self, sabotage: Sabotaged) -> Self {
        self.sabotage = sabotage;
        self
    }

    /// Compile a free-text template found at configuration key `location`.
    pub fn text(&mut self, location: &str, source: &str) -> TextTemplate {
        self.of_kind(Kind::Text, location, source)
    }

    /// Compile an HTTP header value template (no control characters) at `location`.
    pub fn header(&mut self, location: &str, source: &str) -> TextTemplate {
        self.of_kind(Kind::Header, location, source)
    }

    /// Compile a key or id template (no empty values) at `location`.
    pub fn key(&mut self, location: &str, source: &str) -> TextTemplate {
        self.of_kind(Kind::Key, location, source)
    }

    /// Compile a request path template (values percent-encoded) at `location`.
    pub fn path(&mut self, location: &str, source: &str) -> TextTemplate {
        self.of_kind(Kind::Path, location, source)
    }

    /// Compile what `f` compiles allowing it to read the provider's answer
    /// ([`ANSWER`]): a call's `on_success`.
    pub fn with_answer<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> T {
        let was = std::mem::replace(&mut self.answer_allowed, true);
        let out = f(self);
        self.answer_allowed = was;
        out
    }

    fn of_kind(&mut self, kind: Kind, location: &str, source: &str) -> TextTemplate {
        let name = location.to_owned();
        match self.env.add_template_owned(name.clone(), source.to_owned()) {
            Err(e) => self.errors.push(CompileError { location: location.to_owned(), message: e.to_string() }),
            Ok(()) => {
                let reads = self.env.get_template(&name).map(|t| t.undeclared_variables(false).contains(ANSWER));
                if reads.unwrap_or(false) {
                    if self.answer_allowed {
                        self.answer_reads.insert(name.clone());
                    } else {
                        self.errors.push(CompileError {
                            location: location.to_owned(),
                            message: format!(
                                "reads `{ANSWER}`, the provider's answer, which only the effects of a call's on_success \
                                 have (a call can die without an answer, and nothing else follows a call)"
                            ),
                        });
                    }
                }
            }
        }
        self.kinds.insert(name.clone(), kind);
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
    pub fn finish(mut self) -> Result<Templates, Vec<CompileError>> {
        if !self.errors.is_empty() {
            return Err(self.errors);
        }
        let sabotage = self.sabotage;
        let sabotaged = sabotage.has(Sabotage::NullAsText);
        let mut reads = HashMap::new();
        for (name, kind) in &self.kinds {
            let fields = match (kind, self.env.get_template(name)) {
                (Kind::Key | Kind::Path, Ok(t)) if !sabotaged && !sabotage.has(Sabotage::PrintedValuesOnly) => {
                    t.undeclared_variables(true).into_iter().collect()
                }
                _ => Vec::new(),
            };
            // Sabotaged, every template is checked as free text.
            let kind = if sabotaged || sabotage.has(Sabotage::ControlsUnchecked) { Kind::Text } else { *kind };
            reads.insert(name.clone(), (kind, fields));
        }
        // minijinja marks `tojson` and `escape` output safe, which would skip
        // a path's encoding: the same filters here give
        // the same text, not marked safe.
        self.env.add_filter(
            "tojson",
            |v: &minijinja::Value, indent: Option<minijinja::Value>, kwargs: minijinja::value::Kwargs| {
                minijinja::filters::tojson(v, indent, kwargs).map(|out| out.to_string())
            },
        );
        for name in ["e", "escape"] {
            self.env.add_filter(name, |state: &State, v: &minijinja::Value| {
                minijinja::filters::escape(state, v).map(|out| out.to_string())
            });
        }
        let kinds = self.kinds;
        self.env.set_formatter(move |out, state, value| {
            if sabotaged {
                return minijinja::escape_formatter(out, state, value);
            }
            format_value(kinds.get(state.name()).copied().unwrap_or(Kind::Text), out, state, value)
        });
        Ok(Templates { env: Arc::new(self.env), reads: Arc::new(reads), answer_reads: Arc::new(self.answer_reads) })
    }
}

/// Write one interpolated value of a template of `kind` (see the module doc).
fn format_value(kind: Kind, out: &mut Output, state: &State, value: &minijinja::Value) -> Result<(), Error> {
    if value.is_none() {
        return Err(Error::new(ErrorKind::InvalidOperation, NULL_VALUE));
    }
    if matches!(kind, Kind::Text | Kind::Header) {
        return minijinja::escape_formatter(out, state, value);
    }
    let text = value.to_string();
    if text.is_empty() {
        return Err(Error::new(ErrorKind::InvalidOperation, EMPTY_VALUE));
    }
    if kind == Kind::Path && !value.is_safe() {
        // `.` and `..` move up the path, and URL parsers treat `%2E%2E`
        // the same (WHATWG): no encoding keeps them a plain segment.
        if text == "." || text == ".." {
            return Err(Error::new(ErrorKind::InvalidOperation, DOT_VALUE));
        }
        return out.write_str(&utf8_percent_encode(&text, SEGMENT).to_string()).map_err(Error::from);
    }
    out.write_str(&text).map_err(Error::from)
}

/// `value` as one segment of a request path, for code handlers building a
/// [`crate::CallSpec`] path, encoded as route templates encode theirs: every
/// character but RFC 3986's unreserved ones percent-encoded (`/`, `?`, `#`
/// among them). `None` for an empty value, `.` or `..`, which no encoding
/// keeps from changing the path.
pub fn path_segment(value: &str) -> Option<String> {
    if value.is_empty() || value == "." || value == ".." {
        return None;
    }
    Some(utf8_percent_encode(value, SEGMENT).to_string())
}

/// `"{{ expr }}"` (and nothing else) → `Some("expr")`.
fn single_expression(s: &str) -> Option<&str> {
    let inner = s.trim().strip_prefix("{{")?.strip_suffix("}}")?;
    if inner.contains("{{") || inner.contains("}}") {
        return None;
    }
    Some(inner.trim())
}

/// A template of a call's `on_success` that reads the provider's answer,
/// kept unrendered in the intent with the event fields it reads, and
/// rendered when the call succeeds ([`render_deferred`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct Deferred {
    /// Where its value goes: a JSON Pointer into the serialized outcome.
    pub at: String,
    /// The template's configuration key, for errors.
    pub template: String,
    /// What it builds.
    pub kind: Kind,
    /// Whether its value keeps its JSON type (a single-expression leaf).
    pub json: bool,
    pub source: String,
    /// The event fields it reads, as a sparse context.
    pub context: Value,
}

/// Render `d` with the provider's `answer` (the value of [`ANSWER`]), with
/// the checks its kind has at ingest.
pub fn render_deferred(d: &Deferred, answer: &Value) -> Result<Value, RenderError> {
    let mut b = TemplateBuilder { answer_allowed: true, ..TemplateBuilder::default() };
    let t = b.of_kind(d.kind, &d.template, &d.source);
    let ts =
        b.finish().map_err(|e| RenderError(e.into_iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")))?;
    let mut ctx = match &d.context {
        Value::Object(m) => m.clone(),
        _ => Map::new(),
    };
    ctx.insert(ANSWER.to_owned(), answer.clone());
    // The same checks as at ingest, in words that fit an answer.
    let text = ts
        .render(&t, &Context::from(Value::Object(ctx)))
        .map_err(|e| RenderError(e.0.replace("this event", "the provider's answer (or the event)")))?;
    if !d.json {
        return Ok(Value::String(text));
    }
    serde_json::from_str(&text).map_err(|e| RenderError(format!("template {} produced invalid JSON: {e}", d.template)))
}

/// Stands for the provider's answer when a deferred template is tried at
/// ingest: every attribute and item of it is another stand-in, so only the
/// event's fields can fail the trial.
#[derive(Debug)]
struct AnyAnswer;

impl minijinja::value::Object for AnyAnswer {
    fn get_value(self: &Arc<Self>, _key: &minijinja::Value) -> Option<minijinja::Value> {
        Some(minijinja::Value::from_object(AnyAnswer))
    }
}

/// Escape one JSON Pointer reference token (RFC 6901).
pub fn pointer_token(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

impl Templates {
    /// Every variable path (`data.order_id`, `aggregate_id`) the templates
    /// whose configuration key starts with `prefix` read.
    pub fn paths_read(&self, prefix: &str) -> std::collections::BTreeSet<String> {
        self.env
            .templates()
            .filter(|(name, _)| name.starts_with(prefix))
            .flat_map(|(_, t)| t.undeclared_variables(true))
            .collect()
    }

    /// Whether `t` reads the provider's answer, so it is rendered when the
    /// call succeeds ([`Templates::defer`]), not with the event.
    pub fn reads_answer(&self, t: &TextTemplate) -> bool {
        self.answer_reads.contains(&t.name)
    }

    /// Keep `t`, which reads the provider's answer, for later: its source and
    /// the event fields it reads from `ctx`, its value going to pointer `at`.
    /// What the event makes of it is checked now, before the call, as for any
    /// template: rendered with a stand-in answer, a field the event lacks, or
    /// a null or blank one where its kind refuses it, is an error naming the
    /// field. (Only such errors: one the stand-in itself causes, such as
    /// arithmetic on it, waits for the real answer.)
    pub fn defer(&self, t: &TextTemplate, json: bool, at: String, ctx: &Context) -> Result<Deferred, RenderError> {
        let tmpl = self.env.get_template(&t.name).map_err(|e| RenderError(format!("{}: {e}", t.name)))?;
        let stand = minijinja::Value::from_object(AnyAnswer);
        let trial = Context {
            json: ctx.json.clone(),
            engine: minijinja::context! { response => stand.clone(), ..ctx.engine.clone() },
            marked: ctx.marked.clone().map(|m| minijinja::context! { response => stand.clone(), ..m }),
        };
        if let Err(e) = self.render(t, &trial)
            && !e.0.starts_with(&format!("template {} failed", t.name))
        {
            return Err(e);
        }
        // Only the fields it reads that the event has: the others are
        // behind `default`, `is defined` or a branch not taken, or are globals.
        let mut fields = Value::Object(Map::new());
        let mut paths: Vec<String> = tmpl.undeclared_variables(true).into_iter().collect();
        paths.sort();
        for path in paths.iter().filter(|p| p.split('.').next() != Some(ANSWER)) {
            if let Some(v) = lookup(&ctx.json, path) {
                insert_at(&mut fields, path, v.clone());
            }
        }
        let kind = self.reads.get(&t.name).map_or(Kind::Text, |(k, _)| *k);
        Ok(Deferred { at, template: t.name.clone(), kind, json, source: tmpl.source().to_owned(), context: fields })
    }

    /// [`Templates::render_json`], keeping the leaves that read the
    /// provider's answer in `deferred` (their place, at pointer `at` and
    /// below, holds null until then).
    pub fn render_json_deferring(
        &self,
        t: &JsonTemplate,
        ctx: &Context,
        at: &str,
        deferred: &mut Vec<Deferred>,
    ) -> Result<Value, RenderError> {
        Ok(match t {
            JsonTemplate::Text(l) | JsonTemplate::Expr(l) if self.reads_answer(l) => {
                deferred.push(self.defer(l, matches!(t, JsonTemplate::Expr(_)), at.to_owned(), ctx)?);
                Value::Null
            }
            JsonTemplate::Array(items) => Value::Array(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| self.render_json_deferring(v, ctx, &format!("{at}/{i}"), deferred))
                    .collect::<Result<_, _>>()?,
            ),
            JsonTemplate::Object(fields) => {
                let mut map = Map::with_capacity(fields.len());
                for (k, v) in fields {
                    let value = self.render_json_deferring(v, ctx, &format!("{at}/{}", pointer_token(k)), deferred)?;
                    map.insert(k.clone(), value);
                }
                Value::Object(map)
            }
            other => self.render_json(other, ctx)?,
        })
    }

    /// Render a string template against `ctx`.
    pub fn render(&self, t: &TextTemplate, ctx: &Context) -> Result<String, RenderError> {
        let (kind, reads) = self.reads.get(&t.name).map_or((Kind::Text, &[][..]), |(k, r)| (*k, r.as_slice()));
        // Every field a key or path reads, not only what it prints.
        let mut null = Vec::new();
        let mut blank = Vec::new();
        for path in reads {
            match lookup(&ctx.json, path) {
                Some(Value::Null) => null.push(path.as_str()),
                Some(Value::String(v)) if is_blank(v) => blank.push(path.as_str()),
                _ => {}
            }
        }
        if !null.is_empty() {
            return Err(RenderError(format!(
                "template {} references {}, which is null in this event",
                t.name,
                null.join(", ")
            )));
        }
        if !blank.is_empty() {
            return Err(RenderError(format!(
                "template {} references {}, which is empty in this event; a key, id or path needs a value",
                t.name,
                blank.join(", ")
            )));
        }
        let rendered = self.render_unchecked(t, ctx)?;
        if kind == Kind::Text {
            return Ok(rendered);
        }
        // What the reads above cannot see: a field reached by subscript
        // (`data['order-id']`, `data.items[0].id`) counts as its parent. So
        // the template is rendered once more with every null or blank value
        // of the event replaced by a marker; if the marker shows, such a
        // value made the key or path.
        if let (Some(marked), false) = (&ctx.marked, reads.is_empty()) {
            let tmpl = self.env.get_template(&t.name).map_err(|e| RenderError(format!("{}: {e}", t.name)))?;
            if tmpl.render(marked).is_ok_and(|out| out.contains(MARKER)) {
                let under = |p: &str, r: &str| {
                    p == r || p.strip_prefix(r).is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
                };
                let mut fields: Vec<String> =
                    blank_paths(&ctx.json, "").into_iter().filter(|p| reads.iter().any(|r| under(p, r))).collect();
                fields.sort();
                return Err(RenderError(format!(
                    "template {} reads {}, which is null or empty in this event; a key, id or path needs a value",
                    t.name,
                    fields.join(", ")
                )));
            }
        }
        let what = match kind {
            Kind::Header => "an HTTP header",
            Kind::Path => "a request path",
            _ => "a key or id",
        };
        if let Some((_, c)) = control_char(&rendered).filter(|(_, c)| !(kind == Kind::Header && *c == '\t')) {
            return Err(RenderError(format!(
                "template {} rendered the control character U+{:04X}, which {what} cannot carry{}",
                t.name,
                u32::from(c),
                self.fields_holding(t, ctx, |v| control_char(v).is_some()),
            )));
        }
        if kind == Kind::Key && rendered.len() > MAX_KEY_BYTES {
            return Err(RenderError(format!(
                "template {} rendered {} bytes, over the {MAX_KEY_BYTES}-byte limit for keys and ids{}",
                t.name,
                rendered.len(),
                self.fields_holding(t, ctx, |v| v.len() > MAX_KEY_BYTES / 2),
            )));
        }
        if kind == Kind::Key && is_blank(&rendered) {
            return Err(RenderError(format!("template {} rendered an empty key", t.name)));
        }
        Ok(rendered)
    }

    /// ` (from FIELDS)`: the fields `t` reads whose text value `bad` finds at fault.
    fn fields_holding(&self, t: &TextTemplate, ctx: &Context, bad: impl Fn(&str) -> bool) -> String {
        let Ok(tmpl) = self.env.get_template(&t.name) else { return String::new() };
        let mut found: Vec<String> = tmpl
            .undeclared_variables(true)
            .into_iter()
            .filter(|path| lookup(&ctx.json, path).and_then(Value::as_str).is_some_and(&bad))
            .collect();
        found.sort();
        if found.is_empty() { String::new() } else { format!(" (from {})", found.join(", ")) }
    }

    /// Render without the checks of what the template builds.
    fn render_unchecked(&self, t: &TextTemplate, ctx: &Context) -> Result<String, RenderError> {
        let tmpl = self.env.get_template(&t.name).map_err(|e| RenderError(format!("{}: {e}", t.name)))?;
        tmpl.render(&ctx.engine).map_err(|e| {
            // The fields of the template whose value in this event is `which`.
            let fields = |which: &dyn Fn(Option<&Value>) -> bool| {
                let mut found: Vec<String> =
                    tmpl.undeclared_variables(true).into_iter().filter(|path| which(lookup(&ctx.json, path))).collect();
                found.sort();
                found.join(", ")
            };
            let detail = e.detail().unwrap_or_default();
            let (found, what) = if e.kind() == ErrorKind::UndefinedError {
                (fields(&|v| v.is_none()), "which this event does not have")
            } else if detail == NULL_VALUE {
                (fields(&|v| v == Some(&Value::Null)), "which is null in this event")
            } else if detail == EMPTY_VALUE {
                (
                    fields(&|v| v.and_then(Value::as_str) == Some("")),
                    "which is empty in this event; a key, id or path needs a value",
                )
            } else if detail == DOT_VALUE {
                let dots = |v: Option<&Value>| matches!(v.and_then(Value::as_str), Some("." | ".."));
                (fields(&dots), "which is . or .. in this event: a path value may not move up the request path")
            } else {
                (String::new(), "")
            };
            if found.is_empty() {
                // Never the error's own text, which may quote a value ("unable
                // to calculate 4111… + 1"): a detail of ours, or minijinja's kind.
                let ours = [NULL_VALUE, EMPTY_VALUE, DOT_VALUE].contains(&detail);
                let why = if ours { detail.to_owned() } else { e.kind().to_string() };
                let line = e.line().map(|l| format!(" (line {l})")).unwrap_or_default();
                RenderError(format!("template {} failed: {why}{line}", t.name))
            } else {
                RenderError(format!("template {} references {found}, {what}", t.name))
            }
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

/// Set `value` at dotted path `path` of object `into`, making objects on the way.
fn insert_at(into: &mut Value, path: &str, value: Value) {
    let mut at = into;
    let mut parts = path.split('.').peekable();
    while let Some(part) = parts.next() {
        let Value::Object(m) = at else { return };
        if parts.peek().is_none() {
            m.insert(part.to_owned(), value);
            return;
        }
        at = m.entry(part.to_owned()).or_insert_with(|| Value::Object(Map::new()));
    }
}

/// Follow a dotted path (`data.order.id`) through a JSON value. Paths through
/// a null count as missing, like strict undefined does; a path that ends at a
/// null finds it.
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
    json: Arc<Value>,
    engine: minijinja::Value,
    /// The context with every null and blank string replaced by [`MARKER`],
    /// when it has any (most events have none).
    marked: Option<minijinja::Value>,
}

/// Stands for a null or blank value in a second rendering of a key or
/// path: letters and digits only, so a path's encoding leaves it as it is.
const MARKER: &str = "RELAYBLANKc0ffee5d1e7a";

/// Dotted paths of the null and blank-string values in `v`.
fn blank_paths(v: &Value, at: &str) -> Vec<String> {
    match v {
        Value::Null => vec![at.to_owned()],
        Value::String(s) if is_blank(s) => vec![at.to_owned()],
        Value::Object(m) => m
            .iter()
            .flat_map(|(k, v)| blank_paths(v, &if at.is_empty() { k.clone() } else { format!("{at}.{k}") }))
            .collect(),
        Value::Array(a) => a.iter().enumerate().flat_map(|(i, v)| blank_paths(v, &format!("{at}[{i}]"))).collect(),
        _ => Vec::new(),
    }
}

/// `v` with every null and blank string replaced by [`MARKER`], if it has any.
fn marked(v: &Value) -> Option<Value> {
    fn walk(v: &Value, changed: &mut bool) -> Value {
        match v {
            Value::Null => {
                *changed = true;
                Value::String(MARKER.into())
            }
            Value::String(s) if is_blank(s) => {
                *changed = true;
                Value::String(MARKER.into())
            }
            Value::Object(m) => Value::Object(m.iter().map(|(k, v)| (k.clone(), walk(v, changed))).collect()),
            Value::Array(a) => Value::Array(a.iter().map(|v| walk(v, changed)).collect()),
            other => other.clone(),
        }
    }
    let mut changed = false;
    let out = walk(v, &mut changed);
    changed.then_some(out)
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
        let marked = marked(&json).map(|m| minijinja::Value::from_serialize(&m));
        Context { json: Arc::new(json), engine, marked }
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

    // Strict mode alone let a null render as "none".
    #[test]
    fn a_null_where_text_needs_a_value_is_an_error_that_names_the_field() {
        let mut b = TemplateBuilder::default();
        let key = b.key("routes[0].actions[0].idempotency_key", "capture:{{ data.order_id }}");
        let text = b.text("routes[0].actions[0].headers.x-ref", "ref {{ data.order_id }}");
        let ts = b.finish().unwrap();
        let c: Context = json!({"data": {"order_id": null}}).into();
        for t in [&key, &text] {
            let err = ts.render(t, &c).unwrap_err();
            assert!(err.0.contains("data.order_id") && err.0.contains("null"), "{err}");
            assert!(err.0.contains(&t.name), "{err}");
        }
    }

    #[test]
    fn an_empty_value_in_a_key_or_path_is_an_error_but_empty_free_text_is_not() {
        let mut b = TemplateBuilder::default();
        let key = b.key("k", "capture:{{ data.order_id }}");
        let path = b.path("p", "/orders/{{ data.order_id }}/capture");
        let text = b.text("t", "note:{{ data.order_id }}");
        let ts = b.finish().unwrap();
        let c: Context = json!({"data": {"order_id": ""}}).into();
        for t in [&key, &path] {
            let err = ts.render(t, &c).unwrap_err();
            assert!(err.0.contains("data.order_id") && err.0.contains("empty"), "{err}");
        }
        assert_eq!(ts.render(&text, &c).unwrap(), "note:");
    }

    #[test]
    fn a_null_in_a_single_expression_json_leaf_stays_json_null() {
        let mut b = TemplateBuilder::default();
        let t = b.json("body", &json!({"note": "{{ data.note }}"}));
        let ts = b.finish().unwrap();
        assert_eq!(ts.render_json(&t, &json!({"data": {"note": null}}).into()).unwrap(), json!({"note": null}));
    }

    // Event data must not rewrite the request URL.
    #[test]
    fn path_values_are_percent_encoded_as_one_segment_unless_marked_safe() {
        let mut b = TemplateBuilder::default();
        let p = b.path("p", "/accounts/{{ data.acct }}/captures");
        let raw = b.path("r", "/{{ data.prefix | safe }}/x");
        let ts = b.finish().unwrap();
        let render = |v: &str| ts.render(&p, &json!({"data": {"acct": v}}).into()).unwrap();
        assert_eq!(render("acct-2/captures#"), "/accounts/acct-2%2Fcaptures%23/captures");
        assert_eq!(render("x?amount=1"), "/accounts/x%3Famount%3D1/captures");
        for dots in [".", ".."] {
            let err = ts.render(&p, &json!({"data": {"acct": dots}}).into()).unwrap_err();
            assert!(err.0.contains("data.acct") && err.0.contains("move up"), "{err}");
        }
        assert_eq!(render("..x"), "/accounts/..x/captures");
        assert_eq!(render("%2e%2e"), "/accounts/%252e%252e/captures");
        assert_eq!(render("a b\u{e9}"), "/accounts/a%20b%C3%A9/captures");
        assert_eq!(render("o-1_A.~"), "/accounts/o-1_A.~/captures");
        assert_eq!(ts.render(&raw, &json!({"data": {"prefix": "v2/api"}}).into()).unwrap(), "/v2/api/x");
    }

    // The check held only for a value printed directly.
    #[test]
    fn a_key_or_path_template_checks_every_field_it_reads_whatever_concatenates_or_filters_it() {
        let mut b = TemplateBuilder::default();
        let sources = [
            "{{ 'capture:' ~ data.order_id }}",
            "capture:{{ data.order_id | string }}",
            "capture:{{ [data.order_id, 'x'] | join('-') }}",
            "{{ data.order_id if data.order_id else 'none' }}",
            // Subscripts: the reads name only `data`, the marker finds them.
            "{{ 'capture:' ~ data['order_id'] }}",
        ];
        let keys: Vec<TextTemplate> = sources.iter().enumerate().map(|(i, src)| b.key(&format!("k{i}"), src)).collect();
        let path = b.path("p", "/captures/{{ 'c-' ~ data.order_id }}");
        let ts = b.finish().unwrap();
        for value in [json!(null), json!(""), json!("  ")] {
            let c: Context = json!({"data": {"order_id": value}}).into();
            for t in keys.iter().chain([&path]) {
                let err = ts.render(t, &c).unwrap_err();
                assert!(err.0.contains("data.order_id") && err.0.contains(&t.name), "{value}: {err}");
            }
        }
        let c: Context = json!({"data": {"order_id": "o-1"}}).into();
        assert_eq!(ts.render(&keys[0], &c).unwrap(), "capture:o-1");
    }

    // `escape` and `tojson` output must not be marked safe and skip the encoding.
    #[test]
    fn escape_and_tojson_output_is_still_encoded_in_a_path() {
        let mut b = TemplateBuilder::default();
        let e = b.path("e", "/o/{{ data.id | e }}");
        let j = b.path("j", "/o/{{ data.id | tojson }}");
        let pretty = b.text("t", "{{ data | tojson(indent=2) }} {{ data.id | e }}");
        let ts = b.finish().unwrap();
        let shown = ts.render(&pretty, &json!({"data": {"id": "<a>"}}).into()).unwrap();
        assert_eq!(shown, "{\n  \"id\": \"\\u003ca\\u003e\"\n} &lt;a&gt;", "the filters work as minijinja's own");
        let c: Context = json!({"data": {"id": "../../admin"}}).into();
        for t in [&e, &j] {
            let p = ts.render(t, &c).unwrap();
            assert!(!p.contains("/../") && p.starts_with("/o/") && p.matches('/').count() == 2, "{p}");
        }
    }

    // Control characters and over-long keys
    // are errors at render, never a request that cannot be built.
    #[test]
    fn control_characters_in_keys_paths_and_headers_and_over_long_keys_are_errors_naming_the_field() {
        let mut b = TemplateBuilder::default();
        let key = b.key("routes[0].actions[0].idempotency_key", "cap:{{ data.order_id }}");
        let header = b.header("routes[0].actions[0].headers.x-note", "{{ data.note }}");
        let body = b.text("routes[0].actions[0].body.note", "{{ data.note }}");
        let ts = b.finish().unwrap();
        let c: Context = json!({"data": {"order_id": "o-1\r\n", "note": "line one\nline two"}}).into();
        let err = ts.render(&key, &c).unwrap_err();
        assert!(
            err.0.contains("idempotency_key") && err.0.contains("U+000D") && err.0.contains("data.order_id"),
            "{err}"
        );
        let err = ts.render(&header, &c).unwrap_err();
        assert!(
            err.0.contains("headers.x-note") && err.0.contains("data.note") && !err.0.contains("line one"),
            "{err}"
        );
        assert_eq!(ts.render(&body, &c).unwrap(), "line one\nline two", "free text in a body may hold a newline");
        let long: Context = json!({"data": {"order_id": "x".repeat(2000)}}).into();
        let err = ts.render(&key, &long).unwrap_err();
        assert!(err.0.contains("1024") && err.0.contains("data.order_id"), "{err}");
        let tab: Context = json!({"data": {"note": "a\tb"}}).into();
        assert_eq!(ts.render(&header, &tab).unwrap(), "a\tb", "a header may hold a tab");
    }

    // Minijinja's own error text quotes operand values.
    #[test]
    fn a_failing_expression_is_reported_without_the_values_it_failed_on() {
        let mut b = TemplateBuilder::default();
        let t = b.text("t", "{{ data.card + 1 }}");
        let ts = b.finish().unwrap();
        let err = ts.render(&t, &json!({"data": {"card": "4111111111111111"}}).into()).unwrap_err();
        assert!(!err.0.contains("4111") && err.0.contains("template t failed"), "{err}");
    }

    // Code handlers had no way to encode a path segment.
    #[test]
    fn a_handler_encodes_a_path_segment_as_templates_do() {
        assert_eq!(path_segment("acct-2/captures#").as_deref(), Some("acct-2%2Fcaptures%23"));
        assert_eq!(path_segment("o-1_A.~").as_deref(), Some("o-1_A.~"));
        for bad in ["", ".", ".."] {
            assert_eq!(path_segment(bad), None, "{bad:?}");
        }
    }

    // `undeclared_variables` names a subscripted
    // field's parent only, so `data.items[0].id` slipped past the reads.
    #[test]
    fn a_null_reached_by_subscript_or_index_is_an_error_naming_the_field_but_unrelated_nulls_are_not() {
        let mut b = TemplateBuilder::default();
        let key = b.key("k", "{{ 'c:' ~ data.items[0].id }}");
        let plain = b.key("p", "capture:{{ data.order_id }}");
        let ts = b.finish().unwrap();
        let c: Context = json!({"data": {"order_id": "o-1", "note": null, "items": [{"id": null}]}}).into();
        let err = ts.render(&key, &c).unwrap_err();
        assert!(err.0.contains("data.items[0].id") && !err.0.contains("data.note"), "{err}");
        assert_eq!(ts.render(&plain, &c).unwrap(), "capture:o-1", "a null elsewhere in the event is not read");
    }
}
