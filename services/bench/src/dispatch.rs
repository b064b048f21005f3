//! Dispatch: intents called and finalized, against raw HTTP and the database alone.

use super::*;

/// What the seeded intents' dispatcher claims: consumer `bench`, endpoint `sink`.
const BENCH: relay_store::intents::Scope<'static> =
    relay_store::intents::Scope { consumer: "bench", endpoints: &["sink"] };

/// `m` intents due now, apart from any the relay writes for events.
pub(super) async fn insert_intents(pool: &PgPool, m: usize) -> anyhow::Result<()> {
    Ok(seed::pending_intents(pool, "bench", "sink", "direct-", m).await?)
}

/// Where the dispatchers under test run.
#[derive(Clone, Copy)]
pub(super) enum Dispatchers {
    /// One, in this process, beside the provider.
    InThisProcess,
    /// `relay dispatch --intents-only` processes.
    Processes(usize),
}

/// Dispatch `m` pending intents with dispatchers of `concurrency` each, to a
/// provider that answers after `provider_delay`; timed from the provider's
/// first call to the last intent finished. Latency: each call, from the
/// request sent to its outcome written ([`call_latency`]).
pub(super) async fn dispatch_relay(
    env: &Env,
    m: usize,
    concurrency: usize,
    dispatchers: Dispatchers,
    provider_delay: Duration,
) -> anyhow::Result<(f64, Option<(f64, f64)>)> {
    let s = setup_with_provider(env, 1, provider_delay).await?;
    insert_intents(&s.db.pool, m).await?;
    let t0 = Instant::now();
    let mut relay = if let Dispatchers::Processes(processes) = dispatchers {
        let path = std::env::temp_dir().join(format!("{}.toml", unique("bench")));
        std::fs::write(&path, config_text(env, &s, concurrency))?;
        let procs = (0..processes).map(|i| {
            RelayProcess::start(RelaySpec {
                bin: env.relay_bin.clone(),
                config: path.clone(),
                args: vec!["dispatch".into(), "--intents-only".into()],
                env: vec![("DATABASE_URL".into(), s.db.url.clone()), ("RUST_LOG".into(), "warn".into())],
                log: std::env::temp_dir().join(format!("{}-d{i}.log", unique("bench"))),
            })
        });
        UnderTest::Processes(procs.collect::<anyhow::Result<_>>()?)
    } else {
        let relay = Relay::new(config(env, &s, concurrency)?, Handlers::default(), Faults::none()).await?;
        UnderTest::start(relay, DISPATCH)
    };
    let took =
        wait_drained(&mut relay, &s.db.pool, Work::Intents, relay_core::IntentState::Succeeded.as_str(), m as i64, t0)
            .await?;
    // Timed from the first call: separate processes first start, connect
    // and prepare, which the dispatcher in this process did before `t0`.
    let started = s.sink.first.get().map_or(Duration::ZERO, |first| first.duration_since(t0));
    let rate = m as f64 / took.saturating_sub(started).as_secs_f64();
    relay.stop().await?;
    Ok((rate, Some(call_latency(&s.db.pool).await?)))
}

/// What the dispatch rows' latency columns measure.
pub(super) const RELAY_CALL: &str = "a call's request sent → its outcome written";
pub(super) const RAW_CALL: &str = "request sent → response read";

/// p50 and p99 in ms of the succeeded attempts, from the request sent
/// (`started_at`, the dispatcher's clock) to the statement recording the
/// outcome (`finished_at`, its transaction's start in the database) — on
/// one machine, one clock. In a backlog drain an intent's time since it was
/// written is only its place in the queue; this is what each call costs.
pub(super) async fn call_latency(pool: &PgPool) -> anyhow::Result<(f64, f64)> {
    Ok(seed::call_latency(pool).await?)
}

/// What the database alone allows: the dispatcher's statements — claim a
/// batch (`claim_batch` = 256), record every attempt as succeeded in one
/// fenced finish — with no HTTP call in between, `workers` loops side by
/// side. Not a goal of its own: it shows how much of the raw HTTP rate a
/// dispatcher could reach on this machine if its own work cost nothing.
///
/// `commit`: whether the claims wait for the disk, as the dispatcher's do
/// (issue 28, D5), or not, as they did before — the difference is what
/// durable intent claims cost.
pub(super) async fn dispatch_database_only(
    env: &Env,
    m: usize,
    workers: usize,
    commit: relay_store::ClaimCommit,
) -> anyhow::Result<(f64, Option<(f64, f64)>)> {
    use relay::runtime::claim_loop::Resume;
    use relay_store::intents::{self, AttemptRecord, Finish, NextState};
    let s = setup(env, 1).await?;
    insert_intents(&s.db.pool, m).await?;
    let t0 = Instant::now();
    let loops = (0..workers).map(|w| {
        let pool = s.db.pool.clone();
        async move {
            let worker = format!("bench-db-{w}");
            let mut conn = relay_store::FinishPool::beside(&pool, 1).acquire().await?;
            let mut claims = relay_store::ClaimPool::beside(&pool, 1, commit).acquire().await?;
            // As the dispatcher's claim loop (`relay::runtime::claim_loop`): after the
            // last row of a full claim, from the start once a claim after it
            // comes back short; no poll interval, as nothing else writes.
            let mut resume: Resume<relay_store::Position> = Resume::default();
            loop {
                let (after, back) = resume.next(Duration::MAX);
                let claim = intents::claim_after(
                    &mut claims,
                    &BENCH,
                    &worker,
                    256,
                    Duration::from_secs(30),
                    after,
                    relay_store::intents::Room::ANY,
                )
                .await?;
                if claim.rows.is_empty() && after.is_none() {
                    return anyhow::Ok(());
                }
                match claim.last {
                    Some(last) if claim.rows.len() == 256 => resume.claimed(back, last),
                    _ => resume.back_to(None),
                }
                if claim.rows.is_empty() {
                    continue;
                }
                let now = Utc::now();
                let items: Vec<Finish> = claim
                    .rows
                    .iter()
                    .map(|c| Finish {
                        id: c.id,
                        token: c.lease_token,
                        next: NextState::Succeeded,
                        attempt: AttemptRecord {
                            started_at: Some(now),
                            outcome: intents::AttemptOutcome::Succeeded,
                            status: Some(200),
                            error_class: None,
                            error: None,
                        },
                        attempt_no: c.attempts,
                        worker: worker.clone(),
                        attempted: true,
                    })
                    .collect();
                intents::finish_many(&mut conn, &items).await?;
            }
        }
    });
    for r in futures::future::join_all(loops).await {
        r?;
    }
    let took = t0.elapsed();
    let done = seed::in_state(&s.db.pool, Work::Intents, relay_core::IntentState::Succeeded.as_str()).await?;
    anyhow::ensure!(done == m as i64, "database-only dispatch finished {done} of {m} intents");
    Ok((m as f64 / took.as_secs_f64(), None))
}

/// The limit: the same client, the same provider, no database.
pub(super) async fn dispatch_limit(
    m: usize,
    concurrency: usize,
    provider_delay: Duration,
) -> anyhow::Result<(f64, Option<(f64, f64)>)> {
    let (sink, url) = Sink::start(provider_delay).await?;
    let client = reqwest::Client::builder().pool_max_idle_per_host(concurrency).build()?;
    let t0 = Instant::now();
    let mut took: Vec<f64> = futures::stream::iter(0..m)
        .map(|i| {
            let req = client
                .post(format!("{url}/captures"))
                .header("Idempotency-Key", format!("capture:o-{i}"))
                .json(&serde_json::json!({"order_id": format!("o-{i}")}));
            async move {
                let sent = Instant::now();
                req.send().await.and_then(reqwest::Response::error_for_status).expect("sink answers");
                sent.elapsed().as_secs_f64() * 1000.0
            }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let rate = m as f64 / t0.elapsed().as_secs_f64();
    assert_eq!(sink.requests.load(Ordering::Relaxed), m as u64);
    took.sort_by(f64::total_cmp);
    Ok((rate, Some((percentile(&took, 0.5), percentile(&took, 0.99)))))
}

/// A median with its spread and, when measured, its latency percentiles.
type Measure = (f64, (f64, f64), Option<(f64, f64)>);

/// The relay's row and the raw HTTP client's row for the same `setting`.
fn relay_and_raw(section: &mut Section, setting: &str, (relay, raw): (Measure, Measure), intents: usize) {
    let note = format!("{intents} intents, 1 process; latency: {RELAY_CALL}");
    section.rows.push(row(format!("relay, {setting}"), relay, note));
    let note = format!("same client and provider, no database; latency: {RAW_CALL}");
    section.rows.push(row(format!("limit: raw HTTP, {setting}"), raw, note));
}

/// The dispatch section of the report.
pub(super) async fn dispatch_section(env: &Env) -> anyhow::Result<Section> {
    eprintln!("bench: dispatch");
    let m = env.size(1_000, 20_000);
    let mut dispatch = Section::new(&format!("2. Dispatch ({m} intents → HTTP POST → finalized)"), "calls/s");
    let concurrencies: &[usize] = if env.quick { &[8, 64] } else { &[1, 8, 64, 256] };
    let mut best = (0.0f64, 0.0f64, 0usize);
    for &c in concurrencies {
        let mc = if c == 1 { m / 10 } else { m };
        let r = median(env, || dispatch_relay(env, mc, c, Dispatchers::InThisProcess, Duration::ZERO)).await?;
        let l = median(env, || dispatch_limit(mc, c, Duration::ZERO)).await?;
        if r.0 > best.0 {
            best = (r.0, l.0, c);
        }
        relay_and_raw(&mut dispatch, &format!("concurrency {c}"), (r, l), mc);
    }
    // Two loops: one per core (4 and 8 measured no faster here).
    let workers = 2;
    let db_only = median(env, || dispatch_database_only(env, m, workers, relay_store::ClaimCommit::Durable)).await?;
    dispatch.rows.push(row(
        "ceiling: the database alone (claim + finish, no HTTP call)",
        db_only,
        format!(
            "{m} intents, {workers} loops of claim 256 → finish 256; claims wait for the disk, as the dispatcher's"
        ),
    ));
    let db_async = median(env, || dispatch_database_only(env, m, workers, relay_store::ClaimCommit::Async)).await?;
    dispatch.rows.push(row(
        "ceiling: the database alone, claims not waiting for the disk",
        db_async,
        format!("{m} intents, {workers} loops; `synchronous_commit = off` on claims, as before issue 28 (D5)"),
    ));
    // One separate process too: the rows above run the dispatcher in
    // this process, beside the provider; this one tells what running
    // apart costs from what more processes cost.
    let procs: &[usize] = if env.quick { &[2] } else { &[1, 2, 4] };
    for &p in procs {
        let r = median(env, || dispatch_relay(env, m, 64, Dispatchers::Processes(p), Duration::ZERO)).await?;
        let processes = if p == 1 { "1 process".to_string() } else { format!("{p} processes") };
        dispatch.rows.push(row(
            format!("relay, {processes} × concurrency 64"),
            r,
            format!("`relay dispatch --intents-only`; latency: {RELAY_CALL}"),
        ));
    }
    // A provider that answers at once makes the relay's bookkeeping the
    // whole cost of a call; a real one takes milliseconds. The same
    // comparison with a provider that takes 10 ms (a fast real API).
    let (slow, c) = (Duration::from_millis(10), *concurrencies.last().unwrap_or(&64));
    let ms = slow.as_millis();
    let r = median(env, || dispatch_relay(env, m, c, Dispatchers::InThisProcess, slow)).await?;
    let l = median(env, || dispatch_limit(m, c, slow)).await?;
    relay_and_raw(&mut dispatch, &format!("concurrency {c}, provider answering after {ms} ms"), (r, l), m);
    dispatch.verdicts.push(format!(
        "best relay / raw HTTP at the same concurrency ({}) = **{:.2}** (goal ≥ 0.5)",
        best.2,
        best.0 / best.1.max(1.0)
    ));
    dispatch.verdicts.push(format!(
        "durable intent claims (issue 28, D5): the database ceiling is {:.2} × what it is with claims that do not \
         wait for the disk",
        db_only.0 / db_async.0.max(1.0)
    ));
    // On one machine the database's work and the HTTP work of each call
    // take turns on the same cores: their costs per call add up.
    let both = 1.0 / (1.0 / db_only.0.max(1.0) + 1.0 / best.1.max(1.0));
    dispatch.verdicts.push(format!(
        "the database alone and raw HTTP sharing these cores allow at most 1 / (1/{:.0} + 1/{:.0}) = {:.0} calls/s \
         = {:.2} × raw HTTP; the relay reaches **{:.2}** of that bound",
        db_only.0,
        best.1,
        both,
        both / best.1.max(1.0),
        best.0 / both
    ));
    dispatch.verdicts.push(format!(
        "with a provider that takes {ms} ms per call: relay / raw HTTP at concurrency {c} = **{:.2}** \
         (the goal is set against the provider that answers at once)",
        r.0 / l.0.max(1.0)
    ));
    Ok(dispatch)
}
