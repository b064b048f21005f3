//! Assembly: a configured relay — database pool, routes, handlers, faults —
//! and the components it can run in one process.

use std::sync::Arc;

use relay_core::{RelayConfig, Router};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgPool};
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use crate::deliver::dispatcher::Dispatcher;
use crate::ingest::consumer::{ConsumerSettings, InboxConsumer};
use crate::ingest::handler::Handlers;
use crate::ingest::processor::Processor;
use crate::ops::admin::Operator;
use crate::publish::publisher::Publisher;
use crate::runtime::faults::Faults;
use crate::runtime::kafka::InputTopics;

/// Which components to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Components {
    /// The inbox consumer.
    pub consumer: bool,
    /// The intent dispatcher.
    pub dispatcher: bool,
    /// The outbox publisher.
    pub publisher: bool,
}

impl Components {
    /// Everything.
    pub const ALL: Components = Components { consumer: true, dispatcher: true, publisher: true };
}

/// A configured relay.
#[derive(Clone)]
pub struct Relay {
    cfg: RelayConfig,
    pool: PgPool,
    router: Arc<Router>,
    handlers: Handlers,
    faults: Faults,
    registry: Option<Arc<relay_registry::Registry>>,
}

/// An encoder for every topic an emit of `cfg` (a route's own or a call
/// outcome's) writes with a `format`, from the latest schema of its
/// subject; a start fails naming each one it cannot make.
pub async fn emit_encoders(
    cfg: &RelayConfig,
    registry: Option<&relay_registry::Registry>,
) -> anyhow::Result<relay_core::router::Encoders> {
    let mut encoders = relay_core::router::Encoders::new();
    let mut problems = Vec::new();
    for (topic, format) in cfg.emit_formats() {
        let Some(registry) = registry else {
            problems.push(format!(
                "topic {topic}: emits with format = {:?} need [schema_registry]",
                format.format.as_str()
            ));
            continue;
        };
        match registry.encoder(&format).await {
            Ok(e) => {
                encoders.insert(topic, e);
            }
            Err(why) => problems.push(format!("topic {topic}: {why}")),
        }
    }
    anyhow::ensure!(problems.is_empty(), "emits cannot be encoded:\n  {}", problems.join("\n  "));
    Ok(encoders)
}

/// [`emit_encoders`] with a registry client of its own: for a command that
/// records outcomes without a running relay (`relay intents resolve`). Asks
/// the registry only when an emit has a `format`.
pub async fn own_emit_encoders(cfg: &RelayConfig) -> anyhow::Result<relay_core::router::Encoders> {
    if cfg.emit_formats().is_empty() {
        return Ok(Default::default());
    }
    let registry = cfg.schema_registry.as_ref().map(relay_registry::Registry::new).transpose()?;
    emit_encoders(cfg, registry.as_ref()).await
}

impl Relay {
    /// Connect to the database, compile the routes, and check the schema is current.
    pub async fn new(mut cfg: RelayConfig, handlers: Handlers, faults: Faults) -> anyhow::Result<Relay> {
        crate::config::read_schemas(&mut cfg)?;
        for warning in cfg.warnings() {
            tracing::warn!("{warning}");
        }
        #[cfg(feature = "faults")]
        let router = match faults.sabotage() {
            s if s.any() => Router::sabotaged(&cfg, s)?,
            _ => Router::new(&cfg)?,
        };
        #[cfg(not(feature = "faults"))]
        let router = Router::new(&cfg)?;
        // Only a sabotaged relay registers: a sound one beside it in the same
        // test process must not clear its defects.
        #[cfg(feature = "faults")]
        if faults.sabotage().any() {
            relay_store::sabotage::set(&cfg.consumer.name, faults.sabotage());
        }
        let wanted = cfg.routes.iter().filter_map(|r| r.handler.as_deref());
        let missing = handlers.missing(wanted);
        if !missing.is_empty() {
            anyhow::bail!("routes name handlers that are not registered in this binary: {}", missing.join(", "));
        }
        let pool = connect(&cfg).await?;
        if !relay_store::migrations_current(&pool).await? {
            anyhow::bail!("the database schema is not current: run `relay migrate` first");
        }
        register_front_door(&cfg, &pool).await?;
        let registry = match &cfg.schema_registry {
            Some(r) => Some(Arc::new(relay_registry::Registry::new(r)?)),
            None => None,
        };
        let encoders = emit_encoders(&cfg, registry.as_deref()).await?;
        let router = Arc::new(router.with_encoders(encoders));
        Ok(Relay { cfg, pool, router, handlers, faults, registry })
    }

    /// The configuration.
    pub fn config(&self) -> &RelayConfig {
        &self.cfg
    }

    /// The database pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// A record processor over this relay's routes (for replays).
    pub fn processor(&self) -> Processor {
        Processor::new(self.router.clone(), self.handlers.clone())
            .with_faults(self.faults.clone())
            .with_registry(self.registry.clone())
    }

    /// The operator actions over this relay's database and configuration.
    pub fn operator(&self) -> Operator {
        Operator::new(self.pool.clone(), &self.cfg).with_encoders(self.router.encoders())
    }

    /// The inbox consumer.
    pub fn consumer(&self) -> anyhow::Result<InboxConsumer> {
        self.consumer_with(self.processor(), InputTopics::default())
    }

    /// The inbox consumer of `inputs`, processing with `processor`.
    fn consumer_with(&self, processor: Processor, inputs: InputTopics) -> anyhow::Result<InboxConsumer> {
        let c = &self.cfg.consumer;
        let topics = self.cfg.subscribed_topics();
        if topics.is_empty() {
            anyhow::bail!("no topics to consume: add [[routes]] (or [topics.NAME]) to the configuration");
        }
        let settings = ConsumerSettings {
            name: c.name.clone(),
            group: c.group().to_owned(),
            topics,
            batch_size: c.batch_size,
            max_buffered_bytes: c.max_buffered_bytes,
            reference_retry: c.reference_retry,
            database_backoff: c.database_backoff,
            largest_batch: inputs.largest_batch,
            transaction_timeout: self.cfg.database.transaction_timeout,
        };
        InboxConsumer::new(&self.cfg.kafka, settings, processor, self.pool.clone(), self.faults.clone())
    }

    /// The intent dispatcher.
    pub fn dispatcher(&self) -> anyhow::Result<Dispatcher> {
        let (settings, consumer) = (self.cfg.dispatcher.clone(), &self.cfg.consumer.name);
        let (endpoints, encoders) = (&self.cfg.endpoints, self.router.encoders());
        Dispatcher::new(self.pool.clone(), settings, consumer, endpoints, encoders, self.faults.clone())
    }

    /// The outbox publisher.
    pub fn publisher(&self) -> anyhow::Result<Publisher> {
        let (settings, consumer) = (self.cfg.publisher.clone(), &self.cfg.consumer.name);
        Publisher::new(self.pool.clone(), &self.cfg.kafka, settings, consumer, self.faults.clone())
    }

    /// Run `which` until `shutdown` is cancelled or one of them fails (then
    /// the others are stopped gracefully and the first error is returned).
    pub async fn run(&self, which: Components, shutdown: CancellationToken) -> anyhow::Result<()> {
        let inner = shutdown.child_token();
        let metrics = crate::runtime::metrics::install();
        crate::runtime::trace::init(&self.cfg.telemetry)?;
        if which.consumer || which.publisher {
            crate::runtime::kafka::preflight(&self.cfg.kafka).await?;
        }
        let inputs = if which.consumer {
            crate::runtime::kafka::check_input_topics(&self.cfg).await?
        } else {
            InputTopics::default()
        };
        // Every process that deletes inbox rows checks first (R15): the
        // consumer, and the dispatcher, beside which cleanup runs.
        let checked = if which.consumer || which.dispatcher {
            Some(crate::ops::retention::check_topic_retention(&self.cfg).await?)
        } else {
            None
        };
        let mut set = tokio::task::JoinSet::new();
        if self.cfg.admin.listen.is_some() {
            let (cfg, pool, processor, t) = (self.cfg.clone(), self.pool.clone(), self.processor(), inner.clone());
            set.spawn(
                async move { ("admin server", crate::ops::server::serve(cfg, pool, processor, metrics, t).await) },
            );
        }
        if let Some(checked) = checked.filter(|_| which.dispatcher) {
            // Retention cleanup runs beside dispatchers; a row lock keeps it to one at a time.
            let (pool, retention, consumer, t) =
                (self.pool.clone(), self.cfg.retention.clone(), self.cfg.consumer.name.clone(), inner.clone());
            tokio::spawn(crate::ops::retention::run(pool, retention, consumer, checked, t));
        }
        let dispatcher = which.dispatcher.then(|| self.dispatcher()).transpose()?;
        // Consumer and dispatcher side by side: claim at ingest (crate::deliver::handoff).
        let handoff = match &dispatcher {
            Some(d) if which.consumer && self.cfg.dispatcher.claim_at_ingest => {
                Some(d.handoff(self.cfg.consumer.batch_size))
            }
            _ => None,
        };
        if which.consumer {
            let processor = self.processor();
            let processor = match handoff {
                Some(h) => processor.claiming_for(h),
                None => processor,
            };
            let c = self.consumer_with(processor, inputs)?;
            let t = inner.clone();
            set.spawn(async move { ("consumer", c.run(t).await) });
        }
        if let Some(d) = dispatcher {
            let t = inner.clone();
            set.spawn(async move { ("dispatcher", d.run(t).await) });
        }
        if which.publisher {
            let p = self.publisher()?;
            let t = inner.clone();
            set.spawn(async move { ("publisher", p.run(t).await) });
        }
        let mut first_error = None;
        while let Some(joined) = set.join_next().await {
            let (name, result) = joined?;
            match result {
                Ok(()) => info!(component = name, "component stopped"),
                Err(e) => {
                    error!(component = name, error = format!("{e:#}"), "component failed; stopping the others");
                    inner.cancel();
                    first_error.get_or_insert(e);
                }
            }
        }
        crate::runtime::trace::shutdown();
        first_error.map_or(Ok(()), Err)
    }
}

/// Open the pool described by the configuration.
///
/// sqlx checks every connection with a round trip each time it leaves the
/// pool (`test_before_acquire`); on the relay's busy paths that was one
/// round trip of the five a claim took and one of the nine of a consumer's
/// batch, each of them a wait for a core on a loaded machine (or a network
/// round trip to a database elsewhere). Here only a connection
/// that sat idle for 5 s (`relay_store::CHECK_IDLE_AFTER`) is checked (the hook sqlx
/// documents for this), which is where a restarted server or a dropped
/// connection hides between bursts. A connection in steady use that breaks
/// fails its next statement instead, which every caller already treats as a
/// transient error and retries — as it must for a statement in flight when
/// the server goes away.
///
/// Its sessions search `pg_catalog` alone for functions and operators:
/// with `public` (the default) on the path, a function planted there with
/// an exact argument type (`public.unnest(text[])`) would be chosen over
/// the built-in one and run as relay's role in every claim. Relay names
/// its own objects with their schema. A transaction left idle for five
/// minutes is ended by the server.
pub async fn connect(cfg: &RelayConfig) -> anyhow::Result<PgPool> {
    let url = cfg.database.url()?;
    let options = url
        .parse::<sqlx::postgres::PgConnectOptions>()
        .map_err(|e| anyhow::anyhow!("{}", cannot_connect(url, &e)))?
        .options([
            ("search_path", "pg_catalog,pg_temp"),
            // A relay that froze or lost its network mid-batch leaves its
            // transaction open, holding the batch's inbox rows and key
            // locks, until the server notices the connection is gone (two
            // hours of TCP keepalive by default); the partition's next
            // owner waits on them. The server ends such a transaction
            // after five minutes idle: relay's own never idle that long.
            ("idle_in_transaction_session_timeout", "300s"),
        ]);
    PgPoolOptions::new()
        .max_connections(cfg.database.max_connections)
        .acquire_timeout(cfg.database.acquire_timeout)
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for > relay_store::CHECK_IDLE_AFTER {
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
        .connect_with(options)
        .await
        .map_err(|e| anyhow::anyhow!("{}", cannot_connect(url, &e)))
}

/// Why the pool could not connect, naming the server and its TLS settings
/// (never the password): a certificate error says which CA file was used.
fn cannot_connect(url: &str, e: &sqlx::Error) -> String {
    let Ok(parsed) = url::Url::parse(url) else {
        return format!("cannot connect to PostgreSQL (database.url / DATABASE_URL): {e}");
    };
    let param = |name: &str| parsed.query_pairs().find(|(k, _)| k == name).map(|(_, v)| v.into_owned());
    let server = format!("{}:{}", parsed.host_str().unwrap_or("localhost"), parsed.port().unwrap_or(5432));
    let mode = param("sslmode").unwrap_or_else(|| "prefer (sqlx's default)".into());
    let text = e.to_string();
    let hint = match param("sslrootcert") {
        _ if !(text.contains("certificate") || text.contains("UnknownIssuer")) => String::new(),
        Some(ca) => format!(
            "; the server's certificate could not be verified with the CA in sslrootcert = {ca:?}: \
             set sslrootcert to the CA that signed it"
        ),
        None => "; the server's certificate could not be verified with the system's CA certificates: \
                 set sslrootcert in the URL to the CA that signed it"
            .into(),
    };
    format!("cannot connect to PostgreSQL at {server} (database.url / DATABASE_URL, sslmode = {mode}): {e}{hint}")
}

/// What `cfg` lets applications enqueue (`[application]`), for the database.
pub fn front_door(cfg: &RelayConfig) -> Option<relay_store::application::FrontDoor> {
    let app = cfg.application.as_ref()?;
    let endpoints = app
        .endpoints
        .iter()
        .filter_map(|name| {
            let e = cfg.endpoints.get(name)?;
            let profile = e.profile();
            Some(relay_store::application::Endpoint {
                name: name.clone(),
                max_attempts: i32::try_from(e.max_attempts).unwrap_or(i32::MAX),
                max_age_secs: e.max_age.as_secs_f64(),
                key_max_length: profile.max_length.map(|n| i32::try_from(n).unwrap_or(i32::MAX)),
                key_in_body: matches!(profile.key, relay_core::profile::KeyPlacement::BodyField(_)),
                sends_key: profile.key != relay_core::profile::KeyPlacement::Omitted,
                reserved_headers: crate::deliver::http::reserved_headers(e),
            })
        })
        .collect();
    Some(relay_store::application::FrontDoor {
        source: app.source(&cfg.consumer.name),
        max_payload_bytes: i32::try_from(app.max_payload_bytes).unwrap_or(i32::MAX),
        topics: app.topics.clone(),
        endpoints,
        sagas: app.sagas.clone(),
        role: app.role.clone(),
    })
}

/// Register `cfg`'s front door for applications (or close it), warning when
/// its role does not exist yet. A registration that differs from the one in
/// the database and cannot be written fails: a door left wider than the
/// configuration (a topic, endpoint, saga or role taken out, or the section
/// removed) must not stay open because the running role may not narrow it.
pub async fn register_front_door(
    cfg: &RelayConfig,
    pool: &PgPool,
) -> anyhow::Result<relay_store::application::Registered> {
    let door = front_door(cfg);
    let registered = match relay_store::application::register(pool, &cfg.consumer.name, door.as_ref()).await {
        Ok(r) => r,
        Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("42501" | "55P03")) => anyhow::bail!(
            "[application] differs from the front door for applications registered in the database, and this \
             relay could not write it ({}): run `relay migrate` with this configuration as the role that owns \
             relay's schema (or wait for the other relay registering it), then start again",
            e.message()
        ),
        Err(e) => return Err(anyhow::Error::from(e).context("register the [application] front door")),
    };
    if let Some(door) = &door
        && let Some(why) = registered.closed_because(&door.role)
    {
        tracing::warn!(role = %door.role, "{why}");
    }
    Ok(registered)
}
