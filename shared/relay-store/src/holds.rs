//! Held record keys (`on_poison = "hold_key"`, consumer side): when a record
//! of such a route is dead-lettered, its Kafka key is held on its partition,
//! and the key's later records there are parked as dead letters of class
//! `held` behind it, in order, while other keys flow. The operator releases
//! the key by replaying the head (once it resolves) or skipping it; the held
//! records are then replayed in offset order (`relay::ops::admin`).
//!
//! A consumer batch reads the holds of its keys `FOR SHARE` and a release
//! locks its hold `FOR UPDATE`: a record held while a release runs is
//! either seen by it (the release waits for the batch) or not held at all
//! (the batch waits for the release, then finds no hold), never stranded.

use chrono::{DateTime, Utc};
use relay_core::{Poison, RawRecord};
use sqlx::{FromRow, PgConnection};

/// The keys among `keys` held on `topic`/`partition`, each with the offset
/// of the record holding it, locked `FOR SHARE` until the caller's
/// transaction ends.
pub async fn held(
    conn: &mut PgConnection,
    consumer: &str,
    topic: &str,
    partition: i32,
    keys: &[&[u8]],
) -> Result<Vec<(Vec<u8>, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT key, head_offset FROM relay.held_keys
          WHERE consumer = $1 AND topic = $2 AND partition = $3
            AND sha256(key) = ANY(ARRAY(SELECT sha256(k) FROM unnest($4::bytea[]) AS k))
            AND key = ANY($4::bytea[])
            FOR SHARE",
    )
    .bind(consumer)
    .bind(topic)
    .bind(partition)
    .bind(keys)
    .fetch_all(conn)
    .await
}

/// Hold `record`'s key behind its dead letter (just parked, or parked
/// before), unless the key is held already, the record has no key, or its
/// dead letter was resolved (a re-read of the topic must not hold the key
/// again behind a record an operator dealt with).
pub async fn open(conn: &mut PgConnection, consumer: &str, record: &RawRecord) -> Result<(), sqlx::Error> {
    let Some(key) = &record.key else { return Ok(()) };
    sqlx::query(&format!(
        r#"WITH head AS (
               SELECT id FROM relay.dead_letters
                WHERE consumer = $1 AND topic = $2 AND partition = $3 AND "offset" = $5
                  AND NOT {resolved}),
           hold AS (
               INSERT INTO relay.held_keys (consumer, topic, partition, key, head, head_offset)
               SELECT $1, $2, $3, $4, head.id, $5 FROM head
               ON CONFLICT DO NOTHING
               RETURNING id, head)
           UPDATE relay.dead_letters d SET hold_id = hold.id FROM hold WHERE d.id = hold.head"#,
        resolved = crate::dead_letters::RESOLVED
    ))
    .bind(consumer)
    .bind(&record.topic)
    .bind(record.partition)
    .bind(key)
    .bind(record.offset)
    .execute(conn)
    .await?;
    Ok(())
}

/// The reason stored with a held record. It does not name the head: the
/// head moves when a held record fails in its turn, and rewriting the
/// reasons of everything held behind would cost a release O(backlog). The
/// dead letter's `held_behind` and `relay dead-letters holds` name it.
pub const HELD_REASON: &str = "held: an earlier record of its key on this partition was dead-lettered (on_poison = \
     \"hold_key\"); it is applied, in order, once that one is replayed or skipped";

/// How a held key is shown (logs, CLI, API, console): its first 256 bytes
/// as text, invalid UTF-8 replaced. The bytes themselves stay in the table.
pub fn preview(key: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(&key[..key.len().min(256)])
}

fn serialize_preview<S: serde::Serializer>(key: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&preview(key))
}

/// A held key.
#[derive(Debug, Clone, FromRow, serde::Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct HeldKey {
    /// Id of the hold.
    pub id: i64,
    pub topic: String,
    pub partition: i32,
    /// The Kafka record key held (serialized as its [`preview`]).
    #[serde(serialize_with = "serialize_preview")]
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub key: Vec<u8>,
    /// The dead letter that holds it: replay or skip it to release the key.
    pub head: i64,
    pub head_offset: i64,
    /// Held since.
    pub since: DateTime<Utc>,
    /// Records held behind the head, waiting.
    pub held: i64,
    /// The head was replayed (and resolved) or skipped, but the release of
    /// its key was cut short (a crash between two chunks): replay or skip
    /// the head again to finish it.
    pub head_resolved: bool,
}

const HELD_KEY: &str = r#"h.id, h.topic, h.partition, h.key, h.head, h.head_offset, h.since,
    (SELECT count(*) FROM relay.dead_letters d WHERE d.hold_id = h.id AND d."offset" > h.head_offset
        AND d.replay_state = 'open') AS held,
    coalesce((SELECT d.replay_state <> 'open'
       FROM relay.dead_letters d WHERE d.id = h.head), false) AS head_resolved"#;

/// A hold, as a release works on it: without [`HeldKey`]'s counts, which
/// read the whole backlog.
#[derive(Debug, Clone, FromRow)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct Hold {
    /// Id of the hold.
    pub id: i64,
    /// The Kafka record key held.
    pub key: Vec<u8>,
    /// The dead letter that holds it.
    pub head: i64,
    pub head_offset: i64,
}

/// The held keys of `consumer`, oldest first, at most `limit`.
pub async fn list(conn: &mut PgConnection, consumer: &str, limit: i64) -> Result<Vec<HeldKey>, sqlx::Error> {
    sqlx::query_as(&format!("SELECT {HELD_KEY} FROM relay.held_keys h WHERE h.consumer = $1 ORDER BY h.id LIMIT $2"))
        .bind(consumer)
        .bind(limit)
        .fetch_all(conn)
        .await
}

/// How many keys of `consumer` are held, per topic: `(topic, keys, cut
/// short)`, where the last counts those whose head was resolved but whose
/// release was cut short ([`HeldKey::head_resolved`]).
pub async fn count_by_topic(conn: &mut PgConnection, consumer: &str) -> Result<Vec<(String, i64, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT h.topic, count(*), count(*) FILTER (WHERE d.replay_state <> 'open')
           FROM relay.held_keys h JOIN relay.dead_letters d ON d.id = h.head
          WHERE h.consumer = $1 GROUP BY h.topic ORDER BY h.topic",
    )
    .bind(consumer)
    .fetch_all(conn)
    .await
}

/// Dead letter `letter` of `consumer`, locked for a replay or a skip, with
/// the hold it belongs to locked too, if any.
#[derive(Debug, Clone)]
pub enum LetterLock {
    /// No such dead letter (of this consumer).
    NotFound,
    /// Its hold changed between the two reads (a consumer batch held its key
    /// behind it, or a release let go of it): roll back and try again.
    Changed,
    /// Locked until the transaction ends.
    Locked {
        /// What was done with it before.
        state: relay_core::ReplayState,
        /// Its hold, locked (`FOR UPDATE`): the consumer's batches of the key
        /// wait until the transaction ends.
        hold: Option<Hold>,
    },
}

/// Lock dead letter `letter` and its hold, in the order a release takes
/// them (the hold, then its letters), so that a replay or a skip of a held
/// record never deadlocks with the release of its key.
pub async fn lock_letter(conn: &mut PgConnection, consumer: &str, letter: i64) -> Result<LetterLock, sqlx::Error> {
    let hold_id: Option<Option<i64>> =
        sqlx::query_scalar("SELECT hold_id FROM relay.dead_letters WHERE id = $1 AND consumer = $2")
            .bind(letter)
            .bind(consumer)
            .fetch_optional(&mut *conn)
            .await?;
    let Some(hold_id) = hold_id else { return Ok(LetterLock::NotFound) };
    let hold = match hold_id {
        Some(id) => lock(&mut *conn, id).await?,
        None => None,
    };
    let Some((state, now)) = crate::dead_letters::lock(conn, consumer, letter).await? else {
        return Ok(LetterLock::NotFound);
    };
    if now != hold.as_ref().map(|h| h.id) {
        return Ok(LetterLock::Changed);
    }
    Ok(LetterLock::Locked { state, hold })
}

/// Hold `id`, locked (`FOR UPDATE`) for a release, if it is still there.
pub async fn lock(conn: &mut PgConnection, id: i64) -> Result<Option<Hold>, sqlx::Error> {
    sqlx::query_as("SELECT id, key, head, head_offset FROM relay.held_keys WHERE id = $1 FOR UPDATE")
        .bind(id)
        .fetch_optional(conn)
        .await
}

/// The records held behind `hold`'s head after offset `after` (at least
/// the head's) and not replayed yet (a release that was cut short between
/// two chunks is taken up where it stopped), in offset order, at most
/// `limit`.
pub async fn waiting(conn: &mut PgConnection, hold: &Hold, after: i64, limit: i64) -> Result<Vec<i64>, sqlx::Error> {
    sqlx::query_scalar(&format!(
        r#"SELECT id FROM relay.dead_letters WHERE hold_id = $1 AND "offset" > $2 AND NOT {resolved}
            ORDER BY "offset" LIMIT $3"#,
        resolved = crate::dead_letters::RESOLVED
    ))
    .bind(hold.id)
    .bind(after.max(hold.head_offset))
    .bind(limit)
    .fetch_all(conn)
    .await
}

/// Held dead letters `letters` were replayed by a release: they are no
/// longer part of the hold (retention may take them in time). Let go of in
/// each chunk, so that dropping the hold clears only its head.
pub async fn let_go(conn: &mut PgConnection, hold: &Hold, letters: &[i64]) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE relay.dead_letters SET hold_id = NULL WHERE hold_id = $1 AND id = ANY($2)")
        .bind(hold.id)
        .bind(letters)
        .execute(conn)
        .await?;
    Ok(())
}

/// Held dead letter `letter` failed when its key was released: it holds the
/// key now, with its own failure, and the records after it stay held.
pub async fn move_head(
    conn: &mut PgConnection,
    hold: &mut Hold,
    letter: i64,
    offset: i64,
    poison: &Poison,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE relay.dead_letters SET error_class = $2, reason = $3 WHERE id = $1")
        .bind(letter)
        .bind(poison.class)
        .bind(&poison.reason)
        .execute(&mut *conn)
        .await?;
    sqlx::query("UPDATE relay.held_keys SET head = $2, head_offset = $3 WHERE id = $1")
        .bind(hold.id)
        .bind(letter)
        .bind(offset)
        .execute(&mut *conn)
        .await?;
    // The letters before it are done with (the old head, and those this
    // chunk replayed): no longer part of the hold.
    sqlx::query(r#"UPDATE relay.dead_letters SET hold_id = NULL WHERE hold_id = $1 AND "offset" < $2"#)
        .bind(hold.id)
        .bind(offset)
        .execute(conn)
        .await?;
    hold.head = letter;
    hold.head_offset = offset;
    Ok(())
}

/// Drop `hold`: the key flows again; its head may be cleaned up.
pub async fn release(conn: &mut PgConnection, hold: &Hold) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM relay.held_keys WHERE id = $1").bind(hold.id).execute(conn).await?;
    Ok(())
}
