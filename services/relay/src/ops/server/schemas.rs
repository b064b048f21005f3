//! Schema pieces the handlers' OpenAPI declarations share: the error
//! answer, and the names an enum bound to SQL stores.

use relay_core::PoisonClass;
use relay_store::intents::IntentState;
use relay_store::ops::PauseKind;
use relay_store::outbox::OutboxState;
use serde::Serialize;
use utoipa::ToSchema;

/// A text schema of `values`: the names an enum bound to SQL stores, taken
/// from the enum so the description lists what the handler parses.
pub(super) fn one_of(values: impl IntoIterator<Item = &'static str>) -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(values.into_iter().collect::<Vec<_>>()))
        .build()
}

pub(super) fn pause_kinds() -> utoipa::openapi::Object {
    one_of(PauseKind::ALL.map(PauseKind::as_str))
}

pub(super) fn intent_states() -> utoipa::openapi::Object {
    one_of(IntentState::ALL.map(IntentState::as_str))
}

pub(super) fn poison_classes() -> utoipa::openapi::Object {
    one_of(PoisonClass::ALL.map(PoisonClass::as_str))
}

pub(super) fn outbox_states() -> utoipa::openapi::Object {
    one_of(OutboxState::ALL.map(OutboxState::as_str))
}

/// What every failed `/api` call answers (`ApiError::into_response`).
#[derive(Serialize, ToSchema)]
pub(super) struct ErrorBody {
    /// What went wrong and, where there is one, what to do about it.
    pub(super) error: String,
}
