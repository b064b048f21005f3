//! Shared setup of the end-to-end tests: a fresh database, fresh topics, a
//! fake provider, and a relay configured against them, run in-process or as
//! `relay` processes. The generic pieces (databases, topics, producers,
//! processes, private servers) are `relay_testkit`'s; what is here knows the
//! relay's configuration and routes.
//!
//! Each test file declares it `pub mod support;`: its public items are then
//! the test crate's exports, not dead code in the files that use part of it.

pub mod ops;

use std::net::SocketAddr;

use example_provider::{Provider, Settings};
use relay::{Components, Faults, Handlers, Relay};
use relay_core::RelayConfig;
use relay_testkit::process::{RelayProcess, RelaySpec};
use relay_testkit::{TestDb, TestProducer, create_topics, kafka_bootstrap, unique};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use relay_testkit::{DEADLINE, TestEvent, eventually, routes};

/// Route used by most tests: order.placed → capture call (+ payment.captured
/// on success, payment.failed when it ends dead).
pub static CAPTURE_ROUTE: std::sync::LazyLock<String> = std::sync::LazyLock::new(routes::capture_route);

/// A saga move on `payment.confirmed`: order `data.order_id` from pending to
/// paid (retried, then parked, while the saga does not exist: R19).
pub static SAGA_ROUTE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    routes::route(None, "payment.confirmed", "") + &routes::saga_move("mark-paid", "pending", "paid")
});

/// One test's world: its own database, topics, provider and names.
pub struct Harness {
    /// A fresh database, migrated.
    pub db: TestDb,
    /// The test broker.
    pub bootstrap: String,
    /// The fake provider the `psp` endpoint calls.
    pub provider: Provider,
    /// The input topic (`{topic}` in routes).
    pub topic: String,
    /// The output topic (`{out}` in routes).
    pub out: String,
    /// The dead-letter topic.
    pub dlq: String,
    /// The consumer name (inbox namespace).
    pub consumer: String,
    /// The consumer group.
    pub group: String,
    /// A producer to the test broker.
    pub producer: TestProducer,
    /// This test's share of the machine: see [`Harness::alone`].
    _share: Share,
}

/// Tests of a binary run two at a time (one per core). A test that bounds
/// how long recovery takes runs alone: on two cores another test's relay
/// processes or JVM start would be measured with it, and the bound would
/// say more about the neighbour than about the relay.
static MACHINE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Held for a harness's life. The lock is fair: once a timed test waits, new
/// tests wait behind it, so it is not starved by a stream of short ones (and
/// a test must not build a second harness while it holds one).
enum Share {
    Shared(#[allow(dead_code)] tokio::sync::RwLockReadGuard<'static, ()>),
    Alone(#[allow(dead_code)] tokio::sync::RwLockWriteGuard<'static, ()>),
}

/// A relay running in-process (a task of the test's runtime).
pub struct Running {
    token: CancellationToken,
    handle: JoinHandle<anyhow::Result<()>>,
}

impl Running {
    /// Graceful stop; returns the run's result.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.token.cancel();
        self.handle.await?
    }

    /// Drop the run where it is, like a crash of the task (nothing finished,
    /// nothing committed on the way out; not a process kill: tasks it
    /// spawned apart may run on until they find their channels closed).
    pub fn abort(self) {
        self.handle.abort();
    }

    /// Wait for the run to end by itself (e.g. a fault point), with a deadline.
    pub async fn finished(self) -> anyhow::Result<()> {
        tokio::time::timeout(DEADLINE, self.handle).await.expect("the relay did not stop")?
    }
}

/// Log to the test output (`RUST_LOG`, default `warn,relay=info`), once per binary.
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn,relay=info".into()))
        .with_test_writer()
        .try_init();
}

impl Harness {
    /// A fresh world whose input topic has `partitions` partitions.
    pub async fn new(partitions: i32) -> Harness {
        Harness::with_provider(partitions, Settings::default()).await
    }

    /// [`Harness::new`] for a test that measures how long something takes:
    /// no other test of this binary runs while it holds the harness.
    pub async fn alone(partitions: i32) -> Harness {
        let share = Share::Alone(MACHINE.write().await);
        Harness::build(partitions, Settings::default(), share).await
    }

    /// [`Harness::new`] with a provider of these `settings` (its [`example_provider::Dialect`]).
    pub async fn with_provider(partitions: i32, settings: Settings) -> Harness {
        let share = Share::Shared(MACHINE.read().await);
        Harness::build(partitions, settings, share).await
    }

    async fn build(partitions: i32, settings: Settings, share: Share) -> Harness {
        init_logs();
        let bootstrap = kafka_bootstrap();
        let topic = unique("orders");
        let out = unique("out");
        let dlq = unique("dlq");
        create_topics(&bootstrap, &[&topic, &out, &dlq], partitions).await.expect("create topics");
        let provider = Provider::start(SocketAddr::from(([127, 0, 0, 1], 0)), settings).await.expect("provider");
        Harness {
            db: TestDb::new().await.expect("test database"),
            producer: TestProducer::new(&bootstrap).expect("producer"),
            bootstrap,
            provider,
            topic,
            out,
            dlq,
            consumer: unique("consumer"),
            group: unique("group"),
            _share: share,
        }
    }

    /// The base configuration plus `routes` ({topic}, {out} substituted).
    pub fn config(&self, routes: &str) -> RelayConfig {
        self.config_of(&self.config_text(routes))
    }

    /// `text` (a whole configuration, e.g. [`Harness::config_text`] with
    /// more added) parsed, against this harness's database.
    pub fn config_of(&self, text: &str) -> RelayConfig {
        let mut cfg = RelayConfig::from_toml(text).unwrap_or_else(|e| panic!("test config: {e}\n{text}"));
        cfg.database.url = Some(self.db.url.clone().into());
        cfg
    }

    /// The configuration as TOML (no database URL: processes get DATABASE_URL).
    pub fn config_text(&self, routes: &str) -> String {
        format!(
            r#"
[consumer]
name = "{consumer}"
group_id = "{group}"
dead_letter_topic = "{dlq}"
batch_size = 50
max_record_bytes = 65536
[consumer.reference_retry]
max_attempts = 4
backoff = {{ min_delay = "50ms", max_delay = "200ms", factor = 2.0 }}
[consumer.database_backoff]
min_delay = "50ms"
max_delay = "500ms"

[kafka]
bootstrap_servers = "{bootstrap}"
# The broker's minimum: a killed member's partitions move on sooner.
consumer_properties = {{ "session.timeout.ms" = "6000" }}

[database]
max_connections = 8

[dispatcher]
lease = "3s"
poll_interval = "100ms"
rescue_interval = "200ms"
concurrency = 16

[publisher]
lease = "8s"
delivery_timeout = "5s"
poll_interval = "100ms"

[endpoints.psp]
base_url = "{provider}"
timeout = "1s"
connect_timeout = "500ms"
max_attempts = 5
backoff = {{ min_delay = "20ms", max_delay = "100ms", factor = 2.0 }}
{routes}
"#,
            consumer = self.consumer,
            group = self.group,
            dlq = self.dlq,
            bootstrap = self.bootstrap,
            provider = self.provider.url(),
            routes = routes.replace("{topic}", &self.topic).replace("{out}", &self.out),
        )
    }

    /// Write `text` to a config file of this test.
    pub fn write_config(&self, text: &str) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("{}.toml", unique("relay-test")));
        std::fs::write(&path, text).expect("write config");
        path
    }

    /// A `relay` process (`args` e.g. `["consume"]`) on `config`, logging to a temp file.
    pub fn process(&self, config: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> RelayProcess {
        let bin = env!("CARGO_BIN_EXE_relay");
        let mut all =
            vec![("DATABASE_URL".to_string(), self.db.url.clone()), ("RUST_LOG".to_string(), "info".to_string())];
        // A sabotaged test run breaks the processes too, as `no_faults` does in-process.
        if let Ok(sabotage) = std::env::var("RELAY_SABOTAGE") {
            all.push(("RELAY_SABOTAGE".to_string(), sabotage));
        }
        all.extend(env.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())));
        let log = std::env::temp_dir().join(format!("{}.log", unique(&format!("relay-{}", args[0]))));
        RelayProcess::start(RelaySpec {
            bin: bin.into(),
            config: config.to_path_buf(),
            args: args.iter().map(|a| (*a).to_string()).collect(),
            env: all,
            log,
        })
        .expect("start relay process")
    }

    /// A relay over `cfg` (not running).
    pub async fn relay(&self, cfg: RelayConfig, handlers: Handlers, faults: Faults) -> Relay {
        Relay::new(cfg, handlers, faults).await.expect("relay")
    }

    /// Run `which` of a relay over `cfg` in this process.
    pub async fn start(&self, cfg: RelayConfig, which: Components, faults: Faults) -> Running {
        self.start_with(cfg, which, Handlers::default(), faults).await
    }

    /// [`Harness::start`] with code handlers.
    pub async fn start_with(&self, cfg: RelayConfig, which: Components, handlers: Handlers, faults: Faults) -> Running {
        let relay = self.relay(cfg, handlers, faults).await;
        let token = CancellationToken::new();
        let t = token.clone();
        let handle = tokio::spawn(async move { relay.run(which, t).await });
        Running { token, handle }
    }

    /// Produce `e` to the input topic; its (partition, offset).
    pub async fn send(&self, e: &TestEvent) -> (i32, i64) {
        self.producer.event(&self.topic, e).await.expect("produce")
    }

    /// Send orders `o-0` … `o-{n-1}` (events `evt-0` … `evt-{n-1}`), in order.
    pub async fn send_orders(&self, n: usize) {
        for i in 0..n {
            self.send(&order(&format!("evt-{i}"), &format!("o-{i}"))).await;
        }
    }

    /// Inbox rows of this consumer.
    pub async fn inbox(&self) -> i64 {
        self.db.count("inbox", &format!("consumer = '{}'", self.consumer)).await
    }

    /// The inbox outcome of event `id`, if recorded.
    pub async fn outcome(&self, id: &str) -> Option<String> {
        let mut conn = self.db.conn().await.expect("connection");
        relay_store::inbox::outcome_of(&mut conn, &self.consumer, id).await.expect("inbox lookup")
    }

    /// Intents in `state`.
    pub async fn intents_in(&self, state: &str) -> i64 {
        self.db.count("intents", &format!("state = '{state}'")).await
    }

    /// Wait until the inbox has `n` rows.
    pub async fn await_inbox(&self, n: i64) {
        eventually(&format!("{n} inbox rows"), DEADLINE, || async { (self.inbox().await >= n).then_some(()) }).await;
        assert_eq!(self.inbox().await, n, "inbox rows");
    }

    /// Wait until no intent is pending or running and `n` are finished.
    pub async fn await_intents_finished(&self, n: i64) {
        eventually(&format!("{n} finished intents"), DEADLINE, || async {
            let finished = self.db.count("intents", "state IN ('succeeded', 'dead', 'uncertain')").await;
            let open = self.db.count("intents", "state IN ('pending', 'running')").await;
            (finished >= n && open == 0).then_some(())
        })
        .await;
    }

    /// Wait until the outbox has nothing left to publish and at least `n` rows published.
    pub async fn await_published(&self, n: i64) {
        eventually(&format!("{n} published outbox rows"), DEADLINE, || async {
            let published = self.db.count("outbox", "state = 'published'").await;
            let open = self.db.count("outbox", "state <> 'published'").await;
            (published >= n && open == 0).then_some(())
        })
        .await;
    }

    /// What the provider applied, as `relay verify` reads a provider's record.
    pub fn provider_effects(&self) -> Vec<relay_cli::verify::ProviderEffect> {
        self.provider
            .applied()
            .into_iter()
            .map(|a| relay_cli::verify::ProviderEffect { idempotency_key: a.key, intent_id: a.intent_id })
            .collect()
    }

    /// Sets `compression.type` of `topic` (the input topic, or another).
    pub async fn set_topic_compression(&self, topic: &str, codec: &str) {
        self.set_topic_config(topic, "compression.type", codec).await;
    }

    /// Sets the topic configuration `name` of `topic` to `value`.
    pub async fn set_topic_config(&self, topic: &str, name: &str, value: &str) {
        use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ResourceSpecifier};
        let admin: AdminClient<rdkafka::client::DefaultClientContext> =
            rdkafka::ClientConfig::new().set("bootstrap.servers", &self.bootstrap).create().unwrap();
        let change = AlterConfig::new(ResourceSpecifier::Topic(topic)).set(name, value);
        for r in admin.alter_configs([&change], &AdminOptions::new()).await.unwrap() {
            r.unwrap();
        }
    }

    /// Committed offset of our group on the input topic, per partition;
    /// a coordinator still loading (`NotCoordinator` on a broker just
    /// started) is asked again until it answers.
    pub async fn committed(&self) -> std::collections::HashMap<i32, Option<i64>> {
        eventually("the group coordinator to answer", DEADLINE, || async { self.try_committed().await.ok() }).await
    }

    /// Committed offsets, or the broker's error: right after a broker
    /// restart the group coordinator answers `NotCoordinator` for a while,
    /// which a loop polling for progress must read as "not yet".
    pub async fn try_committed(&self) -> anyhow::Result<std::collections::HashMap<i32, Option<i64>>> {
        relay_testkit::committed_offsets(&self.bootstrap, &self.group, &self.topic).await
    }

    /// The committed offsets of every partition added up: how many records
    /// are consumed, when each partition starts at offset 0.
    pub async fn committed_total(&self) -> i64 {
        self.committed().await.values().map(|o| o.unwrap_or(0)).sum()
    }

    /// Wait until partition `p`'s committed offset is exactly `offset`.
    pub async fn await_committed(&self, p: i32, offset: i64) {
        eventually(&format!("committed offset {offset} on partition {p}"), DEADLINE, || async {
            (self.committed().await.get(&p).copied().flatten() == Some(offset)).then_some(())
        })
        .await;
    }
}

/// `order.placed` event `id` for order `order` (amount 100), keyed by the order.
pub fn order(id: &str, order: &str) -> TestEvent {
    TestEvent::new(id, "order.placed", serde_json::json!({"order_id": order, "amount": 100})).key(order)
}

/// No fault points armed.
///
/// With `RELAY_SABOTAGE` set in the test's environment, the named fixed
/// defects are put back (`relay::runtime::faults::Sabotage`): the way to see
/// that a test fails without its fix, e.g. `RELAY_SABOTAGE=fenced-by-id
/// cargo test -p relay-cli --test dispatcher a_stale_completion`.
pub fn no_faults() -> Faults {
    match std::env::var("RELAY_SABOTAGE") {
        Ok(spec) => {
            Faults::none().with_sabotage(relay::runtime::faults::Sabotaged::parse(&spec).expect("RELAY_SABOTAGE"))
        }
        Err(_) => Faults::none(),
    }
}
