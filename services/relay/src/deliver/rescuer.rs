//! The rescuer: every `rescue_interval`, intents whose lease expired (their
//! worker crashed, stalled or stopped mid-call) go back to pending, to be
//! sent again with the same idempotency key (C9, C10), or to uncertain when
//! their call may have been applied and their budget is spent.

use std::sync::Arc;
use std::time::Duration;

use relay_store::intents;
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// Rescues expired leases of every dispatcher, not only its own: a crashed
/// process has no rescuer left.
pub(super) struct Rescuer {
    pub(super) pool: PgPool,
    pub(super) worker: String,
    pub(super) every: Duration,
    /// Woken when a rescue made intents due, for the claim loop.
    pub(super) progress: Arc<Notify>,
}

impl Rescuer {
    /// Until `shutdown`.
    pub(super) async fn run(self, shutdown: CancellationToken) {
        loop {
            tokio::select! { _ = shutdown.cancelled() => return, _ = tokio::time::sleep(self.every) => {} }
            match rescue_once(&self.pool).await {
                Ok(ids) if !ids.is_empty() => {
                    self.progress.notify_one();
                    crate::runtime::metrics::rescued("intent", ids.len() as u64);
                    warn!(worker = %self.worker, rescued = ids.len(), intents = ?ids,
                          "rescued intents whose lease expired; they will be sent again with the same idempotency key")
                }
                Ok(_) => {}
                Err(e) => warn!(worker = %self.worker, error = %e, "rescuing expired leases failed; retrying"),
            }
        }
    }
}

/// Return up to 500 intents with expired leases to pending.
pub(super) async fn rescue_once(pool: &PgPool) -> Result<Vec<uuid::Uuid>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    intents::rescue_expired(&mut conn, 500).await
}
