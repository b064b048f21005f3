//! librdkafka client configuration from [`KafkaConfig`]: the relay's
//! required settings, then every user property passed through unchanged (so
//! TLS, SASL, client racks, tuning all work), then secrets from the
//! environment; and the check at start that the brokers take our TLS and
//! SASL settings ([`preflight`]).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use relay_core::config::{ConfigError, KafkaConfig};
use secrecy::ExposeSecret;
use tracing::{debug, error, info, warn};

/// Which client is being configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The inbox consumer.
    Consumer,
    /// The outbox publisher.
    Producer,
}

/// Settings the relay's guarantees depend on; a user property may not change them.
fn required(role: Role) -> &'static [(&'static str, &'static str)] {
    match role {
        // Offsets are stored and committed by the relay only after the DB
        // commit (R1); records of aborted producer transactions are never applied.
        Role::Consumer => &[
            ("enable.auto.commit", "false"),
            ("enable.auto.offset.store", "false"),
            ("isolation.level", "read_committed"),
            // A batch failing its checksum (bytes flipped on a broker's disk)
            // is reported as a bad message before librdkafka skips it, and
            // the consumer stops there; unchecked, a flipped digit in an
            // uncompressed value would be applied as the producer's data.
            ("check.crcs", "true"),
        ],
        // Idempotent producer, acks from all in-sync replicas (R10).
        Role::Producer => &[("enable.idempotence", "true"), ("acks", "all")],
    }
}

/// The most a consumer's compressed batch inflates to, and the most one
/// fetch response holds.
pub const MAX_INFLATED_BATCH: usize = 8 * 1024 * 1024;

/// `auto.offset.reset` values that never skip records: librdkafka's names for
/// the earliest offset, and `error` (no reset at all).
const SAFE_OFFSET_RESETS: &[&str] = &["earliest", "smallest", "beginning", "error"];

/// Build a client configuration.
pub fn client_config(cfg: &KafkaConfig, role: Role) -> Result<ClientConfig, ConfigError> {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.bootstrap_servers);
    match role {
        Role::Consumer => {
            c.set("auto.offset.reset", "earliest");
            c.set("session.timeout.ms", "10000");
            c.set("heartbeat.interval.ms", "1000");
            // 64 KiB per partition per fetch (librdkafka: 1 MiB), so that what
            // the consumer finds queued holds records of every partition, not
            // 2 000 of one: a batch runs one transaction per partition in
            // parallel, and a batch of one partition runs them one after
            // another. Ingest benchmark, 4 partitions: ~13 000 -> ~16 000
            // records/s (and ~19 500 with each partition on its own task,
            // consumer.rs). A record larger than this is still fetched whole;
            // raise it (kafka.consumer_properties) for large records over a
            // slow link.
            c.set("max.partition.fetch.bytes", "65536");
            // librdkafka inflates a zstd batch up to receive.message.max.bytes
            // (100 MB by default) before relay sees any of its records, and a
            // fetch of 64 KiB can carry twenty small batches that each inflate
            // that far: gigabytes per partition from one hostile producer.
            // 8 MiB per batch, and a fetch response (fetch.max.bytes) within
            // it, as librdkafka requires. A batch that inflates past it is
            // unreadable and parked; raise both for producers whose batches
            // are larger uncompressed.
            c.set("fetch.max.bytes", MAX_INFLATED_BATCH.to_string());
            c.set("receive.message.max.bytes", (MAX_INFLATED_BATCH + 512).to_string());
        }
        Role::Producer => {
            c.set("linger.ms", "5");
            c.set("compression.type", "lz4");
        }
    }
    let role_props = match role {
        Role::Consumer => &cfg.consumer_properties,
        Role::Producer => &cfg.producer_properties,
    };
    let mut problems = Vec::new();
    for (k, v) in cfg.properties.iter().chain(role_props) {
        let name = guarded_name(k);
        if role == Role::Consumer && name == "auto.offset.reset" && !SAFE_OFFSET_RESETS.contains(&v.as_str()) {
            problems.push(format!(
                "kafka property auto.offset.reset = {v:?}: a partition without a committed offset (a new \
                 group, or offsets expired while the relay was down) would skip its unprocessed records; \
                 the relay reads from the earliest offset (the inbox makes records it has seen duplicates); \
                 use \"earliest\" or \"error\""
            ));
            continue;
        }
        if let Some((_, want)) = required(role).iter().find(|(rk, _)| *rk == name) {
            if v != want {
                problems.push(format!(
                    "kafka property {k} = {v:?}: the relay needs {k} = {want} for its delivery guarantees"
                ));
            }
            continue;
        }
        c.set(k, v);
    }
    for (k, v) in crate::config::kafka_secrets(cfg)? {
        // A secret is for credentials: one of the properties guarded above
        // would go round their checks.
        let name = guarded_name(&k);
        if name == "auto.offset.reset" || required(role).iter().any(|(rk, _)| *rk == name) {
            problems.push(format!(
                "kafka secret_properties sets {k}, a property the relay guards: set it (if at all) in \
                 [kafka].properties, where its value is checked"
            ));
            continue;
        }
        c.set(k, v.expose_secret());
    }
    for (k, v) in required(role) {
        c.set(*k, *v);
    }
    if problems.is_empty() { Ok(c) } else { Err(ConfigError::Invalid { problems }) }
}

/// The name property `k` is checked under. librdkafka passes a property it
/// does not know globally to the default topic configuration, without a
/// `topic.` prefix: set so, a guarded property would pass the checks and
/// race the relay's own value (which wins depends on a map's order). It is
/// set as given: `topic.metadata.refresh.interval.ms` is a global property
/// of its own.
fn guarded_name(k: &str) -> &str {
    k.strip_prefix("topic.").unwrap_or(k)
}

/// Forward one librdkafka log line to tracing, at its level, naming the
/// client (`producer`, or the consumer's name): the one log context of the
/// consumer's and the publisher's clients.
pub fn forward_log(client: &str, level: RDKafkaLogLevel, facility: &str, message: &str) {
    match level {
        RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error => {
            error!(client, facility, "librdkafka: {message}")
        }
        RDKafkaLogLevel::Warning => warn!(client, facility, "librdkafka: {message}"),
        _ => debug!(client, facility, "librdkafka: {message}"),
    }
}

/// Forward a client-level error (librdkafka's error callback) to tracing.
pub fn forward_error(client: &str, error: &KafkaError, reason: &str) {
    warn!(client, error = %error, "Kafka client error: {reason}");
}

/// What librdkafka reported while [`preflight`] waited for the brokers.
#[derive(Default)]
struct Probe {
    /// The first TLS or SASL failure: waiting longer does not mend those.
    fatal: Mutex<Option<(RDKafkaErrorCode, String)>>,
    /// The last other error (a broker down, a name that does not resolve).
    last: Mutex<Option<String>>,
}

/// Whether a client error or log line says the brokers refused our TLS or
/// SASL settings, and which, however librdkafka reports it: a refused client
/// certificate can arrive as a transport error ("alert bad certificate",
/// a disconnect in the SSL handshake) rather than as an SSL error, and
/// which one depends on timing.
fn refusal(code: Option<RDKafkaErrorCode>, reason: &str) -> Option<RDKafkaErrorCode> {
    if let Some(c @ (RDKafkaErrorCode::SSL | RDKafkaErrorCode::Authentication)) = code {
        return Some(c);
    }
    // Told by the failure, not by the broker's address (`sasl_ssl://…`).
    let r = reason.to_ascii_lowercase();
    if ["ssl handshake", "handshake failed", "alert", "certificate", "ssl_handshake", "ssl listener"]
        .iter()
        .any(|w| r.contains(w))
    {
        Some(RDKafkaErrorCode::SSL)
    } else if r.contains("sasl authentication") || r.contains("authentication failed") {
        Some(RDKafkaErrorCode::Authentication)
    } else {
        None
    }
}

impl Probe {
    fn note(&self, code: Option<RDKafkaErrorCode>, reason: &str) {
        match refusal(code, reason) {
            Some(c) => {
                self.fatal
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .get_or_insert((c, reason.to_owned()));
            }
            None => *self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(reason.to_owned()),
        }
    }
}

impl ClientContext for Probe {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        forward_log("preflight", level, fac, log_message);
        // A connection's failure is logged (facility FAIL) even when no
        // error callback follows it before the wait ends.
        if fac == "FAIL" {
            self.note(None, log_message);
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.note(error.rdkafka_error_code(), reason);
    }
}

impl ConsumerContext for Probe {}

/// How long [`preflight`] waits for the brokers to answer.
const PREFLIGHT_WAIT: Duration = Duration::from_secs(15);

/// Connect to the brokers once, before the consumer and the publisher
/// start, so that a TLS or SASL setting the brokers refuse fails the start
/// with an error naming the broker and the setting at fault (the CA file,
/// the mechanism and user), instead of clients that retry the handshake
/// forever while nothing is consumed. Brokers that are merely unreachable
/// are only warned about: the clients connect by themselves when they come.
pub async fn preflight(cfg: &KafkaConfig) -> anyhow::Result<()> {
    let client_cfg = client_config(cfg, Role::Consumer)?;
    let consumer: BaseConsumer<Probe> = client_cfg.create_with_context(Probe::default()).map_err(|e| {
        anyhow::anyhow!("cannot create a Kafka client for {} with these kafka.properties: {e}", cfg.bootstrap_servers)
    })?;
    let started = Instant::now();
    let consumer = std::sync::Arc::new(consumer);
    let mut said_waiting = false;
    loop {
        let c = consumer.clone();
        let answered = tokio::task::spawn_blocking(move || {
            let answered = c.fetch_metadata(None, Duration::from_millis(500)).is_ok();
            // Errors reach the context only while the client is polled.
            let _ = c.poll(Duration::ZERO);
            answered
        })
        .await?;
        let probe = consumer.context();
        if let Some((code, reason)) = probe.fatal.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take() {
            anyhow::bail!("{}", refused(&client_cfg, code, &reason));
        }
        if answered {
            debug!(brokers = %cfg.bootstrap_servers, "Kafka brokers answered");
            return Ok(());
        }
        if started.elapsed() > PREFLIGHT_WAIT {
            let last = probe.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
            warn!(
                brokers = %cfg.bootstrap_servers,
                error = last.as_deref().unwrap_or("no answer"),
                "the Kafka brokers did not answer within {}s; starting anyway, the clients keep connecting",
                PREFLIGHT_WAIT.as_secs()
            );
            return Ok(());
        }
        if !said_waiting && started.elapsed() > Duration::from_secs(2) {
            info!(brokers = %cfg.bootstrap_servers, "waiting for the Kafka brokers to answer");
            said_waiting = true;
        }
    }
}

/// Input topic codecs whose batches librdkafka inflates without a cap:
/// gzip (inflated once to learn its size, then again), lz4 (grown by
/// realloc), and `producer`, which keeps whatever a producer sent. Only zstd
/// is capped (by `receive.message.max.bytes`); snappy cannot grow more
/// than a few dozen times.
const UNBOUNDED_CODECS: &[&str] = &["producer", "gzip", "lz4"];

/// Refuse (or warn about, per `kafka.on_unbounded_compression`) input
/// topics whose batches the client would inflate without a cap: one 1 MB
/// gzip batch inflates to about 1 GB before relay sees a record, which
/// kills the process, and every member after it, on every restart.
/// A broker that will not say (no DescribeConfigs, an ACL) is warned about.
pub async fn check_input_compression(cfg: &relay_core::RelayConfig) -> anyhow::Result<()> {
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    use rdkafka::client::DefaultClientContext;
    let topics = cfg.subscribed_topics();
    if topics.is_empty() {
        return Ok(());
    }
    let admin: AdminClient<DefaultClientContext> = client_config(&cfg.kafka, Role::Consumer)?.create()?;
    let specs: Vec<ResourceSpecifier<'_>> = topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let results = match admin.describe_configs(&specs, &opts).await {
        Ok(r) => r,
        Err(e) => {
            warn!(error = %e, "cannot read the input topics' compression.type from the brokers; if a topic keeps \
                   gzip or lz4 batches, one small hostile batch can inflate to gigabytes in the Kafka client: \
                   set compression.type = zstd on the input topics");
            return Ok(());
        }
    };
    let mut unbounded = Vec::new();
    for (topic, result) in topics.iter().zip(results) {
        match result {
            Ok(resource) => {
                let codec = resource.get("compression.type").and_then(|e| e.value.as_deref()).unwrap_or("producer");
                if UNBOUNDED_CODECS.contains(&codec) {
                    unbounded.push(format!("{topic} (compression.type = {codec})"));
                }
            }
            Err(e) => warn!(topic = %topic, error = %e, "cannot read this input topic's compression.type"),
        }
    }
    if unbounded.is_empty() {
        return Ok(());
    }
    let msg = format!(
        "input topic(s) {} may hold gzip or lz4 batches, which the Kafka client inflates without any cap before \
         relay sees a record: one hostile 1 MB batch can take gigabytes and crash every member that fetches it. \
         Set compression.type = zstd on each (kafka-configs.sh --alter --entity-type topics --entity-name TOPIC \
         --add-config compression.type=zstd): the broker then stores new batches as zstd, whose output the client \
         caps at receive.message.max.bytes (batches written before the change keep their codec)",
        unbounded.join(", ")
    );
    match cfg.kafka.on_unbounded_compression {
        relay_core::config::Shortfall::Refuse => {
            anyhow::bail!("{msg}; or set kafka.on_unbounded_compression = \"warn\" to start anyway")
        }
        relay_core::config::Shortfall::Warn => {
            warn!("{msg}");
            Ok(())
        }
    }
}

/// The start error for a TLS or SASL failure: what failed, against which
/// broker, and which setting to look at.
fn refused(c: &ClientConfig, code: RDKafkaErrorCode, reason: &str) -> String {
    let brokers = c.get("bootstrap.servers").unwrap_or_default();
    let protocol = c.get("security.protocol").unwrap_or("plaintext");
    match code {
        RDKafkaErrorCode::SSL => {
            let ca = match c.get("ssl.ca.location") {
                Some(ca) => format!("the CA in kafka property ssl.ca.location = {ca:?}"),
                None => "the system's CA certificates (kafka property ssl.ca.location is not set)".into(),
            };
            let hint = if reason.contains("certificate verify failed") || reason.contains("could not be verified") {
                format!("the broker's certificate is not signed by {ca}: set ssl.ca.location to the CA that signed it")
            } else {
                format!(
                    "check ssl.ca.location (now: {ca}) and, if the brokers require client certificates, \
                     ssl.certificate.location and ssl.key.location"
                )
            };
            format!(
                "TLS with the Kafka brokers at {brokers} failed (security.protocol = {protocol}): {hint}. librdkafka said: {reason}"
            )
        }
        _ => format!(
            "the Kafka brokers at {brokers} refused the SASL login (security.protocol = {protocol}, sasl.mechanism = {}, \
             sasl.username = {:?}): check the mechanism, the user and its password (kafka.secret_properties). librdkafka said: {reason}",
            c.get("sasl.mechanism").or_else(|| c.get("sasl.mechanisms")).unwrap_or("GSSAPI (librdkafka's default)"),
            c.get("sasl.username").unwrap_or_default(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A librdkafka built without OpenSSL or zstd fails every TLS or SCRAM
    /// setting when the client is created.
    #[test]
    fn clients_take_tls_every_sasl_mechanism_and_every_compression_codec() {
        for (protocol, mechanism) in [
            ("SSL", None),
            ("SASL_SSL", Some("SCRAM-SHA-512")),
            ("SASL_SSL", Some("SCRAM-SHA-256")),
            ("SASL_SSL", Some("PLAIN")),
            ("SASL_PLAINTEXT", Some("SCRAM-SHA-256")),
        ] {
            let mut cfg = KafkaConfig::default();
            cfg.properties.insert("security.protocol".into(), protocol.into());
            if let Some(m) = mechanism {
                cfg.properties.insert("sasl.mechanism".into(), m.into());
                cfg.properties.insert("sasl.username".into(), "u".into());
                cfg.properties.insert("sasl.password".into(), "p".into());
            }
            let consumer = client_config(&cfg, Role::Consumer).unwrap().create::<BaseConsumer>();
            assert!(consumer.is_ok(), "{protocol} {mechanism:?}: {:?}", consumer.err());
        }
        for codec in ["zstd", "lz4", "snappy", "gzip"] {
            let mut cfg = KafkaConfig::default();
            cfg.producer_properties.insert("compression.type".into(), codec.into());
            let producer = client_config(&cfg, Role::Producer).unwrap().create::<rdkafka::producer::BaseProducer>();
            assert!(producer.is_ok(), "{codec}: {:?}", producer.err());
        }
    }

    #[test]
    fn user_properties_pass_through_but_guarantees_cannot_be_turned_off() {
        let mut cfg = KafkaConfig::default();
        cfg.properties.insert("security.protocol".into(), "SASL_SSL".into());
        let c = client_config(&cfg, Role::Consumer).unwrap();
        assert_eq!(c.get("security.protocol"), Some("SASL_SSL"));
        assert_eq!(c.get("enable.auto.offset.store"), Some("false"));

        cfg.consumer_properties.insert("enable.auto.commit".into(), "true".into());
        let err = client_config(&cfg, Role::Consumer).unwrap_err().to_string();
        assert!(err.contains("enable.auto.commit"), "{err}");
    }

    // An offset reset to the end would skip records never processed (R1).
    #[test]
    fn an_offset_reset_that_skips_records_is_refused() {
        for bad in ["latest", "largest", "end"] {
            let mut cfg = KafkaConfig::default();
            cfg.consumer_properties.insert("auto.offset.reset".into(), bad.into());
            let err = client_config(&cfg, Role::Consumer).unwrap_err().to_string();
            assert!(err.contains("auto.offset.reset") && err.contains("earliest"), "{err}");
        }
        let mut cfg = KafkaConfig::default();
        cfg.properties.insert("auto.offset.reset".into(), "error".into());
        assert_eq!(client_config(&cfg, Role::Consumer).unwrap().get("auto.offset.reset"), Some("error"));
        // The topic-level name librdkafka takes for the same field.
        for at in ["properties", "consumer_properties"] {
            let mut cfg = KafkaConfig::default();
            let props = if at == "properties" { &mut cfg.properties } else { &mut cfg.consumer_properties };
            props.insert("topic.auto.offset.reset".into(), "latest".into());
            let err = client_config(&cfg, Role::Consumer).unwrap_err().to_string();
            assert!(err.contains("auto.offset.reset") && err.contains("earliest"), "{at}: {err}");
        }
    }

    // Read_uncommitted would apply records of aborted transactions.
    #[test]
    fn records_of_aborted_transactions_cannot_be_read() {
        let mut cfg = KafkaConfig::default();
        cfg.consumer_properties.insert("isolation.level".into(), "read_uncommitted".into());
        let err = client_config(&cfg, Role::Consumer).unwrap_err().to_string();
        assert!(err.contains("isolation.level") && err.contains("read_committed"), "{err}");
        // Without CRC checks a corrupted value would be applied as it reads.
        let mut cfg = KafkaConfig::default();
        cfg.properties.insert("check.crcs".into(), "false".into());
        let err = client_config(&cfg, Role::Consumer).unwrap_err().to_string();
        assert!(err.contains("check.crcs"), "{err}");
        let c = client_config(&KafkaConfig::default(), Role::Consumer).unwrap();
        assert_eq!(c.get("isolation.level"), Some("read_committed"));
    }

    #[test]
    fn a_refused_certificate_or_login_is_told_from_a_broker_that_is_down_however_it_is_reported() {
        use RDKafkaErrorCode as C;
        let transport = Some(C::BrokerTransportFailure);
        for reason in [
            "ssl://127.0.0.1:9093/bootstrap: SSL handshake failed: ssl/record/rec_layer_s3.c:1605: error:0A000412:SSL \
             routines::sslv3 alert bad certificate: SSL alert number 42",
            "ssl://127.0.0.1:9093/bootstrap: Disconnected while requesting ApiVersion: might be caused by incorrect \
             security.protocol configuration (connecting to a SSL listener?)",
            "ssl://127.0.0.1:9093/bootstrap: SSL handshake failed: error:0A000086:SSL routines::certificate verify failed",
            "sasl_ssl://127.0.0.1:9094/bootstrap: SSL handshake failed: error:0A000086:SSL routines::certificate \
             verify failed: broker certificate could not be verified (after 174ms in state SSL_HANDSHAKE)",
        ] {
            assert_eq!(refusal(transport, reason), Some(C::SSL), "{reason}");
        }
        let sasl = "sasl_ssl://127.0.0.1:9094/bootstrap: SASL authentication error: Authentication failed during \
                    authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512";
        assert_eq!(refusal(transport, sasl), Some(C::Authentication));
        assert_eq!(refusal(Some(C::SSL), "anything"), Some(C::SSL));
        for down in [
            "127.0.0.1:9092/bootstrap: Connect to ipv4#127.0.0.1:9092 failed: Connection refused (after 0ms in state CONNECT)",
            "1/1 brokers are down",
        ] {
            assert_eq!(refusal(transport, down), None, "{down}");
        }
    }

    #[test]
    fn secret_properties_come_from_the_environment() {
        let mut cfg = KafkaConfig::default();
        cfg.secret_properties.insert("sasl.password".into(), "RELAY_TEST_NOT_SET_ANYWHERE".into());
        let err = client_config(&cfg, Role::Producer).unwrap_err().to_string();
        assert!(err.contains("RELAY_TEST_NOT_SET_ANYWHERE"), "{err}");
        // Nor can a secret set what the checks guard (PATH is set wherever tests run).
        let mut cfg = KafkaConfig::default();
        cfg.secret_properties.insert("auto.offset.reset".into(), "PATH".into());
        let err = client_config(&cfg, Role::Consumer).unwrap_err().to_string();
        assert!(err.contains("sets auto.offset.reset, a property the relay guards"), "{err}");
    }

    #[test]
    fn a_consumer_inflates_a_batch_to_8_mib_at_most_and_librdkafka_accepts_it() {
        let cfg = KafkaConfig { bootstrap_servers: "127.0.0.1:1".into(), ..KafkaConfig::default() };
        let c = client_config(&cfg, Role::Consumer).unwrap();
        assert_eq!(c.get("receive.message.max.bytes"), Some("8389120"));
        assert_eq!(c.get("fetch.max.bytes"), Some("8388608"));
        // librdkafka checks the two against each other and message.max.bytes.
        let consumer: Result<rdkafka::consumer::BaseConsumer, _> = c.clone().set("group.id", "g").create();
        assert!(consumer.is_ok(), "{:?}", consumer.err());
    }
}
