//! The shared adaptive rate of an endpoint: one row per
//! endpoint in `relay.endpoint_rates`, adjusted by every dispatcher process
//! that calls it, and `relay.rate_members`, where each beats so the rate
//! can be divided among the live ones.

use sqlx::PgConnection;

/// How an endpoint's shared rate moves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rule {
    /// Calls per second when the row is first written.
    pub start: f64,
    /// Never below.
    pub min: f64,
    /// Never above.
    pub max: f64,
    /// Multiplied by this when throttled.
    pub decrease: f64,
    /// Calls per second added per second without throttling.
    pub increase: f64,
    /// After a decrease, neither again nor an increase for this long: the
    /// lower rate takes that long to show at the provider.
    pub cooldown: std::time::Duration,
    /// A process that has not beaten for this long no longer counts.
    pub member_ttl: std::time::Duration,
}

/// Beat for `worker`, tell the rate of `endpoint` whether this process was
/// throttled since its last beat, and return the rate (all processes
/// together) and how many processes share it. The time-based increase does
/// not grow with the number of processes: each adds only for the time since
/// the row was last touched.
pub async fn adjust(
    conn: &mut PgConnection,
    endpoint: &str,
    worker: &str,
    throttled: bool,
    rule: &Rule,
) -> Result<(f64, i64), sqlx::Error> {
    sqlx::query("INSERT INTO relay.endpoint_rates (endpoint, rate) VALUES ($1, $2) ON CONFLICT (endpoint) DO NOTHING")
        .bind(endpoint)
        .bind(rule.start)
        .execute(&mut *conn)
        .await?;
    sqlx::query(
        "INSERT INTO relay.rate_members (endpoint, worker) VALUES ($1, $2)
         ON CONFLICT (endpoint, worker) DO UPDATE SET seen_at = now()",
    )
    .bind(endpoint)
    .bind(worker)
    .execute(&mut *conn)
    .await?;
    let (rate, members): (f64, i64) = sqlx::query_as(
        "WITH r AS (
             UPDATE relay.endpoint_rates r
                SET rate = CASE
                        WHEN r.throttled_at > now() - make_interval(secs => $6) THEN r.rate
                        WHEN $2 THEN greatest($3, r.rate * $5)
                        ELSE least($4, r.rate + $7 * extract(epoch FROM now() - r.updated_at))
                    END,
                    throttled_at = CASE
                        WHEN $2 AND NOT coalesce(r.throttled_at > now() - make_interval(secs => $6), false)
                        THEN now() ELSE r.throttled_at END,
                    updated_at = now()
              WHERE r.endpoint = $1
             RETURNING r.rate
         )
         SELECT (SELECT rate FROM r),
                (SELECT count(*) FROM relay.rate_members
                  WHERE endpoint = $1 AND seen_at > now() - make_interval(secs => $8))",
    )
    .bind(endpoint)
    .bind(throttled)
    .bind(rule.min)
    .bind(rule.max)
    .bind(rule.decrease)
    .bind(rule.cooldown.as_secs_f64())
    .bind(rule.increase)
    .bind(rule.member_ttl.as_secs_f64())
    .fetch_one(&mut *conn)
    .await?;
    Ok((rate, members.max(1)))
}
