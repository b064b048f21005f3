//! Any Avro value of the Schema Registry, decoded to an event or
//! dead-lettered, holds no more than Avro may (`relay_budget::allowed`),
//! plus the room apache-avro reserves for a block's claimed items before it
//! reads one (`relay_budget::AVRO_RESERVATION`). Not in `scripts/fuzz.sh`:
//! collections nested in each other each reserve their room before their
//! first item is read (28 bytes of a map schema held 145 MB, over twice the
//! cap), which only decoding with our own bound on claimed counts would stop.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use relay_budget::targets::{Registered, SCHEMAS};
use relay_core::envelope::TopicFormat;

#[global_allocator]
static ALLOCATOR: relay_budget::Counting = relay_budget::Counting;

fn registered() -> &'static Registered {
    static R: OnceLock<Registered> = OnceLock::new();
    R.get_or_init(|| Registered::new(Registered::client()))
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, body)) = data.split_first() else { return };
    let schemas: Vec<_> = SCHEMAS.iter().filter(|(_, format, _)| *format == TopicFormat::Avro).collect();
    let (id, format, _) = schemas[usize::from(pick) % schemas.len()];
    let m = registered().measure(*format, *id, body, &|_, _| {});
    let most = relay_budget::AVRO_RESERVATION + relay_budget::allowed(m.target, m.wire);
    assert!(m.peak <= most, "a value of schema {id}: {m:?} over {most}");
});
