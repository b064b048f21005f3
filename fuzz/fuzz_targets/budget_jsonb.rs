//! Any intent outcome or body read back from the database holds no more
//! than the dispatcher may (`relay_budget::allowed`).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOCATOR: relay_budget::Counting = relay_budget::Counting;

fuzz_target!(|data: &[u8]| {
    let m = relay_budget::targets::jsonb(data);
    if let Err(why) = m.check("a stored value") {
        panic!("{why}");
    }
});
