//! What the lifecycles share at run time: the claim loop's timing and
//! position ([`claim_loop`]), Kafka client settings and its log context
//! ([`kafka`]), fault points for the crash tests ([`faults`]), metrics and
//! trace propagation.

pub mod claim_loop;
pub mod db;
pub mod faults;
pub mod kafka;
pub mod metrics;
pub mod trace;
