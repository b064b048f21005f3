//! What a partition task does after each batch: one pure decision ([`next`])
//! over how the batch ended and what failed in a row before it, written as
//! a table and tested as one, as `relay_core::retry::decide` is for intents.
//! The task does what it says and keeps the I/O (parks, waits, logs).
//!
//! | the batch                            | then                                    |
//! |--------------------------------------|-----------------------------------------|
//! | ran, stopped at a paused route       | hold the partition there                |
//! | ran to its end                       | go on                                   |
//! | stopped at a record not processable yet, budget left | wait (not yet), try again |
//! | the same, budget spent               | park it — or leave it, if revoked since |
//! | the database failed                  | wait (database), try again              |
//! | the Schema Registry could not be asked | wait (registry), try again            |

use std::time::Duration;

use relay_core::retry::BackoffPolicy;

/// How a step of a partition task ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Ended {
    /// A batch ran: `done` records were written, and it stopped at a record
    /// of paused route `paused`, or at a record not processable yet
    /// (`not_yet`), or at neither.
    Ran { done: usize, paused: Option<String>, not_yet: bool },
    /// The record that spent its budget was parked.
    Parked,
    /// The database failed (the batch, or a park).
    Database,
    /// The Schema Registry could not be asked.
    Registry,
}

/// Failures in a row, by cause. `not_yet` is the stopped record's attempts,
/// kept beside its partition so that a new task goes on counting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct InARow {
    pub(super) database: u32,
    pub(super) registry: u32,
    pub(super) not_yet: u32,
}

/// What a partition task waits out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WaitFor {
    /// The database (an outage, a lock held too long, a conflict).
    Database,
    /// The Schema Registry.
    Registry,
    /// A record not processable yet (a missing reference, a sequence gap,
    /// a schema the registry does not have yet).
    NotYet,
}

/// What the task does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Next {
    /// Take the next records.
    Go,
    /// Hold the partition at its next record, whose route is paused.
    Hold(String),
    /// Park the record not processable yet: its budget is spent.
    Park,
    /// Its budget is spent, but the partition was revoked since: its new
    /// owner may have applied it, so it is not this task's to park.
    Leave,
    /// Wait, the `n`-th time in a row for this cause, then try again.
    Wait(WaitFor, u32),
}

/// The decision after `ended`, counting failures in `row`, with `max_attempts`
/// for a record not processable yet; `revoked`: the partition was revoked
/// since the task started.
pub(super) fn next(ended: &Ended, row: &mut InARow, max_attempts: u32, revoked: bool) -> Next {
    match ended {
        Ended::Ran { done, paused, not_yet } => {
            (row.database, row.registry) = (0, 0);
            if *done > 0 {
                row.not_yet = 0;
            }
            if let Some(route) = paused {
                // No retry budget is spent on a pause.
                return Next::Hold(route.clone());
            }
            if !not_yet {
                return Next::Go;
            }
            row.not_yet += 1;
            match (row.not_yet >= max_attempts, revoked) {
                (false, _) => Next::Wait(WaitFor::NotYet, row.not_yet),
                (true, true) => Next::Leave,
                (true, false) => Next::Park,
            }
        }
        Ended::Parked => {
            row.not_yet = 0;
            Next::Go
        }
        Ended::Database => {
            row.database += 1;
            Next::Wait(WaitFor::Database, row.database)
        }
        Ended::Registry => {
            row.registry += 1;
            Next::Wait(WaitFor::Registry, row.registry)
        }
    }
}

impl WaitFor {
    /// How long the `n`-th wait in a row lasts: an outage of the database or
    /// the registry backs off by `outage` (at least 50 ms, so that a
    /// zero-delay policy does not spin), a record not processable yet by its
    /// budget's `not_yet`.
    pub(super) fn delay(
        self,
        n: u32,
        outage: &BackoffPolicy,
        not_yet: &BackoffPolicy,
        rng: &mut impl rand::Rng,
    ) -> Duration {
        match self {
            WaitFor::Database | WaitFor::Registry => outage.delay(n, rng).max(Duration::from_millis(50)),
            WaitFor::NotYet => not_yet.delay(n, rng),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ran(done: usize, paused: Option<&str>, not_yet: bool) -> Ended {
        Ended::Ran { done, paused: paused.map(str::to_owned), not_yet }
    }

    #[test]
    fn each_way_a_batch_ends_decides_the_partition_s_next_step() {
        let row = |database, registry, not_yet| InARow { database, registry, not_yet };
        // (ended, failures before, budget, revoked) -> (next, failures after)
        let table = [
            (ran(3, None, false), row(2, 1, 4), 8, false, Next::Go, row(0, 0, 0)),
            (ran(0, Some("placed"), false), row(1, 0, 2), 8, false, Next::Hold("placed".into()), row(0, 0, 2)),
            (ran(2, Some("placed"), false), row(0, 0, 2), 8, false, Next::Hold("placed".into()), row(0, 0, 0)),
            (ran(0, None, true), row(3, 0, 0), 8, false, Next::Wait(WaitFor::NotYet, 1), row(0, 0, 1)),
            (ran(0, None, true), row(0, 0, 6), 8, false, Next::Wait(WaitFor::NotYet, 7), row(0, 0, 7)),
            (ran(5, None, true), row(0, 0, 6), 8, false, Next::Wait(WaitFor::NotYet, 1), row(0, 0, 1)),
            (ran(0, None, true), row(0, 0, 7), 8, false, Next::Park, row(0, 0, 8)),
            (ran(0, None, true), row(0, 0, 7), 8, true, Next::Leave, row(0, 0, 8)),
            (ran(0, None, true), row(0, 0, 0), 1, false, Next::Park, row(0, 0, 1)),
            (Ended::Parked, row(2, 0, 8), 8, false, Next::Go, row(2, 0, 0)),
            (Ended::Database, row(2, 1, 3), 8, false, Next::Wait(WaitFor::Database, 3), row(3, 1, 3)),
            (Ended::Registry, row(2, 1, 3), 8, true, Next::Wait(WaitFor::Registry, 2), row(2, 2, 3)),
        ];
        for (ended, before, budget, revoked, want, after) in table {
            let mut r = before;
            assert_eq!(next(&ended, &mut r, budget, revoked), want, "{ended:?} after {before:?}");
            assert_eq!(r, after, "{ended:?} after {before:?}");
        }
    }

    #[test]
    fn an_outage_waits_at_least_50_ms_and_a_record_not_processable_yet_as_its_budget_says() {
        let none = BackoffPolicy { min_delay: Duration::ZERO, max_delay: Duration::ZERO, ..BackoffPolicy::DATABASE };
        let budget = BackoffPolicy { min_delay: Duration::from_secs(3), max_delay: Duration::from_secs(3), ..none };
        let mut rng = rand::rng();
        assert_eq!(WaitFor::Database.delay(1, &none, &budget, &mut rng), Duration::from_millis(50));
        assert_eq!(WaitFor::Registry.delay(9, &none, &budget, &mut rng), Duration::from_millis(50));
        assert!(WaitFor::NotYet.delay(1, &none, &budget, &mut rng) <= Duration::from_secs(3));
    }
}
