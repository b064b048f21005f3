//! Parked input records (R11, R19): kept with the original bytes, position
//! and reason, so an operator can inspect them and replay them through the
//! same guards with their original event id.

use chrono::{DateTime, Utc};
use relay_core::{Poison, PoisonClass, RawRecord, ReplayState};
use serde_json::Value;
use sqlx::{FromRow, PgConnection};

use crate::headers;

/// Park a record. `None` when the same record at the same position was
/// parked already (a redelivery after a crash between the DB commit and the
/// offset commit); another record at a parked one's position (the topic
/// created again since) is parked beside it.
/// `held`: it is parked behind the hold of its key ([`crate::holds`]).
/// Of its key and payload at most `keep` bytes each are stored, the reason
/// saying so: a record over the limit (a compressed batch inflated to
/// hundreds of megabytes, say) is never processed as it is, and stored
/// whole it would fill the database's disk at a thousand times the rate it
/// came in.
pub async fn insert(
    conn: &mut PgConnection,
    consumer: &str,
    record: &RawRecord,
    poison: &Poison,
    attempts: i32,
    held: bool,
    keep: usize,
) -> Result<Option<i64>, sqlx::Error> {
    fn cut(b: &Option<Vec<u8>>, keep: usize) -> Option<&[u8]> {
        b.as_deref().map(|b| &b[..b.len().min(keep)])
    }
    let (key, payload) = (cut(&record.key, keep), cut(&record.payload, keep));
    let len = |b: &Option<Vec<u8>>| b.as_ref().map_or(0, Vec::len);
    let reason = if len(&record.key) > keep || len(&record.payload) > keep {
        format!(
            "{}; stored: the first {keep} bytes of its key ({} bytes) and payload ({} bytes)",
            poison.reason,
            len(&record.key),
            len(&record.payload)
        )
    } else {
        poison.reason.clone()
    };
    sqlx::query_scalar(
        r#"INSERT INTO relay.dead_letters
               (consumer, topic, partition, "offset", event_id, event_type, key, payload, headers,
                error_class, reason, attempts, hold_id)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12,
                   CASE WHEN $13 THEN (SELECT id FROM relay.held_keys h
                                        WHERE h.consumer = $1 AND h.topic = $2 AND h.partition = $3
                                          AND sha256(h.key) = sha256($7) AND h.key = $7) END)
           ON CONFLICT (consumer, topic, partition, "offset", fingerprint) DO NOTHING
           RETURNING id"#,
    )
    .bind(consumer)
    .bind(&record.topic)
    .bind(record.partition)
    .bind(record.offset)
    .bind(&poison.event_id)
    .bind(&poison.event_type)
    .bind(key)
    .bind(payload)
    .bind(headers::to_json(&record.headers))
    .bind(poison.class)
    .bind(reason)
    .bind(attempts)
    .bind(held)
    .fetch_optional(conn)
    .await
}

/// A dead letter.
#[derive(Debug, Clone, FromRow, serde::Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct DeadLetter {
    pub id: i64,
    pub consumer: String,
    /// Source topic.
    pub topic: String,
    /// Source partition.
    pub partition: i32,
    /// Source offset.
    pub offset: i64,
    /// Event id, if it could be read.
    pub event_id: Option<String>,
    /// Event type, if it could be read.
    pub event_type: Option<String>,
    pub error_class: PoisonClass,
    pub reason: String,
    /// Attempts made.
    pub attempts: i32,
    /// Parked at.
    pub created_at: DateTime<Utc>,
    /// Last replay.
    pub replayed_at: Option<DateTime<Utc>>,
    /// Whether it is resolved (by a replay, or a skip).
    pub replay_state: ReplayState,
    /// Last replay's outcome, in words.
    pub replay_outcome: Option<String>,
    /// Payload size in bytes.
    pub payload_bytes: Option<i32>,
    /// The held key it belongs to, as its head or held behind it
    /// ([`crate::holds`]): not deleted while set.
    pub hold_id: Option<i64>,
    /// It is the head of its held key: replaying it (once it resolves) or
    /// skipping it releases the key.
    pub holds_key: bool,
    /// The head of the held key it waits behind, if it is held behind one.
    pub held_behind: Option<i64>,
}

/// A dead letter with the original record, for inspection and replay.
#[derive(Debug, Clone)]
pub struct DeadLetterRecord {
    /// Metadata.
    pub meta: DeadLetter,
    /// The original record.
    pub record: RawRecord,
}

/// Filters for listing and purging.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this consumer.
    pub consumer: Option<String>,
    /// Only this error class.
    pub error_class: Option<PoisonClass>,
    /// Only this topic.
    pub topic: Option<String>,
    /// Which ones by replay state.
    pub resolution: Resolution,
}

/// Dead letters by what they still ask of an operator. A dead letter is
/// *resolved* once a replay went through (applied, a duplicate or a
/// classified no-op) or it was skipped, and it no longer holds its key: a
/// head whose key's release was cut short (a crash between two chunks)
/// still waits for a replay or skip to finish it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Resolution {
    /// All of them.
    #[default]
    Any,
    /// Not (yet) resolved.
    Unresolved,
    /// Resolved.
    Resolved,
}

impl Resolution {
    fn as_str(self) -> &'static str {
        match self {
            Resolution::Any => "any",
            Resolution::Unresolved => "unresolved",
            Resolution::Resolved => "resolved",
        }
    }
}

/// SQL predicate: the dead letter was resolved by a replay or skipped.
pub const RESOLVED: &str = "replay_state <> 'open'";

const COLUMNS: &str = r#"id, consumer, topic, partition, "offset", event_id, event_type, error_class, reason,
    attempts, created_at, replayed_at, replay_state, replay_outcome, octet_length(payload) AS payload_bytes, hold_id,
    (hold_id IS NOT NULL AND EXISTS (
        SELECT 1 FROM relay.held_keys h WHERE h.id = dead_letters.hold_id AND h.head = dead_letters.id)) AS holds_key,
    (SELECT h.head FROM relay.held_keys h WHERE h.id = dead_letters.hold_id AND h.head <> dead_letters.id)
        AS held_behind"#;

const WHERE: &str = "($1::text IS NULL OR consumer = $1) AND ($2::text IS NULL OR error_class = $2)
    AND ($3::text IS NULL OR topic = $3)
    AND ($4 = 'any' OR ($4 = 'resolved') = (replay_state <> 'open'
        AND NOT EXISTS (SELECT 1 FROM relay.held_keys h WHERE h.head = dead_letters.id)))";

/// List dead letters, oldest first, after id `after`.
pub async fn list(conn: &mut PgConnection, f: &Filter, after: i64, limit: i64) -> Result<Vec<DeadLetter>, sqlx::Error> {
    sqlx::query_as(&format!("SELECT {COLUMNS} FROM relay.dead_letters WHERE {WHERE} AND id > $5 ORDER BY id LIMIT $6"))
        .bind(&f.consumer)
        .bind(f.error_class)
        .bind(&f.topic)
        .bind(f.resolution.as_str())
        .bind(after)
        .bind(limit)
        .fetch_all(conn)
        .await
}

/// Count dead letters matching `f`.
pub async fn count(conn: &mut PgConnection, f: &Filter) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(&format!("SELECT count(*) FROM relay.dead_letters WHERE {WHERE}"))
        .bind(&f.consumer)
        .bind(f.error_class)
        .bind(&f.topic)
        .bind(f.resolution.as_str())
        .fetch_one(conn)
        .await
}

#[derive(FromRow)]
struct Raw {
    key: Option<Vec<u8>>,
    payload: Option<Vec<u8>>,
    headers: Value,
}

/// One dead letter with its original record.
pub async fn get(conn: &mut PgConnection, consumer: &str, id: i64) -> Result<Option<DeadLetterRecord>, sqlx::Error> {
    let Some(meta) = sqlx::query_as::<_, DeadLetter>(&format!(
        "SELECT {COLUMNS} FROM relay.dead_letters WHERE id = $1 AND consumer = $2"
    ))
    .bind(id)
    .bind(consumer)
    .fetch_optional(&mut *conn)
    .await?
    else {
        return Ok(None);
    };
    let raw: Raw = sqlx::query_as("SELECT key, payload, headers FROM relay.dead_letters WHERE id = $1")
        .bind(id)
        .fetch_one(conn)
        .await?;
    let record = RawRecord {
        topic: meta.topic.clone(),
        partition: meta.partition,
        offset: meta.offset,
        key: raw.key,
        payload: raw.payload,
        headers: headers::from_json(&raw.headers),
    };
    Ok(Some(DeadLetterRecord { meta, record }))
}

/// Whether `record`'s position was parked and resolved by an operator.
pub async fn resolved_at(conn: &mut PgConnection, consumer: &str, record: &RawRecord) -> Result<bool, sqlx::Error> {
    let found: Option<bool> = sqlx::query_scalar(&format!(
        r#"SELECT {RESOLVED} FROM relay.dead_letters
            WHERE consumer = $1 AND topic = $2 AND partition = $3 AND "offset" = $4"#
    ))
    .bind(consumer)
    .bind(&record.topic)
    .bind(record.partition)
    .bind(record.offset)
    .fetch_optional(conn)
    .await?;
    Ok(found == Some(true))
}

/// The replay outcome of a dead letter an operator skipped (it held its
/// key): resolved, never applied.
pub const SKIPPED: &str = relay_core::InboxOutcome::Skipped.as_str();

/// Lock dead letter `id` of `consumer` (`FOR UPDATE`, until the
/// transaction ends) so that two replays or skips of it run one after the
/// other: what was done with it, and the hold it belongs to now. Lock its
/// hold first ([`crate::holds::lock_letter`]).
pub async fn lock(
    conn: &mut PgConnection,
    consumer: &str,
    id: i64,
) -> Result<Option<(ReplayState, Option<i64>)>, sqlx::Error> {
    sqlx::query_as("SELECT replay_state, hold_id FROM relay.dead_letters WHERE id = $1 AND consumer = $2 FOR UPDATE")
        .bind(id)
        .bind(consumer)
        .fetch_optional(conn)
        .await
}

/// Record a replay (or a skip) of dead letter `id`: where it stands now,
/// and what happened, in words.
pub async fn mark_replayed(
    conn: &mut PgConnection,
    consumer: &str,
    id: i64,
    state: ReplayState,
    detail: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE relay.dead_letters SET replayed_at = now(), replay_state = $2, replay_outcome = $3
          WHERE id = $1 AND consumer = $4",
    )
    .bind(id)
    .bind(state)
    .bind(detail)
    .bind(consumer)
    .execute(conn)
    .await?;
    Ok(())
}

/// Delete one dead letter, unless it belongs to a held key.
pub async fn delete(conn: &mut PgConnection, consumer: &str, id: i64) -> Result<bool, sqlx::Error> {
    let done = sqlx::query("DELETE FROM relay.dead_letters WHERE id = $1 AND consumer = $2 AND hold_id IS NULL")
        .bind(id)
        .bind(consumer)
        .execute(conn)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// Delete dead letters matching `f`, at most `limit` (bounded batches),
/// except those of a held key: they are the key's unfinished records.
pub async fn purge(conn: &mut PgConnection, f: &Filter, limit: i64) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(&format!(
        "DELETE FROM relay.dead_letters WHERE hold_id IS NULL AND id IN (
             SELECT id FROM relay.dead_letters WHERE {WHERE} AND hold_id IS NULL ORDER BY id LIMIT $5)"
    ))
    .bind(&f.consumer)
    .bind(f.error_class)
    .bind(&f.topic)
    .bind(f.resolution.as_str())
    .bind(limit)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}
