//! Checks switched off on purpose, each putting a fixed defect back, for the
//! tests that prove the generative test and the soak catch it. Only with the
//! `sabotage` feature (through `relay/faults`), never in a release build.

/// Which fixed defects to put back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sabotage {
    /// Render `null` as `none` and let empty values through (issue 22 item 3).
    pub null_as_text: bool,
    /// Check only the values a key or path prints, not every field it reads
    /// (`{{ 'capture:' ~ data.order_id }}` renders `capture:none`: issue 27, D6).
    pub printed_values_only: bool,
    /// Let control characters into keys, paths and headers (issue 27, D4).
    pub controls_unchecked: bool,
    /// Take an empty idempotency key extension as a key (issue 27, D3).
    pub blank_keys_as_keys: bool,
}

impl Sabotage {
    /// Any of them on.
    pub fn any(&self) -> bool {
        *self != Sabotage::default()
    }
}
