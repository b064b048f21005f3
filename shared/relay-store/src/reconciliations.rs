//! Reconciling uncertain intents: take the ones due for a
//! question to their provider, record each question and its answer, and
//! move the intent as the answer says. A succeeded one is finished like a
//! call's outcome, by the dispatcher's completer (fenced, with its
//! `on_success` effects); the others here, fenced by the take's lease token.

use std::time::Duration;

use chrono::{DateTime, Utc};
use relay_core::profile::Reconciled;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::intents::{ClaimedIntent, Fenced, claimed_columns};

/// Take up to `limit` of `consumer`'s uncertain intents of `endpoint` due
/// for a reconciliation — asked fewer than `max` times, and `after` since
/// they became uncertain or past their `next_reconcile_at` — running under
/// a lease of `lease` for `worker`, as [`crate::intents::take_uncertain`]
/// leaves them: `finished_at` is kept, so a lost lease returns them to
/// uncertain, never to pending.
///
/// One whose stored columns cannot be read is not returned: it goes back
/// to uncertain at once, asked `max` times (so no reconciler takes it
/// again: an operator resolves it), its question recorded unasked with
/// [`crate::Unreadable::reason`]. The others are taken as usual.
#[allow(clippy::too_many_arguments)]
pub async fn take_due(
    conn: &mut PgConnection,
    consumer: &str,
    endpoint: &str,
    after: Duration,
    max: u32,
    limit: i64,
    worker: &str,
    lease: Duration,
) -> Result<Vec<ClaimedIntent>, sqlx::Error> {
    let rows = sqlx::query(concat!(
        "UPDATE relay.intents
            SET state = 'running', lease_token = gen_random_uuid(), locked_by = $6,
                locked_until = now() + make_interval(secs => $7)
          WHERE id IN (SELECT id FROM relay.intents
                        WHERE state = 'uncertain' AND consumer = $1 AND endpoint = $2 AND reconciles < $4
                          AND coalesce(next_reconcile_at, finished_at + make_interval(secs => $3)) <= now()
                          AND NOT EXISTS (SELECT 1 FROM relay.pauses p
                                           WHERE p.kind = 'endpoint' AND p.name = relay.intents.endpoint
                                             AND p.consumer IN ('', relay.intents.consumer))
                        ORDER BY finished_at LIMIT $5
                        FOR UPDATE SKIP LOCKED)
         RETURNING ",
        claimed_columns!()
    ))
    .bind(consumer)
    .bind(endpoint)
    .bind(after.as_secs_f64())
    .bind(i32::try_from(max).unwrap_or(i32::MAX))
    .bind(limit)
    .bind(worker)
    .bind(lease.as_secs_f64())
    .fetch_all(&mut *conn)
    .await?;
    let (mut taken, mut unreadable) = (Vec::with_capacity(rows.len()), Vec::new());
    for row in &rows {
        match crate::decode_claimed::<ClaimedIntent>(row)? {
            Ok(intent) => taken.push(intent),
            Err(u) => unreadable.push(u),
        }
    }
    if !unreadable.is_empty() {
        tracing::error!(intents = ?unreadable.iter().map(|u| u.id).collect::<Vec<_>>(),
                        "uncertain intents cannot be read; left uncertain, for an operator to resolve");
        sqlx::query(
            "WITH moved AS (
                 UPDATE relay.intents i
                    SET state = 'uncertain', lease_token = NULL, locked_until = NULL, locked_by = NULL,
                        reconciles = greatest(i.reconciles + 1, $4), next_reconcile_at = NULL
                   FROM unnest($1::uuid[], $2::uuid[], $3::text[]) AS u(id, token, error)
                  WHERE i.id = u.id AND i.lease_token = u.token
                 RETURNING i.id, i.reconciles, u.error
             )
             INSERT INTO relay.intent_reconciliations (intent_id, n, worker, verdict, error)
             SELECT id, reconciles, $5, $6, error FROM moved",
        )
        .bind(unreadable.iter().map(|u| u.id).collect::<Vec<_>>())
        .bind(unreadable.iter().map(|u| u.lease_token).collect::<Vec<_>>())
        .bind(unreadable.iter().map(crate::Unreadable::reason).collect::<Vec<_>>())
        .bind(i32::try_from(max).unwrap_or(i32::MAX))
        .bind(worker)
        .bind(Reconciled::Unknown)
        .execute(&mut *conn)
        .await?;
    }
    Ok(taken)
}

/// One question to the provider and what its answer said.
#[derive(Debug, Clone)]
pub struct Asked {
    /// Who asked.
    pub worker: String,
    /// When the request left (`None`: it never did).
    pub started_at: Option<DateTime<Utc>>,
    /// The answer's status, if there was one.
    pub status: Option<i32>,
    /// What it said.
    pub verdict: Reconciled,
    /// What went wrong, or what the answer said, in a line.
    pub error: Option<String>,
}

/// Record `asked` for intent `id` taken under `token`, and move it: still
/// unknown → uncertain again, asked again `interval` from now; not applied
/// → pending with a new budget (its attempts for `max_age` from now), no
/// longer uncertain (the provider's word
/// settles the doubt, so it may be sent again and end dead); succeeded →
/// only recorded here (the completer finishes it with its effects).
pub async fn record(
    conn: &mut PgConnection,
    id: Uuid,
    token: Uuid,
    asked: &Asked,
    interval: Duration,
    max_age: Duration,
) -> Result<Fenced, sqlx::Error> {
    let moved = match asked.verdict {
        Reconciled::Unknown => {
            "UPDATE relay.intents SET state = 'uncertain', lease_token = NULL, locked_until = NULL, locked_by = NULL,
                    reconciles = reconciles + 1, next_reconcile_at = now() + make_interval(secs => $8)
              WHERE id = $1 AND lease_token = $2 AND $9 >= 0"
        }
        Reconciled::NotApplied => {
            "UPDATE relay.intents SET state = 'pending', lease_token = NULL, locked_until = NULL, locked_by = NULL,
                    reconciles = reconciles + 1, next_reconcile_at = NULL, ever_uncertain = false,
                    next_attempt_at = now(), finished_at = NULL,
                    max_attempts = attempts + max_attempts, expires_at = now() + make_interval(secs => $9)
              WHERE id = $1 AND lease_token = $2"
        }
        Reconciled::Succeeded => {
            "UPDATE relay.intents SET reconciles = reconciles + 1 WHERE id = $1 AND lease_token = $2 AND $8 >= 0 AND $9 >= 0"
        }
    };
    // The question is written from what the fenced UPDATE moved: under a
    // lost lease nothing is, and its number is the count after it.
    let sql = format!(
        "WITH moved AS ({moved} RETURNING id, reconciles)
         INSERT INTO relay.intent_reconciliations (intent_id, n, worker, started_at, status, verdict, error)
         SELECT id, reconciles, $3, $4, $5, $6, $7 FROM moved
         RETURNING 1"
    );
    let n = sqlx::query(&sql)
        .bind(id)
        .bind(token)
        .bind(&asked.worker)
        .bind(asked.started_at)
        .bind(asked.status)
        .bind(asked.verdict)
        .bind(&asked.error)
        .bind(interval.as_secs_f64())
        .bind(max_age.as_secs_f64())
        .execute(conn)
        .await?
        .rows_affected();
    Ok(if n == 1 { Fenced::Done } else { Fenced::LeaseLost })
}

/// A reconciliation as shown to operators.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReconciliationView {
    /// Its number among the intent's reconciliations.
    pub n: i32,
    /// Who asked.
    pub worker: String,
    /// When the request left.
    pub started_at: Option<DateTime<Utc>>,
    /// When the answer was recorded.
    pub finished_at: DateTime<Utc>,
    /// The answer's status.
    pub status: Option<i32>,
    /// What it said.
    pub verdict: Reconciled,
    /// What went wrong, or what the answer said.
    pub error: Option<String>,
}

/// The reconciliations of intent `id`, oldest first.
pub async fn list(conn: &mut PgConnection, id: Uuid) -> Result<Vec<ReconciliationView>, sqlx::Error> {
    sqlx::query_as(
        "SELECT n, worker, started_at, finished_at, status, verdict, error
           FROM relay.intent_reconciliations WHERE intent_id = $1 ORDER BY n",
    )
    .bind(id)
    .fetch_all(conn)
    .await
}
