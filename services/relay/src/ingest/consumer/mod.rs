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
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use relay_core::RawRecord;
use relay_core::config::{KafkaConfig, RetryBudget};
use relay_core::retry::BackoffPolicy;
use sqlx::PgPool;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::ingest::partitions::{
    Done, Filed, Limits, PartitionResult, PartitionRun, Partitions, Resume, TopicPartition,
};
use crate::ingest::processor::Processor;
use crate::ingest::unreadable::{self, Unreadable};
use crate::runtime::db::bounded;
use crate::runtime::faults::{Faults, Sabotage};
use crate::runtime::kafka::consumer_config;

mod context;
mod partition;

pub use context::RelayContext;
use context::tpl_of;

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
    /// How long one batch's (or parked record's) transaction may go
    /// unanswered before relay asks whether the database still works on it.
    pub transaction_timeout: Duration,
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
        let ctx = RelayContext::new(state.clone(), settings.name.clone());
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
                let ask = bounded(&this.pool, Duration::from_secs(1), async |conn: &mut sqlx::PgConnection| {
                    sqlx::query("SELECT 1").execute(conn).await.map(drop)
                });
                if ask.await.is_ok() {
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
        let read = bounded(&self.pool, Duration::from_secs(5), async |conn: &mut sqlx::PgConnection| {
            relay_store::holds::count_by_topic(conn, consumer).await
        });
        let Ok::<Vec<(String, i64, i64)>, _>(counts) = read.await else { return };
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
            let assignment = self.consumer.assignment().ok();
            let partitions = assignment.as_ref().map_or(1, |a| a.count().max(1));
            let (room, checks, buffered) = {
                let mut s = self.state.lock().expect("partition state lock");
                s.set_assigned(partitions);
                (s.room(), s.holding() || s.running() || s.seeking(), s.buffered_bytes())
            };
            crate::runtime::metrics::buffered(&self.settings.name, buffered);
            self.pause_or_resume_for_room(assignment.as_ref());
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break Ok(()),
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    if let Some(stop) = self.task_ended(done) {
                        break stop;
                    }
                }
                // Before receiving in this biased select, or a steady stream
                // of records would never let it run.
                _ = every_second.tick(), if checks => self.check_held_and_slow().await,
                m = self.consumer.recv(), if room => {
                    let stop = match m {
                        Ok(m) => self.receive_fetched(&m, partitions),
                        Err(e) => self.receive_error(&e),
                    };
                    if let Some(stop) = stop {
                        break Err(stop);
                    }
                }
                // A partition started waiting out a retry: its records left the bound.
                _ = self.waits_changed.notified() => {}
                // A batch the client cannot read was found: park it, go on after it.
                Some((generation, runs)) = found.recv() => self.park_unreadable(generation, runs),
            }
        };
        Self::wait_for_tasks(tasks, outcome).await
    }

    /// A partition's task ended: whether the loop stops, and how.
    fn task_ended(
        &self,
        done: Result<(TopicPartition, PartitionResult), tokio::task::JoinError>,
    ) -> Option<anyhow::Result<()>> {
        let (_, run) = match done {
            Ok(done) => done,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => return Some(Err(anyhow::anyhow!("a partition's task was cancelled: {e}"))),
        };
        match run {
            Ok(run) if run.interrupted => Some(Ok(())),
            Ok(run) => {
                self.task_done(run);
                None
            }
            Err(f) => Some(Err(f.into())),
        }
    }

    /// Every second: held partitions whose route was resumed move on, seeks
    /// that failed are tried again, and slow partitions stop filling the
    /// shared buffer.
    async fn check_held_and_slow(&self) {
        self.pause_slow();
        let seeks = self.state.lock().expect("partition state lock").seeks_due();
        for r in seeks {
            self.resume(r);
        }
        if self.state.lock().expect("partition state lock").holding() {
            self.release_held().await;
        }
    }

    /// File `first` and whatever else librdkafka has fetched already, while
    /// the bound allows; the error to stop on, if one came.
    fn receive_fetched(self: &Arc<Self>, first: &BorrowedMessage<'_>, partitions: usize) -> Option<anyhow::Error> {
        let mut received = vec![self.take(first)];
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
        unreadable
    }

    /// Stopping (or a fault: "crash" only once every partition's
    /// transaction in flight has ended, as when they all ended together).
    async fn wait_for_tasks(
        mut tasks: JoinSet<(TopicPartition, PartitionResult)>,
        outcome: anyhow::Result<()>,
    ) -> anyhow::Result<()> {
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
        if self.state.lock().expect("partition state lock").is_room_paused(&r.tp) {
            return;
        }
        if let Err(e) = self.consumer.resume(&tpl_of([&r.tp])) {
            warn!(consumer = %self.settings.name, error = %e, "resuming fetches failed");
        }
    }

    /// Pause every assigned partition at the broker while the bytes
    /// buffered are at their bound, and let them fetch again once down to
    /// half ([`Partitions::pause_for_room`]).
    fn pause_or_resume_for_room(&self, assignment: Option<&TopicPartitionList>) {
        if self.faults.sabotage().has(Sabotage::ReadAheadPastFullBuffer) {
            return;
        }
        let (pause, resume) = {
            let mut s = self.state.lock().expect("partition state lock");
            let assigned = match assignment {
                Some(a) if s.full() => context::tps(a),
                _ => Vec::new(),
            };
            (s.pause_for_room(&assigned), s.resume_for_room())
        };
        if !pause.is_empty() {
            debug!(consumer = %self.settings.name, partitions = pause.len(), "buffer full: fetching paused");
            if let Err(e) = self.consumer.pause(&tpl_of(&pause)) {
                warn!(consumer = %self.settings.name, error = %e, "pausing fetches while the buffer is full failed");
            }
        }
        if !resume.is_empty() {
            debug!(consumer = %self.settings.name, partitions = resume.len(), "buffer half empty: fetching again");
            if let Err(e) = self.consumer.resume(&tpl_of(&resume)) {
                warn!(consumer = %self.settings.name, error = %e, "resuming fetches failed");
            }
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
        let name = &self.settings.name;
        let read = bounded(&self.pool, Duration::from_millis(500), async |conn: &mut sqlx::PgConnection| {
            relay_store::ops::paused_routes(conn, name).await
        });
        let routes: Vec<String> = match read.await {
            Ok(routes) => routes.into_iter().collect(),
            Err(_) => return,
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
}
