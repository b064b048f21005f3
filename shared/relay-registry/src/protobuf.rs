//! Protobuf messages to JSON and back, with the registered `.proto` file.
//!
//! Descriptors come from `protox` (a `.proto` compiler in Rust: no `protoc`
//! on the machine) and messages are read and written by `prost-reflect`,
//! whose JSON is the standard Protobuf JSON mapping, with two choices made
//! for routes: fields under their `.proto` names (`order_id`, not
//! `orderId`), and 64-bit integers as JSON numbers, as Avro longs are.
//!
//! In the wire format a Protobuf value starts with its message indexes: the
//! path from the file's top-level messages to the one written, as a
//! zig-zag varint count and that many zig-zag varints; `[0]`, the first
//! message, is the single byte `0`.

use std::collections::HashMap;

use base64::Engine as _;
use prost::Message as _;
use prost_reflect::{
    DeserializeOptions, DynamicMessage, FileDescriptor, MessageDescriptor, ReflectMessage as _, SerializeOptions,
};
use serde_json::Value;

use crate::Undecoded;

/// The name the schema's own file is compiled under when the registry gives
/// `.proto` text (a descriptor carries its own name).
const MAIN_FILE: &str = "registered.proto";

/// Nesting of messages a value's indexes may name; a file deeper than this
/// is not written by hand.
const MAX_INDEXES: usize = 64;

/// Most `google.protobuf.Any` values a value may hold one inside another.
/// Its JSON form unpacks each Any, and prost-reflect's serializer recurses
/// once per level with no bound but the thread's stack (each unpacking
/// decodes afresh, so prost's own nesting limit starts again at every
/// level): a chain of Anys of about 26 bytes a level would overflow it, an
/// abort no batch can park.
const MAX_ANY_DEPTH: usize = 8;

/// The full name of the type whose values carry another message.
const ANY: &str = "google.protobuf.Any";

/// Refuse a value holding Anys nested deeper than [`MAX_ANY_DEPTH`], by
/// unpacking them as the serializer will, one level at a time on a stack of
/// its own (no recursion): at most that many times the value's bytes.
fn check_any_depth(msg: &DynamicMessage) -> Result<(), String> {
    use prost_reflect::Value as V;
    let mut stack: Vec<(DynamicMessage, usize)> = vec![(msg.clone(), 0)];
    while let Some((m, depth)) = stack.pop() {
        if m.descriptor().full_name() == ANY {
            if depth == MAX_ANY_DEPTH {
                return Err(format!("holds {ANY} values nested more than {MAX_ANY_DEPTH} deep"));
            }
            let url = m.get_field_by_name("type_url");
            let value = m.get_field_by_name("value");
            let (Some(V::String(url)), Some(V::Bytes(value))) = (url.as_deref(), value.as_deref()) else { continue };
            // A type the schema does not know fails the serializer, saying so.
            let Some(desc) =
                url.rsplit_once('/').and_then(|(_, name)| m.descriptor().parent_pool().get_message_by_name(name))
            else {
                continue;
            };
            let inner =
                DynamicMessage::decode(desc, value.as_ref()).map_err(|e| format!("an {ANY} does not decode: {e}"))?;
            stack.push((inner, depth + 1));
            continue;
        }
        for (_, value) in m.fields() {
            let items: Box<dyn Iterator<Item = &V>> = match value {
                V::List(items) => Box::new(items.iter()),
                V::Map(entries) => Box::new(entries.values()),
                other => Box::new(std::iter::once(other)),
            };
            for item in items {
                if let V::Message(inner) = item {
                    stack.push((inner.clone(), depth));
                }
            }
        }
    }
    Ok(())
}

/// A registered schema: its file, with what it imports.
pub(crate) struct Schema {
    file: FileDescriptor,
}

impl Schema {
    /// `text` as the registry gives it (`.proto` text, or a base64
    /// `FileDescriptorProto` where the producer's serializer registered
    /// one), with the files it imports by name.
    pub(crate) fn parse(text: &str, imports: &HashMap<String, String>) -> Result<Schema, String> {
        let main = file(MAIN_FILE, text, false)?;
        let name = main.name().to_owned();
        let mut files: HashMap<String, protox::file::File> = HashMap::new();
        for (n, t) in imports {
            files.insert(n.clone(), file(n, t, true)?);
        }
        files.insert(name.clone(), main);
        let mut chain = protox::file::ChainFileResolver::new();
        chain.add(Files(files));
        chain.add(protox::file::GoogleFileResolver::new());
        let mut compiler = protox::Compiler::with_file_resolver(chain);
        compiler.open_file(&name).map_err(|e| flat(&e))?;
        let pool = compiler.descriptor_pool();
        let file = pool.get_file_by_name(&name).ok_or_else(|| format!("{name} did not compile to a file"))?;
        if file.messages().len() == 0 {
            return Err("the file declares no message".into());
        }
        Ok(Schema { file })
    }

    /// The value of a record (its message indexes, then the message) as
    /// JSON text of at most `limit` bytes.
    pub(crate) fn decode(&self, body: &[u8], limit: usize) -> Result<Vec<u8>, Undecoded> {
        let (indexes, rest) = indexes(body)?;
        let desc = self.message(&indexes)?;
        let msg = DynamicMessage::decode(desc.clone(), rest)
            .map_err(|e| format!("does not decode as {}: {e}", desc.full_name()))?;
        check_any_depth(&msg).map_err(|why| format!("{} {why}", desc.full_name()))?;
        let opts = SerializeOptions::new()
            .stringify_64_bit_integers(false)
            .use_proto_field_name(true)
            .skip_default_fields(false);
        // Written out as it is serialized: every default of each item of a
        // repeated field makes a few bytes of the record many of JSON.
        crate::json_text(limit, |out| msg.serialize_with_options(out, &opts)).map_err(|e| match e {
            Undecoded::Invalid(why) => Undecoded::Invalid(format!("{} has no JSON form: {why}", desc.full_name())),
            too_large => too_large,
        })
    }

    /// [`Schema::decode`] within the bound of its size, read back as a value.
    #[cfg(test)]
    fn decode_value(&self, body: &[u8]) -> Result<Value, String> {
        let text = self.decode(body, crate::max_json_bytes(body.len())).map_err(|e| e.to_string())?;
        Ok(serde_json::from_slice(&text).expect("decoded to JSON"))
    }

    /// The message at `indexes` (top-level, then nested).
    fn message(&self, indexes: &[usize]) -> Result<MessageDescriptor, String> {
        let no =
            |at: &[usize]| format!("the value's message indexes {indexes:?} name no message of the schema (at {at:?})");
        let (first, nested) = indexes.split_first().ok_or_else(|| no(&[]))?;
        let mut m = self.file.messages().nth(*first).ok_or_else(|| no(&indexes[..1]))?;
        for (depth, i) in nested.iter().enumerate() {
            let child = m.child_messages().nth(*i);
            m = child.ok_or_else(|| no(&indexes[..depth + 2]))?;
        }
        Ok(m)
    }

    /// The first message of the file: the one emits write by default.
    pub(crate) fn first_message(&self) -> MessageDescriptor {
        self.file.messages().next().expect("parse refuses a file without messages")
    }

    /// The message `name` (a full name) declared in the file itself, at
    /// any depth: message indexes can only name those.
    fn declared(&self, name: &str) -> Result<MessageDescriptor, String> {
        let mut all: Vec<MessageDescriptor> = Vec::new();
        let mut stack: Vec<MessageDescriptor> = self.file.messages().collect();
        while let Some(m) = stack.pop() {
            stack.extend(m.child_messages());
            all.push(m);
        }
        all.iter().find(|m| m.full_name() == name).cloned().ok_or_else(|| {
            let mut names: Vec<&str> = all.iter().map(MessageDescriptor::full_name).collect();
            names.sort_unstable();
            format!("schema_message {name:?} is not a message of its file; it declares {}", names.join(", "))
        })
    }
}

/// The file `name` from the registry's `text`; a descriptor keeps its own
/// name unless `rename` (an import is found by the name it is imported as).
fn file(name: &str, text: &str, rename: bool) -> Result<protox::file::File, String> {
    // A descriptor is base64 without spaces; `.proto` text always has some.
    let trimmed = text.trim();
    if let Some(bytes) = Some(trimmed)
        .filter(|t| !t.contains(char::is_whitespace))
        .and_then(|t| base64::engine::general_purpose::STANDARD.decode(t).ok())
    {
        let proto = prost_types::FileDescriptorProto::decode(bytes.as_slice())
            .map_err(|e| format!("{name}: base64 that is not a FileDescriptorProto ({e})"))?;
        let mut f = protox::file::File::from_file_descriptor_proto(proto);
        if rename || f.name().is_empty() {
            let mut proto = f.file_descriptor_proto().clone();
            proto.name = Some(name.to_owned());
            f = protox::file::File::from_file_descriptor_proto(proto);
        }
        return Ok(f);
    }
    protox::file::File::from_source(name, text).map_err(|e| flat(&e))
}

/// The files of a schema and its references, by import name.
struct Files(HashMap<String, protox::file::File>);

impl protox::file::FileResolver for Files {
    fn open_file(&self, name: &str) -> Result<protox::file::File, protox::Error> {
        self.0.get(name).cloned().ok_or_else(|| protox::Error::file_not_found(name))
    }
}

/// An error of protox on one line: its source spans are for a terminal.
fn flat(e: &protox::Error) -> String {
    e.to_string().split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The message indexes at the start of `body`, and what follows them.
fn indexes(body: &[u8]) -> Result<(Vec<usize>, &[u8]), String> {
    let mut rest = body;
    let count = zigzag(&mut rest).ok_or("the value ends inside its message indexes")?;
    if count == 0 {
        return Ok((vec![0], rest));
    }
    let count = usize::try_from(count)
        .ok()
        .filter(|c| *c <= MAX_INDEXES)
        .ok_or_else(|| format!("the value claims {count} message indexes (at most {MAX_INDEXES})"))?;
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let i = zigzag(&mut rest).ok_or("the value ends inside its message indexes")?;
        out.push(usize::try_from(i).map_err(|_| format!("the value has message index {i}, below 0"))?);
    }
    Ok((out, rest))
}

/// A zig-zag varint, consumed from `buf`.
fn zigzag(buf: &mut &[u8]) -> Option<i64> {
    let mut v: u64 = 0;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = buf.split_first()?;
        *buf = rest;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(((v >> 1) as i64) ^ -((v & 1) as i64));
        }
    }
    None
}

fn put_zigzag(out: &mut Vec<u8>, v: i64) {
    let mut u = ((v << 1) ^ (v >> 63)) as u64;
    while u >= 0x80 {
        out.push((u as u8) | 0x80);
        u >>= 7;
    }
    out.push(u as u8);
}

/// The message indexes of `m` as written before its bytes.
fn put_indexes(out: &mut Vec<u8>, m: &MessageDescriptor) {
    let mut path = Vec::new();
    let mut at = m.clone();
    loop {
        let (siblings, parent): (Vec<MessageDescriptor>, _) = match at.parent_message() {
            Some(p) => (p.child_messages().collect(), Some(p)),
            None => (at.parent_file().messages().collect(), None),
        };
        path.push(siblings.iter().position(|s| s.full_name() == at.full_name()).unwrap_or(0) as i64);
        match parent {
            Some(p) => at = p,
            None => break,
        }
    }
    path.reverse();
    if path == [0] {
        out.push(0);
        return;
    }
    put_zigzag(out, path.len() as i64);
    for i in path {
        put_zigzag(out, i);
    }
}

/// JSON into a registered message, in the wire format.
pub(crate) struct Encoder {
    id: u32,
    message: MessageDescriptor,
    describe: String,
}

impl Encoder {
    /// Writes `message` (default the file's first) of `schema`, registered
    /// under `id`.
    pub(crate) fn new(id: u32, schema: &Schema, message: Option<&str>, describe: String) -> Result<Encoder, String> {
        let message = match message {
            Some(name) => schema.declared(name)?,
            None => schema.first_message(),
        };
        let describe = format!("{describe}, message {}", message.full_name());
        Ok(Encoder { id, message, describe })
    }
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe)
    }
}

impl relay_core::effects::DataEncoder for Encoder {
    fn encode(&self, data: &Value) -> Result<Vec<u8>, String> {
        let opts = DeserializeOptions::new().deny_unknown_fields(true);
        let mut track = serde_path_to_error::Track::new();
        let msg = DynamicMessage::deserialize_with_options(
            self.message.clone(),
            serde_path_to_error::Deserializer::new(data, &mut track),
            &opts,
        )
        .map_err(|_| {
            // The reason is built from the path and the schema alone: serde's
            // message quotes the value, and quoting can be escaped from.
            let path: Vec<String> = track.path().iter().filter_map(key_of).collect();
            let (at, place) = walk(&self.message, &path);
            let at = if at.is_empty() { "/".to_owned() } else { at };
            let why = match unknown_fields(&place, &path, data) {
                Some(names) => format!("the message has no field {}", names.join(", ")),
                None => match expected(place) {
                    Some(kind) => format!("expected {kind}"),
                    None => "does not fit".to_owned(),
                },
            };
            format!("at {at}: {why} (message {})", self.message.full_name())
        })?;
        let mut v = crate::header(self.id);
        put_indexes(&mut v, &self.message);
        msg.encode(&mut v).map_err(|e| e.to_string())?;
        Ok(v)
    }

    fn content_type(&self) -> &str {
        "application/x-protobuf"
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}

/// A path segment as a key: an object key or a list index.
fn key_of(s: &serde_path_to_error::Segment) -> Option<String> {
    use serde_path_to_error::Segment;
    match s {
        Segment::Seq { index } => Some(index.to_string()),
        Segment::Map { key } | Segment::Enum { variant: key } => Some(key.clone()),
        Segment::Unknown => None,
    }
}

/// The field of `m` called `name` (its `.proto` or its JSON name).
fn field(m: &MessageDescriptor, name: &str) -> Option<prost_reflect::FieldDescriptor> {
    m.get_field_by_name(name).or_else(|| m.get_field_by_json_name(name))
}

/// What the schema expects at `place` ([`walk`]), in words.
fn expected(place: At) -> Option<String> {
    Some(match place {
        At::Message(msg) => describe(&prost_reflect::Kind::Message(msg)),
        At::Scalar(kind) => describe(&kind),
        At::Items(kind, false) => format!("a list of {}", describe(&kind)),
        At::Items(kind, true) => format!("an object of {}", describe(&kind)),
        At::Other => return None,
    })
}

fn describe(kind: &prost_reflect::Kind) -> String {
    use prost_reflect::Kind;
    match kind {
        Kind::Message(m) if m.full_name().starts_with("google.protobuf.") => {
            format!("{} in its JSON form (e.g. RFC 3339 text for a Timestamp)", m.full_name())
        }
        Kind::Message(m) => format!("a {} object", m.full_name()),
        Kind::Enum(e) => {
            let names: Vec<String> = e.values().take(8).map(|v| v.name().to_owned()).collect();
            format!("one of {} ({})", names.join(", "), e.full_name())
        }
        Kind::String => "text".into(),
        Kind::Bytes => "base64 text".into(),
        Kind::Bool => "true or false".into(),
        Kind::Double | Kind::Float => "a number".into(),
        other => format!("an integer ({other:?})").to_lowercase(),
    }
}

/// Where a path into the data stands in the schema.
enum At {
    /// A message: its keys are fields.
    Message(MessageDescriptor),
    /// A list (false) or a map (true) field of items of this kind: its
    /// segments are indexes, or keys (data).
    Items(prost_reflect::Kind, bool),
    /// A scalar or an enum: nothing is below it.
    Scalar(prost_reflect::Kind),
    /// Somewhere the schema does not reach.
    Other,
}

/// `path` as a JSON pointer in which a map's keys (data, as much as its
/// values) are `*`, and where the pointer ends in the schema.
fn walk(m: &MessageDescriptor, path: &[String]) -> (String, At) {
    let mut at = At::Message(m.clone());
    let mut pointer = String::new();
    for key in path {
        let (shown, next) = match &at {
            At::Message(msg) => match field(msg, key) {
                Some(f) if f.is_map() => (
                    key.clone(),
                    At::Items(
                        match f.kind() {
                            prost_reflect::Kind::Message(entry) => entry.map_entry_value_field().kind(),
                            other => other,
                        },
                        true,
                    ),
                ),
                Some(f) if f.is_list() => (key.clone(), At::Items(f.kind(), false)),
                Some(f) => (key.clone(), kind_at(f.kind())),
                None => ("*".to_owned(), At::Other),
            },
            At::Items(kind, map) => {
                let shown = if *map { "*".to_owned() } else { key.clone() };
                (shown, kind_at(kind.clone()))
            }
            At::Scalar(_) | At::Other => ("*".to_owned(), At::Other),
        };
        pointer.push('/');
        pointer.push_str(&shown.replace('~', "~0").replace('/', "~1"));
        at = next;
    }
    (pointer, at)
}

fn kind_at(kind: prost_reflect::Kind) -> At {
    match kind {
        prost_reflect::Kind::Message(m) => At::Message(m),
        other => At::Scalar(other),
    }
}

/// The keys of the object at `path` in `data` that are no field of the
/// message there (`place`, [`walk`]), if that is what is wrong (only where
/// the schema has a message: a map's keys are data, never listed).
fn unknown_fields(place: &At, path: &[String], data: &Value) -> Option<Vec<String>> {
    let At::Message(msg) = place else { return None };
    let mut here = data;
    for key in path {
        here = match here {
            Value::Object(o) => o.get(key)?,
            Value::Array(a) => a.get(key.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    let unknown: Vec<String> =
        here.as_object()?.keys().filter(|k| field(msg, k).is_none()).map(|k| crate::shown_key(k)).collect();
    (!unknown.is_empty()).then_some(unknown)
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_core::effects::DataEncoder as _;
    use serde_json::json;

    /// A value of `message E { google.protobuf.Any p = 1; }` whose `p` is an
    /// Any of an Any … `levels` deep, the innermost an empty `E`.
    fn anys(levels: usize) -> Vec<u8> {
        fn delimited(tag: u8, bytes: &[u8], out: &mut Vec<u8>) {
            out.push(tag);
            prost::encoding::encode_varint(bytes.len() as u64, out);
            out.extend_from_slice(bytes);
        }
        let any = |url: &[u8], inner: &[u8]| {
            let mut a = Vec::new();
            delimited(0x0a, url, &mut a);
            delimited(0x12, inner, &mut a);
            a
        };
        let mut v = any(b"type.googleapis.com/E", b"");
        for _ in 1..levels {
            v = any(b"type.googleapis.com/google.protobuf.Any", &v);
        }
        let mut body = vec![0];
        delimited(0x0a, &v, &mut body);
        body
    }

    #[test]
    fn anys_nested_past_a_few_levels_are_refused_before_their_json_is_written() {
        let schema = Schema::parse(
            "syntax = \"proto3\";\nimport \"google/protobuf/any.proto\";\nmessage E { google.protobuf.Any p = 1; }",
            &HashMap::new(),
        )
        .unwrap();
        let shallow = schema.decode_value(&anys(3)).unwrap();
        assert_eq!(shallow["p"]["@type"], "type.googleapis.com/google.protobuf.Any", "{shallow}");
        // 3 000 levels (78 KB) overflowed the stack of the thread decoding it
        // (an abort); 35 000 fit one record under the default limit.
        let deep = anys(3_000);
        match schema.decode(&deep, crate::max_json_bytes(deep.len())) {
            Err(Undecoded::Invalid(why)) => assert!(why.contains("nested more than 8 deep"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    const PAYMENTS: &str = r#"
        syntax = "proto3";
        package shop;
        import "google/protobuf/timestamp.proto";
        import "money.proto";
        message PaymentRequested {
          string payment_id = 1;
          Money amount = 2;
          int64 attempt = 3;
          Status status = 4;
          google.protobuf.Timestamp at = 5;
          repeated Line lines = 6;
          bytes token = 7;
          message Line { string sku = 1; uint32 qty = 2; }
          enum Status { NEW = 0; HELD = 1; }
        }
        message Refund { string payment_id = 1; }
    "#;
    const MONEY: &str = r#"syntax = "proto3"; package shop; message Money { int64 minor = 1; string currency = 2; }"#;

    fn schema() -> Schema {
        Schema::parse(PAYMENTS, &HashMap::from([("money.proto".to_owned(), MONEY.to_owned())])).unwrap()
    }

    fn encoder() -> Encoder {
        Encoder::new(7, &schema(), None, "subject payments-value, schema id 7".into()).unwrap()
    }

    #[test]
    fn data_encodes_to_the_message_that_decodes_back_to_it_under_its_proto_names() {
        let data = json!({
            "payment_id": "p-1", "amount": {"minor": 1500, "currency": "EUR"}, "attempt": 9_007_199_254_740_993_i64,
            "status": "HELD", "at": "2026-12-05T10:00:00Z", "lines": [{"sku": "A", "qty": 2}], "token": "AAE="
        });
        let bytes = encoder().encode(&data).unwrap();
        assert_eq!(&bytes[..6], &[0, 0, 0, 0, 7, 0], "header, then the indexes [0] as one zero byte");
        assert_eq!(schema().decode_value(&bytes[5..]).unwrap(), data);
        // Unset fields come out with their defaults, so templates can name them.
        let bytes = encoder().encode(&json!({"paymentId": "p-2"})).unwrap();
        let back = schema().decode_value(&bytes[5..]).unwrap();
        assert_eq!(back["payment_id"], "p-2");
        assert_eq!(back["attempt"], 0);
        assert_eq!(back["status"], "NEW");
        assert_eq!(back["lines"], json!([]));
        assert!(back.get("amount").is_none(), "a message field without a value has none: {back}");
    }

    #[test]
    fn message_indexes_name_nested_and_later_messages() {
        let s = schema();
        let line = s.first_message().child_messages().next().unwrap();
        let mut out = Vec::new();
        put_indexes(&mut out, &line);
        // Two indexes, [0, 0], each a zig-zag varint.
        assert_eq!(out, [4, 0, 0]);
        let msg = DynamicMessage::deserialize(line, &json!({"sku": "B", "qty": 3})).unwrap();
        out.extend(msg.encode_to_vec());
        assert_eq!(s.decode_value(&out).unwrap(), json!({"sku": "B", "qty": 3}));
        let refund = s.file.messages().nth(1).unwrap();
        let mut out = Vec::new();
        put_indexes(&mut out, &refund);
        assert_eq!(out, [2, 2]);
        out.extend(DynamicMessage::deserialize(refund, &json!({"payment_id": "p"})).unwrap().encode_to_vec());
        assert_eq!(s.decode_value(&out).unwrap(), json!({"payment_id": "p"}));
        for (bytes, says) in [
            (&[2u8, 4][..], "indexes [2] name no message"),
            (&[4, 0, 8], "indexes [0, 4] name no message"),
            (&[0x80], "ends inside its message indexes"),
            (&[], "ends inside"),
            (&[2, 1], "below 0"),
            (&[0xfe, 0x01], "claims 127 message indexes"),
        ] {
            let e = s.decode_value(bytes).unwrap_err();
            assert!(e.contains(says), "{says:?} in {e}");
        }
        let e = s.decode_value(&[0, 0x0a, 0xff]).unwrap_err();
        assert!(e.contains("does not decode as shop.PaymentRequested"), "{e}");
    }

    #[test]
    fn a_misfit_names_the_field_and_never_the_value() {
        let e = encoder().encode(&json!({"payment_id": 4111111111111111_i64})).unwrap_err();
        assert!(e.contains("at /payment_id") && !e.contains("4111"), "{e}");
        let e = encoder().encode(&json!({"amount": {"minor": "secret-ish"}})).unwrap_err();
        assert!(e.contains("at /amount/minor") && !e.contains("secret"), "{e}");
        let e = encoder().encode(&json!({"status": "GONE"})).unwrap_err();
        assert!(e.contains("at /status") && !e.contains("GONE"), "{e}");
        let e = encoder().encode(&json!({"payment_id": "p", "surprise": 1})).unwrap_err();
        assert!(e.contains("the message has no field \"surprise\""), "{e}");
        // A key no field can have came with the data: not shown.
        let e = encoder().encode(&json!({"payment_id": "p", "4111111111111111": 1})).unwrap_err();
        assert!(e.contains("the message has no field *") && !e.contains("4111"), "{e}");
        // Quotes inside a value do not let it out (serde escapes them in its message).
        for data in [
            json!({"attempt": "x\" 4111111111111111"}),
            json!({"amount": {"minor": "x\" 4111111111111111"}}),
            json!({"status": "a' 4111111111111111"}),
            json!({"lines": [{"qty": "` 4111111111111111"}]}),
        ] {
            let e = encoder().encode(&data).unwrap_err();
            assert!(!e.contains("4111"), "{e}");
        }
        // Keys are data too where the schema has no message: an object in a
        // text field, a map's keys; a map value's unknown field is named.
        let maps = Schema::parse(
            "syntax = \"proto3\"; message M { string id = 1; map<string, int32> by_card = 2; \
             map<string, L> lines = 3; message L { string sku = 1; } }",
            &HashMap::new(),
        )
        .unwrap();
        let maps = Encoder::new(1, &maps, None, "d".into()).unwrap();
        for data in [
            json!({"id": {"4111111111111111": 1}}),
            json!({"by_card": {"4111111111111111": "x"}}),
            json!({"lines": {"4111111111111111": {"sku": "A", "bogus": 1}}}),
        ] {
            let e = maps.encode(&data).unwrap_err();
            assert!(!e.contains("4111"), "{e}");
        }
        let e = maps.encode(&json!({"lines": {"k": {"sku": "A", "bogus": 1}}})).unwrap_err();
        assert!(e.contains("at /lines/*: the message has no field \"bogus\""), "{e}");
        let e = encoder().encode(&json!({"lines": [{"qty": "many"}]})).unwrap_err();
        assert!(e.contains("at /lines/0/qty: expected an integer (uint32)"), "{e}");
        let e = encoder().encode(&json!({"status": "GONE"})).unwrap_err();
        assert!(e.contains("expected one of NEW, HELD"), "{e}");
        assert!(e.contains("message shop.PaymentRequested"), "{e}");
        assert_eq!(encoder().content_type(), "application/x-protobuf");
        assert!(encoder().describe().ends_with("message shop.PaymentRequested"));
    }

    #[test]
    fn an_emit_may_name_any_message_the_file_declares_and_its_indexes_say_which() {
        let s = schema();
        let refund = Encoder::new(7, &s, Some("shop.Refund"), "d".into()).unwrap();
        let bytes = refund.encode(&json!({"payment_id": "p-1"})).unwrap();
        assert_eq!(&bytes[5..7], &[2, 2], "indexes [1]");
        assert_eq!(s.decode_value(&bytes[5..]).unwrap(), json!({"payment_id": "p-1"}));
        let line = Encoder::new(7, &s, Some("shop.PaymentRequested.Line"), "d".into()).unwrap();
        let bytes = line.encode(&json!({"sku": "A", "qty": 1})).unwrap();
        assert_eq!(&bytes[5..8], &[4, 0, 0], "indexes [0, 0]");
        assert!(line.describe().ends_with("message shop.PaymentRequested.Line"));
        // Money is imported, not declared: no index can name it.
        let e = Encoder::new(7, &s, Some("shop.Money"), "d".into()).err().unwrap();
        assert!(e.contains("not a message of its file") && e.contains("shop.Refund"), "{e}");
    }

    #[test]
    fn a_descriptor_in_base64_is_read_as_the_serializer_registered_it() {
        let proto = schema().file.file_descriptor_proto().clone();
        let b64 = base64::engine::general_purpose::STANDARD.encode(proto.encode_to_vec());
        let money = base64::engine::general_purpose::STANDARD
            .encode(Schema::parse(MONEY, &HashMap::new()).unwrap().file.file_descriptor_proto().encode_to_vec());
        let s = Schema::parse(&b64, &HashMap::from([("money.proto".to_owned(), money)])).unwrap();
        assert_eq!(s.first_message().full_name(), "shop.PaymentRequested");
    }

    /// An order whose lines have eight fields, none with presence: each
    /// empty line (two bytes on the wire) is written out with every default.
    const ORDER_LINES: &str = r#"
        syntax = "proto3";
        message Order { string order_id = 1; repeated Line lines = 2; }
        message Line { string sku = 1; string name = 2; int64 quantity = 3; int64 unit_minor = 4;
                       string currency = 5; int64 tax_minor = 6; string warehouse = 7; bool gift = 8; }
    "#;

    #[test]
    fn a_value_whose_defaults_expand_past_the_bound_is_refused_as_oversized() {
        let s = Schema::parse(ORDER_LINES, &HashMap::new()).unwrap();
        // Indexes [0], order_id "o-1", then 100 000 empty lines.
        let mut body = vec![0u8, 0x0a, 3, b'o', b'-', b'1'];
        for _ in 0..100_000 {
            body.extend([0x12, 0x00]);
        }
        match s.decode_value(&body) {
            Err(e) => assert!(e.contains("oversized"), "{e}"),
            Ok(v) => panic!(
                "a value of {} bytes decoded to {} bytes of JSON",
                body.len(),
                serde_json::to_vec(&v).unwrap().len()
            ),
        }
    }

    #[test]
    fn the_json_written_is_the_json_of_the_value_it_was_built_as_before() {
        let s = Schema::parse(
            "syntax = \"proto3\"; message F { float f = 1; double d = 2; map<int32, string> m = 3; \
             uint64 u = 4; repeated float fs = 5; bytes b = 6; }",
            &HashMap::new(),
        )
        .unwrap();
        let data = json!({"f": 0.1, "d": 0.1, "m": {"7": "x"}, "u": 18_446_744_073_709_551_615_u64,
                          "fs": [1.5, 0.3, "NaN"], "b": "AP8="});
        let msg = DynamicMessage::deserialize(s.first_message(), &data).unwrap();
        let opts = SerializeOptions::new()
            .stringify_64_bit_integers(false)
            .use_proto_field_name(true)
            .skip_default_fields(false);
        let built = msg.serialize_with_options(serde_json::value::Serializer, &opts).unwrap();
        let mut body = vec![0];
        body.extend(msg.encode_to_vec());
        assert_eq!(s.decode_value(&body).unwrap(), built);
        assert_eq!(built["f"], json!(0.10000000149011612), "as before: an f32 widened");
    }

    #[test]
    fn a_schema_that_cannot_be_used_says_why() {
        let e = Schema::parse(PAYMENTS, &HashMap::new()).err().unwrap();
        assert!(e.contains("money.proto"), "{e}");
        let e = Schema::parse("syntax = \"proto3\"; message {", &HashMap::new()).err().unwrap();
        assert!(!e.contains('\n'), "{e}");
        let e = Schema::parse("syntax = \"proto3\"; enum E { A = 0; }", &HashMap::new()).err().unwrap();
        assert!(e.contains("no message"), "{e}");
    }
}
