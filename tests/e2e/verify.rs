//! `relay verify` catches what it exists to catch: a clean run passes, and
//! each planted bug (a guard disabled on purpose) or damaged state is reported
//! with the ids involved.

use std::time::Duration;

use crate::support::*;
use example_provider::{FaultKind, FaultRule};
use relay::runtime::faults::{Sabotage, Sabotaged, point};
use relay::{Components, FaultAction, Faults};
use relay_cli::verify::{Report, VerifyOptions, verify};
use relay_core::RelayConfig;

async fn check(h: &Harness, cfg: &RelayConfig) -> Report {
    let report =
        verify(cfg, &h.db.pool, &VerifyOptions { effects: Some(h.provider_effects()), grace: Duration::from_secs(30) })
            .await
            .expect("verify runs");
    println!("{}", report.render());
    report
}

fn checks(r: &Report) -> Vec<&'static str> {
    r.violations.iter().map(|v| v.check).collect()
}

#[tokio::test]
async fn a_clean_run_with_duplicates_and_poison_passes_every_check() {
    let h = Harness::new(2).await;
    h.send_orders(30).await;
    h.send_orders(5).await; // duplicates
    h.producer.raw(&h.topic, Some(0), None, &[("ce_specversion".into(), b"1.0".to_vec())], Some(b"{")).await.unwrap();
    let cfg = h.config(&CAPTURE_ROUTE);
    let run = h.start(cfg.clone(), Components::ALL, no_faults()).await;
    h.await_intents_finished(30).await;
    h.await_published(31).await; // 30 outcome events + 1 dead-letter copy
    eventually("all offsets committed", DEADLINE, || async {
        let total = h.committed_total().await;
        (total == 36).then_some(())
    })
    .await;
    run.stop().await.unwrap();

    let r = check(&h, &cfg).await;
    assert!(r.ok(), "{}", r.render());
    assert_eq!((r.input_records, r.unique_events, r.duplicate_deliveries, r.poison_records), (36, 30, 5, 1));
    assert_eq!(r.provider_effects, Some(30));
    assert_eq!(r.published_rows, 31);
}

#[tokio::test]
async fn committing_the_offset_before_the_database_loses_an_event_and_the_checker_names_it() {
    let h = Harness::new(1).await;
    h.send_orders(3).await;
    let cfg = h.config(&CAPTURE_ROUTE);
    // Planted bug: offset first, then the crash before the DB commit.
    let broken = Faults::new(&[(point::CONSUMER_BEFORE_DB_COMMIT, FaultAction::Fail, 1)])
        .with_sabotage(Sabotaged::of(&[Sabotage::OffsetBeforeCommit]));
    let crashed =
        h.start(cfg.clone(), Components { consumer: true, dispatcher: false, publisher: false }, broken).await;
    assert!(crashed.finished().await.is_err());
    for i in 3..6 {
        h.send(&order(&format!("evt-{i}"), &format!("o-{i}"))).await;
    }
    let run = h.start(cfg.clone(), Components::ALL, no_faults()).await;
    h.await_committed(0, 6).await;
    h.await_intents_finished(3).await;
    run.stop().await.unwrap();

    let r = check(&h, &cfg).await;
    assert_eq!(checks(&r), vec!["lost"], "{}", r.render());
    assert_eq!(r.violations[0].ids.len(), 3, "the first batch was lost: {:?}", r.violations[0].ids);
    assert!(r.violations[0].ids.iter().any(|id| id.starts_with("evt-0 ")), "{:?}", r.violations[0].ids);
}

const COUNTED_ROUTE: &str = r#"
[[routes]]
topic = "{topic}"
type = "order.placed"
counter = "orders"

[[routes.actions]]
kind = "emit"
name = "seen"
type = "order.seen"
topic = "{out}"
"#;

#[tokio::test]
async fn applying_duplicates_again_is_caught_by_the_business_counter_check() {
    let h = Harness::new(1).await;
    for i in 0..5 {
        h.send(&order(&format!("evt-{i}"), &format!("o-{i}"))).await;
        h.send(&order(&format!("evt-{i}"), &format!("o-{i}"))).await;
    }
    let cfg = h.config(COUNTED_ROUTE);
    // Planted bug: the inbox's "already recorded" is ignored.
    let broken = no_faults().with_sabotage(Sabotaged::of(&[Sabotage::NoInboxDedup]));
    let run = h.start(cfg.clone(), Components::ALL, broken).await;
    h.await_committed(0, 10).await;
    h.await_published(5).await;
    run.stop().await.unwrap();

    let r = check(&h, &cfg).await;
    assert_eq!(checks(&r), vec!["counter_mismatch"], "{}", r.render());
    assert!(r.violations[0].message.contains("is 10 but 5"), "{}", r.violations[0].message);
}

#[tokio::test]
async fn a_new_idempotency_key_per_attempt_double_applies_and_the_checker_names_the_intent() {
    let h = Harness::new(1).await;
    // Every first request times out after being applied: the retry is where keys matter.
    h.provider.set_faults(vec![FaultRule {
        path_prefix: None,
        key_prefix: None,
        times: Some(1),
        kind: FaultKind::TimeoutAfterApply { delay_ms: 1500 },
    }]);
    h.send(&order("evt-1", "o-1")).await;
    let cfg = h.config(&CAPTURE_ROUTE);
    let broken = no_faults().with_sabotage(Sabotaged::of(&[Sabotage::FreshIdempotencyKey]));
    let run = h.start(cfg.clone(), Components::ALL, broken).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();

    let r = check(&h, &cfg).await;
    assert_eq!(checks(&r), vec!["intent_applied_twice"], "{}", r.render());
    let intent: String = sqlx::query_scalar("SELECT id::text FROM relay.intents").fetch_one(&h.db.pool).await.unwrap();
    let v = r.violations.iter().find(|v| v.check == "intent_applied_twice").unwrap();
    assert!(v.ids[0].starts_with(&intent), "{:?}", v.ids);
}

#[tokio::test]
async fn damaged_state_is_reported_check_by_check() {
    let h = Harness::new(1).await;
    h.send_orders(4).await;
    h.producer.raw(&h.topic, None, None, &[("ce_specversion".into(), b"1.0".to_vec())], Some(b"{")).await.unwrap();
    let cfg = h.config(&CAPTURE_ROUTE);
    let run = h.start(cfg.clone(), Components::ALL, no_faults()).await;
    h.await_intents_finished(4).await;
    h.await_published(5).await;
    h.await_committed(0, 5).await;
    run.stop().await.unwrap();
    assert!(check(&h, &cfg).await.ok());

    let pool = &h.db.pool;
    let exec = |sql: &'static str| async move { sqlx::query(sql).execute(pool).await.unwrap() };
    exec("DELETE FROM relay.dead_letters").await;
    exec("DELETE FROM relay.intents WHERE idempotency_key = 'capture:o-1'").await;
    exec("UPDATE relay.counters SET value = value + 1").await;
    exec(
        "INSERT INTO relay.outbox (id, consumer, source_id, action, topic, state, published_at)
          SELECT gen_random_uuid(), consumer, 'x', 'x', topic, 'published', now() FROM relay.outbox LIMIT 1",
    )
    .await;
    exec("UPDATE relay.intents SET state = 'running', lease_token = gen_random_uuid(), locked_until = now() - interval '1 hour'
           WHERE idempotency_key = 'capture:o-2'")
        .await;
    // An outbox row that keeps failing: its retry is always ahead, so it is never "stuck".
    exec(
        "INSERT INTO relay.outbox (id, consumer, source_id, action, topic, attempts, next_attempt_at, last_error)
          SELECT gen_random_uuid(), consumer, 'y', 'y', topic, 12, now() + interval '1 minute', 'Broker: Leader not available'
            FROM relay.outbox LIMIT 1",
    )
    .await;
    // One the broker can never take.
    exec(
        "INSERT INTO relay.outbox (id, consumer, source_id, action, topic, state, last_error)
          SELECT gen_random_uuid(), consumer, 'z', 'z', topic, 'dead', 'permanent: Message size too large'
            FROM relay.outbox LIMIT 1",
    )
    .await;
    let mut r = check(&h, &cfg).await;
    let mut found = checks(&r);
    found.sort();
    assert_eq!(
        found,
        vec![
            "counter_mismatch",
            "dead_outbox",
            "failing",
            "missing_intent",
            "poison_not_parked",
            "published_not_on_topic",
            "stuck_intent",
        ],
        "{}",
        r.render()
    );
    r.violations.retain(|v| v.check == "missing_intent");
    assert_eq!(r.violations[0].ids, vec!["evt-1/capture".to_string()]);
}

#[tokio::test]
async fn an_intent_that_ended_dead_after_an_attempt_that_may_have_been_applied_is_reported() {
    // Issue 28 D1: a timeout after sending, then 503s until the budget ends.
    // Planted bug: only the last attempt decides, so the intent ends dead and
    // payment.failed is emitted for a capture that may have gone through.
    let h = Harness::new(1).await;
    let key_rule = |times, kind| FaultRule { path_prefix: None, key_prefix: Some("capture:o-1".into()), times, kind };
    h.provider.set_faults(vec![
        key_rule(Some(1), FaultKind::TimeoutBeforeApply { delay_ms: 1500 }),
        key_rule(None, FaultKind::Status { status: 429, retry_after_secs: None }),
    ]);
    h.send(&order("evt-1", "o-1")).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.endpoints.get_mut("psp").unwrap().max_attempts = 2;
    let broken = no_faults().with_sabotage(Sabotaged::of(&[Sabotage::UncertaintyForgotten]));
    let run = h.start(cfg.clone(), Components::ALL, broken).await;
    h.await_intents_finished(1).await;
    h.await_published(1).await;
    run.stop().await.unwrap();

    let r = check(&h, &cfg).await;
    assert_eq!(checks(&r), vec!["dead_after_uncertain"], "{}", r.render());
    assert!(r.violations[0].ids[0].contains("(capture:o-1): attempt 1 was uncertain"), "{:?}", r.violations[0].ids);
}

#[tokio::test]
async fn an_intent_that_ended_dead_after_a_5xx_is_reported_whatever_its_attempts_were_recorded_as() {
    // A provider that applied the capture and replays its stored 500.
    // Planted bug: the 5xx is read as "not applied" (as before the outcome
    // table), so the attempts are recorded retryable and the spent budget
    // ends dead with payment.failed. The check reads the statuses too.
    let h = Harness::new(1).await;
    let key_rule = |times, kind| FaultRule { path_prefix: None, key_prefix: Some("capture:o-1".into()), times, kind };
    h.provider.set_faults(vec![key_rule(None, FaultKind::AppliedThenFail { status: 500 })]);
    h.send(&order("evt-1", "o-1")).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.endpoints.get_mut("psp").unwrap().max_attempts = 2;
    let broken = no_faults().with_sabotage(Sabotaged::of(&[Sabotage::ServerErrorsCertain]));
    let run = h.start(cfg.clone(), Components::ALL, broken).await;
    h.await_intents_finished(1).await;
    h.await_published(1).await;
    run.stop().await.unwrap();

    let r = check(&h, &cfg).await;
    assert_eq!(checks(&r), vec!["dead_after_uncertain"], "{}", r.render());
    assert!(
        r.violations[0].ids[0].contains("(capture:o-1): attempt 1 was retryable (HTTP 500)"),
        "{:?}",
        r.violations[0].ids
    );
}

#[tokio::test]
async fn an_intent_a_reconciliation_found_not_applied_may_end_dead_without_a_report() {
    // Issue 29 part 2: a timeout after sending (uncertain), then the
    // provider's status API says it was not applied: the doubt is settled,
    // the call is sent again, refused for good, and ends dead with
    // payment.failed. That is the provider's word, not a guess.
    let h = Harness::new(1).await;
    let rule = |times, kind| FaultRule { path_prefix: Some("/captures/o-1".into()), key_prefix: None, times, kind };
    h.provider.set_faults(vec![
        rule(Some(1), FaultKind::TimeoutBeforeApply { delay_ms: 1500 }),
        rule(None, FaultKind::Status { status: 400, retry_after_secs: None }),
    ]);
    h.send(&order("evt-1", "o-1")).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.endpoints.get_mut("psp").unwrap().reconcile = Some(
        serde_json::from_value(serde_json::json!({
            "path": "/lookup/{{ intent_id }}", "after": "100ms", "interval": "100ms", "not_applied": [{"status": 404}],
        }))
        .unwrap(),
    );
    let run = h.start(cfg.clone(), Components::ALL, no_faults()).await;
    eventually("the intent dead after its reconciliation", DEADLINE, || async {
        (h.db.count("intents", "state = 'dead'").await == 1).then_some(())
    })
    .await;
    h.await_published(1).await;
    run.stop().await.unwrap();
    assert_eq!(h.db.count("intent_reconciliations", "verdict = 'not_applied'").await, 1);
    let r = check(&h, &cfg).await;
    assert!(!checks(&r).contains(&"dead_after_uncertain"), "{}", r.render());
}
