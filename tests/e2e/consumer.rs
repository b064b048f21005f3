//! The inbox consumer against real PostgreSQL and a real Kafka broker:
//! dedup (C3–C6), poison (C7), crashes around the DB commit (C1, C2),
//! contiguous offsets, missing references (R19), sequence guard (R6),
//! code handlers, dead-letter replay.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use crate::support::*;
use async_trait::async_trait;
use relay::ops::admin::ReplayOutcome;
use relay::{Components, FaultAction, Faults, Handler, HandlerError, Handlers};
use relay_core::{CallSpec, InputEvent, Plan, RelayConfig};
use relay_store::inbox;
use relay_testkit::{TestEvent, read_topic, unique};
use serde_json::json;

const CONSUMER_ONLY: Components = Components { consumer: true, dispatcher: false, publisher: false };

/// Another member joins `h`'s group, for a topic of its own: every member
/// gives its partitions back (an eager rebalance) and the relay gets its own
/// again. The member stays in the group while the returned consumer lives.
async fn another_member_joins(h: &Harness) -> rdkafka::consumer::StreamConsumer {
    use rdkafka::consumer::Consumer;
    let other_topic = unique("other");
    relay_testkit::create_topics(&h.bootstrap, &[&other_topic], 1).await.unwrap();
    let member: rdkafka::consumer::StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &h.bootstrap)
        .set("group.id", &h.group)
        .set("session.timeout.ms", "6000")
        .create()
        .unwrap();
    member.subscribe(&[&other_topic]).unwrap();
    eventually("the other member's assignment", DEADLINE, || async {
        let _ = tokio::time::timeout(std::time::Duration::from_millis(200), member.recv()).await;
        member.assignment().ok().filter(|a| a.count() > 0).map(|_| ())
    })
    .await;
    member
}

#[tokio::test]
async fn a_duplicate_event_id_at_another_offset_causes_one_effect() {
    let h = Harness::new(1).await;
    let first = h.send(&order("evt-1", "o-1")).await;
    let second = h.send(&order("evt-1", "o-1")).await;
    assert_ne!(first.1, second.1, "the duplicate sits at another offset");
    h.send(&order("evt-2", "o-2")).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_committed(0, 3).await;
    h.await_intents_finished(2).await;
    h.await_published(2).await;
    run.stop().await.unwrap();

    assert_eq!(h.inbox().await, 2);
    let stats = h.provider.stats();
    assert_eq!(stats.applied_for("capture:o-1"), 1);
    assert_eq!(stats.applied_for("capture:o-2"), 1);
    assert_eq!(stats.requests, 2, "the duplicate never became a second intent");
    let mut conn = h.db.conn().await.unwrap();
    assert_eq!(
        inbox::counter(&mut conn, &h.consumer, "orders").await.unwrap(),
        2,
        "business counter counts unique events"
    );
    // Downstream sees each outcome event once, under its derived CloudEvents id.
    let out = read_topic(&h.bootstrap, &h.out, 2).await.unwrap();
    assert_eq!(out.len(), 2);
    assert!(
        out.iter().all(|r| r.header("ce_type") == Some("payment.captured") && r.header("ce_causationid").is_some())
    );
}

#[tokio::test]
async fn replaying_the_topic_from_offset_zero_in_a_new_group_causes_no_new_effects() {
    let h = Harness::new(2).await;
    h.send_orders(20).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_inbox(20).await;
    h.await_intents_finished(20).await;
    run.stop().await.unwrap();
    let before = h.provider.stats();

    // Same consumer name, new group: reads the whole topic again from offset 0.
    let mut cfg = h.config(&CAPTURE_ROUTE);
    let new_group = unique("replay-group");
    cfg.consumer.group_id = Some(new_group.clone());
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    eventually("the new group to reach the end of both partitions", DEADLINE, || async {
        let c = relay_testkit::committed_offsets(&h.bootstrap, &new_group, &h.topic).await.unwrap();
        let total: i64 = c.values().map(|o| o.unwrap_or(0)).sum();
        (total == 20).then_some(())
    })
    .await;
    run.stop().await.unwrap();

    assert_eq!(h.inbox().await, 20);
    assert_eq!(h.db.count("intents", "true").await, 20);
    let after = h.provider.stats();
    assert_eq!(after.applied, before.applied, "no new effect at the provider");
    assert_eq!(after.requests, before.requests, "no new call at all");
    // The counter has a row per partition written (so partitions never wait
    // for each other's counter row), and they add up to the unique events.
    let mut conn = h.db.conn().await.unwrap();
    assert_eq!(inbox::counter(&mut conn, &h.consumer, "orders").await.unwrap(), 20, "replaying counted nothing twice");
    let consumer = format!("consumer = '{}'", h.consumer);
    let partitions: i64 =
        sqlx::query_scalar(&format!("SELECT count(DISTINCT partition) FROM relay.inbox WHERE {consumer}"))
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    assert_eq!(h.db.count("counters", &consumer).await, partitions);
}

#[tokio::test]
async fn a_new_event_id_with_the_same_idempotency_key_causes_one_effect() {
    let h = Harness::new(1).await;
    h.send(&order("evt-1", "o-1").ext("idempotencykey", "place:o-1")).await;
    // An upstream retry minted a new event id for the same operation.
    h.send(&order("evt-1-retry", "o-1").ext("idempotencykey", "place:o-1")).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_committed(0, 2).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();

    let mut conn = h.db.conn().await.unwrap();
    assert_eq!(h.outcome("evt-1").await.as_deref(), Some("applied"));
    assert_eq!(h.outcome("evt-1-retry").await.as_deref(), Some("duplicate_key"));
    assert_eq!(h.db.count("intents", "true").await, 1);
    assert_eq!(h.provider.stats().applied, 1);
    assert_eq!(inbox::counter(&mut conn, &h.consumer, "orders").await.unwrap(), 1);
}

fn versioned_route() -> String {
    routes::order_updated("data = { version = \"{{ aggregate_version }}\" }\n")
}

#[tokio::test]
async fn an_older_version_after_a_newer_one_is_ignored_and_counted_as_stale() {
    let h = Harness::new(1).await;
    let update = |id: &str, v: i64| {
        TestEvent::new(id, "order.updated", json!({"order_id": "o-1"}))
            .ext("aggregateid", "o-1")
            .ext("aggregateversion", v)
    };
    h.send(&update("u-1", 1)).await;
    h.send(&update("u-3", 3)).await;
    h.send(&update("u-2", 2)).await; // late
    h.send(&update("u-3b", 3)).await; // same version again, new id
    let run = h.start(h.config(&versioned_route()), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, 4).await;
    run.stop().await.unwrap();

    let mut conn = h.db.conn().await.unwrap();
    assert_eq!(h.outcome("u-1").await.as_deref(), Some("applied"));
    assert_eq!(h.outcome("u-3").await.as_deref(), Some("applied"));
    assert_eq!(h.outcome("u-2").await.as_deref(), Some("stale"));
    assert_eq!(h.outcome("u-3b").await.as_deref(), Some("duplicate_version"));
    assert_eq!(h.db.count("inbox", "outcome = 'stale'").await, 1, "stale events are counted");
    assert_eq!(h.db.count("outbox", "true").await, 2, "only applied versions emit");
    assert_eq!(inbox::counter(&mut conn, &h.consumer, "updates").await.unwrap(), 2);
}

const SCHEMA_ROUTE: &str = r#"
[[routes]]
topic = "{topic}"
type = "order.placed"
schema = "SCHEMA"
counter = "orders"

[[routes.actions]]
kind = "emit"
name = "accepted"
type = "order.accepted"
topic = "{out}"
key = "{{ data.order_id }}"
"#;

#[tokio::test]
async fn poison_records_are_dead_lettered_with_their_reason_while_the_partition_keeps_moving() {
    let h = Harness::new(1).await;
    let schema = std::env::temp_dir().join(format!("{}.schema.json", unique("order")));
    std::fs::write(&schema, r#"{"type":"object","required":["order_id"],"properties":{"order_id":{"type":"string"}}}"#)
        .unwrap();
    let mut cfg = h.config(&SCHEMA_ROUTE.replace("SCHEMA", &schema.display().to_string()));
    cfg.consumer.strict = true;

    h.send(&order("ok-1", "o-1")).await;
    // Bad JSON.
    let headers = |id: Option<&str>| {
        let mut v = vec![
            ("ce_specversion".to_string(), b"1.0".to_vec()),
            ("ce_type".to_string(), b"order.placed".to_vec()),
            ("ce_source".to_string(), b"/t".to_vec()),
        ];
        if let Some(id) = id {
            v.push(("ce_id".to_string(), id.as_bytes().to_vec()));
        }
        v
    };
    let (_, bad_json) =
        h.producer.raw(&h.topic, None, None, &headers(Some("bad-1")), Some(b"{\"order_id\": ")).await.unwrap();
    // No event id.
    let (_, no_id) =
        h.producer.raw(&h.topic, None, None, &headers(None), Some(b"{\"order_id\":\"o-x\"}")).await.unwrap();
    // Schema-invalid.
    let (_, invalid) = h.send(&TestEvent::new("bad-3", "order.placed", json!({"order_id": 42}))).await;
    // Unknown type on a strict consumer.
    let (_, unknown) = h.send(&TestEvent::new("bad-4", "order.exploded", json!({}))).await;
    // Oversized.
    let (_, oversized) =
        h.send(&TestEvent::new("bad-5", "order.placed", json!({"order_id": "x".repeat(70_000)}))).await;
    // Invalid UTF-8 in a CloudEvents header.
    let mut bin = headers(Some("bad-6"));
    bin.push(("ce_subject".to_string(), vec![0xff, 0xfe]));
    let (_, bad_header) = h.producer.raw(&h.topic, None, None, &bin, Some(b"{\"order_id\":\"o-y\"}")).await.unwrap();
    let (_, last) = h.send(&order("ok-2", "o-2")).await;

    let run = h.start(cfg, Components { consumer: true, dispatcher: false, publisher: true }, no_faults()).await;
    h.await_committed(0, last + 1).await;
    h.await_published(2 + 6).await;
    run.stop().await.unwrap();

    assert_eq!(h.inbox().await, 2, "both good records were processed");
    let rows: Vec<(i64, String, Option<String>, String)> =
        sqlx::query_as(r#"SELECT "offset", error_class, event_id, reason FROM relay.dead_letters ORDER BY "offset""#)
            .fetch_all(&h.db.pool)
            .await
            .unwrap();
    let classes: Vec<(i64, &str)> = rows.iter().map(|(o, c, _, _)| (*o, c.as_str())).collect();
    assert_eq!(
        classes,
        vec![
            (bad_json, "bad_json"),
            (no_id, "missing_id"),
            (invalid, "schema_invalid"),
            (unknown, "unknown_type"),
            (oversized, "oversized"),
            (bad_header, "bad_header")
        ]
    );
    assert_eq!(rows[0].2.as_deref(), Some("bad-1"), "the id is kept when it could be read");
    assert!(rows[2].3.contains("/order_id"), "schema errors name the field: {}", rows[2].3);
    assert!(rows[4].3.contains("65536"), "oversize names the limit: {}", rows[4].3);

    // The dead-letter topic has a copy of each, with where it came from and why.
    let dlq = read_topic(&h.bootstrap, &h.dlq, 6).await.unwrap();
    assert_eq!(dlq.len(), 6);
    let copy =
        dlq.iter().find(|r| r.header("relay_dlq_offset") == Some(&invalid.to_string())).expect("schema-invalid copy");
    assert_eq!(copy.header("relay_dlq_topic"), Some(h.topic.as_str()));
    assert_eq!(copy.header("relay_dlq_partition"), Some("0"));
    assert_eq!(copy.header("relay_dlq_event_id"), Some("bad-3"));
    assert_eq!(copy.header("relay_dlq_error_class"), Some("schema_invalid"));
    assert_eq!(copy.json(), json!({"order_id": 42}), "the original value is kept");
}

#[tokio::test]
async fn a_consumer_that_dies_after_the_db_commit_gets_the_record_again_and_applies_nothing_twice() {
    let h = Harness::new(1).await;
    h.send(&order("evt-1", "o-1")).await;
    // C2: stop right after the commit, before the offset is stored.
    let faults = Faults::new(&[(relay::runtime::faults::point::CONSUMER_AFTER_DB_COMMIT, FaultAction::Fail, 1)]);
    let run = h.start(h.config(&CAPTURE_ROUTE), CONSUMER_ONLY, faults).await;
    assert!(run.finished().await.is_err(), "the fault stops the consumer like a crash");
    assert_eq!(h.inbox().await, 1, "the transaction committed");
    assert_eq!(h.committed().await.get(&0).copied().flatten(), None, "no offset was committed");

    // A new consumer in the same group gets the record again.
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_committed(0, 1).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();
    assert_eq!(h.inbox().await, 1);
    assert_eq!(h.db.count("intents", "true").await, 1);
    assert_eq!(h.provider.stats().applied, 1);
    let mut conn = h.db.conn().await.unwrap();
    assert_eq!(
        inbox::counter(&mut conn, &h.consumer, "orders").await.unwrap(),
        1,
        "the redelivery did not count twice"
    );
}

#[tokio::test]
async fn a_consumer_that_dies_before_the_db_commit_gets_the_record_again_and_applies_it_once() {
    let h = Harness::new(1).await;
    h.send(&order("evt-1", "o-1")).await;
    // C1: die with the batch written but not committed.
    let faults = Faults::new(&[(relay::runtime::faults::point::CONSUMER_BEFORE_DB_COMMIT, FaultAction::Fail, 1)]);
    let run = h.start(h.config(&CAPTURE_ROUTE), CONSUMER_ONLY, faults).await;
    assert!(run.finished().await.is_err());
    assert_eq!(h.inbox().await, 0, "nothing was committed");

    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_committed(0, 1).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();
    assert_eq!(h.inbox().await, 1);
    assert_eq!(h.provider.stats().applied, 1);
}

/// A handler that refuses an order until `ready` is set, counting refusals.
struct WaitsForCustomer {
    ready: Arc<AtomicBool>,
    refusals: Arc<AtomicU32>,
}

#[async_trait]
impl Handler for WaitsForCustomer {
    async fn handle(&self, tx: &mut sqlx::PgConnection, event: &InputEvent) -> Result<Plan, HandlerError> {
        if event.data["order_id"] == "o-stuck" && !self.ready.load(Ordering::SeqCst) {
            self.refusals.fetch_add(1, Ordering::SeqCst);
            return Err(HandlerError::NotYet("customer c-1 is not known yet".into()));
        }
        // The handler writes the application's own state in the same transaction.
        sqlx::query("CREATE TABLE IF NOT EXISTS public.app_orders (order_id text PRIMARY KEY)")
            .execute(&mut *tx)
            .await?;
        sqlx::query("INSERT INTO public.app_orders VALUES ($1)")
            .bind(event.data["order_id"].as_str())
            .execute(&mut *tx)
            .await?;
        Ok(Plan {
            calls: vec![CallSpec {
                action: "capture".into(),
                endpoint: "psp".into(),
                method: "POST".into(),
                path: "/captures".into(),
                body: Some(event.data.clone()),
                headers: Default::default(),
                idempotency_key: None,
                ordering_key: None,
                fairness_key: None,
                on_success: Default::default(),
                on_dead: Default::default(),
            }],
            ..Plan::default()
        })
    }
}

const HANDLER_ROUTE: &str = r#"
[[routes]]
topic = "{topic}"
type = "order.placed"
handler = "waits-for-customer"
"#;

/// Routes orders through [`WaitsForCustomer`] with a retry budget that keeps
/// a refused order waiting until the test sets `ready`.
fn waiting_for_customer(h: &Harness) -> (Arc<AtomicBool>, Arc<AtomicU32>, Handlers, RelayConfig) {
    let ready = Arc::new(AtomicBool::new(false));
    let refusals = Arc::new(AtomicU32::new(0));
    let handlers = Handlers::default()
        .register("waits-for-customer", WaitsForCustomer { ready: ready.clone(), refusals: refusals.clone() });
    let mut cfg = h.config(HANDLER_ROUTE);
    cfg.consumer.reference_retry.max_attempts = 1000;
    (ready, refusals, handlers, cfg)
}

/// A handler that returns a saga move, which handlers may not do.
struct MovesASaga;

#[async_trait]
impl Handler for MovesASaga {
    async fn handle(&self, _: &mut sqlx::PgConnection, event: &InputEvent) -> Result<Plan, HandlerError> {
        let saga = relay_core::SagaMove {
            action: "start".into(),
            saga_type: "order".into(),
            saga_id: event.data["order_id"].as_str().unwrap_or_default().into(),
            from: Vec::new(),
            to: "placed".into(),
            start: true,
        };
        Ok(Plan { sagas: vec![saga], ..Plan::default() })
    }
}

// Saga moves a handler returned were once dropped without a word (the
// per-record path applied the route's moves before the handler ran).
#[tokio::test]
async fn a_handler_returning_saga_moves_is_dead_lettered_saying_so_not_silently_ignored() {
    let h = Harness::new(1).await;
    let handlers = Handlers::default().register("moves-a-saga", MovesASaga);
    let cfg = h.config(&HANDLER_ROUTE.replace("waits-for-customer", "moves-a-saga"));
    let (_, offset) = h.send(&order("evt-1", "o-1")).await;
    let run = h.start_with(cfg, CONSUMER_ONLY, handlers, no_faults()).await;
    h.await_committed(0, offset + 1).await;
    run.stop().await.unwrap();
    let reason: String =
        sqlx::query_scalar("SELECT reason FROM relay.dead_letters").fetch_one(&h.db.pool).await.unwrap();
    assert!(reason.contains("saga moves belong in the route"), "{reason}");
    assert_eq!(h.db.count("sagas", "true").await, 0, "nothing of it applied");
    assert_eq!(h.inbox().await, 0, "parked, not recorded as applied");
}

#[tokio::test]
async fn the_committed_offset_never_passes_a_record_that_is_not_processed_yet() {
    let h = Harness::new(1).await;
    let (ready, refusals, handlers, cfg) = waiting_for_customer(&h);

    h.send(&order("evt-1", "o-1")).await;
    let (_, stuck) = h.send(&order("evt-2", "o-stuck")).await;
    h.send(&order("evt-3", "o-3")).await;
    let run = h.start_with(cfg, CONSUMER_ONLY, handlers, no_faults()).await;

    // The record before it is committed (asynchronously) ...
    h.await_committed(0, stuck).await;
    // ... and while the stuck record keeps being retried, the offset stays there.
    let seen = refusals.load(Ordering::SeqCst);
    eventually("the stuck record to be retried twice more", DEADLINE, || async {
        (refusals.load(Ordering::SeqCst) >= seen + 2).then_some(())
    })
    .await;
    assert_eq!(
        h.committed().await.get(&0).copied().flatten(),
        Some(stuck),
        "committed up to, not past, the stuck record"
    );
    assert_eq!(h.inbox().await, 1, "the record after it waits too (per-partition order)");

    ready.store(true, Ordering::SeqCst);
    h.await_committed(0, stuck + 2).await;
    run.stop().await.unwrap();
    assert_eq!(h.inbox().await, 3);
    let app_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM public.app_orders").fetch_one(&h.db.pool).await.unwrap();
    assert_eq!(app_rows, 3, "the handler's own writes committed with the inbox rows");
    assert_eq!(h.db.count("intents", "action = 'capture'").await, 3);
}

#[tokio::test]
async fn a_record_that_is_not_processable_yet_holds_up_its_own_partition_only() {
    let h = Harness::new(2).await;
    let (ready, refusals, handlers, cfg) = waiting_for_customer(&h);
    let (stuck_partition, stuck) = h.send(&order("evt-stuck", "o-stuck")).await;
    // Orders keyed to the other partition, sent before and while the stuck one waits.
    let mut next = 0;
    let mut send_to_other = async |n: usize| {
        let mut sent = 0;
        while sent < n {
            next += 1;
            assert!(next < 1000, "no key of 1000 went to the other partition");
            let (p, _) = h.send(&order(&format!("evt-{next}"), &format!("o-{next}"))).await;
            sent += usize::from(p != stuck_partition);
        }
    };
    send_to_other(3).await;
    let run = h.start_with(cfg, CONSUMER_ONLY, handlers, no_faults()).await;
    let other_applied = async |n: i64| {
        let sql = "SELECT count(*) FROM relay.inbox WHERE partition <> $1";
        eventually(&format!("{n} records of the other partition applied"), DEADLINE, || async {
            let got: i64 = sqlx::query_scalar(sql).bind(stuck_partition).fetch_one(&h.db.pool).await.unwrap();
            (got == n).then_some(())
        })
        .await;
    };
    other_applied(3).await;
    eventually("the stuck record to be refused", DEADLINE, || async {
        (refusals.load(Ordering::SeqCst) >= 1).then_some(())
    })
    .await;
    // More records behind the stuck one than the consumer buffers for all
    // partitions together (batch_size 50 × 2 partitions; issue 22 item 8):
    // they wait in its partition, not in a buffer the other partition needs.
    let mut last_behind = 0;
    for i in 0..120 {
        last_behind = h.send(&order(&format!("behind-{i}"), &format!("b-{i}")).partition(stuck_partition)).await.1;
    }
    // Records that arrive while it waits for its retries: the other partition
    // does not wait for it.
    send_to_other(3).await;
    other_applied(6).await;
    assert_eq!(h.outcome("evt-stuck").await, None, "still waiting for its customer");
    assert_eq!(h.committed().await.get(&stuck_partition).copied().flatten().unwrap_or(0), stuck);

    ready.store(true, Ordering::SeqCst);
    eventually("the stuck record applied once its customer is known", DEADLINE, || async {
        (h.outcome("evt-stuck").await.as_deref() == Some("applied")).then_some(())
    })
    .await;
    eventually("the records behind it committed", DEADLINE, || async {
        let c = h.committed().await.get(&stuck_partition).copied().flatten();
        c.is_some_and(|c| c > last_behind).then_some(())
    })
    .await;
    run.stop().await.unwrap();
    assert_eq!(h.db.count("inbox", &format!("event_id LIKE 'behind-%' AND partition = {stuck_partition}")).await, 120);
}

#[tokio::test]
async fn an_event_for_an_aggregate_that_never_appears_is_retried_then_parked_and_replayable() {
    let h = Harness::new(1).await;
    let confirmed = |id: &str, order: &str| TestEvent::new(id, "payment.confirmed", json!({"order_id": order}));
    let (_, missing) = h.send(&confirmed("p-1", "o-missing")).await;
    let (_, last) = h.send(&confirmed("p-2", "o-missing-too")).await;
    let cfg = h.config(&SAGA_ROUTE);
    let run = h.start(cfg.clone(), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();

    let (class, attempts, offset): (String, i32, i64) =
        sqlx::query_as(r#"SELECT error_class, attempts, "offset" FROM relay.dead_letters WHERE event_id = 'p-1'"#)
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
    assert_eq!(
        (class.as_str(), attempts, offset),
        ("missing_reference", 4, missing),
        "parked after its 4 attempts, never dropped"
    );
    assert_eq!(h.inbox().await, 0);

    // The aggregate shows up; the operator replays the dead letter: same event id, same guards.
    sqlx::query("INSERT INTO relay.sagas (consumer, saga_type, saga_id, state, last_event_id) VALUES ($1, 'order', 'o-missing', 'pending', 'seed')")
        .bind(&h.consumer)
        .execute(&h.db.pool)
        .await
        .unwrap();
    let relay = h.relay(cfg, Handlers::default(), no_faults()).await;
    let id: i64 = sqlx::query_scalar("SELECT id FROM relay.dead_letters WHERE event_id = 'p-1'")
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    assert_eq!(relay.operator().replay(&relay.processor(), id).await.unwrap(), ReplayOutcome::Applied);
    assert_eq!(
        relay.operator().replay(&relay.processor(), id).await.unwrap(),
        ReplayOutcome::Duplicate,
        "a second replay is a no-op"
    );
    let state: String = sqlx::query_scalar("SELECT state FROM relay.sagas WHERE saga_id = 'o-missing'")
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    assert_eq!(state, "paid");
    assert_eq!(h.outcome("p-1").await.as_deref(), Some("applied"));
}

/// Two saga moves of one order, keyed by it; a dead letter of either holds the key.
static HELD_SAGA_ROUTES: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let held = "on_poison = \"hold_key\"\n";
    [
        routes::route(None, "payment.confirmed", held),
        routes::saga_move("mark-paid", "pending", "paid"),
        routes::route(None, "order.shipped", held),
        routes::saga_move("mark-shipped", "paid", "shipped"),
    ]
    .concat()
});

#[tokio::test]
async fn a_parked_record_holds_its_key_and_a_replay_releases_the_held_records_in_order() {
    let h = Harness::new(1).await;
    let ev = |id: &str, ty: &str, order: &str, key: &str| TestEvent::new(id, ty, json!({"order_id": order})).key(key);
    sqlx::query(
        "INSERT INTO relay.sagas (consumer, saga_type, saga_id, state, last_event_id) VALUES ($1, 'order', 'o-2', 'pending', 's')",
    )
    .bind(&h.consumer)
    .execute(&h.db.pool)
    .await
    .unwrap();
    // o-1 and o-3 do not exist yet: their first records wait, then are parked and hold their keys.
    h.send(&ev("p-1", "payment.confirmed", "o-1", "o-1")).await;
    h.send(&ev("p-2", "payment.confirmed", "o-2", "o-2")).await;
    h.send(&ev("s-1", "order.shipped", "o-1", "o-1")).await; // held: applied only after p-1
    h.send(&ev("p-3", "payment.confirmed", "o-3", "o-3")).await;
    h.send(&ev("s-3", "order.shipped", "o-missing", "o-3")).await; // held; on release it fails in its turn
    let (_, last) = h.send(&ev("s-3b", "order.shipped", "o-3", "o-3")).await; // held behind both
    let mut cfg = h.config(&HELD_SAGA_ROUTES);
    cfg.consumer.dead_letter_topic = Some(format!("{}-dlq", h.topic));
    let run = h.start(cfg.clone(), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();

    assert_eq!(h.outcome("p-2").await.as_deref(), Some("applied"), "another key flows");
    for held in ["s-1", "s-3", "s-3b"] {
        assert_eq!(h.outcome(held).await, None, "{held} is not applied while its key is held");
    }
    let letter = async |event: &str| -> (i64, String, Option<i64>) {
        sqlx::query_as("SELECT id, error_class, hold_id FROM relay.dead_letters WHERE event_id = $1")
            .bind(event)
            .fetch_one(&h.db.pool)
            .await
            .unwrap()
    };
    let (p1, class, hold) = letter("p-1").await;
    assert_eq!((class.as_str(), hold.is_some()), ("missing_reference", true));
    let (s1, class, _) = letter("s-1").await;
    assert_eq!(class, "held");
    assert_eq!(h.db.count("held_keys", "true").await, 2, "o-1 and o-3 are held");
    assert_eq!(
        h.db.count("outbox", "true").await,
        2,
        "copies of p-1 and p-3 for the dead-letter topic, none of the held"
    );

    let relay = h.relay(cfg.clone(), Handlers::default(), no_faults()).await;
    let ops = relay.operator();
    // A held record never goes ahead of its head, nor is it deleted.
    let early = ops.replay(&relay.processor(), s1).await.unwrap();
    assert!(matches!(&early, ReplayOutcome::Held(why) if why.contains(&format!("dead letter {p1}"))), "{early:?}");
    assert!(ops.delete_dead_letter(s1).await.is_err());
    assert!(ops.delete_dead_letter(p1).await.is_err(), "nor is its head");
    assert_eq!(h.outcome("s-1").await, None);

    // o-1 appears; replaying its head applies it, then what was held, in order.
    sqlx::query("INSERT INTO relay.sagas (consumer, saga_type, saga_id, state, last_event_id) VALUES ($1, 'order', 'o-1', 'pending', 's'), ($1, 'order', 'o-3', 'pending', 's')")
        .bind(&h.consumer)
        .execute(&h.db.pool)
        .await
        .unwrap();
    let r = ops.replay_releasing(&relay.processor(), p1).await.unwrap();
    assert_eq!(r.outcome, ReplayOutcome::Applied);
    let released = r.released.expect("the key is released");
    assert_eq!((released.key.as_slice(), released.replayed, released.held_behind), (&b"o-1"[..], 1, None));
    assert_eq!(h.outcome("s-1").await.as_deref(), Some("applied"), "shipped after paid, not before");
    let state: String =
        sqlx::query_scalar("SELECT state FROM relay.sagas WHERE saga_id = 'o-1'").fetch_one(&h.db.pool).await.unwrap();
    assert_eq!(state, "shipped");

    // o-3: the first held record fails in its turn and holds the key now; the one after it stays held.
    let (p3, _, _) = letter("p-3").await;
    let r = ops.replay_releasing(&relay.processor(), p3).await.unwrap();
    let (s3, _, _) = letter("s-3").await;
    assert_eq!(r.released.as_ref().map(|r| (r.replayed, r.held_behind)), Some((0, Some(s3))), "{r:?}");
    let (_, class, hold) = letter("s-3").await;
    assert_eq!((class.as_str(), hold.is_some()), ("missing_reference", true));
    let copied = format!("source_id = '{}/0/' || (SELECT \"offset\" FROM relay.dead_letters WHERE id = {s3})", h.topic);
    assert_eq!(
        h.db.count("outbox", &copied).await,
        1,
        "failing in its turn, s-3 is poison: copied to the dead-letter topic"
    );
    assert_eq!(h.outcome("s-3b").await, None, "still held behind s-3");
    let s3b = ops.dead_letter(dead_letter_of(&h, "s-3b").await).await.unwrap();
    assert_eq!(s3b.meta.held_behind, Some(s3), "it names its new head");
    let listed: Vec<_> = ops.held_keys(10).await.unwrap().iter().map(|k| (k.head, k.held, k.head_resolved)).collect();
    assert!(listed.contains(&(s3, 1, false)), "{listed:?}");
    // Skipping s-3 (never applied) lets s-3b through.
    let released = ops.skip_dead_letter(&relay.processor(), s3).await.unwrap();
    assert_eq!((released.replayed, released.held_behind), (1, None));
    assert_eq!(h.outcome("s-3").await.as_deref(), Some("skipped"), "a skipped record is never applied");
    assert_eq!(h.outcome("s-3b").await.as_deref(), Some("applied"));
    assert_eq!(h.db.count("held_keys", "true").await, 0);
    assert!(ops.skip_dead_letter(&relay.processor(), s3).await.is_err(), "nothing to skip any more");

    // Released, the key flows again at ingest.
    h.send(&ev("p-1-again", "payment.confirmed", "o-1", "o-1")).await;
    let (_, last) = h.send(&ev("s-3c", "order.shipped", "o-3", "o-3")).await;
    let run = h.start(cfg, CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    assert_eq!(h.outcome("p-1-again").await.as_deref(), Some("invalid_transition"));
    assert_eq!(h.outcome("s-3c").await.as_deref(), Some("duplicate_transition"));
    assert_eq!(h.db.count("dead_letters", "error_class = 'held' AND replay_outcome IS NULL").await, 0);
}

/// The id of the dead letter of event `event`.
async fn dead_letter_of(h: &Harness, event: &str) -> i64 {
    sqlx::query_scalar("SELECT id FROM relay.dead_letters WHERE event_id = $1")
        .bind(event)
        .fetch_one(&h.db.pool)
        .await
        .unwrap()
}

/// Until `n` sessions of the test database wait for a lock, in statements
/// that read `table`.
async fn lock_waiters(h: &Harness, n: i64, table: &str) {
    eventually(&format!("{n} session(s) waiting for a lock on {table}"), DEADLINE, || async {
        let waiters: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'",
        )
        .bind(table)
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
        (waiters >= n).then_some(())
    })
    .await;
}

/// Order saga `id`, in `state`.
async fn order_saga(h: &Harness, id: &str, state: &str) {
    sqlx::query("INSERT INTO relay.sagas (consumer, saga_type, saga_id, state, last_event_id) VALUES ($3, 'order', $1, $2, 's')")
        .bind(id)
        .bind(state)
        .bind(&h.consumer)
        .execute(&h.db.pool)
        .await
        .unwrap();
}

/// `on_poison = "hold_key"` taken out of the config while keys are held:
/// the holds already recorded still hold, until their heads are dealt with.
#[tokio::test]
async fn a_key_held_before_hold_key_was_taken_out_of_the_config_stays_held() {
    let h = Harness::new(1).await;
    let ev = |id: &str, ty: &str| TestEvent::new(id, ty, json!({"order_id": "o-1"})).key("o-1");
    let (_, last) = h.send(&ev("p-1", "payment.confirmed")).await; // o-1 does not exist yet: parked, holds o-1
    let run = h.start(h.config(&HELD_SAGA_ROUTES), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    assert_eq!(h.db.count("held_keys", "true").await, 1);

    order_saga(&h, "o-1", "pending").await;
    let cfg = h.config(&HELD_SAGA_ROUTES.replace("on_poison = \"hold_key\"\n", ""));
    assert!(!format!("{cfg:?}").contains("HoldKey"), "no route holds keys any more");
    // Applied now, s-1 would find the order pending and be lost as an invalid transition.
    let (_, last) = h.send(&ev("s-1", "order.shipped")).await;
    let run = h.start(cfg.clone(), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    assert_eq!(h.outcome("s-1").await, None, "s-1 waits behind p-1 although no route holds keys now");
    assert_eq!(h.db.count("dead_letters", "event_id = 's-1' AND error_class = 'held'").await, 1);

    let relay = h.relay(cfg, Handlers::default(), no_faults()).await;
    let p1 = dead_letter_of(&h, "p-1").await;
    let r = relay.operator().replay_releasing(&relay.processor(), p1).await.unwrap();
    assert_eq!((r.outcome, r.released.map(|r| r.replayed)), (ReplayOutcome::Applied, Some(1)));
    assert_eq!(h.outcome("s-1").await.as_deref(), Some("applied"), "in order: paid, then shipped");
    assert_eq!(h.db.count("held_keys", "true").await, 0);
}

/// A record without a Kafka key, dead-lettered on a `hold_key` route,
/// holds nothing; a keyed record of the same order after it is applied.
/// An empty key is a key like any other.
#[tokio::test]
async fn a_record_without_a_key_holds_nothing_and_an_empty_key_is_held() {
    let h = Harness::new(1).await;
    order_saga(&h, "o-2", "paid").await;
    let ev = |id: &str, ty: &str, order: &str| TestEvent::new(id, ty, json!({"order_id": order}));
    h.send(&ev("p-1", "payment.confirmed", "o-1")).await; // no key; o-1 does not exist: parked
    h.send(&ev("p-9", "payment.confirmed", "o-9").key("")).await; // empty key; parked, holds ""
    h.send(&ev("s-2", "order.shipped", "o-2")).await; // no key: goes on
    let (_, last) = h.send(&ev("s-2b", "order.shipped", "o-2").key("")).await; // held behind p-9
    let run = h.start(h.config(&HELD_SAGA_ROUTES), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    assert_eq!(h.outcome("s-2").await.as_deref(), Some("applied"));
    assert_eq!(h.outcome("s-2b").await, None);
    assert_eq!(h.db.count("dead_letters", "event_id = 'p-1' AND hold_id IS NULL").await, 1);
    assert_eq!(h.db.count("held_keys", "key = ''::bytea").await, 1);
    assert_eq!(h.db.count("held_keys", "true").await, 1);
}

/// A release replays held records a chunk per transaction. Cut short
/// between two chunks (a crash: the fault point fails), the key stays held
/// behind its resolved head, and replaying (or skipping) that head again
/// goes on from where it stopped, in order, without applying anything twice.
#[tokio::test]
async fn a_release_cut_short_between_chunks_is_taken_up_by_replaying_or_skipping_the_head_again() {
    let h = Harness::new(1).await;
    let orders = ["a", "b", "c", "d", "e", "f", "g", "h"];
    for o in orders {
        order_saga(&h, o, "pending").await;
    }
    let pay =
        |id: &str, order: &str, key: &str| TestEvent::new(id, "payment.confirmed", json!({"order_id": order})).key(key);
    // Two keys, each held behind a payment of an order that does not exist
    // yet, with four payments of existing orders behind it.
    h.send(&pay("p-1", "o-1", "k-1")).await;
    h.send(&pay("p-2", "o-2", "k-2")).await;
    let mut last = 0;
    for (n, o) in orders.iter().enumerate() {
        let key = if n < 4 { "k-1" } else { "k-2" };
        last = h.send(&pay(&format!("pay-{o}"), o, key)).await.1;
    }
    let cfg = h.config(&HELD_SAGA_ROUTES);
    let run = h.start(cfg.clone(), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    assert_eq!(h.db.count("dead_letters", "error_class = 'held'").await, 8);
    order_saga(&h, "o-1", "pending").await;
    let (p1, p2) = (dead_letter_of(&h, "p-1").await, dead_letter_of(&h, "p-2").await);
    let applied = async |orders: &[&str]| -> Vec<Option<String>> {
        let mut out = Vec::new();
        for o in orders {
            out.push(h.outcome(&format!("pay-{o}")).await);
        }
        out
    };
    let yes = || Some("applied".to_string());

    // Chunks of 2; the release stops after the first one.
    let cut = Faults::new(&[(relay::runtime::faults::point::RELEASE_AFTER_CHUNK, FaultAction::Fail, 1)]);
    let relay = h.relay(cfg.clone(), Handlers::default(), cut.clone()).await;
    let ops = relay.operator().with_release_chunk(2);
    assert!(ops.replay_releasing(&relay.processor(), p1).await.is_err(), "cut short");
    assert_eq!(applied(&["a", "b", "c", "d"]).await, [yes(), yes(), None, None]);
    assert_eq!(h.outcome("p-1").await.as_deref(), Some("applied"));
    assert_eq!(h.db.count("held_keys", "key = 'k-1'::bytea").await, 1, "still held behind p-1");
    // Each chunk lets go of the letters it replayed: the last one has no
    // backlog of them to clear in its transaction.
    assert_eq!(h.db.count("dead_letters", "event_id IN ('pay-a', 'pay-b') AND hold_id IS NOT NULL").await, 0);
    assert_eq!(h.db.count("dead_letters", "event_id IN ('p-1', 'pay-c', 'pay-d') AND hold_id IS NOT NULL").await, 3);
    // A record of the key that comes meanwhile is parked behind the head,
    // resolved or not, and goes with the rest.
    order_saga(&h, "x", "pending").await;
    let (_, last) = h.send(&pay("pay-x", "x", "k-1")).await;
    let run = h.start(cfg.clone(), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    assert_eq!(h.db.count("dead_letters", "event_id = 'pay-x' AND error_class = 'held'").await, 1);
    let relay = h.relay(cfg.clone(), Handlers::default(), no_faults()).await;
    let ops = relay.operator().with_release_chunk(2);
    let shown = ops.held_keys(10).await.unwrap();
    let cut_short: Vec<_> = shown.iter().map(|k| (k.head, k.held, k.head_resolved)).collect();
    assert!(cut_short.contains(&(p1, 3, true)), "the listing shows the release cut short: {cut_short:?}");
    // Retention took p-1's inbox row meanwhile: taking the release up must
    // not process p-1 again (it would be applied a second time).
    sqlx::query("DELETE FROM relay.inbox WHERE event_id = 'p-1'").execute(&h.db.pool).await.unwrap();
    let again = ops.replay_releasing(&relay.processor(), p1).await.unwrap();
    assert_eq!(again.outcome, ReplayOutcome::Duplicate);
    assert_eq!(h.outcome("p-1").await, None, "p-1 was not processed again");
    assert_eq!(again.released.map(|r| (r.replayed, r.held_behind)), Some((3, None)), "c, d and x, not a and b again");
    assert_eq!(applied(&["a", "b", "c", "d", "x"]).await, [yes(), yes(), yes(), yes(), yes()]);
    let stored: Option<String> = sqlx::query_scalar("SELECT replay_outcome FROM relay.dead_letters WHERE id = $1")
        .bind(p1)
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    assert_eq!(stored.as_deref(), Some("applied"), "the second replay keeps what the first one did on record");
    // Released and let go, p-1 and a are resolved letters like any other: a
    // replay of either, once retention took its inbox row or while its route
    // is paused, neither applies it again nor reopens it.
    sqlx::query("DELETE FROM relay.inbox WHERE event_id IN ('p-1', 'pay-a')").execute(&h.db.pool).await.unwrap();
    let mut conn = h.db.pool.acquire().await.unwrap();
    let paid = format!("{}/payment.confirmed", h.topic);
    relay_store::ops::pause(&mut conn, &h.consumer, relay_store::ops::PauseKind::Route, &paid, None).await.unwrap();
    for (event, letter) in [("p-1", p1), ("pay-a", dead_letter_of(&h, "pay-a").await)] {
        let again = ops.replay_releasing(&relay.processor(), letter).await.unwrap();
        assert_eq!((again.outcome, again.released), (ReplayOutcome::Duplicate, None), "{event}");
        assert_eq!(h.outcome(event).await, None, "{event} was not processed again");
        let stored: Option<String> = sqlx::query_scalar("SELECT replay_outcome FROM relay.dead_letters WHERE id = $1")
            .bind(letter)
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
        assert_eq!(stored.as_deref(), Some("applied"), "{event} stays resolved");
    }
    relay_store::ops::resume(&mut conn, &h.consumer, relay_store::ops::PauseKind::Route, &paid).await.unwrap();

    // The same with a skip, taken up by skipping again.
    let cut = Faults::new(&[(relay::runtime::faults::point::RELEASE_AFTER_CHUNK, FaultAction::Fail, 1)]);
    let relay = h.relay(cfg.clone(), Handlers::default(), cut).await;
    assert!(relay.operator().with_release_chunk(3).skip_dead_letter(&relay.processor(), p2).await.is_err());
    assert_eq!(applied(&["e", "f", "g", "h"]).await, [yes(), yes(), yes(), None]);
    let relay = h.relay(cfg, Handlers::default(), no_faults()).await;
    let ops = relay.operator().with_release_chunk(3);
    let replayed = ops.replay_releasing(&relay.processor(), p2).await.unwrap();
    assert_eq!(replayed.outcome, ReplayOutcome::Skipped);
    assert_eq!(replayed.released.map(|r| r.replayed), Some(1), "a replay of the skipped head takes the release up too");
    assert_eq!(applied(&["e", "f", "g", "h"]).await, [yes(), yes(), yes(), yes()]);
    assert_eq!(h.outcome("p-2").await.as_deref(), Some("skipped"));
    assert_eq!(h.db.count("held_keys", "true").await, 0);
    assert!(ops.skip_dead_letter(&relay.processor(), p2).await.is_err(), "nothing held any more");
}

/// A replay of a held record while its key is being released: the release
/// holds the hold and then marks the held records, so a replay that locked
/// its letter first and then waited for the hold would deadlock with it.
/// Both take the hold first: the second waits for the first and finds the
/// record replayed.
#[tokio::test]
async fn a_replay_of_a_held_record_during_its_key_s_release_waits_for_it_and_does_not_deadlock() {
    let h = Harness::new(1).await;
    order_saga(&h, "a", "pending").await;
    let pay = |id: &str, order: &str| TestEvent::new(id, "payment.confirmed", json!({"order_id": order})).key("k-1");
    h.send(&pay("p-1", "o-1")).await; // o-1 does not exist yet: holds k-1
    let (_, last) = h.send(&pay("pay-a", "a")).await;
    let cfg = h.config(&HELD_SAGA_ROUTES);
    let run = h.start(cfg.clone(), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    order_saga(&h, "o-1", "pending").await;
    let (p1, held) = (dead_letter_of(&h, "p-1").await, dead_letter_of(&h, "pay-a").await);

    // The replay of p-1 stops on o-1's row, locked here, with the hold taken.
    let mut blocker = h.db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM relay.sagas WHERE saga_id = 'o-1' FOR UPDATE").execute(&mut *blocker).await.unwrap();
    let relay = h.relay(cfg, Handlers::default(), no_faults()).await;
    let (ops, processor) = (relay.operator(), relay.processor());
    let head = ops.replay_releasing(&processor, p1);
    let behind = async {
        // The head's replay, its hold taken, waits for o-1's row.
        lock_waiters(&h, 1, "relay.sagas").await;
        ops.replay_releasing(&processor, held).await
    };
    let unblock = async {
        // The held record's replay waits for the hold.
        lock_waiters(&h, 1, "relay.held_keys").await;
        blocker.commit().await.unwrap();
    };
    let (head, behind, ()) = tokio::join!(head, behind, unblock);
    let head = head.expect("the release of k-1");
    let behind = behind.expect("the replay of the held record");
    assert_eq!(head.outcome, ReplayOutcome::Applied);
    assert_eq!(head.released.map(|r| (r.replayed, r.held_behind)), Some((1, None)));
    assert_eq!(behind.outcome, ReplayOutcome::Duplicate, "released before it: applied once");
    assert_eq!(h.outcome("pay-a").await.as_deref(), Some("applied"));
    assert_eq!(h.db.count("held_keys", "true").await, 0);
}

/// The database rejects a record in the middle of a batch's first run: the
/// bare run is rolled back and redone a record at a time. The rejected
/// record holds its key from there, in the same batch: the next record of
/// its key is held behind it, while the other keys are applied.
#[tokio::test]
async fn a_record_the_database_rejects_mid_batch_holds_its_key_for_the_rest_of_the_batch() {
    let h = Harness::new(1).await;
    h.send(&order("ok-1", "o-1")).await;
    let bad = TestEvent::new("bad", "order.placed", json!({"order_id": "o-2", "amount": "1\u{0}"})).key("o-2");
    h.send(&bad).await;
    h.send(&order("after-bad", "o-2")).await;
    let (_, last) = h.send(&order("ok-3", "o-3")).await;
    let routes =
        CAPTURE_ROUTE.replacen("counter = \"orders\"\n", "counter = \"orders\"\non_poison = \"hold_key\"\n", 1);
    assert!(routes.contains("hold_key"));
    let run = h.start(h.config(&routes), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    assert_eq!(h.outcome("ok-1").await.as_deref(), Some("applied"));
    assert_eq!(h.outcome("ok-3").await.as_deref(), Some("applied"));
    assert_eq!(h.outcome("after-bad").await, None, "held behind the rejected record of its key");
    assert_eq!(
        h.db.count("dead_letters", "event_id = 'bad' AND error_class = 'rejected' AND hold_id IS NOT NULL").await,
        1
    );
    assert_eq!(h.db.count("dead_letters", "event_id = 'after-bad' AND error_class = 'held'").await, 1);
    assert_eq!(h.db.count("held_keys", "key = 'o-2'::bytea").await, 1);
}

/// A held record whose route is paused when its key is released stops the
/// release there: it holds the key now (still of class `held`, its reason
/// naming the route), and goes through once the route is resumed.
#[tokio::test]
async fn a_release_stops_at_a_held_record_of_a_paused_route_until_it_is_resumed() {
    use relay_store::ops::{self, PauseKind};
    let h = Harness::new(1).await;
    let ev = |id: &str, ty: &str| TestEvent::new(id, ty, json!({"order_id": "o-1"})).key("o-1");
    h.send(&ev("p-1", "payment.confirmed")).await; // o-1 does not exist yet: parked, holds o-1
    let (_, last) = h.send(&ev("s-1", "order.shipped")).await; // held
    let cfg = h.config(&HELD_SAGA_ROUTES);
    let run = h.start(cfg.clone(), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    order_saga(&h, "o-1", "pending").await;
    let shipped = format!("{}/order.shipped", h.topic);
    let mut conn = h.db.conn().await.unwrap();
    ops::pause(&mut conn, &h.consumer, PauseKind::Route, &shipped, None).await.unwrap();

    let relay = h.relay(cfg, Handlers::default(), no_faults()).await;
    let ops_ = relay.operator();
    let (p1, s1) = (dead_letter_of(&h, "p-1").await, dead_letter_of(&h, "s-1").await);
    let r = ops_.replay_releasing(&relay.processor(), p1).await.unwrap();
    assert_eq!(r.outcome, ReplayOutcome::Applied, "p-1's own route is not paused");
    assert_eq!(r.released.map(|r| (r.replayed, r.held_behind)), Some((0, Some(s1))));
    assert_eq!(h.outcome("s-1").await, None, "nothing goes through a paused route");
    let (class, reason): (String, String) =
        sqlx::query_as("SELECT error_class, reason FROM relay.dead_letters WHERE id = $1")
            .bind(s1)
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
    assert_eq!(class, "held");
    assert!(reason.contains(&shipped) && reason.contains("paused"), "{reason}");
    assert_eq!(h.db.count("held_keys", &format!("head = {s1}")).await, 1, "s-1 holds the key now");

    ops::resume(&mut conn, &h.consumer, PauseKind::Route, &shipped).await.unwrap();
    let r = ops_.replay_releasing(&relay.processor(), s1).await.unwrap();
    assert_eq!((r.outcome, r.released.map(|r| r.replayed)), (ReplayOutcome::Applied, Some(0)));
    assert_eq!(h.outcome("s-1").await.as_deref(), Some("applied"));
    assert_eq!(h.db.count("held_keys", "true").await, 0);
}

/// A skip that comes while a batch is parking a record behind the same
/// key waits for that batch (its hold read is locked `FOR SHARE`), and
/// then releases that record too: none is left held behind no hold.
#[tokio::test]
async fn a_skip_waits_for_a_batch_parking_a_record_behind_the_key_and_releases_it() {
    let h = Harness::new(1).await;
    let ev = |id: &str, ty: &str| TestEvent::new(id, ty, json!({"order_id": "o-1"})).key("o-1");
    let (_, last) = h.send(&ev("p-1", "payment.confirmed")).await; // o-1 does not exist yet: parked, holds o-1
    let cfg = h.config(&HELD_SAGA_ROUTES);
    let run = h.start(cfg.clone(), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    order_saga(&h, "o-1", "paid").await;

    // The batch of s-1 stops for 5 s right after it read the hold of o-1,
    // before it parks s-1 behind it.
    let hold_read = relay::runtime::faults::point::CONSUMER_AFTER_HOLD_READ;
    let slow = Faults::new(&[(hold_read, FaultAction::Pause(std::time::Duration::from_secs(5)), 1)]);
    let (_, last) = h.send(&ev("s-1", "order.shipped")).await;
    let run = h.start(cfg.clone(), CONSUMER_ONLY, slow.clone()).await;
    eventually("the batch of s-1 to read the hold", DEADLINE, || async { (slow.hits(hold_read) >= 1).then_some(()) })
        .await;
    let relay = h.relay(cfg, Handlers::default(), no_faults()).await;
    let p1 = dead_letter_of(&h, "p-1").await;
    let (ops, processor) = (relay.operator(), relay.processor());
    // The skip waits for the batch (it would not, begun after the batch).
    let (released, ()) = tokio::join!(ops.skip_dead_letter(&processor, p1), lock_waiters(&h, 1, "relay.held_keys"));
    let released = released.unwrap();
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    assert_eq!((released.replayed, released.held_behind), (1, None), "the skip saw s-1, parked meanwhile");
    assert_eq!(h.outcome("s-1").await.as_deref(), Some("applied"));
    assert_eq!(h.db.count("dead_letters", "error_class = 'held' AND replay_outcome IS NULL").await, 0);
}

/// A skipped head is never applied: not by a replay afterwards (the
/// records of its key went ahead of it), nor by a redelivery of its record
/// (a crash before the offset commit; here a new consumer group reads the
/// topic again).
#[tokio::test]
async fn a_skipped_head_is_never_applied_by_a_later_replay_or_a_redelivery() {
    let h = Harness::new(1).await;
    let p1 = TestEvent::new("p-1", "payment.confirmed", json!({"order_id": "o-1"})).key("o-1");
    let (_, last) = h.send(&p1).await; // o-1 does not exist yet: parked, holds o-1
    let cfg = h.config(&HELD_SAGA_ROUTES);
    let run = h.start(cfg.clone(), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();

    let relay = h.relay(cfg.clone(), Handlers::default(), no_faults()).await;
    let ops = relay.operator();
    let p1 = dead_letter_of(&h, "p-1").await;
    let released = ops.skip_dead_letter(&relay.processor(), p1).await.unwrap();
    assert_eq!((released.replayed, released.held_behind), (0, None));
    assert_eq!(h.outcome("p-1").await.as_deref(), Some("skipped"));

    // The reason p-1 failed is gone now: applied, it would move the order.
    order_saga(&h, "o-1", "pending").await;
    let again = ops.replay_releasing(&relay.processor(), p1).await.unwrap();
    assert_eq!(again.outcome, ReplayOutcome::Skipped, "{again:?}");
    assert!(again.outcome.resolved());
    let mut reread = cfg;
    let group = format!("{}-reread", h.group);
    reread.consumer.group_id = Some(group.clone());
    let run = h.start(reread, CONSUMER_ONLY, no_faults()).await;
    eventually("the topic read again", DEADLINE, || async {
        let committed = relay_testkit::committed_offsets(&h.bootstrap, &group, &h.topic).await.ok()?;
        (committed.get(&0).copied().flatten() == Some(last + 1)).then_some(())
    })
    .await;
    run.stop().await.unwrap();
    let state: String =
        sqlx::query_scalar("SELECT state FROM relay.sagas WHERE saga_id = 'o-1'").fetch_one(&h.db.pool).await.unwrap();
    assert_eq!(state, "pending", "the skipped payment was never applied");
    let outcome: Option<String> = sqlx::query_scalar("SELECT replay_outcome FROM relay.dead_letters WHERE id = $1")
        .bind(p1)
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    assert_eq!(outcome.as_deref(), Some("skipped"));
}

#[tokio::test]
async fn saga_moves_are_guarded_and_every_no_op_is_classified() {
    let h = Harness::new(1).await;
    sqlx::query("INSERT INTO relay.sagas (consumer, saga_type, saga_id, state, last_event_id) VALUES ($1, 'order', 'o-1', 'pending', 's'), ($1, 'order', 'o-2', 'shipped', 's')")
        .bind(&h.consumer)
        .execute(&h.db.pool)
        .await
        .unwrap();
    let confirmed = |id: &str, order: &str| TestEvent::new(id, "payment.confirmed", json!({"order_id": order}));
    h.send(&confirmed("p-1", "o-1")).await; // pending -> paid
    h.send(&confirmed("p-1-again", "o-1")).await; // already paid: duplicate transition
    let (_, last) = h.send(&confirmed("p-2", "o-2")).await; // shipped: invalid transition
    let run = h.start(h.config(&SAGA_ROUTE), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();

    assert_eq!(h.outcome("p-1").await.as_deref(), Some("applied"));
    assert_eq!(h.outcome("p-1-again").await.as_deref(), Some("duplicate_transition"));
    assert_eq!(h.outcome("p-2").await.as_deref(), Some("invalid_transition"));
    let history = h.db.count("history", "kind = 'saga' AND source_id = 'p-1'").await;
    assert_eq!(history, 1, "the applied transition has one history row keyed by its event");
}

const SEQUENCE_ROUTE: &str = r#"
[[routes]]
topic = "{topic}"
type = "account.entry"
sequence_guard = true

[[routes.actions]]
kind = "emit"
name = "posted"
type = "account.posted"
topic = "{out}"
data = { seq = "{{ sequence }}" }
"#;

#[tokio::test]
async fn the_sequence_guard_applies_in_order_and_never_applies_across_a_gap() {
    let h = Harness::new(1).await;
    let entry = |id: &str, seq: i64| {
        TestEvent::new(id, "account.entry", json!({})).ext("aggregateid", "acct-1").ext("sequence", seq)
    };
    h.send(&entry("e-1", 1)).await;
    h.send(&entry("e-1-dup", 1)).await; // seq <= last: duplicate
    let (_, gap) = h.send(&entry("e-3", 3)).await; // gap: waits, then parked
    let (_, last) = h.send(&entry("e-2", 2)).await; // the missing one, behind it in the partition
    let cfg = h.config(SEQUENCE_ROUTE);
    let run = h.start(cfg.clone(), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();

    assert_eq!(h.outcome("e-1-dup").await.as_deref(), Some("duplicate_sequence"));
    assert_eq!(h.outcome("e-2").await.as_deref(), Some("applied"));
    assert_eq!(h.outcome("e-3").await, None, "never applied across the gap");
    let (id, class, offset): (i64, String, i64) =
        sqlx::query_as(r#"SELECT id, error_class, "offset" FROM relay.dead_letters"#)
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
    assert_eq!((class.as_str(), offset), ("sequence_gap", gap));

    // Now that 2 is applied, replaying 3 applies it.
    let relay = h.relay(cfg, Handlers::default(), no_faults()).await;
    assert_eq!(relay.operator().replay(&relay.processor(), id).await.unwrap(), ReplayOutcome::Applied);
    let last_seq: i64 = sqlx::query_scalar("SELECT last_seq FROM relay.aggregates WHERE aggregate_id = 'acct-1'")
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    assert_eq!(last_seq, 3);
}

#[tokio::test]
async fn a_template_that_references_a_missing_field_dead_letters_the_event_naming_the_field() {
    let h = Harness::new(1).await;
    let (_, bad) = h.send(&TestEvent::new("evt-1", "order.placed", json!({"amount": 5}))).await;
    let (_, last) = h.send(&order("evt-2", "o-2")).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    let (class, reason, offset): (String, String, i64) =
        sqlx::query_as(r#"SELECT error_class, reason, "offset" FROM relay.dead_letters"#)
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
    assert_eq!((class.as_str(), offset), ("template_error", bad));
    assert!(reason.contains("data.order_id"), "{reason}");
    assert_eq!(h.inbox().await, 1);
}

/// An event applied before a restart, delivered again after its route
/// changed so that it no longer renders (as after a crash between the
/// database commit and the offset commit, with a config or a latest schema
/// changed meanwhile): a duplicate, not a dead letter holding its key.
#[tokio::test]
async fn an_applied_event_delivered_again_after_its_route_changed_is_a_duplicate_not_a_dead_letter() {
    let h = Harness::new(1).await;
    h.send(&order("evt-1", "o-1")).await;
    h.send(&order("evt-2", "o-2")).await;
    let held = CAPTURE_ROUTE.replace("counter = \"orders\"", "counter = \"orders\"\non_poison = \"hold_key\"");
    let run = h.start(h.config(&held), CONSUMER_ONLY, no_faults()).await;
    h.await_inbox(2).await;
    run.stop().await.unwrap();

    // The path now reads a field these events lack; o-1 gets a new event too.
    h.send(&order("evt-3", "o-3")).await;
    let (_, last) = h.send(&order("evt-4", "o-1")).await;
    let mut cfg =
        h.config(&held.replace("/captures/{{ data.order_id }}", "/captures/{{ data.order_id }}/{{ data.shop }}"));
    let group = unique("redelivery-group");
    cfg.consumer.group_id = Some(group.clone());
    let run = h.start(cfg, CONSUMER_ONLY, no_faults()).await;
    eventually("the new group past every record", DEADLINE, || async {
        let c = relay_testkit::committed_offsets(&h.bootstrap, &group, &h.topic).await.unwrap();
        (c.get(&0).copied().flatten() == Some(last + 1)).then_some(())
    })
    .await;
    run.stop().await.unwrap();
    let dead: Vec<String> = sqlx::query_scalar("SELECT event_id FROM relay.dead_letters ORDER BY \"offset\"")
        .fetch_all(&h.db.pool)
        .await
        .unwrap();
    assert_eq!(dead, ["evt-3", "evt-4"], "only the events never applied are dead-lettered");
    assert_eq!(h.inbox().await, 2);
    // evt-4 holds o-1's key as its own dead letter; evt-1, applied, held nothing before it.
    let held_at: Vec<i64> = sqlx::query_scalar("SELECT head_offset FROM relay.held_keys ORDER BY head_offset")
        .fetch_all(&h.db.pool)
        .await
        .unwrap();
    assert_eq!(held_at, [last - 1, last], "o-3's and o-1's keys, each held by its own dead letter");
}

#[tokio::test]
async fn while_the_database_is_down_nothing_is_committed_and_processing_resumes_when_it_is_back() {
    // Connections reset, and new ones refused.
    outage_then_back(relay_testkit::TcpProxy::cut, "the consumer to retry the database").await;
}

#[tokio::test]
async fn a_database_that_goes_silent_mid_batch_is_given_up_on_and_the_partition_goes_on_once_it_answers() {
    // The host goes silent without a reset (a failover, a frozen machine):
    // the pooled connections stay open and never answer again, and the
    // connections opened instead are never answered either.
    outage_then_back(relay_testkit::TcpProxy::stall, "relay to give up on a silent connection and open another").await;
}

/// A handler that takes its time over each record, on the database.
struct Slow;

#[async_trait]
impl Handler for Slow {
    async fn handle(&self, tx: &mut sqlx::PgConnection, _: &InputEvent) -> Result<Plan, HandlerError> {
        sqlx::query("SELECT pg_sleep(0.3)").execute(&mut *tx).await?;
        Ok(Plan::default())
    }
}

// A batch that ran past database.transaction_timeout was taken for a silent
// database and retried from the start, for ever: a slow batch is one the
// database is still working on, and it goes on.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_slower_than_the_transaction_timeout_goes_on_while_the_database_works_on_it() {
    let h = Harness::new(1).await;
    let mut cfg = h.config(&routes::route(None, "order.placed", "handler = \"slow\"\n"));
    cfg.consumer.batch_size = 10;
    cfg.database.transaction_timeout = std::time::Duration::from_secs(1);
    let mut last = 0;
    for i in 0..10 {
        last = h.send(&order(&format!("evt-{i}"), &format!("o-{i}"))).await.1;
    }
    let handlers = Handlers::default().register("slow", Slow);
    let run = h.start_with(cfg, CONSUMER_ONLY, handlers, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    assert_eq!(h.inbox().await, 10, "every record recorded once");
}

// The pool checks a connection given back with a round trip of no deadline,
// holding its slot: a connection given back as the database went silent
// kept the slot for good, and a pool of such slots never served again.
#[tokio::test]
async fn a_connection_given_back_as_the_database_goes_silent_does_not_keep_its_pool_slot() {
    let db = relay_testkit::TestDb::new().await.unwrap();
    let proxy = relay_testkit::TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await.unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(std::time::Duration::from_secs(1))
        .connect(&relay_testkit::url_via(&db.url, proxy.addr()))
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *conn).await.unwrap();
    proxy.stall();
    relay::runtime::db::give_back(conn);
    proxy.restore();
    eventually("the pool to serve a connection again", DEADLINE, || async {
        let mut conn = pool.acquire().await.ok()?;
        sqlx::query("SELECT 1").execute(&mut *conn).await.ok().map(drop)
    })
    .await;
}

/// Five records go through; the database goes away (`outage`) while five
/// more arrive; nothing is committed until it is back, and then all ten are,
/// once each.
async fn outage_then_back(outage: fn(&relay_testkit::TcpProxy), retrying: &str) {
    let h = Harness::new(1).await;
    let proxy = relay_testkit::TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await.unwrap();
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.database.url = Some(relay_testkit::url_via(&h.db.url, proxy.addr()).into());
    cfg.database.acquire_timeout = std::time::Duration::from_millis(500);
    cfg.database.transaction_timeout = std::time::Duration::from_secs(2);
    h.send_orders(5).await;
    let run = h.start(cfg, CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, 5).await;

    outage(&proxy);
    let before = proxy.attempts();
    for i in 5..10 {
        h.send(&order(&format!("evt-{i}"), &format!("o-{i}"))).await;
    }
    // The consumer keeps trying to reach the database (with backoff) ...
    eventually(retrying, DEADLINE, || async { (proxy.attempts() >= before + 3).then_some(()) }).await;
    // ... and meanwhile commits no offset for the records it could not record.
    assert_eq!(h.committed().await.get(&0).copied().flatten(), Some(5));
    assert_eq!(h.inbox().await, 5);

    proxy.restore();
    h.await_committed(0, 10).await;
    run.stop().await.unwrap();
    assert_eq!(h.inbox().await, 10, "nothing lost");
    assert_eq!(h.db.count("intents", "true").await, 10, "nothing doubled");
}

#[tokio::test]
async fn consumers_joining_and_leaving_the_group_mid_stream_lose_nothing_and_double_nothing() {
    let h = Harness::new(4).await;
    let n = 400;
    for i in 0..n {
        h.send(&order(&format!("evt-{i}"), &format!("o-{i}")).partition(i % 4)).await;
    }
    let mut small = h.config(&CAPTURE_ROUTE);
    small.consumer.batch_size = 5; // many small batches: the rebalance lands mid-stream
    // Each instance counts its committed batches at a fault point; A is slowed
    // down so that B joins while most records are still unprocessed.
    let after_commit = relay::runtime::faults::point::CONSUMER_AFTER_DB_COMMIT;
    let a_faults = Faults::new(&[(after_commit, FaultAction::Pause(std::time::Duration::from_millis(30)), 0)]);
    let b_faults = Faults::new(&[(after_commit, FaultAction::Pause(std::time::Duration::ZERO), 0)]);
    let a = h.start(small.clone(), CONSUMER_ONLY, a_faults.clone()).await;
    eventually("consumer A to make progress", DEADLINE, || async { (h.inbox().await >= 20).then_some(()) }).await;
    let b = h.start(small.clone(), CONSUMER_ONLY, b_faults.clone()).await;
    eventually("consumer B to get partitions and commit work", DEADLINE, || async {
        (b_faults.hits(after_commit) >= 3).then_some(())
    })
    .await;
    let a_batches = a_faults.hits(after_commit);
    assert!(h.inbox().await < i64::from(n), "B joined while records were still in flight");
    a.stop().await.unwrap(); // A leaves: B takes its partitions
    let dispatch = h
        .start(h.config(&CAPTURE_ROUTE), Components { consumer: false, dispatcher: true, publisher: true }, no_faults())
        .await;
    h.await_inbox(i64::from(n)).await;
    eventually("every offset committed", DEADLINE, || async {
        let total = h.committed_total().await;
        (total == i64::from(n)).then_some(())
    })
    .await;
    h.await_intents_finished(i64::from(n)).await;
    b.stop().await.unwrap();
    dispatch.stop().await.unwrap();

    let stats = h.provider.stats();
    assert_eq!(stats.applied, u64::from(n as u32), "every order captured");
    assert!(stats.double_applied().is_empty());
    assert_eq!(h.db.count("intents", "true").await, i64::from(n));
    // The checks above cannot see a record applied twice (intents dedup by
    // derived id, the provider by key): the business counter and the
    // requests per key can.
    let mut conn = h.db.conn().await.unwrap();
    assert_eq!(
        inbox::counter(&mut conn, &h.consumer, "orders").await.unwrap(),
        i64::from(n),
        "each order counted once"
    );
    for (key, s) in &stats.by_key {
        assert_eq!(s.requests, 1, "{key}: one request");
    }
    assert!(a_batches > 0 && b_faults.hits(after_commit) > 3, "both instances did work");
}

#[tokio::test]
async fn the_database_connection_uses_tls_when_the_url_asks_for_it() {
    let h = Harness::new(1).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    let sep = if h.db.url.contains('?') { '&' } else { '?' };
    cfg.database.url = Some(format!("{}{sep}sslmode=require", h.db.url).into());
    let relay = h.relay(cfg, relay::Handlers::default(), no_faults()).await;
    let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(relay.pool())
        .await
        .unwrap();
    assert!(ssl, "sslmode=require in the URL gives a TLS connection");
}

const DEBEZIUM_ROUTE: &str = r#"
[topics."{topic}"]
format = "json"
fields.id = { header = "id" }
fields.type = { header = "eventType" }
fields.aggregate_id = "key"

[[routes]]
topic = "{topic}"
type = "OrderCreated"
fields.idempotency_key = { pointer = "/request/id" }
counter = "created"

[[routes.actions]]
kind = "emit"
name = "seen"
type = "order.seen"
topic = "{out}"
data = { order = "{{ aggregate_id }}", request = "{{ idempotency_key }}" }
"#;

#[tokio::test]
async fn producers_that_do_not_speak_cloudevents_are_read_through_configured_field_sources() {
    let h = Harness::new(1).await;
    // A Debezium outbox event router record: id and type in headers, aggregate in the key.
    let dbz = |id: &str, request: &str| {
        let headers =
            vec![("id".to_string(), id.as_bytes().to_vec()), ("eventType".to_string(), b"OrderCreated".to_vec())];
        (headers, json!({"request": {"id": request}, "total": 5}).to_string())
    };
    let (hs, body) = dbz("dbz-1", "req-1");
    h.producer.raw(&h.topic, None, Some(b"order-9"), &hs, Some(body.as_bytes())).await.unwrap();
    let (hs, body) = dbz("dbz-2", "req-1"); // same request id: a business duplicate
    h.producer.raw(&h.topic, None, Some(b"order-9"), &hs, Some(body.as_bytes())).await.unwrap();
    let (_, body) = dbz("unused", "req-2");
    let (_, last) = h.producer.raw(&h.topic, None, Some(b"order-9"), &[], Some(body.as_bytes())).await.unwrap(); // no id header
    let run = h
        .start(h.config(DEBEZIUM_ROUTE), Components { consumer: true, dispatcher: false, publisher: true }, no_faults())
        .await;
    h.await_committed(0, last + 1).await;
    h.await_published(2).await; // one event + one dead-letter copy
    run.stop().await.unwrap();

    assert_eq!(h.outcome("dbz-1").await.as_deref(), Some("applied"));
    assert_eq!(h.outcome("dbz-2").await.as_deref(), Some("duplicate_key"));
    let class: String =
        sqlx::query_scalar("SELECT error_class FROM relay.dead_letters").fetch_one(&h.db.pool).await.unwrap();
    assert_eq!(class, "missing_id", "a record without its id header is never processed under an invented id");
    let out = read_topic(&h.bootstrap, &h.out, 1).await.unwrap();
    assert_eq!(out[0].json(), json!({"order": "order-9", "request": "req-1"}));
    assert_eq!(out[0].key.as_deref(), Some(&b"order-9"[..]), "the key defaults to the aggregate id");
}

#[tokio::test]
async fn structured_mode_cloudevents_are_processed_like_binary_mode_ones() {
    let h = Harness::new(1).await;
    let structured = json!({
        "specversion": "1.0", "id": "evt-s1", "type": "order.placed", "source": "/shop",
        "datacontenttype": "application/json", "idempotencykey": "place:o-1",
        "data": {"order_id": "o-1", "amount": 100}
    });
    let ct = vec![("content-type".to_string(), b"application/cloudevents+json".to_vec())];
    h.producer.raw(&h.topic, None, Some(b"o-1"), &ct, Some(structured.to_string().as_bytes())).await.unwrap();
    // The same event again in binary mode: same id, so a duplicate.
    let (_, last) = h.send(&order("evt-s1", "o-1").ext("idempotencykey", "place:o-1")).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_committed(0, last + 1).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();
    assert_eq!(h.inbox().await, 1);
    assert_eq!(h.provider.stats().applied_for("capture:o-1"), 1);
}

#[tokio::test]
async fn a_record_the_database_rejects_inside_a_batch_is_parked_alone_and_its_neighbours_are_applied() {
    let h = Harness::new(1).await;
    h.send(&order("ok-1", "o-1")).await;
    // PostgreSQL's jsonb cannot hold U+0000 (ids and keys with one are poison
    // before any write): the request body's batched insert fails, the batch
    // falls back to one record at a time, and only this one is parked.
    let bad_amount = TestEvent::new("bad-id", "order.placed", json!({"order_id": "o-2", "amount": "1\u{0}"}));
    let (_, bad) = h.send(&bad_amount).await;
    let (_, last) = h.send(&order("ok-3", "o-3")).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    assert_eq!(h.inbox().await, 2);
    assert_eq!(h.db.count("intents", "true").await, 2);
    let (class, offset, id): (String, i64, Option<String>) =
        sqlx::query_as(r#"SELECT error_class, "offset", event_id FROM relay.dead_letters"#)
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
    assert_eq!((class.as_str(), offset), ("rejected", bad));
    assert_eq!(id.as_deref(), Some("bad-id"));
}

#[tokio::test]
async fn a_batch_that_writes_no_intents_wakes_no_dispatcher() {
    // The consumer writes a batch's intents, outbox rows and counters with
    // one statement (relay_store::effects); a part with no rows must be left
    // out of it, or its table's statement-level trigger would send a wake-up
    // for nothing.
    let db = relay_testkit::TestDb::new().await.unwrap();
    let mut listener = sqlx::postgres::PgListener::connect_with(&db.pool).await.unwrap();
    listener.listen("relay_intents").await.unwrap();
    let record = relay_core::OutboxRecord {
        id: uuid::Uuid::new_v4(),
        action: "accepted".into(),
        topic: "out".into(),
        key: None,
        headers: Vec::new(),
        payload: Some(b"{}".to_vec()),
        event_type: None,
        ordering_key: None,
    };
    let mut conn = db.conn().await.unwrap();
    let new = relay_store::effects::insert(
        &mut conn,
        "c",
        &[] as &[relay_core::NewIntent],
        None,
        &[("e-1", &record)],
        &[("orders", 0, 1)],
    )
    .await
    .unwrap();
    assert_eq!((new.intents.len(), new.outbox.len()), (0, 1));
    assert_eq!(inbox::counter(&mut conn, "c", "orders").await.unwrap(), 1);
    // Notifications arrive in commit order: the first one must be this marker.
    sqlx::query("SELECT pg_notify('relay_intents', 'marker')").execute(&mut *conn).await.unwrap();
    let first = tokio::time::timeout(std::time::Duration::from_secs(10), listener.recv()).await.unwrap().unwrap();
    assert_eq!(first.payload(), "marker", "the outbox-only write woke the dispatchers");
}

#[tokio::test]
async fn an_unrouted_record_the_database_rejects_is_parked_and_its_partition_moves_on() {
    // Issue 22 item 1: an unrouted event (strict = false) is recorded in the
    // inbox; one whose id PostgreSQL cannot store (a NUL byte) must be
    // dead-lettered like any other poison, not abort the transaction and
    // stall the partition behind a "database outage". Since issue 27 a
    // control character in an id is poison before any write (bad_field).
    let h = Harness::new(1).await;
    h.send(&order("ok-1", "o-1")).await;
    let (_, bad) = h.send(&TestEvent::new("odd\u{0}id", "something.else", json!({}))).await;
    h.send(&TestEvent::new("bad-corr", "something.else", json!({})).ext("correlationid", "c\u{0}1")).await;
    let (_, last) = h.send(&order("ok-3", "o-3")).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    assert_eq!(h.inbox().await, 2, "the two routed events");
    let parked: Vec<(String, i64)> =
        sqlx::query_as(r#"SELECT error_class, "offset" FROM relay.dead_letters ORDER BY "offset""#)
            .fetch_all(&h.db.pool)
            .await
            .unwrap();
    assert_eq!(parked, vec![("bad_field".to_string(), bad), ("bad_field".to_string(), bad + 1)]);
}

#[tokio::test]
async fn a_partition_held_at_a_paused_route_flows_again_after_a_rebalance_and_a_resume() {
    // Issue 22 item 2: a held partition is paused at the broker; a rebalance
    // that hands it back to the same member must not leave it paused there
    // for good, or it never fetches again, even after the route is resumed.
    use relay_store::ops::{self, PauseKind};
    let h = Harness::new(1).await;
    let mut conn = h.db.conn().await.unwrap();
    ops::pause(&mut conn, &h.consumer, PauseKind::Route, "order-placed", None).await.unwrap();
    h.send(&TestEvent::new("first", "something.else", json!({}))).await;
    h.send(&order("evt-1", "o-1")).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), CONSUMER_ONLY, no_faults()).await;
    // Offset 0 is processed; the batch holds at offset 1 (the paused route).
    h.await_committed(0, 1).await;
    // Another member joins the group: ours gets its partition again.
    let _other = another_member_joins(&h).await;
    ops::resume(&mut conn, &h.consumer, PauseKind::Route, "order-placed").await.unwrap();
    let (_, last) = h.send(&order("evt-2", "o-2")).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    assert_eq!(h.inbox().await, 3);
}

#[tokio::test]
async fn a_dead_letter_is_replayed_only_by_its_own_consumer_and_never_through_a_paused_route() {
    // Issue 22 items 13 and 16.
    use relay_store::ops::{self, PauseKind};
    let h = Harness::new(1).await;
    // No order_id: the capture route's templates dead-letter it.
    let (_, last) = h.send(&TestEvent::new("evt-1", "order.placed", json!({"amount": 5}))).await;
    let cfg = h.config(&CAPTURE_ROUTE);
    let run = h.start(cfg.clone(), CONSUMER_ONLY, no_faults()).await;
    h.await_committed(0, last + 1).await;
    run.stop().await.unwrap();
    let id: i64 = sqlx::query_scalar("SELECT id FROM relay.dead_letters").fetch_one(&h.db.pool).await.unwrap();

    // The operator fixes the route: keyed by the event id instead.
    let fixed =
        routes::order_placed("") + &routes::call_keyed("capture", "psp", "/captures/{{ id }}", "capture:{{ id }}", "");
    // Another consumer sharing the database sees none of this consumer's dead letters.
    let mut other_cfg = h.config(&fixed);
    other_cfg.consumer.name = unique("other");
    let other = h.relay(other_cfg.clone(), Handlers::default(), no_faults()).await;
    assert_eq!(other.operator().replay(&other.processor(), id).await.unwrap(), ReplayOutcome::NotFound);
    let mut conn = h.db.conn().await.unwrap();
    assert!(relay_store::dead_letters::get(&mut conn, &other_cfg.consumer.name, id).await.unwrap().is_none());
    assert!(!relay_store::dead_letters::delete(&mut conn, &other_cfg.consumer.name, id).await.unwrap());

    // Its own consumer, with the route paused: the replay waits like the partition would.
    let relay = h.relay(h.config(&fixed), Handlers::default(), no_faults()).await;
    ops::pause(&mut conn, &h.consumer, PauseKind::Route, "order-placed", None).await.unwrap();
    let paused = relay.operator().replay(&relay.processor(), id).await.unwrap();
    assert!(matches!(&paused, ReplayOutcome::StillFailing(why) if why.contains("paused")), "{paused:?}");
    assert_eq!(h.inbox().await, 0, "nothing applied through a paused route");
    ops::resume(&mut conn, &h.consumer, PauseKind::Route, "order-placed").await.unwrap();
    assert_eq!(relay.operator().replay(&relay.processor(), id).await.unwrap(), ReplayOutcome::Applied);
    assert_eq!(h.inbox().await, 1);
}

#[tokio::test]
async fn a_buffer_bounded_to_one_large_record_still_processes_every_record() {
    // Issue 22 item 18: the records waiting to start are bounded in bytes too;
    // at the tightest bound (one record's worth) nothing may stall.
    let h = Harness::new(2).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.consumer.max_record_bytes = 20_000;
    cfg.consumer.max_buffered_bytes = 20_000;
    let note = "n".repeat(15_000);
    for i in 0..30 {
        let e =
            TestEvent::new(&format!("evt-{i}"), "order.placed", json!({"order_id": format!("o-{i}"), "note": note}))
                .partition(i % 2);
        h.send(&e).await;
    }
    let run = h.start(cfg.clone(), CONSUMER_ONLY, no_faults()).await;
    h.await_inbox(30).await;
    eventually("every offset committed", DEADLINE, || async { (h.committed_total().await == 30).then_some(()) }).await;
    run.stop().await.unwrap();
    cfg.consumer.max_buffered_bytes = 10_000;
    let err = cfg.validate().expect_err("a buffer smaller than a record is refused").to_string();
    assert!(err.contains("max_buffered_bytes"), "{err}");
}

/// Log lines written to a buffer, to read back as JSON.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A handler that only logs.
struct Logs;

#[async_trait]
impl Handler for Logs {
    async fn handle(&self, _tx: &mut sqlx::PgConnection, event: &InputEvent) -> Result<Plan, HandlerError> {
        tracing::info!(order = %event.data["order_id"], "handler saw the order");
        Ok(Plan::default())
    }
}

// The default (current-thread) runtime: the relay's tasks run on this
// thread, so the subscriber set for it sees their lines.
#[tokio::test]
async fn a_code_handlers_own_log_lines_name_the_record_and_partition_they_belong_to() {
    let logs = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .json()
        .with_env_filter("info")
        .with_writer({
            let logs = logs.clone();
            move || logs.clone()
        })
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let h = Harness::new(1).await;
    let route = "[[routes]]\ntopic = \"{topic}\"\ntype = \"order.placed\"\nhandler = \"logs\"\n";
    let run =
        h.start_with(h.config(route), CONSUMER_ONLY, Handlers::default().register("logs", Logs), no_faults()).await;
    h.send(&order("evt-logged", "o-1")).await;
    h.await_inbox(1).await;
    run.stop().await.unwrap();

    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("handler saw the order"))
        .unwrap_or_else(|| panic!("no handler line in:\n{text}"));
    let line: serde_json::Value = serde_json::from_str(line).unwrap();
    let span = |name: &str| {
        line["spans"]
            .as_array()
            .and_then(|s| s.iter().find(|s| s["name"] == name))
            .cloned()
            .unwrap_or_else(|| panic!("no {name} span: {line}"))
    };
    let (handler, partition) = (span("handler"), span("partition"));
    assert_eq!(
        (handler["handler"].as_str(), handler["event_id"].as_str()),
        (Some("logs"), Some("evt-logged")),
        "{line}"
    );
    assert_eq!(handler["event_type"], "order.placed", "{line}");
    assert_eq!(
        (partition["topic"].as_str(), partition["partition"].as_i64()),
        (Some(h.topic.as_str()), Some(0)),
        "{line}"
    );
}

/// librdkafka may be built without a codec. Batches compressed with every
/// codec a producer may choose, kept as sent (`producer`, which relay only
/// warns of here), are consumed.
#[tokio::test]
async fn records_compressed_with_zstd_snappy_lz4_and_gzip_are_all_consumed() {
    let h = Harness::new(1).await;
    h.set_topic_compression(&h.topic, "producer").await;
    let codecs = ["zstd", "snappy", "lz4", "gzip"];
    for (c, codec) in codecs.iter().enumerate() {
        // Sent at once with a linger, so each batch holds several records.
        let producer = relay_testkit::TestProducer::with_properties(
            &h.bootstrap,
            &[("compression.type", codec), ("linger.ms", "50")],
        )
        .unwrap();
        let orders: Vec<TestEvent> =
            (0..10).map(|i| order(&format!("evt-{codec}-{i}"), &format!("o-{c}-{i}"))).collect();
        futures::future::join_all(orders.iter().map(|e| producer.event(&h.topic, e))).await;
    }
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.kafka.on_unbounded_compression = relay_core::config::Shortfall::Warn;
    let run = h.start(cfg, CONSUMER_ONLY, no_faults()).await;
    h.await_inbox(40).await;
    h.await_committed(0, 40).await;
    run.stop().await.unwrap();
    for codec in codecs {
        let n = h.db.count("inbox", &format!("event_id LIKE 'evt-{codec}-%'")).await;
        assert_eq!(n, 10, "every {codec}-compressed record was consumed");
    }
}

// Ingest review D8: a revoke left the task of a partition waiting out a
// retry asleep; given back to this member, the partition's refetched
// backlog filled the shared buffer and no partition received anything until
// that task woke (up to the retry's max delay, here 45 s).
#[tokio::test]
async fn a_rebalance_while_a_partition_waits_out_a_long_retry_does_not_stop_the_other_partitions() {
    let h = Harness::new(2).await;
    let (_ready, refusals, handlers, mut cfg) = waiting_for_customer(&h);
    cfg.consumer.reference_retry.backoff.min_delay = std::time::Duration::from_secs(45);
    cfg.consumer.reference_retry.backoff.max_delay = std::time::Duration::from_secs(45);
    cfg.consumer.max_record_bytes = 8 * 1024;
    cfg.consumer.max_buffered_bytes = 16 * 1024;
    let (stuck_partition, _) = h.send(&order("evt-stuck", "o-stuck")).await;
    // More behind the stuck record than the whole buffer holds.
    for i in 0..150 {
        let e = TestEvent::new(
            &format!("behind-{i}"),
            "order.placed",
            json!({"order_id": format!("b-{i}"), "pad": "p".repeat(300)}),
        );
        h.send(&e.partition(stuck_partition)).await;
    }
    let other = 1 - stuck_partition;
    let run = h.start_with(cfg, CONSUMER_ONLY, handlers, no_faults()).await;
    eventually("the stuck record refused", DEADLINE, || async { (refusals.load(Ordering::SeqCst) >= 1).then_some(()) })
        .await;
    // Another member joins the group: ours gets both partitions again.
    let _member = another_member_joins(&h).await;
    // The other partition keeps flowing, long before the 45 s retry is due.
    let mut last = 0;
    for i in 0..5 {
        last = h.send(&order(&format!("evt-{i}"), &format!("o-{i}")).partition(other)).await.1;
    }
    eventually("the other partition's records committed", std::time::Duration::from_secs(15), || async {
        h.committed().await.get(&other).copied().flatten().is_some_and(|c| c > last).then_some(())
    })
    .await;
    run.stop().await.unwrap();
}

// Ingest review "to check": with more partitions than connections, tasks
// waiting for a connection timed out and were logged as a database outage.
#[tokio::test]
async fn partitions_waiting_for_a_busy_pool_are_told_apart_from_an_outage_and_all_go_through() {
    let partitions = 8;
    let h = Harness::new(partitions).await;
    let text = h
        .config_text(&CAPTURE_ROUTE)
        .replace("[database]\nmax_connections = 8\n", "[database]\nmax_connections = 1\nacquire_timeout = \"250ms\"\n");
    assert!(text.contains("max_connections = 1"), "{text}");
    let config = h.write_config(&text);
    for i in 0..800 {
        h.send(&order(&format!("evt-{i}"), &format!("o-{i}")).partition(i % partitions)).await;
    }
    // Each transaction holds the one connection 150 ms before its commit, so
    // the other partitions' waits (up to 7 × 150 ms) pass the 250 ms acquire timeout however
    // fast the machine (the timeout also bounds the first connect: 25 ms
    // failed the start on a loaded machine).
    let mut run = h.process(&config, &["consume"], &[("RELAY_FAULTS", "consumer.before_db_commit=pause:150ms")]);
    eventually("every record committed", DEADLINE, || async { (h.committed_total().await == 800).then_some(()) }).await;
    assert!(run.terminate(std::time::Duration::from_secs(30)).unwrap().success(), "{}", run.log());
    let log = run.log();
    assert!(log.contains("database connections was busy"), "the waits were seen: {log}");
    assert!(!log.contains("database error"), "a busy pool is not an outage: {log}");
    assert_eq!(h.inbox().await, 800);
}

/// A handler that updates one row of the application's, which a test may
/// hold locked: its transaction then waits on the lock.
struct LocksARow;

#[async_trait]
impl Handler for LocksARow {
    async fn handle(&self, tx: &mut sqlx::PgConnection, event: &InputEvent) -> Result<Plan, HandlerError> {
        if event.data["order_id"] == "o-locked" {
            sqlx::query("UPDATE public.stock SET n = n - 1 WHERE sku = 'a'").execute(&mut *tx).await?;
        }
        Ok(Plan::default())
    }
}

// Review of issue 27: a task stuck in its transaction (here on a row lock)
// was neither waiting out a retry nor paused, so its partition's records
// filled the buffer every partition shares and the others stopped too.
#[tokio::test]
async fn a_partition_whose_transaction_hangs_on_a_lock_does_not_stop_the_others() {
    let h = Harness::new(2).await;
    let mut conn = h.db.conn().await.unwrap();
    sqlx::query("CREATE TABLE public.stock (sku text PRIMARY KEY, n int)").execute(&mut *conn).await.unwrap();
    sqlx::query("INSERT INTO public.stock VALUES ('a', 10)").execute(&mut *conn).await.unwrap();
    let route = "[[routes]]\ntopic = \"{topic}\"\ntype = \"order.placed\"\nhandler = \"locks\"\n";
    let handlers = Handlers::default().register("locks", LocksARow);
    let mut cfg = h.config(route);
    cfg.consumer.batch_size = 10;
    // The test holds the row until the end.
    let mut holder = h.db.conn().await.unwrap();
    let mut lock = sqlx::Connection::begin(&mut *holder).await.unwrap();
    sqlx::query("SELECT n FROM public.stock WHERE sku = 'a' FOR UPDATE").execute(&mut *lock).await.unwrap();
    h.send(&order("evt-locked", "o-locked").partition(0)).await;
    for i in 0..100 {
        h.send(&order(&format!("behind-{i}"), &format!("b-{i}")).partition(0)).await;
    }
    let run = h.start_with(cfg, CONSUMER_ONLY, handlers, no_faults()).await;
    eventually("the first record's transaction waiting on the lock", DEADLINE, || async {
        let waiting: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_locks WHERE NOT granted").fetch_one(&h.db.pool).await.unwrap();
        (waiting > 0).then_some(())
    })
    .await;
    // Records of the other partition, behind the stuck one's backlog in the client's queue.
    let mut last = 0;
    for i in 0..5 {
        last = h.send(&order(&format!("evt-{i}"), &format!("o-{i}")).partition(1)).await.1;
    }
    // Well before the lock goes: within a few seconds of the slow-task check.
    eventually("the other partition's records committed", std::time::Duration::from_secs(15), || async {
        h.committed().await.get(&1).copied().flatten().is_some_and(|c| c > last).then_some(())
    })
    .await;
    lock.rollback().await.unwrap();
    eventually("the locked partition's records committed once the lock goes", DEADLINE, || async {
        h.committed().await.get(&0).copied().flatten().is_some_and(|c| c >= 101).then_some(())
    })
    .await;
    run.stop().await.unwrap();
    assert_eq!(h.db.count("inbox", "partition = 0").await, 101, "nothing of the slow partition lost");
}

// Another of relay's writers holding an ordering key's lock for long (a
// stalled batch of another process, say): the consumer's batch waited on it
// without end, in silence; it now gives up after lock_timeout, says why,
// and retries until it is free.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_waiting_on_a_key_lock_someone_else_holds_says_so_and_retries_until_it_is_free() {
    let h = Harness::new(1).await;
    let route =
        CAPTURE_ROUTE.replace("idempotency_key = ", "ordering_key = \"{{ data.order_id }}\"\nidempotency_key = ");
    let mut holder = h.db.pool.begin().await.unwrap();
    relay_store::ordering::lock(&mut holder, &h.consumer, [relay_store::ordering::Key::Intent("o-1")]).await.unwrap();
    h.send(&order("evt-1", "o-1")).await;
    let config = h.write_config(&h.config_text(&route));
    let mut run = h.process(&config, &["consume"], &[]);
    eventually("the consumer to say it waited for a lock", DEADLINE, || async {
        run.log().contains("waited over 5 s for a lock another transaction holds").then_some(())
    })
    .await;
    assert_eq!(h.outcome("evt-1").await, None, "nothing written while the key is held");
    holder.rollback().await.unwrap();
    eventually("the record applied once the lock is free", DEADLINE, || async {
        (h.outcome("evt-1").await.as_deref() == Some("applied")).then_some(())
    })
    .await;
    assert!(run.terminate(std::time::Duration::from_secs(30)).unwrap().success(), "{}", run.log());
}

// A dead letter was unique per position alone: after a topic was created
// again (or the group moved to a mirror whose offsets start again), a new
// record at a parked one's position was taken for its redelivery and
// dropped unseen, its offset committed.
#[tokio::test]
async fn another_record_at_a_parked_record_s_position_is_parked_too_and_a_redelivery_is_not() {
    use relay_core::{Poison, PoisonClass};
    use relay_store::dead_letters;
    let db = relay_testkit::TestDb::new().await.unwrap();
    let mut conn = db.conn().await.unwrap();
    let poison = Poison::new(PoisonClass::Rejected, "a reason");
    let first = TestEvent::new("evt-1", "order.placed", json!({"order_id": "o-1"})).record("orders", 7);
    let again = first.clone();
    let other = TestEvent::new("evt-2", "order.placed", json!({"order_id": "o-2"})).record("orders", 7);
    assert_eq!((first.partition, first.offset), (other.partition, other.offset), "one position");
    assert!(dead_letters::insert(&mut conn, "c", &first, &poison, 1, false, 1024).await.unwrap().is_some());
    assert!(
        dead_letters::insert(&mut conn, "c", &again, &poison, 1, false, 1024).await.unwrap().is_none(),
        "the same record redelivered is parked once"
    );
    assert!(
        dead_letters::insert(&mut conn, "c", &other, &poison, 1, false, 1024).await.unwrap().is_some(),
        "another record at the same position is parked too"
    );
    assert_eq!(db.count("dead_letters", "true").await, 2);

    // A record over the limit (a compressed batch inflated far past it) is
    // stored cut to the limit, saying so: whole, it filled the disk at a
    // thousand times the rate it came in.
    let mut big = TestEvent::new("evt-3", "order.placed", json!({"order_id": "o-3"})).record("orders", 8);
    big.payload = Some(vec![b'x'; 5000]);
    dead_letters::insert(&mut conn, "c", &big, &poison, 1, false, 1024).await.unwrap().unwrap();
    let (stored, reason): (i32, String) =
        sqlx::query_as("SELECT octet_length(payload), reason FROM relay.dead_letters WHERE \"offset\" = 8")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(stored, 1024);
    assert!(reason.ends_with("stored: the first 1024 bytes of its key (0 bytes) and payload (5000 bytes)"), "{reason}");
}

// A saga was one per type and id in the database: a deployment's route or
// application moved (or first started) another deployment's saga of the
// same name.
#[tokio::test]
async fn a_saga_is_its_deployment_s_and_another_deployment_s_move_finds_none() {
    use relay_store::sagas::{self, Transition};
    let db = relay_testkit::TestDb::new().await.unwrap();
    let mut conn = db.conn().await.unwrap();
    let start: relay_core::SagaMove = serde_json::from_value(
        json!({"action": "open", "saga_type": "order", "saga_id": "o-42", "from": [], "to": "pending", "start": true}),
    )
    .unwrap();
    let pay: relay_core::SagaMove = serde_json::from_value(
        json!({"action": "pay", "saga_type": "order", "saga_id": "o-42", "from": ["pending"], "to": "paid", "start": false}),
    )
    .unwrap();
    let detail = json!({});
    assert_eq!(
        sagas::apply(&mut conn, "a", &start, "e-1", relay_core::HistoryKind::Saga, &detail).await.unwrap(),
        Transition::Applied
    );
    assert_eq!(
        sagas::apply(&mut conn, "b", &pay, "e-2", relay_core::HistoryKind::Saga, &detail).await.unwrap(),
        Transition::Missing
    );
    assert_eq!(sagas::state(&mut conn, "a", "order", "o-42").await.unwrap().as_deref(), Some("pending"));
    assert_eq!(
        sagas::apply(&mut conn, "b", &start, "e-3", relay_core::HistoryKind::Saga, &detail).await.unwrap(),
        Transition::Applied
    );
    assert_eq!(
        sagas::apply(&mut conn, "b", &pay, "e-4", relay_core::HistoryKind::Saga, &detail).await.unwrap(),
        Transition::Applied
    );
    assert_eq!(sagas::state(&mut conn, "a", "order", "o-42").await.unwrap().as_deref(), Some("pending"));
    assert_eq!(sagas::state(&mut conn, "b", "order", "o-42").await.unwrap().as_deref(), Some("paid"));
}
