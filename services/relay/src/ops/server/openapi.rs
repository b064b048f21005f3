//! The OpenAPI description, built from the handlers' declarations: one
//! `routes!` per handler registers it at the path its `#[utoipa::path]`
//! documents.

use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::Shared;
use super::schemas::ErrorBody;
// Globs: `routes!` names the `__path_…` type `#[utoipa::path]` generates
// beside each handler, which importing the handler by name does not bring in.
use super::{dead_letters::*, intents::*, outbox::*, overview::*, pauses::*, probes::*};

/// The operator API's routes and their OpenAPI description, from one
/// declaration: `routes!` registers each handler at the path its
/// `#[utoipa::path]` documents, so the description cannot name a route that
/// is not served or miss one that is. [`router`] puts them all behind one
/// bearer-token check.
pub(super) fn api_parts() -> (Router<Shared>, utoipa::openapi::OpenApi) {
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
pub(super) fn common_responses(doc: &mut utoipa::openapi::OpenApi) {
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
pub(super) async fn openapi() -> impl IntoResponse {
    // Built once: it is the same for the life of the process.
    static DOC: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ([(header::CONTENT_TYPE, "application/json")], DOC.get_or_init(openapi_json).as_str())
}

/// The probes, `/metrics` and this description, declared the same way;
/// they answer without the token.
pub(super) fn probe_parts() -> (Router<Shared>, utoipa::openapi::OpenApi) {
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
pub(super) struct ApiDoc;

/// The bearer scheme every `/api` route requires.
pub(super) struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        doc.components.get_or_insert_with(Default::default).add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
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
