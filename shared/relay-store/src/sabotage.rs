//! The defects put back ([`relay_core::sabotage`]) that live in this
//! crate's statements, per consumer: a sabotaged relay beside a sound one in
//! one test process breaks only itself. A registry rather than a parameter:
//! the statements are free functions that callers compose, and a test-only
//! argument on each writer would thread the switch through every production
//! signature. Without the `sabotage` feature nothing is ever registered.

use relay_core::sabotage::Sabotage;
#[cfg(feature = "sabotage")]
use relay_core::sabotage::Sabotaged;
#[cfg(feature = "sabotage")]
use std::collections::HashMap;
#[cfg(feature = "sabotage")]
use std::sync::{LazyLock, RwLock};

#[cfg(feature = "sabotage")]
static REGISTERED: LazyLock<RwLock<HashMap<String, Sabotaged>>> = LazyLock::new(RwLock::default);

/// The defects `consumer`'s relay runs with, in this process.
#[cfg(feature = "sabotage")]
pub fn set(consumer: &str, sabotaged: Sabotaged) {
    let mut all = REGISTERED.write().unwrap_or_else(std::sync::PoisonError::into_inner);
    all.insert(consumer.to_owned(), sabotaged);
}

/// Whether `defect` is on for `consumer`.
pub(crate) fn is(consumer: &str, defect: Sabotage) -> bool {
    #[cfg(feature = "sabotage")]
    return REGISTERED
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(consumer)
        .is_some_and(|s| s.has(defect));
    #[cfg(not(feature = "sabotage"))]
    {
        let _ = (consumer, defect);
        false
    }
}
