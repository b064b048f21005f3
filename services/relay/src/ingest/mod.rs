//! Ingest: Kafka records in, one PostgreSQL transaction per partition batch,
//! offsets committed after it (R1–R7, R12, R14, R20).
//!
//! * [`consumer`] — reads partitions, batches their records, runs each batch
//!   in one transaction and commits the offsets after it; retries what is
//!   not processable yet and parks poison.
//! * [`processor`] — one batch of records inside the caller's transaction:
//!   route, guard, write (where a record becomes rows).
//! * `partitions` — what the consumer knows of each partition it owns.
//! * `unreadable` — finds a batch the Kafka client cannot read, to park it.
//! * [`handler`] — the code handler trait: a database connection in, more
//!   effects out, never an external client.

pub mod consumer;
pub mod handler;
mod partitions;
pub mod processor;
mod unreadable;
