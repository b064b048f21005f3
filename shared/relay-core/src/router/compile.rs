//! Routes compiled once at load: their templates parsed, their actions
//! checked, so that rendering an event does no parsing.

use super::{CompiledAction, CompiledCall, CompiledEmit, CompiledOutcome, CompiledSaga};
use crate::config::{ActionConfig, EmitAction, OutcomeConfig, SagaAction};
use crate::effects::{EmitSpec, Plan, SagaMove};
use crate::template::TemplateBuilder;

/// What a plan may hold, whoever made it (templates check as they render;
/// a code handler's values are checked here): keys and ids bounded and free
/// of control characters and not blank, paths and headers free of control
/// characters, header names HTTP tokens. A request that could not be built
/// would otherwise die unsent and fire `on_dead`.
pub(super) fn check_plan(plan: &Plan) -> Result<(), String> {
    let key = |what: String, v: &str| {
        if crate::limits::is_blank(v) {
            return Err(format!("{what} is empty"));
        }
        crate::limits::check_key(&what, v)
    };
    let emits = |at: &str, emits: &[EmitSpec]| -> Result<(), String> {
        for e in emits {
            if let Some(k) = &e.key {
                key(format!("{at}emit {:?} key", e.action), k)?;
            }
        }
        Ok(())
    };
    let sagas = |at: &str, sagas: &[SagaMove]| -> Result<(), String> {
        sagas.iter().try_for_each(|m| key(format!("{at}saga move {:?} id", m.action), &m.saga_id))
    };
    sagas("", &plan.sagas)?;
    emits("", &plan.emits)?;
    for c in &plan.calls {
        let at = format!("call {:?}", c.action);
        crate::limits::check_controls(&format!("{at} path"), &c.path)?;
        for (name, value) in &c.headers {
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)) {
                return Err(format!("{at} has a header name that is not an HTTP token"));
            }
            if let Some((_, ch)) = crate::limits::control_char(value).filter(|(_, ch)| *ch != '\t') {
                return Err(format!(
                    "{at} header {name:?} contains the control character U+{:04X}, which an HTTP header cannot carry",
                    u32::from(ch)
                ));
            }
        }
        for (what, k) in [("idempotency key", &c.idempotency_key), ("ordering key", &c.ordering_key)] {
            let Some(k) = k else { continue };
            key(format!("{at} {what}"), k)?;
            if k.starts_with(crate::ids::APP_KEY_PREFIX) {
                return Err(format!(
                    "{at} {what} starts with {:?}, which only keys applications give relay.call start with",
                    crate::ids::APP_KEY_PREFIX
                ));
            }
        }
        if let Some(k) = &c.fairness_key {
            key(format!("{at} fairness key"), k)?;
        }
        for (label, o) in [("on_success", &c.on_success), ("on_dead", &c.on_dead)] {
            emits(&format!("{at} {label} "), &o.emit)?;
            sagas(&format!("{at} {label} "), &o.saga)?;
        }
    }
    Ok(())
}

pub(super) fn compile_emit(b: &mut TemplateBuilder, at: &str, e: &EmitAction) -> CompiledEmit {
    CompiledEmit {
        name: e.name.clone(),
        event_type: e.event_type.clone(),
        topic: e.topic.clone(),
        key: e.key.as_ref().map(|k| b.key(&format!("{at}.key"), k)),
        subject: e.subject.as_ref().map(|k| b.text(&format!("{at}.subject"), k)),
        data: e.data.as_ref().map(|d| b.json(&format!("{at}.data"), d)),
        ordered: e.ordered,
    }
}

pub(super) fn compile_saga(b: &mut TemplateBuilder, at: &str, s: &SagaAction) -> CompiledSaga {
    CompiledSaga {
        name: s.name.clone(),
        saga_type: s.saga.clone(),
        id: b.key(&format!("{at}.id"), &s.id),
        from: s.from.clone(),
        to: s.to.clone(),
        start: s.start,
    }
}

pub(super) fn compile_outcome(b: &mut TemplateBuilder, at: &str, o: &OutcomeConfig) -> CompiledOutcome {
    CompiledOutcome {
        emit: o.emit.iter().enumerate().map(|(i, e)| compile_emit(b, &format!("{at}.emit[{i}]"), e)).collect(),
        saga: o.saga.iter().enumerate().map(|(i, s)| compile_saga(b, &format!("{at}.saga[{i}]"), s)).collect(),
    }
}

pub(super) fn compile_action(b: &mut TemplateBuilder, at: &str, a: &ActionConfig) -> CompiledAction {
    match a {
        ActionConfig::Emit(e) => CompiledAction::Emit(compile_emit(b, at, e)),
        ActionConfig::Saga(s) => CompiledAction::Saga(compile_saga(b, at, s)),
        ActionConfig::Call(c) => CompiledAction::Call(CompiledCall {
            name: c.name.clone(),
            endpoint: c.endpoint.clone(),
            method: c.method.to_ascii_uppercase(),
            path: b.path(&format!("{at}.path"), &c.path),
            body: c.body.as_ref().map(|d| b.json(&format!("{at}.body"), d)),
            headers: c.headers.iter().map(|(k, v)| (k.clone(), b.header(&format!("{at}.headers.{k}"), v))).collect(),
            idempotency_key: c.idempotency_key.as_ref().map(|k| b.key(&format!("{at}.idempotency_key"), k)),
            ordering_key: c.ordering_key.as_ref().map(|k| b.key(&format!("{at}.ordering_key"), k)),
            fairness_key: c.fairness_key.as_ref().map(|k| b.key(&format!("{at}.fairness_key"), k)),
            on_success: b.with_answer(|b| compile_outcome(b, &format!("{at}.on_success"), &c.on_success)),
            on_dead: compile_outcome(b, &format!("{at}.on_dead"), &c.on_dead),
        }),
    }
}
