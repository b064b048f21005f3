//! librdkafka client configuration from [`KafkaConfig`]: the relay's
//! required settings, then every user property passed through unchanged (so
//! SASL_SSL, client racks, tuning all work), then secrets from the environment.

use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::KafkaError;
use relay_core::config::{ConfigError, KafkaConfig};
use secrecy::ExposeSecret;
use tracing::{debug, error, warn};

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
        // Offsets are stored and committed by the relay only after the DB commit (R1).
        Role::Consumer => &[("enable.auto.commit", "false"), ("enable.auto.offset.store", "false")],
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

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn secret_properties_come_from_the_environment() {
        let mut cfg = KafkaConfig::default();
        cfg.secret_properties.insert("sasl.password".into(), "RELAY_TEST_NOT_SET_ANYWHERE".into());
        let err = client_config(&cfg, Role::Producer).unwrap_err().to_string();
        assert!(err.contains("RELAY_TEST_NOT_SET_ANYWHERE"), "{err}");
    }
}
