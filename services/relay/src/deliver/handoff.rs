//! Claim at ingest: when the consumer and the dispatcher run in one process
//! (`relay run`), the consumer writes the intents of routine records already
//! claimed by that dispatcher and hands them over in memory after its commit.
//!
//! ```text
//! consumer: reserve room → INSERT intents as running (lease, attempt 1) → COMMIT → hand over
//! dispatcher:                                                              call → finalize (fenced)
//! ```
//!
//! Without it every intent waits, after the consumer's commit, for a NOTIFY
//! to wake the claim loop and for a claim statement to move it from pending
//! to running: a round trip and a row write on the path from the event to
//! the call. The row the consumer writes is the one the claim would have
//! left (`running`, a fresh lease token, `locked_by` this dispatcher, a
//! lease from the statement on, attempt 1 counted), so everything after
//! the claim is unchanged: a crash between the commit and the call leaves a
//! lease that expires and is rescued (C9), a late finish after a rescue is
//! fenced off by the token (C17).
//!
//! Not held: intents with an ordering key (they wait for their key's earlier
//! intents, which only the claim checks), intents of a paused endpoint (the
//! insert checks `relay.pauses` as the claim does), and anything beyond the
//! room the dispatcher has ([`room`]: a claim batch and a consumer batch of
//! handed-over intents between the consumer's commit and their outcomes).
//! Those are written pending and claimed as usual.

use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_store::intents::{self, ClaimedIntent};
use sqlx::PgPool;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tracing::{debug, warn};

/// How many more intents of an endpoint the dispatcher has room for.
pub type EndpointRoom = Arc<dyn Fn(&str) -> usize + Send + Sync>;

/// The consumer's side: reserves room and hands claimed intents over.
#[derive(Clone)]
pub struct Handoff {
    room: Arc<Semaphore>,
    tx: mpsc::UnboundedSender<Vec<Handed>>,
    worker: Arc<str>,
    lease: Duration,
    endpoint_room: EndpointRoom,
}

impl std::fmt::Debug for Handoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handoff").field("worker", &self.worker).field("lease", &self.lease).finish()
    }
}

/// The dispatcher's side: receives what the consumer handed over.
#[derive(Debug)]
pub struct Desk {
    rx: mpsc::UnboundedReceiver<Vec<Handed>>,
}

/// An intent claimed at ingest, on its way to the dispatcher. It holds one
/// unit of the dispatcher's room until it is dropped (its call done).
#[derive(Debug)]
pub struct Handed {
    /// The intent as a claim would have returned it.
    pub intent: ClaimedIntent,
    /// Taken before the statement that wrote the lease, so the lease is known
    /// to last at least `lease` from here.
    pub since: Instant,
    /// One unit of room, given back when its outcome is handed to a
    /// finalizer (see [`room`]).
    pub room: OwnedSemaphorePermit,
}

/// Room reserved for one statement's intents (see [`Handoff::reserve`]).
#[derive(Debug)]
pub struct Reserved {
    permits: OwnedSemaphorePermit,
    /// Taken before the statement that writes the leases.
    since: Instant,
}

impl Reserved {
    /// How many intents it has room for.
    pub fn len(&self) -> usize {
        self.permits.num_permits()
    }

    /// Whether it has room for none (never true for a reservation made).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Attach `intent` to one unit of this room.
    pub fn hand(&mut self, intent: ClaimedIntent) -> Option<Handed> {
        let room = self.permits.split(1)?;
        Some(Handed { intent, since: self.since, room })
    }
}

/// How many handed-over intents may be on their way at a time (reserved,
/// waiting for a call slot, in a call, or waiting for a finalizer to take
/// their outcome): a claim batch, as the claim loop claims ahead, plus a
/// whole consumer batch of one call per record.
///
/// With the claim batch alone, a consumer batch of more intents than that
/// wrote the rest pending, to wait for a NOTIFY and a claim — and consumer
/// batches are full exactly when load is high: at 90 % of the peak in the
/// bench (batches of 500, claims of 256) 2–10 % of the intents went that
/// slower way; with this room 0–1.3 % (BENCHMARKS.md). The bound stays: a
/// dispatcher that falls behind (a slow provider) leaves what does not fit
/// pending in the database, not in memory.
pub fn room(claim_batch: usize, consumer_batch: usize) -> usize {
    claim_batch + consumer_batch
}

/// A connected pair: `room` intents at most on their way at a time, and of
/// each endpoint at most `endpoint_room` says.
pub fn channel(worker: &str, lease: Duration, room: usize, endpoint_room: EndpointRoom) -> (Handoff, Desk) {
    let (tx, rx) = mpsc::unbounded_channel();
    let room = Arc::new(Semaphore::new(room));
    (Handoff { room, tx, worker: worker.into(), lease, endpoint_room }, Desk { rx })
}

impl Handoff {
    /// The dispatcher's worker id, written as `locked_by`.
    pub fn worker(&self) -> &str {
        &self.worker
    }

    /// The dispatcher's lease.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// How many more intents of an endpoint the dispatcher has room for.
    pub fn endpoint_room(&self) -> &(dyn Fn(&str) -> usize + Send + Sync) {
        &*self.endpoint_room
    }

    /// Room for up to `wanted` intents, as much as is free now (`None` if
    /// none is): never waits — what finds no room is written pending.
    pub fn reserve(&self, wanted: usize) -> Option<Reserved> {
        let n = wanted.min(self.room.available_permits());
        let n = u32::try_from(n).ok().filter(|&n| n > 0)?;
        let permits = self.room.clone().try_acquire_many_owned(n).ok()?;
        Some(Reserved { permits, since: Instant::now() })
    }

    /// Hand over intents whose claim was committed. If the dispatcher has
    /// stopped they are given back to pending instead.
    pub async fn send(&self, pool: &PgPool, handed: Vec<Handed>) {
        if handed.is_empty() {
            return;
        }
        crate::runtime::metrics::claimed("ingest", handed.len() as u64);
        if let Err(back) = self.tx.send(handed) {
            give_back(pool, back.0).await;
        }
    }
}

impl Desk {
    /// The next handed-over intents; never resolves once every [`Handoff`] is gone.
    pub async fn recv(&mut self) -> Vec<Handed> {
        match self.rx.recv().await {
            Some(handed) => handed,
            None => std::future::pending().await,
        }
    }

    /// Handed-over intents waiting now, without waiting.
    pub fn try_recv(&mut self) -> Option<Vec<Handed>> {
        self.rx.try_recv().ok()
    }

    /// Stop taking intents and give back to pending what was handed over and
    /// not started (a dispatcher stopping). A consumer that hands over later
    /// gives its intents back itself.
    pub async fn close(mut self, pool: &PgPool) {
        self.rx.close();
        let mut left = Vec::new();
        while let Ok(handed) = self.rx.try_recv() {
            left.extend(handed);
        }
        give_back(pool, left).await;
    }
}

/// Return unstarted claims to pending, uncounted; what fails to go back is
/// rescued when its lease expires.
pub async fn give_back(pool: &PgPool, handed: Vec<Handed>) {
    if handed.is_empty() {
        return;
    }
    let n = handed.len();
    let mut conn = match pool.acquire().await {
        Ok(conn) => conn,
        Err(e) => {
            warn!(intents = n, error = %e, "giving back intents claimed at ingest failed; they are rescued when their lease expires");
            return;
        }
    };
    for h in handed {
        if let Err(e) = intents::release(&mut conn, h.intent.id, h.intent.lease_token).await {
            warn!(intent_id = %h.intent.id, error = %e, "giving back an intent claimed at ingest failed; it is rescued when its lease expires");
        }
    }
    debug!(intents = n, "intents claimed at ingest given back to pending: the dispatcher has stopped");
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_store::intents::{Held, NewIntent};

    fn claimed() -> ClaimedIntent {
        let now = chrono::Utc::now();
        ClaimedIntent::held_at_insert(
            NewIntent::default(),
            Held { lease_token: uuid::Uuid::nil(), expires_at: now, created_at: now },
        )
    }

    #[test]
    fn room_is_held_per_intent_handed_over_and_comes_back_when_it_is_done() {
        let (handoff, _desk) = channel("w-1", Duration::from_secs(30), 3, Arc::new(|_: &str| usize::MAX));
        let mut reserved = handoff.reserve(10).expect("room");
        assert_eq!(reserved.len(), 3, "as much as is free, never more");
        assert!(handoff.reserve(1).is_none(), "none left, and reserving never waits");
        let handed = reserved.hand(claimed()).expect("a unit of the reservation");
        drop(reserved);
        assert_eq!(handoff.reserve(10).map(|r| r.len()), Some(2), "the unused units went back");
        drop(handed);
        assert_eq!(handoff.reserve(10).map(|r| r.len()), Some(3), "the call done, its unit is back");
    }

    #[test]
    fn a_reservation_hands_over_no_more_intents_than_it_has_room_for() {
        let (handoff, _desk) = channel("w-1", Duration::from_secs(30), 1, Arc::new(|_: &str| usize::MAX));
        let mut reserved = handoff.reserve(5).expect("room");
        let first = reserved.hand(claimed());
        assert!(first.is_some());
        assert!(reserved.hand(claimed()).is_none(), "the second finds no unit: it is written pending");
    }
}
