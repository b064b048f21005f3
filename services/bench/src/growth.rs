//! Growth: claim and ingest rates with large tables and a snapshot held open.

use super::*;

pub(super) async fn prefill(pool: &PgPool, inbox: usize, finished_intents: usize) -> anyhow::Result<()> {
    let history = seed::History { inbox, succeeded_intents: finished_intents, published_outbox: 0 };
    seed::history(pool, "bench", history).await?;
    // Steady state, not the aftermath of a bulk load: without this,
    // autovacuum works through the new rows during the measurement.
    seed::vacuum_analyze(pool).await?;
    Ok(())
}

/// Ingest and claim throughput with `inbox` old inbox rows, `finished` old
/// intents and optionally a snapshot held open the whole time.
pub(super) async fn growth_case(
    env: &Env,
    n: usize,
    m: usize,
    inbox: usize,
    finished: usize,
    snapshot: bool,
) -> anyhow::Result<(f64, f64)> {
    let s = setup(env, 4).await?;
    prefill(&s.db.pool, inbox, finished).await?;
    let holder = if snapshot { Some(seed::hold_snapshot(&s.db.url).await?) } else { None };
    let ingest = ingest_into(env, &s, n, 0).await?;
    // Claim/dispatch the intents just written plus `m` more.
    insert_intents(&s.db.pool, m).await?;
    let pending = seed::in_state(&s.db.pool, Work::Intents, relay_core::IntentState::Pending.as_str()).await?;
    let target =
        seed::in_state(&s.db.pool, Work::Intents, relay_core::IntentState::Succeeded.as_str()).await? + pending;
    let relay = Relay::new(config(env, &s, 64)?, Handlers::default(), Faults::none()).await?;
    let t0 = Instant::now();
    let mut relay = UnderTest::start(relay, DISPATCH);
    let took =
        wait_drained(&mut relay, &s.db.pool, Work::Intents, relay_core::IntentState::Succeeded.as_str(), target, t0)
            .await?;
    let claim = pending as f64 / took.as_secs_f64();
    relay.stop().await?;
    if let Some(conn) = holder {
        seed::release_snapshot(conn).await?;
    }
    Ok((ingest, claim))
}

/// The growth section of the report.
pub(super) async fn growth_section(env: &Env) -> anyhow::Result<Section> {
    eprintln!("bench: growth");
    let gn = env.size(2_000, 20_000);
    let gm = env.size(1_000, 10_000);
    let mut growth = Section::new(
        &format!("5. Growth: ingest {gn} records and dispatch them plus {gm} more, as tables grow"),
        "ingest records/s",
    );
    let cases: Vec<(String, usize, usize, bool)> = if env.quick {
        vec![
            ("empty tables".into(), 0, 0, false),
            ("20 000 old inbox rows, 20 000 finished intents".into(), 20_000, 20_000, false),
            ("empty, with a snapshot held open".into(), 0, 0, true),
        ]
    } else {
        vec![
            ("empty tables".into(), 0, 0, false),
            ("1 M old inbox rows".into(), 1_000_000, 0, false),
            ("10 M old inbox rows".into(), 10_000_000, 0, false),
            ("1 M finished intents".into(), 0, 1_000_000, false),
            ("empty, with a snapshot held open".into(), 0, 0, true),
        ]
    };
    let mut base = None;
    for (name, inbox, finished, snapshot) in cases {
        eprintln!("bench: growth: {name}");
        let mut ing = Vec::new();
        let mut cl = Vec::new();
        for _ in 0..env.runs.max(1) {
            let (i, c) = growth_case(env, gn, gm, inbox, finished, snapshot).await?;
            ing.push(i);
            cl.push(c);
        }
        let ((i, spread), (c, _)) = (median_spread(ing), median_spread(cl));
        let (bi, bc) = *base.get_or_insert((i, c));
        growth.rows.push(Row {
            name,
            rate: i,
            spread,
            latency: None,
            note: format!(
                "ingest {:.0} % of empty; claim+dispatch {c:.0}/s ({:.0} % of empty)",
                100.0 * i / bi,
                100.0 * c / bc
            ),
        });
    }
    growth.verdicts.push("goal: every case within 20 % of the empty case (see the notes)".into());
    Ok(growth)
}
