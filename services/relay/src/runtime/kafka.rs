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

/// The least `receive.message.max.bytes` is, which is also the most a zstd
/// batch inflates to: batches of topics kept in zstd before it became
/// unbounded per fetch (see [`check_input_topics`]) still inflate this far.
pub const MAX_INFLATED_BATCH: usize = 8 * 1024 * 1024;

/// The most batch bytes one fetch response carries (`fetch.max.bytes`),
/// unless a single batch is larger. With a topic stored in snappy, whose
/// output is at most ~21.3 times its input, one response inflates to at
/// most ~43 MiB.
pub const FETCH_MAX_BYTES: usize = 2 * 1024 * 1024;

/// Kafka's default `max.message.bytes`: the largest batch a topic keeps
/// unless configured otherwise.
pub const KAFKA_DEFAULT_LARGEST_BATCH: usize = 1_048_588;

/// What a fetch response holds besides its batches: a header of about 50
/// bytes per partition and, under read_committed, 16 bytes per aborted
/// transaction overlapping the fetched range. librdkafka drops a response
/// over `receive.message.max.bytes` and reports it as a bad message, and
/// the broker only bounds the batch bytes, so the limit leaves this much
/// room: ~20 000 partitions of one broker.
const RESPONSE_HEADROOM: usize = 1024 * 1024;

/// `receive.message.max.bytes` for a consumer of topics whose largest batch
/// is `largest_batch` bytes: a response is at most one fetch's batch bytes,
/// or one larger batch, plus its headers.
pub fn receive_limit(largest_batch: usize) -> usize {
    MAX_INFLATED_BATCH.max(FETCH_MAX_BYTES).max(largest_batch) + RESPONSE_HEADROOM
}

/// `auto.offset.reset` values that never skip records: librdkafka's names for
/// the earliest offset, and `error` (no reset at all).
const SAFE_OFFSET_RESETS: &[&str] = &["earliest", "smallest", "beginning", "error"];

/// Build a client configuration (a consumer's for topics whose batches are
/// at most Kafka's default size).
pub fn client_config(cfg: &KafkaConfig, role: Role) -> Result<ClientConfig, ConfigError> {
    configure(cfg, role, KAFKA_DEFAULT_LARGEST_BATCH)
}

/// The inbox consumer's configuration, for input topics whose largest batch
/// is `largest_batch` bytes (their `max.message.bytes`).
pub fn consumer_config(cfg: &KafkaConfig, largest_batch: usize) -> Result<ClientConfig, ConfigError> {
    configure(cfg, Role::Consumer, largest_batch)
}

fn configure(cfg: &KafkaConfig, role: Role, largest_batch: usize) -> Result<ClientConfig, ConfigError> {
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
            // A response over receive.message.max.bytes is dropped and
            // reported as a bad message, on which the consumer stops: the
            // limit must hold the largest response the broker may send.
            c.set("fetch.max.bytes", FETCH_MAX_BYTES.to_string());
            c.set("receive.message.max.bytes", receive_limit(largest_batch).to_string());
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

/// Input topic codecs whose batches inflate within a bound per fetch:
/// snappy's output is at most ~21.3 times its input (a 3-byte copy of 64
/// bytes), and a topic set to either has the broker re-encode every batch
/// producers send. librdkafka inflates gzip and lz4 without a cap; zstd is
/// capped per batch (at `receive.message.max.bytes`), not per fetch, and a
/// 300-byte zstd batch can inflate to the cap, so ~200 of them in one
/// 64 KiB partition fetch take ~1.6 GiB; `producer` keeps whatever a
/// producer sent.
const BOUNDED_CODECS: &[&str] = &["snappy", "uncompressed"];

/// What the input topics' configurations say that the consumer's needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputTopics {
    /// The largest `max.message.bytes` among them: the largest batch a fetch
    /// may have to carry whole.
    pub largest_batch: usize,
}

impl Default for InputTopics {
    fn default() -> Self {
        InputTopics { largest_batch: KAFKA_DEFAULT_LARGEST_BATCH }
    }
}

/// Read the input topics' configurations: refuse (or warn about, per
/// `kafka.on_unbounded_compression`) topics whose batches the client would
/// inflate without a bound per fetch (one 1 MB gzip batch inflates to about
/// 1 GB before relay sees a record, which kills the process, and every
/// member after it, on every restart), and learn their largest batch. A
/// broker that will not say (no DescribeConfigs, an ACL) is warned about.
pub async fn check_input_topics(cfg: &relay_core::RelayConfig) -> anyhow::Result<InputTopics> {
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    use rdkafka::client::DefaultClientContext;
    let topics = cfg.subscribed_topics();
    let mut found = InputTopics::default();
    if topics.is_empty() {
        return Ok(found);
    }
    let admin: AdminClient<DefaultClientContext> = client_config(&cfg.kafka, Role::Consumer)?.create()?;
    let specs: Vec<ResourceSpecifier<'_>> = topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let results = match admin.describe_configs(&specs, &opts).await {
        Ok(r) => r,
        Err(e) => {
            warn!(error = %e, "cannot read the input topics' configurations from the brokers; if a topic keeps \
                   zstd, gzip or lz4 batches, a few small hostile batches can inflate to gigabytes in the Kafka \
                   client: set compression.type = snappy on the input topics. A batch over {} bytes stops the \
                   consumer unless kafka.consumer_properties raises receive.message.max.bytes",
                   receive_limit(found.largest_batch));
            return Ok(found);
        }
    };
    let mut unbounded = Vec::new();
    for (topic, result) in topics.iter().zip(results) {
        match result {
            Ok(resource) => {
                let codec = resource.get("compression.type").and_then(|e| e.value.as_deref()).unwrap_or("producer");
                if !BOUNDED_CODECS.contains(&codec) {
                    unbounded.push(format!("{topic} (compression.type = {codec})"));
                }
                let largest = resource.get("max.message.bytes").and_then(|e| e.value.as_deref()?.parse().ok());
                found.largest_batch = found.largest_batch.max(largest.unwrap_or(KAFKA_DEFAULT_LARGEST_BATCH));
            }
            Err(e) => warn!(topic = %topic, error = %e, "cannot read this input topic's configuration"),
        }
    }
    if unbounded.is_empty() {
        return Ok(found);
    }
    let msg = format!(
        "input topic(s) {} may hold zstd, gzip or lz4 batches, which the Kafka client inflates without a bound \
         per fetch before relay sees a record: a few hostile batches of a few hundred bytes can take gigabytes \
         and crash every member that fetches them. Set compression.type = snappy on each (kafka-configs.sh \
         --alter --entity-type topics --entity-name TOPIC --add-config compression.type=snappy), or \
         uncompressed: the broker then re-encodes every new batch into it, and snappy inflates at most ~21 times \
         (batches written before the change keep their codec)",
        unbounded.join(", ")
    );
    match cfg.kafka.on_unbounded_compression {
        relay_core::config::Shortfall::Refuse => {
            anyhow::bail!("{msg}; or set kafka.on_unbounded_compression = \"warn\" to start anyway")
        }
        relay_core::config::Shortfall::Warn => {
            warn!("{msg}");
            Ok(found)
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
    fn a_consumer_receives_a_full_fetch_or_its_largest_batch_with_room_for_headers() {
        let cfg = KafkaConfig { bootstrap_servers: "127.0.0.1:1".into(), ..KafkaConfig::default() };
        let c = client_config(&cfg, Role::Consumer).unwrap();
        assert_eq!(c.get("fetch.max.bytes"), Some("2097152"));
        assert_eq!(c.get("receive.message.max.bytes"), Some("9437184"), "8 MiB for zstd, 1 MiB of headers");
        let big = consumer_config(&cfg, 12 * 1024 * 1024).unwrap();
        assert_eq!(big.get("receive.message.max.bytes"), Some("13631488"), "a 12 MiB batch and its headers");
        // librdkafka checks the two against each other and message.max.bytes.
        for c in [c, big] {
            let consumer: Result<rdkafka::consumer::BaseConsumer, _> = c.clone().set("group.id", "g").create();
            assert!(consumer.is_ok(), "{:?}", consumer.err());
        }
    }
}
