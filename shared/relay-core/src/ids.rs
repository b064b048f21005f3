//! Deterministic ids for everything the relay derives from an input event (R7).
//!
//! An intent or outbox event produced while processing input `E` for action `A`
//! gets `UUIDv5(NAMESPACE, consumer ␟ E ␟ A)`. Reprocessing the same input (a
//! redelivery, a replay, a second consumer group of the same consumer name)
//! therefore produces the same id, and the primary key turns the second insert
//! into a no-op. Each part is length-prefixed (`5:evt-1`), so no choice of
//! ids can make two different triples hash the same name.

use uuid::Uuid;

/// The relay's UUIDv5 namespace. Never change it: every stored id depends on it.
pub const NAMESPACE: Uuid = Uuid::from_u128(0x6d1b_4f6e_2a0c_5e3b_9c41_7f2d_8a13_0e55);

/// `len:part` for each part: an injective encoding of the tuple.
fn name(parts: &[&str]) -> String {
    let mut out = String::with_capacity(parts.iter().map(|p| p.len() + 4).sum());
    for p in parts {
        out.push_str(&p.len().to_string());
        out.push(':');
        out.push_str(p);
    }
    out
}

/// Id of the intent or outbox event that `action` produces from input `event_id`.
pub fn derived_id(consumer: &str, event_id: &str, action: &str) -> Uuid {
    Uuid::new_v5(&NAMESPACE, name(&[consumer, event_id, action]).as_bytes())
}

/// Id of the dead-letter copy of the record at `topic/partition/offset`: the
/// same position always yields the same dead-letter record id.
pub fn dead_letter_id(consumer: &str, topic: &str, partition: i32, offset: i64) -> Uuid {
    let (partition, offset) = (partition.to_string(), offset.to_string());
    Uuid::new_v5(&NAMESPACE, name(&["dlq", consumer, topic, &partition, &offset]).as_bytes())
}

/// Id of an effect recorded when intent `intent_id` finishes (`outcome` is
/// `succeeded` or `dead`, `action` the name of the effect).
pub fn outcome_id(intent_id: Uuid, outcome: &str, action: &str) -> Uuid {
    let intent_id = intent_id.to_string();
    Uuid::new_v5(&NAMESPACE, name(&["outcome", &intent_id, outcome, action]).as_bytes())
}

/// What `relay.call` puts before an idempotency key or ordering key an
/// application gives (migration 0029), and `relay.publish` before an
/// event's ordering key (0030); what no route's call may render its keys
/// with: an application's row never shares a key with a route's.
pub const APP_KEY_PREFIX: &str = "app:";

/// The `action` of the rows applications write through `relay.call` and
/// `relay.publish` (migration 0027).
pub const APPLICATION_ACTION: &str = "application";

/// Whose rows' keys these are: a route's, or an application's (written by
/// `relay.call` and `relay.publish`, or the outcome of an application's
/// call). The two never share an ordering key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySpace {
    /// Rows a route writes (and the outcomes of its calls).
    Routes,
    /// Rows an application writes (and the outcomes of its calls).
    Applications,
}

impl KeySpace {
    /// The space of the rows an intent of `action` leads to.
    pub fn of_action(action: &str) -> KeySpace {
        if action == APPLICATION_ACTION { KeySpace::Applications } else { KeySpace::Routes }
    }

    /// The ordering key an ordered event of Kafka key `key` is stored under.
    /// An application's is `app:KEY`, as `relay.publish` stores it. A
    /// route's is the key itself or, when it starts with [`APP_KEY_PREFIX`]
    /// or `\`, the key after a `\` (one-to-one, so two keys stay two): a
    /// route's Kafka key is the user's data and is not refused as a call's
    /// keys are, and stored so it is never an application's `app:KEY`.
    pub fn event_ordering_key(self, key: &str) -> String {
        match self {
            KeySpace::Applications => format!("{APP_KEY_PREFIX}{key}"),
            KeySpace::Routes if key.starts_with(APP_KEY_PREFIX) || key.starts_with('\\') => format!("\\{key}"),
            KeySpace::Routes => key.to_owned(),
        }
    }
}

/// Id of a row an application enqueued through `relay.publish` (`kind`
/// `publish`) or `relay.call` (`call`) with business key `key`, for
/// `consumer`. PostgreSQL computes it (`relay.app_id`, migration 0027),
/// where SHA-1, and so UUIDv5, needs an extension the relay's role may not
/// be allowed to create: a UUIDv8 over SHA-256, the name-based layout of
/// RFC 9562 appendix B.2, over the same namespace and injective name.
/// Its own name space (`app`) keeps it apart from every id derived from an
/// input event.
pub fn app_id(consumer: &str, kind: &str, key: &str) -> Uuid {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(NAMESPACE.as_bytes());
    h.update(name(&["app", consumer, kind, key]).as_bytes());
    let digest = h.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    Uuid::new_v8(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_event_s_ordering_key_is_never_an_application_s_and_stays_one_to_one() {
        let keys = ["o-1", "app:o-1", "\\app:o-1", "\\", "", "ap", "\\\\x"];
        let stored: Vec<String> = keys.iter().map(|k| KeySpace::Routes.event_ordering_key(k)).collect();
        assert_eq!(stored[0], "o-1", "an ordinary key is stored as it is");
        assert!(stored.iter().all(|k| !k.starts_with(APP_KEY_PREFIX)), "{stored:?}");
        let distinct: std::collections::BTreeSet<&String> = stored.iter().collect();
        assert_eq!(distinct.len(), keys.len(), "{stored:?}");
    }

    #[test]
    fn the_same_input_and_action_always_yield_the_same_id() {
        assert_eq!(derived_id("c", "e-1", "pay"), derived_id("c", "e-1", "pay"));
    }

    #[test]
    fn consumer_event_and_action_each_change_the_id() {
        let base = derived_id("c", "e-1", "pay");
        assert_ne!(base, derived_id("d", "e-1", "pay"));
        assert_ne!(base, derived_id("c", "e-2", "pay"));
        assert_ne!(base, derived_id("c", "e-1", "ship"));
    }

    #[test]
    fn parts_cannot_bleed_into_each_other() {
        assert_ne!(derived_id("a", "b\u{1f}c", "x"), derived_id("a\u{1f}b", "c", "x"));
        assert_ne!(derived_id("ab", "c", "x"), derived_id("a", "bc", "x"));
    }

    #[test]
    fn ids_are_version_5() {
        assert_eq!(derived_id("c", "e", "a").get_version_num(), 5);
        assert_eq!(dead_letter_id("c", "t", 0, 1).get_version_num(), 5);
    }

    #[test]
    fn the_namespace_is_pinned() {
        // Changing NAMESPACE would silently re-key every stored intent.
        assert_eq!(derived_id("relay", "evt-1", "capture").to_string(), "9c8c32ed-5b43-5349-9391-95fe2caf462d");
    }

    #[test]
    fn application_ids_are_pinned_and_apart_from_event_ids() {
        // The value relay.app_id (migration 0027) gives: stored ids depend on it.
        let id = app_id("relay", "publish", "order-42-placed");
        assert_eq!(id.to_string(), "c65267a0-877c-86de-ba5a-d1b601cdaa66");
        assert_eq!(id.get_version_num(), 8);
        assert_ne!(id, app_id("relay", "call", "order-42-placed"));
        assert_ne!(id, derived_id("relay", "order-42-placed", "publish"));
    }
}
