//! Counts for `relay stats` ([`snapshot`]: exact, reads whole tables), for
//! the console ([`overview`]: exact while the history tables are small,
//! their sizes estimated once they are not) and for the metrics gauges
//! ([`gauges`]: cheap enough to run every few seconds in every process).

use relay_core::{InboxOutcome, IntentState, OutboxState};
use serde::Serialize;
use sqlx::PgConnection;

/// A snapshot of the relay's tables.
#[derive(Debug, Clone, Default, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Stats {
    /// Inbox rows by outcome (empty when [`Stats::inbox_estimated`] is set).
    pub inbox: Vec<(InboxOutcome, i64)>,
    /// All inbox rows, PostgreSQL's estimate, where counting them by
    /// outcome would read too large a table ([`overview`]).
    pub inbox_estimated: Option<i64>,
    /// Intents by state.
    pub intents: Vec<(IntentState, i64)>,
    /// Age in seconds of the oldest pending or running intent.
    pub oldest_pending_intent_secs: Option<f64>,
    /// Outbox rows by state.
    pub outbox: Vec<(OutboxState, i64)>,
    /// Age in seconds of the oldest unpublished outbox row.
    pub oldest_unpublished_outbox_secs: Option<f64>,
    /// Dead letters not yet replayed successfully.
    pub dead_letters_unresolved: i64,
    /// Dead letters in total.
    pub dead_letters_total: i64,
    /// Business counters `(consumer, name, value)`.
    pub counters: Vec<(String, String, i64)>,
    /// Dead intents holding their ordering key (`on_poison = "hold_key"`):
    /// each keeps the later intents of its key waiting.
    pub intents_holding_keys: i64,
    /// Kafka record keys held behind a dead letter (`on_poison = "hold_key"`).
    pub held_keys: i64,
    /// Records parked behind those, waiting for their key's release.
    pub records_held: i64,
}

impl Stats {
    /// The count of `key` in a `(key, count)` list, 0 when absent.
    pub fn count<K: PartialEq>(list: &[(K, i64)], key: K) -> i64 {
        list.iter().find(|(k, _)| *k == key).map_or(0, |(_, n)| *n)
    }
}

/// Take a snapshot.
pub async fn snapshot(conn: &mut PgConnection) -> Result<Stats, sqlx::Error> {
    let inbox = inbox_by_outcome(&mut *conn).await?;
    let intents = sqlx::query_as("SELECT state, count(*) FROM relay.intents GROUP BY state ORDER BY state")
        .fetch_all(&mut *conn)
        .await?;
    let oldest_pending_intent_secs = sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - min(created_at))::float8 FROM relay.intents
          WHERE state IN ('pending', 'running')",
    )
    .fetch_one(&mut *conn)
    .await?;
    let outbox = sqlx::query_as("SELECT state, count(*) FROM relay.outbox GROUP BY state ORDER BY state")
        .fetch_all(&mut *conn)
        .await?;
    let oldest_unpublished_outbox_secs = sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - min(created_at))::float8 FROM relay.outbox
          WHERE state IN ('pending', 'running')",
    )
    .fetch_one(&mut *conn)
    .await?;
    let (dead_letters_total, dead_letters_unresolved): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE replay_state = 'open')
           FROM relay.dead_letters",
    )
    .fetch_one(&mut *conn)
    .await?;
    let counters = counters(&mut *conn).await?;
    let (intents_holding_keys, held_keys, records_held): (i64, i64, i64) =
        sqlx::query_as(HOLDING_KEYS).fetch_one(&mut *conn).await?;
    Ok(Stats {
        inbox,
        inbox_estimated: None,
        intents,
        oldest_pending_intent_secs,
        outbox,
        oldest_unpublished_outbox_secs,
        dead_letters_unresolved,
        dead_letters_total,
        counters,
        intents_holding_keys,
        held_keys,
        records_held,
    })
}

/// Dead intents that hold their ordering key (few; read through their own
/// partial index, `intents_holding_keys`), held record keys, and the records
/// waiting behind those (through `dead_letters_by_hold`; not those a release
/// cut short replayed already).
const HOLDING_KEYS: &str = r#"SELECT
    (SELECT count(*) FROM relay.intents WHERE state = 'dead' AND holds_key),
    (SELECT count(*) FROM relay.held_keys),
    (SELECT count(*) FROM relay.held_keys h JOIN relay.dead_letters d ON d.hold_id = h.id AND d."offset" > h.head_offset
      WHERE d.replay_state = 'open')"#;

/// A history table whose size the console shows as an estimate beyond this
/// many rows (see [`overview`]).
pub const EXACT_UP_TO: i64 = 100_000;

/// [`Stats`] for a screen refreshed every few seconds: the backlog (pending,
/// running, dead intents; unpublished outbox rows; dead letters) is counted
/// exactly through the partial indexes, as for [`gauges`]. The history
/// (inbox rows by outcome, succeeded intents, published outbox rows) is
/// counted exactly only while its table holds at most `exact_up_to` live
/// rows; beyond that, counting it reads the whole table on every refresh
/// (10 M inbox rows: seconds of a core every 3 s per open console), so the
/// figure is PostgreSQL's running estimate of live rows
/// (`pg_stat_user_tables.n_live_tup`, kept up by every insert and delete;
/// no ANALYZE needed) less the exact backlog. The returned list names the
/// figures that are estimates: `inbox`, `intents.succeeded`,
/// `outbox.published`; an estimated inbox is [`Stats::inbox_estimated`].
pub async fn overview(conn: &mut PgConnection, exact_up_to: i64) -> Result<(Stats, Vec<&'static str>), sqlx::Error> {
    let live: Vec<(String, i64)> = sqlx::query_as(
        "SELECT relname::text, n_live_tup FROM pg_stat_user_tables
          WHERE schemaname = 'relay' AND relname IN ('inbox', 'intents', 'outbox')",
    )
    .fetch_all(&mut *conn)
    .await?;
    let rows = |table: &str| live.iter().find(|(t, _)| t == table).map_or(0, |(_, n)| *n);
    let big = |table: &str| rows(table) > exact_up_to;
    let mut stats = backlog(&mut *conn).await?;
    let mut estimated = Vec::new();
    if big("inbox") {
        estimated.push("inbox");
        stats.inbox_estimated = Some(rows("inbox"));
    } else {
        stats.inbox = inbox_by_outcome(&mut *conn).await?;
    }
    fn sum<K>(list: &[(K, i64)]) -> i64 {
        list.iter().map(|(_, n)| n).sum()
    }
    let succeeded = if big("intents") {
        estimated.push("intents.succeeded");
        (rows("intents") - sum(&stats.intents)).max(0)
    } else {
        sqlx::query_scalar("SELECT count(*) FROM relay.intents WHERE state = 'succeeded'").fetch_one(&mut *conn).await?
    };
    let published = if big("outbox") {
        estimated.push("outbox.published");
        (rows("outbox") - sum(&stats.outbox)).max(0)
    } else {
        sqlx::query_scalar("SELECT count(*) FROM relay.outbox WHERE state = 'published'").fetch_one(&mut *conn).await?
    };
    stats.intents.push((IntentState::Succeeded, succeeded));
    stats.intents.sort();
    stats.outbox.push((OutboxState::Published, published));
    stats.outbox.sort();
    Ok((stats, estimated))
}

/// The counts behind the metrics gauges, refreshed every
/// `admin.gauge_interval` by every relay process with an admin server.
///
/// Only what reads the backlog is counted exactly: unfinished and dead
/// intents, unpublished outbox rows, each through its partial index. The size
/// of the tables that keep history (inbox rows, succeeded intents, published
/// outbox rows) is PostgreSQL's estimate (`pg_class.reltuples`, refreshed by
/// autovacuum and ANALYZE): counting those exactly scans them whole, millions
/// of rows per interval and process once retention keeps weeks. `relay stats`
/// still counts everything exactly ([`snapshot`]).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Gauges {
    /// The backlog, exact: intents `pending`, `running`, `dead`,
    /// `uncertain`; outbox rows `pending`, `running`, `dead`; dead letters
    /// (few unless something is badly wrong, and then they are the point);
    /// counters. Its `inbox` is empty: inbox rows are history.
    #[serde(flatten)]
    pub backlog: Stats,
    /// Estimated rows per table of the `relay` schema (0 before the first
    /// ANALYZE).
    pub table_rows_estimated: Vec<(String, i64)>,
}

/// The statement behind [`Gauges`]' exact counts (public so a test can check
/// its plan): one scalar subquery per partial index, so each reads only the
/// rows it counts.
pub const GAUGE_COUNTS: &str = "SELECT
    (SELECT count(*) FROM relay.intents WHERE state = 'pending'),
    (SELECT count(*) FROM relay.intents WHERE state = 'running'),
    (SELECT count(*) FROM relay.intents WHERE state = 'dead'),
    (SELECT count(*) FROM relay.intents WHERE state = 'uncertain'),
    (SELECT extract(epoch FROM now() - min(created_at))::float8 FROM relay.intents WHERE state = 'pending'),
    (SELECT extract(epoch FROM now() - min(created_at))::float8 FROM relay.intents WHERE state = 'running'),
    (SELECT count(*) FROM relay.outbox WHERE state = 'pending'),
    (SELECT count(*) FROM relay.outbox WHERE state = 'running'),
    (SELECT count(*) FROM relay.outbox WHERE state = 'dead'),
    (SELECT extract(epoch FROM now() - min(created_at))::float8 FROM relay.outbox WHERE state = 'pending'),
    (SELECT extract(epoch FROM now() - min(created_at))::float8 FROM relay.outbox WHERE state = 'running'),
    (SELECT count(*) FROM relay.dead_letters WHERE replay_state = 'open'),
    (SELECT count(*) FROM relay.dead_letters)";

/// Take the gauges' counts and estimates (see [`Gauges`]).
pub async fn gauges(conn: &mut PgConnection) -> Result<Gauges, sqlx::Error> {
    let backlog = backlog(&mut *conn).await?;
    let table_rows_estimated = sqlx::query_as(
        "SELECT relname::text, greatest(reltuples, 0)::bigint FROM pg_class
          WHERE relnamespace = 'relay'::regnamespace AND relkind = 'r' ORDER BY relname",
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(Gauges { backlog, table_rows_estimated })
}

/// The backlog counted exactly ([`GAUGE_COUNTS`]) and the counters, which
/// [`gauges`] and [`overview`] share; no inbox counts.
async fn backlog(conn: &mut PgConnection) -> Result<Stats, sqlx::Error> {
    type Row = (i64, i64, i64, i64, Option<f64>, Option<f64>, i64, i64, i64, Option<f64>, Option<f64>, i64, i64);
    let (
        pending,
        running,
        dead,
        uncertain,
        oldest_p,
        oldest_r,
        o_pending,
        o_running,
        o_dead,
        o_oldest_p,
        o_oldest_r,
        unresolved,
        letters,
    ): Row = sqlx::query_as(GAUGE_COUNTS).fetch_one(&mut *conn).await?;
    let counters = counters(&mut *conn).await?;
    let (intents_holding_keys, held_keys, records_held): (i64, i64, i64) =
        sqlx::query_as(HOLDING_KEYS).fetch_one(&mut *conn).await?;
    let oldest = |a: Option<f64>, b: Option<f64>| a.into_iter().chain(b).reduce(f64::max);
    Ok(Stats {
        inbox: Vec::new(),
        inbox_estimated: None,
        intents: vec![
            (IntentState::Pending, pending),
            (IntentState::Running, running),
            (IntentState::Dead, dead),
            (IntentState::Uncertain, uncertain),
        ],
        oldest_pending_intent_secs: oldest(oldest_p, oldest_r),
        outbox: vec![(OutboxState::Pending, o_pending), (OutboxState::Running, o_running), (OutboxState::Dead, o_dead)],
        oldest_unpublished_outbox_secs: oldest(o_oldest_p, o_oldest_r),
        dead_letters_unresolved: unresolved,
        dead_letters_total: letters,
        counters,
        intents_holding_keys,
        held_keys,
        records_held,
    })
}

/// Inbox rows by outcome, counted exactly (reads the whole table).
async fn inbox_by_outcome(conn: &mut PgConnection) -> Result<Vec<(InboxOutcome, i64)>, sqlx::Error> {
    sqlx::query_as("SELECT outcome, count(*) FROM relay.inbox GROUP BY outcome ORDER BY outcome").fetch_all(conn).await
}

/// Business counters `(consumer, name, value)`, for both [`snapshot`] and [`gauges`].
async fn counters(conn: &mut PgConnection) -> Result<Vec<(String, String, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT consumer, name, sum(value)::int8 FROM relay.counters GROUP BY consumer, name ORDER BY consumer, name",
    )
    .fetch_all(conn)
    .await
}
