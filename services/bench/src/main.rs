//! `relay-bench [--quick] [--runs N] [--out BENCHMARKS.md]` — see the library docs.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use relay_bench::{Env, run_all};

/// The allocator the `relay` binary uses, since most sections run the relay
/// inside this process (and the references run here too, with the same one).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Benchmark the relay against its limits and the naive way, side by side.
#[derive(Parser)]
#[command(name = "relay-bench")]
struct Args {
    /// Small sizes and one run: checks that the harness works (CI).
    #[arg(long)]
    quick: bool,
    /// Runs per figure (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Only these sections, comma-separated (ingest, dispatch, publish, latency, growth, memory, app).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Latency: the steady loads to run at, as fractions of the peak.
    #[arg(long, value_delimiter = ',', default_values_t = [0.1, 0.5, 0.9])]
    load: Vec<f64>,
    /// Latency: take this rate (records/s) as the peak instead of searching
    /// for it, so that two builds can be compared at the same fixed loads.
    #[arg(long)]
    peak: Option<f64>,
    /// Latency (consumer and dispatcher in one process): every intent
    /// written pending and claimed by the claim loop, instead of claimed at
    /// ingest (`dispatcher.claim_at_ingest = false`), to compare the two.
    #[arg(long)]
    no_claim_at_ingest: bool,
    /// A Confluent-compatible Schema Registry, for the ingest section's Avro row.
    #[arg(long, env = "RELAY_TEST_SCHEMA_REGISTRY_URL")]
    schema_registry: Option<String>,
    /// Write the Markdown report here (e.g. BENCHMARKS.md).
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    services: relay_testkit::process::Services,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "error".into())).init();
    let a = Args::parse();
    let env = Env {
        admin_url: a.services.database_url.clone(),
        bootstrap: a.services.bootstrap.clone(),
        relay_bin: a.services.relay_bin(),
        quick: a.quick,
        runs: if a.quick { 1 } else { a.runs },
        only: a.only,
        loads: a.load,
        peak: a.peak,
        claim_at_ingest: !a.no_claim_at_ingest,
        registry: a.schema_registry,
    };
    let started = std::time::Instant::now();
    let sections = match run_all(&env).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let mut md = format!(
        "## Results\n\n`scripts/bench.sh{}` on {} ({} CPUs), {}; {} run(s) per figure, {:.0} s in all.\n\n",
        if a.quick { " --quick" } else { "" },
        std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_owned()).unwrap_or_default(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        chrono::Utc::now().format("%Y-%m-%d %H:%M UTC"),
        env.runs,
        started.elapsed().as_secs_f64()
    );
    for s in &sections {
        md.push_str(&s.render());
    }
    println!("{md}");
    if let Some(path) = a.out {
        let head = std::fs::read_to_string(&path).ok().and_then(|t| t.split("## Results").next().map(str::to_owned));
        let text = format!("{}{md}", head.unwrap_or_default());
        if let Err(e) = std::fs::write(&path, text) {
            eprintln!("error: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
