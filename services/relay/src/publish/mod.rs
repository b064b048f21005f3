//! Publish: outbox rows out to Kafka with an idempotent producer, marked
//! published only after the broker's acknowledgement (R10, C14).

pub mod publisher;
