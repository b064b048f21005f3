//! The front door for applications (`relay.publish`, `relay.call`,
//! migrations 0027, 0028 and 0029): what a deployment takes from them, written from its
//! `[application]` section so the functions check it in the caller's
//! transaction, and the grants of the enqueue role.

use sqlx::PgPool;

/// One endpoint as applications may call it: its budget and key rules.
#[derive(Debug, Clone, PartialEq)]
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
    /// Request headers relay sets on this endpoint's calls, which
    /// applications may not (lower-case; a trailing `*` is a prefix).
    pub reserved_headers: Vec<String>,
}

/// What deployment `consumer` takes from applications.
#[derive(Debug, Clone, PartialEq)]
pub struct FrontDoor {
    /// CloudEvents source of their events.
    pub source: String,
    /// The largest payload accepted.
    pub max_payload_bytes: i32,
    /// Topics they may publish to.
    pub topics: Vec<String>,
    /// Endpoints they may call.
    pub endpoints: Vec<Endpoint>,
    /// Saga types their calls' outcomes may move.
    pub sagas: Vec<String>,
    /// The role that may enqueue: callers must be its members.
    pub role: String,
}

impl FrontDoor {
    /// The same door in the order the database lists it, so that two
    /// registrations compare equal when they register the same thing.
    fn normalized(&self) -> FrontDoor {
        let mut door = self.clone();
        for list in [&mut door.topics, &mut door.sagas] {
            list.sort();
            list.dedup();
        }
        door.endpoints.sort_by(|a, b| a.name.cmp(&b.name));
        door.endpoints.dedup_by(|a, b| a.name == b.name);
        for e in &mut door.endpoints {
            e.reserved_headers.sort();
            e.reserved_headers.dedup();
            // The database keeps microseconds.
            e.max_age_secs = (e.max_age_secs * 1e6).round() / 1e6;
        }
        door
    }
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
    /// Registered as configured, but the role lacks its grants and this
    /// relay's role may not give them (it does not own the functions):
    /// nobody can enqueue until `relay migrate` runs as the owner. Narrower
    /// than configured, so a start goes on.
    Ungranted,
}

impl Registered {
    /// Why no application can enqueue through a door registered so, and
    /// what to do, for the log of a start and the output of `relay migrate`.
    pub fn closed_because(&self, role: &str) -> Option<String> {
        match self {
            Registered::RoleMissing => Some(format!(
                "[application]: role {role:?} does not exist, so no application can enqueue yet: create it \
                 (CREATE ROLE {role} NOLOGIN; GRANT {role} TO your_app_user) and run `relay migrate` again"
            )),
            Registered::Ungranted => Some(format!(
                "[application]: role {role:?} lacks EXECUTE on relay.publish and relay.call, and this relay's role \
                 may not grant it, so no application can enqueue yet: run `relay migrate` as the role that owns \
                 relay's schema"
            )),
            Registered::Open | Registered::Closed => None,
        }
    }
}

/// The signatures the enqueue role gets EXECUTE on.
const FUNCTIONS: [&str; 2] = [
    "relay.publish(text, text, text, jsonb, text, jsonb, boolean, text, text, text, text, text)",
    "relay.call(text, text, text, jsonb, text, text, text, jsonb, jsonb, jsonb, text, text, text, text)",
];

/// The door registered for `consumer`, if any.
pub async fn registered(pool: &PgPool, consumer: &str) -> Result<Option<FrontDoor>, sqlx::Error> {
    // A door an older relay registered has no role: it never equals one
    // this relay would write.
    let Some((source, max_payload_bytes, role)) = sqlx::query_as::<_, (String, i32, String)>(
        "SELECT source, max_payload_bytes, coalesce(role, '') FROM relay.app_front_doors WHERE consumer = $1",
    )
    .bind(consumer)
    .fetch_optional(pool)
    .await?
    else {
        return Ok(None);
    };
    let topics = sqlx::query_scalar("SELECT topic FROM relay.app_topics WHERE consumer = $1 ORDER BY topic")
        .bind(consumer)
        .fetch_all(pool)
        .await?;
    let sagas = sqlx::query_scalar("SELECT saga_type FROM relay.app_sagas WHERE consumer = $1 ORDER BY saga_type")
        .bind(consumer)
        .fetch_all(pool)
        .await?;
    type Row = (String, i32, f64, Option<i32>, bool, bool, Vec<String>);
    let endpoints = sqlx::query_as::<_, Row>(
        "SELECT endpoint, max_attempts, extract(epoch FROM max_age)::float8, key_max_length, key_in_body,
                sends_key, coalesce(reserved_headers, '{}')
           FROM relay.app_endpoints WHERE consumer = $1 ORDER BY endpoint",
    )
    .bind(consumer)
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(|(name, max_attempts, max_age_secs, key_max_length, key_in_body, sends_key, reserved_headers)| Endpoint {
        name,
        max_attempts,
        max_age_secs,
        key_max_length,
        key_in_body,
        sends_key,
        reserved_headers,
    })
    .collect();
    Ok(Some(FrontDoor { source, max_payload_bytes, topics, endpoints, sagas, role }))
}

/// Whether `role` exists, and has what registration grants it.
async fn role_state(pool: &PgPool, role: &str) -> Result<(bool, bool), sqlx::Error> {
    sqlx::query_as(
        "SELECT r.oid IS NOT NULL,
                r.oid IS NOT NULL AND has_schema_privilege(r.oid, 'relay', 'USAGE')
                    AND has_function_privilege(r.oid, $2, 'EXECUTE') AND has_function_privilege(r.oid, $3, 'EXECUTE')
           FROM (SELECT 1) one LEFT JOIN pg_roles r ON r.rolname = $1",
    )
    .bind(role)
    .bind(FUNCTIONS[0])
    .bind(FUNCTIONS[1])
    .fetch_one(pool)
    .await
}

/// Write `door` for `consumer` (or close it, with `None`), in one
/// transaction. What is registered already, with its grants, is left alone,
/// so every start of an unchanged deployment only reads; a role given up
/// (changed, or the door closed) loses its grants unless another
/// deployment's door still names it.
pub async fn register(pool: &PgPool, consumer: &str, door: Option<&FrontDoor>) -> Result<Registered, sqlx::Error> {
    let door = door.map(FrontDoor::normalized);
    let current = registered(pool, consumer).await?;
    let (role_exists, granted) = match &door {
        Some(d) => role_state(pool, &d.role).await?,
        None => (false, false),
    };
    let outcome = match &door {
        None => Registered::Closed,
        Some(_) if role_exists => Registered::Open,
        Some(_) => Registered::RoleMissing,
    };
    if current == door && (granted || !role_exists) {
        return Ok(outcome);
    }
    let only_grants = current == door;
    match write_and_grant(pool, consumer, door.as_ref(), role_exists).await {
        Err(sqlx::Error::Database(e)) if only_grants && e.code().as_deref() == Some("42501") => {
            return Ok(Registered::Ungranted);
        }
        Err(e) => return Err(e),
        Ok(()) => {}
    }
    // A GRANT by a role that may not give the privilege only warns.
    match &door {
        Some(d) if role_exists && !role_state(pool, &d.role).await?.1 => Ok(Registered::Ungranted),
        _ => Ok(outcome),
    }
}

/// The writes and grants of [`register`], in one transaction.
async fn write_and_grant(
    pool: &PgPool,
    consumer: &str,
    door: Option<&FrontDoor>,
    role_exists: bool,
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    // A deployment still starting elsewhere waits a while, not forever.
    sqlx::query("SET LOCAL lock_timeout = '10s'").execute(&mut *tx).await?;
    // Two deployments registering at once would GRANT on the same functions,
    // and concurrent GRANTs fail ("tuple concurrently updated").
    crate::ordering::lock_singleton(&mut tx, crate::ordering::Singleton::Registration).await?;
    // The role registered now, read again under the lock: another start may
    // have changed it since the read above.
    let held: Option<Option<String>> =
        sqlx::query_scalar("SELECT role FROM relay.app_front_doors WHERE consumer = $1 FOR UPDATE")
            .bind(consumer)
            .fetch_optional(&mut *tx)
            .await?;
    let given_up = held.flatten().filter(|r| door.as_ref().is_none_or(|d| d.role != *r));
    match &door {
        None => {
            sqlx::query("DELETE FROM relay.app_front_doors WHERE consumer = $1")
                .bind(consumer)
                .execute(&mut *tx)
                .await?;
        }
        Some(door) => write(&mut tx, consumer, door).await?,
    }
    if let Some(role) = given_up {
        let unused: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)
                AND NOT EXISTS (SELECT 1 FROM relay.app_front_doors WHERE role = $1)",
        )
        .bind(&role)
        .fetch_one(&mut *tx)
        .await?;
        if unused {
            let role = quote_ident(&role);
            sqlx::query(&format!("REVOKE EXECUTE ON FUNCTION {} FROM {role}", FUNCTIONS.join(", ")))
                .execute(&mut *tx)
                .await?;
            sqlx::query(&format!("REVOKE USAGE ON SCHEMA relay FROM {role}")).execute(&mut *tx).await?;
        }
    }
    if let (Some(door), true) = (door, role_exists) {
        // GRANT takes no parameters; the name is quoted as an identifier.
        let role = quote_ident(&door.role);
        sqlx::query(&format!("GRANT USAGE ON SCHEMA relay TO {role}")).execute(&mut *tx).await?;
        sqlx::query(&format!("GRANT EXECUTE ON FUNCTION {} TO {role}", FUNCTIONS.join(", "))).execute(&mut *tx).await?;
    }
    tx.commit().await
}

/// The rows of `door`, replacing what `consumer` had.
async fn write(tx: &mut sqlx::PgConnection, consumer: &str, door: &FrontDoor) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO relay.app_front_doors (consumer, source, max_payload_bytes, role) VALUES ($1, $2, $3, $4)
         ON CONFLICT (consumer) DO UPDATE SET source = $2, max_payload_bytes = $3, role = $4, registered_at = now()",
    )
    .bind(consumer)
    .bind(&door.source)
    .bind(door.max_payload_bytes)
    .bind(&door.role)
    .execute(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM relay.app_topics WHERE consumer = $1").bind(consumer).execute(&mut *tx).await?;
    sqlx::query("INSERT INTO relay.app_topics (consumer, topic) SELECT $1, unnest($2::text[]) ON CONFLICT DO NOTHING")
        .bind(consumer)
        .bind(&door.topics)
        .execute(&mut *tx)
        .await?;
    sqlx::query("DELETE FROM relay.app_sagas WHERE consumer = $1").bind(consumer).execute(&mut *tx).await?;
    sqlx::query(
        "INSERT INTO relay.app_sagas (consumer, saga_type) SELECT $1, unnest($2::text[]) ON CONFLICT DO NOTHING",
    )
    .bind(consumer)
    .bind(&door.sagas)
    .execute(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM relay.app_endpoints WHERE consumer = $1").bind(consumer).execute(&mut *tx).await?;
    for e in &door.endpoints {
        sqlx::query(
            "INSERT INTO relay.app_endpoints (consumer, endpoint, max_attempts, max_age, key_max_length,
                                              key_in_body, sends_key, reserved_headers)
             VALUES ($1, $2, $3, make_interval(secs => $4), $5, $6, $7, $8)",
        )
        .bind(consumer)
        .bind(&e.name)
        .bind(e.max_attempts)
        .bind(e.max_age_secs)
        .bind(e.key_max_length)
        .bind(e.key_in_body)
        .bind(e.sends_key)
        .bind(&e.reserved_headers)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

/// `name` as a PostgreSQL identifier, quoted.
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
