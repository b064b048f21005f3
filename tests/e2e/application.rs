//! The outbox from any application (issue 30): a service that never links
//! relay enqueues events and calls with `relay.publish` and `relay.call` in
//! its own transactions, as a member of the enqueue role. Rolled back,
//! nothing is sent; committed (once, or retried after an ambiguous commit,
//! or the application killed right after its commit), relay publishes and
//! calls once. The examples in `examples/` are run as they are.

use std::time::Duration;

use crate::support::*;
use relay::{Components, Handlers};
use relay_cli::verify::{VerifyOptions, verify};
use relay_core::ids::app_id;
use relay_testkit::process::PrivatePostgres;
use relay_testkit::read_topic;
use sqlx::{Connection, PgConnection};

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
    python_at(&app_url(h), &h.out, args).await
}

/// The Python example with `args` on database `url`, publishing to `topic`.
async fn python_at(url: &str, topic: &str, args: &[&str]) -> (Option<i32>, String) {
    let python = std::env::var("RELAY_TEST_PYTHON").expect(
        "RELAY_TEST_PYTHON is not set: run the tests with scripts/test.sh, which installs psycopg into \
         .cache/python (ensure_python_example_deps in scripts/lib.sh) and sets it",
    );
    run(tokio::process::Command::new(python)
        .arg(examples().join("python/enqueue.py"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("RELAY_TOPIC", topic))
    .await
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
        assert_eq!(stats.applied_for(&format!("app:capture:{order}")), 1, "{order} captured once");
    }
    for order in ["o-psql-rolled-back", "o-py-rb"] {
        assert_eq!(stats.applied_for(&format!("app:capture:{order}")), 0, "{order} was rolled back");
    }
    let report = verify(
        &cfg,
        &h.db.pool,
        &VerifyOptions { effects: Some(h.provider_effects()), grace: Duration::from_secs(30) },
    )
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
    // Granted, then closed (the [application] section taken out): the role
    // loses its grants again, as no door names it.
    h.relay(h.config(FRONT_DOOR), Handlers::default(), no_faults()).await;
    h.relay(h.config(""), Handlers::default(), no_faults()).await;
    let err = sqlx::query("SELECT relay.publish('t', 'k', 'x', '{}', id => 'a')").execute(&mut conn).await.unwrap_err();
    assert_eq!(err.as_database_error().and_then(|d| d.code()).as_deref(), Some("42501"), "{err}");
    // relay itself, with no door open, hears the cause and the fix.
    let closed =
        refused(&mut h.db.pool.acquire().await.unwrap(), "SELECT relay.publish('t', 'k', 'x', '{}', id => 'a')").await;
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
    let sent = "relay.call: idempotency_key: 16 characters as sent (the key given with relay's app: prefix); \
                endpoint 'psp'";
    assert!(long.starts_with(sent), "{long}");
    let default_key = refused(&mut conn, "SELECT relay.call('psp', 'POST', '/x', '{}', id => 'a')").await;
    assert!(
        default_key.contains("40 characters as sent (the call's id with relay's app: prefix)"),
        "the default key is the call's id, in the applications' key space: {default_key}"
    );
}

/// A role the DBA created for a second deployment; relay_app is not in it
/// (scripts/lib.sh, ensure_application_roles).
const OTHER_ROLE: &str = "relay_enqueue_other";

/// SQLSTATE and message of what `sql` was refused with.
async fn refused_with(conn: &mut PgConnection, sql: &str) -> (String, String) {
    let err = sqlx::query(sql).execute(&mut *conn).await.expect_err(sql);
    let db = err.as_database_error().unwrap_or_else(|| panic!("{sql}: {err}"));
    (db.code().unwrap_or_default().into_owned(), db.message().to_owned())
}

#[tokio::test]
async fn text_that_becomes_a_key_a_header_or_a_url_is_bounded_and_clean() {
    let h = Harness::new(1).await;
    h.relay(h.config(FRONT_DOOR), Handlers::default(), no_faults()).await;
    let mut conn = PgConnection::connect(&app_url(&h)).await.unwrap();
    let out = &h.out;
    let publish = |args: &str| format!("SELECT relay.publish('{out}', {args})");
    let call = |args: &str| format!("SELECT relay.call('psp', {args})");
    let many: String = (0..65).map(|n| format!("\"x-h{n}\": \"v\"")).collect::<Vec<_>>().join(", ");
    let cases = [
        (publish("'  ', 'x', '{}', id => 'a'"), "relay.publish: key: blank"),
        (publish("repeat('k', 1025), 'x', '{}', id => 'a'"), "relay.publish: key: 1025 bytes, over the 1024-byte"),
        (
            publish("'a' || chr(13) || 'b', 'x', '{}', id => 'a'"),
            "relay.publish: key: holds the control character U+000D",
        ),
        (publish("'k', 'x', '{}', id => 'a' || chr(10)"), "relay.publish: id: holds the control character U+000A"),
        (publish("'k', 'x', '{}', id => repeat('i', 1025)"), "relay.publish: id: 1025 bytes"),
        (publish("'k', 'x' || chr(1), '{}', id => 'a'"), "relay.publish: type: holds the control character U+0001"),
        (
            publish("'k', 'x', '{}', id => 'a', traceparent => '00-' || chr(133)"),
            "relay.publish: traceparent: holds the control character U+0085",
        ),
        (
            publish("'k', 'x', '{}', id => 'a', headers => '{\"bad name\": \"x\"}'"),
            "relay.publish: headers: 'bad name' is not a header name",
        ),
        (
            publish(
                "'k', 'x', '{}', id => 'a', headers => jsonb_build_object('x-ok', 'a' || chr(13) || chr(10) || 'b')",
            ),
            "relay.publish: headers.x-ok: holds the control character U+000D",
        ),
        (
            publish(&format!("'k', 'x', '{{}}', id => 'a', headers => '{{{many}}}'")),
            "relay.publish: headers: 65 headers",
        ),
        (
            call("'POST', '/x', '{}', id => 'a', headers => '{\"Authorization\": \"Bearer app\"}'"),
            "relay.call: headers: 'Authorization' is relay's to set",
        ),
        // Sent as HTTP headers, which carry printable ASCII only: such a
        // call could never be built, and ended dead with its on_dead.
        (
            call("'POST', '/x', '{}', id => 'a', headers => '{\"x-note\": \"café\"}'"),
            "relay.call: headers.x-note: holds 'é' at character 4; it is sent as an HTTP header",
        ),
        (
            call("'POST', '/x', '{}', id => 'a', idempotency_key => 'clé-1'"),
            "relay.call: idempotency_key: holds 'é' at character 3",
        ),
        (
            call("'POST', '/x', '{}', id => 'a', correlation_id => 'ü'"),
            "relay.call: correlation_id: holds 'ü' at character 1",
        ),
        // An event's Kafka headers carry any text.
        (
            publish(
                "'k', 'x', '{}', id => 'a', correlation_id => 'ü', headers => '{\"x-note\": \"é\"}', subject => repeat('s', 2000)",
            ),
            "relay.publish: subject",
        ),
        (
            call("'POST', '/x', '{}', id => 'a', headers => '{\"Idempotency-Key\": \"mine\"}'"),
            "relay.call: headers: 'Idempotency-Key' is relay's to set",
        ),
        (call("'POST', '/x', '{}', id => 'a', headers => '{\"Host\": \"evil.test\"}'"), "relay.call: headers: 'Host'"),
        (
            call("'POST', '/x', '{}', id => 'a', headers => '{\"X-Relay-Attempt\": \"1\"}'"),
            "relay.call: headers: 'X-Relay-Attempt' is relay's to set",
        ),
        (
            call("'POST', '/x', '{}', id => 'a', headers => '{\"webhook-signature\": \"v1,x\"}'"),
            "relay.call: headers: 'webhook-signature'",
        ),
        (call("'POST', '/../admin', '{}', id => 'a'"), "relay.call: path: '/../admin' holds a . or .. segment"),
        (call("'POST', '/captures/%2E%2e/admin', '{}', id => 'a'"), "relay.call: path: '/captures/%2E%2e/admin' holds"),
        (call("'POST', '/a/./b?x=1', '{}', id => 'a'"), "relay.call: path: '/a/./b?x=1' holds"),
        (call("'POST', '/x#frag', '{}', id => 'a'"), "relay.call: path: '/x#frag' must start with /"),
        (call("'POST', '/x' || chr(127), '{}', id => 'a'"), "relay.call: path: holds the control character U+007F"),
        (
            call("'POST', '/x', '{}', id => 'a', idempotency_key => 'k' || chr(10)"),
            "relay.call: idempotency_key: holds the control character U+000A",
        ),
        (call("'POST', '/x', '{}', id => 'a', ordering_key => ' '"), "relay.call: ordering_key: blank"),
        (
            call("'POST', '/x', '{}', id => 'a', correlation_id => 'c' || chr(9)"),
            "relay.call: correlation_id: holds the control character U+0009",
        ),
        (publish("chr(160) || ' ' || chr(12288), 'x', '{}', id => 'a'"), "relay.publish: key: blank"),
        (call("'POST', '/captures/..;/admin', '{}', id => 'a'"), "relay.call: path: '/captures/..;/admin' holds"),
        (call("'POST', '/captures/..%2Fadmin', '{}', id => 'a'"), "relay.call: path: '/captures/..%2Fadmin' must"),
        (call("'POST', '/captures/%252e%252e/admin', '{}', id => 'a'"), "relay.call: path: '/captures/%252e"),
        (call("'POST', '/a' || chr(92) || 'b', '{}', id => 'a'"), "relay.call: path: E'/a\\\\b' must start with /"),
        (
            call("'POST', '/x', '{}', id => 'a', headers => '{\"X-Original-URL\": \"/admin\"}'"),
            "relay.call: headers: 'X-Original-URL' is relay's to set",
        ),
        (
            call("'POST', '/x', '{}', id => 'a', headers => '{\"User-Agent\": \"mine\"}'"),
            "relay.call: headers: 'User-Agent' is relay's to set",
        ),
    ];
    for (sql, expected) in &cases {
        let (code, message) = refused_with(&mut conn, sql).await;
        assert_eq!(code, "22023", "{sql}: {message}");
        assert!(message.starts_with(expected), "{sql}\n  said: {message}\n  not: {expected}…");
    }
    assert_eq!(h.db.count("outbox", "true").await + h.db.count("intents", "true").await, 0, "nothing enqueued");
    // What is fine still goes: a query string (encoded slashes and percent
    // signs in it too), dots inside segments, headers of the application's own.
    sqlx::query(&call(
        "'GET', '/v1.2/captures/o-1..x?expand=a.b&next=%2Fhome%25', NULL, id => 'ok', headers => '{\"X-Tenant\": \"t-1\"}'",
    ))
    .execute(&mut conn)
    .await
    .expect("a clean call is taken");
    sqlx::query(&publish("'k', 'x', '{}', id => 'ok', headers => '{\"x-tenant\": \"t-1\"}'"))
        .execute(&mut conn)
        .await
        .expect("a clean event is taken");

    // The checks read the same whatever the caller's string settings: on a
    // new connection (PL/pgSQL parses a function's statements once per
    // connection, under the settings of its first call).
    let mut scs = PgConnection::connect(&app_url(&h)).await.unwrap();
    sqlx::query("SET standard_conforming_strings = off").execute(&mut scs).await.unwrap();
    sqlx::query(&call("'POST', '/v1/x', '{}', id => 'scs'")).execute(&mut scs).await.expect("a plain path is taken");
    let (_, message) = refused_with(&mut scs, &call("'POST', '/v1/../x', '{}', id => 'scs-2'")).await;
    assert!(message.starts_with("relay.call: path: '/v1/../x' holds"), "{message}");
    let (_, message) = refused_with(&mut scs, &publish("'k' || chr(10), 'x', '{}', id => 'scs-3'")).await;
    assert!(message.starts_with("relay.publish: key: holds the control character"), "{message}");
    let (_, message) = refused_with(&mut scs, &publish("chr(160), 'x', '{}', id => 'scs-4'")).await;
    assert!(message.starts_with("relay.publish: key: blank"), "{message}");
}

#[tokio::test]
async fn a_door_an_older_relay_registered_takes_nothing_until_registered_again() {
    let h = Harness::new(1).await;
    h.relay(h.config(FRONT_DOOR), Handlers::default(), no_faults()).await;
    let mut conn = PgConnection::connect(&app_url(&h)).await.unwrap();
    // As an older relay writes it: no reserved headers, then no role.
    sqlx::query("UPDATE relay.app_endpoints SET reserved_headers = NULL").execute(&h.db.pool).await.unwrap();
    let with_headers =
        "SELECT relay.call('psp', 'POST', '/x', '{}', id => 'c', headers => '{\"Authorization\": \"x\"}')";
    let (code, message) = refused_with(&mut conn, with_headers).await;
    assert_eq!(code, "22023", "{message}");
    assert!(message.starts_with("relay.call: headers: this endpoint was registered by an older relay"), "{message}");
    sqlx::query("UPDATE relay.app_front_doors SET role = NULL").execute(&h.db.pool).await.unwrap();
    let publish = format!("SELECT relay.publish('{}', 'k', 'x', '{{}}', id => 'e')", h.out);
    let (code, message) = refused_with(&mut conn, &publish).await;
    assert_eq!(code, "42501", "{message}");
    assert!(message.contains("was registered by an older relay"), "{message}");
    // Registered again by this relay: open as configured.
    h.relay(h.config(FRONT_DOOR), Handlers::default(), no_faults()).await;
    sqlx::query(&publish).execute(&mut conn).await.expect("open again");
    let (code, _) = refused_with(&mut conn, with_headers).await;
    assert_eq!(code, "22023", "Authorization is relay's again");
}

#[tokio::test]
async fn a_member_of_one_deployment_s_role_cannot_enqueue_for_another_deployment() {
    let h = Harness::new(1).await;
    h.relay(h.config(FRONT_DOOR), Handlers::default(), no_faults()).await;
    let mut other = h.config(FRONT_DOOR);
    other.consumer.name = format!("{}-other", h.consumer);
    other.application.as_mut().unwrap().role = OTHER_ROLE.into();
    h.relay(other.clone(), Handlers::default(), no_faults()).await;
    let mut conn = PgConnection::connect(&app_url(&h)).await.unwrap();
    let publish = |consumer: &str| {
        format!("SELECT relay.publish('{}', 'k', 'x', '{{}}', id => 'a', consumer => '{consumer}')", h.out)
    };
    sqlx::query(&publish(&h.consumer)).execute(&mut conn).await.expect("its own deployment takes it");
    let (code, message) = refused_with(&mut conn, &publish(&other.consumer.name)).await;
    assert_eq!(code, "42501", "{message}");
    assert!(
        message.contains("role relay_app may not enqueue")
            && message.contains("does not have the privileges of relay_enqueue_other"),
        "{message}"
    );
    let (code, message) =
        refused_with(&mut conn, &format!("SELECT relay.publish('{}', 'k', 'x', '{{}}', id => 'b')", h.out)).await;
    assert_eq!((code.as_str(), message.contains("name one with consumer =>")), ("22023", true), "{message}");

    // The role acted as is judged, not the login: relay_app_wide has both
    // deployments' roles, relay_app_narrow (which it may SET ROLE to) the
    // first one's only.
    let wide_url = app_url(&h).replacen("relay_app:relay_app@", "relay_app_wide:relay_app_wide@", 1);
    let mut wide = PgConnection::connect(&wide_url).await.unwrap();
    sqlx::query(&publish(&other.consumer.name)).execute(&mut wide).await.expect("the login has the other's role");
    sqlx::query("SET ROLE relay_app_narrow").execute(&mut wide).await.unwrap();
    let (code, message) = refused_with(&mut wide, &publish(&other.consumer.name)).await;
    assert_eq!(code, "42501", "{message}");
    assert!(message.contains("role relay_app_narrow may not enqueue"), "{message}");
    sqlx::query(&publish(&h.consumer)).execute(&mut wide).await.expect("the narrow role has the first's");

    // A start that changes nothing writes nothing.
    let stamp = || async {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(
            "SELECT registered_at FROM relay.app_front_doors WHERE consumer = $1",
        )
        .bind(&h.consumer)
        .fetch_one(&h.db.pool)
        .await
        .unwrap()
    };
    let before = stamp().await;
    h.relay(h.config(FRONT_DOOR), Handlers::default(), no_faults()).await;
    assert_eq!(stamp().await, before, "the same registration again is only read");

    // The first deployment moves to the other role: relay_app has no way in
    // any more, and the role given up loses its grants.
    let mut moved = h.config(FRONT_DOOR);
    moved.application.as_mut().unwrap().role = OTHER_ROLE.into();
    h.relay(moved, Handlers::default(), no_faults()).await;
    let (code, message) = refused_with(&mut conn, &publish(&h.consumer)).await;
    assert_eq!(code, "42501", "{message}");
    let granted: bool = sqlx::query_scalar(
        "SELECT has_function_privilege('relay_enqueue',
             'relay.publish(text, text, text, jsonb, text, jsonb, boolean, text, text, text, text, text)', 'EXECUTE')",
    )
    .fetch_one(&h.db.pool)
    .await
    .unwrap();
    assert!(!granted, "relay_enqueue keeps no grant no door names it for");
    assert_eq!(h.db.count("outbox", "true").await, 2, "the allowed events (one id per deployment)");
}

#[tokio::test]
async fn the_front_door_takes_the_key_locks_relay_s_own_writers_take() {
    use relay_store::ordering::{Key, lock};
    let h = Harness::new(1).await;
    h.relay(h.config(FRONT_DOOR), Handlers::default(), no_faults()).await;
    let mut app = PgConnection::connect(&app_url(&h)).await.unwrap();
    let mut tx = app.begin().await.unwrap();
    sqlx::query(&format!("SELECT relay.publish('{}', 'k-1', 'x', '{{}}', id => 'e-1')", h.out))
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("SELECT relay.call('psp', 'POST', '/x', '{}', id => 'c-1', ordering_key => 'o-1')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let keys = [
        (Key::Outbox { topic: &h.out, key: "app:k-1" }, true),
        (Key::Intent("app:o-1"), true),
        (Key::Outbox { topic: &h.out, key: "app:k-2" }, false),
        (Key::Intent("app:o-2"), false),
        // A route's ordering key of the same text is not the application's.
        (Key::Intent("o-1"), false),
        (Key::Outbox { topic: &h.out, key: "k-1" }, false),
    ];
    for (key, held) in keys {
        let mut writer = h.db.pool.begin().await.unwrap();
        sqlx::query("SET LOCAL lock_timeout = '200ms'").execute(&mut *writer).await.unwrap();
        let taken = lock(&mut writer, &h.consumer, [key]).await;
        match (held, taken) {
            (true, Err(e)) => assert_eq!(e.as_database_error().and_then(|d| d.code()).as_deref(), Some("55P03")),
            (false, Ok(())) => {}
            (held, taken) => panic!("{key:?}: held by the application {held}, taken {taken:?}"),
        }
        writer.rollback().await.unwrap();
    }
    tx.rollback().await.unwrap();
}

/// Two names, `{app}{i}` and `{route}{j}` after `prefix`, whose `hashtext`
/// is the same: the advisory lock of one is the other's when both are
/// locked in one name space. Found by grouping 2×200 000 names by hash
/// (about nine 32-bit collisions between the two sides expected).
async fn colliding(h: &Harness, prefix: &str, app: &str, route: &str) -> (String, String) {
    sqlx::query_as(
        "SELECT $2 || min(n) FILTER (WHERE app), $3 || min(n) FILTER (WHERE NOT app)
           FROM (SELECT true AS app, n, hashtext($1 || $2 || n) AS h FROM generate_series(1, 200000) n
                 UNION ALL
                 SELECT false, n, hashtext($1 || $3 || n) FROM generate_series(1, 200000) n) t
          GROUP BY h HAVING bool_or(app) AND NOT bool_and(app)
          LIMIT 1",
    )
    .bind(prefix)
    .bind(app)
    .bind(route)
    .fetch_one(&h.db.pool)
    .await
    .expect("a hashtext collision among 2×200 000 names")
}

// An application could choose an ordering key whose lock collided in
// hashtext with a route's, hold its transaction open, and so stop every
// batch writing that route key (each waits, then fails on lock_timeout).
#[tokio::test]
async fn an_application_s_key_chosen_to_collide_with_a_route_s_lock_does_not_stop_the_route() {
    use relay_store::ordering::{Key, lock};
    let h = Harness::new(1).await;
    h.relay(h.config(FRONT_DOOR), Handlers::default(), no_faults()).await;
    let c = &h.consumer;
    // relay.call stores app:KEY and locks consumer U+0002 app:KEY.
    let (call_key, route_call_key) = colliding(&h, &format!("{c}\u{2}"), "app:a", "r").await;
    let call_key = call_key.strip_prefix("app:").unwrap().to_owned();
    let (event_key, route_event_key) = colliding(&h, &format!("{c}\u{2}{}\u{1}", h.out), "app:e", "r").await;
    let event_key = event_key.strip_prefix("app:").unwrap().to_owned();
    let mut app = PgConnection::connect(&app_url(&h)).await.unwrap();
    let mut tx = app.begin().await.unwrap();
    sqlx::query("SELECT relay.call('psp', 'POST', '/x', '{}', id => 'c-1', ordering_key => $1)")
        .bind(&call_key)
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("SELECT relay.publish($1, $2, 'x', '{}', id => 'e-1')")
        .bind(&h.out)
        .bind(&event_key)
        .execute(&mut *tx)
        .await
        .unwrap();
    for key in [Key::Intent(&route_call_key), Key::Outbox { topic: &h.out, key: &route_event_key }] {
        let mut writer = h.db.pool.begin().await.unwrap();
        sqlx::query("SET LOCAL lock_timeout = '200ms'").execute(&mut *writer).await.unwrap();
        let taken = lock(&mut writer, &h.consumer, [key]).await;
        assert!(taken.is_ok(), "{key:?} waits on the application's transaction: {taken:?}");
        writer.rollback().await.unwrap();
    }
    tx.rollback().await.unwrap();
}

// An application's ordered event on a topic a route also emits to, with
// the route's Kafka key, held the route's events of that key once it ended
// dead (too big for the broker, say): they waited for an operator.
#[tokio::test]
async fn an_application_s_dead_event_never_holds_a_route_s_events_of_its_key() {
    let h = Harness::new(1).await;
    let cfg = h.config(&format!("{FRONT_DOOR}{}", *CAPTURE_ROUTE));
    h.relay(cfg.clone(), Handlers::default(), no_faults()).await;
    let mut app = PgConnection::connect(&app_url(&h)).await.unwrap();
    sqlx::query("SELECT relay.publish($1, 'o-7', 'order.noted', '{}', id => 'note-7')")
        .bind(&h.out)
        .execute(&mut app)
        .await
        .unwrap();
    sqlx::query("UPDATE relay.outbox SET state = 'dead', last_error = 'too big' WHERE action = 'application'")
        .execute(&h.db.pool)
        .await
        .unwrap();
    let data = serde_json::json!({"order_id": "o-7", "amount": 100});
    h.send(&relay_testkit::TestEvent::new("evt-7", "order.placed", data).key("o-7")).await;
    let run = h.start(cfg, relay::Components::ALL, no_faults()).await;
    eventually("the route's payment.captured of o-7 published", DEADLINE, || async {
        let state: Option<String> =
            sqlx::query_scalar("SELECT state FROM relay.outbox WHERE event_type = 'payment.captured'")
                .fetch_optional(&h.db.pool)
                .await
                .unwrap();
        (state.as_deref() == Some("published")).then_some(())
    })
    .await;
    run.stop().await.unwrap();
    let key: String = sqlx::query_scalar("SELECT ordering_key FROM relay.outbox WHERE action = 'application'")
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    assert_eq!(key, "app:o-7");
}

// A claim took up to claim_batch (64) intents whatever their size, and a
// dispatcher held them decoded, with the ones claimed ahead: 128 bodies of
// 900 KiB each, and the JSON trees they decode to, at once.
#[tokio::test]
async fn a_dispatcher_holds_no_more_claimed_json_than_its_byte_room() {
    let h = Harness::new(1).await;
    h.provider.set_faults(vec![example_provider::FaultRule {
        path_prefix: None,
        key_prefix: None,
        times: None,
        kind: example_provider::FaultKind::HoldUntilReleased,
    }]);
    let mut cfg = h.config(FRONT_DOOR);
    // Two of the calls below fit, not three.
    cfg.dispatcher.max_claimed_bytes = 2 * 1024 * 1024;
    h.relay(cfg.clone(), Handlers::default(), no_faults()).await;
    let mut app = PgConnection::connect(&app_url(&h)).await.unwrap();
    for i in 0..8 {
        sqlx::query(
            "SELECT relay.call('psp', 'POST', '/big', jsonb_build_object('pad', repeat('x', 700000)), id => $1)",
        )
        .bind(format!("big-{i}"))
        .execute(&mut app)
        .await
        .unwrap();
    }
    let run = h.start(cfg, DELIVERY, no_faults()).await;
    eventually("two calls at the provider", DEADLINE, || async { (h.provider.stats().requests >= 2).then_some(()) })
        .await;
    let running = h.db.count("intents", "state = 'running'").await;
    assert_eq!(running, 2, "intents claimed while two calls of 700 KB each hold the 2 MiB room");
    h.provider.release_held();
    eventually("every call made", DEADLINE, || async {
        (h.db.count("intents", "state = 'succeeded'").await == 8).then_some(())
    })
    .await;
    run.stop().await.unwrap();
}

// sqlx names its migrations table without a schema, and it was found on
// the default path, "$user", public: once a schema named like relay's login
// existed (relay's own, for the login `relay` docs/production.md uses), the next `relay
// migrate` made an empty table there and ran migration 1 again, which failed
// for good. The table is relay's now, wherever the path points.
#[tokio::test]
async fn migrating_again_finds_relay_s_migrations_whatever_schema_is_named_like_its_login() {
    let db = relay_testkit::TestDb::new().await.unwrap();
    let login = current_user(&db.pool).await;
    sqlx::raw_sql(&format!("CREATE SCHEMA \"{login}\"")).execute(&db.pool).await.unwrap();
    relay_store::migrate(&db.pool).await.expect("migrating again applies nothing");
    assert!(relay_store::migrations_current(&db.pool).await.unwrap());
    let strays: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_class WHERE relname = '_sqlx_migrations'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(strays, 1, "one migrations table, relay's");

    // A database an earlier release left so (the full table in public, an
    // empty one in schema relay) is repaired, not refused.
    sqlx::raw_sql(
        "ALTER TABLE relay._sqlx_migrations SET SCHEMA public;
         CREATE TABLE relay._sqlx_migrations (LIKE public._sqlx_migrations INCLUDING ALL)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    relay_store::migrate(&db.pool).await.expect("the earlier table found again");
    assert!(relay_store::migrations_current(&db.pool).await.unwrap());
}

async fn current_user(pool: &sqlx::PgPool) -> String {
    sqlx::query_scalar("SELECT current_user::text").fetch_one(pool).await.unwrap()
}

#[tokio::test]
async fn a_migration_changed_after_it_was_applied_leaves_the_schema_not_current() {
    let h = Harness::new(1).await;
    assert!(relay_store::migrations_current(&h.db.pool).await.unwrap());
    sqlx::query(
        "UPDATE relay._sqlx_migrations SET checksum = decode('00', 'hex')
          WHERE version = (SELECT max(version) FROM relay._sqlx_migrations)",
    )
    .execute(&h.db.pool)
    .await
    .unwrap();
    assert!(!relay_store::migrations_current(&h.db.pool).await.unwrap(), "a changed migration is not current");
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
    // A retry under another span, a moment later: the same event.
    for parent in [
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-1111111111111111-01",
    ] {
        sqlx::query("SELECT pg_sleep(0.002)").execute(&mut conn).await.unwrap();
        let again: uuid::Uuid = sqlx::query_scalar(&format!(
            "SELECT relay.publish('{}', 'o-1', 'order.placed', '{{\"n\": 1}}', id => 'evt-1', traceparent => '{parent}',
                                  correlation_id => '{parent}')",
            h.out
        ))
        .fetch_one(&mut conn)
        .await
        .unwrap();
        assert_eq!(again, ids[0].0);
    }
    // The same id for something else is refused, not dropped unseen.
    let (code, message) = refused_with(
        &mut conn,
        &format!("SELECT relay.publish('{}', 'o-1', 'order.placed', '{{\"n\": 2}}', id => 'evt-1')", h.out),
    )
    .await;
    assert_eq!(code, "22023", "{message}");
    assert!(message.starts_with("relay.publish: id: 'evt-1' was already used for a different event"), "{message}");
    let (code, message) = refused_with(
        &mut conn,
        "SELECT relay.call('psp', 'POST', '/refunds/o-1', '{}', id => 'cap-1', ordering_key => 'o-1')",
    )
    .await;
    assert_eq!(code, "22023", "{message}");
    assert!(message.starts_with("relay.call: id: 'cap-1' was already used for a different call"), "{message}");
    assert_eq!(h.db.count("outbox", "true").await, 1);
    assert_eq!(h.db.count("intents", "true").await, 1);
    let (max_attempts, idempotency_key, ordering_key): (i32, String, Option<String>) =
        sqlx::query_as("SELECT max_attempts, idempotency_key, ordering_key FROM relay.intents")
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
    // The default key is the call's id, in the applications' key space.
    assert_eq!(
        (max_attempts, idempotency_key, ordering_key.as_deref()),
        (5, format!("app:{}", ids[0].1), Some("app:o-1"))
    );
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
        "SELECT relay.app_refuse('publish', 'id', 'why')",
        "SELECT relay.app_outcome('c', 'on_success', '{}')",
        "SELECT * FROM relay.app_headers('publish', '{}', '{}') AS x(name text, value jsonb)",
        "SELECT relay.app_check_text('publish', 'id', 'x', 1)",
        "SELECT relay.app_check_key('publish', 'key', 'x')",
        "SELECT relay.app_reused('publish', 'id', 'x')",
        "SELECT relay.app_check_depth('call', 'body', '[]')",
        "INSERT INTO relay.app_sagas (consumer, saga_type) VALUES ('c', 'order')",
        "UPDATE relay.app_front_doors SET role = 'relay_app'",
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

/// A call's outcomes, given by the application: on success its event is
/// published and its saga moved once; on its death, the other outcome.
#[tokio::test]
async fn a_call_s_outcomes_given_by_the_application_are_recorded_once_when_it_ends() {
    let h = Harness::new(1).await;
    let mut cfg = h.config(FRONT_DOOR);
    cfg.application.as_mut().unwrap().sagas = vec!["order".into()];
    h.relay(cfg.clone(), Handlers::default(), no_faults()).await;
    sqlx::query(
        "INSERT INTO relay.sagas (consumer, saga_type, saga_id, state, last_event_id) VALUES ($1, 'order', 'o-1', 'pending', 's')",
    )
    .bind(&h.consumer)
    .execute(&h.db.pool)
    .await
    .unwrap();
    // The provider refuses every capture of o-2 for good.
    h.provider.set_faults(vec![example_provider::FaultRule {
        path_prefix: Some("/captures/o-2".into()),
        key_prefix: None,
        times: None,
        kind: example_provider::FaultKind::Status { status: 422, retry_after_secs: None },
    }]);
    let mut conn = PgConnection::connect(&app_url(&h)).await.unwrap();
    let outcomes = |order: &str| {
        serde_json::json!({
            "on_success": {
                "emit": [{"name": "captured", "type": "payment.captured", "topic": h.out, "key": order,
                          "data": {"order_id": order}}],
                "saga": [{"name": "paid", "saga": "order", "id": order, "from": ["pending"], "to": "paid"}]
            },
            "on_dead": {"emit": [{"name": "failed", "type": "payment.failed", "topic": h.out, "key": order,
                                  "data": {"order_id": order}}]}
        })
    };
    for order in ["o-1", "o-2"] {
        let o = outcomes(order);
        sqlx::query(
            "SELECT relay.call('psp', 'POST', '/captures/' || $1, '{}', id => 'capture-' || $1,
                               on_success => $2, on_dead => $3)",
        )
        .bind(order)
        .bind(&o["on_success"])
        .bind(&o["on_dead"])
        .execute(&mut conn)
        .await
        .unwrap();
    }
    let run = h.start(cfg, DELIVERY, no_faults()).await;
    h.await_intents_finished(2).await;
    h.await_published(2).await;
    let records = read_topic(&h.bootstrap, &h.out, 2).await.unwrap();
    run.stop().await.unwrap();
    let mut seen: Vec<(String, String)> = records
        .iter()
        .map(|r| {
            let key = String::from_utf8_lossy(r.key.as_deref().unwrap()).into_owned();
            (key, r.headers.get("ce_type").cloned().unwrap_or_default())
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [("o-1".to_string(), "payment.captured".to_string()), ("o-2".to_string(), "payment.failed".to_string())]
    );
    let state: String =
        sqlx::query_scalar("SELECT state FROM relay.sagas WHERE saga_id = 'o-1'").fetch_one(&h.db.pool).await.unwrap();
    assert_eq!(state, "paid");
    assert_eq!(h.intents_in("succeeded").await, 1);
    assert_eq!(h.intents_in("dead").await, 1);
    // Ordered in the applications' key space, as relay.publish's events:
    // dead, one would otherwise hold a route's events of its Kafka key.
    let mut keys: Vec<String> =
        sqlx::query_scalar("SELECT ordering_key FROM relay.outbox").fetch_all(&h.db.pool).await.unwrap();
    keys.sort();
    assert_eq!(keys, ["app:o-1", "app:o-2"]);

    // Outcomes that could never be recorded are refused, naming the place.
    let cases = [
        (serde_json::json!([]), "relay.call: on_success: an object"),
        (serde_json::json!({"emit": [], "colour": 1}), "relay.call: on_success.colour: unknown"),
        (
            serde_json::json!({"emit": [{"name": "x", "type": "t", "data": 1}]}),
            "relay.call: on_success.emit[0].topic: required",
        ),
        (
            serde_json::json!({"emit": [{"name": "x", "type": "t", "topic": "elsewhere", "data": 1, "ordered": false}]}),
            "relay.call: on_success.emit[0].topic: 'elsewhere'",
        ),
        (
            serde_json::json!({"emit": [{"name": "x", "type": "t", "topic": h.out, "ordered": true, "data": 1}]}),
            "relay.call: on_success.emit[0].key: an ordered event needs a key",
        ),
        (
            serde_json::json!({"emit": [{"name": "x", "type": "t", "topic": h.out, "key": "k"}]}),
            "relay.call: on_success.emit[0].data: required",
        ),
        (
            serde_json::json!({"emit": [{"name": "x", "type": "t", "topic": h.out, "key": "k", "data": 1},
                                        {"name": "x", "type": "t", "topic": h.out, "key": "k", "data": 2}]}),
            "relay.call: on_success.emit[1].name: 'x' twice",
        ),
        (
            // Each ordered event locks its key when the call ends: thousands
            // would fill PostgreSQL's lock table and fail the calls beside it.
            serde_json::json!({"emit": (0..65).map(|i| serde_json::json!(
                {"name": format!("e-{i}"), "type": "t", "topic": h.out, "key": format!("k-{i}"), "data": 1}
            )).collect::<Vec<_>>()}),
            "relay.call: on_success.emit: 65 events; an outcome has at most 64",
        ),
        (
            serde_json::json!({"saga": (0..65).map(|i| serde_json::json!(
                {"name": format!("m-{i}"), "saga": "order", "id": format!("o-{i}"), "to": "x"}
            )).collect::<Vec<_>>()}),
            "relay.call: on_success.saga: 65 saga moves; an outcome has at most 64",
        ),
        (
            serde_json::json!({"saga": [{"name": "m", "saga": "order", "id": "o", "from": [1], "to": "x"}]}),
            "relay.call: on_success.saga[0].from",
        ),
        (
            serde_json::json!({"saga": [{"name": "m", "saga": "order", "id": "o"}]}),
            "relay.call: on_success.saga[0].to: required",
        ),
        // A saga type the deployment did not open to applications.
        (
            serde_json::json!({"saga": [{"name": "m", "saga": "ledger", "id": "o", "to": "settled"}]}),
            "relay.call: on_success.saga[0].saga: 'ledger' is not a saga type",
        ),
        (
            serde_json::json!({"emit": [{"name": "x", "type": "t", "topic": h.out, "key": "k\n", "data": 1}]}),
            "relay.call: on_success.emit[0].key: holds the control character U+000A",
        ),
    ];
    for (outcome, expected) in &cases {
        let err = sqlx::query("SELECT relay.call('psp', 'POST', '/x', '{}', id => 'bad', on_success => $1)")
            .bind(outcome)
            .execute(&mut conn)
            .await
            .expect_err(expected);
        let message = err.as_database_error().map(|d| d.message().to_owned()).unwrap_or_else(|| err.to_string());
        assert!(message.starts_with(expected), "{outcome}\n  said: {message}\n  not: {expected}…");
    }
}

/// The whole promise, with processes: a Python service enqueues orders in
/// its own transactions (some rolled back, some run twice as after an
/// ambiguous commit, each retried until it commits) while the relay
/// dispatchers delivering them are killed with SIGKILL twice and
/// PostgreSQL crashes and restarts once. Every committed order's event is
/// published and its capture made exactly once in effect, nothing rolled
/// back is sent, and `relay verify` passes.
#[tokio::test(flavor = "multi_thread")]
async fn a_python_service_s_rows_are_sent_once_across_relay_kills_and_a_postgresql_crash() {
    let h = Harness::new(1).await;
    let pg = PrivatePostgres::start().unwrap();
    let admin = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&pg.url()).await.unwrap();
    relay_store::migrate(&admin).await.unwrap();
    for sql in [
        "CREATE ROLE relay_enqueue NOLOGIN",
        "CREATE ROLE relay_app LOGIN IN ROLE relay_enqueue",
        "CREATE TABLE public.orders (id text PRIMARY KEY, amount_cents integer NOT NULL)",
        "GRANT SELECT, INSERT ON public.orders TO relay_enqueue",
    ] {
        sqlx::query(sql).execute(&admin).await.unwrap();
    }
    let config = h.write_config(&h.config_text(FRONT_DOOR));
    let env = [("DATABASE_URL", pg.url())];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut migrate = h.process(&config, &["migrate"], &env);
    assert!(migrate.wait(Duration::from_secs(60)).unwrap().success(), "{}", migrate.log());
    let open: bool = sqlx::query_scalar(
        "SELECT has_function_privilege('relay_app',
                    'relay.publish(text, text, text, jsonb, text, jsonb, boolean, text, text, text, text, text)',
                    'EXECUTE')",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    assert!(open, "`relay migrate` registered the front door and granted the role");
    let app = pg.url().replace("://postgres@", "://relay_app@");

    // The service: 30 orders, every third run twice, every fifth preceded
    // by a rolled-back one; each transaction retried until it commits
    // (PostgreSQL goes away under it).
    let failures = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let service = {
        let (app, topic, failures) = (app.clone(), h.out.clone(), failures.clone());
        tokio::spawn(async move {
            for i in 0..30 {
                let order = format!("o-{i}");
                let mut runs: Vec<Vec<String>> = vec![vec![order.clone()]];
                if i % 3 == 0 {
                    runs.push(vec![order.clone()]);
                }
                if i % 5 == 0 {
                    runs.insert(0, vec![format!("{order}-rb"), "--rollback".into()]);
                }
                for args in runs {
                    let args: Vec<&str> = args.iter().map(String::as_str).collect();
                    eventually(&format!("{args:?} committed or rolled back"), DEADLINE, || async {
                        let (code, _) = python_at(&app, &topic, &args).await;
                        if code != Some(0) {
                            failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        (code == Some(0)).then_some(())
                    })
                    .await;
                }
            }
        })
    };
    let published = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM relay.outbox WHERE state = 'published'")
            .fetch_one(&admin)
            .await
            .unwrap_or(-1)
    };
    let mut relay = h.process(&config, &["dispatch"], &env);
    eventually("5 published", DEADLINE, || async { (published().await >= 5).then_some(()) }).await;
    relay.kill9().unwrap();
    let mut relay = h.process(&config, &["dispatch"], &env);
    eventually("10 published", DEADLINE, || async { (published().await >= 10).then_some(()) }).await;
    pg.stop_immediately().unwrap();
    eventually("the service and the relay to meet the outage", DEADLINE, || async {
        let seen = failures.load(std::sync::atomic::Ordering::Relaxed) > 0 && relay.log().contains("database error");
        seen.then_some(())
    })
    .await;
    pg.start_again().unwrap();
    eventually("15 published", DEADLINE, || async { (published().await >= 15).then_some(()) }).await;
    relay.kill9().unwrap();
    let mut relay = h.process(&config, &["dispatch"], &env);
    service.await.unwrap();
    eventually("everything sent", DEADLINE, || async {
        let open: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM relay.outbox WHERE state <> 'published')
                  + (SELECT count(*) FROM relay.intents WHERE state <> 'succeeded')",
        )
        .fetch_one(&admin)
        .await
        .unwrap_or(1);
        (open == 0).then_some(())
    })
    .await;
    assert!(relay.terminate(Duration::from_secs(30)).unwrap().success(), "{}", relay.log());

    let orders: std::collections::BTreeSet<String> = (0..30).map(|i| format!("o-{i}")).collect();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM relay.outbox").fetch_one(&admin).await.unwrap();
    assert_eq!(rows, 30, "one event per committed order, none per rollback or retry");
    let records = read_topic(&h.bootstrap, &h.out, 30).await.unwrap();
    let ids: std::collections::BTreeSet<&String> = records.iter().filter_map(|r| r.headers.get("ce_id")).collect();
    let keys: std::collections::BTreeSet<String> =
        records.iter().map(|r| String::from_utf8_lossy(r.key.as_deref().unwrap()).into_owned()).collect();
    assert_eq!((ids.len(), &keys), (30, &orders), "each committed event on the topic (a republish keeps its id)");
    let stats = h.provider.stats();
    for order in &orders {
        assert_eq!(stats.applied_for(&format!("app:capture:{order}")), 1, "{order}");
    }
    assert!(stats.double_applied().is_empty());
    assert_eq!(stats.applied, 30, "nothing rolled back was captured");
    let mut cfg = h.config(FRONT_DOOR);
    cfg.database.url = Some(pg.url().into());
    let report =
        verify(&cfg, &admin, &VerifyOptions { effects: Some(h.provider_effects()), grace: Duration::from_secs(30) })
            .await
            .expect("verify runs");
    assert!(report.ok(), "{}", report.render());
}

/// What an example printed about its transaction (its JSON line's `committed`).
fn said_committed(out: &str) -> Option<bool> {
    out.lines().find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?.get("committed")?.as_bool())
}

/// An example program in another language, run as the application's role.
#[derive(Debug, Clone, Copy)]
enum Example {
    Python,
    Node,
    Go,
    Java,
}

impl Example {
    fn command(self, h: &Harness) -> tokio::process::Command {
        let need = |var: &str| {
            std::env::var(var).unwrap_or_else(|_| {
                panic!(
                    "{var} is not set: run the tests with scripts/test.sh, which builds the examples' dependencies \
                     (ensure_example_deps and ensure_python_example_deps in scripts/lib.sh) and sets it"
                )
            })
        };
        let (mut cmd, url) = match self {
            Example::Python => {
                let mut c = tokio::process::Command::new(need("RELAY_TEST_PYTHON"));
                c.arg(examples().join("python/enqueue.py"));
                (c, app_url(h))
            }
            Example::Node => {
                let mut c = tokio::process::Command::new("node");
                c.arg(examples().join("node/enqueue.js"));
                (c, app_url(h))
            }
            Example::Go => (tokio::process::Command::new(need("RELAY_TEST_GO_EXAMPLE")), app_url(h)),
            Example::Java => {
                let mut c = tokio::process::Command::new("java");
                c.arg("-cp").arg(need("RELAY_TEST_JAVA_CLASSPATH")).arg(examples().join("java/Enqueue.java"));
                // JDBC's URL form: jdbc:postgresql://host:port/db?user=…&password=…
                let url = app_url(h);
                let (auth, rest) = url.trim_start_matches("postgres://").split_once('@').unwrap();
                let (user, password) = auth.split_once(':').unwrap();
                (c, format!("jdbc:postgresql://{rest}?user={user}&password={password}"))
            }
        };
        cmd.env("DATABASE_URL", url).env("RELAY_TOPIC", &h.out);
        cmd
    }
}

/// Each example — Python (psycopg), Node (pg), Go (pgx), Java (pgjdbc) —
/// rolls back one order and commits another, runs that one again (a retry)
/// and commits a third before killing itself: relay sends each committed
/// order's event and call once, and nothing rolled back.
#[tokio::test]
async fn every_language_s_example_enqueues_in_its_own_transaction_and_each_committed_row_is_sent_once() {
    let h = Harness::new(1).await;
    orders_table(&h).await;
    let cfg = h.config(FRONT_DOOR);
    h.relay(cfg.clone(), Handlers::default(), no_faults()).await;
    let langs = [Example::Python, Example::Node, Example::Go, Example::Java];
    let mut committed = Vec::new();
    for lang in langs {
        let name = format!("{lang:?}").to_lowercase();
        let (ok, again, killed, rb) =
            (format!("{name}-1"), format!("{name}-1"), format!("{name}-2"), format!("{name}-rb"));
        let (code, out) = run(lang.command(&h).args([rb.as_str(), "--rollback"])).await;
        assert_eq!((code, said_committed(&out)), (Some(0), Some(false)), "{lang:?} rollback: {out}");
        for order in [&ok, &again] {
            let (code, out) = run(lang.command(&h).arg(order)).await;
            assert_eq!((code, said_committed(&out)), (Some(0), Some(true)), "{lang:?}: {out}");
        }
        let (code, out) = run(lang.command(&h).args([killed.as_str(), "--die-after-commit"])).await;
        assert_ne!(code, Some(0), "{lang:?} kills itself after the commit: {out}");
        assert_eq!(said_committed(&out), Some(true), "{lang:?} committed first: {out}");
        committed.extend([ok, killed]);
    }
    assert_eq!(h.db.count("outbox", "true").await, 8, "one event per committed order");
    assert_eq!(h.db.count("intents", "true").await, 8, "one call per committed order");
    let run_ = h.start(cfg, DELIVERY, no_faults()).await;
    h.await_published(8).await;
    h.await_intents_finished(8).await;
    let records = read_topic(&h.bootstrap, &h.out, 8).await.unwrap();
    run_.stop().await.unwrap();
    let mut keys: Vec<String> =
        records.iter().map(|r| String::from_utf8_lossy(r.key.as_deref().unwrap()).into_owned()).collect();
    keys.sort();
    committed.sort();
    assert_eq!(keys, committed);
    let stats = h.provider.stats();
    for order in &committed {
        assert_eq!(stats.applied_for(&format!("app:capture:{order}")), 1, "{order}");
    }
    assert_eq!(stats.applied, 8, "nothing rolled back was captured");
}

/// JSON nested `n` deep: arrays within arrays.
fn nested(n: usize) -> String {
    format!("'{}1{}'::jsonb", "[".repeat(n), "]".repeat(n))
}

#[tokio::test]
async fn a_call_s_json_is_bounded_in_depth_and_its_outcomes_count_in_its_size() {
    // A body or outcome data nested deeper than the dispatcher's JSON reader
    // takes (128 levels) made every claim that met it fail; outcomes of any
    // size were taken, and a claim of such calls could exhaust the
    // dispatcher's memory.
    let h = Harness::new(1).await;
    let mut cfg = h.config(FRONT_DOOR);
    cfg.application.as_mut().unwrap().max_payload_bytes = 65_536;
    h.relay(cfg.clone(), Handlers::default(), no_faults()).await;
    let mut conn = PgConnection::connect(&app_url(&h)).await.unwrap();
    let out = &h.out;
    let emit = |data: &str| {
        format!(
            "jsonb_build_object('emit', jsonb_build_array(jsonb_build_object('name', 'x', 'type', 't', \
             'topic', '{out}', 'key', 'k', 'data', {data})))"
        )
    };
    let call = |args: &str| format!("SELECT relay.call('psp', 'POST', '/x', {args})");
    let huge = "jsonb_build_object('pad', repeat('x', 100000))";
    let cases = [
        (call(&format!("{}, id => 'a'", nested(200))), "relay.call: body: nested more than 64 levels deep"),
        (call(&format!("{}, id => 'a'", nested(65))), "relay.call: body: nested more than 64 levels deep"),
        (
            call(&format!("'{{}}', id => 'a', on_success => {}", emit(&nested(200)))),
            "relay.call: on_success.emit[0].data: nested more than 64 levels deep",
        ),
        (
            call(&format!("'{{}}', id => 'a', on_dead => {}", emit(&nested(65)))),
            "relay.call: on_dead.emit[0].data: nested more than 64 levels deep",
        ),
        (call(&format!("'{{}}', id => 'a', on_success => {}", emit(huge))), "relay.call: on_success: the call is "),
        (call(&format!("'{{}}', id => 'a', on_dead => {}", emit(huge))), "relay.call: on_dead: the call is "),
    ];
    for (sql, expected) in &cases {
        let message = refused(&mut conn, sql).await;
        assert!(message.starts_with(expected), "{sql}\n  said: {message}\n  not: {expected}…");
        assert!(
            message.contains("64 levels") || message.contains("more than the 65536 bytes relay accepts"),
            "names the limit: {message}"
        );
    }
    assert_eq!(h.db.count("intents", "true").await, 0, "nothing enqueued");
    // At the limit, the call is taken, and the dispatcher reads it back.
    sqlx::query(&call(&format!("{}, id => 'deep-ok', on_success => {}", nested(64), emit(&nested(64)))))
        .execute(&mut conn)
        .await
        .expect("64 levels are taken");
    let run = h.start(cfg, DELIVERY, no_faults()).await;
    h.await_intents_finished(1).await;
    h.await_published(1).await;
    run.stop().await.unwrap();
    assert_eq!(h.intents_in("succeeded").await, 1);
}

/// The example's capture route: the order's saga waits for the payment,
/// which the capture's outcome moves to paid or payment_failed.
fn capture_with_saga() -> String {
    let keyed = format!("ordering_key = \"{{{{ data.customer }}}}\"\n{}", routes::order_and_amount_body());
    [
        routes::order_placed(""),
        routes::saga_start("start-order", "payment_pending"),
        routes::capture(&keyed),
        routes::saga_on("on_success", "order-paid", "payment_pending", "paid"),
        routes::failed(),
        routes::saga_on("on_dead", "order-payment-failed", "payment_pending", "payment_failed"),
        "\n[application]\ntopics = [\"{out}\"]\nendpoints = [\"psp\"]\n".into(),
    ]
    .concat()
}

/// A harness whose provider answers as the IETF draft (422: a key reused
/// with another body), and its configuration with that profile.
async fn ietf_harness() -> (Harness, relay_core::RelayConfig) {
    let h = Harness::with_provider(
        1,
        example_provider::Settings { dialect: example_provider::Dialect::Ietf, ..Default::default() },
    )
    .await;
    let text =
        h.config_text(&capture_with_saga()).replace("[endpoints.psp]\n", "[endpoints.psp]\nprofile = \"ietf\"\n");
    let cfg = h.config_of(&text);
    (h, cfg)
}

/// An order event of `customer` (the route's ordering key).
fn order_of(id: &str, order: &str, customer: &str) -> relay_testkit::TestEvent {
    let data = serde_json::json!({"order_id": order, "amount": 100, "customer": customer});
    relay_testkit::TestEvent::new(id, "order.placed", data).key(order)
}

/// State and last error of the intent of input event `source_event`, once written.
async fn intent_of(h: &Harness, source_event: &str) -> Option<(String, Option<String>)> {
    sqlx::query_as("SELECT state, last_error FROM relay.intents WHERE source_event_id = $1")
        .bind(source_event)
        .fetch_optional(&h.db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn an_application_s_idempotency_key_never_is_the_key_a_route_sends() {
    // The application sends the key the route will render for the order,
    // with another body, before the order's event arrives: the provider
    // would take the route's capture for a key reused with another request
    // (422), the capture would die and the order's saga go to payment_failed.
    let (h, cfg) = ietf_harness().await;
    h.relay(cfg.clone(), Handlers::default(), no_faults()).await;
    let mut app = PgConnection::connect(&app_url(&h)).await.unwrap();
    sqlx::query(
        "SELECT relay.call('psp', 'POST', '/captures/o-42', '{\"order_id\": \"o-42\", \"amount_cents\": 1}',
                           id => 'app-capture-o-42', idempotency_key => 'capture:o-42')",
    )
    .execute(&mut app)
    .await
    .unwrap();
    let run = h.start(cfg.clone(), DELIVERY, no_faults()).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();

    h.send(&order_of("evt-42", "o-42", "cust-17")).await;
    let run = h.start(cfg.clone(), relay::Components::ALL, no_faults()).await;
    h.await_intents_finished(2).await;
    run.stop().await.unwrap();
    let (state, error) = intent_of(&h, "evt-42").await.expect("the route's intent");
    assert_eq!(state, "succeeded", "the route's capture: {error:?}");
    let saga: String =
        sqlx::query_scalar("SELECT state FROM relay.sagas WHERE saga_id = 'o-42'").fetch_one(&h.db.pool).await.unwrap();
    assert_eq!(saga, "paid");
    assert_eq!(h.db.count("outbox", "event_type = 'payment.failed'").await, 0);
    // The provider saw two keys, each applied once.
    let stats = h.provider.stats();
    assert_eq!((stats.applied_for("capture:o-42"), stats.applied_for("app:capture:o-42")), (1, 1), "{stats:?}");
    let stored: String = sqlx::query_scalar("SELECT idempotency_key FROM relay.intents WHERE action = 'application'")
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    assert_eq!(stored, "app:capture:o-42");
}

#[tokio::test]
async fn an_application_s_ordering_key_never_holds_a_route_s() {
    // An application's call on ordering key cust-17 that ends uncertain
    // held the key the route renders for customer cust-17: the route's
    // captures for that customer waited until an operator acted.
    let (h, cfg) = ietf_harness().await;
    h.relay(cfg.clone(), Handlers::default(), no_faults()).await;
    let mut app = PgConnection::connect(&app_url(&h)).await.unwrap();
    sqlx::query("SELECT relay.call('psp', 'POST', '/notes', '{}', id => 'note-1', ordering_key => 'cust-17')")
        .execute(&mut app)
        .await
        .unwrap();
    // As if it had ended uncertain: it holds its key until an operator acts.
    sqlx::query("UPDATE relay.intents SET state = 'uncertain', ever_uncertain = true, finished_at = now()")
        .execute(&h.db.pool)
        .await
        .unwrap();
    h.send(&order_of("evt-7", "o-7", "cust-17")).await;
    let run = h.start(cfg.clone(), relay::Components::ALL, no_faults()).await;
    eventually("the route's capture for cust-17", DEADLINE, || async {
        intent_of(&h, "evt-7").await.filter(|(state, _)| state == "succeeded")
    })
    .await;
    run.stop().await.unwrap();
    let key: String = sqlx::query_scalar("SELECT ordering_key FROM relay.intents WHERE action = 'application'")
        .fetch_one(&h.db.pool)
        .await
        .unwrap();
    assert_eq!(key, "app:cust-17");
}

// A configuration with only [application] (the classic outbox, no input
// topic) passed check-config, and `relay run` then exited with "no topics to
// consume": only `relay dispatch` served it. `relay run` serves what the
// configuration asks for.
#[tokio::test(flavor = "multi_thread")]
async fn relay_run_with_only_an_application_front_door_publishes_what_applications_enqueue() {
    let h = Harness::new(1).await;
    let config = h.write_config(&h.config_text(FRONT_DOOR));
    let mut run = h.process(&config, &["run"], &[]);
    let mut app = PgConnection::connect(&app_url(&h)).await.unwrap();
    // The front door is registered as the process starts.
    let publish = format!("SELECT relay.publish('{}', 'k-1', 'order.placed', '{{\"order\": 1}}', id => 'o-1')", h.out);
    eventually("the front door open", DEADLINE, || async {
        sqlx::query(&publish).execute(&mut PgConnection::connect(&app_url(&h)).await.ok()?).await.ok()
    })
    .await;
    let _ = sqlx::query(&publish).execute(&mut app).await;
    h.await_published(1).await;
    assert!(run.terminate(Duration::from_secs(30)).unwrap().success(), "{}", run.log());
    assert!(!run.log().contains("no topics to consume"), "{}", run.log());
    assert_eq!(read_topic(&h.bootstrap, &h.out, 1).await.unwrap().len(), 1);
}

// The producer counts an event's headers and key with its data against its
// message.max.bytes: a limit on the data alone let 64 headers of 8 KiB
// through, a record that could never be published (its dead row then held
// its key for every later event).
#[tokio::test]
async fn an_event_s_headers_and_key_count_with_its_data_in_the_size_relay_accepts() {
    let h = Harness::new(1).await;
    let mut cfg = h.config(FRONT_DOOR);
    cfg.application.as_mut().unwrap().max_payload_bytes = 65_536;
    h.relay(cfg, Handlers::default(), no_faults()).await;
    let mut conn = PgConnection::connect(&app_url(&h)).await.unwrap();
    let headers: serde_json::Map<String, serde_json::Value> =
        (0..64).map(|n| (format!("x-h{n}"), serde_json::Value::String("v".repeat(8000)))).collect();
    let sql = format!(
        "SELECT relay.publish('{}', 'k', 'x', '{{\"a\": 1}}', id => 'big', headers => '{}'::jsonb)",
        h.out,
        serde_json::Value::Object(headers)
    );
    let why = refused(&mut conn, &sql).await;
    assert!(why.contains("headers") && why.contains("together") && why.contains("65536"), "{why}");
    let small = format!(
        "SELECT relay.publish('{}', 'k', 'x', '{{\"a\": 1}}', id => 'small', headers => '{{\"x-h\": \"v\"}}')",
        h.out
    );
    sqlx::query(&small).execute(&mut conn).await.unwrap();
}

/// An application's connection in an open transaction that published an
/// event of type `ty` with ordering key `key` to the harness's output topic,
/// holding the key until `COMMIT`.
async fn hold_key(h: &Harness, key: &str, ty: &str) -> PgConnection {
    let mut held = PgConnection::connect(&app_url(h)).await.unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut held).await.unwrap();
    sqlx::query("SELECT relay.publish($1, $2, $3, '{}', id => 'note-' || $2)")
        .bind(&h.out)
        .bind(key)
        .bind(ty)
        .execute(&mut held)
        .await
        .unwrap();
    held
}

// An application's open transaction that published with an ordering key
// holds the key until it ends. The completer recorded up to 256 outcomes in
// one transaction and waited for every key in it: one outcome whose event
// had that key made the whole batch wait, fail on lock_timeout, lose its
// leases, and be called again. Now only that outcome waits, its lease kept
// meanwhile, and it is recorded, after the application's event, once the
// transaction ends.
#[tokio::test(flavor = "multi_thread")]
async fn an_application_holding_an_event_s_key_delays_only_the_outcome_with_that_key() {
    let h = Harness::new(1).await;
    let cfg = h.config(FRONT_DOOR);
    h.relay(cfg.clone(), Handlers::default(), no_faults()).await;
    let mut app = PgConnection::connect(&app_url(&h)).await.unwrap();
    for n in 1..=20 {
        let order = format!("o-{n}");
        let on_success = serde_json::json!({"emit": [{"name": "captured", "type": "payment.captured", "topic": h.out,
                                                     "key": order, "data": {"order_id": order}}]});
        sqlx::query(
            "SELECT relay.call('psp', 'POST', '/captures/' || $1, '{}', id => 'capture-' || $1, on_success => $2)",
        )
        .bind(&order)
        .bind(&on_success)
        .execute(&mut app)
        .await
        .unwrap();
    }
    let mut held = hold_key(&h, "o-1", "order.noted").await;
    let run = h.start(cfg, DELIVERY, no_faults()).await;
    eventually("the 19 calls whose keys are free recorded", DEADLINE, || async {
        (h.intents_in("succeeded").await == 19).then_some(())
    })
    .await;
    // Held for twice the dispatcher's lease (3 s): the waiting outcome keeps its claim.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(h.intents_in("running").await, 1, "o-1's outcome waits for its key, claimed");
    sqlx::raw_sql("COMMIT").execute(&mut held).await.unwrap();
    h.await_intents_finished(20).await;
    h.await_published(21).await;
    let records = read_topic(&h.bootstrap, &h.out, 21).await.unwrap();
    run.stop().await.unwrap();
    assert_eq!(h.intents_in("succeeded").await, 20);
    let stats = h.provider.stats();
    assert_eq!((stats.requests, stats.applied), (20, 20), "each call made once: {stats:?}");
    let o1: Vec<String> = records
        .iter()
        .filter(|r| r.key.as_deref() == Some(b"o-1".as_slice()))
        .map(|r| r.headers.get("ce_type").cloned().unwrap_or_default())
        .collect();
    assert_eq!(o1, ["order.noted", "payment.captured"], "the application's event first, as committed");
}

// pg_advisory_lock may be called by any role that can connect: one that
// computed a key's lock (consumer, U+0002, the key, hashed by hashtext)
// held it and stalled every batch of the key's partition. A key's lock is
// now a row of a table relay owns, which only relay's roles may lock.
#[tokio::test(flavor = "multi_thread")]
async fn a_role_that_is_not_relay_s_cannot_hold_a_route_s_ordering_key() {
    let h = Harness::new(1).await;
    let route =
        CAPTURE_ROUTE.replace("idempotency_key = ", "ordering_key = \"{{ data.order_id }}\"\nidempotency_key = ");
    let mut intruder = PgConnection::connect(&app_url(&h)).await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(1380273153, hashtext($1 || chr(2) || 'o-1'))")
        .bind(&h.consumer)
        .execute(&mut intruder)
        .await
        .unwrap();
    h.send(&order("evt-1", "o-1")).await;
    let run = h.start(h.config_of(&h.config_text(&route)), Components::ALL, no_faults()).await;
    h.await_intents_finished(1).await;
    run.stop().await.unwrap();
    assert_eq!(h.outcome("evt-1").await.as_deref(), Some("applied"));
    let mut tx = intruder.begin().await.unwrap();
    let refused = sqlx::query("SELECT 1 FROM relay.key_locks FOR UPDATE").execute(&mut *tx).await.unwrap_err();
    assert_eq!(refused.as_database_error().and_then(|d| d.code()).as_deref(), Some("42501"), "{refused}");
    tx.rollback().await.unwrap();
    intruder.close().await.unwrap();
}

// An outcome held behind a key another transaction holds stopped counting
// against any room once its call ended: claims went on, and held outcomes,
// each with its JSON, piled up without bound for as long as the
// application's transaction stayed open. Counted in the claims' room
// instead, they let one application stop every call of the deployment.
// They have a room of their own now: once it is full, applications' calls
// wait, and the others go on.
#[tokio::test(flavor = "multi_thread")]
async fn outcomes_held_behind_a_key_stop_applications_calls_once_they_fill_their_room_and_no_other() {
    let h = Harness::new(1).await;
    let mut cfg = h.config(FRONT_DOOR);
    // Two of the outcomes below fill the 2 MiB room, and a third goes past.
    cfg.dispatcher.max_claimed_bytes = 2 * 1024 * 1024;
    h.relay(cfg.clone(), Handlers::default(), no_faults()).await;
    let mut app = PgConnection::connect(&app_url(&h)).await.unwrap();
    let on_success = serde_json::json!({"emit": [{"name": "done", "type": "big.done", "topic": h.out, "key": "k",
                                                 "data": {"pad": "x".repeat(700_000)}}]});
    for i in 0..12 {
        sqlx::query("SELECT relay.call('psp', 'POST', '/big', '{}', id => $1, on_success => $2)")
            .bind(format!("big-{i}"))
            .bind(&on_success)
            .execute(&mut app)
            .await
            .unwrap();
    }
    let mut held = hold_key(&h, "k", "note").await;
    let run = h.start(cfg, DELIVERY, no_faults()).await;
    eventually("three calls made", DEADLINE, || async { (h.provider.stats().requests >= 3).then_some(()) }).await;
    // Calls of the deployment's routes go on meanwhile.
    relay_testkit::seed::pending_intents(&h.db.pool, &h.consumer, "psp", "r-", 5).await.unwrap();
    eventually("the route's calls made while the application's wait", DEADLINE, || async {
        (h.db.count("intents", "action = 'capture' AND state = 'succeeded'").await == 5).then_some(())
    })
    .await;
    assert_eq!(h.db.count("intents", "action = 'application' AND state = 'succeeded'").await, 0);
    // The room filled, at most the calls then in flight (the claims' own
    // room: two more) went out after it.
    let made = h.provider.stats().requests - 5;
    assert!((3..=5).contains(&made), "{made} of 12 application calls made while their outcomes wait");
    sqlx::raw_sql("COMMIT").execute(&mut held).await.unwrap();
    eventually("every call made and recorded", DEADLINE, || async {
        (h.db.count("intents", "state = 'succeeded'").await == 17).then_some(())
    })
    .await;
    run.stop().await.unwrap();
    assert_eq!(h.provider.stats().requests, 17);
}

// Key locks were 65 536 slots shared by every deployment of the database:
// an application of one deployment holding a slot (or all of them, in one
// open transaction) made another deployment's writers of keys in those
// slots wait. A deployment's slots are now rows of its own.
#[tokio::test]
async fn a_deployment_s_key_slots_are_its_own_and_computed_alike_in_rust_and_sql() {
    use relay_store::ordering::{Key, lock};
    let db = relay_testkit::TestDb::new().await.unwrap();
    let key = Key::Outbox { topic: "orders.events", key: "app:o-1" };
    let slot = key.slot("b");
    let in_sql: i32 =
        sqlx::query_scalar("SELECT relay.key_slot(3, 'b' || chr(2) || 'orders.events' || chr(1) || 'app:o-1')")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(slot, in_sql, "relay.key_slot and Key::slot agree");
    let mut a = db.pool.begin().await.unwrap();
    sqlx::query("SELECT relay.lock_keys('a', ARRAY[$1])").bind(slot).execute(&mut *a).await.unwrap();
    let mut b = db.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '200ms'").execute(&mut *b).await.unwrap();
    lock(&mut b, "b", [key]).await.expect("deployment b's key waits on no slot of deployment a");
    b.rollback().await.unwrap();
    let mut again = db.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '200ms'").execute(&mut *again).await.unwrap();
    let held = sqlx::query("SELECT relay.lock_keys('a', ARRAY[$1])").bind(slot).execute(&mut *again).await;
    let refused = held.expect_err("deployment a's slot is held");
    assert_eq!(refused.as_database_error().and_then(|d| d.code()).as_deref(), Some("55P03"));
    again.rollback().await.unwrap();
    a.rollback().await.unwrap();
}
