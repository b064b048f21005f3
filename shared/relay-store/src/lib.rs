//! Every SQL statement of the relay, one named async function per statement,
//! grouped by concern: [`inbox`], [`sagas`], [`intents`], [`outbox`],
//! [`dead_letters`], [`stats`].
//!
//! Conventions that must stay true:
//!
//! * Writers take `&mut PgConnection` — a transaction or a savepoint handed
//!   down by the caller — and never commit: only the orchestrator (consumer,
//!   dispatcher, publisher) decides the transaction boundary.
//! * Dedup is `INSERT … ON CONFLICT DO NOTHING` and the affected-row count,
//!   turned into an outcome enum; never check-then-insert (R2).
//! * Claims are one statement: a CTE with `FOR UPDATE SKIP LOCKED` feeding
//!   the `UPDATE` that sets the lease and counts the attempt (R9). Finishing a
//!   claimed row always checks its lease token (fencing).
//!
//! Queries are plain `sqlx::query` checked by the integration tests against a
//! real PostgreSQL, not `query!` macros: the macros need a live database or a
//! committed `.sqlx` cache at build time, and every statement here is already
//! executed by the end-to-end suite on every CI run.

use sqlx::PgPool;
use sqlx::migrate::Migrator;

pub mod dead_letters;
pub mod headers;
pub mod inbox;
pub mod intents;
pub mod ops;
pub mod outbox;
pub mod sagas;
pub mod stats;

pub use sqlx::{PgConnection, Postgres, Transaction};

/// The relay's migrations (`migrations/` at the workspace root), embedded.
pub static MIGRATOR: Migrator = sqlx::migrate!("../../migrations");

/// Apply pending migrations.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}

/// Whether every embedded migration has been applied to this database.
pub async fn migrations_current(pool: &PgPool) -> Result<bool, sqlx::Error> {
    let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success ORDER BY version")
        .fetch_all(pool)
        .await
        .or_else(|e| match &e {
            sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01") => Ok(Vec::new()),
            _ => Err(e),
        })?;
    Ok(MIGRATOR.iter().all(|m| applied.contains(&m.version)))
}

/// How a database error should be handled by the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbErrorKind {
    /// The data itself is unacceptable (SQLSTATE class 22 data exception or
    /// 23 integrity violation): retrying the same record gives the same error.
    Permanent,
    /// Anything else (connection lost, pool timeout, serialization failure,
    /// deadlock, admin shutdown): retry the whole transaction later.
    Transient,
}

/// Classify a database error.
pub fn classify_error(e: &sqlx::Error) -> DbErrorKind {
    match e {
        sqlx::Error::Database(db) => match db.code().as_deref().map(|c| &c[..2.min(c.len())]) {
            Some("22") | Some("23") => DbErrorKind::Permanent,
            _ => DbErrorKind::Transient,
        },
        _ => DbErrorKind::Transient,
    }
}
