//! Entry points for the fuzz targets (`fuzz/`), also driven on stable by the
//! randomized tests below: decoding a record and rendering a template must
//! never panic, whatever the bytes. A panic in the consumer would crash-loop
//! it on a poison record instead of dead-lettering the record.

use serde_json::Value;

use crate::envelope::{DecodeOptions, FieldOverrides, FieldSource, RawRecord, TopicFormat, decode, resolve};
use crate::template::TemplateBuilder;

/// Decode and resolve `record` as a CloudEvents topic and as a plain JSON
/// topic with header/pointer/key sources. Errors are fine; panics are bugs.
pub fn exercise_envelope(record: &RawRecord, max_record_bytes: usize) {
    let none = FieldOverrides::default();
    let sources = FieldOverrides {
        id: Some(FieldSource::Header("id".into())),
        event_type: Some(FieldSource::Pointer("/type".into())),
        aggregate_id: Some(FieldSource::Key),
        aggregate_version: Some(FieldSource::Pointer("/v".into())),
        sequence: Some(FieldSource::Header("seq".into())),
        idempotency_key: Some(FieldSource::Extension("idempotencykey".into())),
        ..FieldOverrides::default()
    };
    // A registry format's value arrives decoded; with or without CloudEvents headers.
    let formats = [(TopicFormat::Cloudevents, &none), (TopicFormat::Json, &sources), (TopicFormat::Avro, &sources)];
    for (format, fields) in formats {
        let opts = DecodeOptions { max_record_bytes, format, fields };
        if let Ok(decoded) = decode(record, &opts) {
            let _ = resolve(record, decoded.clone(), fields);
            let _ = resolve(record, decoded, &none);
        }
    }
}

/// Compile `source` as a text and as a JSON template and render both against `ctx`.
pub fn exercise_template(source: &str, ctx: &Value) {
    let mut b = TemplateBuilder::default();
    let text = b.text("fuzz.text", source);
    let json = b.json("fuzz.json", &serde_json::json!({"a": source, "b": [source, 1]}));
    if let Ok(t) = b.finish() {
        let ctx = crate::template::Context::from(ctx.clone());
        let _ = t.render(&text, &ctx);
        let _ = t.render_json(&json, &ctx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::Header;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn valid() -> RawRecord {
        RawRecord {
            topic: "t".into(),
            partition: 0,
            offset: 0,
            key: Some(b"k".to_vec()),
            payload: Some(br#"{"type":"x","v":3,"order":{"id":"o"}}"#.to_vec()),
            headers: vec![
                Header::text("ce_specversion", "1.0"),
                Header::text("ce_id", "e"),
                Header::text("ce_type", "x"),
                Header::text("ce_source", "/s"),
                Header::text("ce_aggregateversion", "4"),
                Header::text("content-type", "application/json"),
                Header::text("id", "e"),
            ],
        }
    }

    fn mutate(rng: &mut StdRng, bytes: &mut Vec<u8>) {
        match rng.random_range(0..4) {
            0 if !bytes.is_empty() => {
                let i = rng.random_range(0..bytes.len());
                bytes[i] = rng.random();
            }
            1 if !bytes.is_empty() => {
                bytes.truncate(rng.random_range(0..bytes.len()));
            }
            2 => bytes.push(rng.random()),
            _ => {
                let i = rng.random_range(0..=bytes.len());
                bytes.insert(i, *b"{}[]\",:\\\0\xff".get(rng.random_range(0..11)).unwrap_or(&b'x'));
            }
        }
    }

    #[test]
    fn mutated_records_never_panic_the_decoder() {
        let mut rng = StdRng::seed_from_u64(0x5eed);
        for _ in 0..20_000 {
            let mut r = valid();
            for _ in 0..rng.random_range(1..6) {
                match rng.random_range(0..5) {
                    0 => mutate(&mut rng, r.payload.get_or_insert_with(Vec::new)),
                    1 => {
                        let i = rng.random_range(0..r.headers.len());
                        if rng.random_bool(0.2) {
                            r.headers[i].value = None;
                        } else {
                            mutate(&mut rng, r.headers[i].value.get_or_insert_with(Vec::new));
                        }
                    }
                    2 => {
                        let i = rng.random_range(0..r.headers.len());
                        r.headers.remove(i);
                        if r.headers.is_empty() {
                            r.headers.push(Header::text("ce_specversion", "0.3"));
                        }
                    }
                    3 => {
                        r.headers.push(Header::text("content-type", "application/cloudevents+json"));
                    }
                    _ => r.payload = None,
                }
            }
            exercise_envelope(&r, if rng.random_bool(0.1) { 16 } else { 1 << 20 });
        }
    }

    #[test]
    fn random_templates_and_contexts_never_panic_the_renderer() {
        let mut rng = StdRng::seed_from_u64(0xface);
        let pieces = [
            "{{", "}}", "{%", "%}", "data", ".", "x", "|", "tojson", "[0]", " ", "if", "for", "in", "endfor", "~", "'",
        ];
        let ctx = serde_json::json!({"data": {"x": [1, {"y": null}], "s": "\u{0}\u{ffff}"}, "id": "e"});
        for _ in 0..20_000 {
            let n = rng.random_range(0..12);
            let source: String = (0..n).map(|_| pieces[rng.random_range(0..pieces.len())]).collect();
            exercise_template(&source, &ctx);
        }
    }
}
