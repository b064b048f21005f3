//! `/api/dead-letters` and `/api/held-keys`: records that could not be
//! applied, and the keys held behind them.

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use relay_core::PoisonClass;
use relay_store::dead_letters::DeadLetter;
use relay_store::dead_letters::Resolution;
use relay_store::holds::HeldKey;
use serde::{Deserialize, Serialize};
use tracing::info;
use utoipa::{IntoParams, ToSchema};

use super::schemas::{ErrorBody, poison_classes};
use super::{ApiError, ApiResult, AppState, Shared};
use crate::ops::admin::{DeadLetters, Released, ReplayOutcome, Replayed};

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct DeadLetterQuery {
    /// Only this error class (e.g. `bad_json`, `schema_invalid`).
    #[param(schema_with = poison_classes)]
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
        (status = 200, description = "A page and the total matching", body = DeadLetterPage),
    )
)]
pub(super) async fn list_dead_letters(
    State(s): State<Shared>,
    Query(q): Query<DeadLetterQuery>,
) -> ApiResult<DeadLetterPage> {
    let resolution = if q.all { Resolution::Any } else { Resolution::Unresolved };
    let f = s.operator.filter(parse_class(q.class)?, q.topic, resolution);
    let items = s.operator.dead_letters(&f, q.after, q.limit.unwrap_or(100).clamp(1, 1000)).await?;
    let total = s.operator.count_dead_letters(&f).await?;
    Ok(Json(DeadLetterPage { items, total }))
}

#[utoipa::path(
    get,
    path = "/api/dead-letters/{id}",
    tag = "dead letters",
    summary = "One dead letter with its record (key, headers, value as text, first 64 KiB)",
    params(("id" = i64, Path, description = "Dead letter id")),
    responses(
        (status = 200, description = "The dead letter", body = DeadLetterShown),
        (status = 404, description = "No such dead letter", body = ErrorBody),
    )
)]
pub(super) async fn show_dead_letter(State(s): State<Shared>, Path(id): Path<i64>) -> ApiResult<DeadLetterShown> {
    let dl = s.operator.dead_letter(id).await?;
    let text =
        |b: &Option<Vec<u8>>| b.as_deref().map(|v| String::from_utf8_lossy(&v[..v.len().min(64 * 1024)]).into_owned());
    let headers = dl
        .record
        .headers
        .iter()
        .map(|h| HeaderText {
            name: h.name.clone(),
            value: h.value.as_deref().map(|v| String::from_utf8_lossy(v).into_owned()),
        })
        .collect();
    Ok(Json(DeadLetterShown {
        key: text(&dl.record.key),
        headers,
        value: text(&dl.record.payload),
        dead_letter: dl.meta,
    }))
}

#[utoipa::path(
    post,
    path = "/api/dead-letters/{id}/replay",
    tag = "dead letters",
    summary = "Process a dead letter again, as the consumer would",
    params(("id" = i64, Path, description = "Dead letter id")),
    responses(
        (status = 200, description = "What the replay did", body = ReplayAnswer),
        (status = 404, description = "No such dead letter", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
pub(super) async fn replay_dead_letter(State(s): State<Shared>, Path(id): Path<i64>) -> ApiResult<ReplayAnswer> {
    let r = s.operator.replay_releasing(&s.processor, id).await?;
    match r.outcome {
        ReplayOutcome::NotFound => Err(ApiError(StatusCode::NOT_FOUND, format!("no dead letter {id}"))),
        _ => Ok(Json(ReplayAnswer::new(id, &r))),
    }
}

#[utoipa::path(
    post,
    path = "/api/dead-letters/{id}/skip",
    tag = "dead letters",
    summary = "Resolve a dead letter without applying it, releasing what waits behind it",
    params(("id" = i64, Path, description = "Dead letter id")),
    responses(
        (status = 200, description = "Skipped", body = SkipAnswer),
        (status = 404, description = "No such dead letter", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
pub(super) async fn skip_dead_letter(State(s): State<Shared>, Path(id): Path<i64>) -> ApiResult<SkipAnswer> {
    let released = s.operator.skip_dead_letter(&s.processor, id).await?;
    info!(dead_letter = id, "dead letter skipped through the admin API");
    Ok(Json(SkipAnswer { id, skipped: true, released: ReleaseAnswer::from(&released) }))
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
        (status = 200, description = "Held keys", body = HeldKeys),
    )
)]
pub(super) async fn held_keys(State(s): State<Shared>, Query(q): Query<HeldKeysQuery>) -> ApiResult<HeldKeys> {
    let held_keys = s.operator.held_keys(q.limit.unwrap_or(200).clamp(1, 1000)).await?;
    Ok(Json(HeldKeys { held_keys }))
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
    #[schema(schema_with = poison_classes)]
    class: Option<String>,
    /// Purge: only resolved ones.
    #[serde(default)]
    resolved: bool,
}

impl Bulk {
    /// The dead letters a bulk request names: its ids, or all of `resolution` (of its class).
    fn select(self, s: &AppState, resolution: Resolution) -> Result<DeadLetters, ApiError> {
        Ok(if self.all {
            DeadLetters::Matching(s.operator.filter(parse_class(self.class)?, None, resolution))
        } else {
            DeadLetters::Ids(self.ids)
        })
    }
}

/// An error class named in a request, parsed (a 400 lists the known ones).
fn parse_class(class: Option<String>) -> Result<Option<PoisonClass>, ApiError> {
    class.map(|c| c.parse::<PoisonClass>()).transpose().map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.to_string()))
}

#[utoipa::path(
    post,
    path = "/api/dead-letters/replay",
    tag = "dead letters",
    summary = "Replay dead letters by id, or all unresolved ones (of a class)",
    request_body = Bulk,
    responses(
        (status = 200, description = "One result per dead letter", body = ReplayResults),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
    )
)]
pub(super) async fn replay_dead_letters(State(s): State<Shared>, Json(b): Json<Bulk>) -> ApiResult<ReplayResults> {
    let which = b.select(&s, Resolution::Unresolved)?;
    let done = s.operator.replay_all(&s.processor, which, |_, _, _, _| {}).await?;
    let results: Vec<ReplayAnswer> = done.iter().map(|(id, r)| ReplayAnswer::new(*id, r)).collect();
    let resolved = results.iter().filter(|r| r.resolved).count();
    Ok(Json(ReplayResults { results, resolved }))
}

#[utoipa::path(
    delete,
    path = "/api/dead-letters/{id}",
    tag = "dead letters",
    summary = "Delete a dead letter that holds no key (an open one is gone for good: its record was committed past)",
    params(("id" = i64, Path, description = "Dead letter id")),
    responses(
        (status = 200, description = "Deleted", body = Deleted),
        (status = 404, description = "No such dead letter", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
pub(super) async fn delete_dead_letter(State(s): State<Shared>, Path(id): Path<i64>) -> ApiResult<Deleted> {
    s.operator.delete_dead_letter(id).await?;
    Ok(Json(Deleted { deleted: 1 }))
}

#[utoipa::path(
    post,
    path = "/api/dead-letters/purge",
    tag = "dead letters",
    summary = "Delete dead letters by id, or all (resolved ones, of a class)",
    request_body = Bulk,
    responses(
        (status = 200, description = "How many were deleted", body = Deleted),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
pub(super) async fn purge_dead_letters(State(s): State<Shared>, Json(b): Json<Bulk>) -> ApiResult<Deleted> {
    let resolution = if b.resolved { Resolution::Resolved } else { Resolution::Any };
    let deleted = s.operator.purge(b.select(&s, resolution)?, |_| {}).await?;
    Ok(Json(Deleted { deleted }))
}

/// A page of dead letters.
#[derive(Serialize, ToSchema)]
pub(super) struct DeadLetterPage {
    /// Oldest first.
    items: Vec<DeadLetter>,
    /// How many match the filter, on every page.
    total: i64,
}

/// One dead letter with its record.
#[derive(Serialize, ToSchema)]
pub(super) struct DeadLetterShown {
    dead_letter: DeadLetter,
    /// The record's key as text (first 64 KiB).
    key: Option<String>,
    /// The record's headers, values as text.
    headers: Vec<HeaderText>,
    /// The record's value as text (first 64 KiB).
    value: Option<String>,
}

/// A record header, its value as text.
#[derive(Serialize, ToSchema)]
pub(super) struct HeaderText {
    name: String,
    value: Option<String>,
}

/// What a replay of one dead letter did.
#[derive(Serialize, ToSchema)]
pub(super) struct ReplayAnswer {
    id: i64,
    /// `applied`, `duplicate`, `no_op`, `still_failing`, `held`, `skipped` or `not_found`.
    outcome: String,
    /// What the outcome says besides its name (why it still fails, the no-op's class).
    detail: String,
    /// Whether the dead letter is resolved now.
    resolved: bool,
    /// The key it held, released, if it held one.
    released: Option<ReleaseAnswer>,
}

impl ReplayAnswer {
    fn new(id: i64, r: &Replayed) -> Self {
        let (outcome, detail) = r.outcome.label();
        ReplayAnswer {
            id,
            outcome: outcome.to_owned(),
            detail: detail.to_owned(),
            resolved: r.outcome.resolved(),
            released: r.released.as_ref().map(ReleaseAnswer::from),
        }
    }
}

/// A held key let go: its held records replayed in order.
#[derive(Serialize, ToSchema)]
pub(super) struct ReleaseAnswer {
    /// The Kafka record key, as text.
    key: String,
    /// Held records replayed.
    replayed: u64,
    /// The held record that failed in its turn and holds the key now.
    held_behind: Option<i64>,
    /// The release in words.
    detail: String,
}

impl From<&Released> for ReleaseAnswer {
    fn from(r: &Released) -> Self {
        ReleaseAnswer {
            key: relay_store::holds::preview(&r.key).into_owned(),
            replayed: r.replayed,
            held_behind: r.held_behind,
            detail: r.describe(),
        }
    }
}

/// A skip: the dead letter stays, marked skipped, and its key is released.
#[derive(Serialize, ToSchema)]
pub(super) struct SkipAnswer {
    id: i64,
    skipped: bool,
    released: ReleaseAnswer,
}

/// The held keys.
#[derive(Serialize, ToSchema)]
pub(super) struct HeldKeys {
    held_keys: Vec<HeldKey>,
}

/// The results of a bulk replay.
#[derive(Serialize, ToSchema)]
pub(super) struct ReplayResults {
    /// One per dead letter, in id order.
    results: Vec<ReplayAnswer>,
    /// How many are resolved now.
    resolved: usize,
}

/// How many dead letters were deleted.
#[derive(Serialize, ToSchema)]
pub(super) struct Deleted {
    deleted: u64,
}
