//! Retention (R15): delete processed rows older than their configured
//! retention, in bounded batches, and refuse (or warn) at start when the
//! inbox would forget events the broker still keeps.
//!
//! Each batch is one short transaction that deletes at most
//! `retention.batch_size` of the oldest rows through an index, so cleanup never
//! holds locks that ingestion waits on for long; a row lock relay's own
//! (`ordering::Singleton::Retention`) keeps two relay processes from
//! cleaning the same table at once.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use relay_core::RelayConfig;
use relay_core::config::{RetentionConfig, Shortfall};
use relay_store::ops::{self, Cleanup};
use relay_store::ordering;
use sqlx::{Connection, PgPool};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::runtime::kafka::{Role, client_config};

/// What one cleanup pass deleted, per kind of row.
pub type Deleted = Vec<(Cleanup, u64)>;

/// Proof that [`check_topic_retention`] passed (or warned, as configured)
/// for this process: [`cleanup_once`] and [`run`] take it, so no process
/// deletes inbox rows without the R15 check — `relay consume`, `relay
/// dispatch` and `relay cleanup` alike.
#[derive(Debug, Clone, Copy)]
pub struct RetentionChecked(());

fn plan(cfg: &RetentionConfig) -> Vec<(Cleanup, Duration)> {
    [
        (Cleanup::Inbox, cfg.inbox),
        (Cleanup::IdempotencyKeys, cfg.inbox),
        (Cleanup::SucceededIntents, cfg.succeeded_intents),
        (Cleanup::DeadIntents, cfg.dead_intents),
        (Cleanup::PublishedOutbox, cfg.published_outbox),
        (Cleanup::DeadLetters, cfg.dead_letters),
    ]
    .into_iter()
    .filter_map(|(what, keep)| keep.map(|k| (what, k)))
    .collect()
}

/// One pass over every table with a retention. `progress` is called after
/// each batch with the running total for that kind of row. Returns `None` if
/// another process holds the cleaner's lock.
pub async fn cleanup_once(
    pool: &PgPool,
    cfg: &RetentionConfig,
    consumer: &str,
    _checked: RetentionChecked,
    mut progress: impl FnMut(Cleanup, u64),
) -> Result<Option<Deleted>, sqlx::Error> {
    let mut out = Vec::new();
    for (what, keep) in plan(cfg) {
        let mut total = 0;
        loop {
            let mut conn = pool.acquire().await?;
            let mut tx = conn.begin().await?;
            if !ordering::try_lock_singleton(&mut tx, ordering::Singleton::Retention).await? {
                return Ok(None);
            }
            let n = ops::delete_batch(&mut tx, what, consumer, keep, i64::from(cfg.batch_size)).await?;
            tx.commit().await?;
            total += n;
            if n > 0 {
                progress(what, total);
            }
            if n < u64::from(cfg.batch_size) {
                break;
            }
            tokio::task::yield_now().await;
        }
        out.push((what, total));
    }
    Ok(Some(out))
}

/// Clean up every `retention.interval` until `shutdown`.
pub async fn run(
    pool: PgPool,
    cfg: RetentionConfig,
    consumer: String,
    checked: RetentionChecked,
    shutdown: CancellationToken,
) {
    if plan(&cfg).is_empty() {
        return;
    }
    loop {
        match cleanup_once(&pool, &cfg, &consumer, checked, |_, _| {}).await {
            Ok(Some(deleted)) => {
                let total: u64 = deleted.iter().map(|d| d.1).sum();
                if total > 0 {
                    let detail: Vec<String> =
                        deleted.iter().filter(|d| d.1 > 0).map(|(w, n)| format!("{n} {}", w.label())).collect();
                    info!(consumer = %consumer, deleted = total, "retention cleanup: {}", detail.join(", "));
                }
            }
            Ok(None) => {}
            Err(e) => warn!(error = %e, "retention cleanup failed; it runs again at the next interval"),
        }
        tokio::select! { _ = shutdown.cancelled() => return, _ = tokio::time::sleep(cfg.interval) => {} }
    }
}

/// How long a broker may still hand a topic's records back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BrokerKeeps {
    /// Up to this long after they were written.
    For(Duration),
    /// Indefinitely, for this reason.
    Forever(String),
}

/// What a topic's configuration lets the broker keep. A record is deleted
/// with its segment, and a segment only once its newest record is older than
/// `retention.ms`; the active segment rolls after `segment.ms`, so a record
/// may live up to `retention.ms + segment.ms`. A compacted topic
/// (`cleanup.policy` with `compact`) keeps the latest record of every key
/// indefinitely, and `retention.ms = -1` keeps everything.
pub fn broker_keeps(retention_ms: Option<i64>, segment_ms: Option<i64>, cleanup_policy: Option<&str>) -> BrokerKeeps {
    if cleanup_policy.is_some_and(|p| p.split(',').any(|p| p.trim() == "compact")) {
        return BrokerKeeps::Forever(format!(
            "is compacted (cleanup.policy = {}): it keeps the latest record of every key indefinitely",
            cleanup_policy.unwrap_or_default()
        ));
    }
    // Kafka's defaults: 7 days each.
    let week = 7 * 86_400_000;
    let retention = retention_ms.unwrap_or(week);
    if retention < 0 {
        return BrokerKeeps::Forever("keeps records forever (retention.ms = -1)".into());
    }
    let segment = segment_ms.unwrap_or(week).max(0);
    BrokerKeeps::For(Duration::from_millis(retention.saturating_add(segment) as u64))
}

/// Compare `retention.inbox` with how long each input topic's records may
/// still be handed back ([`broker_keeps`]): an inbox that forgets events
/// sooner than the broker would let a replay apply them again (R15, R17).
/// Refuses (an error) or warns per configuration.
pub async fn check_topic_retention(cfg: &RelayConfig) -> anyhow::Result<RetentionChecked> {
    let Some(inbox) = cfg.retention.inbox else { return Ok(RetentionChecked(())) };
    let topics = cfg.subscribed_topics();
    let admin: AdminClient<DefaultClientContext> = client_config(&cfg.kafka, Role::Consumer)?.create()?;
    let specs: Vec<ResourceSpecifier<'_>> = topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let results = admin
        .describe_configs(&specs, &opts)
        .await
        .map_err(|e| anyhow::anyhow!("cannot read the input topics' retention from the broker: {e}"))?;
    let mut problems = Vec::new();
    for (topic, result) in topics.iter().zip(results) {
        let resource = match result {
            Ok(r) => r,
            Err(e) => {
                problems.push(format!("topic {topic}: cannot read its configuration ({e})"));
                continue;
            }
        };
        let number =
            |name: &str| resource.get(name).and_then(|e| e.value.as_deref()).and_then(|v| v.parse::<i64>().ok());
        let policy = resource.get("cleanup.policy").and_then(|e| e.value.as_deref());
        match broker_keeps(number("retention.ms"), number("segment.ms"), policy) {
            BrokerKeeps::Forever(why) => problems.push(format!(
                "topic {topic} {why}, but retention.inbox is {}",
                humantime::format_duration(inbox)
            )),
            BrokerKeeps::For(keeps) if keeps > inbox => problems.push(format!(
                "topic {topic} may hand records back for up to {} (retention.ms + segment.ms) but retention.inbox is only {}",
                humantime::format_duration(keeps),
                humantime::format_duration(inbox)
            )),
            BrokerKeeps::For(_) => {}
        }
    }
    if problems.is_empty() {
        return Ok(RetentionChecked(()));
    }
    let msg = format!(
        "the inbox would forget events the broker still keeps, so replaying them would apply them again: {}. \
         Set retention.inbox to at least the topic's retention.ms + segment.ms (or leave it unset to keep inbox rows forever)",
        problems.join("; ")
    );
    match cfg.retention.on_shorter_than_topic {
        Shortfall::Refuse => {
            anyhow::bail!("{msg}; or set retention.on_shorter_than_topic = \"warn\" to start anyway")
        }
        Shortfall::Warn => {
            warn!("{msg}");
            Ok(RetentionChecked(()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: i64 = 86_400_000;

    // A record lives up to retention.ms + segment.ms, and a
    // compacted topic keeps records indefinitely.
    #[test]
    fn the_broker_keeps_records_for_retention_plus_a_segment_or_forever_when_compacted() {
        let days = |d: u64| BrokerKeeps::For(Duration::from_secs(d * 86_400));
        assert_eq!(broker_keeps(Some(7 * DAY), Some(7 * DAY), Some("delete")), days(14));
        assert_eq!(broker_keeps(Some(DAY), Some(DAY / 24), None), BrokerKeeps::For(Duration::from_secs(25 * 3600)));
        assert_eq!(broker_keeps(None, None, None), days(14), "Kafka's defaults");
        assert!(matches!(broker_keeps(Some(-1), Some(DAY), Some("delete")), BrokerKeeps::Forever(_)));
        for policy in ["compact", "compact,delete", "delete, compact"] {
            let BrokerKeeps::Forever(why) = broker_keeps(Some(DAY), Some(DAY), Some(policy)) else {
                panic!("{policy} keeps records indefinitely")
            };
            assert!(why.contains("compacted"), "{why}");
        }
    }
}
