//! Outbox rows: Kafka records to publish, claimed by publishers with a lease
//! and marked published only after the broker acknowledged them (R10).

use std::time::Duration;

use relay_core::{Header, OutboxRecord};
use serde_json::Value;
use sqlx::{FromRow, PgConnection, Row};
use uuid::Uuid;

use crate::{Claim, ClaimConnection, FinishConnection, headers};

pub use relay_core::OutboxState;

/// An outbox row as shown to operators (its payload's size, not its bytes).
#[derive(Debug, Clone, FromRow, serde::Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct OutboxView {
    /// Id (the CloudEvents id of events).
    pub id: Uuid,
    /// Write order.
    pub seq: i64,
    pub consumer: String,
    /// What wrote it: an event id, or `intent id:outcome`.
    pub source_id: String,
    /// The route's emit or dead-letter action.
    pub action: String,
    pub topic: String,
    /// Event type, for events.
    pub event_type: Option<String>,
    pub ordering_key: Option<String>,
    /// Where it is.
    pub state: OutboxState,
    /// Attempts so far.
    pub attempts: i32,
    pub last_error: Option<String>,
    /// Payload size in bytes.
    pub payload_bytes: Option<i32>,
    /// Rows of the same topic and ordering key written after it and not published yet.
    pub waiting_behind: i64,
    /// Written at.
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub published_at: Option<chrono::DateTime<chrono::Utc>>,
}

const VIEW: &str = "o.id, o.seq, o.consumer, o.source_id, o.action, o.topic, o.event_type, o.ordering_key, o.state,
    o.attempts, o.last_error, octet_length(o.payload) AS payload_bytes,
    CASE WHEN o.ordering_key IS NULL OR o.state IN ('published', 'skipped') THEN 0 ELSE (
        SELECT count(*) FROM relay.outbox l
         WHERE l.topic = o.topic AND l.ordering_key = o.ordering_key AND l.consumer = o.consumer
           AND l.seq > o.seq AND l.state IN ('pending', 'running', 'dead')) END AS waiting_behind,
    o.created_at, o.published_at";

/// Outbox rows of `consumer` in `state` (any, if `None`) to `topic` (any),
/// written before `before`, newest first.
pub async fn list(
    conn: &mut PgConnection,
    consumer: &str,
    state: Option<OutboxState>,
    topic: Option<&str>,
    before: Option<chrono::DateTime<chrono::Utc>>,
    limit: i64,
) -> Result<Vec<OutboxView>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {VIEW} FROM relay.outbox o
          WHERE o.consumer = $1 AND ($2::text IS NULL OR o.state = $2) AND ($3::text IS NULL OR o.topic = $3)
            AND ($4::timestamptz IS NULL OR o.created_at < $4)
          ORDER BY o.created_at DESC, o.seq DESC LIMIT $5"
    ))
    .bind(consumer)
    .bind(state.map(OutboxState::as_str))
    .bind(topic)
    .bind(before)
    .bind(limit)
    .fetch_all(conn)
    .await
}

/// One outbox row of `consumer`.
pub async fn get(conn: &mut PgConnection, consumer: &str, id: Uuid) -> Result<Option<OutboxView>, sqlx::Error> {
    sqlx::query_as(&format!("SELECT {VIEW} FROM relay.outbox o WHERE o.id = $1 AND o.consumer = $2"))
        .bind(id)
        .bind(consumer)
        .fetch_optional(conn)
        .await
}

/// What an operator's action on a dead outbox row did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acted {
    /// Done.
    Done,
    /// Left as it is: not dead, or no such row of the consumer.
    NotDead,
}

/// Queue a dead row of `consumer` again (a fresh attempt count; same id, so
/// downstream deduplication still sees one event). It holds its key, so it
/// is published before the rows of its key written after it.
pub async fn replay(conn: &mut PgConnection, consumer: &str, id: Uuid) -> Result<Acted, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE relay.outbox SET state = 'pending', attempts = 0, next_attempt_at = now()
          WHERE id = $1 AND consumer = $2 AND state = 'dead'",
    )
    .bind(id)
    .bind(consumer)
    .execute(conn)
    .await?;
    Ok(if done.rows_affected() == 1 { Acted::Done } else { Acted::NotDead })
}

/// Give up on a dead row of `consumer`: `skipped`, never published, and the
/// rows of its key written after it go on. Its error is kept.
pub async fn skip(conn: &mut PgConnection, consumer: &str, id: Uuid) -> Result<Acted, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE relay.outbox SET state = 'skipped', last_error = concat_ws('; ', last_error, 'skipped by an operator')
          WHERE id = $1 AND consumer = $2 AND state = 'dead'",
    )
    .bind(id)
    .bind(consumer)
    .execute(conn)
    .await?;
    Ok(if done.rows_affected() == 1 { Acted::Done } else { Acted::NotDead })
}

/// Insert an outbox record; `false` when it already exists (same derived id).
pub async fn insert(
    conn: &mut PgConnection,
    consumer: &str,
    source_id: &str,
    r: &OutboxRecord,
) -> Result<bool, sqlx::Error> {
    crate::ordering::lock(&mut *conn, consumer, crate::ordering::outbox_keys(std::iter::once(r))).await?;
    let done = sqlx::query(
        "INSERT INTO relay.outbox
             (id, consumer, source_id, action, topic, key, headers, payload, event_type, ordering_key)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
         ON CONFLICT (id) DO NOTHING",
    )
    .bind(r.id)
    .bind(consumer)
    .bind(source_id)
    .bind(&r.action)
    .bind(&r.topic)
    .bind(&r.key)
    .bind(headers::to_json(&r.headers))
    .bind(&r.payload)
    .bind(&r.event_type)
    .bind(&r.ordering_key)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// A claimed outbox row.
#[derive(Debug, Clone, FromRow)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct ClaimedRow {
    /// Id (the CloudEvents id of events).
    pub id: Uuid,
    /// Insertion order: rows are produced in this order.
    pub seq: i64,
    /// Fencing token.
    pub lease_token: Uuid,
    pub topic: String,
    pub key: Option<Vec<u8>>,
    /// Headers (see [`crate::headers`]).
    pub headers: Value,
    /// Value.
    pub payload: Option<Vec<u8>>,
    pub event_type: Option<String>,
    /// Ordering key: the next row of this topic and key becomes claimable
    /// once this one is published.
    pub ordering_key: Option<String>,
    /// Attempts including this one.
    pub attempts: i32,
}

impl ClaimedRow {
    /// Headers decoded.
    pub fn headers(&self) -> Vec<Header> {
        headers::from_json(&self.headers)
    }
}

/// Claim up to `limit` due rows, oldest first. A row whose topic and
/// ordering key has an earlier unpublished row waits for it, so events of one
/// key reach the partition in the order they were written. Commits by itself,
/// on a claim connection ([`crate::ClaimPool`]): one round trip. A short
/// claim also says when the next row comes due ([`Claim::next_due`]).
pub async fn claim(
    conn: &mut ClaimConnection,
    consumer: &str,
    limit: i64,
    lease: Duration,
) -> Result<Claim<ClaimedRow>, sqlx::Error> {
    claim_after(conn, consumer, limit, lease, None).await
}

/// [`claim`], taking only rows whose `seq` is above `after` (`None`: from
/// the start); the rows come back in `seq` order, so the last one's is where
/// the next claim of a drain may start. Why, and what a claim after a
/// position passes over, as for [`crate::intents::claim_after`]: here a row
/// given back for a retry or rescued, and the next row of an ordering key
/// whose earlier row was still unpublished when the claim passed it — which
/// has a higher `seq` than that earlier row, so a claim after the earlier
/// row's `seq` finds it (the publisher's lanes move their shared position
/// back to it when they publish it).
pub async fn claim_after(
    conn: &mut ClaimConnection,
    consumer: &str,
    limit: i64,
    lease: Duration,
    after: Option<i64>,
) -> Result<Claim<ClaimedRow>, sqlx::Error> {
    let query = sqlx::query(CLAIM)
        .bind(limit)
        .bind(lease.as_secs_f64())
        .bind(after.unwrap_or(i64::MIN))
        .bind(consumer)
        .bind(limit.saturating_mul(WINDOW));
    let mut claim: Claim<ClaimedRow> = crate::fetch_claim(conn.as_conn(), query, false).await?;
    claim.rows.sort_by_key(|r| r.seq);
    Ok(claim)
}

/// Where the claim after `claim` (of at most `limit` rows) may start: after
/// its last row if it was full, after the window it examined if it stopped
/// there ([`Claim::passed`]); `None`, from the start, when it reached the end.
pub fn resume_after(claim: &Claim<ClaimedRow>, limit: usize) -> Option<i64> {
    match claim.rows.last() {
        Some(last) if claim.rows.len() == limit => Some(last.seq),
        _ => claim.passed,
    }
}

/// How many pending rows a claim examines, in claims' worth of rows: one
/// (64 keys drained at 3 347 rows/s, 1 242 with four; unordered rows fill
/// a claim from its first window either way).
pub const WINDOW: i64 = 1;

/// The claim statement ([`claim`]); public so a test can check its plan.
/// `$1` limit, `$2` lease in seconds, `$3` the `seq` to claim after (the
/// lowest `int8` for the start; an Index Cond of `outbox_pending_by_seq`,
/// where the scan starts), `$4` the consumer whose rows these are, `$5` the
/// window: the most pending rows it examines. Rows and `next_due` as for
/// [`crate::intents::CLAIM`].
///
/// The window keeps a claim's cost bounded when most pending rows wait
/// behind an earlier row of their key: without it, a backlog of many rows on
/// few keys was read whole on every claim, each row with its key's check,
/// to take one row per key (495 rows/s drained on 64 keys). A claim that
/// examined a full window without filling its batch says where the window
/// ended (`passed`), and the next claim goes on from there.
///
/// A `dead` row holds its key like an unpublished one: the
/// rows after it wait until an operator replays or skips it (`relay
/// outbox`), so a replayed row is never published after rows written after it.
pub const CLAIM: &str = "WITH win AS MATERIALIZED (
             SELECT o.seq FROM relay.outbox o
              WHERE o.state = 'pending' AND o.seq > $3::int8 AND o.consumer = $4::text
              ORDER BY o.seq
              LIMIT $5
         ), bound AS (
             SELECT max(win.seq) AS edge, count(*) AS examined FROM win
         ), due AS (
             SELECT o.id FROM relay.outbox o
              WHERE o.state = 'pending' AND o.next_attempt_at <= now() AND o.seq > $3::int8
                AND o.seq <= (SELECT edge FROM bound)
                AND o.consumer = $4::text
                AND (o.ordering_key IS NULL OR NOT EXISTS (
                        SELECT 1 FROM relay.outbox e
                         WHERE e.topic = o.topic AND e.ordering_key = o.ordering_key AND e.consumer = o.consumer
                           AND e.seq < o.seq AND e.state IN ('pending', 'running', 'dead')))
              ORDER BY o.seq
              LIMIT $1
              FOR UPDATE SKIP LOCKED
         ), claimed AS (
             UPDATE relay.outbox o
                SET state = 'running', attempts = o.attempts + 1, lease_token = gen_random_uuid(),
                    locked_until = now() + make_interval(secs => $2)
               FROM due WHERE o.id = due.id
             RETURNING o.id, o.seq, o.lease_token, o.topic, o.key, o.headers, o.payload, o.event_type,
                       o.ordering_key, o.attempts
         ), next AS (
             SELECT CASE WHEN (SELECT count(*) FROM claimed) < $1 THEN (
                        SELECT min(next_attempt_at) FROM relay.outbox
                         WHERE state = 'pending' AND next_attempt_at > now() AND consumer = $4::text) END AS next_due
         )
         SELECT c.*, next.next_due,
                CASE WHEN bound.examined = $5 AND (SELECT count(*) FROM claimed) < $1 THEN bound.edge END AS passed
           FROM next CROSS JOIN bound LEFT JOIN claimed c ON true";

/// The statement of [`mark_published`]; public so a test can check its plan.
/// Fenced on the token alone, for the reason given at
/// [`crate::intents::FINISH`].
pub const MARK_PUBLISHED: &str = "UPDATE relay.outbox o
            SET state = 'published', published_at = now(), lease_token = NULL, locked_until = NULL,
                last_error = NULL
           FROM unnest($1::uuid[], $2::uuid[]) AS f(id, token)
          WHERE o.id = f.id AND o.lease_token = f.token";

/// Mark rows published, each only if we still hold its lease. Returns how
/// many were ours. One statement, its own transaction, on a finish
/// connection ([`crate::FinishPool`]): one round trip.
pub async fn mark_published(conn: &mut FinishConnection, ids: &[Uuid], tokens: &[Uuid]) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(MARK_PUBLISHED).bind(ids).bind(tokens).execute(&mut **conn).await?;
    Ok(done.rows_affected())
}

/// Put a row back to pending after a failed delivery (fenced). One
/// statement, its own transaction, on a finish connection
/// ([`crate::FinishPool`]).
pub async fn schedule_retry(
    conn: &mut FinishConnection,
    id: Uuid,
    token: Uuid,
    delay: Duration,
    error: &str,
) -> Result<bool, sqlx::Error> {
    let retry = sqlx::query(
        "UPDATE relay.outbox
            SET state = 'pending', next_attempt_at = now() + make_interval(secs => $3),
                last_error = $4, lease_token = NULL, locked_until = NULL
          WHERE id = $1 AND lease_token = $2",
    )
    .bind(id)
    .bind(token)
    .bind(delay.as_secs_f64())
    .bind(error);
    let done = retry.execute(&mut **conn).await?;
    Ok(done.rows_affected() == 1)
}

/// End a row the broker can never take (fenced): `dead`, with the error.
/// One statement, its own transaction, on a finish connection.
pub async fn mark_dead(conn: &mut FinishConnection, id: Uuid, token: Uuid, error: &str) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE relay.outbox SET state = 'dead', last_error = $3, lease_token = NULL, locked_until = NULL
          WHERE id = $1 AND lease_token = $2",
    )
    .bind(id)
    .bind(token)
    .bind(error)
    .execute(&mut **conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Return rows whose publisher lost its lease to pending.
pub async fn rescue_expired(conn: &mut PgConnection, limit: i64) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "WITH expired AS (
             SELECT id FROM relay.outbox WHERE state = 'running' AND locked_until < now()
              ORDER BY locked_until LIMIT $1 FOR UPDATE SKIP LOCKED
         )
         UPDATE relay.outbox o
            SET state = 'pending', next_attempt_at = now(), lease_token = NULL, locked_until = NULL,
                last_error = 'lease expired: the publisher holding it was lost'
           FROM expired WHERE o.id = expired.id",
    )
    .bind(limit)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// Insert many outbox records in one statement: `(source_id, record)` pairs.
/// Returns the ids that were new.
pub async fn insert_many(
    conn: &mut PgConnection,
    consumer: &str,
    rows: &[(&str, &OutboxRecord)],
) -> Result<Vec<Uuid>, sqlx::Error> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    crate::ordering::lock(&mut *conn, consumer, crate::ordering::outbox_keys(rows.iter().map(|(_, r)| *r))).await?;
    insert_locked(conn, consumer, rows).await
}

/// [`insert_many`] by a caller that holds the rows' ordering keys already
/// ([`crate::ordering::try_lock_slots`]).
pub async fn insert_locked(
    conn: &mut PgConnection,
    consumer: &str,
    rows: &[(&str, &OutboxRecord)],
) -> Result<Vec<Uuid>, sqlx::Error> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let rows = bind_many(sqlx::query(INSERT_MANY), consumer, rows).fetch_all(conn).await?;
    rows.iter().map(|r| r.try_get(0)).collect()
}

/// The statement of [`insert_many`] (`$1` consumer, `$2`…`$10`: one array
/// per column).
pub(crate) const INSERT_MANY: &str = "INSERT INTO relay.outbox
             (id, consumer, source_id, action, topic, key, headers, payload, event_type, ordering_key)
         SELECT id, $1, source_id, action, topic, key, headers, payload, event_type, ordering_key
           FROM unnest($2::uuid[], $3::text[], $4::text[], $5::text[], $6::bytea[], $7::jsonb[], $8::bytea[],
                       $9::text[], $10::text[])
                AS t(id, source_id, action, topic, key, headers, payload, event_type, ordering_key)
         ON CONFLICT (id) DO NOTHING
         RETURNING id";

/// Bind the parameters of [`INSERT_MANY`] to `q`, after those it has.
pub(crate) fn bind_many<'q>(
    q: crate::PgQuery<'q>,
    consumer: &'q str,
    rows: &[(&'q str, &'q OutboxRecord)],
) -> crate::PgQuery<'q> {
    q.bind(consumer)
        .bind(rows.iter().map(|(_, r)| r.id).collect::<Vec<_>>())
        .bind(rows.iter().map(|(s, _)| *s).collect::<Vec<_>>())
        .bind(rows.iter().map(|(_, r)| r.action.as_str()).collect::<Vec<_>>())
        .bind(rows.iter().map(|(_, r)| r.topic.as_str()).collect::<Vec<_>>())
        .bind(rows.iter().map(|(_, r)| r.key.as_deref()).collect::<Vec<_>>())
        .bind(rows.iter().map(|(_, r)| headers::to_json(&r.headers)).collect::<Vec<_>>())
        .bind(rows.iter().map(|(_, r)| r.payload.as_deref()).collect::<Vec<_>>())
        .bind(rows.iter().map(|(_, r)| r.event_type.as_deref()).collect::<Vec<_>>())
        .bind(rows.iter().map(|(_, r)| r.ordering_key.as_deref()).collect::<Vec<_>>())
}
