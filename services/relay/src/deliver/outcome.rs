//! The messages between the executor and the completer: an attempt's
//! [`Completion`] on its way to be recorded, and how its claim
//! [`Finished`] once it was.

use relay_core::retry::ErrorClass;
use relay_store::intents::{AttemptRecord, ClaimedIntent, NextState};

use super::http::CallResult;

pub use relay_core::retry::Finished;

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
    /// The provider's answer its `on_success` read, kept with the intent
    /// ([`Completion::answered`]).
    pub(super) answer: Option<serde_json::Value>,
    /// Why its outcome's effects are not recorded with it (they could not
    /// be rendered from the answer, or an event does not fit its schema).
    pub(super) effects_dropped: Option<String>,
    /// Its claimed JSON's share of the claims' byte room, given back once
    /// the outcome is recorded (or dropped).
    pub(super) counted: Option<super::counted::Counted>,
}

impl Completion {
    /// Log this attempt as `finished` says it ended, for worker `worker`
    /// (and count it in the metrics).
    pub(super) fn log(&self, worker: &str, finished: Finished) {
        let (intent, result, took) = (&self.intent, &self.result, self.started.elapsed());
        // The attempt's outcome as classified when it ended (`uncertain` for a
        // timeout after sending, even when it left the intent dead).
        let outcome = (finished != Finished::LeaseLost).then_some(self.attempt.outcome);
        crate::runtime::metrics::call(&intent.intent.endpoint, finished, outcome, took.as_secs_f64());
        let mismatch = result.error_class == Some(ErrorClass::KeyMismatch) && finished != Finished::LeaseLost;
        if mismatch {
            crate::runtime::metrics::key_mismatch(&intent.intent.endpoint);
        }
        let status = result.status.map(i64::from).unwrap_or(-1);
        let class = result.error_class.map_or("", ErrorClass::as_str);
        let error = result.error.as_deref().unwrap_or("");
        let call = &intent.intent;
        let (agg, corr) = (call.aggregate_id.as_deref().unwrap_or(""), call.correlation_id.as_deref().unwrap_or(""));
        let ms = took.as_millis() as u64;
        macro_rules! emit {
            ($lvl:expr, $($msg:tt)+) => {
                tracing::event!(
                    $lvl, worker = %worker, intent_id = %intent.id, endpoint = %call.endpoint,
                    action = %call.action, event_id = %call.source_event_id, idempotency_key = %call.idempotency_key,
                    aggregate_id = agg, correlation_id = corr, attempt = intent.attempts, status, error_class = class,
                    result = finished.label(), duration_ms = ms, $($msg)+
                )
            };
        }
        match finished {
            Finished::Succeeded if self.effects_dropped.is_some() => {
                crate::runtime::metrics::effects_dropped(&call.endpoint);
                let why = self.effects_dropped.as_deref().unwrap_or("");
                emit!(
                    tracing::Level::ERROR,
                    "call succeeded, but its events are not emitted and its sagas not moved: {why}"
                )
            }
            Finished::Dead if self.effects_dropped.is_some() => {
                crate::runtime::metrics::effects_dropped(&call.endpoint);
                let why = self.effects_dropped.as_deref().unwrap_or("");
                // A replay is refused for an intent with on_dead effects
                // (intents::requeue), recorded or not: by hand is the way.
                emit!(
                    tracing::Level::ERROR,
                    "intent is dead and will not be retried: {error}; its events are not emitted and its sagas not \
                     moved (emit them by hand: a replay is refused as its on_dead effects are declared): {why}"
                )
            }
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
            Finished::KeyHeld => emit!(
                tracing::Level::DEBUG,
                "another transaction holds an ordering key of this outcome's events; recorded once it is free"
            ),
        }
    }

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
        Completion {
            intent,
            next,
            attempt,
            attempted: true,
            result,
            started: std::time::Instant::now(),
            answer: None,
            effects_dropped: None,
            counted: None,
        }
    }

    /// Why this outcome's effects are not recorded, if they could not be
    /// rendered from the provider's answer or an event does not fit its
    /// topic's schema (known once the completer took it).
    pub fn effects_dropped(&self) -> Option<&str> {
        self.effects_dropped.as_deref()
    }

    /// Record this outcome without its `which` effects (`on_success`,
    /// `on_dead`) for `why`: kept as its attempt's error, for the log and
    /// for `relay intents show`, where an operator who emits them by hand
    /// reads it.
    pub(super) fn drop_effects(&mut self, which: &str, why: &str) {
        let why = format!("{which} effects not recorded: {why}");
        self.attempt.error = Some(match self.attempt.error.take() {
            Some(e) => format!("{e}; {why}"),
            None => why.clone(),
        });
        self.effects_dropped = Some(why);
    }

    /// For a success whose `on_success` reads the provider's answer: its
    /// effects rendered from `answer` (`None`: the provider's answer is not
    /// known), to be recorded with the answer. If they cannot be rendered,
    /// the success is recorded without them, saying why: the provider did
    /// apply the call, so neither a retry nor death would be true.
    pub(super) fn answered(mut self, answer: Option<serde_json::Value>) -> Completion {
        let on_success = &self.intent.intent.on_success;
        if self.next != NextState::Succeeded || !relay_core::Outcome::reads_answer(on_success) {
            return self;
        }
        let rendered = match &answer {
            Some(a) => relay_core::Outcome::answered(on_success, a).map_err(|e| {
                let cut = a.get("truncated").and_then(serde_json::Value::as_bool) == Some(true);
                let hint = if cut {
                    format!(
                        " (the answer's body was longer than endpoints.{}.response_bytes, or cut off by its timeout, \
                         so response.body is null: raise response_bytes)",
                        self.intent.intent.endpoint
                    )
                } else {
                    String::new()
                };
                format!("{}{hint}", e.0)
            }),
            None => Err("the provider's answer is not known (the intent was resolved by an operator)".to_owned()),
        };
        self.answer = answer;
        match rendered {
            Ok(effects) => self.intent.intent.on_success = effects,
            Err(why) => {
                self.intent.intent.on_success = serde_json::json!({});
                self.drop_effects("on_success", &why);
            }
        }
        self
    }

    /// A reconciliation's finding that uncertain intent `intent`, taken for
    /// it, was applied by the provider: it succeeds with its `on_success`
    /// effects; no call attempt was made, so no attempt row is written, and
    /// `why` (what the provider answered) and the answer's `status` are kept
    /// as its last error and status.
    pub fn reconciled(
        intent: ClaimedIntent,
        status: Option<i32>,
        why: String,
        answer: Option<serde_json::Value>,
    ) -> Completion {
        let outcome = relay_core::retry::AttemptOutcome::Succeeded;
        let attempt = AttemptRecord { started_at: None, outcome, status, error_class: None, error: Some(why) };
        Completion { attempted: false, ..Completion::decided(intent, NextState::Succeeded, attempt) }.answered(answer)
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
        Completion { attempted: false, ..Completion::decided(intent, next, attempt) }.answered(None)
    }
}

/// The provider's answer in `r` as `on_success` templates read it, its body
/// kept only when whole and at most `keep` bytes; `via` as
/// [`relay_core::effects::answer`] says.
pub(super) fn answer_of(r: &CallResult, keep: usize, via: &str) -> Option<serde_json::Value> {
    let status = r.status?;
    let body = r.body.as_deref().unwrap_or_default();
    let whole = r.body_complete && body.len() <= keep;
    Some(relay_core::effects::answer(status, &r.headers, body, !whole, via))
}
