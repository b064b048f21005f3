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
//! started. A task still running for one stops before its next transaction
//! (a retry wait is cut short), and what it commits from then on moves no
//! offset (`advance` checks the revoke generation): the new owner starts at
//! the committed offset, and the inbox makes the records it meets again
//! duplicates — their insert waits for the old owner's transaction and then
//! finds the rows.
//!
//! What is buffered, and which partition is paused at the broker and why, is
//! `ingest/partitions.rs`'s to decide; this file does the I/O.

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
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use relay_core::config::{KafkaConfig, RetryBudget};
use relay_core::retry::BackoffPolicy;
use relay_core::{Poison, PoisonClass, RawRecord};
use sqlx::{Connection, PgPool};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Level, debug, error, info, warn};

use relay_core::Disposition;

use crate::ingest::next::{Ended, InARow, Next, WaitFor, next};
use crate::ingest::partitions::{
    Done, Filed, Limits, PartitionResult, PartitionRun, Partitions, Resume, Start, TopicPartition,
};
use crate::ingest::processor::{Processed, Processor};
use crate::ingest::unreadable::{self, Unreadable};
use crate::runtime::faults::{FaultInjected, Faults, Sabotage, point};
use crate::runtime::kafka::{consumer_config, forward_error, forward_log};

/// Consumer context: commits on revoke, forwards librdkafka logs to tracing.
pub struct RelayContext {
    state: Arc<Mutex<Partitions>>,
    name: String,
}

fn tps(tpl: &TopicPartitionList) -> Vec<TopicPartition> {
    tpl.elements().iter().map(|e| TopicPartition::new(e.topic(), e.partition())).collect()
}

fn tpl_of<'a>(tps: impl IntoIterator<Item = &'a TopicPartition>) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::new();
    for tp in tps {
        let _ = tpl.add_partition(&tp.topic, tp.partition);
    }
    tpl
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
                let revoked = tps(tpl);
                let offsets = self.state.lock().expect("partition state lock").revoke(&revoked);
                let mut commit = TopicPartitionList::new();
                for (tp, next) in &offsets {
                    let _ = commit.add_partition_offset(&tp.topic, tp.partition, Offset::Offset(*next));
                }
                if commit.count() > 0
                    && let Err(e) = base.commit(&commit, CommitMode::Sync)
                {
                    warn!(consumer = %self.name, error = %e, "committing offsets of revoked partitions failed; \
                              their records will be redelivered and deduplicated by the inbox");
                }
                let names: Vec<String> = revoked.iter().map(ToString::to_string).collect();
                info!(consumer = %self.name, partitions = ?names, "partitions revoked; processed offsets committed");
            }
            Rebalance::Assign(_) => {}
            Rebalance::Error(e) => warn!(consumer = %self.name, error = %e, "rebalance error"),
        }
    }

    /// A partition paused at the broker stays paused in librdkafka across a
    /// revoke and a new assignment, while the revoke forgot why it was
    /// paused: nothing would ever resume it. So every partition assigned
    /// that is not paused by the relay is resumed here; what was waiting or
    /// held for it is fetched again from the committed offset.
    fn post_rebalance(&self, base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            let assigned = tps(tpl);
            let resume = self.state.lock().expect("partition state lock").assigned(&assigned);
            if !resume.is_empty()
                && let Err(e) = base.resume(&tpl_of(&resume))
            {
                warn!(consumer = %self.name, error = %e, "resuming assigned partitions failed; a partition paused before the rebalance may stay paused");
            }
            let names: Vec<String> = assigned.iter().map(ToString::to_string).collect();
            info!(consumer = %self.name, partitions = ?names, "partitions assigned");
        }
    }
}

/// What a search for unreadable batches found, with the revoke generation
/// it started in.
type Found = (u64, Vec<Unreadable>);

/// How long one batch may run before its partition is treated as waiting:
/// a batch takes milliseconds, so this is a lock or a handler stuck.
const SLOW_TASK: Duration = Duration::from_secs(5);

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
    /// The largest batch the topics keep (their `max.message.bytes`): a
    /// fetch response must have room for it.
    pub largest_batch: usize,
}

/// The inbox consumer.
pub struct InboxConsumer {
    /// Wakes the receive loop when a partition starts waiting out a retry:
    /// its waiting records are dropped, which may free receiving.
    waits_changed: tokio::sync::Notify,
    /// Whether a search for an unreadable batch is running, and where its
    /// finds go (with the revoke generation it started in); the loop holds
    /// the receiving end.
    probing: std::sync::atomic::AtomicBool,
    /// When the last search started: one at most every few seconds.
    probed_at: Mutex<Option<Instant>>,
    found: tokio::sync::mpsc::UnboundedSender<Found>,
    found_rx: Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<Found>>>,
    kafka: KafkaConfig,
    consumer: StreamConsumer<RelayContext>,
    state: Arc<Mutex<Partitions>>,
    processor: Processor,
    pool: PgPool,
    settings: ConsumerSettings,
    faults: Faults,
    /// The database is known to be down: a watcher asks it until it answers.
    db_down: tokio::sync::Notify,
    /// Bumped each time the database answers again after being down: wakes
    /// every partition task waiting out a database error at once, instead of
    /// each at the end of its own backoff (seconds apart).
    db_back: tokio::sync::watch::Sender<u64>,
}

struct BatchRun {
    done: usize,
    /// The record not processable yet, and its route.
    stopped: Option<(Poison, Option<String>)>,
    paused: Option<String>,
}

enum BatchError {
    Db(sqlx::Error),
    Fault(FaultInjected),
    /// The Schema Registry could not be asked: the partition waits.
    Registry(String),
}

/// Why a record could not be parked alone (no registry is asked).
enum ParkError {
    Db(sqlx::Error),
    Fault(FaultInjected),
}

impl From<sqlx::Error> for ParkError {
    fn from(e: sqlx::Error) -> Self {
        ParkError::Db(e)
    }
}

impl From<FaultInjected> for ParkError {
    fn from(e: FaultInjected) -> Self {
        ParkError::Fault(e)
    }
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
        let limits = Limits { batch_size: settings.batch_size, max_buffered_bytes: settings.max_buffered_bytes };
        let state = Arc::new(Mutex::new(Partitions::new(limits)));
        let mut cfg = consumer_config(kafka, settings.largest_batch)?;
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
        let (found, found_rx) = tokio::sync::mpsc::unbounded_channel();
        Ok(InboxConsumer {
            probing: std::sync::atomic::AtomicBool::new(false),
            probed_at: Mutex::new(None),
            found,
            found_rx: Mutex::new(Some(found_rx)),
            kafka: kafka.clone(),
            waits_changed: tokio::sync::Notify::new(),
            consumer,
            state,
            processor,
            pool,
            settings,
            faults,
            db_down: tokio::sync::Notify::new(),
            db_back: tokio::sync::watch::Sender::new(0),
        })
    }

    /// Run until `shutdown` is cancelled (then finish the batch in flight and
    /// commit) or a fault point fails (then stop without committing, like a crash).
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let me = Arc::new(self);
        me.warn_of_leftover_holds().await;
        // Holds the consumer only while it looks: a consumer whose task was
        // dropped (aborted) must not stay in the group, its partitions
        // assigned and never fetched, through a watcher that outlived it.
        let watcher = tokio::spawn(Self::watch_database(Arc::downgrade(&me), shutdown.clone()));
        let result = me.run_loop(&shutdown).await;
        watcher.abort();
        if result.is_ok() {
            me.commit_all(CommitMode::Sync);
        }
        me.leave_group().await;
        info!(consumer = %me.settings.name, "inbox consumer stopped");
        result
    }

    /// Unsubscribe and serve the revocation before the consumer is dropped.
    /// Closing with the unassignment still in flight can trip librdkafka's
    /// assertion that nothing is assigned at termination
    /// (`rd_kafka_cgrp_terminated`, librdkafka issue 4027): an abort on an
    /// orderly stop. Records received meanwhile are dropped: nothing after
    /// the last commit is acknowledged, so they come again.
    async fn leave_group(&self) {
        self.consumer.unsubscribe();
        let end = tokio::time::Instant::now() + Duration::from_secs(10);
        while self.consumer.assignment().is_ok_and(|a| a.count() > 0) && tokio::time::Instant::now() < end {
            let _ = tokio::time::timeout(Duration::from_millis(100), self.consumer.recv()).await;
        }
    }

    /// Once a partition's task meets the database down, ask it every 250 ms
    /// until it answers, then wake every task waiting for it (C15: every
    /// partition moves within seconds of the database's return, however long
    /// the outage grew their backoffs).
    async fn watch_database(me: std::sync::Weak<Self>, shutdown: CancellationToken) {
        loop {
            let Some(this) = me.upgrade() else { return };
            let down = tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = this.db_down.notified() => true,
                // Let go of the consumer now and then: it may be gone.
                _ = tokio::time::sleep(Duration::from_secs(1)) => false,
            };
            if !down {
                continue;
            }
            loop {
                let ask = async {
                    let mut conn = this.pool.acquire().await?;
                    sqlx::query("SELECT 1").execute(&mut *conn).await
                };
                if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(1), ask).await {
                    info!(consumer = %this.settings.name, "the database answers again; waking the partitions waiting for it");
                    this.db_back.send_modify(|n| *n += 1);
                    break;
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                }
            }
        }
    }

    /// Keys held on a topic where no route holds keys any more still hold
    /// (their records wait behind their heads): say so once at start, as an
    /// operator who took `hold_key` out may not expect it.
    async fn warn_of_leftover_holds(&self) {
        let consumer = self.processor.consumer();
        let read = async {
            let mut conn = self.pool.acquire().await?;
            relay_store::holds::count_by_topic(&mut conn, consumer).await
        };
        let Ok(Ok(counts)) = tokio::time::timeout(Duration::from_secs(5), read).await else { return };
        for (topic, keys, cut_short) in counts {
            if !self.processor.router().holds_keys_on(&topic) {
                warn!(
                    consumer,
                    topic,
                    keys,
                    "keys are held on a topic where no route has on_poison = \"hold_key\" any more: their later \
                     records keep waiting behind their heads; replay or skip those (`relay dead-letters holds`)"
                );
            }
            if cut_short > 0 {
                warn!(
                    consumer,
                    topic,
                    keys = cut_short,
                    "keys stay held behind a head that was replayed or skipped: the release was cut short (a crash \
                     between two chunks); replay or skip the head again to finish it (`relay dead-letters holds`)"
                );
            }
        }
    }

    /// Each partition is processed on a task of its own, one task per
    /// partition at a time (R13: in order), and the loop keeps receiving while
    /// tasks run: records of a busy partition wait for its task to end and
    /// then go as its next batch. No partition waits for another: not for a
    /// slower transaction (every partition once waited for the slowest, see
    /// BENCHMARKS.md; one whose batch runs over 5 s gives its waiting
    /// records back and pauses), and not for a record that is not processable yet (R19:
    /// its partition retries it with backoff for up to its budget while the
    /// others flow, holding no more than its share of the buffer).
    async fn run_loop(self: &Arc<Self>, shutdown: &CancellationToken) -> anyhow::Result<()> {
        let mut tasks: JoinSet<(TopicPartition, PartitionResult)> = JoinSet::new();
        // One schedule for the checks of held and slow partitions: a sleep
        // made anew on every turn would never end while records keep coming.
        let mut found = self.found_rx.lock().expect("probe lock").take().expect("the loop runs once");
        let mut every_second = tokio::time::interval(Duration::from_secs(1));
        every_second.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let outcome = loop {
            self.start_ready(&mut tasks, shutdown);
            let partitions = self.consumer.assignment().map_or(1, |a| a.count().max(1));
            let (room, checks, buffered) = {
                let mut s = self.state.lock().expect("partition state lock");
                s.set_assigned(partitions);
                (s.room(), s.holding() || s.running() || s.seeking(), s.buffered_bytes())
            };
            crate::runtime::metrics::buffered(&self.settings.name, buffered);
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break Ok(()),
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    let (_, run) = match done {
                        Ok(done) => done,
                        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                        Err(e) => anyhow::bail!("a partition's task was cancelled: {e}"),
                    };
                    match run {
                        Ok(run) if run.interrupted => break Ok(()),
                        Ok(run) => self.task_done(run),
                        Err(f) => break Err(f.into()),
                    }
                }
                // Every second: held partitions whose route was resumed move
                // on, and slow ones stop filling the shared buffer. Before
                // receiving in this biased select, or a steady stream of
                // records would never let it run.
                _ = every_second.tick(), if checks => {
                    self.pause_slow();
                    let seeks = self.state.lock().expect("partition state lock").seeks_due();
                    for r in seeks {
                        self.resume(r);
                    }
                    if self.state.lock().expect("partition state lock").holding() {
                        self.release_held().await;
                    }
                }
                m = self.consumer.recv(), if room => match m {
                    Ok(m) => {
                        let mut received = vec![self.take(&m)];
                        // Whatever else librdkafka has fetched already, while the bound allows.
                        let (mut records, mut bytes) = {
                            let s = self.state.lock().expect("partition state lock");
                            (s.waiting_records(), s.buffered_bytes())
                        };
                        records += 1;
                        bytes += received[0].0.size();
                        let limit = self.settings.batch_size * partitions;
                        let mut unreadable = None;
                        while records < limit && bytes < self.settings.max_buffered_bytes {
                            match self.consumer.recv().now_or_never() {
                                Some(Ok(m)) => {
                                    let r = self.take(&m);
                                    records += 1;
                                    bytes += r.0.size();
                                    received.push(r);
                                }
                                Some(Err(e)) => {
                                    unreadable = self.receive_error(&e);
                                    break;
                                }
                                None => break,
                            }
                        }
                        self.receive(received);
                        if let Some(stop) = unreadable {
                            break Err(stop);
                        }
                    }
                    Err(e) => {
                        if let Some(stop) = self.receive_error(&e) {
                            break Err(stop);
                        }
                    }
                },
                // A partition started waiting out a retry: its records left the bound.
                _ = self.waits_changed.notified() => {}
                // A batch the client cannot read was found: park it, go on after it.
                Some((generation, runs)) = found.recv() => self.park_unreadable(generation, runs),
            }
        };
        // Stopping (or a fault: "crash" only once every partition's
        // transaction in flight has ended, as when they all ended together).
        let mut fault = outcome.err();
        while let Some(done) = tasks.join_next().await {
            match done {
                Ok((_, Err(f))) => fault = fault.or(Some(f.into())),
                Ok((_, Ok(_))) => {}
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(e) => anyhow::bail!("a partition's task was cancelled: {e}"),
            }
        }
        match fault {
            Some(f) => Err(f),
            None => Ok(()),
        }
    }

    /// A receive error, and whether the consumer must stop for it.
    ///
    /// A record librdkafka cannot read must never be passed over by a later
    /// commit, and how librdkafka goes on depends on why (its msgset
    /// reader): a batch that does not decompress is fetched and reported
    /// again, without its partition or offset, so nothing after it is
    /// committed while a search finds it and it is parked as one dead
    /// letter (`ingest/unreadable.rs`); a batch it cannot parse at all (a bad
    /// message, a message format it does not know) is skipped, and the fetch
    /// goes on past it. For those the consumer stops (the process exits with
    /// the error) before it receives anything after it: a restart meets the
    /// same record again, an operator must look at the partition.
    /// A batch failing its checksum (`check.crcs`, always on) is such a bad
    /// message: it is reported, then skipped.
    fn receive_error(self: &Arc<Self>, e: &KafkaError) -> Option<anyhow::Error> {
        let code = match e {
            KafkaError::MessageConsumption(code) | KafkaError::MessageConsumptionFatal(code) => *code,
            _ => {
                warn!(consumer = %self.settings.name, error = %e, "Kafka receive error; the client reconnects by itself");
                return None;
            }
        };
        crate::runtime::metrics::receive_error(&self.settings.name, &format!("{code:?}"));
        match code {
            RDKafkaErrorCode::BadCompression => {
                error!(consumer = %self.settings.name, error = %e,
                       "a batch could not be read from Kafka; its partition stops there, nothing after it is committed, until it is found and parked");
                self.find_unreadable();
                None
            }
            RDKafkaErrorCode::BadMessage | RDKafkaErrorCode::NotImplemented => Some(anyhow::anyhow!(
                "a record could not be read from Kafka ({e}) and the client would skip it: the consumer stops \
                 rather than commit past it; inspect the partition (kafka-dump-log) before starting again"
            )),
            _ => {
                warn!(consumer = %self.settings.name, error = %e, "Kafka receive error");
                None
            }
        }
    }

    /// Look, off the runtime, for the partition whose batch cannot be read
    /// (one search at a time; its finds come back to the loop).
    fn find_unreadable(self: &Arc<Self>) {
        {
            let mut at = self.probed_at.lock().expect("probe lock");
            if at.is_some_and(|t| t.elapsed() < Duration::from_secs(5)) {
                return;
            }
            if self.probing.swap(true, std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            *at = Some(Instant::now());
        }
        let generation = self.state.lock().expect("partition state lock").generation();
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            let positions = me.positions();
            let _ = me.found.send((generation, unreadable::probe(&me.kafka, me.settings.largest_batch, &positions)));
        });
    }

    /// Where fetching stands for each assigned partition: the position
    /// (next offset to hand over), else — nothing handed over yet — the
    /// committed offset, else none (the probe starts at the earliest).
    /// Blocking: asks the broker.
    fn positions(&self) -> Vec<(TopicPartition, Option<i64>)> {
        let Ok(tpl) = self.consumer.position() else { return Vec::new() };
        let committed = self.consumer.committed(Duration::from_secs(10)).ok();
        let at = |tpl: &TopicPartitionList, tp: &TopicPartition| match tpl
            .find_partition(&tp.topic, tp.partition)
            .map(|e| e.offset())
        {
            Some(Offset::Offset(o)) => Some(o),
            _ => None,
        };
        tpl.elements()
            .iter()
            .map(|e| {
                let tp = TopicPartition::new(e.topic(), e.partition());
                let from = at(&tpl, &tp).or_else(|| committed.as_ref().and_then(|c| at(c, &tp)));
                (tp, from)
            })
            .collect()
    }

    /// Park each run of unreadable offsets (a stand-in record at its first
    /// offset, which its partition's task dead-letters in order) and fetch
    /// the partition on from the first readable offset after it.
    fn park_unreadable(&self, generation: u64, runs: Vec<Unreadable>) {
        self.probing.store(false, std::sync::atomic::Ordering::SeqCst);
        for u in runs {
            let why = format!(
                "the Kafka client could not read the batch at offsets {}..{} ({}); its records are not recoverable \
                 from the topic: inspect the broker's log segment",
                u.from,
                u.until - 1,
                u.error
            );
            if !self.state.lock().expect("partition state lock").unreadable(&u.tp, generation, u.from, u.until, why) {
                continue;
            }
            error!(consumer = %self.settings.name, topic = %u.tp.topic, partition = u.tp.partition, from = u.from, until = u.until,
                   "a batch the Kafka client cannot read is parked as a dead letter; the partition goes on after it");
            if let Err(e) =
                self.consumer.seek(&u.tp.topic, u.tp.partition, Offset::Offset(u.until), Duration::from_secs(1))
            {
                // Paused and sought again every second, as a resume's failed
                // seek is: the state already stands after the batch.
                warn!(consumer = %self.settings.name, error = %e, "seeking past an unreadable batch failed; tried again");
                self.state
                    .lock()
                    .expect("partition state lock")
                    .seek_failed(Resume { tp: u.tp.clone(), seek: Some(u.until) });
                self.pause(std::slice::from_ref(&u.tp));
            }
        }
    }

    /// File received records with their partitions (dropped when their
    /// partition was revoked since they were fetched, or is paused).
    fn receive(&self, received: Vec<(RawRecord, u64)>) {
        // Counted per receive and topic, not per record: a metric update
        // hashes its labels.
        let mut by_topic: BTreeMap<&str, u64> = BTreeMap::new();
        for (record, _) in &received {
            *by_topic.entry(record.topic.as_str()).or_default() += 1;
        }
        for (topic, n) in by_topic {
            crate::runtime::metrics::records_received(&self.settings.name, topic, n);
        }
        let mut s = self.state.lock().expect("partition state lock");
        for (record, generation) in received {
            let (tp, offset) = (TopicPartition::new(&record.topic, record.partition), record.offset);
            if s.receive(record, generation) == Filed::Dropped {
                debug!(topic = %tp.topic, partition = tp.partition, offset, "a fetched record dropped: its partition is revoked or paused, it is fetched again");
            }
        }
    }

    /// Start a task for every partition with waiting records and none running.
    fn start_ready(
        self: &Arc<Self>,
        tasks: &mut JoinSet<(TopicPartition, PartitionResult)>,
        shutdown: &CancellationToken,
    ) {
        let starts = self.state.lock().expect("partition state lock").start_ready();
        for start in starts {
            let (me, shutdown) = (self.clone(), shutdown.clone());
            tasks.spawn(async move {
                let tp = start.tp.clone();
                let run = me.process_partition(start, &shutdown).await;
                (tp, run)
            });
        }
    }

    /// A partition's task ended: pause it at the broker if it is held at a
    /// paused route, resume it (from where its records were dropped) if it
    /// was paused while its task waited out a retry.
    fn task_done(&self, run: PartitionRun) {
        let done = self.state.lock().expect("partition state lock").task_done(&run.tp, run.generation, run.held);
        match done {
            Done::Nothing => {}
            Done::Pause => {
                self.pause(&[run.tp]);
            }
            Done::Resume(r) => self.resume(r),
        }
    }

    /// Pause fetching `tps` at the broker, as the partition state decided.
    /// A revoke and a new assignment may have come between that decision
    /// and this call (the assignment resumed the partition, this would
    /// pause it for good): what the state no longer has paused is resumed.
    fn pause(&self, tps: &[TopicPartition]) {
        if let Err(e) = self.consumer.pause(&tpl_of(tps)) {
            warn!(error = %e, "pausing fetches failed; the partition's records are fetched and dropped meanwhile");
        }
        let undone: Vec<TopicPartition> = {
            let s = self.state.lock().expect("partition state lock");
            tps.iter().filter(|tp| !s.is_paused(tp)).cloned().collect()
        };
        if !undone.is_empty() {
            let _ = self.consumer.resume(&tpl_of(&undone));
        }
    }

    /// Fetch `r.tp` again, from `r.seek` if records of it were dropped.
    fn resume(&self, r: Resume) {
        let TopicPartition { topic, partition } = &r.tp;
        if let Some(offset) = r.seek
            && let Err(e) = self.consumer.seek(topic, *partition, Offset::Offset(offset), Duration::from_secs(1))
        {
            // Without the seek, fetching would go on past the dropped
            // records: the partition stays paused and the seek is tried
            // again every second (R1).
            warn!(consumer = %self.settings.name, topic = %topic, partition, offset, error = %e,
                  "seeking back to records dropped while the partition waited failed; it stays paused and the seek is tried again");
            self.state.lock().expect("partition state lock").seek_failed(r);
            return;
        }
        if let Err(e) = self.consumer.resume(&tpl_of([&r.tp])) {
            warn!(consumer = %self.settings.name, error = %e, "resuming fetches failed");
        }
    }

    /// Partitions whose task has run one batch for over [`SLOW_TASK`] give
    /// their waiting records back and pause, as if waiting out a retry.
    fn pause_slow(&self) {
        let slow = self.state.lock().expect("partition state lock").slow(Instant::now(), SLOW_TASK);
        if slow.is_empty() {
            return;
        }
        warn!(consumer = %self.settings.name, partitions = slow.len(),
              "a partition's transaction has run for over {}s; its partition is paused until it ends, so the others keep the buffer", SLOW_TASK.as_secs());
        self.pause(&slow);
        self.waits_changed.notify_one();
    }

    /// Held partitions whose route was resumed fetch again from where they were held.
    async fn release_held(&self) {
        // Bounded, so a database that is down never holds up the loop.
        let read = async {
            let mut conn = self.pool.acquire().await?;
            relay_store::ops::paused_routes(&mut conn, &self.settings.name).await
        };
        let routes: Vec<String> = match tokio::time::timeout(Duration::from_millis(500), read).await {
            Ok(Ok(routes)) => routes.into_iter().collect(),
            _ => return,
        };
        let released = self.state.lock().expect("partition state lock").release(&routes);
        if !released.is_empty() {
            info!(consumer = %self.settings.name, partitions = released.len(), "held partitions resumed");
        }
        for r in released {
            self.resume(r);
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
        (record, self.state.lock().expect("partition state lock").generation())
    }

    /// Store and commit `next` as the end of `tp`'s processed prefix, which
    /// finished records of `bytes`. Called after every database commit, so
    /// progress before a stuck record is committed while the record waits.
    /// Not for a partition revoked since `generation` (when its task
    /// started): the revoke committed what was done before it, the new owner
    /// starts there, and what this task recorded since is a duplicate to the
    /// inbox when the new owner meets it.
    fn advance(&self, tp: &TopicPartition, generation: u64, next: i64, bytes: usize, mode: CommitMode) {
        if !self.state.lock().expect("partition state lock").advance(tp, generation, next, bytes) {
            return;
        }
        let mut tpl = TopicPartitionList::new();
        if tpl.add_partition_offset(&tp.topic, tp.partition, Offset::Offset(next)).is_err() {
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
        for (tp, next) in self.state.lock().expect("partition state lock").next_offsets() {
            let _ = tpl.add_partition_offset(&tp.topic, tp.partition, Offset::Offset(next));
        }
        if tpl.count() > 0
            && let Err(e) = self.consumer.commit(&tpl, mode)
        {
            warn!(consumer = %self.settings.name, error = %e, "final offset commit failed; records will be redelivered and deduplicated");
        }
    }

    /// Everything logged while a partition's records are worked through
    /// (a database error, a record waiting, …) names the partition.
    #[tracing::instrument(name = "partition", skip_all, fields(consumer = %self.settings.name, topic = %start.tp.topic, partition = start.tp.partition))]
    async fn process_partition(&self, start: Start, shutdown: &CancellationToken) -> PartitionResult {
        let Start { tp, records, generation, revoke, not_yet } = start;
        let mut run = PartitionRun { tp: tp.clone(), generation, interrupted: false, held: None };
        let mut i = 0;
        let mut row = InARow { not_yet, ..InARow::default() };
        let mut rng = StdRng::from_os_rng();
        let max_attempts = self.settings.reference_retry.max_attempts;
        while i < records.len() {
            // A return of the database after this attempt starts wakes its wait.
            let mut db_back = self.db_back.subscribe();
            if self.revoked(&tp, generation) {
                // R13: stop taking work for it; the new owner starts at the committed offset.
                debug!(topic = %tp.topic, partition = tp.partition, left = records.len() - i, "partition revoked; its remaining records are left to the new owner");
                return Ok(run);
            }
            // A stand-in for a batch the client could not read: parked alone.
            if let Some((until, why)) = self.unreadable_at(&tp, &records[i]) {
                match self.park_stand_in(&records[i], until, why, &tp, generation).await {
                    Ok(()) => i += 1,
                    Err(ParkError::Fault(f)) => return Err(f),
                    Err(ParkError::Db(e)) => {
                        let Next::Wait(_, n) = next(&Ended::Database, &mut row, max_attempts, false) else { continue };
                        let wait = self.db_unavailable(&e, n, &mut rng);
                        tokio::select! {
                            _ = shutdown.cancelled() => { run.interrupted = true; return Ok(run); }
                            _ = revoke.cancelled() => {}
                            _ = db_back.changed() => {}
                            _ = tokio::time::sleep(wait) => {}
                        }
                    }
                }
                continue;
            }
            let batch_end = records.len().min(i + self.settings.batch_size);
            let end = (i + 1..batch_end).find(|&j| self.unreadable_at(&tp, &records[j]).is_some()).unwrap_or(batch_end);
            let (ended, stopped, mut failure) = match self.run_batch(&tp, generation, &records[i..end]).await {
                Ok(BatchRun { done, stopped, paused }) => {
                    if done > 0 {
                        let bytes = records[i..i + done].iter().map(RawRecord::size).sum();
                        i += done;
                        self.advance(&tp, generation, records[i - 1].offset + 1, bytes, CommitMode::Async);
                    }
                    (Ended::Ran { done, paused, not_yet: stopped.is_some() }, stopped, None)
                }
                Err(BatchError::Fault(f)) => return Err(f),
                Err(BatchError::Db(e)) => (Ended::Database, None, Some(BatchError::Db(e))),
                Err(BatchError::Registry(why)) => (Ended::Registry, None, Some(BatchError::Registry(why))),
            };
            let mut decided = next(&ended, &mut row, max_attempts, self.revoked(&tp, generation));
            if let (Ended::Ran { not_yet: true, .. }, Some((poison, _)), false) =
                (&ended, &stopped, matches!(decided, Next::Hold(_)))
            {
                crate::runtime::metrics::not_yet(&self.settings.name, poison.class.as_str());
                // Kept beside the partition, so a new task (after a
                // rebalance that gives it back) goes on counting.
                self.state.lock().expect("partition state lock").not_yet(&tp, records[i].offset, row.not_yet);
            }
            if decided == Next::Park {
                let (poison, route) = stopped.as_ref().expect("a record stopped the batch");
                match self.park_spent(&records[i], poison, route.as_deref(), row.not_yet, &tp, generation).await {
                    Ok(()) => {
                        i += 1;
                        decided = next(&Ended::Parked, &mut row, max_attempts, false);
                    }
                    Err(ParkError::Fault(f)) => return Err(f),
                    Err(ParkError::Db(e)) => {
                        decided = next(&Ended::Database, &mut row, max_attempts, false);
                        failure = Some(BatchError::Db(e));
                    }
                }
            }
            let (wait_for, n) = match decided {
                Next::Go => continue,
                Next::Leave => return Ok(run),
                Next::Park => unreachable!("parked above"),
                Next::Hold(route) => {
                    // Hold this partition from here; the other partitions keep flowing.
                    warn!(consumer = %self.settings.name, topic = %tp.topic, partition = tp.partition, offset = records[i].offset,
                          route = %route, "route is paused: this partition is held at its next event of the route until it is resumed");
                    run.held = Some((route, records[i].offset));
                    return Ok(run);
                }
                Next::Wait(wait_for, n) => (wait_for, n),
            };
            let wait = match (wait_for, failure) {
                (WaitFor::Database, Some(BatchError::Db(e))) => self.db_unavailable(&e, n, &mut rng),
                (WaitFor::Registry, Some(BatchError::Registry(why))) => {
                    self.registry_unavailable(&tp, &records[i], n, &why, &mut rng)
                }
                (_, _) => {
                    let poison = stopped.as_ref().map(|(p, _)| p);
                    self.not_processable_yet(&records[i], poison, n, &mut rng)
                }
            };
            if self.wait(&tp, generation, wait, wait_for == WaitFor::Database, &revoke, shutdown, &mut db_back).await {
                run.interrupted = true;
                return Ok(run);
            }
        }
        Ok(run)
    }

    /// Whether `tp` was revoked since generation `generation`.
    fn revoked(&self, tp: &TopicPartition, generation: u64) -> bool {
        self.state.lock().expect("partition state lock").revoked_since(tp, generation)
    }

    /// Where an unreadable batch's stand-in `record` stands for, if it is one.
    fn unreadable_at(&self, tp: &TopicPartition, record: &RawRecord) -> Option<(i64, String)> {
        self.state.lock().expect("partition state lock").unreadable_at(tp, record.offset)
    }

    /// Park the stand-in of a batch the client could not read, and commit
    /// past the whole batch: a new owner starting inside it would park the
    /// same loss again.
    async fn park_stand_in(
        &self,
        record: &RawRecord,
        until: i64,
        why: String,
        tp: &TopicPartition,
        generation: u64,
    ) -> Result<(), ParkError> {
        self.park_alone(record, &Poison::new(PoisonClass::Unreadable, why), 1, None).await?;
        crate::runtime::metrics::dead_lettered(&self.settings.name, &record.topic, PoisonClass::Unreadable.as_str());
        self.advance(tp, generation, until, record.size(), CommitMode::Async);
        Ok(())
    }

    /// Park `record`, not processable yet after `attempts`, and go past it.
    async fn park_spent(
        &self,
        record: &RawRecord,
        poison: &Poison,
        route: Option<&str>,
        attempts: u32,
        tp: &TopicPartition,
        generation: u64,
    ) -> Result<(), ParkError> {
        self.park_alone(record, poison, attempts, route).await?;
        // The records after it naming the same missing schema need no budget each.
        self.processor.decoder().gave_up(record);
        crate::runtime::metrics::dead_lettered(&self.settings.name, &record.topic, poison.class.as_str());
        warn!(
            consumer = %self.settings.name, topic = %record.topic, partition = record.partition,
            offset = record.offset, event_id = poison.event_id.as_deref().unwrap_or(""),
            error_class = %poison.class, attempts,
            "record parked after its retry budget: {}", poison.reason
        );
        self.advance(tp, generation, record.offset + 1, record.size(), CommitMode::Async);
        Ok(())
    }

    /// How long to wait for `record`, not processable yet at its `n`-th attempt.
    fn not_processable_yet(&self, record: &RawRecord, poison: Option<&Poison>, n: u32, rng: &mut StdRng) -> Duration {
        let s = &self.settings;
        let delay = WaitFor::NotYet.delay(n, &s.database_backoff, &s.reference_retry.backoff, rng);
        let (event_id, class, reason) =
            poison.map_or(("", "", ""), |p| (p.event_id.as_deref().unwrap_or(""), p.class.as_str(), p.reason.as_str()));
        warn!(
            consumer = %s.name, topic = %record.topic, partition = record.partition,
            offset = record.offset, event_id, error_class = class, attempt = n,
            retry_in_ms = delay.as_millis() as u64,
            "record not processable yet; the partition waits for it: {reason}"
        );
        delay
    }

    /// How long to wait for the Schema Registry, its `n`-th failure in a row.
    fn registry_unavailable(
        &self,
        tp: &TopicPartition,
        record: &RawRecord,
        n: u32,
        why: &str,
        rng: &mut StdRng,
    ) -> Duration {
        let s = &self.settings;
        let delay = WaitFor::Registry.delay(n, &s.database_backoff, &s.reference_retry.backoff, rng);
        crate::runtime::metrics::registry_unavailable(&s.name, &tp.topic);
        warn!(
            consumer = %s.name, topic = %tp.topic, partition = tp.partition, offset = record.offset,
            attempt = n, retry_in_ms = delay.as_millis() as u64,
            "the Schema Registry could not be asked; nothing was written for this batch and the \
             partition waits for it (a registry outage never dead-letters a record): {why}"
        );
        delay
    }

    /// Wait `wait` before the partition's next try, or until the database is
    /// back (`for_database`), the partition is revoked or the consumer stops
    /// (then `true`). Meanwhile what else is buffered for the partition is
    /// dropped and it is paused at the broker, so it holds no more than its
    /// batch.
    #[allow(clippy::too_many_arguments)]
    async fn wait(
        &self,
        tp: &TopicPartition,
        generation: u64,
        wait: Duration,
        for_database: bool,
        revoke: &CancellationToken,
        shutdown: &CancellationToken,
        db_back: &mut tokio::sync::watch::Receiver<u64>,
    ) -> bool {
        if self.state.lock().expect("partition state lock").wait_out(tp, generation) {
            self.pause(std::slice::from_ref(tp));
        }
        self.waits_changed.notify_one();
        tokio::select! {
            _ = shutdown.cancelled() => true,
            // Revoked: the loop's next turn sees it and leaves the records to the new owner.
            _ = revoke.cancelled() => false,
            _ = db_back.changed(), if for_database => false,
            _ = tokio::time::sleep(wait) => false,
        }
    }

    fn db_unavailable(&self, e: &sqlx::Error, failures: u32, rng: &mut StdRng) -> Duration {
        let s = &self.settings;
        let delay = WaitFor::Database.delay(failures, &s.database_backoff, &s.reference_retry.backoff, rng);
        // The database gone (a connection error, an admin shutdown, no
        // resources), not a conflict between transactions: watch for its return.
        let gone = match e {
            sqlx::Error::Database(db) => db.code().is_some_and(|c| ["08", "53", "57"].iter().any(|p| c.starts_with(p))),
            _ => true,
        };
        if gone {
            self.db_down.notify_one();
        }
        if matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03")) {
            warn!(
                consumer = %self.settings.name, error = %e, attempt = failures, retry_in_ms = delay.as_millis() as u64,
                "this batch waited over 5 s for a lock another transaction holds (an application's open \
                 transaction that called relay.call or relay.publish with an ordering key, or wrote a row this \
                 batch writes); rolled back and retried. Set idle_in_transaction_session_timeout for \
                 application roles"
            );
            return delay;
        }
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
        let max = self.pool.options().get_max_connections();
        if matches!(e, sqlx::Error::PoolTimedOut) && self.pool.size() >= max {
            // Not an outage: more partitions (and dispatcher work) than
            // connections, each waiting its turn.
            warn!(
                consumer = %self.settings.name, attempt = failures, retry_in_ms = delay.as_millis() as u64,
                "every one of the {max} database connections was busy for database.acquire_timeout; this partition \
                 waits its turn (raise database.max_connections to at least the partitions this process may own \
                 plus the dispatcher's work)"
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
    async fn run_batch(
        &self,
        tp: &TopicPartition,
        generation: u64,
        records: &[RawRecord],
    ) -> Result<BatchRun, BatchError> {
        // Values in a Schema Registry format are decoded first, with no
        // connection or transaction held while the registry is asked; the
        // JSON they decode to counts against the partition's share of
        // max_buffered_bytes, as their bytes did, and the batch ends where
        // it is spent (the loop goes on with the rest).
        let share = self.state.lock().expect("partition state lock").share();
        let views = self.processor.decoder().views_within(records, share).await.map_err(BatchError::Registry)?;
        let records = &records[..views.len()];
        let mut conn = self.pool.acquire().await?;
        // A pause applies to every batch that starts after it was recorded:
        // read on the batch's own connection, in its task (never in the
        // receive loop, which a slow pool would hold up).
        let read_at = Instant::now();
        let gates =
            relay_store::ops::batch_gates(&mut conn, self.processor.consumer(), &tp.topic, tp.partition).await?;
        self.processor.paused().set_as_of(gates.paused, read_at);
        let mut tx = conn.begin_with(relay_store::BEGIN_BOUNDED).await?;
        let started = Instant::now();
        // Intents written already claimed by this process's dispatcher: handed
        // over after the commit, dropped (room given back) if there is none.
        let mut held = Vec::new();
        let processed = match self
            .processor
            .process_batch_first(&mut tx, records, &views, share, gates.keys_held, &mut held)
            .await?
        {
            Some(processed) => processed,
            None => {
                // The batch's first run was rejected; it was all the
                // transaction held. Again, with a savepoint around each run.
                tx.rollback().await?;
                held.clear();
                tx = conn.begin_with(relay_store::BEGIN_BOUNDED).await?;
                self.processor.process_batch(&mut tx, records, &views, share, gates.keys_held, &mut held).await?
            }
        };
        let (mut stopped, mut paused) = (None, None);
        for (record, p) in records.iter().zip(&processed) {
            match &p.disposition {
                Disposition::DeadLetter(poison) | Disposition::Held(poison) => {
                    crate::ingest::park::park(
                        &mut tx,
                        self.processor.router(),
                        record,
                        poison,
                        1,
                        p.info.route.as_deref(),
                    )
                    .await?;
                }
                Disposition::RetryLater(poison) => stopped = Some((poison.clone(), p.info.route.clone())),
                Disposition::Paused { route } => paused = Some(route.clone()),
                _ => {}
            }
        }
        let done = processed.len() - usize::from(stopped.is_some() || paused.is_some());
        let took = started.elapsed() / u32::try_from(processed.len().max(1)).unwrap_or(1);
        if self.faults.sabotage().has(Sabotage::OffsetBeforeCommit) && done > 0 {
            // Deliberately wrong (R1): the offset goes out before the data is safe.
            self.advance(tp, generation, records[done - 1].offset + 1, 0, CommitMode::Sync);
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

    async fn park_alone(
        &self,
        record: &RawRecord,
        poison: &Poison,
        attempts: u32,
        route: Option<&str>,
    ) -> Result<(), ParkError> {
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin_with(relay_store::BEGIN_BOUNDED).await?;
        crate::ingest::park::park(&mut tx, self.processor.router(), record, poison, attempts, route).await?;
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
        if let Disposition::Held(_) = &p.disposition {
            crate::runtime::metrics::held(&self.settings.name, &record.topic);
        }
        let level = match &p.disposition {
            Disposition::Applied { .. } => Level::DEBUG,
            Disposition::Duplicate | Disposition::NoOp { .. } => Level::INFO,
            Disposition::DeadLetter(_)
            | Disposition::Held(_)
            | Disposition::RetryLater(_)
            | Disposition::Paused { .. } => Level::WARN,
        };
        let detail = match &p.disposition {
            Disposition::Applied { intents, events } => {
                format!("applied: {intents} intent(s), {events} event(s) written")
            }
            Disposition::Duplicate => "duplicate: already in the inbox, nothing written".into(),
            Disposition::NoOp { outcome, detail } => format!("{}: {detail}", outcome.as_str()),
            Disposition::DeadLetter(poison) => format!("dead-lettered ({}): {}", poison.class, poison.reason),
            Disposition::RetryLater(poison) => format!("not yet ({}): {}", poison.class, poison.reason),
            Disposition::Held(poison) => poison.reason.clone(),
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
