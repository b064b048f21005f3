//! What the consumer knows of its partitions: which it owns and since when
//! (revoke generations), how far each is processed, which are held at a
//! paused route or paused at the broker, and the records waiting for each
//! partition's task.

use std::collections::{BTreeMap, HashMap, HashSet};

use relay_core::RawRecord;

use crate::runtime::faults::FaultInjected;

/// A topic and partition.
pub(super) type Tp = (String, i32);

#[derive(Default)]
pub(super) struct PartitionState {
    /// Bumped on every revoke.
    pub(super) generation: u64,
    /// Generation at which each partition was last revoked.
    pub(super) revoked_at: HashMap<Tp, u64>,
    /// Next offset to commit per owned partition (end of the processed prefix).
    pub(super) next_offsets: HashMap<Tp, i64>,
    /// Records of partitions held at a paused route, in order, not yet
    /// processed; the partition is paused at the broker meanwhile.
    pub(super) held: HashMap<Tp, Vec<RawRecord>>,
    /// Partitions whose fetching is paused at the broker (because they are held).
    pub(super) paused_at_broker: HashSet<Tp>,
    /// Partitions whose fetching is paused because a batch of their records
    /// already waits for their task while it waits out a retry
    /// (`InboxConsumer::receive`).
    pub(super) paused_full: HashSet<Tp>,
    /// Partitions whose task is waiting out a retry (R19, or the database):
    /// their records wait outside the shared bound, paused at the broker
    /// once a batch of them waits.
    pub(super) waiting_out: HashSet<Tp>,
}

impl PartitionState {
    /// Whether `tp` was revoked after `generation`.
    pub(super) fn revoked_since(&self, tp: &Tp, generation: u64) -> bool {
        self.revoked_at.get(tp).is_some_and(|revoked| *revoked > generation)
    }
}

/// How one partition's records ended.
pub(super) struct PartitionRun {
    pub(super) tp: Tp,
    /// The revoke generation its task started in.
    pub(super) generation: u64,
    pub(super) interrupted: bool,
    /// Records from a paused route on: to hold until the route is resumed.
    pub(super) held: Vec<RawRecord>,
}

pub(super) type PartitionResult = Result<PartitionRun, FaultInjected>;

/// What the consumer loop holds between receiving records and starting them.
#[derive(Default)]
pub(super) struct Work {
    /// Records received and not started, per partition, in offset order, each
    /// with the revoke generation it was fetched in.
    pub(super) waiting: BTreeMap<Tp, Vec<(RawRecord, u64)>>,
    /// The bytes of `waiting`, per partition.
    pub(super) waiting_bytes: HashMap<Tp, usize>,
    /// Partitions with a task running.
    pub(super) busy: HashSet<Tp>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_counts_as_revoked_only_by_a_revoke_after_its_generation() {
        let tp: Tp = ("orders".into(), 0);
        let mut s = PartitionState::default();
        assert!(!s.revoked_since(&tp, 0), "never revoked");
        s.generation = 2;
        s.revoked_at.insert(tp.clone(), 2);
        assert!(s.revoked_since(&tp, 1), "revoked after a batch fetched in generation 1");
        assert!(!s.revoked_since(&tp, 2), "not by the revoke its own generation began with");
        assert!(!s.revoked_since(&("orders".into(), 1), 0), "other partitions are unaffected");
    }
}
