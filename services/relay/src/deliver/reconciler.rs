//! Reconciling uncertain intents: for an endpoint with
//! `[endpoints.NAME.reconcile]`, ask its provider what became of each call
//! whose outcome is unknown — a lookup, or the call again with its key where
//! the provider answers a known key with the stored result — after a delay,
//! within a budget, through the endpoint's own limits and call slots.
//!
//! * applied → the intent succeeds with its `on_success` effects, recorded
//!   by the completer exactly as a call's outcome (fenced by the take's lease
//!   token, effects in the same transaction);
//! * not applied → pending again with a new budget (the provider's word
//!   settles the doubt: it may be sent, and may now end dead);
//! * still unknown → uncertain, asked again after `interval`; once the
//!   budget is spent it waits for an operator.
//!
//! Every question and its answer is a row of `relay.intent_reconciliations`
//! (`relay intents show`, the API and the console list them).

use std::sync::Arc;

use relay_core::profile::{ReconcileConfig, Reconciled};
use relay_core::template::{Context, TemplateBuilder, Templates, TextTemplate};
use relay_store::intents::{self, ClaimedIntent, Fenced};
use relay_store::reconciliations::{self, Asked};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::completer::Completer;
use super::executor::Executor;
use super::http::{CallResult, Request};
use super::outcome::{Completion, Finished};

/// How much of a lookup's answer is read to tell what it says.
const ANSWER_BYTES: usize = 16 * 1024;

/// Intents taken per endpoint and round.
const TAKE: i64 = 16;

/// The endpoints that reconcile, with their compiled lookup paths.
pub(super) struct Reconcilers {
    endpoints: Vec<(String, ReconcileConfig, Option<TextTemplate>)>,
    templates: Templates,
}

impl Reconcilers {
    /// Those of `endpoints` that say how to reconcile; `None` if none do.
    pub(super) fn new(
        endpoints: &std::collections::BTreeMap<String, relay_core::config::EndpointConfig>,
    ) -> anyhow::Result<Option<Reconcilers>> {
        let mut b = TemplateBuilder::default();
        let endpoints: Vec<_> = endpoints
            .iter()
            .filter_map(|(name, e)| {
                let r = e.reconcile.clone()?;
                let path = r.path.as_deref().map(|p| b.path(&format!("endpoints.{name}.reconcile.path"), p));
                Some((name.clone(), r, path))
            })
            .collect();
        if endpoints.is_empty() {
            return Ok(None);
        }
        let templates = b.finish().map_err(|errors| {
            anyhow::anyhow!("{}", errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))
        })?;
        Ok(Some(Reconcilers { endpoints, templates }))
    }

    fn of(&self, endpoint: &str) -> Option<(&ReconcileConfig, Option<&TextTemplate>)> {
        self.endpoints.iter().find(|(n, ..)| n == endpoint).map(|(_, r, t)| (r, t.as_ref()))
    }
}

/// Asks providers about a dispatcher's uncertain intents, through the
/// dispatcher's endpoint clients and call slots, and records what they say
/// as the completer records a call's outcome.
pub(super) struct Reconciler {
    pub(super) pool: sqlx::PgPool,
    pub(super) worker: String,
    pub(super) consumer: String,
    /// The lease of a taken intent, as of a claim's.
    pub(super) lease: std::time::Duration,
    /// How often due intents are looked for.
    pub(super) every: std::time::Duration,
    pub(super) executor: Arc<Executor>,
    pub(super) completer: Arc<Completer>,
    /// Woken when an intent goes back to pending, for the claim loop.
    pub(super) progress: Arc<tokio::sync::Notify>,
    pub(super) reconcilers: Arc<Reconcilers>,
}

impl Reconciler {
    /// Until `shutdown`: every poll interval, take the uncertain intents due
    /// for a reconciliation and ask about each one, in `slots` (the
    /// dispatcher's call slots).
    pub(super) async fn run(self: Arc<Self>, shutdown: CancellationToken, slots: Arc<Semaphore>) {
        let rec = self.reconcilers.clone();
        let every = self.every;
        let mut tasks = JoinSet::new();
        loop {
            tokio::select! { _ = shutdown.cancelled() => break, _ = tokio::time::sleep(every) => {} }
            while tasks.try_join_next().is_some() {}
            for (endpoint, r, _) in &rec.endpoints {
                if shutdown.is_cancelled() {
                    break;
                }
                let taken_at = std::time::Instant::now();
                let taken = match self.pool.acquire().await {
                    Ok(mut conn) => {
                        let (consumer, worker) = (&self.consumer, &self.worker);
                        reconciliations::take_due(
                            &mut conn,
                            consumer,
                            endpoint,
                            r.after,
                            r.max_attempts,
                            TAKE,
                            worker,
                            self.lease,
                        )
                        .await
                    }
                    Err(e) => Err(e),
                };
                match taken {
                    Ok(taken) => {
                        for intent in taken {
                            let (me, rec, slots) = (self.clone(), rec.clone(), slots.clone());
                            tasks.spawn(async move { me.reconcile(&rec, intent, taken_at, &slots).await });
                        }
                    }
                    Err(e) => warn!(endpoint = %endpoint, error = %e, "taking intents to reconcile failed; retrying"),
                }
            }
        }
        while tasks.join_next().await.is_some() {}
    }

    /// Ask about one uncertain intent, record the answer, move the intent.
    async fn reconcile(
        &self,
        rec: &Reconcilers,
        intent: ClaimedIntent,
        taken_at: std::time::Instant,
        slots: &Semaphore,
    ) {
        let (id, token, endpoint) = (intent.id, intent.lease_token, intent.intent.endpoint.clone());
        let (Some((r, path)), Some(client)) = (rec.of(&endpoint), self.executor.client(&endpoint)) else {
            return self.give_back(id, token).await;
        };
        let lookup_path = match self.lookup_path(rec, path, &intent, client) {
            Ok(p) => p,
            // Questions that cannot be asked are answered "unknown" with why:
            // they count against the budget and show in the history, instead
            // of being taken again every round ahead of the others.
            Err(why) => return self.settle_unasked(id, token, &endpoint, self.unasked(why), r, client).await,
        };
        let request = request_of(&intent, r, lookup_path.as_deref(), client);
        let send_by = self.executor.send_by(&intent, taken_at);
        let Ok(answer) = client.call(request, send_by, slots, self.executor.stopping()).await else {
            return self.give_back(id, token).await;
        };
        let (verdict, said) = verdict_of(r, &intent, &answer, client);
        let asked = Asked {
            worker: self.worker.clone(),
            started_at: answer.started_at,
            status: answer.status.map(i32::from),
            verdict,
            error: Some(said.clone()),
        };
        crate::runtime::metrics::reconciled(&endpoint, verdict);
        if self.record(id, token, &asked, r, client).await {
            let via = if lookup_path.is_some() { "lookup" } else { "resend" };
            self.act_on(verdict, intent, &answer, said, via, r, client).await;
        }
    }

    /// The lookup path rendered for `intent` (`None`: the provider is asked
    /// by sending the call again with its key), or why it cannot be asked.
    fn lookup_path(
        &self,
        rec: &Reconcilers,
        path: Option<&TextTemplate>,
        intent: &ClaimedIntent,
        client: &super::http::EndpointClient,
    ) -> Result<Option<String>, String> {
        let lookup_path = match path.map(|t| rec.templates.render(t, &Context::from(lookup_context(intent)))) {
            Some(Ok(p)) => Some(p),
            None => None,
            Some(Err(e)) => return Err(format!("the reconcile path cannot be rendered for this intent: {}", e.0)),
        };
        // As of the latest moment the resend may leave (the lease's end).
        let latest_send = chrono::Utc::now() + chrono::Duration::from_std(self.lease).unwrap_or_default();
        if lookup_path.is_none() && client.profile().key_forgotten(intent.created_at, latest_send) {
            // Sent again now, the call would be a new request to the provider.
            return Err(format!("not sent again: {}", relay_core::retry::KEY_FORGOTTEN));
        }
        Ok(lookup_path)
    }

    /// A question that could not be asked, answered "unknown" with `why`.
    fn unasked(&self, why: String) -> Asked {
        Asked {
            worker: self.worker.clone(),
            started_at: None,
            status: None,
            verdict: Reconciled::Unknown,
            error: Some(why),
        }
    }

    /// Record what a question learnt, fenced by the take's lease token:
    /// `false` when nothing was recorded (the lease was lost, or the
    /// database failed, and the intent is given back).
    async fn record(
        &self,
        id: uuid::Uuid,
        token: uuid::Uuid,
        asked: &Asked,
        r: &ReconcileConfig,
        client: &super::http::EndpointClient,
    ) -> bool {
        let recorded = match self.pool.acquire().await {
            Ok(mut conn) => {
                let max_age = client.config().max_age;
                reconciliations::record(&mut conn, id, token, asked, r.interval, max_age).await
            }
            Err(e) => Err(e),
        };
        match recorded {
            Ok(Fenced::Done) => true,
            Ok(Fenced::LeaseLost) => {
                warn!(intent_id = %id, "reconciliation answered after its lease was lost; nothing recorded");
                false
            }
            Err(e) => {
                error!(intent_id = %id, error = %e, "recording a reconciliation failed; it is asked again later");
                self.give_back(id, token).await;
                false
            }
        }
    }

    /// Move the intent as `verdict` says, once it is recorded: a success
    /// through the completer (its effects once), not applied back to
    /// pending (the claim loop is woken), unknown left uncertain.
    #[allow(clippy::too_many_arguments)]
    async fn act_on(
        &self,
        verdict: Reconciled,
        intent: ClaimedIntent,
        answer: &CallResult,
        said: String,
        via: &str,
        r: &ReconcileConfig,
        client: &super::http::EndpointClient,
    ) {
        let (id, token, endpoint) = (intent.id, intent.lease_token, intent.intent.endpoint.clone());
        match verdict {
            Reconciled::Succeeded => {
                let status = answer.status.map(i32::from);
                let data = super::outcome::answer_of(answer, client.config().response_bytes, via);
                let mut done = [Completion::reconciled(intent, status, said.clone(), data)];
                let finished = self.completer.finalize(&mut done).await;
                if finished.as_slice() == [Finished::Succeeded]
                    && let Some(why) = done[0].effects_dropped()
                {
                    crate::runtime::metrics::effects_dropped(&endpoint);
                    error!(intent_id = %id, endpoint = %endpoint,
                           "{said}, but its events are not emitted and its sagas not moved: {why}");
                } else if finished.as_slice() == [Finished::Succeeded] {
                    info!(intent_id = %id, endpoint = %endpoint, "{said}; its on_success effects are recorded");
                } else {
                    warn!(intent_id = %id, endpoint = %endpoint, result = ?finished,
                          "the provider applied it but the success could not be recorded; asked again later");
                    self.give_back(id, token).await;
                }
            }
            Reconciled::NotApplied => {
                self.progress.notify_one();
                info!(intent_id = %id, endpoint = %endpoint, "{said}");
            }
            Reconciled::Unknown => {
                warn!(intent_id = %id, endpoint = %endpoint, "{said}; still uncertain, asked again in {:?}", r.interval)
            }
        }
    }

    /// Record a question that could not be asked, and return the intent to
    /// uncertain with it counted.
    async fn settle_unasked(
        &self,
        id: uuid::Uuid,
        token: uuid::Uuid,
        endpoint: &str,
        asked: Asked,
        r: &ReconcileConfig,
        client: &super::http::EndpointClient,
    ) {
        warn!(intent_id = %id, endpoint = %endpoint, why = asked.error.as_deref().unwrap_or(""), "reconciliation not asked");
        crate::runtime::metrics::reconciled(endpoint, asked.verdict);
        let recorded = match self.pool.acquire().await {
            Ok(mut conn) => {
                reconciliations::record(&mut conn, id, token, &asked, r.interval, client.config().max_age).await
            }
            Err(e) => Err(e),
        };
        if !matches!(recorded, Ok(Fenced::Done)) {
            self.give_back(id, token).await;
        }
    }

    /// Return a taken intent to uncertain at once (the rescuer would when
    /// the lease expires: never to pending, never a call).
    async fn give_back(&self, id: uuid::Uuid, token: uuid::Uuid) {
        if let Ok(mut conn) = self.pool.acquire().await {
            let _ = intents::give_back_uncertain(&mut conn, id, token).await;
        }
    }
}

/// The question's request: a lookup at `lookup_path`, or the call itself
/// sent again with its key, body and headers.
fn request_of<'i>(
    intent: &'i ClaimedIntent,
    r: &'i ReconcileConfig,
    lookup_path: Option<&'i str>,
    client: &super::http::EndpointClient,
) -> Request<'i> {
    let call = &intent.intent;
    let keep_body = ANSWER_BYTES.max(client.config().response_bytes);
    match lookup_path {
        None => Request {
            method: &call.method,
            path: &call.path,
            body: call.body.as_ref(),
            headers: &call.headers,
            idempotency_key: Some(&call.idempotency_key),
            traceparent: call.traceparent.as_deref(),
            correlation_id: call.correlation_id.as_deref(),
            intent_id: intent.id,
            attempt: intent.attempts,
            keep_body,
        },
        // The intent's own headers go with a lookup too: they may scope it
        // (an account header), and without them a lookup could find nothing
        // and take the call for not applied.
        Some(path) => Request {
            method: &r.method,
            path,
            body: None,
            headers: &call.headers,
            idempotency_key: None,
            traceparent: call.traceparent.as_deref(),
            correlation_id: call.correlation_id.as_deref(),
            intent_id: intent.id,
            attempt: intent.attempts,
            keep_body,
        },
    }
}

/// What `answer` says of `intent`, and the sentence that says it. An
/// applied call whose answer was cut off, where `on_success` reads it,
/// stays unknown: its effects could not be rendered, so it is asked again
/// later, as a call's cut-off answer is.
fn verdict_of(
    r: &ReconcileConfig,
    intent: &ClaimedIntent,
    answer: &CallResult,
    client: &super::http::EndpointClient,
) -> (Reconciled, String) {
    let json = answer.body.as_deref().and_then(|b| serde_json::from_slice(b).ok());
    let mut verdict = r.verdict(answer.status, json.as_ref());
    let keep = ANSWER_BYTES.max(client.config().response_bytes);
    let cut = answer.body.as_ref().is_some_and(|b| b.len() < keep) && !answer.body_complete;
    if verdict == Reconciled::Succeeded && cut && relay_core::Outcome::reads_answer(&intent.intent.on_success) {
        verdict = Reconciled::Unknown;
    }
    let how = if r.resend { "the call sent again with its key" } else { "a lookup" };
    let said = match (verdict, answer.status) {
        (Reconciled::Succeeded, Some(s)) => format!("reconciled by {how}: the provider applied it (HTTP {s})"),
        (Reconciled::NotApplied, Some(s)) => {
            format!("reconciled by {how}: the provider did not apply it (HTTP {s}); queued to be sent again")
        }
        (_, Some(s)) => format!("{how} answered HTTP {s}, which says neither applied nor not applied"),
        (_, None) => format!("{how} got no answer: {}", answer.error.as_deref().unwrap_or("")),
    };
    (verdict, said)
}

/// What a lookup path template sees of an intent.
fn lookup_context(i: &ClaimedIntent) -> serde_json::Value {
    serde_json::json!({
        "intent_id": i.id,
        "idempotency_key": i.intent.idempotency_key,
        "endpoint": i.intent.endpoint,
        "method": i.intent.method,
        "path": i.intent.path,
        "body": i.intent.body,
    })
}
