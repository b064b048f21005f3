//! Kafka headers as stored in `jsonb`: `[{"name": …, "text": …}]`, with
//! `"base64"` instead of `"text"` for values that are not UTF-8 and neither
//! for a null value, and `"name_base64"` beside the lossy `"name"` for a
//! name that is not UTF-8. Readable by an operator in psql, exact for replay.
//!
//! A record read with more headers than the relay reads holds at most
//! [`MAX_HEADERS`](relay_core::limits::MAX_HEADERS) of them; the entry standing for the rest
//! ([`relay_core::envelope::LeftOut`]) is stored as `{"left_out": <count>}`,
//! or `{"left_out": "unreadable"}`, so a replay of it is poison again.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use relay_core::Header;
use relay_core::envelope::LeftOut;
use serde_json::{Value, json};

/// Encode headers for a `jsonb` column.
pub fn to_json(headers: &[Header]) -> Value {
    Value::Array(
        headers
            .iter()
            .map(|h| {
                match h.as_left_out() {
                    Some(LeftOut::Headers(n)) => return json!({"left_out": n}),
                    Some(LeftOut::Unreadable) => return json!({"left_out": "unreadable"}),
                    None => {}
                }
                // jsonb cannot hold U+0000: such names and values go as base64 too.
                let name = h.name.replace('\0', "\u{fffd}");
                let mut item = match &h.value {
                    None => json!({"name": name}),
                    Some(v) => match std::str::from_utf8(v) {
                        Ok(text) if !text.contains('\0') => json!({"name": name, "text": text}),
                        _ => json!({"name": name, "base64": STANDARD.encode(v)}),
                    },
                };
                if h.raw_name.is_some() || name != h.name {
                    item["name_base64"] = Value::String(STANDARD.encode(h.name_bytes()));
                }
                item
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
                    match item.get("left_out") {
                        Some(Value::Number(n)) => {
                            let n = usize::try_from(n.as_u64()?).ok()?;
                            return Some(Header::left_out(LeftOut::Headers(n)));
                        }
                        Some(Value::String(_)) => return Some(Header::left_out(LeftOut::Unreadable)),
                        _ => {}
                    }
                    let value = if let Some(t) = item.get("text").and_then(Value::as_str) {
                        Some(t.as_bytes().to_vec())
                    } else if let Some(b) = item.get("base64").and_then(Value::as_str) {
                        Some(STANDARD.decode(b).ok()?)
                    } else {
                        None
                    };
                    match item.get("name_base64").and_then(Value::as_str) {
                        Some(b) => Some(Header::from_wire(&STANDARD.decode(b).ok()?, value)),
                        None => Some(Header::new(item.get("name")?.as_str()?, value)),
                    }
                })
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_core::limits::MAX_HEADERS;

    #[test]
    fn headers_round_trip_exactly_including_binary_and_null_values() {
        let hs = vec![
            Header::text("ce_id", "e-1"),
            Header::new("bin", Some(vec![0xff, 0x00, 0x10])),
            Header::new("nothing", None),
            Header::new("nul", Some(b"a\0b".to_vec())),
            Header::from_wire(b"\xff\xfe", Some(b"v".to_vec())),
            Header::from_wire(b"a\0b", None),
        ];
        assert_eq!(from_json(&to_json(&hs)), hs);
        assert_eq!(to_json(&hs)[0], json!({"name": "ce_id", "text": "e-1"}));
    }

    #[test]
    fn a_record_read_with_headers_left_out_stores_at_most_max_headers_and_how_many_it_left_out() {
        let mut hs: Vec<Header> = (0..MAX_HEADERS).map(|i| Header::new(format!("h{i}"), None)).collect();
        hs.push(Header::left_out(LeftOut::Headers(299_488)));
        let stored = to_json(&hs);
        let items = stored.as_array().unwrap();
        assert_eq!(items.iter().filter(|i| i.get("name").is_some()).count(), MAX_HEADERS);
        assert_eq!(items.last(), Some(&json!({"left_out": 299_488})));
        assert_eq!(from_json(&stored), hs, "read back as it was: a replay is poison again");
        let unreadable = vec![Header::left_out(LeftOut::Unreadable)];
        assert_eq!(to_json(&unreadable), json!([{"left_out": "unreadable"}]));
        assert_eq!(from_json(&to_json(&unreadable)), unreadable);
    }
}
