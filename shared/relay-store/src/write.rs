//! Where input events become rows: one path for a batch of records and for a
//! single one alike (R2–R7, R14, R20).
//!
//! [`write()`] takes planned records ([`Planned`]: the inbox row, the guards
//! the route asks for, the [`Effects`] the core derived) and, inside the
//! caller's transaction:
//!
//! 1. inserts the inbox rows (`ON CONFLICT DO NOTHING`): an id already there,
//!    or met earlier in the batch, is a duplicate and writes nothing else;
//! 2. claims the business idempotency keys: one taken (by an earlier event,
//!    or earlier in the batch) makes its record a `duplicate_key` no-op;
//! 3. runs each remaining record's checks in order — version guard,
//!    sequence guard, saga moves ([`sagas::apply`]);
//! 4. writes the effects of the records still standing — intents, outbox
//!    rows, counters — in one statement ([`effects::insert`]).
//!
//! A no-op found in step 3, or a record that is not processable yet, has
//! already written its inbox row and key and maybe some of its checks:
//! [`Disposition::undo`] says so, and the caller rolls the record back (a
//! savepoint around it) and records its inbox row with the no-op's class
//! ([`crate::inbox::insert`]). A record with checks is therefore written in a
//! batch of its own; records without them share one batch, four round trips
//! whatever their number. A code handler runs between step 3 and step 4:
//! [`admit`] is steps 1–3, [`finish`] step 4.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use relay_core::{Disposition, Effects, HistoryKind, NewIntent, PoisonClass};
use serde_json::json;
use sqlx::PgConnection;

use crate::inbox::{self, InboxOutcome, NewInboxRow, SequenceCheck, VersionCheck};
use crate::intents::{ClaimedIntent, Hold};
use crate::sagas::{self, Transition};
use crate::{effects, sabotage};

/// One input event to write.
#[derive(Debug, Clone)]
pub struct Planned<'a> {
    /// Its inbox row: identity, position, key, aggregate; the outcome is
    /// `applied` for a routed event, `unrouted` for one without a route.
    pub inbox: NewInboxRow<'a>,
    /// The version guard's version (guard on), for `inbox.aggregate_id`.
    pub version: Option<i64>,
    /// The sequence guard's sequence number (guard on), for `inbox.aggregate_id`.
    pub sequence: Option<i64>,
    /// What it writes; `None` for an unrouted event.
    pub effects: Option<&'a Effects>,
}

impl Planned<'_> {
    /// Whether [`write()`] runs checks for it (then it must be alone in its batch).
    pub fn has_checks(&self) -> bool {
        self.version.is_some() || self.sequence.is_some() || self.effects.is_some_and(|e| !e.sagas.is_empty())
    }
}

/// Intents to write already claimed for a dispatcher of this process (its
/// hand-over): up to `room` of the batch's intents without an ordering key,
/// and of each endpoint at most as many as `endpoint_room` says it has room
/// for (a throttled endpoint's intents are written pending rather than
/// held to wait at its limits while other endpoints' wait for room).
#[derive(Clone, Copy)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct HoldRoom<'a> {
    /// The dispatcher's worker id.
    pub worker: &'a str,
    pub lease: Duration,
    /// How many intents it has room for.
    pub room: usize,
    /// How many more intents of an endpoint it has room for.
    pub endpoint_room: &'a (dyn Fn(&str) -> usize + Send + Sync),
}

impl std::fmt::Debug for HoldRoom<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HoldRoom")
            .field("worker", &self.worker)
            .field("lease", &self.lease)
            .field("room", &self.room)
            .finish()
    }
}

/// What [`write()`] did: one [`Disposition`] per record, and the intents written
/// already claimed ([`HoldRoom`]), to hand over once the transaction commits.
#[derive(Debug, Default)]
pub struct Batch {
    /// Per record, in order.
    pub written: Vec<Disposition>,
    /// New intents written claimed.
    pub held: Vec<ClaimedIntent>,
}

/// Write `batch` (see the module doc). `Err` is a database error; a
/// permanent one (the data) leaves the caller's savepoint to roll back.
pub async fn write(
    conn: &mut PgConnection,
    consumer: &str,
    batch: &[Planned<'_>],
    hold: Option<HoldRoom<'_>>,
) -> Result<Batch, sqlx::Error> {
    let admitted = admit(conn, consumer, batch).await?;
    finish(conn, consumer, batch, admitted, hold).await
}

/// Steps 1–3 of [`write()`]: `None` for each record admitted (its effects
/// are to be written), else what became of it.
pub async fn admit(
    conn: &mut PgConnection,
    consumer: &str,
    batch: &[Planned<'_>],
) -> Result<Vec<Option<Disposition>>, sqlx::Error> {
    let dedup = !sabotage::is(consumer, relay_core::sabotage::Sabotage::NoInboxDedup);
    let mut out: Vec<Option<Disposition>> = vec![None; batch.len()];
    // 1. Inbox rows; a second occurrence of an id in the batch is a duplicate.
    let mut first = HashSet::new();
    let mut rows = Vec::with_capacity(batch.len());
    for (k, p) in batch.iter().enumerate() {
        if first.insert(p.inbox.event_id) {
            rows.push(p.inbox.clone());
        } else if dedup {
            out[k] = Some(Disposition::Duplicate);
        }
    }
    let inserted: HashSet<String> = inbox::insert_many(conn, &rows).await?.into_iter().collect();
    // 2. Business idempotency keys (R4); the first in the batch claims.
    let mut claimed_here = HashSet::new();
    let mut keyed = Vec::new();
    for (k, p) in batch.iter().enumerate() {
        if out[k].is_some() {
            continue;
        }
        if !inserted.contains(p.inbox.event_id) && dedup {
            out[k] = Some(Disposition::Duplicate);
        } else if p.effects.is_none() {
            out[k] =
                Some(Disposition::NoOp { outcome: InboxOutcome::Unrouted, detail: "no route for this type".into() });
        } else if let Some(key) = p.inbox.idempotency_key {
            if claimed_here.insert(key) {
                keyed.push((key, p.inbox.event_id));
            } else {
                out[k] = Some(Disposition::NoOp {
                    outcome: InboxOutcome::DuplicateKey,
                    detail: format!("idempotency key {key:?} was taken by an earlier event of this batch"),
                });
            }
        }
    }
    let won: HashSet<String> = inbox::claim_idempotency_keys(conn, consumer, &keyed).await?.into_iter().collect();
    for (k, p) in batch.iter().enumerate() {
        if out[k].is_none()
            && let Some(key) = p.inbox.idempotency_key
            && !won.contains(key)
        {
            out[k] = Some(Disposition::NoOp {
                outcome: InboxOutcome::DuplicateKey,
                detail: format!("idempotency key {key:?} was taken by an earlier event"),
            });
        }
    }
    let lost_keys: Vec<&str> = batch
        .iter()
        .zip(&out)
        .filter(|(p, w)| {
            matches!(w, Some(Disposition::NoOp { outcome: InboxOutcome::DuplicateKey, .. }))
                && inserted.contains(p.inbox.event_id)
        })
        .map(|(p, _)| p.inbox.event_id)
        .collect();
    inbox::set_outcome_many(conn, consumer, &lost_keys, InboxOutcome::DuplicateKey).await?;
    // 3. Checks, in order.
    for (k, p) in batch.iter().enumerate() {
        if out[k].is_none() && p.has_checks() {
            out[k] = check(conn, consumer, p).await?;
        }
    }
    Ok(out)
}

/// The version guard, the sequence guard and the saga moves of `p`, in that
/// order; the first that says no decides.
async fn check(conn: &mut PgConnection, consumer: &str, p: &Planned<'_>) -> Result<Option<Disposition>, sqlx::Error> {
    // The router guarantees an aggregate id when a guard is on.
    let aggregate = p.inbox.aggregate_id.unwrap_or_default();
    let no_op = |outcome, detail| Ok(Some(Disposition::NoOp { outcome, detail }));
    if let Some(version) = p.version {
        match inbox::check_version(conn, consumer, aggregate, version).await? {
            VersionCheck::Applied => {}
            VersionCheck::Duplicate => {
                return no_op(
                    InboxOutcome::DuplicateVersion,
                    format!("version {version} of {aggregate} was applied already"),
                );
            }
            VersionCheck::Stale { current } => {
                return no_op(
                    InboxOutcome::Stale,
                    format!("version {version} of {aggregate} is older than applied version {current}"),
                );
            }
        }
    }
    if let Some(seq) = p.sequence {
        match inbox::check_sequence(conn, consumer, aggregate, seq).await? {
            SequenceCheck::Applied => {}
            SequenceCheck::Duplicate { last } => {
                return no_op(
                    InboxOutcome::DuplicateSequence,
                    format!("sequence {seq} of {aggregate} is at or below the last applied {last}"),
                );
            }
            SequenceCheck::Gap { last } => {
                return Ok(Some(Disposition::not_yet(
                    PoisonClass::SequenceGap,
                    format!(
                        "sequence {seq} of {aggregate} arrived while the last applied is {last}; waiting for {}",
                        last + 1
                    ),
                )));
            }
        }
    }
    for m in p.effects.map(|e| e.sagas.as_slice()).unwrap_or_default() {
        let detail = json!({"from": m.from, "to": m.to, "start": m.start});
        let subject = format!("{}/{}", m.saga_type, m.saga_id);
        match sagas::apply(conn, consumer, m, p.inbox.event_id, HistoryKind::Saga, &detail).await? {
            Transition::Applied => {}
            Transition::AlreadyThere => {
                return no_op(InboxOutcome::DuplicateTransition, format!("saga {subject} is already {:?}", m.to));
            }
            Transition::Invalid { current } => {
                return no_op(
                    InboxOutcome::InvalidTransition,
                    format!("saga {subject} is {current:?}; {} may only move it from {:?}", m.action, m.from),
                );
            }
            Transition::Missing => {
                let detail = format!("saga {subject} does not exist (yet)");
                return Ok(Some(Disposition::not_yet(PoisonClass::MissingReference, detail)));
            }
        }
    }
    Ok(None)
}

/// Step 4 of [`write()`]: the effects of the records [`admit`] admitted, in
/// one statement, and the final [`Batch`]. `batch` is the one admitted, its
/// effects grown by what a code handler added since, if any.
pub async fn finish(
    conn: &mut PgConnection,
    consumer: &str,
    batch: &[Planned<'_>],
    admitted: Vec<Option<Disposition>>,
    hold: Option<HoldRoom<'_>>,
) -> Result<Batch, sqlx::Error> {
    let standing: Vec<(usize, &Effects)> = batch
        .iter()
        .zip(&admitted)
        .enumerate()
        .filter(|(_, (_, w))| w.is_none())
        .filter_map(|(k, (p, _))| p.effects.map(|e| (k, e)))
        .collect();
    let intents: Vec<&NewIntent> = standing.iter().flat_map(|(_, e)| &e.intents).collect();
    let outbox: Vec<(&str, &relay_core::OutboxRecord)> =
        standing.iter().flat_map(|(k, e)| e.events.iter().map(|r| (batch[*k].inbox.event_id, r))).collect();
    let mut counters: BTreeMap<(&str, i32), i64> = BTreeMap::new();
    for (k, e) in &standing {
        if let Some(c) = &e.counter {
            *counters.entry((c.as_str(), batch[*k].inbox.partition)).or_default() += 1;
        }
    }
    let adds: Vec<(&str, i32, i64)> = counters.into_iter().map(|((name, shard), n)| (name, shard, n)).collect();
    // Claim at ingest: the first `room` intents without an ordering key,
    // each endpoint's up to its own room.
    let take: Vec<bool> = match hold {
        Some(h) => {
            let mut left = h.room;
            let mut per_endpoint: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
            intents
                .iter()
                .map(|i| {
                    let endpoint_left = per_endpoint
                        .entry(i.intent.endpoint.as_str())
                        .or_insert_with(|| (h.endpoint_room)(&i.intent.endpoint));
                    let take = i.intent.ordering_key.is_none() && left > 0 && *endpoint_left > 0;
                    left -= usize::from(take);
                    *endpoint_left -= usize::from(take);
                    take
                })
                .collect()
        }
        None => Vec::new(),
    };
    let hold = hold.map(|h| Hold { worker: h.worker, lease: h.lease, take: &take });
    let mut new = effects::insert(conn, consumer, &intents, hold, &outbox, &adds).await?;
    let mut written: Vec<Disposition> =
        admitted.into_iter().map(|w| w.unwrap_or(Disposition::Applied { intents: 0, events: 0 })).collect();
    for (k, e) in &standing {
        written[*k] = Disposition::Applied {
            intents: e.intents.iter().filter(|i| new.intents.contains(&i.id)).count(),
            events: e.events.iter().filter(|r| new.outbox.contains(&r.id)).count(),
        };
    }
    // `remove`: one claim per row, whatever the list repeats. Only these
    // intents are copied: the insert above reads them where they are.
    let held = intents
        .into_iter()
        .filter_map(|i| new.held.remove(&i.id).map(|h| ClaimedIntent::held_at_insert(i.clone(), h)))
        .collect();
    Ok(Batch { written, held })
}
