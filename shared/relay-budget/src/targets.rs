//! The decoders relay runs on bytes from outside, each measured from the
//! bytes as they arrive to what relay holds once it has read them: an event
//! (or the poison it is and its dead letter), a plan of effects, an outcome.
//! The budget tests (`tests/budget.rs`) drive them with hostile shapes, the
//! fuzz targets (`fuzz/`) with whatever the fuzzer finds.
//!
//! Over the budget today ([`crate::OVER_BUDGET`]):
//!
//! * JSON (the envelope, JSON Schema, `jsonb`): serde_json's tree takes up
//!   to about 127 bytes per byte of text (a one-key object is a 632-byte
//!   B-tree node for five bytes, nested), and a structured CloudEvent's data
//!   or a stored outcome is held twice (the event keeps it while it is
//!   cloned; the outcome is cloned to be read).
//! * Avro: apache-avro builds its own value of the whole datum before it is
//!   written as JSON, with each record's field names and each enum's symbol
//!   copied per item: one byte of the record (an enum index, a null branch)
//!   costs a few hundred bytes there, before the JSON bound is reached.
//!   Worse, a block's item count is trusted (see the ignored test).
//! * Protobuf: prost-reflect's message holds each item of a repeated field
//!   as a value of about 50 bytes, and a packed scalar is one byte; then
//!   the JSON, up to its bound, and the event's tree built from it.
//! * Templates: the event's data is cloned into the context and converted
//!   whole to the template engine's values (and once more with blanks
//!   marked, when it has any), and each template that copies a part of the
//!   data (`"{{ data.items }}"`) renders it to text and parses it again.

use relay_core::effects::{OutboxRecord, encode_dead_letter};
use relay_core::envelope::{DecodeOptions, FieldOverrides, FieldSource, TopicFormat, copy_headers, decode, resolve};
use relay_core::router::{Routed, Router};
use relay_core::{Outcome, RawRecord, RelayConfig};
use serde_json::Value;

use crate::{Measured, peak_during};

/// A record of any headers read and decoded to an event or dead-lettered:
/// at most [`relay_core::limits::MAX_HEADERS`] of them are copied.
pub const HEADERS: &str = "headers";
/// A record's value decoded to an event: CloudEvents binary and structured
/// mode, plain JSON, and a registry value already decoded to JSON.
pub const ENVELOPE: &str = "envelope";
/// An Avro value of the Schema Registry, decoded to an event.
pub const AVRO: &str = "avro";
/// A Protobuf value of the Schema Registry, decoded to an event.
pub const PROTOBUF: &str = "protobuf";
/// A JSON Schema value of the Schema Registry, checked and decoded to an event.
pub const JSON_SCHEMA: &str = "json-schema";
/// A record routed: decoded, its route's templates rendered to effects.
pub const TEMPLATE: &str = "template";
/// An intent's `jsonb` read back by the dispatcher: its outcome and body.
pub const JSONB: &str = "jsonb";

/// The most a dead letter's copy may hold of the record, as the consumer's
/// default `max_record_bytes`.
const MAX_RECORD_BYTES: usize = 960 * 1024;

/// A record as the broker holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct WireRecord {
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    /// Its headers: names as bytes, values or null.
    pub headers: Vec<(Vec<u8>, Option<Vec<u8>>)>,
}

/// Bytes of `n` as a zig-zag varint, as Kafka writes lengths and counts.
fn varint_len(n: i64) -> usize {
    let mut z = ((n << 1) ^ (n >> 63)) as u64;
    let mut len = 1;
    while z >= 0x80 {
        z >>= 7;
        len += 1;
    }
    len
}

fn len_of(bytes: Option<&Vec<u8>>) -> usize {
    bytes.map_or(varint_len(-1), |b| varint_len(b.len() as i64) + b.len())
}

impl WireRecord {
    /// Its size in Kafka's record format (v2), without the batch around
    /// it: length, attributes, timestamp and offset deltas (a byte each at
    /// least), key, value, and each header's name and value with their
    /// lengths.
    pub fn wire_len(&self) -> usize {
        let headers: usize = self
            .headers
            .iter()
            .map(|(name, value)| varint_len(name.len() as i64) + name.len() + len_of(value.as_ref()))
            .sum();
        let body = 3 + len_of(self.key.as_ref()) + len_of(self.value.as_ref()) + varint_len(self.headers.len() as i64);
        let body = body + headers;
        varint_len(body as i64) + body
    }

    /// The record as the consumer reads it: key and value copied, at most
    /// `keep` headers ([`relay_core::limits::MAX_HEADERS`] in relay).
    pub fn read(&self, topic: &str, keep: usize) -> RawRecord {
        RawRecord {
            topic: topic.to_owned(),
            partition: 0,
            offset: 7,
            key: self.key.clone(),
            payload: self.value.clone(),
            headers: copy_headers(self.headers.len(), keep, |i| {
                self.headers.get(i).map(|(name, value)| (name.as_slice(), value.as_deref()))
            }),
        }
    }
}

/// Where a topic of plain JSON (or a decoded registry value without
/// CloudEvents headers) takes its fields from: constants for id and type,
/// so that the data itself is always read; the others from the data and
/// headers.
fn plain_fields() -> FieldOverrides {
    FieldOverrides {
        id: Some(FieldSource::Value("e-1".into())),
        event_type: Some(FieldSource::Value("order.placed".into())),
        aggregate_id: Some(FieldSource::Pointer("/order_id".into())),
        sequence: Some(FieldSource::Header("seq".into())),
        idempotency_key: Some(FieldSource::Extension("idempotencykey".into())),
        ..FieldOverrides::default()
    }
}

/// What relay does with `record` of a topic in `format` once read, up to
/// the event or the dead letter, holding what it builds on the way.
fn to_event(record: &RawRecord, format: TopicFormat, park: &dyn Fn(&RawRecord, &OutboxRecord)) -> String {
    let fields = if format == TopicFormat::Cloudevents { FieldOverrides::default() } else { plain_fields() };
    let opts = DecodeOptions { max_record_bytes: MAX_RECORD_BYTES, format, fields: &fields };
    match decode(record, &opts).and_then(|event| resolve(record, event, &fields)) {
        Ok(event) => {
            let outcome = "ok".to_owned();
            drop(event);
            outcome
        }
        Err(poison) => dead_letter(record, &poison, park),
    }
}

/// The dead letter of `record`: its copy for the dead-letter topic, and
/// whatever `park` builds of it (the test stores its headers as the
/// dead-letter row does).
fn dead_letter(record: &RawRecord, poison: &relay_core::Poison, park: &dyn Fn(&RawRecord, &OutboxRecord)) -> String {
    let copy = encode_dead_letter("budget", "budget.dlq", record, poison, 1, MAX_RECORD_BYTES);
    park(record, &copy);
    poison.class.as_str().to_owned()
}

/// [`ENVELOPE`] (or [`HEADERS`], as `target` says): `record`, read keeping
/// at most `keep_headers` headers, of a topic in `format` (a registry
/// format: its value already decoded to JSON), then decoded to an event or
/// dead-lettered.
pub fn envelope(
    target: &'static str,
    record: &WireRecord,
    format: TopicFormat,
    keep_headers: usize,
    park: &dyn Fn(&RawRecord, &OutboxRecord),
) -> Measured {
    let (outcome, peak) = peak_during(|| {
        let read = record.read("orders", keep_headers);
        to_event(&read, format, park)
    });
    Measured { target, wire: record.wire_len(), peak, outcome }
}

/// Schemas the registry targets decode with, by id: each shaped so that
/// a few bytes of a value can claim many items.
pub const SCHEMAS: &[(u32, TopicFormat, &str)] = &[
    (1, TopicFormat::Avro, r#"{"type":"array","items":"long"}"#),
    (
        2,
        TopicFormat::Avro,
        r#"{"type":"array","items":{"type":"record","name":"Reading","fields":[
            {"name":"optional_measurement_0","type":["null","long"],"default":null},
            {"name":"optional_measurement_1","type":["null","long"],"default":null},
            {"name":"optional_measurement_2","type":["null","long"],"default":null},
            {"name":"optional_measurement_3","type":["null","string"],"default":null},
            {"name":"optional_measurement_4","type":["null","boolean"],"default":null},
            {"name":"optional_measurement_5","type":["null","double"],"default":null},
            {"name":"optional_measurement_6","type":["null","bytes"],"default":null},
            {"name":"optional_measurement_7","type":["null","long"],"default":null}]}}"#,
    ),
    (
        3,
        TopicFormat::Avro,
        r#"{"type":"array","items":{"type":"enum","name":"Status","symbols":
            ["PAYMENT_AUTHORIZATION_PENDING_REVIEW_BY_THE_ISSUING_BANK_OF_THE_CARDHOLDER_ACCOUNT_AND_RISK_ENGINE","B"]}}"#,
    ),
    (4, TopicFormat::Avro, r#"{"type":"map","values":"string"}"#),
    (5, TopicFormat::Avro, r#"{"type":"array","items":{"type":"array","items":"boolean"}}"#),
    (
        6,
        TopicFormat::Avro,
        r#"{"type":"record","name":"Order","fields":[{"name":"order_id","type":"string"},
            {"name":"note","type":"string"},{"name":"tags","type":{"type":"array","items":"string"}},
            {"name":"lines","type":{"type":"array","items":{"type":"record","name":"Line","fields":[
            {"name":"sku","type":"string"},{"name":"qty","type":"int"}]}}}]}"#,
    ),
    (
        11,
        TopicFormat::Protobuf,
        r#"syntax = "proto3";
        message Order { string order_id = 1; repeated Line lines = 2; string note = 3; }
        message Line { string sku = 1; string name = 2; int64 quantity = 3; int64 unit_minor = 4;
                       string currency = 5; int64 tax_minor = 6; string warehouse = 7; bool gift = 8; }"#,
    ),
    (
        12,
        TopicFormat::Protobuf,
        r#"syntax = "proto3";
        message Bag { repeated int32 ints = 1; repeated Empty empties = 2; map<string, string> labels = 3;
                      repeated string texts = 4; repeated double doubles = 5; }
        message Empty {}"#,
    ),
    (13, TopicFormat::Protobuf, r#"syntax = "proto3"; message Node { repeated Node children = 1; string name = 2; }"#),
    (21, TopicFormat::JsonSchema, r#"{}"#),
    (
        22,
        TopicFormat::JsonSchema,
        r#"{"type":"object","properties":{"order_id":{"type":"string"},"items":{"type":"array",
            "items":{"type":["object","number","array","null","string","boolean"]}}}}"#,
    ),
];

/// The registry targets: a client that knows [`SCHEMAS`] without asking a
/// registry, and a runtime to drive its decode.
pub struct Registered {
    rt: tokio::runtime::Runtime,
    registry: relay_registry::Registry,
}

impl Registered {
    /// A client of no registry (nothing listens at its address); the
    /// targets only decode with schemas it was told.
    pub fn client() -> relay_registry::Registry {
        relay_registry::Registry::new(&relay_core::config::SchemaRegistryConfig {
            url: "http://127.0.0.1:9/".parse().expect("a URL"),
            username: None,
            password_env: None,
            token_env: None,
            timeout: std::time::Duration::from_secs(1),
            tls: Default::default(),
        })
        .expect("a client")
    }

    /// The targets over `registry` (see [`Registered::client`]), which is
    /// told [`SCHEMAS`].
    pub fn new(registry: relay_registry::Registry) -> Registered {
        for (id, format, text) in SCHEMAS {
            registry.know(*id, *format, text).unwrap_or_else(|e| panic!("schema {id}: {e}"));
        }
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("a runtime");
        Registered { rt, registry }
    }

    /// [`AVRO`], [`PROTOBUF`] or [`JSON_SCHEMA`]: a record whose value is
    /// `body` framed with schema `id` (of `format`), read, decoded by the
    /// registry client, and then, as the processor does, the record with
    /// its value decoded to JSON decoded to an event; or dead-lettered.
    pub fn measure(
        &self,
        format: TopicFormat,
        id: u32,
        body: &[u8],
        park: &dyn Fn(&RawRecord, &OutboxRecord),
    ) -> Measured {
        let mut value = vec![0u8];
        value.extend(id.to_be_bytes());
        value.extend(body);
        let wire = WireRecord { key: None, value: Some(value), headers: Vec::new() };
        let (outcome, peak) = peak_during(|| {
            let record = wire.read("orders", relay_core::limits::MAX_HEADERS);
            let decoded = self.rt.block_on(self.registry.decode(format, &record.topic, record.payload.as_deref()));
            match decoded {
                Ok(json) => {
                    let mut view = record.clone();
                    view.payload = Some(json);
                    to_event(&view, format, park)
                }
                Err(failure) => {
                    let class = match failure {
                        relay_registry::Failure::Oversized(_) => relay_core::PoisonClass::Oversized,
                        _ => relay_core::PoisonClass::BadEncoding,
                    };
                    dead_letter(&record, &relay_core::Poison::new(class, failure.to_string()), park)
                }
            }
        });
        let target = match format {
            TopicFormat::Avro => AVRO,
            TopicFormat::Protobuf => PROTOBUF,
            _ => JSON_SCHEMA,
        };
        Measured { target, wire: wire.wire_len(), peak, outcome }
    }
}

/// The route [`Templates`] renders: a call whose path, key, header and body
/// read the event, and events on success and on death, as the routes of
/// relay.example.toml do.
const ROUTE: &str = r#"
[consumer]
name = "budget"
[endpoints.psp]
base_url = "http://127.0.0.1:1"
[[routes]]
topic = "orders"
type = "order.placed"
[[routes.actions]]
kind = "call"
name = "capture"
endpoint = "psp"
path = "/orders/{{ data.order_id }}/capture"
idempotency_key = "capture:{{ data.order_id }}"
headers = { "x-order" = "{{ data.order_id }}" }
body = { amount = "{{ data.amount }}", items = "{{ data.items }}", note = "order {{ data.order_id }}" }
[[routes.actions.on_success.emit]]
name = "captured"
type = "payment.captured"
topic = "payments"
data = { order_id = "{{ data.order_id }}", items = "{{ data.items }}", status = "{{ response.status }}" }
[[routes.actions.on_dead.emit]]
name = "failed"
type = "payment.failed"
topic = "payments"
data = { order_id = "{{ data.order_id }}" }
"#;

/// [`TEMPLATE`]: records routed by one route shaped like relay.example.toml's (a call
/// with events on success and on death).
pub struct Templates {
    router: Router,
}

impl Default for Templates {
    fn default() -> Self {
        let cfg = RelayConfig::from_toml(ROUTE).expect("the route's configuration");
        Templates { router: Router::new(&cfg).expect("the route compiles") }
    }
}

impl Templates {
    /// A binary-mode CloudEvent of type `order.placed` whose data is `data`
    /// (JSON text, or anything), routed: decoded, its route's templates
    /// rendered and its effects built; or dead-lettered.
    pub fn measure(&self, data: &[u8], park: &dyn Fn(&RawRecord, &OutboxRecord)) -> Measured {
        let text = |name: &str, value: &str| (name.as_bytes().to_vec(), Some(value.as_bytes().to_vec()));
        let wire = WireRecord {
            key: Some(b"o-1".to_vec()),
            value: Some(data.to_vec()),
            headers: vec![
                text("ce_specversion", "1.0"),
                text("ce_id", "e-1"),
                text("ce_type", "order.placed"),
                text("ce_source", "/shop"),
                text("content-type", "application/json"),
            ],
        };
        let (outcome, peak) = peak_during(|| {
            let record = wire.read("orders", relay_core::limits::MAX_HEADERS);
            let routed = self.router.route(&record).and_then(|routed| match routed {
                Routed::Route(route, event) => {
                    let plan = self.router.plan(route, &event, &record)?;
                    let prov = self.router.provenance(&event);
                    self.router.effects(route, &event, plan, &prov, chrono::DateTime::UNIX_EPOCH).map(drop)
                }
                Routed::Unrouted(_) | Routed::Paused(..) => Ok(()),
            });
            match routed {
                Ok(()) => "ok".to_owned(),
                Err(poison) => dead_letter(&record, &poison, park),
            }
        });
        Measured { target: TEMPLATE, wire: wire.wire_len(), peak, outcome }
    }
}

/// [`JSONB`]: `text`, an intent's `on_success` (or `on_dead`) and its
/// body as PostgreSQL returns them, read as the dispatcher reads them:
/// parsed (serde_json, as sqlx does; nesting past 128 levels is an error,
/// not a deeper stack), rendered with the provider's answer when it reads
/// it, its effects taken out; the body parsed and written as a request.
pub fn jsonb(text: &[u8]) -> Measured {
    let (outcome, peak) = peak_during(|| {
        let stored: Value = match serde_json::from_slice(text) {
            Ok(v) => v,
            Err(e) => return format!("unreadable: {}", e.classify_name()),
        };
        let answer = serde_json::json!({"status": 200, "headers": {}, "body": {"id": "ch_1"}});
        let rendered = if Outcome::reads_answer(&stored) { Outcome::answered(&stored, &answer).ok() } else { None };
        let effects = serde_json::from_value::<Outcome>(rendered.unwrap_or_else(|| stored.clone()));
        let request = serde_json::to_vec(&stored).map(|body| body.len());
        drop(stored);
        match (effects, request) {
            (Ok(o), Ok(_)) => format!("ok, {} events", o.emit.len()),
            (Err(_), _) => "no outcome".to_owned(),
            (_, Err(_)) => "no body".to_owned(),
        }
    });
    Measured { target: JSONB, wire: text.len(), peak, outcome }
}

/// The kind of a serde_json error, without its position.
trait ClassifyName {
    fn classify_name(&self) -> &'static str;
}

impl ClassifyName for serde_json::Error {
    fn classify_name(&self) -> &'static str {
        match self.classify() {
            serde_json::error::Category::Io => "io",
            serde_json::error::Category::Syntax => "syntax",
            serde_json::error::Category::Data => "data",
            serde_json::error::Category::Eof => "eof",
        }
    }
}
