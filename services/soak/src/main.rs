//! `relay-soak`: the chaos soak. See the library docs and EVIDENCE.md.

use std::process::ExitCode;

use clap::Parser;
use relay_soak::{SoakOptions, run};

/// Drive load through relay processes while SIGKILLing them, then verify.
#[derive(Parser)]
#[command(name = "relay-soak")]
struct Args {
    /// Orders to produce.
    #[arg(long, default_value_t = 5000)]
    events: usize,
    /// Input topics.
    #[arg(long, default_value_t = 3)]
    topics: usize,
    /// Partitions per topic.
    #[arg(long, default_value_t = 4)]
    partitions: i32,
    /// SIGKILLs to deliver (at least).
    #[arg(long, default_value_t = 50)]
    kills: usize,
    /// Share of orders re-sent under the same event id.
    #[arg(long, default_value_t = 0.07)]
    duplicates: f64,
    /// Share of orders re-sent under a new id with the same idempotency key.
    #[arg(long, default_value_t = 0.02)]
    retries: f64,
    /// Share of poison records.
    #[arg(long, default_value_t = 0.005)]
    poison: f64,
    /// Skip the final replay from offset 0.
    #[arg(long)]
    no_replay: bool,
    /// Planted bug for the relay processes (RELAY_SABOTAGE), to see the checker catch it.
    #[arg(long)]
    sabotage: Option<String>,
    /// RELAY_FAULTS for the consumers (e.g. consumer.before_db_commit=pause:200ms to widen a window).
    #[arg(long)]
    consumer_faults: Option<String>,
    #[command(flatten)]
    services: relay_testkit::process::Services,
    /// Random seed (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// How long draining may take after the load.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    drain_deadline: std::time::Duration,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into())).init();
    let a = Args::parse();
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(1)
    });
    let opts = SoakOptions {
        events: a.events,
        topics: a.topics,
        partitions: a.partitions,
        kills: a.kills,
        duplicate_ratio: a.duplicates,
        retry_ratio: a.retries,
        poison_ratio: a.poison,
        replay: !a.no_replay,
        sabotage: a.sabotage,
        consumer_faults: a.consumer_faults,
        relay_bin: a.services.relay_bin(),
        database_url: a.services.database_url.clone(),
        bootstrap: a.services.bootstrap.clone(),
        seed,
        drain_deadline: a.drain_deadline,
    };
    match run(&opts).await {
        Ok((summary, report)) => {
            println!("\n{}", report.render());
            println!("{}", summary.render(&report));
            if report.ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
