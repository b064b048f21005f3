//! Memory: the relay's peak RSS with a backlog waiting.

use super::*;

/// Peak RSS (VmHWM) of a process, in MiB.
pub(super) fn peak_rss_mib(pid: u32) -> anyhow::Result<f64> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .with_context(|| format!("no VmHWM line in {path}"))
}

pub(super) async fn memory(env: &Env, backlog: usize) -> anyhow::Result<Vec<Measured>> {
    let s = setup(env, 4).await?;
    let path = std::env::temp_dir().join(format!("{}.toml", unique("bench")));
    std::fs::write(&path, config_text(env, &s, 64))?;
    let spec = |args: &[&str]| RelaySpec {
        bin: env.relay_bin.clone(),
        config: path.clone(),
        args: args.iter().map(|a| (*a).to_string()).collect(),
        env: vec![("DATABASE_URL".into(), s.db.url.clone()), ("RUST_LOG".into(), "warn".into())],
        log: std::env::temp_dir().join(format!("{}-mem.log", unique("bench"))),
    };
    // Consumer with `backlog` records waiting.
    produce(env, &s.topic, 0..backlog).await?;
    let offsets = OffsetWatch::new(&env.bootstrap, &s.group, &s.topic).await?;
    let process = |args: &[&str]| anyhow::Ok(UnderTest::Processes(vec![RelayProcess::start(spec(args))?]));
    let mut c = process(&["consume"])?;
    let t0 = Instant::now();
    wait_until(&mut c, "the backlog consumed", Duration::from_secs(900), async || {
        offsets.total().await.is_ok_and(|t| t >= backlog as i64)
    })
    .await?;
    let consume_rate = backlog as f64 / t0.elapsed().as_secs_f64();
    let consumer_mib = c.peak_rss_mib()?;
    c.stop().await?;
    // Dispatcher with the resulting `backlog` pending intents.
    let mut d = process(&["dispatch", "--intents-only"])?;
    let t0 = Instant::now();
    let took = wait_drained(
        &mut d,
        &s.db.pool,
        Work::Intents,
        relay_core::IntentState::Succeeded.as_str(),
        backlog as i64,
        t0,
    )
    .await?;
    let dispatch_rate = backlog as f64 / took.as_secs_f64();
    let dispatcher_mib = d.peak_rss_mib()?;
    d.stop().await?;
    // Publisher with the `backlog` outbox rows.
    let mut p = process(&["dispatch", "--outbox-only"])?;
    let t0 = Instant::now();
    let took =
        wait_drained(&mut p, &s.db.pool, Work::Outbox, relay_core::OutboxState::Published.as_str(), backlog as i64, t0)
            .await?;
    let publish_rate = backlog as f64 / took.as_secs_f64();
    let publisher_mib = p.peak_rss_mib()?;
    p.stop().await?;
    let r = |process: &'static str, waiting: &str, rate: f64, mib: f64| Measured {
        process,
        peak_rss: mib,
        row: Row {
            name: format!("{process}, {backlog} {waiting} waiting"),
            rate,
            spread: (rate, rate),
            latency: None,
            note: format!("peak RSS {mib:.0} MiB"),
        },
    };
    Ok(vec![
        r("`relay consume`", "records", consume_rate, consumer_mib),
        r("`relay dispatch --intents-only`", "intents", dispatch_rate, dispatcher_mib),
        r("`relay dispatch --outbox-only`", "rows", publish_rate, publisher_mib),
    ])
}

/// [`memory`] `env.runs` times over, per process kind: the median rate and
/// the median peak RSS, with their spread. A single process's peak RSS moves
/// by a quarter between runs of the same build (mimalloc keeps freed memory
/// for reuse, more or less of it depending on timing: one process kind's
/// 400 000-item run measured 79 %, 92 %, 122 % and 129 % of its 100 000-item
/// run in single runs of unchanged code), so a verdict on single runs would
/// say "grows" or "flat" by chance.
pub(super) async fn memory_median(env: &Env, backlog: usize) -> anyhow::Result<Vec<Measured>> {
    let mut runs = Vec::new();
    for _ in 0..env.runs.max(1) {
        runs.push(memory(env, backlog).await?);
    }
    let kinds = runs[0].len();
    Ok((0..kinds)
        .map(|k| {
            let first = &runs[0][k];
            let (rate, spread) = median_spread(runs.iter().map(|r| r[k].row.rate).collect());
            let (rss, (rss_lo, rss_hi)) = median_spread(runs.iter().map(|r| r[k].peak_rss).collect());
            let note = if runs.len() > 1 {
                format!("peak RSS {rss:.0} MiB (median of {}: {rss_lo:.0} – {rss_hi:.0})", runs.len())
            } else {
                format!("peak RSS {rss:.0} MiB")
            };
            Measured {
                process: first.process,
                peak_rss: rss,
                row: Row { name: first.row.name.clone(), rate, spread, latency: None, note },
            }
        })
        .collect())
}

/// One process kind's row of the memory section, with its peak RSS.
pub(super) struct Measured {
    /// The command, as the verdict names it.
    process: &'static str,
    peak_rss: f64,
    row: Row,
}

/// The memory section of the report.
pub(super) async fn memory_section(env: &Env) -> anyhow::Result<Section> {
    eprintln!("bench: memory");
    // Bounded means flat: the same processes again with four times the backlog.
    let (backlog, big) = (env.size(5_000, 100_000), env.size(20_000, 400_000));
    let mut mem =
        Section::new(&format!("6. Memory with a {backlog}- and a {big}-item backlog (separate processes)"), "items/s");
    let small_rows = memory_median(env, backlog).await?;
    eprintln!("bench: memory: {big}-item backlog");
    let big_rows = memory_median(env, big).await?;
    let shares: Vec<(&str, f64)> =
        small_rows.iter().zip(&big_rows).map(|(a, b)| (a.process, b.peak_rss / a.peak_rss)).collect();
    // Within 20 %, as the growth section, of medians (see memory_median).
    let flat = shares.iter().all(|(_, share)| *share <= 1.2);
    let verdict = match (env.quick, flat) {
        // A debug build with a few thousand items never reaches its steady state.
        (true, _) => "no verdict at --quick sizes",
        (false, true) => "**flat**, within 20 %",
        (false, false) => "**grows with the backlog**",
    };
    mem.verdicts.push(format!(
        "median peak RSS with {big} items waiting, as a share of the same process with {backlog}: {} — {} \
         (goal: bounded)",
        shares.iter().map(|(name, share)| format!("{name} {:.0} %", 100.0 * share)).collect::<Vec<_>>().join(", "),
        verdict
    ));
    mem.rows = small_rows.into_iter().chain(big_rows).map(|m| m.row).collect();
    Ok(mem)
}
