//! Handlers registered in code, for logic a declarative route cannot say.
//!
//! A handler runs inside the event's database transaction (a savepoint of
//! it), may read and write the application's own tables through the
//! connection it is given, and returns the calls and events to make. It is
//! never given an HTTP client or a producer: the relay makes every external
//! call through an intent, after the transaction commits.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use relay_core::{InputEvent, Plan};
use sqlx::PgConnection;

/// Why a handler did not produce a plan.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Something the event refers to is not there yet (R19): retry the
    /// record with backoff, then park it.
    #[error("not yet: {0}")]
    NotYet(String),
    /// The event is permanently unacceptable: dead-letter it with this reason.
    #[error("rejected: {0}")]
    Reject(String),
    /// A database error. An outage (no connection, a conflict rolled back, a
    /// shutdown) retries the transaction; any other error (the handler's own
    /// SQL, a constraint) is this record's: it is dead-lettered naming the
    /// handler. A handler must return its statements' errors, never swallow
    /// them: PostgreSQL then refuses every later statement of the
    /// transaction, and the record is dead-lettered saying so.
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// A handler for one route (`handler = "name"` in the route).
///
/// ```no_run
/// use relay::{Handler, HandlerError, Handlers};
/// use relay_core::{CallSpec, InputEvent, Plan};
///
/// struct ReserveStock;
///
/// #[async_trait::async_trait]
/// impl Handler for ReserveStock {
///     async fn handle(&self, tx: &mut sqlx::PgConnection, event: &InputEvent) -> Result<Plan, HandlerError> {
///         let sku = event.data["sku"].as_str().ok_or_else(|| HandlerError::Reject("no sku".into()))?;
///         // A guarded write in the inbox transaction: zero rows means "not yet".
///         let done = sqlx::query("UPDATE stock SET reserved = reserved + 1 WHERE sku = $1 AND available > reserved")
///             .bind(sku)
///             .execute(&mut *tx)
///             .await?;
///         if done.rows_affected() == 0 {
///             // Reasons go to logs and the console: name fields, never quote values.
///             return Err(HandlerError::NotYet("no stock for this sku yet".into()));
///         }
///         // The call is made later by the dispatcher, with a stable idempotency key.
///         Ok(Plan {
///             calls: vec![CallSpec {
///                 action: "notify-warehouse".into(),
///                 endpoint: "warehouse".into(),
///                 method: "POST".into(),
///                 // Event data in a path: one encoded segment, as route templates do.
///                 path: format!("/reservations/{}", relay_core::path_segment(sku).ok_or_else(|| {
///                     HandlerError::Reject("sku cannot be a path segment".into())
///                 })?),
///                 body: Some(event.data.clone()),
///                 headers: Default::default(),
///                 idempotency_key: None, // the intent id
///                 ordering_key: Some(sku.to_owned()),
///                 fairness_key: None,
///                 on_success: Default::default(),
///                 on_dead: Default::default(),
///             }],
///             ..Plan::default()
///         })
///     }
/// }
///
/// let handlers = Handlers::default().register("reserve-stock", ReserveStock);
/// # let _ = handlers;
/// ```
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Apply `event` using `tx` (inside the inbox transaction) and return the
    /// calls and events it causes. Ids of returned calls and events are
    /// derived from (consumer, event id, action name): use stable action names.
    async fn handle(&self, tx: &mut PgConnection, event: &InputEvent) -> Result<Plan, HandlerError>;
}

/// Handlers by name.
#[derive(Clone, Default)]
pub struct Handlers {
    by_name: HashMap<String, Arc<dyn Handler>>,
}

impl std::fmt::Debug for Handlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.by_name.keys()).finish()
    }
}

impl Handlers {
    /// Register `handler` under `name`.
    pub fn register(mut self, name: impl Into<String>, handler: impl Handler) -> Handlers {
        self.by_name.insert(name.into(), Arc::new(handler));
        self
    }

    /// The handler named `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn Handler>> {
        self.by_name.get(name)
    }

    /// Names the configuration refers to that are not registered.
    pub fn missing<'a>(&self, wanted: impl Iterator<Item = &'a str>) -> Vec<String> {
        wanted.filter(|n| !self.by_name.contains_key(*n)).map(str::to_owned).collect()
    }
}

/// An action of `extra` whose derived id `route` (or `extra` itself)
/// already has: the same action name gets the same derived id, and the
/// second row would be dropped on insert without a word.
pub(crate) fn reused_action<'a>(
    route: &relay_core::effects::Effects,
    extra: &'a relay_core::effects::Effects,
) -> Option<&'a str> {
    let taken: std::collections::HashSet<uuid::Uuid> =
        route.intents.iter().map(|i| i.id).chain(route.events.iter().map(|e| e.id)).collect();
    let mut seen = std::collections::HashSet::new();
    extra
        .intents
        .iter()
        .map(|i| (i.id, i.intent.action.as_str()))
        .chain(extra.events.iter().map(|e| (e.id, e.action.as_str())))
        .find(|(id, _)| taken.contains(id) || !seen.insert(*id))
        .map(|(_, action)| action)
}
