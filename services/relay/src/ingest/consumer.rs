//! The inbox consumer: Kafka records in, one PostgreSQL transaction per
//! partition batch, offsets committed only after that transaction (R1).
//!
//! Loop: receive what is already fetched; each partition's records run on a
//! task of their own, one task per partition at a time, in order, in
//! transactions of up to `batch_size` records, written in savepoints that a
//! bad record rolls back alone ([`crate::ingest::processor`], R12); records
//! of a partition whose task is running wait for it and form its next batch.
//! After each commit the next offset of the partition is stored and
//! committed. The committed offset is always the end of a contiguous
//! processed prefix:
//!
//! * a poison record is parked (dead-letter table + dead-letter topic) in the
//!   same transaction and counts as processed: the partition keeps moving (R11);
//! * a record that is "not yet" processable (missing saga, sequence gap) stops
//!   its partition: what came before is committed, the record is retried with
//!   backoff, and parked when the budget is spent (R19); other partitions go on;
//! * if the database is unreachable nothing is committed: the batch is retried
//!   with backoff until it succeeds or the process shuts down.
//!
//! Rebalance (R13): the revoke callback commits what was processed for the
//! revoked partitions (synchronously) and drops their records fetched but not
//! started. A task still running for one stops before its next transaction,
//! and what it commits from then on moves no offset (`advance` checks the
//! revoke generation): the new owner starts at the committed offset, and the
//! inbox makes the records it meets again duplicates — their insert waits for
//! the old owner's transaction and then finds the rows.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::{Offset, TopicPartitionList};
use relay_core::config::{KafkaConfig, RetryBudget};
use relay_core::retry::BackoffPolicy;
use relay_core::{Poison, RawRecord};
use sqlx::{Connection, PgPool};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Level, debug, error, info, warn};

use relay_core::Disposition;

use crate::ingest::partitions::{PartitionResult, PartitionRun, PartitionState, Tp, Work};
use crate::ingest::processor::{Processed, Processor};
use crate::runtime::faults::{FaultInjected, Faults, point};
use crate::runtime::kafka::{Role, client_config, forward_error, forward_log};

/// Consumer context: commits on revoke, forwards librdkafka logs to tracing.
pub struct RelayContext {
    state: Arc<Mutex<PartitionState>>,
    name: String,
}

impl ClientContext for RelayContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        forward_log(&self.name, level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        forward_error(&self.name, &error, reason);
    }

    /// librdkafka's statistics (every `statistics.interval.ms`): the consumer
    /// lag it computes per assigned partition becomes the `relay_consumer_lag` gauge.
    fn stats(&self, statistics: rdkafka::Statistics) {
        for (topic, t) in &statistics.topics {
            for (partition, p) in &t.partitions {
                if *partition >= 0 && p.consumer_lag >= 0 {
                    crate::runtime::metrics::lag(&self.name, topic, *partition, p.consumer_lag);
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
                        s.paused_full.remove(&tp);
                        s.waiting_out.remove(&tp);
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

    /// A partition we paused at the broker (held at a paused route) stays
    /// paused in librdkafka across a revoke and a new assignment, while the
    /// revoke forgot that we held it: nothing would ever resume it, and a
    /// partition handed back to this member would never be fetched again.
    /// So every partition assigned that we do not hold is resumed here; the
    /// held records were dropped at the revoke and are fetched again from the
    /// committed offset (and held again if the route is still paused).
    fn post_rebalance(&self, base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            let assigned: Vec<String> =
                tpl.elements().iter().map(|e| format!("{}[{}]", e.topic(), e.partition())).collect();
            let mut resume = TopicPartitionList::new();
            {
                let s = self.state.lock().expect("partition state lock");
                for e in tpl.elements() {
                    if !s.held.contains_key(&(e.topic().to_owned(), e.partition())) {
                        let _ = resume.add_partition(e.topic(), e.partition());
                    }
                }
            }
            if resume.count() > 0
                && let Err(e) = base.resume(&resume)
            {
                warn!(consumer = %self.name, error = %e, "resuming assigned partitions failed; a partition paused before the rebalance may stay paused");
            }
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
    /// Most bytes of records received and not started (all partitions).
    pub max_buffered_bytes: usize,
    /// Budget for "not yet" records.
    pub reference_retry: RetryBudget,
    /// Backoff while the database is down.
    pub database_backoff: BackoffPolicy,
}

/// The inbox consumer.
pub struct InboxConsumer {
    /// When held partitions were last tried.
    held_tried: Mutex<Option<Instant>>,
    /// Wakes the receive loop when a partition starts waiting out a retry:
    /// its records then leave the shared bound, which may free receiving.
    waits_changed: tokio::sync::Notify,
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
        Ok(InboxConsumer {
            held_tried: Mutex::new(None),
            waits_changed: tokio::sync::Notify::new(),
            consumer,
            state,
            processor,
            pool,
            settings,
            faults,
        })
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

    /// Each partition is processed on a task of its own, one task per
    /// partition at a time (R13: in order), and the loop keeps receiving while
    /// tasks run: records of a busy partition wait for its task to end and
    /// then go as its next batch. No partition waits for another: not for a
    /// slower transaction (every partition once waited for the slowest, see
    /// BENCHMARKS.md), and
    /// not for a record that is not processable yet (R19: its partition
    /// retries it with backoff for up to its budget while the others flow).
    async fn run_loop(self: &Arc<Self>, shutdown: &CancellationToken) -> anyhow::Result<()> {
        let mut work = Work::default();
        let mut tasks: JoinSet<(Tp, PartitionResult)> = JoinSet::new();
        let outcome = loop {
            self.start_ready(&mut work, &mut tasks, shutdown).await;
            // At most a batch per assigned partition waits unstarted, not
            // counting partitions whose task waits out a retry: those are
            // paused at the broker once a batch of theirs waits (`receive`),
            // so one partition waiting out its R19 retries stops only its
            // own fetching. (Pausing every busy partition instead cost 85 %
            // of the ingest benchmark: a pause drops librdkafka's prefetched
            // records, and each batch then waited for a fetch.)
            let partitions = self.consumer.assignment().map_or(1, |a| a.count().max(1));
            let limit = self.settings.batch_size * partitions;
            let (holding, waiting, bytes) = {
                let s = self.state.lock().expect("partition state lock");
                let fetching = |tp: &&Tp| !s.paused_full.contains(*tp) && !s.waiting_out.contains(*tp);
                let waiting: usize = work.waiting.iter().filter(|(tp, _)| fetching(tp)).map(|(_, q)| q.len()).sum();
                let bytes: usize = work.waiting_bytes.iter().filter(|(tp, _)| fetching(tp)).map(|(_, b)| b).sum();
                (!s.held.is_empty(), waiting, bytes)
            };
            // Records are copied out of librdkafka (the dead-letter table
            // keeps even an oversized one whole), so bytes are bounded too.
            let room = waiting < limit && bytes < self.settings.max_buffered_bytes;
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break Ok(()),
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    let (tp, run) = match done {
                        Ok(done) => done,
                        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                        Err(e) => anyhow::bail!("a partition's task was cancelled: {e}"),
                    };
                    work.busy.remove(&tp);
                    match run {
                        Ok(run) if run.interrupted => break Ok(()),
                        Ok(run) => self.hold(run, &mut work),
                        Err(f) => break Err(f),
                    }
                }
                m = self.consumer.recv(), if room => match m {
                    Ok(m) => {
                        let mut received = vec![self.take(&m)];
                        let mut got = received[0].0.size();
                        while waiting + received.len() < limit && bytes + got < self.settings.max_buffered_bytes {
                            match self.consumer.recv().now_or_never() {
                                Some(Ok(m)) => {
                                    let r = self.take(&m);
                                    got += r.0.size();
                                    received.push(r);
                                }
                                Some(Err(e)) => {
                                    warn!(consumer = %self.settings.name, error = %e, "Kafka receive error");
                                    break;
                                }
                                None => break,
                            }
                        }
                        self.receive(received, &mut work, partitions);
                    }
                    Err(e) => {
                        warn!(consumer = %self.settings.name, error = %e, "Kafka receive error; the client reconnects by itself");
                    }
                },
                // A partition started waiting out a retry: its records leave the bound.
                _ = self.waits_changed.notified() => {}
                // While partitions are held, wake up to see whether their route was resumed.
                _ = tokio::time::sleep(Duration::from_secs(1)), if holding => {}
            }
        };
        // Stopping (or a fault: "crash" only once every partition's
        // transaction in flight has ended, as when they all ended together).
        let mut fault = outcome.err();
        while let Some(done) = tasks.join_next().await {
            match done {
                Ok((_, Err(f))) => fault = fault.or(Some(f)),
                Ok((_, Ok(_))) => {}
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(e) => anyhow::bail!("a partition's task was cancelled: {e}"),
            }
        }
        match fault {
            Some(f) => Err(f.into()),
            None => Ok(()),
        }
    }

    /// File received records: dropped when their partition was revoked since
    /// they were fetched, behind the held ones when it is held, else waiting
    /// for their partition's next task.
    fn receive(&self, received: Vec<(RawRecord, u64)>, work: &mut Work, partitions: usize) {
        // Counted per receive and topic, not per record: a metric update
        // hashes its labels.
        let mut by_topic: BTreeMap<&str, u64> = BTreeMap::new();
        for (record, _) in &received {
            *by_topic.entry(record.topic.as_str()).or_default() += 1;
        }
        for (topic, n) in by_topic {
            crate::runtime::metrics::records_received(&self.settings.name, topic, n);
        }
        // Partitions whose next batch is full while their task runs: paused
        // at the broker until that batch starts.
        let mut to_pause = TopicPartitionList::new();
        // A partition's share of the byte bound (never below one record).
        let share = (self.settings.max_buffered_bytes / partitions).max(1);
        let mut s = self.state.lock().expect("partition state lock");
        for (record, generation) in received {
            let tp = (record.topic.clone(), record.partition);
            if s.revoked_since(&tp, generation) {
                debug!(topic = %tp.0, partition = tp.1, offset = record.offset, "dropping a fetched record of a revoked partition");
                continue;
            }
            if let Some(held) = s.held.get_mut(&tp) {
                // Fetched before the pause reached the broker: it queues behind the held ones.
                held.push(record);
                continue;
            }
            let size = record.size();
            let queue = work.waiting.entry(tp.clone()).or_default();
            queue.push((record, generation));
            let queued_bytes = work.waiting_bytes.entry(tp.clone()).or_default();
            *queued_bytes += size;
            let full = queue.len() >= self.settings.batch_size || *queued_bytes >= share;
            if full && s.waiting_out.contains(&tp) && s.paused_full.insert(tp.clone()) {
                let _ = to_pause.add_partition(&tp.0, tp.1);
            }
        }
        drop(s);
        if to_pause.count() > 0
            && let Err(e) = self.consumer.pause(&to_pause)
        {
            warn!(consumer = %self.settings.name, error = %e, "pausing fetches of a partition with a full batch waiting failed");
        }
    }

    /// Start a task for every partition with waiting records and none running.
    async fn start_ready(
        self: &Arc<Self>,
        work: &mut Work,
        tasks: &mut JoinSet<(Tp, PartitionResult)>,
        shutdown: &CancellationToken,
    ) {
        // Held partitions are tried again (their route may have been resumed).
        if !self.state.lock().expect("partition state lock").held.is_empty() && self.held_retry_due() {
            let mut s = self.state.lock().expect("partition state lock");
            let generation = s.generation;
            for (tp, records) in s.held.drain() {
                *work.waiting_bytes.entry(tp.clone()).or_default() +=
                    records.iter().map(RawRecord::size).sum::<usize>();
                let queued = work.waiting.entry(tp).or_default();
                queued.splice(0..0, records.into_iter().map(|r| (r, generation)));
            }
        }
        if !work.waiting.keys().any(|tp| !work.busy.contains(tp)) {
            return;
        }
        // A pause applies to every batch that starts after it was recorded.
        self.refresh_pauses().await;
        let ready: Vec<Tp> = work.waiting.keys().filter(|tp| !work.busy.contains(*tp)).cloned().collect();
        let mut resume = TopicPartitionList::new();
        let mut s = self.state.lock().expect("partition state lock");
        for tp in ready {
            let queued = work.waiting.remove(&tp).unwrap_or_default();
            work.waiting_bytes.remove(&tp);
            // Its waiting batch starts now: fetch again (unless it is held).
            if s.paused_full.remove(&tp) && !s.paused_at_broker.contains(&tp) {
                let _ = resume.add_partition(&tp.0, tp.1);
            }
            let records: Vec<RawRecord> =
                queued.into_iter().filter(|(_, g)| !s.revoked_since(&tp, *g)).map(|(r, _)| r).collect();
            if records.is_empty() {
                continue;
            }
            work.busy.insert(tp.clone());
            let (me, shutdown, generation) = (self.clone(), shutdown.clone(), s.generation);
            tasks.spawn(async move {
                let run = me.process_partition(tp.clone(), records, generation, &shutdown).await;
                (tp, run)
            });
        }
        drop(s);
        if resume.count() > 0
            && let Err(e) = self.consumer.resume(&resume)
        {
            warn!(consumer = %self.settings.name, error = %e, "resuming fetches of a partition whose batch started failed");
        }
    }

    /// Copy a message out of librdkafka's buffer, tagged with the revoke generation.
    fn take(&self, m: &BorrowedMessage<'_>) -> (RawRecord, u64) {
        // Names as bytes: rdkafka's own header accessors panic on a name
        // that is not UTF-8 (relay_kafka_raw).
        let headers = relay_kafka_raw::headers(m);
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

    fn is_held(&self, tp: &Tp) -> bool {
        self.state.lock().expect("partition state lock").held.contains_key(tp)
    }

    /// Hold what a paused route left over (with what was received for the
    /// partition meanwhile), pausing the partition at the broker; resume it
    /// when it is no longer held. Nothing is held for a partition revoked
    /// since its task started: the new owner gets those records.
    fn hold(&self, mut run: PartitionRun, work: &mut Work) {
        let (mut pause, mut resume) = (TopicPartitionList::new(), TopicPartitionList::new());
        {
            let mut s = self.state.lock().expect("partition state lock");
            if s.revoked_since(&run.tp, run.generation) {
                return;
            }
            if run.held.is_empty() {
                if s.paused_at_broker.remove(&run.tp) {
                    let _ = resume.add_partition(&run.tp.0, run.tp.1);
                }
            } else {
                work.waiting_bytes.remove(&run.tp);
                if let Some(later) = work.waiting.remove(&run.tp) {
                    run.held.extend(later.into_iter().map(|(r, _)| r));
                }
                // Paused at the broker from here on because it is held.
                s.paused_full.remove(&run.tp);
                s.held.insert(run.tp.clone(), run.held);
                if s.paused_at_broker.insert(run.tp.clone()) {
                    let _ = pause.add_partition(&run.tp.0, run.tp.1);
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
    /// committed while the record waits. Not for a partition revoked since
    /// `generation` (when its task started): the revoke committed what was
    /// done before it, the new owner starts there, and what this task
    /// recorded since is a duplicate to the inbox when the new owner meets it.
    fn advance(&self, tp: &Tp, generation: u64, next: i64, mode: CommitMode) {
        {
            let mut s = self.state.lock().expect("partition state lock");
            if s.revoked_since(tp, generation) {
                return;
            }
            s.next_offsets.insert(tp.clone(), next);
        }
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

    /// Everything logged while a partition's records are worked through
    /// (a database error, a record waiting, …) names the partition.
    #[tracing::instrument(name = "partition", skip_all, fields(consumer = %self.settings.name, topic = %tp.0, partition = tp.1))]
    async fn process_partition(
        &self,
        tp: Tp,
        records: Vec<RawRecord>,
        generation: u64,
        shutdown: &CancellationToken,
    ) -> PartitionResult {
        let mut run = PartitionRun { tp: tp.clone(), generation, interrupted: false, held: Vec::new() };
        let mut i = 0;
        let mut not_yet = 0u32;
        let mut db_failures = 0u32;
        let mut rng = StdRng::from_os_rng();
        while i < records.len() {
            if self.state.lock().expect("partition state lock").revoked_since(&tp, generation) {
                // R13: stop taking work for it; the new owner starts at the committed offset.
                debug!(topic = %tp.0, partition = tp.1, left = records.len() - i, "partition revoked; its remaining records are left to the new owner");
                return Ok(run);
            }
            let end = records.len().min(i + self.settings.batch_size);
            let wait = match self.run_batch(&tp, generation, &records[i..end]).await {
                Ok(BatchRun { done, stopped, paused }) => {
                    db_failures = 0;
                    if done > 0 {
                        i += done;
                        self.advance(&tp, generation, records[i - 1].offset + 1, CommitMode::Async);
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
                    crate::runtime::metrics::not_yet(&self.settings.name, poison.class.as_str());
                    not_yet += 1;
                    let record = &records[i];
                    let budget = self.settings.reference_retry;
                    if not_yet >= budget.max_attempts {
                        match self.park_alone(record, &poison, not_yet).await {
                            Ok(()) => {
                                crate::runtime::metrics::dead_lettered(
                                    &self.settings.name,
                                    &record.topic,
                                    poison.class.as_str(),
                                );
                                warn!(
                                    consumer = %self.settings.name, topic = %record.topic, partition = record.partition,
                                    offset = record.offset, event_id = poison.event_id.as_deref().unwrap_or(""),
                                    error_class = %poison.class, attempts = not_yet,
                                    "record parked after its retry budget: {}", poison.reason
                                );
                                i += 1;
                                self.advance(&tp, generation, record.offset + 1, CommitMode::Async);
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
            self.state.lock().expect("partition state lock").waiting_out.insert(tp.clone());
            self.waits_changed.notify_one();
            let interrupted = tokio::select! {
                _ = shutdown.cancelled() => true,
                _ = tokio::time::sleep(wait) => false,
            };
            self.state.lock().expect("partition state lock").waiting_out.remove(&tp);
            if interrupted {
                run.interrupted = true;
                return Ok(run);
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
        let conflict = matches!(e, sqlx::Error::Database(db) if db.code().is_some_and(|c| c.starts_with("40")));
        if conflict {
            // A deadlock or serialization failure with another partition's
            // transaction (relay_store::ordering): PostgreSQL aborted this one.
            warn!(
                consumer = %self.settings.name, error = %e, attempt = failures, retry_in_ms = delay.as_millis() as u64,
                "this batch's transaction conflicted with another and was rolled back; retrying"
            );
            return delay;
        }
        error!(
            consumer = %self.settings.name, error = %e, attempt = failures, retry_in_ms = delay.as_millis() as u64,
            "database error; nothing was committed for this batch and its offsets stay where they were; retrying"
        );
        delay
    }

    /// One transaction over `records` (one partition, in order).
    async fn run_batch(&self, tp: &Tp, generation: u64, records: &[RawRecord]) -> Result<BatchRun, BatchError> {
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin().await?;
        let started = Instant::now();
        // Intents written already claimed by this process's dispatcher: handed
        // over after the commit, dropped (room given back) if there is none.
        let mut held = Vec::new();
        let processed = match self.processor.process_batch_first(&mut tx, records, &mut held).await? {
            Some(processed) => processed,
            None => {
                // The batch's first run was rejected; it was all the
                // transaction held. Again, with a savepoint around each run.
                tx.rollback().await?;
                held.clear();
                tx = conn.begin().await?;
                self.processor.process_batch(&mut tx, records, &mut held).await?
            }
        };
        let (mut stopped, mut paused) = (None, None);
        for (record, p) in records.iter().zip(&processed) {
            match &p.disposition {
                Disposition::DeadLetter(poison) => {
                    self.processor.park(&mut tx, record, poison, 1).await?;
                }
                Disposition::RetryLater(poison) => stopped = Some(poison.clone()),
                Disposition::Paused { route } => paused = Some(route.clone()),
                _ => {}
            }
        }
        let done = processed.len() - usize::from(stopped.is_some() || paused.is_some());
        let took = started.elapsed() / u32::try_from(processed.len().max(1)).unwrap_or(1);
        if self.faults.sabotage().offset_before_commit && done > 0 {
            // Deliberately wrong (R1): the offset goes out before the data is safe.
            self.advance(tp, generation, records[done - 1].offset + 1, CommitMode::Sync);
        }
        self.faults.hit(point::CONSUMER_BEFORE_DB_COMMIT).await?;
        tx.commit().await?;
        self.faults.hit(point::CONSUMER_AFTER_DB_COMMIT).await?;
        if let Some(handoff) = self.processor.handoff() {
            handoff.send(&self.pool, held).await;
        }
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
        crate::runtime::metrics::record_processed(
            &self.settings.name,
            &record.topic,
            p.info.route.as_deref().unwrap_or(""),
            p.disposition.result(),
            took.as_secs_f64(),
        );
        if let Disposition::DeadLetter(poison) = &p.disposition {
            crate::runtime::metrics::poison(&self.settings.name, poison.class.as_str());
            crate::runtime::metrics::dead_lettered(&self.settings.name, &record.topic, poison.class.as_str());
        }
        let level = match &p.disposition {
            Disposition::Applied { .. } => Level::DEBUG,
            Disposition::Duplicate | Disposition::NoOp { .. } => Level::INFO,
            Disposition::DeadLetter(_) | Disposition::RetryLater(_) | Disposition::Paused { .. } => Level::WARN,
        };
        let detail = match &p.disposition {
            Disposition::Applied { intents, events } => {
                format!("applied: {intents} intent(s), {events} event(s) written")
            }
            Disposition::Duplicate => "duplicate: already in the inbox, nothing written".into(),
            Disposition::NoOp { outcome, detail } => format!("{}: {detail}", outcome.as_str()),
            Disposition::DeadLetter(poison) => format!("dead-lettered ({}): {}", poison.class, poison.reason),
            Disposition::RetryLater(poison) => format!("not yet ({}): {}", poison.class, poison.reason),
            Disposition::Paused { route } => format!("route {route} is paused"),
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
                    result = p.disposition.result(),
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
