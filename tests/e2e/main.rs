//! Relay's end-to-end tests, one binary: each module is one area, run
//! against the PostgreSQL, Apache Kafka and Schema Registry that
//! `scripts/test.sh` starts; `support` holds the harness and the helpers
//! they share. One binary is linked once (each of sixteen weighed about
//! 370 MB), and its tests share one pool of threads, two at a time.
//!
//! Run one area or one test with a filter:
//! `scripts/test.sh -p relay-cli --test e2e -- crash_matrix::c10`.

mod support;

mod admin;
mod application;
mod cli;
mod compose;
mod consumer;
mod crash_matrix;
mod dispatcher;
mod generative;
mod helm;
mod hostile;
mod plans;
mod providers;
mod registry;
mod soak;
mod tls;
mod verify;
