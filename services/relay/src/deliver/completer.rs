//! Recording attempts' outcomes: batched, fenced by each claim's lease
//! token, with the outcome effects (events, saga moves) in the same
//! transaction.

use std::collections::HashSet;
use std::sync::Arc;

use chrono::Utc;
use relay_core::effects::encode_event;
use relay_core::ids::{KeySpace, outcome_id};
use relay_core::retry::BackoffPolicy;
use relay_core::router::Encoders;
use relay_core::{HistoryKind, IntentState, Outcome, Provenance};
use relay_store::FinishPool;
use relay_store::intents::{self, ClaimedIntent, Finish, NextState};
use relay_store::sagas::{self, Transition};
use relay_store::{ordering, outbox};
use sqlx::PgConnection;
use sqlx::PgPool;
use tokio::sync::{Notify, Semaphore, mpsc};
use tokio::task::JoinSet;
use tracing::{error, warn};

use super::outcome::{Completion, Finished};
use crate::runtime::faults::{Faults, Sabotage, point};

/// How many batches of outcomes are written at once ([`Completer::run`]).
pub(super) const FINALIZERS: usize = 2;

/// An outcome on its way to be recorded, with how many times its events'
/// ordering keys were found held ([`Finished::KeyHeld`]).
struct Held {
    completion: Completion,
    tries: u32,
}

impl Held {
    fn new(completion: Completion) -> Held {
        Held { completion, tries: 0 }
    }
}

/// Records the outcomes the executor hands over, for one worker: its own
/// connections, and a signal to the claim loop when an outcome made other
/// intents due.
pub struct Completer {
    /// The finalizers' connections ([`FinishPool`]: one round trip a batch
    /// of outcomes that records nothing but states).
    finishes: FinishPool,
    worker: String,
    /// How long outcomes may take to be recorded before their leases count
    /// as lost.
    lease: std::time::Duration,
    faults: Faults,
    /// Notified when a recorded outcome made intents claimable that no
    /// NOTIFY announces (a retry scheduled, a key's earlier intent finished).
    progress: Arc<Notify>,
    /// The encoders of the topics outcome events are written to with a
    /// schema (`format`), by topic.
    encoders: Encoders,
    /// The dispatcher's count of the JSON of outcomes held for a key
    /// ([`Completer::held`]).
    held_bytes: Arc<std::sync::atomic::AtomicU64>,
}

impl Completer {
    /// A completer for `worker`'s claims of `lease`, on connections beside
    /// `pool`, encoding outcome events with `encoders` (`Router::encoders`).
    pub fn new(
        pool: &PgPool,
        worker: &str,
        lease: std::time::Duration,
        faults: Faults,
        progress: Arc<Notify>,
        encoders: Encoders,
        held_bytes: Arc<std::sync::atomic::AtomicU64>,
    ) -> Completer {
        let finishes = FinishPool::beside(pool, FINALIZERS as u32);
        Completer { finishes, worker: worker.to_owned(), lease, faults, progress, encoders, held_bytes }
    }

    /// Record completions in batches: whatever has arrived while earlier
    /// batches were written goes into the next one (up to 256), with one
    /// fenced statement for all of them (one round trip when that is all
    /// the batch records: [`FinishPool`]). Two batches are
    /// written at once, so one commit's WAL flush does not hold up the next
    /// batch; more writers would each take what had arrived the moment they
    /// were free, so batches shrink and per-statement costs dominate
    /// (measured: BENCHMARKS.md, "What was done to make it fast").
    ///
    /// An outcome whose events' ordering keys another transaction holds
    /// ([`Finished::KeyHeld`]) comes back here after a pause, its lease
    /// extended meanwhile, and goes into a later batch: a batch never waits
    /// for a key, so one held key delays its own outcomes and no others.
    pub(super) async fn run(self: Arc<Self>, mut rx: mpsc::Receiver<Completion>) {
        let slots = Arc::new(Semaphore::new(FINALIZERS));
        let mut writers = JoinSet::new();
        let (again_tx, mut again) = mpsc::unbounded_channel::<Held>();
        loop {
            let first = tokio::select! {
                c = rx.recv() => match c {
                    Some(c) => Held::new(c),
                    None => break,
                },
                Some(h) = again.recv() => h,
            };
            let slot = slots.clone().acquire_owned().await.expect("semaphore never closed");
            let mut batch = vec![first];
            while batch.len() < 256 {
                match again.try_recv() {
                    Ok(h) => batch.push(h),
                    Err(_) => break,
                }
            }
            while batch.len() < 256 {
                match rx.try_recv() {
                    Ok(c) => batch.push(Held::new(c)),
                    Err(_) => break,
                }
            }
            let (me, again_tx) = (self.clone(), again_tx.clone());
            writers.spawn(async move {
                let tries: Vec<u32> = batch.iter().map(|h| h.tries).collect();
                let mut batch: Vec<Completion> = batch.into_iter().map(|h| h.completion).collect();
                let results = me.finalize(&mut batch).await;
                drop(slot);
                let unblocks = |(c, r): (&Completion, &Finished)| {
                    *r == Finished::Retrying
                        || (!matches!(r, Finished::LeaseLost | Finished::KeyHeld)
                            && c.intent.intent.ordering_key.is_some())
                };
                // An outcome recorded gives its bytes back to the claims' room.
                let freed = batch.iter().zip(&results).any(|(c, r)| c.counted.is_some() && *r != Finished::KeyHeld);
                if freed || batch.iter().zip(&results).any(unblocks) {
                    me.progress.notify_one();
                }
                let mut held = Vec::new();
                for ((c, r), tries) in batch.into_iter().zip(results).zip(tries) {
                    match r {
                        Finished::KeyHeld => held.push(me.held(c, tries)),
                        r => c.log(&me.worker, r),
                    }
                }
                me.hold(held, &again_tx).await;
            });
            while writers.try_join_next().is_some() {}
        }
        // Closed: what is still held is left to its lease (rescued, and sent
        // again with the same idempotency key).
        drop(again_tx);
        while writers.join_next().await.is_some() {}
        while let Ok(h) = again.try_recv() {
            warn!(intent_id = %h.completion.intent.id,
                  "stopping with this outcome's ordering key held elsewhere; rescued when its lease expires");
        }
    }

    /// `c`, found with a key of its events held once more (`tries` times
    /// before). Its JSON moves from the claims' room to the held outcomes'
    /// until it is recorded: claims of applications' calls stop while those
    /// fill it (the dispatcher's `held_outcomes`), or they would pile up in
    /// memory for as long as an application holds the key; the request's
    /// body and headers, sent already, are not kept.
    fn held(&self, mut c: Completion, tries: u32) -> Held {
        if tries == 0 {
            c.intent.intent.body = None;
            c.intent.intent.headers = serde_json::Value::Null;
            // The smaller count is taken before the first is given back, so
            // the room never looks empty in between.
            let smaller = super::counted::Counted::add(&self.held_bytes, c.intent.intent.json_bytes() as u64);
            c.counted = Some(smaller);
        }
        Held { completion: c, tries: tries + 1 }
    }

    /// Keep the claims of outcomes whose events' keys are held, then hand
    /// them back to [`Completer::run`] after a pause that doubles with each
    /// try (10 ms up to a second, and never a quarter of the lease). One
    /// whose lease was lost meanwhile ends there.
    async fn hold(&self, held: Vec<Held>, again: &mpsc::UnboundedSender<Held>) {
        if held.is_empty() {
            return;
        }
        let claims: Vec<_> = held.iter().map(|h| (h.completion.intent.id, h.completion.intent.lease_token)).collect();
        let kept: HashSet<(uuid::Uuid, uuid::Uuid)> = match self.finishes.acquire().await {
            Ok(mut conn) => match intents::extend_leases(&mut conn, &claims, self.lease).await {
                Ok(kept) => kept.into_iter().collect(),
                Err(e) => {
                    warn!(intents = held.len(), error = %e, "could not extend the leases of outcomes waiting for a key");
                    claims.iter().copied().collect()
                }
            },
            Err(e) => {
                warn!(intents = held.len(), error = %e, "could not extend the leases of outcomes waiting for a key");
                claims.iter().copied().collect()
            }
        };
        let tries = held.iter().map(|h| h.tries).max().unwrap_or(1);
        let pause = std::time::Duration::from_millis(10u64 << tries.min(7))
            .min(std::time::Duration::from_secs(1))
            .min(self.lease / 4);
        tokio::time::sleep(pause).await;
        for h in held {
            let c = &h.completion;
            if !kept.contains(&(c.intent.id, c.intent.lease_token)) {
                c.log(&self.worker, Finished::LeaseLost);
            } else {
                if h.tries % 50 == 0 {
                    warn!(intent_id = %c.intent.id, tries = h.tries,
                          "an ordering key of this outcome's events is still held by another transaction \
                           (an application's open transaction that publishes with the key?); recorded once it is free");
                }
                if let Err(mpsc::error::SendError(h)) = again.send(h) {
                    h.completion.log(&self.worker, Finished::LeaseLost);
                }
            }
        }
    }

    /// Record a batch, retrying database errors until the leases would
    /// expire. An outcome the database rejects (a permanent error) must not
    /// cost the others theirs: the batch is then recorded one by one. One
    /// whose outcome effects the database rejects is recorded without them,
    /// its state and attempt as they are, and the rejection logged: left to
    /// the rescuer instead, the call would be made again up to the budget and
    /// end uncertain although the provider answered. (What the finalizers
    /// run; public for tests that hand it a batch.) An outcome whose events
    /// do not fit their topics' schemas is recorded without its effects,
    /// saying why in the completion ([`Completion::effects_dropped`]).
    pub async fn finalize(&self, batch: &mut [Completion]) -> Vec<Finished> {
        if self.faults.hit(point::DISPATCHER_BEFORE_FINISH).await.is_err() {
            return vec![Finished::LeaseLost; batch.len()];
        }
        let effects: Vec<_> = batch.iter_mut().map(|c| self.effects_of(c)).collect();
        let batch = &*batch;
        let deadline = std::time::Instant::now() + self.lease;
        match self.finalize_until(batch, &effects, deadline).await {
            Ok(f) => f,
            Err(_) => {
                let mut out = Vec::with_capacity(batch.len());
                for (c, e) in batch.iter().zip(&effects) {
                    let one = std::slice::from_ref(c);
                    match self.finalize_until(one, std::slice::from_ref(e), deadline).await {
                        Ok(f) => out.extend(f),
                        Err(e) => {
                            error!(intent_id = %c.intent.id, error = %e, rejection = %relay_store::rejection(&e),
                                   "the database rejected this outcome's effects; the intent is recorded without them \
                                    (its events are not emitted, its sagas not moved): fix the route's effects, then \
                                    move the saga or emit the event by hand");
                            match self.finalize_until(one, &[None], deadline).await {
                                Ok(f) => {
                                    crate::runtime::metrics::effects_dropped(&c.intent.intent.endpoint);
                                    out.extend(f)
                                }
                                Err(e) => {
                                    error!(intent_id = %c.intent.id, error = %e,
                                           "the database rejected this outcome; the intent is rescued when its lease expires");
                                    out.push(Finished::LeaseLost);
                                }
                            }
                        }
                    }
                }
                out
            }
        }
    }

    /// What the outcome of `c` records besides the intent's state: its
    /// stored effects with their events encoded, and the outcome's label.
    /// None when it records nothing, or when an event does not fit its
    /// topic's schema: then nothing of it is recorded (an outcome's effects
    /// are all or none), and `c` says why; data that does not read the
    /// provider's answer was checked at ingest, so this is an answer (or a
    /// schema changed since) that does not fit.
    fn effects_of(&self, c: &mut Completion) -> Option<(Outcome, &'static str)> {
        let (stored, label, which) = match c.next {
            NextState::Succeeded => (&c.intent.intent.on_success, IntentState::Succeeded.as_str(), "on_success"),
            NextState::Dead => (&c.intent.intent.on_dead, IntentState::Dead.as_str(), "on_dead"),
            // Nothing is known, so nothing is told: no on_dead, no on_success.
            NextState::Retry(_) | NextState::Uncertain => return None,
        };
        let mut outcome = outcome_effects(&c.intent, stored)?;
        for e in &mut outcome.emit {
            match relay_core::router::encode_with(&self.encoders, e) {
                Ok(encoded) => e.encoded = encoded,
                Err(why) => {
                    c.drop_effects(which, &why);
                    return None;
                }
            }
        }
        Some((outcome, label))
    }

    /// [`Completer::finalize_once`], retrying transient errors until
    /// `deadline` (then every intent counts as lost); `Err` for a permanent one.
    pub(super) async fn finalize_until(
        &self,
        batch: &[Completion],
        outcomes: &[Option<(Outcome, &'static str)>],
        deadline: std::time::Instant,
    ) -> Result<Vec<Finished>, sqlx::Error> {
        let mut attempt = 0u32;
        loop {
            match self.finalize_once(batch, outcomes).await {
                Ok(f) => return Ok(f),
                Err(e) if relay_store::classify_error(&e) == relay_store::DbErrorKind::Permanent => return Err(e),
                Err(e) => {
                    attempt += 1;
                    let delay = BackoffPolicy::DATABASE.delay(attempt, &mut rand::rng());
                    if std::time::Instant::now() + delay >= deadline {
                        error!(intents = batch.len(), error = %e,
                               "could not record outcomes before the leases expire; the intents will be rescued and re-sent with the same keys");
                        return Ok(vec![Finished::LeaseLost; batch.len()]);
                    }
                    warn!(intents = batch.len(), error = %e, "recording outcomes failed; retrying");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    /// Record `batch` with what each outcome records besides the intent's
    /// state (`outcomes`: [`Completer::effects_of`] of each, or none when
    /// the database rejected them), if its lease still holds, in one
    /// transaction.
    pub(super) async fn finalize_once(
        &self,
        batch: &[Completion],
        outcomes: &[Option<(Outcome, &'static str)>],
    ) -> Result<Vec<Finished>, sqlx::Error> {
        let items: Vec<Finish> = batch
            .iter()
            .map(|c| Finish {
                id: c.intent.id,
                token: c.intent.lease_token,
                next: c.next,
                attempt: c.attempt.clone(),
                attempt_no: c.intent.attempts,
                worker: self.worker.clone(),
                attempted: c.attempted,
            })
            .collect();
        // An outcome counts only under the claim it was made under: fenced by
        // (intent id, lease token), so a stale completion beside a fresh one
        // of the same intent matches nothing.
        type Ours = HashSet<(uuid::Uuid, uuid::Uuid)>;
        let by_id = self.faults.sabotage().has(Sabotage::FencedById); // Deliberately wrong when set.
        let mine = |c: &Completion, ours: &Ours| {
            ours.contains(&(c.intent.id, c.intent.lease_token)) || (by_id && ours.iter().any(|o| o.0 == c.intent.id))
        };
        let finished =
            |c: &Completion, ours: &Ours| if mine(c, ours) { Finished::from(c.next) } else { Finished::LeaseLost };
        let mut conn = self.finishes.acquire().await?;
        if outcomes.iter().all(Option::is_none) && batch.iter().all(|c| c.answer.is_none()) {
            // Only states and audit rows: one statement, its own transaction (FinishPool).
            let ours = intents::finish_many(&mut conn, &items).await?.into_iter().collect();
            return Ok(batch.iter().map(|c| finished(c, &ours)).collect());
        }
        // Each outcome's events, and the slots of their ordering keys.
        let now = Utc::now();
        let events: Vec<Vec<(String, relay_core::OutboxRecord)>> = batch
            .iter()
            .zip(outcomes)
            .map(|(c, o)| o.as_ref().map_or_else(Vec::new, |o| events_of(c, o, now)))
            .collect();
        let key_slots = key_slots_of(batch, &events);
        // Keys another transaction holds are skipped, never waited for: an
        // outcome with such a key waits for a later batch (KeyHeld), and the
        // others are recorded now.
        let all: Vec<ordering::Slot<'_>> = key_slots.iter().flatten().copied().collect();
        ordering::write_slots(&mut conn, &all).await?;
        let mut tx = sqlx::Connection::begin_with(&mut *conn, relay_store::BEGIN_BOUNDED).await?;
        let got = ordering::try_lock_slots(&mut tx, &all).await?;
        let held: Vec<bool> =
            key_slots.iter().map(|s| !s.iter().all(|&(c, s)| got.contains(&(c.to_owned(), s)))).collect();
        let items: Vec<Finish> = items.into_iter().zip(&held).filter(|(_, h)| !**h).map(|(f, _)| f).collect();
        let ours: Ours = intents::finish_many(&mut tx, &items).await?.into_iter().collect();
        let recorded = |i: usize| !held[i] && mine(&batch[i], &ours);
        // Kept also when the effects could not be rendered from it: the
        // operator who emits them by hand reads it in `relay intents show`.
        let answers: Vec<_> = (0..batch.len())
            .filter(|&i| recorded(i))
            .filter_map(|i| Some((batch[i].intent.id, batch[i].answer.as_ref()?)))
            .collect();
        intents::keep_answers(&mut tx, &answers).await?;
        let mut records = Vec::new();
        for (i, c) in batch.iter().enumerate() {
            let Some((outcome, label)) = outcomes[i].as_ref().filter(|_| recorded(i)) else { continue };
            let source_id = format!("{}:{label}", c.intent.id);
            records.extend(events[i].iter().map(|(source_id, r)| (c.intent.intent.consumer.as_str(), source_id, r)));
            for m in &outcome.saga {
                self.move_saga(&mut tx, &c.intent, m, &source_id, label).await?;
            }
        }
        insert_per_consumer(&mut tx, &records).await?;
        tx.commit().await?;
        Ok(batch
            .iter()
            .enumerate()
            .map(|(i, c)| if held[i] { Finished::KeyHeld } else { finished(c, &ours) })
            .collect())
    }

    pub(super) async fn move_saga(
        &self,
        tx: &mut PgConnection,
        intent: &ClaimedIntent,
        m: &relay_core::SagaMove,
        source_id: &str,
        label: &str,
    ) -> Result<(), sqlx::Error> {
        let detail = serde_json::json!({"from": m.from, "to": m.to, "intent": intent.id, "outcome": label});
        let t = sagas::apply(tx, &intent.intent.consumer, m, source_id, HistoryKind::Outcome, &detail).await?;
        if t != Transition::Applied {
            let saga = format!("{}/{}", m.saga_type, m.saga_id);
            warn!(intent_id = %intent.id, %saga, action = %m.action, result = ?t, "outcome saga move was a no-op");
        }
        Ok(())
    }
}

/// The outbox rows of `outcome`'s events, with their source ids.
fn events_of(
    c: &Completion,
    (outcome, label): &(Outcome, &'static str),
    now: chrono::DateTime<Utc>,
) -> Vec<(String, relay_core::OutboxRecord)> {
    let source_id = format!("{}:{label}", c.intent.id);
    let call = &c.intent.intent;
    let prov = Provenance {
        source: call.emit_source.clone(),
        correlation_id: call.correlation_id.clone(),
        causation_id: call.causation_id.clone(),
        traceparent: call.traceparent.clone(),
        aggregate_id: call.aggregate_id.clone(),
    };
    // An application's call's events are ordered with its own, never a route's.
    let space = KeySpace::of_action(&call.action);
    outcome
        .emit
        .iter()
        .map(|emit| {
            (source_id.clone(), encode_event(outcome_id(c.intent.id, label, &emit.action), emit, &prov, space, now))
        })
        .collect()
}

/// The stored outcome effects of an intent, if any.
pub(super) fn outcome_effects(intent: &ClaimedIntent, effects: &serde_json::Value) -> Option<Outcome> {
    match serde_json::from_value::<Outcome>(effects.clone()) {
        Ok(o) if !o.is_empty() => Some(o),
        Ok(_) => None,
        Err(e) => {
            error!(intent_id = %intent.id, error = %e, "stored outcome effects are unreadable; none recorded");
            None
        }
    }
}

/// The ordering-key slots each completion's outcome events take.
fn key_slots_of<'a>(
    batch: &'a [Completion],
    events: &'a [Vec<(String, relay_core::OutboxRecord)>],
) -> Vec<Vec<ordering::Slot<'a>>> {
    batch
        .iter()
        .zip(events)
        .map(|(c, rows)| {
            let consumer = c.intent.intent.consumer.as_str();
            relay_store::ordering::outbox_keys(rows.iter().map(|r| &r.1))
                .map(|k| (consumer, k.slot(consumer)))
                .collect()
        })
        .collect()
}

/// Outcome events (consumer, source id, record), one statement per consumer
/// in the batch.
async fn insert_per_consumer(
    tx: &mut sqlx::PgConnection,
    records: &[(&str, &String, &relay_core::OutboxRecord)],
) -> Result<(), sqlx::Error> {
    let mut consumers: Vec<&str> = records.iter().map(|r| r.0).collect();
    consumers.sort_unstable();
    consumers.dedup();
    for consumer in consumers {
        let rows: Vec<(&str, &relay_core::OutboxRecord)> =
            records.iter().filter(|r| r.0 == consumer).map(|r| (r.1.as_str(), r.2)).collect();
        outbox::insert_locked(tx, consumer, &rows).await?;
    }
    Ok(())
}
