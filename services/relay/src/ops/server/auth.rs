//! The bearer token in front of every `/api` route.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use secrecy::ExposeSecret;

use super::{ApiError, AppState, Shared};

/// The layer in front of every `/api` route.
pub(super) async fn require_token(
    State(s): State<Shared>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Result<Response, ApiError> {
    authorize(&s, request.headers())?;
    Ok(next.run(request).await)
}

pub(super) fn authorize(s: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
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
