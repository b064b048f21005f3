//! Intents: external calls to make, claimed by dispatchers.
//!
//! Lifecycle (see the migration for the column comments):
//!
//! ```text
//! insert --> pending --claim--> running --success--> succeeded
//! insert with a Hold ----------> running  (claimed at ingest: same row, same lease)
//!                                   |-----retry-----> pending (next_attempt_at later)
//!                                   |-----dead------> dead
//!                                   |-----budget spent after an unknown outcome--> uncertain
//!                                   '--lease expired (rescue)--> pending
//! ```
//!
//! Every transition out of `running` names the lease token it holds; a worker
//! whose lease was rescued and re-claimed finds zero rows and records nothing.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{FromRow, Row};
use uuid::Uuid;

pub use relay_core::IntentState;
pub use relay_core::effects::{Intent, NewIntent};

mod claim;
mod finish;
mod insert;
mod operate;
mod view;

pub use claim::{CLAIM, Room, Scope, claim, claim_after};
pub use finish::{
    AttemptOutcome, AttemptRecord, ErrorClass, FINISH, Fenced, Finish, NextState, answer, extend_leases, finish,
    finish_many, finish_unreadable, keep_answers, release, rescue_expired,
};
pub use insert::{Held, Hold};
pub(crate) use insert::{INSERT_MANY, bind_many, fair_delays};
pub use operate::{ReplayRules, Requeue, Skip, give_back_uncertain, pending_elsewhere, requeue, skip, take_uncertain};
pub use view::{AttemptView, IntentFilter, IntentView, attempts, get, ids, list};

/// A claimed intent: the intent and what the claim adds — everything a
/// worker needs to make the call and record its outcome.
#[derive(Debug, Clone)]
pub struct ClaimedIntent {
    /// Intent id.
    pub id: Uuid,
    /// Fencing token of this claim.
    pub lease_token: Uuid,
    /// The call and its effects, as written.
    pub intent: Intent,
    /// This attempt's number (counted at claim).
    pub attempts: i32,
    /// Age budget deadline.
    pub expires_at: DateTime<Utc>,
    /// Last error before this attempt.
    pub last_error: Option<String>,
    /// Some attempt before this claim may have been applied (`ever_uncertain`).
    pub ever_uncertain: bool,
    /// Written at.
    pub created_at: DateTime<Utc>,
}

/// The columns a [`ClaimedIntent`] is read from: a claim ([`CLAIM`]) and an
/// operator's take of an uncertain intent ([`take_uncertain`]) return these.
macro_rules! claimed_columns {
    () => {
        "id, lease_token, consumer, source_event_id, action, endpoint, method, path, body, request_headers, \
         idempotency_key, ordering_key, attempts, max_attempts, expires_at, on_success, on_dead, emit_source, \
         aggregate_id, correlation_id, causation_id, traceparent, last_error, ever_uncertain, created_at, holds_key, fairness_key"
    };
}
pub(crate) use claimed_columns;

impl<'r> FromRow<'r, PgRow> for ClaimedIntent {
    fn from_row(row: &'r PgRow) -> Result<Self, sqlx::Error> {
        Ok(ClaimedIntent {
            id: row.try_get("id")?,
            lease_token: row.try_get("lease_token")?,
            intent: Intent {
                consumer: row.try_get("consumer")?,
                source_event_id: row.try_get("source_event_id")?,
                action: row.try_get("action")?,
                endpoint: row.try_get("endpoint")?,
                method: row.try_get("method")?,
                path: row.try_get("path")?,
                body: row.try_get("body")?,
                headers: row.try_get("request_headers")?,
                idempotency_key: row.try_get("idempotency_key")?,
                ordering_key: row.try_get("ordering_key")?,
                holds_key: row.try_get("holds_key")?,
                fairness_key: row.try_get("fairness_key")?,
                max_attempts: row.try_get("max_attempts")?,
                on_success: row.try_get("on_success")?,
                on_dead: row.try_get("on_dead")?,
                emit_source: row.try_get("emit_source")?,
                aggregate_id: row.try_get("aggregate_id")?,
                correlation_id: row.try_get("correlation_id")?,
                causation_id: row.try_get("causation_id")?,
                traceparent: row.try_get("traceparent")?,
            },
            attempts: row.try_get("attempts")?,
            expires_at: row.try_get("expires_at")?,
            last_error: row.try_get("last_error")?,
            ever_uncertain: row.try_get("ever_uncertain")?,
            created_at: row.try_get("created_at")?,
        })
    }
}

impl ClaimedIntent {
    /// Its retry budget, for [`relay_core::retry::decide`].
    pub fn budget(&self) -> relay_core::retry::Budget {
        relay_core::retry::Budget {
            attempts: u32::try_from(self.attempts).unwrap_or(0),
            max_attempts: u32::try_from(self.intent.max_attempts).unwrap_or(0),
            expires_at: self.expires_at,
            uncertain_before: self.ever_uncertain,
            // The endpoint's profile may say otherwise (the executor knows it).
            resends_unknown: true,
            key_forgotten: false,
        }
    }
}

impl ClaimedIntent {
    /// The claimed intent that a claim of `new` would have returned, for a
    /// row written already held ([`Hold`], [`Held`]): first attempt, no error yet.
    pub fn held_at_insert(new: NewIntent, held: Held) -> ClaimedIntent {
        ClaimedIntent {
            id: new.id,
            lease_token: held.lease_token,
            intent: new.intent,
            attempts: 1,
            expires_at: held.expires_at,
            last_error: None,
            ever_uncertain: false,
            created_at: held.created_at,
        }
    }
}
