//! A batch's effects — intents, outbox rows and counter increments — written
//! with one statement.

use std::borrow::Borrow;
use std::collections::{HashMap, HashSet};

use relay_core::OutboxRecord;
use sqlx::{PgConnection, Row};
use uuid::Uuid;

use crate::intents::{Held, Hold, NewIntent};
use crate::{inbox, intents, outbox, param_count, shift_params};

/// What [`insert`] wrote: the ids that were new (the others existed).
#[derive(Debug, Default)]
pub struct Inserted {
    /// New intents.
    pub intents: HashSet<Uuid>,
    /// New outbox rows.
    pub outbox: HashSet<Uuid>,
    /// New intents written already claimed ([`Hold`]), by id.
    pub held: HashMap<Uuid, Held>,
}

/// Insert intents and outbox rows (`(source_id, record)` pairs) and add to
/// counters (`(name, shard, increment)`), as the multi-row insert of
/// intents, [`outbox::insert_many`] and the counters' upsert do, but in
/// one statement: each is a data-modifying part of one `WITH`. They are
/// independent (none reads what another writes), so the one statement does
/// exactly what the three did, in one round trip instead of three: the
/// consumer writes them in every batch, and each round trip is a wait for a
/// core on a loaded machine, or for the network with the database elsewhere.
///
/// An empty part is left out of the statement, not written as an insert of
/// no rows: the tables' statement-level triggers send the dispatchers' and
/// publishers' wake-ups, and they would fire for an insert of nothing too.
///
/// `hold` writes some of the intents already claimed by a dispatcher (see
/// `intents::INSERT_MANY`); their claims come back in [`Inserted::held`].
pub async fn insert(
    conn: &mut PgConnection,
    consumer: &str,
    new_intents: &[impl Borrow<NewIntent> + Sync],
    hold: Option<Hold<'_>>,
    new_outbox: &[(&str, &OutboxRecord)],
    counters: &[(&str, i32, i64)],
) -> Result<Inserted, sqlx::Error> {
    let parts = [
        (!new_intents.is_empty(), "new_intents", intents::INSERT_MANY),
        (!new_outbox.is_empty(), "new_outbox", outbox::INSERT_MANY),
        (!counters.is_empty(), "counted", inbox::ADD_TO_COUNTERS),
    ];
    let (mut with, mut select, mut params) = (Vec::new(), Vec::new(), 0);
    for (wanted, name, sql) in parts {
        if !wanted {
            continue;
        }
        with.push(format!("{name} AS ({})", shift_params(sql, params)));
        match name {
            "new_intents" => {
                select.push(format!("SELECT '{name}' AS part, id, lease_token, expires_at, created_at FROM {name}"))
            }
            "new_outbox" => select.push(format!(
                "SELECT '{name}' AS part, id, NULL::uuid AS lease_token, NULL::timestamptz AS expires_at, \
                 NULL::timestamptz AS created_at FROM {name}"
            )),
            _ => {}
        }
        params += param_count(sql);
    }
    if with.is_empty() {
        return Ok(Inserted::default());
    }
    // Keyed rows draw their `seq` in commit order (crate::ordering).
    let keys = new_intents
        .iter()
        .filter_map(|i| i.borrow().intent.ordering_key.as_deref().map(crate::ordering::Key::Intent))
        .chain(crate::ordering::outbox_keys(new_outbox.iter().map(|(_, r)| *r)));
    crate::ordering::lock(&mut *conn, consumer, keys).await?;
    if select.is_empty() {
        select.push(
            "SELECT NULL::text AS part, NULL::uuid AS id, NULL::uuid AS lease_token, \
             NULL::timestamptz AS expires_at, NULL::timestamptz AS created_at WHERE false"
                .into(),
        );
    }
    let delays = intents::fair_delays(&mut *conn, consumer, new_intents).await?;
    let sql = format!("WITH {} {}", with.join(", "), select.join(" UNION ALL "));
    let mut q = sqlx::query(&sql);
    if !new_intents.is_empty() {
        q = intents::bind_many(q, new_intents, hold, delays);
    }
    if !new_outbox.is_empty() {
        q = outbox::bind_many(q, consumer, new_outbox);
    }
    if !counters.is_empty() {
        q = inbox::bind_counters(q, consumer, counters);
    }
    let mut inserted = Inserted::default();
    for row in q.fetch_all(conn).await? {
        let id: Uuid = row.try_get("id")?;
        if row.try_get::<&str, _>("part")? != "new_intents" {
            inserted.outbox.insert(id);
            continue;
        }
        inserted.intents.insert(id);
        if let Some(lease_token) = row.try_get::<Option<Uuid>, _>("lease_token")? {
            let (expires_at, created_at) = (row.try_get("expires_at")?, row.try_get("created_at")?);
            inserted.held.insert(id, Held { lease_token, expires_at, created_at });
        }
    }
    Ok(inserted)
}

#[cfg(test)]
mod tests {
    #[test]
    fn each_part_counts_its_parameters() {
        use crate::{inbox, intents, outbox, param_count};
        assert_eq!(param_count(intents::INSERT_MANY), 26);
        assert_eq!(param_count(outbox::INSERT_MANY), 10);
        assert_eq!(param_count(inbox::ADD_TO_COUNTERS), 4);
        assert_eq!(param_count("SELECT 1"), 0);
    }
}
