//! What became of one input record: its [`Disposition`], and the class
//! stored with its inbox row ([`InboxOutcome`]).

use crate::envelope::{Poison, PoisonClass};
use crate::stored::stored_names;

stored_names! {
    /// The recorded result of an event, stored in `inbox.outcome` (the
    /// `inbox_outcome_known` check lists the same names).
    pub enum InboxOutcome ("inbox outcome") {
        /// The route's effects were written.
        Applied = "applied",
        /// Another event with the same business idempotency key came first.
        DuplicateKey = "duplicate_key",
        /// Its aggregate version is lower than one already applied.
        Stale = "stale",
        /// Its aggregate version equals the one already applied.
        DuplicateVersion = "duplicate_version",
        /// The saga was already in the target state.
        DuplicateTransition = "duplicate_transition",
        /// The saga is in a state the transition may not start from.
        InvalidTransition = "invalid_transition",
        /// Its sequence number was already applied.
        DuplicateSequence = "duplicate_sequence",
        /// No route for its type (non-strict consumer).
        Unrouted = "unrouted",
        /// Never applied: an operator skipped its dead letter, which held its
        /// key (`on_poison = "hold_key"`); its key's later records went ahead.
        Skipped = "skipped",
    }
}

/// What processing one record decided: the one answer of the write path
/// (`relay_store::write`) and of the processor around it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Its effects were written: how many intents and outbox rows were new.
    Applied {
        /// New intents.
        intents: usize,
        /// New outbox rows.
        events: usize,
    },
    /// Already in the inbox (a duplicate delivery or a replay, or earlier in
    /// the same batch): nothing written.
    Duplicate,
    /// Recorded in the inbox as a classified no-op (R5).
    NoOp {
        /// The class.
        outcome: InboxOutcome,
        /// Why, for the log line.
        detail: String,
    },
    /// Not processable yet (missing reference, sequence gap): retried with
    /// backoff, then dead-lettered.
    RetryLater(Poison),
    /// Permanently unprocessable: dead-lettered.
    DeadLetter(Poison),
    /// Held behind an earlier dead letter of its Kafka key on its partition
    /// (`on_poison = "hold_key"`): parked as a dead letter of class
    /// [`PoisonClass::Held`], applied when that key is released.
    Held(Poison),
    /// Its route is paused: the partition waits here, nothing is skipped.
    Paused {
        /// The paused route.
        route: String,
    },
}

impl Disposition {
    /// Not processable yet, for `class` and `detail` (no identity yet).
    pub fn not_yet(class: PoisonClass, detail: String) -> Disposition {
        Disposition::RetryLater(Poison::new(class, detail))
    }

    /// Short name for logs and counts.
    pub fn result(&self) -> &'static str {
        match self {
            Disposition::Applied { .. } => "applied",
            Disposition::Duplicate => "duplicate",
            Disposition::NoOp { outcome, .. } => outcome.as_str(),
            Disposition::DeadLetter(_) => "poison",
            Disposition::Held(_) => "held",
            Disposition::RetryLater(_) => "retry_later",
            Disposition::Paused { .. } => "paused",
        }
    }

    /// Whether the writes made for the record must be rolled back: a no-op
    /// found by a check (its inbox row, key and earlier checks are written;
    /// the inbox row is then recorded again with the class), or a record not
    /// processable yet.
    pub fn undo(&self) -> bool {
        matches!(
            self,
            Disposition::RetryLater(_)
                | Disposition::NoOp {
                    outcome: InboxOutcome::Stale
                        | InboxOutcome::DuplicateVersion
                        | InboxOutcome::DuplicateSequence
                        | InboxOutcome::DuplicateTransition
                        | InboxOutcome::InvalidTransition,
                    ..
                }
        )
    }
}
