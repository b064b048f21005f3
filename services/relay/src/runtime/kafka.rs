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
            // With CRC checks on, librdkafka skips a batch failing its
            // checksum and goes on: its records would be passed over by the
            // next offset commit. Off, a batch it cannot read is fetched and
            // reported again, and its partition stops there.
            ("check.crcs", "false"),
        ],
        // Idempotent producer, acks from all in-sync replicas (R10).
        Role::Producer => &[("enable.idempotence", "true"), ("acks", "all")],
    }
}

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
        if role == Role::Consumer && k == "auto.offset.reset" && !SAFE_OFFSET_RESETS.contains(&v.as_str()) {
            problems.push(format!(
                "kafka property auto.offset.reset = {v:?}: a partition without a committed offset (a new \
                 group, or offsets expired while the relay was down) would skip its unprocessed records; \
                 the relay reads from the earliest offset (the inbox makes records it has seen duplicates); \
                 use \"earliest\" or \"error\""
            ));
            continue;
        }
        if let Some((_, want)) = required(role).iter().find(|(rk, _)| rk == k) {
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
        c.set(k, v.expose_secret());
    }
    for (k, v) in required(role) {
        c.set(*k, *v);
    }
    if problems.is_empty() { Ok(c) } else { Err(ConfigError::Invalid { problems }) }
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

impl ClientContext for Probe {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        forward_log("preflight", level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        let code = error.rdkafka_error_code();
        match code {
            Some(c @ (RDKafkaErrorCode::SSL | RDKafkaErrorCode::Authentication)) => {
                self.fatal
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .get_or_insert((c, reason.to_owned()));
            }
            _ => *self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(reason.to_owned()),
        }
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

    /// Security review H3: librdkafka was built without OpenSSL or zstd, so
    /// every TLS or SCRAM setting failed when the client was created.
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

    // Issue 22 item 17.
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
    }

    // Ingest review D9: read_uncommitted would apply records of aborted transactions.
    #[test]
    fn records_of_aborted_transactions_cannot_be_read() {
        let mut cfg = KafkaConfig::default();
        cfg.consumer_properties.insert("isolation.level".into(), "read_uncommitted".into());
        let err = client_config(&cfg, Role::Consumer).unwrap_err().to_string();
        assert!(err.contains("isolation.level") && err.contains("read_committed"), "{err}");
        // Issue 27: CRC checks make librdkafka skip a corrupt batch.
        let mut cfg = KafkaConfig::default();
        cfg.properties.insert("check.crcs".into(), "true".into());
        let err = client_config(&cfg, Role::Consumer).unwrap_err().to_string();
        assert!(err.contains("check.crcs"), "{err}");
        let c = client_config(&KafkaConfig::default(), Role::Consumer).unwrap();
        assert_eq!(c.get("isolation.level"), Some("read_committed"));
    }

    #[test]
    fn secret_properties_come_from_the_environment() {
        let mut cfg = KafkaConfig::default();
        cfg.secret_properties.insert("sasl.password".into(), "RELAY_TEST_NOT_SET_ANYWHERE".into());
        let err = client_config(&cfg, Role::Producer).unwrap_err().to_string();
        assert!(err.contains("RELAY_TEST_NOT_SET_ANYWHERE"), "{err}");
    }
}
