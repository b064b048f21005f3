//! The admin HTTP server of a relay process (`[admin] listen`):
//!
//! * `GET /metrics` — Prometheus text format;
//! * `GET /healthz` — the process is up;
//! * `GET /readyz` — database reachable, migrations current, broker reachable
//!   (503 with the failing checks otherwise);
//! * `/api/…` — the JSON admin API, behind `Authorization: Bearer <token>`
//!   (the token comes from the environment variable `admin.token_env`);
//! * `GET /api/openapi.json` — the OpenAPI description of all of the above,
//!   generated from the handlers (no token);
//! * `/` — the web console, static files compiled into the binary, talking to
//!   the API from the browser (no build step, nothing fetched at run time).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
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
use utoipa::{IntoParams, OpenApi, ToSchema};
use utoipa_axum::{router::OpenApiRouter, routes};

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
/// readiness checks share them, never the pool ingestion and dispatch use.
const ADMIN_CONNECTIONS: u32 = 2;
/// The shortest admin token accepted.
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
    // The admin server's own few connections: its callers cannot take
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
    let operator = Operator::new(pool, &cfg).with_encoders(processor.router().encoders());
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
/// descriptors and tasks for ever.
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
    let (api, _) = api_parts();
    let api = api.route_layer(axum::middleware::from_fn_with_state(state.clone(), require_token));
    let (probes, _) = probe_parts();
    Router::new()
        .route("/", get(|| async { ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], INDEX_HTML) }))
        .route("/app.js", get(|| async { ([(header::CONTENT_TYPE, "text/javascript; charset=utf-8")], APP_JS) }))
        .route("/style.css", get(|| async { ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE_CSS) }))
        .merge(probes)
        .merge(api)
        .with_state(state)
        .layer(axum::middleware::map_response(hardened))
}

/// Headers every admin answer carries: the console runs
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

/// The operator API's routes and their OpenAPI description, from one
/// declaration: `routes!` registers each handler at the path its
/// `#[utoipa::path]` documents, so the description cannot name a route that
/// is not served or miss one that is. [`router`] puts them all behind one
/// bearer-token check.
fn api_parts() -> (Router<Shared>, utoipa::openapi::OpenApi) {
    let (router, mut doc) = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(counts))
        .routes(routes!(list_dead_letters))
        .routes(routes!(replay_dead_letters))
        .routes(routes!(purge_dead_letters))
        .routes(routes!(show_dead_letter, delete_dead_letter))
        .routes(routes!(replay_dead_letter))
        .routes(routes!(skip_dead_letter))
        .routes(routes!(held_keys))
        .routes(routes!(list_intents))
        .routes(routes!(replay_intents))
        .routes(routes!(show_intent))
        .routes(routes!(replay_intent))
        .routes(routes!(resolve_intent))
        .routes(routes!(skip_intent))
        .routes(routes!(list_outbox))
        .routes(routes!(show_outbox))
        .routes(routes!(replay_outbox))
        .routes(routes!(skip_outbox))
        .routes(routes!(list_pauses, pause))
        .routes(routes!(resume))
        .split_for_parts();
    common_responses(&mut doc);
    (router, doc)
}

/// The answers every `/api` operation can give besides its own: 401
/// without the token, 503 when the API is disabled or the database cannot
/// be reached, 500 for an unexpected error (each an [`ErrorBody`]); and
/// axum refuses a malformed path, query or body before the handler runs,
/// in plain text (400, or 415 / 422 for a body).
fn common_responses(doc: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
    let json_error = |what: &str| {
        ResponseBuilder::new()
            .description(what)
            .content("application/json", ContentBuilder::new().schema(Some(Ref::from_schema_name("ErrorBody"))).build())
    };
    // What axum may also answer itself, in plain text.
    let error = |what: &str| {
        json_error(what)
            .content("text/plain", ContentBuilder::new().schema(Some(utoipa::openapi::Object::new())).build())
            .build()
    };
    let json_error = |what: &str| json_error(what).build();
    for (path, item) in doc.paths.paths.iter_mut() {
        if !path.starts_with("/api/") || path == "/api/openapi.json" {
            continue;
        }
        for op in [&mut item.get, &mut item.post, &mut item.delete].into_iter().flatten() {
            let r = &mut op.responses.responses;
            let takes_input = op.parameters.as_ref().is_some_and(|p| !p.is_empty()) || op.request_body.is_some();
            if takes_input {
                r.entry("400".into()).or_insert_with(|| {
                    error("A malformed id or parameter (plain text when axum refuses it before the handler)").into()
                });
            }
            if op.request_body.is_some() {
                r.insert("415".into(), error("The body is not sent as application/json").into());
                r.insert("422".into(), error("The body is JSON but not what the operation takes").into());
            }
            r.insert("500".into(), error("An unexpected error; the body says which").into());
            r.insert("401".into(), json_error("Missing or wrong bearer token").into());
            r.insert(
                "503".into(),
                json_error("The admin API is disabled (no token set) or the database cannot be reached").into(),
            );
        }
    }
}

#[utoipa::path(get, path = "/api/openapi.json", tag = "overview", summary = "This description (no token needed)",
    responses((status = 200, description = "OpenAPI 3.1", body = Object)))]
async fn openapi() -> impl IntoResponse {
    // Built once: it is the same for the life of the process.
    static DOC: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ([(header::CONTENT_TYPE, "application/json")], DOC.get_or_init(openapi_json).as_str())
}

/// The probes, `/metrics` and this description, declared the same way;
/// they answer without the token.
fn probe_parts() -> (Router<Shared>, utoipa::openapi::OpenApi) {
    OpenApiRouter::new()
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(metrics))
        .routes(routes!(openapi))
        .split_for_parts()
}

/// The admin API's OpenAPI 3 description, as served at `/api/openapi.json`
/// and checked in at `docs/openapi.json`.
pub fn openapi_json() -> String {
    let mut doc = api_parts().1;
    for (path, mut item) in probe_parts().1.paths.paths {
        // No token: an empty requirement overrides the document's.
        for op in [&mut item.get, &mut item.post].into_iter().flatten() {
            op.security = Some(vec![utoipa::openapi::security::SecurityRequirement::default()]);
        }
        doc.paths.paths.insert(path, item);
    }
    let mut text = doc.to_pretty_json().expect("the OpenAPI description serializes");
    text.push('\n');
    text
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "relay admin API",
        description = "Operate one relay: counts, dead letters (replay, skip, purge), intents (replay, resolve, \
                       skip), the outbox, pauses. Every /api route needs `Authorization: Bearer <token>`, the token \
                       being the value of the variable admin.token_env names (RELAY_ADMIN_TOKEN by default); \
                       /healthz, /readyz, /metrics and /api/openapi.json do not.",
        license(name = "Apache-2.0")
    ),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
    components(schemas(ErrorBody)),
    tags(
        (name = "probes", description = "Liveness, readiness and Prometheus metrics"),
        (name = "overview", description = "Counts of every table by state"),
        (name = "dead letters", description = "Records and events that could not be applied"),
        (name = "intents", description = "External calls"),
        (name = "outbox", description = "Events to publish"),
        (name = "pauses", description = "Routes and endpoints held on purpose"),
    )
)]
struct ApiDoc;

/// The bearer scheme every `/api` route requires.
struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        doc.components.get_or_insert_with(Default::default).add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// A text schema of `values`: the names an enum bound to SQL stores, taken
/// from the enum so the description lists what the handler parses.
fn one_of(values: impl IntoIterator<Item = &'static str>) -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(values.into_iter().collect::<Vec<_>>()))
        .build()
}

fn pause_kinds() -> utoipa::openapi::Object {
    one_of([PauseKind::Route, PauseKind::Endpoint].map(PauseKind::as_str))
}

fn intent_states() -> utoipa::openapi::Object {
    one_of(IntentState::ALL.map(IntentState::as_str))
}

fn outbox_states() -> utoipa::openapi::Object {
    one_of(relay_store::outbox::OutboxState::ALL.map(relay_store::outbox::OutboxState::as_str))
}

/// What every failed `/api` call answers (`ApiError::into_response`).
#[derive(ToSchema)]
#[allow(dead_code)] // Only described: the answer is built with `json!`.
struct ErrorBody {
    /// What went wrong and, where there is one, what to do about it.
    error: String,
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
    // whatever the guess's length.
    let ok = given.is_some_and(|g| {
        let (a, b) = (g.as_bytes(), token.expose_secret().as_bytes());
        let diff =
            b.iter().enumerate().fold(a.len() ^ b.len(), |acc, (i, y)| acc | usize::from(a.get(i).unwrap_or(&0) ^ y));
        diff == 0
    });
    if ok { Ok(()) } else { Err(ApiError(StatusCode::UNAUTHORIZED, "missing or wrong bearer token".into())) }
}

#[utoipa::path(get, path = "/healthz", tag = "probes", summary = "Liveness: the process answers",
    responses((status = 200, description = "Alive", body = String, content_type = "text/plain", example = "ok\n")))]
async fn healthz() -> &'static str {
    "ok\n"
}

#[utoipa::path(get, path = "/metrics", tag = "probes", summary = "Prometheus metrics",
    responses((status = 200, description = "The text exposition format", body = String, content_type = "text/plain; version=0.0.4")))]
async fn metrics(State(s): State<Shared>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], s.metrics.render())
}

#[utoipa::path(get, path = "/readyz", tag = "probes", summary = "Readiness: the database (migrations current) and the broker answer",
    responses(
        (status = 200, description = "Ready", body = Object, example = json!({"ready": true, "checks": {"database": "ok", "broker": "ok"}})),
        (status = 503, description = "Not ready: the checks say why", body = Object,
         example = json!({"ready": false, "checks": {"database": "migrations are not current: run `relay migrate`", "broker": "ok"}}))
    ))]
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

#[utoipa::path(
    get,
    path = "/api/counts",
    tag = "overview",
    summary = "Rows of every table by state, and what is paused",
    responses(
        (status = 200, description = "Counts", body = Object, example = json!({"stats": {"inbox": 120, "intents": {"pending": 2, "dead": 1}, "outbox": {"pending": 0}, "dead_letters": {"unresolved": 3}}, "estimated": [], "pauses": []})),
    )
)]
async fn counts(State(s): State<Shared>) -> ApiResult {
    Ok(Json(json!(s.operator.counts().await?)))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct DeadLetterQuery {
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
async fn list_dead_letters(State(s): State<Shared>, Query(q): Query<DeadLetterQuery>) -> ApiResult {
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
async fn replay_dead_letter(State(s): State<Shared>, Path(id): Path<i64>) -> ApiResult {
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
async fn skip_dead_letter(State(s): State<Shared>, Path(id): Path<i64>) -> ApiResult {
    let released = s.operator.skip_dead_letter(&s.processor, id).await?;
    info!(dead_letter = id, "dead letter skipped through the admin API");
    Ok(Json(json!({"id": id, "skipped": true, "released": released_json(&released)})))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct HeldKeysQuery {
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
async fn held_keys(State(s): State<Shared>, Query(q): Query<HeldKeysQuery>) -> ApiResult {
    let rows = s.operator.held_keys(q.limit.unwrap_or(200).clamp(1, 1000)).await?;
    Ok(Json(json!({"held_keys": rows})))
}

#[derive(Deserialize, ToSchema)]
struct Bulk {
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
async fn replay_dead_letters(State(s): State<Shared>, Json(b): Json<Bulk>) -> ApiResult {
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
async fn delete_dead_letter(State(s): State<Shared>, Path(id): Path<i64>) -> ApiResult {
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
async fn purge_dead_letters(State(s): State<Shared>, Json(b): Json<Bulk>) -> ApiResult {
    let resolution = if b.resolved { Resolution::Resolved } else { Resolution::Any };
    let deleted = s.operator.purge(b.select(&s, resolution), |_| {}).await?;
    Ok(Json(json!({"deleted": deleted})))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct IntentQuery {
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
        (status = 200, description = "Intents", body = Object, example = json!({"items": [{"id": "0b9c…", "endpoint": "psp", "state": "dead", "attempts": 5, "last_error": "HTTP 500"}]})),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
    )
)]
async fn list_intents(State(s): State<Shared>, Query(q): Query<IntentQuery>) -> ApiResult {
    let state = q
        .state
        .map(|st| st.parse::<IntentState>())
        .transpose()
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.to_string()))?;
    let items = s.operator.intents(state, q.endpoint, q.before, q.limit.unwrap_or(100).clamp(1, 1000)).await?;
    Ok(Json(json!({"items": items})))
}

fn parse_id(id: &str) -> Result<uuid::Uuid, ApiError> {
    id.parse().map_err(|_| ApiError(StatusCode::BAD_REQUEST, format!("{id:?} is not an intent id (a UUID)")))
}

#[utoipa::path(
    get,
    path = "/api/intents/{id}",
    tag = "intents",
    summary = "One intent with its attempts, reconciliations and response",
    params(("id" = String, Path, description = "Intent id (a UUID)")),
    responses(
        (status = 200, description = "The intent", body = Object, example = json!({"intent": {"id": "0b9c…", "state": "succeeded"}, "attempts": [], "reconciliations": [], "response": null})),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 404, description = "No such intent", body = ErrorBody),
    )
)]
async fn show_intent(State(s): State<Shared>, Path(id): Path<String>) -> ApiResult {
    Ok(Json(json!(s.operator.intent(parse_id(&id)?).await?)))
}

#[derive(Deserialize, Default, IntoParams)]
#[into_params(parameter_in = Query)]
struct ReplayQuery {
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
        (status = 200, description = "Queued", body = Object, example = json!({"id": "0b9c…", "requeued": true})),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 404, description = "No such intent", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
async fn replay_intent(State(s): State<Shared>, Path(id): Path<String>, Query(q): Query<ReplayQuery>) -> ApiResult {
    let id = parse_id(&id)?;
    s.operator.requeue(id, KeyWindow::past_allowed(q.past_key_window)).await?;
    Ok(Json(json!({"id": id, "requeued": true})))
}

#[derive(Deserialize, ToSchema)]
struct Resolve {
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
        (status = 200, description = "Resolved", body = Object, example = json!({"id": "0b9c…", "resolved": "succeeded", "effects_not_recorded": null})),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 404, description = "No such intent", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
async fn resolve_intent(State(s): State<Shared>, Path(id): Path<String>, Json(r): Json<Resolve>) -> ApiResult {
    let id = parse_id(&id)?;
    let dropped = s.operator.resolve(id, r.resolution, r.note.as_deref()).await?;
    info!(intent_id = %id, resolution = ?r.resolution, "uncertain intent resolved through the admin API");
    Ok(Json(json!({"id": id, "resolved": r.resolution, "effects_not_recorded": dropped})))
}

#[derive(Deserialize, ToSchema)]
struct IntentBulk {
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
        (status = 200, description = "What was queued and what was not", body = Object, example = json!({"requeued": 3, "asked": 4, "refused": 0, "not_replayed": [{"id": "0b9c…", "why": "past the key window of the provider"}]})),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
    )
)]
async fn replay_intents(State(s): State<Shared>, Json(b): Json<IntentBulk>) -> ApiResult {
    let which = if b.all { Intents::Dead { endpoint: b.endpoint } } else { Intents::Ids(b.ids) };
    let done = s.operator.requeue_all(which, KeyWindow::past_allowed(b.past_key_window), |_| {}).await?;
    let past: Vec<_> = done.not_replayed.iter().map(|(id, why)| json!({"id": id, "why": why})).collect();
    Ok(Json(json!({"requeued": done.queued, "asked": done.asked, "refused": done.refused, "not_replayed": past})))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct OutboxQuery {
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
        (status = 200, description = "Rows", body = Object, example = json!({"items": [{"id": "5d1e…", "topic": "payments", "state": "dead", "attempts": 3}]})),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
    )
)]
async fn list_outbox(State(s): State<Shared>, Query(q): Query<OutboxQuery>) -> ApiResult {
    let state = q
        .state
        .map(|st| st.parse::<relay_store::outbox::OutboxState>())
        .transpose()
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.to_string()))?;
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let items = s.operator.outbox_rows(state, q.topic.as_deref(), q.before, limit).await?;
    Ok(Json(json!({"items": items})))
}

fn parse_outbox_id(id: &str) -> Result<uuid::Uuid, ApiError> {
    id.parse().map_err(|_| ApiError(StatusCode::BAD_REQUEST, format!("{id:?} is not an outbox row id (a UUID)")))
}

#[utoipa::path(
    get,
    path = "/api/outbox/{id}",
    tag = "outbox",
    summary = "One outbox row",
    params(("id" = String, Path, description = "Outbox row id (a UUID)")),
    responses(
        (status = 200, description = "The row", body = Object, example = json!({"row": {"id": "5d1e…", "topic": "payments", "state": "published"}})),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 404, description = "No such outbox row", body = ErrorBody),
    )
)]
async fn show_outbox(State(s): State<Shared>, Path(id): Path<String>) -> ApiResult {
    Ok(Json(json!({"row": s.operator.outbox_row(parse_outbox_id(&id)?).await?})))
}

#[utoipa::path(
    post,
    path = "/api/outbox/{id}/replay",
    tag = "outbox",
    summary = "Queue a dead outbox row again",
    params(("id" = String, Path, description = "Outbox row id (a UUID)")),
    responses(
        (status = 200, description = "Queued", body = Object, example = json!({"id": "5d1e…", "requeued": true})),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 404, description = "No such outbox row", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
async fn replay_outbox(State(s): State<Shared>, Path(id): Path<String>) -> ApiResult {
    let id = parse_outbox_id(&id)?;
    s.operator.outbox_replay(id).await?;
    info!(outbox_id = %id, "dead outbox row queued again through the admin API");
    Ok(Json(json!({"id": id, "requeued": true})))
}

#[utoipa::path(
    post,
    path = "/api/intents/{id}/skip",
    tag = "intents",
    summary = "Give up a dead intent, releasing the key it holds",
    params(("id" = String, Path, description = "Intent id (a UUID)")),
    responses(
        (status = 200, description = "Skipped", body = Object, example = json!({"id": "0b9c…", "released_key": "o-1", "waiting": 2})),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 404, description = "No such intent", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
async fn skip_intent(State(s): State<Shared>, Path(id): Path<String>) -> ApiResult {
    let id = parse_id(&id)?;
    let (key, waiting) = s.operator.intent_skip(id).await?;
    info!(intent_id = %id, "dead intent skipped through the admin API");
    Ok(Json(json!({"id": id, "released_key": key, "waiting": waiting})))
}

#[utoipa::path(
    post,
    path = "/api/outbox/{id}/skip",
    tag = "outbox",
    summary = "Give up a dead outbox row",
    params(("id" = String, Path, description = "Outbox row id (a UUID)")),
    responses(
        (status = 200, description = "Skipped", body = Object, example = json!({"id": "5d1e…", "skipped": true})),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 404, description = "No such outbox row", body = ErrorBody),
        (status = 409, description = "Not in a state that allows it (the reason says which)", body = ErrorBody),
    )
)]
async fn skip_outbox(State(s): State<Shared>, Path(id): Path<String>) -> ApiResult {
    let id = parse_outbox_id(&id)?;
    s.operator.outbox_skip(id).await?;
    info!(outbox_id = %id, "dead outbox row skipped through the admin API");
    Ok(Json(json!({"id": id, "skipped": true})))
}

#[utoipa::path(
    get,
    path = "/api/pauses",
    tag = "pauses",
    summary = "What is paused",
    responses(
        (status = 200, description = "Pauses", body = Object, example = json!({"pauses": [{"kind": "endpoint", "name": "psp", "reason": "provider incident", "paused_at": "2026-12-05T10:00:00Z"}]})),
    )
)]
async fn list_pauses(State(s): State<Shared>) -> ApiResult {
    Ok(Json(json!({"pauses": s.operator.pauses().await?})))
}

#[derive(Deserialize, ToSchema)]
struct PauseRequest {
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
        (status = 200, description = "Paused (already: it was)", body = Object, example = json!({"paused": true, "already": false})),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
        (status = 404, description = "No such route or endpoint", body = ErrorBody),
    )
)]
async fn pause(State(s): State<Shared>, Json(p): Json<PauseRequest>) -> ApiResult {
    let done = s.operator.pause(p.kind, &p.name, p.reason.as_deref()).await?;
    info!(kind = p.kind.as_str(), name = %p.name, "paused through the admin API");
    Ok(Json(json!({"paused": true, "already": done == Paused::AlreadyPaused})))
}

#[utoipa::path(
    delete,
    path = "/api/pauses/{kind}/{name}",
    tag = "pauses",
    summary = "Resume a route or an endpoint",
    params(("kind" = String, Path, description = "route or endpoint"), ("name" = String, Path, description = "Name of the route or endpoint")),
    responses(
        (status = 200, description = "Resumed (false: it was not paused)", body = Object, example = json!({"resumed": true})),
        (status = 400, description = "A malformed id or parameter", body = ErrorBody),
    )
)]
async fn resume(State(s): State<Shared>, Path((kind, name)): Path<(String, String)>) -> ApiResult {
    let kind = kind.parse::<PauseKind>().map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.to_string()))?;
    let done = s.operator.resume(kind, &name).await?;
    info!(kind = kind.as_str(), %name, "resumed through the admin API");
    Ok(Json(json!({"resumed": done == Resumed::Resumed})))
}

#[cfg(test)]
mod openapi_tests {
    /// The checked-in description is what the code serves; regenerate it
    /// with `RELAY_UPDATE_OPENAPI=1 cargo test -p relay openapi`.
    #[test]
    fn the_checked_in_openapi_description_is_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json");
        let now = super::openapi_json();
        if std::env::var_os("RELAY_UPDATE_OPENAPI").is_some() {
            std::fs::write(&path, &now).unwrap();
        }
        let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            checked_in == now,
            "docs/openapi.json is not what the handlers describe: regenerate it with \
             RELAY_UPDATE_OPENAPI=1 cargo test -p relay openapi, and review the diff"
        );
    }
}
