//! Intents: external calls to make, claimed by dispatchers.
//!
//! Lifecycle (see the migration for the column comments):
//!
//! ```text
//! insert --> pending --claim--> running --success--> succeeded
//! insert with a Hold ----------> running  (claimed at ingest: same row, same lease)
//!                                   |-----retry-----> pending (next_attempt_at later)
//!                                   |-----dead------> dead
//!                                   |-----budget spent after an unknown outcome--> uncertain
//!                                   '--lease expired (rescue)--> pending
//! ```
//!
//! Every transition out of `running` names the lease token it holds; a worker
//! whose lease was rescued and re-claimed finds zero rows and records nothing.

use std::borrow::Borrow;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{FromRow, PgConnection, Row};
use uuid::Uuid;

use crate::{Claim, ClaimConnection, Position, Unreadable};

pub use relay_core::IntentState;
pub use relay_core::effects::{Intent, NewIntent};

/// A claimed intent: the intent and what the claim adds — everything a
/// worker needs to make the call and record its outcome.
#[derive(Debug, Clone)]
pub struct ClaimedIntent {
    /// Intent id.
    pub id: Uuid,
    /// Fencing token of this claim.
    pub lease_token: Uuid,
    /// The call and its effects, as written.
    pub intent: Intent,
    /// This attempt's number (counted at claim).
    pub attempts: i32,
    /// Age budget deadline.
    pub expires_at: DateTime<Utc>,
    /// Last error before this attempt.
    pub last_error: Option<String>,
    /// Some attempt before this claim may have been applied (`ever_uncertain`).
    pub ever_uncertain: bool,
    /// Written at.
    pub created_at: DateTime<Utc>,
}

/// The columns a [`ClaimedIntent`] is read from: a claim ([`CLAIM`]) and an
/// operator's take of an uncertain intent ([`take_uncertain`]) return these.
macro_rules! claimed_columns {
    () => {
        "id, lease_token, consumer, source_event_id, action, endpoint, method, path, body, request_headers, \
         idempotency_key, ordering_key, attempts, max_attempts, expires_at, on_success, on_dead, emit_source, \
         aggregate_id, correlation_id, causation_id, traceparent, last_error, ever_uncertain, created_at, holds_key, fairness_key"
    };
}
pub(crate) use claimed_columns;

impl<'r> FromRow<'r, PgRow> for ClaimedIntent {
    fn from_row(row: &'r PgRow) -> Result<Self, sqlx::Error> {
        Ok(ClaimedIntent {
            id: row.try_get("id")?,
            lease_token: row.try_get("lease_token")?,
            intent: Intent {
                consumer: row.try_get("consumer")?,
                source_event_id: row.try_get("source_event_id")?,
                action: row.try_get("action")?,
                endpoint: row.try_get("endpoint")?,
                method: row.try_get("method")?,
                path: row.try_get("path")?,
                body: row.try_get("body")?,
                headers: row.try_get("request_headers")?,
                idempotency_key: row.try_get("idempotency_key")?,
                ordering_key: row.try_get("ordering_key")?,
                holds_key: row.try_get("holds_key")?,
                fairness_key: row.try_get("fairness_key")?,
                max_attempts: row.try_get("max_attempts")?,
                on_success: row.try_get("on_success")?,
                on_dead: row.try_get("on_dead")?,
                emit_source: row.try_get("emit_source")?,
                aggregate_id: row.try_get("aggregate_id")?,
                correlation_id: row.try_get("correlation_id")?,
                causation_id: row.try_get("causation_id")?,
                traceparent: row.try_get("traceparent")?,
            },
            attempts: row.try_get("attempts")?,
            expires_at: row.try_get("expires_at")?,
            last_error: row.try_get("last_error")?,
            ever_uncertain: row.try_get("ever_uncertain")?,
            created_at: row.try_get("created_at")?,
        })
    }
}

impl ClaimedIntent {
    /// Its retry budget, for [`relay_core::retry::decide`].
    pub fn budget(&self) -> relay_core::retry::Budget {
        relay_core::retry::Budget {
            attempts: u32::try_from(self.attempts).unwrap_or(0),
            max_attempts: u32::try_from(self.intent.max_attempts).unwrap_or(0),
            expires_at: self.expires_at,
            uncertain_before: self.ever_uncertain,
            // The endpoint's profile may say otherwise (the executor knows it).
            resends_unknown: true,
            key_forgotten: false,
        }
    }
}

/// Claim up to `limit` due intents for `worker` with a lease of `lease`, in one
/// statement: `FOR UPDATE SKIP LOCKED` picks rows no other dispatcher holds and
/// the `UPDATE` sets the lease and counts the attempt (R9). Intents whose
/// ordering key has an earlier unfinished or uncertain intent, or any running
/// one, are not due (R13; "earlier" is commit order, [`crate::ordering`]):
/// an uncertain intent holds its key until an operator replays it, since
/// the provider may have applied it. The
/// attempt's audit row is written when it finishes ([`finish_many`]) or, if
/// its worker is lost, by the rescuer ([`rescue_expired`]). Commits by
/// itself, on a claim connection ([`crate::ClaimPool`]): one round trip. A
/// short claim also says when the next intent comes due ([`Claim::next_due`]).
pub async fn claim(
    conn: &mut ClaimConnection,
    scope: &Scope<'_>,
    worker: &str,
    limit: i64,
    lease: Duration,
) -> Result<Claim<ClaimedIntent>, sqlx::Error> {
    claim_after(conn, scope, worker, limit, lease, None, Room::ANY).await
}

/// How much JSON a claim may take: its rows' body, headers and outcomes,
/// as PostgreSQL prints them, in total. A dispatcher holds what it claimed
/// until the calls end, decoded; a count of rows alone would let 64 rows of
/// 900 KiB each, and the trees they decode to, be claimed at once.
#[derive(Debug, Clone, Copy)]
pub struct Room {
    /// Bytes the claimed rows may take together.
    pub bytes: u64,
    /// Take the first due row even if it alone is larger (the claimer holds
    /// nothing else): a row larger than the room is still called, alone.
    pub first_always: bool,
    /// Take applications' calls (`relay.call`): not while the outcomes of
    /// earlier ones wait in memory for keys an application holds, past
    /// their own room.
    pub applications: bool,
}

impl Room {
    /// No bound.
    pub const ANY: Room = Room { bytes: u64::MAX, first_always: true, applications: true };
}

/// Which intents a dispatcher may claim: those its consumer wrote, for
/// endpoints it has a client for. Two deployments sharing a database, or a
/// rolling deploy that adds an endpoint, must not call each other's intents
/// with the wrong base URL and credentials, nor spend their attempts on an
/// endpoint they cannot reach.
#[derive(Debug, Clone, Copy)]
pub struct Scope<'a> {
    /// The consumer whose intents these are.
    pub consumer: &'a str,
    /// The endpoints this dispatcher can call.
    pub endpoints: &'a [&'a str],
}

/// [`claim`], taking only rows that come after `after` in the claim order
/// (`None`: from the start). For a claim loop draining a backlog: every
/// claim reads the due index from its start, and the entries of rows
/// claimed before are read again and again until vacuum removes them —
/// which it cannot while any transaction older than those claims is open.
/// With a snapshot held open during a 30 000-intent drain, that made each
/// claim read all the entries of the claims before it. A loop that starts
/// after the last row of its previous full claim ([`Claim::last`]) reads
/// only new entries; what it passes over — rows left behind an earlier row
/// of their ordering key, rows of a paused endpoint, rows whose
/// transaction committed after later ones — it finds on its next claim
/// from the start, which it must make regularly (the dispatcher: after any
/// short claim, when its own progress may have made rows due, and at least
/// once per poll interval).
pub async fn claim_after(
    conn: &mut ClaimConnection,
    scope: &Scope<'_>,
    worker: &str,
    limit: i64,
    lease: Duration,
    after: Option<Position>,
    room: Room,
) -> Result<Claim<ClaimedIntent>, sqlx::Error> {
    let claim = sqlx::query(CLAIM)
        .bind(limit)
        .bind(worker)
        .bind(lease.as_secs_f64())
        .bind(after.map(|p| p.due))
        .bind(after.map_or(0, |p| p.seq))
        .bind(scope.endpoints)
        .bind(scope.consumer)
        .bind(i64::try_from(room.bytes).unwrap_or(i64::MAX))
        .bind(room.first_always)
        .bind(room.applications);
    crate::fetch_claim(conn.as_conn(), claim, true).await
}

/// The claim statement ([`claim`]); public so a test can check its plan.
/// `$1` limit, `$2` worker, `$3` lease in seconds, `$4` and `$5` the
/// position to claim after (`$4` null: from the start), `$6` the endpoints
/// and `$7` the consumer of the [`Scope`], `$8` to `$10` the [`Room`]. Its
/// rows are the claimed intents, each with `next_due` and `cut`; when it
/// claims fewer than `$1`, `next_due` is when the earliest pending intent
/// not due yet comes due, and at least one row comes back (all columns but
/// `next_due` and `cut` null when none was claimed), which [`claim`] sorts
/// out. Rows locked by `due` past the room are not updated; their locks
/// end with the statement's commit. The room is a running sum over the
/// claim's own rows, correlated rather than a window function (which made
/// concurrent claims take seconds), and skipped when the whole claim fits,
/// as it mostly does: row by row it costs a claim quadratic time.
///
/// Each endpoint's due rows are read apart, through `intents_due`, which
/// leads with the consumer and the endpoint, and a paused endpoint's not at
/// all: read in one run of due rows, a paused or busy endpoint's backlog, or
/// another deployment's, was read again by every claim before the rows it
/// could take (a million rows: seconds a claim). Each endpoint locks at most
/// `$1` rows; those past the first `$1` of all are not updated, and their
/// locks end with the statement.
///
/// An intent's first claim starts its age budget again (`max_age`, the
/// difference its insert left between `expires_at` and `created_at`): time
/// relay kept it from being sent (its key held behind an uncertain intent,
/// its endpoint paused, a fair share's delay) must not end it dead, with
/// its `on_dead` effects, before it was ever sent.
pub const CLAIM: &str = concat!(
    "WITH ready AS MATERIALIZED (
             SELECT u.name FROM unnest($6::text[]) AS u(name)
              WHERE NOT EXISTS (SELECT 1 FROM relay.pauses p
                                 WHERE p.kind = 'endpoint' AND p.name = u.name AND p.consumer IN ('', $7::text))
         ), due AS (
             SELECT d.id, d.next_attempt_at, d.seq, d.bytes
               FROM ready AS ep
              CROSS JOIN LATERAL (
                    SELECT i.id, i.next_attempt_at, i.seq,
                           coalesce(octet_length(i.body::text), 0) + octet_length(i.request_headers::text)
                           + octet_length(i.on_success::text) + octet_length(i.on_dead::text) AS bytes
                      FROM relay.intents i
                     WHERE i.consumer = $7::text AND i.endpoint = ep.name
                       AND i.state = 'pending' AND i.next_attempt_at <= now()
                       AND ($10 OR i.action <> 'application')
                       AND (i.next_attempt_at, i.seq) > (COALESCE($4::timestamptz, '-infinity'), $5::int8)
                       AND (i.ordering_key IS NULL OR NOT EXISTS (
                               SELECT 1 FROM relay.intents e
                                WHERE e.ordering_key = i.ordering_key AND e.consumer = i.consumer
                                  AND (e.state IN ('pending', 'running', 'uncertain')
                                       OR (e.state = 'dead' AND e.holds_key))
                                  AND (e.seq < i.seq OR e.state = 'running')))
                     ORDER BY i.next_attempt_at, i.seq
                     LIMIT $1
                     FOR UPDATE OF i SKIP LOCKED) d
              ORDER BY d.next_attempt_at, d.seq
              LIMIT $1
         ), fits AS (
             SELECT d.id FROM due d
              WHERE (SELECT sum(bytes) FROM due) <= $8
                 OR (SELECT sum(e.bytes) FROM due e
                      WHERE (e.next_attempt_at, e.seq) <= (d.next_attempt_at, d.seq)) <= $8
                 OR ($9 AND NOT EXISTS (SELECT 1 FROM due e
                                         WHERE (e.next_attempt_at, e.seq) < (d.next_attempt_at, d.seq)))
         ), claimed AS (
             UPDATE relay.intents i
                SET state = 'running', attempts = i.attempts + 1, lease_token = gen_random_uuid(),
                    locked_by = $2, locked_until = now() + make_interval(secs => $3),
                    expires_at = CASE WHEN i.attempts = 0 AND i.locked_by IS NULL
                                      THEN greatest(i.expires_at, now() + (i.expires_at - i.created_at))
                                      ELSE i.expires_at END
               FROM fits WHERE i.id = fits.id
             RETURNING i.*
         ), next AS (
             SELECT CASE WHEN (SELECT count(*) FROM claimed) < $1 THEN (
                        SELECT min(n.next_attempt_at) FROM unnest($6::text[]) AS ep(name)
                         CROSS JOIN LATERAL (
                               SELECT i.next_attempt_at FROM relay.intents i
                                WHERE i.consumer = $7::text AND i.endpoint = ep.name
                                  AND i.state = 'pending' AND i.next_attempt_at > now()
                                ORDER BY i.next_attempt_at LIMIT 1) n) END AS next_due,
                    (SELECT count(*) FROM due) > (SELECT count(*) FROM fits) AS cut
         )
         SELECT ",
    claimed_columns!(),
    ", next_attempt_at AS due_at, seq, next.next_due, next.cut
           FROM next LEFT JOIN claimed c ON true"
);

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

pub use relay_core::retry::{AttemptOutcome, ErrorClass, NextState};

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
/// ([`Claim::unreadable`]) as dead, fenced by their lease tokens, with
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
/// An uncertain intent an operator's resolution took ([`take_uncertain`]:
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

/// An intent as shown to operators.
#[derive(Debug, Clone, FromRow, serde::Serialize)]
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

/// Insert many intents, `ON CONFLICT DO NOTHING`, returning the ids that
/// were new ([`crate::effects::insert`]); `$1`…`$20`: one array per column.
///
/// `$21` (one flag per row), `$22` (worker) and `$23` (lease in seconds)
/// hold rows for a dispatcher at insert ([`Hold`]): a flagged row without an
/// ordering key whose endpoint is not paused is written as the claim
/// statement ([`CLAIM`]) would leave it — running, attempt 1 counted, a fresh
/// lease token, `locked_until` a lease from now — and returns its token; any
/// other row is written pending, as without a hold. The lease starts at the
/// statement (`clock_timestamp()`), not at its transaction's start.
pub(crate) const INSERT_MANY: &str = "INSERT INTO relay.intents
             (id, consumer, source_event_id, action, endpoint, method, path, body, request_headers,
              idempotency_key, ordering_key, max_attempts, expires_at, on_success, on_dead,
              emit_source, aggregate_id, correlation_id, causation_id, traceparent, holds_key, fairness_key,
              next_attempt_at, state, attempts, lease_token, locked_by, locked_until)
         SELECT id, consumer, source_event_id, action, endpoint, method, path, body, request_headers,
                idempotency_key, ordering_key, max_attempts, now() + make_interval(secs => max_age),
                on_success, on_dead, emit_source, aggregate_id, correlation_id, causation_id, traceparent, holds_key,
                fairness_key, now() + make_interval(secs => coalesce(delay, 0)),
                CASE WHEN h.held THEN 'running' ELSE 'pending' END, h.held::int4,
                CASE WHEN h.held THEN gen_random_uuid() END, CASE WHEN h.held THEN $22::text END,
                CASE WHEN h.held THEN clock_timestamp() + make_interval(secs => $23::float8) END
           FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                       $8::jsonb[], $9::jsonb[], $10::text[], $11::text[], $12::int4[], $13::float8[],
                       $14::jsonb[], $15::jsonb[], $16::text[], $17::text[], $18::text[], $19::text[], $20::text[],
                       $21::bool[], $24::bool[], $25::text[], $26::float8[])
                AS t(id, consumer, source_event_id, action, endpoint, method, path, body, request_headers,
                     idempotency_key, ordering_key, max_attempts, max_age, on_success, on_dead,
                     emit_source, aggregate_id, correlation_id, causation_id, traceparent, take, holds_key,
                     fairness_key, delay)
          CROSS JOIN LATERAL (
                SELECT t.take AND t.ordering_key IS NULL AND t.fairness_key IS NULL AND NOT EXISTS (
                           SELECT 1 FROM relay.pauses p
                            WHERE p.kind = 'endpoint' AND p.name = t.endpoint AND p.consumer IN ('', t.consumer)) AS held
          ) h
         ON CONFLICT (id) DO NOTHING
         RETURNING id, lease_token, expires_at, created_at";

/// Rows of a multi-row intent insert to write as already claimed by a
/// dispatcher (see `INSERT_MANY`).
#[derive(Debug, Clone, Copy)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct Hold<'a> {
    /// The dispatcher's worker id (`locked_by`).
    pub worker: &'a str,
    pub lease: Duration,
    /// One flag per row: hold this one if it can be.
    pub take: &'a [bool],
}

/// What the insert wrote for a held row: its claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The claim's fencing token.
    pub lease_token: Uuid,
    /// Age budget deadline, as stored.
    pub expires_at: DateTime<Utc>,
    /// When the row was written.
    pub created_at: DateTime<Utc>,
}

impl ClaimedIntent {
    /// The claimed intent that a claim of `new` would have returned, for a
    /// row written already held ([`Hold`], [`Held`]): first attempt, no error yet.
    pub fn held_at_insert(new: NewIntent, held: Held) -> ClaimedIntent {
        ClaimedIntent {
            id: new.id,
            lease_token: held.lease_token,
            intent: new.intent,
            attempts: 1,
            expires_at: held.expires_at,
            last_error: None,
            ever_uncertain: false,
            created_at: held.created_at,
        }
    }
}

/// Bind the parameters of [`INSERT_MANY`] to `q`, after those it has.
pub(crate) fn bind_many<'q, R: Borrow<NewIntent>>(
    q: crate::PgQuery<'q>,
    rows: &'q [R],
    hold: Option<Hold<'q>>,
    delays: Vec<Option<f64>>,
) -> crate::PgQuery<'q> {
    fn col<'a, R: Borrow<NewIntent>, T: 'a>(rows: &'a [R], f: impl Fn(&'a NewIntent) -> T) -> Vec<T> {
        rows.iter().map(|r| f(r.borrow())).collect()
    }
    let take: Vec<bool> = match hold {
        Some(h) => (0..rows.len()).map(|k| h.take.get(k).copied().unwrap_or(false)).collect(),
        None => vec![false; rows.len()],
    };
    q.bind(col(rows, |r| r.id))
        .bind(col(rows, |r| r.intent.consumer.as_str()))
        .bind(col(rows, |r| r.intent.source_event_id.as_str()))
        .bind(col(rows, |r| r.intent.action.as_str()))
        .bind(col(rows, |r| r.intent.endpoint.as_str()))
        .bind(col(rows, |r| r.intent.method.as_str()))
        .bind(col(rows, |r| r.intent.path.as_str()))
        .bind(col(rows, |r| r.intent.body.clone()))
        .bind(col(rows, |r| r.intent.headers.clone()))
        .bind(col(rows, |r| r.intent.idempotency_key.as_str()))
        .bind(col(rows, |r| r.intent.ordering_key.as_deref()))
        .bind(col(rows, |r| r.intent.max_attempts))
        .bind(col(rows, |r| r.max_age.as_secs_f64()))
        .bind(col(rows, |r| r.intent.on_success.clone()))
        .bind(col(rows, |r| r.intent.on_dead.clone()))
        .bind(col(rows, |r| r.intent.emit_source.as_str()))
        .bind(col(rows, |r| r.intent.aggregate_id.as_deref()))
        .bind(col(rows, |r| r.intent.correlation_id.as_deref()))
        .bind(col(rows, |r| r.intent.causation_id.as_deref()))
        .bind(col(rows, |r| r.intent.traceparent.as_deref()))
        .bind(take)
        .bind(hold.map(|h| h.worker))
        .bind(hold.map(|h| h.lease.as_secs_f64()))
        .bind(col(rows, |r| r.intent.holds_key))
        .bind(col(rows, |r| r.intent.fairness_key.as_deref()))
        .bind(delays)
}

/// For the rows with a fairness key: how long after now each is due, at its
/// key's next slots (`relay.fairness_clocks`, advanced past them here, in
/// the caller's transaction); `None` for the others, and no round trip if
/// there are none. The clocks are taken in one sorted statement, so two
/// transactions that share keys wait for each other, never deadlock.
pub(crate) async fn fair_delays<R: Borrow<NewIntent>>(
    conn: &mut PgConnection,
    consumer: &str,
    rows: &[R],
) -> Result<Vec<Option<f64>>, sqlx::Error> {
    use std::collections::BTreeMap;
    // (endpoint, key) → (spacing, rows in batch order)
    let mut groups: BTreeMap<(&str, &str), (f64, Vec<usize>)> = BTreeMap::new();
    for (n, r) in rows.iter().enumerate() {
        let r = r.borrow();
        if let (Some(key), Some(spacing)) = (r.intent.fairness_key.as_deref(), r.fair_spacing) {
            let g = groups.entry((r.intent.endpoint.as_str(), key)).or_insert((spacing.as_secs_f64(), Vec::new()));
            g.1.push(n);
        }
    }
    let mut delays = vec![None; rows.len()];
    if groups.is_empty() {
        return Ok(delays);
    }
    let endpoints: Vec<&str> = groups.keys().map(|k| k.0).collect();
    let keys: Vec<&str> = groups.keys().map(|k| k.1).collect();
    let spans: Vec<f64> = groups.values().map(|(s, rows)| s * rows.len() as f64).collect();
    let starts: Vec<(String, String, f64)> = sqlx::query_as(
        "INSERT INTO relay.fairness_clocks AS c (consumer, endpoint, key, next_slot)
         SELECT $1, t.endpoint, t.key, now() + make_interval(secs => t.span)
           FROM unnest($2::text[], $3::text[], $4::float8[]) WITH ORDINALITY AS t(endpoint, key, span, n)
          ORDER BY t.n
         ON CONFLICT (consumer, endpoint, key) DO UPDATE
            SET next_slot = greatest(c.next_slot, now()) + (excluded.next_slot - now())
         RETURNING c.endpoint, c.key, extract(epoch FROM c.next_slot - now())::float8",
    )
    .bind(consumer)
    .bind(&endpoints)
    .bind(&keys)
    .bind(&spans)
    .fetch_all(&mut *conn)
    .await?;
    for (endpoint, key, end) in starts {
        let Some((spacing, members)) = groups.get(&(endpoint.as_str(), key.as_str())) else { continue };
        let start = end - spacing * members.len() as f64;
        for (i, n) in members.iter().enumerate() {
            delays[*n] = Some((start + spacing * i as f64).max(0.0));
        }
    }
    Ok(delays)
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

/// Endpoints outside `endpoints` with pending intents of `consumer`, and
/// how many each has: no dispatcher of this configuration claims them (an
/// endpoint renamed or removed while they waited), so they wait, and hold
/// their ordering keys, until one does.
pub async fn pending_elsewhere(
    conn: &mut PgConnection,
    consumer: &str,
    endpoints: &[&str],
) -> Result<Vec<(String, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT endpoint, count(*) FROM relay.intents
          WHERE state = 'pending' AND consumer = $1 AND NOT (endpoint = ANY($2))
          GROUP BY endpoint ORDER BY endpoint",
    )
    .bind(consumer)
    .bind(endpoints)
    .fetch_all(conn)
    .await
}

/// Take uncertain intent `id` of `consumer` for an operator's resolution
/// (succeeded or failed, once the provider was asked): running under a
/// fresh lease of `lease` for `worker`, as a claim leaves it, so that its
/// outcome is recorded by the same fenced path as a call's, effects and all.
/// `None` if it is not one of the consumer's uncertain intents. Its
/// `finished_at` is kept: that is how the rescuer knows to return it to
/// uncertain ([`rescue_expired`]), and [`give_back_uncertain`] does at once.
/// One whose stored columns cannot be read is given back at once, and the
/// error says why ([`Unreadable::reason`]).
pub async fn take_uncertain(
    conn: &mut PgConnection,
    consumer: &str,
    id: Uuid,
    worker: &str,
    lease: Duration,
) -> Result<Option<ClaimedIntent>, sqlx::Error> {
    let taken = sqlx::query(concat!(
        "UPDATE relay.intents
            SET state = 'running', lease_token = gen_random_uuid(), locked_by = $3,
                locked_until = now() + make_interval(secs => $4)
          WHERE id = $1 AND consumer = $2 AND state = 'uncertain'
         RETURNING ",
        claimed_columns!()
    ))
    .bind(id)
    .bind(consumer)
    .bind(worker)
    .bind(lease.as_secs_f64())
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = taken else { return Ok(None) };
    match crate::decode_claimed(&row)? {
        Ok(intent) => Ok(Some(intent)),
        Err(unreadable) => {
            give_back_uncertain(conn, unreadable.id, unreadable.lease_token).await?;
            Err(sqlx::Error::Decode(unreadable.reason().into()))
        }
    }
}

/// Return an uncertain intent taken for a resolution that could not be
/// recorded to uncertain (fenced by its token).
pub async fn give_back_uncertain(conn: &mut PgConnection, id: Uuid, token: Uuid) -> Result<Fenced, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE relay.intents SET state = 'uncertain', lease_token = NULL, locked_until = NULL, locked_by = NULL
          WHERE id = $1 AND lease_token = $2",
    )
    .bind(id)
    .bind(token)
    .execute(conn)
    .await?;
    Ok(if done.rows_affected() == 1 { Fenced::Done } else { Fenced::LeaseLost })
}

/// What [`requeue`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requeue {
    /// Queued again in its place: an uncertain intent, or a dead one
    /// without an ordering key.
    Queued,
    /// Queued again behind the intents of its ordering key written after it:
    /// a dead intent let them run, so running it now in its old place is no
    /// longer possible; it runs after them (its order is lost, and said so).
    QueuedBehindItsKey,
    /// Left as it is: neither dead nor uncertain, or no such intent of the consumer.
    NotDeadOrUncertain,
    /// Left dead: its `on_dead` effects (a failure event, a saga moved to
    /// failed) were recorded when it died, and a replay that succeeded
    /// would record `on_success` beside them — two stories for one call.
    OnDeadRecorded,
    /// Left as it is: its replay's attempts could run past the provider's
    /// key window (why, in words), and the operator did not say
    /// `--past-key-window`.
    PastKeyWindow(String),
    /// Left uncertain: its provider keeps no idempotency keys, so sending
    /// it again could apply it twice; ask the provider and resolve it.
    UncertainWithoutKeys,
    /// Left uncertain: the provider has forgotten its key already, so no
    /// attempt would be sent (sent, it would be a new request); allowing a
    /// replay past the window changes nothing: ask the provider and resolve it.
    UncertainKeyForgotten,
}

/// What [`skip`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// The dead intent let go of its ordering key: `waiting` later intents
    /// of the key may run now.
    Released {
        /// The key.
        key: String,
        /// Its intents waiting behind it.
        waiting: i64,
    },
    /// Nothing to do: it is not a dead intent of this consumer that holds
    /// its key.
    NotHolding,
}

/// Let dead intent `id` of `consumer` release the ordering key it holds
/// (`on_poison = "hold_key"`): it stays dead, its failure as it was, and the
/// key's later intents go on (dispatchers are woken).
pub async fn skip(conn: &mut PgConnection, consumer: &str, id: Uuid) -> Result<Skip, sqlx::Error> {
    use sqlx::Connection;
    let mut tx = conn.begin().await?;
    let key: Option<Option<String>> = sqlx::query_scalar(
        "UPDATE relay.intents SET holds_key = false
          WHERE id = $1 AND consumer = $2 AND state = 'dead' AND holds_key
          RETURNING ordering_key",
    )
    .bind(id)
    .bind(consumer)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(Some(key)) = key else { return Ok(Skip::NotHolding) };
    let waiting: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM relay.intents WHERE consumer = $1 AND ordering_key = $2 AND state = 'pending'",
    )
    .bind(consumer)
    .bind(&key)
    .fetch_one(&mut *tx)
    .await?;
    sqlx::query("SELECT pg_notify('relay_intents', '')").execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(Skip::Released { key, waiting })
}

/// What a replay must respect of an intent's endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayRules {
    /// How long the provider remembers a key, if known and respected.
    pub key_window: Option<std::time::Duration>,
    /// Whether the provider deduplicates by key, so that an uncertain
    /// intent may be sent again.
    pub keys: bool,
    /// The endpoint's max age: the replay's attempts run this long from
    /// now (`None`: as long as the intent's first budget did).
    pub max_age: Option<std::time::Duration>,
    /// How long the provider remembers a key, if known, whether or not the
    /// replay respects it: an uncertain intent past it is never sent again.
    pub window: Option<std::time::Duration>,
}

impl ReplayRules {
    /// No window to respect, keys deduplicated: any dead or uncertain intent is replayed.
    pub const ANY: ReplayRules = ReplayRules { key_window: None, keys: true, max_age: None, window: None };
}

/// Give a dead (or uncertain) intent of `consumer` a new budget and queue it
/// again, keeping its id and idempotency key (the provider still sees one
/// operation). An uncertain intent recorded no outcome effects, so its
/// replay ends in one story whatever the provider answers; so does a dead
/// intent whose route declared no `on_dead` effects. A dead intent whose
/// `on_dead` effects were recorded is refused ([`Requeue::OnDeadRecorded`]):
/// the world was told it failed. Its uncertainty (`ever_uncertain`) is kept.
///
/// Ordering keys: an uncertain intent held its key, so it is queued in its
/// place, ahead of the intents that waited for it. A dead one did not; it
/// gets a new place behind the key's later intents
/// ([`Requeue::QueuedBehindItsKey`]), drawn under the key's lock as an insert
/// would ([`crate::ordering`]). Runs in its own transaction: `conn` must not
/// be in one.
pub async fn requeue(
    conn: &mut PgConnection,
    consumer: &str,
    id: Uuid,
    rules: impl Fn(&str) -> ReplayRules,
) -> Result<Requeue, sqlx::Error> {
    use sqlx::Connection;
    type Row = (String, Option<String>, bool, String, DateTime<Utc>, DateTime<Utc>, DateTime<Utc>, bool);
    let mut tx = conn.begin().await?;
    let row: Option<Row> = sqlx::query_as(
        "SELECT state, ordering_key,
                state = 'dead' AND (jsonb_array_length(COALESCE(on_dead->'emit', '[]')) > 0
                                    OR jsonb_array_length(COALESCE(on_dead->'saga', '[]')) > 0),
                endpoint, created_at, expires_at, now(), holds_key
           FROM relay.intents
          WHERE id = $1 AND consumer = $2 AND state IN ('dead', 'uncertain')
          FOR UPDATE",
    )
    .bind(id)
    .bind(consumer)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((state, key, told, endpoint, created_at, expires_at, now, holds)) = row else {
        return Ok(Requeue::NotDeadOrUncertain);
    };
    if told {
        return Ok(Requeue::OnDeadRecorded);
    }
    let rules = rules(&endpoint);
    // The replay's attempts run until then: the endpoint's max age from now
    // (not the intent's whole past budget, which a replay would lengthen).
    let budget = rules.max_age.and_then(|a| chrono::Duration::from_std(a).ok()).unwrap_or(expires_at - created_at);
    let runs_until = now.checked_add_signed(budget).unwrap_or(expires_at);
    if state == IntentState::Uncertain.as_str() && !rules.keys {
        return Ok(Requeue::UncertainWithoutKeys);
    }
    let forgotten = rules
        .window
        .and_then(|w| chrono::Duration::from_std(w).ok())
        .is_some_and(|w| created_at.checked_add_signed(w).is_some_and(|closes| now > closes));
    if state == IntentState::Uncertain.as_str() && forgotten {
        return Ok(Requeue::UncertainKeyForgotten);
    }
    let past = rules.key_window.and_then(|w| relay_core::profile::replay_past_window(created_at, runs_until, w));
    if let Some(why) = past {
        return Ok(Requeue::PastKeyWindow(why));
    }
    // A dead intent that released its key is queued behind the key's later
    // intents (they went on); one that held it keeps its place, first.
    let behind = state == IntentState::Dead.as_str() && key.is_some() && !holds;
    if let Some(k) = key.as_deref().filter(|_| behind) {
        crate::ordering::lock(&mut tx, consumer, [crate::ordering::Key::Intent(k)]).await?;
    }
    let requeue = if behind {
        "UPDATE relay.intents
            SET state = 'pending', next_attempt_at = now(), finished_at = NULL, seq = DEFAULT,
                max_attempts = attempts + max_attempts, expires_at = $2, reconciles = 0, next_reconcile_at = NULL
          WHERE id = $1"
    } else {
        "UPDATE relay.intents
            SET state = 'pending', next_attempt_at = now(), finished_at = NULL,
                max_attempts = attempts + max_attempts, expires_at = $2, reconciles = 0, next_reconcile_at = NULL
          WHERE id = $1"
    };
    sqlx::query(requeue).bind(id).bind(runs_until).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(if behind { Requeue::QueuedBehindItsKey } else { Requeue::Queued })
}
