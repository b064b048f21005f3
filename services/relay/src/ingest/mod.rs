//! Ingest: Kafka records in, one PostgreSQL transaction per partition batch,
//! offsets committed after it (R1–R7, R12, R14, R20).
//!
//! * [`consumer`] — reads partitions, batches their records, runs each batch
//!   in one transaction and commits the offsets after it; retries what is
//!   not processable yet and parks poison.
//! * [`processor`] — one batch of records inside the caller's transaction:
//!   route, guard, write (where a record becomes rows). Beside it:
//!   [`decode`] (values in a Schema Registry format read as JSON),
//!   [`pauses`] (the routes an operator paused, as last read) and [`park`]
//!   (dead letters, key holds and dead-letter topic copies).
//! * `partitions` — what the consumer knows of each partition it owns;
//!   `next` — what a partition task does after each batch (a pure decision).
//! * `unreadable` — finds a batch the Kafka client cannot read, to park it.
//! * [`handler`] — the code handler trait: a database connection in, more
//!   effects out, never an external client.

pub mod consumer;
pub mod decode;
pub mod handler;
mod held;
mod next;
pub mod park;
mod partitions;
pub mod pauses;
pub mod processor;
mod unreadable;
