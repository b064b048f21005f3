//! The `relay` command and the tools users reach through it.
//!
//! * [`cli`] — the command line: `run`, `migrate`, the operator commands
//!   (over [`relay::ops`]), and the two tools below.
//! * [`verify`] — `relay verify`: reads the input topics, the database, the
//!   output topics and the provider's record, and checks every invariant.
//! * [`demo`] — `relay demo`: the whole pipeline on an embedded broker and
//!   the example provider.
//!
//! Why a crate of its own: `verify` reads the whole system as an outsider
//! and `demo` needs the fake provider, so neither belongs in the production
//! library (`relay`), which imports neither; yet users reach both as
//! `relay verify` and `relay demo`, so they ship in the same binary rather
//! than a second one, and the README's commands stay as they are. A cargo
//! feature would have kept them in the production crate's source tree.

pub mod cli;
pub mod demo;
#[cfg(test)]
mod docs_examples;
mod explain;
mod telemetry;
pub mod verify;

/// `text` with its control characters escaped (`\u{1b}` for ESC): what a
/// record or a provider put in an id, a reason or a value must not move the
/// cursor, rewrite lines or set the clipboard of the operator's terminal.
/// JSON output (`--json`) is escaped by serde.
pub fn printable(text: &str) -> String {
    if !text.chars().any(char::is_control) {
        return text.to_owned();
    }
    text.chars().map(|c| if c.is_control() { c.escape_unicode().to_string() } else { c.to_string() }).collect()
}
