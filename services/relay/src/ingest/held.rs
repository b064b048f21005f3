//! The Kafka keys held behind a dead letter (`on_poison = "hold_key"`), as
//! one partition batch sees them: the records of a held key wait, parked
//! behind its head, until an operator replays or skips it.

use relay_core::{Disposition, RawRecord, Router};
use relay_store::{dead_letters, holds};
use sqlx::PgConnection;

use crate::runtime::faults::{Faults, point};

/// The held keys of one partition batch, each with its head's offset: those
/// found held when the batch began, and those a record of it held since.
#[derive(Debug, Default)]
pub(super) struct HeldKeys {
    /// A route on the topic holds keys.
    on: bool,
    keys: std::collections::HashMap<Vec<u8>, i64>,
}

impl HeldKeys {
    /// Whether `record` is held: its key is, and it comes after the head (a
    /// redelivery of the head or of a record before it is not).
    pub(super) fn holds(&self, record: &RawRecord) -> bool {
        let head = record.key.as_deref().and_then(|k| self.keys.get(k));
        head.is_some_and(|head| record.offset > *head)
    }

    /// The keys of `records` (one partition's) held now, locked until the
    /// transaction ends ([`relay_store::holds`]). No query unless some key
    /// of the partition is held (`keys_held`): holds opened before a
    /// `hold_key` route was taken out of the config hold still.
    pub(super) async fn read(
        conn: &mut PgConnection,
        router: &Router,
        faults: &Faults,
        records: &[RawRecord],
        keys_held: bool,
    ) -> Result<HeldKeys, sqlx::Error> {
        let Some(first) = records.first() else { return Ok(HeldKeys::default()) };
        let mut held = HeldKeys { on: router.holds_keys_on(&first.topic), keys: std::collections::HashMap::new() };
        if !keys_held {
            return Ok(held);
        }
        let mut keys: Vec<&[u8]> = records.iter().filter_map(|r| r.key.as_deref()).collect();
        keys.sort_unstable();
        keys.dedup();
        if !keys.is_empty() {
            let found = holds::held(conn, router.consumer(), &first.topic, first.partition, &keys).await?;
            held.keys.extend(found);
        }
        let fault = faults.hit(point::CONSUMER_AFTER_HOLD_READ).await;
        fault.map_err(|e| sqlx::Error::Io(std::io::Error::other(e)))?;
        Ok(held)
    }

    /// `record` was processed: if it was dead-lettered on a route that holds
    /// keys, its key is held from here, as the consumer's park will hold it
    /// in this transaction ([`relay_store::holds::open`]) — unless an
    /// operator resolved its dead letter before (the topic is read again).
    pub(super) async fn note(
        &mut self,
        conn: &mut PgConnection,
        router: &Router,
        record: &RawRecord,
        disposition: &Disposition,
        route: Option<&str>,
    ) -> Result<(), sqlx::Error> {
        if !self.on || !matches!(disposition, Disposition::DeadLetter(_)) {
            return Ok(());
        }
        let Some(key) = &record.key else { return Ok(()) };
        if self.keys.contains_key(key) || !router.holds_key(&record.topic, route) {
            return Ok(());
        }
        if !dead_letters::resolved_at(conn, router.consumer(), record).await? {
            self.keys.insert(key.clone(), record.offset);
        }
        Ok(())
    }
}
