//! The front door for applications (`relay.publish`, `relay.call`,
//! migration 0027): what a deployment takes from them, written from its
//! `[application]` section so the functions check it in the caller's
//! transaction, and the grants of the enqueue role.

use sqlx::PgPool;

/// One endpoint as applications may call it: its budget and key rules.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// Name (of `[endpoints]`).
    pub name: String,
    /// Attempts budget.
    pub max_attempts: i32,
    /// Age budget, seconds.
    pub max_age_secs: f64,
    /// The provider's longest idempotency key, if any.
    pub key_max_length: Option<i32>,
    /// The key goes in a body field.
    pub key_in_body: bool,
    /// The provider gets a key at all.
    pub sends_key: bool,
}

/// What deployment `consumer` takes from applications.
#[derive(Debug, Clone)]
pub struct FrontDoor {
    /// CloudEvents source of their events.
    pub source: String,
    /// The largest payload accepted.
    pub max_payload_bytes: i32,
    /// Topics they may publish to.
    pub topics: Vec<String>,
    /// Endpoints they may call.
    pub endpoints: Vec<Endpoint>,
    /// The role that may enqueue.
    pub role: String,
}

/// How a registration went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Registered {
    /// Open, and the role has its grants.
    Open,
    /// Open, but the role does not exist: nobody can enqueue until the DBA
    /// creates it (and relay registers again).
    RoleMissing,
    /// Closed: the deployment takes nothing from applications.
    Closed,
}

/// Write `door` for `consumer` (or close it, with `None`), in one
/// transaction; the same registration twice changes nothing. Concurrent
/// starts of one deployment serialize on the front door's row.
pub async fn register(pool: &PgPool, consumer: &str, door: Option<&FrontDoor>) -> Result<Registered, sqlx::Error> {
    let mut tx = pool.begin().await?;
    // Two deployments registering at once would GRANT on the same functions,
    // and concurrent GRANTs fail ("tuple concurrently updated").
    sqlx::query("SELECT pg_advisory_xact_lock(1380273155, 0)").execute(&mut *tx).await?;
    let Some(door) = door else {
        sqlx::query("DELETE FROM relay.app_front_doors WHERE consumer = $1").bind(consumer).execute(&mut *tx).await?;
        tx.commit().await?;
        return Ok(Registered::Closed);
    };
    sqlx::query(
        "INSERT INTO relay.app_front_doors (consumer, source, max_payload_bytes) VALUES ($1, $2, $3)
         ON CONFLICT (consumer) DO UPDATE SET source = $2, max_payload_bytes = $3, registered_at = now()",
    )
    .bind(consumer)
    .bind(&door.source)
    .bind(door.max_payload_bytes)
    .execute(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM relay.app_topics WHERE consumer = $1").bind(consumer).execute(&mut *tx).await?;
    sqlx::query("INSERT INTO relay.app_topics (consumer, topic) SELECT $1, unnest($2::text[]) ON CONFLICT DO NOTHING")
        .bind(consumer)
        .bind(&door.topics)
        .execute(&mut *tx)
        .await?;
    sqlx::query("DELETE FROM relay.app_endpoints WHERE consumer = $1").bind(consumer).execute(&mut *tx).await?;
    for e in &door.endpoints {
        sqlx::query(
            "INSERT INTO relay.app_endpoints
                    (consumer, endpoint, max_attempts, max_age, key_max_length, key_in_body, sends_key)
             VALUES ($1, $2, $3, make_interval(secs => $4), $5, $6, $7)",
        )
        .bind(consumer)
        .bind(&e.name)
        .bind(e.max_attempts)
        .bind(e.max_age_secs)
        .bind(e.key_max_length)
        .bind(e.key_in_body)
        .bind(e.sends_key)
        .execute(&mut *tx)
        .await?;
    }
    let role_exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)")
        .bind(&door.role)
        .fetch_one(&mut *tx)
        .await?;
    if role_exists {
        // GRANT takes no parameters; the name is quoted as an identifier.
        let role = quote_ident(&door.role);
        sqlx::query(&format!("GRANT USAGE ON SCHEMA relay TO {role}")).execute(&mut *tx).await?;
        sqlx::query(&format!(
            "GRANT EXECUTE ON FUNCTION
                 relay.publish(text, text, text, jsonb, text, jsonb, boolean, text, text, text, text, text),
                 relay.call(text, text, text, jsonb, text, text, text, jsonb, jsonb, jsonb, text, text, text, text)
             TO {role}"
        ))
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(if role_exists { Registered::Open } else { Registered::RoleMissing })
}

/// `name` as a PostgreSQL identifier, quoted.
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
