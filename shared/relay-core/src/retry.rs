//! Retry classification and backoff for external calls (R8).
//!
//! The decision whether an attempt is retried lives in exactly one function,
//! [`classify`]. The delay before the next attempt is a pure function of
//! `(attempt, policy, random source)`, [`BackoffPolicy::delay`], so tests can
//! pin it with a seeded generator.
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

/// What one attempt at an external call produced, as far as retrying cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptResult {
    /// The provider answered.
    Response {
        /// HTTP status code.
        status: u16,
        /// `Retry-After`, when present and parseable.
        retry_after: Option<Duration>,
    },
    /// No answer in time. `sent` is true when the request may have reached the
    /// provider (the connection was up): the outcome is then unknown.
    Timeout {
        /// Whether the request may have been delivered.
        sent: bool,
    },
    /// The connection could not be made: the request was not delivered.
    Connect,
    /// Any other transport error (reset mid-response, TLS, …): may have been delivered.
    Transport,
}

/// The decision for one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The call took effect.
    Success,
    /// Try again with the same idempotency key.
    Retry {
        /// The provider asked for at least this long.
        retry_after: Option<Duration>,
        /// The request may have taken effect (timeout after send): recorded as
        /// an *uncertain* attempt, retried with the same key.
        uncertain: bool,
    },
    /// Never retried: a client error the provider will keep returning.
    Permanent,
}

/// Classify an attempt:
///
/// | result | verdict |
/// |---|---|
/// | 2xx | success |
/// | 408, 425, 429, 5xx except 501 | retry (honouring `Retry-After`) |
/// | a status in the endpoint's `also_retry` (default: 409) | retry (honouring `Retry-After`) |
/// | timeout before/after sending | retry (uncertain when after) |
/// | connection refused / DNS / connect timeout | retry |
/// | other transport error | retry, uncertain |
/// | 501 and every other status | permanent |
///
/// Why 409 is retried by default: providers that implement idempotency keys
/// (the IETF `Idempotency-Key` header draft, Stripe) answer `409 Conflict`
/// while a request with the same key is *still being processed*, which is
/// exactly what the relay meets when it retries after a timeout (an uncertain
/// attempt). Treating that 409 as permanent would declare the call dead, and
/// record its `on_dead` effects, while the provider is applying it. An
/// endpoint whose API uses 409 for business conflicts sets `retryable_statuses = []`.
pub fn classify(result: &AttemptResult, also_retry: &[u16]) -> Verdict {
    match *result {
        AttemptResult::Response { status, retry_after } => match status {
            200..=299 => Verdict::Success,
            s if also_retry.contains(&s) => Verdict::Retry { retry_after, uncertain: false },
            408 | 425 | 429 => Verdict::Retry { retry_after, uncertain: false },
            501 => Verdict::Permanent,
            500..=599 => Verdict::Retry { retry_after, uncertain: false },
            _ => Verdict::Permanent,
        },
        AttemptResult::Timeout { sent } => Verdict::Retry { retry_after: None, uncertain: sent },
        AttemptResult::Connect => Verdict::Retry { retry_after: None, uncertain: false },
        AttemptResult::Transport => Verdict::Retry { retry_after: None, uncertain: true },
    }
}

/// Parse a `Retry-After` value: delay-seconds or an HTTP date (relative to `now`).
pub fn parse_retry_after(value: &str, now: chrono::DateTime<chrono::Utc>) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = chrono::DateTime::parse_from_rfc2822(value).ok()?;
    let delta = at.with_timezone(&chrono::Utc) - now;
    Some(delta.to_std().unwrap_or(Duration::ZERO))
}

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
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn status(s: u16) -> Verdict {
        classify(&AttemptResult::Response { status: s, retry_after: None }, &[])
    }

    #[test]
    fn success_is_2xx_only() {
        assert_eq!(status(200), Verdict::Success);
        assert_eq!(status(204), Verdict::Success);
        assert_eq!(status(302), Verdict::Permanent);
    }

    #[test]
    fn throttling_timeouts_and_server_errors_are_retried() {
        for s in [408, 425, 429, 500, 502, 503, 504, 599] {
            assert!(matches!(status(s), Verdict::Retry { uncertain: false, .. }), "{s}");
        }
    }

    #[test]
    fn not_implemented_and_other_client_errors_are_permanent() {
        for s in [400, 401, 403, 404, 409, 422, 501] {
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
        let r = AttemptResult::Response { status: 409, retry_after: Some(Duration::from_secs(1)) };
        assert_eq!(classify(&r, &[]), Verdict::Permanent);
        assert_eq!(
            classify(&r, &[409]),
            Verdict::Retry { retry_after: Some(Duration::from_secs(1)), uncertain: false }
        );
    }

    #[test]
    fn retry_after_is_passed_through() {
        let v = classify(&AttemptResult::Response { status: 429, retry_after: Some(Duration::from_secs(3)) }, &[]);
        assert_eq!(v, Verdict::Retry { retry_after: Some(Duration::from_secs(3)), uncertain: false });
    }

    #[test]
    fn retry_after_accepts_seconds_and_http_dates() {
        let now = chrono::DateTime::parse_from_rfc3339("2026-11-30T12:00:00Z").unwrap().to_utc();
        assert_eq!(parse_retry_after("7", now), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after("Mon, 30 Nov 2026 12:00:30 GMT", now), Some(Duration::from_secs(30)));
        assert_eq!(parse_retry_after("Mon, 30 Nov 2026 11:00:00 GMT", now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("soon", now), None);
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
