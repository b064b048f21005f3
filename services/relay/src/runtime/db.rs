//! Bounds on waits for PostgreSQL that nothing else would end.
//!
//! sqlx has no client-side statement timeout or TCP keepalive, so a
//! database host that vanishes without a reset (a failover, a frozen
//! machine) leaves a query waiting for ever; and the pool checks every
//! connection given back with a round trip of no deadline, holding its
//! slot meanwhile. Work that must end runs under a deadline here, a
//! connection given up on is closed, and connections go back to the pool
//! through a bounded check.

use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres};

/// How long a question about another connection, or a connection's way
/// back to the pool, may take.
pub const PROBE: Duration = Duration::from_secs(2);

/// How long a server process may sit between two statements of a
/// transaction whose client waits for an answer before the statement is
/// taken for lost: relay's own transactions go from one statement to the
/// next in milliseconds, a code handler's in well under this.
pub const IDLE_IN_WORK: Duration = Duration::from_secs(10);

/// Whether the server process `pid` is still working on a transaction whose
/// answer is late (asked on another connection, within [`PROBE`]). `None`
/// (its process is not known yet), a database that does not answer, a
/// process gone, or one waiting for a statement that never came: no.
pub async fn still_working(pool: &PgPool, pid: Option<i32>) -> bool {
    let Some(pid) = pid else { return false };
    let ask = async |conn: &mut PgConnection| relay_store::ops::backend_working(conn, pid, IDLE_IN_WORK).await;
    bounded(pool, PROBE, ask).await.unwrap_or(false)
}

/// Let go of a pooled connection whose work ran out of `limit`, and say so
/// as the error that work ends with. The connection is closed unread, not
/// returned (the pool's check would wait on a silent peer); its server
/// process, when known and the database answers, is ended, so that its
/// transaction's locks and rows are let go now rather than when the server
/// notices.
pub async fn abandon(pool: &PgPool, conn: PoolConnection<Postgres>, pid: Option<i32>, limit: Duration) -> sqlx::Error {
    drop(conn.detach());
    if let Some(pid) = pid {
        let end = async |c: &mut PgConnection| relay_store::ops::end_backend(c, pid).await;
        let _ = bounded(pool, PROBE, end).await;
    }
    timed_out(limit)
}

/// Run `work` on `conn` for as long as the database works on it: each time
/// it runs past another `limit`, [`still_working`] asks about its server
/// process (`pid`, once `work` has stored it there) and `on_long` is told
/// when it goes on. A transaction the database stopped on is
/// [abandoned](abandon) (the error); one that ends, however it ends, gives
/// `conn` [back](give_back).
pub async fn watched<T>(
    pool: &PgPool,
    mut conn: PoolConnection<Postgres>,
    limit: Duration,
    pid: &AtomicI32,
    mut on_long: impl FnMut(Duration),
    work: impl AsyncFnOnce(&mut PgConnection) -> T,
) -> Result<T, sqlx::Error> {
    let done = {
        let mut running = std::pin::pin!(work(&mut conn));
        loop {
            match tokio::time::timeout(limit, &mut running).await {
                Ok(done) => break Some(done),
                Err(_) if still_working(pool, known(pid)).await => on_long(limit),
                Err(_) => break None,
            }
        }
    };
    match done {
        Some(done) => {
            give_back(conn);
            Ok(done)
        }
        None => Err(abandon(pool, conn, known(pid), limit).await),
    }
}

/// The server process an [`AtomicI32`] holds, once set (pids are positive).
fn known(pid: &AtomicI32) -> Option<i32> {
    Some(pid.load(Ordering::Relaxed)).filter(|&p| p > 0)
}

/// Give `conn` back to the pool through its check, within [`PROBE`]: a
/// check that gets no answer closes the connection and frees its slot,
/// where a plain drop would hold the slot for as long as the peer is silent.
pub fn give_back(mut conn: PoolConnection<Postgres>) {
    // `return_to_pool` is the drop's own work, run here under a deadline
    // (sqlx 0.8 exposes it, hidden from its docs; a test pins the behaviour).
    let returning = conn.return_to_pool();
    drop(conn);
    tokio::spawn(async move {
        let _ = tokio::time::timeout(PROBE, returning).await;
    });
}

/// Run `work` on a connection from `pool`, all within `limit` (acquiring
/// included); a connection whose work ran out of time is closed unread, and
/// one whose work ended is [given back](give_back).
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
        Ok(done) => {
            give_back(conn);
            done
        }
        Err(_) => {
            drop(conn.detach());
            Err(timed_out(limit))
        }
    }
}

/// The error of work given up on after `limit`.
fn timed_out(limit: Duration) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("PostgreSQL did not answer within {limit:?}; the connection was closed"),
    ))
}
