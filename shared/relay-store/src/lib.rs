//! Every SQL statement of the relay, one named async function per statement,
//! grouped by concern: [`inbox`], [`sagas`], [`intents`], [`outbox`],
//! [`dead_letters`], [`stats`], [`ops`], and the read-only checks of `relay
//! verify` / `relay demo` in [`audit`]. [`write`](mod@write) is where an input event
//! becomes rows (inbox, keys, guards, saga moves, intents, outbox, counters),
//! for a batch and a single record alike. Connections with session settings
//! of their own (claims, finishes) are in `session`; statements composed of
//! several (one round trip) get their `$n` renumbered by `compose`.
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
//!   claimed row always checks its lease token (fencing). A claim is the one
//!   writer that commits by itself: it runs on a connection of its own
//!   ([`ClaimPool`]) whose session settings must not reach other work.
//!
//! Queries are plain `sqlx::query` checked by the integration tests against a
//! real PostgreSQL, not `query!` macros: the macros need a live database or a
//! committed `.sqlx` cache at build time, and every statement here is already
//! executed by the end-to-end suite on every CI run.

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use sqlx::migrate::Migrator;

pub mod application;
pub mod audit;
pub mod dead_letters;
pub mod effects;
pub mod headers;
pub mod holds;
pub mod inbox;
pub mod intents;
pub mod ops;
pub mod ordering;
pub mod outbox;
pub mod rates;
pub mod reconciliations;
pub mod sabotage;
pub mod sagas;
pub mod stats;
pub mod write;

mod compose;
#[cfg(test)]
mod names_in_sql;
mod session;

pub(crate) use compose::{PgQuery, param_count, shift_params};
pub(crate) use session::execute_by_key;
pub use session::{
    CHECK_IDLE_AFTER, ClaimCommit, ClaimConnection, ClaimPool, Claimer, FinishConnection, FinishPool, begin_by_key,
};

pub use sqlx::{PgConnection, Postgres, Transaction};

/// `BEGIN` for the transactions that wait on locks anyone may hold: the
/// per-key advisory locks an application's `relay.call` also takes, rows an
/// application may have written and not committed. A wait past it fails
/// the transaction with 55P03, retried like any outage, and says so,
/// instead of stalling a partition (or the outcomes) for as long as one
/// open application transaction lasts. One round trip, as a plain `BEGIN`.
pub const BEGIN_BOUNDED: &str = "BEGIN; SET LOCAL lock_timeout = '5s'";

/// What one claim took, in claim order, and — when it took fewer rows than it
/// asked for — when the next pending row that is not due yet comes due, for
/// the claimer's sleep (`None`: nothing scheduled, or the claim came back full
/// and the claimer goes again at once).
#[derive(Debug)]
pub struct Claim<T> {
    /// The rows claimed.
    pub rows: Vec<T>,
    /// Rows claimed (running under the claim's lease) whose columns could
    /// not be read; the claimer must finish or release each of them.
    pub unreadable: Vec<Unreadable>,
    /// When the earliest pending row not yet due comes due.
    pub next_due: Option<DateTime<Utc>>,
    /// The last of the claimed rows in the claim's scan order, for a claim
    /// that may start after it ([`intents::claim_after`]); `None` when
    /// nothing was claimed, and for outbox claims (whose rows come back in
    /// claim order: the last row's `seq` is their position).
    pub last: Option<Position>,
    /// For outbox claims: the `seq` up to which the claim examined every
    /// pending row, when it stopped at its window ([`outbox::WINDOW`])
    /// before filling its batch; the next claim may go on after it.
    pub passed: Option<i64>,
    /// For intent claims: the claim stopped at its byte room
    /// ([`intents::claim_after`]) with due rows left over. Short, but not
    /// because nothing more is due: the claimer claims again once some of
    /// what it holds has finished.
    pub cut: bool,
}

/// A claimed row whose columns could not be decoded: JSON nested deeper
/// than serde_json reads (128 levels), or any other value its type cannot
/// take. Its id and lease token are read first, so it can be finished alone
/// while the rest of its claim goes on.
#[derive(Debug, Clone)]
pub struct Unreadable {
    /// The row's id.
    pub id: uuid::Uuid,
    /// The lease token its claim (or take) gave it.
    pub lease_token: uuid::Uuid,
    /// What could not be read, as the decoder says (it names the column).
    pub error: String,
}

impl Unreadable {
    /// Why the row is finished without being sent, for its `last_error`
    /// and the log: its id and the cause.
    pub fn reason(&self) -> String {
        format!(
            "row {} cannot be read ({}): relay cannot send it, and recorded none of its effects",
            self.id, self.error
        )
    }
}

/// Decode a row of a claim or take as `T`: `Ok(Err(_))` for a row whose
/// id and lease token were read but not the rest; an error only when even
/// those could not be.
pub(crate) fn decode_claimed<T>(row: &sqlx::postgres::PgRow) -> Result<Result<T, Unreadable>, sqlx::Error>
where
    T: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>,
{
    use sqlx::Row;
    match T::from_row(row) {
        Ok(t) => Ok(Ok(t)),
        Err(e) => {
            let id = row.try_get("id")?;
            let lease_token = row.try_get("lease_token")?;
            Ok(Err(Unreadable { id, lease_token, error: e.to_string() }))
        }
    }
}

/// A place in the order intents are claimed in (`intents_due`: when due,
/// then insertion order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    /// The row's `next_attempt_at`.
    pub due: DateTime<Utc>,
    /// The row's `seq`.
    pub seq: i64,
}

/// Run a claim statement and split what it returns (`query`: a statement
/// like [`intents::CLAIM`], bound): every row carries `next_due`, and a row
/// whose `id` is null is no claimed row but only that (the statement returns
/// one such row when it claimed nothing).
///
/// The claim statement looks `next_due` up only when it claimed fewer rows
/// than it asked for: after a full claim the claimer claims again at once and
/// the lookup would go unused. In the same statement `now()` and the snapshot
/// are the claim's, so no row falls between the two: a row due by then was
/// seen by the claim (taken, or blocked behind an earlier row of its ordering
/// key, a paused endpoint or another claimer), a row due later is counted
/// here. Blocked rows are left out on purpose: counting them would hide a
/// retry due in 20 ms behind them and leave it to the poll interval. It is
/// part of the claim statement, not a query after it, because a claimer
/// under a steady load comes back short on nearly every claim: the lookup as
/// a statement of its own was one round trip in four of every claim.
///
/// `positioned`: the claimed rows carry `due_at` and `seq`, and
/// [`Claim::last`] is the greatest of them.
///
/// Rows are decoded one by one: one that cannot be read goes to
/// [`Claim::unreadable`] and the others are returned as usual. The claim
/// has committed by now, so failing it whole would leave every row it took
/// running until its lease ran out, to be claimed, and fail, again.
pub(crate) async fn fetch_claim<T>(
    conn: &mut PgConnection,
    query: sqlx::query::Query<'_, Postgres, sqlx::postgres::PgArguments>,
    positioned: bool,
) -> Result<Claim<T>, sqlx::Error>
where
    T: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>,
{
    use sqlx::Row;
    let mut claim =
        Claim { rows: Vec::new(), unreadable: Vec::new(), next_due: None, last: None, passed: None, cut: false };
    for row in query.fetch_all(conn).await? {
        claim.next_due = row.try_get("next_due")?;
        if positioned {
            claim.cut = row.try_get("cut")?;
        } else {
            claim.passed = row.try_get("passed")?;
        }
        if row.try_get::<Option<uuid::Uuid>, _>("id")?.is_some() {
            if positioned {
                let here = Position { due: row.try_get("due_at")?, seq: row.try_get("seq")? };
                claim.last = claim.last.max(Some(here));
            }
            match decode_claimed(&row)? {
                Ok(t) => claim.rows.push(t),
                Err(u) => {
                    tracing::error!(row = %u.id, error = %u.error, "a claimed row cannot be read; the rest of its claim goes on");
                    claim.unreadable.push(u);
                }
            }
        }
    }
    Ok(claim)
}

/// The relay's migrations (`migrations/` at the workspace root), embedded.
pub static MIGRATOR: Migrator = sqlx::migrate!("../../migrations");

/// Before the migrator runs: relay's schema exists, and the migrator's own
/// table, which sqlx names without a schema, is relay's. Found through
/// `"$user", public` it was another table once a schema named like relay's
/// login existed (relay's own, for a login named `relay`: the second
/// `relay migrate` then met an empty table and ran migration 1 again), and
/// the owner of `public` could drop it or put a view of its own there. A
/// table earlier releases left in `public` is moved, if relay's role owns it,
/// over an empty one that second `relay migrate` left in schema relay.
const PREPARE_MIGRATIONS: &str = r#"
SET search_path = pg_catalog, pg_temp;
CREATE SCHEMA IF NOT EXISTS relay;
DO $$
DECLARE
    earlier regclass := to_regclass('public._sqlx_migrations');
    empty boolean;
BEGIN
    IF earlier IS NOT NULL AND to_regclass('relay._sqlx_migrations') IS NOT NULL THEN
        EXECUTE 'SELECT NOT EXISTS (SELECT 1 FROM relay._sqlx_migrations)' INTO empty;
        IF empty THEN
            DROP TABLE relay._sqlx_migrations;
        END IF;
    END IF;
    IF to_regclass('relay._sqlx_migrations') IS NULL AND earlier IS NOT NULL THEN
        IF (SELECT relkind <> 'r' OR relowner <> current_user::regrole FROM pg_class WHERE oid = earlier) THEN
            RAISE EXCEPTION 'public._sqlx_migrations is not a table relay''s role % owns, so relay does not take '
                'it for its migrations (kept in relay._sqlx_migrations): inspect it (who made it, which versions '
                'it lists), then move it as its owner (ALTER TABLE public._sqlx_migrations SET SCHEMA relay) '
                'or, on a database relay never migrated, drop it', current_user;
        END IF;
        ALTER TABLE public._sqlx_migrations SET SCHEMA relay;
    END IF;
END $$;
SET search_path = relay, pg_catalog, pg_temp;
"#;

/// Apply pending migrations, keeping sqlx's table in relay's schema (made
/// first if need be; a table earlier releases left in `public` moved
/// there). On a connection closed afterwards, so that its search path goes
/// back to no pool.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    let mut conn = pool.acquire().await?;
    sqlx::raw_sql(PREPARE_MIGRATIONS).execute(&mut *conn).await?;
    let done = MIGRATOR.run(&mut *conn).await;
    let _ = conn.close().await;
    done
}

/// Whether every embedded migration has been applied to this database, as
/// it is embedded: one changed after it was applied (same version, another
/// checksum) leaves the schema not current, and `relay migrate` says which.
/// The table is read in relay's schema only: one of the same name that
/// another role made elsewhere says nothing.
pub async fn migrations_current(pool: &PgPool) -> Result<bool, sqlx::Error> {
    let applied: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT version, checksum FROM relay._sqlx_migrations WHERE success ORDER BY version")
            .fetch_all(pool)
            .await
            .or_else(|e| match &e {
                sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01") => Ok(Vec::new()),
                _ => Err(e),
            })?;
    Ok(MIGRATOR.iter().all(|m| applied.iter().any(|(v, sum)| *v == m.version && sum[..] == m.checksum[..])))
}

/// How a database error should be handled by the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbErrorKind {
    /// The record's data is unacceptable (SQLSTATE class 22 data exception,
    /// 23 integrity violation, 54 program limit — an id or key too long for
    /// its index —, or 25P02: a statement after a failure a code handler
    /// swallowed): retrying the same record gives the same error.
    Permanent,
    /// Anything else (connection lost, pool timeout, serialization failure,
    /// deadlock, admin shutdown): retry the whole transaction later.
    Transient,
}

/// Classify a database error met while writing a record.
pub fn classify_error(e: &sqlx::Error) -> DbErrorKind {
    match e {
        sqlx::Error::Database(db) => match db.code().as_deref() {
            Some("25P02") => DbErrorKind::Permanent,
            Some(c) if ["22", "23", "54"].contains(&&c[..2.min(c.len())]) => DbErrorKind::Permanent,
            _ => DbErrorKind::Transient,
        },
        _ => DbErrorKind::Transient,
    }
}

/// Whether `e` says the database is unavailable, overloaded or in a state
/// that passes, rather than that a statement or its use was wrong: no
/// connection (I/O, TLS, the pool, class 08), a transaction rolled back by
/// a conflict (40), insufficient resources (53), operator intervention such
/// as a shutdown (57), a system error (58), a read-only server during a
/// failover (25006), a lock not available now (55P03, 55006), or missing
/// privileges (42501: an operator's grant mends it). A code handler's error
/// that is none of these is its record's — its own SQL, a constraint, a row
/// it expected and did not find, a value it could not decode —, never
/// retried as an outage.
pub fn is_outage(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db.code().as_deref().is_some_and(|c| {
            ["08", "40", "53", "57", "58"].contains(&&c[..2.min(c.len())])
                || ["25006", "55P03", "55006", "42501"].contains(&c)
        }),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}

/// What the database rejected, for a dead letter's reason: the SQLSTATE and
/// the constraint, table and column it names — never PostgreSQL's message,
/// which quotes the offending value (`invalid input syntax for type
/// numeric: "4111…"`), and reasons go to logs and the console (R16).
pub fn rejection(e: &sqlx::Error) -> String {
    let sqlx::Error::Database(db) = e else { return e.to_string() };
    let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() else {
        return format!("SQLSTATE {}", db.code().unwrap_or_default());
    };
    let meaning = match pg.code() {
        "23505" => " (unique violation)",
        "23503" => " (foreign key violation)",
        "23502" => " (not null violation)",
        "23514" => " (check violation)",
        "22001" => " (value too long for its column)",
        "22P02" => " (invalid text for its type)",
        "54000" => " (a value too large for its index)",
        "25P02" => " (statement in a transaction aborted by an earlier error)",
        _ => "",
    };
    let mut out = format!("SQLSTATE {}{meaning}", pg.code());
    for (what, v) in [("table", pg.table()), ("column", pg.column()), ("constraint", pg.constraint())] {
        if let Some(v) = v {
            out += &format!(", {what} {v}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::MIGRATOR;

    /// sqlx runs a migration in one transaction unless it starts with
    /// `-- no-transaction` (and PostgreSQL runs the statements of one simple
    /// query in one transaction): a VALIDATE beside the ALTER TABLE that
    /// added the constraint runs under its ACCESS EXCLUSIVE lock and blocks
    /// every reader and writer of the table for the whole scan.
    #[test]
    fn constraints_are_validated_outside_the_transaction_that_added_them() {
        for m in MIGRATOR.iter() {
            let sql = m.sql.to_ascii_uppercase();
            if sql.contains("VALIDATE CONSTRAINT") {
                assert!(
                    m.no_tx,
                    "migration {} ({}) validates a constraint inside its transaction: move the VALIDATE to a \
                     migration of its own that starts with `-- no-transaction`",
                    m.version, m.description
                );
                assert!(
                    !sql.contains("ADD CONSTRAINT") && !sql.contains("DROP CONSTRAINT"),
                    "migration {} ({}) changes constraints and validates one: validate in a migration of its own",
                    m.version,
                    m.description
                );
            }
        }
    }
}
