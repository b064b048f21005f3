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

/// What became of a transaction whose answer is late.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// The database still works on it: wait.
    Working,
    /// Its server process waits for statements that no longer come: end it.
    Stuck,
    /// Its process is gone, or the database does not answer: let go.
    Lost,
}

/// Ask about server process `pid` on a connection of its own (never one of
/// the pool's, which may all be busy), within [`PROBE`]. A database that
/// answers with an error (too many connections, say) is alive: ask again
/// next time. One that does not answer in time is taken for gone.
async fn ask_about(pool: &PgPool, pid: Option<i32>) -> Verdict {
    use relay_store::ops::Backend;
    use sqlx::ConnectOptions;
    let Some(pid) = pid else { return Verdict::Lost };
    let options = pool.connect_options();
    let ask = async {
        let mut conn = options.connect().await?;
        relay_store::ops::backend(&mut conn, pid, IDLE_IN_WORK).await
    };
    match tokio::time::timeout(PROBE, ask).await {
        Ok(Ok(Backend::Working)) | Ok(Err(sqlx::Error::Database(_))) => Verdict::Working,
        Ok(Ok(Backend::Stuck)) => Verdict::Stuck,
        Ok(Ok(Backend::Gone)) | Ok(Err(_)) | Err(_) => Verdict::Lost,
    }
}

/// Let go of a pooled connection whose work ran out of `limit`, and say so
/// as the error that work ends with. The connection is closed unread, not
/// returned (the pool's check would wait on a silent peer). Its server
/// process, when it was found stuck, is ended, so that its transaction's
/// locks and rows are let go now rather than when the server notices; one
/// found gone, or not asked about, is left alone (after a failover its pid
/// may be another session's).
pub async fn abandon(
    pool: &PgPool,
    conn: PoolConnection<Postgres>,
    stuck: Option<i32>,
    limit: Duration,
) -> sqlx::Error {
    drop(conn.detach());
    if let Some(pid) = stuck {
        let end = async |c: &mut PgConnection| relay_store::ops::end_backend(c, pid).await;
        let _ = bounded(pool, PROBE, end).await;
    }
    timed_out(limit)
}

/// Run `work` on `conn` for as long as the database works on it: each time
/// it runs past another `limit`, relay asks about its server process
/// (`pid`, once `work` has stored it there) while `work` goes on, and
/// `on_long` is told when it goes on. A transaction the database stopped on
/// is [abandoned](abandon) (the error); one that ends, however it ends,
/// gives `conn` [back](give_back).
pub async fn watched<T>(
    pool: &PgPool,
    mut conn: PoolConnection<Postgres>,
    limit: Duration,
    pid: &AtomicI32,
    mut on_long: impl FnMut(Duration),
    work: impl AsyncFnOnce(&mut PgConnection) -> T,
) -> Result<T, sqlx::Error> {
    /// What came first while asking: the work's end, or the answer.
    enum First<T> {
        Done(T),
        Asked(Verdict),
    }
    let ended = {
        let mut running = std::pin::pin!(work(&mut conn));
        loop {
            if let Ok(done) = tokio::time::timeout(limit, &mut running).await {
                break Ok(done);
            }
            // The work is polled while the question is out: a connection
            // left unread would block its server process writing to it.
            let first = tokio::select! {
                done = &mut running => First::Done(done),
                verdict = ask_about(pool, known(pid)) => First::Asked(verdict),
            };
            match first {
                First::Done(done) => break Ok(done),
                First::Asked(Verdict::Working) => on_long(limit),
                First::Asked(verdict) => break Err(verdict),
            }
        }
    };
    match ended {
        Ok(done) => {
            give_back(conn);
            Ok(done)
        }
        Err(verdict) => {
            let stuck = known(pid).filter(|_| verdict == Verdict::Stuck);
            Err(abandon(pool, conn, stuck, limit).await)
        }
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
