//! `relay intents`: list, show, resolve, skip, replay.

use relay::ops::admin::{IntentResolution, Intents, KeyWindow, Operator};
use relay_core::RelayConfig;
use relay_core::retry::AttemptOutcome;
use relay_store::intents::IntentState;

use super::{IntentCommand, operator};
use crate::printable as safe;

/// Run `relay intents …`.
pub(super) async fn command(cfg: RelayConfig, cmd: IntentCommand) -> anyhow::Result<()> {
    let ops = operator(&cfg).await?;
    match cmd {
        IntentCommand::List { state, endpoint, limit, json } => list(&ops, state, endpoint, limit, json).await,
        IntentCommand::Show { id } => show(&ops, id).await,
        IntentCommand::Resolve { id, succeeded, failed: _, note } => resolve(&ops, &cfg, id, succeeded, note).await,
        IntentCommand::Skip { ids } => skip(&ops, ids).await,
        IntentCommand::Replay { ids, all, endpoint, past_key_window } => {
            replay(&ops, ids, all, endpoint, past_key_window).await
        }
    }
}

/// `relay intents list`.
async fn list(
    ops: &Operator,
    state: Option<IntentState>,
    endpoint: Option<String>,
    limit: i64,
    json: bool,
) -> anyhow::Result<()> {
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
    Ok(())
}

/// `relay intents show`: an intent with its attempts and reconciliations.
async fn show(ops: &Operator, id: uuid::Uuid) -> anyhow::Result<()> {
    let relay::ops::admin::IntentHistory { intent: i, attempts, reconciliations, response } = ops.intent(id).await?;
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
    Ok(())
}

/// `relay intents resolve`: settle an uncertain or dead intent by hand, recording its effects.
async fn resolve(
    ops: &Operator,
    cfg: &RelayConfig,
    id: uuid::Uuid,
    succeeded: bool,
    note: Option<String>,
) -> anyhow::Result<()> {
    let resolution = if succeeded { IntentResolution::Succeeded } else { IntentResolution::Failed };
    // Outcome events with a `format` are encoded as the dispatcher's are.
    let ops = ops.clone().with_encoders(relay::app::own_emit_encoders(cfg).await?);
    let dropped = ops.resolve(id, resolution, note.as_deref()).await?;
    let effects = if succeeded { "on_success" } else { "on_dead" };
    match dropped {
        None => println!("{id}: resolved as {resolution:?}; its {effects} effects are recorded"),
        Some(why) => println!(
            "{id}: resolved as {resolution:?}; its {effects} effects are NOT recorded ({why}): emit its events \
             or move its sagas by hand"
        ),
    }
    Ok(())
}

/// `relay intents skip`: give dead intents up, releasing their keys.
async fn skip(ops: &Operator, ids: Vec<uuid::Uuid>) -> anyhow::Result<()> {
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
    Ok(())
}

/// `relay intents replay`: queue dead or uncertain intents again, same ids and keys.
async fn replay(
    ops: &Operator,
    ids: Vec<uuid::Uuid>,
    all: bool,
    endpoint: Option<String>,
    past_key_window: bool,
) -> anyhow::Result<()> {
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
    Ok(())
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
