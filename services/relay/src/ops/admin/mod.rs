//! Operator actions: the one service behind both the `relay` command line
//! and the HTTP admin API ([`crate::ops::server`]). Dead letters (list, show,
//! replay through the same guards with the original event id, purge), intents
//! (list, show, queue again), outbox rows (list, show, replay or skip a dead
//! one), pauses and counts. Each action decides here —
//! which names are known, what "all" selects, what counts as resolved — and
//! its callers only render the answer (text, JSON, an HTTP status).

use std::collections::HashMap;

use relay_core::{PoisonClass, RelayConfig};
use relay_store::dead_letters::{Filter, Resolution};
use relay_store::intents::{self};
use relay_store::ops::{self, Pause, PauseKind, Paused, Resumed};
use relay_store::outbox::{self, Acted, OutboxState, OutboxView};
use relay_store::stats::{self, Stats};
use sqlx::PgPool;
use uuid::Uuid;

mod dead_letter_actions;
mod intent_actions;

pub use dead_letter_actions::{DeadLetters, Released, ReplayOutcome, Replayed};
pub use intent_actions::{
    IntentHistory, IntentResolution, Intents, KeyWindow, Requeued, UNCERTAIN_KEY_FORGOTTEN, UNCERTAIN_WITHOUT_KEYS,
    on_dead_recorded,
};

/// Why an operator action was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// What was asked for does not exist (HTTP 404).
    #[error("{0}")]
    NotFound(String),
    /// It exists but is in no state for this action (HTTP 409).
    #[error("{0}")]
    Conflict(String),
    /// The database failed (HTTP 503).
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// Another service it needs could not be asked, e.g. the Schema
    /// Registry; nothing was changed (HTTP 503).
    #[error("{0}; nothing was changed, try again")]
    Unavailable(String),
    /// Anything else (HTTP 500).
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// The counts the console shows.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct Counts {
    /// Rows by table and state.
    pub stats: Stats,
    /// Tables counted by estimate (too large to count exactly on every refresh).
    pub estimated: Vec<&'static str>,
    /// What is paused.
    pub pauses: Vec<Pause>,
}

/// The operator actions of one consumer's relay.
#[derive(Debug, Clone)]
pub struct Operator {
    pool: PgPool,
    consumer: String,
    routes: Vec<String>,
    endpoints: Vec<String>,
    /// What a replay must respect of each endpoint (its key window, whether it has keys).
    replay_rules: HashMap<String, intents::ReplayRules>,
    /// Held records a release replays per transaction.
    release_chunk: i64,
    /// What encodes the outcome events a resolution records, by topic
    /// ([`Operator::with_encoders`]).
    encoders: relay_core::router::Encoders,
    /// The topics the configuration writes with a `format`: each needs an
    /// encoder before a resolution records anything.
    formatted: Vec<String>,
}

/// Bulk actions work through ids in pages of this many.
const PAGE: i64 = 1000;

/// Held records a release replays per transaction: a few seconds of work at
/// most, which is as long as a consumer batch of the key may wait for it.
pub const RELEASE_CHUNK: i64 = 500;

impl Operator {
    /// The operator of the relay configured by `cfg`, over `pool`.
    pub fn new(pool: PgPool, cfg: &RelayConfig) -> Operator {
        Operator {
            pool,
            consumer: cfg.consumer.name.clone(),
            routes: cfg.routes.iter().map(|r| r.display_name()).collect(),
            endpoints: cfg.endpoints.keys().cloned().collect(),
            replay_rules: cfg
                .endpoints
                .iter()
                .map(|(n, e)| {
                    let p = e.profile();
                    let rules = intents::ReplayRules {
                        key_window: p.window,
                        keys: p.resends_unknown(),
                        max_age: Some(e.max_age),
                        window: p.window,
                    };
                    (n.clone(), rules)
                })
                .collect(),
            release_chunk: RELEASE_CHUNK,
            encoders: Default::default(),
            formatted: cfg.emit_formats().into_iter().map(|(topic, _)| topic).collect(),
        }
    }

    /// The same operator, encoding the outcome events a resolution records
    /// with `encoders` (`relay::app::emit_encoders`): needed when an
    /// outcome emit has a `format`, whose events would otherwise go out as
    /// JSON.
    pub fn with_encoders(mut self, encoders: relay_core::router::Encoders) -> Operator {
        self.encoders = encoders;
        self
    }

    /// The same operator, releasing held keys `n` records per transaction
    /// (default [`RELEASE_CHUNK`]; tests use small chunks).
    pub fn with_release_chunk(mut self, n: i64) -> Operator {
        self.release_chunk = n.max(1);
        self
    }

    /// A dead-letter filter of this consumer.
    pub fn filter(&self, class: Option<PoisonClass>, topic: Option<String>, resolution: Resolution) -> Filter {
        Filter { consumer: Some(self.consumer.clone()), error_class: class, topic, resolution }
    }

    /// Every count, exact (for the command line).
    pub async fn stats(&self) -> Result<Stats, OpsError> {
        Ok(stats::snapshot(&mut *self.pool.acquire().await?).await?)
    }

    /// The counts and pauses, estimated where tables are large: every open
    /// console asks every 3 s (see `stats::overview`).
    pub async fn counts(&self) -> Result<Counts, OpsError> {
        let mut conn = self.pool.acquire().await?;
        let (stats, estimated) = stats::overview(&mut conn, stats::EXACT_UP_TO).await?;
        Ok(Counts { stats, estimated, pauses: ops::pauses(&mut conn, &self.consumer).await? })
    }

    /// This consumer's outbox rows in `state` (any, if `None`) to `topic`
    /// (any) written before `before`, newest first.
    pub async fn outbox_rows(
        &self,
        state: Option<OutboxState>,
        topic: Option<&str>,
        before: Option<chrono::DateTime<chrono::Utc>>,
        limit: i64,
    ) -> Result<Vec<OutboxView>, OpsError> {
        let mut conn = self.pool.acquire().await?;
        Ok(outbox::list(&mut conn, &self.consumer, state, topic, before, limit).await?)
    }

    /// Outbox row `id` of this consumer.
    pub async fn outbox_row(&self, id: Uuid) -> Result<OutboxView, OpsError> {
        outbox::get(&mut *self.pool.acquire().await?, &self.consumer, id)
            .await?
            .ok_or_else(|| OpsError::NotFound(format!("no outbox row {id} (list them with `relay outbox list`)")))
    }

    /// Queue dead outbox row `id` again: it is published before the rows of
    /// its key written after it, which waited for it.
    pub async fn outbox_replay(&self, id: Uuid) -> Result<(), OpsError> {
        match outbox::replay(&mut *self.pool.acquire().await?, &self.consumer, id).await? {
            Acted::Done => Ok(()),
            Acted::NotDead => Err(not_dead(id)),
        }
    }

    /// Skip dead outbox row `id` for good: it is never published, and the
    /// rows of its key written after it go on.
    pub async fn outbox_skip(&self, id: Uuid) -> Result<(), OpsError> {
        match outbox::skip(&mut *self.pool.acquire().await?, &self.consumer, id).await? {
            Acted::Done => Ok(()),
            Acted::NotDead => Err(not_dead(id)),
        }
    }

    /// Every pause.
    pub async fn pauses(&self) -> Result<Vec<Pause>, OpsError> {
        Ok(ops::pauses(&mut *self.pool.acquire().await?, &self.consumer).await?)
    }

    /// Pause route or endpoint `name`, which the configuration must know.
    pub async fn pause(&self, kind: PauseKind, name: &str, reason: Option<&str>) -> Result<Paused, OpsError> {
        let known = match kind {
            PauseKind::Route => &self.routes,
            PauseKind::Endpoint => &self.endpoints,
        };
        if !known.iter().any(|k| k == name) {
            return Err(OpsError::NotFound(format!(
                "no {} named {name:?} in the configuration (known: {})",
                kind.as_str(),
                known.join(", ")
            )));
        }
        Ok(ops::pause(&mut *self.pool.acquire().await?, &self.consumer, kind, name, reason).await?)
    }

    /// Resume route or endpoint `name` of this deployment: another
    /// deployment's pause of the same name stays.
    pub async fn resume(&self, kind: PauseKind, name: &str) -> Result<Resumed, OpsError> {
        Ok(ops::resume(&mut *self.pool.acquire().await?, &self.consumer, kind, name).await?)
    }
}

fn not_dead(id: Uuid) -> OpsError {
    OpsError::Conflict(format!(
        "outbox row {id} is not dead (or is not this consumer's): only dead rows are replayed or skipped"
    ))
}
