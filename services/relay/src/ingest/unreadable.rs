//! Finding a batch the Kafka client cannot read, so that it can be parked
//! instead of stopping its partition for good.
//!
//! librdkafka reports a batch whose bytes do not decompress as an error
//! without its partition or offset (rdkafka's `KafkaError` drops them), and
//! fetches it again and again. This probes, with a client of its own, each
//! assigned partition from the consumer's position: the one whose position
//! cannot be read holds the batch, and reads from later offsets, which fail
//! naming the batch's first offset while they fall in it, find its end. The
//! consumer then parks the offsets in between as one dead letter and
//! fetches on from there.
//!
//! Written here because no crate does it: it is a question about one
//! broker's log, answered with the same client the consumer uses.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use relay_core::config::KafkaConfig;
use relay_kafka_raw::Fetched;
use tracing::warn;

use crate::ingest::partitions::TopicPartition;
use crate::runtime::kafka::consumer_config;

/// A run of offsets of one partition the client cannot read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Unreadable {
    pub(super) tp: TopicPartition,
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
    /// The batch there cannot be read; it starts at `base`.
    Unreadable { base: i64, error: String },
    /// Nothing there yet: the end of the partition.
    End,
    /// No answer in time.
    Unknown,
}

/// Which of `positions` (partition, the consumer's next offset; `None`:
/// the earliest, as the consumer starts without a committed offset) cannot
/// be read there, and up to where (in topics whose largest batch is
/// `largest_batch`). Blocking: run it off the async runtime.
pub(super) fn probe(
    kafka: &KafkaConfig,
    largest_batch: usize,
    positions: &[(TopicPartition, Option<i64>)],
) -> Vec<Unreadable> {
    let client = consumer_config(kafka, largest_batch).map(|mut c| {
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
        let Ok((low, end)) = consumer.fetch_watermarks(&tp.topic, tp.partition, Duration::from_secs(10)) else {
            continue;
        };
        let from = from.unwrap_or(low).max(low);
        let Read::Unreadable { base, error } = read(&consumer, tp, from) else { continue };
        if let Some(until) = first_readable_after(&consumer, tp, base, from, end) {
            found.push(Unreadable { tp: tp.clone(), from, until, error });
        }
    }
    found
}

/// The first offset after `bad` (in the batch starting at `base`, which
/// cannot be read) that is not in that batch, or `end`. A read anywhere in
/// a batch fails naming the batch's first offset, so "fails naming `base`"
/// holds up to the batch's end and not after it: the search doubles its
/// step until it leaves the batch, then halves back to the end, in about
/// 2 log2(n) reads for a batch of n records (one batch can hold hundreds of
/// thousands). It never passes the batch's end, so readable records after
/// it, and a corrupt batch after those, are not taken into it. `None` if
/// the broker stops answering.
fn first_readable_after(consumer: &BaseConsumer, tp: &TopicPartition, base: i64, bad: i64, end: i64) -> Option<i64> {
    search_batch_end(base, bad, end, |offset| read(consumer, tp, offset))
}

/// [`first_readable_after`] over any reader.
fn search_batch_end(base: i64, bad: i64, end: i64, mut read: impl FnMut(i64) -> Read) -> Option<i64> {
    // Where the batch's end lies: after `inside`, at or before `outside`.
    let mut inside = bad;
    let mut outside = None;
    let mut step = 1;
    // Whether the read at `q` left the batch, and what it found there.
    let mut left = |q: i64| -> Option<Option<i64>> {
        match read(q) {
            Read::Unreadable { base: b, .. } if b == base => Some(None),
            // A record at or after `q` (a batch's first offsets may be
            // gone to compaction), or another batch that fails: where it starts.
            Read::Record(at) => Some(Some(at.max(q))),
            Read::Unreadable { .. } | Read::End => Some(Some(q)),
            Read::Unknown => None,
        }
    };
    while outside.is_none() {
        let q = inside.saturating_add(step);
        if q >= end {
            outside = Some((end, end));
            break;
        }
        match left(q)? {
            None => {
                inside = q;
                step = step.saturating_mul(2);
            }
            Some(found) => outside = Some((q, found)),
        }
    }
    let (mut hi, mut found) = outside.expect("set before the loop ends");
    while hi - inside > 1 {
        let mid = inside + (hi - inside) / 2;
        match left(mid)? {
            None => inside = mid,
            Some(f) => (hi, found) = (mid, f),
        }
    }
    Some(found)
}

/// Read `tp` from `offset`.
fn read(consumer: &BaseConsumer, tp: &TopicPartition, offset: i64) -> Read {
    let mut tpl = TopicPartitionList::new();
    if tpl.add_partition_offset(&tp.topic, tp.partition, Offset::Offset(offset)).is_err()
        || consumer.assign(&tpl).is_err()
    {
        return Read::Unknown;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        match relay_kafka_raw::poll_fetched(consumer, Duration::from_millis(500)) {
            Fetched::Record { partition, offset: at } if partition == tp.partition && at >= offset => {
                return Read::Record(at);
            }
            Fetched::Failed { partition, offset: base, code: code @ RDKafkaErrorCode::BadCompression }
                if partition == tp.partition =>
            {
                return Read::Unreadable { base, error: KafkaError::MessageConsumption(code).to_string() };
            }
            Fetched::End { partition } if partition == tp.partition => return Read::End,
            _ => {}
        }
    }
    Read::Unknown
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader over corrupt batches (first offset, first offset after),
    /// every other offset readable, counting its reads.
    fn reader(batches: &[(i64, i64)], reads: &mut usize) -> impl FnMut(i64) -> Read {
        move |o: i64| {
            *reads += 1;
            match batches.iter().find(|(from, until)| (*from..*until).contains(&o)) {
                Some(&(base, _)) => Read::Unreadable { base, error: "bad".into() },
                None => Read::Record(o),
            }
        }
    }

    // Two corrupt batches (100..=109 and 112..=140) with readable records
    // 110 and 111 between them: the search stops at 110, so 110 and 111 are
    // fetched and applied, not parked without their bytes.
    #[test]
    fn the_search_stops_at_the_first_readable_record_between_two_corrupt_batches() {
        let batches = [(100, 110), (112, 141)];
        let mut n = 0;
        assert_eq!(search_batch_end(100, 100, 200, reader(&batches, &mut n)), Some(110));
        assert_eq!(search_batch_end(112, 112, 200, reader(&batches, &mut n)), Some(141));
        assert_eq!(search_batch_end(112, 112, 130, reader(&batches, &mut n)), Some(130), "up to the end");
        assert_eq!(search_batch_end(100, 104, 200, reader(&batches, &mut n)), Some(110), "from inside the batch");
        // Two corrupt batches back to back: the first ends where the second starts.
        let touching = [(100, 110), (110, 300)];
        assert_eq!(search_batch_end(100, 100, 400, reader(&touching, &mut n)), Some(110));
    }

    // One read per offset: a ~1 MB zstd batch of tiny records spans
    // hundreds of thousands of offsets, and a read costs a fetch of the
    // whole batch, so the walk stalled its partition for hours.
    #[test]
    fn the_end_of_a_batch_of_a_million_records_is_found_in_a_few_dozen_reads() {
        let mut reads = 0;
        let found = search_batch_end(100, 100, 5_000_000, reader(&[(100, 1_000_100)], &mut reads));
        assert_eq!(found, Some(1_000_100));
        assert!(reads <= 64, "{reads} reads");
    }
}
