//! `/api/pauses`: routes and endpoints held on purpose.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use relay_store::ops::{Pause, PauseKind, Paused, Resumed};
use serde::{Deserialize, Serialize};
use tracing::info;
use utoipa::ToSchema;

use super::schemas::{ErrorBody, pause_kinds};
use super::{ApiError, ApiResult, Shared};

#[utoipa::path(
    get,
    path = "/api/pauses",
    tag = "pauses",
    summary = "What is paused",
    responses(
        (status = 200, description = "Pauses", body = Pauses),
    )
)]
pub(super) async fn list_pauses(State(s): State<Shared>) -> ApiResult<Pauses> {
    Ok(Json(Pauses { pauses: s.operator.pauses().await? }))
}

#[derive(Deserialize, ToSchema)]
pub(super) struct PauseRequest {
    /// What to pause.
    #[schema(schema_with = pause_kinds)]
    kind: PauseKind,
    /// The route's or endpoint's name in the configuration.
    name: String,
    /// Shown with the pause.
    reason: Option<String>,
}

#[utoipa::path(
    post,
    path = "/api/pauses",
    tag = "pauses",
    summary = "Pause a route or an endpoint",
    request_body = PauseRequest,
    responses(
        (status = 200, description = "Paused (already: it was)", body = PauseTaken),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 404, description = "No such route or endpoint", body = ErrorBody),
    )
)]
pub(super) async fn pause(State(s): State<Shared>, Json(p): Json<PauseRequest>) -> ApiResult<PauseTaken> {
    let done = s.operator.pause(p.kind, &p.name, p.reason.as_deref()).await?;
    info!(kind = p.kind.as_str(), name = %p.name, "paused through the admin API");
    Ok(Json(PauseTaken { paused: true, already: done == Paused::AlreadyPaused }))
}

#[utoipa::path(
    delete,
    path = "/api/pauses/{kind}/{name}",
    tag = "pauses",
    summary = "Resume a route or an endpoint",
    params(("kind" = String, Path, description = "route or endpoint"), ("name" = String, Path, description = "Name of the route or endpoint")),
    responses(
        (status = 200, description = "Resumed (false: it was not paused)", body = PauseEnded),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
    )
)]
pub(super) async fn resume(
    State(s): State<Shared>,
    Path((kind, name)): Path<(String, String)>,
) -> ApiResult<PauseEnded> {
    let kind = kind.parse::<PauseKind>().map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.to_string()))?;
    let done = s.operator.resume(kind, &name).await?;
    info!(kind = kind.as_str(), %name, "resumed through the admin API");
    Ok(Json(PauseEnded { resumed: done == Resumed::Resumed }))
}

/// What is paused.
#[derive(Serialize, ToSchema)]
pub(super) struct Pauses {
    pauses: Vec<Pause>,
}

/// A pause taken.
#[derive(Serialize, ToSchema)]
pub(super) struct PauseTaken {
    paused: bool,
    /// It was paused already.
    already: bool,
}

/// A pause ended (`false`: there was none).
#[derive(Serialize, ToSchema)]
pub(super) struct PauseEnded {
    resumed: bool,
}
