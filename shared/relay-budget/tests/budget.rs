//! One memory budget for every input relay takes from outside: each
//! decoder, fed hostile and random inputs, holds at most
//! `relay_core::limits::MEMORY_PER_WIRE_BYTE` bytes per byte of the input on
//! the wire plus `MEMORY_PER_INPUT` (a decoder of `relay_budget::OVER_BUDGET`
//! its own factor, until it is brought within the budget).
//!
//! `RELAY_BUDGET_CASES` sets the inputs per target (default 128); run with
//! `--nocapture` to see each target's worst and normal ratios.

use std::cell::RefCell;
use std::collections::BTreeMap;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};
use relay_budget::targets::{self, Registered, Templates, WireRecord};
use relay_budget::{Counting, Measured, peak_during};
use relay_core::RawRecord;
use relay_core::effects::OutboxRecord;
use relay_core::envelope::TopicFormat;
use relay_core::limits::MAX_HEADERS;

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Inputs per target: `RELAY_BUDGET_CASES`, else a number that keeps the
/// whole file to seconds.
fn cases() -> u32 {
    std::env::var("RELAY_BUDGET_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(128)
}

/// `RELAY_BUDGET_SURVEY` set: measure and print, never fail (to see where
/// each target stands).
fn survey() -> bool {
    std::env::var_os("RELAY_BUDGET_SURVEY").is_some()
}

/// What a dead letter stores besides its copy: the row's headers (and the
/// copy's, in the outbox) as `jsonb`.
fn park(record: &RawRecord, copy: &OutboxRecord) {
    let row = relay_store::headers::to_json(&record.headers);
    let outbox = relay_store::headers::to_json(&copy.headers);
    std::hint::black_box((row, outbox));
}

/// The worst ratio seen per target, printed with `--nocapture`.
#[derive(Default)]
struct Seen(RefCell<BTreeMap<&'static str, (f64, String, usize)>>);

impl Seen {
    fn saw(&self, m: &Measured, shape: &str) {
        let mut seen = self.0.borrow_mut();
        let at = seen.entry(m.target).or_default();
        at.2 += 1;
        // Below a few KiB the constant dominates the ratio.
        if m.ratio() > at.0 && m.wire >= 4096 {
            *at = (m.ratio(), format!("{shape}, {} bytes, {}", m.wire, m.outcome), at.2);
        }
    }

    fn print(&self, normal: &[Measured]) {
        for (target, (ratio, shape, n)) in self.0.borrow().iter() {
            let normal: Vec<String> = normal
                .iter()
                .filter(|m| m.target == *target)
                .map(|m| format!("{:.1}x of {} B", m.ratio(), m.wire))
                .collect();
            println!("{target}: {n} inputs, worst {ratio:.1}x ({shape}); normal {}", normal.join(", "));
        }
    }
}

/// Whether `measure` keeps every input within what its target may hold:
/// `fixed` inputs first (the worst shapes known), then random ones from
/// `inputs`. `Err` names the first input past it.
fn holds<T: std::fmt::Debug + Clone>(
    seen: &Seen,
    fixed: Vec<T>,
    inputs: impl Strategy<Value = T>,
    measure: impl Fn(&T) -> (Measured, String),
) -> Result<(), String> {
    every(fixed, inputs, |input| {
        let (m, shape) = measure(input);
        seen.saw(&m, &shape);
        if survey() { Ok(()) } else { m.check(&shape) }
    })
}

/// Whether `verdict` passes `fixed`, then random inputs from `inputs`.
fn every<T: std::fmt::Debug + Clone>(
    fixed: Vec<T>,
    inputs: impl Strategy<Value = T>,
    verdict: impl Fn(&T) -> Result<(), String>,
) -> Result<(), String> {
    for input in &fixed {
        verdict(input)?;
    }
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        // A failing input names its shape and size; shrinking a large one
        // costs more than it tells.
        max_shrink_iters: 16,
        ..Config::default()
    });
    runner.run(&inputs, |input| verdict(&input).map_err(TestCaseError::fail)).map_err(|e| match e {
        TestError::Fail(why, _) => why.message().to_owned(),
        TestError::Abort(why) => format!("aborted: {}", why.message()),
    })
}

/// `result` is the failure of a property run with a fix switched off:
/// `Err` mentioning `says`.
fn caught(result: Result<(), String>, seen: &Seen, what: &str, says: &str) {
    if survey() {
        return seen.print(&[]);
    }
    match result {
        Err(why) => {
            assert!(why.contains(says), "{what}: failed for another reason: {why}");
            println!("{what}: {why}");
        }
        Ok(()) => panic!("{what} went unnoticed"),
    }
}

// ---------------------------------------------------------------- shapes

/// A JSON document of a hostile or random shape.
#[derive(Debug, Clone)]
enum Doc {
    /// An array of `n` copies of a tiny element.
    Repeated { elem: &'static str, n: usize },
    /// An object of `n` distinct short keys, each with a tiny value.
    Keys { n: usize, value: &'static str },
    /// Arrays or objects nested `depth` deep.
    Deep { depth: usize, object: bool },
    /// One string of `len` characters, escaped or not.
    Text { len: usize, escaped: bool },
    /// An array of `n` objects of `fields` fields each.
    Records { n: usize, fields: usize },
    /// An array of `n` objects of one key, nested `depth` deep: the most
    /// serde_json's tree takes per byte (a B-tree node per five bytes).
    Chains { n: usize, depth: usize },
    /// A small random value.
    Any(serde_json::Value),
}

const TINY: &[&str] = &["0", "[]", "{}", "null", "\"\"", "true", "-1e5", "[[]]", "{\"\":0}", "\" \""];

impl Doc {
    fn text(&self) -> String {
        match self {
            Doc::Repeated { elem, n } => format!("[{}]", vec![*elem; *n].join(",")),
            Doc::Keys { n, value } => {
                let entries: Vec<String> = (0..*n).map(|i| format!("\"{i:x}\":{value}")).collect();
                format!("{{{}}}", entries.join(","))
            }
            Doc::Deep { depth, object: false } => format!("{}{}", "[".repeat(*depth), "]".repeat(*depth)),
            Doc::Deep { depth, object: true } => format!("{}0{}", "{\"a\":".repeat(*depth), "}".repeat(*depth)),
            Doc::Text { len, escaped: false } => format!("\"{}\"", "x".repeat(*len)),
            Doc::Text { len, escaped: true } => format!("\"{}\"", "\\u00e9".repeat(*len)),
            Doc::Records { n, fields } => {
                let one: Vec<String> = (0..*fields).map(|f| format!("\"field_{f}\":\"\"")).collect();
                format!("[{}]", vec![format!("{{{}}}", one.join(",")); *n].join(","))
            }
            Doc::Chains { n, depth } => {
                let one = format!("{}0{}", "{\"\":".repeat(*depth), "}".repeat(*depth));
                format!("[{}]", vec![one; *n].join(","))
            }
            Doc::Any(v) => v.to_string(),
        }
    }

    fn shape(&self) -> String {
        match self {
            Doc::Repeated { elem, n } => format!("an array of {n} × {elem}"),
            Doc::Keys { n, value } => format!("an object of {n} short keys of {value}"),
            Doc::Deep { depth, object } => {
                format!("{} nested {depth} deep", if *object { "objects" } else { "arrays" })
            }
            Doc::Text { len, escaped } => {
                format!("a string of {len} {}", if *escaped { "escapes" } else { "characters" })
            }
            Doc::Records { n, fields } => format!("an array of {n} objects of {fields} empty fields"),
            Doc::Chains { n, depth } => format!("an array of {n} one-key objects nested {depth} deep"),
            Doc::Any(_) => "a random value".to_owned(),
        }
    }
}

/// Most items of a generated collection: large enough that the per-byte
/// cost shows over the constant, small enough for seconds in all.
const ITEMS: usize = 20_000;

fn items() -> impl Strategy<Value = usize> {
    prop_oneof![1 => 0..64usize, 3 => 64..ITEMS]
}

fn any_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        "[a-z\\\\\"\u{0}-\u{7f}\u{e9}]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(6, 256, 12, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..12).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{0,6}", inner, 0..12)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn doc() -> impl Strategy<Value = Doc> {
    prop_oneof![
        3 => (prop::sample::select(TINY), items()).prop_map(|(elem, n)| Doc::Repeated { elem, n }),
        2 => (items(), prop::sample::select(&["0", "null", "\"\"", "[]"][..])).prop_map(|(n, value)| Doc::Keys { n, value }),
        1 => (0..200usize, any::<bool>()).prop_map(|(depth, object)| Doc::Deep { depth, object }),
        1 => (0..200_000usize, any::<bool>()).prop_map(|(len, escaped)| Doc::Text { len, escaped }),
        2 => (items(), 1..12usize).prop_map(|(n, fields)| Doc::Records { n: n / fields, fields }),
        2 => (items(), 1..120usize).prop_map(|(n, depth)| Doc::Chains { n: n / depth, depth }),
        2 => any_value().prop_map(Doc::Any),
    ]
}

// ------------------------------------------------------------ envelope

/// How a record carries its event.
#[derive(Debug, Clone, Copy)]
enum Mode {
    /// CloudEvents binary mode: attributes in `ce_*` headers.
    Binary,
    /// CloudEvents structured mode: the whole event as JSON in the value.
    Structured,
    /// A plain JSON topic.
    Plain,
    /// A registry format's value, already decoded to JSON, with or without
    /// CloudEvents headers.
    Decoded { cloudevent: bool },
}

/// What a record carries beside its event in headers.
#[derive(Debug, Clone)]
enum Extra {
    None,
    /// `n` headers of names of at most one byte, null or empty values.
    Tiny {
        n: usize,
        named: bool,
        null: bool,
    },
    /// `n` extension attributes of `len`-byte values.
    Long {
        n: usize,
        len: usize,
    },
    /// A header name that is not UTF-8.
    NotUtf8,
}

#[derive(Debug, Clone)]
struct RecordInput {
    mode: Mode,
    extra: Extra,
    key: Option<Vec<u8>>,
    doc: Doc,
}

impl RecordInput {
    fn shape(&self) -> String {
        let extra = match &self.extra {
            Extra::None => String::new(),
            Extra::Tiny { n, .. } => format!(" and {n} tiny headers"),
            Extra::Long { n, len } => format!(" and {n} headers of {len} bytes"),
            Extra::NotUtf8 => " and a header name that is not UTF-8".to_owned(),
        };
        format!("{:?} record of {}{extra}", self.mode, self.doc.shape())
    }

    fn format(&self) -> TopicFormat {
        match self.mode {
            Mode::Binary | Mode::Structured => TopicFormat::Cloudevents,
            Mode::Plain => TopicFormat::Json,
            Mode::Decoded { .. } => TopicFormat::Avro,
        }
    }

    fn wire(&self) -> WireRecord {
        let text = |name: &str, value: &str| (name.as_bytes().to_vec(), Some(value.as_bytes().to_vec()));
        let ce = || {
            vec![
                text("ce_specversion", "1.0"),
                text("ce_id", "e-1"),
                text("ce_type", "order.placed"),
                text("ce_source", "/shop"),
                text("content-type", "application/json"),
            ]
        };
        let doc = self.doc.text();
        let (mut headers, value) = match self.mode {
            Mode::Binary | Mode::Decoded { cloudevent: true } => (ce(), doc),
            Mode::Structured => (
                vec![text("content-type", "application/cloudevents+json")],
                format!(r#"{{"specversion":"1.0","id":"e-1","type":"order.placed","source":"/shop","data":{doc}}}"#),
            ),
            Mode::Plain | Mode::Decoded { cloudevent: false } => (vec![text("seq", "3")], doc),
        };
        match &self.extra {
            Extra::None => {}
            Extra::Tiny { n, named, null } => headers.extend((0..*n).map(|i| {
                let name = if *named { vec![b'a' + (i % 26) as u8] } else { Vec::new() };
                (name, if *null { None } else { Some(Vec::new()) })
            })),
            Extra::Long { n, len } => headers.extend((0..*n).map(|i| text(&format!("ce_ext{i}"), &"v".repeat(*len)))),
            Extra::NotUtf8 => headers.push((vec![0xff, 0xfe], Some(b"x".to_vec()))),
        }
        WireRecord { key: self.key.clone(), value: Some(value.into_bytes()), headers }
    }

    fn measure(&self, target: &'static str, keep_headers: usize) -> (Measured, String) {
        (targets::envelope(target, &self.wire(), self.format(), keep_headers, &park), self.shape())
    }
}

fn mode() -> impl Strategy<Value = Mode> {
    prop_oneof![
        Just(Mode::Binary),
        Just(Mode::Structured),
        Just(Mode::Plain),
        any::<bool>().prop_map(|cloudevent| Mode::Decoded { cloudevent }),
    ]
}

fn key() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop::option::of(prop::collection::vec(any::<u8>(), 0..64))
}

/// Records of hostile headers (librdkafka reads at most 100 000) and a
/// value of little or no JSON.
fn headers_input() -> impl Strategy<Value = RecordInput> {
    let extra = prop_oneof![
        4 => (0..100_000usize, any::<bool>(), any::<bool>()).prop_map(|(n, named, null)| Extra::Tiny { n, named, null }),
        2 => (0..600usize, 0..2_000usize).prop_map(|(n, len)| Extra::Long { n, len }),
        1 => Just(Extra::NotUtf8),
        1 => Just(Extra::None),
    ];
    let value = prop_oneof![
        any_value().prop_map(Doc::Any),
        (0..100_000usize, any::<bool>()).prop_map(|(len, escaped)| Doc::Text { len, escaped }),
    ];
    (mode(), extra, key(), value).prop_map(|(mode, extra, key, doc)| RecordInput { mode, extra, key, doc })
}

/// Records of hostile values with ordinary headers.
fn value_input() -> impl Strategy<Value = RecordInput> {
    (mode(), key(), doc()).prop_map(|(mode, key, doc)| RecordInput { mode, extra: Extra::None, key, doc })
}

/// The worst headers known: the most tiny ones librdkafka reads, of each
/// kind.
fn worst_headers() -> Vec<RecordInput> {
    [(false, true), (true, true), (true, false)]
        .map(|(named, null)| RecordInput {
            mode: Mode::Binary,
            extra: Extra::Tiny { n: 100_000, named, null },
            key: None,
            doc: normal_doc(),
        })
        .into()
}

/// Every record of hostile headers, read keeping at most `keep_headers`
/// of them, stays within the budget.
fn headers_keep_the_budget(keep_headers: usize, seen: &Seen) -> Result<(), String> {
    holds(seen, worst_headers(), headers_input(), |input| input.measure(targets::HEADERS, keep_headers))
}

#[test]
fn a_record_of_any_headers_is_read_and_decoded_within_the_budget() {
    let seen = Seen::default();
    headers_keep_the_budget(MAX_HEADERS, &seen).unwrap_or_else(|why| panic!("{why}"));
    let normal = RecordInput { mode: Mode::Binary, extra: Extra::None, key: Some(b"o-1".to_vec()), doc: normal_doc() };
    seen.print(&[normal.measure(targets::HEADERS, MAX_HEADERS).0]);
}

#[test]
fn the_budget_catches_a_reader_that_copies_every_header() {
    let seen = Seen::default();
    caught(headers_keep_the_budget(usize::MAX, &seen), &seen, "a reader copying every header", "tiny headers");
}

#[test]
fn every_record_s_value_decodes_within_what_the_envelope_may_hold() {
    let seen = Seen::default();
    let worst = [Mode::Binary, Mode::Structured, Mode::Plain]
        .into_iter()
        .flat_map(|mode| {
            [Doc::Chains { n: 200, depth: 100 }, Doc::Chains { n: 20_000, depth: 1 }].map(|doc| RecordInput {
                mode,
                extra: Extra::None,
                key: None,
                doc,
            })
        })
        .collect();
    holds(&seen, worst, value_input(), |input| input.measure(targets::ENVELOPE, MAX_HEADERS))
        .unwrap_or_else(|why| panic!("{why}"));
    let normal: Vec<Measured> = [Mode::Binary, Mode::Structured, Mode::Plain]
        .into_iter()
        .map(|mode| {
            let input = RecordInput { mode, extra: Extra::None, key: Some(b"o-1".to_vec()), doc: normal_doc() };
            input.measure(targets::ENVELOPE, MAX_HEADERS).0
        })
        .collect();
    seen.print(&normal);
}

/// The consumer bounds what it buffers by `size` ([`RawRecord::size`]),
/// which must count what a record holds, whatever its headers.
fn size_counts_what_a_record_holds(size: fn(&RawRecord) -> usize) -> Result<(), String> {
    every(worst_headers(), headers_input(), |input| {
        let wire = input.wire();
        let (record, held) = peak_during(|| wire.read("orders", MAX_HEADERS));
        let counted = size(&record);
        if held <= counted {
            return Ok(());
        }
        Err(format!("{} holds {held} bytes once read and is counted as {counted}", input.shape()))
    })
}

#[test]
fn the_consumer_s_buffer_bound_counts_what_each_record_holds() {
    size_counts_what_a_record_holds(RawRecord::size).unwrap_or_else(|why| panic!("{why}"));
}

#[test]
fn the_budget_catches_a_buffer_bound_that_counts_only_bytes_produced() {
    let result = size_counts_what_a_record_holds(RawRecord::content_size);
    caught(result, &Seen::default(), "a buffer bound counting only the bytes produced", "tiny headers");
}

fn normal_doc() -> Doc {
    Doc::Any(serde_json::json!({
        "order_id": "o-1042", "amount": 1250, "currency": "EUR",
        "customer": {"id": "c-9", "email": "ada@example.com", "name": "Ada Lovelace"},
        "lines": (0..20).map(|i| serde_json::json!({"sku": format!("SKU-{i:04}"), "qty": i % 3 + 1, "price_minor": 500 + i, "name": "A thing someone ordered"})).collect::<Vec<_>>(),
        "placed_at": "2026-12-06T10:00:00Z"
    }))
}

// ------------------------------------------------------------ registry

/// Bytes of `n` as a zig-zag varint (Avro's lengths and counts).
fn zigzag(n: i64, out: &mut Vec<u8>) {
    varint(((n << 1) ^ (n >> 63)) as u64, out);
}

/// Bytes of `n` as a base-128 varint (Protobuf's tags and lengths).
fn varint(mut n: u64, out: &mut Vec<u8>) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// A value for a schema of [`targets::SCHEMAS`].
#[derive(Debug, Clone)]
enum Value {
    /// Avro `array<long>`: `n` zeros in one block.
    AvroLongs(usize),
    /// Avro array of records of eight optional fields, all null.
    AvroNullRecords(usize),
    /// Avro array of an enum with a long symbol, `n` times that symbol.
    AvroSymbols(usize),
    /// Avro `map<string>` of `n` distinct keys and empty values.
    AvroMap(usize),
    /// Avro `array<array<boolean>>`: `n` empty arrays.
    AvroEmptyArrays(usize),
    /// Avro order of `n` lines and a note of `note` bytes.
    AvroOrder { lines: usize, note: usize },
    /// Protobuf order of `n` empty lines (every default written out) and a
    /// note of `note` bytes.
    ProtoLines { n: usize, note: usize },
    /// Protobuf packed `repeated int32` of `n` zeros.
    ProtoPacked(usize),
    /// Protobuf `n` empty messages of a repeated field.
    ProtoEmpties(usize),
    /// Protobuf map of `n` entries with keys of one byte.
    ProtoMap(usize),
    /// Protobuf messages nested `depth` deep.
    ProtoDeep(usize),
    /// JSON Schema of anything, a document of that shape.
    Json(Doc),
    /// Bytes as they come, for schema `id`.
    Raw { id: u32, bytes: Vec<u8> },
}

impl Value {
    fn format(&self) -> TopicFormat {
        match self.id() {
            1..=10 => TopicFormat::Avro,
            11..=20 => TopicFormat::Protobuf,
            _ => TopicFormat::JsonSchema,
        }
    }

    fn id(&self) -> u32 {
        match self {
            Value::AvroLongs(_) => 1,
            Value::AvroNullRecords(_) => 2,
            Value::AvroSymbols(_) => 3,
            Value::AvroMap(_) => 4,
            Value::AvroEmptyArrays(_) => 5,
            Value::AvroOrder { .. } => 6,
            Value::ProtoLines { .. } => 11,
            Value::ProtoPacked(_) | Value::ProtoEmpties(_) | Value::ProtoMap(_) => 12,
            Value::ProtoDeep(_) => 13,
            Value::Json(_) => 21,
            Value::Raw { id, .. } => *id,
        }
    }

    fn body(&self) -> Vec<u8> {
        let mut b = Vec::new();
        let block = |n: usize, item: &[u8], b: &mut Vec<u8>| {
            if n > 0 {
                zigzag(n as i64, b);
                for _ in 0..n {
                    b.extend(item);
                }
            }
            b.push(0);
        };
        match self {
            Value::AvroLongs(n) => block(*n, &[0], &mut b),
            Value::AvroNullRecords(n) => block(*n, &[0; 8], &mut b),
            Value::AvroSymbols(n) => block(*n, &[0], &mut b),
            Value::AvroEmptyArrays(n) => block(*n, &[0], &mut b),
            Value::AvroMap(n) => {
                if *n > 0 {
                    zigzag(*n as i64, &mut b);
                    for i in 0..*n {
                        let key = format!("{i:x}");
                        zigzag(key.len() as i64, &mut b);
                        b.extend(key.as_bytes());
                        b.push(0);
                    }
                }
                b.push(0);
            }
            Value::AvroOrder { lines, note } => {
                for text in ["o-1", &"n".repeat(*note)] {
                    zigzag(text.len() as i64, &mut b);
                    b.extend(text.as_bytes());
                }
                b.push(0); // no tags
                block(*lines, &[2, b'A', 4], &mut b);
            }
            Value::ProtoLines { n, note } => {
                b.extend([0, 0x0a, 3, b'o', b'-', b'1']);
                for _ in 0..*n {
                    b.extend([0x12, 0]);
                }
                b.push(0x1a);
                varint(*note as u64, &mut b);
                b.extend(std::iter::repeat_n(b'n', *note));
            }
            Value::ProtoPacked(n) => {
                b.extend([0, 0x0a]);
                varint(*n as u64, &mut b);
                b.extend(std::iter::repeat_n(0, *n));
            }
            Value::ProtoEmpties(n) => {
                b.push(0);
                for _ in 0..*n {
                    b.extend([0x12, 0]);
                }
            }
            Value::ProtoMap(n) => {
                b.push(0);
                for i in 0..*n {
                    b.extend([0x1a, 3, 0x0a, 1, (i % 256) as u8]);
                }
            }
            Value::ProtoDeep(depth) => {
                // Each level is a `children` field around the level below.
                let mut inner: Vec<u8> = Vec::new();
                for _ in 0..*depth {
                    let mut outer = vec![0x0a];
                    varint(inner.len() as u64, &mut outer);
                    outer.extend(&inner);
                    inner = outer;
                }
                b.push(0);
                b.extend(inner);
            }
            Value::Json(doc) => b.extend(doc.text().into_bytes()),
            Value::Raw { bytes, .. } => b.extend(bytes),
        }
        b
    }

    fn shape(&self) -> String {
        match self {
            Value::Json(doc) => format!("a JSON Schema value of {}", doc.shape()),
            Value::Raw { id, bytes } => format!("{} random bytes for schema {id}", bytes.len()),
            other => format!("{other:?}"),
        }
    }
}

fn registry_value() -> impl Strategy<Value = Value> {
    // Random Avro bytes: see `avro_values_claiming_items_they_do_not_hold_stay_within_the_budget`.
    let ids: Vec<u32> = targets::SCHEMAS.iter().map(|(id, ..)| *id).filter(|id| *id > 10).collect();
    prop_oneof![
        items().prop_map(Value::AvroLongs),
        items().prop_map(|n| Value::AvroNullRecords(n / 8)),
        items().prop_map(Value::AvroSymbols),
        items().prop_map(|n| Value::AvroMap(n / 4)),
        items().prop_map(Value::AvroEmptyArrays),
        (items(), 0..100_000usize).prop_map(|(lines, note)| Value::AvroOrder { lines: lines / 3, note }),
        (items(), 0..200_000usize).prop_map(|(n, note)| Value::ProtoLines { n, note }),
        items().prop_map(Value::ProtoPacked),
        items().prop_map(Value::ProtoEmpties),
        items().prop_map(|n| Value::ProtoMap(n / 4)),
        (0..300usize).prop_map(Value::ProtoDeep),
        doc().prop_map(Value::Json),
        (prop::sample::select(ids), prop::collection::vec(any::<u8>(), 0..2_000))
            .prop_map(|(id, bytes)| Value::Raw { id, bytes }),
    ]
}

/// The worst values known: a few bytes each claiming an item that costs
/// many (a default-filled line, an enum's symbol, eight field names).
fn worst_values() -> Vec<Value> {
    vec![
        Value::ProtoLines { n: 20_000, note: 0 },
        Value::ProtoPacked(20_000),
        Value::AvroSymbols(20_000),
        Value::AvroNullRecords(2_500),
        Value::Json(Doc::Chains { n: 200, depth: 100 }),
    ]
}

/// Every value decoded by `targets` stays within what its format may hold.
fn registry_values_keep_the_budget(targets: &Registered, seen: &Seen) -> Result<(), String> {
    holds(seen, worst_values(), registry_value(), |value| {
        (targets.measure(value.format(), value.id(), &value.body(), &park), value.shape())
    })
}

#[test]
fn every_registry_value_decodes_within_what_its_format_may_hold() {
    let targets = Registered::new(Registered::client());
    let seen = Seen::default();
    registry_values_keep_the_budget(&targets, &seen).unwrap_or_else(|why| panic!("{why}"));
    let line = |b: &mut Vec<u8>, i: u8| {
        // sku "SKU-i", name, quantity 2, unit_minor 500, currency "EUR".
        let mut l = vec![0x0a, 5, b'S', b'K', b'U', b'-', b'0' + i % 10, 0x12, 11];
        l.extend(b"A thing one");
        l.extend([0x18, 2, 0x20, 0xf4, 0x03, 0x2a, 3]);
        l.extend(b"EUR");
        b.push(0x12);
        varint(l.len() as u64, b);
        b.extend(l);
    };
    let normal = [
        Value::AvroOrder { lines: 20, note: 40 },
        Value::Raw {
            id: 11,
            bytes: {
                let mut b = vec![0, 0x0a, 6];
                b.extend(b"o-1042");
                (0..20).for_each(|i| line(&mut b, i));
                b
            },
        },
        Value::Json(normal_doc()),
    ]
    .map(|v| targets.measure(v.format(), v.id(), &v.body(), &park));
    seen.print(&normal);
}

#[test]
fn the_budget_catches_registry_values_decoded_without_a_bound() {
    let targets = Registered::new(Registered::client().unbounded());
    let seen = Seen::default();
    let result = registry_values_keep_the_budget(&targets, &seen);
    caught(result, &seen, "registry values decoded without a bound", "ProtoLines");
}

/// Avro values that claim more items than they hold: a block's count is
/// taken on trust (apache-avro reserves room for up to 64 MiB of items
/// before reading one), and a union read at the end of the value is null,
/// so items whose fields are all optional cost nothing on the wire.
fn claiming_values() -> Vec<Value> {
    [(1, 1_000_000), (2, 100_000), (5, 1_000_000)]
        .map(|(id, count)| {
            let mut bytes = Vec::new();
            zigzag(count, &mut bytes);
            Value::Raw { id, bytes }
        })
        .into()
}

use relay_budget::AVRO_RESERVATION;

#[test]
fn avro_values_claiming_items_they_do_not_hold_are_refused_within_the_reservation_cap() {
    let targets = Registered::new(Registered::client());
    for value in claiming_values() {
        let m = targets.measure(value.format(), value.id(), &value.body(), &park);
        assert!(m.outcome != "ok", "{} decoded: {m:?}", value.shape());
        assert!(m.peak <= AVRO_RESERVATION + relay_budget::allowed(m.target, m.wire), "{}: {m:?}", value.shape());
    }
    let random = (prop::sample::select(vec![1u32, 2, 3, 4, 5, 6]), prop::collection::vec(any::<u8>(), 0..2_000))
        .prop_map(|(id, bytes)| Value::Raw { id, bytes });
    let mut runner = TestRunner::new(Config { cases: 256, failure_persistence: None, ..Config::default() });
    runner
        .run(&random, |value| {
            let m = targets.measure(value.format(), value.id(), &value.body(), &park);
            let most = AVRO_RESERVATION + relay_budget::allowed(m.target, m.wire);
            if m.peak > most {
                return Err(TestCaseError::fail(format!("{}: {m:?} over {most}", value.shape())));
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
}

// ----------------------------------------------------------- templates

#[test]
fn every_event_s_templates_render_within_what_templates_may_hold() {
    let templates = Templates::default();
    let seen = Seen::default();
    let data = |items: &Doc| format!(r#"{{"order_id":"o-1","amount":1250,"items":{}}}"#, items.text());
    let inputs = (doc(), any::<bool>()).prop_map(|(items, with_fields)| (items, with_fields));
    let worst = vec![(Doc::Chains { n: 200, depth: 100 }, true), (Doc::Chains { n: 20_000, depth: 1 }, true)];
    holds(&seen, worst, inputs, |(items, with_fields)| {
        let text = if *with_fields { data(items) } else { items.text() };
        (templates.measure(text.as_bytes(), &park), format!("data whose items are {}", items.shape()))
    })
    .unwrap_or_else(|why| panic!("{why}"));
    let normal = templates.measure(normal_doc().text().as_bytes(), &park);
    seen.print(&[normal]);
}

// --------------------------------------------------------------- jsonb

/// An outcome emitting one event of `data`, as an intent stores it.
fn emit(data: &str) -> String {
    format!(
        r#"{{"emit":[{{"action":"captured","event_type":"payment.captured","topic":"payments","key":null,"subject":null,"data":{data},"ordered":false}}],"saga":[]}}"#
    )
}

#[test]
fn every_intent_read_back_stays_within_the_budget() {
    let seen = Seen::default();
    let stored = |d: &Doc, how: usize| {
        match how {
        0 => d.text(),
        1 => emit(&d.text()),
        _ => emit("null").replacen(
            r#","saga":[]"#,
            &format!(
                r#","deferred":[{{"at":"/emit/0/data","template":"t","kind":"text","json":true,"source":"{{{{ response.status }}}}","context":{}}}]"#,
                d.text()
            ),
            1,
        ),
    }
    };
    let worst = vec![(Doc::Chains { n: 200, depth: 100 }, 1), (Doc::Chains { n: 200, depth: 100 }, 2)];
    holds(&seen, worst, (doc(), 0..3usize), |(d, how)| {
        let shape =
            format!("{} as {}", d.shape(), ["a value", "an event's data", "a deferred template's context"][*how]);
        (targets::jsonb(stored(d, *how).as_bytes()), shape)
    })
    .unwrap_or_else(|why| panic!("{why}"));
    seen.print(&[targets::jsonb(emit(&normal_doc().text()).as_bytes())]);
}
