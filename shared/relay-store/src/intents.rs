//! Intents: external calls to make, claimed by dispatchers.
//!
//! Lifecycle (see the migration for the column comments):
//!
//! ```text
//! pending --claim--> running --success--> succeeded
//!                       |-----retry-----> pending (next_attempt_at later)
//!                       |-----dead------> dead
//!                       '--lease expired (rescue)--> pending
//! ```
//!
//! Every transition out of `running` names the lease token it holds; a worker
//! whose lease was rescued and re-claimed finds zero rows and records nothing.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgConnection};
use uuid::Uuid;

/// An intent to insert.
#[derive(Debug, Clone)]
pub struct NewIntent {
    /// Derived id (R7).
    pub id: Uuid,
    /// Consumer that produced it.
    pub consumer: String,
    /// Input event id.
    pub source_event_id: String,
    /// Action name.
    pub action: String,
    /// Endpoint name.
    pub endpoint: String,
    /// HTTP method.
    pub method: String,
    /// Path under the endpoint's base URL.
    pub path: String,
    /// JSON body.
    pub body: Option<Value>,
    /// Extra headers, as a JSON object.
    pub headers: Value,
    /// Idempotency key sent on every attempt (R8).
    pub idempotency_key: String,
    /// Per-key ordering.
    pub ordering_key: Option<String>,
    /// Attempt budget.
    pub max_attempts: i32,
    /// Age budget.
    pub max_age: Duration,
    /// Effects on success (serialized [`relay_core::Outcome`]).
    pub on_success: Value,
    /// Effects on death.
    pub on_dead: Value,
    /// CloudEvents source for outcome events.
    pub emit_source: String,
    /// Aggregate id.
    pub aggregate_id: Option<String>,
    /// Correlation id.
    pub correlation_id: Option<String>,
    /// Causation id (the input event).
    pub causation_id: Option<String>,
    /// W3C trace context.
    pub traceparent: Option<String>,
}

/// Insert an intent; `false` when it already exists (a reprocessed input).
pub async fn insert(conn: &mut PgConnection, i: &NewIntent) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO relay.intents
             (id, consumer, source_event_id, action, endpoint, method, path, body, request_headers,
              idempotency_key, ordering_key, max_attempts, expires_at, on_success, on_dead,
              emit_source, aggregate_id, correlation_id, causation_id, traceparent)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12,
                 now() + make_interval(secs => $13), $14, $15, $16, $17, $18, $19, $20)
         ON CONFLICT (id) DO NOTHING",
    )
    .bind(i.id)
    .bind(&i.consumer)
    .bind(&i.source_event_id)
    .bind(&i.action)
    .bind(&i.endpoint)
    .bind(&i.method)
    .bind(&i.path)
    .bind(&i.body)
    .bind(&i.headers)
    .bind(&i.idempotency_key)
    .bind(&i.ordering_key)
    .bind(i.max_attempts)
    .bind(i.max_age.as_secs_f64())
    .bind(&i.on_success)
    .bind(&i.on_dead)
    .bind(&i.emit_source)
    .bind(&i.aggregate_id)
    .bind(&i.correlation_id)
    .bind(&i.causation_id)
    .bind(&i.traceparent)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// A claimed intent: everything a worker needs to make the call.
#[derive(Debug, Clone, FromRow)]
pub struct ClaimedIntent {
    /// Intent id.
    pub id: Uuid,
    /// Fencing token of this claim.
    pub lease_token: Uuid,
    /// Consumer that produced it.
    pub consumer: String,
    /// Input event id.
    pub source_event_id: String,
    /// Action name.
    pub action: String,
    /// Endpoint name.
    pub endpoint: String,
    /// HTTP method.
    pub method: String,
    /// Path.
    pub path: String,
    /// JSON body.
    pub body: Option<Value>,
    /// Extra headers (JSON object).
    pub request_headers: Value,
    /// Idempotency key.
    pub idempotency_key: String,
    /// Ordering key.
    pub ordering_key: Option<String>,
    /// This attempt's number (counted at claim).
    pub attempts: i32,
    /// Attempt budget.
    pub max_attempts: i32,
    /// Age budget deadline.
    pub expires_at: DateTime<Utc>,
    /// Effects on success.
    pub on_success: Value,
    /// Effects on death.
    pub on_dead: Value,
    /// CloudEvents source for outcome events.
    pub emit_source: String,
    /// Aggregate id.
    pub aggregate_id: Option<String>,
    /// Correlation id.
    pub correlation_id: Option<String>,
    /// Causation id.
    pub causation_id: Option<String>,
    /// W3C trace context.
    pub traceparent: Option<String>,
    /// Last error before this attempt.
    pub last_error: Option<String>,
    /// Written at.
    pub created_at: DateTime<Utc>,
}

impl ClaimedIntent {
    /// Whether this claim is already over budget (count or age): the intent
    /// must be declared dead without another call.
    pub fn over_budget(&self, now: DateTime<Utc>) -> bool {
        self.attempts > self.max_attempts || now >= self.expires_at
    }
}

/// Claim up to `limit` due intents for `worker` with a lease of `lease`, in one
/// statement: `FOR UPDATE SKIP LOCKED` picks rows no other dispatcher holds, the
/// `UPDATE` sets the lease and counts the attempt (R9), and an attempt row is
/// opened for audit. Intents whose ordering key has an earlier unfinished
/// intent are not due (R13).
pub async fn claim(
    conn: &mut PgConnection,
    worker: &str,
    limit: i64,
    lease: Duration,
) -> Result<Vec<ClaimedIntent>, sqlx::Error> {
    sqlx::query_as::<_, ClaimedIntent>(
        "WITH due AS (
             SELECT i.id FROM relay.intents i
              WHERE i.state = 'pending' AND i.next_attempt_at <= now()
                AND (i.ordering_key IS NULL OR NOT EXISTS (
                        SELECT 1 FROM relay.intents e
                         WHERE e.ordering_key = i.ordering_key AND e.seq < i.seq
                           AND e.state IN ('pending', 'running')))
              ORDER BY i.next_attempt_at, i.seq
              LIMIT $1
              FOR UPDATE SKIP LOCKED
         ), claimed AS (
             UPDATE relay.intents i
                SET state = 'running', attempts = i.attempts + 1, lease_token = gen_random_uuid(),
                    locked_by = $2, locked_until = now() + make_interval(secs => $3)
               FROM due WHERE i.id = due.id
             RETURNING i.*
         ), opened AS (
             INSERT INTO relay.intent_attempts (intent_id, attempt, worker, lease_token)
             SELECT id, attempts, $2, lease_token FROM claimed WHERE attempts <= max_attempts
         )
         SELECT id, lease_token, consumer, source_event_id, action, endpoint, method, path, body,
                request_headers, idempotency_key, ordering_key, attempts, max_attempts, expires_at,
                on_success, on_dead, emit_source, aggregate_id, correlation_id, causation_id, traceparent,
                last_error, created_at
           FROM claimed",
    )
    .bind(limit)
    .bind(worker)
    .bind(lease.as_secs_f64())
    .fetch_all(conn)
    .await
}

/// How one attempt ended, for the audit row and the intent's last_* columns.
#[derive(Debug, Clone)]
pub struct AttemptRecord {
    /// When the request was sent (`None` if no request was made).
    pub started_at: Option<DateTime<Utc>>,
    /// `succeeded`, `retryable`, `permanent` or `uncertain`.
    pub outcome: &'static str,
    /// HTTP status, if the provider answered.
    pub status: Option<i32>,
    /// Error class (`http_status`, `timeout`, `connect`, `transport`, `budget`, …).
    pub error_class: Option<String>,
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

async fn close_attempt(conn: &mut PgConnection, id: Uuid, token: Uuid, rec: &AttemptRecord) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE relay.intent_attempts
            SET started_at = $7, finished_at = now(), outcome = $3, status = $4, error_class = $5, error = $6
          WHERE intent_id = $1 AND lease_token = $2 AND outcome = 'running'",
    )
    .bind(id)
    .bind(token)
    .bind(rec.outcome)
    .bind(rec.status)
    .bind(&rec.error_class)
    .bind(&rec.error)
    .bind(rec.started_at)
    .execute(conn)
    .await?;
    Ok(())
}

/// Finish a claimed intent as succeeded (fenced).
pub async fn mark_succeeded(
    conn: &mut PgConnection,
    id: Uuid,
    token: Uuid,
    rec: &AttemptRecord,
) -> Result<Fenced, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE relay.intents
            SET state = 'succeeded', finished_at = now(), last_status = $3, last_error = NULL,
                last_error_class = NULL, lease_token = NULL, locked_until = NULL, locked_by = NULL
          WHERE id = $1 AND lease_token = $2 AND state = 'running'",
    )
    .bind(id)
    .bind(token)
    .bind(rec.status)
    .execute(&mut *conn)
    .await?;
    fenced(conn, done.rows_affected(), id, token, rec).await
}

/// Put a claimed intent back to pending until `delay` from now (fenced).
pub async fn schedule_retry(
    conn: &mut PgConnection,
    id: Uuid,
    token: Uuid,
    delay: Duration,
    rec: &AttemptRecord,
) -> Result<Fenced, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE relay.intents
            SET state = 'pending', next_attempt_at = now() + make_interval(secs => $3),
                last_status = $4, last_error = $5, last_error_class = $6,
                lease_token = NULL, locked_until = NULL, locked_by = NULL
          WHERE id = $1 AND lease_token = $2 AND state = 'running'",
    )
    .bind(id)
    .bind(token)
    .bind(delay.as_secs_f64())
    .bind(rec.status)
    .bind(&rec.error)
    .bind(&rec.error_class)
    .execute(&mut *conn)
    .await?;
    fenced(conn, done.rows_affected(), id, token, rec).await
}

/// Declare a claimed intent dead with its last error (fenced).
pub async fn mark_dead(
    conn: &mut PgConnection,
    id: Uuid,
    token: Uuid,
    rec: &AttemptRecord,
) -> Result<Fenced, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE relay.intents
            SET state = 'dead', finished_at = now(),
                last_status = COALESCE($3, last_status), last_error = $4,
                last_error_class = $5, lease_token = NULL, locked_until = NULL, locked_by = NULL
          WHERE id = $1 AND lease_token = $2 AND state = 'running'",
    )
    .bind(id)
    .bind(token)
    .bind(rec.status)
    .bind(&rec.error)
    .bind(&rec.error_class)
    .execute(&mut *conn)
    .await?;
    fenced(conn, done.rows_affected(), id, token, rec).await
}

async fn fenced(
    conn: &mut PgConnection,
    rows: u64,
    id: Uuid,
    token: Uuid,
    rec: &AttemptRecord,
) -> Result<Fenced, sqlx::Error> {
    if rows == 0 {
        return Ok(Fenced::LeaseLost);
    }
    close_attempt(conn, id, token, rec).await?;
    Ok(Fenced::Done)
}

/// Return intents whose lease expired (their worker crashed or stalled) to
/// pending, closing their open attempt as `lease_expired`. The attempt stays
/// counted, so an intent that kills every worker still runs out of budget.
pub async fn rescue_expired(conn: &mut PgConnection, limit: i64) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query_scalar(
        "WITH expired AS (
             SELECT id, lease_token FROM relay.intents
              WHERE state = 'running' AND locked_until < now()
              ORDER BY locked_until LIMIT $1
              FOR UPDATE SKIP LOCKED
         ), closed AS (
             UPDATE relay.intent_attempts a
                SET outcome = 'lease_expired', finished_at = now(), error_class = 'lease_expired',
                    error = 'the worker lost its lease (crashed, stalled or shut down mid-call)'
               FROM expired
              WHERE a.intent_id = expired.id AND a.lease_token = expired.lease_token
                AND a.outcome = 'running'
         )
         UPDATE relay.intents i
            SET state = 'pending', next_attempt_at = now(), lease_token = NULL, locked_until = NULL,
                locked_by = NULL, last_error_class = 'lease_expired',
                last_error = 'lease expired: the worker holding it was lost'
           FROM expired WHERE i.id = expired.id
         RETURNING i.id",
    )
    .bind(limit)
    .fetch_all(conn)
    .await
}

/// When the next pending intent becomes due (for the dispatcher's sleep).
pub async fn next_due_at(conn: &mut PgConnection) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    sqlx::query_scalar("SELECT min(next_attempt_at) FROM relay.intents WHERE state = 'pending'").fetch_one(conn).await
}

/// An intent as shown to operators.
#[derive(Debug, Clone, FromRow, serde::Serialize)]
pub struct IntentView {
    /// Id.
    pub id: Uuid,
    /// Consumer.
    pub consumer: String,
    /// Input event id.
    pub source_event_id: String,
    /// Action.
    pub action: String,
    /// Endpoint.
    pub endpoint: String,
    /// Method.
    pub method: String,
    /// Path.
    pub path: String,
    /// Idempotency key.
    pub idempotency_key: String,
    /// State.
    pub state: String,
    /// Attempts so far.
    pub attempts: i32,
    /// Budget.
    pub max_attempts: i32,
    /// Last HTTP status.
    pub last_status: Option<i32>,
    /// Last error.
    pub last_error: Option<String>,
    /// Last error class.
    pub last_error_class: Option<String>,
    /// Next attempt.
    pub next_attempt_at: DateTime<Utc>,
    /// Written at.
    pub created_at: DateTime<Utc>,
    /// Finished at.
    pub finished_at: Option<DateTime<Utc>>,
}

/// One intent by id.
pub async fn get(conn: &mut PgConnection, id: Uuid) -> Result<Option<IntentView>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, consumer, source_event_id, action, endpoint, method, path, idempotency_key, state,
                attempts, max_attempts, last_status, last_error, last_error_class, next_attempt_at,
                created_at, finished_at
           FROM relay.intents WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(conn)
    .await
}

/// One attempt, for audit.
#[derive(Debug, Clone, FromRow, serde::Serialize)]
pub struct AttemptView {
    /// Attempt number.
    pub attempt: i32,
    /// Worker.
    pub worker: String,
    /// Claimed.
    pub claimed_at: DateTime<Utc>,
    /// Request sent.
    pub started_at: Option<DateTime<Utc>>,
    /// Finished.
    pub finished_at: Option<DateTime<Utc>>,
    /// Outcome.
    pub outcome: String,
    /// HTTP status.
    pub status: Option<i32>,
    /// Error class.
    pub error_class: Option<String>,
    /// Error.
    pub error: Option<String>,
}

/// The attempts of an intent, oldest first.
pub async fn attempts(conn: &mut PgConnection, id: Uuid) -> Result<Vec<AttemptView>, sqlx::Error> {
    sqlx::query_as(
        "SELECT attempt, worker, claimed_at, started_at, finished_at, outcome, status, error_class, error
           FROM relay.intent_attempts WHERE intent_id = $1 ORDER BY attempt",
    )
    .bind(id)
    .fetch_all(conn)
    .await
}
