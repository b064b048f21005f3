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

/// Deliberately broken behaviour, to prove that `relay verify` and the soak
/// catch the bugs the relay's design exists to prevent. Never set in
/// production: every process that has one logs it at ERROR when it starts.
/// `RELAY_SABOTAGE=offset-before-commit,no-inbox-dedup,…` (the items are
/// this struct's fields, in kebab case).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sabotage {
    /// Commit the Kafka offset *before* the database transaction (breaks R1).
    pub offset_before_commit: bool,
    /// Ignore the inbox's "already recorded" and apply duplicates again (breaks R2).
    pub no_inbox_dedup: bool,
    /// Send a new idempotency key on every attempt (breaks R8).
    pub fresh_idempotency_key: bool,
    /// Check the lease only before the waits for the endpoint's rate and
    /// concurrency limits, not when the request is sent (breaks C17: issue 22 item 4).
    pub lease_checked_before_wait: bool,
    /// Render a JSON null as `none` into keys and paths, and let empty values
    /// through (breaks R8's one key per operation: issue 22 item 3).
    pub null_as_text: bool,
    /// Draw ordering keys' `seq` in insert order, not commit order (breaks
    /// R13 across partitions: issue 22 item 5).
    pub ordering_by_insert: bool,
    /// Key and path templates check only what they print, not every field
    /// they read (breaks R8's one key per operation: issue 27, D6).
    pub printed_values_only: bool,
    /// Let control characters into keys, paths and headers: such a call
    /// dies unsent and fires `on_dead` (issue 27, D4).
    pub controls_unchecked: bool,
    /// Take an empty idempotency key as a key shared by every event that has
    /// one (breaks R4: issue 27, D3).
    pub blank_keys_as_keys: bool,
    /// Decide an intent's end from the last attempt alone, forgetting that an
    /// earlier one may have been applied (fires on_dead for money that may
    /// have moved: issue 28, D1).
    pub uncertainty_forgotten: bool,
    /// Start the lease clock when the claim returns, not before it is sent
    /// (two calls of one intent in flight: issue 28, D2).
    pub lease_clock_after_claim: bool,
    /// Follow the provider's redirects (a 302 to a login page counts as
    /// success: issue 28, D7).
    pub redirects_followed: bool,
    /// Fence outcome effects by intent id alone, not by (id, lease token)
    /// (issue 28, D9).
    pub fenced_by_id: bool,
    /// Commit intent claims without waiting for the disk, as outbox claims
    /// do: a claim lost in a database crash lets a second call of the intent
    /// start while the first is in flight (issue 28, D5).
    pub claims_async: bool,
    /// Take an endpoint's rate token before its concurrency permit: calls
    /// queued behind a stalled provider spend tokens, then all go at once
    /// when it answers again (issue 28, D12).
    pub token_before_permit: bool,
    /// Keep a call slot while waiting for a rate token after a wait for the
    /// slot: a throttled endpoint's calls hold the slots the others need
    /// (second review of issue 28, N4).
    pub slot_kept_for_token: bool,
    /// Provider profiles' answers about keys ignored: "in progress" and "same
    /// key, other request" are read as plain statuses (issue 29, part 1).
    pub key_answers_ignored: bool,
    /// An unknown outcome re-sent to a provider without keys (issue 29, part 1).
    pub unknown_resent: bool,
    /// A 5xx or a provider's "in progress" read as "not applied": a spent
    /// budget then ends dead and announces failures for calls that went through.
    pub server_errors_certain: bool,
}

impl Sabotage {
    /// Parse the comma-separated list.
    pub fn parse(spec: &str) -> Result<Sabotage, String> {
        let mut s = Sabotage::default();
        for item in spec.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            match item {
                "offset-before-commit" => s.offset_before_commit = true,
                "no-inbox-dedup" => s.no_inbox_dedup = true,
                "fresh-idempotency-key" => s.fresh_idempotency_key = true,
                "lease-checked-before-wait" => s.lease_checked_before_wait = true,
                "null-as-text" => s.null_as_text = true,
                "ordering-by-insert" => s.ordering_by_insert = true,
                "printed-values-only" => s.printed_values_only = true,
                "controls-unchecked" => s.controls_unchecked = true,
                "blank-keys-as-keys" => s.blank_keys_as_keys = true,
                "uncertainty-forgotten" => s.uncertainty_forgotten = true,
                "lease-clock-after-claim" => s.lease_clock_after_claim = true,
                "redirects-followed" => s.redirects_followed = true,
                "fenced-by-id" => s.fenced_by_id = true,
                "claims-async" => s.claims_async = true,
                "token-before-permit" => s.token_before_permit = true,
                "slot-kept-for-token" => s.slot_kept_for_token = true,
                "key-answers-ignored" => s.key_answers_ignored = true,
                "unknown-resent" => s.unknown_resent = true,
                "server-errors-certain" => s.server_errors_certain = true,
                other => {
                    return Err(format!(
                        "RELAY_SABOTAGE: unknown item {other:?} (offset-before-commit, no-inbox-dedup, \
                         fresh-idempotency-key, lease-checked-before-wait, null-as-text, ordering-by-insert, \
                         printed-values-only, controls-unchecked, blank-keys-as-keys, uncertainty-forgotten, \
                         lease-clock-after-claim, redirects-followed, fenced-by-id, claims-async, \
                         token-before-permit, slot-kept-for-token, key-answers-ignored, unknown-resent, \
                         server-errors-certain)"
                    ));
                }
            }
        }
        Ok(s)
    }

    /// Any sabotage on.
    pub fn any(&self) -> bool {
        *self != Sabotage::default()
    }

    /// The part of it that relay-core's router and templates put back.
    pub fn core(&self) -> relay_core::sabotage::Sabotage {
        relay_core::sabotage::Sabotage {
            null_as_text: self.null_as_text,
            printed_values_only: self.printed_values_only,
            controls_unchecked: self.controls_unchecked,
            blank_keys_as_keys: self.blank_keys_as_keys,
        }
    }
}

/// The configured faults. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    #[cfg(feature = "faults")]
    points: Arc<HashMap<String, Fault>>,
    #[cfg(feature = "faults")]
    sabotage: Sabotage,
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
        Faults { points: Arc::new(points), sabotage: Sabotage::default() }
    }

    #[cfg(feature = "faults")]
    /// The same faults with `sabotage` switched on.
    pub fn with_sabotage(mut self, sabotage: Sabotage) -> Faults {
        self.sabotage = sabotage;
        self
    }

    /// The sabotage in effect (none, without the `faults` feature).
    pub fn sabotage(&self) -> Sabotage {
        #[cfg(feature = "faults")]
        return self.sabotage;
        #[cfg(not(feature = "faults"))]
        Sabotage::default()
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
            Ok(s) => Sabotage::parse(&s)?,
            Err(_) => Sabotage::default(),
        };
        if sabotage.any() {
            tracing::error!(
                ?sabotage,
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
