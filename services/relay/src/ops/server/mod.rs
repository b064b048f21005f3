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

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use relay_core::RelayConfig;
use secrecy::SecretString;
use serde_json::Value;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::ingest::processor::Processor;
use crate::ops::admin::{Operator, OpsError};

// The rooms below take these imports and the types beneath through
// `use super::*`: one prelude for the server's files.
mod auth;
mod console;
mod dead_letters;
mod intents;
mod listener;
mod openapi;
mod outbox;
mod overview;
mod pauses;
mod probes;
mod schemas;

pub use openapi::openapi_json;

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
/// How often readiness is checked, and how old a check may be before
/// `/readyz` says it is stale.
const READINESS_EVERY: Duration = Duration::from_secs(2);
const READINESS_STALE: Duration = Duration::from_secs(15);

type Shared = Arc<AppState>;

/// An API error: a status and a message that says what to do.
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(schemas::ErrorBody { error: self.1 })).into_response()
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

/// A handler's answer: `T` as JSON (its schema in the OpenAPI document), or an error.
type ApiResult<T> = Result<Json<T>, ApiError>;

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
    let checker = tokio::spawn(probes::check_readiness(pool.clone(), cfg.kafka.clone(), ready_tx, shutdown.clone()));
    let operator = Operator::new(pool, &cfg).with_encoders(processor.router().encoders());
    let token_env = cfg.admin.token_env.clone();
    let state = Arc::new(AppState { operator, processor, token, token_env, metrics, readiness });
    let app = router(state);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("admin.listen = {addr}: cannot listen: {e}"))?;
    info!(%addr, "admin server listening (console at /, API under /api, /metrics, /healthz, /readyz)");
    listener::accept_loop(listener, app, shutdown).await;
    gauges.abort();
    checker.abort();
    Ok(())
}

/// The console, the probes, and the API behind its token, every answer
/// hardened.
fn router(state: Shared) -> Router {
    let (api, _) = openapi::api_parts();
    let api = api.route_layer(axum::middleware::from_fn_with_state(state.clone(), auth::require_token));
    let (probes, _) = openapi::probe_parts();
    console::routes()
        .merge(probes)
        .merge(api)
        .with_state(state)
        .layer(axum::middleware::map_response(listener::hardened))
}
