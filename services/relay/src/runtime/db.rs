//! Bounds on waits for PostgreSQL that nothing else would end.
//!
//! sqlx has no client-side statement timeout or TCP keepalive, so a
//! database host that vanishes without a reset (a failover, a frozen
//! machine) leaves a query waiting for ever. Work that must end is run
//! under a deadline here, and a connection that ran out of it is closed.

use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres};

/// Let go of a pooled connection whose work ran out of `limit`, and say so
/// as the error that work ends with. The connection is closed unread, not
/// returned: the pool's check on return would wait on a silent peer for
/// ever, holding the slot.
pub fn abandon(conn: PoolConnection<Postgres>, limit: Duration) -> sqlx::Error {
    drop(conn.detach());
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("PostgreSQL did not answer within {limit:?}; the connection was closed"),
    ))
}

/// Run `work` on a connection from `pool`, all within `limit` (acquiring
/// included); a connection whose work ran out of time is [abandoned](abandon).
pub async fn bounded<T>(
    pool: &PgPool,
    limit: Duration,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error> {
    let until = tokio::time::Instant::now() + limit;
    let mut conn = match tokio::time::timeout_at(until, pool.acquire()).await {
        Ok(conn) => conn?,
        Err(_) => return Err(sqlx::Error::PoolTimedOut),
    };
    match tokio::time::timeout_at(until, work(&mut conn)).await {
        Ok(done) => done,
        Err(_) => Err(abandon(conn, limit)),
    }
}
