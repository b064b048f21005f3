//! `relay check-config --explain ROUTE`: what a route would write for one
//! event — its saga moves, calls and events, with their derived ids and
//! keys — rendered without any I/O, through the same decoding, field
//! resolution, schema check and templates as the consumer.
//!
//! The event is the operator's (a record value as the topic carries it)
//! or an example built from the route itself: every field its templates
//! read gets a placeholder (`data.order_id` → `"example-order_id"`), and
//! every field source the route's guards and id need (a data pointer, a
//! header, an extension, the key) gets a value where it is read from.

use std::collections::BTreeSet;

use serde_json::{Map, Value, json};

use crate::RelayConfig;
use crate::effects::{Effects, Plan};
use crate::envelope::{FieldSource, Header, InputEvent, RawRecord, TopicFormat};
use crate::router::{Routed, Router};

/// A route's writes for one event.
#[derive(Debug)]
pub struct Explained {
    /// The record it was rendered against.
    pub record: RawRecord,
    /// The event as the route saw it.
    pub event: InputEvent,
    /// What the templates rendered.
    pub plan: Plan,
    /// What would be written: derived ids, idempotency keys, encoded events.
    pub effects: Effects,
    /// Whether a code handler also runs for it (its writes are not shown).
    pub handler: Option<String>,
}

/// The index in `cfg.routes` of the route called `name` (its `name`, or
/// `topic/type`), or an error listing the routes there are.
pub fn find_route(cfg: &RelayConfig, name: &str) -> Result<usize, String> {
    cfg.routes.iter().position(|r| r.display_name() == name || r.name.as_deref() == Some(name)).ok_or_else(|| {
        let names: Vec<String> = cfg.routes.iter().map(|r| r.display_name()).collect();
        format!("no route {name:?}; the routes are: {}", names.join(", "))
    })
}

/// An example record for route `i`: on its topic, of its type, with a
/// value for every field its templates read and every source its fields
/// come from.
pub fn example_record(cfg: &RelayConfig, router: &Router, i: usize) -> Result<RawRecord, String> {
    let r = &cfg.routes[i];
    let (route, reads) =
        router.route_at(cfg, i).ok_or_else(|| format!("route {} is not compiled", r.display_name()))?;
    let format = cfg.topics.get(&r.topic).map_or(TopicFormat::Cloudevents, |t| t.format);
    let mut data = r.schema_document.as_ref().map_or_else(|| Value::Object(Map::new()), |s| from_schema(s, "data", 0));
    let mut extensions = Map::new();
    for path in &reads {
        let mut parts = path.split('.');
        match parts.next() {
            Some("data") => {
                let rest: Vec<&str> = parts.collect();
                if !rest.is_empty() {
                    put(&mut data, &rest, json!(format!("example-{}", rest[rest.len() - 1])));
                }
            }
            Some("extensions") => {
                if let Some(name) = parts.next() {
                    extensions.insert(name.to_owned(), json!(format!("example-{name}")));
                }
            }
            _ => {}
        }
    }
    let mut headers = Vec::new();
    let mut key = None;
    let id = "explain-0001";
    let topic_fields = cfg.topics.get(&r.topic).map(|t| t.fields.clone()).unwrap_or_default();
    let f = &route.fields;
    let sources: [(&Option<FieldSource>, &str, Value); 9] = [
        (&topic_fields.id, "", json!(id)),
        (&topic_fields.event_type, "", json!(r.event_type)),
        (&f.aggregate_id, "aggregateid", json!("example-aggregate")),
        (&f.aggregate_version, "aggregateversion", json!(1)),
        (&f.sequence, "sequence", json!(1)),
        (&f.idempotency_key, "idempotencykey", json!("example-idempotency-key")),
        (&f.correlation_id, "correlationid", json!("example-correlation")),
        (&f.causation_id, "causationid", json!("example-cause")),
        (&f.traceparent, "traceparent", json!("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")),
    ];
    for (source, default_extension, value) in sources {
        let text = value.as_str().map_or_else(|| value.to_string(), str::to_owned);
        match source {
            Some(FieldSource::Pointer(p)) => {
                let parts: Vec<String> =
                    p.split('/').skip(1).map(|s| s.replace("~1", "/").replace("~0", "~")).collect();
                let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
                if !parts.is_empty() {
                    put(&mut data, &parts, value);
                }
            }
            Some(FieldSource::Header(h)) => headers.push(Header::text(h.clone(), text)),
            Some(FieldSource::Extension(e)) => {
                extensions.insert(e.clone(), json!(text));
            }
            Some(FieldSource::Key) => key = Some(text.into_bytes()),
            Some(FieldSource::Value(_)) => {}
            // Only the guards need theirs: the others are optional.
            None if route.version_guard && default_extension == "aggregateversion"
                || (route.version_guard || route.sequence_guard) && default_extension == "aggregateid"
                || route.sequence_guard && default_extension == "sequence" =>
            {
                extensions.insert(default_extension.to_owned(), json!(text));
            }
            None => {}
        }
    }
    let payload = envelope(format, id, &r.event_type, extensions, data, &mut headers);
    Ok(RawRecord {
        topic: r.topic.clone(),
        partition: 0,
        offset: 0,
        key,
        payload: Some(serde_json::to_vec(&payload).map_err(|e| e.to_string())?),
        headers,
    })
}

/// The record value of an example event `id` of type `event_type` in the
/// topic's `format`: a structured CloudEvent, or the data with the
/// extensions as binary-mode headers.
fn envelope(
    format: TopicFormat,
    id: &str,
    event_type: &str,
    extensions: Map<String, Value>,
    data: Value,
    headers: &mut Vec<Header>,
) -> Value {
    match format {
        TopicFormat::Cloudevents => {
            headers.push(Header::text("content-type", "application/cloudevents+json"));
            let mut event = Map::new();
            event.insert("specversion".into(), json!("1.0"));
            event.insert("id".into(), json!(id));
            event.insert("type".into(), json!(event_type));
            event.insert("source".into(), json!("urn:relay:explain"));
            event.insert("time".into(), json!("2026-01-01T00:00:00Z"));
            event.extend(extensions);
            event.insert("data".into(), data);
            Value::Object(event)
        }
        // The value as routes read it (after the registry's decoding), the
        // extensions as CloudEvents binary-mode headers.
        _ => {
            for (name, v) in extensions {
                let text = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
                headers.push(Header::text(format!("ce_{name}"), text));
            }
            data
        }
    }
}

/// An instance of JSON Schema `schema` (named `name`, for placeholders):
/// its `const`, first `examples`, `default` or `enum` value where it has
/// one, else a value of its type — every property of an object. Patterns
/// and formats other than dates are not followed: the example skips the
/// route's schema check, and `--event` gives a real one.
fn from_schema(schema: &Value, name: &str, depth: usize) -> Value {
    let Some(o) = schema.as_object() else { return json!(format!("example-{name}")) };
    if let Some(v) = o.get("const").or_else(|| o.get("examples").and_then(|e| e.get(0))).or_else(|| o.get("default")) {
        return v.clone();
    }
    if let Some(v) = o.get("enum").and_then(|e| e.get(0)) {
        return v.clone();
    }
    let kind = match o.get("type") {
        Some(Value::String(t)) => t.as_str(),
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).find(|t| *t != "null").unwrap_or("null"),
        _ if o.contains_key("properties") => "object",
        _ => "string",
    };
    match kind {
        "object" if depth < 8 => Value::Object(
            o.get("properties")
                .and_then(Value::as_object)
                .map(|ps| ps.iter().map(|(k, v)| (k.clone(), from_schema(v, k, depth + 1))).collect())
                .unwrap_or_default(),
        ),
        "array" if depth < 8 => json!([from_schema(o.get("items").unwrap_or(&Value::Null), name, depth + 1)]),
        "integer" => json!(o.get("minimum").and_then(Value::as_i64).unwrap_or(1).max(1)),
        "number" => json!(o.get("minimum").and_then(Value::as_f64).unwrap_or(1.5)),
        "boolean" => json!(true),
        "null" => Value::Null,
        _ => match o.get("format").and_then(Value::as_str) {
            Some("date-time") => json!("2026-01-01T00:00:00Z"),
            Some("date") => json!("2026-01-01"),
            Some("uuid") => json!("00000000-0000-4000-8000-000000000001"),
            _ => json!(format!("example-{name}")),
        },
    }
}

/// `value` at `path` in `into`, making the objects on the way.
fn put(into: &mut Value, path: &[&str], value: Value) {
    let Some((first, rest)) = path.split_first() else { return };
    if !into.is_object() {
        *into = Value::Object(Map::new());
    }
    let map = into.as_object_mut().expect("made an object");
    if rest.is_empty() {
        map.entry(first.to_string()).or_insert(value);
    } else {
        put(map.entry(first.to_string()).or_insert(Value::Object(Map::new())), rest, value);
    }
}

/// What route `i` writes for `record`, or why the record would be
/// dead-lettered (the reason the consumer would give). `router` is
/// [`Router::new`] of `cfg`, or of [`without_schema`] for an example.
pub fn explain(cfg: &RelayConfig, router: &Router, i: usize, record: RawRecord) -> Result<Explained, String> {
    let r = &cfg.routes[i];
    if record.topic != r.topic {
        return Err(format!(
            "the record is on topic {:?}; route {} reads {:?}",
            record.topic,
            r.display_name(),
            r.topic
        ));
    }
    let (route, event) =
        match router.route(&record).map_err(|p| format!("dead-lettered as {}: {}", p.class.as_str(), p.reason))? {
            Routed::Route(route, event) => (route, event),
            Routed::Unrouted(event) | Routed::Paused(_, event) => {
                return Err(format!(
                    "the event has type {:?}; route {} takes type {:?}",
                    event.event_type,
                    r.display_name(),
                    r.event_type
                ));
            }
        };
    let plan = router
        .plan(route, &event, &record)
        .map_err(|p| format!("dead-lettered as {}: {}", p.class.as_str(), p.reason))?;
    let effects = router
        .effects(route, &event, plan.clone(), &router.provenance(&event), chrono::Utc::now())
        .map_err(|p| format!("dead-lettered as {}: {}", p.class.as_str(), p.reason))?;
    Ok(Explained { record, event, plan, effects, handler: route.handler.clone() })
}

/// `cfg` with route `i`'s JSON Schema left out: an example event is not
/// made to fit patterns and formats, so only a given event is checked.
pub fn without_schema(cfg: &RelayConfig, i: usize) -> RelayConfig {
    let mut cfg = cfg.clone();
    cfg.routes[i].schema_document = None;
    cfg.routes[i].schema = None;
    cfg
}

/// The variable paths of `reads` a template of the route reads, for the
/// example's description.
pub fn placeholders(reads: &BTreeSet<String>) -> Vec<String> {
    reads.iter().filter(|p| p.starts_with("data.") || p.starts_with("extensions.")).cloned().collect()
}
