//! One partition's records worked through on a task of its own: batches in
//! transactions, "not yet" records waited out and parked when their budget
//! is spent, the database waited out, each record logged.

use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::rngs::StdRng;
use rdkafka::consumer::CommitMode;
use relay_core::{Disposition, Poison, PoisonClass, RawRecord};
use sqlx::{Connection, PgConnection};
use std::sync::atomic::{AtomicI32, Ordering};
use tokio_util::sync::CancellationToken;
use tracing::{Level, debug, error, warn};

use super::InboxConsumer;
use crate::deliver::handoff::Handed;
use crate::ingest::decode::View;
use crate::ingest::next::{Ended, InARow, Next, WaitFor, next};
use crate::ingest::partitions::{PartitionResult, PartitionRun, Start, TopicPartition};
use crate::ingest::processor::Processed;
use crate::runtime::db;
use crate::runtime::faults::{FaultInjected, Sabotage, point};

/// A batch to write: records of one partition, in order, with their decoded views.
struct Batch<'a> {
    tp: &'a TopicPartition,
    generation: u64,
    records: &'a [RawRecord],
    views: &'a [View],
    share: usize,
    /// The connection's server process, once known (0 until then).
    pid: &'a AtomicI32,
}

/// What a batch's committed transaction did.
struct Written {
    processed: Vec<Processed>,
    /// Intents written claimed, for the dispatcher beside this consumer.
    held: Vec<Handed>,
    stopped: Option<(Poison, Option<String>)>,
    paused: Option<String>,
    done: usize,
    /// Time per record.
    took: Duration,
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

/// One partition task: its records, where it is in them, and its counts.
struct Task {
    tp: TopicPartition,
    generation: u64,
    /// Cancelled when the partition is revoked.
    revoke: CancellationToken,
    records: Vec<RawRecord>,
    /// The next record to work on.
    at: usize,
    row: InARow,
    rng: StdRng,
    run: PartitionRun,
}

impl Task {
    fn new(start: Start) -> Task {
        let Start { tp, records, generation, revoke, not_yet } = start;
        let run = PartitionRun { tp: tp.clone(), generation, interrupted: false, held: None };
        let row = InARow { not_yet, ..InARow::default() };
        Task { tp, generation, revoke, records, at: 0, row, rng: StdRng::from_os_rng(), run }
    }
}

/// What a partition task does after a step.
enum Step {
    /// Work on from the next record.
    Go,
    /// End the task (revoked, or held at a paused route).
    Leave,
    /// Wait in place, then try the same record again (the database was down
    /// while parking a stand-in).
    Retry(Duration),
    /// Give the waiting records back and wait this long (cut short by the
    /// database's return when `for_database`), then try again.
    WaitOut { wait: Duration, for_database: bool },
}

impl InboxConsumer {
    /// Everything logged while a partition's records are worked through
    /// (a database error, a record waiting, …) names the partition.
    #[tracing::instrument(name = "partition", skip_all, fields(consumer = %self.settings.name, topic = %start.tp.topic, partition = start.tp.partition))]
    pub(super) async fn process_partition(&self, start: Start, shutdown: &CancellationToken) -> PartitionResult {
        let mut t = Task::new(start);
        while t.at < t.records.len() {
            // A return of the database after this attempt starts wakes its wait.
            let mut db_back = self.db_back.subscribe();
            if self.revoked(&t.tp, t.generation) {
                // R13: stop taking work for it; the new owner starts at the committed offset.
                debug!(topic = %t.tp.topic, partition = t.tp.partition, left = t.records.len() - t.at, "partition revoked; its remaining records are left to the new owner");
                return Ok(t.run);
            }
            let step = match self.unreadable_at(&t.tp, &t.records[t.at]) {
                // A stand-in for a batch the client could not read: parked alone.
                Some((until, why)) => self.stand_in_step(&mut t, until, why).await?,
                None => self.batch_step(&mut t).await?,
            };
            let interrupted = match step {
                Step::Go => false,
                Step::Leave => return Ok(t.run),
                Step::Retry(wait) => tokio::select! {
                    _ = shutdown.cancelled() => true,
                    _ = t.revoke.cancelled() => false,
                    _ = db_back.changed() => false,
                    _ = tokio::time::sleep(wait) => false,
                },
                Step::WaitOut { wait, for_database } => {
                    self.wait(&t.tp, t.generation, wait, for_database, &t.revoke, shutdown, &mut db_back).await
                }
            };
            if interrupted {
                t.run.interrupted = true;
                return Ok(t.run);
            }
        }
        Ok(t.run)
    }

    /// Park the stand-in at `t`'s record for the batch the client could not
    /// read; with the database down, wait (in place) and try again.
    async fn stand_in_step(&self, t: &mut Task, until: i64, why: String) -> Result<Step, FaultInjected> {
        match self.park_stand_in(&t.records[t.at], until, why, &t.tp, t.generation).await {
            Ok(()) => {
                t.at += 1;
                Ok(Step::Go)
            }
            Err(ParkError::Fault(f)) => Err(f),
            Err(ParkError::Db(e)) => {
                let max_attempts = self.settings.reference_retry.max_attempts;
                let Next::Wait(_, n) = next(&Ended::Database, &mut t.row, max_attempts, false) else {
                    return Ok(Step::Go);
                };
                Ok(Step::Retry(self.db_unavailable(&e, n, &mut t.rng)))
            }
        }
    }

    /// Run `t`'s next batch (up to the next stand-in), advance the offset
    /// past what it finished, and decide what comes next (`ingest/next.rs`).
    async fn batch_step(&self, t: &mut Task) -> Result<Step, FaultInjected> {
        let max_attempts = self.settings.reference_retry.max_attempts;
        let (tp, generation, i) = (t.tp.clone(), t.generation, t.at);
        let batch_end = t.records.len().min(i + self.settings.batch_size);
        let end = (i + 1..batch_end).find(|&j| self.unreadable_at(&tp, &t.records[j]).is_some()).unwrap_or(batch_end);
        let (ended, stopped, mut failure) = match self.run_batch(&tp, generation, &t.records[i..end]).await {
            Ok(BatchRun { done, stopped, paused }) => {
                if done > 0 {
                    let bytes = t.records[i..i + done].iter().map(RawRecord::size).sum();
                    t.at += done;
                    self.advance(&tp, generation, t.records[t.at - 1].offset + 1, bytes, CommitMode::Async);
                }
                (Ended::Ran { done, paused, not_yet: stopped.is_some() }, stopped, None)
            }
            Err(BatchError::Fault(f)) => return Err(f),
            Err(BatchError::Db(e)) => (Ended::Database, None, Some(BatchError::Db(e))),
            Err(BatchError::Registry(why)) => (Ended::Registry, None, Some(BatchError::Registry(why))),
        };
        let mut decided = next(&ended, &mut t.row, max_attempts, self.revoked(&tp, generation));
        if let (Ended::Ran { not_yet: true, .. }, Some((poison, _)), false) =
            (&ended, &stopped, matches!(decided, Next::Hold(_)))
        {
            crate::runtime::metrics::not_yet(&self.settings.name, poison.class.as_str());
            // Kept beside the partition, so a new task (after a rebalance
            // that gives it back) goes on counting.
            self.state.lock().expect("partition state lock").not_yet(&tp, t.records[t.at].offset, t.row.not_yet);
        }
        if decided == Next::Park {
            let (poison, route) = stopped.as_ref().expect("a record stopped the batch");
            match self.park_spent(&t.records[t.at], poison, route.as_deref(), t.row.not_yet, &tp, generation).await {
                Ok(()) => {
                    t.at += 1;
                    decided = next(&Ended::Parked, &mut t.row, max_attempts, false);
                }
                Err(ParkError::Fault(f)) => return Err(f),
                Err(ParkError::Db(e)) => {
                    decided = next(&Ended::Database, &mut t.row, max_attempts, false);
                    failure = Some(BatchError::Db(e));
                }
            }
        }
        let (wait_for, n) = match decided {
            Next::Go => return Ok(Step::Go),
            Next::Leave => return Ok(Step::Leave),
            Next::Park => unreachable!("parked above"),
            Next::Hold(route) => {
                // Hold this partition from here; the other partitions keep flowing.
                let offset = t.records[t.at].offset;
                warn!(consumer = %self.settings.name, topic = %tp.topic, partition = tp.partition, offset,
                      route = %route, "route is paused: this partition is held at its next event of the route until it is resumed");
                t.run.held = Some((route, offset));
                return Ok(Step::Leave);
            }
            Next::Wait(wait_for, n) => (wait_for, n),
        };
        let record = &t.records[t.at];
        let wait = match (wait_for, failure) {
            (WaitFor::Database, Some(BatchError::Db(e))) => self.db_unavailable(&e, n, &mut t.rng),
            (WaitFor::Registry, Some(BatchError::Registry(why))) => {
                self.registry_unavailable(&tp, record, n, &why, &mut t.rng)
            }
            (_, _) => {
                let poison = stopped.as_ref().map(|(p, _)| p);
                self.not_processable_yet(record, poison, n, &mut t.rng)
            }
        };
        Ok(Step::WaitOut { wait, for_database: wait_for == WaitFor::Database })
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
        let max = self.pool.options().get_max_connections();
        // Every connection busy is a pool too small, not a database gone.
        let saturated = matches!(e, sqlx::Error::PoolTimedOut) && self.pool.size() >= max;
        let gone = !saturated
            && match e {
                sqlx::Error::Database(db) => {
                    db.code().is_some_and(|c| ["08", "53", "57"].iter().any(|p| c.starts_with(p)))
                }
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
        if saturated {
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
        let conn = self.pool.acquire().await?;
        let pid = AtomicI32::new(0);
        let batch = Batch { tp, generation, records, views: &views, share, pid: &pid };
        let write = async |c: &mut PgConnection| self.write_batch(c, batch).await;
        let limit = self.settings.transaction_timeout;
        let written = db::watched(&self.pool, conn, limit, &pid, |l| self.running_long(tp, l), write)
            .await
            .map_err(BatchError::Db)??;
        let Written { processed, held, stopped, paused, done, took } = written;
        if let Some(handoff) = self.processor.handoff() {
            handoff.send(&self.pool, held).await;
        }
        for (record, p) in records.iter().zip(&processed).take(done) {
            self.log_record(record, p, took);
        }
        Ok(BatchRun { done, stopped, paused })
    }

    /// Write `b`'s records in one transaction on `conn`, and commit it.
    async fn write_batch(&self, conn: &mut PgConnection, b: Batch<'_>) -> Result<Written, BatchError> {
        let (tp, records, views, share) = (b.tp, b.records, b.views, b.share);
        // A pause applies to every batch that starts after it was recorded:
        // read on the batch's own connection, in its task (never in the
        // receive loop, which a slow pool would hold up).
        let read_at = Instant::now();
        let gates =
            relay_store::ops::batch_gates(&mut *conn, self.processor.consumer(), &tp.topic, tp.partition).await?;
        b.pid.store(gates.pid, Ordering::Relaxed);
        self.processor.paused().set_as_of(gates.paused, read_at);
        let mut tx = conn.begin_with(relay_store::BEGIN_BOUNDED).await?;
        let started = Instant::now();
        // Intents written already claimed by this process's dispatcher: handed
        // over after the commit, dropped (room given back) if there is none.
        let mut held = Vec::new();
        let processed =
            match self.processor.process_batch_first(&mut tx, records, views, share, gates.keys_held, &mut held).await?
            {
                Some(processed) => processed,
                None => {
                    // The batch's first run was rejected; it was all the
                    // transaction held. Again, with a savepoint around each run.
                    tx.rollback().await?;
                    held.clear();
                    tx = conn.begin_with(relay_store::BEGIN_BOUNDED).await?;
                    self.processor.process_batch(&mut tx, records, views, share, gates.keys_held, &mut held).await?
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
            self.advance(tp, b.generation, records[done - 1].offset + 1, 0, CommitMode::Sync);
        }
        self.faults.hit(point::CONSUMER_BEFORE_DB_COMMIT).await?;
        tx.commit().await?;
        self.faults.hit(point::CONSUMER_AFTER_DB_COMMIT).await?;
        Ok(Written { processed, held, stopped, paused, done, took })
    }

    async fn park_alone(
        &self,
        record: &RawRecord,
        poison: &Poison,
        attempts: u32,
        route: Option<&str>,
    ) -> Result<(), ParkError> {
        let conn = self.pool.acquire().await?;
        let pid = AtomicI32::new(0);
        let park = async |c: &mut PgConnection| {
            pid.store(relay_store::ops::backend_pid(c).await?, Ordering::Relaxed);
            let mut tx = c.begin_with(relay_store::BEGIN_BOUNDED).await?;
            crate::ingest::park::park(&mut tx, self.processor.router(), record, poison, attempts, route).await?;
            self.faults.hit(point::CONSUMER_BEFORE_DB_COMMIT).await?;
            tx.commit().await?;
            self.faults.hit(point::CONSUMER_AFTER_DB_COMMIT).await?;
            Ok::<_, ParkError>(())
        };
        let tp = TopicPartition::new(&record.topic, record.partition);
        let limit = self.settings.transaction_timeout;
        db::watched(&self.pool, conn, limit, &pid, |l| self.running_long(&tp, l), park).await.map_err(ParkError::Db)?
    }

    /// Say that `tp`'s transaction ran past another `limit` and goes on, the
    /// database still working on it (a slow batch is never an outage).
    fn running_long(&self, tp: &TopicPartition, limit: Duration) {
        warn!(consumer = %self.settings.name, topic = %tp.topic, partition = tp.partition,
              "a transaction has run for another {}s (database.transaction_timeout); the database is still \
               working on it, so it goes on", limit.as_secs());
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
