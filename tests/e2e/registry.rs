//! Topics in the Confluent Schema Registry wire format, against a real
//! registry (Apicurio Registry's Confluent-compatible API, started by
//! `scripts/test.sh`) and records written by an independent implementation
//! of the format: Confluent's own Python serializer (`confluent-kafka` from
//! PyPI, `tests/registry/produce.py`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use crate::support::ops::*;
use crate::support::*;
use relay::Components;
use relay_cli::verify::{VerifyOptions, verify};
use relay_testkit::{read_topic, unique};
use serde_json::{Value, json};

/// The registry the test scripts started (`start_schema_registry`).
fn registry_url() -> String {
    std::env::var("RELAY_TEST_SCHEMA_REGISTRY_URL").expect(
        "RELAY_TEST_SCHEMA_REGISTRY_URL is not set: run the tests with scripts/test.sh, which starts Apicurio \
         Registry (start_schema_registry in scripts/lib.sh) and sets it",
    )
}

const ORDER_V1: &str = r#"{"type":"record","name":"OrderPlaced","namespace":"shop","fields":[
  {"name":"event_id","type":"string"},
  {"name":"order_id","type":"string"},
  {"name":"amount_cents","type":"long"},
  {"name":"price","type":{"type":"bytes","logicalType":"decimal","precision":9,"scale":2}}]}"#;

/// The producer ahead of relay: a new optional field (BACKWARD compatible).
const ORDER_V2: &str = r#"{"type":"record","name":"OrderPlaced","namespace":"shop","fields":[
  {"name":"event_id","type":"string"},
  {"name":"order_id","type":"string"},
  {"name":"amount_cents","type":"long"},
  {"name":"price","type":{"type":"bytes","logicalType":"decimal","precision":9,"scale":2}},
  {"name":"note","type":["null","string"],"default":null}]}"#;

/// An Avro topic whose id comes from the decoded value and whose events
/// are re-emitted as JSON with what the route read of them.
fn avro_config(h: &Harness, registry: &str) -> relay_core::RelayConfig {
    registry_config(h, registry, "avro")
}

/// [`avro_config`] for a topic of `format`.
fn registry_config(h: &Harness, registry: &str, format: &str) -> relay_core::RelayConfig {
    let data = r#"{ order_id = "{{ data.order_id }}", cents = "{{ data.amount_cents }}", price = "{{ data.price }}", note = "{{ data.note | default('') }}" }"#;
    route_config(h, registry, format, None, data)
}

/// A topic of `format` whose route emits `data` (a TOML inline table of
/// templates) to the out topic in the same format, keyed by the order id.
fn formatted_route(h: &Harness, registry: &str, format: &str, data: &str) -> relay_core::RelayConfig {
    route_config(h, registry, format, Some(format), data)
}

/// A topic of `format` (ids from `/event_id`, every record an
/// `order.placed`) whose route emits `data` to the out topic, in
/// `emit_format` or as JSON.
fn route_config(
    h: &Harness,
    registry: &str,
    format: &str,
    emit_format: Option<&str>,
    data: &str,
) -> relay_core::RelayConfig {
    let emit_format = emit_format.map(|f| format!("format = \"{f}\"\n")).unwrap_or_default();
    h.config(&format!(
        r#"
[schema_registry]
url = "{registry}"
timeout = "2s"

[topics."{{topic}}"]
format = "{format}"
fields.id = {{ pointer = "/event_id" }}
fields.type = {{ value = "order.placed" }}

[[routes]]
topic = "{{topic}}"
type = "order.placed"

[[routes.actions]]
kind = "emit"
name = "payment"
type = "payment.requested"
topic = "{{out}}"
{emit_format}key = "{{{{ data.order_id }}}}"
data = {data}
"#
    ))
}

/// Produce `records` ({key, value}) to the input topic with Confluent's
/// serializer of `format` (`avro`, `json`, `protobuf`: see `produce.py`) and `schema`; the schema id it
/// registered.
async fn produce(h: &Harness, registry: &str, format: &str, schema: &str, records: Value) -> u32 {
    produce_to(h, registry, format, &h.topic, schema, records).await
}

/// [`produce`] to `topic`; with no records, only registers the schema.
async fn produce_to(h: &Harness, registry: &str, format: &str, topic: &str, schema: &str, records: Value) -> u32 {
    let python = std::env::var("RELAY_TEST_PYTHON").expect(
        "RELAY_TEST_PYTHON is not set: run the tests with scripts/test.sh, which installs confluent-kafka into \
         .cache/python (ensure_python_example_deps in scripts/lib.sh) and sets it",
    );
    let file = std::env::temp_dir().join(format!("{}.avsc", unique("schema")));
    std::fs::write(&file, schema).expect("write schema");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/registry/produce.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .args([format, &h.bootstrap, registry, topic, &file.display().to_string(), &records.to_string()])
        .output()
        .await
        .expect("run the Python producer");
    assert!(out.status.success(), "the Python producer failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().parse().expect("the schema id the producer printed")
}

/// A JSON record of the out topic by key.
async fn emitted(h: &Harness, n: usize) -> std::collections::HashMap<String, Value> {
    read_topic(&h.bootstrap, &h.out, n)
        .await
        .expect("read the out topic")
        .into_iter()
        .map(|r| {
            let data: Value = serde_json::from_slice(r.payload.as_deref().unwrap_or_default()).expect("JSON event");
            (String::from_utf8(r.key.unwrap_or_default()).unwrap(), data)
        })
        .collect()
}

async fn dead_letters(h: &Harness) -> Vec<(i64, String, String)> {
    sqlx::query_as(r#"SELECT "offset", error_class, reason FROM relay.dead_letters ORDER BY "offset""#)
        .fetch_all(&h.db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn avro_records_from_confluent_s_serializer_are_routed_and_undecodable_ones_dead_lettered_naming_id_and_topic() {
    let h = Harness::new(1).await;
    let registry = registry_url();
    let v1 = produce(
        &h,
        &registry,
        "avro",
        ORDER_V1,
        json!([
            {"key": "o-1", "value": {"event_id": "e-1", "order_id": "o-1", "amount_cents": 1250, "price": {"$decimal": "12.50"}}},
            {"key": "o-2", "value": {"event_id": "e-2", "order_id": "o-2", "amount_cents": 99, "price": {"$decimal": "0.99"}}},
        ]),
    )
    .await;
    // Not the wire format (a JSON producer on the topic), then an id no registry has.
    h.producer.raw(&h.topic, None, Some(b"o-3"), &[], Some(br#"{"event_id":"e-3"}"#)).await.unwrap();
    h.producer.raw(&h.topic, None, Some(b"o-4"), &[], Some(&[0, 0x7f, 0xff, 0xff, 0xf0, 2, 4])).await.unwrap();
    // An id above any a registry gives (its API answers a bare 404), and a
    // known id whose datum ends early.
    h.producer.raw(&h.topic, None, Some(b"o-6"), &[], Some(&[0, 0xff, 0xff, 0xff, 0xff, 2])).await.unwrap();
    let mut short = vec![0];
    short.extend(v1.to_be_bytes());
    short.extend([2]);
    h.producer.raw(&h.topic, None, Some(b"o-7"), &[], Some(&short)).await.unwrap();
    // The producer moves ahead of relay: a new optional field.
    let v2 = produce(
        &h,
        &registry,
        "avro",
        ORDER_V2,
        json!([{"key": "o-5", "value": {"event_id": "e-5", "order_id": "o-5", "amount_cents": 7, "price": {"$decimal": "0.07"}, "note": "gift"}}]),
    )
    .await;
    assert_ne!(v1, v2, "the evolved schema has an id of its own");

    let cfg = avro_config(&h, &registry);
    let run = h.start(cfg.clone(), Components::ALL, no_faults()).await;
    h.await_inbox(3).await;
    h.await_published(3).await;
    run.stop().await.unwrap();
    let seen = emitted(&h, 3).await;
    // `relay verify` reads the topic as the consumer did: every record
    // applied or parked, none lost, none poison left unparked.
    let report = verify(&cfg, &h.db.pool, &VerifyOptions::default()).await.unwrap();
    assert!(report.ok(), "{report:?}");
    assert_eq!((report.input_records, report.poison_records, report.dead_letters), (7, 4, 4), "{report:?}");

    assert_eq!(seen["o-1"], json!({"order_id": "o-1", "cents": 1250, "price": "12.50", "note": ""}));
    assert_eq!(seen["o-2"], json!({"order_id": "o-2", "cents": 99, "price": "0.99", "note": ""}));
    assert_eq!(seen["o-5"], json!({"order_id": "o-5", "cents": 7, "price": "0.07", "note": "gift"}));
    let dead = dead_letters(&h).await;
    let says = [
        ("magic byte", ""),
        // Not in the registry: tried again within the reference budget, then parked.
        ("schema id 2147483632", "40403"),
        ("schema id 4294967295", "above the largest"),
        (&*format!("schema id {v1}"), "does not decode"),
    ];
    assert_eq!(dead.len(), says.len(), "{dead:?}");
    for ((_, class, reason), (a, b)) in dead.iter().zip(says) {
        assert_eq!(class, "bad_encoding");
        assert!(reason.contains(&h.topic) && reason.contains(a) && reason.contains(b), "{a:?} {b:?} in {reason}");
    }
}

/// A value whose JSON is many times its bytes: an array of booleans is a
/// byte each in Avro and `false,` in JSON.
const FLAGS: &str = r#"{"type":"record","name":"Flags","namespace":"shop","fields":[
  {"name":"event_id","type":"string"},
  {"name":"order_id","type":"string"},
  {"name":"flags","type":{"type":"array","items":"boolean"}}]}"#;

// A batch held every record's decoded JSON at once, bounded only by record
// (16 times its bytes and more): 200 records under 1 MiB each could hold
// gigabytes. The decoded JSON now counts against the partition's share of
// max_buffered_bytes, and a batch ends where it is spent.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_holds_no_more_decoded_json_than_its_partition_s_share_of_the_buffer() {
    let h = Harness::new(1).await;
    let registry = registry_url();
    // 12 records of about 1.5 KB, each about 9 KB as JSON: their bytes
    // (18 KB) fit one batch under a 32 KiB buffer, their JSON does not.
    // (Small, as the producer takes them as one command-line argument.)
    let records: Vec<Value> = (0..12)
        .map(|i| json!({"key": format!("o-{i}"), "value": {"event_id": format!("e-{i}"), "order_id": format!("o-{i}"), "flags": vec![false; 1_500]}}))
        .collect();
    produce(&h, &registry, "avro", FLAGS, Value::Array(records)).await;
    let mut cfg = route_config(&h, &registry, "avro", None, r#"{ order_id = "{{ data.order_id }}" }"#);
    cfg.consumer.max_record_bytes = 16 * 1024;
    cfg.consumer.max_buffered_bytes = 32 * 1024;
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    h.await_inbox(12).await;
    run.stop().await.unwrap();
    // One transaction per batch: the inbox rows of a batch share their xmin.
    let batches: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT xmin::text) FROM relay.inbox").fetch_one(&h.db.pool).await.unwrap();
    assert!(batches >= 3, "12 records of 9 KB of JSON in {batches} batches under a 32 KiB share");
}

/// Records naming an id the registry does not have: the first spends the
/// reference budget, the ones after it are dead-lettered after one more ask
/// each, and the partition goes on.
#[tokio::test(flavor = "multi_thread")]
async fn records_naming_an_id_the_registry_does_not_have_are_dead_lettered_without_a_budget_each() {
    let h = Harness::new(1).await;
    let registry = registry_url();
    let unknown = [0, 0x7f, 0xff, 0xff, 0xf0, 2, 4];
    for n in 0..20 {
        h.producer.raw(&h.topic, None, Some(format!("o-{n}").as_bytes()), &[], Some(&unknown)).await.unwrap();
    }
    produce(
        &h,
        &registry,
        "avro",
        ORDER_V1,
        json!([{"key": "o-ok", "value": {"event_id": "e-ok", "order_id": "o-ok", "amount_cents": 5, "price": {"$decimal": "0.05"}}}]),
    )
    .await;
    let mut cfg = avro_config(&h, &registry);
    // The default budget: 8 asks over about 8 s.
    cfg.consumer.reference_retry = relay_core::config::RetryBudget::default();
    let started = std::time::Instant::now();
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    // The first record's budget takes up to 16 s; twenty budgets would take minutes.
    let within = std::time::Duration::from_secs(45);
    loop {
        let (dead, inbox) = (dead_letters(&h).await.len(), h.inbox().await);
        if dead == 20 && inbox == 1 {
            break;
        }
        assert!(started.elapsed() < within, "after {within:?}: {dead} of 20 dead-lettered, {inbox} applied");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    run.stop().await.unwrap();
    let dead = dead_letters(&h).await;
    for (i, (_, class, reason)) in dead.iter().enumerate() {
        assert_eq!(class, "bad_encoding");
        assert!(
            reason.contains(&h.topic) && reason.contains("schema id 2147483632") && reason.contains("40403"),
            "{reason}"
        );
        assert_eq!(i > 0, reason.contains("dead-lettered at once"), "record {i}: {reason}");
    }
    assert_eq!(h.outcome("e-ok").await.as_deref(), Some("applied"));
}

/// A stand-in in front of the real registry that answers 503 until `up`.
async fn flaky_registry(real: String, up: Arc<AtomicBool>, asked: Arc<AtomicU32>) -> String {
    use axum::extract::{Path, State};
    use axum::http::StatusCode;
    type Shared = (String, Arc<AtomicBool>, Arc<AtomicU32>);
    async fn by_id(State((real, up, asked)): State<Shared>, Path(id): Path<u32>) -> (StatusCode, String) {
        asked.fetch_add(1, Ordering::SeqCst);
        if !up.load(Ordering::SeqCst) {
            return (StatusCode::SERVICE_UNAVAILABLE, "down for maintenance".into());
        }
        let resp = reqwest::get(format!("{real}/schemas/ids/{id}")).await.expect("the real registry");
        (StatusCode::from_u16(resp.status().as_u16()).unwrap(), resp.text().await.unwrap())
    }
    let app = axum::Router::new().route("/schemas/ids/{id}", axum::routing::get(by_id)).with_state((real, up, asked));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_registry_that_is_down_holds_the_partition_and_dead_letters_nothing_until_it_is_back() {
    let h = Harness::new(1).await;
    let real = registry_url();
    produce(
        &h,
        &real,
        "avro",
        ORDER_V1,
        json!([{"key": "o-1", "value": {"event_id": "e-1", "order_id": "o-1", "amount_cents": 5, "price": {"$decimal": "0.05"}}}]),
    )
    .await;
    let (up, asked) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU32::new(0)));
    let flaky = flaky_registry(real, up.clone(), asked.clone()).await;
    let run = h.start(avro_config(&h, &flaky), Components::ALL, no_faults()).await;
    eventually("the consumer to ask the registry three times", DEADLINE, || async {
        (asked.load(Ordering::SeqCst) >= 3).then_some(())
    })
    .await;
    assert_eq!(h.inbox().await, 0, "nothing is written while the schema cannot be read");
    assert!(dead_letters(&h).await.is_empty(), "a registry outage dead-letters nothing");
    assert_eq!(h.committed_total().await, 0, "the offset stays where it was");
    up.store(true, Ordering::SeqCst);
    h.await_inbox(1).await;
    assert_eq!(h.outcome("e-1").await.as_deref(), Some("applied"));
    run.stop().await.unwrap();
    assert!(dead_letters(&h).await.is_empty());
}

const ORDER_JSON: &str = r#"{"$schema":"http://json-schema.org/draft-07/schema#","title":"OrderPlaced","type":"object",
  "properties":{"event_id":{"type":"string"},"order_id":{"type":"string"},"amount_cents":{"type":"integer"},
    "price":{"type":"string"},"note":{"type":"string"}},
  "required":["event_id","order_id","amount_cents","price"]}"#;

#[tokio::test(flavor = "multi_thread")]
async fn json_schema_records_are_checked_against_their_registered_schema_and_routed() {
    let h = Harness::new(1).await;
    let registry = registry_url();
    let id = produce(
        &h,
        &registry,
        "json",
        ORDER_JSON,
        json!([{"key": "o-1", "value": {"event_id": "e-1", "order_id": "o-1", "amount_cents": 1250, "price": "12.50", "note": "gift"}}]),
    )
    .await;
    // The wire format with the registered id, but a value its schema refuses.
    let mut bad = vec![0];
    bad.extend(id.to_be_bytes());
    bad.extend(br#"{"event_id":"e-2","order_id":"o-2","price":"1.00"}"#);
    h.producer.raw(&h.topic, None, Some(b"o-2"), &[], Some(&bad)).await.unwrap();
    // An Avro schema's id (registered under another subject) on a JSON Schema topic.
    let avro = register(&registry, &format!("{}-value", unique("other")), "AVRO", ORDER_V1).await;
    let mut wrong = vec![0];
    wrong.extend(avro.to_be_bytes());
    wrong.extend([2, b'e']);
    h.producer.raw(&h.topic, None, Some(b"o-3"), &[], Some(&wrong)).await.unwrap();

    let run = h.start(registry_config(&h, &registry, "json-schema"), Components::ALL, no_faults()).await;
    h.await_inbox(1).await;
    h.await_published(1).await;
    eventually("two dead letters", DEADLINE, || async { (dead_letters(&h).await.len() == 2).then_some(()) }).await;
    run.stop().await.unwrap();

    let seen = emitted(&h, 1).await;
    assert_eq!(seen["o-1"], json!({"order_id": "o-1", "cents": 1250, "price": "12.50", "note": "gift"}));
    let dead = dead_letters(&h).await;
    let (_, class, reason) = &dead[0];
    assert_eq!(class, "bad_encoding");
    assert!(
        reason.contains(&format!("schema id {id}")) && reason.contains("required property \"amount_cents\" is missing"),
        "{reason}"
    );
    let (_, class, reason) = &dead[1];
    assert_eq!(class, "bad_encoding");
    assert!(reason.contains(&format!("schema id {avro}")) && reason.contains("of type Avro"), "{reason}");
}

/// What relay emitted on the out topic, read by Confluent's deserializer
/// of `format`: (key, content type, value) by key.
async fn consumed(
    h: &Harness,
    registry: &str,
    format: &str,
    n: usize,
) -> std::collections::HashMap<String, (String, Value)> {
    consumed_with(h, registry, format, n, None).await
}

/// [`consumed`], with the Protobuf message to read as (`consume.py`'s
/// SCHEMA_FILE).
async fn consumed_with(
    h: &Harness,
    registry: &str,
    format: &str,
    n: usize,
    spec: Option<&std::path::Path>,
) -> std::collections::HashMap<String, (String, Value)> {
    let python = std::env::var("RELAY_TEST_PYTHON").expect("RELAY_TEST_PYTHON is not set: run scripts/test.sh");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/registry/consume.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .args([format, &h.bootstrap, registry, &h.out, &n.to_string()])
        .args(spec)
        .output()
        .await
        .expect("run the Python consumer");
    assert!(out.status.success(), "the Python consumer failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).expect("a JSON line");
            let key = v["key"].as_str().unwrap().to_owned();
            let mut value = v["value"].clone();
            if format == "protobuf" {
                // Read without the registry (consume.py says why): the id and the message indexes are checked here.
                value["$schema_id"] = v["schema_id"].clone();
                value["$message_indexes"] = v["message_indexes"].clone();
            }
            (key, (v["content_type"].as_str().unwrap_or_default().to_owned(), value))
        })
        .collect()
}

/// Register `schema` of `kind` (`AVRO`, `JSON`, `PROTOBUF`) under `subject`; its id.
async fn register(registry: &str, subject: &str, kind: &str, schema: &str) -> u32 {
    register_with(registry, subject, kind, schema, json!([])).await
}

/// [`register`] with schema `references` ([{name, subject, version}]).
async fn register_with(registry: &str, subject: &str, kind: &str, schema: &str, references: Value) -> u32 {
    let registered: Value = reqwest::Client::new()
        .post(format!("{registry}/subjects/{subject}/versions"))
        .json(&json!({"schema": schema, "schemaType": kind, "references": references}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    u32::try_from(registered["id"].as_u64().unwrap_or_else(|| panic!("an id: {registered}"))).unwrap()
}

const PAYMENT: &str = r#"{"type":"record","name":"PaymentRequested","namespace":"pay","fields":[
  {"name":"order_id","type":"string"},
  {"name":"amount","type":{"type":"bytes","logicalType":"decimal","precision":9,"scale":2}},
  {"name":"cents","type":"long"},
  {"name":"channel","type":{"type":"enum","name":"Channel","symbols":["WEB","STORE"]},"default":"WEB"},
  {"name":"note","type":["null","string"],"default":null},
  {"name":"placed","type":{"type":"long","logicalType":"timestamp-millis"}}]}"#;

#[tokio::test(flavor = "multi_thread")]
async fn an_avro_record_comes_out_as_avro_that_confluent_s_deserializer_reads_and_a_misfit_fails_at_ingest() {
    let h = Harness::new(1).await;
    let registry = registry_url();
    let id = register(&registry, &format!("{}-value", h.out), "AVRO", PAYMENT).await;
    produce(
        &h,
        &registry,
        "avro",
        ORDER_V1,
        json!([
            {"key": "o-1", "value": {"event_id": "e-1", "order_id": "o-1", "amount_cents": 1250, "price": {"$decimal": "12.50"}}},
            // Its cents do not fit a long once the route prefixes them: poison at ingest.
            {"key": "o-2", "value": {"event_id": "e-2", "order_id": "o-2", "amount_cents": 7, "price": {"$decimal": "0.07"}}},
        ]),
    )
    .await;
    let cfg = formatted_route(
        &h,
        &registry,
        "avro",
        r#"{ order_id = "{{ data.order_id }}", amount = "{{ data.price }}", cents = "{% if data.order_id == 'o-2' %}x{% endif %}{{ data.amount_cents }}", note = "for {{ data.order_id }}", placed = "2026-12-05T10:00:00.250Z" }"#,
    );
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    h.await_inbox(1).await;
    h.await_published(1).await;
    eventually("the misfit dead-lettered", DEADLINE, || async { (!dead_letters(&h).await.is_empty()).then_some(()) })
        .await;
    run.stop().await.unwrap();

    let read = consumed(&h, &registry, "avro", 1).await;
    let (content_type, value) = &read["o-1"];
    assert_eq!(content_type, "application/avro");
    assert_eq!(
        value,
        &json!({"order_id": "o-1", "amount": "12.50", "cents": 1250, "channel": "WEB", "note": "for o-1",
                "placed": "2026-12-05T10:00:00.250000+00:00"})
    );
    let dead = dead_letters(&h).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    let (_, class, reason) = &dead[0];
    assert_eq!(class, "schema_invalid");
    let subject = format!("subject {}-value, schema id {id}", h.out);
    assert!(reason.contains(&subject) && reason.contains("/cents: expected an integer, found text"), "{reason}");
    assert!(!reason.contains("x7"), "the reason names the field, never the value: {reason}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_json_schema_emit_is_checked_at_ingest_and_read_by_confluent_s_deserializer() {
    let h = Harness::new(1).await;
    let registry = registry_url();
    let schema = r#"{"type":"object","properties":{"order_id":{"type":"string"},"cents":{"type":"integer"}},"required":["order_id","cents"]}"#;
    register(&registry, &format!("{}-value", h.out), "JSON", schema).await;
    produce(
        &h,
        &registry,
        "json",
        ORDER_JSON,
        json!([
            {"key": "o-1", "value": {"event_id": "e-1", "order_id": "o-1", "amount_cents": 1250, "price": "12.50"}},
            {"key": "o-2", "value": {"event_id": "e-2", "order_id": "o-2", "amount_cents": 7, "price": "0.07"}},
        ]),
    )
    .await;
    let cfg = formatted_route(
        &h,
        &registry,
        "json-schema",
        r#"{ order_id = "{{ data.order_id }}", cents = "{{ data.amount_cents if data.order_id == 'o-1' else 'x' }}" }"#,
    );
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    h.await_inbox(1).await;
    h.await_published(1).await;
    eventually("the misfit dead-lettered", DEADLINE, || async { (!dead_letters(&h).await.is_empty()).then_some(()) })
        .await;
    run.stop().await.unwrap();

    let read = consumed(&h, &registry, "json", 1).await;
    let (content_type, value) = &read["o-1"];
    assert_eq!(content_type, "application/json");
    assert_eq!(value, &json!({"order_id": "o-1", "cents": 1250}));
    let (_, class, reason) = &dead_letters(&h).await[0];
    assert_eq!(class, "schema_invalid");
    assert!(reason.contains("/cents fails \"type\""), "{reason}");
}

/// JSON Schema references as Confluent's serializers write them: the name
/// is the `$ref`, here one reference of another (money.json names
/// currency.json). Both directions: records the Python serializer wrote with
/// them are checked through every level (one that does not fit the
/// referenced schema is poison naming its field), and what relay writes is
/// checked against them at ingest and read back by the Python deserializer,
/// which resolves them itself.
#[tokio::test(flavor = "multi_thread")]
async fn json_schemas_that_refer_to_other_subjects_are_read_and_written() {
    let h = Harness::new(1).await;
    let registry = registry_url();
    let currency_subject = unique("currency");
    // Apicurio takes a schema that is not an object only with its `$schema`.
    let currency = r#"{"$schema":"http://json-schema.org/draft-07/schema#","type":"string","pattern":"^[A-Z]{3}$"}"#;
    register(&registry, &currency_subject, "JSON", currency).await;
    let money_subject = unique("money");
    let money = r#"{"$schema":"http://json-schema.org/draft-07/schema#","type":"object",
        "properties":{"minor":{"type":"integer"},"currency":{"$ref":"currency.json"}},
        "required":["minor","currency"]}"#;
    let currency = json!([{"name": "currency.json", "subject": currency_subject, "version": 1}]);
    register_with(&registry, &money_subject, "JSON", money, currency).await;
    let reference = json!([{"name": "money.json", "subject": money_subject, "version": 1}]);
    let order = r#"{"type":"object","properties":{"event_id":{"type":"string"},"order_id":{"type":"string"},
        "total":{"$ref":"money.json"}},"required":["event_id","order_id","total"]}"#;
    let id = produce(
        &h,
        &registry,
        "json",
        &json!({"schema": order, "references": reference}).to_string(),
        json!([
            {"key": "o-1", "value": {"event_id": "e-1", "order_id": "o-1", "total": {"minor": 1250, "currency": "EUR"}}},
            {"key": "o-3", "value": {"event_id": "e-3", "order_id": "o-3", "total": {"minor": 7, "currency": "EUR"}}},
        ]),
    )
    .await;
    // The registered id, but a currency the reference's reference refuses
    // (the Python serializer would not write it).
    let mut bad = vec![0];
    bad.extend(id.to_be_bytes());
    bad.extend(br#"{"event_id":"e-2","order_id":"o-2","total":{"minor":5,"currency":"euro"}}"#);
    h.producer.raw(&h.topic, None, Some(b"o-2"), &[], Some(&bad)).await.unwrap();
    let charge = r#"{"type":"object","properties":{"order_id":{"type":"string"},"amount":{"$ref":"money.json"}},
        "required":["order_id","amount"]}"#;
    register_with(&registry, &format!("{}-value", h.out), "JSON", charge, reference).await;
    // o-3's amount does not fit money.json once written: refused at ingest.
    let cfg = formatted_route(
        &h,
        &registry,
        "json-schema",
        r#"{ order_id = "{{ data.order_id }}", amount = { minor = "{{ data.total.minor if data.order_id == 'o-1' else 'x' }}", currency = "{{ data.total.currency }}" } }"#,
    );
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    h.await_inbox(1).await;
    h.await_published(1).await;
    eventually("two dead letters", DEADLINE, || async { (dead_letters(&h).await.len() == 2).then_some(()) }).await;
    run.stop().await.unwrap();

    let read = consumed(&h, &registry, "json", 1).await;
    assert_eq!(read["o-1"].1, json!({"order_id": "o-1", "amount": {"minor": 1250, "currency": "EUR"}}));
    // In offset order: o-3 (the producer's second record), then o-2.
    let dead = dead_letters(&h).await;
    let (_, class, reason) = &dead[1];
    assert_eq!(class, "bad_encoding");
    assert!(reason.contains(&format!("schema id {id}")) && reason.contains("/total/currency"), "{reason}");
    assert!(!reason.contains("euro"), "the reason names the field, never the value: {reason}");
    let (_, class, reason) = &dead[0];
    assert_eq!(class, "schema_invalid");
    assert!(reason.contains("/amount/minor"), "{reason}");
}

/// The input's `.proto` files as the producer compiles them (with protoc):
/// an import the serializer registers as a reference, and a well-known type.
fn order_proto(with_note: bool) -> String {
    let note = if with_note { "  string note = 5;\n" } else { "" };
    json!({
        "files": {
            "shop/money.proto": "syntax = \"proto3\";\npackage shop;\nmessage Money { int64 minor = 1; string currency = 2; }\n",
            "shop/order.proto": format!(
                "syntax = \"proto3\";\npackage shop;\nimport \"shop/money.proto\";\nimport \"google/protobuf/timestamp.proto\";\n\
                 message OrderPlaced {{\n  string event_id = 1;\n  string order_id = 2;\n  shop.Money total = 3;\n  \
                 google.protobuf.Timestamp placed = 4;\n{note}}}\n"
            ),
        },
        "file": "shop/order.proto",
        "message": "shop.OrderPlaced",
    })
    .to_string()
}

/// What relay emits, with an import.
const PAYMENT_PROTO: &str = "syntax = \"proto3\";\npackage pay;\nimport \"pay/channel.proto\";\n\
    message PaymentRequested {\n  string order_id = 1;\n  int64 cents = 2;\n  string currency = 3;\n  \
    pay.Channel channel = 4;\n  repeated string tags = 5;\n}\n";
// A message beside the enum: Apicurio cannot give a file without one in the
// `format=serialized` form Confluent's deserializer asks references in (HTTP 500).
const CHANNEL_PROTO: &str =
    "syntax = \"proto3\";\npackage pay;\nenum Channel { WEB = 0; STORE = 1; }\nmessage Till { string id = 1; }\n";

#[tokio::test(flavor = "multi_thread")]
async fn protobuf_records_from_confluent_s_serializer_come_out_as_protobuf_that_its_deserializer_reads() {
    let h = Harness::new(1).await;
    let registry = registry_url();
    // The emit's schema, registered by Confluent's serializer as a producer
    // of the topic would: a descriptor, its import as a reference.
    let out_spec = json!({"files": {"pay/payment.proto": PAYMENT_PROTO, "pay/channel.proto": CHANNEL_PROTO},
                          "file": "pay/payment.proto", "message": "pay.PaymentRequested"})
    .to_string();
    let out_id = produce_to(&h, &registry, "protobuf", &h.out, &out_spec, json!([])).await;

    let v1 = produce(
        &h,
        &registry,
        "protobuf",
        &order_proto(false),
        json!([
            {"key": "o-1", "value": {"event_id": "e-1", "order_id": "o-1", "total": {"minor": "1250", "currency": "EUR"}, "placed": "2026-12-05T10:00:00Z"}},
            // The route writes text where the emit's schema has an int64: poison at ingest.
            {"key": "o-2", "value": {"event_id": "e-2", "order_id": "o-2", "total": {"minor": "7", "currency": "EUR"}}},
        ]),
    )
    .await;
    // The producer moves ahead of relay: a new field.
    let v2 = produce(
        &h,
        &registry,
        "protobuf",
        &order_proto(true),
        json!([{"key": "o-3", "value": {"event_id": "e-3", "order_id": "o-3", "total": {"minor": "99", "currency": "USD"}, "note": "gift"}}]),
    )
    .await;
    assert_ne!(v1, v2, "the evolved schema has an id of its own");
    // The registered id, but message indexes naming no message, then bytes
    // that end inside a field.
    let framed = |tail: &[u8]| {
        let mut v = vec![0];
        v.extend(v1.to_be_bytes());
        v.extend(tail);
        v
    };
    h.producer.raw(&h.topic, None, Some(b"o-4"), &[], Some(&framed(&[2, 6]))).await.unwrap();
    h.producer.raw(&h.topic, None, Some(b"o-5"), &[], Some(&framed(&[0, 0x0a, 0x20, b'e']))).await.unwrap();

    let cfg = formatted_route(
        &h,
        &registry,
        "protobuf",
        r#"{ order_id = "{{ data.order_id }}", cents = "{% if data.order_id == 'o-2' %}x{% endif %}{{ data.total.minor }}", currency = "{{ data.total.currency }}", channel = "STORE", tags = ["{{ data.note | default('none') }}", "{{ data.placed | default('') }}"] }"#,
    );
    let run = h.start(cfg.clone(), Components::ALL, no_faults()).await;
    h.await_inbox(2).await;
    h.await_published(2).await;
    eventually("three dead letters", DEADLINE, || async { (dead_letters(&h).await.len() == 3).then_some(()) }).await;
    run.stop().await.unwrap();
    let report = verify(&cfg, &h.db.pool, &VerifyOptions::default()).await.unwrap();
    assert!(report.ok(), "{report:?}");
    assert_eq!((report.input_records, report.poison_records), (5, 2), "{report:?}");

    let spec = std::env::temp_dir().join(format!("{}.json", unique("payment-proto")));
    std::fs::write(&spec, &out_spec).unwrap();
    let read = consumed_with(&h, &registry, "protobuf", 2, Some(&spec)).await;
    let (content_type, value) = &read["o-1"];
    assert_eq!(content_type, "application/x-protobuf");
    // Python's JSON mapping writes int64 as text; the timestamp is RFC 3339.
    assert_eq!(
        value,
        &json!({"order_id": "o-1", "cents": "1250", "currency": "EUR", "channel": "STORE",
                "tags": ["none", "2026-12-05T10:00:00Z"], "$schema_id": out_id, "$message_indexes": [0]})
    );
    assert_eq!(read["o-3"].1["tags"], json!(["gift", ""]), "the newer field reached the route");

    let dead = dead_letters(&h).await;
    let by_class =
        |class: &str| dead.iter().filter(|(_, c, _)| c == class).map(|(_, _, r)| r.clone()).collect::<Vec<_>>();
    let invalid = by_class("schema_invalid");
    assert_eq!(invalid.len(), 1, "{dead:?}");
    assert!(
        invalid[0].contains(&format!("schema id {out_id}"))
            && invalid[0].contains("at /cents")
            && !invalid[0].contains("x7"),
        "names the field, never the value: {}",
        invalid[0]
    );
    let bad = by_class("bad_encoding");
    assert_eq!(bad.len(), 2, "{dead:?}");
    assert!(bad.iter().all(|r| r.contains(&h.topic) && r.contains(&format!("schema id {v1}"))), "{bad:?}");
    assert!(bad.iter().any(|r| r.contains("name no message")), "{bad:?}");
    assert!(bad.iter().any(|r| r.contains("does not decode as shop.OrderPlaced")), "{bad:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn avro_schemas_that_refer_to_other_subjects_are_read_and_written() {
    let h = Harness::new(1).await;
    let registry = registry_url();
    let money = r#"{"type":"record","name":"Money","namespace":"shop","fields":[
        {"name":"minor","type":"long"},{"name":"currency","type":"string"}]}"#;
    let money_subject = unique("shop.Money");
    register(&registry, &money_subject, "AVRO", money).await;
    let reference = json!([{"name": "shop.Money", "subject": money_subject, "version": 1}]);
    let order = r#"{"type":"record","name":"Placed","namespace":"shop","fields":[
        {"name":"event_id","type":"string"},{"name":"order_id","type":"string"},{"name":"total","type":"shop.Money"}]}"#;
    produce(
        &h,
        &registry,
        "avro",
        &json!({"schema": order, "references": reference}).to_string(),
        json!([{"key": "o-1", "value": {"event_id": "e-1", "order_id": "o-1", "total": {"minor": 1250, "currency": "EUR"}}}]),
    )
    .await;
    // What relay writes uses the same referenced type.
    let charge = r#"{"type":"record","name":"Charge","namespace":"pay","fields":[
        {"name":"order_id","type":"string"},{"name":"amount","type":"shop.Money"}]}"#;
    register_with(&registry, &format!("{}-value", h.out), "AVRO", charge, reference).await;
    let cfg = formatted_route(
        &h,
        &registry,
        "avro",
        r#"{ order_id = "{{ data.order_id }}", amount = { minor = "{{ data.total.minor }}", currency = "{{ data.total.currency }}" } }"#,
    );
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    h.await_inbox(1).await;
    h.await_published(1).await;
    run.stop().await.unwrap();
    assert!(dead_letters(&h).await.is_empty(), "{:?}", dead_letters(&h).await);
    let read = consumed(&h, &registry, "avro", 1).await;
    assert_eq!(read["o-1"].1, json!({"order_id": "o-1", "amount": {"minor": 1250, "currency": "EUR"}}));
}

/// What a capture's outcome writes: its own schema, the provider's answer in it.
const CAPTURED: &str = r#"{"type":"record","name":"Captured","namespace":"pay","fields":[
  {"name":"order_id","type":"string"},
  {"name":"payment_id","type":"string"},
  {"name":"status","type":"long"},
  {"name":"cents","type":"long"}]}"#;

/// A capture whose outcomes write Avro: two `on_success` events reading the
/// provider's answer (o-2's second does not fit once answered), an
/// `on_dead` one whose data is final at ingest (o-3's does not fit).
fn capture_in_avro() -> String {
    let avro = |data: &str| format!("format = \"avro\"\ndata = {{ order_id = \"{{{{ data.order_id }}}}\", {data} }}\n");
    let noted = avro(
        r#"payment_id = "{{ response.body.id }}", status = "{% if data.order_id == 'o-2' %}x{% endif %}{{ response.status }}", cents = "{{ data.amount_cents }}""#,
    );
    [
        "\n[topics.\"{topic}\"]\nformat = \"avro\"\nfields.id = { pointer = \"/event_id\" }\nfields.type = { value = \"order.placed\" }\n".into(),
        routes::route(None, "order.placed", ""),
        routes::capture(""),
        routes::emit_on("on_success", "captured", "payment.captured", &avro(r#"payment_id = "{{ response.body.id }}", status = "{{ response.status }}", cents = "{{ data.amount_cents }}""#)),
        routes::emit_on("on_success", "noted", "payment.noted", &noted)
            .replace("key = \"{{ data.order_id }}\"", "key = \"{{ data.order_id }}-noted\""),
        routes::emit_on("on_dead", "failed", "payment.failed", &avro(r#"payment_id = "", status = 0, cents = "{% if data.order_id == 'o-3' %}x{% endif %}{{ data.amount_cents }}""#)),
    ]
    .concat()
}

/// A call's outcome events in Avro, read by Confluent's deserializer:
/// `on_success` rendered from the provider's answer and encoded when the
/// call is done; `on_dead` encoded when an operator resolves an uncertain
/// call as failed, through the admin API and through the CLI. Data that
/// does not read the answer is checked at ingest (before any call); data
/// that does is checked when the call is done, and a misfit leaves the
/// success recorded without any of its effects, saying why.
#[tokio::test(flavor = "multi_thread")]
async fn a_call_s_outcome_events_are_written_in_avro_with_the_provider_s_answer() {
    let h = Harness::new(1).await;
    let registry = registry_url();
    let id = register(&registry, &format!("{}-value", h.out), "AVRO", CAPTURED).await;
    // o-4's and o-5's provider applies and answers too late: uncertain, their one attempt spent.
    let late = |key: &str| example_provider::FaultRule {
        path_prefix: None,
        key_prefix: Some(key.into()),
        times: None,
        kind: example_provider::FaultKind::TimeoutAfterApply { delay_ms: 1500 },
    };
    h.provider.set_faults(vec![late("capture:o-4"), late("capture:o-5")]);
    let records: Vec<Value> = (1..=5)
        .map(|n| {
            json!({"key": format!("o-{n}"), "value": {"event_id": format!("e-{n}"), "order_id": format!("o-{n}"),
                   "amount_cents": 1250, "price": {"$decimal": "12.50"}}})
        })
        .collect();
    produce(&h, &registry, "avro", ORDER_V1, Value::Array(records)).await;
    let routes = format!("[schema_registry]\nurl = \"{registry}\"\ntimeout = \"2s\"\n{}", capture_in_avro());
    let text = h.config_text(&routes).replace("max_attempts = 5\n", "max_attempts = 1\n");
    assert!(text.contains("max_attempts = 1\n"), "one attempt: {text}");
    let ((mut p, admin), config) = run_with_admin_config(&h, &text).await;
    eventually("o-3 dead-lettered", DEADLINE, || async { (!dead_letters(&h).await.is_empty()).then_some(()) }).await;
    h.await_intents_finished(4).await;
    let pool = &h.db.pool;
    let intent = |event: &'static str| async move {
        sqlx::query_scalar::<_, uuid::Uuid>("SELECT id FROM relay.intents WHERE source_event_id = $1")
            .bind(event)
            .fetch_one(pool)
            .await
            .unwrap()
    };
    let (o4, o5) = (intent("e-4").await, intent("e-5").await);
    assert_eq!(h.intents_in("uncertain").await, 2);

    // An operator without the encoders refuses rather than write JSON to an Avro topic.
    let cfg = relay_core::RelayConfig::from_toml(&text).unwrap();
    let bare = relay::ops::admin::Operator::new(h.db.pool.clone(), &cfg);
    let refused = bare.resolve(o4, relay::ops::admin::IntentResolution::Failed, None).await.unwrap_err().to_string();
    assert!(refused.contains(&format!("topic {}", h.out)) && refused.contains("no encoder"), "{refused}");
    // The provider has no capture of o-4 or o-5: their on_dead events are Avro too.
    let resolved = admin
        .api(reqwest::Method::POST, &format!("/api/intents/{o4}/resolve"), Some(json!({"resolution": "failed"})))
        .await;
    assert_eq!(resolved.get("effects_not_recorded"), Some(&Value::Null), "{resolved}");
    let (ok, out) = cli(&h, &config, &["intents", "resolve", &o5.to_string(), "--failed"]).await;
    assert!(ok && out.contains("on_dead effects are recorded"), "{out}");
    h.await_published(4).await;
    p.terminate(DEADLINE).unwrap();

    let read = consumed(&h, &registry, "avro", 4).await;
    assert_eq!(read["o-1"].0, "application/avro");
    for key in ["o-1", "o-1-noted"] {
        let mut event = read[key].1.clone();
        let payment = event["payment_id"].take();
        assert!(payment.as_str().is_some_and(|p| p.starts_with("res_")), "the provider's id: {payment}");
        assert_eq!(event, json!({"order_id": "o-1", "payment_id": null, "status": 201, "cents": 1250}));
    }
    for o in ["o-4", "o-5"] {
        assert_eq!(read[o].0, "application/avro");
        assert_eq!(read[o].1, json!({"order_id": o, "payment_id": "", "status": 0, "cents": 1250}));
    }
    // o-2 was captured, and its second event does not fit: the success is
    // recorded without any of its events, saying why (the field, not the value).
    let (state, error): (String, Option<String>) =
        sqlx::query_as("SELECT state, last_error FROM relay.intents WHERE source_event_id = 'e-2'")
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
    let error = error.unwrap_or_default();
    assert_eq!(state, "succeeded");
    let subject = format!("subject {}-value, schema id {id}", h.out);
    assert!(
        error.contains("on_success effects not recorded: the data of emit \"noted\" does not fit")
            && error.contains(&subject)
            && error.contains("/status"),
        "{error}"
    );
    assert!(!error.contains("x201"), "the reason names the field, never the value: {error}");
    let events = h.db.count("outbox", &format!("topic = '{}'", h.out)).await;
    assert_eq!(events, 4, "o-1's two, o-4's and o-5's; none of o-2's");
    // o-3's on_dead data was final at ingest: dead-lettered before any call.
    let dead = dead_letters(&h).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    let (_, class, reason) = &dead[0];
    assert_eq!(class, "schema_invalid");
    assert!(reason.contains("call \"capture\" on_dead: the data of emit \"failed\"") && reason.contains("/cents"));
    assert_eq!(h.provider.stats().requests_for("capture:o-3"), 0, "no call for a dead-lettered event");
}
