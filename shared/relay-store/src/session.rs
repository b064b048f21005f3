//! Connections with session settings of their own: the claim loops'
//! ([`ClaimPool`], [`Claimer`]) and the dispatcher's finalizers'
//! ([`FinishPool`]), and transactions that find rows by key
//! ([`begin_by_key`]). Why the planner is steered here, and where it is
//! checked: `tests/e2e/plans.rs` asserts the plans these settings give, and
//! BENCHMARKS.md has the measurements (a claim from a 20 000-row backlog
//! took 13 ms per batch of 50 with the planner free to read and sort the
//! backlog, 1 ms by index order).

use sqlx::{Connection, PgConnection, PgPool, Postgres, Transaction};

/// The settings of [`begin_by_key`] (and of a [`ClaimPool`]'s sessions), as a
/// literal for `concat!`, each set with `$set` (`"SET LOCAL"` or `"SET"`).
macro_rules! by_key_settings {
    ($set:literal) => {
        concat!(
            $set,
            " enable_seqscan = off; ",
            $set,
            " enable_hashjoin = off; ",
            $set,
            " enable_mergejoin = off; ",
            // A plan the settings above price out (a sort they cannot avoid)
            // costs past jit_above_cost, and JIT compiles it again on every
            // run: 0.8 s a claim, where the claim takes 2 ms.
            $set,
            " jit = off"
        )
    };
}

/// What a claim connection's session is set to ([`ClaimPool`]), by whether
/// its commits wait for the disk.
const CLAIM_SETTINGS: &str = concat!("SET enable_sort = off; ", by_key_settings!("SET"));
const ASYNC_CLAIM_SETTINGS: &str =
    concat!("SET synchronous_commit = off; SET enable_sort = off; ", by_key_settings!("SET"));

/// Whether a claim's commit waits for the disk ([`ClaimPool`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimCommit {
    /// Waits, as every other commit: a claim survives a database crash.
    /// Intent claims: a lost claim would leave the row pending while its
    /// call is in flight, and another dispatcher would call again at once.
    Durable,
    /// Does not wait (`synchronous_commit = off`): outbox claims, whose
    /// loss in a crash costs at most a duplicate publish under the same
    /// record id, which consumers deduplicate anyway (R10).
    Async,
}

/// The connections claims run on ([`crate::intents::claim`], [`crate::outbox::claim`]): a
/// small pool beside the main one, to the same database, whose sessions
/// start with the planner told not to sort (`enable_sort = off`) and to find
/// rows by key (the settings of [`begin_by_key`]), and for outbox claims
/// with commits that do not wait for the disk ([`ClaimCommit`]). A claim is then one
/// statement in one round trip, committed as it ends: no `BEGIN` with `SET
/// LOCAL` before it and no `COMMIT` after it, which were two of the three
/// round trips of every claim — each a wait for a core on a loaded machine,
/// or for the network with the database elsewhere. Nothing else runs on
/// these connections, so the settings reach nothing else. (They are set with
/// `SET` once a connection is open, not sent as startup parameters: PgBouncer
/// refuses startup parameters it does not track, even in session mode. A
/// pooler in transaction mode would not keep them, but neither would it keep
/// the relay's `LISTEN` or its prepared statements: the relay needs session
/// pooling or none.)
///
/// An outbox claim is the one write of the relay that may be lost in a
/// database crash: the row is pending again as it was, another claim takes
/// it, and a publisher still holding the lost claim finds its token gone when
/// it marks the row (the record may then be published twice under one id,
/// R10). Every later committed write makes the claim durable with it, since
/// the log is flushed in order. Intent claims are not allowed that loss:
/// the call is made right after the claim, and a claim lost
/// while it is in flight makes the row due again at once — a second call with
/// the same key, concurrent with the first, long before the lease would have
/// expired. What waiting for the flush costs intent claims is measured in
/// BENCHMARKS.md.
///
/// A claim takes the first due rows of its partial index in the index's
/// order, reading only the rows it takes. The other plan — read every due row
/// and sort them — reads the whole backlog on every claim, and PostgreSQL
/// picks it whenever its statistics say few rows are pending: a new table, or
/// a burst after a quiet spell, until autoanalyze catches up. Draining a
/// 20 000-intent backlog, that plan cost 13 ms per claim of 50 instead of
/// 1 ms, most of the dispatcher's database time. With sorting off, the index
/// order is the only plan left that needs no sort (`tests/e2e/plans.rs` checks
/// the plans).
#[derive(Clone, Debug)]
pub struct ClaimPool(PgPool);

impl ClaimPool {
    /// A pool of at most `max_connections` claim connections to `pool`'s
    /// database, with `pool`'s options otherwise, whose commits are `commit`;
    /// connections are opened when first needed.
    pub fn beside(pool: &PgPool, max_connections: u32, commit: ClaimCommit) -> ClaimPool {
        let settings = match commit {
            ClaimCommit::Durable => CLAIM_SETTINGS,
            ClaimCommit::Async => ASYNC_CLAIM_SETTINGS,
        };
        ClaimPool(pool_beside(pool, max_connections, settings))
    }

    /// A claim connection.
    pub async fn acquire(&self) -> Result<ClaimConnection, sqlx::Error> {
        Ok(ClaimConnection(self.0.acquire().await?))
    }

    /// A claimer: one claim loop's connection, kept between its claims.
    pub fn claimer(&self) -> Claimer {
        Claimer { pool: self.clone(), kept: None }
    }
}

/// A pool of at most `max_connections` connections to `pool`'s database, with
/// `pool`'s options otherwise, whose sessions start with `settings`;
/// connections are opened when first needed.
fn pool_beside(pool: &PgPool, max_connections: u32, settings: &'static str) -> PgPool {
    let options =
        pool.options().clone().min_connections(0).max_connections(max_connections).after_connect(move |conn, _| {
            Box::pin(async move { sqlx::Executor::execute(conn, settings).await.map(drop) })
        });
    options.connect_lazy_with(pool.connect_options().as_ref().clone())
}

/// What a finish connection's session is set to ([`FinishPool`]).
const FINISH_SETTINGS: &str = by_key_settings!("SET");

/// The connections outcomes are recorded on — the dispatcher's finalizers'
/// ([`crate::intents::finish_many`]) and the publisher's marks
/// ([`crate::outbox::mark_published`]): a small pool beside the main one whose
/// sessions find rows by key (the settings of [`begin_by_key`], for the
/// session instead of one transaction). A batch of outcomes that records
/// nothing but the intents' new state and their audit rows — no outcome
/// events, no saga moves — is then one statement, committed as it ends: one
/// round trip instead of three (`BEGIN` with `SET LOCAL`, the statement,
/// `COMMIT`). One statement is one transaction, so the state and the audit
/// rows are still written together or not at all. Unlike claims, finishes
/// wait for the disk as every other commit does: a finish lost in a crash
/// would be a call made and then forgotten. Nothing else runs on these
/// connections, so the settings reach nothing else.
#[derive(Clone, Debug)]
pub struct FinishPool(PgPool);

impl FinishPool {
    /// A pool of at most `max_connections` finish connections to `pool`'s
    /// database, with `pool`'s options otherwise; connections are opened
    /// when first needed.
    pub fn beside(pool: &PgPool, max_connections: u32) -> FinishPool {
        FinishPool(pool_beside(pool, max_connections, FINISH_SETTINGS))
    }

    /// A finish connection: statements on it find their rows by key; a
    /// transaction begun on it with a plain `BEGIN` does too.
    pub async fn acquire(&self) -> Result<FinishConnection, sqlx::Error> {
        Ok(FinishConnection(self.0.acquire().await?))
    }
}

/// A connection of a [`FinishPool`]; usable as a plain connection too (it
/// dereferences to one): its settings only steer the planner, and commits on
/// it wait for the disk. (A [`ClaimConnection`] does not dereference, so that
/// nothing but a claim commits without waiting.)
#[derive(Debug)]
pub struct FinishConnection(sqlx::pool::PoolConnection<Postgres>);

impl std::ops::Deref for FinishConnection {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.0
    }
}

impl std::ops::DerefMut for FinishConnection {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.0
    }
}

/// A connection that sat unused for longer than this is checked with a round
/// trip before it is used again — where a restarted server or a dropped
/// connection hides between bursts. The relay's pool does it before handing
/// such a connection out (`relay::app::connect`), a [`Claimer`] by giving
/// its kept connection back to the pool.
pub const CHECK_IDLE_AFTER: std::time::Duration = std::time::Duration::from_secs(5);

/// One claim loop's connection of a [`ClaimPool`], kept from one claim to the
/// next. A connection given back to a pool is checked with a round trip
/// first (sqlx does that on every release), and a claim loop claims many
/// times a second under load; kept, its claims cost one round trip each and
/// nothing more. One that sat unused for [`CHECK_IDLE_AFTER`] is given
/// back and taken again instead (so that it is checked), as is one whose
/// claim failed ([`Claimer::claim`]): the pool closes it if it is broken.
/// One kept for [`Claimer::KEEP_AT_MOST`] is given back too, so that the
/// pool's `max_lifetime` still retires it.
#[derive(Debug)]
pub struct Claimer {
    pool: ClaimPool,
    kept: Option<Kept>,
}

/// A kept connection, when it was taken and when last used.
#[derive(Debug)]
struct Kept {
    conn: ClaimConnection,
    taken: std::time::Instant,
    used: std::time::Instant,
}

impl Claimer {
    /// How long a connection is kept at most before it goes back to the pool.
    pub const KEEP_AT_MOST: std::time::Duration = std::time::Duration::from_secs(60);

    /// Run `claim` on the kept connection; if it fails, the connection is
    /// given back (the pool closes it if it is broken) and the next claim
    /// takes another.
    pub async fn claim<T>(
        &mut self,
        claim: impl AsyncFnOnce(&mut ClaimConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        let done = claim(self.connection().await?).await;
        if done.is_err() {
            self.kept = None;
        }
        done
    }

    /// The connection to claim on.
    pub async fn connection(&mut self) -> Result<&mut ClaimConnection, sqlx::Error> {
        let now = std::time::Instant::now();
        if self.kept.as_ref().is_some_and(|k| {
            now.duration_since(k.used) > CHECK_IDLE_AFTER || now.duration_since(k.taken) > Self::KEEP_AT_MOST
        }) {
            // Given back before taking one: the pool may hold only this one.
            self.kept = None;
        }
        let kept = match self.kept.take() {
            Some(kept) => Kept { used: now, ..kept },
            None => Kept { conn: self.pool.acquire().await?, taken: now, used: now },
        };
        Ok(&mut self.kept.insert(kept).conn)
    }
}

/// A connection of a [`ClaimPool`].
#[derive(Debug)]
pub struct ClaimConnection(sqlx::pool::PoolConnection<Postgres>);

impl ClaimConnection {
    /// The connection itself, to read a claim's plan (`tests/e2e/plans.rs`).
    /// Anything run on it runs with the claim settings.
    pub fn as_conn(&mut self) -> &mut PgConnection {
        &mut self.0
    }
}

/// Begin a transaction whose statements find their rows by key — the fenced
/// finishes of claimed rows — with the planner told to use an index for
/// every table it reads and to join by nested loop (`SET LOCAL
/// enable_seqscan = off, enable_hashjoin = off, enable_mergejoin = off`).
///
/// A claim or finish joins a handful of ids with the table. PostgreSQL caches
/// each connection's plan of a statement it has run five times; when that
/// happened while the table was small (a new deployment: no rows, or no
/// statistics yet), the cached plan reads the whole table into a hash for
/// every batch, and keeps doing so as the table grows until autoanalyze
/// invalidates it. In the latency benchmark (a fresh database per run, 10 s
/// at a steady rate) that was most of the dispatcher's database time: a
/// finish of 3 intents took 1.4 ms on average and 5 ms on a 10 000-row table,
/// against 0.2 ms through the primary key; the claims paid the same. With
/// these settings the only plan left probes the primary key once per row,
/// whatever the statistics said when the plan was made. Nothing else is
/// affected: `SET LOCAL` ends with the transaction.
pub async fn begin_by_key(conn: &mut PgConnection) -> Result<Transaction<'_, Postgres>, sqlx::Error> {
    conn.begin_with(concat!("BEGIN; ", by_key_settings!("SET LOCAL"))).await
}

/// Run one fenced statement in a transaction of its own begun with
/// [`begin_by_key`]: `conn` must not be in one.
pub(crate) async fn execute_by_key(
    conn: &mut PgConnection,
    statement: sqlx::query::Query<'_, Postgres, sqlx::postgres::PgArguments>,
) -> Result<sqlx::postgres::PgQueryResult, sqlx::Error> {
    let mut tx = begin_by_key(conn).await?;
    let done = statement.execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(done)
}
