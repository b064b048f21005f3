//! The inbox consumer: Kafka records in, one PostgreSQL transaction per
//! partition batch, offsets committed only after that transaction (R1).
//!
//! Loop: receive a batch (what is already fetched, up to `batch_size`),
//! split it by partition, and for each partition run its records in order in
//! one transaction, each record in a savepoint (R12). After the commit the next
//! offset of the partition is stored and committed. The committed offset is
//! always the end of a contiguous processed prefix:
//!
//! * a poison record is parked (dead-letter table + dead-letter topic) in the
//!   same transaction and counts as processed: the partition keeps moving (R11);
//! * a record that is "not yet" processable (missing saga, sequence gap) stops
//!   its partition's batch: what came before is committed, the record is
//!   retried with backoff, and parked when the budget is spent (R19);
//! * if the database is unreachable nothing is committed: the batch is retried
//!   with backoff until it succeeds or the process shuts down.
//!
//! Rebalance (R13): records are only received between batches, so when a
//! partition is revoked no record of it is being processed. The revoke
//! callback commits what was processed for it (synchronously), and records of
//! the revoked partition that were fetched but not started are dropped.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use relay_core::config::{KafkaConfig, RetryBudget};
use relay_core::retry::BackoffPolicy;
use relay_core::{Header, Poison, RawRecord};
use sqlx::{Connection, PgPool};
use tokio_util::sync::CancellationToken;
use tracing::{Level, debug, error, info, warn};

use crate::faults::{FaultInjected, Faults, point};
use crate::kafka::{Role, client_config};
use crate::processor::{Processed, Processor, Step};

type Tp = (String, i32);

#[derive(Default)]
struct PartitionState {
    /// Bumped on every revoke.
    generation: u64,
    /// Generation at which each partition was last revoked.
    revoked_at: HashMap<Tp, u64>,
    /// Next offset to commit per owned partition (end of the processed prefix).
    next_offsets: HashMap<Tp, i64>,
    /// Records of partitions held at a paused route, in order, not yet
    /// processed; the partition is paused at the broker meanwhile.
    held: HashMap<Tp, Vec<RawRecord>>,
    /// Partitions whose fetching is paused at the broker (because they are held).
    paused_at_broker: std::collections::HashSet<Tp>,
}

/// Consumer context: commits on revoke, forwards librdkafka logs to tracing.
pub struct RelayContext {
    state: Arc<Mutex<PartitionState>>,
    name: String,
}

impl ClientContext for RelayContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        match level {
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error => {
                error!(consumer = %self.name, facility = fac, "librdkafka: {log_message}")
            }
            RDKafkaLogLevel::Warning => {
                warn!(consumer = %self.name, facility = fac, "librdkafka: {log_message}")
            }
            _ => debug!(consumer = %self.name, facility = fac, "librdkafka: {log_message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        warn!(consumer = %self.name, error = %error, "Kafka client error: {reason}");
    }

    /// librdkafka's statistics (every `statistics.interval.ms`): the consumer
    /// lag it computes per assigned partition becomes the `relay_consumer_lag` gauge.
    fn stats(&self, statistics: rdkafka::Statistics) {
        for (topic, t) in &statistics.topics {
            for (partition, p) in &t.partitions {
                if *partition >= 0 && p.consumer_lag >= 0 {
                    crate::metrics::lag(&self.name, topic, *partition, p.consumer_lag);
                }
            }
        }
    }
}

impl ConsumerContext for RelayContext {
    fn pre_rebalance(&self, base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => {
                let mut commit = TopicPartitionList::new();
                let revoked: Vec<String>;
                {
                    let mut s = self.state.lock().expect("partition state lock");
                    s.generation += 1;
                    let generation = s.generation;
                    revoked = tpl.elements().iter().map(|e| format!("{}[{}]", e.topic(), e.partition())).collect();
                    for e in tpl.elements() {
                        let tp = (e.topic().to_owned(), e.partition());
                        s.revoked_at.insert(tp.clone(), generation);
                        // Held records were never processed: the new owner gets them again.
                        s.held.remove(&tp);
                        s.paused_at_broker.remove(&tp);
                        if let Some(next) = s.next_offsets.remove(&tp) {
                            let _ = commit.add_partition_offset(&tp.0, tp.1, Offset::Offset(next));
                        }
                    }
                }
                if commit.count() > 0
                    && let Err(e) = base.commit(&commit, CommitMode::Sync)
                {
                    warn!(consumer = %self.name, error = %e, "committing offsets of revoked partitions failed; \
                              their records will be redelivered and deduplicated by the inbox");
                }
                info!(consumer = %self.name, partitions = ?revoked, "partitions revoked; processed offsets committed");
            }
            Rebalance::Assign(_) => {}
            Rebalance::Error(e) => warn!(consumer = %self.name, error = %e, "rebalance error"),
        }
    }

    fn post_rebalance(&self, _base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            let assigned: Vec<String> =
                tpl.elements().iter().map(|e| format!("{}[{}]", e.topic(), e.partition())).collect();
            info!(consumer = %self.name, partitions = ?assigned, "partitions assigned");
        }
    }
}

/// Settings of the consumer loop.
#[derive(Debug, Clone)]
pub struct ConsumerSettings {
    /// Consumer (inbox) name.
    pub name: String,
    /// Kafka group.
    pub group: String,
    /// Topics to subscribe to.
    pub topics: Vec<String>,
    /// Most records per batch.
    pub batch_size: usize,
    /// Budget for "not yet" records.
    pub reference_retry: RetryBudget,
    /// Backoff while the database is down.
    pub database_backoff: BackoffPolicy,
}

/// The inbox consumer.
pub struct InboxConsumer {
    /// When held partitions were last tried.
    held_tried: Mutex<Option<Instant>>,
    consumer: StreamConsumer<RelayContext>,
    state: Arc<Mutex<PartitionState>>,
    processor: Processor,
    pool: PgPool,
    settings: ConsumerSettings,
    faults: Faults,
}

struct BatchRun {
    done: usize,
    stopped: Option<Poison>,
    paused: Option<String>,
}

enum BatchError {
    Db(sqlx::Error),
    Fault(FaultInjected),
}

impl From<sqlx::Error> for BatchError {
    fn from(e: sqlx::Error) -> Self {
        BatchError::Db(e)
    }
}

impl From<FaultInjected> for BatchError {
    fn from(e: FaultInjected) -> Self {
        BatchError::Fault(e)
    }
}

/// How one partition's records ended.
struct PartitionRun {
    tp: Tp,
    interrupted: bool,
    /// Records from a paused route on: to hold until the route is resumed.
    held: Vec<RawRecord>,
}

impl InboxConsumer {
    /// Create the Kafka consumer and subscribe.
    pub fn new(
        kafka: &KafkaConfig,
        settings: ConsumerSettings,
        processor: Processor,
        pool: PgPool,
        faults: Faults,
    ) -> anyhow::Result<InboxConsumer> {
        let state = Arc::new(Mutex::new(PartitionState::default()));
        let mut cfg = client_config(kafka, Role::Consumer)?;
        cfg.set("group.id", &settings.group);
        if cfg.get("statistics.interval.ms").is_none() {
            cfg.set("statistics.interval.ms", "5000");
        }
        cfg.set_log_level(RDKafkaLogLevel::Warning);
        let ctx = RelayContext { state: state.clone(), name: settings.name.clone() };
        let consumer: StreamConsumer<RelayContext> = cfg.create_with_context(ctx)?;
        let topics: Vec<&str> = settings.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics)?;
        info!(consumer = %settings.name, group = %settings.group, topics = ?settings.topics, "inbox consumer subscribed");
        Ok(InboxConsumer { held_tried: Mutex::new(None), consumer, state, processor, pool, settings, faults })
    }

    /// Run until `shutdown` is cancelled (then finish the batch in flight and
    /// commit) or a fault point fails (then stop without committing, like a crash).
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let me = Arc::new(self);
        let result = me.run_loop(&shutdown).await;
        if result.is_ok() {
            me.commit_all(CommitMode::Sync);
        }
        me.consumer.unsubscribe();
        info!(consumer = %me.settings.name, "inbox consumer stopped");
        result
    }

    async fn run_loop(self: &Arc<Self>, shutdown: &CancellationToken) -> anyhow::Result<()> {
        loop {
            let holding = !self.state.lock().expect("partition state lock").held.is_empty();
            let first = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                m = self.consumer.recv() => Some(m),
                // While partitions are held, wake up to see whether their route was resumed.
                _ = tokio::time::sleep(Duration::from_secs(1)), if holding => None,
            };
            let mut batch = Vec::with_capacity(self.settings.batch_size);
            match first {
                None => {}
                Some(Ok(m)) => batch.push(self.take(&m)),
                Some(Err(e)) => {
                    warn!(consumer = %self.settings.name, error = %e, "Kafka receive error; the client reconnects by itself");
                    continue;
                }
            }
            // Up to batch_size records per partition in one transaction each:
            // gather what is already fetched for all assigned partitions.
            let partitions = self.consumer.assignment().map_or(1, |a| a.count().max(1));
            while batch.len() < self.settings.batch_size * partitions {
                match self.consumer.recv().now_or_never() {
                    Some(Ok(m)) => batch.push(self.take(&m)),
                    Some(Err(e)) => {
                        warn!(consumer = %self.settings.name, error = %e, "Kafka receive error");
                        break;
                    }
                    None => break,
                }
            }
            // Counted per batch and topic, not per record: a metric update
            // hashes its labels.
            let mut received: BTreeMap<&str, u64> = BTreeMap::new();
            for (record, _) in &batch {
                *received.entry(record.topic.as_str()).or_default() += 1;
            }
            for (topic, n) in received {
                crate::metrics::records_received(&self.settings.name, topic, n);
            }
            self.refresh_pauses().await;
            let runs = self.process_batch(batch, shutdown).await?;
            if runs.iter().any(|r| r.interrupted) {
                return Ok(());
            }
        }
    }

    /// Copy a message out of librdkafka's buffer, tagged with the revoke generation.
    fn take(&self, m: &BorrowedMessage<'_>) -> (RawRecord, u64) {
        let headers = m
            .headers()
            .map(|hs| {
                hs.iter().map(|h| Header { name: h.key.to_owned(), value: h.value.map(<[u8]>::to_vec) }).collect()
            })
            .unwrap_or_default();
        let record = RawRecord {
            topic: m.topic().to_owned(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().map(<[u8]>::to_vec),
            headers,
        };
        (record, self.state.lock().expect("partition state lock").generation)
    }

    async fn process_batch(
        self: &Arc<Self>,
        batch: Vec<(RawRecord, u64)>,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<Vec<PartitionRun>> {
        let mut by_partition: BTreeMap<Tp, Vec<RawRecord>> = BTreeMap::new();
        {
            let mut s = self.state.lock().expect("partition state lock");
            for (record, generation) in batch {
                let tp = (record.topic.clone(), record.partition);
                if s.revoked_at.get(&tp).is_some_and(|revoked| *revoked > generation) {
                    debug!(topic = %tp.0, partition = tp.1, offset = record.offset, "dropping a fetched record of a revoked partition");
                    continue;
                }
                if let Some(held) = s.held.get_mut(&tp) {
                    // Fetched before the pause reached the broker: it queues behind the held ones.
                    held.push(record);
                    continue;
                }
                by_partition.entry(tp).or_default().push(record);
            }
            // Held partitions are tried again (their route may have been resumed).
            if self.held_retry_due() {
                for (tp, records) in s.held.drain() {
                    by_partition.entry(tp).or_default().splice(0..0, records);
                }
            }
        }
        // Each partition on a task of its own: decoding, rendering and
        // encoding a partition's records is CPU work, and on one task the
        // partitions would take turns at it instead of using every core. The
        // JoinSet aborts them if this future is dropped.
        let mut tasks = tokio::task::JoinSet::new();
        for (tp, records) in by_partition {
            let (me, shutdown) = (self.clone(), shutdown.clone());
            tasks.spawn(async move { me.process_partition(tp, records, &shutdown).await });
        }
        // Every partition finishes its work before a fault is reported, as
        // when they shared this task.
        let (mut runs, mut fault) = (Vec::with_capacity(tasks.len()), None);
        while let Some(done) = tasks.join_next().await {
            match done {
                Ok(Ok(run)) => runs.push(run),
                Ok(Err(f)) => fault = fault.or(Some(f)),
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(e) => anyhow::bail!("a partition's task was cancelled: {e}"),
            }
        }
        if let Some(f) = fault {
            return Err(f.into());
        }
        self.hold(&mut runs);
        Ok(runs)
    }

    fn is_held(&self, tp: &Tp) -> bool {
        self.state.lock().expect("partition state lock").held.contains_key(tp)
    }

    /// Hold what paused routes left over, pausing those partitions at the
    /// broker; resume the partitions that are no longer held.
    fn hold(&self, runs: &mut [PartitionRun]) {
        let (mut pause, mut resume) = (TopicPartitionList::new(), TopicPartitionList::new());
        {
            let mut s = self.state.lock().expect("partition state lock");
            for r in runs {
                if r.held.is_empty() {
                    if s.paused_at_broker.remove(&r.tp) {
                        let _ = resume.add_partition(&r.tp.0, r.tp.1);
                    }
                } else {
                    s.held.insert(r.tp.clone(), std::mem::take(&mut r.held));
                    if s.paused_at_broker.insert(r.tp.clone()) {
                        let _ = pause.add_partition(&r.tp.0, r.tp.1);
                    }
                }
            }
        }
        if pause.count() > 0
            && let Err(e) = self.consumer.pause(&pause)
        {
            warn!(error = %e, "pausing fetches of held partitions failed; their records queue in memory instead");
        }
        if resume.count() > 0 {
            if let Err(e) = self.consumer.resume(&resume) {
                warn!(error = %e, "resuming fetches failed");
            }
            info!(consumer = %self.settings.name, partitions = resume.count(), "held partitions resumed");
        }
    }

    /// Whether held partitions should be tried again now (at most once a second).
    fn held_retry_due(&self) -> bool {
        let mut last = self.held_tried.lock().expect("held lock");
        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return false;
        }
        *last = Some(Instant::now());
        true
    }

    /// Store and commit `next` as the end of `tp`'s processed prefix. Called
    /// after every database commit, so progress before a stuck record is
    /// committed while the record waits.
    fn advance(&self, tp: &Tp, next: i64, mode: CommitMode) {
        self.state.lock().expect("partition state lock").next_offsets.insert(tp.clone(), next);
        let mut tpl = TopicPartitionList::new();
        if tpl.add_partition_offset(&tp.0, tp.1, Offset::Offset(next)).is_err() {
            return;
        }
        if let Err(e) = self.consumer.store_offsets(&tpl) {
            debug!(error = %e, "storing offsets failed (partition no longer assigned?)");
        }
        if let Err(e) = self.consumer.commit(&tpl, mode) {
            warn!(consumer = %self.settings.name, error = %e, "offset commit failed; it is retried with the next batch");
        }
    }

    fn commit_all(&self, mode: CommitMode) {
        let mut tpl = TopicPartitionList::new();
        for ((topic, partition), next) in &self.state.lock().expect("partition state lock").next_offsets {
            let _ = tpl.add_partition_offset(topic, *partition, Offset::Offset(*next));
        }
        if tpl.count() > 0
            && let Err(e) = self.consumer.commit(&tpl, mode)
        {
            warn!(consumer = %self.settings.name, error = %e, "final offset commit failed; records will be redelivered and deduplicated");
        }
    }

    async fn process_partition(
        &self,
        tp: Tp,
        records: Vec<RawRecord>,
        shutdown: &CancellationToken,
    ) -> Result<PartitionRun, FaultInjected> {
        let mut run = PartitionRun { tp: tp.clone(), interrupted: false, held: Vec::new() };
        let mut i = 0;
        let mut not_yet = 0u32;
        let mut db_failures = 0u32;
        let mut rng = StdRng::from_os_rng();
        while i < records.len() {
            let end = records.len().min(i + self.settings.batch_size);
            let wait = match self.run_batch(&tp, &records[i..end]).await {
                Ok(BatchRun { done, stopped, paused }) => {
                    db_failures = 0;
                    if done > 0 {
                        i += done;
                        self.advance(&tp, records[i - 1].offset + 1, CommitMode::Async);
                        not_yet = 0;
                    }
                    if let Some(route) = paused {
                        // Hold the rest of this partition (no retry budget is spent);
                        // the other partitions keep flowing.
                        if !self.is_held(&tp) {
                            warn!(consumer = %self.settings.name, topic = %tp.0, partition = tp.1, offset = records[i].offset,
                                  route = %route, "route is paused: this partition is held at its next event of the route until it is resumed");
                        }
                        run.held = records[i..].to_vec();
                        return Ok(run);
                    }
                    let Some(poison) = stopped else { continue };
                    crate::metrics::not_yet(&self.settings.name, poison.class.as_str());
                    not_yet += 1;
                    let record = &records[i];
                    let budget = self.settings.reference_retry;
                    if not_yet >= budget.max_attempts {
                        match self.park_alone(record, &poison, not_yet).await {
                            Ok(()) => {
                                warn!(
                                    consumer = %self.settings.name, topic = %record.topic, partition = record.partition,
                                    offset = record.offset, event_id = poison.event_id.as_deref().unwrap_or(""),
                                    error_class = %poison.class, attempts = not_yet,
                                    "record parked after its retry budget: {}", poison.reason
                                );
                                i += 1;
                                self.advance(&tp, record.offset + 1, CommitMode::Async);
                                not_yet = 0;
                                continue;
                            }
                            Err(BatchError::Fault(f)) => return Err(f),
                            Err(BatchError::Db(e)) => {
                                db_failures += 1;
                                self.db_unavailable(&e, db_failures, &mut rng)
                            }
                        }
                    } else {
                        let delay = budget.backoff.delay(not_yet, &mut rng);
                        warn!(
                            consumer = %self.settings.name, topic = %record.topic, partition = record.partition,
                            offset = record.offset, event_id = poison.event_id.as_deref().unwrap_or(""),
                            error_class = %poison.class, attempt = not_yet, retry_in_ms = delay.as_millis() as u64,
                            "record not processable yet; the partition waits for it: {}", poison.reason
                        );
                        delay
                    }
                }
                Err(BatchError::Fault(f)) => return Err(f),
                Err(BatchError::Db(e)) => {
                    db_failures += 1;
                    self.db_unavailable(&e, db_failures, &mut rng)
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => { run.interrupted = true; return Ok(run); }
                _ = tokio::time::sleep(wait) => {}
            }
        }
        Ok(run)
    }

    /// Reload the paused routes from the database, before every batch: a
    /// pause applies to every batch that starts after it was recorded.
    async fn refresh_pauses(&self) {
        let Ok(mut conn) = self.pool.acquire().await else { return };
        match relay_store::ops::paused_routes(&mut conn).await {
            Ok(routes) => self.processor.set_paused(routes),
            Err(e) => debug!(error = %e, "reading paused routes failed; keeping the last known set"),
        }
    }

    fn db_unavailable(&self, e: &sqlx::Error, failures: u32, rng: &mut impl rand::Rng) -> Duration {
        let delay = self.settings.database_backoff.delay(failures, rng).max(Duration::from_millis(50));
        error!(
            consumer = %self.settings.name, error = %e, attempt = failures, retry_in_ms = delay.as_millis() as u64,
            "database error; nothing was committed for this batch and its offsets stay where they were; retrying"
        );
        delay
    }

    /// One transaction over `records` (one partition, in order).
    async fn run_batch(&self, tp: &Tp, records: &[RawRecord]) -> Result<BatchRun, BatchError> {
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin().await?;
        let started = Instant::now();
        let processed = self.processor.process_batch(&mut tx, records).await?;
        let (mut stopped, mut paused) = (None, None);
        for (record, p) in records.iter().zip(&processed) {
            match &p.step {
                Step::Poison(poison) => {
                    self.processor.park(&mut tx, record, poison, 1).await?;
                }
                Step::RetryLater(poison) => stopped = Some(poison.clone()),
                Step::Paused { route } => paused = Some(route.clone()),
                _ => {}
            }
        }
        let done = processed.len() - usize::from(stopped.is_some() || paused.is_some());
        let took = started.elapsed() / u32::try_from(processed.len().max(1)).unwrap_or(1);
        if self.faults.sabotage().offset_before_commit && done > 0 {
            // Deliberately wrong (R1): the offset goes out before the data is safe.
            self.advance(tp, records[done - 1].offset + 1, CommitMode::Sync);
        }
        self.faults.hit(point::CONSUMER_BEFORE_DB_COMMIT).await?;
        tx.commit().await?;
        self.faults.hit(point::CONSUMER_AFTER_DB_COMMIT).await?;
        for (record, p) in records.iter().zip(&processed).take(done) {
            self.log_record(record, p, took);
        }
        Ok(BatchRun { done, stopped, paused })
    }

    async fn park_alone(&self, record: &RawRecord, poison: &Poison, attempts: u32) -> Result<(), BatchError> {
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin().await?;
        self.processor.park(&mut tx, record, poison, attempts).await?;
        self.faults.hit(point::CONSUMER_BEFORE_DB_COMMIT).await?;
        tx.commit().await?;
        self.faults.hit(point::CONSUMER_AFTER_DB_COMMIT).await?;
        Ok(())
    }

    fn log_record(&self, record: &RawRecord, p: &Processed, took: Duration) {
        crate::metrics::record_processed(
            &self.settings.name,
            &record.topic,
            p.info.route.as_deref().unwrap_or(""),
            p.step.result(),
            took.as_secs_f64(),
        );
        if let Step::Poison(poison) = &p.step {
            crate::metrics::poison(&self.settings.name, poison.class.as_str());
            crate::metrics::dead_lettered(&self.settings.name, &record.topic, poison.class.as_str());
        }
        let level = match &p.step {
            Step::Applied { .. } => Level::DEBUG,
            Step::Duplicate | Step::NoOp { .. } => Level::INFO,
            Step::Poison(_) | Step::RetryLater(_) | Step::Paused { .. } => Level::WARN,
        };
        let detail = match &p.step {
            Step::Applied { intents, events } => {
                format!("applied: {intents} intent(s), {events} event(s) written")
            }
            Step::Duplicate => "duplicate: already in the inbox, nothing written".into(),
            Step::NoOp { outcome, detail } => format!("{}: {detail}", outcome.as_str()),
            Step::Poison(poison) => format!("dead-lettered ({}): {}", poison.class, poison.reason),
            Step::RetryLater(poison) => format!("not yet ({}): {}", poison.class, poison.reason),
            Step::Paused { route } => format!("route {route} is paused"),
        };
        let i = &p.info;
        macro_rules! emit {
            ($lvl:expr) => {
                tracing::event!(
                    $lvl,
                    consumer = %self.settings.name,
                    group = %self.settings.group,
                    topic = %record.topic,
                    partition = record.partition,
                    offset = record.offset,
                    event_id = i.id.as_deref().unwrap_or(""),
                    event_type = i.event_type.as_deref().unwrap_or(""),
                    route = i.route.as_deref().unwrap_or(""),
                    idempotency_key = i.idempotency_key.as_deref().unwrap_or(""),
                    aggregate_id = i.aggregate_id.as_deref().unwrap_or(""),
                    correlation_id = i.correlation_id.as_deref().unwrap_or(""),
                    causation_id = i.causation_id.as_deref().unwrap_or(""),
                    result = p.step.result(),
                    duration_us = took.as_micros() as u64,
                    "{detail}"
                )
            };
        }
        match level {
            Level::WARN => emit!(Level::WARN),
            Level::INFO => emit!(Level::INFO),
            _ => emit!(Level::DEBUG),
        }
    }
}
