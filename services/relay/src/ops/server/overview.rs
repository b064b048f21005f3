//! `/api/counts`: rows of every table by state, and what is paused.

use axum::Json;
use axum::extract::State;
use serde_json::json;

use super::{ApiResult, Shared};

#[utoipa::path(
    get,
    path = "/api/counts",
    tag = "overview",
    summary = "Rows of every table by state, and what is paused",
    responses(
        (status = 200, description = "Counts", body = Object, example = json!({"stats": {"inbox": 120, "intents": {"pending": 2, "dead": 1}, "outbox": {"pending": 0}, "dead_letters": {"unresolved": 3}}, "estimated": [], "pauses": []})),
    )
)]
pub(super) async fn counts(State(s): State<Shared>) -> ApiResult {
    Ok(Json(json!(s.operator.counts().await?)))
}
