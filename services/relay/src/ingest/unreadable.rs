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
/// be, or `end`: doubling steps, then halving, as a batch's offsets all
/// read the same. `None` if the broker stops answering.
fn first_readable_after(consumer: &BaseConsumer, tp: &Tp, bad: i64, end: i64) -> Option<i64> {
    let (mut lo, mut hi, mut first) = (bad, None, end);
    let mut step = 1;
    while hi.is_none() {
        let q = lo + step;
        if q >= end {
            hi = Some(end);
            break;
        }
        match read(consumer, tp, q) {
            Read::Record(at) => {
                hi = Some(q);
                first = at;
            }
            Read::Unreadable(_) => {
                lo = q;
                step *= 2;
            }
            Read::End => hi = Some(end),
            Read::Unknown => return None,
        }
    }
    let mut hi = hi?;
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match read(consumer, tp, mid) {
            Read::Record(at) => {
                hi = mid;
                first = at;
            }
            Read::Unreadable(_) => lo = mid,
            Read::End => hi = mid,
            Read::Unknown => return None,
        }
    }
    Some(first.max(lo + 1))
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
