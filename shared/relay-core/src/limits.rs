//! What text from an event may be, wherever it becomes an id, a key, a
//! header or a reason: bounded in length and free of control characters.
//!
//! Ids and keys end up in PostgreSQL btree indexes (inbox, idempotency keys,
//! aggregates, sagas, per-key ordering), whose entries hold at most about
//! 2.7 kB: a longer one fails its insert with SQLSTATE 54000 on every retry.
//! They and the correlation id, traceparent and rendered headers also end up
//! in HTTP headers, which cannot carry control characters (CloudEvents
//! forbids them in attributes too). Checking here, at decode and render,
//! makes such an event poison naming the field, instead of a partition
//! retried forever or a call that dies unsent and fires `on_dead`.

use std::borrow::Cow;

/// Most bytes of an id or key read from an event (event id and type,
/// aggregate id, idempotency key, correlation and causation id) or rendered
/// into one (idempotency, ordering and record keys, saga ids).
pub const MAX_KEY_BYTES: usize = 1024;

/// Most bytes of a dead-letter reason: it goes to logs, a header of the
/// dead-letter copy and the console, so attacker-sized text stays out.
pub const MAX_REASON_BYTES: usize = 1024;

/// Most headers a record may carry. Kafka allows any number; a record with
/// more is `bad_header` poison, so decoding stays cheap and the dead-letter
/// copy fits the producer's size limit.
pub const MAX_HEADERS: usize = 512;

/// The memory budget of one input relay takes from outside (a record, a row
/// read back, an answer): at most this many bytes held per byte of it on
/// the wire, plus [`MEMORY_PER_INPUT`]. Every JSON input becomes a
/// serde_json tree, which takes 32 bytes per value, 48 while its array
/// grows: `[0,0,…]` is 2 bytes a value on the wire. 64 is one such tree
/// plus the input. Measured by `shared/relay-budget`.
pub const MEMORY_PER_WIRE_BYTE: usize = 64;

/// Memory any one input may take besides [`MEMORY_PER_WIRE_BYTE`] per byte:
/// what a small input costs whatever its size, such as the dead letter of
/// a record of [`MAX_HEADERS`] headers, stored as JSON objects.
pub const MEMORY_PER_INPUT: usize = 1024 * 1024;

/// `text` cut to at most `max` bytes (on a character boundary), saying how
/// long it was.
pub fn bounded(text: &str, max: usize) -> Cow<'_, str> {
    if text.len() <= max {
        return Cow::Borrowed(text);
    }
    let note = format!("… ({} bytes in all)", text.len());
    let mut end = max.saturating_sub(note.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}{note}", &text[..end]))
}

/// The first control character of `text` (CloudEvents' ranges U+0000–U+001F
/// and U+007F–U+009F) and its byte offset.
pub fn control_char(text: &str) -> Option<(usize, char)> {
    text.char_indices().find(|(_, c)| c.is_control())
}

/// Why `value`, the `what` of an event, cannot be an id or key: too long, or
/// holding a control character. The reason names the field, never the value.
pub fn check_key(what: &str, value: &str) -> Result<(), String> {
    if value.len() > MAX_KEY_BYTES {
        return Err(format!("{what} is {} bytes, over the {MAX_KEY_BYTES}-byte limit for ids and keys", value.len()));
    }
    check_controls(what, value)
}

/// Why `value` cannot go into an HTTP header or an id: a control character.
pub fn check_controls(what: &str, value: &str) -> Result<(), String> {
    match control_char(value) {
        Some((at, c)) => Err(format!(
            "{what} contains the control character U+{:04X} at byte {at}; ids, keys and headers cannot carry one",
            u32::from(c)
        )),
        None => Ok(()),
    }
}

/// Whether `value` is empty or only whitespace: never a key.
pub fn is_blank(value: &str) -> bool {
    value.trim().is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_text_is_cut_on_a_character_boundary_saying_how_long_it_was() {
        assert_eq!(bounded("short", 10), "short");
        let long = "é".repeat(1000);
        let cut = bounded(&long, 100);
        assert!(cut.len() <= 100, "{}", cut.len());
        assert!(cut.ends_with("(2000 bytes in all)"), "{cut}");
    }

    #[test]
    fn keys_are_bounded_and_free_of_control_characters_and_the_reason_names_no_value() {
        assert!(check_key("event id", "evt-1").is_ok());
        let long = check_key("event id", &"x".repeat(MAX_KEY_BYTES + 1)).unwrap_err();
        assert!(long.contains("event id") && long.contains("1024"), "{long}");
        for bad in ["o-1\n", "a\rb", "\u{7f}", "x\u{85}", "tab\there"] {
            let why = check_key("idempotency key", bad).unwrap_err();
            assert!(why.contains("idempotency key") && why.contains("U+"), "{why}");
            assert!(!why.contains(bad), "no value in the reason: {why}");
        }
        assert!(is_blank("  \t") && is_blank("") && !is_blank(" k "));
    }
}
