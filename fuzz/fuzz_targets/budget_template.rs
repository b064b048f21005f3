//! Any event data, routed and its route's templates rendered, holds no more
//! than templates may (`relay_budget::allowed`).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use relay_budget::targets::Templates;

#[global_allocator]
static ALLOCATOR: relay_budget::Counting = relay_budget::Counting;

fn templates() -> &'static Templates {
    static T: OnceLock<Templates> = OnceLock::new();
    T.get_or_init(Templates::default)
}

fuzz_target!(|data: &[u8]| {
    let m = templates().measure(data, &|_, _| {});
    if let Err(why) = m.check("event data") {
        panic!("{why}");
    }
});
