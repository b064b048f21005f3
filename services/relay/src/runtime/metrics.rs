//! Prometheus metrics (R16), through the `metrics` facade and its Prometheus
//! exporter; `/metrics` on the admin server renders them.
//!
//! Counters are incremented where things happen (consumer, dispatcher,
//! publisher); gauges that describe tables (backlog, oldest pending, dead
//! intents and letters, business counters, estimated table sizes) are
//! refreshed from the database by [`refresh_gauges`] on an interval.
//! Business counters are read from `relay.counters`, which counts unique
//! effects, not deliveries (R20).

use std::sync::OnceLock;

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use relay_core::profile::Reconciled;
use relay_core::retry::{AttemptOutcome, Finished};
use relay_store::stats;
use sqlx::PgPool;

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Install the Prometheus recorder (once per process) and return its handle.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &buckets)
                .expect("static bucket list is not empty");
            match builder.install_recorder() {
                Ok(handle) => handle,
                // Another recorder is installed (an embedding application's):
                // render an empty registry rather than fail.
                Err(_) => PrometheusBuilder::new().build_recorder().handle(),
            }
        })
        .clone()
}

/// One record decided by the consumer.
pub fn record_processed(consumer: &str, topic: &str, route: &str, result: &'static str, seconds: f64) {
    let (c, t, r) = (consumer.to_owned(), topic.to_owned(), route.to_owned());
    counter!("relay_records_processed_total", "consumer" => c.clone(), "topic" => t.clone(), "route" => r, "result" => result)
        .increment(1);
    match result {
        "duplicate" => counter!("relay_duplicates_total", "consumer" => c.clone(), "layer" => "inbox").increment(1),
        "duplicate_key" => {
            counter!("relay_duplicates_total", "consumer" => c.clone(), "layer" => "idempotency_key").increment(1)
        }
        "stale" | "duplicate_version" | "duplicate_sequence" => {
            counter!("relay_out_of_order_total", "consumer" => c.clone(), "result" => result).increment(1)
        }
        "invalid_transition" | "duplicate_transition" => {
            counter!("relay_transition_noops_total", "consumer" => c.clone(), "result" => result).increment(1)
        }
        _ => {}
    }
    histogram!("relay_processing_seconds", "consumer" => c, "topic" => t).record(seconds);
}

/// Records fetched from Kafka.
pub fn records_received(consumer: &str, topic: &str, n: u64) {
    counter!("relay_records_received_total", "consumer" => consumer.to_owned(), "topic" => topic.to_owned())
        .increment(n);
}

/// A record parked as a dead letter.
pub fn dead_lettered(consumer: &str, topic: &str, class: &str) {
    counter!("relay_dead_lettered_total", "consumer" => consumer.to_owned(), "topic" => topic.to_owned(), "class" => class.to_owned())
        .increment(1);
}

/// A batch of `topic` that waited because the Schema Registry could not be asked.
pub fn registry_unavailable(consumer: &str, topic: &str) {
    counter!("relay_schema_registry_unavailable_total", "consumer" => consumer.to_owned(), "topic" => topic.to_owned())
        .increment(1);
}

/// A record parked behind the dead letter that holds its key.
pub fn held(consumer: &str, topic: &str) {
    counter!("relay_records_held_total", "consumer" => consumer.to_owned(), "topic" => topic.to_owned()).increment(1);
}

/// A record without a Kafka key dead-lettered on a `hold_key` route: it
/// holds nothing.
pub fn keyless_not_held(consumer: &str, topic: &str) {
    counter!("relay_keyless_dead_letters_not_held_total", "consumer" => consumer.to_owned(), "topic" => topic.to_owned())
        .increment(1);
}

/// A record that is not processable yet (retried with backoff).
pub fn not_yet(consumer: &str, class: &str) {
    counter!("relay_failures_total", "consumer" => consumer.to_owned(), "kind" => "retryable", "class" => class.to_owned())
        .increment(1);
}

/// A permanent record failure (poison).
pub fn poison(consumer: &str, class: &str) {
    counter!("relay_failures_total", "consumer" => consumer.to_owned(), "kind" => "permanent", "class" => class.to_owned())
        .increment(1);
}

/// Consumer lag of one partition.
pub fn lag(consumer: &str, topic: &str, partition: i32, lag: i64) {
    gauge!("relay_consumer_lag", "consumer" => consumer.to_owned(), "topic" => topic.to_owned(), "partition" => partition.to_string())
        .set(lag as f64);
}

/// A record the consumer could not read from Kafka, by librdkafka's code.
pub fn receive_error(consumer: &str, code: &str) {
    counter!("relay_receive_errors_total", "consumer" => consumer.to_owned(), "code" => code.to_owned()).increment(1);
}

/// Bytes of records the consumer received and has not finished (waiting for
/// their partition's task, or handed to it and not committed): at most
/// `consumer.max_buffered_bytes` plus one record.
pub fn buffered(consumer: &str, bytes: usize) {
    gauge!("relay_consumer_buffered_bytes", "consumer" => consumer.to_owned()).set(bytes as f64);
}

/// One finished call attempt, and how its attempt was classified (none when
/// its lease was lost before that was recorded).
pub fn call(endpoint: &str, finished: Finished, outcome: Option<AttemptOutcome>, seconds: f64) {
    let e = endpoint.to_owned();
    counter!("relay_calls_total", "endpoint" => e.clone(), "result" => finished.label()).increment(1);
    let failure = match finished {
        Finished::Retrying => {
            counter!("relay_call_retries_total", "endpoint" => e.clone()).increment(1);
            Some("retryable")
        }
        Finished::Dead => Some("permanent"),
        Finished::Uncertain => Some("uncertain"),
        Finished::Succeeded | Finished::LeaseLost | Finished::KeyHeld => None,
    };
    if let Some(kind) = failure {
        counter!("relay_call_failures_total", "endpoint" => e.clone(), "kind" => kind).increment(1);
    }
    if outcome == Some(AttemptOutcome::Uncertain) {
        counter!("relay_call_uncertain_total", "endpoint" => e.clone()).increment(1);
    }
    histogram!("relay_dispatch_seconds", "endpoint" => e).record(seconds);
}

/// Intents claimed by a dispatcher: `via` is `claim` (the claim loop) or
/// `ingest` (written claimed by the consumer beside it, [`crate::deliver::handoff`]).
pub fn claimed(via: &'static str, n: u64) {
    counter!("relay_intents_claimed_total", "via" => via).increment(n);
}

/// Leases rescued after their holder was lost.
pub fn rescued(kind: &'static str, n: u64) {
    counter!("relay_leases_rescued_total", "kind" => kind).increment(n);
}

/// An endpoint's adaptive rate: shared by all processes, and this one's share.
pub fn adaptive_rate(endpoint: &str, shared: f64, share: f64) {
    gauge!("relay_endpoint_rate", "endpoint" => endpoint.to_owned(), "scope" => "shared").set(shared);
    gauge!("relay_endpoint_rate", "endpoint" => endpoint.to_owned(), "scope" => "process").set(share);
}

/// OAuth2 tokens fetched for an endpoint's calls (`ok`: whether one came).
pub fn token_fetch(endpoint: &str, ok: bool) {
    let result = if ok { "ok" } else { "error" };
    counter!("relay_oauth2_token_fetches_total", "endpoint" => endpoint.to_owned(), "result" => result).increment(1);
}

/// Outcomes recorded without their effects, which the database rejected:
/// each is an event not emitted or a saga not moved, to be done by hand.
pub fn effects_dropped(endpoint: &str) {
    counter!("relay_outcome_effects_dropped_total", "endpoint" => endpoint.to_owned()).increment(1);
}

/// Calls whose provider said their idempotency key was already used with
/// a different request: alert on any (two calls share a key, a bug upstream).
pub fn key_mismatch(endpoint: &str) {
    counter!("relay_call_key_mismatches_total", "endpoint" => endpoint.to_owned()).increment(1);
}

/// Reconciliations of uncertain intents, by what they learnt.
pub fn reconciled(endpoint: &str, verdict: Reconciled) {
    counter!("relay_reconciliations_total", "endpoint" => endpoint.to_owned(), "verdict" => verdict.as_str())
        .increment(1);
}

/// Outbox records acknowledged by the broker, or failed.
pub fn published(topic: &str, ok: bool) {
    let name = if ok { "relay_outbox_published_total" } else { "relay_outbox_publish_failures_total" };
    counter!(name, "topic" => topic.to_owned()).increment(1);
}

/// An outbox row the broker can never take, ended dead.
pub fn publish_dead(topic: &str) {
    counter!("relay_outbox_dead_total", "topic" => topic.to_owned()).increment(1);
}

/// Refresh the table gauges (see [`stats::Gauges`] for what is exact and
/// what is PostgreSQL's estimate).
pub async fn refresh_gauges(pool: &PgPool) -> Result<(), sqlx::Error> {
    let stats::Gauges { backlog: g, table_rows_estimated } = stats::gauges(&mut *pool.acquire().await?).await?;
    for (state, n) in &g.intents {
        gauge!("relay_intents", "state" => state.as_str()).set(*n as f64);
    }
    gauge!("relay_intents_holding_keys").set(g.intents_holding_keys as f64);
    gauge!("relay_held_keys").set(g.held_keys as f64);
    gauge!("relay_records_held").set(g.records_held as f64);
    gauge!("relay_intent_oldest_unfinished_seconds").set(g.oldest_pending_intent_secs.unwrap_or(0.0));
    for (state, n) in &g.outbox {
        gauge!("relay_outbox_rows", "state" => state.as_str()).set(*n as f64);
    }
    gauge!("relay_outbox_oldest_unpublished_seconds").set(g.oldest_unpublished_outbox_secs.unwrap_or(0.0));
    gauge!("relay_dead_letters", "state" => "unresolved").set(g.dead_letters_unresolved as f64);
    gauge!("relay_dead_letters", "state" => "all").set(g.dead_letters_total as f64);
    for (consumer, name, v) in &g.counters {
        gauge!("relay_business_counter", "consumer" => consumer.clone(), "name" => name.clone()).set(*v as f64);
    }
    for (table, n) in &table_rows_estimated {
        gauge!("relay_table_rows_estimated", "table" => table.clone()).set(*n as f64);
    }
    Ok(())
}
