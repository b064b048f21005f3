//! What the consumer knows of its partitions, one [`Partition`] each, and
//! the rules over them in one place ([`Partitions`]): which it owns and since
//! when (revoke generations), how far each is processed, the records waiting
//! for each partition's task, which are paused at the broker and where they
//! resume, and how many bytes of records are buffered in all.
//!
//! The consumer loop, its partition tasks and librdkafka's rebalance
//! callbacks share one `Partitions` behind a mutex; every method is short
//! and none does I/O, so the callers pause, resume, seek and commit at the
//! broker with what a method returned (mini-redis's `State` is the model).
//!
//! # The buffer bound
//!
//! Buffered bytes are the records received and not yet done: those waiting
//! for their partition's task and those handed to a running task and not
//! yet committed. Receiving stops while they reach
//! `consumer.max_buffered_bytes` (so the bound holds up to one record over).
//! A task is handed at most one batch — `batch_size` records and a
//! partition's share of the bound (`max_buffered_bytes / partitions`), at
//! least one record —, so a partition whose task waits (a record not
//! processable yet, the database down, a paused route) holds at most its
//! share: its waiting records are dropped, the partition is paused at the
//! broker, and it resumes from the first dropped offset (a seek) when its
//! task is done. Dropping is safe because nothing is committed past a record
//! that is not done (R1): the broker hands the records back.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use relay_core::RawRecord;
use tokio_util::sync::CancellationToken;

use crate::runtime::faults::{FaultInjected, Sabotage, Sabotaged};

/// A topic and partition.
/// One partition of one topic, as the consumer owns it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct TopicPartition {
    pub(super) topic: String,
    pub(super) partition: i32,
}

impl std::fmt::Display for TopicPartition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}[{}]", self.topic, self.partition)
    }
}

impl TopicPartition {
    pub(super) fn new(topic: impl Into<String>, partition: i32) -> TopicPartition {
        TopicPartition { topic: topic.into(), partition }
    }
}

/// The bounds the consumer keeps.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// Most records per task (and per transaction).
    pub(super) batch_size: usize,
    /// Most bytes buffered over all partitions (`consumer.max_buffered_bytes`).
    pub(super) max_buffered_bytes: usize,
}

/// Why a partition is paused at the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Paused {
    /// Its task waits out a retry: it resumes when the task is done.
    Waiting,
    /// Held at a paused route from `offset`: it resumes there when `route` is resumed.
    Held { route: String, offset: i64 },
    /// Its seek back to `offset` failed: tried again until it succeeds,
    /// since fetching on without it would pass over the dropped records.
    Seeking(i64),
}

/// One partition of this member.
#[derive(Debug, Default)]
struct Partition {
    /// The generation of its last revoke, if it was ever revoked.
    revoked_at: Option<u64>,
    /// Next offset to commit (the end of its processed prefix), while owned.
    next_offset: Option<i64>,
    /// Received and not started, in offset order, each with the generation
    /// it was fetched in.
    waiting: Vec<(RawRecord, u64)>,
    /// Bytes of `waiting`.
    waiting_bytes: usize,
    /// Bytes handed to its running task and not yet done, and when the task
    /// started; `None` when no task runs.
    running: Option<(usize, Instant)>,
    /// Paused at the broker, and why.
    paused: Option<Paused>,
    /// The first offset dropped while paused: fetching resumes here.
    resume_at: Option<i64>,
    /// The next offset the client hands over, as far as this state knows:
    /// after the last record queued, or where a resume seeks to; `None`
    /// since an assignment, before anything was received (the client then
    /// stands at the committed offset).
    expect: Option<i64>,
    /// Wakes its task out of a retry wait when the partition is revoked.
    revoke: CancellationToken,
    /// A record not processable yet (R19): its offset and the attempts made,
    /// kept across tasks (and a revoke, should this member get it back).
    not_yet: Option<(i64, u32)>,
    /// Batches the client could not read: the first offset of each, with
    /// why. Its task parks a stand-in record at that offset.
    unreadable: HashMap<i64, (i64, String)>,
    /// Paused at the broker because the buffer is full (besides any
    /// `paused` reason): it fetches again once the buffer is half empty.
    room_paused: bool,
}

impl Partition {
    fn buffered(&self) -> usize {
        self.waiting_bytes + self.running.map_or(0, |(bytes, _)| bytes)
    }

    /// Resume fetching, from the first offset dropped if any.
    fn resume(&mut self, tp: &TopicPartition) -> Resume {
        let seek = self.resume_at.take();
        if seek.is_some() {
            self.expect = seek;
        }
        Resume { tp: tp.clone(), seek }
    }

    /// Drop the waiting records, to fetch them again from their first offset.
    fn drop_waiting(&mut self) {
        if let Some((first, _)) = self.waiting.first() {
            self.resume_at = Some(self.resume_at.map_or(first.offset, |at| at.min(first.offset)));
        }
        self.waiting.clear();
        self.waiting_bytes = 0;
    }
}

/// What receiving a record did with it.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Filed {
    /// Queued for its partition's next task.
    Queued,
    /// Dropped: its partition was revoked since it was fetched, or is paused
    /// (it is fetched again when the partition resumes).
    Dropped,
}

/// A task to start: a partition's next batch.
pub(super) struct Start {
    pub(super) tp: TopicPartition,
    pub(super) records: Vec<RawRecord>,
    pub(super) generation: u64,
    /// Cancelled when the partition is revoked.
    pub(super) revoke: CancellationToken,
    /// R19 attempts already made at its first record.
    pub(super) not_yet: u32,
}

/// Resume fetching `tp`, from `seek` if records of it were dropped.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Resume {
    pub(super) tp: TopicPartition,
    pub(super) seek: Option<i64>,
}

/// Every partition this member was given, and the bounds.
#[derive(Debug)]
pub(super) struct Partitions {
    /// Bumped on every revoke.
    generation: u64,
    parts: HashMap<TopicPartition, Partition>,
    limits: Limits,
    /// Partitions assigned (for each one's share of the bound).
    assigned: usize,
    /// Defects put back for the model check ([`Sabotage::PauseKeptAfterRegrant`],
    /// [`Sabotage::StandInBeforeDropped`]); none outside it.
    sabotage: Sabotaged,
}

impl Partitions {
    pub(super) fn new(limits: Limits) -> Partitions {
        Partitions::sabotaged(limits, Sabotaged::default())
    }

    /// With fixed defects put back.
    pub(super) fn sabotaged(limits: Limits, sabotage: Sabotaged) -> Partitions {
        Partitions { generation: 0, parts: HashMap::new(), limits, assigned: 1, sabotage }
    }

    /// The current revoke generation.
    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    /// How many partitions are assigned (each gets a share of the bound).
    pub(super) fn set_assigned(&mut self, n: usize) {
        self.assigned = n.max(1);
    }

    /// A partition's share of the bound: of the bytes received, and of the
    /// JSON its batch decodes them to ([`crate::ingest::processor::Processor::views_within`]).
    pub(super) fn share(&self) -> usize {
        (self.limits.max_buffered_bytes / self.assigned).max(1)
    }

    /// Whether `tp` was revoked after `generation`.
    pub(super) fn revoked_since(&self, tp: &TopicPartition, generation: u64) -> bool {
        self.parts.get(tp).and_then(|p| p.revoked_at).is_some_and(|at| at > generation)
    }

    /// `tps` were revoked: forget what was waiting or held for them (the new
    /// owner fetches it from the committed offset), wake their tasks out of
    /// any retry wait, and return the offsets to commit for them.
    pub(super) fn revoke<'a>(
        &mut self,
        tps: impl IntoIterator<Item = &'a TopicPartition>,
    ) -> Vec<(TopicPartition, i64)> {
        self.generation += 1;
        let generation = self.generation;
        let mut commit = Vec::new();
        for tp in tps {
            let p = self.parts.entry(tp.clone()).or_default();
            p.revoked_at = Some(generation);
            p.waiting.clear();
            p.waiting_bytes = 0;
            p.paused = None;
            p.resume_at = None;
            p.expect = None;
            p.revoke.cancel();
            p.revoke = CancellationToken::new();
            p.unreadable.clear();
            p.room_paused = false;
            if let Some(next) = p.next_offset.take() {
                commit.push((tp.clone(), next));
            }
        }
        commit
    }

    /// Of newly assigned `tps`, those to resume at the broker: librdkafka
    /// keeps a partition paused across a revoke and a new assignment, and a
    /// revoke forgot why it was paused.
    pub(super) fn assigned<'a>(&self, tps: impl IntoIterator<Item = &'a TopicPartition>) -> Vec<TopicPartition> {
        tps.into_iter().filter(|tp| self.parts.get(*tp).is_none_or(|p| p.paused.is_none())).cloned().collect()
    }

    /// File a received record fetched in `generation`.
    pub(super) fn receive(&mut self, record: RawRecord, generation: u64) -> Filed {
        let tp = TopicPartition::new(&record.topic, record.partition);
        if self.revoked_since(&tp, generation) {
            return Filed::Dropped;
        }
        let p = self.parts.entry(tp).or_default();
        if p.paused.is_some() {
            // Fetched before the pause reached the broker: fetched again on resume.
            p.resume_at = Some(p.resume_at.map_or(record.offset, |at| at.min(record.offset)));
            return Filed::Dropped;
        }
        p.waiting_bytes += record.size();
        p.expect = Some(record.offset + 1);
        p.waiting.push((record, generation));
        Filed::Queued
    }

    /// Bytes of records received and not done, over all partitions.
    pub(super) fn buffered_bytes(&self) -> usize {
        self.parts.values().map(Partition::buffered).sum()
    }

    /// Records waiting for their tasks, over all partitions.
    pub(super) fn waiting_records(&self) -> usize {
        self.parts.values().map(|p| p.waiting.len()).sum()
    }

    /// Whether to receive more: fewer records waiting than a batch per
    /// assigned partition, and fewer bytes buffered than the bound.
    pub(super) fn room(&self) -> bool {
        self.waiting_records() < self.limits.batch_size * self.assigned
            && self.buffered_bytes() < self.limits.max_buffered_bytes
    }

    /// Whether the bytes buffered reached the bound.
    pub(super) fn full(&self) -> bool {
        self.buffered_bytes() >= self.limits.max_buffered_bytes
    }

    /// With the bytes buffered at the bound, every partition of `assigned`
    /// not yet paused for room is, and those not paused already are
    /// returned, to pause at the broker. librdkafka reads ahead until its
    /// queue holds 64 MiB of record values or 100 000 records, and counts no
    /// key or header bytes, so while relay takes nothing more only a pause
    /// (which empties that partition's queue) bounds what it holds. Not on
    /// the bound of records waiting: a resumed partition fetches again only
    /// about a second later, and half a batch per partition of small
    /// records drains far sooner.
    pub(super) fn pause_for_room<'a>(
        &mut self,
        assigned: impl IntoIterator<Item = &'a TopicPartition>,
    ) -> Vec<TopicPartition> {
        if !self.full() {
            return Vec::new();
        }
        let mut pause = Vec::new();
        for tp in assigned {
            let p = self.parts.entry(tp.clone()).or_default();
            if !p.room_paused {
                p.room_paused = true;
                if p.paused.is_none() {
                    pause.push(tp.clone());
                }
            }
        }
        pause
    }

    /// Once the bytes buffered are down to half of what the bound leaves
    /// beside the batches of tasks waiting out a retry, the partitions
    /// paused for room fetch again; returned are those to resume at the
    /// broker (not paused for another reason). Half, so that a full buffer
    /// does not pause and resume on every record (a resumed partition
    /// fetches again about a second later).
    pub(super) fn resume_for_room(&mut self) -> Vec<TopicPartition> {
        if !self.parts.values().any(|p| p.room_paused) {
            return Vec::new();
        }
        // A task waiting out a retry holds its batch (up to its share) until
        // it ends, maybe minutes later: counted, it would keep every other
        // partition paused as long.
        let waiting_out: usize = self
            .parts
            .values()
            .filter(|p| p.paused == Some(Paused::Waiting))
            .map(|p| p.running.map_or(0, |(bytes, _)| bytes))
            .sum();
        let room = self.limits.max_buffered_bytes.saturating_sub(waiting_out);
        if (self.buffered_bytes() - waiting_out) * 2 > room {
            return Vec::new();
        }
        let mut resume = Vec::new();
        for (tp, p) in &mut self.parts {
            if std::mem::take(&mut p.room_paused) && p.paused.is_none() {
                resume.push(tp.clone());
            }
        }
        resume
    }

    /// Whether `tp` is paused because the buffer is full: a resume for
    /// another reason seeks but leaves it paused.
    pub(super) fn is_room_paused(&self, tp: &TopicPartition) -> bool {
        self.parts.get(tp).is_some_and(|p| p.room_paused)
    }

    /// Hand every partition with waiting records and no task its next batch.
    pub(super) fn start_ready(&mut self) -> Vec<Start> {
        let (batch, share, generation) = (self.limits.batch_size, self.share(), self.generation);
        let mut out = Vec::new();
        for (tp, p) in &mut self.parts {
            if p.running.is_some() || p.paused.is_some() || p.waiting.is_empty() {
                continue;
            }
            let (mut n, mut bytes) = (0, 0);
            for (r, _) in &p.waiting {
                if n == batch || (n > 0 && bytes + r.size() > share) {
                    break;
                }
                n += 1;
                bytes += r.size();
            }
            let taken: Vec<(RawRecord, u64)> = p.waiting.drain(..n).collect();
            p.waiting_bytes -= bytes;
            let records: Vec<RawRecord> =
                taken.into_iter().filter(|(_, g)| p.revoked_at.is_none_or(|at| at <= *g)).map(|(r, _)| r).collect();
            if records.is_empty() {
                continue;
            }
            p.running = Some((records.iter().map(RawRecord::size).sum(), Instant::now()));
            let not_yet = match p.not_yet {
                Some((offset, attempts)) if offset == records[0].offset => attempts,
                _ => 0,
            };
            out.push(Start { tp: tp.clone(), records, generation, revoke: p.revoke.clone(), not_yet });
        }
        out
    }

    /// `tp`'s task, started in `generation`, committed up to `next` (the
    /// next offset to commit), finishing records of `bytes`. `false` if the
    /// partition was revoked since: nothing is to be committed for it.
    pub(super) fn advance(&mut self, tp: &TopicPartition, generation: u64, next: i64, bytes: usize) -> bool {
        if self.revoked_since(tp, generation) {
            return false;
        }
        let p = self.parts.entry(tp.clone()).or_default();
        p.next_offset = Some(next);
        if let Some((running, _)) = &mut p.running {
            *running = running.saturating_sub(bytes);
        }
        if p.not_yet.is_some_and(|(offset, _)| offset < next) {
            p.not_yet = None;
        }
        p.unreadable.retain(|offset, _| *offset >= next);
        true
    }

    /// `tp`'s task made attempt `attempts` at the record at `offset`, which is not processable yet.
    pub(super) fn not_yet(&mut self, tp: &TopicPartition, offset: i64, attempts: u32) {
        if let Some(p) = self.parts.get_mut(tp) {
            p.not_yet = Some((offset, attempts));
        }
    }

    /// `tp`'s task, started in `generation`, starts waiting out a retry: its
    /// waiting records are dropped and the partition is paused at the broker
    /// until the task is done. `true` when the caller must pause it now.
    pub(super) fn wait_out(&mut self, tp: &TopicPartition, generation: u64) -> bool {
        if self.revoked_since(tp, generation) {
            return false;
        }
        let Some(p) = self.parts.get_mut(tp) else { return false };
        p.drop_waiting();
        if p.paused.is_some() {
            return false;
        }
        p.paused = Some(Paused::Waiting);
        true
    }

    /// `tp`'s task, started in `generation`, is done; `held` is where it
    /// stopped at a paused route, if it did. Returns whether to pause the
    /// partition now (held) or to resume it (it was waiting), and from where.
    pub(super) fn task_done(&mut self, tp: &TopicPartition, generation: u64, held: Option<(String, i64)>) -> Done {
        let revoked = self.revoked_since(tp, generation);
        let Some(p) = self.parts.get_mut(tp) else { return Done::Nothing };
        p.running = None;
        if revoked {
            // Given back to this member while this task ran, the partition
            // may have been paused as slow since: that pause waited for this
            // task, so it ends with it, or nothing would ever resume it.
            if p.paused == Some(Paused::Waiting) && !self.sabotage.has(Sabotage::PauseKeptAfterRegrant) {
                p.paused = None;
                return Done::Resume(p.resume(tp));
            }
            return Done::Nothing;
        }
        match held {
            Some((route, offset)) => {
                // Everything from `offset` on is fetched again once the route is resumed.
                p.drop_waiting();
                p.resume_at = None;
                let pause = p.paused.is_none();
                p.paused = Some(Paused::Held { route, offset });
                if pause { Done::Pause } else { Done::Nothing }
            }
            None if p.paused == Some(Paused::Waiting) => {
                p.paused = None;
                Done::Resume(p.resume(tp))
            }
            None => Done::Nothing,
        }
    }

    /// Partitions whose task has run one batch for longer than `after` (a
    /// row lock, a slow handler) while records of theirs wait: treated as
    /// waiting out a retry — their waiting records dropped, paused at the
    /// broker until the task is done —, so a slow partition cannot fill the
    /// buffer every partition shares. The ones to pause now.
    pub(super) fn slow(&mut self, now: Instant, after: Duration) -> Vec<TopicPartition> {
        let mut out = Vec::new();
        for (tp, p) in &mut self.parts {
            let slow = p.running.is_some_and(|(_, since)| now.duration_since(since) > after);
            if slow && !p.waiting.is_empty() && p.paused.is_none() {
                p.drop_waiting();
                p.paused = Some(Paused::Waiting);
                out.push(tp.clone());
            }
        }
        out
    }

    /// A resume whose seek failed: the partition stays paused and the seek
    /// is tried again ([`Partitions::seeks_due`]).
    pub(super) fn seek_failed(&mut self, r: Resume) {
        if let (Some(p), Some(offset)) = (self.parts.get_mut(&r.tp), r.seek) {
            p.paused = Some(Paused::Seeking(offset));
        }
    }

    /// The seeks to try again.
    pub(super) fn seeks_due(&mut self) -> Vec<Resume> {
        let mut out = Vec::new();
        for (tp, p) in &mut self.parts {
            if let Some(Paused::Seeking(offset)) = p.paused {
                p.paused = None;
                // Records dropped meanwhile come after `offset`: fetched again from it.
                p.resume_at = None;
                p.expect = Some(offset);
                out.push(Resume { tp: tp.clone(), seek: Some(offset) });
            }
        }
        out
    }

    /// Whether a seek waits to be tried again.
    pub(super) fn seeking(&self) -> bool {
        self.parts.values().any(|p| matches!(p.paused, Some(Paused::Seeking(_))))
    }

    /// The batch of `tp` at offsets `offset..until` could not be read
    /// (`why`): a stand-in record at `offset` is queued for its task, which
    /// parks it, and the caller seeks to `until`. `false` if the partition
    /// was revoked since `generation`, is paused, or the client does not
    /// stand at `offset` (the search ran while it was held, or sought back):
    /// records before `offset` are then still to be fetched, and a stand-in
    /// parked ahead of them would commit past them (R1). Fetching reaches
    /// the batch again after them, and the search finds it again.
    pub(super) fn unreadable(
        &mut self,
        tp: &TopicPartition,
        generation: u64,
        offset: i64,
        until: i64,
        why: String,
    ) -> bool {
        if self.revoked_since(tp, generation) {
            return false;
        }
        let stand_in = RawRecord {
            topic: tp.topic.clone(),
            partition: tp.partition,
            offset,
            key: None,
            payload: None,
            headers: Vec::new(),
        };
        let p = self.parts.entry(tp.clone()).or_default();
        let behind = p.paused.is_some()
            || p.resume_at.is_some_and(|at| at < offset)
            || p.expect.is_some_and(|next| next != offset);
        if behind && !self.sabotage.has(Sabotage::StandInBeforeDropped) {
            return false;
        }
        p.expect = Some(until);
        p.unreadable.insert(offset, (until, why));
        // Again after its first stand-in was dropped (the partition waited):
        // parking twice finds the dead letter there and moves on.
        if !p.waiting.iter().any(|(r, _)| r.offset == offset) {
            p.waiting_bytes += stand_in.size();
            p.waiting.push((stand_in, generation));
        }
        true
    }

    /// Why the record of `tp` at `offset` could not be read, and the first
    /// offset after its batch, if it is a stand-in.
    pub(super) fn unreadable_at(&self, tp: &TopicPartition, offset: i64) -> Option<(i64, String)> {
        self.parts.get(tp).and_then(|p| p.unreadable.get(&offset).cloned())
    }

    /// Whether `tp` is paused at the broker by the relay.
    pub(super) fn is_paused(&self, tp: &TopicPartition) -> bool {
        self.parts.get(tp).is_some_and(|p| p.paused.is_some() || p.room_paused)
    }

    /// Whether any task runs.
    pub(super) fn running(&self) -> bool {
        self.parts.values().any(|p| p.running.is_some())
    }

    /// Whether any partition is held at a paused route.
    pub(super) fn holding(&self) -> bool {
        self.parts.values().any(|p| matches!(p.paused, Some(Paused::Held { .. })))
    }

    /// The held partitions whose route is no longer in `paused_routes`:
    /// each resumes from where it was held.
    pub(super) fn release(&mut self, paused_routes: &[String]) -> Vec<Resume> {
        let mut out = Vec::new();
        for (tp, p) in &mut self.parts {
            if let Some(Paused::Held { route, offset }) = &p.paused
                && !paused_routes.contains(route)
            {
                p.expect = Some(*offset);
                out.push(Resume { tp: tp.clone(), seek: Some(*offset) });
                p.paused = None;
                p.resume_at = None;
            }
        }
        out
    }

    /// Next offsets to commit, for every owned partition.
    pub(super) fn next_offsets(&self) -> Vec<(TopicPartition, i64)> {
        self.parts.iter().filter_map(|(tp, p)| p.next_offset.map(|n| (tp.clone(), n))).collect()
    }
}

/// What to do at the broker once a task is done.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Done {
    Nothing,
    /// Held at a paused route: pause fetching.
    Pause,
    /// It waited out a retry: fetch again (from `seek`, if records were dropped).
    Resume(Resume),
}

/// How one partition's task ended.
pub(super) struct PartitionRun {
    pub(super) tp: TopicPartition,
    /// The revoke generation its task started in.
    pub(super) generation: u64,
    pub(super) interrupted: bool,
    /// Stopped at a paused route: the route and the record's offset.
    pub(super) held: Option<(String, i64)>,
}

pub(super) type PartitionResult = Result<PartitionRun, FaultInjected>;

#[cfg(test)]
mod model;

#[cfg(test)]
mod tests {
    use super::*;

    fn tp(p: i32) -> TopicPartition {
        TopicPartition::new("orders", p)
    }

    fn record(p: i32, offset: i64, bytes: usize) -> RawRecord {
        RawRecord {
            topic: "orders".into(),
            partition: p,
            offset,
            key: None,
            payload: Some(vec![b'x'; bytes]),
            headers: Vec::new(),
        }
    }

    fn partitions(batch_size: usize, max_buffered_bytes: usize, assigned: usize) -> Partitions {
        let mut s = Partitions::new(Limits { batch_size, max_buffered_bytes });
        s.set_assigned(assigned);
        s
    }

    #[test]
    fn a_partition_counts_as_revoked_only_by_a_revoke_after_its_generation() {
        let mut s = partitions(10, 1000, 2);
        assert!(!s.revoked_since(&tp(0), 0), "never revoked");
        s.revoke([&tp(0)]);
        assert!(s.revoked_since(&tp(0), 0), "revoked after a batch fetched in generation 0");
        assert!(!s.revoked_since(&tp(0), 1), "not by the revoke its own generation began with");
        assert!(!s.revoked_since(&tp(1), 0), "other partitions are unaffected");
        assert_eq!(s.receive(record(0, 5, 10), 0), Filed::Dropped, "fetched before the revoke");
        assert_eq!(s.receive(record(0, 5, 10), 1), Filed::Queued);
    }

    // Running tasks' records were not counted at all.
    #[test]
    fn records_handed_to_a_running_task_count_until_they_are_committed() {
        let one = record(0, 0, 100).size();
        let mut s = partitions(10, 10 * one, 4);
        for i in 0..4 {
            s.receive(record(i, 0, 100), 0);
        }
        let started = s.start_ready();
        assert_eq!(started.len(), 4);
        assert_eq!(s.buffered_bytes(), 4 * one, "handed, not done: still buffered");
        assert!(s.advance(&tp(0), 0, 1, one));
        assert_eq!(s.buffered_bytes(), 3 * one);
        assert_eq!(s.task_done(&tp(0), 0, None), Done::Nothing);
        assert_eq!(s.buffered_bytes(), 3 * one);
    }

    // Four partitions each blocked in their task hold at most the bound.
    #[test]
    fn blocked_tasks_and_their_waiting_records_never_hold_more_than_the_bound() {
        let (max, parts) = (1000, 4);
        let mut s = partitions(50, max, parts);
        let mut offset = [0i64; 4];
        // Receive while there is room, starting tasks as the loop does; each
        // task then blocks (waits out a retry) on its first record.
        for round in 0..20 {
            for p in 0..4 {
                if s.room() {
                    s.receive(record(p, offset[p as usize], 30), 0);
                    offset[p as usize] += 1;
                }
            }
            for start in s.start_ready() {
                if round % 3 == 0 {
                    s.wait_out(&start.tp, start.generation);
                }
            }
            assert!(s.buffered_bytes() < max + 30, "round {round}: {} buffered", s.buffered_bytes());
        }
        // A partition waiting out a retry holds no more than its share.
        for p in 0..4 {
            let part = &s.parts[&tp(p)];
            if part.paused.is_some() {
                assert!(part.buffered() <= max / parts, "{p}: {}", part.buffered());
            }
        }
    }

    #[test]
    fn a_task_gets_at_most_a_batch_and_a_share_of_the_bound_but_always_one_record() {
        let one = record(0, 0, 100).size();
        let mut s = partitions(3, 100 * one, 4);
        for o in 0..5 {
            s.receive(record(0, o, 10), 0);
        }
        let start = s.start_ready().pop().unwrap();
        assert_eq!(start.records.len(), 3, "a batch");
        s.task_done(&tp(0), 0, None);
        let mut s = partitions(100, 10 * one, 4);
        for o in 0..5 {
            s.receive(record(0, o, 100), 0);
        }
        assert_eq!(s.start_ready().pop().unwrap().records.len(), 2, "a share: two and a half records");
        let mut s = partitions(100, 10 * one, 4);
        s.receive(record(0, 0, 9 * one), 0);
        assert_eq!(s.start_ready().pop().unwrap().records.len(), 1, "one record over the share still goes");
    }

    #[test]
    fn a_waiting_partition_drops_its_queue_and_resumes_from_the_first_dropped_offset() {
        let mut s = partitions(2, 1000, 1);
        for o in 0..5 {
            s.receive(record(0, o, 10), 0);
        }
        let start = s.start_ready().pop().unwrap();
        assert_eq!(start.records.len(), 2);
        assert!(s.wait_out(&tp(0), 0), "paused at the broker now");
        assert!(!s.wait_out(&tp(0), 0), "once");
        assert_eq!(s.waiting_records(), 0, "offsets 2..5 dropped");
        assert_eq!(s.receive(record(0, 5, 10), 0), Filed::Dropped, "fetched before the pause landed");
        assert!(s.start_ready().is_empty(), "a paused partition starts nothing");
        assert!(s.advance(&tp(0), 0, 2, 20));
        assert_eq!(s.task_done(&tp(0), 0, None), Done::Resume(Resume { tp: tp(0), seek: Some(2) }));
        assert_eq!(s.next_offsets(), vec![(tp(0), 2)]);
    }

    #[test]
    fn a_partition_held_at_a_paused_route_resumes_where_it_was_held_once_the_route_is_resumed() {
        let mut s = partitions(10, 1000, 2);
        for o in 0..3 {
            s.receive(record(0, o, 10), 0);
        }
        s.start_ready();
        s.receive(record(0, 3, 10), 0);
        assert!(s.advance(&tp(0), 0, 1, 10));
        assert_eq!(s.task_done(&tp(0), 0, Some(("placed".into(), 1))), Done::Pause);
        assert!(s.holding());
        assert_eq!(s.buffered_bytes(), 0, "nothing kept: fetched again from offset 1");
        assert!(s.release(&["placed".to_string()]).is_empty(), "still paused");
        assert_eq!(s.release(&[]), vec![Resume { tp: tp(0), seek: Some(1) }]);
        assert!(!s.holding());
    }

    // A revoke left a task asleep in its retry wait, its
    // partition busy and (given back to this member) counted against the bound.
    #[test]
    fn a_revoke_wakes_the_partitions_task_forgets_its_queue_and_pause_and_returns_its_offset() {
        let mut s = partitions(10, 1000, 2);
        for o in 0..3 {
            s.receive(record(0, o, 10), 0);
        }
        let start = s.start_ready().pop().unwrap();
        assert!(s.advance(&tp(0), 0, 1, 10));
        s.receive(record(0, 3, 10), 0);
        s.wait_out(&tp(0), 0);
        s.not_yet(&tp(0), 1, 3);
        assert_eq!(s.revoke([&tp(0)]), vec![(tp(0), 1)]);
        assert!(start.revoke.is_cancelled(), "its task is woken");
        assert_eq!(s.assigned([&tp(0)]), vec![tp(0)], "given back: resumed");
        assert!(!s.advance(&tp(0), 0, 2, 10), "the old task commits nothing any more");
        assert_eq!(s.task_done(&tp(0), 0, None), Done::Nothing);
        assert_eq!(s.buffered_bytes(), 0);
        // The R19 budget is not reset by a revoke: the same member goes on counting.
        s.receive(record(0, 1, 10), 1);
        assert_eq!(s.start_ready().pop().unwrap().not_yet, 3);
    }

    // A task stuck in a transaction (a row lock) was
    // neither waiting out a retry nor paused, and its partition's queue
    // filled the buffer every partition shares.
    #[test]
    fn a_task_running_one_batch_too_long_gives_its_waiting_records_back_and_its_partition_pauses() {
        let mut s = partitions(2, 1000, 2);
        for o in 0..5 {
            s.receive(record(0, o, 10), 0);
        }
        s.start_ready();
        let later = Instant::now() + Duration::from_secs(10);
        assert!(s.slow(Instant::now(), Duration::from_secs(5)).is_empty(), "not slow yet");
        assert_eq!(s.slow(later, Duration::from_secs(5)), vec![tp(0)]);
        assert_eq!(s.waiting_records(), 0);
        assert!(s.slow(later, Duration::from_secs(5)).is_empty(), "paused once");
        assert!(s.advance(&tp(0), 0, 2, 20));
        assert_eq!(s.task_done(&tp(0), 0, None), Done::Resume(Resume { tp: tp(0), seek: Some(2) }));
    }

    // A failed seek left the partition paused for good.
    #[test]
    fn a_failed_seek_keeps_the_partition_paused_and_is_tried_again() {
        let mut s = partitions(10, 1000, 1);
        s.receive(record(0, 0, 10), 0);
        s.receive(record(0, 1, 10), 0);
        let start = s.start_ready().pop().unwrap();
        s.receive(record(0, 2, 10), 0);
        s.wait_out(&start.tp, 0);
        let Done::Resume(r) = s.task_done(&tp(0), 0, None) else { panic!("a resume") };
        assert_eq!(r.seek, Some(2));
        s.seek_failed(r);
        assert!(s.seeking() && s.is_paused(&tp(0)));
        assert_eq!(s.receive(record(0, 2, 10), 0), Filed::Dropped, "nothing taken while it is not fetched from 2");
        assert_eq!(s.seeks_due(), vec![Resume { tp: tp(0), seek: Some(2) }]);
        assert!(!s.seeking() && !s.is_paused(&tp(0)));
    }
}
