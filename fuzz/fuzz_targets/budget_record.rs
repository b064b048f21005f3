//! Any record, read and decoded to an event or dead-lettered, holds no more
//! than its target may (`relay_budget::allowed`): a record of many headers
//! the budget itself, a record's value what the envelope may hold today.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use relay_budget::targets::{self, WireRecord};
use relay_core::envelope::TopicFormat;
use relay_core::limits::MAX_HEADERS;

#[global_allocator]
static ALLOCATOR: relay_budget::Counting = relay_budget::Counting;

#[derive(Arbitrary, Debug)]
struct Input {
    /// Names as bytes: producers may write names that are not UTF-8.
    headers: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    /// Tiny headers added after them, as many as the fuzzer asks (librdkafka
    /// reads at most 100 000).
    tiny: u16,
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    /// 0: CloudEvents, 1: plain JSON, 2: a registry value decoded to JSON.
    format: u8,
}

fuzz_target!(|input: Input| {
    let mut headers = input.headers;
    headers.extend((0..input.tiny).map(|_| (Vec::new(), None)));
    let target = if headers.len() > MAX_HEADERS { targets::HEADERS } else { targets::ENVELOPE };
    let format = [TopicFormat::Cloudevents, TopicFormat::Json, TopicFormat::Avro][usize::from(input.format % 3)];
    let record = WireRecord { key: input.key, value: input.value, headers };
    let m = targets::envelope(target, &record, format, MAX_HEADERS, &|_, _| {});
    if let Err(why) = m.check(&format!("a record of {} headers", record.headers.len())) {
        panic!("{why}");
    }
});
