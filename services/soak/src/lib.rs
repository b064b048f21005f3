//! The chaos soak: drive a steady load through real relay processes while
//! killing them with SIGKILL at random, then check the final state with
//! `relay verify` and the provider's own record.
//!
//! Load: orders across several topics and partitions, a share of them sent
//! again under the same event id (duplicates), a share re-sent under a new id
//! with the same business idempotency key (upstream retries), a share of
//! poison records, and at the end a replay of every topic by a new consumer
//! group. The provider fails (503, 429) and times out after applying at random.
//! Processes: a consumer, intent dispatchers, an outbox publisher and a
//! `relay run` process with all three (whose consumer writes intents already
//! claimed by its own dispatcher), each killed and restarted at random moments.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use example_provider::{FaultKind, FaultRule, Provider, Settings};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use relay_cli::verify::{ProviderEffect, Report, VerifyOptions, verify};
use relay_core::RelayConfig;
use relay_testkit::process::{RelayProcess, RelaySpec};
use relay_testkit::{TestDb, TestEvent, TestProducer, committed_offsets, create_topics, unique};
use serde_json::json;

/// What to run.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    /// Orders to produce (duplicates, retries and poison come on top).
    pub events: usize,
    /// Input topics.
    pub topics: usize,
    /// Partitions per topic.
    pub partitions: i32,
    /// SIGKILLs to deliver (at least).
    pub kills: usize,
    /// Share of orders sent again with the same event id.
    pub duplicate_ratio: f64,
    /// Share of orders re-sent under a new id with the same idempotency key.
    pub retry_ratio: f64,
    /// Share of records that are poison.
    pub poison_ratio: f64,
    /// Replay every topic from offset 0 with a new group at the end.
    pub replay: bool,
    /// `RELAY_SABOTAGE` for the relay processes (planted-bug runs).
    pub sabotage: Option<String>,
    /// `RELAY_FAULTS` for the consumer processes (to widen a window).
    pub consumer_faults: Option<String>,
    /// The `relay` binary.
    pub relay_bin: PathBuf,
    /// A PostgreSQL URL whose role may create databases.
    pub database_url: String,
    /// Kafka bootstrap servers.
    pub bootstrap: String,
    /// Random seed.
    pub seed: u64,
    /// How long draining may take after the load.
    pub drain_deadline: Duration,
}

/// What the soak saw.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Records produced to the input topics.
    pub records_in: u64,
    /// Orders (unique events).
    pub orders: u64,
    /// Records re-sent under an id already sent.
    pub duplicate_sends: u64,
    /// Records re-sent under a new id and an old idempotency key.
    pub retry_sends: u64,
    /// Poison records.
    pub poison: u64,
    /// Records replayed by the replay group.
    pub replayed: u64,
    /// Inbox rows deduplicated by business idempotency key.
    pub key_duplicates: i64,
    /// Calls the provider answered from its stored response (same key again).
    pub provider_replays: u64,
    /// Effects applied at the provider.
    pub effects: u64,
    /// Dead letters.
    pub dead_letters: i64,
    /// Dead intents.
    pub dead_intents: i64,
    /// SIGKILLs delivered (each process restarted after it).
    pub kills: u64,
    /// Of them, those delivered while work was in flight (records not yet
    /// recorded, intents or outbox rows not finished): the ones that test
    /// a crash mid-work. The others hit an idle relay.
    pub kills_under_load: u64,
    /// Processes that died by themselves (a fault point) and were restarted.
    pub crashes: u64,
    /// Wall time.
    pub elapsed: Duration,
}

impl Summary {
    /// The summary table, with the checker's verdict.
    pub fn render(&self, report: &Report) -> String {
        let lost = report.violations.iter().filter(|v| v.check == "lost").map(|v| v.count).sum::<usize>();
        let doubled = report
            .violations
            .iter()
            .filter(|v| v.check == "double_effect" || v.check == "intent_applied_twice")
            .map(|v| v.count)
            .sum::<usize>();
        let rows = [
            ("events in (records produced)", self.records_in.to_string()),
            ("  orders (unique event ids)", self.orders.to_string()),
            ("  re-sent with the same event id", self.duplicate_sends.to_string()),
            ("  re-sent with a new id, same idempotency key", self.retry_sends.to_string()),
            ("  poison records", self.poison.to_string()),
            ("  replayed from offset 0 by a new group", self.replayed.to_string()),
            ("effects applied at the provider", self.effects.to_string()),
            (
                "duplicates suppressed: inbox (at least)",
                format!("{} + redeliveries", self.duplicate_sends + self.replayed.saturating_sub(self.poison)),
            ),
            ("duplicates suppressed: idempotency key", self.key_duplicates.to_string()),
            ("duplicates suppressed: provider (same key)", self.provider_replays.to_string()),
            ("dead letters", self.dead_letters.to_string()),
            ("dead intents", self.dead_intents.to_string()),
            ("kills survived (SIGKILL + restart)", self.kills.to_string()),
            ("  of them with work in flight", self.kills_under_load.to_string()),
            ("self-inflicted crashes restarted", self.crashes.to_string()),
            ("lost", lost.to_string()),
            ("double effects", doubled.to_string()),
            ("invariant violations", report.violations.len().to_string()),
            ("wall time", format!("{:.1}s", self.elapsed.as_secs_f64())),
        ];
        let rule = format!("+{}+{}+\n", "-".repeat(48), "-".repeat(22));
        let mut s = rule.clone();
        for (k, v) in rows {
            s.push_str(&format!("| {k:<46} | {v:>20} |\n"));
        }
        s.push_str(&rule);
        s
    }
}

fn routes(topics: &[String], out: &str) -> String {
    use relay_testkit::routes;
    let capture = [
        routes::route(None, "order.placed", "counter = \"orders\"\n"),
        routes::call("capture", "psp", "/captures", &routes::order_and_amount_body()),
        routes::captured(),
    ]
    .concat()
    .replace("{out}", out);
    topics.iter().map(|t| capture.replace("{topic}", t)).collect()
}

fn config(opts: &SoakOptions, group: &str, topics: &[String], out: &str, dlq: &str, provider: &str) -> String {
    format!(
        r#"
[consumer]
name = "soak"
group_id = "{group}"
dead_letter_topic = "{dlq}"
batch_size = 100
[consumer.reference_retry]
max_attempts = 3
backoff = {{ min_delay = "20ms", max_delay = "100ms" }}

[kafka]
bootstrap_servers = "{bootstrap}"
consumer_properties = {{ "session.timeout.ms" = "6000" }}

[database]
max_connections = 6

[dispatcher]
concurrency = 32
lease = "4s"
poll_interval = "200ms"
rescue_interval = "500ms"

[publisher]
batch_size = 500
lease = "8s"
delivery_timeout = "5s"
poll_interval = "200ms"

[endpoints.psp]
base_url = "{provider}"
timeout = "1s"
connect_timeout = "500ms"
concurrency = 32
max_attempts = 15
max_age = "30m"
backoff = {{ min_delay = "50ms", max_delay = "1s" }}
{routes}
"#,
        bootstrap = opts.bootstrap,
        routes = routes(topics, out),
    )
}

struct Fleet {
    procs: Vec<(String, RelayProcess)>,
}

impl Fleet {
    fn pick(&mut self, rng: &mut StdRng) -> &mut (String, RelayProcess) {
        let i = rng.random_range(0..self.procs.len());
        &mut self.procs[i]
    }
}

/// Run the soak; returns its summary and the checker's report.
pub async fn run(opts: &SoakOptions) -> anyhow::Result<(Summary, Report)> {
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(opts.seed);
    println!(
        "soak: seed {}, {} orders over {} topic(s) x {} partition(s), {} kills",
        opts.seed, opts.events, opts.topics, opts.partitions, opts.kills
    );
    let db = TestDb::create_in(&opts.database_url).await?;
    let run_id = unique("soak");
    let topics: Vec<String> = (0..opts.topics).map(|i| format!("{run_id}-in{i}")).collect();
    let (out, dlq) = (format!("{run_id}-out"), format!("{run_id}-dlq"));
    let mut all: Vec<&str> = topics.iter().map(String::as_str).collect();
    all.push(&out);
    all.push(&dlq);
    create_topics(&opts.bootstrap, &all, opts.partitions).await?;
    let provider = Provider::start(([127, 0, 0, 1], 0).into(), Settings::default()).await?;
    provider.set_faults(vec![FaultRule {
        path_prefix: None,
        key_prefix: None,
        times: None,
        kind: FaultKind::Chaos { per_mille_503: 30, per_mille_429: 20, per_mille_timeout: 20, timeout_ms: 1500 },
    }]);
    let group = format!("{run_id}-group");
    let text = config(opts, &group, &topics, &out, &dlq, &provider.url());
    let cfg_path = std::env::temp_dir().join(format!("{run_id}.toml"));
    std::fs::write(&cfg_path, &text)?;
    let mut cfg = RelayConfig::from_toml(&text)?;
    cfg.database.url = Some(db.url.clone().into());

    let logs = std::env::temp_dir().join(&run_id);
    std::fs::create_dir_all(&logs)?;
    let spec = |name: &str, args: &[&str], extra: &[(&str, &str)]| {
        let mut env = vec![("DATABASE_URL".to_string(), db.url.clone()), ("RUST_LOG".to_string(), "warn".to_string())];
        if let Some(s) = &opts.sabotage {
            env.push(("RELAY_SABOTAGE".into(), s.clone()));
        }
        env.extend(extra.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())));
        RelaySpec {
            bin: opts.relay_bin.clone(),
            config: cfg_path.clone(),
            args: args.iter().map(|a| (*a).to_string()).collect(),
            env,
            log: logs.join(format!("{name}.log")),
        }
    };
    let consumer_env: Vec<(&str, &str)> = opts.consumer_faults.iter().map(|f| ("RELAY_FAULTS", f.as_str())).collect();
    let fleet = Fleet {
        procs: vec![
            ("consumer-1".into(), RelayProcess::start(spec("consumer-1", &["consume"], &consumer_env))?),
            // Consumer, dispatcher and publisher in one process: its consumer
            // writes intents already claimed by its dispatcher (claim at ingest).
            ("runner".into(), RelayProcess::start(spec("runner", &["run"], &consumer_env))?),
            ("dispatcher-1".into(), RelayProcess::start(spec("dispatcher-1", &["dispatch", "--intents-only"], &[]))?),
            ("dispatcher-2".into(), RelayProcess::start(spec("dispatcher-2", &["dispatch", "--intents-only"], &[]))?),
            ("publisher".into(), RelayProcess::start(spec("publisher", &["dispatch", "--outbox-only"], &[]))?),
        ],
    };
    println!("soak: database {}, topics {}, logs in {}", db.name, topics.join(","), logs.display());

    // Progress line every 2 s.
    let produced = Arc::new(AtomicU64::new(0));
    let kills = Arc::new(AtomicU64::new(0));
    let progress = {
        let (pool, produced, kills) = (db.pool.clone(), produced.clone(), kills.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                let q = |sql: &'static str| {
                    let pool = pool.clone();
                    async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(&pool).await.unwrap_or(-1) }
                };
                println!(
                    "soak: {:>6.1}s produced {:>7} | inbox {:>7} | intents done {:>7} | published {:>7} | dead letters {:>5} | kills {:>3}",
                    started.elapsed().as_secs_f64(),
                    produced.load(Ordering::Relaxed),
                    q("SELECT count(*) FROM relay.inbox").await,
                    q("SELECT count(*) FROM relay.intents WHERE state IN ('succeeded', 'dead', 'uncertain')").await,
                    q("SELECT count(*) FROM relay.outbox WHERE state = 'published'").await,
                    q("SELECT count(*) FROM relay.dead_letters").await,
                    kills.load(Ordering::Relaxed),
                );
            }
        })
    };

    // The load, produced in chunks of concurrent sends.
    let producer = Arc::new(TestProducer::new(&opts.bootstrap)?);
    let mut summary = Summary::default();
    let mut plan: Vec<(String, TestEvent, bool)> = Vec::new();
    for i in 0..opts.events {
        let topic = topics[i % topics.len()].clone();
        let order_id = format!("o-{i}");
        let e = TestEvent::new(&format!("e-{i}"), "order.placed", json!({"order_id": order_id, "amount": i}))
            .ext("idempotencykey", format!("place:{order_id}"))
            .key(&order_id);
        plan.push((topic.clone(), e.clone(), false));
        summary.orders += 1;
        if rng.random_bool(opts.duplicate_ratio) {
            plan.push((topic.clone(), e.clone(), false));
            summary.duplicate_sends += 1;
        }
        if rng.random_bool(opts.retry_ratio) {
            let mut retry = e.clone();
            retry.id = Some(format!("e-{i}-retry"));
            plan.push((topic.clone(), retry, false));
            summary.retry_sends += 1;
        }
        if rng.random_bool(opts.poison_ratio) {
            let mut bad = e.clone();
            bad.id = None; // no event id: must be parked, never processed under an invented one
            plan.push((topic, bad, true));
            summary.poison += 1;
        }
    }
    summary.records_in = plan.len() as u64;
    // Produce in the background, in chunks of concurrent sends.
    let production = {
        let (producer, produced) = (producer.clone(), produced.clone());
        tokio::spawn(async move {
            for chunk in plan.chunks(500) {
                let sends = chunk.iter().map(|(topic, e, _)| producer.event(topic, e));
                for r in futures::future::join_all(sends).await {
                    r?;
                }
                produced.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
            anyhow::Ok(())
        })
    };
    // Kills spread over the processing: one each time another 1/(kills+1) of
    // the events has been recorded, so every phase of the run sees crashes.
    let expected_rows = (summary.orders + summary.retry_sends) as i64;
    let step = (expected_rows / (opts.kills as i64 + 1)).max(1);
    let mut next = step;
    // A supervisor restarts processes that die by themselves (a fault point
    // that aborts), as an orchestrator would.
    let fleet = Arc::new(tokio::sync::Mutex::new(fleet));
    let crashes = Arc::new(AtomicU64::new(0));
    let supervisor = {
        let (fleet, crashes) = (fleet.clone(), crashes.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                for (name, p) in &mut fleet.lock().await.procs {
                    if !p.is_running() {
                        crashes.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(process = %name, "exited by itself; restarting");
                        if let Err(e) = p.restart() {
                            tracing::error!(process = %name, error = %e, "restart failed");
                        }
                    }
                }
            }
        })
    };
    // When progress stalls (or everything is recorded) kills go on by time.
    // A kill is counted "under load" when, as it lands, records are still
    // to be recorded or intents and outbox rows are unfinished; kills owed
    // for progress already made go at once (not skipped), so they land
    // while there is work rather than after it.
    let mut last_kill = Instant::now();
    let mut under_load = 0u64;
    while (kills.load(Ordering::Relaxed) as usize) < opts.kills {
        let rows = db.count("inbox", "true").await;
        // At least 300 ms between kills: a process killed again at once
        // would not have started any work to be killed in.
        let due = rows >= next && last_kill.elapsed() >= Duration::from_millis(300);
        if due || last_kill.elapsed() >= Duration::from_secs(3) {
            let open = db.count("intents", "state IN ('pending', 'running')").await
                + db.count("outbox", "state IN ('pending', 'running')").await;
            kill_one(&mut *fleet.lock().await, &mut rng, &kills)?;
            under_load += u64::from(rows < expected_rows || open > 0);
            next += step;
            last_kill = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    summary.kills_under_load = under_load;
    production.await??;
    summary.kills = kills.load(Ordering::Relaxed);

    let records = summary.records_in as i64;
    wait(opts.drain_deadline, "the main group to commit every record", || async {
        let mut total = 0;
        for t in &topics {
            total +=
                committed_offsets(&opts.bootstrap, &group, t).await.ok()?.values().map(|o| o.unwrap_or(0)).sum::<i64>();
        }
        (total == records).then_some(())
    })
    .await?;

    if opts.replay {
        println!("soak: replaying every topic from offset 0 with a new consumer group");
        let replay_group = format!("{run_id}-replay");
        let mut replay =
            RelayProcess::start(spec("replay", &["consume"], &[("RELAY_CONSUMER__GROUP_ID", &replay_group)]))?;
        wait(opts.drain_deadline, "the replay group to reach the end", || async {
            let mut total = 0;
            for t in &topics {
                total += committed_offsets(&opts.bootstrap, &replay_group, t)
                    .await
                    .ok()?
                    .values()
                    .map(|o| o.unwrap_or(0))
                    .sum::<i64>();
            }
            (total == records).then_some(())
        })
        .await?;
        replay.terminate(Duration::from_secs(30))?;
        summary.replayed = summary.records_in;
    }

    wait(opts.drain_deadline, "every intent and outbox row to finish", || async {
        let open: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM relay.intents WHERE state IN ('pending','running'))
                  + (SELECT count(*) FROM relay.outbox WHERE state <> 'published')",
        )
        .fetch_one(&db.pool)
        .await
        .ok()?;
        (open == 0).then_some(())
    })
    .await?;
    supervisor.abort();
    summary.crashes = crashes.load(Ordering::Relaxed);
    for (name, p) in &mut fleet.lock().await.procs {
        let status = p.terminate(Duration::from_secs(30))?;
        if !status.success() {
            anyhow::bail!("{name} exited with {status:?} on SIGTERM");
        }
    }
    progress.abort();

    let effects: Vec<ProviderEffect> = provider
        .applied()
        .into_iter()
        .map(|a| ProviderEffect { idempotency_key: a.key, intent_id: a.intent_id })
        .collect();
    let report =
        verify(&cfg, &db.pool, &VerifyOptions { effects: Some(effects), grace: Duration::from_secs(60) }).await?;
    let stats = provider.stats();
    summary.effects = stats.applied;
    summary.provider_replays = stats.replayed;
    summary.key_duplicates = db.count("inbox", "outcome = 'duplicate_key'").await;
    summary.dead_letters = db.count("dead_letters", "true").await;
    summary.dead_intents = db.count("intents", "state = 'dead'").await;
    summary.elapsed = started.elapsed();
    Ok((summary, report))
}

fn kill_one(fleet: &mut Fleet, rng: &mut StdRng, kills: &AtomicU64) -> anyhow::Result<()> {
    let (name, p) = fleet.pick(rng);
    p.kill9()?;
    p.restart()?;
    let n = kills.fetch_add(1, Ordering::Relaxed) + 1;
    tracing::info!(process = %name, kills = n, "SIGKILL + restart");
    Ok(())
}

async fn wait<T, F, Fut>(deadline: Duration, what: &str, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let end = Instant::now() + deadline;
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if Instant::now() > end {
            anyhow::bail!("timed out after {deadline:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
