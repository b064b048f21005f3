//! One attempt of a claimed intent: send it by the lease's deadline, classify
//! the answer, and decide the intent's next state
//! ([`relay_core::retry::decide`]); the outcome then goes to the
//! [`completer`](super::completer).

use std::time::Duration;

use chrono::Utc;
use relay_core::retry::{self, Decision, ErrorClass, Tried, classify};
use relay_store::intents::{AttemptRecord, ClaimedIntent, NextState};
use tokio::sync::{Semaphore, mpsc};

use super::dispatcher::{Dispatcher, Finished};
use super::http::{CallResult, Request};
use crate::runtime::faults::{FaultInjected, point};

impl Dispatcher {
    /// Make one attempt of a claimed intent, if its request can be sent by
    /// `send_by` once its endpoint lets it and a call slot of `slots` is
    /// free, and decide where the intent goes next (`Err(intent)`: not sent,
    /// to give back). The slot is held only for the call; the outcome then
    /// goes to the finalizer (`hand_over`), which records it batched with
    /// other calls' outcomes and logs it.
    pub async fn execute(
        &self,
        intent: ClaimedIntent,
        send_by: tokio::time::Instant,
        slots: &Semaphore,
    ) -> Result<Result<Completion, ClaimedIntent>, FaultInjected> {
        let started = std::time::Instant::now();
        let Some(client) = self.inner.endpoints.get(&intent.intent.endpoint) else {
            // Claims take only our endpoints' intents; this one came another
            // way (a hand-over from a consumer with another configuration).
            // Not ours to spend an attempt on: give it back.
            tracing::error!(intent_id = %intent.id, endpoint = %intent.intent.endpoint,
                            "intent of an endpoint this dispatcher does not have; given back uncounted");
            return Ok(Err(intent));
        };
        let now = Utc::now();
        let mut budget = intent.budget();
        if self.inner.faults.sabotage().uncertainty_forgotten {
            // Deliberately wrong (D1): only this attempt's outcome counts.
            budget.uncertain_before = false;
        }
        let (tried, result) = if budget.spent(now).is_some() {
            let r = CallResult {
                error_class: Some(ErrorClass::Budget),
                error: intent.last_error.clone(),
                ..CallResult::not_sent()
            };
            (Tried::Spent, r)
        } else {
            let attrs = || {
                vec![
                    opentelemetry::KeyValue::new("relay.intent_id", intent.id.to_string()),
                    opentelemetry::KeyValue::new("relay.endpoint", intent.intent.endpoint.clone()),
                    opentelemetry::KeyValue::new("relay.attempt", i64::from(intent.attempts)),
                    opentelemetry::KeyValue::new("relay.idempotency_key", intent.intent.idempotency_key.clone()),
                ]
            };
            let hop = crate::runtime::trace::Hop::start(
                "relay.call",
                opentelemetry::trace::SpanKind::Client,
                intent.intent.traceparent.as_deref(),
                attrs,
            );
            let fresh_key = self
                .inner
                .faults
                .sabotage()
                .fresh_idempotency_key
                // Deliberately wrong (R8): a new key per attempt.
                .then(|| format!("{}:{}", intent.intent.idempotency_key, uuid::Uuid::new_v4()));
            let request = Request {
                method: &intent.intent.method,
                path: &intent.intent.path,
                body: intent.intent.body.as_ref(),
                headers: &intent.intent.headers,
                idempotency_key: fresh_key.as_deref().unwrap_or(&intent.intent.idempotency_key),
                traceparent: hop.traceparent.as_deref().or(intent.intent.traceparent.as_deref()),
                correlation_id: intent.intent.correlation_id.as_deref(),
                intent_id: intent.id,
                attempt: intent.attempts,
            };
            // Deliberately wrong (C17): the waits at the endpoint's limits are not bounded by the lease.
            let send_by = if self.inner.faults.sabotage().lease_checked_before_wait {
                tokio::time::Instant::now() + Duration::from_secs(86_400)
            } else {
                send_by
            };
            let Ok(r) = client.call(request, send_by, slots, &self.inner.stopping).await else {
                hop.end("not_sent");
                return Ok(Err(intent));
            };
            hop.end(
                r.status
                    .map_or_else(|| r.error_class.map_or("error", ErrorClass::as_str).to_owned(), |s| s.to_string())
                    .as_str(),
            );
            self.inner.faults.hit(point::DISPATCHER_AFTER_CALL).await?;
            (Tried::Attempt(classify(&r.attempt, &client.config().retryable_statuses)), r)
        };
        let decision = retry::decide(&budget, tried, &client.config().backoff, Utc::now(), &mut rand::rng());
        let attempt = attempt_record(&decision, &result);
        let attempted = matches!(tried, Tried::Attempt(_));
        Ok(Ok(Completion { intent, next: decision.next, attempt, attempted, result, started }))
    }

    /// Hand an attempt's outcome to the finalizer, waiting while its queue
    /// is full.
    pub(super) async fn hand_over(&self, completion: Completion, done: &mpsc::Sender<Completion>) {
        if let Err(lost) = done.send(completion).await {
            self.log_attempt(&lost.0, Finished::LeaseLost);
        }
    }

    pub(super) fn log_attempt(&self, c: &Completion, finished: Finished) {
        let (intent, result, took) = (&c.intent, &c.result, c.started.elapsed());
        let label = match finished {
            Finished::Succeeded => "succeeded",
            Finished::Retrying => "retrying",
            Finished::Dead => "dead",
            Finished::Uncertain => "uncertain",
            Finished::LeaseLost => "lease_lost",
        };
        // The attempt's outcome as classified when it ended (`uncertain` for a
        // timeout after sending, even when it left the intent dead).
        let outcome = if finished == Finished::LeaseLost { "" } else { c.attempt.outcome.as_str() };
        crate::runtime::metrics::call(&intent.intent.endpoint, label, outcome, took.as_secs_f64());
        let status = result.status.map(i64::from).unwrap_or(-1);
        let class = result.error_class.map_or("", ErrorClass::as_str);
        let error = result.error.as_deref().unwrap_or("");
        let call = &intent.intent;
        let (agg, corr) = (call.aggregate_id.as_deref().unwrap_or(""), call.correlation_id.as_deref().unwrap_or(""));
        let ms = took.as_millis() as u64;
        macro_rules! emit {
            ($lvl:expr, $($msg:tt)+) => {
                tracing::event!(
                    $lvl, worker = %self.inner.worker, intent_id = %intent.id, endpoint = %call.endpoint,
                    action = %call.action, event_id = %call.source_event_id, idempotency_key = %call.idempotency_key,
                    aggregate_id = agg, correlation_id = corr, attempt = intent.attempts, status, error_class = class,
                    result = label, duration_ms = ms, $($msg)+
                )
            };
        }
        match finished {
            Finished::Succeeded => emit!(tracing::Level::DEBUG, "call succeeded"),
            Finished::Retrying => {
                emit!(tracing::Level::WARN, "call failed; retrying with the same idempotency key: {error}")
            }
            Finished::Dead => emit!(
                tracing::Level::ERROR,
                "intent is dead and will not be retried (replay it once the cause is fixed): {error}"
            ),
            Finished::Uncertain => emit!(
                tracing::Level::ERROR,
                "intent is out of budget and its last attempt may have been applied: left uncertain for an \
                 operator to decide (replay asks again with the same idempotency key): {error}"
            ),
            Finished::LeaseLost => emit!(
                tracing::Level::WARN,
                "lease lost before the outcome was recorded; another worker owns this intent now, nothing recorded"
            ),
        }
    }
}

/// An attempt's outcome on its way to the finalizer.
pub struct Completion {
    // (Fields are the executor's and the completer's; `Completion::decided`
    // builds one from outside, for tests of the completer.)
    pub(super) intent: ClaimedIntent,
    pub(super) next: NextState,
    pub(super) attempt: AttemptRecord,
    /// Whether a request was made (not when the claim found the budget spent).
    pub(super) attempted: bool,
    pub(super) result: CallResult,
    pub(super) started: std::time::Instant,
}

impl Completion {
    /// The outcome `next` of an attempt of `intent` that made a request and
    /// ended as `attempt` says, as the executor hands it to the completer.
    pub fn decided(intent: ClaimedIntent, next: NextState, attempt: AttemptRecord) -> Completion {
        let result = CallResult {
            status: attempt.status.and_then(|s| u16::try_from(s).ok()),
            error_class: attempt.error_class,
            error: attempt.error.clone(),
            started_at: attempt.started_at,
            ..CallResult::not_sent()
        };
        Completion { intent, next, attempt, attempted: true, result, started: std::time::Instant::now() }
    }

    /// An operator's resolution `next` of uncertain intent `intent`, taken
    /// for it ([`relay_store::intents::take_uncertain`]): no attempt was
    /// made, so no audit row is written; `why` (who resolved it, what the
    /// provider said) is kept as its last error, class `resolved`, whichever
    /// way it ended.
    pub fn resolved(intent: ClaimedIntent, next: NextState, why: String) -> Completion {
        let outcome = match next {
            NextState::Succeeded => relay_core::retry::AttemptOutcome::Succeeded,
            _ => relay_core::retry::AttemptOutcome::Permanent,
        };
        let error_class = Some(ErrorClass::Resolved);
        let attempt = AttemptRecord { started_at: None, outcome, status: None, error_class, error: Some(why) };
        Completion { attempted: false, ..Completion::decided(intent, next, attempt) }
    }
}

/// What to record about an attempt: its outcome class, status and error,
/// with the decision's reason in front when the budget ended the intent.
pub(super) fn attempt_record(d: &Decision, r: &CallResult) -> AttemptRecord {
    let error = match &d.why {
        Some(why) => Some(format!("{why}; last error: {}", r.error.as_deref().unwrap_or("none"))),
        None => r.error.clone(),
    };
    AttemptRecord {
        started_at: r.started_at,
        outcome: d.outcome,
        status: r.status.map(i32::from),
        error_class: r.error_class,
        error,
    }
}
