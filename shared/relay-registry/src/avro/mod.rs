//! Avro datums to JSON, with the writer's schema (the one the record names).
//!
//! The mapping is written here rather than apache-avro's
//! `TryFrom<Value> for serde_json::Value`, which turns bytes and decimals
//! into arrays of numbers, dates into bare day counts and fails on NaN:
//! here bytes are base64 text, decimals exact decimal text, logical times
//! RFC 3339 / ISO 8601 text, a union its branch's value, an enum its symbol.

use std::collections::{HashMap, HashSet};

use apache_avro::schema::{FixedSchema, Name, Schema};
use apache_avro::types::Value as Avro;
use base64::Engine as _;
use chrono::{DateTime, NaiveDate, NaiveTime};
use serde_json::{Number, Value};

use crate::Undecoded;

mod write;

pub(crate) use write::Encoder;

/// What one array or map of a record may claim when decoded (its items ×
/// the size of a decoded value): records are at most
/// `consumer.max_record_bytes` (960 KiB by default), so this leaves room for
/// every legitimate one while a crafted length cannot take the process down.
const MAX_ALLOCATION_BYTES: usize = 64 * 1024 * 1024;

/// The largest `fixed` relay decodes: larger than any record it reads
/// (`consumer.max_record_bytes` is 960 KiB by default).
const MAX_FIXED_BYTES: usize = 1024 * 1024;

/// The most digits a decimal's precision or scale may ask for: a 38-digit
/// SQL decimal is the common largest, and a scale of two billion wrote two
/// billion zeros for a one-byte value.
const MAX_DECIMAL_SCALE: usize = 1000;

/// The most levels of records, arrays, maps and unions a schema may nest,
/// counting through named types: each level is a few frames of the
/// decoder's stack and of relay's own walks of the schema.
const MAX_SCHEMA_DEPTH: usize = 64;

/// The most memory an item of an array or a map may decode to for each byte
/// it takes on the wire ([`Decoder::heavy_items`]).
const MAX_TREE_PER_BYTE: usize = 256;

/// The levels inside one definition, and the named types it uses with
/// the level each is used at. Recursion here is bounded by the nesting
/// of one definition's JSON (serde_json stops at 128 levels).
fn levels<'s>(schema: &'s Schema, level: usize, top: bool, uses: &mut Vec<(&'s Name, usize)>) -> usize {
    match schema {
        Schema::Record(r) if !top => {
            uses.push((&r.name, level));
            level
        }
        Schema::Record(r) => r.fields.iter().map(|f| levels(&f.schema, level + 1, false, uses)).max().unwrap_or(level),
        Schema::Ref { name } => {
            uses.push((name, level));
            level
        }
        Schema::Array(a) => levels(&a.items, level + 1, false, uses),
        Schema::Map(m) => levels(&m.types, level + 1, false, uses),
        Schema::Union(u) => u.variants().iter().map(|v| levels(v, level + 1, false, uses)).max().unwrap_or(level),
        _ => level,
    }
}
/// A named type on the walk: its own depth so far, what it uses, and
/// how far through them the walk is.
struct Frame<'s> {
    name: &'s Name,
    depth: usize,
    uses: Vec<(&'s Name, usize)>,
    next: usize,
}

/// The frame of named type `name` as the walk starts it.
fn begin<'s>(name: &'s Name, names: &'s HashMap<Name, Schema>) -> Frame<'s> {
    let mut uses = Vec::new();
    let own = names.get(name).map_or(0, |s| levels(s, 0, true, &mut uses));
    Frame { name, depth: own, uses, next: 0 }
}

/// Refuse `schema` if it nests deeper than `max` levels or contains itself
/// (a recursive type: each level costs a byte of the record and frames of
/// the decoder's stack, so a record of a few hundred KiB would overflow
/// it). Computed without recursion over the named types, each once: a walk
/// that followed every path of shared types took exponential time.
fn depth_within(schema: &Schema, names: &HashMap<Name, Schema>, max: usize) -> Result<(), String> {
    let mut depth: HashMap<&Name, usize> = HashMap::new();
    let mut on_walk: HashSet<&Name> = HashSet::new();
    for start in names.keys() {
        if depth.contains_key(start) {
            continue;
        }
        let mut stack: Vec<Frame<'_>> = Vec::new();
        on_walk.insert(start);
        stack.push(begin(start, names));
        while let Some(top) = stack.last_mut() {
            if let Some(&(used, at)) = top.uses.get(top.next) {
                top.next += 1;
                if let Some(d) = depth.get(used) {
                    top.depth = top.depth.max(at + d);
                } else if on_walk.contains(used) {
                    return Err(format!(
                        "type {used} contains itself (a recursive schema), which relay does not decode yet"
                    ));
                } else if names.contains_key(used) {
                    on_walk.insert(used);
                    stack.push(begin(used, names));
                }
                continue;
            }
            let done = stack.pop().expect("a frame on top");
            on_walk.remove(done.name);
            if done.depth > max {
                return Err(format!(
                    "type {} nests {} levels deep, more than the {max} relay decodes",
                    done.name, done.depth
                ));
            }
            depth.insert(done.name, done.depth);
            if let Some(parent) = stack.last_mut() {
                let at = parent.uses[parent.next - 1].1;
                parent.depth = parent.depth.max(at + done.depth);
            }
        }
    }
    let mut uses = Vec::new();
    let own = levels(schema, 0, true, &mut uses);
    let deepest = uses.iter().map(|(n, at)| at + depth.get(n).copied().unwrap_or(0)).max().unwrap_or(0).max(own);
    if deepest > max {
        return Err(format!("the schema nests {deepest} levels deep, more than the {max} relay decodes"));
    }
    Ok(())
}

/// `imports` ordered so that each comes after those it uses (apache-avro
/// resolves a list front to back; the registry gives references as a set).
fn resolvable_order(mut imports: Vec<Schema>) -> Result<Vec<Schema>, String> {
    let mut ordered: Vec<Schema> = Vec::with_capacity(imports.len());
    while !imports.is_empty() {
        let next = imports.iter().position(|candidate| {
            let list: Vec<&Schema> = ordered.iter().chain(std::iter::once(candidate)).collect();
            apache_avro::schema::ResolvedSchema::new_with_schemata(list).is_ok()
        });
        match next {
            Some(i) => ordered.push(imports.remove(i)),
            // What is left uses a type none of the references defines.
            None => {
                let list: Vec<&Schema> = ordered.iter().chain(&imports).collect();
                return Err(apache_avro::schema::ResolvedSchema::new_with_schemata(list)
                    .err()
                    .map_or_else(|| "the referenced schemas cannot be resolved".into(), |e| e.to_string()));
            }
        }
    }
    Ok(ordered)
}

/// A parsed writer schema and its named types (records, enums, fixed).
pub(crate) struct Decoder {
    schema: Schema,
    /// The schemas it refers to (schema references), parsed.
    imports: Vec<Schema>,
    names: HashMap<Name, Schema>,
}

impl Decoder {
    #[cfg(test)]
    pub(crate) fn parse(text: &str) -> Result<Decoder, String> {
        Decoder::parse_with(text, &[])
    }

    /// The schema `text`, whose named types may come from `imports` (the
    /// schemas its references name).
    pub(crate) fn parse_with(text: &str, imports: &[String]) -> Result<Decoder, String> {
        // A bound on what one collection of a record may claim (apache-avro
        // checks it before allocating); global, and the first call sets it.
        apache_avro::util::max_allocation_bytes(MAX_ALLOCATION_BYTES);
        let (schema, imports) = if imports.is_empty() {
            (Schema::parse_str(text).map_err(|e| e.to_string())?, Vec::new())
        } else {
            Schema::parse_str_with_list(text, imports).map_err(|e| e.to_string())?
        };
        let imports = resolvable_order(imports)?;
        let all: Vec<&Schema> = imports.iter().chain(std::iter::once(&schema)).collect();
        let names = apache_avro::schema::ResolvedSchema::new_with_schemata(all)
            .map_err(|e| e.to_string())?
            .get_names()
            .iter()
            .map(|(n, s)| (n.clone(), (*s).clone()))
            .collect();
        let d = Decoder { schema, imports, names };
        // Before any check that walks the schema by recursion: a chain of
        // named types, each the field of the next, is flat in the schema's
        // JSON and as deep as it is long, and thousands of links overflowed
        // the stack of those checks and of the decoder.
        depth_within(&d.schema, &d.names, MAX_SCHEMA_DEPTH)?;
        if let Some(at) = d.free_items(&d.schema, &mut HashSet::new()) {
            return Err(format!(
                "{at} holds items encoded in zero bytes (null, fixed of size 0, or records of only those): \
                 a few bytes of a record could claim any number of them, so relay refuses the schema"
            ));
        }
        if let Some(why) = d.oversized(&d.schema, &mut HashSet::new()) {
            return Err(format!("{why}, so relay refuses the schema"));
        }
        if let Some(why) = d.heavy_items(&d.schema, &mut HashMap::new(), &mut HashSet::new()) {
            return Err(format!("{why}, so relay refuses the schema"));
        }
        Ok(d)
    }

    /// The fewest bytes a value of `schema` takes on the wire, and about
    /// the most memory apache-avro's decoded value of it takes (it copies an
    /// enum's symbol and a record's field names into every value). Named
    /// types are costed once (`memo`); the schema is known not to contain
    /// itself ([`depth_within`]).
    fn cost<'s>(&'s self, schema: &'s Schema, memo: &mut HashMap<&'s Name, (usize, usize)>) -> (usize, usize) {
        const VALUE: usize = 48;
        const STRING: usize = 24;
        match schema {
            Schema::Null => (0, VALUE),
            Schema::Fixed(f) => (f.size, VALUE + f.size),
            Schema::Duration(_) => (12, VALUE),
            Schema::Enum(e) => (1, VALUE + e.symbols.iter().map(String::len).max().unwrap_or(0)),
            Schema::Record(r) => {
                let (mut bytes, mut mem) = (0usize, VALUE + STRING);
                for f in &r.fields {
                    let (b, m) = self.cost(&f.schema, memo);
                    bytes = bytes.saturating_add(b);
                    mem = mem.saturating_add(STRING + f.name.len()).saturating_add(m);
                }
                (bytes, mem)
            }
            Schema::Union(u) => {
                let costs: Vec<(usize, usize)> = u.variants().iter().map(|v| self.cost(v, memo)).collect();
                let bytes = costs.iter().map(|c| c.0).min().unwrap_or(0);
                (1 + bytes, VALUE + costs.iter().map(|c| c.1).max().unwrap_or(0))
            }
            Schema::Array(_) | Schema::Map(_) => (1, VALUE + STRING),
            Schema::Ref { name } => {
                if let Some(&c) = memo.get(name) {
                    return c;
                }
                let c = self.names.get(name).map_or((1, VALUE), |s| self.cost(s, memo));
                memo.insert(name, c);
                c
            }
            _ => (1, VALUE),
        }
    }

    /// Where `schema` has an array or a map whose items decode to more than
    /// [`MAX_TREE_PER_BYTE`] bytes of memory for each byte they take on the
    /// wire, if anywhere: a few bytes of such a record could claim gigabytes
    /// before any bound on its JSON applies (an enum whose symbol is a
    /// megabyte, one byte an item).
    fn heavy_items<'s>(
        &'s self,
        schema: &'s Schema,
        memo: &mut HashMap<&'s Name, (usize, usize)>,
        seen: &mut HashSet<&'s Name>,
    ) -> Option<String> {
        let items = |s: &'s Schema, memo: &mut HashMap<&'s Name, (usize, usize)>| {
            let (bytes, mem) = self.cost(s, memo);
            (mem > MAX_TREE_PER_BYTE * bytes.max(1)).then(|| {
                format!(
                    "items that take {bytes} byte(s) on the wire decode to about {mem} bytes of memory, more than the \
                     {MAX_TREE_PER_BYTE} per byte relay allows"
                )
            })
        };
        match schema {
            Schema::Array(a) => items(&a.items, memo).or_else(|| self.heavy_items(&a.items, memo, seen)),
            Schema::Map(m) => items(&m.types, memo).or_else(|| self.heavy_items(&m.types, memo, seen)),
            Schema::Union(u) => u.variants().iter().find_map(|v| self.heavy_items(v, memo, seen)),
            Schema::Record(r) => {
                if !seen.insert(&r.name) {
                    return None;
                }
                r.fields
                    .iter()
                    .find_map(|f| self.heavy_items(&f.schema, memo, seen).map(|w| format!("field {:?}: {w}", f.name)))
            }
            Schema::Ref { name } => match self.names.get(name) {
                Some(s) if seen.insert(name) => self.heavy_items(s, memo, seen),
                _ => None,
            },
            _ => None,
        }
    }

    /// Where `schema` makes a decoder allocate more than its record could
    /// hold, whatever the record's bytes, if anywhere: a `fixed` larger
    /// than a record (its buffer is made before a byte is read), or a
    /// decimal whose scale prints more digits than a record could carry
    /// (its text is written whole before any bound on the JSON applies).
    fn oversized<'s>(&'s self, schema: &'s Schema, seen: &mut HashSet<&'s Name>) -> Option<String> {
        let fixed = |f: &FixedSchema| {
            (f.size > MAX_FIXED_BYTES)
                .then(|| format!("fixed {} is {} bytes, over the {MAX_FIXED_BYTES} relay reads", f.name, f.size))
        };
        match schema {
            Schema::Fixed(f) | Schema::Duration(f) => fixed(f),
            Schema::Decimal(d) if d.scale > MAX_DECIMAL_SCALE || d.precision > MAX_DECIMAL_SCALE => Some(format!(
                "a decimal of precision {} and scale {} prints more digits than the {MAX_DECIMAL_SCALE} relay writes",
                d.precision, d.scale
            )),
            Schema::Decimal(d) => match &d.inner {
                apache_avro::schema::InnerDecimalSchema::Fixed(f) => fixed(f),
                apache_avro::schema::InnerDecimalSchema::Bytes => None,
            },
            Schema::Array(a) => self.oversized(&a.items, seen),
            Schema::Map(m) => self.oversized(&m.types, seen),
            Schema::Union(u) => u.variants().iter().find_map(|v| self.oversized(v, seen)),
            Schema::Record(r) => {
                if seen.contains(&r.name) {
                    return None;
                }
                seen.insert(&r.name);
                r.fields
                    .iter()
                    .find_map(|f| self.oversized(&f.schema, seen).map(|w| format!("field {:?}: {w}", f.name)))
            }
            Schema::Ref { name } => match self.names.get(name) {
                Some(s) if !seen.contains(name) => {
                    seen.insert(name);
                    self.oversized(s, seen)
                }
                _ => None,
            },
            _ => None,
        }
    }

    /// Where `schema` has an array or a map whose items encode in zero
    /// bytes, if anywhere. `seen`: named types on the way (recursion).
    fn free_items<'s>(&'s self, schema: &'s Schema, seen: &mut HashSet<&'s Name>) -> Option<String> {
        match schema {
            Schema::Array(a) if self.zero_size(&a.items, &mut HashSet::new()) => Some("an array".into()),
            Schema::Map(m) if self.zero_size(&m.types, &mut HashSet::new()) => Some("a map".into()),
            Schema::Array(a) => self.free_items(&a.items, seen),
            Schema::Map(m) => self.free_items(&m.types, seen),
            Schema::Union(u) => u.variants().iter().find_map(|v| self.free_items(v, seen)),
            Schema::Record(r) => {
                if seen.contains(&r.name) {
                    return None;
                }
                seen.insert(&r.name);
                r.fields.iter().find_map(|f| {
                    self.free_items(&f.schema, seen).map(|at| format!("field {:?} of {}: {at}", f.name, r.name))
                })
            }
            Schema::Ref { name } => match self.names.get(name) {
                Some(s) if !seen.contains(name) => self.free_items(s, seen),
                _ => None,
            },
            _ => None,
        }
    }

    /// Whether a value of `schema` encodes in zero bytes.
    fn zero_size<'s>(&'s self, schema: &'s Schema, seen: &mut HashSet<&'s Name>) -> bool {
        match schema {
            Schema::Null => true,
            Schema::Fixed(f) => f.size == 0,
            Schema::Record(r) => {
                // A record that contains itself cannot be all zero-size and finite.
                if seen.contains(&r.name) {
                    return false;
                }
                seen.insert(&r.name);
                r.fields.iter().all(|f| self.zero_size(&f.schema, seen))
            }
            Schema::Ref { name } => self.names.get(name).is_some_and(|s| self.zero_size(s, seen)),
            _ => false,
        }
    }

    /// The schemas it refers to, then itself: apache-avro resolves a list
    /// in order.
    fn all(&self) -> Vec<&Schema> {
        self.imports.iter().chain(std::iter::once(&self.schema)).collect()
    }

    /// The datum in `body` (all of it) as JSON text of at most `limit` bytes.
    /// Read through [`StrictEnd`], so each item of a block costs bytes.
    pub(crate) fn decode(&self, body: &[u8], limit: usize) -> Result<Vec<u8>, Undecoded> {
        let reader = apache_avro::reader::datum::GenericDatumReader::builder(&self.schema)
            .writer_schemata(self.all())
            .map_err(|e| e.to_string())?
            .build()
            .map_err(|e| e.to_string())?;
        let mut rest = body;
        let value = reader.read_value(&mut StrictEnd(&mut rest)).map_err(|e| e.to_string())?;
        if !rest.is_empty() {
            return Err(format!("{} byte(s) left after the datum", rest.len()).into());
        }
        let datum = Datum { decoder: self, value: &value, schema: Some(&self.schema) };
        crate::json_text(limit, |out| serde::Serialize::serialize(&datum, out))
    }

    /// [`Decoder::decode`] within the bound of its size, read back as a value.
    #[cfg(test)]
    pub(crate) fn decode_value(&self, body: &[u8]) -> Result<Value, String> {
        let text = self.decode(body, crate::max_json_bytes(body.len())).map_err(|e| e.to_string())?;
        Ok(serde_json::from_slice(&text).expect("decoded to JSON"))
    }

    /// `schema` with a reference resolved to the type it names.
    fn resolved<'s>(&'s self, schema: Option<&'s Schema>) -> Option<&'s Schema> {
        match schema {
            Some(Schema::Ref { name }) => self.names.get(name),
            other => other,
        }
    }

    /// A value that holds no other as JSON. `schema` is its schema where
    /// known (a reference resolved), which decimals need for their scale.
    fn scalar(value: &Avro, schema: Option<&Schema>) -> Value {
        match value {
            Avro::Null => Value::Null,
            Avro::Boolean(b) => Value::Bool(*b),
            Avro::Int(i) => (*i).into(),
            Avro::Long(i) => (*i).into(),
            // Through its shortest text, so 0.1f32 reads 0.1, not 0.10000000149011612.
            Avro::Float(f) => float(f.to_string().parse().unwrap_or(f64::from(*f))),
            Avro::Double(f) => float(*f),
            Avro::Bytes(b) | Avro::Fixed(_, b) => base64::engine::general_purpose::STANDARD.encode(b).into(),
            Avro::String(s) | Avro::Enum(_, s) => s.as_str().into(),
            Avro::Date(days) => NaiveDate::from_ymd_opt(1970, 1, 1)
                .and_then(|epoch| epoch.checked_add_signed(chrono::Duration::days(i64::from(*days))))
                .map_or_else(|| (*days).into(), |d| d.to_string().into()),
            Avro::TimeMillis(ms) => time(i64::from(*ms) * 1_000_000).unwrap_or_else(|| (*ms).into()),
            Avro::TimeMicros(us) => time(us.saturating_mul(1_000)).unwrap_or_else(|| (*us).into()),
            Avro::TimestampMillis(ms) => timestamp(DateTime::from_timestamp_millis(*ms), *ms),
            Avro::TimestampMicros(us) => timestamp(DateTime::from_timestamp_micros(*us), *us),
            Avro::TimestampNanos(ns) => timestamp(Some(DateTime::from_timestamp_nanos(*ns)), *ns),
            Avro::LocalTimestampMillis(ms) => local(DateTime::from_timestamp_millis(*ms), *ms),
            Avro::LocalTimestampMicros(us) => local(DateTime::from_timestamp_micros(*us), *us),
            Avro::LocalTimestampNanos(ns) => local(Some(DateTime::from_timestamp_nanos(*ns)), *ns),
            Avro::Decimal(d) => {
                let scale = match schema {
                    Some(Schema::Decimal(d)) => d.scale,
                    _ => 0,
                };
                let unscaled: num_bigint::BigInt = d.clone().into();
                decimal_text(&unscaled.to_string(), scale).into()
            }
            Avro::BigDecimal(d) => d.to_string().into(),
            Avro::Duration(d) => serde_json::json!({
                "months": u32::from(d.months()),
                "days": u32::from(d.days()),
                "millis": u32::from(d.millis()),
            }),
            Avro::Uuid(u) => u.to_string().into(),
            // Written by `Datum`, never passed here.
            Avro::Union(..) | Avro::Array(_) | Avro::Map(_) | Avro::Record(_) => Value::Null,
        }
    }
}

/// A decoded datum as JSON, written as it is serialized rather than built as
/// a `serde_json::Value` first: its JSON is bounded while it is written
/// ([`crate::json_text`]). Bytes are base64 text, decimals exact decimal text,
/// logical times RFC 3339 / ISO 8601 text, a union its branch's value, an
/// enum its symbol.
struct Datum<'a> {
    decoder: &'a Decoder,
    value: &'a Avro,
    /// Its schema where known.
    schema: Option<&'a Schema>,
}

impl serde::Serialize for Datum<'_> {
    fn serialize<S: serde::Serializer>(&self, out: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeMap as _, SerializeSeq as _};
        let d = self.decoder;
        let schema = d.resolved(self.schema);
        let inner = |value, schema| Datum { decoder: d, value, schema };
        match self.value {
            Avro::Union(i, v) => {
                let branch = match schema {
                    Some(Schema::Union(u)) => usize::try_from(*i).ok().and_then(|i| u.variants().get(i)),
                    _ => None,
                };
                inner(v, branch).serialize(out)
            }
            Avro::Array(items) => {
                let item = match schema {
                    Some(Schema::Array(a)) => Some(&*a.items),
                    _ => None,
                };
                let mut seq = out.serialize_seq(Some(items.len()))?;
                for v in items {
                    seq.serialize_element(&inner(v, item))?;
                }
                seq.end()
            }
            Avro::Map(entries) => {
                let item = match schema {
                    Some(Schema::Map(m)) => Some(&*m.types),
                    _ => None,
                };
                let mut map = out.serialize_map(Some(entries.len()))?;
                for (k, v) in entries {
                    map.serialize_entry(k, &inner(v, item))?;
                }
                map.end()
            }
            Avro::Record(fields) => {
                let record = match schema {
                    Some(Schema::Record(r)) => Some(r),
                    _ => None,
                };
                let mut map = out.serialize_map(Some(fields.len()))?;
                for (name, v) in fields {
                    let field = record.and_then(|r| r.lookup.get(name).map(|&i| &r.fields[i].schema));
                    map.serialize_entry(name, &inner(v, field))?;
                }
                map.end()
            }
            Avro::String(text) | Avro::Enum(_, text) => out.serialize_str(text),
            other => Decoder::scalar(other, schema).serialize(out),
        }
    }
}

/// The kind of a JSON value, for errors (never the value).
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "text",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A JSON pointer token (RFC 6901).
fn pointer_token(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

fn base64(s: &str) -> Result<Vec<u8>, base64::DecodeError> {
    base64::engine::general_purpose::STANDARD.decode(s)
}

/// The unscaled integer text of decimal `v` at `scale`, if it is one with
/// at most `scale` fraction digits.
fn decimal_unscaled(v: &Value, scale: usize) -> Option<String> {
    let text = match v {
        Value::String(s) => s.trim().to_owned(),
        Value::Number(n) if n.is_i64() || n.is_u64() => n.to_string(),
        Value::Number(n) => n.to_string(),
        _ => return None,
    };
    let (sign, digits) = text.strip_prefix('-').map_or(("", text.as_str()), |d| ("-", d));
    let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
    if int.is_empty() && frac.is_empty()
        || !int.bytes().all(|b| b.is_ascii_digit())
        || !frac.bytes().all(|b| b.is_ascii_digit())
        || frac.len() > scale
    {
        return None;
    }
    let unscaled = format!("{int}{frac:0<scale$}");
    let unscaled = unscaled.trim_start_matches('0');
    Some(if unscaled.is_empty() { "0".to_owned() } else { format!("{sign}{unscaled}") })
}

/// JSON has no NaN or infinity: those become text, as Avro's JSON encoding has them./// JSON has no NaN or infinity: those become text, as Avro's JSON encoding has them.
fn float(f: f64) -> Value {
    match Number::from_f64(f) {
        Some(n) => Value::Number(n),
        None if f.is_nan() => "NaN".into(),
        None if f > 0.0 => "Infinity".into(),
        None => "-Infinity".into(),
    }
}

fn time(nanos_since_midnight: i64) -> Option<Value> {
    let secs = u32::try_from(nanos_since_midnight / 1_000_000_000).ok()?;
    let nanos = u32::try_from(nanos_since_midnight % 1_000_000_000).ok()?;
    NaiveTime::from_num_seconds_from_midnight_opt(secs, nanos).map(|t| t.to_string().into())
}

fn timestamp(t: Option<DateTime<chrono::Utc>>, raw: i64) -> Value {
    t.map_or_else(|| raw.into(), |t| t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true).into())
}

/// A local timestamp has no zone: ISO 8601 without an offset.
fn local(t: Option<DateTime<chrono::Utc>>, raw: i64) -> Value {
    t.map_or_else(|| raw.into(), |t| t.naive_utc().format("%Y-%m-%dT%H:%M:%S%.f").to_string().into())
}

/// `digits` (an integer, maybe negative) divided by 10^`scale`, as text.
fn decimal_text(digits: &str, scale: usize) -> String {
    if scale == 0 {
        return digits.to_owned();
    }
    let (sign, digits) = digits.strip_prefix('-').map_or(("", digits), |d| ("-", d));
    let padded = format!("{digits:0>width$}", width = scale + 1);
    let (int, frac) = padded.split_at(padded.len() - scale);
    format!("{sign}{int}.{frac}")
}

/// A reader that fails, rather than reports the end, when a datum reads past
/// its bytes. apache-avro takes the end of the input where a union's branch
/// or a string is due as a null, so a block claiming a million such items
/// cost nothing on the wire and gigabytes decoded; a datum that fits its
/// schema never reads past its end.
struct StrictEnd<'a, 'b>(&'a mut &'b [u8]);

impl std::io::Read for StrictEnd<'_, '_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if !buf.is_empty() && self.0.is_empty() {
            return Err(std::io::Error::other("the value ends before its schema does"));
        }
        self.0.read(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // A schema's types can ask for memory no record holds: a decimal's scale
    // is printed as that many digits (2 GB for a one-byte value), a fixed's
    // buffer is made before a byte is read.
    #[test]
    fn a_schema_whose_types_ask_for_more_than_a_record_holds_is_refused() {
        let decimal = r#"{"type":"bytes","logicalType":"decimal","precision":2000000000,"scale":1999999999}"#;
        let err = Decoder::parse(decimal).err().expect("refused");
        assert!(err.contains("scale 1999999999") && err.contains("refuses the schema"), "{err}");
        let fixed = r#"{"type":"record","name":"R","fields":[{"name":"f","type":{"type":"fixed","name":"Big","size":2000000000}}]}"#;
        let err = Decoder::parse(fixed).err().expect("refused");
        assert!(err.contains("field \"f\"") && err.contains("2000000000 bytes"), "{err}");
        let money = r#"{"type":"bytes","logicalType":"decimal","precision":38,"scale":9}"#;
        assert!(Decoder::parse(money).is_ok());
    }

    // A block of 100 000 items of a union, and not one byte for them: each
    // decoded as a null at the end of the input (1 000 000 optional records
    // from 15 bytes took 1.3 GB).
    #[test]
    fn a_block_claiming_items_its_bytes_do_not_hold_is_refused() {
        let schema = r#"{"type": "array", "items": ["null", "long"]}"#;
        let decoder = Decoder::parse(schema).unwrap();
        // Zig-zag varint of 100 000 items, then nothing.
        let mut body = Vec::new();
        let mut n = 200_000u64;
        while n >= 0x80 {
            body.push((n as u8) | 0x80);
            n >>= 7;
        }
        body.push(n as u8);
        let err = decoder.decode(&body, 1 << 30).unwrap_err().to_string();
        assert!(err.contains("ends before its schema does"), "{err}");
    }

    const ORDER: &str = r#"{"type":"record","name":"Order","namespace":"shop","fields":[
        {"name":"id","type":"string"},
        {"name":"cents","type":"long"},
        {"name":"price","type":{"type":"bytes","logicalType":"decimal","precision":10,"scale":2}},
        {"name":"note","type":["null","string"],"default":null},
        {"name":"status","type":{"type":"enum","name":"Status","symbols":["NEW","PAID"]}},
        {"name":"placed","type":{"type":"long","logicalType":"timestamp-millis"}},
        {"name":"day","type":{"type":"int","logicalType":"date"}},
        {"name":"raw","type":"bytes"},
        {"name":"lines","type":{"type":"array","items":{"type":"record","name":"Line","fields":[
            {"name":"sku","type":"string"},{"name":"ratio","type":"double"}]}}},
        {"name":"again","type":"Status"}
    ]}"#;

    fn encode(schema: &Schema, v: Avro) -> Vec<u8> {
        apache_avro::writer::datum::GenericDatumWriter::builder(schema).build().unwrap().write_value_to_vec(v).unwrap()
    }

    #[test]
    fn a_schema_may_use_the_named_types_of_the_schemas_it_refers_to() {
        // Money uses Currency, and the registry lists them in any order.
        let money = r#"{"type":"record","name":"Money","namespace":"shop","fields":[
            {"name":"minor","type":"long"},{"name":"currency","type":"shop.Currency"}]}"#;
        let currency = r#"{"type":"enum","name":"Currency","namespace":"shop","symbols":["EUR","USD"]}"#;
        let order = r#"{"type":"record","name":"Order","namespace":"shop","fields":[
            {"name":"id","type":"string"},{"name":"total","type":"shop.Money"}]}"#;
        assert!(Decoder::parse(order).is_err(), "alone, shop.Money is unknown");
        let imports = [money.to_owned(), currency.to_owned()];
        let d = Decoder::parse_with(order, &imports).unwrap();
        let data = serde_json::json!({"id": "o-1", "total": {"minor": 1250, "currency": "EUR"}});
        let e = Encoder::new(3, Decoder::parse_with(order, &imports).unwrap(), "s".into()).unwrap();
        let e2 = Decoder::parse_with(order, &[money.to_owned()]).err().unwrap();
        assert!(e2.contains("shop.Currency"), "a missing one is named: {e2}");
        let bytes = relay_core::effects::DataEncoder::encode(&e, &data).unwrap();
        assert_eq!(d.decode_value(&bytes[5..]).unwrap(), data);
        let err =
            relay_core::effects::DataEncoder::encode(&e, &serde_json::json!({"id": "o", "total": {"minor": "x"}}))
                .unwrap_err();
        assert!(err.contains("/total/minor"), "{err}");
    }

    #[test]
    fn a_record_becomes_the_json_a_route_reads_with_logical_types_as_text() {
        let d = Decoder::parse(ORDER).unwrap();
        let v = Avro::Record(vec![
            ("id".into(), Avro::String("o-1".into())),
            ("cents".into(), Avro::Long(1250)),
            ("price".into(), Avro::Decimal(apache_avro::Decimal::from(vec![0xfb, 0x1e]))), // -1250
            ("note".into(), Avro::Union(1, Box::new(Avro::String("gift".into())))),
            ("status".into(), Avro::Enum(1, "PAID".into())),
            ("placed".into(), Avro::TimestampMillis(1_764_892_800_123)),
            ("day".into(), Avro::Date(20_427)),
            ("raw".into(), Avro::Bytes(vec![0, 255])),
            (
                "lines".into(),
                Avro::Array(vec![Avro::Record(vec![
                    ("sku".into(), Avro::String("s".into())),
                    ("ratio".into(), Avro::Double(f64::NAN)),
                ])]),
            ),
            ("again".into(), Avro::Enum(0, "NEW".into())),
        ]);
        let json = d.decode_value(&encode(&d.schema, v)).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "id": "o-1", "cents": 1250, "price": "-12.50", "note": "gift", "status": "PAID",
                "placed": "2025-12-05T00:00:00.123Z", "day": "2025-12-05", "raw": "AP8=",
                "lines": [{"sku": "s", "ratio": "NaN"}], "again": "NEW"
            })
        );
    }

    #[test]
    fn bytes_that_are_not_a_datum_of_the_schema_are_refused() {
        let d = Decoder::parse(r#"{"type":"record","name":"R","fields":[{"name":"a","type":"long"}]}"#).unwrap();
        assert!(d.decode_value(&[]).is_err(), "nothing to read");
        assert!(d.decode_value(&[2, 2]).unwrap_err().contains("left after"), "trailing bytes");
    }

    #[test]
    fn a_schema_whose_collections_could_hold_any_number_of_zero_byte_items_is_refused() {
        for items in [
            r#""null""#,
            r#"{"type":"fixed","name":"F","size":0}"#,
            r#"{"type":"record","name":"E","fields":[{"name":"n","type":"null"}]}"#,
        ] {
            let schema = format!(
                r#"{{"type":"record","name":"R","fields":[{{"name":"a","type":{{"type":"array","items":{items}}}}}]}}"#
            );
            let err = Decoder::parse(&schema).err().unwrap_or_else(|| panic!("{items} accepted"));
            assert!(err.contains("field \"a\" of R: an array holds items encoded in zero bytes"), "{err}");
        }
        let map = r#"{"type":"map","values":["null"]}"#;
        assert!(Decoder::parse(map).is_ok(), "a union's branch index takes a byte");
        assert!(Decoder::parse(r#"{"type":"map","values":"null"}"#).err().expect("refused").contains("a map"));
        let linked = r#"{"type":"record","name":"Node","fields":[{"name":"next","type":["null","Node"]},{"name":"tags","type":{"type":"array","items":"long"}}]}"#;
        let err = Decoder::parse(linked).err().expect("a recursive schema is refused");
        assert!(err.contains("type Node contains itself"), "{err}");
        let shared = r#"{"type":"record","name":"R","fields":[{"name":"a","type":{"type":"record","name":"P","fields":[{"name":"x","type":"long"}]}},{"name":"b","type":"P"}]}"#;
        assert!(Decoder::parse(shared).is_ok(), "a named type used twice is not recursive");
    }

    /// A schema of `links` records defined side by side in one record, each
    /// `a{k}` with `fields_per_link` fields of type `a{k-1}`: flat in JSON,
    /// as deep as it is long.
    fn chain(links: usize, fields_per_link: usize) -> String {
        let mut defs = vec![r#"{"name":"d0","type":{"type":"record","name":"a0","fields":[]}}"#.to_owned()];
        for k in 1..links {
            let fields: Vec<String> =
                (0..fields_per_link).map(|f| format!(r#"{{"name":"x{f}","type":"a{}"}}"#, k - 1)).collect();
            defs.push(format!(
                r#"{{"name":"d{k}","type":{{"type":"record","name":"a{k}","fields":[{}]}}}}"#,
                fields.join(",")
            ));
        }
        format!(r#"{{"type":"record","name":"top","fields":[{}]}}"#, defs.join(","))
    }

    // apache-avro decodes a value to a tree that copies an enum's symbol
    // into every item: a 1 MiB symbol and a 1 KiB array of its indexes took
    // a gigabyte before relay's bound on the JSON applied.
    #[test]
    fn a_schema_whose_items_decode_to_far_more_memory_than_their_bytes_is_refused() {
        let symbol = "s".repeat(1 << 20);
        let bomb = format!(r#"{{"type":"array","items":{{"type":"enum","name":"E","symbols":["{symbol}","b"]}}}}"#);
        let err = Decoder::parse(&bomb).err().expect("refused");
        assert!(err.contains("more than the 256 per byte relay allows"), "{err}");
        let names = format!(
            r#"{{"type":"map","values":{{"type":"record","name":"R","fields":[{{"name":"{}","type":"int"}}]}}}}"#,
            "n".repeat(4096)
        );
        assert!(Decoder::parse(&names).err().expect("refused").contains("per byte"));
        // Ordinary names and symbols pass.
        let ordinary = r#"{"type":"array","items":{"type":"record","name":"Line","fields":[
            {"name":"sku","type":"string"},{"name":"quantity","type":"int"},{"name":"unit_price_cents","type":"long"},
            {"name":"status","type":{"type":"enum","name":"Status","symbols":["PENDING_FULFILMENT","SHIPPED"]}},
            {"name":"gift","type":["null","boolean"]}]}}"#;
        assert!(Decoder::parse(ordinary).is_ok());
    }

    // A chain of 12 000 named types, each the field of the next, overflowed
    // the stack of the checks above (an abort: every member that took the
    // partition died on the same record); a chain of types each used twice
    // by the next took exponential time to walk.
    #[test]
    fn a_schema_nested_deeper_than_64_levels_through_named_types_is_refused_in_linear_time() {
        let started = std::time::Instant::now();
        let err = Decoder::parse(&chain(12_000, 1)).err().expect("refused");
        assert!(err.contains("levels deep, more than the 64 relay decodes"), "{err}");
        assert!(Decoder::parse(&chain(60, 1)).is_ok(), "60 levels are read");
        let err = Decoder::parse(&chain(200, 2)).err().expect("refused");
        assert!(err.contains("more than the 64"), "{err}");
        assert!(Decoder::parse(&chain(60, 2)).is_ok(), "shared types are walked once");
        assert!(started.elapsed() < std::time::Duration::from_secs(10), "took {:?}", started.elapsed());
    }

    #[test]
    fn data_encodes_to_the_datum_that_decodes_back_to_it_and_a_misfit_names_its_field() {
        use relay_core::effects::DataEncoder as _;
        let e = Encoder::new(7, Decoder::parse(ORDER).unwrap(), "subject s, schema id 7".into()).unwrap();
        let data = serde_json::json!({
            "id": "o-1", "cents": "1250", "price": "-12.5", "status": "PAID",
            "placed": "2025-12-05T00:00:00.123Z", "day": "2025-12-05", "raw": "AP8=",
            "lines": [{"sku": "s", "ratio": 0.5}], "again": "NEW"
        });
        let bytes = e.encode(&data).unwrap();
        assert_eq!(&bytes[..5], &[0, 0, 0, 0, 7]);
        let back = e.schema().decode_value(&bytes[5..]).unwrap();
        assert_eq!(
            back,
            serde_json::json!({
                "id": "o-1", "cents": 1250, "price": "-12.50", "note": null, "status": "PAID",
                "placed": "2025-12-05T00:00:00.123Z", "day": "2025-12-05", "raw": "AP8=",
                "lines": [{"sku": "s", "ratio": 0.5}], "again": "NEW"
            })
        );
        for (field, value, says) in [
            ("cents", serde_json::json!("a lot"), "/cents: expected an integer, found text"),
            ("status", serde_json::json!("LOST"), "/status: not a symbol of enum shop.Status"),
            ("extra", serde_json::json!("typo"), "/: record shop.Order has no field \"extra\""),
            ("price", serde_json::json!("1.234"), "/price: expected a decimal"),
            ("lines", serde_json::json!([{"sku": 5}]), "/lines/0/ratio: missing"),
        ] {
            let mut bad = data.clone();
            bad[field] = value;
            let err = e.encode(&bad).unwrap_err();
            assert!(err.contains(says), "{says:?} in {err}");
            assert!(!err.contains("LOST") && !err.contains("a lot") && !err.contains("1.234"), "no value: {err}");
        }
        // A union takes the value's own kind first.
        let u = Encoder::new(
            1,
            Decoder::parse(
                r#"{"type":"record","name":"U","fields":[
            {"name":"a","type":["long","string"]},{"name":"b","type":["string","long"]},
            {"name":"c","type":["null","double"],"default":null},
            {"name":"d","type":"bytes","default":"\u00ff"}]}"#,
            )
            .unwrap(),
            String::new(),
        )
        .unwrap();
        let out = u.encode(&serde_json::json!({"a": "01234", "b": 5})).unwrap();
        assert_eq!(
            u.schema().decode_value(&out[5..]).unwrap(),
            serde_json::json!({"a": "01234", "b": 5, "c": null, "d": "/w=="}),
            "text stays text, a number a number; a bytes default is code points"
        );
        // A default apache-avro takes but that is no byte string (a code point over 255).
        let bad_default = r#"{"type":"record","name":"B","fields":[{"name":"n","type":"bytes","default":"\u0100"}]}"#;
        let err = match Decoder::parse(bad_default) {
            Ok(d) => Encoder::new(1, d, String::new()).expect_err("refused"),
            Err(e) => e,
        };
        assert!(err.contains("default"), "{err}");
        let time =
            r#"{"type":"record","name":"T","fields":[{"name":"t","type":{"type":"int","logicalType":"time-millis"}}]}"#;
        assert!(
            Encoder::new(1, Decoder::parse(time).unwrap(), String::new()).err().unwrap().contains("does not write")
        );
        let mut missing = data.clone();
        missing.as_object_mut().unwrap().remove("id");
        assert!(e.encode(&missing).unwrap_err().contains("/id: missing"));
        // A map's key is data: not in the reason.
        let m = r#"{"type":"record","name":"M","fields":[{"name":"meta","type":{"type":"map","values":"long"}}]}"#;
        let m = Encoder::new(1, Decoder::parse(m).unwrap(), String::new()).unwrap();
        let err = m.encode(&serde_json::json!({"meta": {"4111111111111111": "x"}})).unwrap_err();
        assert!(err.contains("/meta/*: expected an integer") && !err.contains("4111"), "{err}");
        // So is a key no field can have, where the record has none of that name.
        let mut whole = data.clone();
        whole["4111111111111111"] = serde_json::json!(1);
        let err = e.encode(&whole).unwrap_err();
        assert!(err.contains("record shop.Order has no field *") && !err.contains("4111"), "{err}");
    }

    #[test]
    fn a_value_whose_field_names_expand_past_the_bound_is_refused_as_oversized() {
        // Eight optional fields per item: a null is one byte (its branch), its
        // JSON the field's name.
        let fields: Vec<String> = (0..8)
            .map(|i| format!(r#"{{"name":"optional_measurement_{i}","type":["null","long"],"default":null}}"#))
            .collect();
        let schema = format!(
            r#"{{"type":"record","name":"Batch","fields":[{{"name":"readings","type":{{"type":"array","items":
               {{"type":"record","name":"Reading","fields":[{}]}}}}}}]}}"#,
            fields.join(",")
        );
        let d = Decoder::parse(&schema).unwrap();
        let items = 20_000;
        let mut body = Vec::new();
        // One block of `items` (a zig-zag varint), each eight zero bytes, then the end.
        let mut n = (items as u64) << 1;
        while n >= 0x80 {
            body.push((n as u8) | 0x80);
            n >>= 7;
        }
        body.push(n as u8);
        body.extend(std::iter::repeat_n(0u8, items * 8));
        body.push(0);
        match d.decode_value(&body) {
            Err(e) => assert!(e.contains("oversized"), "{e}"),
            Ok(v) => panic!(
                "a value of {} bytes decoded to {} bytes of JSON",
                body.len(),
                serde_json::to_vec(&v).unwrap().len()
            ),
        }
    }

    #[test]
    fn decimals_keep_every_digit() {
        assert_eq!(decimal_text("5", 2), "0.05");
        assert_eq!(decimal_text("-5", 3), "-0.005");
        assert_eq!(decimal_text("123456789012345678901234567890", 10), "12345678901234567890.1234567890");
        assert_eq!(decimal_text("42", 0), "42");
    }
}
