//! The admin HTTP server of a relay process (`[admin] listen`):
//!
//! * `GET /metrics` — Prometheus text format;
//! * `GET /healthz` — the process is up;
//! * `GET /readyz` — database reachable, migrations current, broker reachable
//!   (503 with the failing checks otherwise);
//! * `/api/…` — the JSON admin API, behind `Authorization: Bearer <token>`
//!   (the token comes from the environment variable `admin.token_env`);
//! * `/` — the web console, static files compiled into the binary, talking to
//!   the API from the browser (no build step, nothing fetched at run time).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use rdkafka::consumer::{BaseConsumer, Consumer};
use relay_core::RelayConfig;
use relay_store::dead_letters::Resolution;
use relay_store::intents::IntentState;
use relay_store::ops::{PauseKind, Paused, Resumed};
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::ingest::processor::Processor;
use crate::ops::admin::{DeadLetters, Intents, KeyWindow, Operator, OpsError, Released, ReplayOutcome, Replayed};
use crate::runtime::kafka::{Role, client_config};

const INDEX_HTML: &str = include_str!("../../console/index.html");
const APP_JS: &str = include_str!("../../console/app.js");
const STYLE_CSS: &str = include_str!("../../console/style.css");

struct AppState {
    operator: Operator,
    processor: Processor,
    token: Option<SecretString>,
    /// Where the token comes from, for the error when it is not set.
    token_env: String,
    metrics: PrometheusHandle,
    /// The latest readiness check ([`check_readiness`]), refreshed in the
    /// background: `/readyz` answers from it and never touches the database
    /// or the broker itself, so a flood of probes costs nothing.
    readiness: tokio::sync::watch::Receiver<Option<Readiness>>,
}

/// One readiness check's result.
#[derive(Debug, Clone)]
struct Readiness {
    at: std::time::Instant,
    ready: bool,
    checks: Value,
}

/// Connections the admin server's own pool may open: its API, gauges and
/// readiness checks share them, never the pool ingestion and dispatch use
/// (security review M5).
const ADMIN_CONNECTIONS: u32 = 2;
/// The shortest admin token accepted (security review L4).
const MIN_TOKEN_BYTES: usize = 16;
/// Connections served at once; more wait in the kernel's accept queue.
const MAX_CONNECTIONS: usize = 256;
/// A client must send its request's headers within this.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// A request must be answered within this (a bulk replay of many dead
/// letters is paged by its caller).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest a connection is served (a keep-alive one is closed when
/// idle for [`HEADER_READ_TIMEOUT`] anyway).
const CONNECTION_LIFETIME: Duration = Duration::from_secs(300);
/// How often readiness is checked, and how old a check may be before
/// `/readyz` says it is stale.
const READINESS_EVERY: Duration = Duration::from_secs(2);
const READINESS_STALE: Duration = Duration::from_secs(15);

type Shared = Arc<AppState>;

/// An API error: a status and a message that says what to do.
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({"error": self.1}))).into_response()
    }
}

impl From<OpsError> for ApiError {
    fn from(e: OpsError) -> Self {
        let status = match &e {
            OpsError::NotFound(_) => StatusCode::NOT_FOUND,
            OpsError::Conflict(_) => StatusCode::CONFLICT,
            OpsError::Database(_) | OpsError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            OpsError::Other(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(status, format!("{:#}", anyhow::Error::from(e)))
    }
}

type ApiResult = Result<Json<Value>, ApiError>;

/// Serve until `shutdown`. Also refreshes the table gauges.
pub async fn serve(
    cfg: RelayConfig,
    pool: PgPool,
    processor: Processor,
    metrics: PrometheusHandle,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let Some(addr) = cfg.admin.listen else { return Ok(()) };
    // The admin server's own few connections (M5): its callers cannot take
    // those ingestion and dispatch wait for.
    let pool = pool
        .options()
        .clone()
        .min_connections(0)
        .max_connections(ADMIN_CONNECTIONS)
        .connect_lazy_with(pool.connect_options().as_ref().clone());
    let token = std::env::var(&cfg.admin.token_env).ok().filter(|t| !t.is_empty());
    let token = match token {
        Some(t) if t.len() < MIN_TOKEN_BYTES => {
            error!(variable = %cfg.admin.token_env, length = t.len(),
                   "the admin token is too short to resist guessing (at least {MIN_TOKEN_BYTES} bytes, e.g. \
                    `openssl rand -hex 32`): the admin API stays disabled");
            None
        }
        t => t.map(SecretString::from),
    };
    if token.is_none() {
        warn!(variable = %cfg.admin.token_env, "no admin token in the environment: the admin API answers 503 (metrics and health still work)");
    }
    let gauges = {
        let (pool, every, token) = (pool.clone(), cfg.admin.gauge_interval, shutdown.clone());
        tokio::spawn(async move {
            loop {
                if let Err(e) = crate::runtime::metrics::refresh_gauges(&pool).await {
                    warn!(error = %e, "refreshing table gauges failed");
                }
                tokio::select! { _ = token.cancelled() => return, _ = tokio::time::sleep(every) => {} }
            }
        })
    };
    let (ready_tx, readiness) = tokio::sync::watch::channel(None);
    let checker = tokio::spawn(check_readiness(pool.clone(), cfg.kafka.clone(), ready_tx, shutdown.clone()));
    let operator = Operator::new(pool, &cfg);
    let token_env = cfg.admin.token_env.clone();
    let state = Arc::new(AppState { operator, processor, token, token_env, metrics, readiness });
    let app = router(state);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("admin.listen = {addr}: cannot listen: {e}"))?;
    info!(%addr, "admin server listening (console at /, API under /api, /metrics, /healthz, /readyz)");
    accept_loop(listener, app, shutdown).await;
    gauges.abort();
    checker.abort();
    Ok(())
}

/// Serve `app` on `listener` until `shutdown`, then let the requests in
/// flight finish (up to [`REQUEST_TIMEOUT`]). Written out instead of
/// `axum::serve`, which sets no timer, so hyper would apply no header-read
/// timeout, and which limits neither connections nor request time: a few
/// thousand connections that never finish their headers would hold file
/// descriptors and tasks for ever (security review M5).
async fn accept_loop(listener: tokio::net::TcpListener, app: Router, shutdown: CancellationToken) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use tower::ServiceExt;
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT);
    loop {
        let slot = tokio::select! {
            _ = shutdown.cancelled() => break,
            slot = slots.clone().acquire_owned() => slot.expect("never closed"),
        };
        let stream = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, say: wait a little rather than spin.
                    warn!(error = %e, "admin server: accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let app = app.clone();
        let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            let app = app.clone();
            async move {
                let answer = match tokio::time::timeout(REQUEST_TIMEOUT, app.oneshot(req)).await {
                    Ok(answered) => answered.unwrap_or_else(|never| match never {}),
                    Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "the request took too long\n").into_response(),
                };
                Ok::<_, std::convert::Infallible>(answer)
            }
        });
        let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            // A client that never reads its answers would otherwise keep its
            // slot for ever: the header timeout only covers reading requests.
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, conn).await;
            drop(slot);
        });
    }
    drop(listener);
    if tokio::time::timeout(REQUEST_TIMEOUT, graceful.shutdown()).await.is_err() {
        warn!("admin server: connections still open at shutdown were dropped");
    }
}

/// Check the database and the broker every [`READINESS_EVERY`] until
/// `shutdown`, publishing each result for `/readyz`.
async fn check_readiness(
    pool: PgPool,
    kafka: relay_core::config::KafkaConfig,
    out: tokio::sync::watch::Sender<Option<Readiness>>,
    shutdown: CancellationToken,
) {
    let probe: Arc<std::sync::Mutex<Option<BaseConsumer>>> = Arc::default();
    loop {
        let db = match tokio::time::timeout(Duration::from_secs(2), relay_store::migrations_current(&pool)).await {
            Ok(Ok(true)) => Ok("ok".to_string()),
            Ok(Ok(false)) => Err("migrations are not current: run `relay migrate`".to_string()),
            Ok(Err(e)) => Err(format!("unreachable: {e}")),
            Err(_) => Err("no answer within 2 s".to_string()),
        };
        let broker = broker_reachable(&probe, &kafka).await;
        let ready = db.is_ok() && broker.is_ok();
        let checks = json!({"database": db.unwrap_or_else(|e| e), "broker": broker.unwrap_or_else(|e| e)});
        out.send_replace(Some(Readiness { at: std::time::Instant::now(), ready, checks }));
        tokio::select! { _ = shutdown.cancelled() => return, _ = tokio::time::sleep(READINESS_EVERY) => {} }
    }
}

fn router(state: Shared) -> Router {
    Router::new()
        .route("/", get(|| async { ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], INDEX_HTML) }))
        .route("/app.js", get(|| async { ([(header::CONTENT_TYPE, "text/javascript; charset=utf-8")], APP_JS) }))
        .route("/style.css", get(|| async { ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE_CSS) }))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .merge(api(state.clone()))
        .with_state(state)
        .layer(axum::middleware::map_response(hardened))
}

/// Headers every admin answer carries (security review L4): the console runs
/// only its own script and style, is never framed (clickjacking the Replay
/// and Purge buttons), and nothing of it is cached or sniffed.
async fn hardened(mut resp: axum::response::Response) -> axum::response::Response {
    use axum::http::HeaderValue;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; \
             frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.entry(header::CACHE_CONTROL).or_insert(HeaderValue::from_static("no-store"));
    resp
}

/// The operator API: every route behind one bearer-token check.
fn api(state: Shared) -> Router<Shared> {
    Router::new()
        .route("/api/counts", get(counts))
        .route("/api/dead-letters", get(list_dead_letters))
        .route("/api/dead-letters/replay", post(replay_dead_letters))
        .route("/api/dead-letters/purge", post(purge_dead_letters))
        .route("/api/dead-letters/{id}", get(show_dead_letter).delete(delete_dead_letter))
        .route("/api/dead-letters/{id}/replay", post(replay_dead_letter))
        .route("/api/dead-letters/{id}/skip", post(skip_dead_letter))
        .route("/api/held-keys", get(held_keys))
        .route("/api/intents", get(list_intents))
        .route("/api/intents/replay", post(replay_intents))
        .route("/api/intents/{id}", get(show_intent))
        .route("/api/intents/{id}/replay", post(replay_intent))
        .route("/api/intents/{id}/resolve", post(resolve_intent))
        .route("/api/intents/{id}/skip", post(skip_intent))
        .route("/api/outbox", get(list_outbox))
        .route("/api/outbox/{id}", get(show_outbox))
        .route("/api/outbox/{id}/replay", post(replay_outbox))
        .route("/api/outbox/{id}/skip", post(skip_outbox))
        .route("/api/pauses", get(list_pauses).post(pause))
        .route("/api/pauses/{kind}/{name}", axum::routing::delete(resume))
        .route_layer(axum::middleware::from_fn_with_state(state, require_token))
}

/// The layer in front of every `/api` route.
async fn require_token(
    State(s): State<Shared>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Result<Response, ApiError> {
    authorize(&s, request.headers())?;
    Ok(next.run(request).await)
}

fn authorize(s: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(token) = &s.token else {
        return Err(ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the admin API is disabled: set {} in the relay's environment", s.token_env),
        ));
    };
    let given =
        headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    // Compared without an early exit, so the time taken does not tell how
    // much of a guess was right.
    // Nor how long the token is: every byte of the token is compared,
    // whatever the guess's length (security review L4).
    let ok = given.is_some_and(|g| {
        let (a, b) = (g.as_bytes(), token.expose_secret().as_bytes());
        let diff =
            b.iter().enumerate().fold(a.len() ^ b.len(), |acc, (i, y)| acc | usize::from(a.get(i).unwrap_or(&0) ^ y));
        diff == 0
    });
    if ok { Ok(()) } else { Err(ApiError(StatusCode::UNAUTHORIZED, "missing or wrong bearer token".into())) }
}

async fn metrics(State(s): State<Shared>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], s.metrics.render())
}

async fn readyz(State(s): State<Shared>) -> Response {
    let latest = s.readiness.borrow().clone();
    let (ready, checks) = match latest {
        None => (false, json!({"checks": "not checked yet: the first check is under way"})),
        Some(r) if r.at.elapsed() > READINESS_STALE => {
            let why = format!("the last check is {} s old: the checker is stuck", r.at.elapsed().as_secs());
            (false, json!({"stale": why, "last": r.checks}))
        }
        Some(r) => (r.ready, r.checks),
    };
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(json!({"ready": ready, "checks": checks}))).into_response()
}

async fn broker_reachable(
    probe: &Arc<std::sync::Mutex<Option<BaseConsumer>>>,
    kafka: &relay_core::config::KafkaConfig,
) -> Result<String, String> {
    let (probe, kafka) = (probe.clone(), kafka.clone());
    tokio::task::spawn_blocking(move || {
        let mut guard = probe.lock().map_err(|_| "probe lock poisoned".to_string())?;
        if guard.is_none() {
            let c: BaseConsumer = client_config(&kafka, Role::Consumer)
                .map_err(|e| e.to_string())?
                .create()
                .map_err(|e| format!("cannot create a Kafka client: {e}"))?;
            *guard = Some(c);
        }
        let c = guard.as_ref().ok_or("no probe")?;
        c.fetch_metadata(None, Duration::from_secs(2))
            .map(|md| format!("ok ({} broker(s))", md.brokers().len()))
            .map_err(|e| format!("unreachable: {e}"))
    })
    .await
    .map_err(|e| e.to_string())?
}

async fn counts(State(s): State<Shared>) -> ApiResult {
    Ok(Json(json!(s.operator.counts().await?)))
}

#[derive(Deserialize)]
struct DeadLetterQuery {
    class: Option<String>,
    topic: Option<String>,
    #[serde(default)]
    all: bool,
    #[serde(default)]
    after: i64,
    limit: Option<i64>,
}

async fn list_dead_letters(State(s): State<Shared>, Query(q): Query<DeadLetterQuery>) -> ApiResult {
    let resolution = if q.all { Resolution::Any } else { Resolution::Unresolved };
    let f = s.operator.filter(q.class, q.topic, resolution);
    let items = s.operator.dead_letters(&f, q.after, q.limit.unwrap_or(100).clamp(1, 1000)).await?;
    let total = s.operator.count_dead_letters(&f).await?;
    Ok(Json(json!({"items": items, "total": total})))
}

async fn show_dead_letter(State(s): State<Shared>, Path(id): Path<i64>) -> ApiResult {
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

fn outcome_json(id: i64, r: &Replayed) -> Value {
    let (outcome, detail) = r.outcome.label();
    let released = r.released.as_ref().map(released_json);
    json!({"id": id, "outcome": outcome, "detail": detail, "resolved": r.outcome.resolved(), "released": released})
}

fn released_json(r: &Released) -> Value {
    json!({"key": relay_store::holds::preview(&r.key), "replayed": r.replayed, "held_behind": r.held_behind,
           "detail": r.describe()})
}

async fn replay_dead_letter(State(s): State<Shared>, Path(id): Path<i64>) -> ApiResult {
    let r = s.operator.replay_releasing(&s.processor, id).await?;
    match r.outcome {
        ReplayOutcome::NotFound => Err(ApiError(StatusCode::NOT_FOUND, format!("no dead letter {id}"))),
        _ => Ok(Json(outcome_json(id, &r))),
    }
}

async fn skip_dead_letter(State(s): State<Shared>, Path(id): Path<i64>) -> ApiResult {
    let released = s.operator.skip_dead_letter(&s.processor, id).await?;
    info!(dead_letter = id, "dead letter skipped through the admin API");
    Ok(Json(json!({"id": id, "skipped": true, "released": released_json(&released)})))
}

#[derive(Deserialize)]
struct HeldKeysQuery {
    limit: Option<i64>,
}

async fn held_keys(State(s): State<Shared>, Query(q): Query<HeldKeysQuery>) -> ApiResult {
    let rows = s.operator.held_keys(q.limit.unwrap_or(200).clamp(1, 1000)).await?;
    Ok(Json(json!({"held_keys": rows})))
}

#[derive(Deserialize)]
struct Bulk {
    #[serde(default)]
    ids: Vec<i64>,
    #[serde(default)]
    all: bool,
    class: Option<String>,
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

async fn replay_dead_letters(State(s): State<Shared>, Json(b): Json<Bulk>) -> ApiResult {
    let which = b.select(&s, Resolution::Unresolved);
    let done = s.operator.replay_all(&s.processor, which, |_, _, _, _| {}).await?;
    let results: Vec<Value> = done.iter().map(|(id, o)| outcome_json(*id, o)).collect();
    let resolved = done.iter().filter(|(_, r)| r.outcome.resolved()).count();
    Ok(Json(json!({"results": results, "resolved": resolved})))
}

async fn delete_dead_letter(State(s): State<Shared>, Path(id): Path<i64>) -> ApiResult {
    s.operator.delete_dead_letter(id).await?;
    Ok(Json(json!({"deleted": 1})))
}

async fn purge_dead_letters(State(s): State<Shared>, Json(b): Json<Bulk>) -> ApiResult {
    let resolution = if b.resolved { Resolution::Resolved } else { Resolution::Any };
    let deleted = s.operator.purge(b.select(&s, resolution), |_| {}).await?;
    Ok(Json(json!({"deleted": deleted})))
}

#[derive(Deserialize)]
struct IntentQuery {
    state: Option<String>,
    endpoint: Option<String>,
    before: Option<chrono::DateTime<chrono::Utc>>,
    limit: Option<i64>,
}

async fn list_intents(State(s): State<Shared>, Query(q): Query<IntentQuery>) -> ApiResult {
    let state =
        q.state.map(|st| st.parse::<IntentState>()).transpose().map_err(|e| ApiError(StatusCode::BAD_REQUEST, e))?;
    let items = s.operator.intents(state, q.endpoint, q.before, q.limit.unwrap_or(100).clamp(1, 1000)).await?;
    Ok(Json(json!({"items": items})))
}

fn parse_id(id: &str) -> Result<uuid::Uuid, ApiError> {
    id.parse().map_err(|_| ApiError(StatusCode::BAD_REQUEST, format!("{id:?} is not an intent id (a UUID)")))
}

async fn show_intent(State(s): State<Shared>, Path(id): Path<String>) -> ApiResult {
    Ok(Json(json!(s.operator.intent(parse_id(&id)?).await?)))
}

#[derive(Deserialize, Default)]
struct ReplayQuery {
    /// Replay even if the attempts could outlive the provider's key window.
    #[serde(default)]
    past_key_window: bool,
}

async fn replay_intent(State(s): State<Shared>, Path(id): Path<String>, Query(q): Query<ReplayQuery>) -> ApiResult {
    let id = parse_id(&id)?;
    s.operator.requeue(id, KeyWindow::past_allowed(q.past_key_window)).await?;
    Ok(Json(json!({"id": id, "requeued": true})))
}

#[derive(Deserialize)]
struct Resolve {
    resolution: crate::ops::admin::IntentResolution,
    note: Option<String>,
}

async fn resolve_intent(State(s): State<Shared>, Path(id): Path<String>, Json(r): Json<Resolve>) -> ApiResult {
    let id = parse_id(&id)?;
    let dropped = s.operator.resolve(id, r.resolution, r.note.as_deref()).await?;
    info!(intent_id = %id, resolution = ?r.resolution, "uncertain intent resolved through the admin API");
    Ok(Json(json!({"id": id, "resolved": r.resolution, "effects_not_recorded": dropped})))
}

#[derive(Deserialize)]
struct IntentBulk {
    #[serde(default)]
    ids: Vec<uuid::Uuid>,
    #[serde(default)]
    all: bool,
    endpoint: Option<String>,
    #[serde(default)]
    past_key_window: bool,
}

async fn replay_intents(State(s): State<Shared>, Json(b): Json<IntentBulk>) -> ApiResult {
    let which = if b.all { Intents::Dead { endpoint: b.endpoint } } else { Intents::Ids(b.ids) };
    let done = s.operator.requeue_all(which, KeyWindow::past_allowed(b.past_key_window), |_| {}).await?;
    let past: Vec<_> = done.not_replayed.iter().map(|(id, why)| json!({"id": id, "why": why})).collect();
    Ok(Json(json!({"requeued": done.queued, "asked": done.asked, "refused": done.refused, "not_replayed": past})))
}

#[derive(Deserialize)]
struct OutboxQuery {
    state: Option<String>,
    topic: Option<String>,
    before: Option<chrono::DateTime<chrono::Utc>>,
    limit: Option<i64>,
}

async fn list_outbox(State(s): State<Shared>, Query(q): Query<OutboxQuery>) -> ApiResult {
    let state = q
        .state
        .map(|st| st.parse::<relay_store::outbox::OutboxState>())
        .transpose()
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, e))?;
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let items = s.operator.outbox_rows(state, q.topic.as_deref(), q.before, limit).await?;
    Ok(Json(json!({"items": items})))
}

fn parse_outbox_id(id: &str) -> Result<uuid::Uuid, ApiError> {
    id.parse().map_err(|_| ApiError(StatusCode::BAD_REQUEST, format!("{id:?} is not an outbox row id (a UUID)")))
}

async fn show_outbox(State(s): State<Shared>, Path(id): Path<String>) -> ApiResult {
    Ok(Json(json!({"row": s.operator.outbox_row(parse_outbox_id(&id)?).await?})))
}

async fn replay_outbox(State(s): State<Shared>, Path(id): Path<String>) -> ApiResult {
    let id = parse_outbox_id(&id)?;
    s.operator.outbox_replay(id).await?;
    info!(outbox_id = %id, "dead outbox row queued again through the admin API");
    Ok(Json(json!({"id": id, "requeued": true})))
}

async fn skip_intent(State(s): State<Shared>, Path(id): Path<String>) -> ApiResult {
    let id = parse_id(&id)?;
    let (key, waiting) = s.operator.intent_skip(id).await?;
    info!(intent_id = %id, "dead intent skipped through the admin API");
    Ok(Json(json!({"id": id, "released_key": key, "waiting": waiting})))
}

async fn skip_outbox(State(s): State<Shared>, Path(id): Path<String>) -> ApiResult {
    let id = parse_outbox_id(&id)?;
    s.operator.outbox_skip(id).await?;
    info!(outbox_id = %id, "dead outbox row skipped through the admin API");
    Ok(Json(json!({"id": id, "skipped": true})))
}

async fn list_pauses(State(s): State<Shared>) -> ApiResult {
    Ok(Json(json!({"pauses": s.operator.pauses().await?})))
}

#[derive(Deserialize)]
struct PauseRequest {
    kind: PauseKind,
    name: String,
    reason: Option<String>,
}

async fn pause(State(s): State<Shared>, Json(p): Json<PauseRequest>) -> ApiResult {
    let done = s.operator.pause(p.kind, &p.name, p.reason.as_deref()).await?;
    info!(kind = p.kind.as_str(), name = %p.name, "paused through the admin API");
    Ok(Json(json!({"paused": true, "already": done == Paused::AlreadyPaused})))
}

async fn resume(State(s): State<Shared>, Path((kind, name)): Path<(String, String)>) -> ApiResult {
    let kind = match kind.as_str() {
        "route" => PauseKind::Route,
        "endpoint" => PauseKind::Endpoint,
        other => return Err(ApiError(StatusCode::BAD_REQUEST, format!("kind {other:?}: use route or endpoint"))),
    };
    let done = s.operator.resume(kind, &name).await?;
    info!(kind = kind.as_str(), %name, "resumed through the admin API");
    Ok(Json(json!({"resumed": done == Resumed::Resumed})))
}
