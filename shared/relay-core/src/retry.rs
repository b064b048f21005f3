//! Retry classification, backoff and an intent's next state (R8, R10).
//!
//! Three pure functions, each the only place its decision is made:
//! [`classify`] turns one attempt's result into a [`Verdict`];
//! [`decide`] turns a verdict and the intent's [`Budget`] into its
//! [`NextState`]; [`BackoffPolicy::delay`] draws the wait before the next
//! attempt. The clock (`now`) and the random source are parameters, so tests
//! pin every branch with a fixed time and a seeded generator.
//!
//! Schedule: the exponential ceiling comes from `backon`'s
//! [`ExponentialBuilder`] (min delay, factor, max delay); the delay is then
//! drawn uniformly from `[0, ceiling]` ("full jitter"). backon's own jitter adds
//! `[0, ceiling)` on top of the ceiling, which keeps synchronised retries
//! closer together than full jitter does, so we only take its schedule.
//! With the defaults (500 ms, ×2, 60 s cap) the ceilings are
//! 0.5 s, 1 s, 2 s, 4 s, … 32 s, 60 s, 60 s, …

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::stored::{IntentState, stored_names};

pub use crate::answers::AttemptResult;

/// The decision for one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The call took effect.
    Success,
    /// Try again with the same idempotency key.
    Retry {
        /// The provider asked for at least this long.
        retry_after: Option<Duration>,
        /// The request may have taken effect (a timeout after sending, a
        /// reset, a 5xx, "in progress": [`crate::answers::TABLE`]): recorded
        /// as an *uncertain* attempt, retried with the same key.
        uncertain: bool,
    },
    /// Never retried: a client error the provider will keep returning.
    Permanent,
    /// Never retried: the provider says the key was used with a different
    /// request — two calls share a key, a bug upstream that needs a person.
    KeyMismatch,
}

/// Classify an attempt, by the outcome table ([`crate::answers::TABLE`]):
/// a success succeeds, a key mismatch is never retried, an answer the table
/// retries is retried (uncertain when it may have been applied), and every
/// other answer is permanent.
///
/// Why 409 is retried by default without a profile: providers that
/// implement idempotency keys answer `409 Conflict` while a request with the
/// same key is *still being processed*, which is what the relay meets when
/// it retries after a timeout. That 409 is not itself an unknown outcome:
/// the earlier request that may have reached the provider already made the
/// intent uncertain (a timeout, a reset, a 5xx, a lost lease), and a 409 on a
/// first attempt is more likely a business conflict ("already refunded").
/// A profile's own "in progress" answer is different: the provider says a
/// request with this key reached it, so it may have been applied. An
/// endpoint whose API uses 409 for business conflicts sets
/// `retryable_statuses = []`.
pub fn classify(result: &AttemptResult, also_retry: &[u16]) -> Verdict {
    let answer = crate::answers::Answer::of(result, also_retry);
    let meaning = answer.meaning();
    let retry_after = match *result {
        AttemptResult::Response { retry_after, .. } => retry_after,
        _ => None,
    };
    match answer {
        crate::answers::Answer::Success => Verdict::Success,
        crate::answers::Answer::KeyMismatch => Verdict::KeyMismatch,
        _ if meaning.retried => Verdict::Retry { retry_after, uncertain: meaning.may_have_applied },
        _ => Verdict::Permanent,
    }
}

/// Parse a `Retry-After` value: delay-seconds or an HTTP date (relative to
/// `now`) in any of the three forms RFC 9110 says a recipient must accept
/// (IMF-fixdate, RFC 850, asctime), which `httpdate` parses.
pub fn parse_retry_after(value: &str, now: chrono::DateTime<chrono::Utc>) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at: chrono::DateTime<chrono::Utc> = httpdate::parse_http_date(value).ok()?.into();
    Some((at - now).to_std().unwrap_or(Duration::ZERO))
}

stored_names! {
    /// How one attempt ended, as `intent_attempts.outcome` stores it (a CHECK
    /// constraint holds the same names, and `tests/e2e/plans.rs` checks that they
    /// match). Whether the provider may have applied it is decided here and
    /// nowhere else ([`AttemptOutcome::may_have_applied`]).
    pub enum AttemptOutcome ("attempt outcome") {
        /// The call took effect.
        Succeeded = "succeeded",
        /// Failed, known not to have taken effect, and worth another attempt.
        Retryable = "retryable",
        /// Failed for good (a client error), or no attempt left.
        Permanent = "permanent",
        /// No answer after the request may have reached the provider.
        Uncertain = "uncertain",
        /// The worker lost its lease (crashed or stalled) with the call maybe sent.
        LeaseExpired = "lease_expired",
    }
}

impl AttemptOutcome {
    /// Whether the provider may have applied the call in this attempt: once
    /// one attempt of an intent may have, the intent can end succeeded or
    /// uncertain, never dead (no `on_dead` effect for money that may have moved).
    pub fn may_have_applied(self) -> bool {
        matches!(self, AttemptOutcome::Uncertain | AttemptOutcome::LeaseExpired)
    }
}

stored_names! {
    /// What went wrong in an attempt, as `intent_attempts.error_class` and
    /// `intents.last_error_class` store it (CHECK constraints hold the same names).
    pub enum ErrorClass ("error class") {
        /// The provider answered with a status that is not 2xx.
        HttpStatus = "http_status",
        /// No answer within the endpoint's timeout.
        Timeout = "timeout",
        /// The connection could not be made.
        Connect = "connect",
        /// Another transport error (reset mid-exchange, TLS).
        Transport = "transport",
        /// The request could not be expressed (a bad header, method or body).
        Request = "request",
        /// No attempt: the budget (attempts or max age) was spent at the claim.
        Budget = "budget",
        /// The worker holding the lease was lost.
        LeaseExpired = "lease_expired",
        /// The dispatcher had no client for the intent's endpoint. No longer
        /// written, since claims take only the dispatcher's own endpoints;
        /// rows written before keep it.
        EndpointUnknown = "endpoint_unknown",
        /// An operator resolved an uncertain intent, having asked the provider
        /// (as failed: its `on_dead` effects are the operator's word, not a
        /// guess; as succeeded: the class marks the note kept as its last error).
        Resolved = "resolved",
        /// The provider said the key was used with a different request.
        KeyMismatch = "key_mismatch",
    }
}

/// Where an intent goes after an attempt (or after a claim that found its
/// budget spent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NextState {
    /// The call took effect.
    Succeeded,
    /// Try again after this delay.
    Retry(Duration),
    /// Never again: a permanent error or a spent budget.
    Dead,
    /// Budget spent on an attempt whose outcome is unknown (the provider may
    /// have applied it): no outcome effects until an operator decides.
    Uncertain,
}

/// How a dispatcher's claim of an intent ended: where its attempt left the
/// intent, or why nothing was recorded. The `result` label of the call metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    /// The call took effect.
    Succeeded,
    /// Scheduled for another attempt.
    Retrying,
    /// Dead.
    Dead,
    /// Out of budget after an attempt whose outcome is unknown.
    Uncertain,
    /// The lease was lost before the outcome was recorded.
    LeaseLost,
    /// Not recorded yet: another transaction holds an ordering key of its
    /// events (an application's open transaction, say). The completer
    /// records it once the key is free, keeping its lease meanwhile.
    KeyHeld,
}

impl Finished {
    /// The metric label.
    pub const fn label(self) -> &'static str {
        match self {
            Finished::Succeeded => "succeeded",
            Finished::Retrying => "retrying",
            Finished::Dead => "dead",
            Finished::Uncertain => "uncertain",
            Finished::LeaseLost => "lease_lost",
            Finished::KeyHeld => "key_held",
        }
    }
}

impl From<NextState> for Finished {
    fn from(next: NextState) -> Finished {
        match next {
            NextState::Succeeded => Finished::Succeeded,
            NextState::Retry(_) => Finished::Retrying,
            NextState::Dead => Finished::Dead,
            NextState::Uncertain => Finished::Uncertain,
        }
    }
}

impl NextState {
    /// The state the intent is stored in after it: one attempt's end is one
    /// of an intent's states, a retry being `pending` again.
    pub fn state(self) -> IntentState {
        match self {
            NextState::Succeeded => IntentState::Succeeded,
            NextState::Retry(_) => IntentState::Pending,
            NextState::Dead => IntentState::Dead,
            NextState::Uncertain => IntentState::Uncertain,
        }
    }
}

/// What [`decide`] needs to know about an intent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Attempts made, counting the one being decided (the claim counts it).
    pub attempts: u32,
    /// Attempts allowed.
    pub max_attempts: u32,
    /// No attempt starts after this.
    pub expires_at: chrono::DateTime<chrono::Utc>,
    /// Some attempt before this claim may have taken effect
    /// ([`AttemptOutcome::may_have_applied`]): the intent can no longer end
    /// dead, whatever later attempts say. Sticky (`intents.ever_uncertain`):
    /// a 409 "still in progress" or a 503 after a timeout does not make the
    /// timeout's effect any less possible, and neither does a replay.
    pub uncertain_before: bool,
    /// Whether an attempt whose outcome is unknown may be sent again: false
    /// for a provider without idempotency keys
    /// ([`crate::profile::Profile::resends_unknown`]), whose intent then
    /// ends uncertain at once instead.
    pub resends_unknown: bool,
    /// The provider's key window has closed since the intent was written
    /// ([`crate::profile::Profile::window`]): an attempt sent now would be
    /// taken for a new request.
    pub key_forgotten: bool,
}

impl Budget {
    /// Why this claim may not make an attempt at all, if it may not: the
    /// attempts are spent, the max age has passed, or an earlier attempt may
    /// have been applied by a provider that keeps no keys (a lost lease).
    pub fn spent(&self, now: chrono::DateTime<chrono::Utc>) -> Option<String> {
        if self.uncertain_before && !self.resends_unknown {
            Some(NOT_RESENT.into())
        } else if self.uncertain_before && self.key_forgotten {
            Some(KEY_FORGOTTEN.into())
        } else if self.attempts > self.max_attempts {
            Some(format!("retry budget exhausted: {} attempts made", self.max_attempts))
        } else if now >= self.expires_at {
            Some(format!("max age passed at {}", self.expires_at))
        } else {
            None
        }
    }
}

/// What happened at a claim, as [`decide`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tried {
    /// An attempt was made and classified.
    Attempt(Verdict),
    /// No attempt: [`Budget::spent`] said the budget was spent at the claim.
    Spent,
}

/// An intent's next state and what to record about the attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Where the intent goes.
    pub next: NextState,
    /// The attempt's outcome.
    pub outcome: AttemptOutcome,
    /// Why the intent ends here, when the attempt's own error does not say
    /// it (the budget or the max age ended it).
    pub why: Option<String>,
}

/// Why an intent ends `uncertain` rather than dead.
pub const UNCERTAIN: &str = "an attempt's outcome is unknown (the provider may have applied it): left \
                             uncertain, on_dead not recorded; replay it to ask again with the same idempotency key";

/// [`UNCERTAIN`] where sending again cannot tell: the provider keeps no
/// keys, forgot the key, or refuses the key as used by another request.
pub const UNCERTAIN_ASK: &str = "an attempt's outcome is unknown (the provider may have applied it): left \
                                 uncertain, on_dead not recorded; ask the provider, then `relay intents resolve` it";

/// Decide an intent's next state after `tried`, at `now`, drawing a retry's
/// backoff from `rng` (R8, R10):
///
/// | tried | budget left | next |
/// |---|---|---|
/// | success | – | succeeded |
/// | permanent | – | dead; uncertain if an earlier attempt's outcome is unknown |
/// | retry | attempts and time left for the delay | retry after max(backoff, `Retry-After`) |
/// | retry | attempts spent, or the delay passes the max age | dead; uncertain if this or an earlier attempt's outcome is unknown |
/// | spent at the claim | – | dead; uncertain if an earlier attempt's outcome is unknown |
///
/// "Unknown" is sticky ([`Budget::uncertain_before`]): once one attempt may
/// have been applied, the intent ends succeeded or uncertain, never dead, so
/// no `on_dead` effect (`payment.failed`, a saga moved to failed) is ever
/// recorded for a call the provider may have made.
///
/// A `Retry-After` is the provider's word, so it is bounded before any
/// arithmetic: one past the intent's max age can only end it, and the delay
/// returned is never longer than the time left (a `Retry-After` of 10^13 s
/// once overflowed the clock, and of 10^16 s PostgreSQL's interval).
pub fn decide(
    budget: &Budget,
    tried: Tried,
    policy: &BackoffPolicy,
    now: chrono::DateTime<chrono::Utc>,
    rng: &mut impl Rng,
) -> Decision {
    // A replay can settle the doubt only where sending again with the key
    // returns the provider's stored answer.
    let replay_tells = budget.resends_unknown && !budget.key_forgotten && tried != Tried::Attempt(Verdict::KeyMismatch);
    let suffix = if replay_tells { UNCERTAIN } else { UNCERTAIN_ASK };
    let end = |uncertain: bool, outcome, why: String| {
        if uncertain || budget.uncertain_before {
            Decision { next: NextState::Uncertain, outcome, why: Some(format!("{why}; {suffix}")) }
        } else {
            Decision { next: NextState::Dead, outcome, why: Some(why) }
        }
    };
    let verdict = match tried {
        Tried::Spent => {
            let why = budget.spent(now).unwrap_or_else(|| "retry budget exhausted".into());
            return end(false, AttemptOutcome::Permanent, why);
        }
        Tried::Attempt(v) => v,
    };
    let (retry_after, uncertain) = match verdict {
        Verdict::Success => {
            return Decision { next: NextState::Succeeded, outcome: AttemptOutcome::Succeeded, why: None };
        }
        Verdict::Permanent if budget.uncertain_before => {
            return end(true, AttemptOutcome::Permanent, "the provider refused the call for good".into());
        }
        Verdict::Permanent => return Decision { next: NextState::Dead, outcome: AttemptOutcome::Permanent, why: None },
        Verdict::KeyMismatch => return end(false, AttemptOutcome::Permanent, KEY_MISMATCH.into()),
        Verdict::Retry { uncertain: true, .. } if !budget.resends_unknown => {
            return end(true, AttemptOutcome::Uncertain, NOT_RESENT.into());
        }
        Verdict::Retry { retry_after, uncertain } => (retry_after, uncertain),
    };
    let outcome = if uncertain { AttemptOutcome::Uncertain } else { AttemptOutcome::Retryable };
    // Past the intent's end any delay is as good as another.
    let left = (budget.expires_at - now).to_std().unwrap_or_default();
    let backoff = policy.delay(budget.attempts.max(1), rng);
    let delay = match retry_after {
        // The provider's floor, spread over up to half of it again (at most
        // the backoff's ceiling): intents throttled together would otherwise
        // all come due in the same instant, and be throttled again.
        Some(ra) if ra > backoff => {
            let spread = (ra / 2).min(policy.ceiling(budget.attempts.max(1))).as_millis() as u64;
            ra.saturating_add(Duration::from_millis(rng.random_range(0..=spread)))
        }
        _ => backoff,
    };
    if budget.attempts >= budget.max_attempts {
        end(uncertain, outcome, format!("retry budget exhausted after {} attempts", budget.attempts))
    } else if delay >= left {
        let why = match retry_after {
            Some(ra) if ra >= left && !uncertain => {
                format!(
                    "the provider asked to wait {}s, past the intent's max age ({})",
                    ra.as_secs(),
                    budget.expires_at
                )
            }
            _ => format!("max age would pass before the next attempt ({})", budget.expires_at),
        };
        end(uncertain, outcome, why)
    } else {
        Decision { next: NextState::Retry(delay), outcome, why: None }
    }
}

/// Why an intent whose call the provider says reused a key ends.
pub const KEY_MISMATCH: &str = "the provider says this idempotency key was already used with a different request: \
     two calls share a key (a bug in the route's idempotency_key template or in another client of the provider); \
     never retried";

/// Why an intent whose key the provider has forgotten is not sent again.
pub const KEY_FORGOTTEN: &str = "the provider's key window has closed since the intent was written and an attempt \
     may have been applied: sent again, it would be taken for a new request";

/// Why an intent of a provider without keys is not sent again.
pub const NOT_RESENT: &str = "the provider keeps no idempotency keys (profile none) and an attempt may have been \
     applied: not sent again blindly; ask the provider, then resolve the intent";

/// Exponential backoff with full jitter.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BackoffPolicy {
    /// Ceiling after the first failed attempt.
    #[serde(with = "humantime_serde")]
    pub min_delay: Duration,
    /// The ceiling never grows past this.
    #[serde(with = "humantime_serde")]
    pub max_delay: Duration,
    /// Growth factor per attempt (≥ 1).
    pub factor: f32,
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        BackoffPolicy { min_delay: Duration::from_millis(500), max_delay: Duration::from_secs(60), factor: 2.0 }
    }
}

impl BackoffPolicy {
    /// The wait between rounds of database work that failed (a claim, a
    /// batch of outcomes, a publish): 100 ms, doubling, at most 5 s.
    pub const DATABASE: BackoffPolicy =
        BackoffPolicy { min_delay: Duration::from_millis(100), max_delay: Duration::from_secs(5), factor: 2.0 };

    /// The exponential ceiling after failed attempt number `attempt` (1-based).
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let n = attempt.max(1) as usize;
        ExponentialBuilder::default()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay)
            .with_factor(self.factor.max(1.0))
            .without_max_times()
            .build()
            .nth(n - 1)
            .unwrap_or(self.max_delay)
    }

    /// The delay before the attempt after failed attempt `attempt`: uniform in
    /// `[0, ceiling(attempt)]`, drawn from `rng`.
    pub fn delay(&self, attempt: u32, rng: &mut impl Rng) -> Duration {
        let ceiling = self.ceiling(attempt).as_millis() as u64;
        Duration::from_millis(rng.random_range(0..=ceiling))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::KeyAnswer;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn status(s: u16) -> Verdict {
        classify(&AttemptResult::Response { status: s, retry_after: None, key: None }, &[])
    }

    #[test]
    fn success_is_2xx_only() {
        assert_eq!(status(200), Verdict::Success);
        assert_eq!(status(204), Verdict::Success);
        assert_eq!(status(302), Verdict::Permanent);
    }

    #[test]
    fn throttling_timeouts_and_server_errors_are_retried() {
        for s in [408, 425, 429] {
            assert!(matches!(status(s), Verdict::Retry { uncertain: false, .. }), "{s}");
        }
        // A 5xx may follow an applied call (Stripe replays a stored 500 to
        // every retry with the key): retried, and the intent never ends dead.
        for s in [500, 501, 502, 503, 504, 599] {
            assert!(matches!(status(s), Verdict::Retry { uncertain: true, .. }), "{s}");
        }
    }

    #[test]
    fn client_errors_and_redirects_are_permanent() {
        for s in [301, 302, 303, 307, 308, 400, 401, 403, 404, 409, 422] {
            assert_eq!(status(s), Verdict::Permanent, "{s}");
        }
    }

    #[test]
    fn a_timeout_after_sending_is_an_uncertain_retry() {
        assert_eq!(
            classify(&AttemptResult::Timeout { sent: true }, &[]),
            Verdict::Retry { retry_after: None, uncertain: true }
        );
        assert_eq!(
            classify(&AttemptResult::Timeout { sent: false }, &[]),
            Verdict::Retry { retry_after: None, uncertain: false }
        );
        assert_eq!(classify(&AttemptResult::Connect, &[]), Verdict::Retry { retry_after: None, uncertain: false });
    }

    #[test]
    fn an_endpoint_may_retry_more_statuses() {
        let r = AttemptResult::Response { status: 409, retry_after: Some(Duration::from_secs(1)), key: None };
        assert_eq!(classify(&r, &[]), Verdict::Permanent);
        // A 409 on its own is not an unknown outcome ("already refunded").
        assert_eq!(
            classify(&r, &[409]),
            Verdict::Retry { retry_after: Some(Duration::from_secs(1)), uncertain: false }
        );
    }

    #[test]
    fn a_profile_s_key_answers_decide_before_the_status() {
        let answer = |status, key| classify(&AttemptResult::Response { status, retry_after: None, key }, &[]);
        // "Still in progress" says a request with the key reached the provider.
        assert_eq!(answer(409, Some(KeyAnswer::InProgress)), Verdict::Retry { retry_after: None, uncertain: true });
        assert_eq!(answer(422, Some(KeyAnswer::Mismatch)), Verdict::KeyMismatch);
        assert_eq!(answer(400, Some(KeyAnswer::Mismatch)), Verdict::KeyMismatch);
        assert_eq!(answer(200, Some(KeyAnswer::Mismatch)), Verdict::Success, "a 2xx is a success whatever it says");
    }

    #[test]
    fn decide_a_key_mismatch_is_never_retried_and_dead_unless_an_attempt_was_unknown() {
        let d = decided(&budget(1, 5, 24, false), Tried::Attempt(Verdict::KeyMismatch));
        assert_eq!((d.next, d.outcome), (NextState::Dead, AttemptOutcome::Permanent));
        assert!(d.why.unwrap().contains("already used with a different request"));
        let d = decided(&budget(2, 5, 24, true), Tried::Attempt(Verdict::KeyMismatch));
        assert_eq!(d.next, NextState::Uncertain);
        assert!(!d.why.unwrap().contains("replay it"), "a replay would meet the same mismatch");
    }

    #[test]
    fn decide_without_keys_an_unknown_outcome_is_never_sent_again() {
        let keyless = |uncertain_before| Budget { resends_unknown: false, ..budget(1, 5, 24, uncertain_before) };
        let d = decided(&keyless(false), retry(None, true));
        assert_eq!((d.next, d.outcome), (NextState::Uncertain, AttemptOutcome::Uncertain));
        assert!(d.why.unwrap().contains("profile none"));
        // Known not applied: retried as usual.
        assert!(matches!(decided(&keyless(false), retry(None, false)).next, NextState::Retry(_)));
        // A lease lost mid-call: the claim makes no attempt.
        assert!(keyless(true).spent(at()).unwrap().contains("not sent again"));
        let d = decided(&keyless(true), Tried::Spent);
        assert_eq!(d.next, NextState::Uncertain);
        let why = d.why.unwrap();
        assert!(why.contains("relay intents resolve") && !why.contains("replay it"), "{why}");
    }

    #[test]
    fn decide_past_the_key_window_an_unknown_outcome_is_not_sent_again_but_a_known_one_is() {
        let forgotten = |uncertain_before| Budget { key_forgotten: true, ..budget(2, 5, 24, uncertain_before) };
        assert_eq!(forgotten(false).spent(at()), None, "nothing may have been applied: sending is safe");
        let why = forgotten(true).spent(at()).unwrap();
        assert!(why.contains("key window has closed"), "{why}");
        let d = decided(&forgotten(true), Tried::Spent);
        assert_eq!(d.next, NextState::Uncertain);
        assert!(d.why.unwrap().contains("ask the provider"));
    }

    #[test]
    fn retry_after_is_passed_through() {
        let v = classify(
            &AttemptResult::Response { status: 429, retry_after: Some(Duration::from_secs(3)), key: None },
            &[],
        );
        assert_eq!(v, Verdict::Retry { retry_after: Some(Duration::from_secs(3)), uncertain: false });
    }

    #[test]
    fn retry_after_accepts_seconds_and_http_dates() {
        let now = chrono::DateTime::parse_from_rfc3339("2026-11-30T12:00:00Z").unwrap().to_utc();
        assert_eq!(parse_retry_after("7", now), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after("Mon, 30 Nov 2026 12:00:30 GMT", now), Some(Duration::from_secs(30)));
        assert_eq!(parse_retry_after("Mon, 30 Nov 2026 11:00:00 GMT", now), Some(Duration::ZERO));
        // RFC 9110 §5.6.7: the obsolete RFC 850 and asctime forms too.
        assert_eq!(parse_retry_after("Monday, 30-Nov-26 12:00:30 GMT", now), Some(Duration::from_secs(30)));
        assert_eq!(parse_retry_after("Mon Nov 30 12:00:30 2026", now), Some(Duration::from_secs(30)));
        assert_eq!(parse_retry_after("soon", now), None);
    }

    fn at() -> chrono::DateTime<chrono::Utc> {
        chrono::DateTime::parse_from_rfc3339("2026-12-03T12:00:00Z").unwrap().to_utc()
    }

    fn budget(attempts: u32, max_attempts: u32, hours_left: i64, uncertain_before: bool) -> Budget {
        Budget {
            attempts,
            max_attempts,
            expires_at: at() + chrono::Duration::hours(hours_left),
            uncertain_before,
            resends_unknown: true,
            key_forgotten: false,
        }
    }

    fn decided(b: &Budget, tried: Tried) -> Decision {
        decide(b, tried, &BackoffPolicy::default(), at(), &mut StdRng::seed_from_u64(3))
    }

    fn retry(retry_after: Option<u64>, uncertain: bool) -> Tried {
        Tried::Attempt(Verdict::Retry { retry_after: retry_after.map(Duration::from_secs), uncertain })
    }

    #[test]
    fn decide_a_success_succeeds_and_a_permanent_error_is_dead() {
        let b = budget(1, 5, 24, false);
        assert_eq!(decided(&b, Tried::Attempt(Verdict::Success)).next, NextState::Succeeded);
        assert_eq!(decided(&budget(1, 5, 24, true), Tried::Attempt(Verdict::Success)).next, NextState::Succeeded);
        let d = decided(&b, Tried::Attempt(Verdict::Permanent));
        assert_eq!((d.next, d.outcome, d.why), (NextState::Dead, AttemptOutcome::Permanent, None));
    }

    #[test]
    fn decide_a_retry_with_budget_left_waits_the_seeded_backoff() {
        let b = budget(2, 5, 24, false);
        let d = decided(&b, retry(None, false));
        let expected = BackoffPolicy::default().delay(2, &mut StdRng::seed_from_u64(3));
        assert_eq!((d.next, d.outcome), (NextState::Retry(expected), AttemptOutcome::Retryable));
        assert_eq!(decided(&b, retry(None, true)).outcome, AttemptOutcome::Uncertain);
    }

    #[test]
    fn decide_a_retry_after_longer_than_the_backoff_is_honoured() {
        let d = decided(&budget(1, 5, 24, false), retry(Some(3600), false));
        let NextState::Retry(delay) = d.next else { panic!("{d:?}") };
        let ceiling = BackoffPolicy::default().ceiling(1);
        assert!(delay >= Duration::from_secs(3600) && delay <= Duration::from_secs(3600) + ceiling, "{delay:?}");
    }

    #[test]
    fn intents_throttled_together_with_one_retry_after_do_not_all_come_due_at_once() {
        let policy = BackoffPolicy { max_delay: Duration::from_secs(60), ..BackoffPolicy::default() };
        let mut rng = StdRng::seed_from_u64(9);
        let b = budget(6, 10, 24, false);
        let delays: std::collections::BTreeSet<Duration> = (0..50)
            .map(|_| match decide(&b, retry(Some(30), false), &policy, at(), &mut rng).next {
                NextState::Retry(d) => d,
                other => panic!("{other:?}"),
            })
            .collect();
        assert!(delays.iter().all(|d| *d >= Duration::from_secs(30) && *d <= Duration::from_secs(45)), "{delays:?}");
        assert!(delays.len() > 40, "spread over 15 s, not one instant: {delays:?}");
    }

    #[test]
    fn decide_the_last_attempt_failing_ends_dead_or_uncertain() {
        let b = budget(3, 3, 24, false);
        let d = decided(&b, retry(None, false));
        assert_eq!(d.next, NextState::Dead);
        assert!(d.why.unwrap().contains("budget exhausted after 3 attempts"));
        let d = decided(&b, retry(None, true));
        assert_eq!(d.next, NextState::Uncertain);
        assert!(d.why.unwrap().contains(UNCERTAIN));
    }

    #[test]
    fn decide_a_retry_after_past_the_max_age_ends_the_intent_without_overflow() {
        for secs in [10_000_000_000_000, 9_300_000_000_000_000, u64::MAX] {
            let d = decided(&budget(1, 10, 24, false), retry(Some(secs), false));
            assert_eq!(d.next, NextState::Dead, "{secs}");
            assert!(d.why.unwrap().contains("past the intent's max age"), "{secs}");
        }
    }

    #[test]
    fn decide_a_backoff_past_the_max_age_ends_the_intent() {
        // 1 s left; the seed draws a delay above it from the 8th ceiling (60 s).
        let b = Budget { expires_at: at() + chrono::Duration::seconds(1), ..budget(8, 10, 0, false) };
        let d = decided(&b, retry(None, false));
        assert_eq!(d.next, NextState::Dead);
        assert!(d.why.unwrap().contains("max age would pass"));
        assert_eq!(decided(&b, retry(None, true)).next, NextState::Uncertain);
    }

    #[test]
    fn decide_a_claim_with_its_budget_spent_is_dead_unless_an_attempt_was_unknown() {
        let b = budget(4, 3, 24, false);
        assert_eq!(b.spent(at()).as_deref(), Some("retry budget exhausted: 3 attempts made"));
        let d = decided(&b, Tried::Spent);
        assert_eq!((d.next, d.outcome), (NextState::Dead, AttemptOutcome::Permanent));
        let d = decided(&Budget { uncertain_before: true, ..b }, Tried::Spent);
        assert_eq!(d.next, NextState::Uncertain);
        let aged = budget(1, 3, 0, false);
        assert!(aged.spent(at()).unwrap().starts_with("max age passed"));
        assert_eq!(budget(1, 3, 1, false).spent(at()), None);
    }

    // A timeout after sending, then "409 still in progress" or
    // 503 until the budget or the max age ends: the capture may have gone
    // through, so the intent is uncertain and on_dead is never recorded.
    #[test]
    fn decide_once_an_attempt_may_have_applied_the_intent_never_ends_dead() {
        let after_timeout = |attempts, max, hours| budget(attempts, max, hours, true);
        for tried in [retry(None, false), retry(Some(1), false), Tried::Attempt(Verdict::Permanent), Tried::Spent] {
            let d = decided(&after_timeout(3, 3, 24), tried);
            assert_eq!(d.next, NextState::Uncertain, "{tried:?}");
            assert!(d.why.unwrap().contains(UNCERTAIN), "{tried:?}");
        }
        // The max age ends it the same way.
        let aged = Budget { expires_at: at() + chrono::Duration::seconds(1), ..after_timeout(8, 10, 0) };
        assert_eq!(decided(&aged, retry(None, false)).next, NextState::Uncertain);
        // With budget left it is retried, and a success is a success.
        assert!(matches!(decided(&after_timeout(1, 3, 24), retry(None, false)).next, NextState::Retry(_)));
        assert_eq!(decided(&after_timeout(3, 3, 24), Tried::Attempt(Verdict::Success)).next, NextState::Succeeded);
    }

    #[test]
    fn only_an_unknown_outcome_or_a_lost_lease_may_have_applied_the_call() {
        let may: Vec<_> = AttemptOutcome::ALL.into_iter().filter(|o| o.may_have_applied()).collect();
        assert_eq!(may, [AttemptOutcome::Uncertain, AttemptOutcome::LeaseExpired]);
        for o in AttemptOutcome::ALL {
            assert_eq!(o.as_str().parse::<AttemptOutcome>(), Ok(o));
        }
        for c in ErrorClass::ALL {
            assert_eq!(c.as_str().parse::<ErrorClass>(), Ok(c));
        }
    }

    #[test]
    fn ceilings_grow_exponentially_up_to_the_cap() {
        let p = BackoffPolicy::default();
        let ceilings: Vec<_> = (1..=9).map(|a| p.ceiling(a).as_millis()).collect();
        assert_eq!(ceilings, vec![500, 1000, 2000, 4000, 8000, 16000, 32000, 60000, 60000]);
    }

    #[test]
    fn delays_are_full_jitter_within_the_ceiling_and_deterministic_per_seed() {
        let p = BackoffPolicy::default();
        let draw = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            (1..=6).map(|a| p.delay(a, &mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        for (i, d) in draw(7).into_iter().enumerate() {
            assert!(d <= p.ceiling(i as u32 + 1));
        }
        // Full jitter reaches well below the ceiling: over many draws of
        // attempt 6 (ceiling 16 s) some land under a quarter of it.
        let mut rng = StdRng::seed_from_u64(1);
        assert!((0..200).any(|_| p.delay(6, &mut rng) < Duration::from_secs(4)));
    }
}
