//! Fixed defects that can be put back on purpose, for the tests that prove a
//! check catches each one: `relay verify`, the soak, the generative test, the
//! partition model check. One enum names them all ([`Sabotage`]); a process
//! carries the ones switched on as one value ([`Sabotaged`]), set from
//! `RELAY_SABOTAGE=offset-before-commit,no-inbox-dedup,…` or by a test.
//!
//! Only with the `sabotage` feature (through `relay/faults`), never in a
//! release build: without it [`Sabotaged::has`] is `false`, which the
//! compiler folds away, and nothing can switch one on.

/// One defect that can be put back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Sabotage {
    /// Commit the Kafka offset before the database transaction (breaks R1).
    OffsetBeforeCommit,
    /// Ignore the inbox's "already recorded": duplicates are applied again (breaks R2).
    NoInboxDedup,
    /// Send a new idempotency key on every attempt (breaks R8).
    FreshIdempotencyKey,
    /// Check the lease only before the waits for the endpoint's rate and
    /// concurrency limits, not when the request is sent (breaks C17).
    LeaseCheckedBeforeWait,
    /// Render a JSON null as `none` into keys and paths and let empty values
    /// through (breaks R8's one key per operation).
    NullAsText,
    /// Draw ordering keys' `seq` in insert order, not commit order (breaks
    /// R13 across partitions).
    OrderingByInsert,
    /// Key and path templates check only what they print, not every field
    /// they read: `{{ 'capture:' ~ data.order_id }}` renders `capture:none`.
    PrintedValuesOnly,
    /// Let control characters into keys, paths and headers: such a call dies
    /// unsent and fires `on_dead`.
    ControlsUnchecked,
    /// Take an empty idempotency key as a key shared by every event that has
    /// one (breaks R4).
    BlankKeysAsKeys,
    /// Decide an intent's end from its last attempt alone, forgetting that an
    /// earlier one may have been applied: `on_dead` for money that may have moved.
    UncertaintyForgotten,
    /// Start the lease clock when the claim returns, not before it is sent:
    /// two calls of one intent in flight.
    LeaseClockAfterClaim,
    /// Follow the provider's redirects: a 302 to a login page counts as success.
    RedirectsFollowed,
    /// Fence outcome effects by intent id alone, not by (id, lease token).
    FencedById,
    /// Commit intent claims without waiting for the disk, as outbox claims
    /// do: a claim lost in a database crash lets a second call of the intent
    /// start while the first is in flight.
    ClaimsAsync,
    /// Take an endpoint's rate token before its concurrency permit: calls
    /// queued behind a stalled provider spend tokens, then all go at once.
    TokenBeforePermit,
    /// Keep a call slot while waiting for a rate token after a wait for the
    /// slot: a throttled endpoint's calls hold the slots the others need.
    SlotKeptForToken,
    /// Read a provider profile's answers about keys ("in progress", "same
    /// key, other request") as plain statuses.
    KeyAnswersIgnored,
    /// Send an unknown outcome again to a provider that keeps no keys.
    UnknownResent,
    /// Read a 5xx or a provider's "in progress" as "not applied": a spent
    /// budget then ends dead and announces failures for calls that went through.
    ServerErrorsCertain,
    /// A partition paused as slow while given back to this member stays
    /// paused when the old task ends: it stalls for good (the partition
    /// model check).
    PauseKeptAfterRegrant,
    /// An unreadable batch's stand-in is queued even while records before it
    /// were dropped or are not fetched yet: commits past them, breaking R1
    /// (the partition model check).
    StandInBeforeDropped,
    /// Leave partitions fetching while the consumer's buffer is full: the
    /// client reads ahead records of large keys and empty values until the
    /// process runs out of memory.
    ReadAheadPastFullBuffer,
}

impl Sabotage {
    /// Every defect, with the name `RELAY_SABOTAGE` gives it.
    pub const NAMES: [(Sabotage, &'static str); 22] = [
        (Sabotage::OffsetBeforeCommit, "offset-before-commit"),
        (Sabotage::NoInboxDedup, "no-inbox-dedup"),
        (Sabotage::FreshIdempotencyKey, "fresh-idempotency-key"),
        (Sabotage::LeaseCheckedBeforeWait, "lease-checked-before-wait"),
        (Sabotage::NullAsText, "null-as-text"),
        (Sabotage::OrderingByInsert, "ordering-by-insert"),
        (Sabotage::PrintedValuesOnly, "printed-values-only"),
        (Sabotage::ControlsUnchecked, "controls-unchecked"),
        (Sabotage::BlankKeysAsKeys, "blank-keys-as-keys"),
        (Sabotage::UncertaintyForgotten, "uncertainty-forgotten"),
        (Sabotage::LeaseClockAfterClaim, "lease-clock-after-claim"),
        (Sabotage::RedirectsFollowed, "redirects-followed"),
        (Sabotage::FencedById, "fenced-by-id"),
        (Sabotage::ClaimsAsync, "claims-async"),
        (Sabotage::TokenBeforePermit, "token-before-permit"),
        (Sabotage::SlotKeptForToken, "slot-kept-for-token"),
        (Sabotage::KeyAnswersIgnored, "key-answers-ignored"),
        (Sabotage::UnknownResent, "unknown-resent"),
        (Sabotage::ServerErrorsCertain, "server-errors-certain"),
        (Sabotage::PauseKeptAfterRegrant, "pause-kept-after-regrant"),
        (Sabotage::StandInBeforeDropped, "stand-in-before-dropped"),
        (Sabotage::ReadAheadPastFullBuffer, "read-ahead-past-full-buffer"),
    ];

    /// Its name in `RELAY_SABOTAGE`.
    pub fn name(self) -> &'static str {
        Sabotage::NAMES.iter().find(|(s, _)| *s == self).map_or("", |(_, n)| n)
    }

    #[cfg(feature = "sabotage")]
    fn bit(self) -> u32 {
        1 << (self as u32)
    }
}

/// The defects switched on in a process (or a test's relay): none, but in a
/// build with the `sabotage` feature.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sabotaged(u32);

impl Sabotaged {
    /// These defects on.
    #[cfg(feature = "sabotage")]
    pub fn of(defects: &[Sabotage]) -> Sabotaged {
        Sabotaged(defects.iter().fold(0, |bits, d| bits | d.bit()))
    }

    /// Parse `RELAY_SABOTAGE`'s comma-separated names.
    #[cfg(feature = "sabotage")]
    pub fn parse(spec: &str) -> Result<Sabotaged, String> {
        let mut on = Vec::new();
        for item in spec.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            match Sabotage::NAMES.iter().find(|(_, n)| *n == item) {
                Some((s, _)) => on.push(*s),
                None => {
                    let names: Vec<&str> = Sabotage::NAMES.iter().map(|(_, n)| *n).collect();
                    return Err(format!("RELAY_SABOTAGE: unknown item {item:?} ({})", names.join(", ")));
                }
            }
        }
        Ok(Sabotaged::of(&on))
    }

    /// Whether `defect` is on.
    pub fn has(self, defect: Sabotage) -> bool {
        #[cfg(feature = "sabotage")]
        return self.0 & defect.bit() != 0;
        #[cfg(not(feature = "sabotage"))]
        {
            let _ = defect;
            false
        }
    }

    /// Whether any is on.
    pub fn any(self) -> bool {
        cfg!(feature = "sabotage") && self.0 != 0
    }

    /// The names of those on, for the log line every sabotaged process writes.
    pub fn names(self) -> Vec<&'static str> {
        Sabotage::NAMES.iter().filter(|(s, _)| self.has(*s)).map(|(_, n)| *n).collect()
    }
}

#[cfg(all(test, feature = "sabotage"))]
mod tests {
    use super::*;

    #[test]
    fn every_defect_has_a_name_and_a_bit_of_its_own_and_parses_back() {
        let all: Vec<Sabotage> = Sabotage::NAMES.iter().map(|(s, _)| *s).collect();
        let spec: Vec<&str> = all.iter().map(|s| s.name()).collect();
        let on = Sabotaged::parse(&spec.join(",")).unwrap();
        assert!(all.iter().all(|s| on.has(*s)));
        assert_eq!(on.names(), spec);
        assert_eq!(Sabotaged::parse("fenced-by-id").unwrap().names(), ["fenced-by-id"]);
        let err = Sabotaged::parse("fenced-by-ids").unwrap_err();
        assert!(err.contains("\"fenced-by-ids\"") && err.contains("claims-async"), "{err}");
    }
}
