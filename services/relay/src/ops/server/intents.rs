//! `/api/intents`: external calls — list, show, replay, resolve, skip.

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use relay_store::intents::IntentState;
use relay_store::intents::IntentView;
use serde::{Deserialize, Serialize};
use tracing::info;
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::schemas::{ErrorBody, intent_states};
use super::{ApiError, ApiResult, Shared};
use crate::ops::admin::{IntentHistory, IntentResolution, Intents, KeyWindow};

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct IntentQuery {
    /// Only intents in this state.
    #[param(schema_with = intent_states)]
    state: Option<String>,
    /// Only calls to this endpoint.
    endpoint: Option<String>,
    /// Only those created before this instant (RFC 3339): the next page.
    before: Option<chrono::DateTime<chrono::Utc>>,
    /// Page size, 1 to 1000 (default 100).
    limit: Option<i64>,
}

#[utoipa::path(
    get,
    path = "/api/intents",
    tag = "intents",
    summary = "Intents, newest first",
    params(IntentQuery),
    responses(
        (status = 200, description = "Intents", body = IntentPage),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
    )
)]
pub(super) async fn list_intents(State(s): State<Shared>, Query(q): Query<IntentQuery>) -> ApiResult<IntentPage> {
    let state = q
        .state
        .map(|st| st.parse::<IntentState>())
        .transpose()
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.to_string()))?;
    let items = s.operator.intents(state, q.endpoint, q.before, q.limit.unwrap_or(100).clamp(1, 1000)).await?;
    Ok(Json(IntentPage { items }))
}

pub(super) fn parse_id(id: &str) -> Result<uuid::Uuid, ApiError> {
    id.parse().map_err(|_| ApiError(StatusCode::BAD_REQUEST, format!("{id:?} is not an intent id (a UUID)")))
}

#[utoipa::path(
    get,
    path = "/api/intents/{id}",
    tag = "intents",
    summary = "One intent with its attempts, reconciliations and response",
    params(("id" = String, Path, description = "Intent id (a UUID)")),
    responses(
        (status = 200, description = "The intent", body = IntentHistory),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 404, description = "No such intent", body = ErrorBody),
    )
)]
pub(super) async fn show_intent(State(s): State<Shared>, Path(id): Path<String>) -> ApiResult<IntentHistory> {
    Ok(Json(s.operator.intent(parse_id(&id)?).await?))
}

#[derive(Deserialize, Default, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct ReplayQuery {
    /// Replay even if the attempts could outlive the provider's key window.
    #[serde(default)]
    past_key_window: bool,
}

#[utoipa::path(
    post,
    path = "/api/intents/{id}/replay",
    tag = "intents",
    summary = "Queue a dead intent again, with the same idempotency key",
    params(("id" = String, Path, description = "Intent id (a UUID)"), ReplayQuery),
    responses(
        (status = 200, description = "Queued", body = IntentRequeued),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 404, description = "No such intent", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
pub(super) async fn replay_intent(
    State(s): State<Shared>,
    Path(id): Path<String>,
    Query(q): Query<ReplayQuery>,
) -> ApiResult<IntentRequeued> {
    let id = parse_id(&id)?;
    s.operator.requeue(id, KeyWindow::past_allowed(q.past_key_window)).await?;
    Ok(Json(IntentRequeued { id, requeued: true }))
}

#[derive(Deserialize, ToSchema)]
pub(super) struct Resolve {
    /// What the provider did.
    resolution: crate::ops::admin::IntentResolution,
    /// Kept with the intent: who checked, where.
    note: Option<String>,
}

#[utoipa::path(
    post,
    path = "/api/intents/{id}/resolve",
    tag = "intents",
    summary = "Say what the provider did with an uncertain intent",
    params(("id" = String, Path, description = "Intent id (a UUID)")),
    request_body = Resolve,
    responses(
        (status = 200, description = "Resolved", body = IntentResolved),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 404, description = "No such intent", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
pub(super) async fn resolve_intent(
    State(s): State<Shared>,
    Path(id): Path<String>,
    Json(r): Json<Resolve>,
) -> ApiResult<IntentResolved> {
    let id = parse_id(&id)?;
    let effects_not_recorded = s.operator.resolve(id, r.resolution, r.note.as_deref()).await?;
    info!(intent_id = %id, resolution = ?r.resolution, "uncertain intent resolved through the admin API");
    Ok(Json(IntentResolved { id, resolved: r.resolution, effects_not_recorded }))
}

#[derive(Deserialize, ToSchema)]
pub(super) struct IntentBulk {
    /// These intents.
    #[serde(default)]
    ids: Vec<uuid::Uuid>,
    /// Every dead intent instead of `ids`.
    #[serde(default)]
    all: bool,
    /// With `all`: only this endpoint's.
    endpoint: Option<String>,
    /// Replay even if attempts could outlive the provider's idempotency-key window.
    #[serde(default)]
    past_key_window: bool,
}

#[utoipa::path(
    post,
    path = "/api/intents/replay",
    tag = "intents",
    summary = "Queue dead intents again, by id or all (of an endpoint)",
    request_body = IntentBulk,
    responses(
        (status = 200, description = "What was queued and what was not", body = IntentsRequeued),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
    )
)]
pub(super) async fn replay_intents(State(s): State<Shared>, Json(b): Json<IntentBulk>) -> ApiResult<IntentsRequeued> {
    let which = if b.all { Intents::Dead { endpoint: b.endpoint } } else { Intents::Ids(b.ids) };
    let done = s.operator.requeue_all(which, KeyWindow::past_allowed(b.past_key_window), |_| {}).await?;
    let not_replayed = done.not_replayed.into_iter().map(|(id, why)| NotReplayed { id, why }).collect();
    Ok(Json(IntentsRequeued { requeued: done.queued, asked: done.asked, refused: done.refused, not_replayed }))
}

#[utoipa::path(
    post,
    path = "/api/intents/{id}/skip",
    tag = "intents",
    summary = "Give up a dead intent, releasing the key it holds",
    params(("id" = String, Path, description = "Intent id (a UUID)")),
    responses(
        (status = 200, description = "Skipped", body = IntentSkipped),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 404, description = "No such intent", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
pub(super) async fn skip_intent(State(s): State<Shared>, Path(id): Path<String>) -> ApiResult<IntentSkipped> {
    let id = parse_id(&id)?;
    let (released_key, waiting) = s.operator.intent_skip(id).await?;
    info!(intent_id = %id, "dead intent skipped through the admin API");
    Ok(Json(IntentSkipped { id, released_key, waiting }))
}

/// A page of intents.
#[derive(Serialize, ToSchema)]
pub(super) struct IntentPage {
    /// Newest first.
    items: Vec<IntentView>,
}

/// A dead intent queued again.
#[derive(Serialize, ToSchema)]
pub(super) struct IntentRequeued {
    id: Uuid,
    requeued: bool,
}

/// An uncertain intent resolved by an operator.
#[derive(Serialize, ToSchema)]
pub(super) struct IntentResolved {
    id: Uuid,
    resolved: IntentResolution,
    /// Why the outcome's effects were not written, when they were not.
    effects_not_recorded: Option<String>,
}

/// What a bulk replay queued and what it did not.
#[derive(Serialize, ToSchema)]
pub(super) struct IntentsRequeued {
    requeued: usize,
    /// Intents asked for.
    asked: usize,
    /// Dead ones whose `on_dead` effects were recorded, left dead.
    refused: Vec<Uuid>,
    not_replayed: Vec<NotReplayed>,
}

/// A dead intent a bulk replay left, and why.
#[derive(Serialize, ToSchema)]
pub(super) struct NotReplayed {
    id: Uuid,
    why: String,
}

/// A dead intent given up, its key released.
#[derive(Serialize, ToSchema)]
pub(super) struct IntentSkipped {
    id: Uuid,
    /// The ordering key it held.
    released_key: String,
    /// Intents of that key waiting behind it, now free to run.
    waiting: i64,
}
