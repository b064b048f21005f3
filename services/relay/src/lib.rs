//! The relay service: Kafka's at-least-once delivery turned into
//! exactly-once effects. The production library, laid out by the life of a
//! record:
//!
//! * [`ingest`] — reads Kafka records and, in one PostgreSQL transaction per
//!   partition batch, records each in the inbox, applies guarded state
//!   changes and writes intents and outbox rows; the offset is committed only
//!   after that transaction.
//! * [`deliver`] — claims intents with `FOR UPDATE SKIP LOCKED` and a lease,
//!   calls the provider outside any transaction with a stable idempotency
//!   key, retries inside a budget, and records the outcome fenced by the lease.
//! * [`publish`] — publishes outbox rows with an idempotent producer and
//!   marks them published after the broker's acknowledgement.
//! * [`runtime`] — what those share: the claim loop's timing and position,
//!   Kafka client settings and logging, metrics, trace propagation, and the
//!   fault points of the crash tests.
//! * [`ops`] — operator actions (replay, pauses, retention) and the HTTP
//!   admin API and console over them.
//! * [`app`] — wires the components of one process together; [`config`]
//!   loads the configuration (file, environment) they are built from.
//!
//! Kafka handlers never call external systems: a [`Handler`] gets a
//! database connection and returns what to call, never a client.
//!
//! The `relay` binary, `relay verify` and `relay demo` live in the
//! `relay-cli` crate, which depends on this one (never the other way).

pub mod app;
pub mod config;
pub mod deliver;
pub mod ingest;
pub mod ops;
pub mod publish;
pub mod runtime;

pub use app::{Components, Relay};
pub use ingest::handler::{Handler, HandlerError, Handlers};
pub use runtime::faults::{FaultAction, Faults};
