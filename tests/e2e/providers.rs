//! Provider profiles (issue 29, part 1) end to end: `relay run` against
//! providers that answer as the IETF `Idempotency-Key` draft and as Stripe
//! do, and one without keys; a key the provider would refuse refused at
//! ingest; the key window checked by `relay check-config`, at start, and at
//! a replay.

use crate::support::ops::*;
use crate::support::*;
use example_provider::{Dialect, FaultKind, FaultRule, Settings};
use relay::Components;
use serde_json::json;

fn settings(dialect: Dialect) -> Settings {
    Settings { dialect, ..Settings::default() }
}

/// The base configuration and `routes`, with `lines` added to endpoint psp.
fn config_with(h: &Harness, routes: &str, lines: &str) -> String {
    let text = h.config_text(routes).replace("max_attempts = 5\n", "max_attempts = 20\n");
    text.replace("[endpoints.psp]\n", &format!("[endpoints.psp]\n{lines}\n"))
}

fn fault(key: &str, times: Option<u32>, kind: FaultKind) -> FaultRule {
    FaultRule { path_prefix: None, key_prefix: Some(key.into()), times, kind }
}

/// An order event whose amount differs from [`order`]'s: the same key
/// (`capture:ORDER`), another body.
fn order_for(id: &str, order: &str, amount: u32) -> TestEvent {
    TestEvent::new(id, "order.placed", json!({"order_id": order, "amount": amount})).key(order)
}

async fn intent_row(h: &Harness, source_event: &str) -> (String, i32, Option<String>, Option<String>) {
    sqlx::query_as("SELECT state, attempts, last_error_class, last_error FROM relay.intents WHERE source_event_id = $1")
        .bind(source_event)
        .fetch_one(&h.db.pool)
        .await
        .unwrap()
}

/// What a provider speaking `dialect` does with relay's calls under
/// `profile`: an answer "in progress" after a timeout is retried to a
/// success (not an unknown outcome: without the profile, the 409 would end
/// the intent uncertain), a key reused with another body ends dead at
/// once with the alert metric, and an ordinary 400 is an ordinary failure.
async fn a_provider_s_answers_about_keys_are_read_as_its_profile_says(dialect: Dialect, profile: &str) {
    let h = Harness::with_provider(1, settings(dialect)).await;
    h.provider.set_faults(vec![
        // Applied, answered after the 1 s timeout: the retries meet "in progress".
        fault("capture:o-2", Some(1), FaultKind::StillRunningAfterApply { delay_ms: 1400 }),
        fault("capture:o-4", None, FaultKind::Status { status: 400, retry_after_secs: None }),
    ]);
    h.send(&order("evt-1", "o-1")).await;
    h.send(&order("evt-2", "o-2")).await;
    h.send(&order_for("evt-3a", "o-3", 100)).await;
    h.send(&order_for("evt-3b", "o-3", 999)).await;
    h.send(&order("evt-4", "o-4")).await;
    let text = config_with(&h, &CAPTURE_ROUTE, &format!("profile = \"{profile}\"\nmax_age = \"1h\""));
    let ((mut p, admin), _) = run_with_admin_config(&h, &text).await;
    h.await_intents_finished(5).await;

    assert_eq!(intent_row(&h, "evt-1").await.0, "succeeded");
    let (state, attempts, ..) = intent_row(&h, "evt-2").await;
    assert_eq!(state, "succeeded", "{dialect:?}: the 409 'in progress' was retried until the stored answer came");
    assert!(attempts >= 2, "{attempts}");
    let seen: Vec<(i32, Option<i32>, String)> = sqlx::query_as(
        "SELECT a.attempt, a.status, a.outcome FROM relay.intent_attempts a
           JOIN relay.intents i ON i.id = a.intent_id WHERE i.source_event_id = 'evt-2' ORDER BY a.attempt",
    )
    .fetch_all(&h.db.pool)
    .await
    .unwrap();
    // "In progress" says a request with the key reached the provider: it
    // may have been applied, so it is recorded uncertain (and retried).
    let in_progress = seen.iter().filter(|(_, status, outcome)| *status == Some(409) && outcome == "uncertain");
    assert!(
        in_progress.count() >= 1,
        "{dialect:?}: a 409 while the first request ran, recorded as uncertain: {seen:?}"
    );
    assert_eq!(h.provider.stats().applied_for("capture:o-2"), 1);

    // One of the two calls sharing a key was applied; the other is dead
    // after one attempt, class key_mismatch, and never sent again.
    let (a, b) = (intent_row(&h, "evt-3a").await, intent_row(&h, "evt-3b").await);
    let (won, lost) = if a.0 == "succeeded" { (a, b) } else { (b, a) };
    assert_eq!(won.0, "succeeded");
    assert_eq!((lost.0.as_str(), lost.1, lost.2.as_deref()), ("dead", 1, Some("key_mismatch")), "{lost:?}");
    assert!(lost.3.as_deref().unwrap_or("").contains("already used with a different request"), "{lost:?}");
    assert_eq!(h.provider.stats().applied_for("capture:o-3"), 1);
    assert_eq!(h.provider.stats().requests_for("capture:o-3"), 2, "the mismatch was not retried");

    let (state, attempts, class, _) = intent_row(&h, "evt-4").await;
    assert_eq!((state.as_str(), attempts, class.as_deref()), ("dead", 1, Some("http_status")), "an ordinary 400");

    h.await_published(2 + 3).await; // captured ×3, failed ×2
    let (_, metrics) = admin.get("/metrics", None).await;
    assert_eq!(metric(&metrics, "relay_call_key_mismatches_total", &[("endpoint", "psp")]), Some(1.0), "{metrics}");
    p.terminate(DEADLINE).unwrap();
    assert!(h.provider.stats().double_applied().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_ietf_provider_s_409_is_in_progress_and_its_422_a_key_reused_with_another_body() {
    a_provider_s_answers_about_keys_are_read_as_its_profile_says(Dialect::Ietf, "ietf").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stripe_provider_s_409_is_in_progress_and_its_idempotency_error_a_key_reused_with_other_parameters() {
    a_provider_s_answers_about_keys_are_read_as_its_profile_says(Dialect::Stripe, "stripe").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn without_keys_a_call_whose_outcome_is_unknown_is_never_sent_again() {
    let h = Harness::with_provider(1, settings(Dialect::Keyless)).await;
    h.provider.set_faults(vec![
        FaultRule {
            path_prefix: Some("/captures/o-1".into()),
            key_prefix: None,
            times: None,
            kind: FaultKind::TimeoutAfterApply { delay_ms: 1500 },
        },
        // A gateway's 502: the request may have been passed on.
        FaultRule {
            path_prefix: Some("/captures/o-3".into()),
            key_prefix: None,
            times: None,
            kind: FaultKind::Status { status: 502, retry_after_secs: None },
        },
    ]);
    h.send(&order("evt-1", "o-1")).await;
    h.send(&order("evt-2", "o-2")).await;
    h.send(&order("evt-3", "o-3")).await;
    let config = h.write_config(&config_with(&h, &CAPTURE_ROUTE, "profile = \"none\""));
    let mut p = h.process(&config, &["run"], &[]);
    h.await_intents_finished(3).await;
    let (state, attempts, _, error) = intent_row(&h, "evt-1").await;
    assert_eq!((state.as_str(), attempts), ("uncertain", 1), "{error:?}");
    assert!(error.unwrap_or_default().contains("profile none"));
    assert_eq!(intent_row(&h, "evt-2").await.0, "succeeded");
    let (state, attempts, ..) = intent_row(&h, "evt-3").await;
    assert_eq!((state.as_str(), attempts), ("uncertain", 1), "a 502 without keys is not re-sent");
    let stats = h.provider.stats();
    assert_eq!((stats.requests, stats.applied, stats.missing_key), (3, 2, 0), "one request each, none re-sent");
    // Neither on_success nor on_dead for the unknown one.
    h.await_published(1).await;
    assert_eq!(h.db.count("outbox", "event_type = 'payment.failed'").await, 0);
    // Nor does an operator's replay send it blindly: it says what to do instead.
    let id: uuid::Uuid = sqlx::query_scalar("SELECT id FROM relay.intents WHERE source_event_id = 'evt-1'")
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    let (ok, out) = cli(&h, &config, &["intents", "replay", &id.to_string()]).await;
    assert!(!ok && out.contains("keeps no idempotency keys") && out.contains("relay intents resolve"), "{out}");
    assert_eq!(intent_row(&h, "evt-1").await.0, "uncertain");
    p.terminate(DEADLINE).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_longer_than_the_provider_accepts_is_dead_lettered_at_ingest_naming_both_lengths() {
    let h = Harness::new(1).await;
    let long = "o".repeat(60); // "capture:" + 60 = 68 characters; Adyen takes 64.
    h.send(&order("evt-1", &long)).await;
    h.send(&order("evt-2", "o-2")).await;
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.endpoints.get_mut("psp").unwrap().profile = Some(relay_core::profile::ProfileName::Adyen);
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    h.await_intents_finished(1).await;
    let reason = eventually("the event dead-lettered", DEADLINE, || async {
        sqlx::query_scalar::<_, String>("SELECT reason FROM relay.dead_letters WHERE event_id = 'evt-1'")
            .fetch_optional(&h.db.pool)
            .await
            .unwrap()
    })
    .await;
    assert!(reason.contains("68 characters") && reason.contains("at most 64"), "{reason}");
    run.stop().await.unwrap();
    assert_eq!(h.provider.stats().requests, 1, "only o-2 was called");
}

/// Capture without on_dead effects (a dead one may be replayed).
fn capture_only() -> String {
    [routes::order_placed(""), routes::capture(&routes::order_body())].concat()
}

#[tokio::test(flavor = "multi_thread")]
async fn check_config_and_the_start_refuse_a_key_window_shorter_than_the_retry_horizon() {
    let h = Harness::new(1).await;
    // Stripe keeps keys 24 h; the default max_age (24 h) + replay_window (1 h) is longer.
    let short = h.write_config(&config_with(&h, &capture_only(), "profile = \"stripe\""));
    let (ok, out) = cli(&h, &short, &["check-config"]).await;
    assert!(!ok, "{out}");
    for part in ["endpoints.psp", "for 1day (profile stripe)", "1day 1h (max_age 1day + replay_window 1h)"] {
        assert!(out.contains(part), "{part:?} in {out}");
    }
    let (ok, out) = cli(&h, &short, &["run"]).await;
    assert!(!ok && out.contains("endpoints.psp: the provider remembers an idempotency key for 1day"), "{out}");

    let warned =
        h.write_config(&config_with(&h, &capture_only(), "profile = \"stripe\"\non_short_key_window = \"warn\""));
    let (ok, out) = cli(&h, &warned, &["check-config"]).await;
    assert!(ok, "{out}");
    assert!(out.contains("key window 1day is SHORTER than the retry horizon 1day 1h"), "{out}");
    assert!(out.contains("warning: endpoints.psp: the provider remembers"), "{out}");

    let fits = h.write_config(&config_with(&h, &capture_only(), "profile = \"stripe\"\nmax_age = \"20h\""));
    let (ok, out) = cli(&h, &fits, &["check-config"]).await;
    assert!(ok && out.contains("profile stripe, key in header Idempotency-Key; key window 1day covers"), "{out}");
    let unknown = h.write_config(&config_with(&h, &capture_only(), "profile = \"ietf\""));
    let (ok, out) = cli(&h, &unknown, &["check-config"]).await;
    assert!(ok && out.contains("key window unknown"), "{out}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replay_whose_attempts_could_outlive_the_key_window_asks_for_past_key_window() {
    let h = Harness::new(1).await;
    h.provider.set_faults(vec![fault("capture:o-1", None, FaultKind::Status { status: 400, retry_after_secs: None })]);
    h.send(&order("evt-1", "o-1")).await;
    let lines = "profile = \"ietf\"\nidempotency = { window = \"3h\" }\nmax_age = \"1h\"\nreplay_window = \"1h\"";
    let config = h.write_config(&config_with(&h, &capture_only(), lines));
    let mut p = h.process(&config, &["run"], &[]);
    h.await_intents_finished(1).await;
    let id: uuid::Uuid = sqlx::query_scalar("SELECT id FROM relay.intents").fetch_one(&h.db.pool).await.unwrap();
    // Inside the window a replay needs no flag (it is sent again, and refused again).
    let (ok, out) = cli(&h, &config, &["intents", "replay", &id.to_string()]).await;
    assert!(ok, "{out}");
    eventually("the replayed intent sent and dead again", DEADLINE, || async {
        (h.provider.stats().requests_for("capture:o-1") == 2 && h.db.count("intents", "state = 'dead'").await == 1)
            .then_some(())
    })
    .await;
    // Written 150 minutes ago: the provider forgets the key 30 minutes from
    // now, and a replay's attempts would run for an hour.
    sqlx::query(
        "UPDATE relay.intents SET created_at = created_at - interval '150 minutes',
                                  expires_at = expires_at - interval '150 minutes'",
    )
    .execute(&h.db.pool)
    .await
    .unwrap();
    h.provider.set_faults(vec![]);
    let (ok, out) = cli(&h, &config, &["intents", "replay", &id.to_string()]).await;
    assert!(!ok, "{out}");
    assert!(out.contains("remembers a key for 3h") && out.contains("--past-key-window"), "{out}");
    assert_eq!(intent_row(&h, "evt-1").await.0, "dead", "left as it was");
    assert_eq!(h.provider.stats().requests_for("capture:o-1"), 2);

    let (ok, out) = cli(&h, &config, &["intents", "replay", &id.to_string(), "--past-key-window"]).await;
    assert!(ok, "{out}");
    eventually("the replayed intent to succeed", DEADLINE, || async {
        (intent_row(&h, "evt-1").await.0 == "succeeded").then_some(())
    })
    .await;
    assert_eq!(h.provider.stats().applied_for("capture:o-1"), 1);
    p.terminate(DEADLINE).unwrap();
}

/// Reconcile with a lookup at the example provider's status API.
const LOOKUP: &str = r#"[endpoints.psp.reconcile]
path = "/lookup/{{ intent_id }}"
after = "200ms"
interval = "200ms"
max_attempts = 3
succeeded = [{ status = 200, pointer = "/state", equals = "applied" }]
not_applied = [{ status = 404 }]
"#;

fn path_fault(prefix: &str, times: Option<u32>, kind: FaultKind) -> FaultRule {
    FaultRule { path_prefix: Some(prefix.into()), key_prefix: None, times, kind }
}

async fn reconciliations(h: &Harness, source_event: &str) -> Vec<(i32, String, Option<i32>)> {
    sqlx::query_as(
        "SELECT r.n, r.verdict, r.status FROM relay.intent_reconciliations r
           JOIN relay.intents i ON i.id = r.intent_id WHERE i.source_event_id = $1 ORDER BY r.n",
    )
    .bind(source_event)
    .fetch_all(&h.db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn uncertain_calls_to_a_provider_without_keys_are_reconciled_by_a_lookup_and_settled_once() {
    let h = Harness::with_provider(1, settings(Dialect::Keyless)).await;
    h.provider.set_faults(vec![
        // Applied, answered after relay's 1 s timeout.
        path_fault("/captures/o-1", None, FaultKind::TimeoutAfterApply { delay_ms: 1500 }),
        // Not applied, answered (503) after the timeout: relay cannot know.
        path_fault("/captures/o-2", Some(1), FaultKind::TimeoutBeforeApply { delay_ms: 1500 }),
    ]);
    h.send(&order("evt-1", "o-1")).await;
    h.send(&order("evt-2", "o-2")).await;
    let text = format!("{}\n{LOOKUP}", config_with(&h, &capture_with_answer(), "profile = \"none\""));
    let ((mut p, admin), config) = run_with_admin_config(&h, &text).await;
    eventually("both intents settled", DEADLINE, || async {
        let done = h.db.count("intents", "state = 'succeeded'").await == 2;
        done.then_some(())
    })
    .await;
    // o-1: one request, applied; the lookup found it; on_success recorded once.
    assert_eq!(reconciliations(&h, "evt-1").await, [(1, "succeeded".to_owned(), Some(200))]);
    let (_, attempts, _, last) = intent_row(&h, "evt-1").await;
    assert_eq!(attempts, 1);
    assert!(last.unwrap_or_default().contains("reconciled by a lookup: the provider applied it"));
    // o-2: not applied, so sent again (once) and applied.
    assert_eq!(reconciliations(&h, "evt-2").await, [(1, "not_applied".to_owned(), Some(404))]);
    assert_eq!(intent_row(&h, "evt-2").await.1, 2, "sent again after the provider said it had not applied it");
    let stats = h.provider.stats();
    assert_eq!((stats.requests, stats.applied), (3, 2), "{stats:?}");
    assert!(stats.double_applied().is_empty());
    h.await_published(2).await;
    assert_eq!(h.db.count("outbox", "event_type = 'payment.captured'").await, 2);
    // The success event carries what the lookup answered, the other one the call's answer.
    let (data, _) = emitted(&h, "evt-1", "payment.captured").await.unwrap();
    assert!(data["payment_id"].as_str().is_some_and(|id| id.starts_with("res_")), "{data}");
    assert_eq!((data["via"].as_str(), data["status"].as_u64()), (Some("lookup"), Some(200)), "{data}");
    assert_eq!(emitted(&h, "evt-2", "payment.captured").await.unwrap().0["via"], "call");
    let (_, metrics) = admin.get("/metrics", None).await;
    for verdict in ["succeeded", "not_applied"] {
        let m = metric(&metrics, "relay_reconciliations_total", &[("endpoint", "psp"), ("verdict", verdict)]);
        assert_eq!(m, Some(1.0), "{verdict}: {metrics}");
    }
    // The history says so, in `relay intents show`.
    let id: uuid::Uuid = sqlx::query_scalar("SELECT id FROM relay.intents WHERE source_event_id = 'evt-1'")
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    let (ok, out) = cli(&h, &config, &["intents", "show", &id.to_string()]).await;
    assert!(ok && out.contains("reconciliations") && out.contains("#1   succeeded      200"), "{out}");
    p.terminate(DEADLINE).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn an_intent_whose_provider_cannot_say_stays_uncertain_once_its_reconciliations_are_spent() {
    let h = Harness::with_provider(1, settings(Dialect::Keyless)).await;
    h.provider.set_faults(vec![
        path_fault("/captures/", None, FaultKind::TimeoutAfterApply { delay_ms: 1500 }),
        path_fault("/lookup/", None, FaultKind::Status { status: 503, retry_after_secs: None }),
    ]);
    h.send(&order("evt-1", "o-1")).await;
    let text = format!("{}\n{LOOKUP}", config_with(&h, &CAPTURE_ROUTE, "profile = \"none\""));
    let cfg = h.config_of(&text);
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    let spent = eventually("three reconciliations", DEADLINE, || async {
        let r = reconciliations(&h, "evt-1").await;
        (r.len() == 3 && h.db.count("intents", "state = 'uncertain'").await == 1).then_some(r)
    })
    .await;
    assert!(spent.iter().all(|(_, v, s)| v == "unknown" && *s == Some(503)), "{spent:?}");
    // Spent: no reconciler takes it again, however long it waits.
    let mut conn = h.db.pool.acquire().await.unwrap();
    let again = relay_store::reconciliations::take_due(
        &mut conn,
        &h.consumer,
        "psp",
        std::time::Duration::ZERO,
        3,
        10,
        "test",
        std::time::Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert!(again.is_empty());
    run.stop().await.unwrap();
    assert_eq!(h.provider.stats().requests, 1, "never sent again");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stripe_call_left_uncertain_is_reconciled_by_sending_it_again_with_its_key() {
    let h = Harness::with_provider(1, settings(Dialect::Stripe)).await;
    h.provider.set_faults(vec![fault("capture:o-1", Some(1), FaultKind::TimeoutAfterApply { delay_ms: 1500 })]);
    h.send(&order("evt-1", "o-1")).await;
    // One attempt: its timeout leaves the intent uncertain at once.
    let text = h.config_text(&capture_with_answer()).replace("max_attempts = 5\n", "max_attempts = 1\n").replace(
        "[endpoints.psp]\n",
        "[endpoints.psp]\nprofile = \"stripe\"\nmax_age = \"1h\"\nreconcile = { resend = true, after = \"200ms\" }\n",
    );
    let mut p = h.process(&h.write_config(&text), &["run"], &[]);
    eventually("the intent reconciled", DEADLINE, || async {
        (h.db.count("intents", "state = 'succeeded'").await == 1).then_some(())
    })
    .await;
    assert_eq!(reconciliations(&h, "evt-1").await, [(1, "succeeded".to_owned(), Some(201))]);
    let stats = h.provider.stats();
    assert_eq!((stats.applied_for("capture:o-1"), stats.requests_for("capture:o-1"), stats.replayed), (1, 2, 1));
    h.await_published(1).await;
    // Stripe's stored answer to the resend: the payment the first request made.
    let (data, _) = emitted(&h, "evt-1", "payment.captured").await.unwrap();
    assert_eq!((data["payment_id"].as_str(), data["via"].as_str()), (Some("res_1"), Some("resend")), "{data}");
    p.terminate(DEADLINE).unwrap();
}

/// Take what a reconciler would take of `psp` right now, ignoring `after`.
async fn due_now(h: &Harness) -> usize {
    let mut conn = h.db.pool.acquire().await.unwrap();
    let five = std::time::Duration::from_secs(5);
    let taken = relay_store::reconciliations::take_due(
        &mut conn,
        &h.consumer,
        "psp",
        std::time::Duration::ZERO,
        3,
        10,
        "t",
        five,
    )
    .await
    .unwrap();
    for i in &taken {
        relay_store::intents::give_back_uncertain(&mut conn, i.id, i.lease_token).await.unwrap();
    }
    taken.len()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_paused_endpoint_s_uncertain_intents_are_not_asked_about() {
    use relay_store::ops::{self, PauseKind};
    let h = Harness::with_provider(1, settings(Dialect::Keyless)).await;
    h.provider.set_faults(vec![path_fault("/captures/o-1", None, FaultKind::TimeoutAfterApply { delay_ms: 1500 })]);
    h.send(&order("evt-1", "o-1")).await;
    // Not asked by the running relay within the test: `after` is an hour.
    let lookup = LOOKUP.replace("after = \"200ms\"", "after = \"1h\"");
    let text = format!("{}\n{lookup}", config_with(&h, &CAPTURE_ROUTE, "profile = \"none\""));
    let cfg = h.config_of(&text);
    let run = h.start(cfg, Components::ALL, no_faults()).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();
    assert_eq!(due_now(&h).await, 1);
    let mut conn = h.db.pool.acquire().await.unwrap();
    ops::pause(&mut conn, &h.consumer, PauseKind::Endpoint, "psp", Some("provider incident")).await.unwrap();
    assert_eq!(due_now(&h).await, 0, "paused: neither a lookup nor a resend goes out");
    ops::resume(&mut conn, &h.consumer, PauseKind::Endpoint, "psp").await.unwrap();
    assert_eq!(due_now(&h).await, 1);

    // An answer recorded after the take's lease was lost records nothing,
    // not even the question (its number would be taken again). This is the
    // sequential case; the race the second review found (a rescue committing
    // between the statement's snapshot and its UPDATE's lock) is closed by
    // writing the question from the fenced UPDATE's own result, and is not
    // reproduced here.
    use relay_store::reconciliations::{Asked, record, take_due};
    let (zero, five) = (std::time::Duration::ZERO, std::time::Duration::from_secs(5));
    let asked = Asked {
        worker: "t".into(),
        started_at: None,
        status: Some(503),
        verdict: relay_core::profile::Reconciled::Unknown,
        error: None,
    };
    let taken = take_due(&mut conn, &h.consumer, "psp", zero, 3, 10, "t", five).await.unwrap();
    sqlx::query("UPDATE relay.intents SET state = 'uncertain', lease_token = NULL").execute(&mut *conn).await.unwrap();
    let lost = record(&mut conn, taken[0].id, taken[0].lease_token, &asked, five, five).await.unwrap();
    assert_eq!(lost, relay_store::intents::Fenced::LeaseLost);
    assert_eq!(h.db.count("intent_reconciliations", "true").await, 0);
    let taken = take_due(&mut conn, &h.consumer, "psp", zero, 3, 10, "t", five).await.unwrap();
    let done = record(&mut conn, taken[0].id, taken[0].lease_token, &asked, five, five).await.unwrap();
    assert_eq!(done, relay_store::intents::Fenced::Done);
    assert_eq!(h.db.count("intent_reconciliations", "n = 1").await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_resend_after_the_provider_forgot_the_key_is_not_made() {
    let h = Harness::with_provider(1, settings(Dialect::Stripe)).await;
    h.provider.set_faults(vec![fault("capture:o-1", Some(1), FaultKind::TimeoutAfterApply { delay_ms: 1500 })]);
    h.send(&order("evt-1", "o-1")).await;
    // A key kept one second; asked two seconds after the intent is uncertain.
    let endpoint = "[endpoints.psp]\nprofile = \"stripe\"\nmax_age = \"1h\"\non_short_key_window = \"warn\"\n\
                    idempotency = { window = \"1s\" }\nreconcile = { resend = true, after = \"2s\", max_attempts = 1 }\n";
    let text = h
        .config_text(&CAPTURE_ROUTE)
        .replace("max_attempts = 5\n", "max_attempts = 1\n")
        .replace("[endpoints.psp]\n", endpoint);
    let mut p = h.process(&h.write_config(&text), &["run"], &[]);
    let asked = eventually("the reconciliation recorded", DEADLINE, || async {
        let r: Option<(String, Option<String>)> =
            sqlx::query_as("SELECT verdict, error FROM relay.intent_reconciliations")
                .fetch_optional(&h.db.pool)
                .await
                .unwrap();
        r
    })
    .await;
    assert_eq!(asked.0, "unknown");
    assert!(asked.1.unwrap_or_default().contains("key window has closed"));
    assert_eq!(h.provider.stats().requests_for("capture:o-1"), 1, "not sent again");
    assert_eq!(h.db.count("intents", "state = 'uncertain'").await, 1);
    p.terminate(DEADLINE).unwrap();
}

/// Capture whose success event carries the provider's answer.
fn capture_with_answer() -> String {
    let answer = "subject = \"payment {{ response.body.id }}\"\ndata = { order_id = \"{{ data.order_id }}\", payment_id = \"{{ response.body.id }}\", status = \"{{ response.status }}\", via = \"{{ response.via }}\" }\n";
    [
        routes::order_placed(""),
        routes::capture(&routes::order_body()),
        routes::emit_on("on_success", "captured", "payment.captured", answer),
    ]
    .concat()
}

/// The data and subject of the outbox event `event_type` that the call of
/// input event `source` led to.
async fn emitted(h: &Harness, source: &str, event_type: &str) -> Option<(serde_json::Value, String)> {
    let row: Option<(Vec<u8>, serde_json::Value)> = sqlx::query_as(
        "SELECT o.payload, o.headers FROM relay.outbox o JOIN relay.intents i ON o.source_id = i.id::text || ':succeeded'
          WHERE i.source_event_id = $1 AND o.event_type = $2",
    )
    .bind(source)
    .bind(event_type)
    .fetch_optional(&h.db.pool)
    .await
    .unwrap();
    row.map(|(payload, headers)| {
        let subject = headers.as_array().unwrap().iter().find(|h| h["name"] == "ce_subject").map(|h| h["text"].clone());
        (
            serde_json::from_slice(&payload).unwrap(),
            subject.and_then(|s| s.as_str().map(str::to_owned)).unwrap_or_default(),
        )
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_success_event_carries_the_provider_s_answer_even_when_a_retry_got_it() {
    let h = Harness::with_provider(1, settings(Dialect::Stripe)).await;
    h.provider.set_faults(vec![
        // Applied, answered too late: the retry gets Stripe's stored answer.
        fault("capture:o-2", Some(1), FaultKind::TimeoutAfterApply { delay_ms: 1500 }),
        // A success whose body is longer than the endpoint keeps.
        fault("capture:o-3", None, FaultKind::Body { status: 200, body: "x".repeat(9000) }),
        // A 200 whose body stalls past the timeout, once: cut off, so asked again.
        fault("capture:o-4", Some(1), FaultKind::StalledBody { status: 200, delay_ms: 1500 }),
        // A body with a NUL, which PostgreSQL's jsonb cannot hold.
        fault(
            "capture:o-5",
            None,
            FaultKind::Body { status: 200, body: r#"{"id":"pi_nul","note":"a\u0000b"}"#.into() },
        ),
    ]);
    for (evt, o) in [("evt-1", "o-1"), ("evt-2", "o-2"), ("evt-3", "o-3"), ("evt-4", "o-4"), ("evt-5", "o-5")] {
        h.send(&order(evt, o)).await;
    }
    let text = config_with(&h, &capture_with_answer(), "profile = \"stripe\"\nmax_age = \"1h\"");
    let ((mut p, admin), config) = run_with_admin_config(&h, &text).await;
    h.await_intents_finished(5).await;
    h.await_published(4).await;

    assert_eq!(h.provider.applied().len(), 3, "o-1, o-2 and o-4 once each (o-3 and o-5 answer with a body only)");
    for (evt, o) in [("evt-1", "o-1"), ("evt-2", "o-2"), ("evt-4", "o-4")] {
        let (data, subject) = emitted(&h, evt, "payment.captured").await.unwrap_or_else(|| panic!("{evt}: no event"));
        let id = data["payment_id"].as_str().unwrap_or_default().to_owned();
        assert!(id.starts_with("res_"), "{evt}: {data}");
        assert_eq!(subject, format!("payment {id}"));
        assert_eq!(
            (data["order_id"].as_str(), data["status"].as_u64(), data["via"].as_str()),
            (Some(o), Some(201), Some("call"))
        );
        // What the provider answered is kept with the intent, once.
        let kept: serde_json::Value =
            sqlx::query_scalar("SELECT response FROM relay.intents WHERE source_event_id = $1")
                .bind(evt)
                .fetch_one(&h.db.pool)
                .await
                .unwrap();
        assert_eq!(kept["body"]["id"], id.as_str(), "{kept}");
        assert_eq!(kept["body"]["idempotency_key"], format!("capture:{o}"));
    }
    let (_, attempts, ..) = intent_row(&h, "evt-2").await;
    assert!(attempts >= 2, "o-2's first answer was lost: {attempts}");
    assert_eq!(h.provider.stats().applied_for("capture:o-2"), 1);
    // The id the provider made on the first request, given again on the retry.
    let first = h.provider.applied().iter().position(|a| a.key == "capture:o-2").unwrap() + 1;
    let (data, _) = emitted(&h, "evt-2", "payment.captured").await.unwrap();
    assert_eq!(data["payment_id"], format!("res_{first}"));
    let (state, attempts, ..) = intent_row(&h, "evt-4").await;
    assert_eq!((state.as_str(), attempts), ("succeeded", 2), "the cut-off answer was asked for again");
    let (data, _) = emitted(&h, "evt-5", "payment.captured").await.unwrap();
    assert_eq!(data["payment_id"], "pi_nul", "a NUL elsewhere in the answer costs nothing");

    // Too long to keep: the success is recorded without its event, saying why.
    let (state, _, _, error) = intent_row(&h, "evt-3").await;
    let error = error.unwrap_or_default();
    assert_eq!(state, "succeeded");
    assert!(error.contains("on_success effects not recorded") && error.contains("response_bytes"), "{error}");
    assert!(emitted(&h, "evt-3", "payment.captured").await.is_none());
    // Its answer is kept all the same, for whoever emits the event by hand.
    let kept: serde_json::Value =
        sqlx::query_scalar("SELECT response FROM relay.intents WHERE source_event_id = 'evt-3'")
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
    assert_eq!((kept["status"].as_u64(), kept["truncated"].as_bool()), (Some(200), Some(true)), "{kept}");
    let (_, metrics) = admin.get("/metrics", None).await;
    assert_eq!(metric(&metrics, "relay_outcome_effects_dropped_total", &[("endpoint", "psp")]), Some(1.0), "{metrics}");

    let id: uuid::Uuid = sqlx::query_scalar("SELECT id FROM relay.intents WHERE source_event_id = 'evt-1'")
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    let (ok, out) = cli(&h, &config, &["intents", "show", &id.to_string()]).await;
    assert!(ok && out.contains("answer") && out.contains("res_"), "{out}");
    p.terminate(DEADLINE).unwrap();
}

fn oauth_settings() -> Settings {
    Settings {
        oauth: Some(example_provider::OAuthSettings {
            client_id: "relay".into(),
            client_secret: "s3cret".into(),
            token_lifetime: std::time::Duration::from_secs(3600),
        }),
        ..Settings::default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn calls_share_one_oauth2_token_and_a_revoked_one_is_replaced_once() {
    let h = Harness::with_provider(1, oauth_settings()).await;
    for i in 0..30 {
        h.send(&order(&format!("evt-{i}"), &format!("o-{i}"))).await;
    }
    let oauth = format!(
        "[endpoints.psp.oauth2]\ntoken_url = \"{}/oauth/token\"\nclient_id = \"relay\"\nclient_secret_env = \"PSP_CLIENT_SECRET\"\n\
         scopes = [\"payments\"]\n",
        h.provider.url().trim_end_matches('/')
    );
    let config = h.write_config(&format!("{}\n{oauth}", h.config_text(&CAPTURE_ROUTE)));
    let mut p = h.process(&config, &["run"], &[("PSP_CLIENT_SECRET", "s3cret")]);
    h.await_intents_finished(30).await;
    assert_eq!(h.intents_in("succeeded").await, 30);
    let stats = h.provider.stats();
    assert_eq!((stats.token_fetches, stats.unauthorized), (1, 0), "30 calls, one token");

    // The provider rotates its keys: the next calls meet 401, one new token, and go on.
    h.provider.revoke_tokens();
    for i in 30..50 {
        h.send(&order(&format!("evt-{i}"), &format!("o-{i}"))).await;
    }
    h.await_intents_finished(50).await;
    assert_eq!(h.intents_in("succeeded").await, 50);
    let stats = h.provider.stats();
    assert_eq!(stats.token_fetches, 2, "{stats:?}");
    assert!(stats.unauthorized >= 1, "{stats:?}");
    assert!(stats.double_applied().is_empty());
    p.terminate(DEADLINE).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_token_that_expires_quickly_is_replaced_before_it_expires_never_refused() {
    let settings = Settings {
        oauth: Some(example_provider::OAuthSettings {
            client_id: "relay".into(),
            client_secret: "s3cret".into(),
            token_lifetime: std::time::Duration::from_secs(2),
        }),
        ..Settings::default()
    };
    let h = Harness::with_provider(1, settings).await;
    for i in 0..40 {
        h.send(&order(&format!("evt-{i}"), &format!("o-{i}"))).await;
    }
    // 40 calls at 10/s: about 4 s of calls with tokens that live 2 s.
    let oauth = format!(
        "[endpoints.psp.oauth2]\ntoken_url = \"{}/oauth/token\"\nclient_id = \"relay\"\n\
         client_secret_env = \"PSP_CLIENT_SECRET\"\nrefresh_before = \"1s\"\n",
        h.provider.url().trim_end_matches('/')
    );
    let text = config_with(&h, &CAPTURE_ROUTE, "rate_limit_per_second = 10");
    let config = h.write_config(&format!("{text}\n{oauth}"));
    let mut p = h.process(&config, &["run"], &[("PSP_CLIENT_SECRET", "s3cret")]);
    h.await_intents_finished(40).await;
    assert_eq!(h.intents_in("succeeded").await, 40);
    let stats = h.provider.stats();
    // Each token is used for its first second: a few fetches for 40 calls,
    // and none refused (each replaced before the provider stops taking it).
    assert!((2..=8).contains(&stats.token_fetches), "{} fetches for 40 calls", stats.token_fetches);
    assert_eq!(stats.unauthorized, 0, "a token was used past its life");
    p.terminate(DEADLINE).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn calls_are_signed_as_standard_webhooks_and_a_wrong_secret_does_not_verify() {
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let h = Harness::with_provider(1, Settings { webhook_secret: Some(secret.into()), ..Settings::default() }).await;
    h.send(&order("evt-1", "o-1")).await;
    h.send(&order("evt-2", "o-2")).await;
    let signing = "[endpoints.psp.signing]\nscheme = \"standard_webhooks\"\nsecret_env = \"HOOKS_SECRET\"\n";
    let config = h.write_config(&format!("{}\n{signing}", h.config_text(&CAPTURE_ROUTE)));
    let mut p = h.process(&config, &["run"], &[("HOOKS_SECRET", secret)]);
    h.await_intents_finished(2).await;
    assert_eq!(h.intents_in("succeeded").await, 2);
    assert_eq!(h.provider.stats().bad_signatures, 0);
    p.terminate(DEADLINE).unwrap();

    // Signed with another secret, the provider's verifier refuses it.
    h.send(&order("evt-3", "o-3")).await;
    let mut p = h.process(&config, &["run"], &[("HOOKS_SECRET", "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD")]);
    h.await_intents_finished(3).await;
    let (state, _, _, error) = intent_row(&h, "evt-3").await;
    assert_eq!(state, "dead");
    assert!(error.unwrap_or_default().contains("signature does not verify"));
    assert_eq!(h.provider.stats().bad_signatures, 1);
    p.terminate(DEADLINE).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn calls_are_signed_with_aws_sigv4_and_a_wrong_secret_does_not_verify() {
    let aws = example_provider::SigV4Settings {
        access_key_id: "AKIDRELAYTEST".into(),
        secret_access_key: "wJalrXUtnFEMI/K7MDENG+bPxRfiCYRELAYKEY".into(),
        region: "eu-west-1".into(),
        service: "execute-api".into(),
    };
    let h = Harness::with_provider(1, Settings { aws_sigv4: Some(aws), ..Settings::default() }).await;
    h.send(&order("evt-1", "o-1")).await;
    h.send(&order("evt-2", "o-2")).await;
    let signing = "[endpoints.psp.signing]\nscheme = \"aws_sigv4\"\nregion = \"eu-west-1\"\nservice = \"execute-api\"\n\
                   access_key_id_env = \"PSP_AWS_KEY_ID\"\nsecret_access_key_env = \"PSP_AWS_SECRET\"\n";
    let config = h.write_config(&format!("{}\n{signing}", h.config_text(&CAPTURE_ROUTE)));
    let env = |secret: &'static str| [("PSP_AWS_KEY_ID", "AKIDRELAYTEST"), ("PSP_AWS_SECRET", secret)];
    let mut p = h.process(&config, &["run"], &env("wJalrXUtnFEMI/K7MDENG+bPxRfiCYRELAYKEY"));
    h.await_intents_finished(2).await;
    assert_eq!(h.intents_in("succeeded").await, 2);
    assert_eq!(h.provider.stats().bad_signatures, 0);
    p.terminate(DEADLINE).unwrap();

    // Signed with another secret, the provider's verifier refuses it (403, as AWS does).
    h.send(&order("evt-3", "o-3")).await;
    let mut p = h.process(&config, &["run"], &env("not-the-secret"));
    h.await_intents_finished(3).await;
    let (state, _, _, error) = intent_row(&h, "evt-3").await;
    assert_eq!(state, "dead");
    assert!(error.unwrap_or_default().contains("signature we calculated does not match"));
    assert_eq!(h.provider.stats().bad_signatures, 1);
    p.terminate(DEADLINE).unwrap();
}

/// Captures ordered per customer, whose dead ones hold their customer's key.
fn hold_key_route() -> String {
    let keyed = format!("ordering_key = \"{{{{ data.customer }}}}\"\n{}", routes::order_body());
    [routes::order_placed("on_poison = \"hold_key\"\n"), routes::capture(&keyed)].concat()
}

fn customer_order(id: &str, order: &str, customer: &str) -> TestEvent {
    TestEvent::new(id, "order.placed", json!({"order_id": order, "customer": customer})).key(customer)
}

async fn intent_id(h: &Harness, source_event: &str) -> uuid::Uuid {
    sqlx::query_scalar("SELECT id FROM relay.intents WHERE source_event_id = $1")
        .bind(source_event)
        .fetch_one(&h.db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_intent_holds_its_key_until_skipped_or_replayed_while_other_keys_flow() {
    let h = Harness::with_provider(1, Settings::default()).await;
    h.provider.set_faults(vec![
        // c-1's first order is refused for good; c-3's once (a replay then works).
        fault("capture:o-1", None, FaultKind::Status { status: 400, retry_after_secs: None }),
        fault("capture:o-5", Some(1), FaultKind::Status { status: 400, retry_after_secs: None }),
    ]);
    for (evt, o, c) in
        [("evt-1", "o-1", "c-1"), ("evt-2", "o-2", "c-1"), ("evt-3", "o-3", "c-1"), ("evt-4", "o-4", "c-2")]
            .into_iter()
            .chain([("evt-5", "o-5", "c-3"), ("evt-6", "o-6", "c-3")])
    {
        h.send(&customer_order(evt, o, c)).await;
    }
    let ((mut p, admin), config) = run_with_admin_config(&h, &h.config_text(&hold_key_route())).await;
    eventually("c-2 done, the heads of c-1 and c-3 dead", DEADLINE, || async {
        let dead = h.db.count("intents", "state = 'dead'").await == 2;
        (dead && intent_row(&h, "evt-4").await.0 == "succeeded").then_some(())
    })
    .await;
    // The later intents of the held keys wait, uncalled; the other key went on.
    for evt in ["evt-2", "evt-3", "evt-6"] {
        assert_eq!(intent_row(&h, evt).await.0, "pending", "{evt}");
    }
    for o in ["o-2", "o-3", "o-6"] {
        assert_eq!(h.provider.stats().requests_for(&format!("capture:{o}")), 0, "{o}");
    }
    let holding = eventually("the gauge", DEADLINE, || async {
        let (_, m) = admin.get("/metrics", None).await;
        metric(&m, "relay_intents_holding_keys", &[]).filter(|v| *v == 2.0)
    })
    .await;
    assert_eq!(holding, 2.0);
    let dead = intent_id(&h, "evt-1").await;
    let (ok, out) = cli(&h, &config, &["intents", "show", &dead.to_string()]).await;
    assert!(ok && out.contains("holds key  c-1"), "{out}");
    // Waiting behind a holder is by design: `relay verify` does not call them stuck.
    let (_, out) = cli(&h, &config, &["verify", "--grace", "0s"]).await;
    assert!(!out.contains("stuck_intent"), "{out}");
    // Retention never deletes a holder (it would release the key unseen).
    let mut conn = h.db.pool.acquire().await.unwrap();
    let cleanup = relay_store::ops::Cleanup::DeadIntents;
    relay_store::ops::delete_batch(&mut conn, cleanup, &h.consumer, std::time::Duration::ZERO, 100).await.unwrap();
    assert_eq!(h.db.count("intents", "state = 'dead'").await, 2, "the holders are kept");

    // Skipped: c-1's later intents go on, in order; the skipped one stays dead.
    let (ok, out) = cli(&h, &config, &["intents", "skip", &dead.to_string()]).await;
    assert!(ok && out.contains("key c-1 released, 2 intent(s)"), "{out}");
    // Replayed: c-3's head runs first, then the one behind it.
    let (ok, out) = cli(&h, &config, &["intents", "replay", &intent_id(&h, "evt-5").await.to_string()]).await;
    assert!(ok, "{out}");
    h.await_intents_finished(6).await;
    assert_eq!(h.intents_in("succeeded").await, 5);
    assert_eq!(intent_row(&h, "evt-1").await.0, "dead");
    let order: Vec<String> = h.provider.applied().into_iter().map(|a| a.key).collect();
    let at = |k: &str| order.iter().position(|x| x == k).unwrap_or_else(|| panic!("{k} not applied: {order:?}"));
    assert!(at("capture:o-2") < at("capture:o-3"), "{order:?}");
    assert!(at("capture:o-5") < at("capture:o-6"), "{order:?}");
    // Nothing holds now; skipping again is refused, naming why.
    let (ok, out) = cli(&h, &config, &["intents", "skip", &dead.to_string()]).await;
    assert!(!ok && out.contains("not a dead intent holding its ordering key"), "{out}");
    p.terminate(DEADLINE).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_lettered_record_holds_its_kafka_key_until_skipped_while_other_keys_flow() {
    let h = Harness::with_provider(1, Settings::default()).await;
    // c-1's first order has no order id: its route cannot render, it is dead-lettered.
    h.send(&TestEvent::new("evt-1", "order.placed", json!({"customer": "c-1"})).key("c-1")).await;
    for (evt, o, c) in [("evt-2", "o-2", "c-1"), ("evt-3", "o-3", "c-1"), ("evt-4", "o-4", "c-2")] {
        h.send(&customer_order(evt, o, c)).await;
    }
    let ((mut p, admin), config) = run_with_admin_config(&h, &h.config_text(&hold_key_route())).await;
    eventually("c-2 done, c-1's later records held", DEADLINE, || async {
        let held = h.db.count("dead_letters", "error_class = 'held'").await == 2;
        (held && intent_row(&h, "evt-4").await.0 == "succeeded").then_some(())
    })
    .await;
    assert_eq!(h.db.count("intents", "source_event_id IN ('evt-2', 'evt-3')").await, 0, "held, not applied");
    // A record of the key that arrives now is held too, behind the same head.
    h.send(&customer_order("evt-5", "o-5", "c-1")).await;
    eventually("the gauges", DEADLINE, || async {
        let (_, m) = admin.get("/metrics", None).await;
        let keys = metric(&m, "relay_held_keys", &[]);
        let held = metric(&m, "relay_records_held", &[]);
        (keys == Some(1.0) && held == Some(3.0)).then_some(())
    })
    .await;
    let (ok, out) = cli(&h, &config, &["dead-letters", "holds"]).await;
    assert!(ok && out.contains("c-1") && !out.contains("c-2"), "{out}");
    let head: i64 = sqlx::query_scalar("SELECT id FROM relay.dead_letters WHERE event_id = 'evt-1'")
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    let held: i64 = sqlx::query_scalar("SELECT id FROM relay.dead_letters WHERE event_id = 'evt-2'")
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    // Nothing of the key goes ahead of its head, nor is it purged.
    let (ok, out) = cli(&h, &config, &["dead-letters", "replay", &held.to_string()]).await;
    assert!(ok && out.contains(&format!("not replayed: held behind dead letter {head}")), "{out}");
    let (ok, out) = cli(&h, &config, &["dead-letters", "purge", "--all", "--yes"]).await;
    assert!(ok && out.contains("deleted 0 dead letter(s)"), "{out}");
    let (status, body) = admin.get("/api/held-keys", Some(TOKEN)).await;
    assert!(status == 200 && body.contains(&format!("\"head\":{head}")), "{status} {body}");
    assert_eq!(h.provider.stats().requests_for("capture:o-2"), 0);

    // Skipped while more records of the key stream in: the held records are
    // applied in order, and every later one after them (held, or not).
    let more = 30;
    let sending = async {
        for i in 6..6 + more {
            h.send(&customer_order(&format!("evt-{i}"), &format!("o-{i}"), "c-1")).await;
        }
    };
    let head_id = head.to_string();
    let skip = ["dead-letters", "skip", head_id.as_str()];
    let ((ok, out), ()) = tokio::join!(cli(&h, &config, &skip), sending);
    assert!(ok && out.contains("released:") && out.contains("held record(s) replayed in order"), "{out}");
    h.await_intents_finished(4 + more).await;
    assert_eq!(h.intents_in("succeeded").await, 4 + more);
    let order: Vec<String> = h.provider.applied().into_iter().map(|a| a.key).collect();
    let at = |k: &str| order.iter().position(|x| x == k).unwrap_or_else(|| panic!("{k} not applied: {order:?}"));
    let c1: Vec<usize> = [2, 3].into_iter().chain(5..6 + more).map(|o| at(&format!("capture:o-{o}"))).collect();
    assert!(c1.windows(2).all(|w| w[0] < w[1]), "c-1's calls in record order: {order:?}");
    assert_eq!(h.db.count("held_keys", "true").await, 0);
    let stranded = h.db.count("dead_letters", "error_class = 'held' AND replay_outcome IS NULL").await;
    assert_eq!(stranded, 0, "no record left behind a released key");
    let (ok, out) = cli(&h, &config, &["dead-letters", "skip", &head.to_string()]).await;
    assert!(!ok && out.contains("holds no key"), "{out}");
    p.terminate(DEADLINE).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn three_dispatchers_share_one_adapted_rate_near_what_the_provider_allows() {
    const ALLOWED: usize = 20; // calls per second the provider takes
    let h = Harness::with_provider(3, Settings { rate_limit: Some(ALLOWED as u32), ..Settings::default() }).await;
    h.send_orders(300).await;
    // Three times what the provider takes, to start with, in each process.
    let adaptive = "adaptive = { start = 60, max = 60, min = 2, increase = 2, decrease = 0.5, cooldown = \"1s\" }";
    let config = h.write_config(&config_with(&h, &CAPTURE_ROUTE, adaptive));
    let started = std::time::Instant::now();
    let mut ps: Vec<_> = (0..3).map(|_| h.process(&config, &["run"], &[])).collect();
    h.await_intents_finished(300).await;
    let took = started.elapsed();
    assert_eq!(h.intents_in("succeeded").await, 300, "all work completes");
    let stats = h.provider.stats();
    assert!(stats.double_applied().is_empty());
    assert!(stats.throttled > 0, "the provider throttled at first");
    // Once adapted (after 5 s), the three together stay near what it takes.
    let peak = h.provider.peak_per_second(started + std::time::Duration::from_secs(5));
    let throttled = stats.throttled;
    assert!(
        peak <= ALLOWED * 3 / 2,
        "{peak} calls in one second, {ALLOWED}/s allowed; took {took:?}, {throttled} throttled"
    );
    let shared: f64 = sqlx::query_scalar("SELECT rate FROM relay.endpoint_rates WHERE endpoint = 'psp'")
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    assert!(shared < 60.0, "the shared rate came down: {shared}");
    for p in &mut ps {
        p.terminate(DEADLINE).unwrap();
    }
}

/// Captures whose calls are shared fairly between tenants.
fn fair_route() -> String {
    let fair = format!("fairness_key = \"{{{{ data.tenant }}}}\"\n{}", routes::order_body());
    [routes::order_placed(""), routes::capture(&fair)].concat()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_small_tenant_s_calls_start_within_a_few_slots_of_a_big_tenant_s_burst() {
    let h = Harness::with_provider(1, Settings::default()).await;
    let tenant_order = |evt: String, o: String, tenant: &str| {
        TestEvent::new(&evt, "order.placed", json!({"order_id": o, "tenant": tenant}))
    };
    // The big tenant's burst first, then the small one's ten, all before relay starts.
    for i in 0..300 {
        h.send(&tenant_order(format!("big-{i}"), format!("b-{i}"), "big")).await;
    }
    for i in 0..10 {
        h.send(&tenant_order(format!("small-{i}"), format!("s-{i}"), "small")).await;
    }
    let text = config_with(&h, &fair_route(), "rate_limit_per_second = 200\nfair_share_per_second = 100");
    let mut p = h.process(&h.write_config(&text), &["run"], &[]);
    h.await_intents_finished(310).await;
    assert_eq!(h.intents_in("succeeded").await, 310, "all work completes");
    // The order in which the calls' first attempts started: what fair shares
    // schedule. (The provider's record of when each took effect also counts
    // attempts retried after a timeout, which a loaded machine adds: one
    // small call retried put it at #102 in CI.)
    let order: Vec<String> = sqlx::query_scalar(
        "SELECT i.idempotency_key FROM relay.intent_attempts a JOIN relay.intents i ON i.id = a.intent_id
          WHERE a.attempt = 1 ORDER BY coalesce(a.started_at, a.claimed_at), a.claimed_at",
    )
    .fetch_all(&h.db.pool)
    .await
    .unwrap();
    assert_eq!(order.len(), 310);
    let last_small = order.iter().rposition(|k| k.starts_with("capture:s-")).unwrap();
    // Counted from the small tenant's arrival: the consumer writes at most
    // a batch (200 records) per transaction, so the big tenant's first
    // calls may have started before the small tenant's intents existed,
    // by as many as the machine took to write a batch (not what fair shares
    // decide). The endpoint takes twice a key's share, so a dispatcher a
    // loaded machine held back catches up with the slots instead of
    // staying behind them by as many calls.
    let before: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM relay.intent_attempts a
          WHERE a.attempt = 1 AND coalesce(a.started_at, a.claimed_at) <
                (SELECT min(created_at) FROM relay.intents WHERE idempotency_key LIKE 'capture:s-%')",
    )
    .fetch_one(&h.db.pool)
    .await
    .unwrap();
    let after_arrival = last_small.saturating_sub(usize::try_from(before).unwrap());
    // Ten small calls taking turns with the big tenant's: about 20 slots.
    // Without fair shares they would come after all 300 (written last).
    assert!(
        after_arrival < 40,
        "the small tenant's last call started #{last_small} of 310, {after_arrival} after its arrival \
         ({before} had started before): {:?}",
        &order[..80]
    );
    p.terminate(DEADLINE).unwrap();
}
