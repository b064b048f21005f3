//! The outbox from any application (issue 30): a service that never links
//! relay enqueues events and calls with `relay.publish` and `relay.call` in
//! its own transactions, as a member of the enqueue role. Rolled back,
//! nothing is sent; committed (once, or retried after an ambiguous commit,
//! or the application killed right after its commit), relay publishes and
//! calls once. The examples in `examples/` are run as they are.

pub mod support;

use std::time::Duration;

use relay::{Components, Handlers};
use relay_cli::verify::{ProviderEffect, VerifyOptions, verify};
use relay_core::ids::app_id;
use relay_testkit::read_topic;
use sqlx::{Connection, PgConnection};
use support::*;

const DELIVERY: Components = Components { consumer: false, dispatcher: true, publisher: true };

/// Applications may publish to {out} and call psp.
const FRONT_DOOR: &str = r#"
[application]
topics = ["{out}"]
endpoints = ["psp"]
"#;

/// The URL of the test database for the application's login role (a
/// member of `relay_enqueue`, created as a DBA would by scripts/lib.sh).
fn app_url(h: &Harness) -> String {
    let base = std::env::var("RELAY_TEST_APP_DATABASE_URL").expect(
        "RELAY_TEST_APP_DATABASE_URL is not set: run the tests with scripts/test.sh, which creates the roles \
         relay_enqueue and relay_app (ensure_application_roles in scripts/lib.sh) and sets it",
    );
    let (server, _) = base.rsplit_once('/').expect("a database URL");
    format!("{server}/{}", h.db.name)
}

/// The application's own table, which its transactions write beside the
/// relay rows.
async fn orders_table(h: &Harness) {
    sqlx::query("CREATE TABLE public.orders (id text PRIMARY KEY, amount_cents integer NOT NULL)")
        .execute(&h.db.pool)
        .await
        .unwrap();
    sqlx::query("GRANT SELECT, INSERT ON public.orders TO relay_enqueue").execute(&h.db.pool).await.unwrap();
}

fn examples() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

async fn run(cmd: &mut tokio::process::Command) -> (Option<i32>, String) {
    let out = tokio::time::timeout(DEADLINE, cmd.output()).await.expect("the example ends").expect("it runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code(), text)
}

/// The Python example with `args`, as the application's role.
async fn python(h: &Harness, args: &[&str]) -> (Option<i32>, String) {
    let python = std::env::var("RELAY_TEST_PYTHON").expect(
        "RELAY_TEST_PYTHON is not set: run the tests with scripts/test.sh, which installs psycopg into \
         .cache/python (ensure_python_example_deps in scripts/lib.sh) and sets it",
    );
    run(tokio::process::Command::new(python)
        .arg(examples().join("python/enqueue.py"))
        .args(args)
        .env("DATABASE_URL", app_url(h))
        .env("RELAY_TOPIC", &h.out))
    .await
}

fn effects(h: &Harness) -> Vec<ProviderEffect> {
    h.provider
        .applied()
        .into_iter()
        .map(|a| ProviderEffect { idempotency_key: a.key, intent_id: a.intent_id })
        .collect()
}

#[tokio::test]
async fn rows_an_application_enqueues_are_sent_once_if_committed_and_never_if_rolled_back() {
    let h = Harness::new(1).await;
    orders_table(&h).await;
    let cfg = h.config(FRONT_DOOR);
    // Registers the front door, as `relay migrate` and every start do.
    h.relay(cfg.clone(), Handlers::default(), no_faults()).await;

    // psql: one transaction rolled back, one committed.
    let (code, out) = run(tokio::process::Command::new("psql")
        .arg(app_url(&h))
        .args(["-X", "-q", "-v", &format!("topic={}", h.out), "-v", "order=o-psql", "-f"])
        .arg(examples().join("psql/enqueue.sql")))
    .await;
    assert_eq!(code, Some(0), "{out}");
    // Python: rolled back; committed, then run again (a retry after an
    // ambiguous commit); committed and killed before relay sent anything.
    let (code, out) = python(&h, &["o-py-rb", "--rollback"]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("\"committed\": false"), "{out}");
    for _ in 0..2 {
        let (code, out) = python(&h, &["o-py"]).await;
        assert_eq!(code, Some(0), "{out}");
    }
    let (code, out) = python(&h, &["o-py-killed", "--die-after-commit"]).await;
    assert_eq!(code, None, "killed by its own SIGKILL: {out}");
    assert!(out.contains("\"committed\": true"), "it committed first: {out}");

    let committed = ["o-psql", "o-py", "o-py-killed"];
    assert_eq!(h.db.count("outbox", "action = 'application'").await, 3, "one event per committed order");
    assert_eq!(h.db.count("intents", "action = 'application'").await, 3, "one call per committed order");

    let run = h.start(cfg.clone(), DELIVERY, no_faults()).await;
    h.await_published(3).await;
    h.await_intents_finished(3).await;
    let records = read_topic(&h.bootstrap, &h.out, 3).await.unwrap();
    run.stop().await.unwrap();

    let mut keys: Vec<String> =
        records.iter().map(|r| String::from_utf8_lossy(r.key.as_deref().unwrap_or_default()).into_owned()).collect();
    keys.sort();
    assert_eq!(keys, ["o-psql", "o-py", "o-py-killed"], "each committed event once, none rolled back");
    for r in &records {
        let order = String::from_utf8_lossy(r.key.as_deref().unwrap()).into_owned();
        let id = app_id(&h.consumer, "publish", &format!("order-{order}-placed"));
        assert_eq!(r.headers.get("ce_id"), Some(&id.to_string()), "the id relay derives from the business key");
        assert_eq!(r.headers.get("ce_type").map(String::as_str), Some("order.placed"));
        assert_eq!(r.headers.get("ce_source"), Some(&format!("/relay/{}/application", h.consumer)));
        assert_eq!(r.headers.get("content-type").map(String::as_str), Some("application/json"));
        let data: serde_json::Value = serde_json::from_slice(r.payload.as_deref().unwrap()).unwrap();
        assert_eq!(data["order_id"], order.as_str());
    }
    let stats = h.provider.stats();
    for order in committed {
        assert_eq!(stats.applied_for(&format!("capture:{order}")), 1, "{order} captured once");
    }
    for order in ["o-psql-rolled-back", "o-py-rb"] {
        assert_eq!(stats.applied_for(&format!("capture:{order}")), 0, "{order} was rolled back");
    }
    let report =
        verify(&cfg, &h.db.pool, &VerifyOptions { effects: Some(effects(&h)), grace: Duration::from_secs(30) })
            .await
            .expect("verify runs");
    assert!(report.ok(), "{}", report.render());
    assert_eq!(report.published_rows, 3);
}

/// What `relay.publish` or `relay.call` was refused with.
async fn refused(conn: &mut PgConnection, sql: &str) -> String {
    let err = sqlx::query(sql).execute(&mut *conn).await.expect_err(sql);
    let db = err.as_database_error().unwrap_or_else(|| panic!("{sql}: {err}"));
    assert_eq!(db.code().as_deref(), Some("22023"), "{sql}: {err}");
    db.message().to_owned()
}

#[tokio::test]
async fn the_front_door_refuses_what_could_never_be_sent_naming_the_field() {
    let h = Harness::new(1).await;
    let mut conn = PgConnection::connect(&app_url(&h)).await.unwrap();
    // Before any relay granted the role anything: no way in.
    let err = sqlx::query("SELECT relay.publish('t', 'k', 'x', '{}', id => 'a')").execute(&mut conn).await.unwrap_err();
    assert_eq!(err.as_database_error().and_then(|d| d.code()).as_deref(), Some("42501"), "{err}");
    // Granted, then closed (the [application] section taken out): the cause and the fix.
    h.relay(h.config(FRONT_DOOR), Handlers::default(), no_faults()).await;
    h.relay(h.config(""), Handlers::default(), no_faults()).await;
    let closed = refused(&mut conn, "SELECT relay.publish('t', 'k', 'x', '{}', id => 'a')").await;
    assert!(closed.starts_with("relay.publish: consumer: no relay deployment takes rows"), "{closed}");

    let mut cfg = h.config(FRONT_DOOR);
    cfg.application.as_mut().unwrap().max_payload_bytes = 64;
    h.relay(cfg.clone(), Handlers::default(), no_faults()).await;
    let out = &h.out;
    let cases = [
        (
            "SELECT relay.publish('elsewhere', 'k', 'x', '{}', id => 'a')".to_string(),
            "relay.publish: topic: 'elsewhere'",
        ),
        (
            format!("SELECT relay.publish('{out}', NULL, 'x', '{{}}', id => 'a', ordered => true)"),
            "relay.publish: key: an ordered event needs a key",
        ),
        (format!("SELECT relay.publish('{out}', 'k', '', '{{}}', id => 'a')"), "relay.publish: type: "),
        (format!("SELECT relay.publish('{out}', 'k', 'x', '{{}}', id => '')"), "relay.publish: id: "),
        (format!("SELECT relay.publish('{out}', 'k', 'x', NULL, id => 'a')"), "relay.publish: data: "),
        (
            format!("SELECT relay.publish('{out}', 'k', 'x', jsonb_build_object('pad', repeat('x', 100)), id => 'a')"),
            "relay.publish: data: 111 bytes, more than the 64",
        ),
        (
            format!(
                "SELECT relay.publish('{out}', 'k', 'x', '{{}}', id => 'a', headers => '{{\"ce_id\": \"forged\"}}')"
            ),
            "relay.publish: headers: 'ce_id' is relay's to set",
        ),
        (
            format!("SELECT relay.publish('{out}', 'k', 'x', '{{}}', id => 'a', headers => '{{\"n\": 1}}')"),
            "relay.publish: headers: the value of 'n' is number",
        ),
        (
            format!("SELECT relay.publish('{out}', 'k', 'x', '{{}}', id => 'a', consumer => 'other')"),
            "relay.publish: consumer: no relay deployment named 'other'",
        ),
        ("SELECT relay.call('nowhere', 'POST', '/x', '{}', id => 'a')".into(), "relay.call: endpoint: 'nowhere'"),
        ("SELECT relay.call('psp', 'FETCH', '/x', '{}', id => 'a')".into(), "relay.call: method: 'FETCH'"),
        ("SELECT relay.call('psp', 'POST', 'x', '{}', id => 'a')".into(), "relay.call: path: 'x'"),
        ("SELECT relay.call('psp', 'POST', '/x', '{}', id => NULL)".into(), "relay.call: id: "),
        (
            "SELECT relay.call('psp', 'POST', '/x', '{}', id => 'a', idempotency_key => '')".into(),
            "relay.call: idempotency_key: empty",
        ),
        (
            "SELECT relay.call('psp', 'POST', '/x', jsonb_build_object('pad', repeat('x', 100)), id => 'a')".into(),
            "relay.call: body: 111 bytes",
        ),
    ];
    for (sql, expected) in &cases {
        let message = refused(&mut conn, sql).await;
        assert!(message.starts_with(expected), "{sql}\n  said: {message}\n  not: {expected}…");
    }
    assert_eq!(h.db.count("outbox", "true").await + h.db.count("intents", "true").await, 0, "nothing enqueued");

    // A provider with a key limit: the key is checked against it.
    let mut strict = cfg.clone();
    strict.endpoints.get_mut("psp").unwrap().idempotency.max_length = Some(8);
    h.relay(strict, Handlers::default(), no_faults()).await;
    let long = refused(
        &mut conn,
        "SELECT relay.call('psp', 'POST', '/x', '{}', id => 'a', idempotency_key => 'far-too-long')",
    )
    .await;
    assert!(long.starts_with("relay.call: idempotency_key: 12 characters; endpoint 'psp'"), "{long}");
    let default_key = refused(&mut conn, "SELECT relay.call('psp', 'POST', '/x', '{}', id => 'a')").await;
    assert!(default_key.contains("36 characters"), "the default key is the call's id: {default_key}");
}

#[tokio::test]
async fn the_database_derives_the_ids_relay_derives_and_a_retried_transaction_enqueues_nothing_twice() {
    let h = Harness::new(1).await;
    h.relay(h.config(FRONT_DOOR), Handlers::default(), no_faults()).await;
    for (kind, key) in [("publish", "order-1-placed"), ("call", "capture-1"), ("publish", "ünï-cödé ✓"), ("call", "")]
    {
        let sql: uuid::Uuid = sqlx::query_scalar("SELECT relay.app_id($1, $2, $3)")
            .bind(&h.consumer)
            .bind(kind)
            .bind(key)
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
        assert_eq!(sql, app_id(&h.consumer, kind, key), "{kind}/{key}");
        assert_eq!(sql.get_version_num(), 8);
    }
    let mut conn = PgConnection::connect(&app_url(&h)).await.unwrap();
    let publish = format!("SELECT relay.publish('{}', 'o-1', 'order.placed', '{{\"n\": 1}}', id => 'evt-1')", h.out);
    let call = "SELECT relay.call('psp', 'POST', '/captures/o-1', '{}', id => 'cap-1', ordering_key => 'o-1')";
    let mut ids = Vec::new();
    for _ in 0..2 {
        let mut tx = conn.begin().await.unwrap();
        let e: uuid::Uuid = sqlx::query_scalar(&publish).fetch_one(&mut *tx).await.unwrap();
        let c: uuid::Uuid = sqlx::query_scalar(call).fetch_one(&mut *tx).await.unwrap();
        tx.commit().await.unwrap();
        ids.push((e, c));
    }
    assert_eq!(ids[0], ids[1]);
    assert_eq!(h.db.count("outbox", "true").await, 1);
    assert_eq!(h.db.count("intents", "true").await, 1);
    let (max_attempts, idempotency_key, ordering_key): (i32, String, Option<String>) =
        sqlx::query_as("SELECT max_attempts, idempotency_key, ordering_key FROM relay.intents")
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
    assert_eq!((max_attempts, idempotency_key, ordering_key.as_deref()), (5, ids[0].1.to_string(), Some("o-1")));
}

#[tokio::test]
async fn the_enqueue_role_can_enqueue_and_do_nothing_else() {
    let h = Harness::new(1).await;
    h.relay(h.config(FRONT_DOOR), Handlers::default(), no_faults()).await;
    let mut conn = PgConnection::connect(&app_url(&h)).await.unwrap();
    sqlx::query(&format!("SELECT relay.publish('{}', 'k', 'x', '{{}}', id => 'ok')", h.out))
        .execute(&mut conn)
        .await
        .expect("the role enqueues");
    let denied = [
        "SELECT count(*) FROM relay.intents",
        "SELECT count(*) FROM relay.outbox",
        "SELECT count(*) FROM relay.app_front_doors",
        "UPDATE relay.outbox SET state = 'running', lease_token = gen_random_uuid(), locked_until = now()",
        "UPDATE relay.intents SET state = 'succeeded'",
        "INSERT INTO relay.outbox (id, consumer, source_id, action, topic) VALUES (gen_random_uuid(), 'c', 's', 'a', 't')",
        "DELETE FROM relay.inbox",
        "SELECT relay.app_id('c', 'publish', 'k')",
        "SELECT relay.app_front_door('publish', NULL)",
    ];
    for sql in denied {
        let err = sqlx::query(sql).execute(&mut conn).await.expect_err(sql);
        let code = err.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned());
        assert_eq!(code.as_deref(), Some("42501"), "{sql} must be refused for lack of privilege: {err}");
    }
    assert_eq!(h.db.count("outbox", "state = 'pending'").await, 1);
}

#[tokio::test]
async fn ten_thousand_events_enqueued_in_one_transaction_are_all_published_once() {
    let h = Harness::new(1).await;
    let cfg = h.config(FRONT_DOOR);
    h.relay(cfg.clone(), Handlers::default(), no_faults()).await;
    let mut conn = PgConnection::connect(&app_url(&h)).await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT count(relay.publish('{}', 'k-' || (n % 50), 'order.placed', jsonb_build_object('n', n),
                                    id => 'bulk-' || n))
           FROM generate_series(1, 10000) AS n",
        h.out
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let run = h.start(cfg, DELIVERY, no_faults()).await;
    h.await_published(10_000).await;
    let records = read_topic(&h.bootstrap, &h.out, 10_000).await.unwrap();
    run.stop().await.unwrap();
    let ids: std::collections::HashSet<&String> = records.iter().filter_map(|r| r.headers.get("ce_id")).collect();
    assert_eq!((records.len(), ids.len()), (10_000, 10_000), "each event once");
    // Per key, in the order they were enqueued.
    let mut last: std::collections::HashMap<Vec<u8>, i64> = std::collections::HashMap::new();
    for r in &records {
        let data: serde_json::Value = serde_json::from_slice(r.payload.as_deref().unwrap()).unwrap();
        let n = data["n"].as_i64().unwrap();
        let prev = last.insert(r.key.clone().unwrap(), n);
        assert!(prev.is_none_or(|p| p < n), "key {:?}: {n} after {prev:?}", r.key);
    }
}
