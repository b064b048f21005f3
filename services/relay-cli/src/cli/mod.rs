//! The `relay` command line: run the components, migrate, operate dead
//! letters, show counts. Errors name their cause and the fix; the exit code
//! is 1 on error, 2 on bad usage.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use relay_core::RelayConfig;
use relay_store::intents::IntentState;
use relay_store::ops::PauseKind;
use relay_store::outbox::OutboxState;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::telemetry::{self, LogFormat};
use relay::app::{Components, Relay, connect};
use relay::ingest::handler::Handlers;
use relay::ops::admin::Operator;
use relay::runtime::faults::Faults;

mod check;
mod dead_letters;
mod intents;
mod operate;
mod outbox;

/// relay — exactly-once effects from Kafka's at-least-once delivery.
#[derive(Debug, Parser)]
#[command(
    name = "relay",
    version = concat!(env!("CARGO_PKG_VERSION"), " (git ", env!("RELAY_GIT_REVISION"), ")"),
    propagate_version = true
)]
pub struct Cli {
    /// Configuration file (TOML). Environment overrides: RELAY_SECTION__KEY, DATABASE_URL.
    #[arg(long, short, env = "RELAY_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// Log format.
    #[arg(long, value_enum, default_value = "text", env = "RELAY_LOG_FORMAT", global = true)]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply pending database migrations.
    Migrate,
    /// Check the configuration (and the routes' templates and schemas) and print a summary.
    CheckConfig {
        /// Instead, render route ROUTE (its name, or topic/type) against an example event and print the
        /// saga moves, calls and events it would write, with their ids and keys (a dry run: no I/O).
        #[arg(long, value_name = "ROUTE")]
        explain: Option<String>,
        /// With --explain: render this record value (JSON, as the topic carries it) instead of an example.
        #[arg(long, value_name = "FILE", requires = "explain")]
        event: Option<PathBuf>,
        /// With --explain: the provider's answer ({"status", "headers", "body"}) for on_success templates
        /// that read `response`.
        #[arg(long, value_name = "FILE", requires = "explain")]
        response: Option<PathBuf>,
        /// With --event: the record's key.
        #[arg(long, value_name = "KEY", requires = "event")]
        key: Option<String>,
        /// With --event: a record header, NAME=VALUE (repeatable).
        #[arg(long = "header", value_name = "NAME=VALUE", requires = "event")]
        headers: Vec<String>,
    },
    /// Run the inbox consumer.
    Consume,
    /// Run the dispatcher: intent calls and outbox publishing.
    Dispatch {
        /// Only make intent calls (run the outbox publisher elsewhere).
        #[arg(long, conflicts_with = "outbox_only")]
        intents_only: bool,
        /// Only publish the outbox.
        #[arg(long)]
        outbox_only: bool,
    },
    /// Run consumer, dispatcher and publisher in one process.
    Run,
    /// List, inspect, replay and purge dead letters.
    #[command(subcommand)]
    DeadLetters(DeadLetterCommand),
    /// List, inspect and replay intents (external calls).
    #[command(subcommand)]
    Intents(IntentCommand),
    /// List and inspect outbox rows (Kafka records to publish); replay or
    /// skip a dead one, which the later rows of its key wait for.
    #[command(subcommand)]
    Outbox(OutboxCommand),
    /// Pause a route (its partitions wait at its next event) or an endpoint
    /// (its intents are not claimed), for every relay process.
    Pause {
        /// `route` or `endpoint`.
        kind: PauseKindArg,
        /// Route name (see check-config) or endpoint name.
        name: String,
        /// Why (shown in the console and `relay pauses`).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Resume a paused route or endpoint.
    Resume {
        /// `route` or `endpoint`.
        kind: PauseKindArg,
        /// Route or endpoint name.
        name: String,
    },
    /// List what is paused.
    Pauses,
    /// Delete rows older than their retention now, in bounded batches, with progress.
    Cleanup,
    /// Show counts: inbox outcomes, intents by state, oldest pending, outbox, dead letters.
    Stats {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Check the final state against the relay's invariants: input topics vs
    /// inbox and dead letters, intents vs the provider's record, outbox vs the
    /// output topics, stuck rows, business counters. Exit code 1 on a violation.
    Verify {
        /// The provider's record of applied effects: a URL (e.g. the example
        /// provider's /_control/effects) or a file (JSON array or JSON lines of
        /// {"idempotency_key": …, "intent_id": …}).
        #[arg(long)]
        provider_effects: Option<String>,
        /// Rows past their lease or due time by more than this count as stuck.
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        grace: std::time::Duration,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// End-to-end demo: an embedded Kafka (librdkafka's mock cluster), a local
    /// fake provider, example events with duplicates and poison. Needs DATABASE_URL.
    Demo,
}

/// What can be paused.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum PauseKindArg {
    /// A route.
    Route,
    /// An endpoint.
    Endpoint,
}

impl From<PauseKindArg> for PauseKind {
    fn from(k: PauseKindArg) -> Self {
        match k {
            PauseKindArg::Route => PauseKind::Route,
            PauseKindArg::Endpoint => PauseKind::Endpoint,
        }
    }
}

/// Intent commands.
#[derive(Debug, Subcommand)]
pub enum IntentCommand {
    /// List intents, newest first.
    List {
        /// Only this state: pending, running, succeeded, dead or uncertain.
        #[arg(long)]
        state: Option<IntentState>,
        /// Only this endpoint.
        #[arg(long)]
        endpoint: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Print JSON lines.
        #[arg(long)]
        json: bool,
    },
    /// Show one intent with its attempts.
    Show {
        /// Intent id.
        id: uuid::Uuid,
    },
    /// Resolve an uncertain intent as the provider says it ended, once
    /// someone asked it: succeeded (its on_success effects are recorded) or
    /// failed (its on_dead effects).
    Resolve {
        /// Intent id.
        id: uuid::Uuid,
        /// The provider applied it.
        #[arg(long, conflicts_with = "failed", required_unless_present = "failed")]
        succeeded: bool,
        /// The provider did not apply it.
        #[arg(long)]
        failed: bool,
        /// Who resolved it and what the provider said (kept as its last error).
        #[arg(long)]
        note: Option<String>,
    },
    /// Queue dead intents again with a fresh budget, keeping their ids and
    /// idempotency keys (the provider sees the same operation).
    Replay {
        /// Intent ids.
        ids: Vec<uuid::Uuid>,
        /// Every dead intent (optionally of one --endpoint).
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// With --all: only this endpoint.
        #[arg(long, requires = "all")]
        endpoint: Option<String>,
        /// Replay even intents whose new attempts could run after the
        /// provider has forgotten their key (it would take them as new
        /// requests): only once the provider says the call was not applied.
        #[arg(long)]
        past_key_window: bool,
    },
    /// Let dead intents that hold their ordering key (route on_poison =
    /// "hold_key") release it: they stay dead, and the later intents of
    /// their keys, which waited, go on.
    Skip {
        /// Intent ids.
        #[arg(required = true)]
        ids: Vec<uuid::Uuid>,
    },
}

/// Outbox commands.
#[derive(Debug, Subcommand)]
pub enum OutboxCommand {
    /// List outbox rows, newest first.
    List {
        /// Only this state: pending, running, published, dead or skipped.
        #[arg(long)]
        state: Option<OutboxState>,
        /// Only this topic.
        #[arg(long)]
        topic: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Print JSON lines.
        #[arg(long)]
        json: bool,
    },
    /// Show one outbox row.
    Show {
        /// Outbox row id.
        id: uuid::Uuid,
    },
    /// Queue dead rows again (same ids): each is published before the rows
    /// of its key written after it, which waited for it.
    Replay {
        /// Outbox row ids.
        #[arg(required = true)]
        ids: Vec<uuid::Uuid>,
    },
    /// Never publish these dead rows: the rows of their keys written after
    /// them go on without them.
    Skip {
        /// Outbox row ids.
        #[arg(required = true)]
        ids: Vec<uuid::Uuid>,
        /// Confirm: skipped rows are never published.
        #[arg(long)]
        yes: bool,
    },
}

/// Dead-letter commands.
#[derive(Debug, Subcommand)]
pub enum DeadLetterCommand {
    /// List dead letters (unresolved ones unless --all).
    List {
        /// Only this error class (e.g. bad_json, missing_id, schema_invalid).
        #[arg(long)]
        class: Option<relay_core::PoisonClass>,
        /// Only this source topic.
        #[arg(long)]
        topic: Option<String>,
        /// Include dead letters already replayed successfully.
        #[arg(long)]
        all: bool,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Print JSON lines.
        #[arg(long)]
        json: bool,
    },
    /// Show one dead letter with its headers and value.
    Show {
        /// Dead letter id.
        id: i64,
    },
    /// Replay dead letters through the same guards, keeping their event ids.
    Replay {
        /// Dead letter ids.
        ids: Vec<i64>,
        /// Replay every unresolved dead letter (optionally of one --class).
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// With --all: only this error class.
        #[arg(long, requires = "all")]
        class: Option<relay_core::PoisonClass>,
    },
    /// Skip a dead letter that holds its Kafka key (route on_poison =
    /// "hold_key"): it stays a dead letter, marked skipped and never
    /// applied, and the records held behind it are applied in order.
    Skip {
        /// Dead letter id (the head of a held key: see `relay dead-letters holds`).
        id: i64,
    },
    /// List the Kafka record keys held behind a dead letter (route
    /// on_poison = "hold_key"), with the dead letter to replay or skip.
    Holds {
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Print JSON lines.
        #[arg(long)]
        json: bool,
    },
    /// Delete dead letters (never those of a held key).
    Purge {
        /// Dead letter ids.
        ids: Vec<i64>,
        /// Delete every dead letter matching the filters.
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// With --all: only this error class.
        #[arg(long, requires = "all")]
        class: Option<relay_core::PoisonClass>,
        /// With --all: only those already resolved by a replay.
        #[arg(long, requires = "all")]
        resolved: bool,
        /// Do it (without this, only say what would be deleted).
        #[arg(long)]
        yes: bool,
    },
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    telemetry::init(cli.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn load(cli: &Cli) -> anyhow::Result<RelayConfig> {
    let path = cli.config.clone().or_else(|| {
        let default = PathBuf::from("relay.toml");
        default.exists().then_some(default)
    });
    Ok(relay::config::load(path.as_deref())?)
}

/// Run one parsed command.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Command::Demo = cli.command {
        return crate::demo::run().await;
    }
    let cfg = load(&cli)?;
    match cli.command {
        Command::Demo => unreachable!("run above"),
        Command::Migrate => migrate(&cfg).await,
        Command::CheckConfig { explain: Some(route), event, response, key, headers } => {
            let given = crate::explain::Given {
                event: event.as_deref(),
                key: key.as_deref(),
                headers: &headers,
                response: response.as_deref(),
            };
            check::explain(&cfg, &route, &given)
        }
        Command::CheckConfig { explain: None, .. } => check::check_config(&cfg),
        Command::Consume => serve(cfg, Components { consumer: true, dispatcher: false, publisher: false }).await,
        Command::Dispatch { intents_only, outbox_only } => {
            serve(cfg, Components { consumer: false, dispatcher: !outbox_only, publisher: !intents_only }).await
        }
        // Without input topics (an [application] front door alone) `run`
        // serves what there is: the intents and the outbox.
        Command::Run if cfg.subscribed_topics().is_empty() => {
            tracing::info!("no input topics configured: running the dispatcher and the publisher only");
            serve(cfg, Components { consumer: false, ..Components::ALL }).await
        }
        Command::Run => serve(cfg, Components::ALL).await,
        Command::DeadLetters(cmd) => dead_letters::command(cfg, cmd).await,
        Command::Intents(cmd) => intents::command(cfg, cmd).await,
        Command::Outbox(cmd) => outbox::command(cfg, cmd).await,
        Command::Pause { kind, name, reason } => operate::pause(&cfg, kind.into(), &name, reason.as_deref()).await,
        Command::Resume { kind, name } => operate::resume(&cfg, kind.into(), &name).await,
        Command::Pauses => operate::pauses(&cfg).await,
        Command::Cleanup => operate::cleanup(&cfg).await,
        Command::Verify { provider_effects, grace, json } => {
            operate::verify(&cfg, provider_effects.as_deref(), grace, json).await
        }
        Command::Stats { json } => operate::stats(&cfg, json).await,
    }
}

/// `relay migrate`: apply migrations, then open (or say why not) the
/// applications' front door.
async fn migrate(cfg: &RelayConfig) -> anyhow::Result<()> {
    let pool = connect(cfg).await?;
    relay_store::migrate(&pool).await?;
    println!("migrations applied; the schema is current");
    let role = cfg.application.as_ref().map(|a| a.role.as_str()).unwrap_or_default();
    let registered = relay::app::register_front_door(cfg, &pool).await?;
    if registered == relay_store::application::Registered::Open {
        println!("applications may enqueue (relay.publish, relay.call) as members of role {role:?}");
    } else if let Some(why) = registered.closed_because(role) {
        println!("{why}");
    }
    Ok(())
}

/// `relay consume`, `dispatch` and `run`: run `which` until a signal.
async fn serve(cfg: RelayConfig, which: Components) -> anyhow::Result<()> {
    let faults = Faults::from_env().map_err(anyhow::Error::msg)?;
    let shutdown = CancellationToken::new();
    let relay = Relay::new(cfg, Handlers::default(), faults).await?;
    tokio::spawn(on_signal(shutdown.clone()));
    relay.run(which, shutdown).await
}

/// Cancel `token` on SIGTERM or Ctrl-C; a second signal exits at once.
pub async fn on_signal(token: CancellationToken) {
    wait_for_signal().await;
    info!("shutdown requested: finishing work in flight and committing (signal again to exit now)");
    token.cancel();
    wait_for_signal().await;
    warn!("second signal: exiting without waiting");
    std::process::exit(130);
}

async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! { _ = ctrl_c => {}, _ = term.recv() => {} }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// The operator actions over the configured database.
async fn operator(cfg: &RelayConfig) -> anyhow::Result<Operator> {
    Ok(Operator::new(connect(cfg).await?, cfg))
}
