//! A share of a shared count, given back when dropped: how the dispatcher's
//! rooms (claimed bytes, held outcomes, handed-over calls) are kept exact
//! whichever way a call or an outcome ends.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// `n` counted in a shared count until this is dropped: when its task ends,
/// or when the outcome it travels with is recorded.
pub(super) struct Counted(Arc<AtomicU64>, u64);

impl Counted {
    pub(super) fn add(count: &Arc<AtomicU64>, n: u64) -> Counted {
        count.fetch_add(n, Ordering::Relaxed);
        Counted(count.clone(), n)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::Relaxed);
    }
}
