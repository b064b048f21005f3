//! From applications: rows enqueued with `relay.publish` and `relay.call`
//! in the application's own transactions, against the same rows written
//! with a plain INSERT (the limit of enqueueing), then published and
//! called, with latencies at steady fractions of the drain rate.

use super::*;

/// Enqueueing transactions of this many rows, from this many connections.
const TX_ROWS: usize = 100;
const CONNECTIONS: usize = 4;
/// Events of one key, so that per-key order is exercised (and paid for).
const KEYS: usize = 64;

/// The bench's config with the front door open to its output topic and sink.
fn app_config(env: &Env, s: &Setup) -> anyhow::Result<RelayConfig> {
    let mut cfg = config(env, s, 64)?;
    cfg.application = Some(relay_core::config::ApplicationConfig {
        topics: vec![s.out.clone()],
        endpoints: vec!["sink".into()],
        sagas: Vec::new(),
        source: None,
        max_payload_bytes: 1024 * 1024,
        role: "relay_enqueue".into(),
    });
    Ok(cfg)
}

/// How rows are enqueued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Enqueue {
    /// `relay.publish` per row.
    Publish,
    /// `relay.call` per row.
    Call,
    /// The same outbox rows by a plain INSERT, all of a transaction in one
    /// statement: no checks, no derived ids, no ordering lock (the limit).
    RawInsert,
    /// The same, one INSERT statement per row, as an application writing a
    /// plain outbox table would (run in the server, as relay.publish is).
    RawInsertPerRow,
}

impl Enqueue {
    /// What drains its rows: the components, the table and the state done.
    fn drained_by(self) -> (Components, Work, &'static str) {
        match self {
            Enqueue::Call => (DISPATCH, Work::Intents, relay_core::IntentState::Succeeded.as_str()),
            _ => (PUBLISH, Work::Outbox, relay_core::OutboxState::Published.as_str()),
        }
    }
}

/// Enqueue rows `range` as `how`, in one transaction.
async fn enqueue(
    conn: &mut sqlx::PgConnection,
    how: Enqueue,
    out: &str,
    range: std::ops::Range<usize>,
) -> anyhow::Result<()> {
    let (from, to) = (range.start as i64, range.end as i64 - 1);
    let mut tx = conn.begin().await?;
    let query = match how {
        Enqueue::Publish => sqlx::query(
            // In key order: concurrent transactions that lock the same keys
            // in different orders would deadlock (docs/applications.md).
            "SELECT count(relay.publish($1, 'k-' || (n % $4), 'order.placed', jsonb_build_object('n', n),
                                        id => 'e-' || n))
               FROM (SELECT n FROM generate_series($2::int8, $3::int8) AS n ORDER BY n % $4, n) AS s",
        )
        .bind(out),
        Enqueue::RawInsert => sqlx::query(
            "INSERT INTO relay.outbox (id, consumer, source_id, action, topic, key, headers, payload, event_type,
                                       ordering_key)
             SELECT gen_random_uuid(), 'bench', 'e-' || n, 'application', $1, convert_to('k-' || (n % $4), 'UTF8'),
                    jsonb_build_array(jsonb_build_object('name', 'ce_specversion', 'text', '1.0'),
                                      jsonb_build_object('name', 'ce_type', 'text', 'order.placed')),
                    convert_to(jsonb_build_object('n', n)::text, 'UTF8'), 'order.placed', 'k-' || (n % $4)
               FROM generate_series($2::int8, $3::int8) AS n",
        )
        .bind(out),
        Enqueue::RawInsertPerRow => {
            // DO takes no parameters; the values are integers and a topic name.
            let sql = format!(
                "DO $do$ BEGIN FOR n IN {from}..{to} LOOP
                   INSERT INTO relay.outbox (id, consumer, source_id, action, topic, key, headers, payload,
                                             event_type, ordering_key)
                   VALUES (gen_random_uuid(), 'bench', 'e-' || n, 'application', {out}, convert_to('k-' || (n % {KEYS}), 'UTF8'),
                           jsonb_build_array(jsonb_build_object('name', 'ce_specversion', 'text', '1.0'),
                                             jsonb_build_object('name', 'ce_type', 'text', 'order.placed')),
                           convert_to(jsonb_build_object('n', n)::text, 'UTF8'), 'order.placed', 'k-' || (n % {KEYS}));
                 END LOOP; END $do$",
                out = quote_literal(out)
            );
            sqlx::query(&sql).execute(&mut *tx).await?;
            tx.commit().await?;
            return Ok(());
        }
        Enqueue::Call => sqlx::query(
            "SELECT count(relay.call('sink', 'POST', '/captures', jsonb_build_object('n', n, 'keys', $3::int8),
                                     id => 'c-' || n))
               FROM generate_series($1::int8, $2::int8) AS n",
        ),
    };
    // Publish and the INSERT take (topic, from, to, keys); the call (from, to, keys).
    query.bind(from).bind(to).bind(KEYS as i64).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

/// `text` as a SQL string literal.
fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// Enqueue `k` rows as `how` in transactions of [`TX_ROWS`] from
/// [`CONNECTIONS`] connections; the rate of enqueueing.
async fn enqueue_all(s: &Setup, how: Enqueue, k: usize) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    let chunks: Vec<usize> = (0..k).step_by(TX_ROWS).collect();
    let per = chunks.len().div_ceil(CONNECTIONS);
    let mut tasks = tokio::task::JoinSet::new();
    for part in chunks.chunks(per.max(1)) {
        let (url, out, part) = (s.db.url.clone(), s.out.clone(), part.to_vec());
        tasks.spawn(async move {
            let mut conn = sqlx::PgConnection::connect(&url).await?;
            for start in part {
                enqueue(&mut conn, how, &out, start..(start + TX_ROWS).min(k)).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(k as f64 / t0.elapsed().as_secs_f64())
}

/// Enqueue `k` rows as `how` (no relay running): the enqueue rate.
async fn enqueue_rate(env: &Env, how: Enqueue, k: usize) -> anyhow::Result<(f64, Option<(f64, f64)>)> {
    let s = setup(env, 4).await?;
    Relay::new(app_config(env, &s)?, Handlers::default(), Faults::none()).await?;
    Ok((enqueue_all(&s, how, k).await?, None))
}

/// `k` rows enqueued as `how`, then drained by the relay: the drain rate.
async fn drain_rate(env: &Env, how: Enqueue, k: usize) -> anyhow::Result<(f64, Option<(f64, f64)>)> {
    let s = setup(env, 4).await?;
    let relay = Relay::new(app_config(env, &s)?, Handlers::default(), Faults::none()).await?;
    enqueue_all(&s, how, k).await?;
    let (which, work, state) = how.drained_by();
    let t0 = Instant::now();
    let mut relay = UnderTest::start(relay, which);
    let took = wait_drained(&mut relay, &s.db.pool, work, state, k as i64, t0).await?;
    relay.stop().await?;
    Ok((k as f64 / took.as_secs_f64(), None))
}

/// Enqueue as `how` at `rate` rows/s for `secs` (a transaction every 10 ms)
/// while the relay drains; p50/p99 from each row's commit (its
/// transaction's `created_at`) to its broker ack (`published_at`, set right
/// after the ack) or to the start of its call's first attempt.
async fn steady(env: &Env, how: Enqueue, rate: f64, secs: f64) -> anyhow::Result<(f64, Option<(f64, f64)>)> {
    let s = setup(env, 4).await?;
    let relay = Relay::new(app_config(env, &s)?, Handlers::default(), Faults::none()).await?;
    let (which, work, state) = how.drained_by();
    let mut relay = UnderTest::start(relay, which);
    let mut conn = sqlx::PgConnection::connect(&s.db.url).await?;
    let tick = Duration::from_millis(10);
    let ticks = (secs / tick.as_secs_f64()).round() as usize;
    let mut timer = tokio::time::interval(tick);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let (t0, mut sent) = (Instant::now(), 0usize);
    for n in 1..=ticks {
        timer.tick().await;
        let due = (rate * tick.as_secs_f64() * n as f64) as usize;
        if due > sent {
            enqueue(&mut conn, how, &s.out, sent..due).await?;
            sent = due;
        }
    }
    let offered = sent as f64 / t0.elapsed().as_secs_f64();
    wait_drained(&mut relay, &s.db.pool, work, state, sent as i64, t0).await?;
    relay.stop().await?;
    let sql = match how {
        Enqueue::Call => {
            "SELECT (extract(epoch FROM a.started_at - i.created_at) * 1000)::float8
               FROM relay.intents i JOIN relay.intent_attempts a ON a.intent_id = i.id AND a.attempt = 1"
        }
        _ => "SELECT (extract(epoch FROM published_at - created_at) * 1000)::float8 FROM relay.outbox",
    };
    let mut ms: Vec<f64> = sqlx::query_scalar(sql).fetch_all(&s.db.pool).await?;
    ms.sort_by(f64::total_cmp);
    Ok((offered, Some((percentile(&ms, 0.5), percentile(&ms, 0.99)))))
}

/// The section.
pub(super) async fn app_section(env: &Env) -> anyhow::Result<Section> {
    eprintln!("bench: from applications");
    let k = env.size(1_000, 50_000);
    let mut sec = Section::new(
        &format!("7. From applications ({k} rows, transactions of {TX_ROWS} from {CONNECTIONS} connections)"),
        "rows/s",
    );
    sec.rows.push(row(
        "enqueue: relay.publish",
        median(env, || enqueue_rate(env, Enqueue::Publish, k)).await?,
        "checks, derived id, CloudEvents headers, per-key lock, in SQL",
    ));
    sec.rows.push(row(
        "limit: the same outbox rows by a plain INSERT",
        median(env, || enqueue_rate(env, Enqueue::RawInsert, k)).await?,
        "no checks, random ids, no ordering lock",
    ));
    sec.rows.push(row(
        "limit: the same rows by plain INSERTs, one per row",
        median(env, || enqueue_rate(env, Enqueue::RawInsertPerRow, k)).await?,
        "as an application writing a plain outbox table would",
    ));
    sec.rows.push(row(
        "enqueue: relay.call",
        median(env, || enqueue_rate(env, Enqueue::Call, k)).await?,
        "checks, derived id and key, budget",
    ));
    let published = median(env, || drain_rate(env, Enqueue::Publish, k)).await?;
    let peak_publish = published.0;
    sec.rows.push(row("published (enqueued rows → broker ack → marked)", published, "the publisher alone"));
    let called = median(env, || drain_rate(env, Enqueue::Call, k)).await?;
    let peak_call = called.0;
    sec.rows.push(row("called (enqueued rows → sink answered → succeeded)", called, "the dispatcher alone"));
    let secs = if env.quick { 1.0 } else { 10.0 };
    for load in [0.5, 0.9] {
        sec.rows.push(row(
            format!("commit → broker ack at {:.0} % of the publish rate", load * 100.0),
            median(env, || steady(env, Enqueue::Publish, peak_publish * load, secs)).await?,
            format!("rate column: the load offered for {secs:.0} s"),
        ));
        sec.rows.push(row(
            format!("commit → call started at {:.0} % of the call rate", load * 100.0),
            median(env, || steady(env, Enqueue::Call, peak_call * load, secs)).await?,
            format!("rate column: the load offered for {secs:.0} s"),
        ));
    }
    let publish = sec.rate("enqueue: relay.publish");
    sec.verdicts.push(format!(
        "relay.publish enqueues at {:.0} % of plain INSERTs of one row each, and {:.0} % of one INSERT per \
         transaction",
        100.0 * publish / sec.rate("limit: the same rows by plain INSERTs, one per row").max(1.0),
        100.0 * publish / sec.rate("limit: the same outbox rows by a plain INSERT").max(1.0)
    ));
    Ok(sec)
}
