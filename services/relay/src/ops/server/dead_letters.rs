//! `/api/dead-letters` and `/api/held-keys`: records that could not be
//! applied, and the keys held behind them.

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use relay_store::dead_letters::Resolution;
use serde::Deserialize;
use serde_json::{Value, json};
use tracing::info;
use utoipa::{IntoParams, ToSchema};

use super::schemas::ErrorBody;
use super::{ApiError, ApiResult, AppState, Shared};
use crate::ops::admin::{DeadLetters, Released, ReplayOutcome, Replayed};

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct DeadLetterQuery {
    /// Only this error class (e.g. `bad_json`, `schema_invalid`).
    class: Option<String>,
    /// Only records of this topic.
    topic: Option<String>,
    /// Resolved ones too (default: unresolved only).
    #[serde(default)]
    all: bool,
    /// Ids above this one: the last id of the previous page.
    #[serde(default)]
    after: i64,
    /// Page size, 1 to 1000 (default 100).
    limit: Option<i64>,
}

#[utoipa::path(
    get,
    path = "/api/dead-letters",
    tag = "dead letters",
    summary = "Dead letters, oldest first, a page at a time",
    params(DeadLetterQuery),
    responses(
        (status = 200, description = "A page and the total matching", body = Object, example = json!({"items": [{"id": 7, "topic": "orders", "partition": 0, "offset": 42, "error_class": "bad_json", "reason": "…"}], "total": 1})),
    )
)]
pub(super) async fn list_dead_letters(State(s): State<Shared>, Query(q): Query<DeadLetterQuery>) -> ApiResult {
    let resolution = if q.all { Resolution::Any } else { Resolution::Unresolved };
    let f = s.operator.filter(q.class, q.topic, resolution);
    let items = s.operator.dead_letters(&f, q.after, q.limit.unwrap_or(100).clamp(1, 1000)).await?;
    let total = s.operator.count_dead_letters(&f).await?;
    Ok(Json(json!({"items": items, "total": total})))
}

#[utoipa::path(
    get,
    path = "/api/dead-letters/{id}",
    tag = "dead letters",
    summary = "One dead letter with its record (key, headers, value as text, first 64 KiB)",
    params(("id" = i64, Path, description = "Dead letter id")),
    responses(
        (status = 200, description = "The dead letter", body = Object, example = json!({"dead_letter": {"id": 7, "error_class": "bad_json"}, "key": "o-1", "headers": [{"name": "ce_type", "value": "order.placed"}], "value": "{…"})),
        (status = 404, description = "No such dead letter", body = ErrorBody),
    )
)]
pub(super) async fn show_dead_letter(State(s): State<Shared>, Path(id): Path<i64>) -> ApiResult {
    let dl = s.operator.dead_letter(id).await?;
    let text =
        |b: &Option<Vec<u8>>| b.as_deref().map(|v| String::from_utf8_lossy(&v[..v.len().min(64 * 1024)]).into_owned());
    let hdrs: Vec<Value> = dl
        .record
        .headers
        .iter()
        .map(|h| json!({"name": h.name, "value": h.value.as_deref().map(String::from_utf8_lossy)}))
        .collect();
    Ok(Json(
        json!({"dead_letter": dl.meta, "key": text(&dl.record.key), "headers": hdrs, "value": text(&dl.record.payload)}),
    ))
}

pub(super) fn outcome_json(id: i64, r: &Replayed) -> Value {
    let (outcome, detail) = r.outcome.label();
    let released = r.released.as_ref().map(released_json);
    json!({"id": id, "outcome": outcome, "detail": detail, "resolved": r.outcome.resolved(), "released": released})
}

pub(super) fn released_json(r: &Released) -> Value {
    json!({"key": relay_store::holds::preview(&r.key), "replayed": r.replayed, "held_behind": r.held_behind,
           "detail": r.describe()})
}

#[utoipa::path(
    post,
    path = "/api/dead-letters/{id}/replay",
    tag = "dead letters",
    summary = "Process a dead letter again, as the consumer would",
    params(("id" = i64, Path, description = "Dead letter id")),
    responses(
        (status = 200, description = "What the replay did", body = Object, example = json!({"id": 7, "outcome": "applied", "detail": "", "resolved": true, "released": null})),
        (status = 404, description = "No such dead letter", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
pub(super) async fn replay_dead_letter(State(s): State<Shared>, Path(id): Path<i64>) -> ApiResult {
    let r = s.operator.replay_releasing(&s.processor, id).await?;
    match r.outcome {
        ReplayOutcome::NotFound => Err(ApiError(StatusCode::NOT_FOUND, format!("no dead letter {id}"))),
        _ => Ok(Json(outcome_json(id, &r))),
    }
}

#[utoipa::path(
    post,
    path = "/api/dead-letters/{id}/skip",
    tag = "dead letters",
    summary = "Resolve a dead letter without applying it, releasing what waits behind it",
    params(("id" = i64, Path, description = "Dead letter id")),
    responses(
        (status = 200, description = "Skipped", body = Object, example = json!({"id": 7, "skipped": true, "released": {"key": "o-1", "replayed": 2, "held_behind": 0, "detail": "…"}})),
        (status = 404, description = "No such dead letter", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
pub(super) async fn skip_dead_letter(State(s): State<Shared>, Path(id): Path<i64>) -> ApiResult {
    let released = s.operator.skip_dead_letter(&s.processor, id).await?;
    info!(dead_letter = id, "dead letter skipped through the admin API");
    Ok(Json(json!({"id": id, "skipped": true, "released": released_json(&released)})))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct HeldKeysQuery {
    /// At most this many, 1 to 1000 (default 200).
    limit: Option<i64>,
}

#[utoipa::path(
    get,
    path = "/api/held-keys",
    tag = "dead letters",
    summary = "Keys held behind a dead letter (routes with on_poison = hold_key)",
    params(HeldKeysQuery),
    responses(
        (status = 200, description = "Held keys", body = Object, example = json!({"held_keys": [{"topic": "orders", "partition": 0, "key": "o-1", "dead_letter_id": 7, "waiting": 3}]})),
    )
)]
pub(super) async fn held_keys(State(s): State<Shared>, Query(q): Query<HeldKeysQuery>) -> ApiResult {
    let rows = s.operator.held_keys(q.limit.unwrap_or(200).clamp(1, 1000)).await?;
    Ok(Json(json!({"held_keys": rows})))
}

#[derive(Deserialize, ToSchema)]
pub(super) struct Bulk {
    /// These dead letters.
    #[serde(default)]
    ids: Vec<i64>,
    /// Every matching one instead of `ids`.
    #[serde(default)]
    all: bool,
    /// With `all`: only this error class.
    class: Option<String>,
    /// Purge: only resolved ones.
    #[serde(default)]
    resolved: bool,
}

impl Bulk {
    /// The dead letters a bulk request names: its ids, or all of `resolution` (of its class).
    fn select(self, s: &AppState, resolution: Resolution) -> DeadLetters {
        if self.all {
            DeadLetters::Matching(s.operator.filter(self.class, None, resolution))
        } else {
            DeadLetters::Ids(self.ids)
        }
    }
}

#[utoipa::path(
    post,
    path = "/api/dead-letters/replay",
    tag = "dead letters",
    summary = "Replay dead letters by id, or all unresolved ones (of a class)",
    request_body = Bulk,
    responses(
        (status = 200, description = "One result per dead letter", body = Object, example = json!({"results": [{"id": 7, "outcome": "applied", "detail": "", "resolved": true, "released": null}], "resolved": 1})),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
    )
)]
pub(super) async fn replay_dead_letters(State(s): State<Shared>, Json(b): Json<Bulk>) -> ApiResult {
    let which = b.select(&s, Resolution::Unresolved);
    let done = s.operator.replay_all(&s.processor, which, |_, _, _, _| {}).await?;
    let results: Vec<Value> = done.iter().map(|(id, o)| outcome_json(*id, o)).collect();
    let resolved = done.iter().filter(|(_, r)| r.outcome.resolved()).count();
    Ok(Json(json!({"results": results, "resolved": resolved})))
}

#[utoipa::path(
    delete,
    path = "/api/dead-letters/{id}",
    tag = "dead letters",
    summary = "Delete a resolved dead letter",
    params(("id" = i64, Path, description = "Dead letter id")),
    responses(
        (status = 200, description = "Deleted", body = Object, example = json!({"deleted": 1})),
        (status = 404, description = "No such dead letter", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
pub(super) async fn delete_dead_letter(State(s): State<Shared>, Path(id): Path<i64>) -> ApiResult {
    s.operator.delete_dead_letter(id).await?;
    Ok(Json(json!({"deleted": 1})))
}

#[utoipa::path(
    post,
    path = "/api/dead-letters/purge",
    tag = "dead letters",
    summary = "Delete dead letters by id, or all (resolved ones, of a class)",
    request_body = Bulk,
    responses(
        (status = 200, description = "How many were deleted", body = Object, example = json!({"deleted": 12})),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
pub(super) async fn purge_dead_letters(State(s): State<Shared>, Json(b): Json<Bulk>) -> ApiResult {
    let resolution = if b.resolved { Resolution::Resolved } else { Resolution::Any };
    let deleted = s.operator.purge(b.select(&s, resolution), |_| {}).await?;
    Ok(Json(json!({"deleted": deleted})))
}
