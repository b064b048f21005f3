//! Read-only queries for checking the relay from outside: `relay verify`
//! reads the state it holds against the relay's invariants, `relay demo`
//! prints what a run left. None is on a hot path.

use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

/// Every event id in `consumer`'s inbox.
pub async fn inbox_ids(pool: &PgPool, consumer: &str) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT event_id FROM relay.inbox WHERE consumer = $1").bind(consumer).fetch_all(pool).await
}

/// Inbox rows by outcome.
pub async fn inbox_by_outcome(pool: &PgPool, consumer: &str) -> Result<Vec<(String, i64)>, sqlx::Error> {
    sqlx::query_as("SELECT outcome, count(*) FROM relay.inbox WHERE consumer = $1 GROUP BY outcome")
        .bind(consumer)
        .fetch_all(pool)
        .await
}

/// Event ids applied (`outcome = 'applied'`) from `topic` with type `event_type`.
pub async fn applied_ids(
    pool: &PgPool,
    consumer: &str,
    topic: &str,
    event_type: &str,
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT event_id FROM relay.inbox WHERE consumer = $1 AND topic = $2 AND event_type = $3 AND outcome = 'applied'",
    )
    .bind(consumer)
    .bind(topic)
    .bind(event_type)
    .fetch_all(pool)
    .await
}

/// How many events were applied from `topic` with type `event_type`.
pub async fn applied_count(pool: &PgPool, consumer: &str, topic: &str, event_type: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*) FROM relay.inbox WHERE consumer = $1 AND topic = $2 AND event_type = $3 AND outcome = 'applied'",
    )
    .bind(consumer)
    .bind(topic)
    .bind(event_type)
    .fetch_one(pool)
    .await
}

/// Where each dead letter was read: `(topic, partition, offset, event id)`.
pub async fn parked_positions(
    pool: &PgPool,
    consumer: &str,
) -> Result<Vec<(String, i32, i64, Option<String>)>, sqlx::Error> {
    sqlx::query_as(r#"SELECT topic, partition, "offset", event_id FROM relay.dead_letters WHERE consumer = $1"#)
        .bind(consumer)
        .fetch_all(pool)
        .await
}

/// Every intent: `(id, state, idempotency key, source event id)`.
pub async fn intents_brief(pool: &PgPool, consumer: &str) -> Result<Vec<(Uuid, String, String, String)>, sqlx::Error> {
    sqlx::query_as("SELECT id, state, idempotency_key, source_event_id FROM relay.intents WHERE consumer = $1")
        .bind(consumer)
        .fetch_all(pool)
        .await
}

/// Outbox rows marked published: `(id, topic)`.
pub async fn published_rows(pool: &PgPool, consumer: &str) -> Result<Vec<(Uuid, String)>, sqlx::Error> {
    sqlx::query_as("SELECT id, topic FROM relay.outbox WHERE consumer = $1 AND state = 'published'")
        .bind(consumer)
        .fetch_all(pool)
        .await
}

/// Intents that ended dead although an attempt of theirs may have been
/// applied: its outcome says so ([`relay_core::retry::AttemptOutcome::may_have_applied`]),
/// or its status is one the outcome table says may follow an applied call
/// on its endpoint (`may_apply`: endpoint and status pairs, from
/// [`relay_core::answers::statuses_that_may_have_applied`]), which catches
/// attempts recorded before that table counted them. Their `on_dead`
/// effects announced a failure for a call that may have gone through. Read
/// from the attempts, not from `ever_uncertain`, so that a flag that was
/// not set is caught too. An intent an operator resolved as failed
/// ([`relay_core::retry::ErrorClass::Resolved`]) is not one: the provider
/// was asked; nor is an attempt a later reconciliation found not applied
/// ([`relay_core::profile::Reconciled::NotApplied`]). Each as
/// `id (key): attempt n was <outcome> (HTTP status)`, the first such attempt.
pub async fn dead_after_uncertain(
    pool: &PgPool,
    consumer: &str,
    may_apply: &[(String, u16)],
) -> Result<Vec<String>, sqlx::Error> {
    use relay_core::retry::{AttemptOutcome, ErrorClass};
    let may: Vec<&str> =
        AttemptOutcome::ALL.into_iter().filter(|o| o.may_have_applied()).map(AttemptOutcome::as_str).collect();
    let endpoints: Vec<&str> = may_apply.iter().map(|(e, _)| e.as_str()).collect();
    let statuses: Vec<i32> = may_apply.iter().map(|(_, s)| i32::from(*s)).collect();
    sqlx::query_scalar(
        "SELECT i.id::text || ' (' || i.idempotency_key || '): attempt '
                || (array_agg(a.attempt::text || ' was ' || a.outcome
                              || coalesce(' (HTTP ' || a.status::text || ')', '') ORDER BY a.attempt))[1]
           FROM relay.intents i JOIN relay.intent_attempts a ON a.intent_id = i.id
          WHERE i.consumer = $1 AND i.state = 'dead'
            AND (a.outcome = ANY($2)
                 OR EXISTS (SELECT 1 FROM unnest($5::text[], $6::int[]) AS m(endpoint, status)
                             WHERE m.endpoint = i.endpoint AND m.status = a.status))
            AND i.last_error_class IS DISTINCT FROM $3
            AND NOT EXISTS (SELECT 1 FROM relay.intent_reconciliations r
                             WHERE r.intent_id = i.id AND r.verdict = $4 AND r.finished_at >= a.finished_at)
          GROUP BY i.id, i.idempotency_key",
    )
    .bind(consumer)
    .bind(may)
    .bind(ErrorClass::Resolved)
    .bind(relay_core::profile::Reconciled::NotApplied)
    .bind(endpoints)
    .bind(statuses)
    .fetch_all(pool)
    .await
}

/// Outbox rows that ended dead, each as `id: last error`.
pub async fn dead_outbox(pool: &PgPool, consumer: &str) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT id::text || ': ' || coalesce(last_error, '') FROM relay.outbox WHERE consumer = $1 AND state = 'dead'",
    )
    .bind(consumer)
    .fetch_all(pool)
    .await
}

/// A table of claimed rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claimed {
    /// `relay.intents`.
    Intents,
    /// `relay.outbox`.
    Outbox,
}

/// Rows of `table` running past their lease, or pending past their due
/// time, by more than `grace`, each as `id (state)`. A pending row waiting
/// behind an earlier row of its ordering key that an operator must act on
/// (an uncertain or holding dead intent, a dead outbox row) is not stuck:
/// it waits as designed, and its head is what the operator sees.
pub async fn stuck(pool: &PgPool, table: Claimed, consumer: &str, grace: Duration) -> Result<Vec<String>, sqlx::Error> {
    let (table, parked) = match table {
        Claimed::Intents => (
            "intents",
            "e.ordering_key = r.ordering_key AND (e.state = 'uncertain' OR (e.state = 'dead' AND e.holds_key))",
        ),
        Claimed::Outbox => ("outbox", "e.topic = r.topic AND e.ordering_key = r.ordering_key AND e.state = 'dead'"),
    };
    sqlx::query_scalar(&format!(
        "SELECT r.id::text || ' (' || r.state || ')' FROM relay.{table} r WHERE r.consumer = $1 AND (
             (r.state = 'running' AND r.locked_until < now() - make_interval(secs => $2))
          OR (r.state = 'pending' AND r.next_attempt_at < now() - make_interval(secs => $2)
              AND NOT (r.ordering_key IS NOT NULL AND EXISTS (
                  SELECT 1 FROM relay.{table} e WHERE e.consumer = r.consumer AND e.seq < r.seq AND {parked}))))"
    ))
    .bind(consumer)
    .bind(grace.as_secs_f64())
    .fetch_all(pool)
    .await
}

/// Pending or running rows of either table that have made `attempts`
/// attempts or more, each as `intent|outbox id (n attempts: last error)`.
pub async fn failing(pool: &PgPool, consumer: &str, attempts: i32) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT 'intent ' || id::text || ' (' || attempts || ' attempts: ' || coalesce(last_error, '') || ')'
           FROM relay.intents WHERE consumer = $1 AND state IN ('pending', 'running') AND attempts >= $2
         UNION ALL
         SELECT 'outbox ' || id::text || ' (' || attempts || ' attempts: ' || coalesce(last_error, '') || ')'
           FROM relay.outbox WHERE consumer = $1 AND state IN ('pending', 'running') AND attempts >= $2",
    )
    .bind(consumer)
    .bind(attempts)
    .fetch_all(pool)
    .await
}

/// Dead intents of every consumer: `(idempotency key, last status, last error)`.
pub async fn dead_intents(pool: &PgPool) -> Result<Vec<(String, Option<i32>, Option<String>)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT idempotency_key, last_status, last_error FROM relay.intents WHERE state = 'dead' ORDER BY idempotency_key",
    )
    .fetch_all(pool)
    .await
}

/// Published outbox rows by topic and event type (dead-letter copies as one type).
pub async fn published_by_type(pool: &PgPool) -> Result<Vec<(String, String, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT topic, CASE WHEN action = 'dead_letter' THEN '(copies of dead-lettered records)' ELSE event_type END, count(*)
           FROM relay.outbox WHERE state = 'published' GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .fetch_all(pool)
    .await
}

/// Every dead letter: `(id, topic, partition, offset, class, reason)`.
pub async fn dead_letters_brief(pool: &PgPool) -> Result<Vec<(i64, String, i32, i64, String, String)>, sqlx::Error> {
    sqlx::query_as(r#"SELECT id, topic, partition, "offset", error_class, reason FROM relay.dead_letters ORDER BY id"#)
        .fetch_all(pool)
        .await
}

/// `consumer`'s sagas of `saga_type`: `(id, state)`.
pub async fn sagas_of(pool: &PgPool, consumer: &str, saga_type: &str) -> Result<Vec<(String, String)>, sqlx::Error> {
    sqlx::query_as("SELECT saga_id, state FROM relay.sagas WHERE consumer = $2 AND saga_type = $1 ORDER BY saga_id")
        .bind(saga_type)
        .bind(consumer)
        .fetch_all(pool)
        .await
}
