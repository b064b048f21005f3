//! Parking a record that can never be processed as it is: its dead letter,
//! the hold of its key where its route says so, and its copy to the
//! dead-letter topic, in the caller's transaction.

use relay_core::effects::encode_dead_letter;
use relay_core::{InputEvent, Poison, PoisonClass, RawRecord, Router};
use relay_store::{dead_letters, holds, outbox};
use sqlx::PgConnection;
use tracing::warn;

/// Park `record` as a dead letter (and queue its copy to the dead-letter
/// topic) in the caller's transaction. `false` if it was parked already.
/// Dead-lettered on `route` (`None`: not routed), it may hold its key
/// ([`Router::holds_key`]); a [`PoisonClass::Held`] one is parked
/// behind the hold of its key.
pub async fn park(
    conn: &mut PgConnection,
    router: &Router,
    record: &RawRecord,
    poison: &Poison,
    attempts: u32,
    route: Option<&str>,
) -> Result<bool, sqlx::Error> {
    let consumer = router.consumer();
    let clean = sanitized(poison);
    let attempts_i32 = i32::try_from(attempts).unwrap_or(i32::MAX);
    let held = poison.class == PoisonClass::Held;
    let keep = router.max_record_bytes();
    let parked = dead_letters::insert(conn, consumer, record, &clean, attempts_i32, held, keep).await?;
    if !held && router.holds_key(&record.topic, route) {
        if record.key.is_some() {
            // Also when it was parked already (a redelivery, or hold_key
            // set since): the batch holds the records of its key behind it.
            holds::open(conn, consumer, record).await?;
        } else if parked.is_some() {
            // A Kafka record key is what is held: with none, nothing can
            // wait behind this record. Said once, when it is parked.
            warn!(consumer, topic = %record.topic, partition = record.partition, offset = record.offset,
                  "a record without a Kafka key was dead-lettered on a route with on_poison = \"hold_key\": \
                   no key is held, and the records after it go on");
            crate::runtime::metrics::keyless_not_held(consumer, &record.topic);
        }
    }
    if parked.is_none() {
        return Ok(false);
    }
    // A held record is not poison: it is applied once its key is released.
    if !held {
        copy_to_dead_letter_topic(conn, router, record, &clean, attempts).await?;
    }
    Ok(true)
}

/// Queue the copy of dead-lettered `record` to the dead-letter topic, if
/// there is one, in the caller's transaction: when it is parked, or when
/// a record held behind its key fails in its turn as the key is released.
pub async fn copy_to_dead_letter_topic(
    conn: &mut PgConnection,
    router: &Router,
    record: &RawRecord,
    poison: &Poison,
    attempts: u32,
) -> Result<(), sqlx::Error> {
    let Some(topic) = router.dead_letter_topic() else { return Ok(()) };
    let consumer = router.consumer();
    let copy = encode_dead_letter(consumer, topic, record, &sanitized(poison), attempts, router.max_record_bytes());
    outbox::insert(conn, consumer, &format!("{}/{}/{}", record.topic, record.partition, record.offset), &copy).await?;
    Ok(())
}

/// PostgreSQL text cannot hold U+0000, and an index entry no more than
/// ~2.7 kB: a dead letter must always be storable, whoever built the poison.
pub(crate) fn sanitized(p: &Poison) -> Poison {
    use relay_core::limits::{MAX_KEY_BYTES, MAX_REASON_BYTES, bounded};
    let clean = |s: &str, max: usize| bounded(&s.replace('\0', "\u{fffd}"), max).into_owned();
    Poison {
        class: p.class,
        reason: clean(&p.reason, MAX_REASON_BYTES),
        event_id: p.event_id.as_deref().map(|s| clean(s, MAX_KEY_BYTES)),
        event_type: p.event_type.as_deref().map(|s| clean(s, MAX_KEY_BYTES)),
    }
}

/// `p` with the identity of the event it is about.
pub(crate) fn identified(p: Poison, event: &InputEvent) -> Poison {
    p.with_identity(Some(&event.id), Some(&event.event_type))
}

/// The dead letter of a record the database rejected. The reason names the
/// SQLSTATE and the constraint, never the message (it quotes values); a
/// handler that left its savepoint aborted is named as the cause.
pub(crate) fn rejected(e: &sqlx::Error, handler: Option<&str>, event: &InputEvent) -> Poison {
    let swallowed = matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("25P02"));
    let why = match handler {
        Some(handler) if swallowed => format!(
            "handler {handler:?} swallowed a database error: the transaction was left aborted ({}); \
             a handler must return the errors of its statements",
            relay_store::rejection(e)
        ),
        _ => format!("the database rejected the event: {}", relay_store::rejection(e)),
    };
    identified(Poison::new(PoisonClass::Rejected, why), event)
}
