//! CloudEvents records, binary (attributes in `ce_` headers) and
//! structured (one JSON document), read with the CloudEvents SDK.

use std::collections::HashMap;

use cloudevents::event::SpecVersion;
use cloudevents::message::{
    BinaryDeserializer, BinarySerializer, Error as CeError, MessageAttributeValue, Result as CeResult,
};
use cloudevents::{AttributesReader, Data, Event as CloudEvent};
use serde_json::Value;

use super::{InputEvent, Poison, PoisonClass, RawRecord, STRUCTURED_CONTENT_TYPE, header_text, json_kind, value_text};

pub(super) fn decode_cloudevent(record: &RawRecord) -> Result<InputEvent, Poison> {
    let content_type = header_text(record, "content-type")?;
    let structured =
        content_type.as_deref().is_some_and(|ct| ct.to_ascii_lowercase().starts_with(STRUCTURED_CONTENT_TYPE));
    let event = if structured {
        decode_structured(record)?
    } else if record.header("ce_specversion").is_some() {
        decode_binary(record)?
    } else {
        return Err(Poison::new(
            PoisonClass::NotCloudEvent,
            "record is not a CloudEvent: no ce_specversion header (binary mode) and content-type \
             is not application/cloudevents+json (structured mode); declare the topic with \
             format = \"json\" and fields.id / fields.type if its producer does not speak CloudEvents",
        ));
    };
    let id = event.id().to_owned();
    let ty = event.ty().to_owned();
    let ident = |p: Poison| p.with_identity(Some(&id), Some(&ty));
    // The SDK also reads 0.3, whose attributes differ (`schemaurl`, `datacontentencoding`):
    // an event of another version is not the contract this relay applies.
    if event.specversion() != SpecVersion::V10 {
        return Err(ident(Poison::new(
            PoisonClass::NotCloudEvent,
            format!(
                "CloudEvents specversion {} is not supported: the relay reads CloudEvents 1.0 only",
                event.specversion()
            ),
        )));
    }
    if id.trim().is_empty() {
        return Err(ident(Poison::new(PoisonClass::MissingId, "CloudEvents id is empty")));
    }
    if ty.trim().is_empty() {
        return Err(ident(Poison::new(PoisonClass::MissingType, "CloudEvents type is empty")));
    }
    let data = event_data_as_json(&event).map_err(ident)?;
    let extensions = event.iter_extensions().map(|(k, v)| (k.to_owned(), v.to_string())).collect();
    Ok(InputEvent {
        id,
        event_type: ty,
        source: event.source().to_string(),
        subject: event.subject().map(str::to_owned),
        time: event.time().copied(),
        data,
        extensions,
        ..InputEvent::default()
    })
}

pub(super) fn decode_structured(record: &RawRecord) -> Result<CloudEvent, Poison> {
    let bytes = record
        .payload
        .as_deref()
        .ok_or_else(|| Poison::new(PoisonClass::BadJson, "structured CloudEvent has an empty record value"))?;
    let json: Value = serde_json::from_slice(bytes)
        .map_err(|e| Poison::new(PoisonClass::BadJson, format!("structured CloudEvent is not valid JSON: {e}")))?;
    let id = json.get("id").and_then(Value::as_str).map(str::to_owned);
    let ty = json.get("type").and_then(Value::as_str).map(str::to_owned);
    match json.get("id") {
        None | Some(Value::Null) => {
            return Err(Poison::new(PoisonClass::MissingId, "structured CloudEvent has no \"id\"")
                .with_identity(None, ty.as_deref()));
        }
        Some(Value::String(_)) => {}
        Some(other) => {
            return Err(Poison::new(
                PoisonClass::MissingId,
                format!("structured CloudEvent \"id\" must be a string, found {}", json_kind(other)),
            )
            .with_identity(None, ty.as_deref()));
        }
    }
    serde_json::from_value::<CloudEvent>(json).map_err(|e| {
        Poison::new(PoisonClass::NotCloudEvent, format!("invalid structured CloudEvent: {e}"))
            .with_identity(id.as_deref(), ty.as_deref())
    })
}

pub(super) fn decode_binary(record: &RawRecord) -> Result<CloudEvent, Poison> {
    let id = header_text(record, "ce_id")?;
    let ty = header_text(record, "ce_type")?;
    if id.is_none() {
        return Err(Poison::new(PoisonClass::MissingId, "binary CloudEvent has no ce_id header")
            .with_identity(None, ty.as_deref()));
    }
    // One pass over the headers, the last of a repeated name winning (as
    // `RawRecord::header` has it): looking each one up again was quadratic
    // in the header count.
    let mut last: HashMap<String, usize> = HashMap::new();
    for (i, h) in record.headers.iter().enumerate() {
        let lower = h.name.to_ascii_lowercase();
        if lower.starts_with("ce_") || lower == "content-type" {
            last.insert(lower, i);
        }
    }
    let mut headers = Vec::with_capacity(last.len());
    for (lower, i) in last {
        headers.push((i, lower, value_text(&record.headers[i])?));
    }
    headers.sort_unstable_by_key(|(i, _, _)| *i);
    let headers = headers.into_iter().map(|(_, name, text)| (name, text)).collect();
    KafkaBinary { headers, payload: record.payload.clone() }.into_event().map_err(|e| {
        Poison::new(PoisonClass::NotCloudEvent, format!("invalid binary CloudEvent: {e}"))
            .with_identity(id.as_deref(), ty.as_deref())
    })
}

/// The CloudEvents Kafka binding, binary mode, over already-validated text headers.
pub(super) struct KafkaBinary {
    headers: Vec<(String, String)>,
    payload: Option<Vec<u8>>,
}

impl BinaryDeserializer for KafkaBinary {
    fn deserialize_binary<R: Sized, V: BinarySerializer<R>>(self, mut visitor: V) -> CeResult<R> {
        let spec = self
            .headers
            .iter()
            .rev()
            .find(|(n, _)| n == "ce_specversion")
            .map(|(_, v)| v.clone())
            .ok_or(CeError::WrongEncoding {})?;
        let spec = SpecVersion::try_from(spec.as_str())?;
        let attribute_names = spec.attribute_names();
        visitor = visitor.set_spec_version(spec)?;
        for (name, value) in self.headers {
            if name == "ce_specversion" {
                continue;
            }
            if name == "content-type" {
                visitor = visitor.set_attribute("datacontenttype", MessageAttributeValue::String(value))?;
                continue;
            }
            let attr = &name["ce_".len()..];
            visitor = if attribute_names.contains(&attr) {
                visitor.set_attribute(attr, MessageAttributeValue::String(value))?
            } else {
                visitor.set_extension(attr, MessageAttributeValue::String(value))?
            };
        }
        match self.payload {
            Some(bytes) => visitor.end_with_data(bytes),
            None => visitor.end(),
        }
    }
}

pub(super) fn is_json_content_type(ct: Option<&str>) -> bool {
    match ct {
        None => true,
        Some(ct) => {
            let ct = ct.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
            ct == "application/json" || ct == "text/json" || ct.ends_with("+json")
        }
    }
}

pub(super) fn event_data_as_json(event: &CloudEvent) -> Result<Value, Poison> {
    let json_ct = is_json_content_type(event.datacontenttype());
    match event.data() {
        None => Ok(Value::Null),
        Some(Data::Json(v)) => Ok(v.clone()),
        Some(Data::String(s)) if json_ct => serde_json::from_str(s)
            .map_err(|e| Poison::new(PoisonClass::BadJson, format!("event data is not valid JSON: {e}"))),
        Some(Data::String(s)) => Ok(Value::String(s.clone())),
        Some(Data::Binary(b)) if json_ct => serde_json::from_slice(b)
            .map_err(|e| Poison::new(PoisonClass::BadJson, format!("event data is not valid JSON: {e}"))),
        Some(Data::Binary(b)) => match std::str::from_utf8(b) {
            Ok(s) if event.datacontenttype().is_some_and(|ct| ct.starts_with("text/")) => {
                Ok(Value::String(s.to_owned()))
            }
            _ => Err(Poison::new(
                PoisonClass::BadJson,
                format!(
                    "event data has content type {:?}; the relay routes on JSON (or text) data",
                    event.datacontenttype().unwrap_or_default()
                ),
            )),
        },
    }
}
