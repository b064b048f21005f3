//! The inbox and the guards that run in the same transaction: technical
//! dedup (R2), business idempotency keys (R4), version and sequence guards
//! (R5, R6), history rows (R14) and business counters (R20).

use relay_core::HistoryKind;
use sqlx::PgConnection;

/// What the inbox insert found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboxInsert {
    /// First time this (consumer, event id) is recorded.
    Inserted,
    /// Already recorded: a duplicate delivery, a successful no-op.
    Duplicate,
}

pub use relay_core::disposition::InboxOutcome;

/// One inbox row to write.
#[derive(Debug, Clone)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct NewInboxRow<'a> {
    /// Consumer name.
    pub consumer: &'a str,
    pub event_id: &'a str,
    pub event_type: &'a str,
    /// Source topic.
    pub topic: &'a str,
    /// Source partition.
    pub partition: i32,
    /// Source offset.
    pub offset: i64,
    /// Business idempotency key.
    pub idempotency_key: Option<&'a str>,
    pub aggregate_id: Option<&'a str>,
    pub correlation_id: Option<&'a str>,
    /// Outcome to record.
    pub outcome: InboxOutcome,
}

/// `INSERT … ON CONFLICT DO NOTHING` the inbox row (R2).
pub async fn insert(conn: &mut PgConnection, row: &NewInboxRow<'_>) -> Result<InboxInsert, sqlx::Error> {
    let done = sqlx::query(
        r#"INSERT INTO relay.inbox
               (consumer, event_id, event_type, topic, partition, "offset",
                idempotency_key, aggregate_id, correlation_id, outcome)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
           ON CONFLICT (consumer, event_id) DO NOTHING"#,
    )
    .bind(row.consumer)
    .bind(row.event_id)
    .bind(row.event_type)
    .bind(row.topic)
    .bind(row.partition)
    .bind(row.offset)
    .bind(row.idempotency_key)
    .bind(row.aggregate_id)
    .bind(row.correlation_id)
    .bind(row.outcome)
    .execute(conn)
    .await?;
    Ok(if done.rows_affected() == 1 { InboxInsert::Inserted } else { InboxInsert::Duplicate })
}

/// What the version guard decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionCheck {
    /// The version is newer than any applied: recorded, apply.
    Applied,
    /// The same version was applied already.
    Duplicate,
    /// A newer version was applied already.
    Stale {
        /// The version already applied.
        current: i64,
    },
}

/// Advance the aggregate's version to `version` if it is newer (R5).
pub async fn check_version(
    conn: &mut PgConnection,
    consumer: &str,
    aggregate_id: &str,
    version: i64,
) -> Result<VersionCheck, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO relay.aggregates AS a (consumer, aggregate_id, version)
         VALUES ($1, $2, $3)
         ON CONFLICT (consumer, aggregate_id) DO UPDATE
             SET version = EXCLUDED.version, updated_at = now()
             WHERE a.version IS NULL OR a.version < EXCLUDED.version",
    )
    .bind(consumer)
    .bind(aggregate_id)
    .bind(version)
    .execute(&mut *conn)
    .await?;
    if done.rows_affected() == 1 {
        return Ok(VersionCheck::Applied);
    }
    let current: i64 =
        sqlx::query_scalar("SELECT version FROM relay.aggregates WHERE consumer = $1 AND aggregate_id = $2")
            .bind(consumer)
            .bind(aggregate_id)
            .fetch_one(conn)
            .await?;
    Ok(if current == version { VersionCheck::Duplicate } else { VersionCheck::Stale { current } })
}

/// What the sequence guard decided (R6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SequenceCheck {
    /// `seq == last + 1`: recorded, apply.
    Applied,
    /// `seq <= last`: already applied.
    Duplicate {
        /// Last applied sequence number.
        last: i64,
    },
    /// `seq > last + 1`: an earlier event is missing; retry later, never apply.
    Gap {
        /// Last applied sequence number.
        last: i64,
    },
}

/// Apply sequence number `seq` of the aggregate if it is the next one.
pub async fn check_sequence(
    conn: &mut PgConnection,
    consumer: &str,
    aggregate_id: &str,
    seq: i64,
) -> Result<SequenceCheck, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE relay.aggregates SET last_seq = $3, updated_at = now()
         WHERE consumer = $1 AND aggregate_id = $2 AND last_seq = $3 - 1",
    )
    .bind(consumer)
    .bind(aggregate_id)
    .bind(seq)
    .execute(&mut *conn)
    .await?;
    if done.rows_affected() == 1 {
        return Ok(SequenceCheck::Applied);
    }
    if seq == 1 {
        let done = sqlx::query(
            "INSERT INTO relay.aggregates (consumer, aggregate_id, last_seq) VALUES ($1, $2, 1)
             ON CONFLICT (consumer, aggregate_id) DO NOTHING",
        )
        .bind(consumer)
        .bind(aggregate_id)
        .execute(&mut *conn)
        .await?;
        if done.rows_affected() == 1 {
            return Ok(SequenceCheck::Applied);
        }
    }
    let last: Option<i64> =
        sqlx::query_scalar("SELECT last_seq FROM relay.aggregates WHERE consumer = $1 AND aggregate_id = $2")
            .bind(consumer)
            .bind(aggregate_id)
            .fetch_optional(conn)
            .await?;
    let last = last.unwrap_or(0);
    Ok(if seq <= last { SequenceCheck::Duplicate { last } } else { SequenceCheck::Gap { last } })
}

/// Record a history row keyed by its source (R14); a replay writes nothing.
pub async fn record_history(
    conn: &mut PgConnection,
    consumer: &str,
    source_id: &str,
    action: &str,
    kind: HistoryKind,
    subject: Option<&str>,
    detail: &serde_json::Value,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO relay.history (consumer, source_id, action, kind, subject, detail)
         VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (consumer, source_id, action) DO NOTHING",
    )
    .bind(consumer)
    .bind(source_id)
    .bind(action)
    .bind(kind)
    .bind(subject)
    .bind(detail)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// A business counter's value (0 when never incremented).
pub async fn counter(conn: &mut PgConnection, consumer: &str, name: &str) -> Result<i64, sqlx::Error> {
    let v: Option<i64> =
        sqlx::query_scalar("SELECT sum(value)::int8 FROM relay.counters WHERE consumer = $1 AND name = $2")
            .bind(consumer)
            .bind(name)
            .fetch_one(conn)
            .await?;
    Ok(v.unwrap_or(0))
}

/// Whether (consumer, event id) is in the inbox, and with which outcome.
pub async fn outcome_of(
    conn: &mut PgConnection,
    consumer: &str,
    event_id: &str,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT outcome FROM relay.inbox WHERE consumer = $1 AND event_id = $2")
        .bind(consumer)
        .bind(event_id)
        .fetch_optional(conn)
        .await
}

/// Insert many inbox rows in one statement (`UNNEST`, `ON CONFLICT DO
/// NOTHING`); returns the event ids that were new. Ids must be distinct.
pub async fn insert_many<'a>(conn: &mut PgConnection, rows: &[NewInboxRow<'a>]) -> Result<Vec<String>, sqlx::Error> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let consumer = rows[0].consumer;
    let col = |f: fn(&NewInboxRow<'a>) -> Option<&'a str>| rows.iter().map(f).collect::<Vec<_>>();
    sqlx::query_scalar(
        r#"INSERT INTO relay.inbox
               (consumer, event_id, event_type, topic, partition, "offset",
                idempotency_key, aggregate_id, correlation_id, outcome)
           SELECT $1, * FROM unnest($2::text[], $3::text[], $4::text[], $5::int4[], $6::int8[],
                                    $7::text[], $8::text[], $9::text[], $10::text[])
           ON CONFLICT (consumer, event_id) DO NOTHING
           RETURNING event_id"#,
    )
    .bind(consumer)
    .bind(col(|r| Some(r.event_id)))
    .bind(col(|r| Some(r.event_type)))
    .bind(col(|r| Some(r.topic)))
    .bind(rows.iter().map(|r| r.partition).collect::<Vec<_>>())
    .bind(rows.iter().map(|r| r.offset).collect::<Vec<_>>())
    .bind(col(|r| r.idempotency_key))
    .bind(col(|r| r.aggregate_id))
    .bind(col(|r| r.correlation_id))
    .bind(rows.iter().map(|r| r.outcome).collect::<Vec<_>>())
    .fetch_all(conn)
    .await
}

/// Claim many business idempotency keys in one statement; returns the keys
/// that were claimed. Keys must be distinct; `(key, event_id)` pairs.
pub async fn claim_idempotency_keys(
    conn: &mut PgConnection,
    consumer: &str,
    pairs: &[(&str, &str)],
) -> Result<Vec<String>, sqlx::Error> {
    if pairs.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_scalar(
        "INSERT INTO relay.idempotency_keys (consumer, idempotency_key, event_id)
         SELECT $1, * FROM unnest($2::text[], $3::text[])
         ON CONFLICT (consumer, idempotency_key) DO NOTHING
         RETURNING idempotency_key",
    )
    .bind(consumer)
    .bind(pairs.iter().map(|p| p.0).collect::<Vec<_>>())
    .bind(pairs.iter().map(|p| p.1).collect::<Vec<_>>())
    .fetch_all(conn)
    .await
}

/// Set the outcome of already-inserted inbox rows.
pub async fn set_outcome_many(
    conn: &mut PgConnection,
    consumer: &str,
    event_ids: &[&str],
    outcome: InboxOutcome,
) -> Result<(), sqlx::Error> {
    if event_ids.is_empty() {
        return Ok(());
    }
    sqlx::query("UPDATE relay.inbox SET outcome = $3 WHERE consumer = $1 AND event_id = ANY($2)")
        .bind(consumer)
        .bind(event_ids)
        .bind(outcome)
        .execute(conn)
        .await?;
    Ok(())
}

/// Add to several business counters at once (`$1` consumer, `$2`…`$4`
/// names, shards and increments; each (name, shard) once). Written only
/// where new inbox rows were inserted in the same transaction, so a counter
/// counts unique events (R20); the shard is the records' partition, so
/// partitions written side by side never wait for each other's counter row
/// (migration 0005), and the value is the sum ([`counter`]).
pub(crate) const ADD_TO_COUNTERS: &str = "INSERT INTO relay.counters (consumer, name, shard, value)
         SELECT $1, * FROM unnest($2::text[], $3::int4[], $4::int8[])
         ON CONFLICT (consumer, name, shard) DO UPDATE SET value = relay.counters.value + EXCLUDED.value";

/// Bind the parameters of [`ADD_TO_COUNTERS`] to `q`, after those it has.
pub(crate) fn bind_counters<'q>(
    q: crate::PgQuery<'q>,
    consumer: &'q str,
    adds: &[(&'q str, i32, i64)],
) -> crate::PgQuery<'q> {
    q.bind(consumer)
        .bind(adds.iter().map(|a| a.0).collect::<Vec<_>>())
        .bind(adds.iter().map(|a| a.1).collect::<Vec<_>>())
        .bind(adds.iter().map(|a| a.2).collect::<Vec<_>>())
}
