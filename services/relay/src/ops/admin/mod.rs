//! Operator actions: the one service behind both the `relay` command line
//! and the HTTP admin API ([`crate::ops::server`]). Dead letters (list, show,
//! replay through the same guards with the original event id, purge), intents
//! (list, show, queue again), outbox rows (list, show, replay or skip a dead
//! one), pauses and counts. Each action decides here —
//! which names are known, what "all" selects, what counts as resolved — and
//! its callers only render the answer (text, JSON, an HTTP status).

use std::collections::HashMap;

use relay_core::{Disposition, RelayConfig};
use relay_store::dead_letters::{self, DeadLetter, DeadLetterRecord, Filter, Resolution};
use relay_store::intents::{self, AttemptView, IntentFilter, IntentState, IntentView, Requeue};
use relay_store::ops::{self, Pause, PauseKind, Paused, Resumed};
use relay_store::outbox::{self, Acted, OutboxState, OutboxView};
use relay_store::stats::{self, Stats};
use relay_store::{holds, inbox};
use sqlx::PgPool;
use uuid::Uuid;

use crate::ingest::processor::Processor;

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

/// What a replay did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayOutcome {
    /// Processed now: the effects were written.
    Applied,
    /// Already processed before (the inbox has it, or a replay resolved
    /// this dead letter before): nothing written.
    Duplicate,
    /// Processed as a classified no-op (stale, invalid transition, …).
    NoOp(String),
    /// Still failing: stays a dead letter.
    StillFailing(String),
    /// Held behind an earlier dead letter of its key, which goes first:
    /// not replayed (why, and which one to replay or skip).
    Held(String),
    /// Skipped by an operator before (it held its key): never applied, as
    /// its key's later records went ahead of it. Resolved; not replayed.
    Skipped,
    /// No dead letter with that id.
    NotFound,
}

impl ReplayOutcome {
    /// Whether the dead letter is resolved.
    pub fn resolved(&self) -> bool {
        matches!(
            self,
            ReplayOutcome::Applied | ReplayOutcome::Duplicate | ReplayOutcome::NoOp(_) | ReplayOutcome::Skipped
        )
    }

    /// A label for the outcome (`applied`, `duplicate`, `no_op`,
    /// `still_failing`, `held`, `skipped`, `not_found`) and its detail, if any.
    pub fn label(&self) -> (&'static str, &str) {
        match self {
            ReplayOutcome::Applied => ("applied", ""),
            ReplayOutcome::Duplicate => ("duplicate", ""),
            ReplayOutcome::NoOp(c) => ("no_op", c),
            ReplayOutcome::StillFailing(why) => ("still_failing", why),
            ReplayOutcome::Held(why) => ("held", why),
            ReplayOutcome::Skipped => (
                "skipped",
                "skipped before: never applied, its key's later records went ahead of it; it is not replayed",
            ),
            ReplayOutcome::NotFound => ("not_found", ""),
        }
    }

    fn stored(&self) -> String {
        match self {
            ReplayOutcome::NoOp(o) => o.clone(),
            ReplayOutcome::StillFailing(why) => format!("failed: {why}"),
            ReplayOutcome::Held(why) => format!("failed: {why}"),
            other => other.label().0.into(),
        }
    }
}

/// What a replay did: its outcome and, when it released a held key, that.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replayed {
    /// The dead letter's own outcome.
    pub outcome: ReplayOutcome,
    /// The key it held, released.
    pub released: Option<Released>,
}

/// A held record key released (a replay of its head resolved, or the head
/// was skipped): its held records were replayed in offset order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// The Kafka record key.
    pub key: Vec<u8>,
    /// Held records processed (applied, duplicates or classified no-ops).
    pub replayed: u64,
    /// The held record that failed in its turn: it holds the key now, and
    /// the records after it stay held behind it.
    pub held_behind: Option<i64>,
}

impl Released {
    /// One line for an operator.
    pub fn describe(&self) -> String {
        let key = holds::preview(&self.key);
        match self.held_behind {
            None => format!("key {key:?} released: {} held record(s) replayed in order", self.replayed),
            Some(id) => format!(
                "key {key:?}: {} held record(s) replayed in order, then dead letter {id} did not go through and holds \
                 the key now",
                self.replayed
            ),
        }
    }
}

/// A replay's outcome, from what processing the record decided.
fn replay_outcome(d: Disposition) -> ReplayOutcome {
    match d {
        Disposition::Applied { .. } => ReplayOutcome::Applied,
        Disposition::Duplicate => ReplayOutcome::Duplicate,
        Disposition::NoOp { outcome, .. } => ReplayOutcome::NoOp(outcome.as_str().to_owned()),
        Disposition::DeadLetter(p) | Disposition::RetryLater(p) | Disposition::Held(p) => {
            ReplayOutcome::StillFailing(p.to_string())
        }
        Disposition::Paused { route } => {
            ReplayOutcome::StillFailing(format!("route {route} is paused; resume it first"))
        }
    }
}

/// Which dead letters a bulk action works on.
#[derive(Debug, Clone)]
pub enum DeadLetters {
    /// These ids (of this consumer).
    Ids(Vec<i64>),
    /// Every one matching (see [`Operator::filter`]).
    Matching(Filter),
}

/// Which intents to queue again.
#[derive(Debug, Clone)]
pub enum Intents {
    /// These ids.
    Ids(Vec<Uuid>),
    /// Every dead intent, of one endpoint if given.
    Dead {
        /// Only this endpoint's.
        endpoint: Option<String>,
    },
}

/// What queuing intents again did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Requeued {
    /// How many were asked for.
    pub asked: usize,
    /// How many were queued again.
    pub queued: usize,
    /// Those neither dead nor uncertain (or unknown), left as they are.
    pub left: Vec<Uuid>,
    /// Dead ones whose `on_dead` effects were recorded, left dead
    /// ([`Requeue::OnDeadRecorded`]).
    pub refused: Vec<Uuid>,
    /// Of those queued, dead ones with an ordering key, queued behind the
    /// intents of their key written after them ([`Requeue::QueuedBehindItsKey`]).
    pub behind_their_key: Vec<Uuid>,
    /// Left as they are, each with why: their attempts could outlive the
    /// provider's key window and `--past-key-window` was not given
    /// ([`Requeue::PastKeyWindow`]), or they are uncertain at a provider
    /// without keys ([`Requeue::UncertainWithoutKeys`]).
    pub not_replayed: Vec<(Uuid, String)>,
}

/// Whether a replay may run attempts past the provider's key window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyWindow {
    /// No: such intents are left as they are, with the reason.
    #[default]
    Within,
    /// Yes: the operator checked with the provider (`--past-key-window`).
    PastAllowed,
}

impl KeyWindow {
    /// The choice a `--past-key-window` flag (or its API field) makes.
    pub fn past_allowed(yes: bool) -> Self {
        if yes { KeyWindow::PastAllowed } else { KeyWindow::Within }
    }
}

/// The counts the console shows.
#[derive(Debug, Clone, serde::Serialize)]
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

/// An intent and what was done about it.
#[derive(Debug, Clone, serde::Serialize)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct IntentHistory {
    pub intent: IntentView,
    /// Its call attempts, oldest first.
    pub attempts: Vec<AttemptView>,
    /// The questions to its provider about an unknown outcome, oldest first.
    pub reconciliations: Vec<relay_store::reconciliations::ReconciliationView>,
    /// The provider's answer its `on_success` effects were rendered from,
    /// if they read one.
    pub response: Option<serde_json::Value>,
}

/// What an operator found out about an uncertain intent from the provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum IntentResolution {
    /// The provider applied it: record its `on_success` effects.
    Succeeded,
    /// The provider did not apply it: record its `on_dead` effects.
    Failed,
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
    pub fn filter(&self, class: Option<String>, topic: Option<String>, resolution: Resolution) -> Filter {
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

    /// Dead letters matching `f` with ids after `after`, oldest first.
    pub async fn dead_letters(&self, f: &Filter, after: i64, limit: i64) -> Result<Vec<DeadLetter>, OpsError> {
        Ok(dead_letters::list(&mut *self.pool.acquire().await?, f, after, limit).await?)
    }

    /// How many dead letters match `f`.
    pub async fn count_dead_letters(&self, f: &Filter) -> Result<i64, OpsError> {
        Ok(dead_letters::count(&mut *self.pool.acquire().await?, f).await?)
    }

    /// Dead letter `id`, with its record.
    pub async fn dead_letter(&self, id: i64) -> Result<DeadLetterRecord, OpsError> {
        dead_letters::get(&mut *self.pool.acquire().await?, &self.consumer, id).await?.ok_or_else(|| {
            OpsError::NotFound(format!("no dead letter {id} (list them with `relay dead-letters list --all`)"))
        })
    }

    /// The ids `which` selects, in order.
    async fn dead_letter_ids(&self, which: DeadLetters) -> Result<Vec<i64>, OpsError> {
        let f = match which {
            DeadLetters::Ids(ids) => return Ok(ids),
            DeadLetters::Matching(f) => f,
        };
        let mut conn = self.pool.acquire().await?;
        let (mut ids, mut after) = (Vec::new(), 0);
        loop {
            let page = dead_letters::list(&mut conn, &f, after, PAGE).await?;
            let Some(last) = page.last() else { return Ok(ids) };
            after = last.id;
            ids.extend(page.iter().map(|d| d.id));
        }
    }

    /// Replay dead letter `id` through `processor` in one transaction (a
    /// dead letter of another consumer sharing the database is not found:
    /// its routes are not these). A route paused now holds the replay as it
    /// holds the partition. See [`Operator::replay_releasing`].
    pub async fn replay(&self, processor: &Processor, id: i64) -> Result<ReplayOutcome, OpsError> {
        Ok(self.replay_releasing(processor, id).await?.outcome)
    }

    /// [`Operator::replay`], and when dead letter `id` holds its Kafka key
    /// (`on_poison = "hold_key"`) and now resolves, the records held behind
    /// it are replayed in offset order and the key is released
    /// (in chunks, see `release`). A held record is not replayed before its
    /// head. Replaying a head whose release was cut short takes it up again,
    /// without processing the head a second time.
    pub async fn replay_releasing(&self, processor: &Processor, id: i64) -> Result<Replayed, OpsError> {
        let Some((mut tx, state, hold)) = self.lock_letter(id).await? else {
            return Ok(Replayed { outcome: ReplayOutcome::NotFound, released: None });
        };
        let outcome = match state {
            dead_letters::Locked::Skipped => Some(ReplayOutcome::Skipped),
            dead_letters::Locked::Resolved => Some(ReplayOutcome::Duplicate),
            dead_letters::Locked::Open => None,
        };
        match (outcome, hold) {
            // Dealt with before, its key still held: its release was cut
            // short. Go on with it; the head itself was applied (or skipped)
            // once, and its inbox row may be gone by now.
            (Some(outcome), Some(h)) if h.head == id => {
                processor.paused().set(ops::paused_routes(&mut tx, &self.consumer).await?);
                let released = Some(self.release(tx, processor, h).await?);
                Ok(Replayed { outcome, released })
            }
            // Resolved before (applied, a duplicate, a classified no-op, or
            // skipped): not processed again. It could only do harm: once
            // retention took its inbox row it would be applied a second time
            // (after the records released behind it), and through a paused
            // route it would be reopened.
            (Some(outcome), _) => Ok(Replayed { outcome, released: None }),
            (_, Some(h)) if h.head != id => {
                let why = format!(
                    "held behind dead letter {} (offset {}) of its key; replay or skip that one, and this one follows in order",
                    h.head, h.head_offset
                );
                Ok(Replayed { outcome: ReplayOutcome::Held(why), released: None })
            }
            (_, hold) => {
                let Some(dl) = dead_letters::get(&mut tx, &self.consumer, id).await? else {
                    return Ok(Replayed { outcome: ReplayOutcome::NotFound, released: None });
                };
                // The pauses as they are now, not as a consumer of this process last read them (if any does).
                processor.paused().set(ops::paused_routes(&mut tx, &self.consumer).await?);
                let view = processor.decoder().view(&dl.record).await.map_err(OpsError::Unavailable)?;
                let processed = processor.process(&mut tx, &dl.record, &view).await?;
                let outcome = replay_outcome(processed.disposition);
                dead_letters::mark_replayed(&mut tx, &self.consumer, id, &outcome.stored()).await?;
                let released = match hold {
                    Some(h) if outcome.resolved() => Some(self.release(tx, processor, h).await?),
                    _ => {
                        tx.commit().await?;
                        None
                    }
                };
                Ok(Replayed { outcome, released })
            }
        }
    }

    /// Dead letter `id` and its hold, locked in a new transaction (hold
    /// first, as a release takes them: [`holds::lock_letter`]). `None`: no
    /// such dead letter of this consumer.
    async fn lock_letter(
        &self,
        id: i64,
    ) -> Result<Option<(sqlx::Transaction<'static, sqlx::Postgres>, dead_letters::Locked, Option<holds::Hold>)>, OpsError>
    {
        // The hold changes under a read only when a consumer batch holds the
        // key behind this letter or a release lets go of it: rare, and done
        // by the next try.
        for _ in 0..10 {
            let mut tx = self.pool.begin().await?;
            match holds::lock_letter(&mut tx, &self.consumer, id).await? {
                holds::LetterLock::NotFound => return Ok(None),
                holds::LetterLock::Changed => continue,
                holds::LetterLock::Locked { state, hold } => return Ok(Some((tx, state, hold))),
            }
        }
        Err(OpsError::Conflict(format!("the hold of dead letter {id} kept changing while it was read: try again")))
    }

    /// Skip dead letter `id`, which holds its Kafka key: it stays a dead
    /// letter, marked `skipped` (resolved, never applied), and the records
    /// held behind it are replayed in offset order. Its event gets an inbox
    /// row `skipped`, so that a redelivery of its record never applies it.
    /// Skipping it again takes up a release that was cut short.
    pub async fn skip_dead_letter(&self, processor: &Processor, id: i64) -> Result<Released, OpsError> {
        let not_found = || OpsError::NotFound(format!("no dead letter {id}"));
        let (mut tx, state, hold) = self.lock_letter(id).await?.ok_or_else(not_found)?;
        let hold = match hold {
            Some(h) if h.head == id => h,
            Some(h) => {
                return Err(OpsError::Conflict(format!(
                    "dead letter {id} is held behind dead letter {} of its key: skip or replay that one",
                    h.head
                )));
            }
            None if state != dead_letters::Locked::Open => {
                return Err(OpsError::Conflict(format!(
                    "dead letter {id} was replayed or skipped before and holds no key any more: nothing to skip"
                )));
            }
            None => {
                return Err(OpsError::Conflict(format!(
                    "dead letter {id} holds no key (only a record dead-lettered by a route with on_poison = \
                     \"hold_key\" does): replay it, or delete it"
                )));
            }
        };
        // The pauses as they are now, for the release's first chunk.
        processor.paused().set(ops::paused_routes(&mut tx, &self.consumer).await?);
        match state {
            // Applied by a replay, or skipped, before the release was cut
            // short: only the release is taken up.
            dead_letters::Locked::Resolved | dead_letters::Locked::Skipped => {
                tracing::info!(dead_letter = id, "dead letter resolved already; taking up the release of its key");
            }
            dead_letters::Locked::Open => {
                let dl = dead_letters::get(&mut tx, &self.consumer, id).await?.ok_or_else(not_found)?;
                dead_letters::mark_replayed(&mut tx, &self.consumer, id, dead_letters::SKIPPED).await?;
                // A record that could not be read has no event id; a redelivery
                // of it fails as before, and is parked at its position already.
                if let Some(event_id) = &dl.meta.event_id {
                    let row = inbox::NewInboxRow {
                        consumer: &self.consumer,
                        event_id,
                        event_type: dl.meta.event_type.as_deref().unwrap_or_default(),
                        topic: &dl.meta.topic,
                        partition: dl.meta.partition,
                        offset: dl.meta.offset,
                        idempotency_key: None,
                        aggregate_id: None,
                        correlation_id: None,
                        outcome: inbox::InboxOutcome::Skipped,
                    };
                    inbox::insert(&mut tx, &row).await?;
                }
            }
        }
        let released = self.release(tx, processor, hold).await?;
        if state == dead_letters::Locked::Open {
            tracing::info!(dead_letter = id, "dead letter skipped");
        }
        Ok(released)
    }

    /// Replay the records held behind `hold`'s head in offset order,
    /// starting in `tx` (which holds the hold locked, and in which the
    /// caller read the pauses into `processor`) and committing every
    /// [`Operator::with_release_chunk`] records: a consumer batch of the
    /// key's partition waits for one chunk, never for the whole backlog,
    /// and records parked behind the head meanwhile are released in a later
    /// chunk. Each chunk lets go of the records it replayed; the hold is
    /// dropped, in the transaction that finds nothing left, or moved to the
    /// record that fails. Cut short between chunks (a crash), the hold stays
    /// with its resolved head: replaying or skipping the head again goes on
    /// from there.
    async fn release(
        &self,
        mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
        processor: &Processor,
        mut hold: holds::Hold,
    ) -> Result<Released, OpsError> {
        let mut released = Released { key: hold.key.clone(), replayed: 0, held_behind: None };
        let head = hold.head;
        let mut after = hold.head_offset;
        loop {
            let ids = holds::waiting(&mut tx, &hold, after, self.release_chunk).await?;
            if ids.is_empty() {
                holds::release(&mut tx, &hold).await?;
                tx.commit().await?;
                tracing::info!(dead_letter = head, "{}", released.describe());
                return Ok(released);
            }
            let mut done = Vec::with_capacity(ids.len());
            for id in ids {
                let dl = dead_letters::get(&mut tx, &self.consumer, id)
                    .await?
                    .ok_or_else(|| OpsError::Conflict(format!("held dead letter {id} vanished during the release")))?;
                let view = processor.decoder().view(&dl.record).await.map_err(OpsError::Unavailable)?;
                let processed = processor.process(&mut tx, &dl.record, &view).await?;
                let failed = match &processed.disposition {
                    // Poison now, as if it had failed when it came: its copy
                    // goes to the dead-letter topic and it is counted (once
                    // committed). Not processable yet (a missing reference)
                    // counts too: a release has no retry budget, the
                    // operator's next replay of it is the retry.
                    Disposition::DeadLetter(p) | Disposition::RetryLater(p) | Disposition::Held(p) => {
                        crate::ingest::park::copy_to_dead_letter_topic(&mut tx, processor.router(), &dl.record, p, 1)
                            .await?;
                        Some((p.clone(), true))
                    }
                    // Not poison: it waits for its route, still held (class `held`).
                    Disposition::Paused { route } => Some((
                        relay_core::Poison::new(
                            relay_core::PoisonClass::Held,
                            format!(
                                "route {route} was paused when its key was released: replay this one once the route \
                                 is resumed, and the records after it follow"
                            ),
                        ),
                        false,
                    )),
                    _ => None,
                };
                let outcome = replay_outcome(processed.disposition);
                dead_letters::mark_replayed(&mut tx, &self.consumer, id, &outcome.stored()).await?;
                if let Some((poison, dead)) = failed {
                    holds::move_head(&mut tx, &mut hold, id, dl.meta.offset, &poison).await?;
                    tx.commit().await?;
                    if dead {
                        crate::runtime::metrics::dead_lettered(&self.consumer, &dl.meta.topic, poison.class.as_str());
                    }
                    released.held_behind = Some(id);
                    tracing::info!(dead_letter = head, "{}", released.describe());
                    return Ok(released);
                }
                released.replayed += 1;
                after = dl.meta.offset;
                done.push(id);
            }
            holds::let_go(&mut tx, &hold, &done).await?;
            tx.commit().await?;
            processor
                .faults()
                .hit(crate::runtime::faults::point::RELEASE_AFTER_CHUNK)
                .await
                .map_err(anyhow::Error::from)?;
            tx = self.pool.begin().await?;
            processor.paused().set(ops::paused_routes(&mut tx, &self.consumer).await?);
            match holds::lock(&mut tx, hold.id).await? {
                // Another release of the key (taken up beside this one)
                // finished it, or moved it to a record that failed.
                None => return Ok(released),
                Some(h) if h.head != head => {
                    released.held_behind = Some(h.head);
                    return Ok(released);
                }
                Some(h) => hold = h,
            }
        }
    }

    /// The held record keys of this consumer, oldest first.
    pub async fn held_keys(&self, limit: i64) -> Result<Vec<holds::HeldKey>, OpsError> {
        Ok(holds::list(&mut *self.pool.acquire().await?, &self.consumer, limit).await?)
    }

    /// Replay every dead letter `which` selects, one transaction each;
    /// `each(done, of, id, replayed)` after each one.
    pub async fn replay_all(
        &self,
        processor: &Processor,
        which: DeadLetters,
        mut each: impl FnMut(usize, usize, i64, &Replayed),
    ) -> Result<Vec<(i64, Replayed)>, OpsError> {
        let ids = self.dead_letter_ids(which).await?;
        let mut results = Vec::with_capacity(ids.len());
        for (n, id) in ids.iter().enumerate() {
            let replayed = self.replay_releasing(processor, *id).await?;
            each(n + 1, ids.len(), *id, &replayed);
            results.push((*id, replayed));
        }
        Ok(results)
    }

    /// Delete dead letter `id`, unless it belongs to a held key (its head,
    /// or held behind it): those are the key's unfinished records.
    pub async fn delete_dead_letter(&self, id: i64) -> Result<(), OpsError> {
        let mut conn = self.pool.acquire().await?;
        if dead_letters::delete(&mut conn, &self.consumer, id).await? {
            return Ok(());
        }
        match dead_letters::get(&mut conn, &self.consumer, id).await? {
            Some(dl) if dl.meta.hold_id.is_some() => Err(OpsError::Conflict(format!(
                "dead letter {id} belongs to a held key (`relay dead-letters holds`): replay or skip the key's \
                 head first; deleting it would lose a record of the key"
            ))),
            _ => Err(OpsError::NotFound(format!("no dead letter {id}"))),
        }
    }

    /// Delete every dead letter `which` selects (unknown ids are skipped);
    /// `progress(deleted)` after each page. Returns how many were deleted.
    pub async fn purge(&self, which: DeadLetters, mut progress: impl FnMut(u64)) -> Result<u64, OpsError> {
        let mut conn = self.pool.acquire().await?;
        let mut deleted = 0;
        match which {
            DeadLetters::Ids(ids) => {
                for id in ids {
                    deleted += u64::from(dead_letters::delete(&mut conn, &self.consumer, id).await?);
                }
            }
            DeadLetters::Matching(f) => loop {
                let n = dead_letters::purge(&mut conn, &f, PAGE).await?;
                if n == 0 {
                    break;
                }
                deleted += n;
                progress(deleted);
            },
        }
        Ok(deleted)
    }

    /// This consumer's intents in `state` (any, if `None`) of `endpoint`
    /// (any) created before `before`, newest first.
    pub async fn intents(
        &self,
        state: Option<IntentState>,
        endpoint: Option<String>,
        before: Option<chrono::DateTime<chrono::Utc>>,
        limit: i64,
    ) -> Result<Vec<IntentView>, OpsError> {
        let f = IntentFilter { consumer: self.consumer.clone(), state, endpoint };
        Ok(intents::list(&mut *self.pool.acquire().await?, &f, before, limit).await?)
    }

    /// Intent `id`, its attempts and its reconciliations.
    pub async fn intent(&self, id: Uuid) -> Result<IntentHistory, OpsError> {
        let mut conn = self.pool.acquire().await?;
        let Some(intent) = intents::get(&mut conn, &self.consumer, id).await? else {
            return Err(OpsError::NotFound(format!("no intent {id} (list them with `relay intents list`)")));
        };
        let attempts = intents::attempts(&mut conn, id).await?;
        let reconciliations = relay_store::reconciliations::list(&mut conn, id).await?;
        let response = intents::answer(&mut conn, id).await?;
        Ok(IntentHistory { intent, attempts, reconciliations, response })
    }

    /// Queue intent `id` again (same id, same idempotency key); only a dead
    /// or uncertain intent of this consumer is, and a dead one only if it
    /// recorded no `on_dead` effects ([`intents::requeue`]).
    pub async fn requeue(&self, id: Uuid, window: KeyWindow) -> Result<(), OpsError> {
        match intents::requeue(&mut *self.pool.acquire().await?, &self.consumer, id, self.window(window)).await? {
            Requeue::Queued | Requeue::QueuedBehindItsKey => Ok(()),
            Requeue::NotDeadOrUncertain => Err(OpsError::Conflict(format!(
                "intent {id} is neither dead nor uncertain (or is not one of consumer {:?}'s): only those are replayed",
                self.consumer
            ))),
            Requeue::OnDeadRecorded => Err(OpsError::Conflict(on_dead_recorded(id))),
            r @ (Requeue::PastKeyWindow(_) | Requeue::UncertainWithoutKeys | Requeue::UncertainKeyForgotten) => {
                Err(OpsError::Conflict(format!("intent {id} not replayed: {}", not_replayed_why(r))))
            }
        }
    }

    /// What a replay must respect, per endpoint: its key window unless
    /// the operator allowed a replay past it.
    fn window(&self, w: KeyWindow) -> impl Fn(&str) -> intents::ReplayRules + '_ {
        move |endpoint| {
            let mut rules = self.replay_rules.get(endpoint).copied().unwrap_or(intents::ReplayRules::ANY);
            if w == KeyWindow::PastAllowed {
                rules.key_window = None;
            }
            rules
        }
    }

    /// Queue every intent `which` selects again (the dead ones as they are
    /// when it starts: one that dies again meanwhile waits for the next
    /// replay); `progress(done so far)` every thousand.
    pub async fn requeue_all(
        &self,
        which: Intents,
        window: KeyWindow,
        mut progress: impl FnMut(usize),
    ) -> Result<Requeued, OpsError> {
        let mut conn = self.pool.acquire().await?;
        let ids = match which {
            Intents::Ids(ids) => ids,
            Intents::Dead { endpoint } => {
                let f = IntentFilter { consumer: self.consumer.clone(), state: Some(IntentState::Dead), endpoint };
                intents::ids(&mut conn, &f).await?
            }
        };
        let mut done = Requeued { asked: ids.len(), ..Requeued::default() };
        for (n, id) in ids.iter().enumerate() {
            match intents::requeue(&mut conn, &self.consumer, *id, self.window(window)).await? {
                Requeue::Queued => done.queued += 1,
                Requeue::QueuedBehindItsKey => {
                    done.queued += 1;
                    done.behind_their_key.push(*id);
                }
                Requeue::NotDeadOrUncertain => done.left.push(*id),
                Requeue::OnDeadRecorded => done.refused.push(*id),
                r @ (Requeue::PastKeyWindow(_) | Requeue::UncertainWithoutKeys | Requeue::UncertainKeyForgotten) => {
                    done.not_replayed.push((*id, not_replayed_why(r)))
                }
            }
            if (n + 1) % PAGE as usize == 0 {
                progress(n + 1);
            }
        }
        Ok(done)
    }

    /// Resolve uncertain intent `id` as the provider says it ended: it
    /// becomes succeeded or dead with the matching outcome effects, recorded
    /// as a call's outcome is (fenced, in one transaction). For an intent
    /// whose attempts ran out after an unknown outcome, once someone asked
    /// the provider; `note` (who, what the provider said) goes into its last
    /// error. Returns why its outcome's effects were not recorded: its
    /// `on_success` ones read the provider's answer, which relay then does
    /// not have, or an event does not fit its topic's schema.
    pub async fn resolve(
        &self,
        id: Uuid,
        resolution: IntentResolution,
        note: Option<&str>,
    ) -> Result<Option<String>, OpsError> {
        use crate::deliver::completer::Completer;
        use crate::deliver::outcome::{Completion, Finished};
        // Without its encoder, an outcome event would go out as JSON to a
        // topic its readers decode with a schema: refused before anything changes.
        if let Some(topic) = self.formatted.iter().find(|t| !self.encoders.contains_key(*t)) {
            return Err(OpsError::Other(anyhow::anyhow!(
                "topic {topic} is written with a schema, but this operator has no encoder for it: build it with \
                 Operator::with_encoders(relay::app::emit_encoders(..)), as `relay intents resolve` does"
            )));
        }
        let worker = format!("operator@{}", crate::runtime::claim_loop::default_worker_id());
        let lease = std::time::Duration::from_secs(60);
        let mut conn = self.pool.acquire().await?;
        let Some(intent) = intents::take_uncertain(&mut conn, &self.consumer, id, &worker, lease).await? else {
            return Err(OpsError::Conflict(format!(
                "intent {id} is not uncertain (or is not consumer {:?}'s): only uncertain intents are resolved",
                self.consumer
            )));
        };
        let (intent_id, token, endpoint) = (intent.id, intent.lease_token, intent.intent.endpoint.clone());
        let (next, said) = match resolution {
            IntentResolution::Succeeded => (intents::NextState::Succeeded, "succeeded"),
            IntentResolution::Failed => (intents::NextState::Dead, "failed"),
        };
        // PostgreSQL text cannot hold NUL; a note with one must not make the
        // resolution unrecordable.
        let note = note.map(|n| n.replace('\0', "\u{FFFD}"));
        let why = format!("resolved as {said} by an operator{}", note.map(|n| format!(": {n}")).unwrap_or_default());
        let why_logged = why.clone();
        // The outcome goes the way a call's does: fenced by the operator's
        // lease, its effects recorded in the same transaction.
        let progress = std::sync::Arc::new(tokio::sync::Notify::new());
        let completer = Completer::new(
            &self.pool,
            &worker,
            lease,
            crate::Faults::none(),
            progress,
            self.encoders.clone(),
            Default::default(),
        );
        let mut done = [Completion::resolved(intent, next, why)];
        let finished = completer.finalize(&mut done).await;
        let dropped = done[0].effects_dropped().map(str::to_owned);
        match finished.as_slice() {
            [Finished::Succeeded | Finished::Dead] => {
                tracing::info!(intent_id = %id, consumer = %self.consumer, resolution = ?resolution, why = %why_logged,
                               "uncertain intent resolved by an operator");
                if let Some(why) = &dropped {
                    crate::runtime::metrics::effects_dropped(&endpoint);
                    tracing::error!(intent_id = %id, "resolved as {said}, but its events are not emitted and its sagas not moved: {why}");
                }
                Ok(dropped)
            }
            other => {
                // Back to uncertain at once (the rescuer would do it too when
                // the operator lease expires: never to pending, never a call).
                let back = intents::give_back_uncertain(&mut conn, intent_id, token).await;
                Err(OpsError::Other(anyhow::anyhow!(
                    "intent {id}: the resolution could not be recorded ({other:?}; given back: {back:?}); it is \
                     uncertain as before, try again"
                )))
            }
        }
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

    /// Let dead intent `id`, which holds its ordering key (its route's
    /// `on_poison = "hold_key"`), release it: it stays dead, and the key's
    /// later intents go on. Returns the key and how many wait behind it.
    pub async fn intent_skip(&self, id: Uuid) -> Result<(String, i64), OpsError> {
        match intents::skip(&mut *self.pool.acquire().await?, &self.consumer, id).await? {
            intents::Skip::Released { key, waiting } => {
                tracing::info!(intent_id = %id, ordering_key = %key, waiting, "dead intent skipped: its key goes on");
                Ok((key, waiting))
            }
            intents::Skip::NotHolding => Err(OpsError::Conflict(format!(
                "intent {id} is not a dead intent holding its ordering key (or is not consumer {:?}'s): only those \
                 are skipped",
                self.consumer
            ))),
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

/// Why an uncertain intent of a provider without keys is not replayed.
pub const UNCERTAIN_WITHOUT_KEYS: &str = "its provider keeps no idempotency keys (profile none), so sending it again \
     could apply it twice; ask the provider, then `relay intents resolve ID --succeeded` or `--failed`";

/// Why an uncertain intent whose key the provider has forgotten is not replayed.
pub const UNCERTAIN_KEY_FORGOTTEN: &str = "the provider's key window has closed since the intent was written, so no \
     attempt would be sent (sent again, it would be taken for a new request), with or without --past-key-window; ask \
     the provider, then `relay intents resolve ID --succeeded` or `--failed`";

/// Why a replay left an intent as it was, for the refusals that come
/// from its provider (its key window, or no keys at all).
fn not_replayed_why(r: Requeue) -> String {
    match r {
        Requeue::PastKeyWindow(why) => why,
        Requeue::UncertainWithoutKeys => UNCERTAIN_WITHOUT_KEYS.into(),
        Requeue::UncertainKeyForgotten => UNCERTAIN_KEY_FORGOTTEN.into(),
        // Not a provider's refusal; the callers match those themselves.
        other => format!("{other:?}"),
    }
}

/// Why a dead intent whose `on_dead` effects were recorded is not replayed.
pub fn on_dead_recorded(id: Uuid) -> String {
    format!(
        "intent {id} is dead and its on_dead effects were recorded (its failure events were emitted, its saga moved, \
         unless its last error says they were not recorded: then emit them by hand): a replay that succeeded would \
         tell the opposite story beside them, so it is refused. Handle it as the failure it was announced as (a new \
         event starts a new call), or see docs/CONTRACT.md, \"Replaying intents\""
    )
}

fn not_dead(id: Uuid) -> OpsError {
    OpsError::Conflict(format!(
        "outbox row {id} is not dead (or is not this consumer's): only dead rows are replayed or skipped"
    ))
}
