//! Ordering keys in commit order (R13).
//!
//! Rows with an ordering key are called (intents) or published (outbox) one
//! at a time, in `seq` order, and `seq` is drawn when a row is inserted. Two
//! transactions that write rows for one key — records of two partitions, each
//! in a transaction of its own — could commit in the other order than they drew
//! their numbers: the row committed first is claimed at once, and the one
//! committed later, with the lower `seq`, then looked "earlier" than a row
//! already running, so both ran at once, in the wrong order.
//!
//! So a transaction locks each ordering key before it inserts rows with
//! that key, held until it commits or rolls back: the next transaction for
//! the key waits for it and draws its `seq` after that commit, which makes
//! `seq` order the commit order for every key. The locks of one statement
//! are taken in one order (sorted), and a consumer's batch takes the keys of
//! all its records in one statement before it writes anything
//! ([`keys_of`]), so two batches cannot deadlock each other through them:
//! each waits for the other's keys in one global order. Two can still
//! deadlock, rarely: a code handler's effects, known only once it ran, lock
//! later; or one holding a key waits for an inbox row the other holds (the
//! same event id delivered on two partitions at once). PostgreSQL then
//! aborts one of them after `deadlock_timeout` (`40P01`), and the consumer
//! retries its batch. Only rows with a key pay for this: one round trip
//! more, and a wait behind the other transaction of that key.
//!
//! A key's lock is a row of `relay.key_locks` (migration 31), locked
//! `FOR UPDATE`: a table relay owns, so no other role can take a key's lock
//! and stall its partition, as any role could take an advisory lock. A row
//! is a deployment's slot ([`Key::slot`]: 2^20 per space), written on the
//! slot's first use and kept: two keys that share a slot wait for each
//! other, which costs a wait and nothing else. Intents' and outbox rows'
//! keys have spaces of their own, and the keys applications give (stored as
//! `app:KEY`, locked by the front door's SQL functions) two more: a key an
//! application chose to share a route key's slot could otherwise make the
//! route's batches wait on the application's open transaction.

use std::collections::HashSet;

use sqlx::Connection;

use relay_core::ids::APP_KEY_PREFIX;
use sqlx::PgConnection;

/// The slot spaces ([`Key::slot`]); `relay.call` locks its keys in
/// [`APP_INTENTS`] and `relay.publish` in [`APP_OUTBOX`] by these numbers.
const INTENTS: i32 = 0;
const OUTBOX: i32 = 1;
const APP_INTENTS: i32 = 2;
const APP_OUTBOX: i32 = 3;

/// An ordering key about to get a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Key<'a> {
    /// An intent's ordering key.
    Intent(&'a str),
    /// An outbox row's ordering key, with its topic.
    Outbox {
        /// The topic.
        topic: &'a str,
        /// The ordering key.
        key: &'a str,
    },
}

/// The ordering keys of what `effects` writes, intents' and outbox rows'.
pub fn keys_of(effects: &relay_core::Effects) -> impl Iterator<Item = Key<'_>> {
    effects
        .intents
        .iter()
        .filter_map(|i| i.intent.ordering_key.as_deref().map(Key::Intent))
        .chain(outbox_keys(effects.events.iter()))
}

impl Key<'_> {
    /// This key's slot in `relay.key_locks` for `consumer`: its space, then
    /// 20 bits of the SHA-256 of its name, as `relay.key_slot` computes it.
    pub fn slot(&self, consumer: &str) -> i32 {
        use sha2::{Digest, Sha256};
        // Namespaced by consumer, as the claims compare keys: two
        // deployments sharing a database do not wait on each other's keys.
        let (space, name) = match *self {
            Key::Intent(k) => {
                (if k.starts_with(APP_KEY_PREFIX) { APP_INTENTS } else { INTENTS }, format!("{consumer}\u{2}{k}"))
            }
            // Kafka topic names hold only [a-zA-Z0-9._-], so the first U+0001 ends the topic.
            Key::Outbox { topic, key } => (
                if key.starts_with(APP_KEY_PREFIX) { APP_OUTBOX } else { OUTBOX },
                format!("{consumer}\u{2}{topic}\u{1}{key}"),
            ),
        };
        let d = Sha256::digest(name.as_bytes());
        (space << 20) | (i32::from(d[0]) << 12) | (i32::from(d[1]) << 4) | (i32::from(d[2]) >> 4)
    }
}

/// Lock `keys` of `consumer`'s rows for the rest of the transaction `conn`
/// is in (nothing to do and no round trip when there are none), waiting for
/// a transaction that holds one. Call it before inserting the rows.
pub async fn lock<'a>(
    conn: &mut PgConnection,
    consumer: &str,
    keys: impl IntoIterator<Item = Key<'a>>,
) -> Result<(), sqlx::Error> {
    let slots = slots(consumer, keys);
    if slots.is_empty() || crate::sabotage::is(consumer, relay_core::sabotage::Sabotage::OrderingByInsert) {
        return Ok(());
    }
    sqlx::query("SELECT relay.lock_keys($1, $2)").bind(consumer).bind(&slots).execute(conn).await?;
    Ok(())
}

/// A deployment's slot ([`Key::slot`]).
pub type Slot<'a> = (&'a str, i32);

/// Write the rows of `slots` that are new, each in a transaction of its
/// own, before [`try_lock_slots`] (which cannot lock a row that does not
/// exist). A new slot another transaction wrote and has not committed is
/// waited for at most 100 ms and then left out: that transaction holds it.
/// Transient errors are returned; a slot left out is found held.
pub async fn write_slots(conn: &mut PgConnection, slots: &[Slot<'_>]) -> Result<(), sqlx::Error> {
    async fn write(conn: &mut PgConnection, slots: &[Slot<'_>]) -> Result<bool, sqlx::Error> {
        let mut tx = conn.begin_with("BEGIN; SET LOCAL lock_timeout = '100ms'").await?;
        let written = sqlx::query(WRITE)
            .bind(slots.iter().map(|s| s.0).collect::<Vec<_>>())
            .bind(slots.iter().map(|s| s.1).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await;
        match written {
            Ok(_) => tx.commit().await.map(|()| true),
            Err(e) if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("55P03") => Ok(false),
            Err(e) => Err(e),
        }
    }
    let mut slots = slots.to_vec();
    slots.sort_unstable();
    slots.dedup();
    if slots.is_empty() || write(conn, &slots).await? {
        return Ok(());
    }
    // One new slot is held: the others, one by one, are not.
    for slot in &slots {
        write(conn, std::slice::from_ref(slot)).await?;
    }
    Ok(())
}

/// Lock those of `slots` that no other transaction holds, without
/// waiting, for the rest of the transaction `conn` is in; returns the slots
/// it locked (a slot whose row does not exist is not: [`write_slots`]
/// first). A writer that must not wait (one batch of many keys, any of
/// which an application may hold for as long as its transaction stays open)
/// writes the rows of the keys it got and leaves the others for later.
pub async fn try_lock_slots(
    conn: &mut PgConnection,
    slots: &[Slot<'_>],
) -> Result<HashSet<(String, i32)>, sqlx::Error> {
    if slots.is_empty() {
        return Ok(HashSet::new());
    }
    let got: Vec<(String, i32)> = sqlx::query_as(TRY_LOCK)
        .bind(slots.iter().map(|s| s.0).collect::<Vec<_>>())
        .bind(slots.iter().map(|s| s.1).collect::<Vec<_>>())
        .fetch_all(conn)
        .await?;
    Ok(got.into_iter().collect())
}

/// The distinct slots of `keys`, sorted.
fn slots<'a>(consumer: &str, keys: impl IntoIterator<Item = Key<'a>>) -> Vec<i32> {
    let mut slots: Vec<i32> = keys.into_iter().map(|k| k.slot(consumer)).collect();
    slots.sort_unstable();
    slots.dedup();
    slots
}

/// `$1` consumers, `$2` slots: the rows that are new.
const WRITE: &str = "INSERT INTO relay.key_locks (consumer, slot)
     SELECT c, s FROM unnest($1::text[], $2::int4[]) AS t(c, s) ORDER BY c, s
     ON CONFLICT DO NOTHING";
/// `$1` consumers, `$2` slots, locked in one order, skipping the rows
/// another transaction holds.
const TRY_LOCK: &str = "SELECT k.consumer, k.slot FROM relay.key_locks k
      JOIN unnest($1::text[], $2::int4[]) AS t(c, s) ON k.consumer = t.c AND k.slot = t.s
     ORDER BY k.consumer, k.slot FOR UPDATE OF k SKIP LOCKED";

/// The singletons' rows of `relay.key_locks`: what only one relay process
/// may do at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Singleton {
    /// Registering the front door (concurrent GRANTs on one function fail).
    Registration = -1,
    /// The retention cleaner.
    Retention = -2,
}

/// Take `which` for the rest of the transaction, waiting for its holder.
pub async fn lock_singleton(conn: &mut PgConnection, which: Singleton) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1 FROM relay.key_locks WHERE consumer = '' AND slot = $1 FOR UPDATE")
        .bind(which as i32)
        .execute(conn)
        .await?;
    Ok(())
}

/// Take `which` for the rest of the transaction if no other holds it
/// (`false`: another does).
pub async fn try_lock_singleton(conn: &mut PgConnection, which: Singleton) -> Result<bool, sqlx::Error> {
    let got: Option<i32> =
        sqlx::query_scalar("SELECT slot FROM relay.key_locks WHERE consumer = '' AND slot = $1 FOR UPDATE SKIP LOCKED")
            .bind(which as i32)
            .fetch_optional(conn)
            .await?;
    Ok(got.is_some())
}

/// The ordering keys of outbox records `rows`.
pub fn outbox_keys<'a>(rows: impl Iterator<Item = &'a relay_core::OutboxRecord>) -> impl Iterator<Item = Key<'a>> {
    rows.filter_map(|r| r.ordering_key.as_deref().map(|key| Key::Outbox { topic: &r.topic, key }))
}
