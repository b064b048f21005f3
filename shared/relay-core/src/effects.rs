//! What processing an event produces, before it is written: saga moves,
//! calls (future intents) and events (future outbox rows).
//!
//! Declarative routes render to these types and code handlers return them, so
//! both go through the same writer and get the same derived ids (R7). They are
//! also stored (as JSON) on an intent as its outcome effects, which is why they
//! are serializable.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::envelope::{Header, Poison, RawRecord};

/// A guarded saga transition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct SagaMove {
    /// Action name (history key).
    pub action: String,
    pub saga_type: String,
    pub saga_id: String,
    /// Allowed current states (ignored when `start`).
    pub from: Vec<String>,
    /// Target state.
    pub to: String,
    /// Create the saga in `to`; it must not exist yet.
    pub start: bool,
}

/// An external call to make, later, through an intent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallSpec {
    /// Action name; part of the intent's derived id.
    pub action: String,
    /// Endpoint name (from configuration).
    pub endpoint: String,
    /// HTTP method.
    pub method: String,
    /// Path appended to the endpoint's base URL.
    pub path: String,
    /// JSON body.
    pub body: Option<Value>,
    /// Extra request headers.
    pub headers: BTreeMap<String, String>,
    /// Idempotency key; `None` uses the intent id.
    pub idempotency_key: Option<String>,
    /// Per-key ordering (R13).
    pub ordering_key: Option<String>,
    /// Fairness key: the calls of each are spread at the endpoint's fair share.
    pub fairness_key: Option<String>,
    /// Effects when the call succeeds.
    pub on_success: Outcome,
    /// Effects when the call dies.
    pub on_dead: Outcome,
}

/// Effects of a finished call.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// Events to emit.
    #[serde(default)]
    pub emit: Vec<EmitSpec>,
    /// Saga moves to make.
    #[serde(default)]
    pub saga: Vec<SagaMove>,
    /// The values above still to be rendered from the provider's answer
    /// (a call's `on_success` reading `response`); their places hold
    /// placeholders until [`Outcome::answered`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deferred: Vec<crate::template::Deferred>,
}

impl Outcome {
    /// Nothing to do.
    pub fn is_empty(&self) -> bool {
        self.emit.is_empty() && self.saga.is_empty()
    }

    /// Whether the stored outcome `stored` reads the provider's answer.
    pub fn reads_answer(stored: &Value) -> bool {
        stored.get("deferred").and_then(Value::as_array).is_some_and(|d| !d.is_empty())
    }

    /// The stored outcome `stored` with its deferred values rendered from
    /// the provider's `answer` ([`answer`]) and put in their places.
    pub fn answered(stored: &Value, answer: &Value) -> Result<Value, crate::template::RenderError> {
        let mut out = stored.clone();
        let Some(deferred) = out.as_object_mut().and_then(|o| o.remove("deferred")) else { return Ok(out) };
        let deferred: Vec<crate::template::Deferred> = serde_json::from_value(deferred)
            .map_err(|e| crate::template::RenderError(format!("stored deferred templates are unreadable: {e}")))?;
        for d in &deferred {
            let value = crate::template::render_deferred(d, answer)?;
            let slot = out.pointer_mut(&d.at).ok_or_else(|| {
                crate::template::RenderError(format!(
                    "template {}: its place {} is not in the outcome",
                    d.template, d.at
                ))
            })?;
            *slot = value;
        }
        Ok(out)
    }
}

/// The provider's answer as a call's `on_success` templates read it
/// (`response`): `status`, `headers` (lower-case names; `Set-Cookie` never
/// kept), `body` (JSON when it parses, else text; null when it was longer
/// than the endpoint keeps, `truncated` then true), and `via`: `call` for
/// the call itself, `lookup` or `resend` for a reconciliation's question.
pub fn answer(status: u16, headers: &[(String, String)], body: &[u8], truncated: bool, via: &str) -> Value {
    let body = if truncated {
        Value::Null
    } else {
        serde_json::from_slice(body).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()))
    };
    let headers: serde_json::Map<String, Value> =
        headers.iter().map(|(k, v)| (k.to_ascii_lowercase(), Value::String(v.clone()))).collect();
    let mut answer =
        serde_json::json!({"status": status, "headers": headers, "body": body, "truncated": truncated, "via": via});
    without_nul(&mut answer);
    answer
}

/// `v` with every NUL in its strings and keys replaced by U+FFFD:
/// PostgreSQL's jsonb cannot hold one, and the answer is stored.
fn without_nul(v: &mut Value) {
    match v {
        Value::String(s) if s.contains('\0') => *s = s.replace('\0', "\u{FFFD}"),
        Value::Array(a) => a.iter_mut().for_each(without_nul),
        Value::Object(m) if m.keys().any(|k| k.contains('\0')) => {
            let old = std::mem::take(m);
            for (k, mut x) in old {
                without_nul(&mut x);
                m.insert(k.replace('\0', "\u{FFFD}"), x);
            }
        }
        Value::Object(m) => m.values_mut().for_each(without_nul),
        _ => {}
    }
}

/// An event to emit through the outbox.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct EmitSpec {
    /// Action name; part of the event's derived id.
    pub action: String,
    /// CloudEvents type.
    pub event_type: String,
    /// Destination topic.
    pub topic: String,
    /// Record key (also the ordering key when `ordered`).
    pub key: Option<String>,
    /// CloudEvents subject.
    pub subject: Option<String>,
    pub data: Value,
    /// Publish after earlier unpublished events of the same topic and key.
    pub ordered: bool,
    /// The data encoded for its topic's schema (the `format` of the emits
    /// to its topic): the record's value, in place of the data as JSON. Set
    /// by the router only; whatever a handler puts here is replaced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoded: Option<EncodedData>,
}

/// An event's data encoded by a schema, e.g. Avro in the Schema Registry
/// wire format.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EncodedData {
    /// The record value.
    pub bytes: Vec<u8>,
    /// Its `content-type` header (CloudEvents binary mode: the data's type).
    pub content_type: String,
}

/// Encodes the data of an emit with a schema (`format = "avro"` on an
/// emit): set on the [`crate::Router`] by whoever holds the schemas, so
/// routing stays free of I/O.
pub trait DataEncoder: Send + Sync + std::fmt::Debug {
    /// The value for `data`, or why it does not fit the schema (naming the field).
    fn encode(&self, data: &Value) -> Result<Vec<u8>, String>;
    /// The `content-type` of what [`DataEncoder::encode`] gives.
    fn content_type(&self) -> &str;
    /// The schema, for reasons: e.g. `subject orders-value, schema id 7`.
    fn describe(&self) -> String;
}

/// Everything one event produces.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    /// Guarded transitions, applied first.
    pub sagas: Vec<SagaMove>,
    /// Calls to make.
    pub calls: Vec<CallSpec>,
    /// Events to emit.
    pub emits: Vec<EmitSpec>,
}

impl Plan {
    /// Append another plan (e.g. a code handler's) to this one.
    pub fn extend(&mut self, other: Plan) {
        self.sagas.extend(other.sagas);
        self.calls.extend(other.calls);
        self.emits.extend(other.emits);
    }
}

/// An intent: the call to make and what its outcome leads to, as the
/// consumer writes it once and every attempt reads it back. A row adds its
/// id and age budget to it ([`NewIntent`]), a claim its lease and attempt
/// count (`relay_store::intents::ClaimedIntent`).
#[derive(Debug, Clone, Default, PartialEq)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct Intent {
    /// Consumer that produced it.
    pub consumer: String,
    /// Input event id.
    pub source_event_id: String,
    /// Action name.
    pub action: String,
    /// Endpoint name.
    pub endpoint: String,
    /// HTTP method.
    pub method: String,
    /// Path under the endpoint's base URL.
    pub path: String,
    /// JSON body.
    pub body: Option<Value>,
    /// Extra headers, as a JSON object (column `request_headers`).
    pub headers: Value,
    /// Idempotency key sent on every attempt (R8).
    pub idempotency_key: String,
    /// Per-key ordering.
    pub ordering_key: Option<String>,
    /// Whether it holds its ordering key once dead (its route's
    /// `on_poison = "hold_key"`), until replayed or skipped.
    pub holds_key: bool,
    pub fairness_key: Option<String>,
    /// Attempt budget.
    pub max_attempts: i32,
    /// Effects on success (a serialized [`Outcome`]).
    pub on_success: Value,
    /// Effects on death.
    pub on_dead: Value,
    /// CloudEvents source for outcome events.
    pub emit_source: String,
    pub aggregate_id: Option<String>,
    pub correlation_id: Option<String>,
    /// Causation id (the input event).
    pub causation_id: Option<String>,
    /// W3C trace context.
    pub traceparent: Option<String>,
}

impl Intent {
    /// The length of its JSON values (body, headers, outcomes) as compact
    /// JSON text: what a claimed intent holds in memory, within a small
    /// factor (the claim's byte room counts the same values, as PostgreSQL
    /// prints them).
    pub fn json_bytes(&self) -> usize {
        /// Counts what is written; serde_json has no length-only serializer.
        struct Count(usize);
        impl std::io::Write for Count {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0 += buf.len();
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut n = Count(0);
        for v in
            [self.body.as_ref(), Some(&self.headers), Some(&self.on_success), Some(&self.on_dead)].into_iter().flatten()
        {
            // Writing a Value to a sink that never fails cannot fail.
            let _ = serde_json::to_writer(&mut n, v);
        }
        n.0
    }
}

/// An intent to insert: its derived id (R7) and its age budget, which the
/// row stores as a deadline.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NewIntent {
    /// Derived id (R7).
    pub id: Uuid,
    /// The call and its effects.
    pub intent: Intent,
    /// Age budget.
    pub max_age: Duration,
    /// For an intent with a fairness key: the spacing of its key's calls
    /// (1 / the endpoint's `fair_share_per_second`).
    pub fair_spacing: Option<Duration>,
}

/// Everything one event writes besides its inbox row, every id derived
/// (R7): what [`crate::Router::effects`] makes of a [`Plan`], and what the
/// store writes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Effects {
    /// Guarded saga transitions, applied before anything else is written.
    pub sagas: Vec<SagaMove>,
    /// Intents, with derived ids and idempotency keys.
    pub intents: Vec<NewIntent>,
    /// Outbox records, encoded, with derived ids.
    pub events: Vec<OutboxRecord>,
    /// The business counter the route adds one to (R20).
    pub counter: Option<String>,
}

/// Where an emitted event comes from, for its CloudEvents attributes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Provenance {
    /// CloudEvents `source` of the relay.
    pub source: String,
    /// Correlation id carried forward (the input's, else the input id).
    pub correlation_id: Option<String>,
    /// The id of the event (or intent) that caused this one.
    pub causation_id: Option<String>,
    /// W3C trace context carried forward.
    pub traceparent: Option<String>,
    /// Aggregate id of the input.
    pub aggregate_id: Option<String>,
}

/// A Kafka record ready for the outbox table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRecord {
    /// Derived id (also the CloudEvents id of events).
    pub id: Uuid,
    /// Action that produced it.
    pub action: String,
    /// Destination topic.
    pub topic: String,
    /// Record key.
    pub key: Option<Vec<u8>>,
    /// Record headers.
    pub headers: Vec<Header>,
    /// Record value.
    pub payload: Option<Vec<u8>>,
    /// Event type, for logs and counts.
    pub event_type: Option<String>,
    /// Publish order key (same topic), when ordered.
    pub ordering_key: Option<String>,
}

/// Encode an event as a CloudEvents binary-mode Kafka record with id `id`,
/// ordered (if it is) in `space`.
pub fn encode_event(
    id: Uuid,
    spec: &EmitSpec,
    prov: &Provenance,
    space: crate::ids::KeySpace,
    now: DateTime<Utc>,
) -> OutboxRecord {
    let mut headers = vec![
        Header::text("ce_specversion", "1.0"),
        Header::text("ce_id", id.to_string()),
        Header::text("ce_type", &spec.event_type),
        Header::text("ce_source", &prov.source),
        Header::text("ce_time", now.to_rfc3339_opts(SecondsFormat::Millis, true)),
        Header::text("content-type", spec.encoded.as_ref().map_or("application/json", |e| e.content_type.as_str())),
    ];
    let mut opt = |name: &str, v: &Option<String>| {
        if let Some(v) = v {
            headers.push(Header::text(name, v));
        }
    };
    opt("ce_subject", &spec.subject);
    opt("ce_correlationid", &prov.correlation_id);
    opt("ce_causationid", &prov.causation_id);
    opt("ce_traceparent", &prov.traceparent);
    opt("ce_aggregateid", &prov.aggregate_id);
    let key = spec.key.clone().or_else(|| prov.aggregate_id.clone());
    OutboxRecord {
        id,
        action: spec.action.clone(),
        topic: spec.topic.clone(),
        key: key.as_ref().map(|k| k.as_bytes().to_vec()),
        headers,
        payload: Some(match &spec.encoded {
            Some(e) => e.bytes.clone(),
            None => serde_json::to_vec(&spec.data).unwrap_or_default(),
        }),
        event_type: Some(spec.event_type.clone()),
        ordering_key: if spec.ordered { key.as_deref().map(|k| space.event_ordering_key(k)) } else { None },
    }
}

/// Header names added to a dead-letter copy of a record.
pub mod dlq_headers {
    /// Original topic.
    pub const TOPIC: &str = "relay_dlq_topic";
    /// Original partition.
    pub const PARTITION: &str = "relay_dlq_partition";
    /// Original offset.
    pub const OFFSET: &str = "relay_dlq_offset";
    /// Event id, when known.
    pub const EVENT_ID: &str = "relay_dlq_event_id";
    /// Error class.
    pub const CLASS: &str = "relay_dlq_error_class";
    /// Human-readable reason.
    pub const REASON: &str = "relay_dlq_reason";
    /// Attempts made.
    pub const ATTEMPTS: &str = "relay_dlq_attempts";
    /// Consumer that parked it.
    pub const CONSUMER: &str = "relay_dlq_consumer";
    /// Set when the original key, value and headers were left out of the
    /// copy (too large for it): how many bytes; the dead-letter table keeps them.
    pub const OMITTED: &str = "relay_dlq_omitted_bytes";
    /// Set when some of the original headers were left out of the copy (more
    /// than the relay reads): how many, or `unknown` when they could not be read.
    pub const OMITTED_HEADERS: &str = "relay_dlq_omitted_headers";
}

/// Encode the dead-letter copy of `record`: the original key, value and
/// headers, plus `relay_dlq_*` headers saying where it came from and why.
///
/// A record larger than `max_bytes` (key, value and headers; the consumer's
/// `max_record_bytes`, so anything the relay accepts as input is copied
/// whole) is copied without its key, value and headers, with
/// [`dlq_headers::OMITTED`] saying how much was left out: the copy of an
/// oversized record could never be published (the broker's and the
/// producer's size limits), and the dead-letter table keeps it whole.
///
/// At most [`MAX_HEADERS`](crate::limits::MAX_HEADERS) of the record's
/// headers are copied, with [`dlq_headers::OMITTED_HEADERS`] saying how many
/// were left out.
pub fn encode_dead_letter(
    consumer: &str,
    topic: &str,
    record: &RawRecord,
    poison: &Poison,
    attempts: u32,
    max_bytes: usize,
) -> OutboxRecord {
    use crate::envelope::LeftOut;
    use crate::limits::MAX_HEADERS;
    let size = record.content_size();
    let whole = size <= max_bytes;
    let mut headers: Vec<Header> = Vec::new();
    let mut omitted_headers = None;
    if whole {
        headers.extend(record.read_headers().take(MAX_HEADERS).cloned());
        let read = record.read_headers().count();
        omitted_headers = match record.headers_left_out() {
            Some(LeftOut::Unreadable) => Some("unknown".to_owned()),
            Some(LeftOut::Headers(n)) => Some((read + n - headers.len()).to_string()),
            None if read > headers.len() => Some((read - headers.len()).to_string()),
            None => None,
        };
    }
    headers.push(Header::text(dlq_headers::TOPIC, &record.topic));
    headers.push(Header::text(dlq_headers::PARTITION, record.partition.to_string()));
    headers.push(Header::text(dlq_headers::OFFSET, record.offset.to_string()));
    if let Some(id) = &poison.event_id {
        headers.push(Header::text(dlq_headers::EVENT_ID, id));
    }
    headers.push(Header::text(dlq_headers::CLASS, poison.class.as_str()));
    headers.push(Header::text(dlq_headers::REASON, &poison.reason));
    headers.push(Header::text(dlq_headers::ATTEMPTS, attempts.to_string()));
    headers.push(Header::text(dlq_headers::CONSUMER, consumer));
    if !whole {
        headers.push(Header::text(dlq_headers::OMITTED, size.to_string()));
    }
    if let Some(n) = omitted_headers {
        headers.push(Header::text(dlq_headers::OMITTED_HEADERS, n));
    }
    OutboxRecord {
        id: crate::ids::dead_letter_id(consumer, &record.topic, record.partition, record.offset),
        action: "dead_letter".into(),
        topic: topic.to_owned(),
        key: if whole { record.key.clone() } else { None },
        headers,
        payload: if whole { record.payload.clone() } else { None },
        event_type: poison.event_type.clone(),
        ordering_key: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::PoisonClass;
    use serde_json::json;

    fn header<'a>(r: &'a OutboxRecord, name: &str) -> Option<&'a str> {
        r.headers
            .iter()
            .find(|h| h.name == name)
            .and_then(|h| h.value.as_deref())
            .map(|v| std::str::from_utf8(v).unwrap())
    }

    #[test]
    fn emitted_events_are_cloudevents_with_the_derived_id_and_causation() {
        let id = Uuid::new_v4();
        let spec = EmitSpec {
            action: "accepted".into(),
            event_type: "order.accepted".into(),
            topic: "out".into(),
            key: None,
            subject: Some("o-1".into()),
            data: json!({"a": 1}),
            ordered: true,
            encoded: None,
        };
        let prov = Provenance {
            source: "relay/test".into(),
            correlation_id: Some("corr".into()),
            causation_id: Some("evt-1".into()),
            traceparent: None,
            aggregate_id: Some("o-1".into()),
        };
        let r = encode_event(id, &spec, &prov, crate::ids::KeySpace::Routes, Utc::now());
        assert_eq!(header(&r, "ce_id"), Some(id.to_string().as_str()));
        assert_eq!(header(&r, "ce_causationid"), Some("evt-1"));
        assert_eq!(header(&r, "ce_type"), Some("order.accepted"));
        assert_eq!(r.key.as_deref(), Some(&b"o-1"[..]), "key defaults to the aggregate id");
        assert_eq!(r.ordering_key.as_deref(), Some("o-1"));
        assert_eq!(r.payload.as_deref(), Some(&br#"{"a":1}"#[..]));
    }

    #[test]
    fn dead_letters_keep_the_original_bytes_and_say_where_from_and_why() {
        let rec = RawRecord {
            topic: "orders".into(),
            partition: 2,
            offset: 41,
            key: Some(b"k".to_vec()),
            payload: Some(b"{bad".to_vec()),
            headers: vec![Header::text("ce_id", "e-1")],
        };
        let poison = Poison::new(PoisonClass::BadJson, "nope").with_identity(Some("e-1"), None);
        let r = encode_dead_letter("c", "orders.dlq", &rec, &poison, 1, 1 << 20);
        assert_eq!(r.topic, "orders.dlq");
        assert_eq!(r.payload, rec.payload);
        assert_eq!(header(&r, dlq_headers::TOPIC), Some("orders"));
        assert_eq!(header(&r, dlq_headers::PARTITION), Some("2"));
        assert_eq!(header(&r, dlq_headers::OFFSET), Some("41"));
        assert_eq!(header(&r, dlq_headers::EVENT_ID), Some("e-1"));
        assert_eq!(header(&r, dlq_headers::CLASS), Some("bad_json"));
        assert_eq!(header(&r, "ce_id"), Some("e-1"), "original headers are kept");
        assert_eq!(r.id, encode_dead_letter("c", "orders.dlq", &rec, &poison, 3, 1 << 20).id);
        assert_eq!(header(&r, dlq_headers::OMITTED), None);
    }

    // The copy of an oversized record could never be published.
    #[test]
    fn a_record_larger_than_the_limit_is_copied_without_its_bytes_and_says_so() {
        let rec = RawRecord {
            topic: "orders".into(),
            partition: 0,
            offset: 1,
            key: Some(b"k".to_vec()),
            payload: Some(vec![b'x'; 2_000]),
            headers: vec![Header::text("ce_id", "e-1")],
        };
        let poison = Poison::new(PoisonClass::Oversized, "too big").with_identity(Some("e-1"), None);
        let r = encode_dead_letter("c", "orders.dlq", &rec, &poison, 1, 1_000);
        assert_eq!((r.key.as_ref(), r.payload.as_ref()), (None, None));
        assert_eq!(header(&r, dlq_headers::OMITTED), Some("2009"), "key 1 + value 2000 + header ce_id: e-1 (8)");
        assert_eq!(header(&r, "ce_id"), None, "original headers left out too");
        assert_eq!(header(&r, dlq_headers::CLASS), Some("oversized"));
        assert_eq!(header(&r, dlq_headers::EVENT_ID), Some("e-1"));
    }

    #[test]
    fn a_dead_letter_copy_keeps_at_most_max_headers_of_the_record_s_and_says_how_many_it_left_out() {
        use crate::envelope::LeftOut;
        use crate::limits::MAX_HEADERS;
        let rec = RawRecord {
            topic: "orders".into(),
            partition: 0,
            offset: 1,
            key: None,
            payload: Some(b"{}".to_vec()),
            headers: (0..MAX_HEADERS + 88).map(|i| Header::text(format!("h{i}"), "v")).collect(),
        };
        let poison = Poison::new(PoisonClass::BadHeader, "too many headers");
        let r = encode_dead_letter("c", "orders.dlq", &rec, &poison, 1, 1 << 20);
        let copied = r.headers.iter().filter(|h| !h.name.starts_with("relay_dlq_")).count();
        assert!(copied <= MAX_HEADERS, "{copied} of the record's {} headers copied", rec.headers.len());
        assert_eq!(header(&r, dlq_headers::OMITTED_HEADERS), Some("88"));
        assert_eq!(header(&r, dlq_headers::CLASS), Some("bad_header"));
        // As read off the wire: the first MAX_HEADERS, then the entry saying how many more.
        let mut read = rec.clone();
        read.headers.truncate(MAX_HEADERS);
        read.headers.push(Header::left_out(LeftOut::Headers(299_488)));
        let r = encode_dead_letter("c", "orders.dlq", &read, &poison, 1, 1 << 20);
        assert_eq!(r.headers.iter().filter(|h| !h.name.starts_with("relay_dlq_")).count(), MAX_HEADERS);
        assert_eq!(header(&r, dlq_headers::OMITTED_HEADERS), Some("299488"));
        assert!(r.headers.iter().all(|h| h.as_left_out().is_none() && !h.name.contains('\0')), "nothing of ours");
        read.headers = vec![Header::left_out(LeftOut::Unreadable)];
        let r = encode_dead_letter("c", "orders.dlq", &read, &poison, 1, 1 << 20);
        assert_eq!(header(&r, dlq_headers::OMITTED_HEADERS), Some("unknown"));
        assert!(r.headers.iter().all(|h| h.name.starts_with("relay_dlq_")));
    }

    // The 1 MiB default was above what the default
    // producer sends (message.max.bytes = 1 000 000), so the copy of any
    // record between the two could never be published.
    #[test]
    fn the_dead_letter_copy_of_the_largest_record_accepted_by_default_fits_the_default_producer() {
        use crate::limits::{MAX_HEADERS, MAX_KEY_BYTES, MAX_REASON_BYTES};
        const PRODUCER_MESSAGE_MAX_BYTES: usize = 1_000_000;
        let max = crate::config::ConsumerConfig::default().max_record_bytes;
        let headers: Vec<Header> = (0..MAX_HEADERS).map(|i| Header::text(format!("h{i:03}"), "v")).collect();
        let used: usize = headers.iter().map(|h| h.name.len() + 1).sum::<usize>() + 1;
        let rec = RawRecord {
            topic: "t".repeat(249),
            partition: i32::MAX,
            offset: i64::MAX,
            key: Some(b"k".to_vec()),
            payload: Some(vec![b'x'; max - used]),
            headers,
        };
        assert_eq!(rec.content_size(), max);
        let poison = Poison::new(PoisonClass::Rejected, "r".repeat(10 * MAX_REASON_BYTES))
            .with_identity(Some(&"i".repeat(10 * MAX_KEY_BYTES)), Some(&"t".repeat(10 * MAX_KEY_BYTES)));
        let copy = encode_dead_letter(&"c".repeat(200), "dlq", &rec, &poison, u32::MAX, max);
        assert!(copy.payload.is_some(), "copied whole");
        // What librdkafka measures: key, value, and each header's name and
        // value with their two varint lengths (at most 5 bytes each).
        let size = copy.key.as_ref().map_or(0, Vec::len)
            + copy.payload.as_ref().map_or(0, Vec::len)
            + copy.headers.iter().map(|h| 10 + h.name.len() + h.value.as_ref().map_or(0, Vec::len)).sum::<usize>();
        assert!(size <= PRODUCER_MESSAGE_MAX_BYTES, "{size}");
    }
}
