//! Operations: pauses and retention cleanup.

use std::time::Duration;

use sqlx::{FromRow, PgConnection};

use relay_core::IntentState;
pub use relay_core::PauseKind;

/// A pause.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Pause {
    /// What is paused.
    pub kind: PauseKind,
    /// Route or endpoint name.
    pub name: String,
    /// Why.
    pub reason: Option<String>,
    /// Since when.
    pub paused_at: chrono::DateTime<chrono::Utc>,
}

/// What [`pause`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Paused {
    /// Paused now.
    Paused,
    /// It was paused already (the first reason stays).
    AlreadyPaused,
}

/// What [`resume`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resumed {
    /// Resumed now.
    Resumed,
    /// It was not paused.
    NotPaused,
}

/// Pause `consumer`'s route or endpoint `name`: its pause, no other
/// deployment's.
pub async fn pause(
    conn: &mut PgConnection,
    consumer: &str,
    kind: PauseKind,
    name: &str,
    reason: Option<&str>,
) -> Result<Paused, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO relay.pauses (consumer, kind, name, reason) VALUES ($4, $1, $2, $3) ON CONFLICT DO NOTHING",
    )
    .bind(kind)
    .bind(name)
    .bind(reason)
    .bind(consumer)
    .execute(conn)
    .await?;
    Ok(if done.rows_affected() == 1 { Paused::Paused } else { Paused::AlreadyPaused })
}

/// Resume `consumer`'s `name` (and a pause taken before pauses were a
/// deployment's, which was every deployment's).
pub async fn resume(
    conn: &mut PgConnection,
    consumer: &str,
    kind: PauseKind,
    name: &str,
) -> Result<Resumed, sqlx::Error> {
    let done = sqlx::query("DELETE FROM relay.pauses WHERE consumer IN ('', $3) AND kind = $1 AND name = $2")
        .bind(kind)
        .bind(name)
        .bind(consumer)
        .execute(conn)
        .await?;
    Ok(if done.rows_affected() >= 1 { Resumed::Resumed } else { Resumed::NotPaused })
}

/// Every pause of `consumer` (with those taken for every deployment).
pub async fn pauses(conn: &mut PgConnection, consumer: &str) -> Result<Vec<Pause>, sqlx::Error> {
    sqlx::query_as(
        "SELECT DISTINCT ON (kind, name) kind, name, reason, paused_at FROM relay.pauses
          WHERE consumer IN ('', $1) ORDER BY kind, name, consumer DESC",
    )
    .bind(consumer)
    .fetch_all(conn)
    .await
}

/// What a consumer batch reads before its transaction begins.
#[derive(Debug, Clone, Default, FromRow)]
pub struct BatchGates {
    /// Names of paused routes.
    pub paused: Vec<String>,
    /// Some key of the batch's partition is held ([`crate::holds`]): the
    /// batch looks its keys up, whether or not a route holds keys today.
    pub keys_held: bool,
    /// The server process of the batch's connection, for
    /// [`backend`] when the batch runs long.
    pub pid: i32,
}

/// The [`BatchGates`] of a batch of `consumer` on `topic`/`partition`, in
/// one round trip. Only that partition's batches open holds. During a
/// rebalance a batch of the member losing the partition may still be open
/// and open one after this read; the new owner re-reads those records from
/// the committed offset, meets the same failing record and holds its key in
/// its own batch (a failure that does not repeat is the exception).
pub async fn batch_gates(
    conn: &mut PgConnection,
    consumer: &str,
    topic: &str,
    partition: i32,
) -> Result<BatchGates, sqlx::Error> {
    sqlx::query_as(
        "SELECT ARRAY(SELECT name FROM relay.pauses WHERE kind = 'route' AND consumer IN ('', $1)) AS paused,
                EXISTS(SELECT 1 FROM relay.held_keys WHERE consumer = $1 AND topic = $2 AND partition = $3) AS keys_held,
                pg_backend_pid() AS pid",
    )
    .bind(consumer)
    .bind(topic)
    .bind(partition)
    .fetch_one(conn)
    .await
}

/// The server process of `conn`.
pub async fn backend_pid(conn: &mut PgConnection) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(conn).await
}

/// What a server process is doing for its client, as another connection sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Running a statement (not blocked writing to a client that stopped
    /// reading), or between two statements for less than the `idle` asked.
    Working,
    /// Waiting for a statement that has not come for longer than that, or
    /// blocked writing to its client: the client's statements no longer
    /// reach it.
    Stuck,
    /// No such process: it ended.
    Gone,
}

/// What server process `pid` is doing ([`Backend`]). Asked on another
/// connection about one whose answer is late, it tells a slow transaction
/// (wait for it) from a lost one.
pub async fn backend(conn: &mut PgConnection, pid: i32, idle: std::time::Duration) -> Result<Backend, sqlx::Error> {
    let idle = i64::try_from(idle.as_millis()).unwrap_or(i64::MAX);
    let working: Option<bool> = sqlx::query_scalar(
        "WITH b(backend_state, wait_event, since) AS (SELECT state, wait_event, state_change FROM pg_stat_activity WHERE pid = $1)
         SELECT (backend_state = 'active' AND wait_event IS DISTINCT FROM 'ClientWrite')
                OR now() - since < make_interval(secs => $2 / 1000.0) FROM b",
    )
    .bind(pid)
    .bind(idle)
    .fetch_optional(conn)
    .await?;
    Ok(match working {
        None => Backend::Gone,
        Some(true) => Backend::Working,
        Some(false) => Backend::Stuck,
    })
}

/// End server process `pid` (one of relay's own connections, found
/// [`Backend::Stuck`]):
/// its open transaction is rolled back and its locks let go at once, not
/// when the server notices the client is gone.
pub async fn end_backend(conn: &mut PgConnection, pid: i32) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_terminate_backend($1)").bind(pid).execute(conn).await?;
    Ok(())
}

/// Names of `consumer`'s paused routes.
pub async fn paused_routes(conn: &mut PgConnection, consumer: &str) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT name FROM relay.pauses WHERE kind = 'route' AND consumer IN ('', $1)")
        .bind(consumer)
        .fetch_all(conn)
        .await
}

/// Which table a cleanup step works on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cleanup {
    /// Inbox rows of `consumer` (and its idempotency keys).
    Inbox,
    /// Idempotency keys of `consumer`.
    IdempotencyKeys,
    /// Succeeded intents (attempts go with them).
    SucceededIntents,
    /// Dead intents.
    DeadIntents,
    /// Published outbox rows.
    PublishedOutbox,
    /// Dead letters.
    DeadLetters,
}

impl Cleanup {
    /// Human name.
    pub fn label(self) -> &'static str {
        match self {
            Cleanup::Inbox => "inbox rows",
            Cleanup::IdempotencyKeys => "idempotency keys",
            Cleanup::SucceededIntents => "succeeded intents",
            Cleanup::DeadIntents => "dead intents",
            Cleanup::PublishedOutbox => "published outbox rows",
            Cleanup::DeadLetters => "dead letters",
        }
    }
}

/// Delete at most `limit` rows of `what` older than `older_than`, oldest
/// first, in one short statement. Returns how many were deleted; call again
/// until it returns less than `limit`.
pub async fn delete_batch(
    conn: &mut PgConnection,
    what: Cleanup,
    consumer: &str,
    older_than: Duration,
    limit: i64,
) -> Result<u64, sqlx::Error> {
    let deleted: i64 = sqlx::query_scalar(&delete_sql(what, limit))
        .bind(consumer)
        .bind(older_than.as_secs_f64())
        .fetch_one(conn)
        .await?;
    Ok(deleted as u64)
}

/// The statement [`delete_batch`] runs for `what` (public so a test can check
/// its plan): `$1` consumer, `$2` age in seconds; it returns how many rows of
/// `what` it deleted. Each reads the oldest rows through an index in the
/// order it deletes them, then the rows themselves by primary key. Intents
/// take their attempt rows with them (there is no foreign key to cascade: see
/// migration 0003). The intents' state is checked again on the rows
/// themselves: one requeued (dead → pending) after the subquery read it is
/// re-read under its lock and left alone; so is every table's filter (an
/// outbox row replayed, a dead letter whose key was held meanwhile).
///
/// The limit is written into the statement, not bound: with `LIMIT $n` a
/// generic plan (which PostgreSQL may pick for a prepared statement after
/// five runs) guesses a tenth of the table and joins it by scanning the whole
/// table; a constant keeps every plan at the batch size (`tests/e2e/plans.rs`).
pub fn delete_sql(what: Cleanup, limit: i64) -> String {
    const FINISHED_INTENTS: &str = "WITH gone AS (
             DELETE FROM relay.intents WHERE state = '{state}' AND NOT (state = 'dead' AND holds_key) AND id IN (
                 SELECT id FROM relay.intents
                  WHERE state = '{state}' AND consumer = $1 AND finished_at < now() - make_interval(secs => $2)
                    AND NOT (state = 'dead' AND holds_key)
                  ORDER BY finished_at LIMIT {limit})
             RETURNING id
         ), attempts AS (
             DELETE FROM relay.intent_attempts a USING gone WHERE a.intent_id = gone.id
         )
         SELECT count(*) FROM gone";
    // The other tables: their oldest rows of the consumer, by one time column.
    let (table, key, only, time) = match what {
        Cleanup::Inbox => ("inbox", "consumer, event_id", "", "received_at"),
        Cleanup::IdempotencyKeys => ("idempotency_keys", "consumer, idempotency_key", "", "created_at"),
        Cleanup::PublishedOutbox => ("outbox", "id", "state = 'published' AND ", "published_at"),
        // A letter of a held key is its unfinished business (`holds`).
        Cleanup::DeadLetters => ("dead_letters", "id", "hold_id IS NULL AND ", "created_at"),
        Cleanup::SucceededIntents | Cleanup::DeadIntents => {
            let state = if what == Cleanup::DeadIntents { IntentState::Dead } else { IntentState::Succeeded };
            return FINISHED_INTENTS.replace("{state}", state.as_str()).replace("{limit}", &limit.to_string());
        }
    };
    format!(
        "WITH gone AS (
             DELETE FROM relay.{table} WHERE {only}({key}) IN (
                 SELECT {key} FROM relay.{table}
                  WHERE {only}consumer = $1 AND {time} < now() - make_interval(secs => $2)
                  ORDER BY {time} LIMIT {limit})
             RETURNING 1
         )
         SELECT count(*) FROM gone"
    )
}
