//! Throttling that adapts and is shared: an endpoint with
//! `[endpoints.NAME.adaptive]` calls at one rate for all dispatcher processes
//! together, kept in the database (`relay_store::rates`): each process says
//! every [`TICK`] whether its calls were throttled (429, 503), and calls at
//! the shared rate divided by the processes calling the endpoint.
//!
//! The local limiter is still `governor`'s, evenly spaced; its quota is fixed
//! at construction, so a changed rate swaps in a new one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use relay_core::config::AdaptiveRate;

/// How often a process reports and reads the shared rate.
pub const TICK: Duration = Duration::from_millis(500);

/// A process that has not reported for this long no longer shares the rate.
pub const MEMBER_TTL: Duration = Duration::from_secs(3);

/// One endpoint's adaptive rate in this process. Shared by its client's clones.
#[derive(Debug)]
pub struct Adaptive {
    cfg: AdaptiveRate,
    /// Whether a call was throttled since the last report.
    throttled: AtomicBool,
    /// The limiter at this process's share, and that share (calls/s).
    current: RwLock<(Arc<DefaultDirectRateLimiter>, f64)>,
}

impl Adaptive {
    /// At `start` until the first report: the processes are not known yet,
    /// so the first half second may go faster than the shared rate.
    pub fn new(cfg: AdaptiveRate) -> Adaptive {
        let current = RwLock::new((limiter(cfg.start), cfg.start));
        Adaptive { cfg, throttled: AtomicBool::new(false), current }
    }

    /// The limiter to take a call's token from now.
    pub fn limiter(&self) -> Arc<DefaultDirectRateLimiter> {
        self.current.read().unwrap_or_else(std::sync::PoisonError::into_inner).0.clone()
    }

    /// A call was answered 429 or 503.
    pub fn throttled(&self) {
        self.throttled.store(true, Ordering::Relaxed);
    }

    /// Whether a call was throttled since the last call of this; clears it.
    pub fn take_throttled(&self) -> bool {
        self.throttled.swap(false, Ordering::Relaxed)
    }

    /// The rule the shared rate moves by.
    pub fn rule(&self) -> relay_store::rates::Rule {
        relay_store::rates::Rule {
            start: self.cfg.start,
            min: self.cfg.min,
            max: self.cfg.max,
            decrease: self.cfg.decrease,
            increase: self.cfg.increase,
            cooldown: self.cfg.cooldown,
            member_ttl: MEMBER_TTL,
        }
    }

    /// Call at `share` calls/s from now (a new limiter only if it moved by
    /// more than 2 %: each swap forgets the spacing of the calls before).
    pub fn set(&self, share: f64) {
        let mut current = self.current.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if (share - current.1).abs() > current.1 * 0.02 {
            *current = (limiter(share), share);
        }
    }

    /// This process's share (calls/s).
    pub fn share(&self) -> f64 {
        self.current.read().unwrap_or_else(std::sync::PoisonError::into_inner).1
    }
}

/// An evenly spaced limiter of `rate` calls/s (no burst).
fn limiter(rate: f64) -> Arc<DefaultDirectRateLimiter> {
    let period = Duration::from_secs_f64(1.0 / rate.max(0.001));
    let quota = Quota::with_period(period).unwrap_or_else(|| Quota::per_second(std::num::NonZeroU32::MIN));
    Arc::new(RateLimiter::direct(quota.allow_burst(std::num::NonZeroU32::MIN)))
}

/// Keeps this process's share of every adaptive rate it calls at: every
/// [`TICK`], for each endpoint whose rate adapts, it reports whether this
/// process was throttled, reads the shared rate and the processes sharing
/// it, and sets this process's share.
pub(super) struct RateSync {
    pub(super) pool: sqlx::PgPool,
    pub(super) worker: String,
    pub(super) endpoints: Vec<(String, Arc<Adaptive>)>,
}

impl RateSync {
    /// Until `shutdown`. A database error keeps the share as it was (and
    /// the throttle, reported next time).
    pub(super) async fn run(self, shutdown: tokio_util::sync::CancellationToken) {
        if self.endpoints.is_empty() {
            return;
        }
        loop {
            tokio::select! { _ = shutdown.cancelled() => return, _ = tokio::time::sleep(TICK) => {} }
            for (endpoint, a) in &self.endpoints {
                self.sync(endpoint, a).await;
            }
        }
    }

    async fn sync(&self, endpoint: &str, a: &Adaptive) {
        let throttled = a.take_throttled();
        let adjusted = match self.pool.acquire().await {
            Ok(mut conn) => relay_store::rates::adjust(&mut conn, endpoint, &self.worker, throttled, &a.rule()).await,
            Err(e) => Err(e),
        };
        match adjusted {
            Ok((rate, members)) => {
                a.set(rate / members as f64);
                crate::runtime::metrics::adaptive_rate(endpoint, rate, a.share());
            }
            Err(e) => {
                if throttled {
                    a.throttled();
                }
                tracing::warn!(endpoint = %endpoint, error = %e, "could not read the shared call rate; keeping this process's share");
            }
        }
    }
}
