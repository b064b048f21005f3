//! Bytes other clients legally produce, against a real broker and database:
//! each bad record is a clear dead letter (or, where the data only lacks a
//! key, processed as keyless), never a crash of the consumer nor a partition
//! retried forever; the record after it is always applied. One test per
//! finding of the ingest review (`D1`…`D10`), each with the record that
//! stopped the relay before.

use crate::support::*;
use async_trait::async_trait;
use relay::{Components, Handler, HandlerError, Handlers};
use relay_core::{InputEvent, Plan};
use relay_testkit::{TestEvent, read_topic};
use serde_json::json;

const CONSUMER_ONLY: Components = Components { consumer: true, dispatcher: false, publisher: false };

/// (offset, error class, reason) of every dead letter, in offset order.
async fn dead_letters(h: &Harness) -> Vec<(i64, String, String)> {
    sqlx::query_as(r#"SELECT "offset", error_class, reason FROM relay.dead_letters ORDER BY "offset""#)
        .fetch_all(&h.db.pool)
        .await
        .unwrap()
}

/// Binary-mode CloudEvents headers of an `order.placed` event `id`.
fn ce_headers(id: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
    [("ce_specversion", "1.0"), ("ce_id", id), ("ce_type", "order.placed"), ("ce_source", "/shop")]
        .into_iter()
        .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect()
}

// D1 / security H1: rdkafka's header accessor unwrapped the name's UTF-8
// check, so this record panicked the consumer, and every restart with it.
#[tokio::test(flavor = "multi_thread")]
async fn a_header_name_that_is_not_utf8_is_dead_lettered_with_its_bytes_and_the_next_record_applied() {
    let h = Harness::new(1).await;
    // A broker that re-encodes a batch (into the topic's codec) reads header
    // names as UTF-8 and replaces these bytes: only a topic keeping what
    // producers send hands them to relay as written.
    h.set_topic_compression(&h.topic, "producer").await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.kafka.on_unbounded_compression = relay_core::config::Shortfall::Warn;
    let mut headers = ce_headers("evt-bad");
    headers.push((vec![0xff, 0xfe], b"v".to_vec()));
    let refs: Vec<(&[u8], &[u8])> = headers.iter().map(|(k, v)| (k.as_slice(), v.as_slice())).collect();
    relay_testkit::produce_with_raw_header_names(&h.bootstrap, &h.topic, 0, &refs, br#"{"order_id":"o-bad"}"#).unwrap();
    let (_, last) = h.send(&order("evt-1", "o-1")).await;
    let run = h.start(cfg, Components { publisher: true, ..CONSUMER_ONLY }, no_faults()).await;
    h.await_committed(0, last + 1).await;
    h.await_published(1).await;
    run.stop().await.unwrap();

    assert_eq!(h.outcome("evt-1").await.as_deref(), Some("applied"));
    let dead = dead_letters(&h).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!((dead[0].0, dead[0].1.as_str()), (0, "bad_header"));
    let mut conn = h.db.conn().await.unwrap();
    let id: i64 = sqlx::query_scalar("SELECT id FROM relay.dead_letters").fetch_one(&h.db.pool).await.unwrap();
    let kept = relay_store::dead_letters::get(&mut conn, &h.consumer, id).await.unwrap().unwrap().record;
    assert!(kept.headers.iter().any(|hd| hd.name_bytes() == [0xff, 0xfe]), "the name's bytes are kept for replay");
    let copy = read_topic(&h.bootstrap, &h.dlq, 1).await.unwrap();
    assert_eq!(copy[0].header("relay_dlq_error_class"), Some("bad_header"));
}

// D2 / security H2: an id longer than an index entry holds failed its insert
// with SQLSTATE 54000 on every retry, taken for a database outage.
#[tokio::test(flavor = "multi_thread")]
async fn an_id_or_key_longer_than_an_index_entry_holds_is_dead_lettered_naming_the_field_and_the_limit() {
    let h = Harness::new(1).await;
    // Random text: PostgreSQL compresses an index entry before it measures
    // it, and random text does not compress below the limit.
    let long: String = (0..3000).map(|_| char::from(b'A' + rand::random::<u8>() % 26)).collect();
    h.send(&order(&long, "o-long")).await;
    h.send(&order("evt-key", "o-key").ext("idempotencykey", &long)).await;
    let (_, last) = h.send(&order("evt-1", "o-1")).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    assert_eq!(h.outcome("evt-1").await.as_deref(), Some("applied"));
    let dead = dead_letters(&h).await;
    let classes: Vec<&str> = dead.iter().map(|d| d.1.as_str()).collect();
    assert_eq!(classes, ["bad_field", "bad_field"], "{dead:?}");
    assert!(dead[0].2.contains("event id") && dead[0].2.contains("1024"), "{}", dead[0].2);
    assert!(dead[1].2.contains("idempotency key") && !dead[1].2.contains(&long), "{}", dead[1].2);
}

// D2, the other half: whatever is still too large for an index (here a
// handler's own table) is the record's, not an outage.
#[tokio::test(flavor = "multi_thread")]
async fn sqlstate_54000_is_classified_as_the_records_error_not_an_outage() {
    let h = Harness::new(1).await;
    let mut conn = h.db.conn().await.unwrap();
    sqlx::query("CREATE TABLE big (k text PRIMARY KEY)").execute(&mut *conn).await.unwrap();
    // Random text: PostgreSQL compresses an index entry before it measures it.
    let long: String = (0..6000).map(|_| char::from(b'!' + rand::random::<u8>() % 90)).collect();
    let err = sqlx::query("INSERT INTO big VALUES ($1)").bind(&long).execute(&mut *conn).await.unwrap_err();
    let code = match &err {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    };
    assert_eq!(code.as_deref(), Some("54000"), "{err}");
    assert_eq!(relay_store::classify_error(&err), relay_store::DbErrorKind::Permanent);
    assert!(!relay_store::is_outage(&err));
}

// D3: an empty idempotency key was a real key: every later event with one
// became a `duplicate_key` no-op and its call was never made.
#[tokio::test(flavor = "multi_thread")]
async fn events_with_an_empty_idempotency_key_are_each_applied_as_if_they_had_none() {
    let h = Harness::new(1).await;
    for (i, key) in ["", "", " ", " "].into_iter().enumerate() {
        h.send(&order(&format!("evt-{i}"), &format!("o-{i}")).ext("idempotencykey", key)).await;
    }
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_committed(0, 4).await;
    h.await_intents_finished(4).await;
    run.stop().await.unwrap();
    let stats = h.provider.stats();
    for i in 0..4 {
        assert_eq!(h.outcome(&format!("evt-{i}")).await.as_deref(), Some("applied"), "evt-{i}");
        assert_eq!(stats.applied_for(&format!("capture:o-{i}")), 1, "o-{i}");
    }
}

fn note_route() -> String {
    [routes::order_placed(""), routes::capture("headers = { x-note = \"{{ data.note }}\" }\n"), routes::failed()]
        .concat()
}

// D4 / security M2: a control character reached an HTTP header; the request
// could not be built, a fake 400 killed the intent and `payment.failed` went out.
#[tokio::test(flavor = "multi_thread")]
async fn a_control_character_bound_for_a_header_is_a_template_error_at_ingest_and_no_failure_is_announced() {
    let h = Harness::new(1).await;
    let note = |id: &str, o: &str, text: &str| {
        TestEvent::new(id, "order.placed", json!({"order_id": o, "note": text, "amount": 1}))
    };
    h.send(&note("evt-bad", "o-bad", "line one\nline two")).await;
    h.send(&note("evt-key", "o-k\r\n", "fine")).await;
    let (_, last) = h.send(&note("evt-1", "o-1", "fine")).await;
    let run = h.start(h.config(&note_route()), Components::ALL, no_faults()).await;
    h.await_committed(0, last + 1).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();
    let dead = dead_letters(&h).await;
    let classes: Vec<&str> = dead.iter().map(|d| d.1.as_str()).collect();
    assert_eq!(classes, ["template_error", "template_error"], "{dead:?}");
    assert!(dead[0].2.contains("x-note") && dead[0].2.contains("data.note"), "{}", dead[0].2);
    assert!(dead[1].2.contains("idempotency_key") && dead[1].2.contains("data.order_id"), "{}", dead[1].2);
    assert_eq!(h.intents_in("dead").await, 0, "no intent died for a request it could not build");
    assert_eq!(h.db.count("outbox", "event_type = 'payment.failed'").await, 0, "no failure announced");
    assert_eq!(h.provider.stats().applied_for("capture:o-1"), 1);
}

/// A handler that inserts a row twice and ignores the second insert's error,
/// as "ignore duplicates" code does: the savepoint is then aborted.
struct SwallowsAnError;

#[async_trait]
impl Handler for SwallowsAnError {
    async fn handle(&self, tx: &mut sqlx::PgConnection, event: &InputEvent) -> Result<Plan, HandlerError> {
        if event.data["order_id"] == "o-bad" {
            for _ in 0..2 {
                let _ = sqlx::query("INSERT INTO seen VALUES ($1)").bind(&event.id).execute(&mut *tx).await;
            }
        }
        if event.data["order_id"] == "o-sql" {
            sqlx::query("INSERT INTO no_such_table VALUES (1)").execute(&mut *tx).await?;
        }
        if event.data["order_id"] == "o-none" {
            // A row the handler expected and did not find: its bug, not an outage.
            sqlx::query("SELECT id FROM seen WHERE id = 'nobody'").fetch_one(&mut *tx).await?;
        }
        if event.data["order_id"] == "o-cast" {
            // PostgreSQL's message quotes the value: "invalid input syntax for type numeric: \"4111…\"".
            sqlx::query("SELECT $1::numeric").bind("4111-1111-card").execute(&mut *tx).await?;
        }
        Ok(Plan::default())
    }
}

// D5: the aborted savepoint failed the next statement with 25P02, and a
// handler's own SQL error was returned as an outage: both retried forever.
#[tokio::test(flavor = "multi_thread")]
async fn a_handler_that_swallows_a_database_error_or_fails_its_own_sql_is_dead_lettered_naming_the_handler() {
    let h = Harness::new(1).await;
    let mut conn = h.db.conn().await.unwrap();
    sqlx::query("CREATE TABLE seen (id text PRIMARY KEY)").execute(&mut *conn).await.unwrap();
    let route = "[[routes]]\ntopic = \"{topic}\"\ntype = \"order.placed\"\nhandler = \"swallows\"\n";
    let handlers = Handlers::default().register("swallows", SwallowsAnError);
    h.send(&order("evt-bad", "o-bad")).await;
    h.send(&order("evt-sql", "o-sql")).await;
    h.send(&order("evt-cast", "o-cast")).await;
    h.send(&order("evt-none", "o-none")).await;
    let (_, last) = h.send(&order("evt-1", "o-1")).await;
    let run = h.start_with(h.config(route), CONSUMER_ONLY, handlers, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    assert_eq!(h.outcome("evt-1").await.as_deref(), Some("applied"));
    let dead = dead_letters(&h).await;
    assert_eq!(dead.len(), 4, "{dead:?}");
    assert!(dead[3].2.contains("no rows"), "{dead:?}");
    assert!(dead.iter().all(|d| d.1 == "rejected" && d.2.contains("\"swallows\"")), "{dead:?}");
    assert!(dead[0].2.contains("25P02") && dead[1].2.contains("42P01"), "{dead:?}");
    // Ingest review "to check": a reason names the SQLSTATE, never the value (R16).
    assert!(dead[2].2.contains("22P02") && !dead[2].2.contains("4111"), "{dead:?}");
}

const SCHEMA_ROUTE: &str = r#"
[[routes]]
name = "order-placed"
topic = "{topic}"
type = "order.placed"
schema = "SCHEMA"
counter = "orders"
"#;

// D10: the schema was checked before the pause, so a paused route still
// dead-lettered its schema-invalid events.
#[tokio::test(flavor = "multi_thread")]
async fn a_paused_route_holds_its_schema_invalid_events_too() {
    use relay_store::ops::{self, PauseKind};
    let h = Harness::new(1).await;
    let schema = std::env::temp_dir().join(format!("{}.schema.json", relay_testkit::unique("order")));
    std::fs::write(&schema, r#"{"type":"object","required":["order_id"]}"#).unwrap();
    let cfg = h.config(&SCHEMA_ROUTE.replace("SCHEMA", &schema.display().to_string()));
    let mut conn = h.db.conn().await.unwrap();
    ops::pause(&mut conn, &h.consumer, PauseKind::Route, "order-placed", None).await.unwrap();
    h.send(&TestEvent::new("first", "something.else", json!({}))).await;
    h.send(&TestEvent::new("evt-invalid", "order.placed", json!({"amount": 1}))).await;
    let (_, last) = h.send(&order("evt-1", "o-1")).await;
    let run = h.start(cfg, CONSUMER_ONLY, no_faults()).await;
    // Offset 0 is processed; its batch stopped at offset 1, held at the pause.
    h.await_committed(0, 1).await;
    assert_eq!(dead_letters(&h).await.len(), 0, "nothing dead-lettered through a paused route");
    ops::resume(&mut conn, &h.consumer, PauseKind::Route, "order-placed").await.unwrap();
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    let dead = dead_letters(&h).await;
    assert_eq!(dead.iter().map(|d| d.1.as_str()).collect::<Vec<_>>(), ["schema_invalid"]);
}

/// A handler that panics on one order.
struct Panics;

#[async_trait]
impl Handler for Panics {
    async fn handle(&self, _: &mut sqlx::PgConnection, event: &InputEvent) -> Result<Plan, HandlerError> {
        assert_ne!(event.data["order_id"], "o-bad", "a bug in the handler");
        Ok(Plan::default())
    }
}

// Ingest review "to check": a panicking handler unwound out of the consumer
// and ended the process, on every restart and every member.
#[tokio::test(flavor = "multi_thread")]
async fn a_handler_that_panics_dead_letters_its_record_naming_the_handler_and_the_partition_moves_on() {
    let h = Harness::new(1).await;
    let route = "[[routes]]\ntopic = \"{topic}\"\ntype = \"order.placed\"\nhandler = \"panics\"\n";
    let handlers = Handlers::default().register("panics", Panics);
    h.send(&order("evt-bad", "o-bad")).await;
    let (_, last) = h.send(&order("evt-1", "o-1")).await;
    let run = h.start_with(h.config(route), CONSUMER_ONLY, handlers, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.expect("the consumer survived the panic");
    assert_eq!(h.outcome("evt-1").await.as_deref(), Some("applied"));
    let dead = dead_letters(&h).await;
    assert_eq!(dead.len(), 1);
    assert!(dead[0].1 == "rejected" && dead[0].2.contains("\"panics\" panicked"), "{dead:?}");
}

/// CRC-32C (Castagnoli), as a record batch's checksum.
fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for b in bytes {
        crc ^= u32::from(*b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

/// Writes the checksum of the record batch at the start of `bytes` (of
/// length field `len`) again: its bytes were changed on purpose, and the
/// change must reach what comes after the checksum check.
fn fix_batch_crc(bytes: &mut [u8], len: usize) {
    let crc = crc32c(&bytes[21..12 + len]);
    bytes[17..21].copy_from_slice(&crc.to_be_bytes());
}

/// A configuration that only warns of a topic kept in a codec relay refuses
/// (zstd, say), for tests of what the client reads, not of that policy.
fn warned_only(h: &Harness) -> String {
    h.config_text(&CAPTURE_ROUTE).replace("[kafka]\n", "[kafka]\non_unbounded_compression = \"warn\"\n")
}

/// A private broker holding five records in one batch, compressed with
/// zstd or (`codec` = `uncompressed`) not, then one more (`evt-after`),
/// with `corrupt` applied to the segment file's bytes while the broker is
/// stopped; `first_len` is the first batch's length field.
async fn broker_with_a_corrupt_batch(
    codec: &str,
    corrupt: impl FnOnce(&mut [u8], usize),
) -> (relay_testkit::process::PrivateKafka, Harness) {
    use relay_testkit::process::PrivateKafka;
    let mut kafka = PrivateKafka::start().unwrap();
    let mut h = Harness::new(1).await;
    h.bootstrap = kafka.bootstrap();
    relay_testkit::create_topics(&h.bootstrap, &[&h.topic, &h.out, &h.dlq], 1).await.unwrap();
    h.set_topic_compression(&h.topic, codec).await;
    let producer_codec = if codec == "uncompressed" { "none" } else { codec };
    let zstd = relay_testkit::TestProducer::with_properties(
        &h.bootstrap,
        &[("compression.type", producer_codec), ("linger.ms", "200")],
    )
    .unwrap();
    let batch: Vec<TestEvent> = (0..5).map(|i| order(&format!("evt-{i}"), &format!("o-{i}")).partition(0)).collect();
    futures::future::join_all(batch.iter().map(|e| zstd.event(&h.topic, e))).await;
    relay_testkit::TestProducer::new(&h.bootstrap)
        .unwrap()
        .event(&h.topic, &order("evt-after", "o-after"))
        .await
        .unwrap();
    kafka.terminate().unwrap();
    // The first batch: a 61-byte v2 header, then the compressed records.
    let segment = kafka.data_dir().join(format!("{}-0", h.topic)).join("00000000000000000000.log");
    let mut bytes = std::fs::read(&segment).unwrap();
    let first_len = u32::from_be_bytes(bytes[8..12].try_into().unwrap()) as usize;
    assert_eq!(i32::from_be_bytes(bytes[57..61].try_into().unwrap()), 5, "the five records are one batch");
    corrupt(&mut bytes, first_len);
    std::fs::write(&segment, bytes).unwrap();
    kafka.start_again().unwrap();
    (kafka, h)
}

// Issue 27: "nothing may ever be skipped silently: a record the client
// cannot decode is dead-lettered, never passed over". A batch whose bytes
// were corrupted on the broker's disk does not decompress; librdkafka reports
// it without its position and fetches it again and again.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_the_client_cannot_decode_is_dead_lettered_and_its_partition_goes_on_after_it() {
    let (_kafka, h) = broker_with_a_corrupt_batch("zstd", |bytes, len| {
        for b in &mut bytes[61 + 4..12 + len - 4] {
            *b ^= 0x5a;
        }
        // A batch that passes its checksum and still does not decompress.
        fix_batch_crc(bytes, len);
    })
    .await;
    let config = h.write_config(&warned_only(&h));
    let mut run = h.process(&config, &["run"], &[]);
    h.await_committed(0, 6).await;
    eventually("the dead letter's copy published", DEADLINE, || async {
        (h.db.count("outbox", "action = 'dead_letter' AND state = 'published'").await == 1).then_some(())
    })
    .await;
    assert!(run.terminate(std::time::Duration::from_secs(30)).unwrap().success(), "{}", run.log());
    assert_eq!(h.outcome("evt-after").await.as_deref(), Some("applied"), "the partition went on after it");
    let dead = dead_letters(&h).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!((dead[0].0, dead[0].1.as_str()), (0, "unreadable"));
    assert!(dead[0].2.contains("offsets 0..4") && dead[0].2.contains("compressed"), "{}", dead[0].2);
    let copy = read_topic(&h.bootstrap, &h.dlq, 1).await.unwrap();
    assert_eq!(copy[0].header("relay_dlq_error_class"), Some("unreadable"));
}

// Review of issue 27: a batch in a message format librdkafka does not know
// (here its magic byte corrupted) is skipped by librdkafka, which fetches on
// past it; the consumer stops before it receives anything after it.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_the_client_would_skip_stops_the_consumer_before_anything_after_it_is_committed() {
    let (_kafka, h) = broker_with_a_corrupt_batch("zstd", |bytes, _| bytes[16] = 3).await;
    let config = h.write_config(&warned_only(&h));
    let mut run = h.process(&config, &["consume"], &[]);
    let status = run.wait(DEADLINE).expect("the consumer stops by itself");
    assert!(!status.success());
    assert!(run.log().contains("the consumer stops rather than commit past it"), "{}", run.log());
    assert_eq!(h.committed().await.get(&0).copied().flatten().unwrap_or(0), 0, "nothing committed past it");
    assert_eq!(h.outcome("evt-after").await, None, "the record after it was not applied");
}

// A digit flipped on a broker's disk in an uncompressed batch still parses:
// without checksums it was applied as the producer's data (here another
// order). The batch fails its checksum, and the consumer stops before it.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_failing_its_checksum_stops_the_consumer_before_its_records_are_applied() {
    let (_kafka, h) = broker_with_a_corrupt_batch("uncompressed", |bytes, len| {
        let batch = &mut bytes[..12 + len];
        let at = batch.windows(3).position(|w| w == b"o-0").expect("the first order's id in the batch");
        batch[at + 2] = b'7';
    })
    .await;
    let config = h.write_config(&h.config_text(&CAPTURE_ROUTE));
    let mut run = h.process(&config, &["consume"], &[]);
    let status = run.wait(DEADLINE).expect("the consumer stops by itself");
    assert!(!status.success());
    assert!(run.log().contains("the consumer stops rather than commit past it"), "{}", run.log());
    assert_eq!(h.outcome("evt-0").await, None, "the corrupted record was not applied");
    assert_eq!(h.db.count("intents", "idempotency_key = 'capture:o-7'").await, 0, "a flipped order was applied");
}

// librdkafka inflates gzip and lz4 batches without a cap (one 1 MB gzip
// batch is about 1 GB inflated, before relay sees a record), and zstd up to
// a cap per batch but not per fetch, so an input topic that keeps them is
// refused at start, naming it and the fix.
#[tokio::test(flavor = "multi_thread")]
async fn an_input_topic_that_keeps_zstd_gzip_or_lz4_batches_is_refused_at_start_naming_it() {
    let h = Harness::new(1).await;
    let config = h.write_config(&h.config_text(&CAPTURE_ROUTE));
    for codec in ["zstd", "gzip"] {
        h.set_topic_compression(&h.topic, codec).await;
        let mut run = h.process(&config, &["run"], &[]);
        let status = run.wait(DEADLINE).expect("the start is refused");
        assert!(!status.success(), "{codec}: {}", run.log());
        let log = run.log();
        assert!(
            log.contains(&format!("{} (compression.type = {codec})", h.topic))
                && log.contains("compression.type = snappy"),
            "{log}"
        );
    }
    // Kafka's default keeps what producers sent: refused too, unless the
    // deployment asks to be warned only.
    h.set_topic_compression(&h.topic, "producer").await;
    let config = h.write_config(&warned_only(&h));
    h.send(&order("evt-1", "o-1")).await;
    let mut run = h.process(&config, &["run"], &[]);
    h.await_committed(0, 1).await;
    assert!(run.terminate(std::time::Duration::from_secs(30)).unwrap().success(), "{}", run.log());
    assert!(run.log().contains("(compression.type = producer)"), "{}", run.log());
    assert_eq!(h.outcome("evt-1").await.as_deref(), Some("applied"));
}

/// Poll until `done` holds of the committed offsets, failing at once if
/// `run` stops or after [`DEADLINE`]; the most `run` held resident meanwhile.
async fn until_committed(
    h: &Harness,
    run: &mut relay_testkit::process::RelayProcess,
    done: impl Fn(&std::collections::HashMap<i32, Option<i64>>) -> bool,
) -> u64 {
    let end = std::time::Instant::now() + DEADLINE;
    let mut peak = 0;
    loop {
        peak = peak.max(run.peak_resident_bytes().unwrap_or(0));
        assert!(run.is_running(), "the consumer stopped: {}", run.log());
        if h.try_committed().await.is_ok_and(|c| done(&c)) {
            return peak;
        }
        assert!(std::time::Instant::now() < end, "not committed within {DEADLINE:?}: {}", run.log());
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// `n` bytes that no codec shrinks, as text.
fn incompressible(n: usize) -> String {
    use rand::Rng;
    let mut rng = rand::rng();
    (0..n).map(|_| char::from(rng.random_range(b'a'..=b'z'))).collect()
}

// The client drops a fetch response over receive.message.max.bytes and
// reports it as a bad message, on which the consumer stops, at every start.
// A topic may keep batches larger than a whole fetch (its max.message.bytes
// raised): the broker sends such a batch alone, and the response must still
// fit. The record is over max_record_bytes, so it is parked; the one after
// it is applied.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_larger_than_a_whole_fetch_is_received_and_its_partition_goes_on() {
    let h = Harness::new(1).await;
    h.set_topic_config(&h.topic, "max.message.bytes", &(14 * 1024 * 1024).to_string()).await;
    let big = relay_testkit::TestProducer::with_properties(
        &h.bootstrap,
        &[("message.max.bytes", "16000000"), ("compression.type", "none")],
    )
    .unwrap();
    let payload = incompressible(12 * 1024 * 1024);
    big.raw(&h.topic, Some(0), None, &order("evt-big", "o-big").headers(), Some(payload.as_bytes())).await.unwrap();
    h.send(&order("evt-after", "o-after").partition(0)).await;
    let config = h.write_config(&h.config_text(&CAPTURE_ROUTE));
    let mut run = h.process(&config, &["consume"], &[]);
    until_committed(&h, &mut run, |c| c.get(&0).copied().flatten() == Some(2)).await;
    assert!(run.terminate(std::time::Duration::from_secs(30)).unwrap().success(), "{}", run.log());
    assert_eq!(h.outcome("evt-after").await.as_deref(), Some("applied"));
    let dead = dead_letters(&h).await;
    assert_eq!((dead.len(), dead[0].1.as_str()), (1, "oversized"), "{dead:?}");
}

// librdkafka reads ahead until its queue holds 64 MiB of record values or
// 100 000 records, and counts no key or header bytes. While relay's buffer is
// full it takes nothing, and records of empty values and 512 KiB keys (here
// 400, 200 MiB inflated, behind a 16 MiB buffer) are read ahead into memory;
// paused at the broker while the buffer is full, the client holds what relay
// does and a fetch. (`RELAY_SABOTAGE=read-ahead-past-full-buffer` leaves it fetching.)
#[tokio::test(flavor = "multi_thread")]
async fn records_of_large_keys_and_empty_values_are_not_read_ahead_past_a_full_buffer() {
    let h = Harness::new(1).await;
    let producer = relay_testkit::TestProducer::with_properties(
        &h.bootstrap,
        &[("compression.type", "snappy"), ("message.max.bytes", "2000000")],
    )
    .unwrap();
    let key = vec![b'k'; 512 * 1024];
    for _ in 0..400 {
        producer.raw(&h.topic, Some(0), Some(&key), &[], None).await.unwrap();
    }
    h.send(&order("evt-after", "o-after").partition(0)).await;
    let small_buffer = h
        .config_text(&CAPTURE_ROUTE)
        .replace("max_record_bytes = 65536\n", "max_record_bytes = 65536\nmax_buffered_bytes = 16777216\n");
    let config = h.write_config(&small_buffer);
    let mut run = h.process(&config, &["consume"], &[]);
    let peak = until_committed(&h, &mut run, |c| c.get(&0).copied().flatten() == Some(401)).await;
    assert!(run.terminate(std::time::Duration::from_secs(30)).unwrap().success(), "{}", run.log());
    assert_eq!(h.outcome("evt-after").await.as_deref(), Some("applied"));
    eprintln!("the consumer held {} MiB at its peak", peak / (1024 * 1024));
    assert!(peak < 110 * 1024 * 1024, "the consumer held {} MiB at its peak", peak / (1024 * 1024));
}

// Snappy inflates at most ~21 times, so a topic kept in snappy bounds what
// one fetch inflates to however producers compress. Here 100 zstd batches of
// ~150 bytes each inflate to 3 MiB: a topic kept in zstd stores them as
// sent, one 64 KiB partition fetch carries them all, and the client inflates
// 300 MiB at once; kept in snappy, the broker re-encodes each to ~150 KB,
// which comes one per fetch. What stays is what the two queues hold (the
// client's 64 MiB, relay's `max_buffered_bytes`) and the process itself.
#[tokio::test(flavor = "multi_thread")]
async fn batches_that_inflate_twenty_thousandfold_stay_within_a_bound_on_a_snappy_topic() {
    let codec = std::env::var("RELAY_TEST_CODEC").unwrap_or("snappy".into());
    let peak = peak_while_reading_inflating_batches(&codec).await;
    assert!(peak < 240 * 1024 * 1024, "the consumer held {} MiB at its peak", peak / (1024 * 1024));
}

/// The most the consumer held resident while reading 100 batches that each
/// inflate to 3 MiB (zstd grows its buffer threefold from an unknown size,
/// so a batch past ~3.4 MiB does not fit 9 MiB), from an input topic kept
/// in `codec`.
async fn peak_while_reading_inflating_batches(codec: &str) -> u64 {
    let h = Harness::new(1).await;
    h.set_topic_compression(&h.topic, codec).await;
    let zstd = relay_testkit::TestProducer::with_properties(
        &h.bootstrap,
        &[("compression.type", "zstd"), ("message.max.bytes", "16000000"), ("linger.ms", "0")],
    )
    .unwrap();
    let blank = vec![b' '; 3 * 1024 * 1024];
    for i in 0..100 {
        zstd.raw(&h.topic, Some(0), None, &order(&format!("evt-{i}"), "o").headers(), Some(&blank)).await.unwrap();
    }
    h.send(&order("evt-after", "o-after").partition(0)).await;
    let config = h.write_config(&warned_only(&h));
    let mut run = h.process(&config, &["consume"], &[]);
    let peak = until_committed(&h, &mut run, |c| c.get(&0).copied().flatten() == Some(101)).await;
    assert!(run.terminate(std::time::Duration::from_secs(30)).unwrap().success(), "{}", run.log());
    assert_eq!(h.outcome("evt-after").await.as_deref(), Some("applied"));
    eprintln!("topic kept in {codec}: the consumer held {} MiB at its peak", peak / (1024 * 1024));
    peak
}
