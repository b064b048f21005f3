//! Configuration: the types of `relay.toml` with their defaults, and their
//! validation, which needs no I/O.
//!
//! * Loading — the file, then `RELAY_*` environment overrides, the schema
//!   files, the secrets named by environment variable — is the service's
//!   (`relay::config`); [`RelayConfig::from_toml`] parses a text alone, for
//!   tests and tools.
//! * Invalid configuration fails at start with every problem at once, each
//!   naming its key (`routes[1].actions[0].endpoint: …`) and what to do.
//! * Secrets never come from the file: the database URL and provider tokens are
//!   read from the environment into [`SecretString`]s, whose `Debug` is redacted,
//!   and Kafka secrets are named by environment variable
//!   (`[kafka.secret_properties] "sasl.password" = "KAFKA_SASL_PASSWORD"`).

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use url::Url;

use crate::envelope::{FieldOverrides, FieldSource, TopicFormat};
use crate::profile::{KeyOverrides, KeyPlacement, Profile, ProfileName, ReconcileConfig};
use crate::retry::BackoffPolicy;

/// The whole configuration of a relay process.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayConfig {
    /// The inbox consumer.
    #[serde(default)]
    pub consumer: ConsumerConfig,
    /// PostgreSQL.
    #[serde(default)]
    pub database: DatabaseConfig,
    /// Kafka client settings shared by the consumer and the publisher.
    #[serde(default)]
    pub kafka: KafkaConfig,
    /// The intent dispatcher.
    #[serde(default)]
    pub dispatcher: DispatcherConfig,
    /// The outbox publisher.
    #[serde(default)]
    pub publisher: PublisherConfig,
    /// Per-topic encoding and field sources, keyed by topic name.
    #[serde(default)]
    pub topics: BTreeMap<String, TopicConfig>,
    /// What to do for each event type on each topic.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// External HTTP APIs the dispatcher calls, keyed by name.
    #[serde(default)]
    pub endpoints: BTreeMap<String, EndpointConfig>,
    /// Metrics, health, the admin API and the web console.
    #[serde(default)]
    pub admin: AdminConfig,
    /// How long processed rows are kept.
    #[serde(default)]
    pub retention: RetentionConfig,
    /// Traces.
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    /// Applications enqueue events and calls in their own transactions
    /// (`relay.publish`, `relay.call`); absent: they cannot.
    #[serde(default)]
    pub application: Option<ApplicationConfig>,
    /// The Confluent-compatible Schema Registry that topics of a registry
    /// format (`format = "avro"`) are decoded with; needed only by them.
    #[serde(default)]
    pub schema_registry: Option<SchemaRegistryConfig>,
}

/// A Confluent-compatible Schema Registry (`[schema_registry]`): Confluent's
/// own, or one speaking its API (Apicurio's `/apis/ccompat/v7`, Karapace).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SchemaRegistryConfig {
    /// Base URL, e.g. `http://registry:8081` or
    /// `https://apicurio/apis/ccompat/v7`; `/schemas/ids/{id}` is appended.
    pub url: url::Url,
    /// Basic auth user; its password is read from `password_env`.
    pub username: Option<String>,
    /// Environment variable holding the basic auth password.
    pub password_env: Option<String>,
    /// Environment variable holding a bearer token, instead of basic auth.
    pub token_env: Option<String>,
    /// A request to the registry that takes longer failed (and is retried).
    #[serde(with = "humantime_serde", default = "default_registry_timeout")]
    pub timeout: Duration,
    /// TLS to the registry: a private CA, a client certificate.
    #[serde(default)]
    pub tls: EndpointTls,
}

fn default_registry_timeout() -> Duration {
    Duration::from_secs(10)
}

/// The SQL front door for applications (`relay.publish`, `relay.call`):
/// what they may enqueue, registered in the database by `relay migrate` and
/// at every start, so the functions check it inside the caller's
/// transaction.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ApplicationConfig {
    /// Topics applications may publish to.
    #[serde(default)]
    pub topics: Vec<String>,
    /// Endpoints (of `[endpoints]`) applications may call.
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// Saga types a call's `on_success`/`on_dead` may move. None by default:
    /// a saga whose state gates money is the deployment's to open.
    #[serde(default)]
    pub sagas: Vec<String>,
    /// CloudEvents `source` of the events applications publish (and of the
    /// outcome events of their calls); default `/relay/CONSUMER/application`.
    pub source: Option<String>,
    /// The largest event `data` accepted, in bytes; for a call, its body,
    /// headers and outcomes together.
    #[serde(default = "default_application_max_payload_bytes")]
    pub max_payload_bytes: u32,
    /// The database role allowed to enqueue: it gets EXECUTE on the two
    /// functions (and USAGE on the schema) and nothing else. The DBA
    /// creates it and grants it to the applications' login roles.
    #[serde(default = "default_application_role")]
    pub role: String,
}

/// 900 KiB: an event this large, with its CloudEvents headers, still fits
/// the producer's default `message.max.bytes` (1 000 000). A larger one
/// would end a dead outbox row holding its key for every later event.
fn default_application_max_payload_bytes() -> u32 {
    900 * 1024
}

/// The producer's largest record unless `message.max.bytes` says otherwise
/// (librdkafka's default).
const PRODUCER_MESSAGE_MAX_BYTES: u64 = 1_000_000;

/// Room an application event's record needs beside its data: CloudEvents
/// headers, its key, the outbox id header.
const APPLICATION_RECORD_HEADROOM: u64 = 64 * 1024;

fn default_application_role() -> String {
    "relay_enqueue".into()
}

impl ApplicationConfig {
    /// The CloudEvents source of application events for `consumer`.
    pub fn source(&self, consumer: &str) -> String {
        self.source.clone().unwrap_or_else(|| format!("/relay/{consumer}/application"))
    }
}

/// The HTTP server of a relay process: `/metrics`, `/healthz`, `/readyz`,
/// the JSON admin API under `/api` and the console at `/`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Address to serve on; no server when unset.
    pub listen: Option<std::net::SocketAddr>,
    /// Environment variable holding the bearer token the API requires.
    /// Without it the API (not metrics or health) answers 503.
    pub token_env: String,
    /// How often the table gauges (inbox size, backlog, oldest pending) are refreshed.
    #[serde(with = "humantime_serde")]
    pub gauge_interval: Duration,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig { listen: None, token_env: "RELAY_ADMIN_TOKEN".into(), gauge_interval: Duration::from_secs(10) }
    }
}

/// What to do when a window relay relies on is shorter than it must be:
/// the inbox would forget events the broker still keeps, or a provider
/// would forget a key before relay's retries and replays end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Shortfall {
    /// Refuse to start.
    #[default]
    Refuse,
    /// Start, with a warning.
    Warn,
}

/// Retention of processed rows (R15). `None` keeps rows forever.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// Inbox rows and idempotency keys: the dedup window. Must be at least
    /// the input topics' `retention.ms`, or a replay could apply old events again.
    #[serde(with = "humantime_serde::option")]
    pub inbox: Option<Duration>,
    /// Succeeded intents (and their attempts).
    #[serde(with = "humantime_serde::option")]
    pub succeeded_intents: Option<Duration>,
    /// Dead intents (kept until configured).
    #[serde(with = "humantime_serde::option")]
    pub dead_intents: Option<Duration>,
    /// Published outbox rows.
    #[serde(with = "humantime_serde::option")]
    pub published_outbox: Option<Duration>,
    /// Dead letters (kept until configured).
    #[serde(with = "humantime_serde::option")]
    pub dead_letters: Option<Duration>,
    /// Rows deleted per statement: small enough never to hold up ingestion.
    pub batch_size: u32,
    /// How often cleanup runs in `relay run`.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// When `inbox` is shorter than an input topic's retention.
    pub on_shorter_than_topic: Shortfall,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            inbox: None,
            succeeded_intents: Some(Duration::from_secs(30 * 24 * 3600)),
            dead_intents: None,
            published_outbox: Some(Duration::from_secs(7 * 24 * 3600)),
            dead_letters: None,
            batch_size: 1000,
            interval: Duration::from_secs(60),
            on_shorter_than_topic: Shortfall::Refuse,
        }
    }
}

/// Traces.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// OTLP/HTTP endpoint for spans (e.g. `http://collector:4318/v1/traces`); off when unset.
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the spans.
    pub service_name: Option<String>,
}

/// The inbox consumer.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsumerConfig {
    /// Consumer name: the inbox namespace and part of every derived id. Two
    /// deployments with the same name dedup against each other; never rename
    /// a consumer that has processed events.
    pub name: String,
    /// Kafka consumer group; defaults to the consumer name.
    pub group_id: Option<String>,
    /// When true, an event type with no route is poison (`unknown_type`);
    /// when false it is recorded in the inbox as `unrouted` and skipped.
    pub strict: bool,
    /// Records larger than this (key + value + headers) are dead-lettered.
    pub max_record_bytes: usize,
    /// Most records processed in one database transaction (per partition).
    pub batch_size: usize,
    /// Most bytes (keys, values, headers) of records received and not yet
    /// done — waiting for their partition's task, or handed to it and not
    /// committed —, over all partitions: receiving stops at it (the bound
    /// holds up to one record over). A task takes at most a batch and its
    /// partition's share of this; a partition whose task waits out a retry
    /// drops the rest and is paused at the broker until it is done. At least
    /// `max_record_bytes`.
    pub max_buffered_bytes: usize,
    /// Topic that receives a copy of every dead-lettered record.
    pub dead_letter_topic: Option<String>,
    /// CloudEvents `source` of events the relay emits; default `relay/<name>`.
    pub event_source: Option<String>,
    /// Retry budget for a missing referenced aggregate (R19) or a sequence gap
    /// (R6) before the record is parked.
    pub reference_retry: RetryBudget,
    /// Backoff while the database is unreachable (retried until it is back).
    pub database_backoff: BackoffPolicy,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        ConsumerConfig {
            name: "relay".into(),
            group_id: None,
            strict: false,
            // 960 KiB: a record this large still has its dead-letter copy
            // (its relay_dlq_* headers added) fit under the producer's
            // default message.max.bytes of 1 000 000.
            max_record_bytes: 960 * 1024,
            batch_size: 200,
            max_buffered_bytes: 64 * 1024 * 1024,
            dead_letter_topic: None,
            event_source: None,
            reference_retry: RetryBudget::default(),
            database_backoff: BackoffPolicy {
                min_delay: Duration::from_millis(200),
                max_delay: Duration::from_secs(10),
                factor: 2.0,
            },
        }
    }
}

impl ConsumerConfig {
    /// The Kafka group id in effect.
    pub fn group(&self) -> &str {
        self.group_id.as_deref().unwrap_or(&self.name)
    }

    /// The CloudEvents `source` of emitted events.
    pub fn source(&self) -> String {
        self.event_source.clone().unwrap_or_else(|| format!("relay/{}", self.name))
    }
}

/// A bounded retry: at most `max_attempts` tries, `backoff` between them.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryBudget {
    /// Attempts in total, the first included.
    pub max_attempts: u32,
    /// Delay between attempts.
    pub backoff: BackoffPolicy,
}

impl Default for RetryBudget {
    fn default() -> Self {
        RetryBudget {
            max_attempts: 8,
            backoff: BackoffPolicy {
                min_delay: Duration::from_millis(200),
                max_delay: Duration::from_secs(5),
                factor: 2.0,
            },
        }
    }
}

/// PostgreSQL connection. TLS is set in the URL (`?sslmode=verify-full&sslrootcert=…`).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// Connection URL; from `DATABASE_URL` or `RELAY_DATABASE__URL`.
    pub url: Option<SecretString>,
    /// Pool size of this process. Claims run on connections of their own
    /// beside the pool: one for a dispatcher, one per publisher lane (two).
    pub max_connections: u32,
    /// How long to wait for a pooled connection before the attempt fails.
    #[serde(with = "humantime_serde")]
    pub acquire_timeout: Duration,
    /// How long one ingest transaction (a batch, or a parked record) may go
    /// unanswered before relay asks, on another connection, whether the
    /// database still works on it: a database host that vanishes without a
    /// reset (a failover, a frozen machine) never answers, and nothing else
    /// would end the wait. A transaction still being worked on goes on.
    #[serde(with = "humantime_serde")]
    pub transaction_timeout: Duration,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: None,
            max_connections: 10,
            acquire_timeout: Duration::from_secs(5),
            transaction_timeout: Duration::from_secs(60),
        }
    }
}

impl fmt::Debug for DatabaseConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatabaseConfig")
            .field("url", &self.url.as_ref().map(|_| "[redacted]"))
            .field("max_connections", &self.max_connections)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("transaction_timeout", &self.transaction_timeout)
            .finish()
    }
}

impl DatabaseConfig {
    /// The URL, or an error that says how to set it.
    pub fn url(&self) -> Result<&str, ConfigError> {
        self.url.as_ref().map(|u| u.expose_secret()).ok_or_else(|| ConfigError::Invalid {
            problems: vec![
                "database.url: not set; export DATABASE_URL=postgres://user:password@host/db \
                 (or RELAY_DATABASE__URL)"
                    .into(),
            ],
        })
    }
}

/// Kafka client settings. Any librdkafka property passes through, so
/// SASL_SSL to a managed cluster is `security.protocol`, `sasl.mechanism`,
/// `sasl.username` here and the password in `secret_properties`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaConfig {
    /// `bootstrap.servers`.
    pub bootstrap_servers: String,
    /// librdkafka properties for both consumer and producer.
    pub properties: BTreeMap<String, String>,
    /// librdkafka properties for the consumer only.
    pub consumer_properties: BTreeMap<String, String>,
    /// librdkafka properties for the producer only.
    pub producer_properties: BTreeMap<String, String>,
    /// librdkafka property → name of the environment variable holding its value.
    pub secret_properties: BTreeMap<String, String>,
    /// What to do when an input topic keeps batches compressed with zstd,
    /// gzip or lz4 (its `compression.type` is none of `snappy` and
    /// `uncompressed`): the Kafka client inflates those without a bound per
    /// fetch, so a few small hostile batches can take gigabytes. Refused by
    /// default; set the topics' `compression.type = snappy`.
    pub on_unbounded_compression: Shortfall,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            bootstrap_servers: "127.0.0.1:9092".into(),
            properties: BTreeMap::new(),
            consumer_properties: BTreeMap::new(),
            producer_properties: BTreeMap::new(),
            secret_properties: BTreeMap::new(),
            on_unbounded_compression: Shortfall::Refuse,
        }
    }
}

/// The intent dispatcher.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DispatcherConfig {
    /// Name recorded on claims and attempts; default `<hostname>-<pid>`.
    pub worker_id: Option<String>,
    /// Calls in flight at once in this process (each endpoint also has its own limit).
    pub concurrency: usize,
    /// Most intents claimed by one statement, and how many claimed intents
    /// may wait for a free call slot (a claim is made once a quarter of a
    /// batch has room, not for every call that ends). Larger drains a backlog
    /// with fewer statements (BENCHMARKS.md has the measurements) but holds
    /// more leases ahead of the calls, which other dispatcher processes then
    /// cannot take.
    pub claim_batch: u32,
    /// Most JSON (bodies, headers and outcomes, as text) of the intents this
    /// process has claimed and not finished, taken together: a claim takes
    /// rows while they fit, and one row alone when nothing is held, however
    /// large. Decoded, they take a few times this in memory. Intents handed
    /// over at ingest (`claim_at_ingest`) are bounded by their count instead.
    pub max_claimed_bytes: u64,
    /// How long a claim is ours: at least every endpoint's
    /// [`EndpointConfig::min_lease`] (its timeout + 2 s).
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// Fallback poll when no NOTIFY arrives.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// How often expired leases are rescued.
    #[serde(with = "humantime_serde")]
    pub rescue_interval: Duration,
    /// With the consumer in the same process (`relay run`): the consumer
    /// writes the intents of routine records (no ordering key, endpoint not
    /// paused) already claimed by this dispatcher, up to `claim_batch` +
    /// the consumer's `batch_size` on their way at a time (beyond that,
    /// pending as usual), and hands them over after its commit — no claim
    /// statement between the commit and the call. `false`: every intent is
    /// claimed by the claim loop, as with separate processes.
    pub claim_at_ingest: bool,
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        DispatcherConfig {
            worker_id: None,
            concurrency: 64,
            claim_batch: 64,
            max_claimed_bytes: 32 * 1024 * 1024,
            lease: Duration::from_secs(60),
            poll_interval: Duration::from_secs(1),
            rescue_interval: Duration::from_secs(5),
            claim_at_ingest: true,
        }
    }
}

/// The outbox publisher.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PublisherConfig {
    /// Most rows claimed and produced per round.
    pub batch_size: u32,
    /// How long a claim is ours; must exceed `delivery_timeout` and a
    /// quarter of it more ([`PublisherConfig::in_flight_bound`]).
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// librdkafka `message.timeout.ms`: give up on a delivery after this.
    #[serde(with = "humantime_serde")]
    pub delivery_timeout: Duration,
    /// Fallback poll when no NOTIFY arrives.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// Delay before a failed publish is tried again.
    pub backoff: BackoffPolicy,
}

impl PublisherConfig {
    /// How long a record may wait for room in the producer's local queue
    /// before its delivery even starts: a quarter of `delivery_timeout`.
    pub fn queue_wait(&self) -> Duration {
        self.delivery_timeout / 4
    }

    /// The longest a claimed row can be in flight: the queue wait, then the
    /// delivery. The lease must outlast it, or a second publisher could
    /// claim and publish a row the first is still delivering.
    pub fn in_flight_bound(&self) -> Duration {
        self.queue_wait() + self.delivery_timeout
    }
}

impl Default for PublisherConfig {
    fn default() -> Self {
        PublisherConfig {
            batch_size: 200,
            lease: Duration::from_secs(60),
            delivery_timeout: Duration::from_secs(30),
            poll_interval: Duration::from_secs(1),
            backoff: BackoffPolicy::default(),
        }
    }
}

/// How the records of one topic are read.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TopicConfig {
    /// CloudEvents (default) or plain JSON.
    pub format: TopicFormat,
    /// Where id, type and the guard fields come from.
    pub fields: FieldOverrides,
}

/// What to do with one event type on one topic.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Route name for logs and metrics; default `<topic>/<type>`.
    pub name: Option<String>,
    /// Source topic.
    pub topic: String,
    /// CloudEvents type this route takes.
    #[serde(rename = "type")]
    pub event_type: String,
    /// JSON Schema file (relative to the configuration file) the data must satisfy.
    pub schema: Option<PathBuf>,
    /// That file's JSON, read by the service when it loads the configuration
    /// (`relay::config`): the router compiles it and does no I/O.
    #[serde(skip)]
    pub schema_document: Option<serde_json::Value>,
    /// Overrides of where the guard fields come from.
    #[serde(default)]
    pub fields: FieldOverrides,
    /// Apply only when `aggregate version > last applied version` (R5).
    #[serde(default)]
    pub version_guard: bool,
    /// Apply only the next sequence number of the aggregate (R6).
    #[serde(default)]
    pub sequence_guard: bool,
    /// Business counter incremented once per unique applied event (R20).
    pub counter: Option<String>,
    /// Name of a handler registered in code, run in the same transaction.
    pub handler: Option<String>,
    /// The actions, in order. Saga moves are guards: if one is a no-op, no
    /// intent or event of this route is written for the event.
    #[serde(default)]
    pub actions: Vec<ActionConfig>,
    /// What a dead intent of this route does to its ordering key.
    #[serde(default)]
    pub on_poison: OnPoison,
}

/// What a route's failure does to the later work of the same key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnPoison {
    /// A dead intent releases its ordering key: the key's later intents go on.
    #[default]
    Release,
    /// Hold the key of what failed, while other keys flow. A dead intent
    /// holds its ordering key: the key's later intents wait (recorded, not
    /// called) until it is replayed or skipped (`relay intents replay` /
    /// `relay intents skip`). A dead-lettered record holds its Kafka key on
    /// its partition: the key's later records there are parked behind it
    /// (class `held`) until it is replayed or skipped (`relay dead-letters
    /// replay` / `relay dead-letters skip`), then applied in order.
    HoldKey,
}

impl RouteConfig {
    /// The route's name in effect.
    pub fn display_name(&self) -> String {
        self.name.clone().unwrap_or_else(|| format!("{}/{}", self.topic, self.event_type))
    }
}

/// One action of a route.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ActionConfig {
    /// Call an endpoint (through an intent).
    Call(CallAction),
    /// Emit an event (through the outbox).
    Emit(EmitAction),
    /// Move a saga (guarded transition).
    Saga(SagaAction),
}

impl ActionConfig {
    /// The action's name (part of derived ids: never rename a live action).
    pub fn name(&self) -> &str {
        match self {
            ActionConfig::Call(a) => &a.name,
            ActionConfig::Emit(a) => &a.name,
            ActionConfig::Saga(a) => &a.name,
        }
    }
}

/// Call an endpoint.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CallAction {
    /// Action name, unique in the route.
    pub name: String,
    /// Key into `[endpoints]`.
    pub endpoint: String,
    /// HTTP method.
    #[serde(default = "default_method")]
    pub method: String,
    /// Path template, appended to the endpoint's base URL.
    pub path: String,
    /// JSON body template.
    pub body: Option<serde_json::Value>,
    /// Extra request header templates.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Idempotency key template; default: the intent's derived id.
    pub idempotency_key: Option<String>,
    /// Per-key ordering template (R13): no call for this key starts while an
    /// earlier one is unfinished.
    pub ordering_key: Option<String>,
    /// Fairness key template (a tenant, a merchant): the calls of each key
    /// are spread at the endpoint's `fair_share_per_second`, so one key's
    /// burst does not take every call slot from the others.
    pub fairness_key: Option<String>,
    /// Effects recorded when the call succeeds.
    #[serde(default)]
    pub on_success: OutcomeConfig,
    /// Effects recorded when the call dies (permanent error or budget spent).
    #[serde(default)]
    pub on_dead: OutcomeConfig,
}

fn default_method() -> String {
    "POST".into()
}

/// Effects of a finished call.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OutcomeConfig {
    /// Events to emit.
    #[serde(default)]
    pub emit: Vec<EmitAction>,
    /// Saga moves to make.
    #[serde(default)]
    pub saga: Vec<SagaAction>,
}

impl OutcomeConfig {
    fn is_empty(&self) -> bool {
        self.emit.is_empty() && self.saga.is_empty()
    }
}

/// Emit an event.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EmitAction {
    /// Action name, unique in the route.
    pub name: String,
    /// CloudEvents type of the emitted event.
    #[serde(rename = "type")]
    pub event_type: String,
    /// Destination topic.
    pub topic: String,
    /// Record key template; default: the input's aggregate id, if any.
    pub key: Option<String>,
    /// CloudEvents `subject` template.
    pub subject: Option<String>,
    /// Data template (a JSON document with templated strings); default: the input data.
    pub data: Option<serde_json::Value>,
    /// Publish in order with earlier events of the same topic and key.
    #[serde(default = "yes")]
    pub ordered: bool,
    /// Encode the data with the topic's schema from the Schema Registry
    /// (`avro`, `protobuf` or `json-schema`), instead of writing it as JSON. Route
    /// actions only: the data is checked at ingest.
    pub format: Option<TopicFormat>,
    /// The registry subject whose latest schema encodes it; default
    /// `<topic>-value` (the topic name strategy).
    pub schema_subject: Option<String>,
    /// With `format = "protobuf"`: the message of the subject's `.proto`
    /// file it writes, by full name (`shop.PaymentRequested`); default the
    /// file's first message.
    pub schema_message: Option<String>,
}

impl EmitAction {
    /// The registry subject of its schema, when it has a format.
    pub fn schema_subject(&self) -> String {
        self.schema_subject.clone().unwrap_or_else(|| format!("{}-value", self.topic))
    }

    /// How it is written, when it has a format.
    pub fn emit_format(&self) -> Option<EmitFormat> {
        self.format.map(|format| EmitFormat {
            format,
            subject: self.schema_subject(),
            message: self.schema_message.clone(),
        })
    }
}

/// How an emit's data is written in a Schema Registry format: what
/// `relay_registry::Registry::encoder` builds an encoder from, and what
/// every emit to one topic must agree on.
#[derive(Debug, Clone, PartialEq, Eq)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct EmitFormat {
    pub format: TopicFormat,
    /// The subject whose latest schema encodes it.
    pub subject: String,
    /// Protobuf: the message written (default the file's first).
    pub message: Option<String>,
}

impl std::fmt::Display for EmitFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "as {} (subject {}", self.format.as_str(), self.subject)?;
        if let Some(m) = &self.message {
            write!(f, ", message {m}")?;
        }
        f.write_str(")")
    }
}

fn yes() -> bool {
    true
}

/// Move a saga from one of `from` to `to`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SagaAction {
    /// Action name, unique in the route.
    pub name: String,
    /// Saga type (e.g. `order`).
    pub saga: String,
    /// Saga id template.
    pub id: String,
    /// States the transition may start from.
    #[serde(default)]
    pub from: Vec<String>,
    /// Target state.
    pub to: String,
    /// Creates the saga in `to` (it must not exist yet) instead of moving it.
    #[serde(default)]
    pub start: bool,
}

/// An external HTTP API.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// Base URL; action paths are appended.
    pub base_url: Url,
    /// Whole-request timeout (after which the outcome is unknown).
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Connect timeout (the request was certainly not delivered).
    #[serde(default = "default_connect_timeout", with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Calls in flight at once to this endpoint, per dispatcher process.
    #[serde(default = "default_endpoint_concurrency")]
    pub concurrency: usize,
    /// Calls started per second, per dispatcher process.
    pub rate_limit_per_second: Option<u64>,
    /// A rate that adapts to the provider's throttling and is shared by
    /// every dispatcher process on the database, instead of a fixed one.
    pub adaptive: Option<AdaptiveRate>,
    /// For calls with a `fairness_key`: how many calls per second one key's
    /// backlog is spread at (set it to what the endpoint can call: a key
    /// alone still goes that fast).
    pub fair_share_per_second: Option<f64>,
    /// Attempts in total before the intent is dead.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// No attempt starts this long after the intent was written.
    #[serde(default = "default_max_age", with = "humantime_serde")]
    pub max_age: Duration,
    /// Delay between attempts.
    #[serde(default)]
    pub backoff: BackoffPolicy,
    /// Statuses retried besides 408, 425, 429, 5xx and the profile's "in
    /// progress" answers. Default: `[409]` without a profile or with
    /// `custom` (see [`crate::retry::classify`] for why), none with another.
    pub retryable_statuses: Option<Vec<u16>>,
    /// The provider's idempotency behaviour ([`crate::profile`]); without
    /// one, a key in `Idempotency-Key`, 409 retried, no window known.
    pub profile: Option<ProfileName>,
    /// Overrides of the profile's parts (`[endpoints.NAME.idempotency]`).
    #[serde(default)]
    pub idempotency: KeyOverrides,
    /// Header carrying the idempotency key (the same as
    /// `idempotency.header`, kept from before profiles).
    pub idempotency_header: Option<String>,
    /// How long after an intent was written an operator may still replay
    /// it with its key: with `max_age`, the retry horizon checked against
    /// the profile's key window.
    #[serde(default = "default_replay_window", with = "humantime_serde")]
    pub replay_window: Duration,
    /// When the retry horizon is longer than the provider's key window.
    #[serde(default)]
    pub on_short_key_window: Shortfall,
    /// How to ask the provider what became of a call whose outcome is
    /// unknown (`[endpoints.NAME.reconcile]`); without it, uncertain intents
    /// wait for an operator.
    pub reconcile: Option<ReconcileConfig>,
    /// The most of a successful answer's body kept for `on_success`
    /// templates that read `response` (bytes); a longer body is kept as
    /// null, `response.truncated` true.
    #[serde(default = "default_response_bytes")]
    pub response_bytes: usize,
    /// Environment variable holding a bearer token for this endpoint.
    pub token_env: Option<String>,
    /// Bearer tokens from an OAuth2 token endpoint (client credentials
    /// grant), instead of `token_env`.
    pub oauth2: Option<OAuth2Config>,
    /// How each request is signed, if it is.
    pub signing: Option<SigningConfig>,
    /// Static request headers.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// TLS towards this endpoint: a private CA, a client certificate.
    #[serde(default)]
    pub tls: EndpointTls,
}

/// An adaptive, shared call rate (`[endpoints.NAME.adaptive]`): lowered by
/// `decrease` when the provider throttles (429 or 503), raised by
/// `increase` calls/s every second it does not, between `min` and `max`;
/// one rate for all dispatcher processes together.
#[derive(Debug, Clone, Copy, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AdaptiveRate {
    /// Calls per second at first (all processes together).
    pub start: f64,
    /// Never below (calls per second).
    #[serde(default = "default_adaptive_min")]
    pub min: f64,
    /// Never above (calls per second).
    pub max: f64,
    /// Factor applied when throttled.
    #[serde(default = "default_adaptive_decrease")]
    pub decrease: f64,
    /// Calls per second added per second without throttling.
    #[serde(default = "default_adaptive_increase")]
    pub increase: f64,
    /// After a decrease, how long before the rate moves again.
    #[serde(default = "default_adaptive_cooldown", with = "humantime_serde")]
    pub cooldown: Duration,
}

fn default_adaptive_min() -> f64 {
    1.0
}
fn default_adaptive_decrease() -> f64 {
    0.5
}
fn default_adaptive_increase() -> f64 {
    1.0
}
fn default_adaptive_cooldown() -> Duration {
    Duration::from_secs(2)
}

/// An OAuth2 client credentials grant (`[endpoints.NAME.oauth2]`): a token
/// is fetched from `token_url`, shared by the endpoint's calls, and fetched
/// again `refresh_before` its expiry, or once after a 401.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OAuth2Config {
    /// The token endpoint.
    pub token_url: Url,
    /// The client id (not a secret).
    pub client_id: String,
    /// Environment variable holding the client secret.
    pub client_secret_env: String,
    /// Scopes asked for.
    #[serde(default)]
    pub scopes: Vec<String>,
    /// How long before its expiry a token is replaced.
    #[serde(default = "default_refresh_before", with = "humantime_serde")]
    pub refresh_before: Duration,
    /// How the client authenticates to the token endpoint.
    #[serde(default)]
    pub client_auth: ClientAuth,
}

/// How an OAuth2 client sends its credentials to the token endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClientAuth {
    /// HTTP Basic (RFC 6749's default).
    #[default]
    Basic,
    /// `client_id` and `client_secret` in the form body.
    Body,
}

fn default_refresh_before() -> Duration {
    Duration::from_secs(30)
}

/// How an endpoint's requests are signed (`[endpoints.NAME.signing]`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "scheme", rename_all = "snake_case", deny_unknown_fields)]
pub enum SigningConfig {
    /// Standard Webhooks (standardwebhooks.com): `webhook-id` (the call's
    /// idempotency key, else its intent id), `webhook-timestamp` and
    /// `webhook-signature` (HMAC-SHA256 over id, timestamp and body), for
    /// relay as a webhook sender.
    StandardWebhooks {
        /// Environment variable holding the secret (`whsec_…`, base64).
        secret_env: String,
    },
    /// AWS Signature Version 4, for AWS-fronted APIs (API Gateway with IAM
    /// auth, Lambda function URLs): `Authorization` and `x-amz-date`.
    AwsSigv4 {
        /// The region, e.g. `eu-west-1`.
        region: String,
        /// The service's signing name, e.g. `execute-api` or `lambda`.
        service: String,
        /// Environment variable holding the access key id.
        access_key_id_env: String,
        /// Environment variable holding the secret access key.
        secret_access_key_env: String,
        /// Environment variable holding a session token (temporary credentials).
        session_token_env: Option<String>,
    },
}

/// TLS settings of one endpoint (`[endpoints.NAME.tls]`). Paths are relative
/// to the configuration file.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointTls {
    /// PEM file of the CA certificates this endpoint's server certificate
    /// must chain to. When set, only these are trusted, not the built-in
    /// public roots: a provider on a private PKI is not impersonated by any
    /// public CA.
    pub ca_file: Option<std::path::PathBuf>,
    /// PEM file of the client certificate (and its chain) for mutual TLS.
    pub client_cert_file: Option<std::path::PathBuf>,
    /// PEM file of the client certificate's private key.
    pub client_key_file: Option<std::path::PathBuf>,
}

impl EndpointTls {
    /// Every path it names, with its key (`ca_file`, …).
    pub fn files(&self) -> impl Iterator<Item = (&'static str, &std::path::PathBuf)> {
        [
            ("ca_file", &self.ca_file),
            ("client_cert_file", &self.client_cert_file),
            ("client_key_file", &self.client_key_file),
        ]
        .into_iter()
        .filter_map(|(k, p)| p.as_ref().map(|p| (k, p)))
    }

    /// Its problems, under `at` (e.g. `endpoints.psp.tls`), for a client
    /// of `url`, the value of key `url_key`.
    fn check(&self, at: &str, url_key: &str, url: &url::Url, p: &mut Vec<String>) {
        if self.client_cert_file.is_some() != self.client_key_file.is_some() {
            p.push(format!(
                "{at}: client_cert_file and client_key_file go together (mutual TLS needs the certificate \
                 and its private key)"
            ));
        }
        if (self.ca_file.is_some() || self.client_cert_file.is_some()) && url.scheme() != "https" {
            p.push(format!("{at}: set, but {url_key} {:?} is not https", url.as_str()));
        }
    }

    /// Every path it names, for rewriting (relative → absolute).
    pub fn files_mut(&mut self) -> impl Iterator<Item = &mut std::path::PathBuf> {
        [&mut self.ca_file, &mut self.client_cert_file, &mut self.client_key_file].into_iter().flatten()
    }
}

/// What a dispatcher lease keeps in hand beyond one call: a request is sent
/// only while at least [`EndpointConfig::call_bound`] plus this is left of
/// the lease (for the outcome's way to the database and clock steps).
pub const LEASE_SPARE: Duration = Duration::from_secs(1);

impl EndpointConfig {
    /// The endpoint's profile with its overrides applied.
    pub fn profile(&self) -> Profile {
        let mut overrides = self.idempotency.clone();
        if overrides.header.is_none() {
            overrides.header.clone_from(&self.idempotency_header);
        }
        Profile::resolve(self.profile.unwrap_or(ProfileName::Custom), &overrides)
    }

    /// Statuses retried besides the ones every endpoint retries.
    pub fn also_retry(&self) -> Vec<u16> {
        // Without a provider's own answers (no profile, or custom), 409 is
        // taken as "in progress", as before profiles.
        let legacy = match self.profile {
            None | Some(ProfileName::Custom) => vec![409],
            Some(_) => Vec::new(),
        };
        self.retryable_statuses.clone().unwrap_or(legacy)
    }

    /// How long relay may still send an intent's key: its attempts for
    /// `max_age`, then a replay within `replay_window`.
    pub fn retry_horizon(&self) -> Duration {
        self.max_age.saturating_add(self.replay_window)
    }

    /// Why endpoint `name`'s retry horizon is longer than its provider
    /// remembers keys, if it is: a retry or a replay after the window would
    /// be taken as a new request and could be applied twice.
    pub fn key_window_shortfall(&self, name: &str) -> Option<String> {
        let profile = self.profile();
        let window = profile.window?;
        let horizon = self.retry_horizon();
        let d = |d: Duration| humantime::format_duration(d).to_string();
        (horizon > window).then(|| {
            format!(
                "endpoints.{name}: the provider remembers an idempotency key for {} (profile {}), but relay may \
                 send one for {} (max_age {} + replay_window {}): an attempt or a replay after the window would \
                 be taken as a new request and could be applied twice; shorten max_age or replay_window, set \
                 idempotency.window if this provider keeps keys longer, or set on_short_key_window = \"warn\"",
                d(window),
                profile.name.as_str(),
                d(horizon),
                d(self.max_age),
                d(self.replay_window),
            )
        })
    }

    /// The longest one attempt runs from the moment its request is sent:
    /// `timeout` bounds connect, response and body together.
    pub fn call_bound(&self) -> Duration {
        self.timeout
    }

    /// The shortest dispatcher lease this endpoint works with: one call, the
    /// spare kept at the send, and one spare more for the wait between claim
    /// and send (call slots, the rate limit). The dispatcher makes exactly
    /// this check when it sends; with a shorter lease every claim would be
    /// given back unsent.
    pub fn min_lease(&self) -> Duration {
        self.call_bound() + 2 * LEASE_SPARE
    }
}

fn default_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_connect_timeout() -> Duration {
    Duration::from_secs(3)
}
fn default_endpoint_concurrency() -> usize {
    16
}
fn default_max_attempts() -> u32 {
    10
}
fn default_max_age() -> Duration {
    Duration::from_secs(24 * 3600)
}
fn default_response_bytes() -> usize {
    DEFAULT_RESPONSE_BYTES
}

/// What an endpoint keeps of an answer's body for `on_success` by default:
/// a payment object's id and status fit many times over.
pub const DEFAULT_RESPONSE_BYTES: usize = 8 * 1024;

/// The most an endpoint may keep of an answer's body (it is stored in the
/// intent row and read into memory per call in flight).
pub const MAX_RESPONSE_BYTES: usize = 1024 * 1024;

fn default_replay_window() -> Duration {
    Duration::from_secs(3600)
}

/// Configuration could not be loaded or is invalid.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read or a value has the wrong type.
    #[error("configuration could not be read: {0}")]
    Load(String),
    /// One or more values are invalid.
    #[error("configuration is invalid:\n  - {}", problems.join("\n  - "))]
    Invalid {
        /// Every problem found, each naming its key.
        problems: Vec<String>,
    },
}

impl RelayConfig {
    /// Parse a TOML string (no environment), then validate. For tests and tools.
    pub fn from_toml(text: &str) -> Result<RelayConfig, ConfigError> {
        let cfg: RelayConfig = toml::from_str(text).map_err(|e| ConfigError::Load(e.to_string()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Every topic the consumer subscribes to: the routed ones and the declared ones.
    pub fn subscribed_topics(&self) -> Vec<String> {
        let mut t: Vec<String> = self.routes.iter().map(|r| r.topic.clone()).collect();
        t.extend(self.topics.keys().cloned());
        t.sort();
        t.dedup();
        t
    }

    /// Check everything that can be checked without I/O to the broker or database.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut p = Vec::new();
        self.check_consumer(&mut p);
        self.check_application(&mut p);
        self.check_workers(&mut p);
        self.check_topics(&mut p);
        if let Some(r) = &self.schema_registry {
            check_schema_registry(r, &mut p);
        }
        self.check_emit_formats(&mut p);
        for (name, e) in &self.endpoints {
            self.check_endpoint(name, e, &mut p);
        }
        self.check_routes(&mut p);
        if p.is_empty() { Ok(()) } else { Err(ConfigError::Invalid { problems: p }) }
    }

    /// The consumer's settings, and retention's batch.
    fn check_consumer(&self, p: &mut Vec<String>) {
        let c = &self.consumer;
        if c.name.trim().is_empty() {
            p.push("consumer.name: must not be empty (it namespaces the inbox)".into());
        }
        if c.batch_size == 0 {
            p.push("consumer.batch_size: must be at least 1".into());
        }
        if self.consumer.max_buffered_bytes < self.consumer.max_record_bytes {
            p.push(format!(
                "consumer.max_buffered_bytes ({}) must be at least consumer.max_record_bytes ({}): \
                 the buffer must hold the largest record accepted",
                self.consumer.max_buffered_bytes, self.consumer.max_record_bytes
            ));
        }
        if c.reference_retry.max_attempts == 0 {
            p.push("consumer.reference_retry.max_attempts: must be at least 1".into());
        }
        if self.retention.batch_size == 0 {
            p.push("retention.batch_size: must be at least 1".into());
        }
    }

    /// The front door for applications, if there is one.
    fn check_application(&self, p: &mut Vec<String>) {
        let Some(app) = &self.application else { return };
        for e in app.endpoints.iter().filter(|e| !self.endpoints.contains_key(*e)) {
            p.push(format!("application.endpoints: {e:?} is not an endpoint of [endpoints]"));
        }
        for t in &app.topics {
            let valid = !t.is_empty()
                && t.len() <= 249
                && t.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
            if !valid {
                p.push(format!("application.topics: {t:?} is not a Kafka topic name (1 to 249 of [a-zA-Z0-9._-])"));
            }
        }
        for s in app.sagas.iter().filter(|s| s.is_empty() || s.len() > crate::limits::MAX_KEY_BYTES) {
            p.push(format!("application.sagas: {s:?} must be a saga type of 1 to 1024 bytes"));
        }
        if app.max_payload_bytes == 0 {
            p.push("application.max_payload_bytes: must be at least 1".into());
        }
        let producer_max = self
            .kafka
            .producer_properties
            .get("message.max.bytes")
            .or_else(|| self.kafka.properties.get("message.max.bytes"))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(PRODUCER_MESSAGE_MAX_BYTES);
        if u64::from(app.max_payload_bytes) + APPLICATION_RECORD_HEADROOM > producer_max {
            p.push(format!(
                "application.max_payload_bytes ({}) with {} bytes of headers and key does not fit the \
                 producer's message.max.bytes ({producer_max}): an event that large could never be published, \
                 and its dead outbox row would hold its key for every later event; lower it to at most {}",
                app.max_payload_bytes,
                APPLICATION_RECORD_HEADROOM,
                producer_max.saturating_sub(APPLICATION_RECORD_HEADROOM)
            ));
        }
        if app.role.is_empty() || app.role.len() > 63 {
            p.push("application.role: must be a role name of 1 to 63 bytes".into());
        }
    }

    /// The dispatcher's and the publisher's settings.
    fn check_workers(&self, p: &mut Vec<String>) {
        if self.database.transaction_timeout < Duration::from_secs(1) {
            p.push(format!(
                "database.transaction_timeout ({:?}) must be at least 1s: a batch's transaction runs several \
                 statements, and one that times out is rolled back and retried",
                self.database.transaction_timeout
            ));
        }
        if self.dispatcher.concurrency == 0 {
            p.push("dispatcher.concurrency: must be at least 1".into());
        }
        if self.dispatcher.claim_batch == 0 {
            p.push("dispatcher.claim_batch: must be at least 1".into());
        }
        if self.publisher.lease <= self.publisher.in_flight_bound() {
            p.push(format!(
                "publisher.lease ({:?}) must be longer than publisher.delivery_timeout ({:?}) and the quarter of \
                 it a record may wait for room in the producer's queue ({:?} in all), or a second publisher could \
                 claim a row that is still being delivered",
                self.publisher.lease,
                self.publisher.delivery_timeout,
                self.publisher.in_flight_bound()
            ));
        }
    }

    /// Input and dead-letter topic names, and each topic's fields and format.
    fn check_topics(&self, p: &mut Vec<String>) {
        let subscribed = self.subscribed_topics();
        for topic in &subscribed {
            check_topic_name(&format!("the input topic {topic:?}"), topic, p);
        }
        if let Some(dlq) = &self.consumer.dead_letter_topic {
            check_topic_name("consumer.dead_letter_topic", dlq, p);
            if subscribed.contains(dlq) {
                p.push(format!(
                    "consumer.dead_letter_topic: {dlq:?} is also an input topic: every dead-lettered \
                     record would come back, be dead-lettered again, and so on for ever; use a topic of its own"
                ));
            }
        }
        for (topic, t) in &self.topics {
            check_fields(&format!("topics.{topic:?}.fields"), &t.fields, p);
            if let Some(FieldSource::Value(_)) = &t.fields.id {
                p.push(format!(
                    "topics.{topic:?}.fields.id: a constant gives every event the same id, and all but \
                     the first would be dropped as duplicates; take the id from a header, the data or an extension"
                ));
            }
            if let Some(FieldSource::Key) = &t.fields.id {
                p.push(format!(
                    "topics.{topic:?}.fields.id: the record key is shared by every event of one key \
                     (an aggregate, an order), and all but the first would be dropped as duplicates; \
                     take the event's own id from a header, the data or an extension"
                ));
            }
            if t.format.uses_registry() && self.schema_registry.is_none() {
                p.push(format!(
                    "topics.{topic:?}: format = {:?} decodes records with schemas from a Schema Registry; \
                     add [schema_registry] url = \"http://registry:8081\"",
                    t.format.as_str()
                ));
            }
            if t.format == TopicFormat::Json && (t.fields.id.is_none() || t.fields.event_type.is_none()) {
                p.push(format!(
                    "topics.{topic:?}: format = \"json\" needs fields.id and fields.type \
                     (e.g. fields.id = {{ header = \"id\" }}, fields.type = {{ value = \"OrderPlaced\" }})"
                ));
            }
        }
    }

    /// Endpoint `name`'s settings.
    fn check_endpoint(&self, name: &str, e: &EndpointConfig, p: &mut Vec<String>) {
        let at = format!("endpoints.{name}");
        if e.concurrency == 0 {
            p.push(format!("{at}.concurrency: must be at least 1"));
        }
        if e.max_attempts == 0 {
            p.push(format!("{at}.max_attempts: must be at least 1"));
        }
        if e.fair_share_per_second.is_some_and(|r| !(r > 0.0 && r.is_finite())) {
            p.push(format!("{at}.fair_share_per_second: must be more than 0"));
        }
        if let Some(a) = &e.adaptive {
            if e.rate_limit_per_second.is_some() {
                p.push(format!("{at}: adaptive and rate_limit_per_second both set the rate; keep one"));
            }
            let ok = a.min > 0.0 && a.min <= a.start && a.start <= a.max && a.max.is_finite();
            if !ok {
                p.push(format!("{at}.adaptive: needs 0 < min ({}) <= start ({}) <= max ({})", a.min, a.start, a.max));
            }
            if !(a.decrease > 0.0 && a.decrease < 1.0) {
                p.push(format!("{at}.adaptive.decrease = {}: must be between 0 and 1", a.decrease));
            }
            if !(a.increase >= 0.0 && a.increase.is_finite()) {
                p.push(format!("{at}.adaptive.increase = {}: must be 0 or more", a.increase));
            }
        }
        if e.rate_limit_per_second == Some(0) {
            p.push(format!("{at}.rate_limit_per_second: must be at least 1 (or leave it out)"));
        }
        check_profile(name, e, p);
        e.tls.check(&format!("{at}.tls"), "base_url", &e.base_url, p);
        if self.dispatcher.lease < e.min_lease() {
            p.push(format!(
                "dispatcher.lease ({:?}) must be at least {at}.timeout + {:?} ({:?}): a request is sent \
                 only while its timeout and {:?} to spare are left of the lease, or a rescued intent \
                 could run twice at once; lengthen the lease or shorten the timeout",
                self.dispatcher.lease,
                2 * LEASE_SPARE,
                e.min_lease(),
                LEASE_SPARE
            ));
        }
    }

    /// Each route: its topic and type once, its fields, its actions.
    fn check_routes(&self, p: &mut Vec<String>) {
        let mut seen = BTreeMap::new();
        for (i, r) in self.routes.iter().enumerate() {
            let at = format!("routes[{i}]");
            if r.topic.trim().is_empty() {
                p.push(format!("{at}.topic: must not be empty"));
            }
            if r.event_type.trim().is_empty() {
                p.push(format!("{at}.type: must not be empty"));
            }
            if let Some(prev) = seen.insert((r.topic.clone(), r.event_type.clone()), i) {
                p.push(format!(
                    "{at}: topic {:?} type {:?} is already routed by routes[{prev}]",
                    r.topic, r.event_type
                ));
            }
            check_fields(&format!("{at}.fields"), &r.fields, p);
            if r.fields.id.is_some() || r.fields.event_type.is_some() {
                p.push(format!(
                    "{at}.fields: id and type are read before routing; set them under [topics.{:?}.fields]",
                    r.topic
                ));
            }
            let mut names = BTreeMap::new();
            for (j, a) in r.actions.iter().enumerate() {
                let aat = format!("{at}.actions[{j}]");
                self.validate_action(&aat, a, &mut names, p);
            }
            if r.actions.is_empty() && r.handler.is_none() && r.counter.is_none() {
                p.push(format!("{at}: has no actions, handler or counter; it would do nothing"));
            }
        }
    }

    /// What may start but should be looked at: a key window shorter than
    /// its endpoint's retry horizon where `on_short_key_window = "warn"`.
    pub fn warnings(&self) -> Vec<String> {
        self.endpoints
            .iter()
            .filter(|(_, e)| e.on_short_key_window == Shortfall::Warn)
            .filter_map(|(name, e)| e.key_window_shortfall(name))
            .collect()
    }

    fn validate_action(&self, at: &str, a: &ActionConfig, names: &mut BTreeMap<String, String>, p: &mut Vec<String>) {
        let name = a.name();
        if name.trim().is_empty() {
            p.push(format!("{at}.name: must not be empty (it is part of the derived ids)"));
        } else if let Some(prev) = names.insert(name.to_owned(), at.to_owned()) {
            p.push(format!("{at}.name: {name:?} is already used by {prev}"));
        }
        match a {
            ActionConfig::Call(c) => {
                if !self.endpoints.contains_key(&c.endpoint) {
                    let known: Vec<_> = self.endpoints.keys().map(String::as_str).collect();
                    p.push(format!(
                        "{at}.endpoint: {:?} is not defined under [endpoints] (defined: {})",
                        c.endpoint,
                        if known.is_empty() { "none".into() } else { known.join(", ") }
                    ));
                }
                if http::Method::from_bytes(c.method.as_bytes()).is_err() {
                    p.push(format!("{at}.method: {:?} is not an HTTP method", c.method));
                }
                let unshared = self.endpoints.get(&c.endpoint).is_some_and(|e| e.fair_share_per_second.is_none());
                if c.fairness_key.is_some() && unshared {
                    p.push(format!(
                        "{at}.fairness_key: endpoint {:?} needs fair_share_per_second, the rate one key's calls are \
                         spread at",
                        c.endpoint
                    ));
                }
                for (k, e) in c.on_success.emit.iter().chain(&c.on_dead.emit).enumerate() {
                    if e.name.trim().is_empty() {
                        p.push(format!("{at}: outcome emit #{k} has an empty name"));
                    }
                    check_topic_name(&format!("{at}: outcome emit {:?} topic", e.name), &e.topic, p);
                    self.check_emit_format(&format!("{at}: outcome emit {:?}", e.name), e, p);
                }
                // Each outcome's events and moves get ids derived from their
                // names: a second of one name would be dropped without a word.
                for (label, o) in [("on_success", &c.on_success), ("on_dead", &c.on_dead)] {
                    let mut seen = std::collections::BTreeSet::new();
                    let names = o.emit.iter().map(|e| &e.name).chain(o.saga.iter().map(|s| &s.name));
                    for n in names.filter(|n| !seen.insert(*n)) {
                        p.push(format!(
                            "{at}.{label}: the name {n:?} is used twice; each emit and saga move of an \
                             outcome needs its own name (its id is derived from it)"
                        ));
                    }
                }
                if !c.on_success.is_empty() || !c.on_dead.is_empty() {
                    for s in c.on_success.saga.iter().chain(&c.on_dead.saga) {
                        if s.start && !s.from.is_empty() {
                            p.push(format!("{at}: outcome saga {:?} has start = true and from", s.name));
                        }
                    }
                }
            }
            ActionConfig::Emit(e) => {
                check_topic_name(&format!("{at}.topic"), &e.topic, p);
                self.check_emit_format(at, e, p);
            }
            ActionConfig::Saga(s) => {
                if s.start && !s.from.is_empty() {
                    p.push(format!("{at}: start = true creates the saga; it cannot also have from"));
                }
                if !s.start && s.from.is_empty() {
                    p.push(format!("{at}.from: list the states the saga may move from (or set start = true)"));
                }
            }
        }
    }
}

/// Kafka's rule for topic names: 1 to 249 of `[a-zA-Z0-9._-]`, not `.` or
/// `..`. librdkafka subscribes by regex to a name that starts with `^`, so
/// a name like `^orders-.*` would consume topics the routes never match.
fn check_topic_name(what: &str, name: &str, p: &mut Vec<String>) {
    let valid_chars = name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if name.is_empty() {
        p.push(format!("{what}: must not be empty"));
    } else if name.starts_with('^') {
        p.push(format!(
            "{what}: {name:?} is a regular expression; the relay routes by exact topic names, so list each topic"
        ));
    } else if !valid_chars || name.len() > 249 || name == "." || name == ".." {
        p.push(format!("{what}: {name:?} is not a Kafka topic name (1 to 249 of letters, digits, '.', '_' and '-')"));
    }
}

/// The problems of endpoint `e`'s idempotency settings.
fn check_profile(name: &str, e: &EndpointConfig, p: &mut Vec<String>) {
    let at = format!("endpoints.{name}");
    if e.oauth2.is_some() && e.token_env.is_some() {
        p.push(format!("{at}: token_env and oauth2 both give the bearer token; keep one"));
    }
    if matches!(e.signing, Some(SigningConfig::AwsSigv4 { .. })) && (e.oauth2.is_some() || e.token_env.is_some()) {
        p.push(format!(
            "{at}: signing.scheme = \"aws_sigv4\" puts its signature in the Authorization header, which token_env \
             or oauth2 also set; keep one"
        ));
    }
    if e.response_bytes == 0 || e.response_bytes > MAX_RESPONSE_BYTES {
        p.push(format!(
            "{at}.response_bytes = {}: keep between 1 and {MAX_RESPONSE_BYTES} bytes of an answer",
            e.response_bytes
        ));
    }
    let o = &e.idempotency;
    if e.idempotency_header.is_some() && o.header.is_some() {
        p.push(format!("{at}: idempotency_header and idempotency.header both name the key's header; keep one"));
    }
    if o.header.is_some() && o.body_field.is_some() {
        p.push(format!("{at}.idempotency: header and body_field both say where the key goes; keep one"));
    }
    if e.profile == Some(ProfileName::None)
        && (o.header.is_some() || o.body_field.is_some() || e.idempotency_header.is_some())
    {
        p.push(format!(
            "{at}: profile = \"none\" sends no idempotency key, but a place for one is set; \
             remove it or choose a profile with keys"
        ));
    }
    let profile = e.profile();
    match &profile.key {
        KeyPlacement::Header(h) if http::HeaderName::from_bytes(h.as_bytes()).is_err() => {
            p.push(format!("{at}: {h:?} is not a valid header name for the idempotency key"));
        }
        KeyPlacement::BodyField(f) if f.split('.').any(|s| s.trim().is_empty()) => {
            p.push(format!("{at}.idempotency.body_field: {f:?} has an empty segment (write a.b.c)"));
        }
        _ => {}
    }
    if o.max_length == Some(0) {
        p.push(format!("{at}.idempotency.max_length: must be at least 1"));
    }
    for (i, m) in profile.mismatch.iter().enumerate() {
        p.extend(m.problems(&format!("{at}.idempotency.mismatch[{i}]")));
    }
    if let Some(r) = &e.reconcile {
        p.extend(r.problems(&format!("{at}.reconcile"), &profile));
        if let Some(path) = &r.path {
            let mut b = crate::template::TemplateBuilder::default();
            b.path(&format!("{at}.reconcile.path"), path);
            if let Err(errors) = b.finish() {
                p.extend(errors.into_iter().map(|e| e.to_string()));
            }
        }
    }
    if e.on_short_key_window == Shortfall::Refuse
        && let Some(why) = e.key_window_shortfall(name)
    {
        p.push(why);
    }
}

/// Field sources that can never find their field: a JSON pointer without
/// its leading `/` (it matches nothing), an extension name with capitals or
/// other characters (CloudEvents extension names are lowercase letters and
/// digits, and binary mode reads them lowercased). For an idempotency key
/// that would switch R4 off without a word; a constant key makes every
/// event but the first a duplicate.
fn check_fields(at: &str, f: &FieldOverrides, p: &mut Vec<String>) {
    let sources = [
        ("id", &f.id),
        ("type", &f.event_type),
        ("aggregate_id", &f.aggregate_id),
        ("aggregate_version", &f.aggregate_version),
        ("sequence", &f.sequence),
        ("idempotency_key", &f.idempotency_key),
        ("correlation_id", &f.correlation_id),
        ("causation_id", &f.causation_id),
        ("traceparent", &f.traceparent),
    ];
    for (name, src) in sources {
        match src {
            Some(FieldSource::Pointer(ptr)) if !ptr.is_empty() && !ptr.starts_with('/') => p.push(format!(
                "{at}.{name}: pointer {ptr:?} is not a JSON pointer, which starts with '/' (e.g. \"/{ptr}\")"
            )),
            Some(FieldSource::Extension(ext))
                if ext.is_empty() || !ext.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()) =>
            {
                p.push(format!(
                    "{at}.{name}: extension {ext:?} cannot match: CloudEvents extension names are lowercase \
                     letters and digits (e.g. {:?})",
                    ext.to_ascii_lowercase()
                ))
            }
            Some(FieldSource::Value(_)) if name == "idempotency_key" => p.push(format!(
                "{at}.idempotency_key: a constant key makes every event but the first a duplicate_key no-op"
            )),
            _ => {}
        }
    }
}

impl RelayConfig {
    /// The problems of emit `e`'s `format` and its schema settings, a
    /// route's own or an outcome's alike.
    fn check_emit_format(&self, at: &str, e: &EmitAction, p: &mut Vec<String>) {
        match e.format {
            None => {}
            Some(f @ (TopicFormat::Cloudevents | TopicFormat::Json)) => p.push(format!(
                "{at}.format: {:?} is how events are written without it; set \"avro\", \"protobuf\" or \
                 \"json-schema\", or leave it out",
                f.as_str()
            )),
            Some(f) if self.schema_registry.is_none() => p.push(format!(
                "{at}.format = {:?} encodes with a schema from a Schema Registry; add [schema_registry]",
                f.as_str()
            )),
            Some(_) => {}
        }
        if e.schema_subject.is_some() && e.format.is_none() {
            p.push(format!("{at}.schema_subject: set, but the emit has no format"));
        }
        if e.schema_message.is_some() && e.format != Some(TopicFormat::Protobuf) {
            p.push(format!("{at}.schema_message: names a Protobuf message, but the emit's format is not \"protobuf\""));
        }
    }

    /// Every topic an emit (a route's own or a call outcome's) writes with
    /// a `format`, and how, by topic: the encoders a process needs. Every
    /// emit to one topic writes one format ([`RelayConfig::validate`]).
    pub fn emit_formats(&self) -> Vec<(String, EmitFormat)> {
        let mut out: BTreeMap<String, EmitFormat> = BTreeMap::new();
        for (_, e) in self.emits() {
            if let Some(f) = e.emit_format() {
                out.entry(e.topic.clone()).or_insert(f);
            }
        }
        out.into_iter().collect()
    }

    /// Every emit of the routes, their own and their calls' outcomes', with
    /// where it is configured.
    fn emits(&self) -> Vec<(String, &EmitAction)> {
        let mut out = Vec::new();
        for (i, r) in self.routes.iter().enumerate() {
            for (j, a) in r.actions.iter().enumerate() {
                match a {
                    ActionConfig::Emit(e) => out.push((format!("routes[{i}].actions[{j}]"), e)),
                    ActionConfig::Call(c) => out.extend(
                        c.on_success
                            .emit
                            .iter()
                            .chain(&c.on_dead.emit)
                            .map(|e| (format!("routes[{i}].actions[{j}] outcome emit {:?}", e.name), e)),
                    ),
                    ActionConfig::Saga(_) => {}
                }
            }
        }
        out
    }

    /// Every emit to one topic writes one format with one subject: a
    /// consumer of the topic reads one encoding (a code handler's emits to
    /// it are encoded the same way, by topic).
    fn check_emit_formats(&self, p: &mut Vec<String>) {
        let mut by_topic: BTreeMap<String, (String, Option<EmitFormat>)> = BTreeMap::new();
        let mut see = |at: String, e: &EmitAction| {
            let this = e.emit_format();
            let describe = |f: &Option<EmitFormat>| match f {
                Some(f) => f.to_string(),
                None => "as JSON".to_owned(),
            };
            match by_topic.get(e.topic.as_str()) {
                Some((first, seen)) if *seen != this => p.push(format!(
                    "{at}: writes topic {:?} {}, but {first} writes it {}; every emit to one topic writes one format",
                    e.topic,
                    describe(&this),
                    describe(seen)
                )),
                Some(_) => {}
                None => {
                    by_topic.insert(e.topic.clone(), (at, this));
                }
            }
        };
        for (at, e) in self.emits() {
            see(at, e);
        }
    }
}

/// The problems of `[schema_registry]`.
fn check_schema_registry(r: &SchemaRegistryConfig, p: &mut Vec<String>) {
    if !matches!(r.url.scheme(), "http" | "https") {
        p.push(format!("schema_registry.url: {:?} is not an http or https URL", r.url.as_str()));
    }
    if r.username.is_some() != r.password_env.is_some() {
        p.push("schema_registry: username and password_env go together (basic auth)".into());
    }
    if r.username.is_some() && r.token_env.is_some() {
        p.push("schema_registry: username and token_env both authenticate; keep one".into());
    }
    if r.timeout.is_zero() {
        p.push("schema_registry.timeout: must be more than 0".into());
    }
    r.tls.check("schema_registry.tls", "url", &r.url, p);
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = r#"
        [consumer]
        name = "payments"

        [endpoints.psp]
        base_url = "http://127.0.0.1:9000"
        timeout = "5s"

        [[routes]]
        topic = "orders"
        type = "order.placed"
        counter = "orders_placed"

        [[routes.actions]]
        kind = "saga"
        name = "start"
        saga = "order"
        id = "{{ data.order_id }}"
        to = "payment_pending"
        start = true

        [[routes.actions]]
        kind = "call"
        name = "capture"
        endpoint = "psp"
        path = "/captures"
        body = { order = "{{ data.order_id }}", amount = "{{ data.amount }}" }
        idempotency_key = "capture:{{ data.order_id }}"

        [[routes.actions.on_success.emit]]
        name = "captured"
        type = "payment.captured"
        topic = "payments"
    "#;

    #[test]
    fn a_valid_file_parses_with_defaults_filled_in() {
        let cfg = RelayConfig::from_toml(VALID).unwrap();
        assert_eq!(cfg.consumer.group(), "payments");
        assert_eq!(cfg.endpoints["psp"].max_attempts, 10);
        assert_eq!(cfg.endpoints["psp"].timeout, Duration::from_secs(5));
        assert_eq!(cfg.routes[0].actions.len(), 2);
        match &cfg.routes[0].actions[1] {
            ActionConfig::Call(c) => {
                assert_eq!(c.method, "POST");
                assert_eq!(c.on_success.emit[0].topic, "payments");
            }
            other => panic!("expected a call, got {other:?}"),
        }
        assert_eq!(cfg.subscribed_topics(), vec!["orders".to_string()]);
    }

    #[test]
    fn an_unknown_endpoint_names_the_key_and_the_known_endpoints() {
        let text = VALID.replace("endpoint = \"psp\"", "endpoint = \"pps\"");
        let err = RelayConfig::from_toml(&text).unwrap_err().to_string();
        assert!(err.contains("routes[0].actions[1].endpoint"), "{err}");
        assert!(err.contains("\"pps\""), "{err}");
        assert!(err.contains("defined: psp"), "{err}");
    }

    // `send`'s queue wait comes before the delivery timeout starts: a lease
    // covering the delivery alone let a second publisher claim a row still
    // in flight.
    #[test]
    fn a_publisher_lease_must_outlast_the_queue_wait_and_the_delivery() {
        let text = format!("{VALID}\n[publisher]\nlease = \"35s\"\ndelivery_timeout = \"30s\"\n");
        let err = RelayConfig::from_toml(&text).unwrap_err().to_string();
        assert!(err.contains("publisher.lease") && err.contains("37.5s"), "{err}");
        let text = format!("{VALID}\n[publisher]\nlease = \"38s\"\ndelivery_timeout = \"30s\"\n");
        assert!(RelayConfig::from_toml(&text).is_ok());
    }

    #[test]
    fn a_transaction_timeout_has_a_default_and_a_floor() {
        let cfg = RelayConfig::from_toml(VALID).unwrap();
        assert_eq!(cfg.database.transaction_timeout, Duration::from_secs(60));
        let text = format!("{VALID}\n[database]\ntransaction_timeout = \"500ms\"\n");
        let err = RelayConfig::from_toml(&text).unwrap_err().to_string();
        assert!(err.contains("database.transaction_timeout") && err.contains("at least 1s"), "{err}");
        let text = format!("{VALID}\n[database]\ntransaction_timeout = \"2s\"\n");
        assert_eq!(RelayConfig::from_toml(&text).unwrap().database.transaction_timeout, Duration::from_secs(2));
    }

    // An application event over the producer's limit could never be
    // published, and its dead row held its key for every later event.
    #[test]
    fn an_application_payload_limit_over_the_producer_s_is_refused() {
        let with = |extra: &str| format!("{VALID}\n[application]\ntopics = [\"payments\"]\n{extra}");
        assert!(RelayConfig::from_toml(&with("")).is_ok(), "the default fits");
        let err = RelayConfig::from_toml(&with("max_payload_bytes = 1048576\n")).unwrap_err().to_string();
        assert!(err.contains("application.max_payload_bytes") && err.contains("at most 934464"), "{err}");
    }

    #[test]
    fn a_wrong_type_names_the_key() {
        let text = VALID.replace("timeout = \"5s\"", "timeout = 5");
        let err = RelayConfig::from_toml(&text).unwrap_err().to_string();
        assert!(err.contains("timeout"), "{err}");
    }

    #[test]
    fn unknown_keys_are_rejected_not_ignored() {
        let text = VALID.replace("counter = \"orders_placed\"", "countr = \"orders_placed\"");
        let err = RelayConfig::from_toml(&text).unwrap_err().to_string();
        assert!(err.contains("countr"), "{err}");
    }

    #[test]
    fn a_lease_shorter_than_a_call_is_rejected() {
        let text = format!("[dispatcher]\nlease = \"6s\"\n{VALID}");
        let err = RelayConfig::from_toml(&text).unwrap_err().to_string();
        assert!(err.contains("dispatcher.lease"), "{err}");
    }

    // The check at start-up is the one the dispatcher makes
    // when it sends, so a lease that passes it leaves time to send.
    #[test]
    fn the_shortest_lease_accepted_leaves_the_dispatcher_time_to_send() {
        let with = |lease: &str| RelayConfig::from_toml(&format!("[dispatcher]\nlease = \"{lease}\"\n{VALID}"));
        let cfg = with("7s").expect("timeout 5 s + 2 s");
        let e = &cfg.endpoints["psp"];
        assert_eq!(e.min_lease(), Duration::from_secs(7));
        let left_to_wait = cfg.dispatcher.lease - e.call_bound() - LEASE_SPARE;
        assert_eq!(left_to_wait, LEASE_SPARE, "a claim can wait this long for a slot and still be sent");
        assert!(with("6.9s").is_err());
    }

    #[test]
    fn duplicate_action_names_and_routes_are_rejected() {
        let text = VALID.replace("name = \"capture\"", "name = \"start\"");
        let err = RelayConfig::from_toml(&text).unwrap_err().to_string();
        assert!(err.contains("\"start\" is already used"), "{err}");
    }

    #[test]
    fn json_topics_must_say_where_id_and_type_come_from() {
        let text = format!("{VALID}\n[topics.legacy]\nformat = \"json\"\n");
        let err = RelayConfig::from_toml(&text).unwrap_err().to_string();
        assert!(err.contains("topics.\"legacy\""), "{err}");
    }

    #[test]
    fn a_registry_format_needs_a_registry_and_a_registry_its_credentials_in_pairs() {
        let err = problems_with("[topics.payments]\nformat = \"avro\"\n");
        assert!(err.contains("topics.\"payments\"") && err.contains("[schema_registry]"), "{err}");
        let ok = "[topics.payments]\nformat = \"avro\"\n[schema_registry]\nurl = \"http://registry:8081\"\n";
        assert_eq!(problems_with(ok), "");
        for (lines, says) in [
            ("url = \"ftp://r\"", "not an http or https URL"),
            ("url = \"http://r\"\nusername = \"u\"", "username and password_env go together"),
            (
                "url = \"http://r\"\nusername = \"u\"\npassword_env = \"P\"\ntoken_env = \"T\"",
                "username and token_env both authenticate",
            ),
            ("url = \"http://r\"\ntimeout = \"0s\"", "timeout: must be more than 0"),
            ("url = \"http://r\"\ntls = { ca_file = \"ca.pem\" }", "is not https"),
        ] {
            let err = problems_with(&format!("[schema_registry]\n{lines}\n"));
            assert!(err.contains(says), "{says:?} in {err}");
        }
        let emit = |extra: &str| {
            problems_with(&format!(
                "[[routes.actions]]\nkind = \"emit\"\nname = \"out\"\ntype = \"t\"\ntopic = \"out\"\n{extra}\n"
            ))
        };
        let err = emit("format = \"avro\"");
        assert!(err.contains("format = \"avro\" encodes with a schema from a Schema Registry"), "{err}");
        assert!(emit("format = \"json\"").contains("is how events are written without it"));
        assert!(emit("schema_subject = \"s\"").contains("schema_subject: set, but the emit has no format"));
        let err = emit("format = \"avro\"\nschema_message = \"shop.X\"");
        assert!(err.contains("schema_message: names a Protobuf message, but the emit's format is not"), "{err}");
        // An outcome's emit is checked as a route's own.
        let outcome = problems_with("format = \"avro\"\nschema_message = \"shop.X\"\n");
        assert!(outcome.contains("outcome emit \"captured\".format = \"avro\" encodes with a schema"), "{outcome}");
        assert!(outcome.contains("outcome emit \"captured\".schema_message: names a Protobuf message"), "{outcome}");
        let cfg =
            RelayConfig::from_toml(&format!("{VALID}\nformat = \"avro\"\n[schema_registry]\nurl = \"http://r\"\n"))
                .unwrap();
        let formats: Vec<String> = cfg.emit_formats().iter().map(|(t, f)| format!("{t} {f}")).collect();
        assert_eq!(formats, ["payments as avro (subject payments-value)"]);
        // VALID's outcome emit writes topic "payments" as JSON.
        let mixed = problems_with(
            "[[routes.actions]]\nkind = \"emit\"\nname = \"p\"\ntype = \"t\"\ntopic = \"payments\"\nformat = \"avro\"\n\
             [schema_registry]\nurl = \"http://r\"\n",
        );
        assert!(mixed.contains("writes topic \"payments\" as avro (subject payments-value)"), "{mixed}");
        assert!(mixed.contains("every emit to one topic writes one format"), "{mixed}");
    }

    #[test]
    fn the_database_url_is_never_printed() {
        let cfg = DatabaseConfig { url: Some(SecretString::from("postgres://u:hunter2@h/db")), ..Default::default() };
        assert!(!format!("{cfg:?}").contains("hunter2"));
    }

    /// The problems `extra` (TOML appended to [`VALID`]) adds.
    fn problems_with(extra: &str) -> String {
        match RelayConfig::from_toml(&format!("{VALID}\n{extra}")) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    }

    /// `psp` of [`VALID`] with `lines` added to its table.
    fn with_psp(lines: &str) -> Result<RelayConfig, String> {
        RelayConfig::from_toml(&VALID.replace("timeout = \"5s\"", &format!("timeout = \"5s\"\n{lines}")))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_key_window_shorter_than_the_retry_horizon_is_refused_naming_the_endpoint_and_the_durations() {
        // Stripe keeps keys 24 h; the default max age is 24 h and replay window 1 h.
        let err = with_psp("profile = \"stripe\"").unwrap_err();
        for part in ["endpoints.psp", "1day", "profile stripe", "1day 1h", "max_age 1day", "replay_window 1h"] {
            assert!(err.contains(part), "{part:?} in {err}");
        }
        let fits = with_psp("profile = \"stripe\"\nmax_age = \"20h\"\nreplay_window = \"4h\"").unwrap();
        assert!(fits.warnings().is_empty());
        let warned = with_psp("profile = \"stripe\"\non_short_key_window = \"warn\"").unwrap();
        assert!(warned.warnings()[0].contains("endpoints.psp"), "{:?}", warned.warnings());
        // A longer window said in the file, and an unknown one, are not refused.
        with_psp("profile = \"stripe\"\nidempotency = { window = \"7d\" }").unwrap();
        with_psp("profile = \"ietf\"").unwrap();
        with_psp("profile = \"adyen\"").unwrap();
    }

    #[test]
    fn an_endpoint_without_a_profile_keeps_retrying_409_and_one_with_a_profile_uses_its_answers() {
        let legacy = with_psp("").unwrap();
        assert_eq!(legacy.endpoints["psp"].also_retry(), [409]);
        assert_eq!(legacy.endpoints["psp"].profile().key, KeyPlacement::Header("Idempotency-Key".into()));
        let ietf = with_psp("profile = \"ietf\"").unwrap();
        assert!(ietf.endpoints["psp"].also_retry().is_empty(), "409 is the profile's, as in-progress");
        let custom = with_psp("profile = \"custom\"\nidempotency = { window = \"2d\" }").unwrap();
        assert_eq!(custom.endpoints["psp"].also_retry(), [409], "custom keeps the behaviour without a profile");
        let old_header = with_psp("idempotency_header = \"X-Key\"").unwrap();
        assert_eq!(old_header.endpoints["psp"].profile().key, KeyPlacement::Header("X-Key".into()));
    }

    #[test]
    fn idempotency_settings_that_cannot_work_are_refused_each_naming_its_key() {
        let cases: &[(&str, &str)] = &[
            ("profile = \"none\"\nidempotency = { header = \"X-Key\" }", "profile = \"none\" sends no"),
            ("idempotency_header = \"A\"\nidempotency = { header = \"B\" }", "both name the key's header"),
            ("idempotency = { header = \"A\", body_field = \"k\" }", "header and body_field"),
            ("idempotency = { header = \"bad header\" }", "not a valid header name"),
            ("idempotency = { body_field = \"a..b\" }", "empty segment"),
            ("idempotency = { max_length = 0 }", "max_length: must be at least 1"),
            ("idempotency = { mismatch = [{ status = 400, pointer = \"error.type\" }] }", "starts with /"),
            ("idempotency = { mismatch = [{ status = 400, equals = \"x\" }] }", "equals and empty need a pointer"),
            ("profile = \"stripes\"", "unknown variant"),
            ("rate_limit_per_second = 5\nadaptive = { start = 5, max = 10 }", "both set the rate"),
            ("adaptive = { start = 50, max = 10 }", "min (1) <= start (50) <= max (10)"),
            ("adaptive = { start = 5, max = 10, decrease = 1.5 }", "decrease = 1.5: must be between 0 and 1"),
            ("response_bytes = 0", "response_bytes = 0"),
            ("fair_share_per_second = 0", "fair_share_per_second: must be more than 0"),
            (
                "oauth2 = { token_url = \"http://t/\", client_id = \"c\", client_secret_env = \"S\" }\ntoken_env = \"T\"",
                "token_env and oauth2",
            ),
            (
                "token_env = \"T\"\nsigning = { scheme = \"aws_sigv4\", region = \"r\", service = \"s\", access_key_id_env = \"A\", secret_access_key_env = \"B\" }",
                "Authorization header",
            ),
        ];
        for (lines, want) in cases {
            let err = with_psp(lines).unwrap_err();
            assert!(err.contains(want), "{lines}: {want:?} not in {err}");
        }
    }

    // Each of these validated, then broke a guarantee.
    #[test]
    fn configurations_that_would_break_a_guarantee_are_refused_each_naming_its_key() {
        let cases: &[(&str, &[&str])] = &[
            ("[topics.orders]\nfields.id = { value = \"x\" }", &["topics.\"orders\".fields.id", "same id"]),
            ("[topics.orders]\nfields.id = \"key\"", &["topics.\"orders\".fields.id", "record key"]),
            ("[topics.orders]\nfields.idempotency_key = { value = \"k\" }", &["idempotency_key", "duplicate_key"]),
            ("[topics.orders]\nfields.idempotency_key = { pointer = \"request_id\" }", &["\"/request_id\""]),
            ("[topics.orders]\nfields.idempotency_key = { extension = \"idempotencyKey\" }", &["\"idempotencykey\""]),
            ("[[routes]]\ntopic = \"^orders-.*\"\ntype = \"x\"\ncounter = \"c\"", &["regular expression"]),
            ("[[routes]]\ntopic = \"orders events\"\ntype = \"x\"\ncounter = \"c\"", &["not a Kafka topic name"]),
            ("[consumer]\ndead_letter_topic = \"orders\"", &["consumer.dead_letter_topic", "input topic"]),
            (
                "[[routes]]\ntopic = \"refunds\"\ntype = \"r\"\n[[routes.actions]]\nkind = \"call\"\nname = \"c\"\n\
                 endpoint = \"psp\"\npath = \"/\"\n[[routes.actions.on_dead.emit]]\nname = \"failed\"\ntype = \"a\"\n\
                 topic = \"out\"\n[[routes.actions.on_dead.emit]]\nname = \"failed\"\ntype = \"b\"\ntopic = \"out\"",
                &["on_dead", "\"failed\" is used twice"],
            ),
        ];
        for (extra, wanted) in cases {
            // A `[consumer]` table of its own replaces VALID's one.
            let text = if extra.starts_with("[consumer]") {
                format!(
                    "{}\n{}",
                    VALID.replace("[consumer]\n        name = \"payments\"", ""),
                    extra.replace("[consumer]", "[consumer]\nname = \"payments\"")
                )
            } else {
                format!("{VALID}\n{extra}")
            };
            let err = match RelayConfig::from_toml(&text) {
                Ok(_) => panic!("accepted:\n{extra}"),
                Err(e) => e.to_string(),
            };
            for w in *wanted {
                assert!(err.contains(w), "{extra}\n wanted {w:?} in: {err}");
            }
        }
        assert_eq!(problems_with("[topics.orders]\nfields.idempotency_key = { pointer = \"/request/id\" }"), "");
    }
}
