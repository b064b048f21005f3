//! The relay's pure domain: how a Kafka record becomes an input event, which
//! route applies, what the route produces, which ids those products get, and
//! how failed calls are classified and retried.
//!
//! * [`envelope`] — record to event; [`router`] — event to plan (routes,
//!   templates in [`template`], derived ids in [`ids`]); [`effects`] — the
//!   plan's parts and their encodings.
//! * [`retry`] — [`retry::classify`] an attempt, [`retry::decide`] the
//!   intent's next state (clock and random source passed in), backoff.
//! * [`config`] — the configuration's types and validation.
//!
//! Nothing in this crate performs I/O. That is what makes its decisions
//! deterministic: the same record under the same configuration always decodes,
//! routes and renders to the same plan with the same derived ids (R7), and a
//! permanent failure here is permanent for that record (it is dead-lettered,
//! not retried).

pub mod answers;
pub mod config;
pub mod disposition;
pub mod effects;
pub mod envelope;
pub mod explain;
pub mod fuzz;
pub mod ids;
pub mod limits;
pub mod profile;
pub mod retry;
pub mod router;
pub mod sabotage;
pub mod stored;
pub mod template;

pub use config::RelayConfig;
pub use disposition::{Disposition, InboxOutcome};
pub use effects::{CallSpec, Effects, EmitSpec, Intent, NewIntent, OutboxRecord, Outcome, Plan, Provenance, SagaMove};
pub use envelope::{Header, InputEvent, Poison, PoisonClass, RawRecord};
pub use router::{CompiledRoute, Routed, Router};
pub use stored::{HistoryKind, IntentState, OutboxState, PauseKind, ReplayState};
pub use template::path_segment;

/// An error and every cause under it, `": "`-joined: a TLS or connection
/// failure says why only in its sources (a refused certificate, a reset).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}
