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
//! So a transaction takes a transaction-scoped advisory lock per ordering key
//! before it inserts rows with that key, held until it commits or rolls back:
//! the next transaction for the key waits for it and draws its `seq` after
//! that commit, which makes `seq` order the commit order for every key. The
//! locks of one statement are taken in one order (sorted), and a consumer's
//! batch takes the keys of all its records in one statement before it writes
//! anything ([`keys_of`]), so two batches cannot deadlock each other through
//! them: each waits for the other's keys in one global order. Two can still
//! deadlock, rarely: a code handler's effects, known only once it ran, lock
//! later; or one holding a key waits for an inbox row the other holds (the
//! same event id delivered on two partitions at once). PostgreSQL then
//! aborts one of them after `deadlock_timeout` (`40P01`), and the consumer
//! retries its batch. Only rows with a key
//! pay for this: one round trip more, and a wait behind the other
//! transaction of that key.
//!
//! Intents' and outbox rows' keys are locked in name spaces of their own
//! (the first argument of `pg_advisory_xact_lock(int4, int4)`); an outbox
//! key is ordered per topic. A hash collision only makes two keys wait for
//! each other, so the keys applications give (stored as `app:KEY`, written
//! by the front door's SQL functions) are locked in two more name spaces:
//! a key an application chose to collide with a route's could otherwise make
//! the route's batches wait on the application's open transaction.

use relay_core::ids::APP_KEY_PREFIX;
use sqlx::PgConnection;

/// The name space of routes' intents' ordering keys.
const INTENTS: i32 = 0x5245_4c01;
/// The name space of routes' outbox rows' ordering keys (per topic).
const OUTBOX: i32 = 0x5245_4c02;
/// The name space of applications' intents' ordering keys (`relay.call`,
/// migration 29, takes it by its decimal value 1380273156).
const APP_INTENTS: i32 = 0x5245_4c04;
/// The name space of applications' outbox rows' ordering keys
/// (`relay.publish`, migration 30: 1380273157).
const APP_OUTBOX: i32 = 0x5245_4c05;

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
        .chain(crate::outbox::ordering_keys(effects.events.iter()))
}

/// Lock `keys` of `consumer`'s rows for the rest of the transaction `conn`
/// is in (nothing to do and no round trip when there are none). Call it
/// before inserting the rows.
pub async fn lock<'a>(
    conn: &mut PgConnection,
    consumer: &str,
    keys: impl IntoIterator<Item = Key<'a>>,
) -> Result<(), sqlx::Error> {
    let (mut spaces, mut names) = (Vec::new(), Vec::new());
    for key in keys {
        match key {
            // Namespaced by consumer, as the claims compare keys: two
            // deployments sharing a database do not wait on each other's keys.
            Key::Intent(k) => {
                spaces.push(if k.starts_with(APP_KEY_PREFIX) { APP_INTENTS } else { INTENTS });
                names.push(format!("{consumer}\u{2}{k}"));
            }
            Key::Outbox { topic, key } => {
                spaces.push(if key.starts_with(APP_KEY_PREFIX) { APP_OUTBOX } else { OUTBOX });
                // Kafka topic names hold only [a-zA-Z0-9._-], so the first U+0001 ends the topic.
                names.push(format!("{consumer}\u{2}{topic}\u{1}{key}"));
            }
        }
    }
    if names.is_empty() || crate::sabotage::is(consumer, crate::sabotage::Broken::OrderingByInsert) {
        return Ok(());
    }
    sqlx::query(LOCK).bind(&spaces).bind(&names).execute(conn).await?;
    Ok(())
}

/// `$1` name spaces, `$2` names. `pg_advisory_xact_lock` is volatile, so it
/// is evaluated row by row after the sort, in the sorted order.
pub const LOCK: &str = "SELECT pg_advisory_xact_lock(s, h)
           FROM (SELECT DISTINCT s, hashtext(n) AS h FROM unnest($1::int4[], $2::text[]) AS t(s, n)) k
          ORDER BY s, h";
