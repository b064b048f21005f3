//! Deliberately wrong behaviour, per consumer, for the tests that prove the
//! checks catch it (`RELAY_SABOTAGE`). Per consumer, so a sabotaged relay
//! beside a sound one in one test process breaks only itself. Switching it
//! on needs the `sabotage` feature; without it nothing is ever broken and
//! the checks compile to `false`.

#[cfg(feature = "sabotage")]
use std::collections::HashSet;
#[cfg(feature = "sabotage")]
use std::sync::{LazyLock, RwLock};

/// What can be broken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Broken {
    /// Ordering keys are not locked: `seq` follows insert order, not commit
    /// order (issue 22 item 5 put back).
    OrderingByInsert,
    /// The inbox's "already recorded" is ignored: duplicates are applied again (R2).
    NoInboxDedup,
}

#[cfg(feature = "sabotage")]
static BROKEN: LazyLock<RwLock<HashSet<(String, Broken)>>> = LazyLock::new(RwLock::default);

/// Break `what` for `consumer` in this process: for tests only.
#[cfg(feature = "sabotage")]
pub fn set(consumer: &str, what: Broken) {
    BROKEN.write().unwrap_or_else(std::sync::PoisonError::into_inner).insert((consumer.to_owned(), what));
}

/// Whether `what` is broken for `consumer`.
pub(crate) fn is(consumer: &str, what: Broken) -> bool {
    #[cfg(feature = "sabotage")]
    return BROKEN.read().unwrap_or_else(std::sync::PoisonError::into_inner).contains(&(consumer.to_owned(), what));
    #[cfg(not(feature = "sabotage"))]
    {
        let _ = (consumer, what);
        false
    }
}
