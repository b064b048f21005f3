//! `/api/counts`: rows of every table by state, and what is paused.

use axum::Json;
use axum::extract::State;

use super::{ApiResult, Shared};
use crate::ops::admin::Counts;

#[utoipa::path(
    get,
    path = "/api/counts",
    tag = "overview",
    summary = "Rows of every table by state, and what is paused",
    responses(
        (status = 200, description = "Counts", body = Counts),
    )
)]
pub(super) async fn counts(State(s): State<Shared>) -> ApiResult<Counts> {
    Ok(Json(s.operator.counts().await?))
}
