//! Fault points: named places in the pipeline where a test can make the
//! process crash, pause or fail, to hit exact windows of the crash matrix
//! (e.g. after the DB commit and before the offset commit, C2).
//!
//! Enabled only by configuration: `RELAY_FAULTS="consumer.after_db_commit=abort@3"`
//! (abort the process the 3rd time the point is reached) for process-level
//! tests, or `Faults::new` with [`FaultAction::Fail`] for in-process ones.
//! With no faults configured every point is a single map lookup.
//!
//! Only in builds with the `faults` cargo feature, which the tests, the soak
//! and the crash matrix turn on (their dev-dependency on `relay` asks for it)
//! and release builds (Dockerfile, `scripts/bench.sh`) do not: without it
//! [`Faults`] is empty, every point is `Ok(())` the compiler removes,
//! [`Faults::sabotage`] is all off, and a process started with
//! `RELAY_FAULTS` or `RELAY_SABOTAGE` set refuses to start.

#[cfg(feature = "faults")]
use std::collections::HashMap;
#[cfg(feature = "faults")]
use std::sync::Arc;
#[cfg(feature = "faults")]
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The named fault points.
pub mod point {
    /// Consumer: a batch read the holds of its keys (locked until it
    /// commits), nothing of it written yet; hit only where a key of the
    /// partition is held. `Fail` fails the batch like a database error.
    pub const CONSUMER_AFTER_HOLD_READ: &str = "consumer.after_hold_read";
    /// Consumer: the batch is written, the transaction not yet committed.
    pub const CONSUMER_BEFORE_DB_COMMIT: &str = "consumer.before_db_commit";
    /// Consumer: the transaction committed, the offset not yet stored/committed.
    pub const CONSUMER_AFTER_DB_COMMIT: &str = "consumer.after_db_commit";
    /// Dispatcher: intents claimed, no call made yet.
    pub const DISPATCHER_AFTER_CLAIM: &str = "dispatcher.after_claim";
    /// Dispatcher: the provider answered, the outcome not yet recorded.
    pub const DISPATCHER_AFTER_CALL: &str = "dispatcher.after_call";
    /// Dispatcher: a finalizer took a batch of outcomes, nothing of it
    /// written yet (hit once per batch). `Fail` drops the batch unrecorded,
    /// as a crash would: its leases expire and the intents are rescued.
    pub const DISPATCHER_BEFORE_FINISH: &str = "dispatcher.before_finish";
    /// Operator: a chunk of a held key's release committed, the next one
    /// not begun. `Fail` stops the release there, as a crash would.
    pub const RELEASE_AFTER_CHUNK: &str = "release.after_chunk";
    /// Publisher: the broker acknowledged, the rows not yet marked published.
    pub const PUBLISHER_AFTER_ACK: &str = "publisher.after_ack";
    /// Every point: a name in `RELAY_FAULTS` must be one of these.
    pub const ALL: &[&str] = &[
        CONSUMER_AFTER_HOLD_READ,
        CONSUMER_BEFORE_DB_COMMIT,
        CONSUMER_AFTER_DB_COMMIT,
        DISPATCHER_AFTER_CLAIM,
        DISPATCHER_AFTER_CALL,
        DISPATCHER_BEFORE_FINISH,
        RELEASE_AFTER_CHUNK,
        PUBLISHER_AFTER_ACK,
    ];
}

/// What happens when a fault point fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// `std::process::abort()`: like kill -9, nothing is flushed or committed.
    Abort,
    /// Sleep, then continue (to widen a race window).
    Pause(Duration),
    /// Return [`FaultInjected`] to the caller, which stops like a crash
    /// would: nothing after the point is done (in-process tests).
    Fail,
}

#[cfg(feature = "faults")]
#[derive(Debug)]
struct Fault {
    action: FaultAction,
    /// Fire on this hit (1-based); 0 = every hit.
    on_hit: u64,
    hits: AtomicU64,
}

/// A fault fired with [`FaultAction::Fail`].
#[derive(Debug, Clone, thiserror::Error)]
#[error("fault injected at {0}")]
pub struct FaultInjected(pub String);

/// The defects that can be put back, and a process's set of them
/// (`RELAY_SABOTAGE=offset-before-commit,no-inbox-dedup,…`): see
/// [`relay_core::sabotage`]. Never set in production: every process that
/// has one logs it at ERROR when it starts.
pub use relay_core::sabotage::{Sabotage, Sabotaged};

/// The configured faults. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    #[cfg(feature = "faults")]
    points: Arc<HashMap<String, Fault>>,
    #[cfg(feature = "faults")]
    sabotage: Sabotaged,
}

impl Faults {
    /// No faults.
    pub fn none() -> Faults {
        Faults::default()
    }

    #[cfg(feature = "faults")]
    /// Faults from `(point, action, on_hit)` triples; `on_hit` 0 fires every time.
    pub fn new(specs: &[(&str, FaultAction, u64)]) -> Faults {
        let points = specs
            .iter()
            .map(|(p, a, n)| ((*p).to_owned(), Fault { action: *a, on_hit: *n, hits: AtomicU64::new(0) }))
            .collect();
        Faults { points: Arc::new(points), sabotage: Sabotaged::default() }
    }

    #[cfg(feature = "faults")]
    /// The same faults with `sabotage` switched on.
    pub fn with_sabotage(mut self, sabotage: Sabotaged) -> Faults {
        self.sabotage = sabotage;
        self
    }

    /// The sabotage in effect (none, without the `faults` feature).
    pub fn sabotage(&self) -> Sabotaged {
        #[cfg(feature = "faults")]
        return self.sabotage;
        #[cfg(not(feature = "faults"))]
        Sabotaged::default()
    }

    #[cfg(feature = "faults")]
    /// Parse `point=abort[@n],point=pause:500ms[@n],point=fail[@n]`.
    pub fn parse(spec: &str) -> Result<Faults, String> {
        let mut out = Vec::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (point, rest) =
                item.split_once('=').ok_or_else(|| format!("RELAY_FAULTS item {item:?}: expected point=action"))?;
            // A misspelt point would never fire, and the test relying on it
            // would prove nothing.
            if !point::ALL.contains(&point) {
                return Err(format!(
                    "RELAY_FAULTS item {item:?}: unknown fault point {point:?} (known: {})",
                    point::ALL.join(", ")
                ));
            }
            let (action, hit) = match rest.split_once('@') {
                Some((a, n)) => {
                    (a, n.parse::<u64>().map_err(|_| format!("RELAY_FAULTS item {item:?}: bad hit count"))?)
                }
                None => (rest, 0),
            };
            let action = match action {
                "abort" => FaultAction::Abort,
                "fail" => FaultAction::Fail,
                a if a.starts_with("pause:") => FaultAction::Pause(
                    humantime::parse_duration(&a["pause:".len()..])
                        .map_err(|e| format!("RELAY_FAULTS item {item:?}: {e}"))?,
                ),
                other => {
                    return Err(format!(
                        "RELAY_FAULTS item {item:?}: unknown action {other:?} (abort, fail, pause:DURATION)"
                    ));
                }
            };
            out.push((point.to_owned(), action, hit));
        }
        let refs: Vec<(&str, FaultAction, u64)> = out.iter().map(|(p, a, n)| (p.as_str(), *a, *n)).collect();
        Ok(Faults::new(&refs))
    }

    /// From `RELAY_FAULTS` and `RELAY_SABOTAGE`, if set.
    #[cfg(feature = "faults")]
    pub fn from_env() -> Result<Faults, String> {
        let faults = match std::env::var("RELAY_FAULTS") {
            Ok(s) => Faults::parse(&s)?,
            Err(_) => Faults::none(),
        };
        let sabotage = match std::env::var("RELAY_SABOTAGE") {
            Ok(s) => Sabotaged::parse(&s)?,
            Err(_) => Sabotaged::default(),
        };
        if sabotage.any() {
            tracing::error!(
                sabotage = ?sabotage.names(),
                "RELAY_SABOTAGE is set: this process is deliberately broken (for checker tests only)"
            );
        }
        Ok(faults.with_sabotage(sabotage))
    }

    /// No faults; an error if `RELAY_FAULTS` or `RELAY_SABOTAGE` asks for
    /// some, which this build cannot give (a test relying on them would
    /// prove nothing).
    #[cfg(not(feature = "faults"))]
    pub fn from_env() -> Result<Faults, String> {
        match ["RELAY_FAULTS", "RELAY_SABOTAGE"].into_iter().find(|v| std::env::var_os(v).is_some()) {
            Some(var) => Err(format!(
                "{var} is set, but this relay was built without fault points (the `faults` cargo feature, \
                 off in release builds): unset {var}, or build with `cargo build -p relay-cli --features relay/faults`"
            )),
            None => Ok(Faults::none()),
        }
    }

    #[cfg(feature = "faults")]
    /// How many times point `name` was reached (only counted for configured points).
    pub fn hits(&self, name: &str) -> u64 {
        self.points.get(name).map_or(0, |f| f.hits.load(Ordering::SeqCst))
    }

    /// Pass fault point `name`.
    #[cfg(not(feature = "faults"))]
    pub async fn hit(&self, _name: &str) -> Result<(), FaultInjected> {
        Ok(())
    }

    /// Pass fault point `name`.
    #[cfg(feature = "faults")]
    pub async fn hit(&self, name: &str) -> Result<(), FaultInjected> {
        let Some(f) = self.points.get(name) else {
            return Ok(());
        };
        let n = f.hits.fetch_add(1, Ordering::SeqCst) + 1;
        if f.on_hit != 0 && f.on_hit != n {
            return Ok(());
        }
        match f.action {
            FaultAction::Abort => {
                tracing::warn!(point = name, hit = n, "fault point: aborting the process");
                std::process::abort();
            }
            FaultAction::Pause(d) => {
                tracing::warn!(point = name, hit = n, pause = ?d, "fault point: pausing");
                tokio::time::sleep(d).await;
                Ok(())
            }
            FaultAction::Fail => {
                tracing::warn!(point = name, hit = n, "fault point: failing");
                Err(FaultInjected(name.to_owned()))
            }
        }
    }
}

#[cfg(all(test, feature = "faults"))]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_fault_fires_only_on_its_hit() {
        let f = Faults::parse("consumer.after_db_commit=fail@2").unwrap();
        assert!(f.hit("consumer.after_db_commit").await.is_ok());
        assert!(f.hit("consumer.after_db_commit").await.is_err());
        assert!(f.hit("consumer.after_db_commit").await.is_ok());
        assert!(f.hit("other").await.is_ok());
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        let err = Faults::parse("dispatcher.after_call=explode").unwrap_err();
        assert!(err.contains("explode"), "{err}");
        let err = Faults::parse("dispatcher.after_cal=abort").unwrap_err();
        assert!(
            err.contains("unknown fault point \"dispatcher.after_cal\"") && err.contains("dispatcher.after_call"),
            "{err}"
        );
        assert!(Faults::parse("consumer.before_db_commit=pause:20ms@1").is_ok());
    }
}
