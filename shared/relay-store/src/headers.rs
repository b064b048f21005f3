//! Kafka headers as stored in `jsonb`: `[{"name": …, "text": …}]`, with
//! `"base64"` instead of `"text"` for values that are not UTF-8 and neither
//! for a null value. Readable by an operator in psql, exact for replay.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use relay_core::Header;
use serde_json::{Value, json};

/// Encode headers for a `jsonb` column.
pub fn to_json(headers: &[Header]) -> Value {
    Value::Array(
        headers
            .iter()
            .map(|h| match &h.value {
                None => json!({"name": h.name}),
                Some(v) => match std::str::from_utf8(v) {
                    // jsonb cannot hold U+0000: such values go as base64 too.
                    Ok(text) if !text.contains('\0') => json!({"name": h.name, "text": text}),
                    _ => json!({"name": h.name, "base64": STANDARD.encode(v)}),
                },
            })
            .collect(),
    )
}

/// Decode headers from a `jsonb` column; malformed entries are skipped.
pub fn from_json(v: &Value) -> Vec<Header> {
    v.as_array()
        .map(|items| {
            items
                .iter()
                .filter_map(|item| {
                    let name = item.get("name")?.as_str()?.to_owned();
                    let value = if let Some(t) = item.get("text").and_then(Value::as_str) {
                        Some(t.as_bytes().to_vec())
                    } else if let Some(b) = item.get("base64").and_then(Value::as_str) {
                        Some(STANDARD.decode(b).ok()?)
                    } else {
                        None
                    };
                    Some(Header { name, value })
                })
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_exactly_including_binary_and_null_values() {
        let hs = vec![
            Header::text("ce_id", "e-1"),
            Header { name: "bin".into(), value: Some(vec![0xff, 0x00, 0x10]) },
            Header { name: "nothing".into(), value: None },
            Header { name: "nul".into(), value: Some(b"a\0b".to_vec()) },
        ];
        assert_eq!(from_json(&to_json(&hs)), hs);
        assert_eq!(to_json(&hs)[0], json!({"name": "ce_id", "text": "e-1"}));
    }
}
