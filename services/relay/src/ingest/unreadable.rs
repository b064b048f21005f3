//! Finding a batch the Kafka client cannot read, so that it can be parked
//! instead of stopping its partition for good.
//!
//! librdkafka reports a batch whose bytes do not decompress as an error
//! without its partition or offset (rdkafka's `KafkaError` drops them), and
//! fetches it again and again. This probes, with a client of its own, each
//! assigned partition from the consumer's position: the one whose position
//! cannot be read holds the batch, and reading from later offsets finds the
//! first one that can be (the batch's end). The consumer then parks the
//! offsets in between as one dead letter and fetches on from there.
//!
//! Written here because no crate does it: it is a question about one
//! broker's log, answered with the same client the consumer uses.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Message, Offset, TopicPartitionList};
use relay_core::config::KafkaConfig;
use tracing::warn;

use crate::ingest::partitions::Tp;
use crate::runtime::kafka::{Role, client_config};

/// A run of offsets of one partition the client cannot read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Unreadable {
    pub(super) tp: Tp,
    /// The first offset that cannot be read.
    pub(super) from: i64,
    /// The first offset after it that can (or the partition's end).
    pub(super) until: i64,
    /// What librdkafka said.
    pub(super) error: String,
}

/// What reading one partition from one offset gave.
enum Read {
    /// A record, at this offset (at or after the one asked for).
    Record(i64),
    /// The batch there cannot be read.
    Unreadable(String),
    /// Nothing there yet: the end of the partition.
    End,
    /// No answer in time.
    Unknown,
}

/// Which of `positions` (partition, the consumer's next offset; `None`:
/// the earliest, as the consumer starts without a committed offset) cannot
/// be read there, and up to where. Blocking: run it off the async runtime.
pub(super) fn probe(kafka: &KafkaConfig, positions: &[(Tp, Option<i64>)]) -> Vec<Unreadable> {
    let client = client_config(kafka, Role::Consumer).map(|mut c| {
        c.set("group.id", format!("relay-probe-{}", uuid::Uuid::new_v4()));
        c.set("enable.partition.eof", "true");
        c
    });
    let consumer: BaseConsumer =
        match client.map_err(|e| e.to_string()).and_then(|c| c.create().map_err(|e| e.to_string())) {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "cannot create a client to find an unreadable batch");
                return Vec::new();
            }
        };
    let mut found = Vec::new();
    for (tp, from) in positions {
        let Ok((low, end)) = consumer.fetch_watermarks(&tp.0, tp.1, Duration::from_secs(10)) else { continue };
        let from = from.unwrap_or(low).max(low);
        let Read::Unreadable(error) = read(&consumer, tp, from) else { continue };
        if let Some(until) = first_readable_after(&consumer, tp, from, end) {
            found.push(Unreadable { tp: tp.clone(), from, until, error });
        }
    }
    found
}

/// The first offset after `bad` (which cannot be read) whose record can
/// be, or `end`: one read per offset, in order. A search that jumps ahead
/// (doubling, then halving) would take two corrupt batches with readable
/// records between them for one, and park those records, readable from
/// the topic, as unreadable. Reads of one broken batch fail at once, so
/// the walk costs a fetch per record of the batch. `None` if the broker
/// stops answering.
fn first_readable_after(consumer: &BaseConsumer, tp: &Tp, bad: i64, end: i64) -> Option<i64> {
    walk_to_readable(bad, end, |offset| read(consumer, tp, offset))
}

/// [`first_readable_after`] over any reader.
fn walk_to_readable(bad: i64, end: i64, mut read: impl FnMut(i64) -> Read) -> Option<i64> {
    let mut q = bad + 1;
    while q < end {
        match read(q) {
            // A record at or after `q`: the first readable one (a batch's
            // first offsets may be gone to compaction).
            Read::Record(at) => return Some(at.max(q)),
            Read::Unreadable(_) => q += 1,
            Read::End => return Some(q),
            Read::Unknown => return None,
        }
    }
    Some(end)
}

/// Read `tp` from `offset`.
fn read(consumer: &BaseConsumer, tp: &Tp, offset: i64) -> Read {
    let mut tpl = TopicPartitionList::new();
    if tpl.add_partition_offset(&tp.0, tp.1, Offset::Offset(offset)).is_err() || consumer.assign(&tpl).is_err() {
        return Read::Unknown;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(500)) {
            Some(Ok(m)) if m.partition() == tp.1 && m.offset() >= offset => return Read::Record(m.offset()),
            Some(Err(e @ KafkaError::MessageConsumption(RDKafkaErrorCode::BadCompression))) => {
                return Read::Unreadable(e.to_string());
            }
            Some(Err(KafkaError::PartitionEOF(p))) if p == tp.1 => return Read::End,
            _ => {}
        }
    }
    Read::Unknown
}

#[cfg(test)]
mod tests {
    use super::*;

    // Two corrupt batches (100..=109 and 112..=140) with readable records
    // 110 and 111 between them: the search stops at 110, so 110 and 111 are
    // fetched and applied, not parked without their bytes.
    #[test]
    fn the_search_stops_at_the_first_readable_record_between_two_corrupt_batches() {
        let broken = |o: i64| (100..=109).contains(&o) || (112..=140).contains(&o);
        let read = |o: i64| if broken(o) { Read::Unreadable("bad".into()) } else { Read::Record(o) };
        assert_eq!(walk_to_readable(100, 200, read), Some(110));
        assert_eq!(walk_to_readable(112, 200, read), Some(141));
        assert_eq!(walk_to_readable(112, 130, read), Some(130), "up to the end");
    }
}
