//! Rows written straight into the relay's tables, for the tests and the
//! benchmark harness that need a backlog or a history without running the
//! pipeline in front of it, and the probes the harness polls while the relay
//! works. SQL on purpose, and here rather than in `relay-store`: these rows
//! are the input of what is checked or measured, written one statement per
//! table, and production never writes them this way.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

/// `n` pending intents of `consumer` to `endpoint`, due now: events
/// `{prefix}e-1` …, bodies `{"order_id": "{prefix}o-1"}` …, keys
/// `capture:{prefix}o-1` … (a prefix keeps them apart from intents the
/// relay writes for events `e-…` in the same database).
pub async fn pending_intents(
    pool: &PgPool,
    consumer: &str,
    endpoint: &str,
    prefix: &str,
    n: usize,
) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO relay.intents (id, consumer, source_event_id, action, endpoint, method, path, body,
                                    idempotency_key, max_attempts, expires_at, emit_source)
         SELECT gen_random_uuid(), $1, $3 || 'e-' || g, 'capture', $2, 'POST', '/captures',
                jsonb_build_object('order_id', $3 || 'o-' || g), 'capture:' || $3 || 'o-' || g, 10,
                now() + interval '1 day', $1
           FROM generate_series(1, $4) g",
    )
    .bind(consumer)
    .bind(endpoint)
    .bind(prefix)
    .bind(n as i64)
    .execute(pool)
    .await?;
    Ok(())
}

/// `n` pending outbox rows of `consumer` to `topic`, in write order: events
/// `e-1` …, CloudEvents headers of type `order.accepted`, key and ordering
/// key `o-1` …, a JSON payload.
pub async fn pending_outbox(pool: &PgPool, consumer: &str, topic: &str, n: usize) -> sqlx::Result<()> {
    sqlx::query(
        r#"INSERT INTO relay.outbox (id, consumer, source_id, action, topic, key, headers, payload, event_type, ordering_key)
           SELECT gen_random_uuid(), $1, 'e-' || g, 'accepted', $2, convert_to('o-' || g, 'UTF8'),
                  '[{"name":"ce_specversion","text":"1.0"},{"name":"ce_type","text":"order.accepted"},{"name":"ce_source","text":"seed"}]'::jsonb,
                  convert_to(jsonb_build_object('order_id', 'o-' || g)::text, 'UTF8'), 'order.accepted', 'o-' || g
             FROM generate_series(1, $3) g"#,
    )
    .bind(consumer)
    .bind(topic)
    .bind(n as i64)
    .execute(pool)
    .await?;
    Ok(())
}

/// How much finished history [`history`] writes.
#[derive(Debug, Clone, Copy, Default)]
pub struct History {
    /// Inbox rows (`applied`, topic `old`).
    pub inbox: usize,
    /// Succeeded intents, one attempt each.
    pub succeeded_intents: usize,
    /// Published outbox rows.
    pub published_outbox: usize,
}

/// Finished history of `consumer` (events `old-1` …), written in statements
/// of at most 200 000 rows. Not analyzed: the caller decides (ANALYZE,
/// VACUUM) what state the statistics are to be in.
pub async fn history(pool: &PgPool, consumer: &str, h: History) -> sqlx::Result<()> {
    const STEP: usize = 200_000;
    let tables = [
        (
            h.inbox,
            r#"INSERT INTO relay.inbox (consumer, event_id, event_type, topic, partition, "offset", outcome)
               SELECT $1, 'old-' || g, 'order.placed', 'old', 0, g, 'applied' FROM generate_series($2, $3) g"#,
        ),
        (
            h.succeeded_intents,
            "INSERT INTO relay.intents (id, consumer, source_event_id, action, endpoint, method, path, idempotency_key,
                                        max_attempts, expires_at, emit_source, state, attempts, finished_at)
             SELECT gen_random_uuid(), $1, 'old-' || g, 'capture', 'psp', 'POST', '/x', 'old:' || g, 10,
                    now() + interval '1 day', $1, 'succeeded', 1, now()
               FROM generate_series($2, $3) g",
        ),
        (
            h.published_outbox,
            "INSERT INTO relay.outbox (id, consumer, source_id, action, topic, state, published_at)
             SELECT gen_random_uuid(), $1, 'old-' || g, 'captured', 'out', 'published', now()
               FROM generate_series($2, $3) g",
        ),
    ];
    for (rows, sql) in tables {
        let mut done = 0;
        while done < rows {
            let n = STEP.min(rows - done);
            sqlx::query(sql).bind(consumer).bind(done as i64 + 1).bind((done + n) as i64).execute(pool).await?;
            done += n;
        }
    }
    Ok(())
}

// What the harness polls while the relay works must cost the database next to
// nothing: a `count(*)` every 10 ms scans the whole table each time and takes
// CPU from the relay under test (with 1 M old rows, most of it). These read
// only the rows that matter, through the relay's own indexes.

/// The database's clock, to tell rows written from now on from old ones.
pub async fn db_now(pool: &PgPool) -> sqlx::Result<DateTime<Utc>> {
    sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(pool).await
}

/// Inbox rows received after `since` (an index range scan on `received_at`).
pub async fn inbox_since(pool: &PgPool, since: DateTime<Utc>) -> sqlx::Result<i64> {
    sqlx::query_scalar("SELECT count(*) FROM relay.inbox WHERE received_at > $1").bind(since).fetch_one(pool).await
}

/// A work table of the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// `relay.intents`.
    Intents,
    /// `relay.outbox`.
    Outbox,
}

impl Work {
    fn table(self) -> &'static str {
        match self {
            Work::Intents => "relay.intents",
            Work::Outbox => "relay.outbox",
        }
    }
}

/// Whether `work` has no row waiting or in flight: two probes of the
/// partial indexes on pending and running rows.
pub async fn drained(pool: &PgPool, work: Work) -> sqlx::Result<bool> {
    let t = work.table();
    let sql = format!(
        "SELECT NOT EXISTS (SELECT 1 FROM {t} WHERE state = 'pending')
            AND NOT EXISTS (SELECT 1 FROM {t} WHERE state = 'running')"
    );
    sqlx::query_scalar(&sql).fetch_one(pool).await
}

/// Rows of `work` in `state` (a whole count: once, after a run).
pub async fn in_state(pool: &PgPool, work: Work, state: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {} WHERE state = $1", work.table()))
        .bind(state)
        .fetch_one(pool)
        .await
}

/// p50 and p99 in ms of the succeeded attempts, from the request sent
/// (`started_at`, the dispatcher's clock) to the statement recording the
/// outcome (`finished_at`, its transaction's start in the database).
pub async fn call_latency(pool: &PgPool) -> sqlx::Result<(f64, f64)> {
    sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)
           FROM (SELECT extract(epoch FROM finished_at - started_at)::float8 * 1000 AS ms
                   FROM relay.intent_attempts WHERE outcome = 'succeeded') a",
    )
    .fetch_one(pool)
    .await
}

/// For intents whose body carries `produced_at_us` (the event's production
/// time, µs since the epoch) from `from_us` on: p50 and p99 in ms of
/// produced → intent written, then of intent written → call started.
pub async fn latency_split(pool: &PgPool, from_us: i64) -> sqlx::Result<(f64, f64, f64, f64)> {
    sqlx::query_as(
        "WITH t AS (SELECT (extract(epoch FROM i.created_at) * 1e6 - (i.body->>'produced_at_us')::float8) / 1e3 AS a,
                           extract(epoch FROM a.started_at - i.created_at) * 1e3 AS b
                      FROM relay.intents i JOIN relay.intent_attempts a ON a.intent_id = i.id
                     WHERE (i.body->>'produced_at_us')::int8 >= $1)
         SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY a), percentile_cont(0.99) WITHIN GROUP (ORDER BY a),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY b), percentile_cont(0.99) WITHIN GROUP (ORDER BY b)
           FROM t",
    )
    .bind(from_us)
    .fetch_one(pool)
    .await
}

/// `VACUUM (ANALYZE)` the whole database: statistics and visibility as in a
/// steady state rather than right after a bulk load.
pub async fn vacuum_analyze(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::query("VACUUM (ANALYZE)").execute(pool).await?;
    Ok(())
}

/// A connection in a transaction that holds a snapshot open: no row version
/// deleted or updated after it starts can be removed, by vacuum or by index
/// scans marking entries dead, until [`release_snapshot`].
pub async fn hold_snapshot(url: &str) -> sqlx::Result<sqlx::PgConnection> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url).await?;
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ").execute(&mut conn).await?;
    sqlx::query("SELECT count(*) FROM relay.intents").execute(&mut conn).await?;
    Ok(conn)
}

/// End the transaction [`hold_snapshot`] opened.
pub async fn release_snapshot(mut conn: sqlx::PgConnection) -> sqlx::Result<()> {
    sqlx::query("ROLLBACK").execute(&mut conn).await?;
    Ok(())
}
