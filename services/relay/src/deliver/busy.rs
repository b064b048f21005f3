//! An endpoint's calls started and not ended in one dispatcher, and the bound
//! past which its intents are left out of claims and of holds at ingest.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use relay_core::config::EndpointConfig;

use super::throttle::Adaptive;

/// An endpoint's calls started and not ended in this dispatcher. Once there
/// are as many as it can make at once and a claim batch more — or, rate
/// limited (a fixed or an adaptive rate), as many as it may start in two
/// seconds at its rate now — claims leave its intents out: more of them
/// would only wait at its limits while other endpoints' intents stay
/// unclaimed behind them. A call ending at the bound wakes the claim loop.
#[derive(Debug)]
pub(super) struct Busy {
    now: Arc<AtomicUsize>,
    /// The bound, as last computed (an adaptive rate moves it).
    most: Arc<AtomicUsize>,
    at_once: usize,
    pub(super) rate_limited: bool,
    adaptive: Option<Arc<Adaptive>>,
}

/// As many calls as start in two seconds at `rate` calls/s: at least one
/// and at most `at_once`, twice.
fn two_seconds_at(rate: f64, at_once: usize) -> usize {
    (rate.ceil().clamp(1.0, at_once as f64) as usize).saturating_mul(2)
}

impl Busy {
    pub(super) fn new(cfg: &EndpointConfig, claim_batch: usize, adaptive: Option<Arc<Adaptive>>) -> Busy {
        let at_once = cfg.concurrency.max(1);
        let most = match (cfg.rate_limit_per_second, &adaptive) {
            (Some(r), _) => two_seconds_at(r as f64, at_once),
            (None, Some(a)) => two_seconds_at(a.share(), at_once),
            (None, None) => at_once.saturating_add(claim_batch),
        };
        Busy {
            now: Arc::default(),
            most: Arc::new(most.into()),
            at_once,
            rate_limited: cfg.rate_limit_per_second.is_some() || adaptive.is_some(),
            adaptive,
        }
    }

    pub(super) fn has_room(&self) -> bool {
        self.room() > 0
    }

    /// How many more calls may start before the endpoint is full.
    pub(super) fn room(&self) -> usize {
        if let Some(a) = &self.adaptive {
            self.most.store(two_seconds_at(a.share(), self.at_once), Relaxed);
        }
        self.most.load(Relaxed).saturating_sub(self.now.load(Relaxed))
    }

    /// Count one call of this endpoint in until the returned guard is
    /// dropped, which notifies `progress` if the endpoint was full.
    pub(super) fn enter(&self, progress: &Arc<tokio::sync::Notify>) -> BusyGuard {
        self.now.fetch_add(1, Relaxed);
        BusyGuard { now: self.now.clone(), most: self.most.clone(), progress: progress.clone() }
    }
}

/// One call counted in [`Busy`]; dropped, it counts the call out and wakes
/// the claim loop if the endpoint was full until then.
pub(super) struct BusyGuard {
    now: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    progress: Arc<tokio::sync::Notify>,
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        if self.now.fetch_sub(1, Relaxed) >= self.most.load(Relaxed) {
            self.progress.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(extra: serde_json::Value) -> EndpointConfig {
        let mut v = serde_json::json!({"base_url": "http://provider.test/", "concurrency": 16});
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_throttled_adaptive_endpoint_counts_as_rate_limited_at_its_rate_now() {
        let cfg = endpoint(serde_json::json!({"adaptive": {"start": 50, "min": 1, "max": 50}}));
        let adaptive = Arc::new(Adaptive::new(cfg.adaptive.unwrap()));
        let busy = Busy::new(&cfg, 64, Some(adaptive.clone()));
        assert!(busy.rate_limited, "its calls wait at its rate line: no hand-over room beyond its own");
        assert_eq!(busy.room(), 32, "two seconds at 50/s, at most its concurrency (16), twice");
        adaptive.set(1.0);
        assert_eq!(busy.room(), 2, "throttled down to 1/s: two seconds' calls, not 16 + a claim batch");
        let unlimited = Busy::new(&endpoint(serde_json::json!({})), 64, None);
        assert!(!unlimited.rate_limited);
        assert_eq!(unlimited.room(), 16 + 64);
        let fixed = Busy::new(&endpoint(serde_json::json!({"rate_limit_per_second": 5})), 64, None);
        assert_eq!((fixed.rate_limited, fixed.room()), (true, 10));
    }
}
