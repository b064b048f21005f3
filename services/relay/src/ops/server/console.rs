//! The web console: static files compiled into the binary, talking to the
//! API from the browser (no build step, nothing fetched at run time).

use axum::Router;
use axum::http::header;
use axum::routing::get;

use super::Shared;

const INDEX_HTML: &str = include_str!("../../../console/index.html");
const APP_JS: &str = include_str!("../../../console/app.js");
const STYLE_CSS: &str = include_str!("../../../console/style.css");

/// The console's routes.
pub(super) fn routes() -> Router<Shared> {
    Router::new()
        .route("/", get(|| async { ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], INDEX_HTML) }))
        .route("/app.js", get(|| async { ([(header::CONTENT_TYPE, "text/javascript; charset=utf-8")], APP_JS) }))
        .route("/style.css", get(|| async { ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE_CSS) }))
}
