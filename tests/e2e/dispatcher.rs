//! The dispatcher against real PostgreSQL, a real broker and a fake provider
//! that honours idempotency keys and counts effects: crashes around the call
//! (C9, C10), timeouts (C11), retryable and permanent failures (C12, C13),
//! fencing and concurrent dispatchers (C17), per-key ordering (R13), NOTIFY.

use std::time::Duration;

use crate::support::*;
use example_provider::{FaultKind, FaultRule};
use relay::ops::admin::KeyWindow;
use relay::runtime::faults::point;
use relay::{Components, FaultAction, Faults};
use relay_store::intents::{self, AttemptOutcome, AttemptRecord, Fenced, Finish, NextState, Scope};
use relay_store::{ClaimCommit, ClaimPool, outbox};
use relay_testkit::read_topic;
use serde_json::json;

const INGEST: Components = Components { consumer: true, dispatcher: false, publisher: true };
const DISPATCH: Components = Components { consumer: false, dispatcher: true, publisher: false };

/// The intents written by hand below: consumer `t` or `c`, endpoint `psp`.
const T_PSP: Scope<'static> = Scope { consumer: "t", endpoints: &["psp"] };
const C_PSP: Scope<'static> = Scope { consumer: "c", endpoints: &["psp"] };

fn rule(key_prefix: &str, times: Option<u32>, kind: FaultKind) -> FaultRule {
    FaultRule { path_prefix: None, key_prefix: Some(key_prefix.into()), times, kind }
}

/// Attempt outcomes of the intent with idempotency key `key`, in order.
async fn attempts(h: &Harness, key: &str) -> Vec<(String, Option<i32>)> {
    sqlx::query_as(
        "SELECT a.outcome, a.status FROM relay.intent_attempts a JOIN relay.intents i ON i.id = a.intent_id
          WHERE i.idempotency_key = $1 ORDER BY a.attempt",
    )
    .bind(key)
    .fetch_all(&h.db.pool)
    .await
    .unwrap()
}

async fn intent_state(h: &Harness, key: &str) -> (String, i32, Option<i32>, Option<String>) {
    sqlx::query_as("SELECT state, attempts, last_status, last_error FROM relay.intents WHERE idempotency_key = $1")
        .bind(key)
        .fetch_one(&h.db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_dispatcher_that_dies_after_the_call_is_replaced_and_the_provider_sees_one_effect() {
    let h = Harness::new(1).await;
    h.send(&order("evt-1", "o-1")).await;
    let ingest = h.start(h.config(&CAPTURE_ROUTE), INGEST, no_faults()).await;
    h.await_inbox(1).await;

    // C10: the provider applied the capture, then the dispatcher died before recording it.
    let faults = Faults::new(&[(point::DISPATCHER_AFTER_CALL, FaultAction::Fail, 1)]);
    let crashed = h.start(h.config(&CAPTURE_ROUTE), DISPATCH, faults).await;
    assert!(crashed.finished().await.is_err(), "the fault stops the dispatcher like a crash");
    assert_eq!(h.provider.stats().applied_for("capture:o-1"), 1);
    assert_eq!(intent_state(&h, "capture:o-1").await.0, "running", "nothing recorded: the lease is still held");

    // Another dispatcher rescues the expired lease and sends the same key again.
    let replacement = h.start(h.config(&CAPTURE_ROUTE), DISPATCH, no_faults()).await;
    h.await_intents_finished(1).await;
    h.await_published(1).await;
    replacement.stop().await.unwrap();
    ingest.stop().await.unwrap();

    let stats = h.provider.stats();
    assert_eq!(stats.requests_for("capture:o-1"), 2, "re-sent");
    assert_eq!(stats.applied_for("capture:o-1"), 1, "but applied once");
    assert_eq!(stats.replayed, 1, "the provider answered the re-send from its stored response");
    assert_eq!(intent_state(&h, "capture:o-1").await.0, "succeeded");
    let a = attempts(&h, "capture:o-1").await;
    assert_eq!(a, vec![("lease_expired".into(), None), ("succeeded".into(), Some(201))]);
    let out = read_topic(&h.bootstrap, &h.out, 1).await.unwrap();
    assert_eq!(out.len(), 1, "one payment.captured");
}

#[tokio::test]
async fn a_dispatcher_that_dies_after_claiming_leaves_the_intent_to_be_rescued_when_the_lease_expires() {
    let h = Harness::new(1).await;
    h.send_orders(5).await;
    let ingest = h.start(h.config(&CAPTURE_ROUTE), INGEST, no_faults()).await;
    h.await_inbox(5).await;

    // C9: claimed, then died before any call.
    let faults = Faults::new(&[(point::DISPATCHER_AFTER_CLAIM, FaultAction::Fail, 1)]);
    let crashed = h.start(h.config(&CAPTURE_ROUTE), DISPATCH, faults).await;
    assert!(crashed.finished().await.is_err());
    assert_eq!(h.provider.stats().requests, 0, "no call was made");
    assert_eq!(h.intents_in("running").await, 5, "claimed and leased");

    let replacement = h.start(h.config(&CAPTURE_ROUTE), DISPATCH, no_faults()).await;
    h.await_intents_finished(5).await;
    replacement.stop().await.unwrap();
    ingest.stop().await.unwrap();
    let stats = h.provider.stats();
    assert_eq!(stats.applied, 5);
    assert!(stats.double_applied().is_empty());
    for i in 0..5 {
        let key = format!("capture:o-{i}");
        assert_eq!(attempts(&h, &key).await, vec![("lease_expired".into(), None), ("succeeded".into(), Some(201))]);
    }
}

#[tokio::test]
async fn a_worker_whose_lease_was_rescued_cannot_finish_the_intent() {
    let h = Harness::new(1).await;
    h.send(&order("evt-1", "o-1")).await;
    let ingest = h.start(h.config(&CAPTURE_ROUTE), INGEST, no_faults()).await;
    h.await_inbox(1).await;
    ingest.stop().await.unwrap();

    let mut conn = h.db.conn().await.unwrap();
    let mut claims = ClaimPool::beside(&h.db.pool, 1, ClaimCommit::Durable).acquire().await.unwrap();
    let scope = Scope { consumer: &h.consumer, endpoints: &["psp"] };
    let stale =
        intents::claim(&mut claims, &scope, "worker-a", 10, Duration::from_secs(60)).await.unwrap().rows.remove(0);
    // Worker A stalls past its lease; the rescuer returns the intent and worker B claims it.
    sqlx::query("UPDATE relay.intents SET locked_until = now() - interval '1 second'")
        .execute(&mut *conn)
        .await
        .unwrap();
    assert_eq!(intents::rescue_expired(&mut conn, 10).await.unwrap(), vec![stale.id]);
    let fresh =
        intents::claim(&mut claims, &scope, "worker-b", 10, Duration::from_secs(60)).await.unwrap().rows.remove(0);
    assert_eq!(fresh.id, stale.id);
    assert_eq!(fresh.attempts, 2, "the lost attempt still counts");

    let done = AttemptRecord {
        started_at: None,
        outcome: AttemptOutcome::Succeeded,
        status: Some(201),
        error_class: None,
        error: None,
    };
    let finish = |i: &intents::ClaimedIntent, next| Finish {
        id: i.id,
        token: i.lease_token,
        next,
        attempt: done.clone(),
        attempt_no: i.attempts,
        worker: "test".into(),
        attempted: true,
    };
    for next in [NextState::Succeeded, NextState::Retry(Duration::ZERO), NextState::Dead] {
        assert_eq!(intents::finish(&mut conn, finish(&stale, next)).await.unwrap(), Fenced::LeaseLost);
    }
    assert_eq!(intent_state(&h, "capture:o-1").await.0, "running", "the stale worker changed nothing");
    assert_eq!(intents::finish(&mut conn, finish(&fresh, NextState::Succeeded)).await.unwrap(), Fenced::Done);
    assert_eq!(
        attempts(&h, "capture:o-1").await,
        vec![("lease_expired".into(), None), ("succeeded".into(), Some(201))]
    );
}

#[tokio::test]
async fn a_short_claim_says_when_the_next_intent_or_outbox_row_comes_due_and_a_full_one_does_not_look() {
    let db = relay_testkit::TestDb::new().await.unwrap();
    sqlx::query(
        "INSERT INTO relay.intents (id, consumer, source_event_id, action, endpoint, method, path,
                                    idempotency_key, max_attempts, expires_at, emit_source, next_attempt_at)
         SELECT gen_random_uuid(), 't', 'e-' || g, 'capture', 'psp', 'POST', '/c', 'capture:' || g, 10,
                now() + interval '1 day', 't', CASE WHEN g = 4 THEN now() + interval '1 hour' ELSE now() END
           FROM generate_series(1, 4) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut conn = ClaimPool::beside(&db.pool, 1, ClaimCommit::Durable).acquire().await.unwrap();
    let lease = Duration::from_secs(60);
    let full = intents::claim(&mut conn, &T_PSP, "w", 2, lease).await.unwrap();
    assert_eq!((full.rows.len(), full.next_due), (2, None), "a full claim goes again at once");
    let short = intents::claim(&mut conn, &T_PSP, "w", 10, lease).await.unwrap();
    assert_eq!(short.rows.len(), 1);
    let in_an_hour = chrono::Utc::now() + chrono::Duration::hours(1);
    let due = short.next_due.expect("the intent due in an hour");
    assert!((due - in_an_hour).num_seconds().abs() < 60, "{due} is not in an hour");
    let empty = intents::claim(&mut conn, &T_PSP, "w", 10, lease).await.unwrap();
    assert_eq!((empty.rows.len(), empty.next_due), (0, Some(due)));

    // The outbox claim says the same, and keeps its rows in write order.
    sqlx::query(
        "INSERT INTO relay.outbox (id, consumer, source_id, action, topic, payload, next_attempt_at)
         SELECT gen_random_uuid(), 't', 'e-' || g, 'captured', 'out', '\\x00'::bytea,
                CASE WHEN g = 4 THEN now() + interval '1 hour' ELSE now() END
           FROM generate_series(1, 4) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let full = outbox::claim(&mut conn, "t", 2, lease).await.unwrap();
    assert_eq!((full.rows.iter().map(|r| r.seq).collect::<Vec<_>>(), full.next_due), (vec![1, 2], None));
    let short = outbox::claim(&mut conn, "t", 10, lease).await.unwrap();
    assert_eq!(short.rows.iter().map(|r| r.seq).collect::<Vec<_>>(), [3]);
    let due = short.next_due.expect("the row due in an hour");
    assert!((due - in_an_hour).num_seconds().abs() < 60, "{due} is not in an hour");
    let empty = outbox::claim(&mut conn, "t", 10, lease).await.unwrap();
    assert_eq!((empty.rows.len(), empty.next_due), (0, Some(due)));
}

#[tokio::test]
async fn a_provider_timeout_after_applying_is_retried_with_the_same_key_and_applied_once() {
    let h = Harness::new(1).await;
    // C11: the provider applies, then answers after the client's 1 s timeout.
    h.provider.set_faults(vec![rule("capture:o-1", Some(1), FaultKind::TimeoutAfterApply { delay_ms: 1500 })]);
    h.send(&order("evt-1", "o-1")).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();

    assert_eq!(h.provider.stats().applied_for("capture:o-1"), 1);
    // Attempt 1 timed out (uncertain); retries while the provider is still
    // applying it get 409 + Retry-After (retried); the last gets the stored response.
    let a = attempts(&h, "capture:o-1").await;
    assert_eq!(a.first(), Some(&("uncertain".into(), None)), "{a:?}");
    assert_eq!(a.last(), Some(&("succeeded".into(), Some(201))), "{a:?}");
    assert!(a[1..a.len() - 1].iter().all(|x| x == &("retryable".to_string(), Some(409))), "{a:?}");
    assert_eq!(intent_state(&h, "capture:o-1").await.0, "succeeded");
}

#[tokio::test]
async fn server_errors_and_throttling_are_retried_with_backoff_until_the_call_succeeds() {
    let h = Harness::new(1).await;
    // C12: 503 twice for one order, 429 with Retry-After: 1 once for another.
    h.provider.set_faults(vec![
        rule("capture:o-503", Some(2), FaultKind::Status { status: 503, retry_after_secs: None }),
        rule("capture:o-429", Some(1), FaultKind::Status { status: 429, retry_after_secs: Some(1) }),
    ]);
    h.send(&order("evt-1", "o-503")).await;
    h.send(&order("evt-2", "o-429")).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_intents_finished(2).await;
    run.stop().await.unwrap();

    let stats = h.provider.stats();
    assert_eq!(stats.applied, 2);
    assert_eq!(stats.requests_for("capture:o-503"), 3);
    assert_eq!(
        attempts(&h, "capture:o-503").await,
        // A 5xx may follow an applied call: recorded uncertain, retried with the key.
        vec![("uncertain".into(), Some(503)), ("uncertain".into(), Some(503)), ("succeeded".into(), Some(201))]
    );
    assert_eq!(
        attempts(&h, "capture:o-429").await,
        vec![("retryable".into(), Some(429)), ("succeeded".into(), Some(201))]
    );
    // Retry-After: 1 is honoured even though the backoff alone would retry within 100 ms.
    let gap = attempts_span(&h, "i.idempotency_key = 'capture:o-429'").await;
    assert!(gap >= 0.95, "second attempt came {gap:.3}s after the first");
}

#[tokio::test]
async fn a_permanent_client_error_or_a_spent_budget_leaves_the_intent_dead_with_its_error() {
    let h = Harness::new(1).await;
    // C13: 422 is permanent; 429 forever (throttled, never taken on)
    // spends the 5-attempt budget. A 5xx forever would end uncertain: it
    // may follow an applied call.
    h.provider.set_faults(vec![
        rule("capture:o-422", None, FaultKind::Status { status: 422, retry_after_secs: None }),
        rule("capture:o-down", None, FaultKind::Status { status: 429, retry_after_secs: None }),
    ]);
    h.send(&order("evt-1", "o-422")).await;
    h.send(&order("evt-2", "o-down")).await;
    h.send(&order("evt-3", "o-fine")).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_intents_finished(3).await;
    h.await_published(3).await;
    run.stop().await.unwrap();

    let (state, attempts_made, status, error) = intent_state(&h, "capture:o-422").await;
    assert_eq!((state.as_str(), attempts_made, status), ("dead", 1, Some(422)));
    assert!(error.unwrap().contains("422"));
    let (state, attempts_made, status, error) = intent_state(&h, "capture:o-down").await;
    assert_eq!((state.as_str(), attempts_made, status), ("dead", 5, Some(429)));
    let error = error.unwrap();
    assert!(error.contains("budget exhausted after 5 attempts") && error.contains("429"), "{error}");
    assert_eq!(h.provider.stats().requests_for("capture:o-down"), 5, "nothing is retried forever");
    assert_eq!(intent_state(&h, "capture:o-fine").await.0, "succeeded");

    // The dead calls emitted payment.failed, the good one payment.captured.
    let out = read_topic(&h.bootstrap, &h.out, 3).await.unwrap();
    let mut types: Vec<&str> = out.iter().filter_map(|r| r.header("ce_type")).collect();
    types.sort();
    assert_eq!(types, vec!["payment.captured", "payment.failed", "payment.failed"]);
}

#[tokio::test]
async fn two_dispatchers_on_the_same_intents_never_run_one_twice() {
    let h = Harness::new(4).await;
    // Slow answers widen the window in which a second worker could take the same row.
    h.provider.set_faults(vec![rule("capture:", None, FaultKind::TimeoutAfterApply { delay_ms: 20 })]);
    let n = 200;
    for i in 0..n {
        h.send(&order(&format!("evt-{i}"), &format!("o-{i}")).partition(i % 4)).await;
    }
    let ingest = h.start(h.config(&CAPTURE_ROUTE), INGEST, no_faults()).await;
    h.await_inbox(i64::from(n)).await;
    // C17: two dispatchers with different worker ids on one queue.
    let mut a = h.config(&CAPTURE_ROUTE);
    a.dispatcher.worker_id = Some("worker-a".into());
    let mut b = h.config(&CAPTURE_ROUTE);
    b.dispatcher.worker_id = Some("worker-b".into());
    let (ra, rb) = (h.start(a, DISPATCH, no_faults()).await, h.start(b, DISPATCH, no_faults()).await);
    h.await_intents_finished(i64::from(n)).await;
    ra.stop().await.unwrap();
    rb.stop().await.unwrap();
    ingest.stop().await.unwrap();

    let stats = h.provider.stats();
    assert_eq!(stats.applied, u64::from(n as u32));
    for (key, s) in &stats.by_key {
        assert_eq!((s.requests, s.applied, s.concurrent), (1, 1, 0), "{key} was sent more than once");
    }
    let workers: Vec<(String, i64)> =
        sqlx::query_as("SELECT worker, count(*) FROM relay.intent_attempts GROUP BY worker ORDER BY worker")
            .fetch_all(&h.db.pool)
            .await
            .unwrap();
    assert_eq!(workers.len(), 2, "both dispatchers took work: {workers:?}");
    assert_eq!(h.db.count("intent_attempts", "outcome <> 'succeeded'").await, 0);
}

fn ordered_route() -> String {
    let keyed = format!("ordering_key = \"{{{{ data.customer }}}}\"\n{}", routes::order_body());
    [routes::route(None, "order.placed", ""), routes::call("capture", "psp", "/captures", &keyed)].concat()
}

#[tokio::test]
async fn with_an_ordering_key_no_call_starts_before_the_earlier_one_for_the_key_finished() {
    let h = Harness::new(1).await;
    // The first order of customer c-1 fails twice; the second must wait for it.
    h.provider.set_faults(vec![rule(
        "capture:first",
        Some(2),
        FaultKind::Status { status: 503, retry_after_secs: None },
    )]);
    let placed = |id: &str, order: &str, customer: &str| {
        crate::support::TestEvent::new(id, "order.placed", json!({"order_id": order, "customer": customer}))
    };
    h.send(&placed("e-1", "first", "c-1")).await;
    h.send(&placed("e-2", "second", "c-1")).await;
    h.send(&placed("e-3", "other", "c-2")).await;
    let run = h.start(h.config(&ordered_route()), Components::ALL, no_faults()).await;
    h.await_intents_finished(3).await;
    run.stop().await.unwrap();

    let order: Vec<String> = h.provider.applied().into_iter().map(|a| a.key).collect();
    let pos = |k: &str| order.iter().position(|x| x == k).unwrap();
    assert!(pos("capture:first") < pos("capture:second"), "per-key order kept: {order:?}");
    let second_started: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM (SELECT min(started_at) FROM relay.intent_attempts a JOIN relay.intents i ON i.id = a.intent_id
                                     WHERE i.idempotency_key = 'capture:second')
                                 - (SELECT finished_at FROM relay.intents WHERE idempotency_key = 'capture:first'))::float8",
    )
    .fetch_one(&h.db.pool)
    .await
    .unwrap();
    assert!(second_started >= 0.0, "the second call started {second_started:.3}s after the first finished");
}

#[tokio::test]
async fn new_intents_wake_the_dispatcher_through_notify_long_before_the_poll_interval() {
    let h = Harness::new(1).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.dispatcher.poll_interval = Duration::from_secs(60);
    cfg.dispatcher.rescue_interval = Duration::from_secs(60);
    let dispatcher = h.start(cfg, DISPATCH, no_faults()).await;
    let ingest = h.start(h.config(&CAPTURE_ROUTE), INGEST, no_faults()).await;
    h.await_inbox(0).await;
    // Give the dispatcher time to go idle on its first (empty) claim: wait for its LISTEN.
    eventually("the dispatcher to LISTEN", DEADLINE, || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
        )
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
        (n >= 1).then_some(())
    })
    .await;
    h.send(&order("evt-1", "o-1")).await;
    eventually("the call to be made", Duration::from_secs(10), || async {
        (h.provider.stats().applied == 1).then_some(())
    })
    .await;
    // The outcome is recorded just after the provider answered.
    h.await_intents_finished(1).await;
    let latency: f64 =
        sqlx::query_scalar("SELECT extract(epoch FROM finished_at - created_at)::float8 FROM relay.intents")
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
    assert!(latency < 6.0, "intent written to call finished took {latency:.3}s with a 60 s poll interval");
    dispatcher.stop().await.unwrap();
    ingest.stop().await.unwrap();
}

/// Orders o-1 … o-`n` (events e-1 … e-`n`), all of customer c-1.
async fn send_orders_of_one_customer(h: &Harness, n: i64) {
    for i in 1..=n {
        h.send(&crate::support::TestEvent::new(
            &format!("e-{i}"),
            "order.placed",
            json!({"order_id": format!("o-{i}"), "customer": "c-1"}),
        ))
        .await;
    }
}

#[tokio::test]
async fn what_a_dispatcher_s_own_outcomes_make_due_is_claimed_at_once_not_at_the_next_poll() {
    // No NOTIFY announces these: the next intent of an ordering key becomes
    // due when the earlier one's outcome is recorded, and a retry when its
    // backoff (20–100 ms here) has passed. With a 60 s poll interval only the
    // dispatcher's own wake-up after recording outcomes gets them going soon.
    let h = Harness::new(1).await;
    h.provider.set_faults(vec![rule(
        "capture:o-1",
        Some(1),
        FaultKind::Status { status: 503, retry_after_secs: None },
    )]);
    let chain: i64 = 4;
    send_orders_of_one_customer(&h, chain).await;
    let ingest = h.start(h.config(&ordered_route()), INGEST, no_faults()).await;
    h.await_inbox(chain).await;
    ingest.stop().await.unwrap();
    let mut cfg = h.config(&ordered_route());
    cfg.dispatcher.poll_interval = Duration::from_secs(60);
    // The rescuer keeps its short test interval: it only wakes the claim loop
    // when it rescued an expired lease, so it cannot stand in for the wake-ups
    // under test, while a lease lost under a loaded machine is still recovered.
    let dispatcher = h.start(cfg, DISPATCH, no_faults()).await;
    eventually("the whole chain to be applied", Duration::from_secs(20), || async {
        (h.provider.stats().applied == chain as u64).then_some(())
    })
    .await;
    dispatcher.stop().await.unwrap();
    let order: Vec<String> = h.provider.applied().into_iter().map(|a| a.key).collect();
    let expected: Vec<String> = (1..=chain).map(|i| format!("capture:o-{i}")).collect();
    assert_eq!(order, expected, "per-key order kept");
    assert_eq!(h.db.count("intent_attempts", "outcome = 'uncertain'").await, 1, "o-1 failed once, then was retried");
}

fn saga_outcome_route() -> String {
    [
        routes::route(None, "order.placed", ""),
        routes::saga_start("start", "payment_pending"),
        routes::call("capture", "psp", "/captures", ""),
        routes::saga_on("on_success", "paid", "payment_pending", "paid"),
        routes::saga_on("on_dead", "failed", "payment_pending", "payment_failed"),
    ]
    .concat()
}

#[tokio::test]
async fn call_outcomes_move_the_saga_in_the_transaction_that_records_them() {
    let h = Harness::new(1).await;
    h.provider.set_faults(vec![rule("capture:o-bad", None, FaultKind::Status { status: 400, retry_after_secs: None })]);
    h.send(&order("evt-1", "o-good")).await;
    h.send(&order("evt-2", "o-bad")).await;
    let run = h.start(h.config(&saga_outcome_route()), Components::ALL, no_faults()).await;
    h.await_intents_finished(2).await;
    run.stop().await.unwrap();
    let states: Vec<(String, String)> =
        sqlx::query_as("SELECT saga_id, state FROM relay.sagas ORDER BY saga_id").fetch_all(&h.db.pool).await.unwrap();
    assert_eq!(states, vec![("o-bad".into(), "payment_failed".into()), ("o-good".into(), "paid".into())]);
    assert_eq!(h.db.count("history", "kind = 'outcome'").await, 2, "each outcome transition has its history row");
}

#[tokio::test]
async fn outbox_rows_are_marked_published_only_after_the_ack_and_a_crash_republishes_the_same_ids() {
    let h = Harness::new(1).await;
    h.send_orders(3).await;
    let calls = h
        .start(h.config(&CAPTURE_ROUTE), Components { consumer: true, dispatcher: true, publisher: false }, no_faults())
        .await;
    h.await_intents_finished(3).await;
    assert_eq!(h.db.count("outbox", "state = 'pending'").await, 3, "written, not yet published");

    // The broker acknowledged, then the publisher died before marking the rows.
    // Every hit fails (0), not just the first: the publisher's two lanes may
    // split the rows, and the lane that did not fail would otherwise mark its
    // share before the other's failure stops it.
    let faults = Faults::new(&[(point::PUBLISHER_AFTER_ACK, FaultAction::Fail, 0)]);
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.publisher.lease = Duration::from_secs(7);
    cfg.publisher.delivery_timeout = Duration::from_secs(5);
    let crashed =
        h.start(cfg.clone(), Components { consumer: false, dispatcher: false, publisher: true }, faults).await;
    assert!(crashed.finished().await.is_err());
    assert_eq!(h.db.count("outbox", "state = 'published'").await, 0, "not marked: no ack was recorded");
    let first = read_topic(&h.bootstrap, &h.out, 3).await.unwrap();
    assert_eq!(first.len(), 3, "but the broker has them");

    // After the lease expires another publisher republishes them, under the same ids.
    let publisher = h.start(cfg, Components { consumer: false, dispatcher: false, publisher: true }, no_faults()).await;
    h.await_published(3).await;
    publisher.stop().await.unwrap();
    calls.stop().await.unwrap();
    let all = read_topic(&h.bootstrap, &h.out, 6).await.unwrap();
    assert_eq!(all.len(), 6, "each event twice on the topic");
    let mut ids: Vec<&str> = all.iter().filter_map(|r| r.header("ce_id")).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3, "a consumer deduplicating on the CloudEvents id sees each event once");
    let ours: Vec<String> =
        sqlx::query_scalar("SELECT id::text FROM relay.outbox ORDER BY 1").fetch_all(&h.db.pool).await.unwrap();
    let mut ours: Vec<&str> = ours.iter().map(String::as_str).collect();
    ours.sort();
    assert_eq!(ids, ours, "the record ids are the outbox row ids");
}

#[tokio::test]
async fn a_record_the_broker_can_never_take_ends_dead_holding_its_key_and_the_others_go_out() {
    // Issue 28 ("to check"): a produce error that can never succeed (here the
    // broker refuses the topic's name) was retried for ever, blocking its key.
    // Now the row ends dead, naming the cause; other keys go on, and later
    // rows of its key wait for an operator (D8).
    let h = Harness::new(1).await;
    // Two rows of key o-1 on the refused topic: the second waits behind the dead first.
    relay_testkit::seed::pending_outbox(&h.db.pool, &h.consumer, "no such topic!", 1).await.unwrap();
    relay_testkit::seed::pending_outbox(&h.db.pool, &h.consumer, "no such topic!", 1).await.unwrap();
    relay_testkit::seed::pending_outbox(&h.db.pool, &h.consumer, &h.out, 2).await.unwrap();
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.publisher.delivery_timeout = Duration::from_secs(20);
    let run = h.start(cfg, Components { consumer: false, dispatcher: false, publisher: true }, no_faults()).await;
    eventually("the bad row dead and the others published", DEADLINE, || async {
        let dead = h.db.count("outbox", "state = 'dead' AND topic = 'no such topic!'").await;
        let published = h.db.count("outbox", "state = 'published'").await;
        (dead == 1 && published == 2).then_some(())
    })
    .await;
    run.stop().await.unwrap();
    let behind: (String, i32) = sqlx::query_as(
        "SELECT state, attempts FROM relay.outbox WHERE topic = 'no such topic!' ORDER BY seq DESC LIMIT 1",
    )
    .fetch_one(&h.db.pool)
    .await
    .unwrap();
    assert_eq!(behind, ("pending".to_string(), 0), "the later row of the dead one's key waits for an operator");
    let error: String = sqlx::query_scalar("SELECT last_error FROM relay.outbox WHERE state = 'dead'")
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    eprintln!("dead: {error}");
    assert!(error.to_lowercase().contains("topic"), "{error}");
}

#[tokio::test]
async fn a_fatal_producer_error_stops_the_publisher_naming_the_cause_and_marks_nothing() {
    // Issue 28 ("to check"): after a librdkafka fatal error the producer
    // never delivers again; a publisher that went on claiming would stall
    // silently while the process looks alive.
    let h = Harness::new(1).await;
    let cfg = h.config(&CAPTURE_ROUTE);
    let publisher = relay::publish::publisher::Publisher::new(
        h.db.pool.clone(),
        &cfg.kafka,
        cfg.publisher,
        &h.consumer,
        no_faults(),
    )
    .unwrap();
    relay_testkit::seed::pending_outbox(&h.db.pool, &h.consumer, &h.out, 3).await.unwrap();
    relay_testkit::raise_fatal_error(rdkafka::producer::Producer::client(publisher.producer()), "injected by the test")
        .unwrap();
    let stopped = tokio::time::timeout(DEADLINE, publisher.run(tokio_util::sync::CancellationToken::new()))
        .await
        .expect("the publisher stopped by itself");
    let e = format!("{:#}", stopped.expect_err("a fatal error ends the publisher with an error"));
    assert!(e.contains("injected by the test") && e.contains("failed for good"), "{e}");
    assert_eq!(h.db.count("outbox", "state = 'published'").await, 0, "nothing was delivered, nothing marked");
}

const KEYED_EMIT_ROUTE: &str = r#"
[[routes]]
topic = "{topic}"
type = "order.placed"

[[routes.actions]]
kind = "emit"
name = "accepted"
type = "order.accepted"
topic = "{out}"
key = "{{ data.customer }}"
data = { order_id = "{{ data.order_id }}" }
"#;

#[tokio::test]
async fn the_next_event_of_a_key_is_published_as_soon_as_the_earlier_one_is_not_at_the_next_poll() {
    // Events of one key are published one batch after another (a row waits
    // until every earlier row of its key is published). Nothing announces
    // that the next one became publishable; with a 60 s poll interval only
    // the publisher looking again after its own batch gets the chain going.
    let h = Harness::new(1).await;
    let chain = 4;
    send_orders_of_one_customer(&h, chain).await;
    let ingest = h
        .start(
            h.config(KEYED_EMIT_ROUTE),
            Components { consumer: true, dispatcher: false, publisher: false },
            no_faults(),
        )
        .await;
    h.await_inbox(chain).await;
    ingest.stop().await.unwrap();
    let mut cfg = h.config(KEYED_EMIT_ROUTE);
    cfg.publisher.poll_interval = Duration::from_secs(60);
    let publisher = h.start(cfg, Components { consumer: false, dispatcher: false, publisher: true }, no_faults()).await;
    eventually("the whole chain to be published", Duration::from_secs(20), || async {
        (h.db.count("outbox", "state = 'published'").await == chain).then_some(())
    })
    .await;
    publisher.stop().await.unwrap();
    let records = read_topic(&h.bootstrap, &h.out, chain as usize).await.unwrap();
    let order: Vec<String> = records
        .iter()
        .map(|r| String::from_utf8_lossy(r.payload.as_deref().unwrap_or_default()).into_owned())
        .collect();
    for (i, payload) in order.iter().enumerate() {
        assert!(payload.contains(&format!("o-{}", i + 1)), "per-key order kept: {order:?}");
    }
}

// A dead row holds its key (until an operator acts) and the rows after it
// wait. Each claim passes a window of them; a sweep sent back to the start
// every poll interval never got past a backlog longer than one interval's
// claims cover, and nothing after it, on any topic, was published.
#[tokio::test]
async fn a_backlog_waiting_behind_a_dead_row_does_not_keep_the_rows_after_it_from_being_published() {
    let h = Harness::new(1).await;
    let insert = "INSERT INTO relay.outbox (id, consumer, source_id, action, topic, key, payload, ordering_key, state)
                  SELECT gen_random_uuid(), $2, 'e-' || g, 'accepted', $1, convert_to('k', 'UTF8'),
                         convert_to('x', 'UTF8'), $3, $4
                    FROM generate_series(1, $5) g";
    for (key, state, n) in [(Some("k"), "dead", 1), (Some("k"), "pending", 50_000), (None, "pending", 1)] {
        sqlx::query(insert)
            .bind(&h.out)
            .bind(&h.consumer)
            .bind(key)
            .bind(state)
            .bind(n)
            .execute(&h.db.pool)
            .await
            .unwrap();
    }
    let mut cfg = h.config(KEYED_EMIT_ROUTE);
    cfg.publisher.batch_size = 10;
    cfg.publisher.poll_interval = Duration::from_millis(100);
    let only_publisher = Components { consumer: false, dispatcher: false, publisher: true };
    let publisher = h.start(cfg, only_publisher, no_faults()).await;
    eventually("the row after the backlog published", Duration::from_secs(30), || async {
        (h.db.count("outbox", "ordering_key IS NULL AND state = 'published'").await == 1).then_some(())
    })
    .await;
    publisher.stop().await.unwrap();
    assert_eq!(h.db.count("outbox", "state = 'pending'").await, 50_000, "the key's rows wait for its dead row");
}

// A claimed outbox row that could not be read (JSON nested deeper than the
// reader goes) was left out of its batch and left running: rescued when its
// lease expired, claimed again, and so on for ever.
#[tokio::test]
async fn an_outbox_row_that_cannot_be_read_ends_dead_saying_why() {
    let h = Harness::new(1).await;
    sqlx::query(
        "INSERT INTO relay.outbox (id, consumer, source_id, action, topic, payload, headers)
         VALUES (gen_random_uuid(), $2, 'e-1', 'accepted', $1, convert_to('x', 'UTF8'),
                 (repeat('[', 200) || repeat(']', 200))::jsonb)",
    )
    .bind(&h.out)
    .bind(&h.consumer)
    .execute(&h.db.pool)
    .await
    .unwrap();
    let only_publisher = Components { consumer: false, dispatcher: false, publisher: true };
    let publisher = h.start(h.config(KEYED_EMIT_ROUTE), only_publisher, no_faults()).await;
    let error: String = eventually("the row to end dead", DEADLINE, || async {
        sqlx::query_scalar("SELECT last_error FROM relay.outbox WHERE state = 'dead'")
            .fetch_optional(&h.db.pool)
            .await
            .unwrap()
    })
    .await;
    publisher.stop().await.unwrap();
    assert!(error.contains("cannot be read"), "{error}");
}

#[tokio::test]
async fn the_next_event_of_a_key_passed_over_by_a_full_claim_is_published_next_not_after_the_drain() {
    // A1 is claimed with B1 in a full claim of 2 that passes over A2 (A1 is
    // not published yet); the publisher's claims then go on after B1. Once
    // A1 is published they must look again from A1's place, not after the
    // position they reached — that would leave A2 until the drain is over
    // (or the 60 s poll interval).
    let h = Harness::new(1).await;
    let others = 40;
    sqlx::query(
        "INSERT INTO relay.outbox (id, consumer, source_id, action, topic, key, payload, ordering_key)
         SELECT gen_random_uuid(), $3, 'e-' || g, 'accepted', $1, convert_to(k, 'UTF8'), convert_to(n.name, 'UTF8'), k
           FROM generate_series(1, $2) g,
                LATERAL (SELECT CASE g WHEN 1 THEN 'A1' WHEN 2 THEN 'A2' ELSE 'B' || (g - 2) END AS name) n,
                LATERAL (SELECT CASE WHEN n.name LIKE 'A%' THEN 'A' ELSE n.name END AS k) key",
    )
    .bind(&h.out)
    .bind(others + 2)
    .bind(&h.consumer)
    .execute(&h.db.pool)
    .await
    .unwrap();
    let mut cfg = h.config(KEYED_EMIT_ROUTE);
    cfg.publisher.batch_size = 2;
    cfg.publisher.poll_interval = Duration::from_secs(60);
    let publisher = h.start(cfg, Components { consumer: false, dispatcher: false, publisher: true }, no_faults()).await;
    eventually("every row to be published", Duration::from_secs(30), || async {
        (h.db.count("outbox", "state = 'published'").await == others + 2).then_some(())
    })
    .await;
    publisher.stop().await.unwrap();
    // Batches published after A2's (each batch is marked in one statement).
    let later: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT published_at) FROM relay.outbox
          WHERE published_at > (SELECT published_at FROM relay.outbox WHERE source_id = 'e-2')",
    )
    .fetch_one(&h.db.pool)
    .await
    .unwrap();
    assert!(later >= 10, "A2 was published at the end of the drain: only {later} batches after it");
    let records = read_topic(&h.bootstrap, &h.out, others as usize + 2).await.unwrap();
    let a: Vec<String> = records
        .iter()
        .filter(|r| r.key.as_deref() == Some(b"A".as_slice()))
        .map(|r| String::from_utf8_lossy(r.payload.as_deref().unwrap_or_default()).into_owned())
        .collect();
    assert_eq!(a, ["A1", "A2"], "per-key order kept");
}

#[tokio::test]
async fn each_endpoint_keeps_to_its_concurrency_limit_and_rate_limit() {
    let h = Harness::new(1).await;
    h.provider.set_faults(vec![rule("capture:", None, FaultKind::TimeoutAfterApply { delay_ms: 100 })]);
    h.send_orders(12).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    let psp = cfg.endpoints.get_mut("psp").unwrap();
    psp.concurrency = 2;
    psp.rate_limit_per_second = Some(8);
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    h.await_intents_finished(12).await;
    run.stop().await.unwrap();

    let stats = h.provider.stats();
    assert_eq!(stats.applied, 12);
    assert!(stats.max_in_flight <= 2, "at most 2 calls at once, saw {}", stats.max_in_flight);
    // 8 per second: after the first (burst) call, each later one waits its 125 ms slot.
    let span = attempts_span(&h, "true").await;
    assert!(span >= 1.2, "12 calls at 8/s took {span:.3}s");
}

#[tokio::test]
async fn calls_queued_behind_a_stalled_provider_keep_the_rate_limit_when_it_answers_again() {
    // Issue 28 D12: calls took their rate token before the concurrency
    // permit, so those queued behind a stalled provider spent tokens while
    // they waited and went at once when it answered again: 4/s became bursts.
    let h = Harness::new(1).await;
    h.provider.set_faults(vec![rule("capture:", Some(1), FaultKind::HoldUntilReleased)]);
    h.send_orders(6).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.dispatcher.lease = Duration::from_secs(30);
    let psp = cfg.endpoints.get_mut("psp").unwrap();
    psp.concurrency = 2;
    psp.rate_limit_per_second = Some(4);
    psp.timeout = Duration::from_secs(5);
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    eventually("two calls held by the provider", DEADLINE, || async {
        (h.provider.stats().requests == 2).then_some(())
    })
    .await;
    // The stall: a second, in which the queued calls would have taken tokens.
    tokio::time::sleep(Duration::from_secs(1)).await;
    h.provider.release_held();
    h.await_intents_finished(6).await;
    run.stop().await.unwrap();

    let sent: Vec<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM started_at)::float8 FROM relay.intent_attempts ORDER BY started_at",
    )
    .fetch_all(&h.db.pool)
    .await
    .unwrap();
    assert_eq!(sent.len(), 6, "one attempt per call");
    // 4/s with no burst: 250 ms between sends. The timestamp is taken a
    // moment after the token, so a loaded machine shortens a gap a little;
    // calls that spent their tokens while queued go within a millisecond.
    let gaps: Vec<f64> = sent.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(gaps.iter().all(|g| *g >= 0.1), "calls sent closer than 4/s allows: gaps {gaps:.3?}");
}

#[tokio::test]
async fn an_error_answer_with_a_nul_byte_is_recorded_once_not_rescued_and_called_again() {
    // Second review of issue 28, N2: PostgreSQL text cannot hold NUL, so an
    // error body with one made the attempt's outcome unrecordable: the lease
    // ran out, the intent was rescued and called again, and ended uncertain.
    let h = Harness::new(1).await;
    let body = "amount\0invalid".to_string();
    h.provider.set_faults(vec![rule("capture:o-1", None, FaultKind::Body { status: 422, body })]);
    h.send(&order("evt-1", "o-1")).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();
    let (state, _, status, error) = intent_state(&h, "capture:o-1").await;
    assert_eq!((state.as_str(), status), ("dead", Some(422)));
    let error = error.unwrap();
    assert!(error.contains("amount\u{FFFD}invalid"), "{error}");
    assert_eq!(h.provider.stats().requests_for("capture:o-1"), 1, "called once");
    assert_eq!(h.db.count("intent_attempts", "true").await, 1);
}

#[tokio::test]
async fn an_error_page_that_never_ends_is_read_only_as_far_as_the_error_text_needs() {
    // Security review L2: the provider's error body was read whole, so an
    // error page that streams without end held the call until its timeout
    // (and its memory grew with every chunk).
    let h = Harness::new(1).await;
    h.provider.set_faults(vec![rule("capture:o-1", Some(1), FaultKind::EndlessBody { status: 503 })]);
    h.send(&order("evt-1", "o-1")).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.endpoints.get_mut("psp").unwrap().timeout = Duration::from_secs(10);
    cfg.dispatcher.lease = Duration::from_secs(30);
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();
    assert_eq!(
        attempts(&h, "capture:o-1").await,
        vec![("uncertain".into(), Some(503)), ("succeeded".into(), Some(201))]
    );
    let (error, took): (String, f64) = sqlx::query_as(
        "SELECT error, extract(epoch FROM finished_at - started_at)::float8 FROM relay.intent_attempts WHERE attempt = 1",
    )
    .fetch_one(&h.db.pool)
    .await
    .unwrap();
    assert!(error.contains("xxxx") && error.len() < 400, "a bounded start of the page: {} bytes", error.len());
    assert!(took < 5.0, "the attempt waited {took:.1} s for the end of an endless page (timeout 10 s)");
}

#[tokio::test]
async fn provider_answers_that_are_not_json_are_classified_by_status_alone() {
    let h = Harness::new(1).await;
    h.provider.set_faults(vec![
        rule("capture:o-page", None, FaultKind::Html { status: 200 }),
        rule("capture:o-gateway", Some(2), FaultKind::Html { status: 502 }),
        rule("capture:o-forbidden", None, FaultKind::Html { status: 403 }),
    ]);
    h.send(&order("evt-1", "o-page")).await;
    h.send(&order("evt-2", "o-gateway")).await;
    h.send(&order("evt-3", "o-forbidden")).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_intents_finished(3).await;
    run.stop().await.unwrap();
    assert_eq!(intent_state(&h, "capture:o-page").await.0, "succeeded", "a 2xx HTML page is still a success");
    assert_eq!(
        attempts(&h, "capture:o-gateway").await,
        vec![("uncertain".into(), Some(502)), ("uncertain".into(), Some(502)), ("succeeded".into(), Some(201))]
    );
    let (state, _, status, error) = intent_state(&h, "capture:o-forbidden").await;
    assert_eq!((state.as_str(), status), ("dead", Some(403)));
    assert!(error.unwrap().contains("<html>"), "the error keeps a bounded snippet of the body");
}

#[tokio::test]
async fn the_trace_of_an_event_continues_through_the_call_and_the_outcome_event() {
    let h = Harness::new(1).await;
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    h.send(&order("evt-1", "o-1").ext("traceparent", parent)).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_intents_finished(1).await;
    h.await_published(1).await;
    run.stop().await.unwrap();

    let trace = |tp: &str| tp.split('-').nth(1).unwrap().to_owned();
    let span = |tp: &str| tp.split('-').nth(2).unwrap().to_owned();
    let sent = h.provider.applied()[0].traceparent.clone().expect("the call carries a traceparent");
    assert_eq!(trace(&sent), trace(parent), "same trace");
    assert_ne!(span(&sent), span(parent), "the call is a span of its own");
    let stored: String =
        sqlx::query_scalar("SELECT traceparent FROM relay.intents").fetch_one(&h.db.pool).await.unwrap();
    assert_eq!(trace(&stored), trace(parent));
    assert_ne!(span(&stored), span(&sent), "the intent carries the processing span, the call a child of it");
    let out = read_topic(&h.bootstrap, &h.out, 1).await.unwrap();
    let emitted = out[0].header("ce_traceparent").expect("the outcome event carries the trace");
    assert_eq!(trace(emitted), trace(parent));
}

#[tokio::test]
async fn a_claim_that_waited_too_long_for_a_call_slot_is_given_back_not_sent_late() {
    let h = Harness::new(1).await;
    // Calls take 0.9 s against a 2 s timeout (with 1 s, a call on a loaded
    // machine timed out and was rightly sent again); one slot; a 4 s lease,
    // so a claim is sent only within 1 s of it (lease − timeout − 1 s spare):
    // of a batch of six, the third on wait 1.8 s and more for the slot. Sent
    // late anyway, the fifth would still be running when its lease ran out
    // and the rescuer sent it again.
    h.provider.set_faults(vec![rule("capture:", None, FaultKind::TimeoutAfterApply { delay_ms: 900 })]);
    h.send_orders(6).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.dispatcher.concurrency = 1;
    cfg.dispatcher.claim_batch = 6;
    cfg.dispatcher.lease = Duration::from_secs(4);
    cfg.endpoints.get_mut("psp").unwrap().timeout = Duration::from_secs(2);
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    h.await_intents_finished(6).await;
    run.stop().await.unwrap();
    let stats = h.provider.stats();
    for (key, s) in &stats.by_key {
        assert_eq!((s.requests, s.applied, s.concurrent), (1, 1, 0), "{key}: sent once, never beside a rescued copy");
    }
    assert_eq!(h.db.count("intents", "attempts <> 1").await, 0, "a given-back claim costs no attempt");
    assert_eq!(h.db.count("intent_attempts", "outcome <> 'succeeded'").await, 0);
}

#[tokio::test]
async fn a_dispatcher_working_through_a_backlog_claims_a_quarter_batch_at_a_time_not_one_per_call() {
    let h = Harness::new(1).await;
    // Calls that take a while: the claim loop sees them end one by one.
    h.provider.set_faults(vec![rule("capture:", None, FaultKind::TimeoutAfterApply { delay_ms: 20 })]);
    let n: usize = 60;
    h.send_orders(n).await;
    let ingest = h.start(h.config(&CAPTURE_ROUTE), INGEST, no_faults()).await;
    h.await_inbox(n as i64).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.dispatcher.concurrency = 1;
    cfg.dispatcher.claim_batch = 16;
    let faults = Faults::new(&[(point::DISPATCHER_AFTER_CLAIM, FaultAction::Pause(Duration::ZERO), 0)]);
    let run = h.start(cfg, DISPATCH, faults.clone()).await;
    h.await_intents_finished(n as i64).await;
    run.stop().await.unwrap();
    ingest.stop().await.unwrap();
    assert_eq!(h.provider.stats().applied, n as u64);
    // 16 first, then 4 whenever 4 calls have ended: about 12 claims. A claim
    // whenever a call ends would make one per call after the first batch.
    let claims = faults.hits(point::DISPATCHER_AFTER_CLAIM);
    assert!(claims <= n as u64 / 3, "{claims} claims for {n} intents");
}

#[tokio::test]
async fn calls_go_on_while_the_finalizers_are_busy_recording_outcomes() {
    let h = Harness::new(1).await;
    h.send_orders(20).await;
    // Every intent is waiting before the dispatcher starts.
    let ingest = h.start(h.config(&CAPTURE_ROUTE), INGEST, no_faults()).await;
    h.await_inbox(20).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.dispatcher.concurrency = 1;
    cfg.dispatcher.claim_batch = 8;
    // Long enough that no lease runs out while its outcome waits.
    cfg.dispatcher.lease = Duration::from_secs(60);
    // Every batch of outcomes waits 3 s before it is written: both finalizers
    // sit on their first outcome and their queue (two outcomes per call
    // slot) is full after two more. A call slot held until its outcome is
    // handed over would stop the calls there, at 5.
    let slow = FaultAction::Pause(Duration::from_secs(3));
    let run = h.start(cfg, DISPATCH, Faults::new(&[(point::DISPATCHER_BEFORE_FINISH, slow, 0)])).await;
    let (calls, recorded) = eventually("calls beyond the finalizers' queue", DEADLINE, || async {
        // Calls first: the count of recorded outcomes only grows, so zero
        // read after means zero when the calls were counted.
        let calls = h.provider.stats().requests;
        let recorded = h.db.count("intents", "state = 'succeeded'").await;
        (calls >= 8).then_some((calls, recorded))
    })
    .await;
    assert_eq!(recorded, 0, "{calls} calls made before the first outcome was written");
    h.await_intents_finished(20).await;
    run.stop().await.unwrap();
    ingest.stop().await.unwrap();
    assert_eq!(h.provider.stats().applied, 20);
}

#[tokio::test]
async fn a_claimer_keeps_its_connection_between_claims_and_replaces_one_that_was_killed() {
    let db = relay_testkit::TestDb::new().await.unwrap();
    let mut claimer = ClaimPool::beside(&db.pool, 1, ClaimCommit::Durable).claimer();
    let lease = Duration::from_secs(60);
    let pid = async |claimer: &mut relay_store::Claimer| -> i32 {
        let conn = claimer.connection().await.unwrap();
        sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(conn.as_conn()).await.unwrap()
    };
    let first = pid(&mut claimer).await;
    claimer.claim(async |conn| intents::claim(conn, &C_PSP, "w", 10, lease).await).await.unwrap();
    assert_eq!(pid(&mut claimer).await, first, "the same session claims again");

    sqlx::query("SELECT pg_terminate_backend($1, 5000)").bind(first).execute(&db.pool).await.unwrap();
    let failed = claimer.claim(async |conn| intents::claim(conn, &C_PSP, "w", 10, lease).await).await;
    assert!(failed.is_err(), "a claim on the killed session fails");
    let claim = claimer.claim(async |conn| intents::claim(conn, &C_PSP, "w", 10, lease).await).await.unwrap();
    assert!(claim.rows.is_empty());
    assert_ne!(pid(&mut claimer).await, first, "claims go on on a new session");
}

/// An intent to `endpoint` as the consumer writes one (`ordering_key` optional).
fn new_intent(n: u32, endpoint: &str, ordering_key: Option<&str>) -> intents::NewIntent {
    intents::NewIntent {
        id: uuid::Uuid::new_v4(),
        max_age: Duration::from_secs(3600),
        fair_spacing: None,
        intent: intents::Intent {
            consumer: "c".into(),
            source_event_id: format!("e-{n}"),
            action: "capture".into(),
            endpoint: endpoint.into(),
            method: "POST".into(),
            path: format!("/captures/{n}"),
            body: Some(json!({"n": n})),
            headers: json!({}),
            idempotency_key: format!("capture:{n}"),
            ordering_key: ordering_key.map(str::to_owned),
            holds_key: false,
            fairness_key: None,
            max_attempts: 5,
            on_success: json!({}),
            on_dead: json!({}),
            emit_source: "test".into(),
            aggregate_id: None,
            correlation_id: None,
            causation_id: None,
            traceparent: None,
        },
    }
}

/// State, attempts and `locked_by` of the intent with id `id`.
async fn row_of(db: &relay_testkit::TestDb, id: uuid::Uuid) -> (String, i32, Option<String>, Option<uuid::Uuid>) {
    sqlx::query_as("SELECT state, attempts, locked_by, lease_token FROM relay.intents WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// Whether the dispatchers were woken (NOTIFY relay_intents) since
/// `listener`, listening on that channel, last read: a marker sent now comes
/// first unless something notified before it (notifications arrive in commit
/// order). Reads up to the marker.
async fn woke_dispatchers(listener: &mut sqlx::postgres::PgListener, conn: &mut sqlx::PgConnection) -> bool {
    sqlx::query("SELECT pg_notify('relay_intents', 'marker')").execute(&mut *conn).await.unwrap();
    let first = tokio::time::timeout(Duration::from_secs(10), listener.recv()).await.unwrap().unwrap();
    if first.payload() != "marker" {
        let marker = tokio::time::timeout(Duration::from_secs(10), listener.recv()).await.unwrap().unwrap();
        assert_eq!(marker.payload(), "marker");
    }
    first.payload() != "marker"
}

#[tokio::test]
async fn an_intent_claimed_at_ingest_is_written_running_unless_it_is_keyed_or_its_endpoint_is_paused() {
    // Claim at ingest (relay::deliver::handoff): the row the consumer writes for a
    // held intent is the one a claim would leave, and only intents a claim
    // could take right now are held. Dispatchers are woken only by an insert
    // that wrote a pending intent (migration 0008).
    let db = relay_testkit::TestDb::new().await.unwrap();
    let mut listener = sqlx::postgres::PgListener::connect_with(&db.pool).await.unwrap();
    listener.listen("relay_intents").await.unwrap();
    let mut conn = db.conn().await.unwrap();
    relay_store::ops::pause(&mut conn, "c", relay_store::ops::PauseKind::Endpoint, "paused", None).await.unwrap();
    let lease = Duration::from_secs(30);

    // All held: written running, no wake-up.
    let plain = [new_intent(1, "psp", None), new_intent(2, "psp", None)];
    let hold = intents::Hold { worker: "w-1", lease, take: &[true, true] };
    let new = relay_store::effects::insert(&mut conn, "c", &plain, Some(hold), &[], &[]).await.unwrap();
    assert_eq!(new.held.len(), 2);
    for i in &plain {
        let held = new.held[&i.id];
        assert_eq!(row_of(&db, i.id).await, ("running".into(), 1, Some("w-1".into()), Some(held.lease_token)));
    }
    let leased: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM locked_until - clock_timestamp())::float8 FROM relay.intents WHERE id = $1",
    )
    .bind(plain[0].id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(leased > 20.0 && leased <= 30.0, "a lease of 30 s from the insert, {leased:.1} s left");
    assert!(!woke_dispatchers(&mut listener, &mut conn).await, "intents written already claimed woke the dispatchers");

    // Keyed, paused or not taken: pending, as without a hold, and announced.
    let others = [new_intent(3, "psp", Some("k-1")), new_intent(4, "paused", None), new_intent(5, "psp", None)];
    let hold = intents::Hold { worker: "w-1", lease, take: &[true, true, false] };
    let new = relay_store::effects::insert(&mut conn, "c", &others, Some(hold), &[], &[]).await.unwrap();
    assert!(new.held.is_empty(), "{:?}", new.held);
    assert_eq!(new.intents.len(), 3);
    for i in &others {
        assert_eq!(row_of(&db, i.id).await, ("pending".into(), 0, None, None), "{}", i.intent.source_event_id);
    }
    assert!(woke_dispatchers(&mut listener, &mut conn).await, "pending intents must wake the dispatchers");

    // A second write of a held intent (a redelivered record) is no new claim.
    let hold = intents::Hold { worker: "w-2", lease, take: &[true] };
    let new = relay_store::effects::insert(&mut conn, "c", &plain[..1], Some(hold), &[], &[]).await.unwrap();
    assert!(new.intents.is_empty() && new.held.is_empty());
    assert_eq!(row_of(&db, plain[0].id).await.2.as_deref(), Some("w-1"));
}

#[tokio::test]
async fn intents_handed_over_but_not_started_go_back_to_pending_uncounted_when_the_dispatcher_stops() {
    let db = relay_testkit::TestDb::new().await.unwrap();
    let any_endpoint: relay::deliver::handoff::EndpointRoom = std::sync::Arc::new(|_: &str| usize::MAX);
    let (handoff, desk) = relay::deliver::handoff::channel("w-1", Duration::from_secs(30), 3, any_endpoint);
    let mut reserved = handoff.reserve(10).expect("room");
    assert_eq!(reserved.len(), 3, "as much room as there is");
    assert!(handoff.reserve(1).is_none(), "no room left");
    let rows = [new_intent(1, "psp", None), new_intent(2, "psp", None)];
    let mut conn = db.conn().await.unwrap();
    let hold = intents::Hold { worker: handoff.worker(), lease: handoff.lease(), take: &[true, true] };
    let new = relay_store::effects::insert(&mut conn, "c", &rows, Some(hold), &[], &[]).await.unwrap();
    let mut handed: Vec<_> = rows
        .iter()
        .map(|r| reserved.hand(intents::ClaimedIntent::held_at_insert(r.clone(), new.held[&r.id])).unwrap())
        .collect();
    drop(reserved);
    assert_eq!(handoff.reserve(10).map(|r| r.len()), Some(1), "the unused room went back");

    // Handed over, then the dispatcher stops before starting it.
    handoff.send(&db.pool, vec![handed.remove(0)]).await;
    desk.close(&db.pool).await;
    // Given back, the worker kept: claimed once, its age budget is not restarted again.
    let given_back = ("pending".to_string(), 0, Some("w-1".to_string()), None);
    assert_eq!(row_of(&db, rows[0].id).await, given_back);
    // Handed over after the dispatcher stopped: the consumer's side gives it back.
    handoff.send(&db.pool, handed).await;
    assert_eq!(row_of(&db, rows[1].id).await, given_back);
    assert_eq!(handoff.reserve(10).map(|r| r.len()), Some(3), "all room back once nothing is held");
}

#[tokio::test]
async fn an_intent_claimed_at_ingest_whose_hand_over_a_crash_prevented_is_rescued_and_called_once() {
    // `relay run`: the consumer writes the intent already claimed by the
    // dispatcher beside it and hands it over after its commit. A crash in
    // between leaves the row running under that dispatcher's lease, its
    // attempt counted and nothing called; once the lease expires it is
    // rescued and called once (C9 for a claim made at ingest).
    let h = Harness::new(1).await;
    h.send(&order("evt-1", "o-1")).await;
    let faults = Faults::new(&[(point::CONSUMER_AFTER_DB_COMMIT, FaultAction::Fail, 1)]);
    let crashed = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, faults).await;
    assert!(crashed.finished().await.is_err(), "the fault stops the relay like a crash");
    assert_eq!(h.provider.stats().requests, 0, "nothing called");
    let (state, attempts_made, _, _) = intent_state(&h, "capture:o-1").await;
    assert_eq!((state.as_str(), attempts_made), ("running", 1), "written claimed, attempt counted");

    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_intents_finished(1).await;
    h.await_published(1).await;
    run.stop().await.unwrap();
    let stats = h.provider.stats();
    assert_eq!((stats.requests, stats.applied), (1, 1), "called once");
    assert_eq!(
        attempts(&h, "capture:o-1").await,
        vec![("lease_expired".into(), None), ("succeeded".into(), Some(201))]
    );
    assert_eq!(h.db.count("intents", "true").await, 1, "the redelivered record wrote nothing new");
}

#[tokio::test]
async fn a_consumer_batch_of_more_intents_than_a_claim_batch_is_claimed_at_ingest_whole() {
    // The dispatcher's room for intents claimed at ingest is a claim batch
    // plus a consumer batch (relay::deliver::handoff::room). With a claim batch alone,
    // a full consumer batch — what high load brings — wrote all but its first
    // `claim_batch` intents pending, each to wait for a NOTIFY and a claim.
    let h = Harness::new(1).await;
    let n = 12;
    for i in 0..n {
        h.send(&order(&format!("evt-{i}"), &format!("o-{i}"))).await;
    }
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.consumer.batch_size = n;
    cfg.dispatcher.claim_batch = 2;
    // Only an insert that wrote a pending intent wakes the dispatchers (migration 0008).
    let mut listener = sqlx::postgres::PgListener::connect_with(&h.db.pool).await.unwrap();
    listener.listen("relay_intents").await.unwrap();
    // Stop like a crash right after the first batch's commit: its rows are as
    // the consumer wrote them, nothing handed over or called yet.
    let faults = Faults::new(&[(point::CONSUMER_AFTER_DB_COMMIT, FaultAction::Fail, 1)]);
    let crashed = h.start(cfg, Components::ALL, faults).await;
    assert!(crashed.finished().await.is_err(), "the fault stops the relay like a crash");
    // An intent written pending may have been claimed (and called) by the
    // claim loop before the crash; its wake-up says it was written pending.
    let mut conn = h.db.conn().await.unwrap();
    assert!(
        !woke_dispatchers(&mut listener, &mut conn).await,
        "the consumer wrote intents pending: it woke the dispatchers"
    );
    assert_eq!(h.provider.stats().requests, 0, "nothing called");
    let states: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM relay.intents GROUP BY state ORDER BY state")
            .fetch_all(&h.db.pool)
            .await
            .unwrap();
    let written: i64 = states.iter().map(|(_, n)| n).sum();
    assert!(written > 2, "the first batch held more intents than a claim batch ({states:?}); nothing to check");
    assert_eq!(states, vec![("running".to_string(), written)], "every intent of the batch written claimed");
}

#[tokio::test]
async fn without_claim_at_ingest_the_consumer_writes_every_intent_pending() {
    let h = Harness::new(1).await;
    h.send(&order("evt-1", "o-1")).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.dispatcher.claim_at_ingest = false;
    let faults = Faults::new(&[(point::CONSUMER_AFTER_DB_COMMIT, FaultAction::Fail, 1)]);
    let crashed = h.start(cfg, Components::ALL, faults).await;
    assert!(crashed.finished().await.is_err(), "the fault stops the relay like a crash");
    // The dispatcher may have claimed and called it meanwhile (a graceful
    // stop records the outcome); it was not written claimed.
    let (state, ..) = intent_state(&h, "capture:o-1").await;
    assert!(state == "pending" || state == "succeeded", "{state}");
}

#[tokio::test]
async fn a_claim_waiting_at_the_rate_limit_is_given_back_before_its_lease_runs_out_not_sent_late() {
    // Issue 22 item 4 (C17): one call a second, 64 call slots, a 3 s lease and
    // a 1 s timeout. Every claim finds a call slot at once; the lease must
    // still be checked when the request is sent, after the rate limit's
    // wait, or calls start after their lease expired, the rescuer re-queues
    // them and a second copy is sent beside (or after) the first.
    let h = Harness::new(1).await;
    let n = 8;
    h.send_orders(n).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.dispatcher.concurrency = 64;
    cfg.endpoints.get_mut("psp").unwrap().rate_limit_per_second = Some(1);
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    h.await_intents_finished(n as i64).await;
    run.stop().await.unwrap();
    let stats = h.provider.stats();
    assert_eq!(stats.applied, n as u64);
    for (key, s) in &stats.by_key {
        assert_eq!((s.requests, s.concurrent), (1, 0), "{key}: sent once, never after its lease ran out");
    }
    assert_eq!(h.db.count("intent_attempts", "outcome <> 'succeeded'").await, 0, "no lease expired");
    assert_eq!(h.db.count("intents", "attempts <> 1").await, 0, "a claim given back costs no attempt");
}

#[tokio::test]
async fn intents_of_one_ordering_key_run_one_at_a_time_in_commit_order() {
    // Issue 22 item 5 (R13): two transactions (records of two partitions)
    // write an intent for one ordering key; the one that wrote first commits
    // last. The claim must never have both running at once, and runs them in
    // the order they committed.
    let db = relay_testkit::TestDb::new().await.unwrap();
    let mut claimer = ClaimPool::beside(&db.pool, 1, ClaimCommit::Durable).claimer();
    let lease = Duration::from_secs(60);
    let first = new_intent(1, "psp", Some("customer-1"));
    let second = new_intent(2, "psp", Some("customer-1"));
    let mut a = db.pool.begin().await.unwrap();
    relay_store::effects::insert(&mut a, "c", std::slice::from_ref(&first), None, &[], &[]).await.unwrap();
    let (pool, row) = (db.pool.clone(), second.clone());
    let b = tokio::spawn(async move {
        let mut b = pool.begin().await.unwrap();
        relay_store::effects::insert(&mut b, "c", std::slice::from_ref(&row), None, &[], &[]).await.unwrap();
        b.commit().await.unwrap();
    });
    // B has committed, or waits for A's lock: either way, as far as it goes.
    eventually("the second transaction to commit or wait", DEADLINE, || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        (b.is_finished() || waiting > 0).then_some(())
    })
    .await;
    let mut claim = async || -> Vec<uuid::Uuid> {
        let c = claimer.claim(async |conn| intents::claim(conn, &C_PSP, "w", 10, lease).await).await.unwrap();
        c.rows.iter().map(|r| r.id).collect()
    };
    let mut order = claim().await;
    a.commit().await.unwrap();
    b.await.unwrap();
    let mut running = order.len();
    while order.len() < 2 {
        let now = claim().await;
        running += now.len();
        assert!(running <= 1, "two intents of one ordering key running at once: {order:?} then {now:?}");
        order.extend(&now);
        if now.is_empty() && running == 1 {
            // Finish the running one; the next may go.
            sqlx::query("UPDATE relay.intents SET state = 'succeeded', lease_token = NULL WHERE state = 'running'")
                .execute(&db.pool)
                .await
                .unwrap();
            running = 0;
        } else if now.is_empty() {
            panic!("nothing claimable with nothing running: {order:?}");
        }
    }
    assert_eq!(order, vec![first.id, second.id], "commit order: the first transaction committed first");
}

#[tokio::test]
async fn an_intent_out_of_budget_after_an_uncertain_attempt_is_left_uncertain_without_its_on_dead_effects() {
    // Issue 22 item 12: the provider answers after the client's timeout,
    // every time. The budget runs out on an uncertain attempt: as far as the
    // relay can know the call may have taken effect, so payment.failed must
    // not be emitted.
    let h = Harness::new(1).await;
    h.provider.set_faults(vec![rule("capture:o-1", None, FaultKind::TimeoutBeforeApply { delay_ms: 1_500 })]);
    h.send(&order("evt-1", "o-1")).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.endpoints.get_mut("psp").unwrap().max_attempts = 2;
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();
    let (state, error): (String, Option<String>) =
        sqlx::query_as("SELECT state, last_error FROM relay.intents").fetch_one(&h.db.pool).await.unwrap();
    assert_eq!(state, "uncertain", "{error:?}");
    assert!(error.unwrap_or_default().contains("outcome is unknown"));
    assert_eq!(h.db.count("outbox", "event_type = 'payment.failed'").await, 0, "on_dead was recorded");
    assert_eq!(h.provider.stats().requests_for("capture:o-1"), 2, "both attempts were sent");
    // A replay asks again with the same key: the provider answers what it did.
    h.provider.set_faults(vec![]);
    let mut conn = h.db.conn().await.unwrap();
    let id: uuid::Uuid = sqlx::query_scalar("SELECT id FROM relay.intents").fetch_one(&mut *conn).await.unwrap();
    assert_eq!(
        intents::requeue(&mut conn, &h.consumer, id, |_| intents::ReplayRules::ANY).await.unwrap(),
        intents::Requeue::Queued,
        "an uncertain intent can be replayed"
    );
    let run = h.start(h.config(&CAPTURE_ROUTE), DISPATCH, no_faults()).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();
    assert_eq!(h.intents_in("succeeded").await, 1);
    assert_eq!(h.provider.stats().applied_for("capture:o-1"), 1, "applied once");
}

#[tokio::test]
async fn an_oversized_record_is_dead_lettered_with_a_copy_the_broker_takes_and_a_row_it_never_takes_ends_dead() {
    // Issue 22 item 7: the dead-letter copy of an oversized record was the
    // whole record, above the producer's limit; the publisher retried the
    // permanent MessageSizeTooLarge forever.
    let h = Harness::new(1).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.consumer.max_record_bytes = 10_000;
    cfg.kafka.producer_properties.insert("message.max.bytes".into(), "20000".into());
    // Not compressible to under the limit either way: the limit is on the record as given.
    let big: String = (0..40_000u32).map(|i| char::from(b'a' + (i.wrapping_mul(2_654_435_761) % 26) as u8)).collect();
    let big_event = TestEvent::new("evt-big", "order.placed", json!({"order_id": "o-big", "note": big}));
    h.send(&big_event).await;
    let (_, last) = h.send(&order("evt-1", "o-1")).await;
    let run = h.start(cfg.clone(), INGEST, no_faults()).await;
    h.await_committed(0, last + 1).await;
    h.await_published(1).await; // the dead-letter copy
    let copy = read_topic(&h.bootstrap, &h.dlq, 1).await.unwrap();
    assert_eq!(copy[0].header("relay_dlq_error_class"), Some("oversized"));
    assert!(copy[0].header("relay_dlq_omitted_bytes").is_some_and(|n| n.parse::<usize>().unwrap() > 40_000));
    // The dead-letter table keeps as much of it as a record may have: an
    // oversized record is never processed as it is, and one inflated from
    // a compressed batch would fill the disk a thousand times faster than
    // it came in.
    let (stored, reason): (i32, String) =
        sqlx::query_as("SELECT length(payload), reason FROM relay.dead_letters").fetch_one(&h.db.pool).await.unwrap();
    assert_eq!(stored, 10_000, "{reason}");
    assert!(reason.contains("stored: the first 10000 bytes of its key"), "{reason}");

    // A row the broker can never take (above the producer's limit) ends dead.
    let row = relay_core::OutboxRecord {
        id: uuid::Uuid::new_v4(),
        action: "too-big".into(),
        topic: h.out.clone(),
        key: None,
        headers: Vec::new(),
        payload: Some(big.into_bytes()),
        event_type: None,
        ordering_key: None,
    };
    let mut conn = h.db.conn().await.unwrap();
    outbox::insert(&mut conn, &h.consumer, "src", &row).await.unwrap();
    let error: String = eventually("the row that can never be published to end dead", DEADLINE, || async {
        sqlx::query_scalar("SELECT last_error FROM relay.outbox WHERE state = 'dead'")
            .fetch_optional(&h.db.pool)
            .await
            .unwrap()
    })
    .await;
    run.stop().await.unwrap();
    assert!(error.contains("permanent"), "{error}");
    let stats = relay_store::stats::gauges(&mut conn).await.unwrap();
    assert_eq!(relay_store::stats::Stats::count(&stats.backlog.outbox, relay_core::OutboxState::Dead), 1);
}

#[tokio::test]
async fn an_absurd_retry_after_ends_its_intent_and_the_outcomes_recorded_with_it_are_kept() {
    // Issue 22 item 11: a Retry-After of ~10^17 s overflowed PostgreSQL's
    // interval, and the whole batch of outcomes it was recorded with failed,
    // again and again.
    let h = Harness::new(1).await;
    let absurd = FaultKind::Status { status: 429, retry_after_secs: Some(99_999_999_999_999_999) };
    h.provider.set_faults(vec![rule("capture:o-0", None, absurd)]);
    h.send_orders(8).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_intents_finished(8).await;
    run.stop().await.unwrap();
    let (state, error): (String, Option<String>) =
        sqlx::query_as("SELECT state, last_error FROM relay.intents WHERE idempotency_key = 'capture:o-0'")
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
    assert_eq!(state, "dead");
    assert!(error.unwrap_or_default().contains("past the intent's max age"));
    assert_eq!(h.intents_in("succeeded").await, 7, "the other outcomes were recorded");
}

/// Seconds from the first to the last attempt of the intents `i` matching `filter`.
async fn attempts_span(h: &Harness, filter: &str) -> f64 {
    sqlx::query_scalar(&format!(
        "SELECT extract(epoch FROM max(a.started_at) - min(a.started_at))::float8
           FROM relay.intent_attempts a JOIN relay.intents i ON i.id = a.intent_id WHERE {filter}"
    ))
    .fetch_one(&h.db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn the_operator_queues_every_dead_intent_of_an_endpoint_again_and_leaves_the_others() {
    use relay::ops::admin::{Intents, Operator, OpsError};
    let db = relay_testkit::TestDb::new().await.unwrap();
    // 2 500 dead intents of `psp`, 3 of `other`, 2 succeeded; and dead ones
    // of another consumer sharing the database (issue 28, D11).
    sqlx::query(
        "INSERT INTO relay.intents (id, consumer, source_event_id, action, endpoint, method, path,
                                    idempotency_key, max_attempts, attempts, expires_at, emit_source, state)
         SELECT gen_random_uuid(), 't', 'e-' || g, 'capture',
                CASE WHEN g <= 2500 THEN 'psp' ELSE 'other' END, 'POST', '/c', 'capture:' || g, 3, 3,
                now() + interval '1 day', 't', CASE WHEN g <= 2503 THEN 'dead' ELSE 'succeeded' END
           FROM generate_series(1, 2505) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO relay.intents (id, consumer, source_event_id, action, endpoint, method, path,
                                    idempotency_key, max_attempts, attempts, expires_at, emit_source, state)
         SELECT gen_random_uuid(), 'u', 'e-' || g, 'capture', 'psp', 'POST', '/c', 'u-capture:' || g, 3, 3,
                now() + interval '1 day', 'u', 'dead'
           FROM generate_series(1, 4) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut cfg = relay_core::RelayConfig::default();
    cfg.consumer.name = "t".into();
    let ops = Operator::new(db.pool.clone(), &cfg);
    let mut progress = Vec::new();
    let done = ops
        .requeue_all(Intents::Dead { endpoint: Some("psp".into()) }, KeyWindow::Within, |n| progress.push(n))
        .await
        .unwrap();
    assert_eq!((done.asked, done.queued, done.left.len()), (2500, 2500, 0));
    assert_eq!(progress, vec![1000, 2000], "progress every thousand");
    let count = |state: &'static str, endpoint: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM relay.intents WHERE state = $1 AND endpoint = $2")
                .bind(state)
                .bind(endpoint)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(count("pending", "psp").await, 2500);
    assert_eq!(count("dead", "other").await, 3, "another endpoint's dead intents stay dead");
    let theirs = db.count("intents", "consumer = 'u' AND state = 'dead'").await;
    assert_eq!(theirs, 4, "another consumer's dead intents stay dead");
    let u1: uuid::Uuid = sqlx::query_scalar("SELECT id FROM relay.intents WHERE idempotency_key = 'u-capture:1'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(matches!(ops.requeue(u1, KeyWindow::Within).await, Err(OpsError::Conflict(_))), "nor is one queued by id");
    assert!(ops.intent(u1).await.is_err(), "nor shown");

    // By id: a dead one is queued, a succeeded one (and an unknown id) left, named.
    let id_of = |key: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, uuid::Uuid>("SELECT id FROM relay.intents WHERE idempotency_key = $1")
                .bind(key)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let (dead, succeeded, unknown) = (id_of("capture:2501").await, id_of("capture:2504").await, uuid::Uuid::nil());
    let done = ops.requeue_all(Intents::Ids(vec![dead, succeeded, unknown]), KeyWindow::Within, |_| {}).await.unwrap();
    assert_eq!((done.asked, done.queued, done.left), (3, 1, vec![succeeded, unknown]));
    let refused = ops.requeue(succeeded, KeyWindow::Within).await.unwrap_err();
    assert!(matches!(&refused, OpsError::Conflict(why) if why.contains("neither dead nor uncertain")), "{refused:?}");
}

/// State and last status of the only intent with key `key`, and whether an
/// attempt of it may have been applied.
async fn ending(h: &Harness, key: &str) -> (String, Option<i32>, bool) {
    sqlx::query_as("SELECT state, last_status, ever_uncertain FROM relay.intents WHERE idempotency_key = $1")
        .bind(key)
        .fetch_one(&h.db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn once_an_attempt_may_have_been_applied_the_intent_never_ends_dead_whatever_later_attempts_say() {
    // Issue 28 D1: attempt 1 times out after sending (the provider may be
    // applying it), later attempts get 503 until the budget ends. The
    // capture may have gone through: no payment.failed, state uncertain —
    // before the fix the last attempt alone decided, and it ended dead.
    let h = Harness::new(1).await;
    h.provider.set_faults(vec![
        rule("capture:o-1", Some(1), FaultKind::TimeoutBeforeApply { delay_ms: 1_500 }),
        rule("capture:o-1", None, FaultKind::Status { status: 503, retry_after_secs: None }),
    ]);
    h.send(&order("evt-1", "o-1")).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.endpoints.get_mut("psp").unwrap().max_attempts = 3;
    let run = h.start(cfg.clone(), Components::ALL, no_faults()).await;
    h.await_intents_finished(1).await;
    assert_eq!(ending(&h, "capture:o-1").await, ("uncertain".into(), Some(503), true));
    assert_eq!(
        attempts(&h, "capture:o-1").await,
        vec![("uncertain".into(), None), ("uncertain".into(), Some(503)), ("uncertain".into(), Some(503))]
    );
    // A replay that meets only 503s again ends uncertain again: the timeout
    // stays as possible as it was.
    let mut conn = h.db.conn().await.unwrap();
    let id: uuid::Uuid = sqlx::query_scalar("SELECT id FROM relay.intents").fetch_one(&mut *conn).await.unwrap();
    assert_eq!(
        intents::requeue(&mut conn, &h.consumer, id, |_| intents::ReplayRules::ANY).await.unwrap(),
        intents::Requeue::Queued
    );
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();
    assert_eq!(ending(&h, "capture:o-1").await, ("uncertain".into(), Some(503), true));
    assert_eq!(h.db.count("outbox", "event_type = 'payment.failed'").await, 0, "on_dead was recorded");
}

#[tokio::test]
async fn a_claim_that_comes_back_late_has_the_lease_it_was_given_not_a_new_one() {
    // Issue 28 D2: the lease clock started when the claim came back, so a
    // claim that took 2.5 s (a loaded database, a starved runtime) still
    // sent its call as if it had the whole lease: the call ran past the
    // database's lease, the rescuer re-queued the intent and a second call
    // with the same key was in flight beside the first.
    let h = Harness::new(1).await;
    // Lease 3 s, timeout 1 s (the harness); the provider takes 900 ms.
    h.provider.set_faults(vec![rule("capture:o-1", None, FaultKind::TimeoutAfterApply { delay_ms: 900 })]);
    h.send(&order("evt-1", "o-1")).await;
    let ingest = h.start(h.config(&CAPTURE_ROUTE), INGEST, no_faults()).await;
    h.await_inbox(1).await;
    let slow_claim =
        Faults::new(&[(point::DISPATCHER_AFTER_CLAIM, FaultAction::Pause(Duration::from_millis(2_500)), 1)])
            .with_sabotage(no_faults().sabotage());
    let dispatch = h.start(h.config(&CAPTURE_ROUTE), DISPATCH, slow_claim).await;
    h.await_intents_finished(1).await;
    h.await_published(1).await;
    dispatch.stop().await.unwrap();
    ingest.stop().await.unwrap();
    let stats = h.provider.stats();
    assert_eq!(stats.by_key["capture:o-1"].concurrent, 0, "two calls of one key in flight at once: {stats:?}");
    assert_eq!(stats.applied_for("capture:o-1"), 1);
    assert_eq!(intent_state(&h, "capture:o-1").await.0, "succeeded");
}

#[tokio::test]
async fn dispatchers_and_publishers_take_only_their_consumer_s_rows_of_endpoints_they_have() {
    // Issue 28 D3: two deployments share a database. Deployment B's
    // dispatcher (its own consumer, endpoint `other` only) claimed A's
    // intents too, spent their attempts on an endpoint it does not have and
    // recorded payment.failed; B's publisher published A's outbox rows.
    let h = Harness::new(1).await;
    h.send_orders(5).await;
    let ingest = h.start(h.config(&CAPTURE_ROUTE), Components { publisher: false, ..INGEST }, no_faults()).await;
    h.await_inbox(5).await;
    ingest.stop().await.unwrap();
    let mut b = h.config(&CAPTURE_ROUTE);
    b.consumer.name = format!("{}-b", h.consumer);
    let psp = b.endpoints.remove("psp").unwrap();
    b.endpoints.insert("other".into(), relay_core::config::EndpointConfig { max_attempts: 2, ..psp });
    b.routes.clear();
    // B's own work, written after A's: an intent and an outbox row.
    relay_testkit::seed::pending_intents(&h.db.pool, &b.consumer.name, "other", "b-", 1).await.unwrap();
    relay_testkit::seed::pending_outbox(&h.db.pool, &b.consumer.name, &h.out, 1).await.unwrap();
    let run_b = h.start(b, Components { consumer: false, ..Components::ALL }, no_faults()).await;
    // Claims go oldest first: once B's own rows are done, A's would have
    // been claimed before them.
    eventually("B's own intent and outbox row", DEADLINE, || async {
        let intent = h.db.count("intents", "idempotency_key = 'capture:b-o-1' AND state = 'succeeded'").await;
        let row = h.db.count("outbox", &format!("consumer = '{}-b' AND state = 'published'", h.consumer)).await;
        (intent == 1 && row == 1).then_some(())
    })
    .await;
    run_b.stop().await.unwrap();
    let a = format!("consumer = '{}'", h.consumer);
    assert_eq!(h.db.count("intents", &format!("{a} AND state = 'pending' AND attempts = 0")).await, 5);
    assert_eq!(h.db.count("outbox", &format!("{a} AND state <> 'pending'")).await, 0, "A's rows untouched");
    assert_eq!(h.provider.stats().requests, 1, "only B's call was made");

    // A's own dispatcher and publisher call and publish them, first attempt each.
    let run_a = h.start(h.config(&CAPTURE_ROUTE), Components { consumer: false, ..Components::ALL }, no_faults()).await;
    h.await_intents_finished(6).await;
    run_a.stop().await.unwrap();
    assert_eq!(h.db.count("intents", &format!("{a} AND state = 'succeeded' AND attempts = 1")).await, 5);
    assert_eq!(h.db.count("outbox", "event_type = 'payment.failed'").await, 0);
}

#[tokio::test]
async fn a_redirect_is_an_answer_not_followed_and_the_call_is_dead_with_its_status() {
    // Issue 28 D7: reqwest followed a 302 to a login page, whose 200 counted
    // as the capture's success; a 307 would have re-sent the body and the
    // idempotency key to another host.
    let h = Harness::new(1).await;
    let to_login = FaultKind::Redirect { status: 302, location: "/login".into() };
    h.provider.set_faults(vec![FaultRule {
        path_prefix: Some("/captures".into()),
        key_prefix: None,
        times: None,
        kind: to_login,
    }]);
    h.send(&order("evt-1", "o-1")).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();
    let (state, _, status, error) = intent_state(&h, "capture:o-1").await;
    assert_eq!((state.as_str(), status), ("dead", Some(302)), "{error:?}");
    assert!(error.unwrap_or_default().contains("redirect to \"/login\" not followed"));
    let stats = h.provider.stats();
    assert_eq!((stats.requests, stats.applied), (1, 0), "the login page was never asked: {stats:?}");
}

#[tokio::test]
async fn a_stale_completion_beside_a_fresh_one_of_the_same_intent_records_nothing() {
    // Issue 28 D9: outcome effects were fenced by intent id, so a stale
    // completion (its lease rescued and re-claimed) that said "dead" in the
    // same batch as the current claim's "retry" recorded payment.failed.
    let h = Harness::new(1).await;
    h.send(&order("evt-1", "o-1")).await;
    let ingest = h.start(h.config(&CAPTURE_ROUTE), INGEST, no_faults()).await;
    h.await_inbox(1).await;
    ingest.stop().await.unwrap();
    let mut claims = ClaimPool::beside(&h.db.pool, 1, ClaimCommit::Durable).acquire().await.unwrap();
    let scope = Scope { consumer: &h.consumer, endpoints: &["psp"] };
    let lease = Duration::from_secs(60);
    let stale = intents::claim(&mut claims, &scope, "worker-a", 1, lease).await.unwrap().rows.remove(0);
    sqlx::query("UPDATE relay.intents SET locked_until = now() - interval '1 second'")
        .execute(&h.db.pool)
        .await
        .unwrap();
    intents::rescue_expired(&mut h.db.conn().await.unwrap(), 10).await.unwrap();
    let fresh = intents::claim(&mut claims, &scope, "worker-b", 1, lease).await.unwrap().rows.remove(0);
    assert_ne!(stale.lease_token, fresh.lease_token);

    let relay = h.relay(h.config(&CAPTURE_ROUTE), relay::Handlers::default(), no_faults()).await;
    let dispatcher = relay.dispatcher().unwrap();
    let record = |outcome, status| AttemptRecord {
        started_at: Some(chrono::Utc::now()),
        outcome,
        status: Some(status),
        error_class: Some(intents::ErrorClass::HttpStatus),
        error: Some(format!("HTTP {status}")),
    };
    use relay::deliver::outcome::Completion;
    use relay::deliver::outcome::Finished;
    let mut batch = [
        Completion::decided(stale, NextState::Dead, record(AttemptOutcome::Permanent, 422)),
        Completion::decided(fresh, NextState::Retry(Duration::from_secs(1)), record(AttemptOutcome::Retryable, 503)),
    ];
    assert_eq!(dispatcher.finalize(&mut batch).await, vec![Finished::LeaseLost, Finished::Retrying]);
    assert_eq!(h.db.count("outbox", "event_type = 'payment.failed'").await, 0, "the stale outcome was recorded");
    assert_eq!(intent_state(&h, "capture:o-1").await.0, "pending");
}

// The completer recorded a batch of outcomes in one transaction that
// waited for every ordering key of their events: one key another
// transaction held made every outcome of the batch wait, fail on
// lock_timeout and lose its lease, to be called again.
#[tokio::test]
async fn an_outcome_whose_event_key_is_held_waits_alone_and_the_rest_of_its_batch_is_recorded() {
    use relay::deliver::outcome::{Completion, Finished};
    use relay_store::ordering::{Key, lock};
    let h = Harness::new(1).await;
    h.send(&order("evt-1", "o-1")).await;
    h.send(&order("evt-2", "o-2")).await;
    let ingest = h.start(h.config(&CAPTURE_ROUTE), INGEST, no_faults()).await;
    h.await_inbox(2).await;
    ingest.stop().await.unwrap();
    let mut claims = ClaimPool::beside(&h.db.pool, 1, ClaimCommit::Durable).acquire().await.unwrap();
    let scope = Scope { consumer: &h.consumer, endpoints: &["psp"] };
    let lease = Duration::from_secs(60);
    let mut claimed = intents::claim(&mut claims, &scope, "worker", 2, lease).await.unwrap().rows;
    claimed.sort_by_key(|c| c.intent.idempotency_key.clone());
    let done = || AttemptRecord {
        started_at: Some(chrono::Utc::now()),
        outcome: AttemptOutcome::Succeeded,
        status: Some(201),
        error_class: None,
        error: None,
    };
    let mut batch: Vec<Completion> =
        claimed.into_iter().map(|c| Completion::decided(c, NextState::Succeeded, done())).collect();
    let mut holder = h.db.pool.begin().await.unwrap();
    lock(&mut holder, &h.consumer, [Key::Outbox { topic: &h.out, key: "o-1" }]).await.unwrap();

    let relay = h.relay(h.config(&CAPTURE_ROUTE), relay::Handlers::default(), no_faults()).await;
    let dispatcher = relay.dispatcher().unwrap();
    let started = std::time::Instant::now();
    assert_eq!(dispatcher.finalize(&mut batch).await, vec![Finished::KeyHeld, Finished::Succeeded]);
    assert!(started.elapsed() < Duration::from_secs(2), "waited {:?} for the held key", started.elapsed());
    assert_eq!(intent_state(&h, "capture:o-1").await.0, "running", "o-1 keeps its claim");
    assert_eq!(intent_state(&h, "capture:o-2").await.0, "succeeded");
    assert_eq!(h.db.count("outbox", "true").await, 1, "o-2's payment.captured alone");

    holder.rollback().await.unwrap();
    assert_eq!(dispatcher.finalize(&mut batch[..1]).await, vec![Finished::Succeeded]);
    assert_eq!(intent_state(&h, "capture:o-1").await.0, "succeeded");
    assert_eq!(h.db.count("outbox", "event_type = 'payment.captured'").await, 2);
}

// The age budget ran from the insert: an intent relay itself kept unsent
// (its key behind an uncertain intent, its endpoint paused) past max_age
// died at its first claim, and its on_dead announced payment.failed for a
// call never made.
#[tokio::test]
async fn an_intent_kept_unsent_past_its_max_age_is_sent_at_its_first_claim() {
    let h = Harness::new(1).await;
    h.send(&order("evt-1", "o-1")).await;
    let ingest = h.start(h.config(&CAPTURE_ROUTE), INGEST, no_faults()).await;
    h.await_inbox(1).await;
    ingest.stop().await.unwrap();
    // Written two days ago and never claimed since.
    sqlx::query(
        "UPDATE relay.intents SET created_at = created_at - interval '2 days',
                expires_at = expires_at - interval '2 days', next_attempt_at = next_attempt_at - interval '2 days'",
    )
    .execute(&h.db.pool)
    .await
    .unwrap();
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();
    let (state, _, status, error) = intent_state(&h, "capture:o-1").await;
    assert_eq!((state.as_str(), status), ("succeeded", Some(201)), "{error:?}");
    assert_eq!(h.provider.stats().applied, 1);
    assert_eq!(h.db.count("outbox", "event_type = 'payment.failed'").await, 0);
}

// Relay's sessions searched `public` for functions: one planted there
// with an exact argument type (`unnest(text[])`) was chosen over
// pg_catalog's `unnest(anyarray)` in every claim, and ran as relay's role.
// Who may create in `public` (the database's owner, on PostgreSQL 15) could
// so grant itself every relay table.
#[tokio::test]
async fn a_function_planted_in_public_is_never_called_by_relay() {
    let h = Harness::new(1).await;
    sqlx::raw_sql(
        "CREATE TABLE public.planted (at timestamptz);
         CREATE FUNCTION public.unnest(a text[]) RETURNS SETOF text LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO public.planted VALUES (now());
             RETURN QUERY SELECT x FROM pg_catalog.unnest(a) x;
         END $$;",
    )
    .execute(&h.db.pool)
    .await
    .unwrap();
    h.send(&order("evt-1", "o-1")).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();
    assert_eq!(intent_state(&h, "capture:o-1").await.0, "succeeded");
    // And a transaction a frozen relay leaves open ends after five minutes.
    let relay = h.relay(h.config(&CAPTURE_ROUTE), relay::Handlers::default(), no_faults()).await;
    let (path, idle): (String, String) =
        sqlx::query_as("SELECT current_setting('search_path'), current_setting('idle_in_transaction_session_timeout')")
            .fetch_one(relay.pool())
            .await
            .unwrap();
    assert_eq!((path.as_str(), idle.as_str()), ("pg_catalog,pg_temp", "5min"));
    let ran: i64 = sqlx::query_scalar("SELECT count(*) FROM public.planted").fetch_one(&h.db.pool).await.unwrap();
    assert_eq!(ran, 0, "the planted function ran in relay's sessions");
}

#[tokio::test]
async fn a_dead_intent_whose_failure_was_announced_is_not_replayed_into_a_success() {
    // Issue 28 D4: replaying a dead intent whose payment.failed was emitted
    // (and saga moved to failed) could succeed and emit payment.captured
    // beside it. Now refused; an uncertain one (nothing announced) is
    // replayed, and its success is the only story.
    let h = Harness::new(1).await;
    h.provider.set_faults(vec![rule("capture:o-1", None, FaultKind::Status { status: 422, retry_after_secs: None })]);
    h.send(&order("evt-1", "o-1")).await;
    let run = h.start(h.config(&CAPTURE_ROUTE), Components::ALL, no_faults()).await;
    h.await_intents_finished(1).await;
    h.await_published(1).await;
    h.provider.set_faults(vec![]);
    let relay = h.relay(h.config(&CAPTURE_ROUTE), relay::Handlers::default(), no_faults()).await;
    let id: uuid::Uuid = sqlx::query_scalar("SELECT id FROM relay.intents").fetch_one(&h.db.pool).await.unwrap();
    let refused = relay.operator().requeue(id, KeyWindow::Within).await.unwrap_err();
    assert!(refused.to_string().contains("on_dead effects were recorded"), "{refused}");
    let all = relay
        .operator()
        .requeue_all(relay::ops::admin::Intents::Dead { endpoint: None }, KeyWindow::Within, |_| {})
        .await
        .unwrap();
    assert_eq!((all.queued, all.refused.clone()), (0, vec![id]));
    run.stop().await.unwrap();
    assert_eq!(intent_state(&h, "capture:o-1").await.0, "dead");
    assert_eq!(h.db.count("outbox", "event_type = 'payment.failed'").await, 1);
    assert_eq!(h.db.count("outbox", "event_type = 'payment.captured'").await, 0);
    assert_eq!(h.provider.stats().applied, 0);
}

#[tokio::test]
async fn a_throttled_endpoint_does_not_hold_up_the_calls_of_a_fast_one() {
    // Issue 28 D10: every call slot was taken before the endpoint's limits
    // and held while waiting at them, and claims filled up with whatever was
    // due first: a backlog at an endpoint limited to 1 call/s held the calls
    // of every other endpoint for up to the lease.
    let h = Harness::new(1).await;
    let consumer = h.consumer.clone();
    relay_testkit::seed::pending_intents(&h.db.pool, &consumer, "throttled", "a-", 30).await.unwrap();
    relay_testkit::seed::pending_intents(&h.db.pool, &consumer, "psp", "b-", 5).await.unwrap();
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.dispatcher.lease = Duration::from_secs(30);
    cfg.dispatcher.concurrency = 8;
    cfg.dispatcher.claim_batch = 8;
    let psp = cfg.endpoints["psp"].clone();
    cfg.endpoints
        .insert("throttled".into(), relay_core::config::EndpointConfig { rate_limit_per_second: Some(1), ..psp });
    let started = std::time::Instant::now();
    let run = h.start(cfg, DISPATCH, no_faults()).await;
    eventually("the fast endpoint's 5 calls", DEADLINE, || async {
        let done = h.db.count("intents", "endpoint = 'psp' AND state = 'succeeded'").await;
        (done == 5).then_some(())
    })
    .await;
    let took = started.elapsed();
    let throttled = h.db.count("intents", "endpoint = 'throttled' AND state = 'succeeded'").await;
    run.stop().await.unwrap();
    assert!(took < Duration::from_secs(5), "the fast endpoint waited {took:?} behind the throttled one");
    assert!(throttled < 10, "the throttled endpoint kept to about 1 call/s: {throttled} in {took:?}");
}

#[tokio::test]
async fn a_stopping_dispatcher_gives_back_the_calls_it_has_not_sent_instead_of_sending_them() {
    // Issue 28: a dispatcher told to stop went on waiting at an endpoint's
    // limits with the calls it had claimed, and sent them when a permit came
    // free — a shutdown took until the lease ran out, or was killed leaving
    // leases that held the intents until they expired.
    let h = Harness::new(1).await;
    let consumer = h.consumer.clone();
    relay_testkit::seed::pending_intents(&h.db.pool, &consumer, "psp", "a-", 20).await.unwrap();
    // The provider holds the one call the endpoint allows at a time.
    h.provider.set_faults(vec![rule("capture:", None, FaultKind::HoldUntilReleased)]);
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.dispatcher.lease = Duration::from_secs(60);
    let psp = cfg.endpoints.get_mut("psp").unwrap();
    psp.concurrency = 1;
    psp.timeout = Duration::from_secs(5);
    let run = h.start(cfg, DISPATCH, no_faults()).await;
    eventually("one call held and more claimed behind it", DEADLINE, || async {
        let running = h.db.count("intents", "state = 'running'").await;
        (h.provider.stats().requests == 1 && running >= 2).then_some(())
    })
    .await;
    let stopping = std::time::Instant::now();
    run.stop().await.unwrap();
    let took = stopping.elapsed();
    // The held call ends at its 5 s timeout; the ones behind it are not sent.
    assert!(took < Duration::from_secs(10), "stopping took {took:?} (the lease is 60 s)");
    assert_eq!(h.provider.stats().requests, 1, "a call waiting for the endpoint's permit was sent while stopping");
    assert_eq!(h.db.count("intents", "state = 'running'").await, 0, "no lease left behind");
    let attempts: i64 =
        sqlx::query_scalar("SELECT sum(attempts)::bigint FROM relay.intents").fetch_one(&h.db.pool).await.unwrap();
    assert_eq!(attempts, 1, "a call given back unsent is not an attempt");
    h.provider.release_held();
}

#[tokio::test]
async fn a_throttled_call_waiting_for_its_token_leaves_the_only_call_slot_to_a_fast_endpoint() {
    // Second review of issue 28, N4: a rate-limited call that had waited for
    // a call slot then awaited a fresh token while holding it, so with few
    // slots a 1/s endpoint took every other endpoint down to its pace.
    let h = Harness::new(1).await;
    let consumer = h.consumer.clone();
    relay_testkit::seed::pending_intents(&h.db.pool, &consumer, "throttled", "a-", 10).await.unwrap();
    relay_testkit::seed::pending_intents(&h.db.pool, &consumer, "psp", "b-", 30).await.unwrap();
    // The fast endpoint keeps the slot busy (30 × 100 ms), so the throttled
    // calls mostly find it taken and wait for it.
    h.provider.set_faults(vec![rule("capture:b-", None, FaultKind::TimeoutAfterApply { delay_ms: 100 })]);
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.dispatcher.lease = Duration::from_secs(30);
    cfg.dispatcher.concurrency = 1;
    let psp = cfg.endpoints["psp"].clone();
    cfg.endpoints
        .insert("throttled".into(), relay_core::config::EndpointConfig { rate_limit_per_second: Some(1), ..psp });
    let run = h.start(cfg, DISPATCH, no_faults()).await;
    eventually("the fast endpoint's 30 calls", DEADLINE, || async {
        (h.db.count("intents", "endpoint = 'psp' AND state = 'succeeded'").await == 30).then_some(())
    })
    .await;
    run.stop().await.unwrap();
    // From the first call sent to the fast endpoint's last one, as recorded.
    let took = attempts_span(&h, "i.endpoint = 'psp'").await;
    eprintln!("30 fast calls beside the throttled endpoint took {took:.2} s");
    // 3 s of calls (3.2 s measured); a slot held for each throttled call's
    // token wait made it 8.4 s.
    assert!(took < 6.0, "30 fast calls took {took:.2} s beside a 1/s endpoint on one slot");
    // And the throttled endpoint kept its pace meanwhile: a call that gave
    // its slot back for a fresher token went to the queue's end each time,
    // and none was made while the fast endpoint kept waiters.
    let throttled_meanwhile = sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM relay.intent_attempts a JOIN relay.intents i ON i.id = a.intent_id
          WHERE i.endpoint = 'throttled' AND a.started_at <= (SELECT max(b.started_at) FROM relay.intent_attempts b
                 JOIN relay.intents j ON j.id = b.intent_id WHERE j.endpoint = 'psp')",
    )
    .fetch_one(&h.db.pool)
    .await
    .unwrap();
    assert!(
        throttled_meanwhile >= 2,
        "{throttled_meanwhile} throttled calls in the {took:.2} s the fast calls took at 1/s"
    );
}

#[tokio::test]
async fn a_dead_outbox_row_holds_its_key_until_an_operator_replays_or_skips_it() {
    // Issue 28 D8: a dead row let the later rows of its key go, and the
    // advised fix (set it back to pending by hand) published it after them:
    // downstream order for the key was B, C, A.
    let h = Harness::new(1).await;
    let record = |name: &str, key: &str, bytes: usize| relay_core::OutboxRecord {
        id: uuid::Uuid::new_v4(),
        action: name.into(),
        topic: h.out.clone(),
        key: Some(key.as_bytes().to_vec()),
        headers: Vec::new(),
        // Not compressible below the producer's limit.
        payload: Some((0..bytes as u32).map(|i| b'a' + (i.wrapping_mul(2_654_435_761) % 26) as u8).collect()),
        event_type: None,
        ordering_key: Some(key.into()),
    };
    let (a, b, c) = (record("A", "k", 40_000), record("B", "k", 10), record("C", "k", 10));
    let other = record("D", "other", 10);
    let mut conn = h.db.conn().await.unwrap();
    for r in [&a, &b, &c, &other] {
        outbox::insert(&mut conn, &h.consumer, "src", r).await.unwrap();
    }
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.kafka.producer_properties.insert("message.max.bytes".into(), "20000".into());
    let publish = Components { consumer: false, dispatcher: false, publisher: true };
    let run = h.start(cfg.clone(), publish, no_faults()).await;
    eventually("A dead and the other key's row published", DEADLINE, || async {
        let dead = h.db.count("outbox", "state = 'dead'").await;
        let d = h.db.count("outbox", "action = 'D' AND state = 'published'").await;
        (dead == 1 && d == 1).then_some(())
    })
    .await;
    let relay = h.relay(cfg.clone(), relay::Handlers::default(), no_faults()).await;
    let ops = relay.operator();
    let shown = ops.outbox_row(a.id).await.unwrap();
    assert_eq!((shown.state.as_str(), shown.waiting_behind), ("dead", 2), "B and C wait behind A");
    assert_eq!(h.db.count("outbox", "action IN ('B', 'C') AND state = 'pending'").await, 2);
    run.stop().await.unwrap();

    // The operator raises the limit and replays A: A, B, C in that order.
    cfg.kafka.producer_properties.insert("message.max.bytes".into(), "1000000".into());
    ops.outbox_replay(a.id).await.unwrap();
    assert!(matches!(ops.outbox_replay(a.id).await, Err(relay::ops::admin::OpsError::Conflict(_))), "not dead now");
    let run = h.start(cfg.clone(), publish, no_faults()).await;
    h.await_published(4).await;
    run.stop().await.unwrap();
    let records = read_topic(&h.bootstrap, &h.out, 4).await.unwrap();
    let sizes: Vec<usize> = records
        .iter()
        .filter(|r| r.key.as_deref() == Some(b"k".as_slice()))
        .map(|r| r.payload.as_ref().map_or(0, Vec::len))
        .collect();
    assert_eq!(sizes, [40_000, 10, 10], "A first, then B and C");

    // Skipped instead, a dead row lets the later rows of its key go without it.
    let (e, f) = (record("E", "k2", 40_000), record("F", "k2", 10));
    for r in [&e, &f] {
        outbox::insert(&mut conn, &h.consumer, "src", r).await.unwrap();
    }
    cfg.kafka.producer_properties.insert("message.max.bytes".into(), "20000".into());
    let run = h.start(cfg.clone(), publish, no_faults()).await;
    eventually("E dead", DEADLINE, || async {
        (h.db.count("outbox", "action = 'E' AND state = 'dead'").await == 1).then_some(())
    })
    .await;
    assert_eq!(h.db.count("outbox", "action = 'F' AND state = 'pending'").await, 1, "F waits behind E");
    ops.outbox_skip(e.id).await.unwrap();
    eventually("F published", DEADLINE, || async {
        (h.db.count("outbox", "action = 'F' AND state = 'published'").await == 1).then_some(())
    })
    .await;
    run.stop().await.unwrap();
    assert_eq!(ops.outbox_row(e.id).await.unwrap().state, relay_core::OutboxState::Skipped);
}

#[tokio::test]
async fn an_outcome_whose_effects_the_database_rejects_is_recorded_without_them_not_called_again() {
    // Issue 28, "to check": the intent was left running, rescued and called
    // again up to its budget, ending uncertain although the provider had
    // answered 201, with on_success never recorded.
    let h = Harness::new(1).await;
    h.send(&order("evt-1", "o-1")).await;
    let ingest = h.start(h.config(&CAPTURE_ROUTE), INGEST, no_faults()).await;
    h.await_inbox(1).await;
    ingest.stop().await.unwrap();
    let mut claims = ClaimPool::beside(&h.db.pool, 1, ClaimCommit::Durable).acquire().await.unwrap();
    let scope = Scope { consumer: &h.consumer, endpoints: &["psp"] };
    let mut claimed =
        intents::claim(&mut claims, &scope, "worker", 1, Duration::from_secs(60)).await.unwrap().rows.remove(0);
    // A saga id PostgreSQL cannot store (a NUL byte): the database rejects the effects.
    let bad =
        json!({"action": "m", "saga_type": "order", "saga_id": "o\u{0}1", "from": [], "to": "paid", "start": true});
    claimed.intent.on_success["saga"] = json!([bad]);
    let relay = h.relay(h.config(&CAPTURE_ROUTE), relay::Handlers::default(), no_faults()).await;
    let done = AttemptRecord {
        started_at: Some(chrono::Utc::now()),
        outcome: AttemptOutcome::Succeeded,
        status: Some(201),
        error_class: None,
        error: None,
    };
    let completion = relay::deliver::outcome::Completion::decided(claimed, NextState::Succeeded, done);
    let finished = relay.dispatcher().unwrap().finalize(&mut [completion]).await;
    assert_eq!(finished, vec![relay::deliver::outcome::Finished::Succeeded]);
    assert_eq!(intent_state(&h, "capture:o-1").await.0, "succeeded");
    assert_eq!(h.db.count("outbox", "true").await, 0, "no effect of the rejected outcome was written");
}

#[tokio::test]
async fn an_uncertain_intent_holds_its_ordering_key_and_a_replayed_dead_one_goes_behind_it() {
    // Issue 28, "to check": dead and uncertain intents let the later intents
    // of their key run while the earlier call's effect was unknown, and a
    // replay then ran the earlier one after them.
    let db = relay_testkit::TestDb::new().await.unwrap();
    let mut claimer = ClaimPool::beside(&db.pool, 1, ClaimCommit::Durable).claimer();
    let lease = Duration::from_secs(60);
    let rows: Vec<_> = (1..=3).map(|n| new_intent(n, "psp", Some("customer-1"))).collect();
    let mut conn = db.conn().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    relay_store::effects::insert(&mut tx, "c", &rows, None, &[], &[]).await.unwrap();
    tx.commit().await.unwrap();
    let mut claim = async || -> Vec<uuid::Uuid> {
        let c = claimer.claim(async |conn| intents::claim(conn, &C_PSP, "w", 10, lease).await).await.unwrap();
        c.rows.iter().map(|r| r.id).collect()
    };
    let end = async |id: uuid::Uuid, state: &str| {
        sqlx::query("UPDATE relay.intents SET state = $2, lease_token = NULL, finished_at = now() WHERE id = $1")
            .bind(id)
            .bind(state)
            .execute(&db.pool)
            .await
            .unwrap();
    };
    assert_eq!(claim().await, vec![rows[0].id]);
    end(rows[0].id, "uncertain").await;
    assert!(claim().await.is_empty(), "the key waits while its earlier call's effect is unknown");
    // Replayed, it goes first: it is still the earliest of its key.
    assert_eq!(
        intents::requeue(&mut conn, "c", rows[0].id, |_| intents::ReplayRules::ANY).await.unwrap(),
        intents::Requeue::Queued
    );
    assert_eq!(claim().await, vec![rows[0].id]);
    end(rows[0].id, "succeeded").await;
    // A dead intent releases its key; replayed, it goes behind the rest.
    assert_eq!(claim().await, vec![rows[1].id]);
    end(rows[1].id, "dead").await;
    assert_eq!(
        intents::requeue(&mut conn, "c", rows[1].id, |_| intents::ReplayRules::ANY).await.unwrap(),
        intents::Requeue::QueuedBehindItsKey
    );
    assert_eq!(claim().await, vec![rows[2].id], "the key's later intent first");
    end(rows[2].id, "succeeded").await;
    assert_eq!(claim().await, vec![rows[1].id]);
}

fn throttled_and_fast() -> String {
    [
        routes::route(Some("placed"), "order.placed", ""),
        routes::call("capture", "throttled", "/captures/{{ data.order_id }}", ""),
        routes::route(Some("refund"), "refund.requested", ""),
        routes::call("refund", "psp", "/refunds/{{ data.order_id }}", ""),
    ]
    .concat()
}

/// Refunds `r-0` … `r-{n-1}` (events `refund-…`), for the `refund` route of
/// [`throttled_and_fast`] and [`slow_and_keyed`].
async fn send_refunds(h: &Harness, n: usize) {
    for i in 0..n {
        h.send(&TestEvent::new(&format!("refund-{i}"), "refund.requested", json!({"order_id": format!("r-{i}")})))
            .await;
    }
}

#[tokio::test]
async fn a_throttled_endpoint_does_not_hold_up_a_fast_one_when_intents_are_claimed_at_ingest() {
    // Review of issue 28's first increment, F2: with consumer and dispatcher
    // in one process, the consumer held a whole batch of the throttled
    // endpoint's intents at ingest, taking the dispatcher's room, and the
    // fast endpoint's intents waited behind them.
    let h = Harness::new(1).await;
    h.send_orders(100).await;
    send_refunds(&h, 5).await;
    let text = format!(
        "{}\n[endpoints.throttled]\nbase_url = \"{}\"\ntimeout = \"1s\"\nrate_limit_per_second = 1\n",
        h.config_text(&throttled_and_fast()),
        h.provider.url()
    );
    let mut cfg = h.config_of(&text);
    cfg.dispatcher.lease = Duration::from_secs(30);
    // A hand-over room (claim batch + consumer batch = 58) smaller than the
    // throttled backlog, as in production (64 + 500 against any backlog).
    cfg.dispatcher.claim_batch = 8;
    let started = std::time::Instant::now();
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    eventually("the fast endpoint's 5 calls", DEADLINE, || async {
        let done = h.db.count("intents", "endpoint = 'psp' AND state = 'succeeded'").await;
        (done == 5).then_some(())
    })
    .await;
    let took = started.elapsed();
    let throttled = h.db.count("intents", "endpoint = 'throttled' AND state = 'succeeded'").await;
    run.stop().await.unwrap();
    assert!(took < Duration::from_secs(8), "the fast endpoint waited {took:?} behind the throttled one");
    assert!(throttled < 15, "the throttled endpoint kept to about 1 call/s: {throttled} in {took:?}");
}

fn slow_and_keyed() -> String {
    [
        routes::route(Some("placed"), "order.placed", ""),
        routes::call("capture", "slow", "/slow/{{ data.order_id }}", "body = { pad = \"{{ data.pad }}\" }\n"),
        routes::route(Some("refund"), "refund.requested", ""),
        routes::call("refund", "psp", "/refunds/{{ data.order_id }}", "ordering_key = \"{{ data.order_id }}\"\n"),
    ]
    .concat()
}

// Intents of a slow endpoint without a rate limit, handed over at ingest
// faster than it answered, filled the claim loop's room, first its count
// and then its bytes: claims stopped, and every intent only a claim starts
// (an ordering key, a retry, one given back) waited until the handed calls
// gave up at their lease.
#[tokio::test]
async fn a_slow_endpoint_s_handed_over_calls_do_not_stop_the_claims_of_keyed_intents() {
    let h = Harness::new(1).await;
    h.provider.set_faults(vec![FaultRule {
        path_prefix: Some("/slow/".into()),
        key_prefix: None,
        times: None,
        kind: FaultKind::HoldUntilReleased,
    }]);
    // 150 calls of 40 KB each: the handed-over ones alone are more than the
    // 1 MiB byte room below.
    for i in 0..150 {
        let data = json!({"order_id": format!("o-{i}"), "amount": 100, "pad": "x".repeat(40_000)});
        h.send(&TestEvent::new(&format!("evt-{i}"), "order.placed", data).key(&format!("o-{i}"))).await;
    }
    send_refunds(&h, 5).await;
    let text = format!(
        "{}\n[endpoints.slow]\nbase_url = \"{}\"\ntimeout = \"30s\"\nconcurrency = 2\n",
        // Handed calls give up at 60 s - 30 s - 1 s.
        h.config_text(&slow_and_keyed()).replace("[dispatcher]\nlease = \"3s\"", "[dispatcher]\nlease = \"60s\""),
        h.provider.url()
    );
    let mut cfg = h.config_of(&text);
    // The hand-over's room (8 + the consumer's batch of 50) is more than
    // the claim loop's (16 + 8), and its bytes more than the claims'.
    cfg.dispatcher.claim_batch = 8;
    cfg.dispatcher.max_claimed_bytes = 1024 * 1024;
    let started = std::time::Instant::now();
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    eventually("the keyed refunds", DEADLINE, || async {
        (h.db.count("intents", "endpoint = 'psp' AND state = 'succeeded'").await == 5).then_some(())
    })
    .await;
    let took = started.elapsed();
    h.provider.release_held();
    run.stop().await.unwrap();
    assert!(took < Duration::from_secs(10), "the keyed refunds waited {took:?} behind the slow endpoint's calls");
}

#[tokio::test]
async fn a_provider_that_applied_a_call_and_replays_its_500_leaves_the_intent_uncertain_without_on_dead() {
    // A Stripe-like provider applies the capture, fails answering 500, and
    // replays that stored 500 to every retry with the key ("treat the
    // result of a 500 as indeterminate"). Before the outcome table counted
    // a 5xx as "may have applied", the spent budget ended it dead and
    // published payment.failed for a capture that had gone through.
    let h = Harness::new(1).await;
    h.provider.set_faults(vec![rule("capture:o-1", None, FaultKind::AppliedThenFail { status: 500 })]);
    h.send(&order("evt-1", "o-1")).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.endpoints.get_mut("psp").unwrap().max_attempts = 3;
    let run = h.start(cfg.clone(), Components::ALL, no_faults()).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();
    assert_eq!(ending(&h, "capture:o-1").await, ("uncertain".into(), Some(500), true));
    assert_eq!(h.provider.stats().requests_for("capture:o-1"), 3, "retried with its key");
    assert_eq!(h.provider.applied().len(), 1, "applied once, by the first request");
    assert_eq!(h.db.count("outbox", "event_type = 'payment.failed'").await, 0, "on_dead was recorded");
    let report = relay_cli::verify::verify(
        &cfg,
        &h.db.pool,
        &relay_cli::verify::VerifyOptions { effects: None, grace: Duration::from_secs(30) },
    )
    .await
    .unwrap();
    assert!(!report.violations.iter().any(|v| v.check == "dead_after_uncertain"), "{}", report.render());
}

#[tokio::test]
async fn an_operator_resolves_an_uncertain_intent_as_the_provider_says_it_ended() {
    // Review of issue 28's first increment, F3: an uncertain intent could
    // only end by succeeding; one the provider never applied (a claim lost
    // before its request went out, then 422s) stayed uncertain for ever.
    let h = Harness::new(1).await;
    h.provider.set_faults(vec![
        rule("capture:o-", Some(1), FaultKind::TimeoutBeforeApply { delay_ms: 1_500 }),
        rule("capture:o-", None, FaultKind::Status { status: 503, retry_after_secs: None }),
    ]);
    h.send_orders(2).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.endpoints.get_mut("psp").unwrap().max_attempts = 2;
    let run = h.start(cfg.clone(), Components::ALL, no_faults()).await;
    h.await_intents_finished(2).await;
    assert_eq!(h.intents_in("uncertain").await, 2);
    let relay = h.relay(cfg.clone(), relay::Handlers::default(), no_faults()).await;
    let ops = relay.operator();
    let id_of = async |key: &str| -> uuid::Uuid {
        sqlx::query_scalar("SELECT id FROM relay.intents WHERE idempotency_key = $1")
            .bind(key)
            .fetch_one(&h.db.pool)
            .await
            .unwrap()
    };
    use relay::ops::admin::IntentResolution;
    let (failed, applied) = (id_of("capture:o-0").await, id_of("capture:o-1").await);
    ops.resolve(failed, IntentResolution::Failed, Some("the provider has no capture for this key")).await.unwrap();
    ops.resolve(applied, IntentResolution::Succeeded, None).await.unwrap();
    let again = ops.resolve(failed, IntentResolution::Succeeded, None).await.unwrap_err();
    assert!(again.to_string().contains("not uncertain"), "{again}");
    h.await_published(2).await;
    run.stop().await.unwrap();
    assert_eq!(ending(&h, "capture:o-0").await.0, "dead");
    assert_eq!(ending(&h, "capture:o-1").await.0, "succeeded");
    assert_eq!(h.db.count("outbox", "event_type = 'payment.failed'").await, 1);
    assert_eq!(h.db.count("outbox", "event_type = 'payment.captured'").await, 1);
    let (_, _, _, error) = intent_state(&h, "capture:o-0").await;
    assert!(error.unwrap_or_default().contains("resolved as failed by an operator: the provider has no capture"));
    // relay verify takes an operator's resolution as the provider's word.
    let report = relay_cli::verify::verify(
        &cfg,
        &h.db.pool,
        &relay_cli::verify::VerifyOptions { effects: None, grace: Duration::from_secs(30) },
    )
    .await
    .unwrap();
    assert!(!report.violations.iter().any(|v| v.check == "dead_after_uncertain"), "{}", report.render());
}

#[tokio::test]
async fn a_resolution_cut_off_leaves_the_intent_uncertain_never_pending_to_be_called_again() {
    // Second review of issue 28, N1: a resolution taken and then cut off
    // (the CLI killed, the request timed out) left the intent running under
    // the operator's lease; the rescuer made it pending and a dispatcher with
    // budget left called the provider again.
    let db = relay_testkit::TestDb::new().await.unwrap();
    let row = new_intent(1, "psp", None);
    let mut conn = db.conn().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    relay_store::effects::insert(&mut tx, "c", std::slice::from_ref(&row), None, &[], &[]).await.unwrap();
    tx.commit().await.unwrap();
    sqlx::query("UPDATE relay.intents SET state = 'uncertain', attempts = 2, finished_at = now() WHERE id = $1")
        .bind(row.id)
        .execute(&db.pool)
        .await
        .unwrap();
    let lease = Duration::from_secs(60);
    let taken = intents::take_uncertain(&mut conn, "c", row.id, "operator@test", lease).await.unwrap().unwrap();
    assert!(intents::take_uncertain(&mut conn, "c", row.id, "operator@test", lease).await.unwrap().is_none());
    // Cut off: the operator lease runs out.
    sqlx::query("UPDATE relay.intents SET locked_until = now() - interval '1 second' WHERE id = $1")
        .bind(row.id)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(intents::rescue_expired(&mut conn, 10).await.unwrap(), vec![row.id]);
    assert_eq!(row_of(&db, row.id).await.0, "uncertain", "back to uncertain, not pending");
    let mut claimer = ClaimPool::beside(&db.pool, 1, ClaimCommit::Durable).claimer();
    let claimed = claimer.claim(async |conn| intents::claim(conn, &C_PSP, "w", 10, lease).await).await.unwrap();
    assert!(claimed.rows.is_empty(), "nothing for a dispatcher to call");
    // And a resolution that fails gives it back at once.
    let taken_again = intents::take_uncertain(&mut conn, "c", row.id, "operator@test", lease).await.unwrap().unwrap();
    assert_ne!(taken_again.lease_token, taken.lease_token);
    assert_eq!(
        intents::give_back_uncertain(&mut conn, row.id, taken_again.lease_token).await.unwrap(),
        intents::Fenced::Done
    );
    assert_eq!(row_of(&db, row.id).await.0, "uncertain");
}

/// A row whose stored JSON the dispatcher cannot read, written by hand as a
/// client that bypassed the front door could: an `on_success` nested 200
/// deep (serde_json reads at most 128 levels), due before the others.
async fn insert_unreadable_intent(h: &Harness) -> uuid::Uuid {
    sqlx::query_scalar(
        "INSERT INTO relay.intents (id, consumer, source_event_id, action, endpoint, method, path, body,
                                    idempotency_key, max_attempts, expires_at, emit_source, next_attempt_at,
                                    on_success)
         VALUES (gen_random_uuid(), $1, 'deep', 'application', 'psp', 'POST', '/captures/deep', '{}', 'deep', 5,
                 now() + interval '1 day', $1, now() - interval '1 minute',
                 jsonb_build_object('emit', jsonb_build_array(jsonb_build_object(
                     'action', 'x', 'event_type', 't', 'topic', 't', 'key', null, 'subject', null, 'ordered', false,
                     'data', (repeat('[', 200) || repeat(']', 200))::jsonb)), 'saga', '[]'::jsonb))
         RETURNING id",
    )
    .bind(&h.consumer)
    .fetch_one(&h.db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_row_whose_json_cannot_be_read_ends_dead_and_the_rest_of_its_claim_is_called() {
    // One undecodable row failed the whole claim after it had committed: the
    // claim's other rows stayed running until their lease ran out, came back
    // "may have been applied", and the same claim failed again, for ever.
    let h = Harness::new(1).await;
    let deep = insert_unreadable_intent(&h).await;
    relay_testkit::seed::pending_intents(&h.db.pool, &h.consumer, "psp", "p-", 5).await.unwrap();
    let run = h.start(h.config(&CAPTURE_ROUTE), DISPATCH, no_faults()).await;
    let healthy = "source_event_id <> 'deep'";
    eventually("the healthy intents called", DEADLINE, || async {
        let done = h.db.count("intents", &format!("{healthy} AND state = 'succeeded'")).await;
        let state: String = sqlx::query_scalar("SELECT state FROM relay.intents WHERE id = $1")
            .bind(deep)
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
        (done == 5 && state == "dead").then_some(())
    })
    .await;
    run.stop().await.unwrap();
    assert_eq!(
        h.db.count("intents", &format!("{healthy} AND state = 'succeeded' AND attempts = 1 AND NOT ever_uncertain"))
            .await,
        5,
        "each called once, on its first claim, and never taken for maybe applied"
    );
    assert_eq!(h.db.count("intent_attempts", "outcome = 'lease_expired'").await, 0, "no lease ran out");
    let (error, class, uncertain): (Option<String>, Option<String>, bool) =
        sqlx::query_as("SELECT last_error, last_error_class, ever_uncertain FROM relay.intents WHERE id = $1")
            .bind(deep)
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
    let error = error.unwrap_or_default();
    assert!(
        error.contains(&deep.to_string()) && error.contains("on_success") && error.contains("recursion"),
        "{error}"
    );
    assert_eq!((class.as_deref(), uncertain), (Some("request"), false));
    let stats = h.provider.stats();
    assert_eq!((stats.requests, stats.requests_for("deep")), (5, 0), "the unreadable one was never sent");
}

#[tokio::test]
async fn an_uncertain_row_whose_json_cannot_be_read_is_left_uncertain_and_the_others_are_reconciled() {
    // The reconciler's take and an operator's take read the same columns as
    // a claim: one unreadable row must neither fail the others' take nor
    // stay running until its lease runs out.
    let db = relay_testkit::TestDb::new().await.unwrap();
    let rows = [new_intent(1, "psp", None), new_intent(2, "psp", None), new_intent(3, "psp", None)];
    let mut conn = db.conn().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    relay_store::effects::insert(&mut tx, "c", &rows, None, &[], &[]).await.unwrap();
    tx.commit().await.unwrap();
    sqlx::query(
        "UPDATE relay.intents SET state = 'uncertain', attempts = 1, ever_uncertain = true,
                finished_at = now() - interval '1 minute'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let deep = "(repeat('[', 200) || repeat(']', 200))::jsonb";
    sqlx::query(&format!("UPDATE relay.intents SET body = {deep} WHERE id = ANY($1)"))
        .bind(vec![rows[0].id, rows[2].id])
        .execute(&db.pool)
        .await
        .unwrap();
    let lease = Duration::from_secs(60);
    let taken = relay_store::reconciliations::take_due(&mut conn, "c", "psp", Duration::ZERO, 3, 10, "w", lease)
        .await
        .expect("the readable row is taken");
    assert_eq!(taken.iter().map(|t| t.id).collect::<Vec<_>>(), vec![rows[1].id]);
    for unreadable in [rows[0].id, rows[2].id] {
        let (state, reconciles, error): (String, i32, Option<String>) = sqlx::query_as(
            "SELECT i.state, i.reconciles, r.error FROM relay.intents i
               LEFT JOIN relay.intent_reconciliations r ON r.intent_id = i.id WHERE i.id = $1",
        )
        .bind(unreadable)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!((state.as_str(), reconciles), ("uncertain", 3), "left to an operator, asked no more");
        let error = error.unwrap_or_default();
        assert!(error.contains(&unreadable.to_string()) && error.contains("body"), "{error}");
    }
    let again =
        relay_store::reconciliations::take_due(&mut conn, "c", "psp", Duration::ZERO, 3, 10, "w", lease).await.unwrap();
    assert!(again.is_empty(), "not taken again: {:?}", again.iter().map(|t| t.id).collect::<Vec<_>>());

    // An operator's take says why, and leaves it uncertain at once.
    let err = intents::take_uncertain(&mut conn, "c", rows[0].id, "operator@test", lease).await.unwrap_err();
    assert!(err.to_string().contains("body"), "{err}");
    assert_eq!(row_of(&db, rows[0].id).await.0, "uncertain", "not left running under the operator's lease");
}

// An uncertain intent resolved as failed by an operator was sent; on a
// hold_key route it holds its key like any dead one, whatever its attempt
// count. With one attempt it was taken for one that died never sent, and
// released the key: the key's later calls went without the operator's skip.
#[tokio::test]
async fn an_uncertain_intent_resolved_failed_after_one_attempt_keeps_holding_its_key() {
    use relay::ops::admin::IntentResolution;
    let h = Harness::new(1).await;
    relay_testkit::seed::pending_intents(&h.db.pool, &h.consumer, "psp", "r-", 1).await.unwrap();
    sqlx::query(
        "UPDATE relay.intents SET state = 'uncertain', ever_uncertain = true, attempts = 1, finished_at = now(),
                ordering_key = 'k', holds_key = true",
    )
    .execute(&h.db.pool)
    .await
    .unwrap();
    let id: uuid::Uuid = sqlx::query_scalar("SELECT id FROM relay.intents").fetch_one(&h.db.pool).await.unwrap();
    let relay = h.relay(h.config(&CAPTURE_ROUTE), relay::Handlers::default(), no_faults()).await;
    relay.operator().resolve(id, IntentResolution::Failed, Some("the provider has no capture")).await.unwrap();
    let (state, holds): (String, bool) = sqlx::query_as("SELECT state, holds_key FROM relay.intents WHERE id = $1")
        .bind(id)
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    assert_eq!((state.as_str(), holds), ("dead", true), "resolved failed after one attempt, it let its key go");
}

// An uncertain intent whose key the provider has forgotten is never sent
// again (sent, it would be a new request): "replay --past-key-window" said
// it was queued, then the claim found the key forgotten and left it
// uncertain again without a request. It is refused, pointing to resolve.
#[tokio::test]
async fn an_uncertain_intent_past_its_key_window_is_not_replayed_even_past_the_window() {
    use relay::ops::admin::KeyWindow;
    let h = Harness::new(1).await;
    relay_testkit::seed::pending_intents(&h.db.pool, &h.consumer, "psp", "w-", 1).await.unwrap();
    sqlx::query(
        "UPDATE relay.intents SET state = 'uncertain', ever_uncertain = true, attempts = 1, finished_at = now(),
                created_at = now() - interval '2 days'",
    )
    .execute(&h.db.pool)
    .await
    .unwrap();
    let id: uuid::Uuid = sqlx::query_scalar("SELECT id FROM relay.intents").fetch_one(&h.db.pool).await.unwrap();
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.endpoints.get_mut("psp").unwrap().profile = Some(relay_core::profile::ProfileName::Stripe);
    let relay = h.relay(cfg, relay::Handlers::default(), no_faults()).await;
    let err = relay.operator().requeue(id, KeyWindow::PastAllowed).await.unwrap_err().to_string();
    assert!(err.contains("key window has closed") && err.contains("relay intents resolve"), "{err}");
    assert_eq!(h.db.count("intents", "state = 'uncertain'").await, 1);
}
