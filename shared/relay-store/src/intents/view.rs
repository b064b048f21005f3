//! Reading intents and their attempts for operators.

use chrono::{DateTime, Utc};
use relay_core::IntentState;
use relay_core::retry::{AttemptOutcome, ErrorClass};
use sqlx::FromRow;
use sqlx::PgConnection;
use uuid::Uuid;

/// An intent as shown to operators.
#[derive(Debug, Clone, FromRow, serde::Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct IntentView {
    pub id: Uuid,
    pub consumer: String,
    /// Input event id.
    pub source_event_id: String,
    pub action: String,
    pub endpoint: String,
    pub method: String,
    pub path: String,
    pub idempotency_key: String,
    /// Where it is.
    pub state: IntentState,
    /// Attempts so far.
    pub attempts: i32,
    /// Budget.
    pub max_attempts: i32,
    /// Last HTTP status.
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
    /// What went wrong last.
    pub last_error_class: Option<ErrorClass>,
    /// Some attempt may have been applied: it can no longer end dead.
    pub ever_uncertain: bool,
    pub next_attempt_at: DateTime<Utc>,
    /// Written at.
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// Per-key ordering.
    pub ordering_key: Option<String>,
    /// Whether, dead, it holds its ordering key (until replayed or skipped).
    pub holds_key: bool,
}

/// One intent of `consumer` by id.
pub async fn get(conn: &mut PgConnection, consumer: &str, id: Uuid) -> Result<Option<IntentView>, sqlx::Error> {
    sqlx::query_as(&format!("SELECT {VIEW} FROM relay.intents WHERE id = $1 AND consumer = $2"))
        .bind(id)
        .bind(consumer)
        .fetch_optional(conn)
        .await
}

/// One attempt, for audit.
#[derive(Debug, Clone, FromRow, serde::Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct AttemptView {
    /// Attempt number.
    pub attempt: i32,
    pub worker: String,
    pub claimed_at: DateTime<Utc>,
    /// Request sent.
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    /// How it ended; none for a row the first versions wrote at the claim
    /// and never finished.
    pub outcome: Option<AttemptOutcome>,
    /// HTTP status.
    pub status: Option<i32>,
    /// What went wrong.
    pub error_class: Option<ErrorClass>,
    pub error: Option<String>,
}

/// The attempts of an intent, oldest first.
pub async fn attempts(conn: &mut PgConnection, id: Uuid) -> Result<Vec<AttemptView>, sqlx::Error> {
    sqlx::query_as(
        "SELECT attempt, worker, claimed_at, started_at, finished_at, NULLIF(outcome, 'running') AS outcome,
                status, error_class, error
           FROM relay.intent_attempts WHERE intent_id = $1 ORDER BY attempt",
    )
    .bind(id)
    .fetch_all(conn)
    .await
}

/// Filters for listing intents (of one consumer: operators act on their own).
#[derive(Debug, Clone, Default)]
pub struct IntentFilter {
    /// Only this consumer's.
    pub consumer: String,
    /// Only this state.
    pub state: Option<IntentState>,
    /// Only this endpoint.
    pub endpoint: Option<String>,
}

const VIEW: &str = "id, consumer, source_event_id, action, endpoint, method, path, idempotency_key, state,
    attempts, max_attempts, last_status, last_error, last_error_class, ever_uncertain, next_attempt_at, created_at,
    finished_at, ordering_key, holds_key";

/// Intents matching `f`, newest first, created before `before` (for paging).
pub async fn list(
    conn: &mut PgConnection,
    f: &IntentFilter,
    before: Option<DateTime<Utc>>,
    limit: i64,
) -> Result<Vec<IntentView>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {VIEW} FROM relay.intents
          WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR endpoint = $2)
            AND ($3::timestamptz IS NULL OR created_at < $3) AND consumer = $5
          ORDER BY created_at DESC LIMIT $4"
    ))
    .bind(f.state.map(IntentState::as_str))
    .bind(&f.endpoint)
    .bind(before)
    .bind(limit)
    .bind(&f.consumer)
    .fetch_all(conn)
    .await
}

/// The ids of every intent matching `f`, oldest first: a snapshot of what a
/// bulk action is to work through (ids only, however many there are).
pub async fn ids(conn: &mut PgConnection, f: &IntentFilter) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT id FROM relay.intents
          WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR endpoint = $2) AND consumer = $3
          ORDER BY created_at, id",
    )
    .bind(f.state.map(IntentState::as_str))
    .bind(&f.endpoint)
    .bind(&f.consumer)
    .fetch_all(conn)
    .await
}
