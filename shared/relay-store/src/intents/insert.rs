//! Writing intents at ingest, claimed there or not, delayed fairly per key.

use std::borrow::Borrow;
use std::time::Duration;

use chrono::{DateTime, Utc};
use relay_core::effects::NewIntent;
use sqlx::PgConnection;
use uuid::Uuid;

/// Insert many intents, `ON CONFLICT DO NOTHING`, returning the ids that
/// were new ([`crate::effects::insert`]); `$1`…`$20`: one array per column.
///
/// `$21` (one flag per row), `$22` (worker) and `$23` (lease in seconds)
/// hold rows for a dispatcher at insert ([`Hold`]): a flagged row without an
/// ordering key whose endpoint is not paused is written as the claim
/// statement ([`CLAIM`]) would leave it — running, attempt 1 counted, a fresh
/// lease token, `locked_until` a lease from now — and returns its token; any
/// other row is written pending, as without a hold. The lease starts at the
/// statement (`clock_timestamp()`), not at its transaction's start.
pub(crate) const INSERT_MANY: &str = "INSERT INTO relay.intents
             (id, consumer, source_event_id, action, endpoint, method, path, body, request_headers,
              idempotency_key, ordering_key, max_attempts, expires_at, on_success, on_dead,
              emit_source, aggregate_id, correlation_id, causation_id, traceparent, holds_key, fairness_key,
              next_attempt_at, state, attempts, lease_token, locked_by, locked_until)
         SELECT id, consumer, source_event_id, action, endpoint, method, path, body, request_headers,
                idempotency_key, ordering_key, max_attempts, now() + make_interval(secs => max_age),
                on_success, on_dead, emit_source, aggregate_id, correlation_id, causation_id, traceparent, holds_key,
                fairness_key, now() + make_interval(secs => coalesce(delay, 0)),
                CASE WHEN h.held THEN 'running' ELSE 'pending' END, h.held::int4,
                CASE WHEN h.held THEN gen_random_uuid() END, CASE WHEN h.held THEN $22::text END,
                CASE WHEN h.held THEN clock_timestamp() + make_interval(secs => $23::float8) END
           FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                       $8::jsonb[], $9::jsonb[], $10::text[], $11::text[], $12::int4[], $13::float8[],
                       $14::jsonb[], $15::jsonb[], $16::text[], $17::text[], $18::text[], $19::text[], $20::text[],
                       $21::bool[], $24::bool[], $25::text[], $26::float8[])
                AS t(id, consumer, source_event_id, action, endpoint, method, path, body, request_headers,
                     idempotency_key, ordering_key, max_attempts, max_age, on_success, on_dead,
                     emit_source, aggregate_id, correlation_id, causation_id, traceparent, take, holds_key,
                     fairness_key, delay)
          CROSS JOIN LATERAL (
                SELECT t.take AND t.ordering_key IS NULL AND t.fairness_key IS NULL AND NOT EXISTS (
                           SELECT 1 FROM relay.pauses p
                            WHERE p.kind = 'endpoint' AND p.name = t.endpoint AND p.consumer IN ('', t.consumer)) AS held
          ) h
         ON CONFLICT (id) DO NOTHING
         RETURNING id, lease_token, expires_at, created_at";

/// Rows of a multi-row intent insert to write as already claimed by a
/// dispatcher (see `INSERT_MANY`).
#[derive(Debug, Clone, Copy)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct Hold<'a> {
    /// The dispatcher's worker id (`locked_by`).
    pub worker: &'a str,
    pub lease: Duration,
    /// One flag per row: hold this one if it can be.
    pub take: &'a [bool],
}

/// What the insert wrote for a held row: its claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The claim's fencing token.
    pub lease_token: Uuid,
    /// Age budget deadline, as stored.
    pub expires_at: DateTime<Utc>,
    /// When the row was written.
    pub created_at: DateTime<Utc>,
}

/// Bind the parameters of [`INSERT_MANY`] to `q`, after those it has.
pub(crate) fn bind_many<'q, R: Borrow<NewIntent>>(
    q: crate::PgQuery<'q>,
    rows: &'q [R],
    hold: Option<Hold<'q>>,
    delays: Vec<Option<f64>>,
) -> crate::PgQuery<'q> {
    fn col<'a, R: Borrow<NewIntent>, T: 'a>(rows: &'a [R], f: impl Fn(&'a NewIntent) -> T) -> Vec<T> {
        rows.iter().map(|r| f(r.borrow())).collect()
    }
    let take: Vec<bool> = match hold {
        Some(h) => (0..rows.len()).map(|k| h.take.get(k).copied().unwrap_or(false)).collect(),
        None => vec![false; rows.len()],
    };
    q.bind(col(rows, |r| r.id))
        .bind(col(rows, |r| r.intent.consumer.as_str()))
        .bind(col(rows, |r| r.intent.source_event_id.as_str()))
        .bind(col(rows, |r| r.intent.action.as_str()))
        .bind(col(rows, |r| r.intent.endpoint.as_str()))
        .bind(col(rows, |r| r.intent.method.as_str()))
        .bind(col(rows, |r| r.intent.path.as_str()))
        .bind(col(rows, |r| r.intent.body.clone()))
        .bind(col(rows, |r| r.intent.headers.clone()))
        .bind(col(rows, |r| r.intent.idempotency_key.as_str()))
        .bind(col(rows, |r| r.intent.ordering_key.as_deref()))
        .bind(col(rows, |r| r.intent.max_attempts))
        .bind(col(rows, |r| r.max_age.as_secs_f64()))
        .bind(col(rows, |r| r.intent.on_success.clone()))
        .bind(col(rows, |r| r.intent.on_dead.clone()))
        .bind(col(rows, |r| r.intent.emit_source.as_str()))
        .bind(col(rows, |r| r.intent.aggregate_id.as_deref()))
        .bind(col(rows, |r| r.intent.correlation_id.as_deref()))
        .bind(col(rows, |r| r.intent.causation_id.as_deref()))
        .bind(col(rows, |r| r.intent.traceparent.as_deref()))
        .bind(take)
        .bind(hold.map(|h| h.worker))
        .bind(hold.map(|h| h.lease.as_secs_f64()))
        .bind(col(rows, |r| r.intent.holds_key))
        .bind(col(rows, |r| r.intent.fairness_key.as_deref()))
        .bind(delays)
}

/// For the rows with a fairness key: how long after now each is due, at its
/// key's next slots (`relay.fairness_clocks`, advanced past them here, in
/// the caller's transaction); `None` for the others, and no round trip if
/// there are none. The clocks are taken in one sorted statement, so two
/// transactions that share keys wait for each other, never deadlock.
pub(crate) async fn fair_delays<R: Borrow<NewIntent>>(
    conn: &mut PgConnection,
    consumer: &str,
    rows: &[R],
) -> Result<Vec<Option<f64>>, sqlx::Error> {
    use std::collections::BTreeMap;
    // (endpoint, key) → (spacing, rows in batch order)
    let mut groups: BTreeMap<(&str, &str), (f64, Vec<usize>)> = BTreeMap::new();
    for (n, r) in rows.iter().enumerate() {
        let r = r.borrow();
        if let (Some(key), Some(spacing)) = (r.intent.fairness_key.as_deref(), r.fair_spacing) {
            let g = groups.entry((r.intent.endpoint.as_str(), key)).or_insert((spacing.as_secs_f64(), Vec::new()));
            g.1.push(n);
        }
    }
    let mut delays = vec![None; rows.len()];
    if groups.is_empty() {
        return Ok(delays);
    }
    let endpoints: Vec<&str> = groups.keys().map(|k| k.0).collect();
    let keys: Vec<&str> = groups.keys().map(|k| k.1).collect();
    let spans: Vec<f64> = groups.values().map(|(s, rows)| s * rows.len() as f64).collect();
    let starts: Vec<(String, String, f64)> = sqlx::query_as(
        "INSERT INTO relay.fairness_clocks AS c (consumer, endpoint, key, next_slot)
         SELECT $1, t.endpoint, t.key, now() + make_interval(secs => t.span)
           FROM unnest($2::text[], $3::text[], $4::float8[]) WITH ORDINALITY AS t(endpoint, key, span, n)
          ORDER BY t.n
         ON CONFLICT (consumer, endpoint, key) DO UPDATE
            SET next_slot = greatest(c.next_slot, now()) + (excluded.next_slot - now())
         RETURNING c.endpoint, c.key, extract(epoch FROM c.next_slot - now())::float8",
    )
    .bind(consumer)
    .bind(&endpoints)
    .bind(&keys)
    .bind(&spans)
    .fetch_all(&mut *conn)
    .await?;
    for (endpoint, key, end) in starts {
        let Some((spacing, members)) = groups.get(&(endpoint.as_str(), key.as_str())) else { continue };
        let start = end - spacing * members.len() as f64;
        for (i, n) in members.iter().enumerate() {
            delays[*n] = Some((start + spacing * i as f64).max(0.0));
        }
    }
    Ok(delays)
}
