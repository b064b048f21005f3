//! Liveness, readiness (checked in the background: a probe never touches
//! the database or the broker itself) and Prometheus metrics.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use rdkafka::consumer::{BaseConsumer, Consumer};
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::{READINESS_EVERY, READINESS_STALE, Readiness, Shared};
use crate::runtime::kafka::{Role, client_config};

#[utoipa::path(get, path = "/healthz", tag = "probes", summary = "Liveness: the process answers",
    responses((status = 200, description = "Alive", body = String, content_type = "text/plain", example = "ok\n")))]
pub(super) async fn healthz() -> &'static str {
    "ok\n"
}

#[utoipa::path(get, path = "/metrics", tag = "probes", summary = "Prometheus metrics",
    responses((status = 200, description = "The text exposition format", body = String, content_type = "text/plain; version=0.0.4")))]
pub(super) async fn metrics(State(s): State<Shared>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], s.metrics.render())
}

#[utoipa::path(get, path = "/readyz", tag = "probes", summary = "Readiness: the database (migrations current) and the broker answer",
    responses(
        (status = 200, description = "Ready", body = Object, example = json!({"ready": true, "checks": {"database": "ok", "broker": "ok"}})),
        (status = 503, description = "Not ready: the checks say why", body = Object,
         example = json!({"ready": false, "checks": {"database": "migrations are not current: run `relay migrate`", "broker": "ok"}}))
    ))]
pub(super) async fn readyz(State(s): State<Shared>) -> Response {
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

pub(super) async fn broker_reachable(
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

/// Check the database and the broker every [`READINESS_EVERY`] until
/// `shutdown`, publishing each result for `/readyz`.
pub(super) async fn check_readiness(
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
