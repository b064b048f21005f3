//! `/api/outbox`: events to publish — list, show, replay, skip.

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use relay_store::outbox::OutboxView;
use serde::{Deserialize, Serialize};
use tracing::info;
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::schemas::{ErrorBody, outbox_states};
use super::{ApiError, ApiResult, Shared};

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct OutboxQuery {
    /// Only rows in this state.
    #[param(schema_with = outbox_states)]
    state: Option<String>,
    /// Only rows for this topic.
    topic: Option<String>,
    /// Only those created before this instant (RFC 3339): the next page.
    before: Option<chrono::DateTime<chrono::Utc>>,
    /// Page size, 1 to 1000 (default 100).
    limit: Option<i64>,
}

#[utoipa::path(
    get,
    path = "/api/outbox",
    tag = "outbox",
    summary = "Outbox rows, newest first",
    params(OutboxQuery),
    responses(
        (status = 200, description = "Rows", body = OutboxPage),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
    )
)]
pub(super) async fn list_outbox(State(s): State<Shared>, Query(q): Query<OutboxQuery>) -> ApiResult<OutboxPage> {
    let state = q
        .state
        .map(|st| st.parse::<relay_store::outbox::OutboxState>())
        .transpose()
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.to_string()))?;
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let items = s.operator.outbox_rows(state, q.topic.as_deref(), q.before, limit).await?;
    Ok(Json(OutboxPage { items }))
}

pub(super) fn parse_outbox_id(id: &str) -> Result<uuid::Uuid, ApiError> {
    id.parse().map_err(|_| ApiError(StatusCode::BAD_REQUEST, format!("{id:?} is not an outbox row id (a UUID)")))
}

#[utoipa::path(
    get,
    path = "/api/outbox/{id}",
    tag = "outbox",
    summary = "One outbox row",
    params(("id" = String, Path, description = "Outbox row id (a UUID)")),
    responses(
        (status = 200, description = "The row", body = OutboxShown),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 404, description = "No such outbox row", body = ErrorBody),
    )
)]
pub(super) async fn show_outbox(State(s): State<Shared>, Path(id): Path<String>) -> ApiResult<OutboxShown> {
    Ok(Json(OutboxShown { row: s.operator.outbox_row(parse_outbox_id(&id)?).await? }))
}

#[utoipa::path(
    post,
    path = "/api/outbox/{id}/replay",
    tag = "outbox",
    summary = "Queue a dead outbox row again",
    params(("id" = String, Path, description = "Outbox row id (a UUID)")),
    responses(
        (status = 200, description = "Queued", body = OutboxActed),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 404, description = "No such outbox row", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
pub(super) async fn replay_outbox(State(s): State<Shared>, Path(id): Path<String>) -> ApiResult<OutboxActed> {
    let id = parse_outbox_id(&id)?;
    s.operator.outbox_replay(id).await?;
    info!(outbox_id = %id, "dead outbox row queued again through the admin API");
    Ok(Json(OutboxActed { id, requeued: Some(true), skipped: None }))
}

#[utoipa::path(
    post,
    path = "/api/outbox/{id}/skip",
    tag = "outbox",
    summary = "Give up a dead outbox row",
    params(("id" = String, Path, description = "Outbox row id (a UUID)")),
    responses(
        (status = 200, description = "Skipped", body = OutboxActed),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 404, description = "No such outbox row", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
pub(super) async fn skip_outbox(State(s): State<Shared>, Path(id): Path<String>) -> ApiResult<OutboxActed> {
    let id = parse_outbox_id(&id)?;
    s.operator.outbox_skip(id).await?;
    info!(outbox_id = %id, "dead outbox row skipped through the admin API");
    Ok(Json(OutboxActed { id, requeued: None, skipped: Some(true) }))
}

/// A page of outbox rows.
#[derive(Serialize, ToSchema)]
pub(super) struct OutboxPage {
    /// Newest first.
    items: Vec<OutboxView>,
}

/// One outbox row.
#[derive(Serialize, ToSchema)]
pub(super) struct OutboxShown {
    row: OutboxView,
}

/// A dead outbox row queued again (`requeued`) or given up (`skipped`).
#[derive(Serialize, ToSchema)]
pub(super) struct OutboxActed {
    id: Uuid,
    #[serde(skip_serializing_if = "Option::is_none")]
    requeued: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    skipped: Option<bool>,
}
