//! A Kafka record's headers as bytes.
//!
//! rdkafka's safe API hands header names out as `&str` and unwraps the
//! UTF-8 check inside the library (`BorrowedHeaders::try_get`), so a record
//! whose header name is not UTF-8 — which Go's sarama and franz-go, or
//! librdkafka's C API, produce legally — panicked the consumer, and every
//! member the partition moved to after it. Here the
//! headers are read through librdkafka's C API as bytes, and the relay
//! decides what such a record is (`bad_header` poison).
//!
//! It also polls a consumer for what a fetch met, failures included, with
//! their position ([`poll_fetched`]): rdkafka's `KafkaError` drops the
//! partition and offset of a record it could not read.
//!
//! This is the only crate of the workspace that allows `unsafe`; nothing
//! else in it is written by hand.

use std::ffi::CStr;
use std::os::raw::{c_char, c_void};
use std::time::Duration;

use rdkafka::bindings as rdsys;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::BorrowedMessage;
use rdkafka::types::RDKafkaErrorCode;
use relay_core::Header;
use relay_core::envelope::{LeftOut, copy_headers};
use relay_core::limits::MAX_HEADERS;

/// The headers of `message`, in wire order, names as bytes: at most
/// [`MAX_HEADERS`] of them, then, if it has more, one entry saying how many
/// were left out ([`LeftOut`]). A record of many tiny headers costs a few
/// bytes each on the wire and far more each as a [`Header`]; it is
/// `bad_header` poison anyway, so only what its dead letter keeps is copied.
pub fn headers(message: &BorrowedMessage<'_>) -> Vec<Header> {
    let mut hdrs: *mut rdsys::rd_kafka_headers_t = std::ptr::null_mut();
    // SAFETY: `message.ptr()` is the live `rd_kafka_message_t` the borrow
    // keeps alive; librdkafka only writes the out pointer, which then points
    // into the message (owned by it, not to be freed here).
    let err = unsafe { rdsys::rd_kafka_message_headers(message.ptr(), &mut hdrs) };
    if err == rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__NOENT {
        return Vec::new();
    }
    // Any other error is a header list librdkafka refuses to parse: more
    // than 100 000 headers, or malformed. Read as none, it would be a
    // record without headers, poison for the wrong reason.
    if err != rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || hdrs.is_null() {
        return vec![Header::left_out(LeftOut::Unreadable)];
    }
    // SAFETY: `hdrs` belongs to the message, alive for this borrow.
    let count = unsafe { rdsys::rd_kafka_header_cnt(hdrs) };
    copy_headers(count, MAX_HEADERS, |idx| {
        let mut name: *const c_char = std::ptr::null();
        let mut value: *const c_void = std::ptr::null();
        let mut size: usize = 0;
        // SAFETY: `hdrs` belongs to the message, alive for this borrow; the
        // out pointers are valid locals. Past the last header librdkafka
        // returns an error and writes nothing.
        let err = unsafe { rdsys::rd_kafka_header_get_all(hdrs, idx, &mut name, &mut value, &mut size) };
        if err != rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
            return None;
        }
        // SAFETY: librdkafka keeps header names NUL-terminated, and the name
        // lives as long as the headers; `copy_headers` copies it before the
        // borrow ends.
        let name = unsafe { CStr::from_ptr(name) }.to_bytes();
        let value = if value.is_null() {
            None
        } else {
            // SAFETY: a non-null value points at `size` bytes owned by the
            // headers, copied by `copy_headers` before the borrow ends.
            Some(unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) })
        };
        Some((name, value))
    })
}

/// What one poll of a consumer met.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fetched {
    /// A record of `partition` at `offset`.
    Record {
        /// The record's partition.
        partition: i32,
        /// The record's offset.
        offset: i64,
    },
    /// The end of `partition`'s log (with `enable.partition.eof`).
    End {
        /// The partition.
        partition: i32,
    },
    /// A fetch of `partition` failed with `code` at `offset`: for a batch
    /// that does not decompress, the batch's first offset (librdkafka's
    /// msgset reader reports its `BaseOffset`), whichever offset was asked
    /// for. librdkafka hands these over as error events, or as messages
    /// with an error; both are read.
    Failed {
        /// The partition.
        partition: i32,
        /// Where librdkafka says it failed.
        offset: i64,
        /// Why.
        code: RDKafkaErrorCode,
    },
    /// Nothing within the timeout, or something else than a fetch (a log
    /// line, a client error without a partition).
    Nothing,
}

/// Poll `consumer` (created with a `group.id`, so that its events come on
/// the consumer queue) once, for at most `timeout`. For a consumer that
/// assigns partitions by hand: a rebalance event would be dropped here.
pub fn poll_fetched(consumer: &BaseConsumer, timeout: Duration) -> Fetched {
    let rk = consumer.client().native_ptr();
    // SAFETY: `rk` is the live handle `consumer` owns; the queue returned is
    // a new reference, destroyed below.
    let queue = unsafe { rdsys::rd_kafka_queue_get_consumer(rk) };
    if queue.is_null() {
        return Fetched::Nothing;
    }
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: `queue` is the valid reference taken above.
    let event = unsafe { rdsys::rd_kafka_queue_poll(queue, ms) };
    // SAFETY: taken above and not used after; an event polled from it
    // keeps what it needs.
    unsafe { rdsys::rd_kafka_queue_destroy(queue) };
    if event.is_null() {
        return Fetched::Nothing;
    }
    // SAFETY: `event` is the live event polled above.
    let fetched = if unsafe { rdsys::rd_kafka_event_type(event) } == rdsys::RD_KAFKA_EVENT_FETCH {
        // SAFETY: a fetch event holds one message, owned by the event, read
        // here before the event is destroyed.
        let message = unsafe { rdsys::rd_kafka_event_message_next(event).as_ref() };
        match message {
            None => Fetched::Nothing,
            Some(m) if m.err == rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR => {
                Fetched::Record { partition: m.partition, offset: m.offset }
            }
            Some(m) if m.err == rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__PARTITION_EOF => {
                Fetched::End { partition: m.partition }
            }
            Some(m) => Fetched::Failed { partition: m.partition, offset: m.offset, code: m.err.into() },
        }
    // SAFETY: `event` is the live event polled above.
    } else if unsafe { rdsys::rd_kafka_event_type(event) } == rdsys::RD_KAFKA_EVENT_ERROR {
        // A consumer's error (a batch that does not decompress among them)
        // comes as an error event carrying its partition and offset.
        // SAFETY: `event` is live; the error code is a plain value.
        let code = unsafe { rdsys::rd_kafka_event_error(event) };
        // SAFETY: `event` is live; the partition returned is a new
        // allocation (or null), copied and destroyed here.
        let at = unsafe { rdsys::rd_kafka_event_topic_partition(event) };
        // SAFETY: null or the allocation above, read before it is destroyed.
        let place = unsafe { at.as_ref() }.map(|tp| (tp.partition, tp.offset));
        if !at.is_null() {
            // SAFETY: allocated by librdkafka for this call, destroyed once.
            unsafe { rdsys::rd_kafka_topic_partition_destroy(at) };
        }
        match place {
            Some((partition, _)) if code == rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__PARTITION_EOF => {
                Fetched::End { partition }
            }
            Some((partition, offset)) => Fetched::Failed { partition, offset, code: code.into() },
            None => Fetched::Nothing,
        }
    } else {
        Fetched::Nothing
    };
    // SAFETY: polled above, destroyed once; nothing read from it is kept.
    unsafe { rdsys::rd_kafka_event_destroy(event) };
    fetched
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use rdkafka::ClientConfig;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::{Header as KHeader, OwnedHeaders};
    use rdkafka::mocking::MockCluster;
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    use rdkafka::{Offset, TopicPartitionList};
    use relay_core::envelope::{DecodeOptions, FieldOverrides, PoisonClass, RawRecord, decode};

    use super::*;

    /// Records produced to a librdkafka mock cluster, each with `counts[i]`
    /// headers (an empty name and a null value) then a structured-mode
    /// content type, read back through [`headers`].
    fn produced_and_read(counts: &[usize]) -> Vec<RawRecord> {
        let mock = MockCluster::new(1).unwrap();
        mock.create_topic("t", 1, 1).unwrap();
        let bootstrap = mock.bootstrap_servers();
        let producer: BaseProducer = ClientConfig::new().set("bootstrap.servers", &bootstrap).create().unwrap();
        let body = br#"{"specversion":"1.0","id":"e-1","type":"t","source":"/s","data":{}}"#;
        for &n in counts {
            let mut hs = OwnedHeaders::new_with_capacity(n + 1);
            for _ in 0..n {
                hs = hs.insert(KHeader { key: "", value: None::<&[u8]> });
            }
            hs = hs.insert(KHeader { key: "content-type", value: Some("application/cloudevents+json") });
            producer
                .send(BaseRecord::<[u8], [u8]>::to("t").payload(&body[..]).headers(hs))
                .map_err(|(e, _)| e)
                .unwrap();
        }
        producer.flush(Duration::from_secs(30)).unwrap();
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", "g")
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset("t", 0, Offset::Beginning).unwrap();
        consumer.assign(&tpl).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut out = Vec::new();
        while out.len() < counts.len() {
            assert!(Instant::now() < deadline, "read {} of {} records", out.len(), counts.len());
            let Some(m) = consumer.poll(Duration::from_millis(200)) else { continue };
            let m = m.unwrap();
            out.push(RawRecord {
                topic: "t".into(),
                partition: 0,
                offset: rdkafka::Message::offset(&m),
                key: None,
                payload: rdkafka::Message::payload(&m).map(<[u8]>::to_vec),
                headers: headers(&m),
            });
        }
        out
    }

    #[test]
    fn a_record_with_more_headers_than_the_relay_reads_is_bad_header_and_not_copied_whole() {
        let fields = FieldOverrides::default();
        let opts = DecodeOptions {
            max_record_bytes: 960 * 1024,
            format: relay_core::envelope::TopicFormat::Cloudevents,
            fields: &fields,
        };
        // Under librdkafka's own limit (100 000), over it, and a normal record.
        let records = produced_and_read(&[5_000, 300_000, 3]);
        for (record, n) in records.iter().zip([5_000, 300_000]) {
            assert!(
                record.headers.len() <= MAX_HEADERS + 1,
                "{n} headers on the wire: {} copied into memory",
                record.headers.len()
            );
            let err = decode(record, &opts).unwrap_err();
            assert_eq!(err.class, PoisonClass::BadHeader, "{n} headers: {err}");
            assert!(err.reason.contains("headers"), "{n} headers: {err}");
        }
        // Under librdkafka's limit the count is known; over it, only that there were too many.
        assert_eq!(records[0].headers_left_out(), Some(LeftOut::Headers(5_000 + 1 - MAX_HEADERS)));
        let err = decode(&records[0], &opts).unwrap_err();
        assert!(err.reason.contains("record has 5001 headers, more than the 512"), "{err}");
        assert_eq!(records[1].headers, [Header::left_out(LeftOut::Unreadable)]);
        let err = decode(&records[1], &opts).unwrap_err();
        assert!(err.reason.contains("headers could not be read"), "{err}");
        let normal = decode(&records[2], &opts).unwrap();
        assert_eq!(normal.id, "e-1");
        assert_eq!(records[2].headers.len(), 4);
    }
}
