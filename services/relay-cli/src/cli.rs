//! The `relay` command line: run the components, migrate, operate dead
//! letters, show counts. Errors name their cause and the fix; the exit code
//! is 1 on error, 2 on bad usage.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use relay_core::RelayConfig;
use relay_core::retry::AttemptOutcome;
use relay_store::dead_letters::Resolution;
use relay_store::intents::IntentState;
use relay_store::ops::{PauseKind, Paused, Resumed};
use relay_store::outbox::OutboxState;
use relay_store::stats::Stats;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::printable as safe;
use crate::telemetry::{self, LogFormat};
use relay::app::{Components, Relay, connect};
use relay::ingest::handler::Handlers;
use relay::ops::admin::{DeadLetters, IntentResolution, Intents, KeyWindow, Operator, ReplayOutcome};
use relay::runtime::faults::Faults;

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
        class: Option<String>,
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
        class: Option<String>,
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
        class: Option<String>,
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

/// One line of an intent's history in `relay intents show`: an attempt or
/// a reconciliation.
fn history_line(
    n: i32,
    what: &str,
    status: Option<i32>,
    at: impl std::fmt::Display,
    worker: &str,
    error: Option<&str>,
) -> String {
    let status = status.map_or("-".into(), |s| s.to_string());
    let error = error.map(|e| format!(": {}", safe(e))).unwrap_or_default();
    format!("    #{n:<3} {what:<13} {status:>4} {at} by {worker}{error}")
}

/// What `check-config` says of an endpoint's key: where it goes, and its
/// provider's window beside relay's retry horizon.
fn key_window_line(name: &str, e: &relay_core::config::EndpointConfig) -> String {
    use relay_core::profile::KeyPlacement;
    let p = e.profile();
    let d = |d: std::time::Duration| humantime::format_duration(d).to_string();
    let key = match &p.key {
        KeyPlacement::Header(h) => format!("key in header {h}"),
        KeyPlacement::BodyField(f) => format!("key in body field {f}"),
        KeyPlacement::Omitted => {
            return format!("profile {}: no idempotency key; an unknown outcome is never re-sent", p.name.as_str());
        }
    };
    let horizon = format!(
        "retry horizon {} (max_age {} + replay_window {})",
        d(e.retry_horizon()),
        d(e.max_age),
        d(e.replay_window)
    );
    match p.window {
        Some(w) if e.key_window_shortfall(name).is_some() => {
            format!("profile {}, {key}; key window {} is SHORTER than the {horizon}", p.name.as_str(), d(w))
        }
        Some(w) => format!("profile {}, {key}; key window {} covers the {horizon}", p.name.as_str(), d(w)),
        None => format!(
            "profile {}, {key}; key window unknown, so the {horizon} is not checked (set idempotency.window)",
            p.name.as_str()
        ),
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
    match &cli.command {
        Command::Demo => return crate::demo::run().await,
        Command::Migrate => {
            let cfg = load(&cli)?;
            let pool = connect(&cfg).await?;
            relay_store::migrate(&pool).await?;
            println!("migrations applied; the schema is current");
            let role = cfg.application.as_ref().map(|a| a.role.as_str()).unwrap_or_default();
            let registered = relay::app::register_front_door(&cfg, &pool).await?;
            if registered == relay_store::application::Registered::Open {
                println!("applications may enqueue (relay.publish, relay.call) as members of role {role:?}");
            } else if let Some(why) = registered.closed_because(role) {
                println!("{why}");
            }
            return Ok(());
        }
        Command::CheckConfig { explain: Some(route), event, response, key, headers } => {
            let cfg = load(&cli)?;
            let given = crate::explain::Given {
                event: event.as_deref(),
                key: key.as_deref(),
                headers,
                response: response.as_deref(),
            };
            let (report, applied) = crate::explain::run(&cfg, route, &given)?;
            print!("{report}");
            // A script running the dry run sees a dead letter in the exit status.
            anyhow::ensure!(applied, "route {route}: nothing would be written for this event (see above)");
            return Ok(());
        }
        Command::CheckConfig { explain: None, .. } => {
            let cfg = load(&cli)?;
            relay_core::Router::new(&cfg)?;
            println!("configuration is valid");
            println!(
                "  consumer {:?} (group {:?}), topics: {}",
                cfg.consumer.name,
                cfg.consumer.group(),
                cfg.subscribed_topics().join(", ")
            );
            for r in &cfg.routes {
                println!("  route {} -> {} action(s)", r.display_name(), r.actions.len());
            }
            let mut problems = Vec::new();
            for (name, e) in &cfg.endpoints {
                println!(
                    "  endpoint {name}: {} (timeout {:?}, {} attempts, max age {:?})",
                    e.base_url, e.timeout, e.max_attempts, e.max_age
                );
                println!("    {}", key_window_line(name, e));
                if let Some(r) = &e.reconcile {
                    let how = match &r.path {
                        Some(p) => format!("by a lookup {} {}", r.method, safe(p)),
                        None => "by sending the call again with its key".into(),
                    };
                    let d = |d: std::time::Duration| humantime::format_duration(d).to_string();
                    println!(
                        "    uncertain intents reconciled {how}, {} after, every {}, at most {} times",
                        d(r.after),
                        d(r.interval),
                        r.max_attempts
                    );
                }
                for (key, path) in e.tls.files() {
                    println!("    tls.{key} {}", path.display());
                }
                // Build its client as a dispatcher would: TLS files parsed,
                // the token's variable read.
                if let Err(err) = relay::deliver::http::EndpointClient::new(name, e, Default::default()) {
                    problems.push(format!("{err:#}"));
                }
            }
            if let Some(r) = &cfg.schema_registry {
                println!("schema registry {}", r.url);
                for (key, path) in r.tls.files() {
                    println!("    tls.{key} {}", path.display());
                }
                // Its client as a consumer builds it: TLS files parsed, secrets read.
                if let Err(err) = relay_registry::Registry::new(r) {
                    problems.push(format!("{err:#}"));
                }
            }
            for warning in cfg.warnings() {
                println!("warning: {warning}");
            }
            anyhow::ensure!(
                problems.is_empty(),
                "a dispatcher could not call every endpoint, or a consumer could not reach the schema registry:\n  {}",
                problems.join("\n  ")
            );
            return Ok(());
        }
        _ => {}
    }
    let cfg = load(&cli)?;
    let faults = Faults::from_env().map_err(anyhow::Error::msg)?;
    let shutdown = CancellationToken::new();
    match cli.command {
        Command::Consume | Command::Dispatch { .. } | Command::Run => {
            let which = match cli.command {
                Command::Consume => Components { consumer: true, dispatcher: false, publisher: false },
                Command::Dispatch { intents_only, outbox_only } => {
                    Components { consumer: false, dispatcher: !outbox_only, publisher: !intents_only }
                }
                // Without input topics (an [application] front door alone)
                // `run` serves what there is: the intents and the outbox.
                _ if cfg.subscribed_topics().is_empty() => {
                    tracing::info!("no input topics configured: running the dispatcher and the publisher only");
                    Components { consumer: false, ..Components::ALL }
                }
                _ => Components::ALL,
            };
            let relay = Relay::new(cfg, Handlers::default(), faults).await?;
            tokio::spawn(on_signal(shutdown.clone()));
            relay.run(which, shutdown).await
        }
        Command::DeadLetters(cmd) => dead_letter_command(cfg, cmd).await,
        Command::Intents(cmd) => intent_command(cfg, cmd).await,
        Command::Outbox(cmd) => outbox_command(cfg, cmd).await,
        Command::Pause { kind, name, reason } => {
            let kind = PauseKind::from(kind);
            let done = operator(&cfg).await?.pause(kind, &name, reason.as_deref()).await?;
            let what = if done == Paused::Paused { "paused" } else { "was already paused" };
            println!("{} {name} {what}", kind.as_str());
            Ok(())
        }
        Command::Resume { kind, name } => {
            let kind = PauseKind::from(kind);
            let done = operator(&cfg).await?.resume(kind, &name).await?;
            let what = if done == Resumed::Resumed { "resumed" } else { "was not paused" };
            println!("{} {name} {what}", kind.as_str());
            Ok(())
        }
        Command::Pauses => {
            let pauses = operator(&cfg).await?.pauses().await?;
            if pauses.is_empty() {
                println!("nothing is paused");
            }
            for p in pauses {
                println!(
                    "{} {} since {}{}",
                    p.kind,
                    p.name,
                    p.paused_at,
                    p.reason.map(|r| format!(": {r}")).unwrap_or_default()
                );
            }
            Ok(())
        }
        Command::Cleanup => {
            let pool = connect(&cfg).await?;
            let checked = relay::ops::retention::check_topic_retention(&cfg).await?;
            let result = relay::ops::retention::cleanup_once(
                &pool,
                &cfg.retention,
                &cfg.consumer.name,
                checked,
                |what, total| {
                    eprintln!("  {}: {total} deleted so far", what.label());
                },
            )
            .await?;
            match result {
                None => anyhow::bail!("another relay process is cleaning up right now; try again in a moment"),
                Some(deleted) if deleted.is_empty() => {
                    println!("no retention is configured ([retention] in the configuration)")
                }
                Some(deleted) => {
                    for (what, n) in deleted {
                        println!("{:<24} {n} deleted", what.label());
                    }
                }
            }
            Ok(())
        }
        Command::Verify { provider_effects, grace, json } => {
            let pool = connect(&cfg).await?;
            let effects = match &provider_effects {
                Some(src) => Some(crate::verify::load_effects(src).await?),
                None => None,
            };
            let report = crate::verify::verify(&cfg, &pool, &crate::verify::VerifyOptions { effects, grace }).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.render());
            }
            if report.ok() { Ok(()) } else { anyhow::bail!("{} invariant violation(s)", report.violations.len()) }
        }
        Command::Stats { json } => {
            let s = operator(&cfg).await?.stats().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                print_stats(&s);
            }
            Ok(())
        }
        Command::Migrate | Command::CheckConfig { .. } | Command::Demo => unreachable!("handled above"),
    }
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

fn print_stats(s: &Stats) {
    println!("inbox (by outcome):");
    if s.inbox.is_empty() {
        println!("  (empty)");
    }
    for (outcome, n) in &s.inbox {
        println!("  {outcome:<22} {n}");
    }
    println!("intents (by state):");
    for state in IntentState::ALL {
        println!("  {state:<22} {}", Stats::count(&s.intents, state));
    }
    match s.oldest_pending_intent_secs {
        Some(age) => println!("  oldest unfinished        {age:.1}s"),
        None => println!("  oldest unfinished        -"),
    }
    println!("outbox (by state):");
    for state in OutboxState::ALL {
        println!("  {state:<22} {}", Stats::count(&s.outbox, state));
    }
    if let Some(age) = s.oldest_unpublished_outbox_secs {
        println!("  oldest unpublished       {age:.1}s");
    }
    println!("dead letters: {} unresolved, {} in total", s.dead_letters_unresolved, s.dead_letters_total);
    if !s.counters.is_empty() {
        println!("business counters:");
        for (consumer, name, v) in &s.counters {
            println!("  {consumer}/{name:<18} {v}");
        }
    }
}

/// The operator actions over the configured database.
async fn operator(cfg: &RelayConfig) -> anyhow::Result<Operator> {
    Ok(Operator::new(connect(cfg).await?, cfg))
}

async fn dead_letter_command(cfg: RelayConfig, cmd: DeadLetterCommand) -> anyhow::Result<()> {
    let ops = operator(&cfg).await?;
    match cmd {
        DeadLetterCommand::List { class, topic, all, limit, json } => {
            let resolution = if all { Resolution::Any } else { Resolution::Unresolved };
            let rows = ops.dead_letters(&ops.filter(class, topic, resolution), 0, limit).await?;
            if json {
                for r in &rows {
                    println!("{}", serde_json::to_string(r)?);
                }
            } else if rows.is_empty() {
                println!("no dead letters");
            } else {
                println!("{:>6}  {:<20} {:<28} {:<16} {:<20} reason", "id", "parked", "source", "class", "event id");
                for r in &rows {
                    let source = format!("{}[{}]@{}", r.topic, r.partition, r.offset);
                    let replay = r.replay_outcome.as_deref().map(|o| format!(" (replayed: {o})")).unwrap_or_default();
                    println!(
                        "{:>6}  {:<20} {:<28} {:<16} {:<20} {}{replay}",
                        r.id,
                        r.created_at.format("%Y-%m-%d %H:%M:%S"),
                        source,
                        r.error_class,
                        safe(r.event_id.as_deref().unwrap_or("-")),
                        safe(&r.reason)
                    );
                }
            }
            Ok(())
        }
        DeadLetterCommand::Show { id } => {
            let dl = ops.dead_letter(id).await?;
            let m = &dl.meta;
            println!("dead letter {id}");
            println!("  source     {}[{}] offset {}", m.topic, m.partition, m.offset);
            println!(
                "  event      id {} type {}",
                safe(m.event_id.as_deref().unwrap_or("-")),
                safe(m.event_type.as_deref().unwrap_or("-"))
            );
            println!("  class      {}", m.error_class);
            println!("  reason     {}", safe(&m.reason));
            println!("  attempts   {}", m.attempts);
            println!("  parked at  {}", m.created_at);
            if let Some(at) = m.replayed_at {
                println!("  replayed   {at}: {}", safe(m.replay_outcome.as_deref().unwrap_or("")));
            }
            println!(
                "  key        {}",
                dl.record.key.as_deref().map(|k| safe(&String::from_utf8_lossy(k))).unwrap_or_else(|| "-".into())
            );
            println!("  headers");
            for h in &dl.record.headers {
                let v =
                    h.value.as_deref().map(|v| safe(&String::from_utf8_lossy(v))).unwrap_or_else(|| "(null)".into());
                println!("    {}: {v}", safe(&h.name));
            }
            let value = dl.record.payload.as_deref().map(|v| safe(&String::from_utf8_lossy(&v[..v.len().min(4096)])));
            println!("  value ({} bytes)", dl.record.payload.as_ref().map_or(0, Vec::len));
            println!("    {}", value.unwrap_or_else(|| "(null)".into()));
            Ok(())
        }
        DeadLetterCommand::Replay { ids, all, class } => {
            if ids.is_empty() && !all {
                anyhow::bail!("nothing to replay: give dead letter ids, or --all");
            }
            let which = if all {
                DeadLetters::Matching(ops.filter(class, None, Resolution::Unresolved))
            } else {
                DeadLetters::Ids(ids)
            };
            let relay = Relay::new(cfg, Handlers::default(), Faults::none()).await?;
            let done = ops
                .replay_all(&relay.processor(), which, |n, of, id, replayed| {
                    match &replayed.outcome {
                        ReplayOutcome::StillFailing(why) => println!("[{n}/{of}] {id}: still failing: {}", safe(why)),
                        ReplayOutcome::Held(why) => println!("[{n}/{of}] {id}: not replayed: {}", safe(why)),
                        skipped @ ReplayOutcome::Skipped => println!("[{n}/{of}] {id}: {}", skipped.label().1),
                        ReplayOutcome::NotFound => println!("[{n}/{of}] {id}: no such dead letter"),
                        other => println!("[{n}/{of}] {id}: {other:?}"),
                    }
                    if let Some(r) = &replayed.released {
                        println!("[{n}/{of}] {id}: {}", safe(&r.describe()));
                    }
                })
                .await?;
            let resolved = done.iter().filter(|(_, r)| r.outcome.resolved()).count();
            println!("replayed {}: {resolved} resolved, {} still failing", done.len(), done.len() - resolved);
            Ok(())
        }
        DeadLetterCommand::Skip { id } => {
            let relay = Relay::new(cfg, Handlers::default(), Faults::none()).await?;
            let released = ops.skip_dead_letter(&relay.processor(), id).await?;
            println!("dead letter {id} skipped; {}", safe(&released.describe()));
            Ok(())
        }
        DeadLetterCommand::Holds { limit, json } => {
            let rows = ops.held_keys(limit).await?;
            if json {
                for r in &rows {
                    println!("{}", serde_json::to_string(r)?);
                }
            } else if rows.is_empty() {
                println!("no held keys");
            } else {
                println!("{:<28} {:<24} {:>6} {:>7}  {:<19}  state", "source", "key", "head", "held", "since");
                for r in &rows {
                    println!(
                        "{:<28} {:<24} {:>6} {:>7}  {}  {}",
                        format!("{}[{}]@{}", r.topic, r.partition, r.head_offset),
                        safe(&relay_store::holds::preview(&r.key)),
                        r.head,
                        r.held,
                        r.since.format("%Y-%m-%d %H:%M:%S"),
                        if r.head_resolved {
                            "head resolved, release unfinished (running, or cut short: replay or skip the head again)"
                        } else {
                            "holding"
                        }
                    );
                }
                println!(
                    "replay (`relay dead-letters replay HEAD`) or skip (`relay dead-letters skip HEAD`) a head to release its key"
                );
            }
            Ok(())
        }
        DeadLetterCommand::Purge { ids, all, class, resolved, yes } => {
            let which = if all {
                let resolution = if resolved { Resolution::Resolved } else { Resolution::Any };
                DeadLetters::Matching(ops.filter(class, None, resolution))
            } else if ids.is_empty() {
                anyhow::bail!("nothing to purge: give dead letter ids, or --all");
            } else {
                DeadLetters::Ids(ids)
            };
            let n = match &which {
                DeadLetters::Matching(f) => ops.count_dead_letters(f).await?,
                DeadLetters::Ids(ids) => ids.len() as i64,
            };
            if !yes {
                println!("would delete {n} dead letter(s); add --yes to delete them");
                return Ok(());
            }
            let deleted = ops.purge(which, |deleted| eprintln!("  deleted {deleted} of {n}")).await?;
            println!("deleted {deleted} dead letter(s)");
            Ok(())
        }
    }
}

async fn outbox_command(cfg: RelayConfig, cmd: OutboxCommand) -> anyhow::Result<()> {
    let ops = operator(&cfg).await?;
    match cmd {
        OutboxCommand::List { state, topic, limit, json } => {
            let rows = ops.outbox_rows(state, topic.as_deref(), None, limit).await?;
            if json {
                for r in &rows {
                    println!("{}", serde_json::to_string(r)?);
                }
            } else if rows.is_empty() {
                println!("no outbox rows");
            } else {
                println!("{:<36}  {:<9} {:<24} {:>8} {:>7}  last error", "id", "state", "topic", "attempts", "waiting");
                for r in &rows {
                    println!(
                        "{}  {:<9} {:<24} {:>8} {:>7}  {}",
                        r.id,
                        r.state,
                        safe(&r.topic),
                        r.attempts,
                        r.waiting_behind,
                        safe(r.last_error.as_deref().unwrap_or(""))
                    );
                }
            }
        }
        OutboxCommand::Show { id } => {
            let r = ops.outbox_row(id).await?;
            println!("outbox row {}", r.id);
            println!("  record     {} to topic {}", r.event_type.as_deref().map_or("-".into(), safe), safe(&r.topic));
            println!("  source     {} ({}), consumer {}", safe(&r.source_id), safe(&r.action), r.consumer);
            println!("  state      {} after {} attempts", r.state, r.attempts);
            if let Some(k) = &r.ordering_key {
                println!("  key        {} ({} later row(s) of it wait for this one)", safe(k), r.waiting_behind);
            }
            println!("  payload    {} bytes", r.payload_bytes.unwrap_or(0));
            if let Some(e) = &r.last_error {
                println!("  last error {}", safe(e));
            }
        }
        OutboxCommand::Replay { ids } => {
            each_row(&ids, "queued again", "queued again (same id)", async |id| ops.outbox_replay(id).await).await?;
        }
        OutboxCommand::Skip { ids, yes } => {
            if !yes {
                println!("would skip {} dead outbox row(s) for good; add --yes to skip them", ids.len());
                return Ok(());
            }
            each_row(&ids, "skipped", "skipped; the later rows of its key go on", async |id| ops.outbox_skip(id).await)
                .await?;
        }
    }
    Ok(())
}

/// Apply `action` to each outbox row of `ids`, printing what became of each
/// (`done` or the refusal); an error if any was refused, so that a script
/// acting on rows sees that some were not ("N of M were not {verb}").
async fn each_row<E: std::fmt::Display>(
    ids: &[uuid::Uuid],
    verb: &str,
    done: &str,
    action: impl AsyncFn(uuid::Uuid) -> Result<(), E>,
) -> anyhow::Result<()> {
    let mut refused = 0;
    for id in ids {
        match action(*id).await {
            Ok(()) => println!("{id}: {done}"),
            Err(e) => {
                refused += 1;
                println!("{id}: {e}");
            }
        }
    }
    anyhow::ensure!(refused == 0, "{refused} of {} outbox row(s) were not {verb} (see above)", ids.len());
    Ok(())
}

async fn intent_command(cfg: RelayConfig, cmd: IntentCommand) -> anyhow::Result<()> {
    let ops = operator(&cfg).await?;
    match cmd {
        IntentCommand::List { state, endpoint, limit, json } => {
            let rows = ops.intents(state, endpoint, None, limit).await?;
            if json {
                for r in &rows {
                    println!("{}", serde_json::to_string(r)?);
                }
            } else if rows.is_empty() {
                println!("no intents");
            } else {
                println!(
                    "{:<36}  {:<9} {:<12} {:>8} {:>6}  {:<30} last error",
                    "id", "state", "endpoint", "attempts", "status", "idempotency key"
                );
                for r in &rows {
                    println!(
                        "{}  {:<9} {:<12} {:>8} {:>6}  {:<30} {}",
                        r.id,
                        r.state,
                        r.endpoint,
                        format!("{}/{}", r.attempts, r.max_attempts),
                        r.last_status.map_or("-".into(), |s| s.to_string()),
                        safe(&r.idempotency_key),
                        safe(r.last_error.as_deref().unwrap_or(""))
                    );
                }
            }
        }
        IntentCommand::Show { id } => {
            let relay::ops::admin::IntentHistory { intent: i, attempts, reconciliations, response } =
                ops.intent(id).await?;
            println!("intent {}", i.id);
            println!("  call       {} {} on endpoint {}", i.method, safe(&i.path), i.endpoint);
            println!("  key        {}", safe(&i.idempotency_key));
            println!("  source     event {} (consumer {}), action {}", safe(&i.source_event_id), i.consumer, i.action);
            println!("  state      {} after {}/{} attempts", i.state, i.attempts, i.max_attempts);
            if i.ever_uncertain {
                println!("  uncertain  an attempt may have been applied: it ends succeeded or uncertain, never dead");
            }
            if let (Some(key), true) = (&i.ordering_key, i.holds_key && i.state == IntentState::Dead) {
                println!(
                    "  holds key  {}: its later intents wait until it is replayed or skipped (`relay intents skip`)",
                    safe(key)
                );
            }
            if let Some(e) = &i.last_error {
                println!("  last error {}", safe(e));
            }
            if let Some(r) = &response {
                println!("  answer     (what on_success read) {}", safe(&r.to_string()));
            }
            println!("  attempts");
            for a in attempts {
                let at = a.started_at.unwrap_or(a.claimed_at);
                println!(
                    "{}",
                    history_line(
                        a.attempt,
                        a.outcome.map_or("unfinished", AttemptOutcome::as_str),
                        a.status,
                        at,
                        &a.worker,
                        a.error.as_deref()
                    )
                );
            }
            if !reconciliations.is_empty() {
                println!("  reconciliations (the provider asked what became of an unknown outcome)");
            }
            for r in reconciliations {
                let at = r.started_at.unwrap_or(r.finished_at);
                println!("{}", history_line(r.n, r.verdict.as_str(), r.status, at, &r.worker, r.error.as_deref()));
            }
        }
        IntentCommand::Resolve { id, succeeded, failed: _, note } => {
            let resolution = if succeeded { IntentResolution::Succeeded } else { IntentResolution::Failed };
            // Outcome events with a `format` are encoded as the dispatcher's are.
            let ops = ops.clone().with_encoders(relay::app::own_emit_encoders(&cfg).await?);
            let dropped = ops.resolve(id, resolution, note.as_deref()).await?;
            let effects = if succeeded { "on_success" } else { "on_dead" };
            match dropped {
                None => println!("{id}: resolved as {resolution:?}; its {effects} effects are recorded"),
                Some(why) => println!(
                    "{id}: resolved as {resolution:?}; its {effects} effects are NOT recorded ({why}): emit its events \
                     or move its sagas by hand"
                ),
            }
        }
        IntentCommand::Skip { ids } => {
            let mut refused = 0;
            for id in &ids {
                match ops.intent_skip(*id).await {
                    Ok((key, waiting)) => {
                        println!("{id}: skipped; key {} released, {waiting} intent(s) of it go on", safe(&key))
                    }
                    Err(e) => {
                        refused += 1;
                        println!("{id}: not skipped: {e}");
                    }
                }
            }
            anyhow::ensure!(refused == 0, "{refused} of {} intent(s) were not skipped", ids.len());
        }
        IntentCommand::Replay { ids, all, endpoint, past_key_window } => {
            if ids.is_empty() && !all {
                anyhow::bail!("nothing to replay: give intent ids, or --all");
            }
            let which = if all { Intents::Dead { endpoint } } else { Intents::Ids(ids) };
            let window = KeyWindow::past_allowed(past_key_window);
            let done = ops.requeue_all(which, window, |n| eprintln!("  {n} done")).await?;
            for (id, why) in &done.not_replayed {
                println!("{id}: not replayed: {why}");
            }
            for id in &done.left {
                println!("{id}: neither dead nor uncertain, left as it is");
            }
            for id in &done.refused {
                println!("{}", relay::ops::admin::on_dead_recorded(*id));
            }
            for id in &done.behind_their_key {
                println!("{id}: queued behind the later intents of its ordering key (they ran while it was dead)");
            }
            println!("queued again: {} of {} (same ids, same idempotency keys)", done.queued, done.asked);
            let refused = done.refused.len() + done.not_replayed.len();
            anyhow::ensure!(refused == 0, "{refused} of {} intents were refused (see above)", done.asked);
        }
    }
    Ok(())
}
