//! Deliver: intents out to external HTTP APIs, exactly once in effect
//! (R8, R9, R11; C9–C13, C17).
//!
//! * [`dispatcher`] — the claim loop (`FOR UPDATE SKIP LOCKED` and a lease),
//!   which starts each claimed intent on the [`executor`] (one attempt) and
//!   sends its [`outcome::Completion`] to the [`completer`] (outcomes
//!   recorded in batches, fenced by the lease). Beside it run the rescuer
//!   (expired leases back to pending), the [`reconciler`] and the rate sync
//!   of [`throttle`], each a type of its own built from the handles it
//!   needs. None of them imports the dispatcher, and no file here imports
//!   one that imports it back; [`outcome`] holds the messages between
//!   executor and completer. An intent's next state is decided in
//!   [`relay_core::retry::decide`].
//! * [`http`] — one endpoint's client: limits, timeout, the stable
//!   idempotency key; [`auth`] — its OAuth2 tokens and request signing.
//! * [`handoff`] — intents claimed at ingest: the dispatcher owns the
//!   channel; the consumer holds only a sender.
//! * [`throttle`] — an endpoint's adaptive rate, shared by every process.
//! * [`reconciler`] — uncertain intents asked about at their provider, for
//!   endpoints that say how.

pub mod auth;
mod busy;
mod call_result;
pub mod completer;
mod counted;
pub mod dispatcher;
pub mod executor;
pub mod handoff;
pub mod http;
pub mod outcome;
pub mod reconciler;
mod rescuer;
pub mod throttle;
