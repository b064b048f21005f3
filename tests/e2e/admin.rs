//! Operating the relay: the admin server of a real `relay run` process
//! (metrics, health, readiness, the token-protected API, pauses), the web
//! console driven in headless Chromium, retention cleanup and its start-up
//! check against the topics' retention.

use std::time::Duration;

use crate::support::ops::*;
use crate::support::*;
use example_provider::{FaultKind, FaultRule};
use relay_core::config::Shortfall;
use relay_store::ops::Cleanup;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread")]
async fn the_admin_server_serves_metrics_health_and_readiness() {
    let h = Harness::new(1).await;
    h.send(&order("evt-1", "o-1")).await;
    h.send(&order("evt-2", "o-2")).await;
    h.send(&order("evt-1", "o-1")).await; // duplicate
    h.producer.raw(&h.topic, None, None, &[("ce_specversion".into(), b"1.0".to_vec())], Some(b"{")).await.unwrap();
    // Parked after its R19 budget: counted as dead-lettered too (issue 22 item 15).
    h.send(&TestEvent::new("p-1", "payment.confirmed", json!({"order_id": "o-missing"}))).await;
    let routes = format!("{}{}", *CAPTURE_ROUTE, *SAGA_ROUTE);
    let (mut p, admin) = run_with_admin(&h, &routes).await;
    h.await_intents_finished(2).await;

    let body = eventually("metrics with the processed records and refreshed gauges", DEADLINE, || async {
        let (_, body) = admin.get("/metrics", None).await;
        // Both orders counted, the poison record dead-lettered and nothing
        // unfinished: a refresh after the calls.
        let ready = metric(&body, "relay_records_processed_total", &[("result", "applied")]) == Some(2.0)
            && metric(&body, "relay_business_counter", &[("name", "orders")]) == Some(2.0)
            && metric(&body, "relay_intents", &[("state", "pending")]) == Some(0.0)
            && metric(&body, "relay_intents", &[("state", "running")]) == Some(0.0)
            && metric(&body, "relay_dead_letters", &[("state", "all")]) == Some(2.0);
        ready.then_some(body)
    })
    .await;
    assert_eq!(metric(&body, "relay_duplicates_total", &[("layer", "inbox")]), Some(1.0), "{body}");
    assert_eq!(metric(&body, "relay_dead_lettered_total", &[("class", "missing_id")]), Some(1.0), "{body}");
    assert_eq!(metric(&body, "relay_dead_lettered_total", &[("class", "missing_reference")]), Some(1.0), "{body}");
    assert_eq!(metric(&body, "relay_records_received_total", &[]), Some(5.0), "{body}");
    assert_eq!(
        metric(&body, "relay_calls_total", &[("endpoint", "psp"), ("result", "succeeded")]),
        Some(2.0),
        "{body}"
    );
    // `relay run`: both intents were written claimed by the consumer, none by a claim.
    assert_eq!(metric(&body, "relay_intents_claimed_total", &[("via", "ingest")]), Some(2.0), "{body}");
    assert_eq!(metric(&body, "relay_intents_claimed_total", &[("via", "claim")]), None, "{body}");
    assert_eq!(metric(&body, "relay_intents", &[("state", "dead")]), Some(0.0), "{body}");
    assert!(metric(&body, "relay_outbox_rows", &[("state", "pending")]).is_some(), "{body}");
    assert!(metric(&body, "relay_table_rows_estimated", &[("table", "inbox")]).is_some(), "{body}");
    assert!(body.contains("relay_processing_seconds_bucket"), "latency histograms: {body}");
    assert!(body.contains("relay_dispatch_seconds_bucket"), "{body}");
    // Lag comes from librdkafka's statistics, every 5 s.
    eventually("the consumer lag gauge", DEADLINE, || async {
        let (_, body) = admin.get("/metrics", None).await;
        (metric(&body, "relay_consumer_lag", &[("partition", "0")]) == Some(0.0)).then_some(())
    })
    .await;

    let (status, _) = admin.get("/healthz", None).await;
    assert_eq!(status, 200);
    let (status, ready) = admin.get("/readyz", None).await;
    assert_eq!(status, 200, "{ready}");
    let ready: Value = serde_json::from_str(&ready).unwrap();
    assert_eq!(ready["ready"], true);
    assert!(ready["checks"]["broker"].as_str().unwrap().starts_with("ok"), "{ready}");

    // Security review L4: the console runs only its own script, is never
    // framed, and nothing of it is cached or sniffed.
    for path in ["/", "/app.js", "/api/counts"] {
        let res = admin.http.get(format!("{}{path}", admin.url)).bearer_auth(TOKEN).send().await.unwrap();
        let h = |name: &str| res.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
        let csp = h("content-security-policy");
        assert!(csp.contains("frame-ancestors 'none'") && csp.contains("script-src 'self'"), "{path}: {csp:?}");
        assert_eq!(h("x-frame-options"), "DENY", "{path}");
        assert_eq!(h("x-content-type-options"), "nosniff", "{path}");
        assert_eq!(h("cache-control"), "no-store", "{path}");
    }
    assert!(p.terminate(Duration::from_secs(30)).unwrap().success());
}

fn two_routes() -> String {
    [
        "\n[endpoints.psp2]\nbase_url = \"PROVIDER\"\ntimeout = \"1s\"\nconnect_timeout = \"500ms\"\n",
        &routes::route(Some("placed"), "order.placed", ""),
        &routes::call("capture", "psp", "/captures", ""),
        &routes::route(Some("shipped"), "order.shipped", ""),
        &routes::call("notify", "psp2", "/notify", ""),
    ]
    .concat()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_admin_api_needs_its_token_and_pauses_hold_work_without_skipping_it() {
    let h = Harness::new(2).await;
    let routes = two_routes().replace("PROVIDER", &h.provider.url());
    let (mut p, admin) = run_with_admin(&h, &routes).await;
    assert_eq!(admin.get("/api/counts", None).await.0, 401);
    assert_eq!(admin.get("/api/counts", Some("wrong")).await.0, 401);
    assert_eq!(admin.get("/api/counts", Some(TOKEN)).await.0, 200);
    // Every /api route is behind the one token layer, and a bad filter is refused, not an empty list.
    assert_eq!(admin.get("/api/intents?state=dead", None).await.0, 401);
    let (status, body) = admin.get("/api/intents?state=deadd", Some(TOKEN)).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("unknown intent state"), "{body}");
    // A misspelt error class is refused, not an empty page.
    let (status, body) = admin.get("/api/dead-letters?class=bad_jsonn", Some(TOKEN)).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("unknown poison class") && body.contains("bad_json"), "{body}");
    assert_eq!(admin.get("/api/intents?state=dead", Some(TOKEN)).await.0, 200);

    // An endpoint pause: its intents wait, the other endpoint's go out.
    admin
        .api(
            reqwest::Method::POST,
            "/api/pauses",
            Some(json!({"kind": "endpoint", "name": "psp", "reason": "provider incident"})),
        )
        .await;
    h.send(&order("evt-1", "o-1").partition(0)).await;
    h.send(&crate::support::TestEvent::new("evt-2", "order.shipped", json!({"order_id": "o-2"})).partition(1)).await;
    eventually("the unpaused endpoint's call", DEADLINE, || async {
        (h.provider.stats().applied_for("notify:o-2") == 1).then_some(())
    })
    .await;
    eventually("the paused endpoint's intent to be written", DEADLINE, || async {
        (h.db.count("intents", "endpoint = 'psp'").await == 1).then_some(())
    })
    .await;
    assert_eq!(h.provider.stats().requests_for("capture:o-1"), 0, "the paused endpoint was not called");
    let pauses = admin.api(reqwest::Method::GET, "/api/pauses", None).await;
    assert_eq!(pauses["pauses"][0]["reason"], "provider incident");
    admin.api(reqwest::Method::DELETE, "/api/pauses/endpoint/psp", None).await;
    eventually("the call after the resume", DEADLINE, || async {
        (h.provider.stats().applied_for("capture:o-1") == 1).then_some(())
    })
    .await;

    // A route pause: its partition waits at the route's event; other partitions go on.
    admin.api(reqwest::Method::POST, "/api/pauses", Some(json!({"kind": "route", "name": "placed"}))).await;
    h.send(&order("evt-3", "o-3").partition(0)).await;
    h.send(&crate::support::TestEvent::new("evt-4", "order.shipped", json!({"order_id": "o-4"})).partition(0)).await;
    h.send(&crate::support::TestEvent::new("evt-5", "order.shipped", json!({"order_id": "o-5"})).partition(1)).await;
    eventually("the other partition's event", DEADLINE, || async { h.outcome("evt-5").await.map(|_| ()) }).await;
    assert_eq!(h.outcome("evt-3").await, None, "the paused route's event waits");
    assert_eq!(h.outcome("evt-4").await, None, "so does everything behind it in its partition");
    let unknown = admin
        .http
        .post(format!("{}/api/pauses", admin.url))
        .bearer_auth(TOKEN)
        .json(&json!({"kind": "route", "name": "nope"}))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status().as_u16(), 404, "unknown names are refused");
    admin.api(reqwest::Method::DELETE, "/api/pauses/route/placed", None).await;
    eventually("the partition to move on after the resume", DEADLINE, || async {
        h.outcome("evt-4").await.map(|_| ())
    })
    .await;
    assert_eq!(h.outcome("evt-3").await.as_deref(), Some("applied"));
    assert!(p.terminate(Duration::from_secs(30)).unwrap().success());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_console_shows_a_dead_intent_and_replaying_it_makes_it_succeed() {
    // A route without on_dead effects: a dead intent whose failure was
    // announced is not replayed (issue 28, D4; the dispatcher tests).
    let route = CAPTURE_ROUTE.split("[[routes.actions.on_dead.emit]]").next().unwrap();
    let h = Harness::new(1).await;
    h.provider.set_faults(vec![FaultRule {
        path_prefix: None,
        key_prefix: Some("capture:o-1".into()),
        times: None,
        kind: FaultKind::Status { status: 422, retry_after_secs: None },
    }]);
    h.send(&order("evt-1", "o-1")).await;
    // An uncertain intent and two dead outbox rows, as a dispatcher and a
    // publisher would have left them (issue 28: D4, D8 in the console).
    relay_testkit::seed::pending_intents(&h.db.pool, &h.consumer, "psp", "u-", 1).await.unwrap();
    sqlx::query(
        "UPDATE relay.intents SET state = 'uncertain', ever_uncertain = true, attempts = 1, finished_at = now(),
                last_error = 'no response within 1s; the request may have been applied (uncertain)'
          WHERE idempotency_key = 'capture:u-o-1'",
    )
    .execute(&h.db.pool)
    .await
    .unwrap();
    relay_testkit::seed::pending_outbox(&h.db.pool, &h.consumer, &h.out, 2).await.unwrap();
    sqlx::query("UPDATE relay.outbox SET state = 'dead', attempts = 1, last_error = 'unknown topic (seeded)'")
        .execute(&h.db.pool)
        .await
        .unwrap();
    let uncertain: String =
        sqlx::query_scalar("SELECT id::text FROM relay.intents").fetch_one(&h.db.pool).await.unwrap();
    // A dead letter holding its Kafka key, and an order held behind it
    // (issue 29, part 6), as a consumer with on_poison = "hold_key" leaves them.
    let (head, held) = {
        let mut conn = h.db.conn().await.unwrap();
        let poison = relay_core::Poison::new(relay_core::PoisonClass::TemplateError, "no order id (seeded)");
        let head = TestEvent::new("evt-head", "order.placed", json!({})).key("k-1").record(&h.topic, 1000);
        let head_id =
            relay_store::dead_letters::insert(&mut conn, &h.consumer, &head, &poison, 1, false, 1 << 20).await.unwrap();
        relay_store::holds::open(&mut conn, &h.consumer, &head).await.unwrap();
        let held = order("evt-held", "o-held").key("k-1").record(&h.topic, 1001);
        let why = relay_core::Poison::new(relay_core::PoisonClass::Held, "held (seeded)");
        let held_id =
            relay_store::dead_letters::insert(&mut conn, &h.consumer, &held, &why, 1, true, 1 << 20).await.unwrap();
        (head_id.unwrap().to_string(), held_id.unwrap().to_string())
    };
    // A head replayed already whose key's release was cut short (a crash
    // between two chunks): still listed, to be replayed or skipped again.
    let cut_short = {
        let mut conn = h.db.conn().await.unwrap();
        let poison = relay_core::Poison::new(relay_core::PoisonClass::TemplateError, "no order id (seeded)");
        let head = TestEvent::new("evt-cut", "order.placed", json!({})).key("k-2").record(&h.topic, 1002);
        let id = relay_store::dead_letters::insert(&mut conn, &h.consumer, &head, &poison, 1, false, 1 << 20)
            .await
            .unwrap()
            .unwrap();
        relay_store::holds::open(&mut conn, &h.consumer, &head).await.unwrap();
        sqlx::query(
            "UPDATE relay.dead_letters SET replay_state = 'resolved', replay_outcome = 'applied' WHERE id = $1",
        )
        .bind(id)
        .execute(&mut *conn)
        .await
        .unwrap();
        id.to_string()
    };
    let rows: Vec<String> =
        sqlx::query_scalar("SELECT id::text FROM relay.outbox ORDER BY seq").fetch_all(&h.db.pool).await.unwrap();
    let (mut p, admin) = run_with_admin(&h, route).await;
    let intent: String = eventually("the intent to die", DEADLINE, || async {
        sqlx::query_scalar("SELECT id::text FROM relay.intents WHERE state = 'dead'")
            .fetch_optional(&h.db.pool)
            .await
            .unwrap()
    })
    .await;
    h.provider.set_faults(Vec::new()); // the provider is fixed; the operator replays

    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/console");
    assert!(
        dir.join("node_modules/playwright-core").exists(),
        "playwright-core is not installed: run `npm ci --prefix tests/console` (scripts/test.sh does)"
    );
    let out = tokio::process::Command::new("node")
        .arg(dir.join("console.mjs"))
        .env("CONSOLE_URL", &admin.url)
        .env("CONSOLE_TOKEN", TOKEN)
        .env("INTENT_ID", &intent)
        .env("UNCERTAIN_ID", &uncertain)
        .env("OUTBOX_REPLAY_ID", &rows[0])
        .env("OUTBOX_SKIP_ID", &rows[1])
        .env("HOLD_HEAD_ID", &head)
        .env("HELD_ID", &held)
        .env("CUT_SHORT_ID", &cut_short)
        .output()
        .await
        .expect("node runs (Node.js is on this machine)");
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "console test failed:\n{log}");
    assert_eq!(h.provider.stats().applied_for("capture:o-1"), 1);
    eventually("the order held behind the skipped dead letter called", DEADLINE, || async {
        (h.provider.stats().applied_for("capture:o-held") == 1).then_some(())
    })
    .await;
    assert_eq!(h.db.count("held_keys", &format!("head <> {cut_short}")).await, 0, "only the seeded cut-short hold");
    assert_eq!(h.provider.stats().requests_for("capture:u-o-1"), 0, "resolving makes no call");
    assert_eq!(h.db.count("intents", "state = 'succeeded'").await, 3, "o-1, the resolved one, the released one");
    assert_eq!(h.db.count("intents", "last_error LIKE '%PSP dashboard: captured%'").await, 1, "the note is kept");
    let attempts: Vec<String> = sqlx::query_scalar(
        "SELECT outcome FROM relay.intent_attempts a JOIN relay.intents i ON i.id = a.intent_id
          WHERE i.idempotency_key = 'capture:o-1' ORDER BY attempt",
    )
    .fetch_all(&h.db.pool)
    .await
    .unwrap();
    assert_eq!(attempts, vec!["permanent", "succeeded"], "the replay is a new attempt of the same intent");
    let states: Vec<String> =
        sqlx::query_scalar("SELECT state FROM relay.outbox WHERE id = ANY($1::uuid[]) ORDER BY seq")
            .bind(&rows)
            .fetch_all(&h.db.pool)
            .await
            .unwrap();
    assert_eq!(states[1], "skipped");
    eventually("the replayed outbox row published", DEADLINE, || async {
        let s: String = sqlx::query_scalar("SELECT state FROM relay.outbox WHERE id = $1::uuid")
            .bind(&rows[0])
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
        (s == "published").then_some(())
    })
    .await;
    assert!(p.terminate(Duration::from_secs(30)).unwrap().success());
}

#[tokio::test(flavor = "multi_thread")]
async fn cleanup_deletes_only_rows_past_their_retention_in_bounded_batches() {
    let h = Harness::new(1).await;
    for i in 0..30 {
        h.send(&order(&format!("evt-{i}"), &format!("o-{i}"))).await;
    }
    let run = h.start(h.config(&CAPTURE_ROUTE), relay::Components::ALL, no_faults()).await;
    h.await_intents_finished(30).await;
    h.await_published(30).await;
    run.stop().await.unwrap();
    // Age two thirds of everything by two days.
    for sql in [
        "UPDATE relay.inbox SET received_at = now() - interval '2 days' WHERE event_id ~ '^evt-([0-9]|1[0-9])$'",
        "UPDATE relay.intents SET finished_at = now() - interval '2 days' WHERE source_event_id ~ '^evt-([0-9]|1[0-9])$'",
        "UPDATE relay.outbox SET published_at = now() - interval '2 days' WHERE source_id LIKE '%:succeeded'
            AND source_id IN (SELECT id::text || ':succeeded' FROM relay.intents WHERE source_event_id ~ '^evt-([0-9]|1[0-9])$')",
    ] {
        sqlx::query(sql).execute(&h.db.pool).await.unwrap();
    }
    let mut retention = relay_core::config::RetentionConfig {
        inbox: Some(Duration::from_secs(86_400)),
        succeeded_intents: Some(Duration::from_secs(86_400)),
        published_outbox: Some(Duration::from_secs(86_400)),
        batch_size: 7,
        on_shorter_than_topic: Shortfall::Warn,
        ..Default::default()
    };
    // The topic keeps records longer than a day: cleaning up is only allowed
    // because this configuration says "warn".
    let mut cfg = h.config(&CAPTURE_ROUTE);
    cfg.retention = retention.clone();
    let checked = relay::ops::retention::check_topic_retention(&cfg).await.unwrap();
    let mut batches = Vec::new();
    let deleted = relay::ops::retention::cleanup_once(&h.db.pool, &retention, &h.consumer, checked, |what, total| {
        batches.push((what, total))
    })
    .await
    .unwrap()
    .expect("no other cleaner");
    let get = |w: Cleanup| deleted.iter().find(|d| d.0 == w).map(|d| d.1);
    assert_eq!(get(Cleanup::Inbox), Some(20));
    assert_eq!(get(Cleanup::SucceededIntents), Some(20));
    assert_eq!(get(Cleanup::PublishedOutbox), Some(20));
    assert!(batches.iter().filter(|b| b.0 == Cleanup::Inbox).count() >= 3, "20 rows in batches of 7: {batches:?}");
    assert_eq!(h.inbox().await, 10, "recent rows are kept");
    assert_eq!(h.db.count("intents", "true").await, 10);
    assert_eq!(h.db.count("intent_attempts", "true").await, 10, "attempts went with their intents");

    // At start, an inbox retention shorter than the topic's is refused (or warned about).
    retention.on_shorter_than_topic = Shortfall::Refuse;
    cfg.retention = retention;
    let err = relay::ops::retention::check_topic_retention(&cfg).await.unwrap_err().to_string();
    assert!(err.contains(&h.topic) && err.contains("retention.inbox"), "{err}");
    // Kafka's defaults keep records 7 days, in segments of 7 days: a record
    // may be handed back for up to 14 days (issue 22 item 6).
    cfg.retention.on_shorter_than_topic = Shortfall::Refuse;
    cfg.retention.inbox = Some(Duration::from_secs(10 * 86_400));
    let err = relay::ops::retention::check_topic_retention(&cfg).await.unwrap_err().to_string();
    assert!(err.contains("segment.ms"), "{err}");
    cfg.retention.inbox = Some(Duration::from_secs(30 * 86_400));
    relay::ops::retention::check_topic_retention(&cfg).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn spans_are_exported_over_otlp_when_an_endpoint_is_configured() {
    // A stand-in OTLP/HTTP collector that keeps what it is sent.
    let bodies: std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>> = Default::default();
    let kept = bodies.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let kept = kept.clone();
            async move {
                kept.lock().unwrap().push(body.to_vec());
                axum::http::StatusCode::OK
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let collector = format!("http://{}/v1/traces", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let h = Harness::new(1).await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    h.send(&order("evt-1", "o-1").ext("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))).await;
    let text = format!(
        "{}\n[telemetry]\notlp_endpoint = \"{collector}\"\nservice_name = \"relay-test\"\n",
        h.config_text(&CAPTURE_ROUTE)
    );
    let config = h.write_config(&text);
    let mut p = h.process(&config, &["run"], &[]);
    h.await_intents_finished(1).await;
    assert!(p.terminate(Duration::from_secs(30)).unwrap().success(), "{}", p.log());
    let want: Vec<u8> = (0..16).map(|i| u8::from_str_radix(&trace_id[2 * i..2 * i + 2], 16).unwrap()).collect();
    let all = bodies.lock().unwrap().concat();
    assert!(!all.is_empty(), "no spans were exported");
    assert!(all.windows(16).any(|w| w == want.as_slice()), "the exported spans belong to the event's trace");
    assert!(all.windows(b"relay.call".len()).any(|w| w == b"relay.call"), "the call span is exported");
    assert!(all.windows(b"relay.inbox".len()).any(|w| w == b"relay.inbox"), "the processing span is exported");
}

#[tokio::test]
async fn every_process_that_deletes_inbox_rows_refuses_an_inbox_retention_shorter_than_the_topic_s() {
    // Issue 28 D6: `relay consume` refused, but `relay dispatch` (beside
    // which cleanup runs) and `relay cleanup` deleted inbox rows the broker
    // could still hand back, so a replay would apply those events again.
    let h = Harness::new(1).await;
    sqlx::query(
        "INSERT INTO relay.inbox (consumer, event_id, event_type, topic, partition, \"offset\", outcome, received_at)
         SELECT $1, 'old-' || g, 't', $2, 0, g, 'applied', now() - interval '2 hours' FROM generate_series(1, 5) g",
    )
    .bind(&h.consumer)
    .bind(&h.topic)
    .execute(&h.db.pool)
    .await
    .unwrap();
    // The topic keeps records for Kafka's default week; the inbox only an hour.
    let text = format!("{}\n[retention]\ninbox = \"1h\"\ninterval = \"100ms\"\n", h.config_text(&CAPTURE_ROUTE));
    let config = h.write_config(&text);

    let mut cleanup = h.process(&config, &["cleanup"], &[]);
    assert!(!cleanup.wait(DEADLINE).unwrap().success(), "relay cleanup refused");
    let log = cleanup.log();
    assert!(log.contains("retention.inbox") && log.contains(&h.topic), "names the setting and the topic: {log}");

    let mut dispatch = h.process(&config, &["dispatch"], &[]);
    assert!(!dispatch.wait(DEADLINE).unwrap().success(), "relay dispatch refused to start");
    assert_eq!(h.inbox().await, 5, "no inbox row was deleted");

    // Told to warn instead, the same cleanup deletes them.
    let config = h.write_config(&format!("{text}on_shorter_than_topic = \"warn\"\n"));
    let mut cleanup = h.process(&config, &["cleanup"], &[]);
    assert!(cleanup.wait(DEADLINE).unwrap().success());
    assert_eq!(h.inbox().await, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn connections_that_never_finish_their_headers_are_closed_and_health_still_answers() {
    // Security review M5: axum::serve set no hyper timer, so no header-read
    // timeout applied and nothing limited connections: thousands of
    // connections that sent half a request held descriptors and tasks for
    // ever. Now each is closed after 10 s, and at most 256 are served at once.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let h = Harness::new(1).await;
    let (mut p, admin) = run_with_admin(&h, &CAPTURE_ROUTE).await;
    let addr = admin.url.trim_start_matches("http://").to_owned();
    let mut slow = Vec::new();
    for _ in 0..300 {
        let mut c = tokio::net::TcpStream::connect(&addr).await.unwrap();
        c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        slow.push(c);
    }
    let started = std::time::Instant::now();
    // Each is closed by the server (EOF), within the header timeout and a margin.
    for mut c in slow {
        let mut buf = [0u8; 256];
        let left = Duration::from_secs(35).saturating_sub(started.elapsed());
        let closed = tokio::time::timeout(left, async {
            loop {
                match c.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(
            closed.is_ok(),
            "a connection that never finished its headers was still open after {:?}",
            started.elapsed()
        );
    }
    let (status, _) = admin.get("/healthz", None).await;
    assert_eq!(status, 200, "health answers once they are gone");
    assert!(p.terminate(Duration::from_secs(30)).unwrap().success());
}

#[tokio::test(flavor = "multi_thread")]
async fn one_peer_holding_every_connection_it_may_leaves_the_health_probe_its_answer() {
    // The liveness probe shares the admin server's connections with anyone
    // who can reach the port: one peer that kept them all alive (a request
    // now and then) made the probe wait unanswered, and the orchestrator
    // restarted a healthy relay again and again.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let h = Harness::new(1).await;
    let (mut p, admin) = run_with_admin(&h, &CAPTURE_ROUTE).await;
    let addr: std::net::SocketAddr = admin.url.trim_start_matches("http://").parse().unwrap();
    async fn get_healthz(c: &mut tokio::net::TcpStream) -> bool {
        if c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.is_err() {
            return false;
        }
        let mut buf = [0u8; 512];
        matches!(c.read(&mut buf).await, Ok(n) if n > 0 && buf[..n].starts_with(b"HTTP/1.1 200"))
    }
    // One peer (127.0.0.1) opens more connections than the server serves
    // at once and keeps each alive with a request.
    let mut held = Vec::new();
    for _ in 0..300 {
        let Ok(mut c) = tokio::net::TcpStream::connect(addr).await else { continue };
        let answered = tokio::time::timeout(Duration::from_millis(50), get_healthz(&mut c)).await;
        held.push((c, answered.unwrap_or(false)));
    }
    let served = held.iter().filter(|(_, ok)| *ok).count();
    // The probe comes from another address (the kubelet's node).
    let probe = async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut c = socket.connect(addr).await.unwrap();
        get_healthz(&mut c).await
    };
    let answered = tokio::time::timeout(Duration::from_secs(3), probe).await;
    assert!(
        matches!(answered, Ok(true)),
        "the probe from another address got no answer while one peer held {served} served connections"
    );
    drop(held);
    assert!(p.terminate(Duration::from_secs(30)).unwrap().success());
}

// Issue 28, D4 and D8: dead outbox rows hold their key and uncertain intents
// wait for an operator, so both need commands that do not mean editing
// `state` by hand — in the admin API and in the CLI, beside a running relay.
#[tokio::test(flavor = "multi_thread")]
async fn operators_replay_and_skip_dead_outbox_rows_and_resolve_uncertain_intents_by_api_and_cli() {
    let h = Harness::new(1).await;
    // Four dead outbox rows (keys o-1 … o-4), as a publisher left them.
    relay_testkit::seed::pending_outbox(&h.db.pool, &h.consumer, &h.out, 4).await.unwrap();
    sqlx::query("UPDATE relay.outbox SET state = 'dead', attempts = 1, last_error = 'unknown topic (seeded)'")
        .execute(&h.db.pool)
        .await
        .unwrap();
    let rows: Vec<String> =
        sqlx::query_scalar("SELECT id::text FROM relay.outbox ORDER BY seq").fetch_all(&h.db.pool).await.unwrap();
    // Two captures whose only attempt timed out after the provider applied them: uncertain.
    h.provider.set_faults(vec![FaultRule {
        path_prefix: None,
        key_prefix: Some("capture:o-unc".into()),
        times: None,
        kind: FaultKind::TimeoutAfterApply { delay_ms: 1_500 },
    }]);
    let text = h.config_text(&CAPTURE_ROUTE).replace("max_attempts = 5", "max_attempts = 1");
    let ((mut p, admin), config) = run_with_admin_config(&h, &text).await;
    h.send(&order("evt-u1", "o-unc1")).await;
    h.send(&order("evt-u2", "o-unc2")).await;
    let uncertain: Vec<String> = eventually("two uncertain intents", DEADLINE, || async {
        let ids: Vec<String> =
            sqlx::query_scalar("SELECT id::text FROM relay.intents WHERE state = 'uncertain' ORDER BY idempotency_key")
                .fetch_all(&h.db.pool)
                .await
                .unwrap();
        (ids.len() == 2).then_some(ids)
    })
    .await;
    let state = async |id: &str| -> String {
        sqlx::query_scalar("SELECT state FROM relay.outbox WHERE id = $1::uuid")
            .bind(id)
            .fetch_one(&h.db.pool)
            .await
            .unwrap()
    };
    let post = async |path: &str, body: Value| -> (u16, Value) {
        let res = admin.http.post(format!("{}{path}", admin.url)).bearer_auth(TOKEN).json(&body).send().await.unwrap();
        (res.status().as_u16(), res.json().await.unwrap_or(Value::Null))
    };

    // The API: list, show, refuse a bad filter, replay one, skip one.
    let dead = admin.api(reqwest::Method::GET, "/api/outbox?state=dead", None).await;
    assert_eq!(dead["items"].as_array().unwrap().len(), 4, "{dead}");
    let (status, body) = admin.get("/api/outbox?state=deadd", Some(TOKEN)).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(admin.get("/api/outbox", None).await.0, 401);
    let row = admin.api(reqwest::Method::GET, &format!("/api/outbox/{}", rows[0]), None).await;
    assert_eq!((row["row"]["state"].as_str(), row["row"]["ordering_key"].as_str()), (Some("dead"), Some("o-1")));
    admin.api(reqwest::Method::POST, &format!("/api/outbox/{}/replay", rows[0]), None).await;
    admin.api(reqwest::Method::POST, &format!("/api/outbox/{}/skip", rows[1]), None).await;
    assert_eq!(post(&format!("/api/outbox/{}/skip", rows[1]), json!({})).await.0, 409, "only dead rows are skipped");
    eventually("the replayed row published", DEADLINE, || async {
        (state(&rows[0]).await == "published").then_some(())
    })
    .await;
    assert_eq!(state(&rows[1]).await, "skipped");

    // The CLI: the same on the other two.
    let (ok, out) = cli(&h, &config, &["outbox", "list", "--state", "dead"]).await;
    assert!(ok && out.contains(&rows[2]) && out.contains(&rows[3]) && !out.contains(&rows[0]), "{out}");
    let (ok, out) = cli(&h, &config, &["outbox", "show", &rows[2]]).await;
    assert!(ok && out.contains("dead after 1 attempts") && out.contains("unknown topic (seeded)"), "{out}");
    let (ok, out) = cli(&h, &config, &["outbox", "skip", &rows[3]]).await;
    assert!(ok && out.contains("add --yes"), "{out}");
    assert_eq!(state(&rows[3]).await, "dead", "not skipped without --yes");
    let (ok, out) = cli(&h, &config, &["outbox", "skip", "--yes", &rows[3]]).await;
    assert!(ok, "{out}");
    let (ok, out) = cli(&h, &config, &["outbox", "replay", &rows[2], &rows[3]]).await;
    assert!(!ok && out.contains("1 of 2 outbox row(s) were not queued again"), "a skipped row is not replayed: {out}");
    eventually("the row replayed from the CLI published", DEADLINE, || async {
        (state(&rows[2]).await == "published").then_some(())
    })
    .await;
    assert_eq!(state(&rows[3]).await, "skipped");

    // Resolving: the API as succeeded, the CLI as failed; each records its
    // route's effects, and only once.
    let note = "PSP dashboard: captured";
    let (status, body) =
        post(&format!("/api/intents/{}/resolve", uncertain[0]), json!({"resolution": "succeeded", "note": note})).await;
    assert_eq!(status, 200, "{body}");
    let again = post(&format!("/api/intents/{}/resolve", uncertain[0]), json!({"resolution": "failed"})).await;
    assert_eq!(again.0, 409, "a resolved intent is not resolved again: {}", again.1);
    let args = ["intents", "resolve", &uncertain[1], "--failed", "--note", "PSP support: never arrived"];
    let (ok, out) = cli(&h, &config, &args).await;
    assert!(ok && out.contains("on_dead effects are recorded"), "{out}");
    let ended: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT state, last_error FROM relay.intents WHERE id = ANY($1::uuid[]) ORDER BY idempotency_key",
    )
    .bind(&uncertain)
    .fetch_all(&h.db.pool)
    .await
    .unwrap();
    assert_eq!(ended[0].0, "succeeded");
    assert!(ended[0].1.as_deref().unwrap_or("").contains(note), "the note is kept: {ended:?}");
    assert_eq!(ended[1].0, "dead");
    assert!(ended[1].1.as_deref().unwrap_or("").contains("never arrived"), "{ended:?}");
    let events = relay_testkit::read_topic(&h.bootstrap, &h.out, 4).await.unwrap();
    let mut types: Vec<&str> = events.iter().filter_map(|r| r.header("ce_type")).collect();
    types.sort();
    assert_eq!(types, ["order.accepted", "order.accepted", "payment.captured", "payment.failed"]);
    assert_eq!(h.provider.stats().requests_for("capture:o-unc1"), 1, "resolving makes no call");
    assert!(p.terminate(Duration::from_secs(30)).unwrap().success(), "{}", p.log());
}

/// The OpenAPI description is served without the token, is the checked-in
/// `docs/openapi.json`, is valid OpenAPI (checked by an independent
/// validator, `openapi-spec-validator` from PyPI), and every operation it
/// names is a served route behind the token: none answers the router's own
/// 404 or 405, each answers 401 without the token.
#[tokio::test(flavor = "multi_thread")]
async fn the_served_openapi_description_is_valid_and_names_only_served_routes() {
    let h = Harness::new(1).await;
    let routes = two_routes().replace("PROVIDER", &h.provider.url());
    let (mut p, admin) = run_with_admin(&h, &routes).await;
    let (status, served) = admin.get("/api/openapi.json", None).await;
    assert_eq!(status, 200, "{served}");
    let checked_in = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json")).unwrap();
    assert_eq!(served, checked_in, "the served description is docs/openapi.json");

    let python = std::env::var("RELAY_TEST_PYTHON").expect("RELAY_TEST_PYTHON is not set: run scripts/test.sh");
    let file = std::env::temp_dir().join(format!("{}.json", relay_testkit::unique("openapi")));
    std::fs::write(&file, &served).unwrap();
    let out = std::process::Command::new(python).args(["-m", "openapi_spec_validator"]).arg(&file).output().unwrap();
    assert!(
        out.status.success(),
        "not valid OpenAPI: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let doc: Value = serde_json::from_str(&served).unwrap();
    let paths = doc["paths"].as_object().unwrap();
    assert!(paths.len() >= 20, "{:?}", paths.keys());
    let mut operations = 0;
    for (path, item) in paths {
        let concrete = path
            .replace("/dead-letters/{id}", "/dead-letters/999999")
            .replace("{id}", "00000000-0000-4000-8000-000000000000")
            .replace("{kind}", "route")
            .replace("{name}", "nope");
        // The same operation with a malformed id, query and body.
        let malformed =
            path.replace("{id}", "abc").replace("{kind}", "neither").replace("{name}", "nope") + "?limit=many";
        for (method, op) in item.as_object().unwrap() {
            operations += 1;
            let method: reqwest::Method = method.to_uppercase().parse().unwrap();
            let documented: Vec<&String> = op["responses"].as_object().unwrap().keys().collect();
            let call = |url: &str, body: Option<&str>, token: Option<&str>| {
                let mut req = admin.http.request(method.clone(), format!("{}{url}", admin.url));
                if method == reqwest::Method::POST {
                    req = req.header("content-type", "application/json").body(body.unwrap_or("{}").to_owned());
                }
                if let Some(t) = token {
                    req = req.bearer_auth(t);
                }
                req.send()
            };
            let open = op.get("security") == Some(&json!([{}]));
            for (url, body) in [(&concrete, None), (&malformed, Some("not json")), (&concrete, Some("[1]"))] {
                let res = call(url, body, Some(TOKEN)).await.unwrap();
                let status = res.status().as_u16();
                let text = res.text().await.unwrap_or_default();
                assert_ne!(status, 405, "{method} {path} is not served");
                // A handler's 404 says what it did not find; the router's is empty.
                assert!(status != 404 || text.contains("\"error\""), "{method} {path} is not served: 404 {text:?}");
                assert!(
                    documented.iter().any(|d| **d == status.to_string()),
                    "{method} {url} {body:?} answered {status}, which its description does not list ({documented:?}): {text}"
                );
            }
            if !open {
                assert_eq!(
                    call(&concrete, None, None).await.unwrap().status().as_u16(),
                    401,
                    "{method} {path} without the token"
                );
            }
        }
    }
    assert!(operations >= 23, "{operations} operations");
    assert!(p.terminate(Duration::from_secs(30)).unwrap().success());
}
