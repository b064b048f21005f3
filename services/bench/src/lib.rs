//! The relay's benchmark harness. Every number is measured next to its
//! reference in the same run, because absolute numbers on shared 2-core
//! machines drift while ratios measured side by side hold:
//!
//! * **ingest** — Kafka records → inbox row + 1 intent + 1 outbox row each,
//!   offsets committed — against the *limit* (the same rows written with
//!   batched `UNNEST` inserts, no Kafka) and the *floor* (a naive consumer:
//!   one transaction per record, check before insert);
//! * **dispatch** — pending intents → HTTP POST → finalized — against the raw
//!   rate of the same HTTP client on the same provider, by concurrency and by
//!   number of dispatcher processes; next to it what the database alone
//!   allows (the same claims and finishes, no call), and so what both sharing
//!   the machine allow;
//! * **relay to Kafka** — outbox rows → acknowledged → marked published —
//!   against the same records produced directly;
//! * **latency** — produce → the provider receives the call, at steady
//!   fractions of the highest rate the pipeline keeps up with;
//! * **growth** — ingest and claim with big tables and a long-open snapshot;
//! * **memory** — peak RSS of consumer and dispatcher processes with a backlog,
//!   and with four times that backlog;
//! * **app** — rows enqueued by applications (`relay.publish`, `relay.call`)
//!   against the same rows by a plain INSERT, drained, and the latency from
//!   their commit to the broker's ack or the call at 50 % and 90 % of that.
//!
//! Each figure is the median of `runs` runs. One module per section
//! (`ingest`, `dispatch`, `publish`, `latency`, `growth`, `memory`), each
//! with its workloads and the section it reports; this file holds what they
//! share (setup, the provider stand-in, polling) and [`run_all`].

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::Utc;
use futures::{FutureExt, StreamExt};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header as KHeader, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use relay::{Components, Faults, Handlers, Relay};
use relay_core::RelayConfig;
use relay_testkit::process::{RelayProcess, RelaySpec};
use relay_testkit::seed::{self, Work};
use relay_testkit::{OffsetWatch, TestDb, TestEvent, TestProducer, create_topics, unique};
use sqlx::{Connection, PgPool};
use tokio_util::sync::CancellationToken;

mod app;
mod dispatch;
mod growth;
mod ingest;
mod latency;
mod memory;
mod publish;

use app::*;
use dispatch::*;
use growth::*;
use ingest::*;
use latency::*;
use memory::*;
use publish::*;

/// Where and how much.
#[derive(Debug, Clone)]
pub struct Env {
    /// PostgreSQL URL of a role that may create databases.
    pub admin_url: String,
    /// Kafka bootstrap servers.
    pub bootstrap: String,
    /// The `relay` binary (for the multi-process rows).
    pub relay_bin: PathBuf,
    /// Small sizes, one run: checks the harness works.
    pub quick: bool,
    /// Runs per figure (median reported).
    pub runs: usize,
    /// Only these sections (ingest, dispatch, publish, latency, growth, memory); empty = all.
    pub only: Vec<String>,
    /// Latency: the steady loads, as fractions of the peak.
    pub loads: Vec<f64>,
    /// Latency: a given peak rate instead of the searched one (A/B runs).
    pub peak: Option<f64>,
    /// `dispatcher.claim_at_ingest` (the relay's default: on).
    pub claim_at_ingest: bool,
    /// A Confluent-compatible Schema Registry (the ingest section's Avro row).
    pub registry: Option<String>,
}

impl Env {
    fn wants(&self, section: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|s| s == section)
    }

    fn size(&self, quick: usize, full: usize) -> usize {
        if self.quick { quick } else { full }
    }
}

/// One measured row.
#[derive(Debug, Clone)]
pub struct Row {
    /// What was measured.
    pub name: String,
    /// Median rate (per second).
    pub rate: f64,
    /// Slowest and fastest run.
    pub spread: (f64, f64),
    /// Latency percentiles in ms, when measured.
    pub latency: Option<(f64, f64)>,
    /// Extra text.
    pub note: String,
}

/// A table of rows with its verdict.
#[derive(Debug, Clone, Default)]
pub struct Section {
    /// Title.
    pub title: String,
    /// Unit of the rate column.
    pub unit: String,
    /// Rows.
    pub rows: Vec<Row>,
    /// Goals and whether they were met.
    pub verdicts: Vec<String>,
}

impl Section {
    fn new(title: &str, unit: &str) -> Section {
        Section { title: title.into(), unit: unit.into(), ..Section::default() }
    }

    fn rate(&self, name: &str) -> f64 {
        self.rows.iter().find(|r| r.name == name).map_or(0.0, |r| r.rate)
    }

    /// Markdown.
    pub fn render(&self) -> String {
        let mut s = format!(
            "### {}\n\n| | {} (median) | min – max | p50 ms | p99 ms | note |\n|---|---:|---:|---:|---:|---|\n",
            self.title, self.unit
        );
        for r in &self.rows {
            let (p50, p99) = r.latency.map_or(("".into(), "".into()), |(a, b)| (format!("{a:.1}"), format!("{b:.1}")));
            s.push_str(&format!(
                "| {} | {:.0} | {:.0} – {:.0} | {p50} | {p99} | {} |\n",
                r.name, r.rate, r.spread.0, r.spread.1, r.note
            ));
        }
        for v in &self.verdicts {
            s.push_str(&format!("\n{v}\n"));
        }
        s.push('\n');
        s
    }
}

async fn median<F, Fut>(env: &Env, mut f: F) -> anyhow::Result<(f64, (f64, f64), Option<(f64, f64)>)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(f64, Option<(f64, f64)>)>>,
{
    let mut rates = Vec::new();
    let mut lat = Vec::new();
    for _ in 0..env.runs.max(1) {
        let (r, l) = f().await?;
        rates.push(r);
        if let Some(l) = l {
            lat.push(l);
        }
    }
    let (mid, spread) = median_spread(rates);
    let lat = if lat.is_empty() {
        None
    } else {
        lat.sort_by(|a, b| a.1.total_cmp(&b.1));
        Some(lat[lat.len() / 2])
    };
    Ok((mid, spread, lat))
}

/// The median of `v` (not empty) and its spread (min, max).
fn median_spread(mut v: Vec<f64>) -> (f64, (f64, f64)) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], (v[0], v[v.len() - 1]))
}

fn row(name: impl Into<String>, m: (f64, (f64, f64), Option<(f64, f64)>), note: impl Into<String>) -> Row {
    Row { name: name.into(), rate: m.0, spread: m.1, latency: m.2, note: note.into() }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

// ---------------------------------------------------------------------------
// A minimal provider: answers 201 (at once, or after a fixed delay standing
// for a remote service's own work) and records, per request, the time since
// the event was produced (when the body carries `produced_at_us`).
// ---------------------------------------------------------------------------

#[derive(Clone, Default)]
struct Sink {
    requests: Arc<AtomicU64>,
    /// When the first request arrived.
    first: Arc<std::sync::OnceLock<Instant>>,
    /// Per request carrying `produced_at_us`: (produced at, µs; latency, ms).
    latencies_ms: Arc<Mutex<Vec<(i64, f64)>>>,
}

fn now_us() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

impl Sink {
    /// A provider that answers each request after `delay` (zero: at once).
    async fn start(delay: Duration) -> anyhow::Result<(Sink, String)> {
        let sink = Sink::default();
        let s = sink.clone();
        let app = axum::Router::new().fallback(move |body: axum::body::Bytes| {
            let s = s.clone();
            async move {
                s.first.get_or_init(Instant::now);
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                s.requests.fetch_add(1, Ordering::Relaxed);
                if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body)
                    && let Some(at) = v.get("produced_at_us").and_then(serde_json::Value::as_i64)
                {
                    s.latencies_ms.lock().expect("sink lock").push((at, (now_us() - at) as f64 / 1000.0));
                }
                (axum::http::StatusCode::CREATED, "{}")
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        tokio::spawn(async move { axum::serve(listener, app).await });
        Ok((sink, url))
    }
}

struct Setup {
    db: TestDb,
    topic: String,
    out: String,
    group: String,
    sink: Sink,
    sink_url: String,
}

const CONSUMER: &str = "bench";

async fn setup(env: &Env, partitions: i32) -> anyhow::Result<Setup> {
    setup_with_provider(env, partitions, Duration::ZERO).await
}

/// [`setup`] with a provider that answers after `delay`.
async fn setup_with_provider(env: &Env, partitions: i32, delay: Duration) -> anyhow::Result<Setup> {
    let db = TestDb::create_in(&env.admin_url).await?;
    let (topic, out) = (unique("bench-in"), unique("bench-out"));
    create_topics(&env.bootstrap, &[&topic, &out], partitions).await?;
    let (sink, sink_url) = Sink::start(delay).await?;
    Ok(Setup { db, topic, out, group: unique("bench-group"), sink, sink_url })
}

fn config_text(env: &Env, s: &Setup, dispatch_concurrency: usize) -> String {
    format!(
        r#"
[consumer]
name = "{CONSUMER}"
group_id = "{group}"
batch_size = 500

[kafka]
bootstrap_servers = "{bootstrap}"

[database]
max_connections = 16

[dispatcher]
concurrency = {dispatch_concurrency}
claim_batch = 256
lease = "30s"
poll_interval = "1s"

[publisher]
batch_size = 2000
lease = "60s"
delivery_timeout = "30s"
poll_interval = "1s"

[endpoints.sink]
base_url = "{sink}"
timeout = "5s"
concurrency = {dispatch_concurrency}

{capture}

[[routes.actions]]
kind = "emit"
name = "accepted"
type = "order.accepted"
topic = "{out}"
key = "{{{{ data.order_id }}}}"
data = {{ order_id = "{{{{ data.order_id }}}}" }}
"#,
        group = s.group,
        bootstrap = env.bootstrap,
        sink = s.sink_url,
        out = s.out,
        capture = capture(&s.topic),
    )
}

/// The measured route on `topic`: a capture by the sink, carrying when its
/// record was produced.
fn capture(topic: &str) -> String {
    use relay_testkit::routes;
    let body = "body = { order_id = \"{{ data.order_id }}\", amount = \"{{ data.amount }}\", produced_at_us = \"{{ data.produced_at_us }}\" }\n";
    [routes::route(None, "order.placed", "counter = \"orders\"\n"), routes::call("capture", "sink", "/captures", body)]
        .concat()
        .replace("{topic}", topic)
}

fn config(env: &Env, s: &Setup, dispatch_concurrency: usize) -> anyhow::Result<RelayConfig> {
    let mut cfg = RelayConfig::from_toml(&config_text(env, s, dispatch_concurrency))?;
    cfg.database.url = Some(s.db.url.clone().into());
    cfg.dispatcher.claim_at_ingest = env.claim_at_ingest;
    Ok(cfg)
}

fn event(i: usize) -> TestEvent {
    let order = format!("o-{i}");
    TestEvent::new(
        &format!("e-{i}"),
        "order.placed",
        serde_json::json!({"order_id": order, "amount": i, "produced_at_us": now_us()}),
    )
    .key(&order)
}

async fn produce(env: &Env, topic: &str, range: std::ops::Range<usize>) -> anyhow::Result<()> {
    let p = TestProducer::new(&env.bootstrap)?;
    let all: Vec<usize> = range.collect();
    for chunk in all.chunks(1000) {
        let sends = chunk.iter().map(|i| {
            let e = event(*i);
            let p = &p;
            async move { p.event(topic, &e).await }
        });
        for r in futures::future::join_all(sends).await {
            r?;
        }
    }
    Ok(())
}

/// Wait until `work` is drained, then check (once) that `done` rows are in
/// `state`: a run where some calls died must fail, not report a rate.
/// Returns the time from `t0` to the drain, without that check (a count over
/// a table with a million old rows would otherwise be part of the rate).
async fn wait_drained(
    relay: &mut UnderTest,
    pool: &PgPool,
    work: Work,
    state: &str,
    done: i64,
    t0: Instant,
) -> anyhow::Result<Duration> {
    wait_until(relay, &format!("every {work:?} row {state}"), Duration::from_secs(900), async || {
        seed::drained(pool, work).await.unwrap_or(false)
    })
    .await?;
    let took = t0.elapsed();
    let n = seed::in_state(pool, work, state).await?;
    anyhow::ensure!(n == done, "{n} {work:?} rows are {state}, expected {done}");
    Ok(took)
}

/// Poll `ok` until it holds, failing at once if the relay under test stops
/// before (its error, or its log) rather than at `deadline`.
async fn wait_until(
    relay: &mut UnderTest,
    what: &str,
    deadline: Duration,
    mut ok: impl AsyncFnMut() -> bool,
) -> anyhow::Result<()> {
    let end = Instant::now() + deadline;
    while !ok().await {
        relay.still_running().with_context(|| format!("waiting for {what}"))?;
        if Instant::now() > end {
            anyhow::bail!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// The relay under test: in this process, or as `relay` processes.
///
/// Every wait of the harness checks it, so a relay that stops early — an
/// error in a component, a process refusing to start (a binary built from
/// other migrations, say) — fails the run at once with its error or the end
/// of its log, instead of leaving the harness polling the database until
/// the wait's deadline (up to 15 minutes) with nothing on screen.
enum UnderTest {
    InProcess { token: CancellationToken, task: Option<tokio::task::JoinHandle<anyhow::Result<()>>> },
    Processes(Vec<RelayProcess>),
}

impl UnderTest {
    /// Run `relay`'s components `which` on a task of this process.
    fn start(relay: Relay, which: Components) -> UnderTest {
        let token = CancellationToken::new();
        let t = token.clone();
        UnderTest::InProcess { token, task: Some(tokio::spawn(async move { relay.run(which, t).await })) }
    }

    /// `Err` naming why, once the relay has stopped.
    fn still_running(&mut self) -> anyhow::Result<()> {
        match self {
            UnderTest::InProcess { task, .. } => match task.as_mut().and_then(|t| t.now_or_never()) {
                None => Ok(()),
                Some(ended) => {
                    *task = None;
                    match ended {
                        Ok(Ok(())) => anyhow::bail!("the relay stopped by itself"),
                        Ok(Err(e)) => Err(e.context("the relay stopped")),
                        Err(e) => anyhow::bail!("the relay's task failed: {e}"),
                    }
                }
            },
            UnderTest::Processes(procs) => match procs.iter_mut().find_map(|p| (!p.is_running()).then_some(p)) {
                None => Ok(()),
                Some(p) => {
                    let status = p.wait(Duration::ZERO).map_or_else(|_| String::new(), |s| format!(" ({s})"));
                    let log = p.log();
                    let lines: Vec<&str> = log.lines().collect();
                    let tail = &lines[lines.len().saturating_sub(20)..];
                    anyhow::bail!(
                        "a relay process exited{status}: `relay {}`; the end of its log ({}):\n{}",
                        p.spec().args.join(" "),
                        p.spec().log.display(),
                        tail.join("\n")
                    )
                }
            },
        }
    }

    /// Stop it (SIGTERM for processes) and return its error, if any.
    async fn stop(self) -> anyhow::Result<()> {
        match self {
            UnderTest::InProcess { token, task } => {
                token.cancel();
                match task {
                    Some(task) => task.await?,
                    None => Ok(()),
                }
            }
            UnderTest::Processes(procs) => {
                for mut p in procs {
                    p.terminate(Duration::from_secs(30))?;
                }
                Ok(())
            }
        }
    }

    /// Peak RSS of its only process. An in-process relay has none of its
    /// own (it shares the bench's), so asking is an error, not a zero.
    fn peak_rss_mib(&self) -> anyhow::Result<f64> {
        match self {
            UnderTest::Processes(procs) => {
                let pid = procs.first().and_then(RelayProcess::pid).context("the relay process is not running")?;
                peak_rss_mib(pid)
            }
            UnderTest::InProcess { .. } => anyhow::bail!("peak RSS is only measured for a relay process"),
        }
    }
}

const CONSUME: Components = Components { consumer: true, dispatcher: false, publisher: false };
const DISPATCH: Components = Components { consumer: false, dispatcher: true, publisher: false };
const PUBLISH: Components = Components { consumer: false, dispatcher: false, publisher: true };

/// Run everything; returns the sections in order.
pub async fn run_all(env: &Env) -> anyhow::Result<Vec<Section>> {
    let mut out = Vec::new();

    if env.wants("ingest") {
        out.push(ingest_section(env).await?);
    }

    if env.wants("dispatch") {
        out.push(dispatch_section(env).await?);
    }

    if env.wants("publish") {
        out.push(publish_section(env).await?);
    }

    if env.wants("latency") {
        out.push(latency_section(env).await?);
    }

    if env.wants("growth") {
        out.push(growth_section(env).await?);
    }

    if env.wants("memory") {
        out.push(memory_section(env).await?);
    }

    if env.wants("app") {
        out.push(app_section(env).await?);
    }
    Ok(out)
}

/// The machine's CPU time from `/proc/stat` (Linux): every process's, on
/// every core, steal included, to tell a rate bound by the cores from one
/// bound by waiting.
#[derive(Debug, Clone, Copy)]
struct CpuClock {
    busy: u64,
    total: u64,
}

impl CpuClock {
    fn now() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let ticks: Vec<u64> =
            stat.lines().next()?.split_whitespace().skip(1).take(8).map(|t| t.parse().ok()).collect::<Option<_>>()?;
        let total: u64 = ticks.iter().sum();
        // idle and iowait
        let idle = ticks.get(3)? + ticks.get(4)?;
        Some(Self { busy: total - idle, total })
    }

    /// The share of all cores' time spent busy since `self`.
    fn busy_since(self) -> Option<f64> {
        let now = Self::now()?;
        let total = now.total.checked_sub(self.total).filter(|t| *t > 0)?;
        Some(now.busy.saturating_sub(self.busy) as f64 / total as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait that would last `deadline` unless the relay's end cuts it short.
    async fn wait_on(relay: &mut UnderTest) -> anyhow::Error {
        let deadline = Duration::from_secs(60);
        let t0 = Instant::now();
        let e = wait_until(relay, "something that never happens", deadline, async || false).await.unwrap_err();
        assert!(t0.elapsed() < deadline / 2, "the wait ran {:?}: the relay's end was not noticed", t0.elapsed());
        e
    }

    #[tokio::test]
    async fn a_wait_fails_at_once_with_the_error_when_the_relay_in_this_process_stops() {
        let token = CancellationToken::new();
        let task = tokio::spawn(async { anyhow::bail!("the dispatcher could not claim: connection refused") });
        let e = wait_on(&mut UnderTest::InProcess { token, task: Some(task) }).await;
        let text = format!("{e:#}");
        assert!(text.contains("waiting for something that never happens"), "{text}");
        assert!(text.contains("connection refused"), "{text}");
    }

    #[tokio::test]
    async fn a_wait_fails_at_once_with_the_log_when_a_relay_process_exits() {
        let dir = std::env::temp_dir();
        let log = dir.join(format!("{}.log", unique("bench-test")));
        std::fs::write(&log, "error: the database schema is not current: run `relay migrate` first\n").unwrap();
        let spec = RelaySpec {
            bin: "false".into(),
            config: dir.join("unused.toml"),
            args: vec!["consume".into()],
            env: Vec::new(),
            log,
        };
        let e = wait_on(&mut UnderTest::Processes(vec![RelayProcess::start(spec).unwrap()])).await;
        let text = format!("{e:#}");
        assert!(text.contains("a relay process exited (exit status: 1): `relay consume`"), "{text}");
        assert!(text.contains("run `relay migrate` first"), "{text}");
    }
}
