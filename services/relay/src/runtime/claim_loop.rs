//! What the dispatcher's and the publisher's claim loops share: when to
//! claim next (LISTEN/NOTIFY, [`until_due`], the poll interval) and where
//! the next claim starts ([`Resume`]).
//!
//! Where a claim loop's next claim may start: the dispatcher's
//! ([`relay_store::intents::claim_after`], a [`relay_store::Position`]) and
//! the publisher's lanes' ([`relay_store::outbox::claim_after`], a `seq`).
//!
//! A claim reads its table's index of pending rows from the start, and the
//! entries of rows claimed before are read again on every claim until
//! vacuum removes them — which it cannot while a transaction older than
//! those claims holds a snapshot open. A loop draining a backlog therefore
//! claims after the last row of its latest full claim. What that passes over
//! (rows given back, retried, rescued, or made due by the loop's own
//! progress) it finds from the start: after a short claim, after an error or
//! whatever else its owner moves it back for, and at least once per poll
//! interval, so no row waits longer than a missed wake-up would.

use std::time::{Duration, Instant};

use chrono::Utc;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tracing::{debug, warn};

/// The position, `P` being a place in the claim order.
#[derive(Debug)]
pub struct Resume<P> {
    /// Claim the rows after this; `None`: from the start.
    after: Option<P>,
    /// Counts every move of `after` back (or to the start), so a full claim
    /// that began before one (another lane's) does not move it forward past
    /// what it was moved back for.
    back: u64,
    /// When a claim last started from the start.
    from_start: Instant,
    /// A sweep past rows waiting behind their keys is under way
    /// ([`Resume::passed`]): it goes on to its end, poll interval or not.
    sweeping: bool,
}

impl<P> Default for Resume<P> {
    fn default() -> Self {
        Resume { after: None, back: 0, from_start: Instant::now(), sweeping: false }
    }
}

impl<P: Copy + Ord> Resume<P> {
    /// Where to claim after now, and the count of moves back to hand to
    /// [`Resume::claimed`].
    pub fn next(&mut self, poll_interval: Duration) -> (Option<P>, u64) {
        if self.from_start.elapsed() >= poll_interval && !self.sweeping {
            self.after = None;
        }
        if self.after.is_none() {
            self.from_start = Instant::now();
        }
        (self.after, self.back)
    }

    /// A full claim that began at `back` ended at `last`: the next claim
    /// starts there, unless the position moved back meanwhile.
    pub fn claimed(&mut self, back: u64, last: P) {
        if self.back == back {
            self.after = Some(last);
            self.sweeping = false;
        }
    }

    /// A short claim that began at `back` examined its whole window, up to
    /// `edge`, and found rows waiting behind earlier rows of their keys: the
    /// next claim goes on after `edge`, and the sweep is not sent back to
    /// the start by the poll interval before it reaches the end. Sent back
    /// every interval, a sweep of a blocked backlog longer than one
    /// interval's claims cover never reached the rows after it.
    pub fn passed(&mut self, back: u64, edge: P) {
        if self.back == back {
            self.after = Some(edge);
            self.sweeping = true;
        }
    }

    /// Move back so the next claim takes the rows after `to` (`None`: from
    /// the start, which also ends a sweep), if it would not already.
    pub fn back_to(&mut self, to: Option<P>) {
        self.after = to.and_then(|to| self.after.map(|a| a.min(to)));
        self.sweeping &= self.after.is_some();
        self.back += 1;
    }
}

/// The sleep before the next claim when the earliest pending row not due yet
/// is due at `next_due` (rows already due but not claimed wait for an earlier
/// row of their key or another worker, and are not counted). A time already
/// past (the row came due since) means re-claim soon, not spin: 5 ms at least.
pub fn until_due(next_due: Option<chrono::DateTime<Utc>>, poll: Duration) -> Duration {
    const SOON: Duration = Duration::from_millis(5);
    match next_due.map(|at| at - Utc::now()) {
        Some(ahead) => ahead.to_std().unwrap_or(SOON).clamp(SOON, poll.max(SOON)),
        None => poll,
    }
}

/// `<hostname>-<pid>`.
pub fn default_worker_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_owned()).unwrap_or_else(|_| "host".into());
    format!("{host}-{}", std::process::id())
}

/// LISTEN on `channel`; `None` (polling only) if it cannot be set up.
pub async fn listen(pool: &PgPool, channel: &str) -> Option<PgListener> {
    match PgListener::connect_with(pool).await {
        Ok(mut l) => match l.listen(channel).await {
            Ok(()) => Some(l),
            Err(e) => {
                warn!(error = %e, channel, "LISTEN failed; falling back to polling");
                None
            }
        },
        Err(e) => {
            warn!(error = %e, channel, "could not open a LISTEN connection; falling back to polling");
            None
        }
    }
}

/// Resolve on the next notification (never, without a listener).
pub async fn notified(listener: &mut Option<PgListener>) {
    match listener {
        Some(l) => {
            if let Err(e) = l.recv().await {
                debug!(error = %e, "LISTEN connection error; it reconnects on the next wait");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLL: Duration = Duration::from_secs(60);

    #[test]
    fn a_full_claim_moves_the_position_to_its_last_row_and_a_short_one_back_to_the_start() {
        let mut r = Resume::default();
        let (after, back) = r.next(POLL);
        assert_eq!(after, None);
        r.claimed(back, 100);
        assert_eq!(r.next(POLL).0, Some(100));
        r.back_to(None);
        assert_eq!(r.next(POLL).0, None);
    }

    #[test]
    fn a_claim_begun_before_a_move_back_does_not_move_the_position_forward() {
        let mut r = Resume::default();
        let (_, back) = r.next(POLL);
        r.claimed(back, 100);
        // Two lanes claim after 100; one publishes a keyed row at 40 while
        // the other's claim (to 300) is on its way.
        let (_, back) = r.next(POLL);
        r.back_to(Some(40));
        r.claimed(back, 300);
        assert_eq!(r.next(POLL).0, Some(40));
        // Moving back never moves forward.
        r.back_to(Some(90));
        assert_eq!(r.next(POLL).0, Some(40));
    }

    #[test]
    fn a_claim_starts_from_the_start_once_a_poll_interval_has_passed() {
        let mut r = Resume::default();
        let (_, back) = r.next(Duration::ZERO);
        r.claimed(back, 100);
        assert_eq!(r.next(Duration::ZERO).0, None, "the poll interval passed");
    }

    #[test]
    fn a_retry_due_later_is_waited_for_but_never_longer_than_the_poll_interval() {
        let poll = Duration::from_secs(1);
        let soon = until_due(Some(Utc::now() + chrono::Duration::milliseconds(300)), poll);
        assert!(soon <= Duration::from_millis(300) && soon >= Duration::from_millis(200), "{soon:?}");
        assert_eq!(until_due(Some(Utc::now() + chrono::Duration::seconds(30)), poll), poll);
        assert_eq!(until_due(None, poll), poll);
    }

    #[test]
    fn a_row_that_came_due_since_it_was_looked_up_is_claimed_soon_without_spinning() {
        // next_due_at only returns future times; one already past came due
        // in between. Rows due but blocked are never returned, so no spin.
        let poll = Duration::from_millis(700);
        assert_eq!(until_due(Some(Utc::now() - chrono::Duration::seconds(5)), poll), Duration::from_millis(5));
    }
}
