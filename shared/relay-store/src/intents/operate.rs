//! The operator's moves and the reconciler's: uncertain intents taken and
//! given back, skipped, queued again.

use std::time::Duration;

use chrono::{DateTime, Utc};
use relay_core::IntentState;
use sqlx::PgConnection;
use uuid::Uuid;

use super::{ClaimedIntent, Fenced, claimed_columns};

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
/// uncertain ([`rescue_expired`](super::rescue_expired)), and [`give_back_uncertain`] does at once.
/// One whose stored columns cannot be read is given back at once, and the
/// error says why ([`Unreadable::reason`](crate::Unreadable::reason)).
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
