//! Recording what became of a claimed intent, fenced by its lease token;
//! leases extended, released, rescued when they expire.

/// How one attempt ended, for the audit row and the intent's last_* columns.
#[derive(Debug, Clone)]
pub struct AttemptRecord {
    /// When the request was sent (`None` if no request was made).
    pub started_at: Option<DateTime<Utc>>,
    /// How it ended; whether it may have been applied follows from it.
    pub outcome: AttemptOutcome,
    /// HTTP status, if the provider answered.
    pub status: Option<i32>,
    /// What went wrong, if anything did.
    pub error_class: Option<ErrorClass>,
    /// Error text (never the response body in full).
    pub error: Option<String>,
}

/// Whether a fenced update found our lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fenced {
    /// The row was ours and is updated.
    Done,
    /// The lease was rescued (and maybe re-claimed): nothing was written.
    LeaseLost,
}

use crate::Unreadable;
use chrono::{DateTime, Utc};
pub use relay_core::retry::{AttemptOutcome, ErrorClass, NextState};
use sqlx::PgConnection;
use uuid::Uuid;

/// The outcome of one claimed intent's attempt, to record.
#[derive(Debug, Clone)]
pub struct Finish {
    /// Intent id.
    pub id: Uuid,
    /// The claim's fencing token.
    pub token: Uuid,
    /// Where the intent goes.
    pub next: NextState,
    /// The attempt, for the audit row and the intent's last_* columns.
    pub attempt: AttemptRecord,
    /// The attempt's number (the intent's `attempts` at claim).
    pub attempt_no: i32,
    /// Worker that made it.
    pub worker: String,
    /// Whether an attempt was made at all (false when the claim found the
    /// budget already spent): only made attempts get an audit row.
    pub attempted: bool,
}

/// The statement of [`finish_many`]; public so a test can check its plan.
///
/// Fenced on the lease token alone: a row holds a token only while it is
/// running (a constraint, migration 0004). Adding `state = 'running'` lets the
/// planner pick the `intents_leases` partial index, which the statistics
/// think is near empty when most of the table is finished, and read every
/// running row once per row finished instead of probing the primary key.
///
/// `last_error` is the attempt's error whatever the state: a call that
/// succeeded has none, and an operator's resolution as succeeded keeps who
/// resolved it and what the provider said there.
pub const FINISH: &str = "WITH u AS (
             SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::float8[], $5::int4[], $6::text[],
                                  $7::text[], $8::text[], $9::timestamptz[], $10::int4[], $11::text[], $12::bool[],
                                  $13::bool[])
                 AS u(id, token, state, delay, status, error, error_class, outcome, started_at, attempt, worker, attempted,
                      uncertain)
         ), done AS (
             UPDATE relay.intents i
                SET state = u.state,
                    next_attempt_at = CASE WHEN u.state = 'pending'
                                           THEN now() + make_interval(secs => u.delay) ELSE i.next_attempt_at END,
                    finished_at = CASE WHEN u.state = 'pending' THEN NULL ELSE now() END,
                    last_status = CASE WHEN u.state IN ('dead', 'uncertain') THEN COALESCE(u.status, i.last_status)
                                       ELSE u.status END,
                    last_error = u.error,
                    last_error_class = u.error_class,
                    ever_uncertain = i.ever_uncertain OR u.uncertain,
                    -- One that dies never sent (its budget ran out while it
                    -- waited behind its key) releases the key: it holds
                    -- nothing back, and the ones after it would each die too.
                    -- One that may have been sent (an uncertain one an
                    -- operator resolved as failed) was sent: it holds it.
                    holds_key = i.holds_key AND NOT (u.state = 'dead' AND NOT u.attempted AND i.attempts <= 1
                                                     AND NOT i.ever_uncertain),
                    lease_token = NULL, locked_until = NULL, locked_by = NULL
               FROM u
              WHERE i.id = u.id AND i.lease_token = u.token
             RETURNING i.id, u.token, u.status, u.error, u.error_class, u.outcome, u.started_at, u.attempt,
                       u.worker, u.attempted
         ), audited AS (
             INSERT INTO relay.intent_attempts
                 (intent_id, attempt, worker, lease_token, started_at, finished_at, outcome, status, error_class, error)
             SELECT id, attempt, worker, token, started_at, now(), outcome, status, error_class, error
               FROM done
              WHERE attempted
         )
         SELECT id, token FROM done";

/// Keep the provider's answers that successes' `on_success` effects were
/// rendered from, beside them (`relay.intents.response`); in the
/// transaction that records those effects, after [`finish_many`] fenced it.
pub async fn keep_answers(conn: &mut PgConnection, answers: &[(Uuid, &serde_json::Value)]) -> Result<(), sqlx::Error> {
    if answers.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = answers.iter().map(|a| a.0).collect();
    let values: Vec<serde_json::Value> = answers.iter().map(|a| a.1.clone()).collect();
    sqlx::query(
        "UPDATE relay.intents i SET response = a.response \
         FROM UNNEST($1::uuid[], $2::jsonb[]) AS a(id, response) WHERE i.id = a.id",
    )
    .bind(&ids)
    .bind(&values)
    .execute(conn)
    .await?;
    Ok(())
}

/// The provider's answer kept for intent `id` ([`keep_answers`]), if any.
pub async fn answer(conn: &mut PgConnection, id: Uuid) -> Result<Option<serde_json::Value>, sqlx::Error> {
    sqlx::query_scalar("SELECT response FROM relay.intents WHERE id = $1")
        .bind(id)
        .fetch_optional(conn)
        .await
        .map(Option::flatten)
}

/// Record many attempts in one statement, each fenced by its lease token:
/// the intent row moves (succeeded / pending again / dead) and the attempt's
/// audit row is written. Returns the (id, lease token) pairs whose lease was
/// still held: an outcome counts only for the claim it was made under, so a
/// stale completion of an intent beside a fresh one of the same intent
/// matches nothing. The others were rescued meanwhile and nothing was
/// written for them. Run it
/// where rows are found by key: alone (its own transaction) or in a
/// transaction on a [`crate::FinishPool`] connection, as the dispatcher does,
/// or in a transaction begun with [`crate::begin_by_key`].
pub async fn finish_many(conn: &mut PgConnection, items: &[Finish]) -> Result<Vec<(Uuid, Uuid)>, sqlx::Error> {
    if items.is_empty() {
        return Ok(Vec::new());
    }
    let delay = |f: &Finish| match f.next {
        NextState::Retry(d) => d.as_secs_f64(),
        _ => 0.0,
    };
    sqlx::query_as(FINISH)
        .bind(items.iter().map(|f| f.id).collect::<Vec<_>>())
        .bind(items.iter().map(|f| f.token).collect::<Vec<_>>())
        .bind(items.iter().map(|f| f.next.state()).collect::<Vec<_>>())
        .bind(items.iter().map(delay).collect::<Vec<_>>())
        .bind(items.iter().map(|f| f.attempt.status).collect::<Vec<_>>())
        .bind(items.iter().map(|f| f.attempt.error.clone()).collect::<Vec<_>>())
        .bind(items.iter().map(|f| f.attempt.error_class).collect::<Vec<_>>())
        .bind(items.iter().map(|f| f.attempt.outcome).collect::<Vec<_>>())
        .bind(items.iter().map(|f| f.attempt.started_at).collect::<Vec<_>>())
        .bind(items.iter().map(|f| f.attempt_no).collect::<Vec<_>>())
        .bind(items.iter().map(|f| f.worker.as_str()).collect::<Vec<_>>())
        .bind(items.iter().map(|f| f.attempted).collect::<Vec<_>>())
        .bind(items.iter().map(|f| f.attempt.outcome.may_have_applied()).collect::<Vec<_>>())
        .fetch_all(conn)
        .await
}

/// Finish claimed intents whose stored columns cannot be read
/// ([`Claim::unreadable`](crate::Claim::unreadable)) as dead, fenced by their lease tokens, with
/// [`Unreadable::reason`] as their last error (class `request`: a request
/// that cannot be expressed); their `on_dead` effects, which are among
/// what cannot be read, are not recorded. One an earlier attempt of which
/// may have been applied (sent from the consumer's hand-over before it was
/// ever read back) ends uncertain instead: never dead after such an attempt. Dead,
/// such a row holds its ordering key only if its route said so
/// (`on_poison = "hold_key"`, released by `relay intents skip`). Runs in
/// its own transaction: `conn` must not be in one. Returns how many it
/// finished (a row whose lease was lost meanwhile is left as it is).
pub async fn finish_unreadable(conn: &mut PgConnection, rows: &[Unreadable]) -> Result<u64, sqlx::Error> {
    if rows.is_empty() {
        return Ok(0);
    }
    let finish = sqlx::query(
        "UPDATE relay.intents i
            SET state = CASE WHEN i.ever_uncertain THEN 'uncertain' ELSE 'dead' END, finished_at = now(),
                last_error = u.error || CASE WHEN i.ever_uncertain
                    THEN '; an earlier attempt may have been applied: left uncertain, on_dead not recorded'
                    ELSE '' END,
                last_error_class = $4, lease_token = NULL, locked_until = NULL, locked_by = NULL
           FROM unnest($1::uuid[], $2::uuid[], $3::text[]) AS u(id, token, error)
          WHERE i.id = u.id AND i.lease_token = u.token",
    )
    .bind(rows.iter().map(|u| u.id).collect::<Vec<_>>())
    .bind(rows.iter().map(|u| u.lease_token).collect::<Vec<_>>())
    .bind(rows.iter().map(Unreadable::reason).collect::<Vec<_>>())
    .bind(ErrorClass::Request);
    Ok(crate::execute_by_key(conn, finish).await?.rows_affected())
}

/// Extend the leases of claims (`(id, lease token)` pairs) to `lease` from
/// now, fenced by their tokens: an outcome that waits to be recorded (its
/// events' ordering keys are held) keeps its claim meanwhile, so that its
/// call is not rescued and made again. Returns the pairs whose leases were
/// still held. Runs in its own transaction: `conn` must not be in one.
pub async fn extend_leases(
    conn: &mut PgConnection,
    claims: &[(Uuid, Uuid)],
    lease: std::time::Duration,
) -> Result<Vec<(Uuid, Uuid)>, sqlx::Error> {
    if claims.is_empty() {
        return Ok(Vec::new());
    }
    let mut tx = crate::begin_by_key(conn).await?;
    let held = sqlx::query_as(
        "UPDATE relay.intents i SET locked_until = now() + make_interval(secs => $3)
           FROM unnest($1::uuid[], $2::uuid[]) AS c(id, token)
          WHERE i.id = c.id AND i.lease_token = c.token AND i.state = 'running'
          RETURNING i.id, i.lease_token",
    )
    .bind(claims.iter().map(|c| c.0).collect::<Vec<_>>())
    .bind(claims.iter().map(|c| c.1).collect::<Vec<_>>())
    .bind(lease.as_secs_f64())
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(held)
}

/// Give back a claim whose attempt was never started: pending again, the
/// attempt not counted (fenced). `locked_by` stays, marking the intent as
/// claimed before: the age budget restarts at a first claim only, not at
/// every claim after a give-back, or throttled calls would carry it on
/// for ever. Runs in its own transaction ([`crate::begin_by_key`]): `conn`
/// must not be in one.
pub async fn release(conn: &mut PgConnection, id: Uuid, token: Uuid) -> Result<Fenced, sqlx::Error> {
    let release = sqlx::query(
        "UPDATE relay.intents
            SET state = 'pending', attempts = attempts - 1, lease_token = NULL, locked_until = NULL
          WHERE id = $1 AND lease_token = $2",
    )
    .bind(id)
    .bind(token);
    let done = crate::execute_by_key(conn, release).await?;
    Ok(if done.rows_affected() == 1 { Fenced::Done } else { Fenced::LeaseLost })
}

/// Record one attempt (see [`finish_many`]).
pub async fn finish(conn: &mut PgConnection, item: Finish) -> Result<Fenced, sqlx::Error> {
    let done = finish_many(conn, std::slice::from_ref(&item)).await?;
    Ok(if done.is_empty() { Fenced::LeaseLost } else { Fenced::Done })
}

/// Return intents whose lease expired (their worker crashed or stalled) to
/// pending, recording the lost attempt as `lease_expired`. The attempt stays
/// counted, so an intent that kills every worker still runs out of budget.
/// An uncertain intent an operator's resolution took ([`take_uncertain`](super::take_uncertain):
/// the only running rows that keep their `finished_at`) goes back to
/// uncertain, never to pending: a resolution cut off must not become a call.
///
/// Only ids are read here, never the JSON columns a claim decodes: no row
/// can make a rescue fail.
pub async fn rescue_expired(conn: &mut PgConnection, limit: i64) -> Result<Vec<Uuid>, sqlx::Error> {
    let lost = AttemptOutcome::LeaseExpired;
    sqlx::query_scalar(
        "WITH expired AS (
             SELECT id, lease_token, attempts, locked_by FROM relay.intents
              WHERE state = 'running' AND locked_until < now()
              ORDER BY locked_until LIMIT $1
              FOR UPDATE SKIP LOCKED
         ), audited AS (
             INSERT INTO relay.intent_attempts (intent_id, attempt, worker, lease_token, finished_at, outcome, error_class, error)
             SELECT id, attempts, coalesce(locked_by, ''), lease_token, now(), $2, $3,
                    'the worker lost its lease (crashed, stalled or shut down mid-call)'
               FROM expired
             ON CONFLICT (intent_id, attempt) DO NOTHING
         )
         UPDATE relay.intents i
            SET state = CASE WHEN i.finished_at IS NULL THEN 'pending' ELSE 'uncertain' END,
                next_attempt_at = now(), lease_token = NULL, locked_until = NULL,
                locked_by = NULL, last_error_class = $3, ever_uncertain = i.ever_uncertain OR $4,
                last_error = 'lease expired: the worker holding it was lost'
           FROM expired WHERE i.id = expired.id
         RETURNING i.id",
    )
    .bind(limit)
    .bind(lost)
    .bind(ErrorClass::LeaseExpired)
    .bind(lost.may_have_applied())
    .fetch_all(conn)
    .await
}
