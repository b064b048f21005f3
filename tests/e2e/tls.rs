//! Production clusters: Kafka over TLS (mutual TLS, and SASL_SSL with
//! SCRAM-SHA-512, SCRAM-SHA-256 and PLAIN) and PostgreSQL with
//! `sslmode=verify-full`, against a real Apache Kafka and a real PostgreSQL
//! of the test's own, with certificates the test makes (openssl). A wrong CA
//! fails the start with an error naming the CA file and the server.

use std::path::Path;
use std::time::Duration;

use crate::support::*;
use relay_core::config::KafkaConfig;
use relay_testkit::process::{PrivateKafka, PrivatePostgres, SASL_PASSWORD, SASL_USER};
use relay_testkit::tls::TestPki;
use relay_testkit::{TestProducer, create_topics, read_topic, unique};

/// The environment variable the relay reads the SASL password from.
const PASSWORD_ENV: &str = "RELAY_TEST_SASL_PASSWORD";

/// Everything a TLS test needs: certificates, a broker with TLS listeners,
/// a PostgreSQL serving TLS, and the test's world on them.
struct Secure {
    pki: TestPki,
    kafka: PrivateKafka,
    pg: PrivatePostgres,
    h: Harness,
}

impl Secure {
    async fn start() -> Secure {
        let dir = std::env::temp_dir().join(unique("relay-pki"));
        let pki = TestPki::generate(&dir).expect("certificates");
        let kafka = PrivateKafka::start_secure(&pki).expect("a broker with TLS listeners");
        let pg = PrivatePostgres::start_tls(&pki).expect("PostgreSQL with TLS");
        let mut h = Harness::new(1).await;
        // The test's own producer, admin and reader use the PLAINTEXT listener.
        h.bootstrap = kafka.bootstrap();
        create_topics(&h.bootstrap, &[&h.topic, &h.out, &h.dlq], 2).await.expect("topics");
        h.producer = TestProducer::new(&h.bootstrap).expect("producer");
        Secure { pki, kafka, pg, h }
    }

    /// The database URL over TLS, the server's certificate checked against `ca`.
    fn database_url(&self, ca: &Path) -> String {
        format!("{}?sslmode=verify-full&sslrootcert={}", self.pg.url(), ca.display())
    }

    /// The `[kafka]` section for the SASL_SSL listener with `mechanism`.
    fn sasl_ssl(&self, mechanism: &str, ca: &Path) -> String {
        format!(
            r#"
[kafka]
bootstrap_servers = "{}"
consumer_properties = {{ "session.timeout.ms" = "6000" }}
secret_properties = {{ "sasl.password" = "{PASSWORD_ENV}" }}
[kafka.properties]
"security.protocol" = "SASL_SSL"
"sasl.mechanism" = "{mechanism}"
"sasl.username" = "{SASL_USER}"
"ssl.ca.location" = "{}"
"#,
            self.kafka.sasl_ssl_bootstrap().expect("secure broker"),
            ca.display()
        )
    }

    /// The `[kafka]` section for the SSL listener, with a client certificate.
    fn mutual_tls(&self) -> String {
        format!(
            r#"
[kafka]
bootstrap_servers = "{}"
consumer_properties = {{ "session.timeout.ms" = "6000" }}
[kafka.properties]
"security.protocol" = "SSL"
"ssl.ca.location" = "{}"
"ssl.certificate.location" = "{}"
"ssl.key.location" = "{}"
"#,
            self.kafka.ssl_bootstrap().expect("secure broker"),
            self.pki.ca().display(),
            self.pki.client_cert().display(),
            self.pki.client_key().display()
        )
    }

    /// The harness's configuration with its `[kafka]` section replaced by `kafka`.
    fn config(&self, kafka: &str) -> String {
        let text = self.h.config_text(&CAPTURE_ROUTE);
        let start = text.find("[kafka]").expect("a [kafka] section");
        let end = start + text[start..].find("[database]").expect("[database] after [kafka]");
        format!("{}{kafka}\n{}", &text[..start], &text[end..])
    }
}

/// Send `n` orders and one record that is not JSON, run `relay run` over
/// `kafka` and the TLS database until all is consumed, called and
/// published, then `relay verify` over the same settings.
async fn run_over(s: &Secure, kafka: &str, first: usize, n: usize) {
    let h = &s.h;
    let config = h.write_config(&s.config(kafka));
    for i in first..first + n {
        h.send(&order(&format!("evt-{i}"), &format!("o-{i}"))).await;
    }
    h.producer.raw(&h.topic, Some(0), None, &[], Some(b"{not json")).await.expect("poison");
    let url = s.database_url(&s.pki.ca());
    let env = [("DATABASE_URL", url.as_str()), (PASSWORD_ENV, SASL_PASSWORD)];
    let mut run = h.process(&config, &["run"], &env);
    // Every run so far sent `n` orders and one poison record.
    let runs = first / n + 1;
    let records = i64::try_from(first + n + runs).unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&url).await.expect("pool over TLS");
    let count = |sql: &'static str| {
        let pool = pool.clone();
        async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(&pool).await.unwrap_or(-1) }
    };
    eventually("every record consumed over TLS", DEADLINE, || async {
        (count("SELECT count(*) FROM relay.inbox").await + count("SELECT count(*) FROM relay.dead_letters").await
            >= records)
            .then_some(())
    })
    .await;
    eventually("every call made and every event published over TLS", DEADLINE, || async {
        let open = count("SELECT count(*) FROM relay.intents WHERE state IN ('pending','running')").await
            + count("SELECT count(*) FROM relay.outbox WHERE state <> 'published'").await;
        (open == 0).then_some(())
    })
    .await;
    eventually("offsets committed over TLS", DEADLINE, || async {
        (h.committed_total().await >= records).then_some(())
    })
    .await;
    let status = run.terminate(Duration::from_secs(30)).expect("stop");
    assert!(status.success(), "relay run over TLS exited with {status:?}:\n{}", run.log());

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_relay"))
        .args(["--config", config.to_str().unwrap(), "verify", "--grace", "1s"])
        .env("DATABASE_URL", &url)
        .env(PASSWORD_ENV, SASL_PASSWORD)
        .env("NO_COLOR", "1")
        .output()
        .expect("relay verify");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "relay verify over TLS failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_relay_consumes_calls_publishes_dead_letters_and_verifies_over_sasl_ssl_mutual_tls_and_verified_postgres() {
    let s = Secure::start().await;
    relay_store::migrate(
        &sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&s.database_url(&s.pki.ca()))
            .await
            .expect("PostgreSQL over TLS"),
    )
    .await
    .expect("migrate");

    run_over(&s, &s.sasl_ssl("SCRAM-SHA-512", &s.pki.ca()), 0, 20).await;
    // The same group and database on the mutual-TLS listener: the second
    // run takes up where the first one committed.
    run_over(&s, &s.mutual_tls(), 20, 20).await;

    assert_eq!(s.h.provider.stats().applied, 40, "each capture applied once");
    assert!(s.h.provider.stats().double_applied().is_empty());
    let captured = read_topic(&s.h.bootstrap, &s.h.out, 40).await.expect("output topic");
    assert_eq!(captured.len(), 40, "payment.captured published over TLS, once each");
    let dead = read_topic(&s.h.bootstrap, &s.h.dlq, 2).await.expect("dead-letter topic");
    assert_eq!(dead.len(), 2, "each poison record copied to the dead-letter topic over TLS");
}

/// SCRAM-SHA-256 and PLAIN log in too; a wrong password is refused at
/// start naming the mechanism and the user.
#[tokio::test(flavor = "multi_thread")]
async fn every_sasl_mechanism_logs_in_and_a_wrong_password_fails_the_start_naming_the_user() {
    let s = Secure::start().await;
    let kafka = |mechanism: &str, password: &str| {
        let mut k = KafkaConfig { bootstrap_servers: s.kafka.sasl_ssl_bootstrap().unwrap(), ..KafkaConfig::default() };
        for (key, value) in [
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", mechanism),
            ("sasl.username", SASL_USER),
            ("sasl.password", password),
            ("ssl.ca.location", s.pki.ca().to_str().unwrap()),
        ] {
            k.properties.insert(key.into(), value.into());
        }
        k
    };
    for mechanism in ["SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN"] {
        relay::runtime::kafka::preflight(&kafka(mechanism, SASL_PASSWORD))
            .await
            .unwrap_or_else(|e| panic!("{mechanism}: {e:#}"));
    }
    let err = relay::runtime::kafka::preflight(&kafka("SCRAM-SHA-512", "not-the-password"))
        .await
        .expect_err("a wrong password must fail the start")
        .to_string();
    assert!(err.contains("SASL") && err.contains("SCRAM-SHA-512") && err.contains(SASL_USER), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_ca_for_kafka_or_postgresql_fails_the_start_naming_the_ca_file_and_the_server() {
    let s = Secure::start().await;
    let wrong = s.pki.wrong_ca();
    let good_db = s.database_url(&s.pki.ca());
    relay_store::migrate(&sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&good_db).await.unwrap())
        .await
        .unwrap();

    // Kafka: the broker's certificate is not signed by the configured CA.
    let config = s.h.write_config(&s.config(&s.sasl_ssl("SCRAM-SHA-512", &wrong)));
    let mut run = s.h.process(&config, &["run"], &[("DATABASE_URL", &good_db), (PASSWORD_ENV, SASL_PASSWORD)]);
    let status = run.wait(DEADLINE).expect("relay run must stop by itself");
    let log = run.log();
    assert!(!status.success(), "{log}");
    let broker = s.kafka.sasl_ssl_bootstrap().unwrap();
    assert!(
        log.contains("ssl.ca.location") && log.contains(wrong.to_str().unwrap()) && log.contains(&broker),
        "the error names the CA file and the broker:\n{log}"
    );

    // PostgreSQL: verify-full against the wrong CA.
    let config = s.h.write_config(&s.config(&s.sasl_ssl("SCRAM-SHA-512", &s.pki.ca())));
    let bad_db = s.database_url(&wrong);
    let mut run = s.h.process(&config, &["run"], &[("DATABASE_URL", &bad_db), (PASSWORD_ENV, SASL_PASSWORD)]);
    let status = run.wait(DEADLINE).expect("relay run must stop by itself");
    let log = run.log();
    assert!(!status.success(), "{log}");
    let server = s.pg.url().trim_start_matches("postgres://postgres@").trim_end_matches("/postgres").to_owned();
    assert!(
        log.contains("sslrootcert") && log.contains(wrong.to_str().unwrap()) && log.contains(&server),
        "the error names the CA file and the server:\n{log}"
    );
}

// A client without a certificate on a listener that requires one is
// refused by the broker, which librdkafka may report as a transport error
// ("alert bad certificate"): the start must fail all the same, naming the
// settings, rather than start anyway and retry for ever.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_without_the_certificate_the_brokers_require_fails_the_start_naming_the_settings() {
    let s = Secure::start().await;
    let without_cert: String = s
        .mutual_tls()
        .lines()
        .filter(|l| !l.contains("ssl.certificate.location") && !l.contains("ssl.key.location"))
        .collect::<Vec<_>>()
        .join("\n");
    let db = s.database_url(&s.pki.ca());
    relay_store::migrate(&sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&db).await.unwrap())
        .await
        .unwrap();
    let config = s.h.write_config(&s.config(&without_cert));
    for _ in 0..3 {
        let mut run = s.h.process(&config, &["run"], &[("DATABASE_URL", &db)]);
        let status = run.wait(DEADLINE).expect("relay run must stop by itself");
        let log = run.log();
        assert!(!status.success(), "{log}");
        assert!(!log.contains("starting anyway"), "{log}");
        assert!(
            log.contains("ssl.certificate.location") && log.contains(&s.kafka.ssl_bootstrap().unwrap()),
            "the error names the client certificate setting and the broker:\n{log}"
        );
    }
}

// Issue 28, L7: an endpoint on a private PKI with mutual TLS. The endpoint
// trusts only its `ca_file` and presents its client certificate; without
// the certificate, or trusting another CA, no request reaches a route.
#[tokio::test(flavor = "multi_thread")]
async fn an_endpoint_with_its_own_ca_and_client_certificate_is_called_and_a_wrong_one_reaches_nothing() {
    use example_provider::{Provider, Settings, TlsFiles};
    let h = Harness::new(1).await;
    let pki = TestPki::generate(&std::env::temp_dir().join(unique("relay-endpoint-pki"))).unwrap();
    let tls = TlsFiles { cert: pki.server_cert(), key: pki.server_key(), client_ca: Some(pki.ca()) };
    let provider = Provider::start_tls("127.0.0.1:0".parse().unwrap(), Settings::default(), &tls).await.unwrap();
    assert!(provider.url().starts_with("https://"));
    let consumer = h.consumer.clone();
    for (endpoint, prefix) in [("mtls", "a-"), ("no-client-cert", "b-"), ("wrong-ca", "c-")] {
        relay_testkit::seed::pending_intents(&h.db.pool, &consumer, endpoint, prefix, 3).await.unwrap();
    }
    sqlx::query("UPDATE relay.intents SET max_attempts = 2").execute(&h.db.pool).await.unwrap();
    let mut cfg = h.config(&CAPTURE_ROUTE);
    let endpoint = |ca: &Path, client: bool| {
        let mut e = cfg.endpoints["psp"].clone();
        e.base_url = provider.url().parse().unwrap();
        e.tls.ca_file = Some(ca.to_owned());
        if client {
            (e.tls.client_cert_file, e.tls.client_key_file) = (Some(pki.client_cert()), Some(pki.client_key()));
        }
        e
    };
    let endpoints = [
        ("mtls", endpoint(&pki.ca(), true)),
        ("no-client-cert", endpoint(&pki.ca(), false)),
        ("wrong-ca", endpoint(&pki.wrong_ca(), true)),
    ];
    cfg.endpoints.extend(endpoints.map(|(n, e)| (n.to_string(), e)));
    let run =
        h.start(cfg, relay::Components { consumer: false, dispatcher: true, publisher: false }, no_faults()).await;
    h.await_intents_finished(9).await;
    run.stop().await.unwrap();

    let ended: Vec<(String, String, Option<String>)> =
        sqlx::query_as("SELECT endpoint, state, last_error FROM relay.intents ORDER BY endpoint, idempotency_key")
            .fetch_all(&h.db.pool)
            .await
            .unwrap();
    for (endpoint, state, error) in &ended {
        let error = error.as_deref().unwrap_or("");
        match endpoint.as_str() {
            "mtls" => assert_eq!(state, "succeeded", "{error}"),
            // A handshake refused is a call never made: dead when the budget
            // ends, not uncertain (TLS 1.3 sends the request before the
            // server has refused the certificate).
            "no-client-cert" => {
                assert_eq!(state, "dead", "{error}");
                assert!(
                    error.contains("refused the TLS handshake") && error.contains("CertificateRequired"),
                    "{error}"
                );
            }
            _ => {
                assert_eq!(state, "dead", "{error}");
                assert!(error.contains("UnknownIssuer"), "{error}");
            }
        }
    }
    let stats = provider.stats();
    assert_eq!(stats.requests, 3, "only the endpoint with the right CA and certificate reached the provider");
    assert_eq!(stats.by_key.keys().filter(|k| k.starts_with("capture:a-")).count(), 3);
}

#[test]
fn check_config_reads_every_endpoint_tls_file_and_commands_that_make_no_calls_need_none() {
    let dir = std::env::temp_dir().join(unique("relay-endpoint-tls"));
    let pki = TestPki::generate(&dir.join("pki")).unwrap();
    std::fs::copy(pki.ca(), dir.join("ca.pem")).unwrap();
    std::fs::write(dir.join("empty.pem"), "").unwrap();
    let write = |tls: &str| {
        let file = dir.join(format!("{}.toml", unique("relay")));
        let text = format!(
            "[consumer]\nname = \"c\"\n[endpoints.psp]\nbase_url = \"https://psp.example/\"\n[endpoints.psp.tls]\n{tls}\n"
        );
        std::fs::write(&file, text).unwrap();
        file
    };
    let check = |tls: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_relay"))
            .arg("--config")
            .arg(write(tls))
            .arg("check-config")
            .env_remove("DATABASE_URL")
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    };
    // Relative to the configuration file, and named in the summary.
    let (ok, out) = check("ca_file = \"ca.pem\"");
    assert!(ok && out.contains("tls.ca_file") && out.contains("ca.pem"), "{out}");
    let (ok, out) = check("ca_file = \"missing.pem\"");
    assert!(!ok && out.contains("endpoints.psp.tls.ca_file: cannot read") && out.contains("missing.pem"), "{out}");
    let (ok, out) = check("ca_file = \"empty.pem\"");
    assert!(!ok && out.contains("holds no PEM certificate"), "{out}");
    let (ok, out) = check("client_cert_file = \"ca.pem\"");
    assert!(!ok && out.contains("client_cert_file and client_key_file go together"), "{out}");
    let (ok, out) = check("ca_file = \"ca.pem\"\ncertificate = \"x\"");
    assert!(!ok && out.contains("certificate"), "unknown keys are refused: {out}");
    // Loading alone (what `relay consume`, `verify`, `outbox` … do) reads no TLS file.
    assert!(relay::config::load(Some(&write("ca_file = \"missing.pem\""))).is_ok());
}
