//! `relay outbox`: list, show, replay, skip.

use relay::ops::admin::Operator;
use relay_core::RelayConfig;
use relay_store::outbox::OutboxState;

use super::{OutboxCommand, operator};
use crate::printable as safe;

/// Run `relay outbox …`.
pub(super) async fn command(cfg: RelayConfig, cmd: OutboxCommand) -> anyhow::Result<()> {
    let ops = operator(&cfg).await?;
    match cmd {
        OutboxCommand::List { state, topic, limit, json } => list(&ops, state, topic, limit, json).await,
        OutboxCommand::Show { id } => show(&ops, id).await,
        OutboxCommand::Replay { ids } => replay(&ops, ids).await,
        OutboxCommand::Skip { ids, yes } => skip(&ops, ids, yes).await,
    }
}

/// `relay outbox list`.
async fn list(
    ops: &Operator,
    state: Option<OutboxState>,
    topic: Option<String>,
    limit: i64,
    json: bool,
) -> anyhow::Result<()> {
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
    Ok(())
}

/// `relay outbox show`: one row.
async fn show(ops: &Operator, id: uuid::Uuid) -> anyhow::Result<()> {
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
    Ok(())
}

/// `relay outbox replay`: queue dead rows again.
async fn replay(ops: &Operator, ids: Vec<uuid::Uuid>) -> anyhow::Result<()> {
    each_row(&ids, "queued again", "queued again (same id)", async |id| ops.outbox_replay(id).await).await?;
    Ok(())
}

/// `relay outbox skip`: give dead rows up for good, releasing their keys.
async fn skip(ops: &Operator, ids: Vec<uuid::Uuid>, yes: bool) -> anyhow::Result<()> {
    if !yes {
        println!("would skip {} dead outbox row(s) for good; add --yes to skip them", ids.len());
        return Ok(());
    }
    each_row(&ids, "skipped", "skipped; the later rows of its key go on", async |id| ops.outbox_skip(id).await).await?;
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
