//! Any Kafka record: decoding and resolving it must never panic.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use relay_core::{Header, RawRecord};

#[derive(Arbitrary, Debug)]
struct Input {
    /// Names as bytes: producers may write names that are not UTF-8.
    headers: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    key: Option<Vec<u8>>,
    payload: Option<Vec<u8>>,
    small_limit: bool,
}

fuzz_target!(|input: Input| {
    let record = RawRecord {
        topic: "fuzz".into(),
        partition: 0,
        offset: 0,
        key: input.key,
        payload: input.payload,
        headers: input.headers.into_iter().map(|(name, value)| Header::from_wire(&name, value)).collect(),
    };
    relay_core::fuzz::exercise_envelope(&record, if input.small_limit { 64 } else { 1 << 20 });
});
