//! From a Kafka record to an [`InputEvent`], or to a classified [`Poison`].
//!
//! Input is CloudEvents 1.0 in either Kafka binding mode:
//!
//! * **binary**: attributes in `ce_*` headers, `content-type` header for
//!   `datacontenttype`, the data in the record value;
//! * **structured**: `content-type: application/cloudevents+json` and the whole
//!   event as JSON in the value.
//!
//! Topics whose producers do not speak CloudEvents (a Debezium outbox, a legacy
//! service) are declared `format = "json"` and say where the id and type come
//! from ([`FieldSource`]).
//!
//! The attribute mapping itself is the CloudEvents SDK's: we implement its
//! [`BinaryDeserializer`](cloudevents::message::BinaryDeserializer) over our own header list instead of enabling the SDK's
//! `rdkafka` feature, because that feature pins an older rdkafka (a second
//! librdkafka build) and unwraps header values, so a record with a null header
//! would panic the consumer instead of being dead-lettered.
//!
//! What must stay true: nothing here invents an event id (R3). A record that
//! has no usable id is [`PoisonClass::MissingId`], never processed under a
//! fresh one.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::limits::{MAX_HEADERS, MAX_KEY_BYTES, MAX_REASON_BYTES, bounded, check_key, is_blank};
use crate::stored::stored_names;

mod cloud_events;

use cloud_events::decode_cloudevent;

/// `content-type` of a structured-mode CloudEvent.
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";

/// One Kafka header. Kafka allows a header without a value; so do we.
///
/// Kafka header names are bytes on the wire, and some clients (Go's sarama
/// and franz-go, librdkafka's C API) write names that are not UTF-8. Such a
/// name is kept exactly in `raw_name` (its lossy text in `name`), and the
/// record is poison ([`PoisonClass::BadHeader`]): never a crash, and the
/// dead letter keeps the original bytes for replay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    /// Header name (lossy text when the name is not UTF-8).
    pub name: String,
    /// Raw value; `None` is Kafka's null header value.
    pub value: Option<Vec<u8>>,
    /// The name's bytes, only when they are not UTF-8.
    pub raw_name: Option<Vec<u8>>,
}

impl Header {
    /// A header with a UTF-8 name and any value.
    pub fn new(name: impl Into<String>, value: Option<Vec<u8>>) -> Self {
        Header { name: name.into(), value, raw_name: None }
    }

    /// A header with a UTF-8 value.
    pub fn text(name: impl Into<String>, value: impl AsRef<str>) -> Self {
        Header::new(name, Some(value.as_ref().as_bytes().to_vec()))
    }

    /// A header as read off the wire: the name as bytes, maybe not UTF-8.
    pub fn from_wire(name: &[u8], value: Option<Vec<u8>>) -> Self {
        match std::str::from_utf8(name) {
            Ok(text) => Header::new(text, value),
            Err(_) => Header { name: String::from_utf8_lossy(name).into_owned(), value, raw_name: Some(name.to_vec()) },
        }
    }

    /// The name's bytes, exactly as on the wire.
    pub fn name_bytes(&self) -> &[u8] {
        self.raw_name.as_deref().unwrap_or(self.name.as_bytes())
    }

    /// The entry that stands for headers a reader of the wire did not copy
    /// ([`LeftOut`]), put after the ones it copied.
    pub fn left_out(what: LeftOut) -> Self {
        let value = match what {
            LeftOut::Headers(n) => Some(n.to_string().into_bytes()),
            LeftOut::Unreadable => None,
        };
        Header::new(LEFT_OUT, value)
    }

    /// What this entry stands for, if it is [`Header::left_out`]'s.
    pub fn as_left_out(&self) -> Option<LeftOut> {
        if self.name != LEFT_OUT || self.raw_name.is_some() {
            return None;
        }
        match &self.value {
            None => Some(LeftOut::Unreadable),
            Some(v) => std::str::from_utf8(v).ok()?.parse().ok().map(LeftOut::Headers),
        }
    }
}

/// Headers of a record that were not copied into memory: a record may carry
/// any number, and a few bytes each on the wire cost far more as [`Header`]s.
/// A record missing some is `bad_header` poison; its header list ends with
/// one entry saying so ([`Header::left_out`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeftOut {
    /// This many headers after the [`MAX_HEADERS`] copied.
    Headers(usize),
    /// None could be read: librdkafka refuses a record of more than 100 000
    /// headers, or a header list it cannot parse.
    Unreadable,
}

/// The headers of a record as a reader of the wire copies them: of its
/// `count` headers, the `i`th given by `nth` (`None`: it cannot be read, and
/// neither can the rest), the first `keep` at most ([`MAX_HEADERS`] when
/// reading records), then, if some were not copied, one [`LeftOut`] entry
/// saying how many. Without the lower `keep` a record of many tiny headers
/// would hold many times its size in memory (the budget tests raise it).
pub fn copy_headers<'w>(
    count: usize,
    keep: usize,
    mut nth: impl FnMut(usize) -> Option<(&'w [u8], Option<&'w [u8]>)>,
) -> Vec<Header> {
    let mut out = Vec::with_capacity(count.min(keep.saturating_add(1)));
    for idx in 0..count.min(keep) {
        let Some((name, value)) = nth(idx) else { break };
        out.push(Header::from_wire(name, value.map(<[u8]>::to_vec)));
    }
    if count > out.len() {
        out.push(Header::left_out(LeftOut::Headers(count - out.len())));
    }
    out
}

/// The name of the [`LeftOut`] entry. No name read off the wire holds a NUL
/// byte (librdkafka hands names over as C strings), so none is taken for it.
const LEFT_OUT: &str = "\0relay:headers-left-out";

/// A Kafka record, independent of the client library, as the consumer hands
/// it to the processor and as a dead letter stores it for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawRecord {
    /// Source topic.
    pub topic: String,
    /// Source partition.
    pub partition: i32,
    /// Offset of this record in its partition.
    pub offset: i64,
    /// Record key, if any.
    pub key: Option<Vec<u8>>,
    /// Record value; `None` for a tombstone.
    pub payload: Option<Vec<u8>>,
    /// Headers in wire order.
    pub headers: Vec<Header>,
}

impl RawRecord {
    /// Bytes it holds in memory, as the consumer's buffer bound counts them:
    /// [`RawRecord::content_size`] plus what each header and the record cost
    /// besides (a header with an empty name and no value is a few bytes on
    /// the wire and still a [`Header`] here).
    pub fn size(&self) -> usize {
        let headers = self.headers.len() * std::mem::size_of::<Header>()
            + self.headers.iter().map(|h| h.raw_name.as_ref().map_or(0, Vec::len)).sum::<usize>();
        std::mem::size_of::<RawRecord>() + self.topic.len() + headers + self.content_size()
    }

    /// Size counted against `max_record_bytes`: key, value, and each
    /// header's name and value.
    pub fn content_size(&self) -> usize {
        let headers: usize = self.headers.iter().map(|h| h.name.len() + h.value.as_ref().map_or(0, Vec::len)).sum();
        self.key.as_ref().map_or(0, Vec::len) + self.payload.as_ref().map_or(0, Vec::len) + headers
    }

    /// The headers left out of it when it was read, if any ([`LeftOut`]).
    pub fn headers_left_out(&self) -> Option<LeftOut> {
        self.headers.iter().find_map(Header::as_left_out)
    }

    /// Its headers as read, without the [`LeftOut`] entry.
    pub fn read_headers(&self) -> impl Iterator<Item = &Header> {
        self.headers.iter().filter(|h| h.as_left_out().is_none())
    }

    /// The last header named `name` (Kafka allows repeats; the last one wins).
    pub fn header(&self, name: &str) -> Option<&Header> {
        self.headers.iter().rev().find(|h| h.name.eq_ignore_ascii_case(name))
    }
}

stored_names! {
    /// Why a record can never be processed as it is. Each class is a
    /// dead-letter `error_class` and a metric label.
    pub enum PoisonClass ("poison class") {
        /// Larger than `consumer.max_record_bytes`.
        Oversized = "oversized",
        /// The value or data is not valid JSON (or not valid UTF-8 where text is needed).
        BadJson = "bad_json",
        /// No usable event id (R3).
        MissingId = "missing_id",
        /// No usable event type.
        MissingType = "missing_type",
        /// Not a CloudEvent on a CloudEvents topic, or an invalid one.
        NotCloudEvent = "not_cloudevent",
        /// A header has no value or is not UTF-8 where text is required.
        BadHeader = "bad_header",
        /// A guard field (version, sequence, …) has the wrong type.
        BadField = "bad_field",
        /// The data does not validate against the route's JSON Schema.
        SchemaInvalid = "schema_invalid",
        /// No route for the event type and the consumer is strict.
        UnknownType = "unknown_type",
        /// A route template could not be rendered from this event.
        TemplateError = "template_error",
        /// The database rejected the event's data (constraint, type), or a
        /// handler rejected it as permanently invalid.
        Rejected = "rejected",
        /// A referenced aggregate never appeared within the retry budget (R19).
        MissingReference = "missing_reference",
        /// A sequence gap never closed within the retry budget (R6).
        SequenceGap = "sequence_gap",
        /// The Kafka client could not read the batch holding it (its bytes do
        /// not decompress): its offsets are parked as one dead letter, without
        /// bytes, and the partition goes on after them.
        Unreadable = "unreadable",
        /// Not poison itself: an earlier record of its key on its partition was
        /// dead-lettered by a route with `on_poison = "hold_key"`, so it waits,
        /// parked behind that one, until it is replayed or skipped.
        Held = "held",
        /// The value is not in its topic's Schema Registry format: a wrong magic
        /// byte, a schema id the registry does not know, or bytes that do not
        /// decode with the registered schema.
        BadEncoding = "bad_encoding",
    }
}

/// A record that must be dead-lettered: the class, a reason a human can act
/// on, and whatever identity could be read before it failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Poison {
    /// Classification.
    pub class: PoisonClass,
    /// Human-readable cause, naming the field or header at fault. Never the payload.
    pub reason: String,
    /// Event id, when it could be read.
    pub event_id: Option<String>,
    /// Event type, when it could be read.
    pub event_type: Option<String>,
}

impl Poison {
    /// A poison with no identity known yet; the reason is cut to
    /// [`MAX_REASON_BYTES`] (it travels to logs, a header and the console).
    pub fn new(class: PoisonClass, reason: impl Into<String>) -> Self {
        let reason = reason.into();
        let reason = match bounded(&reason, MAX_REASON_BYTES) {
            Cow::Borrowed(_) => reason,
            Cow::Owned(cut) => cut,
        };
        Poison { class, reason, event_id: None, event_type: None }
    }

    /// Attach the identity read so far, each cut to [`MAX_KEY_BYTES`]: a
    /// dead letter must be storable even when its id is what was wrong.
    pub fn with_identity(mut self, id: Option<&str>, ty: Option<&str>) -> Self {
        let cut = |v: &str| bounded(v, MAX_KEY_BYTES).into_owned();
        self.event_id = self.event_id.or_else(|| id.map(cut));
        self.event_type = self.event_type.or_else(|| ty.map(cut));
        self
    }
}

impl fmt::Display for Poison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.class, self.reason)
    }
}

impl std::error::Error for Poison {}

/// Where a field of the event comes from, when not from its default
/// CloudEvents attribute or extension.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum FieldSource {
    /// A Kafka header (UTF-8 value).
    Header(String),
    /// A JSON pointer into the event data, e.g. `/order/id`.
    Pointer(String),
    /// A CloudEvents extension attribute.
    Extension(String),
    /// The Kafka record key (UTF-8).
    Key,
    /// A constant, e.g. a fixed event type for a single-type topic.
    Value(String),
}

impl fmt::Display for FieldSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FieldSource::Header(h) => write!(f, "header {h:?}"),
            FieldSource::Pointer(p) => write!(f, "data pointer {p:?}"),
            FieldSource::Extension(e) => write!(f, "extension {e:?}"),
            FieldSource::Key => f.write_str("record key"),
            FieldSource::Value(v) => write!(f, "constant {v:?}"),
        }
    }
}

/// How the records of a topic are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TopicFormat {
    /// CloudEvents 1.0, binary or structured mode (detected per record).
    #[default]
    Cloudevents,
    /// Plain JSON values; id and type come from configured [`FieldSource`]s.
    Json,
    /// Avro in the Confluent Schema Registry wire format (magic byte 0, a
    /// 4-byte schema id, the datum), decoded with the registered schema
    /// before [`decode`] sees it (`relay_registry`). The decoded value is a
    /// binary-mode CloudEvent's data when the record has a `ce_specversion`
    /// header, else the whole event as with [`TopicFormat::Json`].
    Avro,
    /// JSON in the Schema Registry wire format (magic byte 0, a 4-byte
    /// schema id, the JSON text), checked against its registered JSON
    /// Schema before [`decode`] sees it; read as [`TopicFormat::Avro`] then.
    #[serde(rename = "json-schema")]
    JsonSchema,
    /// Protobuf in the Schema Registry wire format (magic byte 0, a 4-byte
    /// schema id, the message indexes, the message), decoded with the
    /// registered `.proto` into the Protobuf JSON mapping; read as
    /// [`TopicFormat::Avro`] then.
    Protobuf,
}

impl TopicFormat {
    /// Whether records of this format are decoded with a schema from the
    /// Schema Registry before [`decode`].
    pub fn uses_registry(self) -> bool {
        matches!(self, TopicFormat::Avro | TopicFormat::JsonSchema | TopicFormat::Protobuf)
    }

    /// As written in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            TopicFormat::Cloudevents => "cloudevents",
            TopicFormat::Json => "json",
            TopicFormat::Avro => "avro",
            TopicFormat::JsonSchema => "json-schema",
            TopicFormat::Protobuf => "protobuf",
        }
    }
}

/// The guard fields of an event and where each may be overridden from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FieldOverrides {
    /// Event id (topic level only: needed before routing).
    pub id: Option<FieldSource>,
    /// Event type (topic level only: needed before routing).
    #[serde(rename = "type")]
    pub event_type: Option<FieldSource>,
    /// Aggregate / entity id. Default: extension `aggregateid`.
    pub aggregate_id: Option<FieldSource>,
    /// Aggregate version for the version guard. Default: extension `aggregateversion`.
    pub aggregate_version: Option<FieldSource>,
    /// Per-aggregate sequence number for the sequence guard. Default: extension `sequence`.
    pub sequence: Option<FieldSource>,
    /// Business idempotency key (R4). Default: extension `idempotencykey`.
    pub idempotency_key: Option<FieldSource>,
    /// Correlation id. Default: extension `correlationid`.
    pub correlation_id: Option<FieldSource>,
    /// Causation id. Default: extension `causationid`.
    pub causation_id: Option<FieldSource>,
    /// W3C trace context. Default: extension `traceparent`.
    pub traceparent: Option<FieldSource>,
}

impl FieldOverrides {
    /// Each field from `self`, else from `fallback`.
    pub fn or(&self, fallback: &FieldOverrides) -> FieldOverrides {
        let pick = |a: &Option<FieldSource>, b: &Option<FieldSource>| a.clone().or_else(|| b.clone());
        FieldOverrides {
            id: pick(&self.id, &fallback.id),
            event_type: pick(&self.event_type, &fallback.event_type),
            aggregate_id: pick(&self.aggregate_id, &fallback.aggregate_id),
            aggregate_version: pick(&self.aggregate_version, &fallback.aggregate_version),
            sequence: pick(&self.sequence, &fallback.sequence),
            idempotency_key: pick(&self.idempotency_key, &fallback.idempotency_key),
            correlation_id: pick(&self.correlation_id, &fallback.correlation_id),
            causation_id: pick(&self.causation_id, &fallback.causation_id),
            traceparent: pick(&self.traceparent, &fallback.traceparent),
        }
    }
}

/// An input event: what routes, guards, templates and handlers see. The
/// one event type from decoding on: [`decode`] fills in what routing needs
/// (id, type, data, …) and leaves the guard fields empty; [`resolve`] reads
/// them once the route, and with it their sources, is known.
#[derive(Debug, Clone, Default, PartialEq)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct InputEvent {
    /// Event id (R3); the inbox key together with the consumer name.
    pub id: String,
    pub event_type: String,
    /// CloudEvents `source`.
    pub source: String,
    /// CloudEvents `subject`.
    pub subject: Option<String>,
    /// CloudEvents `time`.
    pub time: Option<DateTime<Utc>>,
    /// Event data.
    pub data: Value,
    /// Extension attributes, as text.
    pub extensions: BTreeMap<String, String>,
    /// Aggregate id, if the event names one.
    pub aggregate_id: Option<String>,
    /// Aggregate version, for the version guard.
    pub aggregate_version: Option<i64>,
    /// Per-aggregate sequence number, for the sequence guard.
    pub sequence: Option<i64>,
    /// Business idempotency key (R4).
    pub idempotency_key: Option<String>,
    pub correlation_id: Option<String>,
    pub causation_id: Option<String>,
    /// W3C `traceparent`.
    pub traceparent: Option<String>,
}

/// Decode limits and the topic's encoding.
#[derive(Debug, Clone)]
pub struct DecodeOptions<'a> {
    /// Records larger than this are [`PoisonClass::Oversized`].
    pub max_record_bytes: usize,
    /// The topic's format.
    pub format: TopicFormat,
    /// Topic-level field sources (id and type are read from here).
    pub fields: &'a FieldOverrides,
}

/// Decode a record to an [`InputEvent`] with its guard fields still empty
/// (see [`resolve`]), or say exactly why it is poison.
pub fn decode(record: &RawRecord, opts: &DecodeOptions<'_>) -> Result<InputEvent, Poison> {
    let size = record.content_size();
    // A registry format's limit was checked on the record as produced,
    // before its value was decoded to the JSON here.
    if size > opts.max_record_bytes && !opts.format.uses_registry() {
        return Err(Poison::new(
            PoisonClass::Oversized,
            format!("record is {size} bytes, over consumer.max_record_bytes = {}", opts.max_record_bytes),
        ));
    }
    match record.headers_left_out() {
        Some(LeftOut::Headers(n)) => {
            let count = record.headers.len() - 1 + n;
            return Err(Poison::new(
                PoisonClass::BadHeader,
                format!(
                    "record has {count} headers, more than the {MAX_HEADERS} the relay reads \
                     (the first {MAX_HEADERS} are kept)"
                ),
            ));
        }
        Some(LeftOut::Unreadable) => {
            return Err(Poison::new(
                PoisonClass::BadHeader,
                format!(
                    "record's headers could not be read: more than librdkafka reads (100000), or not a \
                     valid header list; the relay reads at most {MAX_HEADERS} headers"
                ),
            ));
        }
        None => {}
    }
    if record.headers.len() > MAX_HEADERS {
        return Err(Poison::new(
            PoisonClass::BadHeader,
            format!("record has {} headers, more than the {MAX_HEADERS} the relay reads", record.headers.len()),
        ));
    }
    if let Some(h) = record.headers.iter().find(|h| h.raw_name.is_some()) {
        return Err(Poison::new(
            PoisonClass::BadHeader,
            format!("a header name is not valid UTF-8 (read as {:?})", bounded(&h.name, 64)),
        ));
    }
    // A registry format's value arrives here decoded to JSON: a CloudEvent's
    // data when its attributes are in headers, else the whole event.
    let cloudevent = match opts.format {
        TopicFormat::Cloudevents => true,
        TopicFormat::Json => false,
        TopicFormat::Avro | TopicFormat::JsonSchema | TopicFormat::Protobuf => {
            record.header("ce_specversion").is_some()
        }
    };
    let mut decoded =
        if cloudevent { decode_cloudevent(record)? } else { decode_plain_json(record, opts.fields, opts.format)? };
    // Topic-level overrides of id and type apply to CloudEvents topics too
    // (a producer that puts the business id in a header, say).
    if cloudevent {
        if let Some(src) = &opts.fields.id {
            decoded.id = required_text(record, &decoded, src, "event id", PoisonClass::MissingId)?;
        }
        if let Some(src) = &opts.fields.event_type {
            decoded.event_type = required_text(record, &decoded, src, "event type", PoisonClass::MissingType)?;
        }
    }
    for (what, value) in [("event id", &decoded.id), ("event type", &decoded.event_type)] {
        check_key(what, value).map_err(|why| {
            Poison::new(PoisonClass::BadField, why).with_identity(Some(&decoded.id), Some(&decoded.event_type))
        })?;
    }
    Ok(decoded)
}

fn required_text(
    record: &RawRecord,
    partial: &InputEvent,
    src: &FieldSource,
    what: &str,
    class: PoisonClass,
) -> Result<String, Poison> {
    match read_source(record, partial, src)? {
        Some(v) if !v.trim().is_empty() => Ok(v),
        Some(_) => Err(Poison::new(class, format!("{what} from {src} is empty"))),
        None => Err(Poison::new(class, format!("{what} is missing: no {src}"))),
    }
}

fn decode_plain_json(record: &RawRecord, fields: &FieldOverrides, format: TopicFormat) -> Result<InputEvent, Poison> {
    let format = format.as_str();
    let data = match &record.payload {
        None => Value::Null,
        Some(bytes) => serde_json::from_slice(bytes)
            .map_err(|e| Poison::new(PoisonClass::BadJson, format!("record value is not valid JSON: {e}")))?,
    };
    let mut partial = InputEvent {
        id: String::new(),
        event_type: String::new(),
        source: record.topic.clone(),
        subject: None,
        time: None,
        data,
        extensions: BTreeMap::new(),
        ..InputEvent::default()
    };
    let id_src = fields.id.as_ref().ok_or_else(|| {
        Poison::new(
            PoisonClass::MissingId,
            format!("topic has format = {format:?}, no ce_specversion header and no fields.id source"),
        )
    })?;
    partial.id = required_text(record, &partial, id_src, "event id", PoisonClass::MissingId)?;
    let ty_src = fields.event_type.as_ref().ok_or_else(|| {
        Poison::new(
            PoisonClass::MissingType,
            format!("topic has format = {format:?}, no ce_specversion header and no fields.type source"),
        )
        .with_identity(Some(&partial.id), None)
    })?;
    partial.event_type = required_text(record, &partial, ty_src, "event type", PoisonClass::MissingType)
        .map_err(|p| p.with_identity(Some(&partial.id), None))?;
    Ok(partial)
}

fn header_text(record: &RawRecord, name: &str) -> Result<Option<String>, Poison> {
    record.header(name).map(value_text).transpose()
}

/// A header's value as text, or why it cannot be read as text.
fn value_text(h: &Header) -> Result<String, Poison> {
    let name = bounded(&h.name, 64);
    match &h.value {
        None => Err(Poison::new(PoisonClass::BadHeader, format!("header {name:?} has no value"))),
        Some(v) => String::from_utf8(v.clone())
            .map_err(|_| Poison::new(PoisonClass::BadHeader, format!("header {name:?} is not valid UTF-8"))),
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Read one field from its source; `Ok(None)` when the source is absent.
fn read_source(record: &RawRecord, event: &InputEvent, src: &FieldSource) -> Result<Option<String>, Poison> {
    match src {
        FieldSource::Header(name) => header_text(record, name),
        FieldSource::Extension(name) => Ok(event.extensions.get(name).cloned()),
        FieldSource::Value(v) => Ok(Some(v.clone())),
        FieldSource::Key => match &record.key {
            None => Ok(None),
            Some(k) => String::from_utf8(k.clone())
                .map(Some)
                .map_err(|_| Poison::new(PoisonClass::BadField, "record key is not valid UTF-8")),
        },
        FieldSource::Pointer(p) => match event.data.pointer(p) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v @ (Value::Number(_) | Value::Bool(_))) => Ok(Some(v.to_string())),
            Some(other) => Err(Poison::new(
                PoisonClass::BadField,
                format!("data pointer {p:?} points at {}, expected a string or number", json_kind(other)),
            )),
        },
    }
}

/// Resolve the guard fields of a decoded event from `fields` (route level
/// already merged over topic level), defaulting to the CloudEvents extensions.
pub fn resolve(record: &RawRecord, decoded: InputEvent, fields: &FieldOverrides) -> Result<InputEvent, Poison> {
    let ident = |p: Poison| p.with_identity(Some(&decoded.id), Some(&decoded.event_type));
    let source = |src: &Option<FieldSource>, default_ext: &str| {
        src.clone().unwrap_or_else(|| FieldSource::Extension(default_ext.to_owned()))
    };
    // An empty or blank value is no value: a producer
    // that always sends the header and leaves it empty when it has no key
    // must not make every such event share one idempotency key or aggregate.
    let text = |src: &Option<FieldSource>, default_ext: &str| -> Result<Option<String>, Poison> {
        let v = read_source(record, &decoded, &source(src, default_ext)).map_err(ident)?;
        Ok(v.filter(|v| !is_blank(v)))
    };
    // An id or key: bounded and free of control characters (limits).
    let key = |src: &Option<FieldSource>, default_ext: &str, what: &str| -> Result<Option<String>, Poison> {
        let v = text(src, default_ext)?;
        if let Some(v) = &v {
            let what = format!("{what} (from {})", source(src, default_ext));
            check_key(&what, v).map_err(|why| ident(Poison::new(PoisonClass::BadField, why)))?;
        }
        Ok(v)
    };
    let int = |src: &Option<FieldSource>, default_ext: &str, what: &str| -> Result<Option<i64>, Poison> {
        match text(src, default_ext)? {
            None => Ok(None),
            // The value is not quoted: it is the event's data (R16), of any size.
            Some(s) => s.trim().parse::<i64>().map(Some).map_err(|_| {
                let from = source(src, default_ext);
                ident(Poison::new(PoisonClass::BadField, format!("{what} from {from} is not an integer")))
            }),
        }
    };
    let aggregate_id = key(&fields.aggregate_id, "aggregateid", "aggregate id")?;
    let aggregate_version = int(&fields.aggregate_version, "aggregateversion", "aggregate version")?;
    let sequence = int(&fields.sequence, "sequence", "sequence")?;
    let idempotency_key = key(&fields.idempotency_key, "idempotencykey", "idempotency key")?;
    let correlation_id = key(&fields.correlation_id, "correlationid", "correlation id")?;
    let causation_id = key(&fields.causation_id, "causationid", "causation id")?;
    // A traceparent that is not W3C's is ignored, as the W3C spec says: it
    // is never forwarded raw to a provider, nor a reason to park a payment.
    let traceparent = text(&fields.traceparent, "traceparent")?.filter(|t| is_traceparent(t));
    Ok(InputEvent {
        aggregate_id,
        aggregate_version,
        sequence,
        idempotency_key,
        correlation_id,
        causation_id,
        traceparent,
        ..decoded
    })
}

/// Whether `t` is a W3C `traceparent`: `vv-<32 hex>-<16 hex>-<2 hex>`,
/// lowercase, neither id all zeros, version `ff` invalid.
fn is_traceparent(t: &str) -> bool {
    let parts: Vec<&str> = t.split('-').collect();
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let zero = |s: &str| s.bytes().all(|b| b == b'0');
    parts.len() >= 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && (parts.len() == 4 || parts[0] != "00")
        && hex(parts[1], 32)
        && !zero(parts[1])
        && hex(parts[2], 16)
        && !zero(parts[2])
        && hex(parts[3], 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record(headers: Vec<Header>, payload: Option<&[u8]>) -> RawRecord {
        RawRecord {
            topic: "orders".into(),
            partition: 0,
            offset: 7,
            key: Some(b"order-1".to_vec()),
            payload: payload.map(<[u8]>::to_vec),
            headers,
        }
    }

    fn opts(fields: &FieldOverrides) -> DecodeOptions<'_> {
        DecodeOptions { max_record_bytes: 1 << 20, format: TopicFormat::Cloudevents, fields }
    }

    fn binary(extra: &[(&str, &str)], data: &[u8]) -> RawRecord {
        let mut headers = vec![
            Header::text("ce_specversion", "1.0"),
            Header::text("ce_id", "evt-1"),
            Header::text("ce_type", "order.placed"),
            Header::text("ce_source", "/shop"),
            Header::text("content-type", "application/json"),
        ];
        headers.extend(extra.iter().map(|(k, v)| Header::text(*k, v)));
        record(headers, Some(data))
    }

    #[test]
    fn binary_mode_reads_attributes_extensions_and_json_data() {
        let rec = binary(
            &[("ce_aggregateid", "order-1"), ("ce_aggregateversion", "3"), ("ce_idempotencykey", "k-1")],
            br#"{"order_id":"order-1","amount":12}"#,
        );
        let none = FieldOverrides::default();
        let decoded = decode(&rec, &opts(&none)).unwrap();
        assert_eq!(decoded.id, "evt-1");
        assert_eq!(decoded.event_type, "order.placed");
        assert_eq!(decoded.source, "/shop");
        assert_eq!(decoded.data, json!({"order_id": "order-1", "amount": 12}));
        let event = resolve(&rec, decoded, &none).unwrap();
        assert_eq!(event.aggregate_id.as_deref(), Some("order-1"));
        assert_eq!(event.aggregate_version, Some(3));
        assert_eq!(event.idempotency_key.as_deref(), Some("k-1"));
        assert_eq!(event.sequence, None);
    }

    #[test]
    fn structured_mode_reads_the_whole_event_from_the_value() {
        let body = json!({
            "specversion": "1.0", "id": "evt-9", "type": "order.placed", "source": "/shop",
            "datacontenttype": "application/json", "correlationid": "corr-1",
            "data": {"order_id": "o-9"}
        });
        let rec = record(
            vec![Header::text("content-type", "application/cloudevents+json; charset=utf-8")],
            Some(body.to_string().as_bytes()),
        );
        let none = FieldOverrides::default();
        let event = resolve(&rec, decode(&rec, &opts(&none)).unwrap(), &none).unwrap();
        assert_eq!(event.id, "evt-9");
        assert_eq!(event.data, json!({"order_id": "o-9"}));
        assert_eq!(event.correlation_id.as_deref(), Some("corr-1"));
    }

    #[test]
    fn a_record_without_an_id_is_poison_and_never_gets_an_invented_one() {
        let mut rec = binary(&[], b"{}");
        rec.headers.retain(|h| h.name != "ce_id");
        let err = decode(&rec, &opts(&FieldOverrides::default())).unwrap_err();
        assert_eq!(err.class, PoisonClass::MissingId);
        assert_eq!(err.event_type.as_deref(), Some("order.placed"));

        let rec = record(
            vec![Header::text("content-type", STRUCTURED_CONTENT_TYPE)],
            Some(br#"{"specversion":"1.0","type":"t","source":"/s"}"#),
        );
        assert_eq!(decode(&rec, &opts(&FieldOverrides::default())).unwrap_err().class, PoisonClass::MissingId);
    }

    // Another CloudEvents version's attributes mean other things: refused, not guessed at.
    #[test]
    fn only_cloudevents_1_0_is_valid_input_in_either_mode() {
        let none = FieldOverrides::default();
        let mut rec = binary(&[], b"{}");
        rec.headers.retain(|h| h.name != "ce_specversion");
        rec.headers.push(Header::text("ce_specversion", "0.3"));
        let err = decode(&rec, &opts(&none)).unwrap_err();
        assert_eq!(err.class, PoisonClass::NotCloudEvent);
        assert!(err.reason.contains("specversion 0.3") && err.reason.contains("1.0 only"), "{}", err.reason);
        assert_eq!(err.event_id.as_deref(), Some("evt-1"));
        for version in ["0.3", "2.0", "1"] {
            let body = json!({"specversion": version, "id": "evt-9", "type": "t", "source": "/s", "data": {}});
            let rec =
                record(vec![Header::text("content-type", STRUCTURED_CONTENT_TYPE)], Some(body.to_string().as_bytes()));
            assert_eq!(decode(&rec, &opts(&none)).unwrap_err().class, PoisonClass::NotCloudEvent, "{version}");
        }
    }

    #[test]
    fn bad_json_data_is_poison_with_the_event_identity() {
        let rec = binary(&[], b"{not json");
        let err = decode(&rec, &opts(&FieldOverrides::default())).unwrap_err();
        assert_eq!(err.class, PoisonClass::BadJson);
        assert_eq!(err.event_id.as_deref(), Some("evt-1"));
    }

    #[test]
    fn a_null_or_non_utf8_header_is_poison_not_a_panic() {
        let mut rec = binary(&[], b"{}");
        rec.headers.push(Header::new("ce_subject", None));
        assert_eq!(decode(&rec, &opts(&FieldOverrides::default())).unwrap_err().class, PoisonClass::BadHeader);
        let mut rec = binary(&[], b"{}");
        rec.headers.push(Header::new("ce_subject", Some(vec![0xff, 0xfe])));
        let err = decode(&rec, &opts(&FieldOverrides::default())).unwrap_err();
        assert_eq!(err.class, PoisonClass::BadHeader);
        assert!(err.reason.contains("ce_subject"), "{err}");
    }

    #[test]
    fn a_plain_json_record_on_a_cloudevents_topic_says_how_to_fix_it() {
        let rec = record(vec![], Some(br#"{"id":"x"}"#));
        let err = decode(&rec, &opts(&FieldOverrides::default())).unwrap_err();
        assert_eq!(err.class, PoisonClass::NotCloudEvent);
        assert!(err.reason.contains("format = \"json\""), "{err}");
    }

    #[test]
    fn oversized_records_are_poison_before_any_parsing() {
        let rec = binary(&[], &vec![b' '; 2048]);
        let fields = FieldOverrides::default();
        let o = DecodeOptions { max_record_bytes: 1024, ..opts(&fields) };
        let err = decode(&rec, &o).unwrap_err();
        assert_eq!(err.class, PoisonClass::Oversized);
        assert!(err.reason.contains("1024"), "{err}");
    }

    #[test]
    fn plain_json_topics_take_id_and_type_from_configured_sources() {
        // A Debezium outbox event router record: id in a header, aggregate in the key.
        let rec = RawRecord {
            headers: vec![Header::text("id", "dbz-1"), Header::text("eventType", "OrderCreated")],
            ..record(vec![], Some(br#"{"order":{"id":"o-1","version":4}}"#))
        };
        let fields = FieldOverrides {
            id: Some(FieldSource::Header("id".into())),
            event_type: Some(FieldSource::Header("eventType".into())),
            aggregate_id: Some(FieldSource::Key),
            aggregate_version: Some(FieldSource::Pointer("/order/version".into())),
            ..FieldOverrides::default()
        };
        let o = DecodeOptions { format: TopicFormat::Json, ..opts(&fields) };
        let event = resolve(&rec, decode(&rec, &o).unwrap(), &fields).unwrap();
        assert_eq!(event.id, "dbz-1");
        assert_eq!(event.event_type, "OrderCreated");
        assert_eq!(event.aggregate_id.as_deref(), Some("order-1"));
        assert_eq!(event.aggregate_version, Some(4));
        assert_eq!(event.source, "orders");
    }

    #[test]
    fn plain_json_without_an_id_source_value_is_missing_id() {
        let rec = record(vec![], Some(br#"{"a":1}"#));
        let fields = FieldOverrides {
            id: Some(FieldSource::Pointer("/id".into())),
            event_type: Some(FieldSource::Value("T".into())),
            ..FieldOverrides::default()
        };
        let o = DecodeOptions { format: TopicFormat::Json, ..opts(&fields) };
        let err = decode(&rec, &o).unwrap_err();
        assert_eq!(err.class, PoisonClass::MissingId);
        assert!(err.reason.contains("/id"), "{err}");
    }

    #[test]
    fn a_non_integer_version_is_a_bad_field_naming_its_source() {
        let rec = binary(&[("ce_aggregateversion", "three")], b"{}");
        let none = FieldOverrides::default();
        let err = resolve(&rec, decode(&rec, &opts(&none)).unwrap(), &none).unwrap_err();
        assert_eq!(err.class, PoisonClass::BadField);
        assert!(err.reason.contains("aggregateversion"), "{err}");
        assert_eq!(err.event_id.as_deref(), Some("evt-1"));
    }

    fn resolved(rec: &RawRecord) -> Result<InputEvent, Poison> {
        let none = FieldOverrides::default();
        resolve(rec, decode(rec, &opts(&none))?, &none)
    }

    // A header name that is not UTF-8.
    #[test]
    fn a_header_name_that_is_not_utf8_is_bad_header_poison() {
        let mut rec = binary(&[], b"{}");
        rec.headers.push(Header::from_wire(b"\xff\xfe", Some(b"v".to_vec())));
        let err = decode(&rec, &opts(&FieldOverrides::default())).unwrap_err();
        assert_eq!(err.class, PoisonClass::BadHeader);
        assert!(err.reason.contains("not valid UTF-8"), "{err}");
        assert_eq!(rec.headers.last().unwrap().name_bytes(), b"\xff\xfe", "the bytes are kept");
    }

    // An id longer than an index entry holds.
    #[test]
    fn an_id_or_key_longer_than_an_index_entry_holds_is_a_bad_field_naming_it() {
        let long = "A1b2".repeat(750);
        let err = decode(&binary(&[("ce_id", &long)], b"{}"), &opts(&FieldOverrides::default())).unwrap_err();
        assert_eq!(err.class, PoisonClass::BadField);
        assert!(err.reason.contains("event id") && err.reason.contains("1024"), "{err}");
        assert!(err.event_id.as_ref().is_some_and(|id| id.len() <= MAX_KEY_BYTES), "the id kept is cut");
        for ext in ["ce_idempotencykey", "ce_aggregateid", "ce_correlationid"] {
            let err = resolved(&binary(&[(ext, &long)], b"{}")).unwrap_err();
            assert_eq!(err.class, PoisonClass::BadField, "{ext}");
            assert!(err.reason.contains(&ext["ce_".len()..]) && !err.reason.contains(&long), "{err}");
        }
    }

    // An empty key is no key, never one shared by every such event.
    #[test]
    fn an_empty_or_blank_idempotency_key_aggregate_or_correlation_id_counts_as_absent() {
        for blank in ["", "   ", "\t"] {
            let rec =
                binary(&[("ce_idempotencykey", blank), ("ce_aggregateid", blank), ("ce_correlationid", blank)], b"{}");
            let e = resolved(&rec).unwrap();
            assert_eq!((e.idempotency_key, e.aggregate_id, e.correlation_id), (None, None, None), "{blank:?}");
        }
        let pointer = FieldOverrides { idempotency_key: Some(FieldSource::Pointer("/k".into())), ..Default::default() };
        let rec = binary(&[], br#"{"k": ""}"#);
        let e = resolve(&rec, decode(&rec, &opts(&pointer)).unwrap(), &pointer).unwrap();
        assert_eq!(e.idempotency_key, None, "an empty pointer value too");
    }

    // Control characters never reach a header.
    #[test]
    fn control_characters_in_ids_are_poison_and_a_malformed_traceparent_is_dropped() {
        let err = decode(&binary(&[("ce_id", "evt-1\r")], b"{}"), &opts(&FieldOverrides::default())).unwrap_err();
        assert_eq!(err.class, PoisonClass::BadField);
        assert!(err.reason.contains("event id") && err.reason.contains("U+000D"), "{err}");
        let err = resolved(&binary(&[("ce_correlationid", "a\r\nX-Evil: 1")], b"{}")).unwrap_err();
        assert!(err.reason.contains("correlation id") && !err.reason.contains("X-Evil"), "{err}");
        for junk in ["junk\u{7f}", "00-abc-def-01", "00-00000000000000000000000000000000-0000000000000001-01"] {
            assert_eq!(resolved(&binary(&[("ce_traceparent", junk)], b"{}")).unwrap().traceparent, None, "{junk}");
        }
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(resolved(&binary(&[("ce_traceparent", good)], b"{}")).unwrap().traceparent.as_deref(), Some(good));
    }

    // Reasons are bounded and quote no value.
    #[test]
    fn a_reason_is_bounded_and_never_quotes_the_value_at_fault() {
        let value = format!("4111-1111-{}", "x".repeat(100_000));
        let err = resolved(&binary(&[("ce_sequence", &value)], b"{}")).unwrap_err();
        assert!(err.reason.len() <= MAX_REASON_BYTES && !err.reason.contains("4111"), "{}", err.reason.len());
        let huge = Poison::new(PoisonClass::Rejected, "r".repeat(1 << 20));
        assert!(huge.reason.len() <= MAX_REASON_BYTES);
    }

    // Decoding was quadratic in the header count.
    #[test]
    fn a_record_with_more_headers_than_the_relay_reads_is_bad_header_and_decoding_stays_linear() {
        let many: Vec<(String, String)> = (0..100_000).map(|i| (format!("ce_x{i}"), String::new())).collect();
        let refs: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let started = std::time::Instant::now();
        let err = decode(&binary(&refs, b"{}"), &opts(&FieldOverrides::default())).unwrap_err();
        assert_eq!(err.class, PoisonClass::BadHeader);
        assert!(err.reason.contains("512"), "{err}");
        // Under the cap, repeated names keep the last value, in one pass.
        let repeated: Vec<(&str, &str)> =
            (0..400).map(|_| ("ce_subject", "s")).chain([("ce_subject", "last")]).collect();
        let e = decode(&binary(&repeated, b"{}"), &opts(&FieldOverrides::default())).unwrap();
        assert_eq!(e.subject.as_deref(), Some("last"));
        assert!(started.elapsed() < std::time::Duration::from_secs(2), "{:?}", started.elapsed());
    }

    #[test]
    fn size_counts_what_a_record_holds_in_memory_for_each_header_and_for_the_record() {
        let many = record((0..1_000).map(|_| Header::new("", None)).collect(), None);
        let least = 1_000 * std::mem::size_of::<Header>() + std::mem::size_of::<RawRecord>();
        assert!(many.size() >= least, "1000 empty headers counted as {} bytes, held in at least {least}", many.size());
        assert_eq!(many.content_size(), "order-1".len(), "max_record_bytes still limits the bytes produced");
    }

    #[test]
    fn a_record_whose_reader_left_headers_out_is_bad_header_naming_how_many_it_had() {
        let none = FieldOverrides::default();
        let mut rec = record(vec![Header::text("content-type", STRUCTURED_CONTENT_TYPE)], Some(b"{}"));
        rec.headers.extend((1..MAX_HEADERS).map(|i| Header::text(format!("h{i}"), "v")));
        rec.headers.push(Header::left_out(LeftOut::Headers(299_488)));
        assert_eq!(rec.headers_left_out(), Some(LeftOut::Headers(299_488)));
        assert_eq!(rec.read_headers().count(), MAX_HEADERS);
        let err = decode(&rec, &opts(&none)).unwrap_err();
        assert_eq!(err.class, PoisonClass::BadHeader);
        assert!(err.reason.contains("record has 300000 headers, more than the 512"), "{err}");
        // Wherever the entry is (a decoded registry value gets its content type again after it).
        rec.headers.rotate_right(1);
        assert_eq!(decode(&rec, &opts(&none)).unwrap_err().class, PoisonClass::BadHeader);
        let unreadable = record(vec![Header::left_out(LeftOut::Unreadable)], Some(b"{}"));
        let err = decode(&unreadable, &opts(&none)).unwrap_err();
        assert_eq!(err.class, PoisonClass::BadHeader);
        assert!(err.reason.contains("headers could not be read"), "{err}");
        // A header of that name with another value is no such entry.
        assert_eq!(Header::new(Header::left_out(LeftOut::Unreadable).name, Some(b"x".to_vec())).as_left_out(), None);
    }

    #[test]
    fn a_registry_value_is_a_cloudevent_s_data_when_its_attributes_are_headers_else_the_whole_event() {
        let fields = FieldOverrides {
            id: Some(FieldSource::Pointer("/event_id".into())),
            event_type: Some(FieldSource::Value("order.placed".into())),
            ..FieldOverrides::default()
        };
        let opts = DecodeOptions { max_record_bytes: 1 << 20, format: TopicFormat::Avro, fields: &fields };
        let value = br#"{"event_id":"e-1","order_id":"o-1"}"#.to_vec();
        let plain = RawRecord {
            topic: "t".into(),
            partition: 0,
            offset: 0,
            key: None,
            payload: Some(value.clone()),
            headers: vec![Header::text("content-type", "application/json")],
        };
        let e = decode(&plain, &opts).unwrap();
        assert_eq!((e.id.as_str(), e.event_type.as_str()), ("e-1", "order.placed"));
        let mut binary = plain.clone();
        binary.headers.clear();
        binary.headers.extend([
            Header::text("ce_specversion", "1.0"),
            Header::text("ce_id", "ce-9"),
            Header::text("ce_type", "order.placed"),
            Header::text("ce_source", "/shop"),
        ]);
        let no_fields = FieldOverrides::default();
        let e = decode(&binary, &DecodeOptions { fields: &no_fields, ..opts.clone() }).unwrap();
        assert_eq!((e.id.as_str(), e.source.as_str()), ("ce-9", "/shop"));
        assert_eq!(e.data["order_id"], "o-1");
        let err = decode(&plain, &DecodeOptions { fields: &no_fields, ..opts }).unwrap_err();
        assert!(err.reason.contains("format = \"avro\", no ce_specversion header and no fields.id"), "{err}");
    }
}
