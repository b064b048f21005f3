//! The `relay` binary as an operator uses it: configuration errors that name
//! the key, a real `relay run` process that is stopped with SIGTERM, logs that
//! carry no payload or secret, and the dead-letter and stats commands.

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use example_provider::{Provider, Settings};
use relay_testkit::{
    DEADLINE, TestDb, TestEvent, TestProducer, create_topics, eventually, kafka_bootstrap, routes, unique,
};
use serde_json::json;

fn relay() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_relay"));
    c.env_remove("DATABASE_URL").env_remove("RELAY_CONFIG").env("NO_COLOR", "1");
    c
}

fn output(c: &mut Command) -> (bool, String, String) {
    let out = c.output().expect("run relay");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write_config(text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("{}.toml", unique("relay-cli")));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn the_version_names_the_commit_the_binary_was_built_from() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let head = Command::new("git").current_dir(&root).args(["rev-parse", "--short=12", "HEAD"]).output().expect("git");
    assert!(head.status.success(), "the tests run in a git checkout");
    let head = String::from_utf8_lossy(&head.stdout).trim().to_owned();
    for (args, name) in [(&["--version"][..], "relay"), (&["migrate", "--version"][..], "relay-migrate")] {
        let (ok, stdout, stderr) = output(relay().args(args));
        assert!(ok, "{stderr}");
        assert_eq!(stdout.trim(), format!("{name} {} (git {head})", env!("CARGO_PKG_VERSION")), "{args:?}");
    }
}

#[test]
fn check_config_accepts_the_example_configuration() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let (ok, stdout, stderr) =
        output(relay().current_dir(&root).args(["--config", "relay.example.toml", "check-config"]));
    assert!(ok, "{stderr}");
    assert!(stdout.contains("configuration is valid") && stdout.contains("route order-placed"), "{stdout}");
}

#[test]
fn environment_variables_override_the_file() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let (ok, stdout, stderr) = output(
        relay()
            .current_dir(&root)
            .env("RELAY_CONSUMER__NAME", "from-env")
            .env("RELAY_KAFKA__BOOTSTRAP_SERVERS", "broker.example:9093")
            .args(["--config", "relay.example.toml", "check-config"]),
    );
    assert!(ok, "{stderr}");
    assert!(stdout.contains("consumer \"from-env\""), "{stdout}");
    let (ok, _, stderr) = output(relay().current_dir(&root).env("RELAY_DISPATCHER__LEASE", "soon").args([
        "--config",
        "relay.example.toml",
        "check-config",
    ]));
    assert!(!ok);
    assert!(stderr.to_lowercase().contains("dispatcher.lease"), "a bad override names its key: {stderr}");
}

#[test]
fn an_invalid_configuration_fails_at_start_naming_the_key_and_the_fix() {
    let path = write_config(
        r#"
[endpoints.psp]
base_url = "http://127.0.0.1:1"
[[routes]]
topic = "t"
type = "x"
[[routes.actions]]
kind = "call"
name = "c"
endpoint = "pssp"
path = "/"
"#,
    );
    let (ok, _, stderr) = output(relay().arg("--config").arg(&path).arg("check-config"));
    assert!(!ok);
    assert!(stderr.contains("routes[0].actions[0].endpoint") && stderr.contains("defined: psp"), "{stderr}");

    let path = write_config("[dispatcher]\nconcurrency = \"many\"\n");
    let (ok, _, stderr) = output(relay().arg("--config").arg(&path).arg("check-config"));
    assert!(!ok);
    assert!(stderr.contains("concurrency"), "{stderr}");
}

#[test]
fn a_missing_database_url_says_how_to_set_it() {
    let path = write_config("[consumer]\nname = \"x\"\n");
    let (ok, _, stderr) = output(relay().arg("--config").arg(&path).arg("stats"));
    assert!(!ok);
    assert!(stderr.contains("DATABASE_URL"), "{stderr}");
}

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn relay_run_processes_events_stops_cleanly_on_sigterm_and_logs_no_payload_or_secret() {
    let db = TestDb::new().await.unwrap();
    let bootstrap = kafka_bootstrap();
    let (topic, out, dlq) = (unique("orders"), unique("out"), unique("dlq"));
    create_topics(&bootstrap, &[&topic, &out, &dlq], 2).await.unwrap();
    let provider = Provider::start(SocketAddr::from(([127, 0, 0, 1], 0)), Settings::default()).await.unwrap();
    // A schema failure over a value (jsonschema's own text quotes it).
    let schema = std::env::temp_dir().join(format!("{}.json", unique("card-schema")));
    std::fs::write(&schema, r#"{"type":"object","properties":{"card":{"type":"integer"}}}"#).unwrap();
    let card = "body = { order_id = \"{{ data.order_id }}\", card = \"{{ data.card }}\" }\n";
    let capture = routes::route(None, "order.placed", "") + &routes::call("capture", "psp", "/captures", card);
    let config = write_config(&format!(
        r#"
[consumer]
name = "cli-test"
dead_letter_topic = "{dlq}"
[kafka]
bootstrap_servers = "{bootstrap}"
[dispatcher]
lease = "3s"
poll_interval = "100ms"
[publisher]
lease = "8s"
delivery_timeout = "5s"
poll_interval = "100ms"
[endpoints.psp]
base_url = "{provider}"
timeout = "1s"
connect_timeout = "500ms"
token_env = "PSP_TOKEN"
{capture}
[[routes]]
topic = "{topic}"
type = "card.checked"
schema = "{schema}"
counter = "cards_checked"
"#,
        provider = provider.url(),
        schema = schema.display(),
        capture = capture.replace("{topic}", &topic),
    ));
    let (ok, _, stderr) = output(relay().env("DATABASE_URL", &db.url).arg("--config").arg(&config).arg("migrate"));
    assert!(ok, "{stderr}");

    let producer = TestProducer::new(&bootstrap).unwrap();
    let secret_payload = "4111-1111-1111-1111";
    for i in 0..5 {
        let e = TestEvent::new(
            &format!("evt-{i}"),
            "order.placed",
            json!({"order_id": format!("o-{i}"), "card": secret_payload}),
        );
        producer.event(&topic, &e).await.unwrap();
    }
    let poison = TestEvent::new("evt-poison", "order.placed", json!({"card": secret_payload})); // template needs order_id
    producer.event(&topic, &poison).await.unwrap();
    let checked = TestEvent::new("evt-schema", "card.checked", json!({"card": secret_payload})); // card must be a number
    producer.event(&topic, &checked).await.unwrap();

    let child = relay()
        // Colour is left to the relay's own check: a pipe is no terminal.
        .env_remove("NO_COLOR")
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "debug")
        .env("PSP_TOKEN", "tok-very-secret-42")
        .arg("--config")
        .arg(&config)
        .arg("run")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = Running(child);
    // Read the logs while the relay runs: at debug level it writes more than a
    // pipe holds, and a full pipe would stall it.
    let mut stderr = child.0.stderr.take().unwrap();
    let log_reader = std::thread::spawn(move || {
        let mut logs = String::new();
        stderr.read_to_string(&mut logs).map(|_| logs)
    });
    eventually("5 captures at the provider", DEADLINE, || async { (provider.stats().applied == 5).then_some(()) })
        .await;
    eventually("the poison records parked", DEADLINE, || async {
        (db.count("dead_letters", "true").await == 2).then_some(())
    })
    .await;
    let reasons: Vec<String> =
        sqlx::query_scalar("SELECT reason FROM relay.dead_letters").fetch_all(&db.pool).await.unwrap();
    assert!(reasons.iter().any(|r| r.contains("/card")), "{reasons:?}");
    assert!(
        !reasons.iter().any(|r| r.contains(secret_payload)),
        "a payload value in a dead-letter reason: {reasons:?}"
    );

    let pid = child.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = tokio::task::spawn_blocking(move || {
        let started = std::time::Instant::now();
        loop {
            if let Some(status) = child.0.try_wait().unwrap() {
                return Some((status, log_reader.join().unwrap().unwrap()));
            }
            if started.elapsed() > Duration::from_secs(30) {
                return None;
            }
            #[allow(
                clippy::disallowed_methods,
                reason = "a test helper polling a child process with a deadline, synchronously"
            )]
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .await
    .unwrap();
    let (status, logs) = status.expect("relay run did not stop within 30 s of SIGTERM");
    assert!(status.success(), "exit status {status:?}\n{logs}");
    assert!(logs.contains("shutdown requested"), "{logs}");
    assert!(logs.contains("inbox consumer stopped") && logs.contains("dispatcher stopped"), "{logs}");
    assert!(logs.contains("evt-3"), "records are logged with their event id");
    assert!(!logs.contains('\u{1b}'), "logs written to a pipe carry no colour codes");
    assert!(!logs.contains(secret_payload), "a payload leaked into the logs");
    assert!(!logs.contains("tok-very-secret-42"), "the provider token leaked into the logs");
    let password_part = db.url.split('@').next().unwrap();
    assert!(!logs.contains(password_part), "the database URL leaked into the logs");

    // Operator commands on what the run left behind (the template failure alone).
    sqlx::query("DELETE FROM relay.dead_letters WHERE event_id = 'evt-schema'").execute(&db.pool).await.unwrap();
    let cli = |args: &[&str]| output(relay().env("DATABASE_URL", &db.url).arg("--config").arg(&config).args(args));
    // A token variable that is missing is named at start.
    let (ok, _, stderr) = cli(&["run"]);
    assert!(!ok);
    assert!(stderr.contains("PSP_TOKEN"), "{stderr}");
    let (ok, stdout, stderr) = cli(&["stats"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("applied") && stdout.contains("succeeded              5"), "{stdout}");
    assert!(stdout.contains("dead letters: 1 unresolved"), "{stdout}");

    let (ok, stdout, _) = cli(&["dead-letters", "list"]);
    assert!(ok);
    assert!(stdout.contains("template_error") && stdout.contains("evt-poison"), "{stdout}");
    let id: i64 = sqlx::query_scalar("SELECT id FROM relay.dead_letters").fetch_one(&db.pool).await.unwrap();
    let (ok, stdout, _) = cli(&["dead-letters", "show", &id.to_string()]);
    assert!(ok);
    assert!(stdout.contains("data.order_id") && stdout.contains("ce_id: evt-poison"), "{stdout}");
    let (ok, stdout, _) = cli(&["dead-letters", "replay", &id.to_string()]);
    assert!(ok);
    assert!(stdout.contains("still failing") && stdout.contains("0 resolved, 1 still failing"), "{stdout}");
    let (ok, stdout, _) = cli(&["dead-letters", "purge", "--all"]);
    assert!(ok);
    assert!(stdout.contains("would delete 1"), "{stdout}");
    assert_eq!(db.count("dead_letters", "true").await, 1, "nothing deleted without --yes");
    let (ok, stdout, _) = cli(&["dead-letters", "purge", "--all", "--yes"]);
    assert!(ok);
    assert!(stdout.contains("deleted 1"), "{stdout}");
    assert_eq!(db.count("dead_letters", "true").await, 0);
}

// Security review L3: ids, reasons, keys, headers and values a record or a
// provider wrote were printed raw: an escape sequence in them could rewrite
// the operator's terminal or set its clipboard.
#[tokio::test]
async fn the_cli_prints_no_control_character_a_record_carried() {
    let db = TestDb::new().await.unwrap();
    let evil = "\u{1b}]52;c;ZXZpbA==\u{7}\u{1b}[2K\r";
    let record = relay_core::RawRecord {
        topic: "orders".into(),
        partition: 0,
        offset: 7,
        key: Some(evil.as_bytes().to_vec()),
        payload: Some(format!("{{\"note\": \"{evil}\"}}").into_bytes()),
        headers: vec![relay_core::Header::text(format!("x-{evil}"), evil)],
    };
    let poison = relay_core::Poison::new(relay_core::PoisonClass::BadField, format!("reason {evil}"))
        .with_identity(Some(&format!("evt{evil}")), Some("order.placed"));
    let mut conn = db.conn().await.unwrap();
    let id = relay_store::dead_letters::insert(&mut conn, "shop", &record, &poison, 1, false, 1 << 20)
        .await
        .unwrap()
        .unwrap();
    let config = write_config("[consumer]\nname = \"shop\"\n[kafka]\nbootstrap_servers = \"127.0.0.1:1\"\n");
    let cli = |args: &[&str]| output(relay().env("DATABASE_URL", &db.url).arg("--config").arg(&config).args(args));
    for args in [vec!["dead-letters", "list"], vec!["dead-letters", "show", &id.to_string()]] {
        let (ok, stdout, stderr) = cli(&args);
        assert!(ok, "{stderr}");
        assert!(stdout.contains("evt"), "{stdout}");
        assert!(
            !stdout.contains('\u{1b}') && !stdout.contains('\u{7}') && !stdout.contains('\r'),
            "{args:?}: {stdout:?}"
        );
        assert!(stdout.contains("\\u{1b}"), "escaped, still readable: {stdout}");
    }
}

/// `check-config --explain` renders a route through the consumer's own
/// decoding, field sources, schema and templates, with nothing to connect
/// to (the registry and endpoint below do not exist): an example event by
/// default, a given record value with `--event` (refused as the consumer
/// would refuse it), and `on_success` templates with `--response`.
#[test]
fn check_config_explain_renders_a_route_without_io_and_says_why_an_event_would_be_dead_lettered() {
    let dir = std::env::temp_dir().join(unique("explain"));
    std::fs::create_dir_all(&dir).unwrap();
    let schema = dir.join("order.schema.json");
    std::fs::write(
        &schema,
        r#"{"type":"object","required":["event_id","order_id","cents"],"properties":{
             "event_id":{"type":"string"},"order_id":{"type":"string","pattern":"^o-"},"cents":{"type":"integer"},
             "channel":{"enum":["web","store"]}}}"#,
    )
    .unwrap();
    let config = write_config(&format!(
        r#"
[schema_registry]
url = "http://127.0.0.1:1"

[endpoints.psp]
base_url = "http://127.0.0.1:1/v2"

[topics.orders]
format = "json"
fields.id = {{ pointer = "/event_id" }}
fields.type = {{ value = "order.placed" }}
fields.aggregate_id = {{ header = "order" }}

[[routes]]
name = "placed"
topic = "orders"
type = "order.placed"
schema = "{schema}"
version_guard = false

[[routes.actions]]
kind = "saga"
name = "open"
saga = "order"
id = "{{{{ data.order_id }}}}"
start = true
to = "placed"

[[routes.actions]]
kind = "call"
name = "capture"
endpoint = "psp"
path = "/captures/{{{{ data.order_id }}}}"
idempotency_key = "capture:{{{{ data.order_id }}}}"
body = {{ order_id = "{{{{ data.order_id }}}}", cents = "{{{{ data.cents }}}}", via = "{{{{ data.channel }}}}" }}

[[routes.actions.on_success.emit]]
name = "captured"
type = "payment.captured"
topic = "payments"
format = "avro"
key = "{{{{ data.order_id }}}}"
data = {{ order_id = "{{{{ data.order_id }}}}", payment_id = "{{{{ response.body.id }}}}" }}

[[routes.actions]]
kind = "emit"
name = "seen"
type = "order.seen"
topic = "orders.seen"
format = "avro"
key = "{{{{ data.order_id }}}}"
data = {{ order_id = "{{{{ data.order_id }}}}", region = "{{{{ extensions.region | default('eu') }}}}" }}
"#,
        schema = schema.display()
    ));
    let explain = |extra: &[&std::ffi::OsStr]| {
        output(relay().arg("--config").arg(&config).args(["check-config", "--explain", "placed"]).args(extra))
    };

    let (ok, stdout, stderr) = explain(&[]);
    assert!(ok, "{stderr}");
    for says in [
        "rendered against an example event (no I/O",
        "the templates read: data.cents, data.channel, data.order_id",
        // The schema's types: an integer, the first enum value.
        "\"cents\": 1,",
        "\"channel\": \"web\"",
        "saga \"open\": order \"example-order_id\" starts at \"placed\"",
        "call \"capture\" -> endpoint psp: POST http://127.0.0.1:1/v2/captures/example-order_id",
        "idempotency key \"capture:example-order_id\"",
        "templates reading `response` stay as written",
        "emit \"seen\" -> topic \"orders.seen\", key \"example-order_id\", type \"order.seen\", outbox id ",
        "\"region\": \"eu\"",
        "written as avro (subject orders.seen-value) with the subject's latest schema",
        "on success: emit \"captured\" is written as avro (subject payments-value) with the subject's latest schema",
    ] {
        assert!(stdout.contains(says), "{says:?} in:\n{stdout}");
    }

    // A given record: its own values, the same derived ids as for any run.
    let event = dir.join("event.json");
    std::fs::write(&event, r#"{"event_id":"e-1","order_id":"o-1","cents":1250,"channel":"store"}"#).unwrap();
    let response = dir.join("response.json");
    std::fs::write(&response, r#"{"status":201,"headers":{},"body":{"id":"pay_9"}}"#).unwrap();
    let (ok, stdout, stderr) =
        explain(&["--event".as_ref(), event.as_os_str(), "--response".as_ref(), response.as_os_str()]);
    assert!(ok, "{stderr}");
    let intent_id = relay_core::ids::derived_id("relay", "e-1", "capture");
    for says in [
        &*format!("intent id {intent_id}, idempotency key \"capture:o-1\""),
        "POST http://127.0.0.1:1/v2/captures/o-1",
        "\"cents\": 1250",
        "on success (with the --response answer)",
        "\"payment_id\": \"pay_9\"",
    ] {
        assert!(stdout.contains(says), "{says:?} in:\n{stdout}");
    }

    // What the consumer would dead-letter, with its reason.
    std::fs::write(&event, r#"{"event_id":"e-2","order_id":"x-2","cents":"12"}"#).unwrap();
    let (ok, stdout, stderr) = explain(&["--event".as_ref(), event.as_os_str()]);
    assert!(!ok && stderr.contains("nothing would be written for this event"), "a script sees it: {stderr}");
    assert!(stdout.contains("this event would not be applied: dead-lettered as schema_invalid"), "{stdout}");
    assert!(stdout.contains("/order_id") && stdout.contains("/cents"), "{stdout}");

    // The record's key and headers: the aggregate comes from header "order".
    std::fs::write(&event, r#"{"event_id":"e-3","order_id":"o-3","cents":5}"#).unwrap();
    let (ok, stdout, stderr) = explain(&[
        "--event".as_ref(),
        event.as_os_str(),
        "--header".as_ref(),
        "order=o-3".as_ref(),
        "--key".as_ref(),
        "k".as_ref(),
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("aggregate \"o-3\""), "{stdout}");
    let (ok, _, stderr) = explain(&["--event".as_ref(), event.as_os_str(), "--header".as_ref(), "order".as_ref()]);
    assert!(!ok && stderr.contains("give NAME=VALUE"), "{stderr}");

    // An example the templates cannot take as text says so, not that the route is broken.
    let looping = write_config(
        "[[routes]]\nname = \"r\"\ntopic = \"t\"\ntype = \"x\"\n[[routes.actions]]\nkind = \"emit\"\nname = \"e\"\n\
         type = \"y\"\ntopic = \"o\"\nkey = \"{{ data.items[0].sku }}\"\n",
    );
    let (ok, stdout, _) = output(relay().arg("--config").arg(&looping).args(["check-config", "--explain", "r"]));
    assert!(!ok && stdout.contains("the example could not be rendered") && stdout.contains("--event FILE"), "{stdout}");

    let (ok, _, stderr) = output(relay().arg("--config").arg(&config).args(["check-config", "--explain", "nope"]));
    assert!(!ok && stderr.contains("no route \"nope\"; the routes are: placed"), "{stderr}");
}
