//! Saga state moved by guarded transitions (R5): the `WHERE state = ANY(from)`
//! is the guard, and zero affected rows is classified, never ignored.

use relay_core::{HistoryKind, SagaMove};
use sqlx::PgConnection;

/// What a guarded transition did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// The saga moved (or was started).
    Applied,
    /// The saga is already in the target state: a duplicate.
    AlreadyThere,
    /// The saga is in a state the transition may not start from.
    Invalid {
        /// Its current state.
        current: String,
    },
    /// The saga does not exist (yet): a missing reference (R19).
    Missing,
}

/// Make saga move `m` because of `source_id` (an input event, or an
/// intent's outcome), and when it moved, record it in the history with
/// `kind` and `detail` (R14). The one way both ingest and call outcomes move
/// a saga: a start creates the saga in `to` unless it exists; a transition
/// moves it to `to` only from one of `from` (the guard).
pub async fn apply(
    conn: &mut PgConnection,
    consumer: &str,
    m: &SagaMove,
    source_id: &str,
    kind: HistoryKind,
    detail: &serde_json::Value,
) -> Result<Transition, sqlx::Error> {
    let moved = if m.start {
        sqlx::query(
            "INSERT INTO relay.sagas (consumer, saga_type, saga_id, state, last_event_id) VALUES ($6, $1, $2, $4, $5)
             ON CONFLICT (consumer, saga_type, saga_id) DO NOTHING",
        )
    } else {
        sqlx::query(
            "UPDATE relay.sagas
                SET state = $4, version = version + 1, last_event_id = $5, updated_at = now()
              WHERE consumer = $6 AND saga_type = $1 AND saga_id = $2 AND state = ANY($3)",
        )
    }
    .bind(&m.saga_type)
    .bind(&m.saga_id)
    .bind(&m.from)
    .bind(&m.to)
    .bind(source_id)
    .bind(consumer)
    .execute(&mut *conn)
    .await?
    .rows_affected()
        == 1;
    if !moved {
        return classify(conn, consumer, &m.saga_type, &m.saga_id, &m.to).await;
    }
    let subject = format!("{}/{}", m.saga_type, m.saga_id);
    crate::inbox::record_history(conn, consumer, source_id, &m.action, kind, Some(&subject), detail).await?;
    Ok(Transition::Applied)
}

async fn classify(
    conn: &mut PgConnection,
    consumer: &str,
    saga_type: &str,
    saga_id: &str,
    to: &str,
) -> Result<Transition, sqlx::Error> {
    Ok(match state(conn, consumer, saga_type, saga_id).await? {
        None => Transition::Missing,
        Some(s) if s == to => Transition::AlreadyThere,
        Some(current) => Transition::Invalid { current },
    })
}

/// The current state of `consumer`'s saga.
pub async fn state(
    conn: &mut PgConnection,
    consumer: &str,
    saga_type: &str,
    saga_id: &str,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT state FROM relay.sagas WHERE consumer = $3 AND saga_type = $1 AND saga_id = $2")
        .bind(saga_type)
        .bind(saga_id)
        .bind(consumer)
        .fetch_optional(conn)
        .await
}
