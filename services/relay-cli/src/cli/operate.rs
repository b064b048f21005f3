//! The operator's commands over the database: pause and resume, clean up,
//! verify, stats.

use relay_core::RelayConfig;
use relay_store::intents::IntentState;
use relay_store::ops::{PauseKind, Paused, Resumed};
use relay_store::outbox::OutboxState;
use relay_store::stats::Stats;

use super::operator;
use relay::app::connect;

/// `relay pause`.
pub(super) async fn pause(cfg: &RelayConfig, kind: PauseKind, name: &str, reason: Option<&str>) -> anyhow::Result<()> {
    let done = operator(cfg).await?.pause(kind, name, reason).await?;
    let what = if done == Paused::Paused { "paused" } else { "was already paused" };
    println!("{} {name} {what}", kind.as_str());
    Ok(())
}

/// `relay resume`.
pub(super) async fn resume(cfg: &RelayConfig, kind: PauseKind, name: &str) -> anyhow::Result<()> {
    let done = operator(cfg).await?.resume(kind, name).await?;
    let what = if done == Resumed::Resumed { "resumed" } else { "was not paused" };
    println!("{} {name} {what}", kind.as_str());
    Ok(())
}

/// `relay pauses`.
pub(super) async fn pauses(cfg: &RelayConfig) -> anyhow::Result<()> {
    let pauses = operator(cfg).await?.pauses().await?;
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

/// `relay cleanup`: delete what is past its retention now, with progress.
pub(super) async fn cleanup(cfg: &RelayConfig) -> anyhow::Result<()> {
    let pool = connect(cfg).await?;
    let checked = relay::ops::retention::check_topic_retention(cfg).await?;
    let result =
        relay::ops::retention::cleanup_once(&pool, &cfg.retention, &cfg.consumer.name, checked, |what, total| {
            eprintln!("  {}: {total} deleted so far", what.label());
        })
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

/// `relay verify`: an error (exit status 1) on any violation.
pub(super) async fn verify(
    cfg: &RelayConfig,
    provider_effects: Option<&str>,
    grace: std::time::Duration,
    json: bool,
) -> anyhow::Result<()> {
    let pool = connect(cfg).await?;
    let effects = match provider_effects {
        Some(src) => Some(crate::verify::load_effects(src).await?),
        None => None,
    };
    let report = crate::verify::verify(cfg, &pool, &crate::verify::VerifyOptions { effects, grace }).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render());
    }
    if report.ok() { Ok(()) } else { anyhow::bail!("{} invariant violation(s)", report.violations.len()) }
}

/// `relay stats`.
pub(super) async fn stats(cfg: &RelayConfig, json: bool) -> anyhow::Result<()> {
    let s = operator(cfg).await?.stats().await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        print_stats(&s);
    }
    Ok(())
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
