//! Counts for `relay stats` and, later, metrics gauges.

use serde::Serialize;
use sqlx::PgConnection;

/// A snapshot of the relay's tables.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Stats {
    /// Inbox rows by outcome.
    pub inbox: Vec<(String, i64)>,
    /// Intents by state.
    pub intents: Vec<(String, i64)>,
    /// Age in seconds of the oldest pending or running intent.
    pub oldest_pending_intent_secs: Option<f64>,
    /// Outbox rows by state.
    pub outbox: Vec<(String, i64)>,
    /// Age in seconds of the oldest unpublished outbox row.
    pub oldest_unpublished_outbox_secs: Option<f64>,
    /// Dead letters not yet replayed successfully.
    pub dead_letters_unresolved: i64,
    /// Dead letters in total.
    pub dead_letters_total: i64,
    /// Business counters `(consumer, name, value)`.
    pub counters: Vec<(String, String, i64)>,
}

impl Stats {
    /// Count in a `(label, count)` list, 0 when absent.
    pub fn count(list: &[(String, i64)], label: &str) -> i64 {
        list.iter().find(|(l, _)| l == label).map_or(0, |(_, n)| *n)
    }
}

/// Take a snapshot.
pub async fn snapshot(conn: &mut PgConnection) -> Result<Stats, sqlx::Error> {
    let inbox = sqlx::query_as("SELECT outcome, count(*) FROM relay.inbox GROUP BY outcome ORDER BY outcome")
        .fetch_all(&mut *conn)
        .await?;
    let intents = sqlx::query_as("SELECT state, count(*) FROM relay.intents GROUP BY state ORDER BY state")
        .fetch_all(&mut *conn)
        .await?;
    let oldest_pending_intent_secs = sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - min(created_at))::float8 FROM relay.intents
          WHERE state IN ('pending', 'running')",
    )
    .fetch_one(&mut *conn)
    .await?;
    let outbox = sqlx::query_as("SELECT state, count(*) FROM relay.outbox GROUP BY state ORDER BY state")
        .fetch_all(&mut *conn)
        .await?;
    let oldest_unpublished_outbox_secs = sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - min(created_at))::float8 FROM relay.outbox
          WHERE state IN ('pending', 'running')",
    )
    .fetch_one(&mut *conn)
    .await?;
    let (dead_letters_total, dead_letters_unresolved): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE NOT (replay_outcome IS NOT NULL AND replay_outcome NOT LIKE 'failed%'))
           FROM relay.dead_letters",
    )
    .fetch_one(&mut *conn)
    .await?;
    let counters = sqlx::query_as("SELECT consumer, name, value FROM relay.counters ORDER BY consumer, name")
        .fetch_all(&mut *conn)
        .await?;
    Ok(Stats {
        inbox,
        intents,
        oldest_pending_intent_secs,
        outbox,
        oldest_unpublished_outbox_secs,
        dead_letters_unresolved,
        dead_letters_total,
        counters,
    })
}
