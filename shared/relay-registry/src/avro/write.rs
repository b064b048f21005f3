//! JSON data written as Avro under a registered schema: outcome events
//! with a `format`, checked against the schema and encoded.

use std::collections::{HashMap, HashSet};

use apache_avro::schema::{Name, Schema};
use apache_avro::types::Value as Avro;
use chrono::{DateTime, NaiveDate};
use serde_json::Value;

use super::Decoder;
use super::{base64, decimal_unscaled, kind, pointer_token};

/// Data (JSON, as templates render it) encoded as an Avro datum of one
/// schema, in the wire format. The mapping is the decoder's, backwards:
/// decimals from exact text (or a number), bytes from base64, dates and
/// timestamps from their text, a union from the first branch the value
/// fits. Fields the schema does not have are left out; a field it needs
/// and the data lacks takes the schema's default, else it fails naming the
/// field.
pub(crate) struct Encoder {
    id: u32,
    schema: Decoder,
    describe: String,
}

impl Encoder {
    /// An encoder for `schema`, or why it cannot write it: a type it does
    /// not write, or a default that does not fit (found now, not on each
    /// event).
    pub(crate) fn new(id: u32, schema: Decoder, describe: String) -> Result<Encoder, String> {
        schema.writable(&schema.schema, "", &mut HashSet::new())?;
        Ok(Encoder { id, schema, describe })
    }
}

/// What a JSON value being encoded is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Rendered data: a value of the schema's kind; a union takes the first
    /// branch of the value's own kind, else the first it can be read as
    /// (text for a number, a number for text).
    Data,
    /// A first pass over a union's branches: the value's own kind only.
    Exact,
    /// A default from the schema: Avro's JSON encoding (bytes and fixed as
    /// text of code points 0-255).
    Default,
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe)
    }
}

impl relay_core::effects::DataEncoder for Encoder {
    fn encode(&self, data: &Value) -> Result<Vec<u8>, String> {
        let value = self.schema.avro(data, &self.schema.schema, "", Mode::Data)?;
        let writer = apache_avro::writer::datum::GenericDatumWriter::builder(&self.schema.schema)
            .schemata(self.schema.all())
            .map_err(|e| e.to_string())?
            .build()
            .map_err(|e| e.to_string())?;
        let body = writer.write_value_to_vec(value).map_err(|e| e.to_string())?;
        let mut out = crate::header(self.id);
        out.extend(body);
        Ok(out)
    }

    fn content_type(&self) -> &str {
        "application/avro"
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}

impl Decoder {
    /// Where `schema` has a type the encoder does not write, or a field
    /// default that does not fit its type.
    fn writable<'s>(&'s self, schema: &'s Schema, at: &str, seen: &mut HashSet<&'s Name>) -> Result<(), String> {
        match schema {
            Schema::Array(a) => self.writable(&a.items, &format!("{at}/0"), seen),
            Schema::Map(m) => self.writable(&m.types, &format!("{at}/*"), seen),
            Schema::Union(u) => u.variants().iter().try_for_each(|v| self.writable(v, at, seen)),
            Schema::Record(r) => {
                if seen.contains(&r.name) {
                    return Ok(());
                }
                seen.insert(&r.name);
                for f in &r.fields {
                    let path = format!("{at}/{}", pointer_token(&f.name));
                    self.writable(&f.schema, &path, seen)?;
                    if let Some(d) = &f.default {
                        self.default(d, &f.schema, &path)
                            .map_err(|e| format!("field {} of {}: its default does not fit: {e}", f.name, r.name))?;
                    }
                }
                Ok(())
            }
            Schema::Ref { name } => match self.names.get(name) {
                Some(s) => self.writable(s, at, seen),
                None => Err(format!("{at}: unknown type {name}")),
            },
            Schema::Duration(_)
            | Schema::BigDecimal
            | Schema::TimeMillis
            | Schema::TimeMicros
            | Schema::TimestampNanos
            | Schema::LocalTimestampMillis
            | Schema::LocalTimestampMicros
            | Schema::LocalTimestampNanos => {
                Err(format!("{}: relay does not write Avro type {schema:?} yet", if at.is_empty() { "/" } else { at }))
            }
            _ => Ok(()),
        }
    }

    /// Field default `d` of a field of `schema` (Avro's: for a union, its first branch).
    fn default(&self, d: &Value, schema: &Schema, at: &str) -> Result<Avro, String> {
        match schema {
            Schema::Union(u) if !u.variants().is_empty() => {
                Ok(Avro::Union(0, Box::new(self.avro(d, &u.variants()[0], at, Mode::Default)?)))
            }
            other => self.avro(d, other, at, Mode::Default),
        }
    }

    /// `v` as a value of `schema`; `at` is its JSON pointer, for errors,
    /// which name the place and the kinds, never the value.
    fn avro(&self, v: &Value, schema: &Schema, at: &str, mode: Mode) -> Result<Avro, String> {
        let w = Place { v, at, mode };
        Ok(match schema {
            Schema::Ref { name } => {
                let s = self.names.get(name).ok_or_else(|| format!("{}: unknown type {name}", w.here()))?;
                return self.avro(v, s, at, mode);
            }
            Schema::Null if v.is_null() => Avro::Null,
            Schema::Null => return Err(w.want("null")),
            Schema::Boolean => Avro::Boolean(v.as_bool().ok_or_else(|| w.want("true or false"))?),
            Schema::Int => {
                let i = w.int().ok_or_else(|| w.want("an integer"))?;
                Avro::Int(i32::try_from(i).map_err(|_| format!("{}: out of an Avro int's range", w.here()))?)
            }
            Schema::Long => Avro::Long(w.int().ok_or_else(|| w.want("an integer"))?),
            Schema::Float => {
                let f = w.float().ok_or_else(|| w.want("a number"))?;
                let narrow = f as f32;
                if narrow.is_infinite() && f.is_finite() {
                    return Err(format!("{}: out of an Avro float's range", w.here()));
                }
                Avro::Float(narrow)
            }
            Schema::Double => Avro::Double(w.float().ok_or_else(|| w.want("a number"))?),
            Schema::String => match v {
                Value::String(s) => Avro::String(s.clone()),
                Value::Number(_) | Value::Bool(_) if w.lenient() => Avro::String(v.to_string()),
                _ => return Err(w.want("text")),
            },
            Schema::Bytes => Avro::Bytes(w.bytes(w.text()?)?),
            Schema::Fixed(f) => {
                let b = w.bytes(w.text()?)?;
                if b.len() != f.size {
                    return Err(format!("{}: {} bytes, fixed {} has {}", w.here(), b.len(), f.name, f.size));
                }
                Avro::Fixed(f.size, b)
            }
            Schema::Enum(e) => {
                let symbol = w.text()?;
                let i = e.symbols.iter().position(|s| s == symbol).ok_or_else(|| {
                    format!("{}: not a symbol of enum {} ({})", w.here(), e.name, e.symbols.join(", "))
                })?;
                Avro::Enum(u32::try_from(i).unwrap_or(u32::MAX), symbol.to_owned())
            }
            Schema::Union(u) => return self.union(&w, u),
            Schema::Array(a) => {
                let items = v.as_array().ok_or_else(|| w.want("an array"))?;
                let items: Result<Vec<_>, _> =
                    items.iter().enumerate().map(|(i, x)| self.avro(x, &a.items, &format!("{at}/{i}"), mode)).collect();
                Avro::Array(items?)
            }
            Schema::Map(m) => {
                let entries = v.as_object().ok_or_else(|| w.want("an object"))?;
                let mut out = HashMap::with_capacity(entries.len());
                for (k, x) in entries {
                    // A map's keys are data (an answer's, an event's): a
                    // reason shows them as `*`, never as they are.
                    out.insert(k.clone(), self.avro(x, &m.types, &format!("{at}/*"), mode)?);
                }
                Avro::Map(out)
            }
            Schema::Record(r) => self.record(&w, r)?,
            Schema::Decimal(d) => w.decimal(d)?,
            Schema::Uuid(_) => Avro::Uuid(w.text()?.parse().map_err(|_| format!("{}: not a UUID", w.here()))?),
            Schema::Date => w.date()?,
            Schema::TimestampMillis | Schema::TimestampMicros => w.timestamp(schema)?,
            other => {
                return Err(format!("{}: relay does not write Avro type {other:?} yet", w.here()));
            }
        })
    }

    /// The first branch of `u` the value fits: its own kind first
    /// ("01234" stays text in ["long", "string"]), only then what it can be
    /// read as.
    fn union(&self, w: &Place<'_>, u: &apache_avro::schema::UnionSchema) -> Result<Avro, String> {
        let passes = if w.mode == Mode::Data { &[Mode::Exact, Mode::Data][..] } else { &[w.mode][..] };
        let mut tried = Vec::new();
        for &pass in passes {
            for (i, branch) in u.variants().iter().enumerate() {
                match self.avro(w.v, branch, w.at, pass) {
                    Ok(value) => return Ok(Avro::Union(u32::try_from(i).unwrap_or(u32::MAX), Box::new(value))),
                    Err(e) if pass == *passes.last().unwrap_or(&pass) => tried.push(e),
                    Err(_) => {}
                }
            }
        }
        Err(format!("{}: fits no branch of its union ({})", w.here(), tried.join("; ")))
    }

    /// The value as record `r`: every field of it, a missing one from its
    /// default; a field the record lacks is refused, since a misspelt
    /// optional field would otherwise ship its default without a word.
    fn record(&self, w: &Place<'_>, r: &apache_avro::schema::RecordSchema) -> Result<Avro, String> {
        let fields = w.v.as_object().ok_or_else(|| w.want("an object"))?;
        if let Some(extra) = fields.keys().find(|k| !r.lookup.contains_key(*k)) {
            return Err(format!("{}: record {} has no field {}", w.here(), r.name, crate::shown_key(extra)));
        }
        let mut out = Vec::with_capacity(r.fields.len());
        for f in &r.fields {
            let path = format!("{}/{}", w.at, pointer_token(&f.name));
            let value = match (fields.get(&f.name), &f.default) {
                (Some(x), _) => self.avro(x, &f.schema, &path, w.mode)?,
                (None, Some(d)) => self.default(d, &f.schema, &path)?,
                (None, None) => {
                    return Err(format!("{path}: missing, and field {} of {} has no default", f.name, r.name));
                }
            };
            out.push((f.name.clone(), value));
        }
        Ok(Avro::Record(out))
    }
}

/// A JSON value being written as Avro, where it is (a JSON pointer) and how
/// strictly it is read; its errors name the place and the kinds, never the
/// value.
struct Place<'a> {
    v: &'a Value,
    at: &'a str,
    mode: Mode,
}

impl Place<'_> {
    fn here(&self) -> String {
        if self.at.is_empty() { "/".to_owned() } else { self.at.to_owned() }
    }

    fn want(&self, what: &str) -> String {
        format!("{}: expected {what}, found {}", self.here(), kind(self.v))
    }

    /// Whether text may stand for a number and a number for text.
    fn lenient(&self) -> bool {
        self.mode != Mode::Exact
    }

    fn int(&self) -> Option<i64> {
        match self.v {
            Value::Number(n) => n.as_i64(),
            Value::String(s) if self.lenient() => s.trim().parse().ok(),
            _ => None,
        }
    }

    fn float(&self) -> Option<f64> {
        match self.v {
            Value::Number(n) => n.as_f64(),
            Value::String(s) if self.lenient() => s.trim().parse().ok().filter(|f: &f64| f.is_finite()),
            _ => None,
        }
    }

    fn text(&self) -> Result<&str, String> {
        self.v.as_str().ok_or_else(|| self.want("text"))
    }

    /// Bytes from text: base64 in data, each character a byte in a field
    /// default (Avro's JSON encoding).
    fn bytes(&self, s: &str) -> Result<Vec<u8>, String> {
        if self.mode == Mode::Default {
            s.chars()
                .map(|c| u8::try_from(u32::from(c)).map_err(|_| format!("{}: not a byte string", self.here())))
                .collect()
        } else {
            base64(s).map_err(|_| format!("{}: not base64", self.here()))
        }
    }

    fn decimal(&self, d: &apache_avro::schema::DecimalSchema) -> Result<Avro, String> {
        let unscaled = decimal_unscaled(self.v, d.scale).ok_or_else(|| self.want("a decimal (text like \"12.50\")"))?;
        let digits = unscaled.trim_start_matches('-').len();
        if digits > d.precision {
            return Err(format!("{}: {digits} digits, over the decimal's precision {}", self.here(), d.precision));
        }
        let n: num_bigint::BigInt = unscaled.parse().map_err(|_| self.want("a decimal"))?;
        let mut bytes = n.to_signed_bytes_be();
        if let apache_avro::schema::InnerDecimalSchema::Fixed(f) = &d.inner {
            if bytes.len() > f.size {
                return Err(format!("{}: too large for fixed {} of {} bytes", self.here(), f.name, f.size));
            }
            let pad = if n.sign() == num_bigint::Sign::Minus { 0xff } else { 0 };
            let mut padded = vec![pad; f.size - bytes.len()];
            padded.extend(bytes);
            bytes = padded;
        }
        Ok(Avro::Decimal(apache_avro::Decimal::from(bytes)))
    }

    fn date(&self) -> Result<Avro, String> {
        Ok(match self.v {
            Value::String(s) => {
                let d = NaiveDate::parse_from_str(s, "%Y-%m-%d")
                    .map_err(|e| format!("{}: not a date: {e}", self.here()))?;
                let epoch = NaiveDate::from_ymd_opt(1970, 1, 1).unwrap_or_default();
                let days = (d - epoch).num_days();
                Avro::Date(i32::try_from(days).map_err(|_| format!("{}: date out of range", self.here()))?)
            }
            _ => Avro::Date(
                i32::try_from(self.int().ok_or_else(|| self.want("a date"))?).map_err(|_| self.want("a date"))?,
            ),
        })
    }

    /// A timestamp in millis or micros (`schema`), from RFC 3339 text or a number.
    fn timestamp(&self, schema: &Schema) -> Result<Avro, String> {
        let t = match self.v {
            Value::String(s) => Some(
                DateTime::parse_from_rfc3339(s)
                    .map_err(|_| format!("{}: not an RFC 3339 time", self.here()))?
                    .with_timezone(&chrono::Utc),
            ),
            _ => None,
        };
        Ok(match (schema, t) {
            (Schema::TimestampMillis, Some(t)) => Avro::TimestampMillis(t.timestamp_millis()),
            (_, Some(t)) => Avro::TimestampMicros(t.timestamp_micros()),
            (Schema::TimestampMillis, None) => Avro::TimestampMillis(self.int().ok_or_else(|| self.want("a time"))?),
            (_, None) => Avro::TimestampMicros(self.int().ok_or_else(|| self.want("a time"))?),
        })
    }
}

#[cfg(test)]
impl Encoder {
    /// The schema it writes under, for tests that decode what it wrote.
    pub(super) fn schema(&self) -> &Decoder {
        &self.schema
    }
}
