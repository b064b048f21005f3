//! The routes an operator paused, as this process last read them: every
//! partition task reads them at once, and a slow read from before a pause
//! must not undo a newer one that has it.

use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::Instant;

/// The paused routes as last read. Cheap to clone; the clones share them.
#[derive(Clone, Debug, Default)]
pub struct PausedRoutes(Arc<RwLock<Read>>);

#[derive(Debug, Default)]
struct Read {
    routes: HashSet<String>,
    /// When the read that gave `routes` started.
    read_at: Option<Instant>,
}

impl PausedRoutes {
    /// Replace the set with `routes`, read now.
    pub fn set(&self, routes: impl IntoIterator<Item = String>) {
        self.set_as_of(routes, Instant::now());
    }

    /// Replace the set with `routes`, whose read started at `read_at`, unless
    /// a read that started later was stored already.
    pub fn set_as_of(&self, routes: impl IntoIterator<Item = String>, read_at: Instant) {
        let mut p = self.0.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if p.read_at.is_some_and(|at| at > read_at) {
            return;
        }
        p.read_at = Some(read_at);
        p.routes.clear();
        p.routes.extend(routes);
    }

    /// Whether route `name` is paused.
    pub fn contains(&self, name: &str) -> bool {
        self.0.read().unwrap_or_else(std::sync::PoisonError::into_inner).routes.contains(name)
    }
}
