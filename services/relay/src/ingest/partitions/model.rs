//! A model check of [`Partitions`] and of what the consumer loop does with
//! its answers: random sequences of records fetched (on time or after a
//! pause), tasks started, stepping, finishing and held at a paused route,
//! the slow tick, revokes and assignments (to this member or another), an
//! unreadable batch found, seeks failing, the database going down and
//! coming back, and the buffer's pauses for room, run against a small world that plays the broker, the tasks
//! and the database the way `consumer.rs` drives them.
//!
//! After every step: the committed offset never passes a record that was
//! not processed (R1), and the bytes buffered stay within the bound. At the
//! end, with every fault over and every partition owned, running the loop
//! must bring each partition to the end of its log: no owned partition is
//! left paused with records to process.

use std::collections::{BTreeSet, HashMap, VecDeque};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use super::*;

const PARTS: i32 = 2;
/// Records per partition.
const LOG_END: i64 = 10;
/// The one record of each partition the client cannot read (a batch of one).
const BAD: i64 = 6;
const RECORD_BYTES: usize = 10;
const BATCH: usize = 3;

fn tp(p: i32) -> TopicPartition {
    TopicPartition::new("orders", p)
}

fn record(p: i32, offset: i64) -> RawRecord {
    RawRecord {
        topic: "orders".into(),
        partition: p,
        offset,
        key: None,
        payload: Some(vec![b'x'; RECORD_BYTES]),
        headers: Vec::new(),
    }
}

/// What `Partitions::unreadable` files for an unreadable batch.
fn stand_in(p: i32) -> RawRecord {
    RawRecord { payload: None, ..record(p, BAD) }
}

#[derive(Debug, Clone, Copy)]
enum Op {
    /// The client hands over `p`'s next record, if `p` is fetched.
    Fetch(i32),
    /// A record of `p` fetched before its pause reached the broker arrives.
    FetchLate(i32),
    /// The loop starts a task for each partition that is ready.
    Start,
    /// `p`'s task works through its next record (or, the database down,
    /// starts waiting out a retry).
    Step(i32),
    /// `p`'s task, out of records (done, or revoked), ends.
    Finish(i32),
    /// `p`'s task meets a paused route at its next record.
    Hold(i32),
    /// Every route is resumed.
    ReleaseRoutes,
    /// The slow tick, with every running task past the limit.
    Slow,
    Revoke(i32),
    /// `p` assigned to this member, or to another that processes it up to an offset.
    Assign(i32, Option<i64>),
    /// The search for the unreadable batch of `p` answers.
    ProbeFound(i32),
    /// The next seek fails.
    FailNextSeek,
    /// The tick retries failed seeks.
    RetrySeeks,
    DbDown,
    DbUp,
    /// The loop's turn: with the bytes buffered at the bound every owned
    /// partition is paused at the broker, and fetches again once down to half.
    Room,
}

fn op() -> impl Strategy<Value = Op> {
    let p = 0..PARTS;
    prop_oneof![
        6 => p.clone().prop_map(Op::Fetch),
        1 => p.clone().prop_map(Op::FetchLate),
        4 => Just(Op::Start),
        6 => p.clone().prop_map(Op::Step),
        3 => p.clone().prop_map(Op::Finish),
        1 => p.clone().prop_map(Op::Hold),
        1 => Just(Op::ReleaseRoutes),
        1 => Just(Op::Slow),
        1 => p.clone().prop_map(Op::Revoke),
        2 => (p.clone(), prop::option::weighted(0.8, Just(())).prop_flat_map(|me| match me {
            Some(()) => Just(None).boxed(),
            None => (0..=LOG_END).prop_map(Some).boxed(),
        }))
            .prop_map(|(p, other)| Op::Assign(p, other)),
        2 => p.clone().prop_map(Op::ProbeFound),
        1 => Just(Op::FailNextSeek),
        1 => Just(Op::RetrySeeks),
        1 => Just(Op::DbDown),
        1 => Just(Op::DbUp),
        4 => Just(Op::Room),
    ]
}

#[derive(Debug)]
struct Task {
    records: VecDeque<RawRecord>,
    generation: u64,
}

/// The broker, the tasks and the database around one [`Partitions`].
#[derive(Debug)]
struct World {
    s: Partitions,
    owned: [bool; PARTS as usize],
    /// Paused at the broker (librdkafka keeps it across a revoke and an assignment).
    broker_paused: [bool; PARTS as usize],
    /// The client's next offset to hand over.
    fetch: [i64; PARTS as usize],
    committed: [i64; PARTS as usize],
    /// Records applied or parked (the database).
    processed: [BTreeSet<i64>; PARTS as usize],
    tasks: HashMap<i32, Task>,
    /// The client met the unreadable batch: the generation of the search under way.
    probing: [Option<u64>; PARTS as usize],
    db_down: bool,
    seek_fails: bool,
}

impl World {
    fn new(sabotage: Sabotaged) -> World {
        let mut s =
            Partitions::sabotaged(Limits { batch_size: BATCH, max_buffered_bytes: 8 * record(0, 0).size() }, sabotage);
        s.set_assigned(PARTS as usize);
        World {
            s,
            owned: [true; PARTS as usize],
            broker_paused: [false; PARTS as usize],
            fetch: [0; PARTS as usize],
            committed: [0; PARTS as usize],
            processed: Default::default(),
            tasks: HashMap::new(),
            probing: [None; PARTS as usize],
            db_down: false,
            seek_fails: false,
        }
    }

    /// As `Consumer::pause`: what the state no longer has paused is resumed.
    fn pause(&mut self, p: i32) {
        self.broker_paused[p as usize] = self.s.is_paused(&tp(p));
    }

    /// As `Consumer::resume`.
    fn resume(&mut self, r: Resume) {
        let p = r.tp.partition as usize;
        if let Some(offset) = r.seek {
            if self.seek_fails {
                self.seek_fails = false;
                self.s.seek_failed(r);
                return;
            }
            self.fetch[p] = offset;
        }
        if !self.s.is_room_paused(&r.tp) {
            self.broker_paused[p] = false;
        }
    }

    fn done(&mut self, d: Done, p: i32) {
        match d {
            Done::Nothing => {}
            Done::Pause => self.pause(p),
            Done::Resume(r) => self.resume(r),
        }
    }

    fn fetch(&mut self, p: i32, late: bool) {
        let i = p as usize;
        if !self.owned[i] || (self.broker_paused[i] && !late) || !self.s.room() || self.fetch[i] >= LOG_END {
            return;
        }
        if self.fetch[i] == BAD {
            // Reported without its partition; the search starts at the positions.
            self.probing[i].get_or_insert(self.s.generation());
            return;
        }
        let generation = self.s.generation();
        self.s.receive(record(p, self.fetch[i]), generation);
        self.fetch[i] += 1;
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Fetch(p) => self.fetch(p, false),
            Op::FetchLate(p) => self.fetch(p, true),
            Op::Start => {
                for start in self.s.start_ready() {
                    let p = start.tp.partition;
                    assert!(!self.tasks.contains_key(&p), "two tasks for partition {p}");
                    self.tasks.insert(p, Task { records: start.records.into(), generation: start.generation });
                }
            }
            Op::Step(p) => {
                let Some(t) = self.tasks.get_mut(&p) else { return };
                if self.s.revoked_since(&tp(p), t.generation) {
                    t.records.clear();
                    return;
                }
                let Some(next) = t.records.front() else { return };
                let stand_in = self.s.unreadable_at(&tp(p), next.offset).is_some();
                if self.db_down {
                    // A stand-in's task retries its park without waiting out.
                    if !stand_in && self.s.wait_out(&tp(p), t.generation) {
                        self.pause(p);
                    }
                    return;
                }
                let r = t.records.pop_front().expect("a record");
                let generation = t.generation;
                self.processed[p as usize].insert(r.offset);
                let bytes = r.size();
                if self.s.advance(&tp(p), generation, r.offset + 1, bytes) {
                    self.committed[p as usize] = r.offset + 1;
                }
            }
            Op::Finish(p) => {
                if self.tasks.get(&p).is_some_and(|t| t.records.is_empty()) {
                    let t = self.tasks.remove(&p).expect("the task");
                    let d = self.s.task_done(&tp(p), t.generation, None);
                    self.done(d, p);
                }
            }
            Op::Hold(p) => {
                let Some(t) = self.tasks.get(&p) else { return };
                let Some(next) = t.records.front() else { return };
                if self.s.revoked_since(&tp(p), t.generation) || self.s.unreadable_at(&tp(p), next.offset).is_some() {
                    return;
                }
                let held = Some(("placed".to_string(), next.offset));
                let t = self.tasks.remove(&p).expect("the task");
                let d = self.s.task_done(&tp(p), t.generation, held);
                self.done(d, p);
            }
            Op::ReleaseRoutes => {
                for r in self.s.release(&[]) {
                    self.resume(r);
                }
            }
            Op::Slow => {
                let later = Instant::now() + Duration::from_secs(3600);
                for t in self.s.slow(later, Duration::from_secs(5)) {
                    self.pause(t.partition);
                }
            }
            Op::Revoke(p) => {
                if !self.owned[p as usize] {
                    return;
                }
                for (t, next) in self.s.revoke([&tp(p)]) {
                    self.committed[t.partition as usize] = next;
                }
                self.owned[p as usize] = false;
                self.probing[p as usize] = None;
            }
            Op::Assign(p, other) => {
                let i = p as usize;
                if self.owned[i] {
                    return;
                }
                match other {
                    Some(upto) => {
                        // Another member processes it from the committed offset and commits.
                        let upto = upto.max(self.committed[i]);
                        self.processed[i].extend(self.committed[i]..upto);
                        self.committed[i] = upto;
                    }
                    None => {
                        self.owned[i] = true;
                        self.fetch[i] = self.committed[i];
                        for t in self.s.assigned([&tp(p)]) {
                            self.broker_paused[t.partition as usize] = false;
                        }
                    }
                }
            }
            Op::ProbeFound(p) => {
                let Some(generation) = self.probing[p as usize].take() else { return };
                let why = "the batch does not decompress".to_string();
                if self.s.unreadable(&tp(p), generation, BAD, BAD + 1, why) {
                    self.fetch[p as usize] = BAD + 1;
                }
            }
            Op::FailNextSeek => self.seek_fails = true,
            Op::RetrySeeks => {
                for r in self.s.seeks_due() {
                    self.resume(r);
                }
            }
            Op::DbDown => self.db_down = true,
            Op::DbUp => self.db_down = false,
            Op::Room => {
                let owned: Vec<TopicPartition> = (0..PARTS).filter(|p| self.owned[*p as usize]).map(tp).collect();
                for t in self.s.pause_for_room(&owned) {
                    self.broker_paused[t.partition as usize] = true;
                }
                for t in self.s.resume_for_room() {
                    self.broker_paused[t.partition as usize] = false;
                }
            }
        }
    }

    /// R1, the buffer bound, and no partition paused for room fetching.
    fn check(&self, step: usize) -> Result<(), String> {
        for p in 0..PARTS {
            if self.owned[p as usize] && self.s.is_room_paused(&tp(p)) && !self.broker_paused[p as usize] {
                return Err(format!("step {step}: partition {p} is paused for room but fetches at the broker"));
            }
        }
        for p in 0..PARTS as usize {
            if let Some(missing) = (0..self.committed[p]).find(|o| !self.processed[p].contains(o)) {
                return Err(format!(
                    "step {step}: partition {p} committed up to {} past offset {missing}, never processed",
                    self.committed[p]
                ));
            }
        }
        // A search for an unreadable batch starts while there is room and its
        // stand-in (no payload) lands when it answers, room or not: one per
        // partition beyond the bound.
        let bound = self.s.limits.max_buffered_bytes + record(0, 0).size() + PARTS as usize * stand_in(0).size();
        if self.s.buffered_bytes() > bound {
            return Err(format!("step {step}: {} bytes buffered over the bound of {bound}", self.s.buffered_bytes()));
        }
        Ok(())
    }

    /// With every fault over and every partition owned, run the loop until
    /// nothing changes: each partition must reach the end of its log.
    fn drain(&mut self) -> Result<(), String> {
        self.db_down = false;
        self.seek_fails = false;
        for p in 0..PARTS {
            self.apply(Op::Assign(p, None));
        }
        for _ in 0..200 {
            let mut ops = vec![Op::RetrySeeks, Op::ReleaseRoutes, Op::Room];
            for p in 0..PARTS {
                ops.extend([Op::Fetch(p), Op::Fetch(p), Op::ProbeFound(p)]);
            }
            ops.push(Op::Start);
            for p in 0..PARTS {
                ops.extend(std::iter::repeat_n(Op::Step(p), BATCH + 1));
                ops.push(Op::Finish(p));
            }
            for op in ops {
                self.apply(op);
            }
            self.check(usize::MAX)?;
            if self.committed.iter().all(|c| *c == LOG_END) {
                return Ok(());
            }
        }
        Err(format!(
            "the loop stopped short of the logs' end: committed {:?}, paused {:?} at the broker, relay paused: {:?}",
            self.committed,
            self.broker_paused,
            (0..PARTS).map(|p| self.s.parts.get(&tp(p)).and_then(|x| x.paused.clone())).collect::<Vec<_>>()
        ))
    }
}

/// Runs `ops`, checking after each; then drains.
fn run(ops: &[Op], sabotage: Sabotaged) -> Result<(), String> {
    let mut w = World::new(sabotage);
    for (step, op) in ops.iter().enumerate() {
        w.apply(*op);
        w.check(step)?;
    }
    w.drain()
}

fn check_all(sabotage: Sabotaged, cases: u32) -> Result<(), String> {
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    runner
        .run(&prop::collection::vec(op(), 1..80), |ops| run(&ops, sabotage).map_err(TestCaseError::fail))
        .map_err(|e| e.to_string())
}

/// Sequences to try: 4 000 by default (about a second), more with
/// `RELAY_MODEL_CASES` for a longer search.
fn cases() -> u32 {
    std::env::var("RELAY_MODEL_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(4000)
}

#[test]
fn partitions_keep_r1_and_the_bound_and_never_stay_paused() {
    if let Err(e) = check_all(Sabotaged::default(), cases()) {
        panic!("{e}");
    }
}

/// Found by the search: two searches under way while the other partition
/// fills the buffer, both answering once it is full.
#[test]
fn stand_ins_found_once_the_buffer_is_full_stay_within_the_bound() {
    use Op::*;
    #[rustfmt::skip]
    let ops = [
        Fetch(1), Fetch(0), Fetch(0), Start, Fetch(0), Step(0), Step(0), FetchLate(1), Fetch(0), Finish(0),
        Step(1), Start, Fetch(1), Finish(1), Step(0), Step(0), Fetch(1), Fetch(0), Fetch(1), Start, Fetch(1),
        Fetch(0), Fetch(1), Fetch(0), ProbeFound(1), Fetch(1), ProbeFound(0),
    ];
    run(&ops, Sabotaged::default()).unwrap();
}

#[test]
fn the_model_check_catches_a_pause_kept_after_the_partition_was_given_back() {
    let sabotage = Sabotaged::of(&[Sabotage::PauseKeptAfterRegrant]);
    let found = check_all(sabotage, 4000).expect_err("the defect must be found");
    assert!(found.contains("stopped short"), "{found}");
}

#[test]
fn the_model_check_catches_a_stand_in_parked_before_records_dropped_ahead_of_it() {
    let sabotage = Sabotaged::of(&[Sabotage::StandInBeforeDropped]);
    let found = check_all(sabotage, 4000).expect_err("the defect must be found");
    assert!(found.contains("never processed"), "{found}");
}
