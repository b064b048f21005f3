//! `relay dead-letters`: list, show, replay, skip, holds, purge.

use relay::app::Relay;
use relay::ingest::handler::Handlers;
use relay::ops::admin::{DeadLetters, Operator, ReplayOutcome};
use relay::runtime::faults::Faults;
use relay_core::{PoisonClass, RelayConfig};
use relay_store::dead_letters::Resolution;

use super::{DeadLetterCommand, operator};
use crate::printable as safe;

/// Run `relay dead-letters …`.
pub(super) async fn command(cfg: RelayConfig, cmd: DeadLetterCommand) -> anyhow::Result<()> {
    let ops = operator(&cfg).await?;
    match cmd {
        DeadLetterCommand::List { class, topic, all, limit, json } => list(&ops, class, topic, all, limit, json).await,
        DeadLetterCommand::Show { id } => show(&ops, id).await,
        DeadLetterCommand::Replay { ids, all, class } => replay(&ops, cfg, ids, all, class).await,
        DeadLetterCommand::Skip { id } => skip(&ops, cfg, id).await,
        DeadLetterCommand::Holds { limit, json } => holds(&ops, limit, json).await,
        DeadLetterCommand::Purge { ids, all, class, resolved, yes } => {
            purge(&ops, ids, all, class, resolved, yes).await
        }
    }
}

/// `relay dead-letters list`: newest first, a line each (or JSON lines).
async fn list(
    ops: &Operator,
    class: Option<PoisonClass>,
    topic: Option<String>,
    all: bool,
    limit: i64,
    json: bool,
) -> anyhow::Result<()> {
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
            let replay =
                r.replay_outcome.as_deref().map(|o| format!(" ({}: {})", r.replay_state, safe(o))).unwrap_or_default();
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

/// `relay dead-letters show`: one dead letter with its record.
async fn show(ops: &Operator, id: i64) -> anyhow::Result<()> {
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
        println!("  state      {}", m.replay_state);
    }
    println!(
        "  key        {}",
        dl.record.key.as_deref().map(|k| safe(&String::from_utf8_lossy(k))).unwrap_or_else(|| "-".into())
    );
    println!("  headers");
    for h in &dl.record.headers {
        let v = h.value.as_deref().map(|v| safe(&String::from_utf8_lossy(v))).unwrap_or_else(|| "(null)".into());
        println!("    {}: {v}", safe(&h.name));
    }
    let value = dl.record.payload.as_deref().map(|v| safe(&String::from_utf8_lossy(&v[..v.len().min(4096)])));
    println!("  value ({} bytes)", dl.record.payload.as_ref().map_or(0, Vec::len));
    println!("    {}", value.unwrap_or_else(|| "(null)".into()));
    Ok(())
}

/// `relay dead-letters replay`: run records again through the routes, with progress.
async fn replay(
    ops: &Operator,
    cfg: RelayConfig,
    ids: Vec<i64>,
    all: bool,
    class: Option<PoisonClass>,
) -> anyhow::Result<()> {
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

/// `relay dead-letters skip`: resolve a dead letter without replaying it, releasing its key.
async fn skip(ops: &Operator, cfg: RelayConfig, id: i64) -> anyhow::Result<()> {
    let relay = Relay::new(cfg, Handlers::default(), Faults::none()).await?;
    let released = ops.skip_dead_letter(&relay.processor(), id).await?;
    println!("dead letter {id} skipped; {}", safe(&released.describe()));
    Ok(())
}

/// `relay dead-letters holds`: the keys held behind dead letters.
async fn holds(ops: &Operator, limit: i64, json: bool) -> anyhow::Result<()> {
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

/// `relay dead-letters purge`: count, then (with `--yes`) delete.
async fn purge(
    ops: &Operator,
    ids: Vec<i64>,
    all: bool,
    class: Option<PoisonClass>,
    resolved: bool,
    yes: bool,
) -> anyhow::Result<()> {
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
