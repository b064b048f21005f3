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
}

impl<P> Default for Resume<P> {
    fn default() -> Self {
        Resume { after: None, back: 0, from_start: Instant::now() }
    }
}

impl<P: Copy + Ord> Resume<P> {
    /// Where to claim after now, and the count of moves back to hand to
    /// [`Resume::claimed`].
    pub fn next(&mut self, poll_interval: Duration) -> (Option<P>, u64) {
        if self.from_start.elapsed() >= poll_interval {
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
        }
    }

    /// Move back so the next claim takes the rows after `to` (`None`: from
    /// the start), if it would not already.
    pub fn back_to(&mut self, to: Option<P>) {
        self.after = to.and_then(|to| self.after.map(|a| a.min(to)));
        self.back += 1;
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
}
