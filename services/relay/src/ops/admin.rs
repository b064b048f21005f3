//! Operator actions on dead letters: replay (through the same guards, with
//! the original event id) and purge.

use relay_store::dead_letters;
use sqlx::{Connection, PgPool};

use relay_core::Disposition;

use crate::ingest::processor::Processor;

/// What a replay did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayOutcome {
    /// Processed now: the effects were written.
    Applied,
    /// Already processed before (the inbox has it): nothing written.
    Duplicate,
    /// Processed as a classified no-op (stale, invalid transition, …).
    NoOp(String),
    /// Still failing: stays a dead letter.
    StillFailing(String),
    /// No dead letter with that id.
    NotFound,
}

impl ReplayOutcome {
    /// Whether the dead letter is resolved.
    pub fn resolved(&self) -> bool {
        matches!(self, ReplayOutcome::Applied | ReplayOutcome::Duplicate | ReplayOutcome::NoOp(_))
    }

    fn stored(&self) -> String {
        match self {
            ReplayOutcome::Applied => "applied".into(),
            ReplayOutcome::Duplicate => "duplicate".into(),
            ReplayOutcome::NoOp(o) => o.clone(),
            ReplayOutcome::StillFailing(why) => format!("failed: {why}"),
            ReplayOutcome::NotFound => "not_found".into(),
        }
    }
}

/// Replay dead letter `id` of `processor`'s consumer through `processor` in
/// one transaction (a dead letter of another consumer sharing the database
/// is not found: its routes are not these). A route paused now holds the
/// replay as it holds the partition.
pub async fn replay(pool: &PgPool, processor: &Processor, id: i64) -> anyhow::Result<ReplayOutcome> {
    let mut conn = pool.acquire().await?;
    let mut tx = conn.begin().await?;
    let consumer = processor.consumer().to_owned();
    let Some(dl) = dead_letters::get(&mut tx, &consumer, id).await? else {
        return Ok(ReplayOutcome::NotFound);
    };
    // The pauses as they are now, not as a consumer of this process last read them (if any does).
    processor.set_paused(relay_store::ops::paused_routes(&mut tx).await?);
    let processed = processor.process(&mut tx, &dl.record).await?;
    let outcome = match processed.disposition {
        Disposition::Applied { .. } => ReplayOutcome::Applied,
        Disposition::Duplicate => ReplayOutcome::Duplicate,
        Disposition::NoOp { outcome, .. } => ReplayOutcome::NoOp(outcome.as_str().to_owned()),
        Disposition::DeadLetter(p) | Disposition::RetryLater(p) => ReplayOutcome::StillFailing(p.to_string()),
        Disposition::Paused { route } => {
            ReplayOutcome::StillFailing(format!("route {route} is paused; resume it first"))
        }
    };
    dead_letters::mark_replayed(&mut tx, &consumer, id, &outcome.stored()).await?;
    tx.commit().await?;
    Ok(outcome)
}
