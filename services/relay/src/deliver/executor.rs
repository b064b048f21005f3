//! One attempt of a claimed intent: send it by the lease's deadline, classify
//! the answer, and decide the intent's next state
//! ([`relay_core::retry::decide`]); the outcome, a [`Completion`], then goes
//! to the [`completer`](super::completer). The executor owns the endpoints'
//! clients and knows nothing of claims or of how outcomes are recorded.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use chrono::Utc;
use relay_core::config::{EndpointConfig, LEASE_SPARE};
use relay_core::retry::{self, Decision, ErrorClass, Tried, Verdict, classify};
use relay_store::intents::{AttemptRecord, ClaimedIntent};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::http::{CallResult, EndpointClient, Request};
use super::outcome::Completion;
use crate::runtime::faults::{FaultInjected, Faults, Sabotage, point};

/// Makes the calls of one dispatcher: its endpoints' clients, the lease
/// they must be sent within, and the signal to stop waiting.
pub struct Executor {
    endpoints: HashMap<String, EndpointClient>,
    lease: Duration,
    faults: Faults,
    /// Cancelled when the dispatcher stops: calls still waiting to be sent
    /// give their claims back instead of waiting out their endpoint's limits.
    stopping: CancellationToken,
}

impl Executor {
    /// The clients of `endpoints`, for calls under leases of `lease`. Must be
    /// called inside a tokio runtime.
    pub fn new(
        endpoints: &BTreeMap<String, EndpointConfig>,
        lease: Duration,
        faults: Faults,
    ) -> anyhow::Result<Executor> {
        let endpoints = endpoints
            .iter()
            .map(|(name, cfg)| Ok((name.clone(), EndpointClient::new(name, cfg, faults.sabotage())?)))
            .collect::<anyhow::Result<_>>()?;
        Ok(Executor { endpoints, lease, faults, stopping: CancellationToken::new() })
    }

    /// The endpoints it can call.
    pub fn endpoints(&self) -> impl Iterator<Item = &str> {
        self.endpoints.keys().map(String::as_str)
    }

    /// The clients of the endpoints whose rate adapts.
    pub(super) fn adaptive(&self) -> impl Iterator<Item = (&str, &std::sync::Arc<super::throttle::Adaptive>)> {
        self.endpoints.iter().filter_map(|(name, c)| Some((name.as_str(), c.adaptive()?)))
    }

    /// The client of endpoint `name`.
    pub(super) fn client(&self, name: &str) -> Option<&EndpointClient> {
        self.endpoints.get(name)
    }

    /// Cancelled once the dispatcher stops: waits to send end unsent.
    pub(super) fn stopping(&self) -> &CancellationToken {
        &self.stopping
    }

    /// Stop waiting: calls not sent yet come back unsent.
    pub fn stop(&self) {
        self.stopping.cancel();
    }

    /// The latest moment a request for `intent`, claimed at `claimed_at`, may
    /// be sent: the lease's end less the whole attempt
    /// ([`EndpointConfig::call_bound`]) and [`LEASE_SPARE`] — the check that
    /// configuration validation makes too ([`EndpointConfig::min_lease`]).
    /// `claimed_at` is taken before the claim is sent (or, at ingest, before
    /// the insert that claims), so this end comes before the database's.
    pub fn send_by(&self, intent: &ClaimedIntent, claimed_at: std::time::Instant) -> tokio::time::Instant {
        let call = self.endpoints.get(&intent.intent.endpoint).map_or(Duration::ZERO, |e| e.config().call_bound());
        let lease_end = tokio::time::Instant::from_std(claimed_at) + self.lease;
        lease_end.checked_sub(call + LEASE_SPARE).unwrap_or_else(|| tokio::time::Instant::from_std(claimed_at))
    }

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
        let Some(client) = self.endpoints.get(&intent.intent.endpoint) else {
            // Claims take only our endpoints' intents; this one came another
            // way (a hand-over from a consumer with another configuration).
            // Not ours to spend an attempt on: give it back.
            tracing::error!(intent_id = %intent.id, endpoint = %intent.intent.endpoint,
                            "intent of an endpoint this dispatcher does not have; given back uncounted");
            return Ok(Err(intent));
        };
        let now = Utc::now();
        let budget = self.budget_of(&intent, client, now);
        // The answer is read and kept only for an on_success that reads it.
        let reads_answer = relay_core::Outcome::reads_answer(&intent.intent.on_success);
        let (tried, result) = if budget.spent(now).is_some() {
            let r = CallResult {
                error_class: Some(ErrorClass::Budget),
                error: intent.last_error.clone(),
                ..CallResult::not_sent()
            };
            (Tried::Spent, r)
        } else {
            match self.attempt(&intent, client, send_by, slots, reads_answer).await? {
                Some((verdict, r)) => (Tried::Attempt(verdict), r),
                None => return Ok(Err(intent)),
            }
        };
        let decision = retry::decide(&budget, tried, &client.config().backoff, Utc::now(), &mut rand::rng());
        let attempt = attempt_record(&decision, &result);
        let attempted = matches!(tried, Tried::Attempt(_));
        let answer = reads_answer.then(|| super::outcome::answer_of(&result, client.config().response_bytes, "call"));
        let next = decision.next;
        let done = Completion {
            intent,
            next,
            attempt,
            attempted,
            result,
            started,
            answer: None,
            effects_dropped: None,
            counted: None,
        };
        Ok(Ok(done.answered(answer.flatten())))
    }

    /// What `intent`'s budget allows at `now`, with what its endpoint's
    /// profile says about resending and the key window (as of the latest
    /// moment the request may leave, the lease's end, not of the claim: the
    /// waits before the send may outlast the window).
    fn budget_of(&self, intent: &ClaimedIntent, client: &EndpointClient, now: chrono::DateTime<Utc>) -> retry::Budget {
        let mut budget = intent.budget();
        // Deliberately wrong when sabotaged: re-sent without keys.
        budget.resends_unknown =
            client.profile().resends_unknown() || self.faults.sabotage().has(Sabotage::UnknownResent);
        let latest_send = now + chrono::Duration::from_std(self.lease).unwrap_or_default();
        budget.key_forgotten = client.profile().key_forgotten(intent.created_at, latest_send);
        if self.faults.sabotage().has(Sabotage::UncertaintyForgotten) {
            // Deliberately wrong: only this attempt's outcome counts.
            budget.uncertain_before = false;
        }
        budget
    }

    /// Send `intent`'s request by `send_by` and classify the answer; `None`
    /// when it was not sent (the caller gives the claim back).
    async fn attempt(
        &self,
        intent: &ClaimedIntent,
        client: &EndpointClient,
        send_by: tokio::time::Instant,
        slots: &Semaphore,
        reads_answer: bool,
    ) -> Result<Option<(Verdict, CallResult)>, FaultInjected> {
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
        // Deliberately wrong when sabotaged (breaks R8): a new key per attempt.
        let fresh_key = (self.faults.sabotage().has(Sabotage::FreshIdempotencyKey))
            .then(|| format!("{}:{}", intent.intent.idempotency_key, uuid::Uuid::new_v4()));
        let request = Request {
            method: &intent.intent.method,
            path: &intent.intent.path,
            body: intent.intent.body.as_ref(),
            headers: &intent.intent.headers,
            idempotency_key: Some(fresh_key.as_deref().unwrap_or(&intent.intent.idempotency_key)),
            traceparent: hop.traceparent.as_deref().or(intent.intent.traceparent.as_deref()),
            correlation_id: intent.intent.correlation_id.as_deref(),
            intent_id: intent.id,
            attempt: intent.attempts,
            keep_body: if reads_answer { client.config().response_bytes } else { 0 },
        };
        // Deliberately wrong (C17): the waits at the endpoint's limits are not bounded by the lease.
        let send_by = if self.faults.sabotage().has(Sabotage::LeaseCheckedBeforeWait) {
            tokio::time::Instant::now() + Duration::from_secs(86_400)
        } else {
            send_by
        };
        let Ok(mut r) = client.call(request, send_by, slots, &self.stopping).await else {
            hop.end("not_sent");
            return Ok(None);
        };
        hop.end(
            r.status
                .map_or_else(|| r.error_class.map_or("error", ErrorClass::as_str).to_owned(), |s| s.to_string())
                .as_str(),
        );
        self.faults.hit(point::DISPATCHER_AFTER_CALL).await?;
        let verdict = self.verdict_of(&mut r, client, reads_answer);
        Ok(Some((verdict, r)))
    }

    /// What the answer `r` means for retrying ([`classify`]); an applied
    /// call whose answer was cut off where `on_success` reads it counts as
    /// a timeout (`r` says so): asked again with the same key, the provider
    /// gives its stored answer; without keys it is uncertain at once.
    fn verdict_of(&self, r: &mut CallResult, client: &EndpointClient, reads_answer: bool) -> Verdict {
        let mut verdict = classify(&r.attempt, client.also_retry());
        if let Verdict::Retry { retry_after, uncertain: true } = verdict
            && r.status.is_some()
            && self.faults.sabotage().has(Sabotage::ServerErrorsCertain)
        {
            // Deliberately wrong: an answer is taken as proof that nothing was applied.
            verdict = Verdict::Retry { retry_after, uncertain: false };
        }
        let keep = client.config().response_bytes;
        let cut = r.body.as_ref().is_some_and(|b| b.len() < keep) && !r.body_complete;
        if reads_answer && cut && r.status.is_some_and(|s| (200..300).contains(&s)) {
            verdict = Verdict::Retry { retry_after: None, uncertain: true };
            r.error_class = Some(ErrorClass::Timeout);
            r.error = Some(format!(
                "HTTP {} but its body was cut off before its end, and on_success reads it",
                r.status.unwrap_or_default()
            ));
        }
        verdict
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
