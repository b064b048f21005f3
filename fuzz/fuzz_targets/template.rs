//! Any template over any event data: compiling and rendering must never panic.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    source: String,
    data: String,
}

fuzz_target!(|input: Input| {
    let data: serde_json::Value = serde_json::from_str(&input.data).unwrap_or(serde_json::Value::String(input.data));
    let ctx = serde_json::json!({"id": "e-1", "type": "t", "data": data});
    relay_core::fuzz::exercise_template(&input.source, &ctx);
});
