//! Claiming intents: by due time, fairly across endpoints, within each
//! endpoint's room, with a lease token.

use std::time::Duration;

use super::{ClaimedIntent, claimed_columns};
use crate::{Claim, ClaimConnection, Position};

/// Claim up to `limit` due intents for `worker` with a lease of `lease`, in one
/// statement: `FOR UPDATE SKIP LOCKED` picks rows no other dispatcher holds and
/// the `UPDATE` sets the lease and counts the attempt (R9). Intents whose
/// ordering key has an earlier unfinished or uncertain intent, or any running
/// one, are not due (R13; "earlier" is commit order, [`crate::ordering`]):
/// an uncertain intent holds its key until an operator replays it, since
/// the provider may have applied it. The
/// attempt's audit row is written when it finishes ([`finish_many`](super::finish_many)) or, if
/// its worker is lost, by the rescuer ([`rescue_expired`](super::rescue_expired)). Commits by
/// itself, on a claim connection ([`crate::ClaimPool`]): one round trip. A
/// short claim also says when the next intent comes due ([`Claim::next_due`]).
pub async fn claim(
    conn: &mut ClaimConnection,
    scope: &Scope<'_>,
    worker: &str,
    limit: i64,
    lease: Duration,
) -> Result<Claim<ClaimedIntent>, sqlx::Error> {
    claim_after(conn, scope, worker, limit, lease, None, Room::ANY).await
}

/// How much JSON a claim may take: its rows' body, headers and outcomes,
/// as PostgreSQL prints them, in total. A dispatcher holds what it claimed
/// until the calls end, decoded; a count of rows alone would let 64 rows of
/// 900 KiB each, and the trees they decode to, be claimed at once.
#[derive(Debug, Clone, Copy)]
pub struct Room {
    /// Bytes the claimed rows may take together.
    pub bytes: u64,
    /// Take the first due row even if it alone is larger (the claimer holds
    /// nothing else): a row larger than the room is still called, alone.
    pub first_always: bool,
    /// Take applications' calls (`relay.call`): not while the outcomes of
    /// earlier ones wait in memory for keys an application holds, past
    /// their own room.
    pub applications: bool,
}

impl Room {
    /// No bound.
    pub const ANY: Room = Room { bytes: u64::MAX, first_always: true, applications: true };
}

/// Which intents a dispatcher may claim: those its consumer wrote, for
/// endpoints it has a client for. Two deployments sharing a database, or a
/// rolling deploy that adds an endpoint, must not call each other's intents
/// with the wrong base URL and credentials, nor spend their attempts on an
/// endpoint they cannot reach.
#[derive(Debug, Clone, Copy)]
pub struct Scope<'a> {
    /// The consumer whose intents these are.
    pub consumer: &'a str,
    /// The endpoints this dispatcher can call.
    pub endpoints: &'a [&'a str],
}

/// [`claim`], taking only rows that come after `after` in the claim order
/// (`None`: from the start). For a claim loop draining a backlog: every
/// claim reads the due index from its start, and the entries of rows
/// claimed before are read again and again until vacuum removes them —
/// which it cannot while any transaction older than those claims is open.
/// With a snapshot held open during a 30 000-intent drain, that made each
/// claim read all the entries of the claims before it. A loop that starts
/// after the last row of its previous full claim ([`Claim::last`]) reads
/// only new entries; what it passes over — rows left behind an earlier row
/// of their ordering key, rows of a paused endpoint, rows whose
/// transaction committed after later ones — it finds on its next claim
/// from the start, which it must make regularly (the dispatcher: after any
/// short claim, when its own progress may have made rows due, and at least
/// once per poll interval).
pub async fn claim_after(
    conn: &mut ClaimConnection,
    scope: &Scope<'_>,
    worker: &str,
    limit: i64,
    lease: Duration,
    after: Option<Position>,
    room: Room,
) -> Result<Claim<ClaimedIntent>, sqlx::Error> {
    let claim = sqlx::query(CLAIM)
        .bind(limit)
        .bind(worker)
        .bind(lease.as_secs_f64())
        .bind(after.map(|p| p.due))
        .bind(after.map_or(0, |p| p.seq))
        .bind(scope.endpoints)
        .bind(scope.consumer)
        .bind(i64::try_from(room.bytes).unwrap_or(i64::MAX))
        .bind(room.first_always)
        .bind(room.applications);
    crate::fetch_claim(conn.as_conn(), claim, true).await
}

/// The claim statement ([`claim`]); public so a test can check its plan.
/// `$1` limit, `$2` worker, `$3` lease in seconds, `$4` and `$5` the
/// position to claim after (`$4` null: from the start), `$6` the endpoints
/// and `$7` the consumer of the [`Scope`], `$8` to `$10` the [`Room`]. Its
/// rows are the claimed intents, each with `next_due` and `cut`; when it
/// claims fewer than `$1`, `next_due` is when the earliest pending intent
/// not due yet comes due, and at least one row comes back (all columns but
/// `next_due` and `cut` null when none was claimed), which [`claim`] sorts
/// out. Rows locked by `due` past the room are not updated; their locks
/// end with the statement's commit. The room is a running sum over the
/// claim's own rows, correlated rather than a window function (which made
/// concurrent claims take seconds), and skipped when the whole claim fits,
/// as it mostly does: row by row it costs a claim quadratic time.
///
/// Each endpoint's due rows are read apart, through `intents_due`, which
/// leads with the consumer and the endpoint, and a paused endpoint's not at
/// all: read in one run of due rows, a paused or busy endpoint's backlog, or
/// another deployment's, was read again by every claim before the rows it
/// could take (a million rows: seconds a claim). Each endpoint locks at most
/// `$1` rows; those past the first `$1` of all are not updated, and their
/// locks end with the statement.
///
/// An intent's first claim starts its age budget again (`max_age`, the
/// difference its insert left between `expires_at` and `created_at`): time
/// relay kept it from being sent (its key held behind an uncertain intent,
/// its endpoint paused, a fair share's delay) must not end it dead, with
/// its `on_dead` effects, before it was ever sent.
pub const CLAIM: &str = concat!(
    "WITH ready AS MATERIALIZED (
             SELECT u.name FROM unnest($6::text[]) AS u(name)
              WHERE NOT EXISTS (SELECT 1 FROM relay.pauses p
                                 WHERE p.kind = 'endpoint' AND p.name = u.name AND p.consumer IN ('', $7::text))
         ), due AS (
             SELECT d.id, d.next_attempt_at, d.seq, d.bytes
               FROM ready AS ep
              CROSS JOIN LATERAL (
                    SELECT i.id, i.next_attempt_at, i.seq,
                           coalesce(octet_length(i.body::text), 0) + octet_length(i.request_headers::text)
                           + octet_length(i.on_success::text) + octet_length(i.on_dead::text) AS bytes
                      FROM relay.intents i
                     WHERE i.consumer = $7::text AND i.endpoint = ep.name
                       AND i.state = 'pending' AND i.next_attempt_at <= now()
                       AND ($10 OR i.action <> 'application')
                       AND (i.next_attempt_at, i.seq) > (COALESCE($4::timestamptz, '-infinity'), $5::int8)
                       AND (i.ordering_key IS NULL OR NOT EXISTS (
                               SELECT 1 FROM relay.intents e
                                WHERE e.ordering_key = i.ordering_key AND e.consumer = i.consumer
                                  AND (e.state IN ('pending', 'running', 'uncertain')
                                       OR (e.state = 'dead' AND e.holds_key))
                                  AND (e.seq < i.seq OR e.state = 'running')))
                     ORDER BY i.next_attempt_at, i.seq
                     LIMIT $1
                     FOR UPDATE OF i SKIP LOCKED) d
              ORDER BY d.next_attempt_at, d.seq
              LIMIT $1
         ), fits AS (
             SELECT d.id FROM due d
              WHERE (SELECT sum(bytes) FROM due) <= $8
                 OR (SELECT sum(e.bytes) FROM due e
                      WHERE (e.next_attempt_at, e.seq) <= (d.next_attempt_at, d.seq)) <= $8
                 OR ($9 AND NOT EXISTS (SELECT 1 FROM due e
                                         WHERE (e.next_attempt_at, e.seq) < (d.next_attempt_at, d.seq)))
         ), claimed AS (
             UPDATE relay.intents i
                SET state = 'running', attempts = i.attempts + 1, lease_token = gen_random_uuid(),
                    locked_by = $2, locked_until = now() + make_interval(secs => $3),
                    expires_at = CASE WHEN i.attempts = 0 AND i.locked_by IS NULL
                                      THEN greatest(i.expires_at, now() + (i.expires_at - i.created_at))
                                      ELSE i.expires_at END
               FROM fits WHERE i.id = fits.id
             RETURNING i.*
         ), next AS (
             SELECT CASE WHEN (SELECT count(*) FROM claimed) < $1 THEN (
                        SELECT min(n.next_attempt_at) FROM unnest($6::text[]) AS ep(name)
                         CROSS JOIN LATERAL (
                               SELECT i.next_attempt_at FROM relay.intents i
                                WHERE i.consumer = $7::text AND i.endpoint = ep.name
                                  AND i.state = 'pending' AND i.next_attempt_at > now()
                                ORDER BY i.next_attempt_at LIMIT 1) n) END AS next_due,
                    (SELECT count(*) FROM due) > (SELECT count(*) FROM fits) AS cut
         )
         SELECT ",
    claimed_columns!(),
    ", next_attempt_at AS due_at, seq, next.next_due, next.cut
           FROM next LEFT JOIN claimed c ON true"
);
