//! Dead letters: listed, shown, replayed through the same guards with the
//! original event id, skipped (releasing the keys they hold), purged.

use relay_core::Disposition;
use relay_core::{InboxOutcome, ReplayState};
use relay_store::dead_letters::{self, DeadLetter, DeadLetterRecord, Filter};
use relay_store::{holds, inbox, ops};

use super::{Operator, OpsError, PAGE};
use crate::ingest::processor::Processor;

/// What a replay did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayOutcome {
    /// Processed now: the effects were written.
    Applied,
    /// Already processed before (the inbox has it, or a replay resolved
    /// this dead letter before): nothing written.
    Duplicate,
    /// Processed as a classified no-op (stale, invalid transition, …).
    NoOp(InboxOutcome),
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
        self.state() != ReplayState::Open
    }

    /// A label for the outcome (`applied`, `duplicate`, `no_op`,
    /// `still_failing`, `held`, `skipped`, `not_found`) and its detail, if any.
    pub fn label(&self) -> (&'static str, &str) {
        match self {
            ReplayOutcome::Applied => ("applied", ""),
            ReplayOutcome::Duplicate => ("duplicate", ""),
            ReplayOutcome::NoOp(c) => ("no_op", c.as_str()),
            ReplayOutcome::StillFailing(why) => ("still_failing", why),
            ReplayOutcome::Held(why) => ("held", why),
            ReplayOutcome::Skipped => (
                "skipped",
                "skipped before: never applied, its key's later records went ahead of it; it is not replayed",
            ),
            ReplayOutcome::NotFound => ("not_found", ""),
        }
    }

    /// Where the dead letter stands after this outcome.
    pub fn state(&self) -> ReplayState {
        match self {
            ReplayOutcome::Applied | ReplayOutcome::Duplicate | ReplayOutcome::NoOp(_) => ReplayState::Resolved,
            ReplayOutcome::Skipped => ReplayState::Skipped,
            ReplayOutcome::StillFailing(_) | ReplayOutcome::Held(_) | ReplayOutcome::NotFound => ReplayState::Open,
        }
    }

    /// The outcome in words, as the dead letter keeps it.
    fn detail(&self) -> String {
        match self {
            ReplayOutcome::NoOp(o) => o.as_str().to_owned(),
            ReplayOutcome::StillFailing(why) | ReplayOutcome::Held(why) => format!("failed: {why}"),
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
        Disposition::NoOp { outcome, .. } => ReplayOutcome::NoOp(outcome),
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

impl Operator {
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
            ReplayState::Skipped => Some(ReplayOutcome::Skipped),
            ReplayState::Resolved => Some(ReplayOutcome::Duplicate),
            ReplayState::Open => None,
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
                dead_letters::mark_replayed(&mut tx, &self.consumer, id, outcome.state(), &outcome.detail()).await?;
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
    ) -> Result<Option<(sqlx::Transaction<'static, sqlx::Postgres>, ReplayState, Option<holds::Hold>)>, OpsError> {
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
            None if state != ReplayState::Open => {
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
            ReplayState::Resolved | ReplayState::Skipped => {
                tracing::info!(dead_letter = id, "dead letter resolved already; taking up the release of its key");
            }
            ReplayState::Open => {
                let dl = dead_letters::get(&mut tx, &self.consumer, id).await?.ok_or_else(not_found)?;
                let skipped = ReplayOutcome::Skipped;
                dead_letters::mark_replayed(&mut tx, &self.consumer, id, skipped.state(), dead_letters::SKIPPED)
                    .await?;
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
        if state == ReplayState::Open {
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
                let failed = still_failing(&mut tx, processor, &dl.record, &processed.disposition).await?;
                let outcome = replay_outcome(processed.disposition);
                dead_letters::mark_replayed(&mut tx, &self.consumer, id, outcome.state(), &outcome.detail()).await?;
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
}

/// What a released record's `disposition` leaves: its poison, and whether
/// it is a dead letter again (then its copy goes to the dead-letter topic
/// now), if it stops the release.
async fn still_failing(
    tx: &mut sqlx::PgConnection,
    processor: &Processor,
    record: &relay_core::RawRecord,
    disposition: &Disposition,
) -> Result<Option<(relay_core::Poison, bool)>, OpsError> {
    Ok(match disposition {
        // Poison now, as if it had failed when it came: its copy
        // goes to the dead-letter topic and it is counted (once
        // committed). Not processable yet (a missing reference)
        // counts too: a release has no retry budget, the
        // operator's next replay of it is the retry.
        Disposition::DeadLetter(p) | Disposition::RetryLater(p) | Disposition::Held(p) => {
            crate::ingest::park::copy_to_dead_letter_topic(tx, processor.router(), record, p, 1).await?;
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
    })
}
