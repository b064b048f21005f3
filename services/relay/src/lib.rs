//! The relay service: Kafka's at-least-once delivery turned into
//! exactly-once effects.
//!
//! * [`consumer`] — reads Kafka records and, in one PostgreSQL transaction per
//!   partition batch, records each in the inbox, applies guarded state changes
//!   and writes intents and outbox rows ([`processor`]); the offset is
//!   committed only after that transaction.
//! * [`dispatcher`] — claims intents with `FOR UPDATE SKIP LOCKED` and a lease,
//!   calls the provider outside any transaction with a stable idempotency key,
//!   retries inside a budget, and records the outcome fenced by the lease.
//! * [`publisher`] — publishes outbox rows with an idempotent producer and
//!   marks them published after the broker's acknowledgement.
//!
//! Kafka handlers never call external systems: a [`handler::Handler`] gets a
//! database connection and returns what to call, never a client.
//!
//! The binary (`relay`) is a thin `main` over [`cli`].

pub mod admin;
pub mod app;
pub mod cli;
pub mod consumer;
pub mod demo;
pub mod dispatcher;
pub mod faults;
pub mod handler;
pub mod handoff;
pub mod http;
pub mod kafka;
pub mod metrics;
pub mod processor;
pub mod publisher;
pub mod resume;
pub mod retention;
pub mod server;
pub mod telemetry;
pub mod trace;
pub mod verify;

pub use app::{Components, Relay};
pub use faults::{FaultAction, Faults};
pub use handler::{Handler, HandlerError, Handlers};
