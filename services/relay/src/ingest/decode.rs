//! How routing reads a record ([`View`]): as it came, or, for a topic in a
//! Schema Registry format, with its value decoded to JSON by the registry.

use std::sync::Arc;

use relay_core::{Poison, PoisonClass, RawRecord, Router};

/// A record as routing reads it: itself, or for a topic in a Schema
/// Registry format its value decoded to JSON — or why that can never be.
/// The record itself is what is stored (inbox, dead letter), so a replay
/// decodes it again.
#[derive(Debug, Clone)]
pub enum View {
    /// The record as it came.
    Raw,
    /// The record with its value decoded to JSON.
    Decoded(RawRecord),
    /// The value can never be decoded as it is.
    Poison(Poison),
    /// The registry does not have the schema the value names, yet: tried
    /// again within the consumer's reference budget, then dead-lettered.
    NotYet(Poison),
}

impl View {
    /// The record routing reads, or why there is none.
    pub fn of<'r>(&'r self, record: &'r RawRecord) -> Result<&'r RawRecord, Poison> {
        match self {
            View::Raw => Ok(record),
            View::Decoded(r) => Ok(r),
            View::Poison(p) | View::NotYet(p) => Err(p.clone()),
        }
    }
}

/// How routing reads `record` ([`View`]) under `router`, its value decoded
/// with `registry` when its topic is in a Schema Registry format. `Err`
/// when the registry could not be asked (nothing is decided).
pub async fn view_of(
    router: &Router,
    registry: Option<&relay_registry::Registry>,
    record: &RawRecord,
) -> Result<View, String> {
    let format = router.topic_format(&record.topic);
    if !format.uses_registry() {
        return Ok(View::Raw);
    }
    // The limit is on the record as produced; its JSON may be larger (names
    // repeated per item, bytes as base64), up to `relay_registry::max_json_bytes`
    // of the value's size, past which the registry refuses it as oversized.
    let (size, max) = (record.content_size(), router.max_record_bytes());
    if size > max {
        let why = format!("record is {size} bytes, over consumer.max_record_bytes = {max}");
        return Ok(View::Poison(Poison::new(PoisonClass::Oversized, why)));
    }
    let Some(registry) = registry else {
        return Err(format!(
            "topic {:?} has format = {:?} and this process has no [schema_registry]",
            record.topic,
            format.as_str()
        ));
    };
    match registry.decode(format, &record.topic, record.payload.as_deref()).await {
        Ok(json) => {
            let mut decoded = record.clone();
            decoded.payload = Some(json);
            // The value is JSON now, whatever the producer declared (no
            // content type reads as JSON too, so none is added).
            if decoded.header("content-type").is_some() {
                decoded.headers.retain(|h| !h.name.eq_ignore_ascii_case("content-type"));
                decoded.headers.push(relay_core::envelope::Header::text("content-type", "application/json"));
            }
            Ok(View::Decoded(decoded))
        }
        Err(relay_registry::Failure::Poison(why)) => Ok(View::Poison(Poison::new(PoisonClass::BadEncoding, why))),
        Err(relay_registry::Failure::NotYet(why)) => Ok(View::NotYet(Poison::new(PoisonClass::BadEncoding, why))),
        Err(relay_registry::Failure::Unavailable(why)) => Err(why),
        Err(relay_registry::Failure::Oversized(why)) => Ok(View::Poison(Poison::new(PoisonClass::Oversized, why))),
    }
}

/// Decodes the values of one router's topics that are in a Schema Registry
/// format. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Decoder {
    router: Arc<Router>,
    registry: Option<Arc<relay_registry::Registry>>,
}

impl Decoder {
    /// A decoder of `router`'s topics through `registry` (none: only topics
    /// in no registry format can be read).
    pub fn new(router: Arc<Router>, registry: Option<Arc<relay_registry::Registry>>) -> Decoder {
        Decoder { router, registry }
    }

    /// Say that `record` was dead-lettered after its budget for "not yet":
    /// if the registry did not have its schema, the records naming the same
    /// id are dead-lettered after one ask for a while
    /// ([`relay_registry::Registry::gave_up`]).
    pub fn gave_up(&self, record: &RawRecord) {
        if let Some(registry) = &self.registry
            && self.router.topic_format(&record.topic).uses_registry()
        {
            registry.gave_up(record.payload.as_deref());
        }
    }

    /// How routing reads each record ([`View`]) from the start of `records`
    /// while their decoded values take `budget` bytes together, and always
    /// the first. `Err` when the registry could not be asked: nothing is
    /// decided, the partition waits. A value in a Schema Registry format is held as JSON for the
    /// whole batch, up to `relay_registry::max_json_bytes` of its size (16
    /// times and more): bounded by record, a batch of 200 records under 1
    /// MiB each could hold gigabytes. The record that does not fit is
    /// decoded again by the next batch.
    pub async fn views_within(&self, records: &[RawRecord], budget: usize) -> Result<Vec<View>, String> {
        let mut out = Vec::with_capacity(records.len());
        let mut held = 0usize;
        for record in records {
            let view = self.view(record).await?;
            if let View::Decoded(r) = &view {
                held = held.saturating_add(r.payload.as_ref().map_or(0, Vec::len));
            }
            if held > budget && !out.is_empty() {
                break;
            }
            out.push(view);
        }
        Ok(out)
    }

    /// [`Decoder::views_within`] of one record.
    pub async fn view(&self, record: &RawRecord) -> Result<View, String> {
        view_of(&self.router, self.registry.as_deref(), record).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_core::RelayConfig;
    use serde_json::json;

    /// A stand-in registry whose schema id 1 is an order of lines of eight
    /// fields, none with presence.
    async fn order_lines_registry() -> String {
        const SCHEMA: &str = "syntax = \"proto3\"; message Order { string order_id = 1; repeated Line lines = 2; } \
            message Line { string sku = 1; string name = 2; int64 quantity = 3; int64 unit_minor = 4; \
            string currency = 5; int64 tax_minor = 6; string warehouse = 7; bool gift = 8; }";
        let app = axum::Router::new().route(
            "/schemas/ids/{id}",
            axum::routing::get(|| async { json!({"schema": SCHEMA, "schemaType": "PROTOBUF"}).to_string() }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}")
    }

    #[tokio::test]
    async fn a_registry_value_that_decodes_past_its_bound_is_oversized_poison_and_a_normal_one_its_json() {
        let cfg = RelayConfig::from_toml(&format!(
            r#"
            consumer = {{ name = "c" }}
            [schema_registry]
            url = "{}"
            [topics.orders]
            format = "protobuf"
            fields.id = {{ pointer = "/order_id" }}
            fields.type = {{ value = "order.placed" }}
            "#,
            order_lines_registry().await
        ))
        .unwrap();
        let router = Router::new(&cfg).unwrap();
        let registry = relay_registry::Registry::new(cfg.schema_registry.as_ref().unwrap()).unwrap();
        // Schema id 1, indexes [0], order_id "o-1", one line with sku "A".
        let mut value = vec![0, 0, 0, 0, 1, 0, 0x0a, 3, b'o', b'-', b'1', 0x12, 3, 0x0a, 1, b'A'];
        let normal = RawRecord {
            topic: "orders".into(),
            partition: 0,
            offset: 0,
            key: None,
            payload: Some(value.clone()),
            headers: Vec::new(),
        };
        let View::Decoded(decoded) = view_of(&router, Some(&registry), &normal).await.unwrap() else {
            panic!("a normal value decodes");
        };
        let line = json!({"sku": "A", "name": "", "quantity": 0, "unit_minor": 0, "currency": "", "tax_minor": 0,
                          "warehouse": "", "gift": false});
        let data: serde_json::Value = serde_json::from_slice(decoded.payload.as_deref().unwrap()).unwrap();
        assert_eq!(data, json!({"order_id": "o-1", "lines": [line]}));
        // 100 000 empty lines: 200 kB on the wire, 10 MB of JSON.
        for _ in 0..100_000 {
            value.extend([0x12, 0x00]);
        }
        let bound = relay_registry::max_json_bytes(value.len());
        let hostile = RawRecord { payload: Some(value), ..normal };
        match view_of(&router, Some(&registry), &hostile).await.unwrap() {
            View::Poison(p) => {
                assert_eq!(p.class, PoisonClass::Oversized, "{p}");
                assert!(p.reason.contains(&format!("decodes to more than {bound} bytes of JSON")), "{p}");
                assert!(p.reason.contains("fewer items per record"), "{p}");
            }
            other => panic!("{other:?}"),
        }
    }
}
