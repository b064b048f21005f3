//! Routes compiled once at start, then applied to every record: decode,
//! find the route, resolve guard fields, validate the data, render the plan.
//!
//! Everything here is pure (no I/O) and deterministic for a given record and
//! configuration, so a permanent failure here is permanent for that record:
//! it is dead-lettered, never retried.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use serde_json::{Value, json};

use crate::config::{EndpointConfig, RelayConfig};
use crate::effects::{
    CallSpec, Effects, EmitSpec, Intent, NewIntent, Outcome, Plan, Provenance, SagaMove, encode_event,
};
use crate::envelope::{
    DecodeOptions, FieldOverrides, InputEvent, Poison, PoisonClass, RawRecord, TopicFormat, decode, resolve,
};
use crate::ids::{KeySpace, derived_id};
use crate::template::{CompileError, JsonTemplate, TemplateBuilder, Templates, TextTemplate, context};

mod compile;
mod schema_errors;

use compile::{check_plan, compile_action};
pub use schema_errors::schema_failure;

/// A route ready to apply.
#[derive(Debug)]
pub struct CompiledRoute {
    /// Route name (logs, metrics).
    pub name: String,
    /// Guard field sources (route over topic level).
    pub fields: FieldOverrides,
    /// Version guard on.
    pub version_guard: bool,
    /// Sequence guard on.
    pub sequence_guard: bool,
    /// Business counter.
    pub counter: Option<String>,
    /// Code handler to run.
    pub handler: Option<String>,
    /// What its dead intents do to their ordering keys.
    pub on_poison: crate::config::OnPoison,
    schema: Option<Arc<jsonschema::Validator>>,
    actions: Vec<CompiledAction>,
}

#[derive(Debug)]
enum CompiledAction {
    Call(CompiledCall),
    Emit(CompiledEmit),
    Saga(CompiledSaga),
}

#[derive(Debug)]
struct CompiledCall {
    name: String,
    endpoint: String,
    method: String,
    path: TextTemplate,
    body: Option<JsonTemplate>,
    headers: Vec<(String, TextTemplate)>,
    idempotency_key: Option<TextTemplate>,
    ordering_key: Option<TextTemplate>,
    fairness_key: Option<TextTemplate>,
    on_success: CompiledOutcome,
    on_dead: CompiledOutcome,
}

#[derive(Debug, Default)]
struct CompiledOutcome {
    emit: Vec<CompiledEmit>,
    saga: Vec<CompiledSaga>,
}

#[derive(Debug)]
struct CompiledEmit {
    name: String,
    event_type: String,
    topic: String,
    key: Option<TextTemplate>,
    subject: Option<TextTemplate>,
    data: Option<JsonTemplate>,
    ordered: bool,
}

#[derive(Debug)]
struct CompiledSaga {
    name: String,
    saga_type: String,
    id: TextTemplate,
    from: Vec<String>,
    to: String,
    start: bool,
}

/// What routing a record gave.
#[derive(Debug)]
pub enum Routed<'a> {
    /// A route applies.
    Route(&'a CompiledRoute, InputEvent),
    /// No route for this type and the consumer is not strict: record and skip.
    Unrouted(InputEvent),
    /// The route is paused: the record waits, whatever else is wrong with it
    /// (its guard fields are not resolved nor its data validated yet).
    Paused(&'a CompiledRoute, InputEvent),
}

/// The compiled routing table of one consumer.
#[derive(Debug)]
pub struct Router {
    consumer: String,
    source: String,
    strict: bool,
    max_record_bytes: usize,
    dead_letter_topic: Option<String>,
    topics: BTreeMap<String, (TopicFormat, FieldOverrides)>,
    routes: HashMap<(String, String), CompiledRoute>,
    /// (topic, route name) of the routes with `on_poison = "hold_key"`.
    holding: std::collections::HashSet<(String, String)>,
    endpoints: BTreeMap<String, EndpointConfig>,
    /// Each endpoint's profile, resolved once (a key it refuses is refused at ingest).
    profiles: HashMap<String, crate::profile::Profile>,
    templates: Templates,
    /// Defects put back on purpose (tests only; all off otherwise).
    sabotage: crate::sabotage::Sabotaged,
    /// The encoders of topics written with a `format`; `None`: not given
    /// (a router that only routes, as `relay verify`'s).
    encoders: Option<Encoders>,
}

/// The encoders of the topics a router's emits write with a `format`, by
/// topic (every emit to one topic writes one format: configuration
/// checks it, and a code handler's emits to it are encoded the same way).
pub type Encoders = HashMap<String, std::sync::Arc<dyn crate::effects::DataEncoder>>;

/// The data of `emit` encoded with the encoder of its topic in
/// `encoders`; none if its topic has none. The error names the emit and
/// the schema, never a value.
pub fn encode_with(encoders: &Encoders, emit: &EmitSpec) -> Result<Option<crate::effects::EncodedData>, String> {
    let Some(encoder) = encoders.get(&emit.topic) else { return Ok(None) };
    let bytes = encoder
        .encode(&emit.data)
        .map_err(|why| format!("the data of emit {:?} does not fit {}: {why}", emit.action, encoder.describe()))?;
    Ok(Some(crate::effects::EncodedData { bytes, content_type: encoder.content_type().to_owned() }))
}

/// Routes could not be compiled.
#[derive(Debug, thiserror::Error)]
#[error("routes are invalid:\n  - {}", .0.join("\n  - "))]
pub struct RouterError(pub Vec<String>);

impl Router {
    /// Compile every route of `cfg` (templates and schemas); every error at once.
    pub fn new(cfg: &RelayConfig) -> Result<Router, RouterError> {
        Router::build(cfg, TemplateBuilder::default())
    }

    /// [`Router::new`] with the defects of `sabotage` put back in its templates
    /// (null and empty values let through, say): deliberately wrong, for the tests that
    /// prove the checks catch it (`RELAY_SABOTAGE=null-as-text`; only with
    /// the `sabotage` feature).
    #[cfg(feature = "sabotage")]
    pub fn sabotaged(cfg: &RelayConfig, sabotage: crate::sabotage::Sabotaged) -> Result<Router, RouterError> {
        let mut router = Router::build(cfg, TemplateBuilder::default().sabotaged(sabotage))?;
        router.sabotage = sabotage;
        Ok(router)
    }

    fn build(cfg: &RelayConfig, mut b: TemplateBuilder) -> Result<Router, RouterError> {
        let mut problems = Vec::new();
        let topics: BTreeMap<_, _> =
            cfg.topics.iter().map(|(k, t)| (k.clone(), (t.format, t.fields.clone()))).collect();
        let mut routes = HashMap::new();
        for (i, r) in cfg.routes.iter().enumerate() {
            let at = format!("routes[{i}]");
            let topic_fields = topics.get(&r.topic).map(|(_, f)| f.clone()).unwrap_or_default();
            let schema = match (&r.schema_document, &r.schema) {
                (Some(doc), path) => match jsonschema::validator_for(doc) {
                    Ok(v) => Some(Arc::new(v)),
                    Err(e) => {
                        let file = path.as_ref().map(|p| format!("{} ", p.display())).unwrap_or_default();
                        problems.push(format!("{at}.schema: {file}is not a valid JSON Schema: {e}"));
                        None
                    }
                },
                (None, Some(path)) => {
                    problems.push(format!(
                        "{at}.schema: {} was not read (relay::config::read_schemas reads the files)",
                        path.display()
                    ));
                    None
                }
                (None, None) => None,
            };
            let actions = r
                .actions
                .iter()
                .enumerate()
                .map(|(j, a)| compile_action(&mut b, &format!("{at}.actions[{j}]"), a))
                .collect();
            routes.insert(
                (r.topic.clone(), r.event_type.clone()),
                CompiledRoute {
                    name: r.display_name(),
                    fields: r.fields.or(&topic_fields),
                    version_guard: r.version_guard,
                    sequence_guard: r.sequence_guard,
                    counter: r.counter.clone(),
                    handler: r.handler.clone(),
                    on_poison: r.on_poison,
                    schema,
                    actions,
                },
            );
        }
        let templates = match b.finish() {
            Ok(t) => Some(t),
            Err(errs) => {
                problems.extend(errs.iter().map(CompileError::to_string));
                None
            }
        };
        match templates {
            Some(templates) if problems.is_empty() => Ok(Router {
                holding: routes
                    .iter()
                    .filter(|(_, r)| r.on_poison == crate::config::OnPoison::HoldKey)
                    .map(|((topic, _), r)| (topic.clone(), r.name.clone()))
                    .collect(),
                consumer: cfg.consumer.name.clone(),
                source: cfg.consumer.source(),
                strict: cfg.consumer.strict,
                max_record_bytes: cfg.consumer.max_record_bytes,
                dead_letter_topic: cfg.consumer.dead_letter_topic.clone(),
                topics,
                routes,
                endpoints: cfg.endpoints.clone(),
                profiles: cfg.endpoints.iter().map(|(n, e)| (n.clone(), e.profile())).collect(),
                templates,
                sabotage: Default::default(),
                encoders: None,
            }),
            _ => Err(RouterError(problems)),
        }
    }

    /// The consumer name (inbox namespace).
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The largest input record accepted (`consumer.max_record_bytes`).
    pub fn max_record_bytes(&self) -> usize {
        self.max_record_bytes
    }

    /// Where dead-letter copies go, if anywhere.
    pub fn dead_letter_topic(&self) -> Option<&str> {
        self.dead_letter_topic.as_deref()
    }

    /// Whether a route on `topic` holds keys (`on_poison = "hold_key"`): a
    /// batch of the topic then looks up which of its keys are held.
    pub fn holds_keys_on(&self, topic: &str) -> bool {
        self.holding.iter().any(|(t, _)| t == topic)
    }

    /// Whether a record of `topic` dead-lettered on route `route` holds its
    /// Kafka key. A record that could not be routed (unreadable, no type)
    /// may be one of any route's, so it holds its key where any route on its
    /// topic does.
    pub fn holds_key(&self, topic: &str, route: Option<&str>) -> bool {
        let Some(route) = route else { return self.holds_keys_on(topic) };
        self.holding.iter().any(|(t, r)| t == topic && r == route)
    }

    /// The endpoint named `name`.
    pub fn endpoint(&self, name: &str) -> Option<&EndpointConfig> {
        self.endpoints.get(name)
    }

    /// The same router, encoding the emits to each topic of `encoders`
    /// with its encoder: one for every topic of
    /// [`RelayConfig::emit_formats`] (`relay::app` makes them all or fails
    /// the start).
    pub fn with_encoders(mut self, encoders: Encoders) -> Router {
        self.encoders = Some(encoders);
        self
    }

    /// The encoders [`Router::with_encoders`] gave (none if not given):
    /// what encodes an outcome's events when its call is done.
    pub fn encoders(&self) -> Encoders {
        self.encoders.clone().unwrap_or_default()
    }

    /// How the records of `topic` are encoded.
    pub fn topic_format(&self, topic: &str) -> TopicFormat {
        self.topics.get(topic).map_or(TopicFormat::Cloudevents, |(f, _)| *f)
    }

    /// Decode and route a record.
    pub fn route<'a>(&'a self, record: &RawRecord) -> Result<Routed<'a>, Poison> {
        self.route_unless_paused(record, |_| false)
    }

    /// Decode and route a record; a record of a route `paused` says is
    /// paused is [`Routed::Paused`] before its fields are resolved and its
    /// data validated, so an operator who pauses a route to fix its schema
    /// or field sources gets its events held, not dead-lettered.
    pub fn route_unless_paused<'a>(
        &'a self,
        record: &RawRecord,
        paused: impl Fn(&CompiledRoute) -> bool,
    ) -> Result<Routed<'a>, Poison> {
        let default = (TopicFormat::Cloudevents, FieldOverrides::default());
        let (format, topic_fields) = self.topics.get(&record.topic).unwrap_or(&default);
        let opts = DecodeOptions { max_record_bytes: self.max_record_bytes, format: *format, fields: topic_fields };
        let decoded = decode(record, &opts)?;
        let key = (record.topic.clone(), decoded.event_type.clone());
        let Some(route) = self.routes.get(&key) else {
            if self.strict {
                return Err(Poison::new(
                    PoisonClass::UnknownType,
                    format!(
                        "no route for type {:?} on topic {:?} and consumer.strict = true",
                        decoded.event_type, record.topic
                    ),
                )
                .with_identity(Some(&decoded.id), Some(&decoded.event_type)));
            }
            return Ok(Routed::Unrouted(resolve(record, decoded, topic_fields)?));
        };
        if paused(route) {
            return Ok(Routed::Paused(route, decoded));
        }
        #[cfg_attr(not(feature = "sabotage"), allow(unused_mut))]
        let mut event = resolve(record, decoded, &route.fields)?;
        #[cfg(feature = "sabotage")]
        if self.sabotage.has(crate::sabotage::Sabotage::BlankKeysAsKeys) && event.idempotency_key.is_none() {
            event.idempotency_key = event.extensions.get("idempotencykey").cloned();
        }
        if let Some(schema) = &route.schema {
            let errors: Vec<String> = schema.iter_errors(&event.data).take(5).map(|e| schema_failure(&e)).collect();
            if !errors.is_empty() {
                return Err(Poison::new(
                    PoisonClass::SchemaInvalid,
                    format!("data does not match the schema of route {}: {}", route.name, errors.join("; ")),
                )
                .with_identity(Some(&event.id), Some(&event.event_type)));
            }
        }
        if route.version_guard && (event.aggregate_id.is_none() || event.aggregate_version.is_none()) {
            return Err(missing_guard_field(route, &event, "version_guard", "aggregate id and version"));
        }
        if route.sequence_guard && (event.aggregate_id.is_none() || event.sequence.is_none()) {
            return Err(missing_guard_field(route, &event, "sequence_guard", "aggregate id and sequence"));
        }
        Ok(Routed::Route(route, event))
    }

    /// The route at index `i` of the configuration's `routes`, and every
    /// variable path its templates read (for `relay check-config --explain`).
    pub fn route_at(&self, cfg: &crate::RelayConfig, i: usize) -> Option<(&CompiledRoute, BTreeSet<String>)> {
        let r = cfg.routes.get(i)?;
        let route = self.routes.get(&(r.topic.clone(), r.event_type.clone()))?;
        Some((route, self.templates.paths_read(&format!("routes[{i}]."))))
    }

    /// The template context of an event.
    pub fn context(&self, event: &InputEvent, record: &RawRecord) -> Value {
        let s = |v: &Option<String>| v.as_ref().map(|v| json!(v));
        context(BTreeMap::from([
            ("consumer", Some(json!(self.consumer))),
            ("id", Some(json!(event.id))),
            ("type", Some(json!(event.event_type))),
            ("source", Some(json!(event.source))),
            ("subject", s(&event.subject)),
            ("time", event.time.map(|t| json!(t.to_rfc3339()))),
            ("data", Some(event.data.clone())),
            ("extensions", Some(json!(event.extensions))),
            ("aggregate_id", s(&event.aggregate_id)),
            ("aggregate_version", event.aggregate_version.map(|v| json!(v))),
            ("sequence", event.sequence.map(|v| json!(v))),
            ("idempotency_key", s(&event.idempotency_key)),
            ("correlation_id", s(&event.correlation_id)),
            ("causation_id", s(&event.causation_id)),
            ("traceparent", s(&event.traceparent)),
            ("topic", Some(json!(record.topic))),
            ("partition", Some(json!(record.partition))),
            ("offset", Some(json!(record.offset))),
        ]))
    }

    /// Provenance of events emitted because of `event`.
    pub fn provenance(&self, event: &InputEvent) -> Provenance {
        Provenance {
            source: self.source.clone(),
            correlation_id: Some(event.correlation_id.clone().unwrap_or_else(|| event.id.clone())),
            causation_id: Some(event.id.clone()),
            traceparent: event.traceparent.clone(),
            aggregate_id: event.aggregate_id.clone(),
        }
    }

    /// What `plan` (the route's, plus a code handler's) writes for `event`:
    /// intents and outbox records with their ids derived from the consumer,
    /// the event id and the action (R7), intents' idempotency keys (the
    /// rendered one, else the intent id) and budgets from their endpoints,
    /// events encoded as CloudEvents with `prov` and `now`. A call naming an
    /// endpoint that is not configured is a permanent error.
    pub fn effects(
        &self,
        route: &CompiledRoute,
        event: &InputEvent,
        plan: Plan,
        prov: &Provenance,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<Effects, Poison> {
        let consumer = self.consumer();
        let checked =
            if self.sabotage.has(crate::sabotage::Sabotage::ControlsUnchecked) { Ok(()) } else { check_plan(&plan) };
        checked.map_err(|why| {
            Poison::new(PoisonClass::TemplateError, why).with_identity(Some(&event.id), Some(&event.event_type))
        })?;
        let hold = route.on_poison == crate::config::OnPoison::HoldKey;
        let mut plan = plan;
        // An outcome's events are encoded when its call is done (by the
        // completer, from the data it then has): nothing encoded is stored
        // with the intent. Data that does not read the provider's answer is
        // final now, so a misfit is refused here, before any call is made.
        for call in &mut plan.calls {
            for (label, outcome) in [("on_success", &mut call.on_success), ("on_dead", &mut call.on_dead)] {
                let Outcome { emit, deferred, .. } = outcome;
                for (i, e) in emit.iter_mut().enumerate() {
                    e.encoded = None;
                    let at = format!("/emit/{i}/data");
                    if deferred.iter().any(|d| d.at == at || d.at.starts_with(&format!("{at}/"))) {
                        continue;
                    }
                    self.encode(e).map_err(|why| {
                        Poison::new(PoisonClass::SchemaInvalid, format!("call {:?} {label}: {why}", call.action))
                            .with_identity(Some(&event.id), Some(&event.event_type))
                    })?;
                }
            }
        }
        let intents = plan.calls.iter().map(|call| self.intent(event, call, prov, hold)).collect::<Result<_, _>>()?;
        for emit in &mut plan.emits {
            emit.encoded = self.encode(emit).map_err(|why| {
                Poison::new(PoisonClass::SchemaInvalid, why).with_identity(Some(&event.id), Some(&event.event_type))
            })?;
        }
        let events = plan
            .emits
            .iter()
            .map(|emit| encode_event(derived_id(consumer, &event.id, &emit.action), emit, prov, KeySpace::Routes, now))
            .collect();
        Ok(Effects { sagas: plan.sagas, intents, events, counter: route.counter.clone() })
    }

    fn intent(&self, event: &InputEvent, call: &CallSpec, prov: &Provenance, hold: bool) -> Result<NewIntent, Poison> {
        let consumer = self.consumer();
        let endpoint = self.endpoint(&call.endpoint).ok_or_else(|| {
            Poison::new(
                PoisonClass::Rejected,
                format!("call {:?} names unknown endpoint {:?}", call.action, call.endpoint),
            )
            .with_identity(Some(&event.id), Some(&event.event_type))
        })?;
        let id = derived_id(consumer, &event.id, &call.action);
        let idempotency_key = call.idempotency_key.clone().unwrap_or_else(|| id.to_string());
        // A key the provider would refuse is refused now, with the event in
        // hand, rather than as a dead intent after the consumer moved on.
        let profile = self.profiles.get(&call.endpoint);
        let body_not_object = matches!(profile.map(|p| &p.key), Some(crate::profile::KeyPlacement::BodyField(_)))
            && call.body.as_ref().is_some_and(|b| !b.is_object());
        if body_not_object {
            let why = format!(
                "call {:?} to endpoint {:?}: its profile puts the idempotency key in a body field, but the body \
                 is not a JSON object",
                call.action, call.endpoint
            );
            return Err(Poison::new(PoisonClass::Rejected, why).with_identity(Some(&event.id), Some(&event.event_type)));
        }
        if let Some(why) = profile.and_then(|p| p.key_refused(&idempotency_key)) {
            let why = format!("call {:?} to endpoint {:?}: {why}", call.action, call.endpoint);
            return Err(Poison::new(PoisonClass::Rejected, why).with_identity(Some(&event.id), Some(&event.event_type)));
        }
        let to_json = |v: &Outcome| serde_json::to_value(v).unwrap_or_default();
        let intent = Intent {
            consumer: consumer.to_owned(),
            source_event_id: event.id.clone(),
            action: call.action.clone(),
            endpoint: call.endpoint.clone(),
            method: call.method.clone(),
            path: call.path.clone(),
            body: call.body.clone(),
            headers: json!(call.headers),
            idempotency_key,
            ordering_key: call.ordering_key.clone(),
            holds_key: hold && call.ordering_key.is_some(),
            fairness_key: call.fairness_key.clone(),
            max_attempts: i32::try_from(endpoint.max_attempts).unwrap_or(i32::MAX),
            on_success: to_json(&call.on_success),
            on_dead: to_json(&call.on_dead),
            emit_source: prov.source.clone(),
            aggregate_id: prov.aggregate_id.clone(),
            correlation_id: prov.correlation_id.clone(),
            causation_id: prov.causation_id.clone(),
            traceparent: prov.traceparent.clone(),
        };
        let fair_spacing = match (&intent.fairness_key, endpoint.fair_share_per_second) {
            (None, _) => None,
            (Some(_), Some(rate)) => Some(std::time::Duration::from_secs_f64(1.0 / rate)),
            (Some(_), None) => {
                let why = format!(
                    "call {:?} has a fairness key, but endpoint {:?} has no fair_share_per_second to spread its \
                     calls at",
                    call.action, call.endpoint
                );
                return Err(
                    Poison::new(PoisonClass::Rejected, why).with_identity(Some(&event.id), Some(&event.event_type))
                );
            }
        };
        Ok(NewIntent { id, intent, max_age: endpoint.max_age, fair_spacing })
    }

    /// Render the route's actions for `event`. A template that cannot be
    /// rendered is a permanent error naming the template and the field.
    pub fn plan(&self, route: &CompiledRoute, event: &InputEvent, record: &RawRecord) -> Result<Plan, Poison> {
        let ctx = crate::template::Context::from(self.context(event, record));
        let poison = |e: crate::template::RenderError| {
            Poison::new(PoisonClass::TemplateError, e.0).with_identity(Some(&event.id), Some(&event.event_type))
        };
        let mut plan = Plan::default();
        let mut none = Vec::new();
        for a in &route.actions {
            match a {
                // Nothing here reads the provider's answer: `none` stays empty.
                CompiledAction::Saga(s) => plan.sagas.push(self.render_saga(s, &ctx, "", &mut none).map_err(poison)?),
                CompiledAction::Emit(e) => plan.emits.push(self.render_emit(e, &ctx, "", &mut none).map_err(poison)?),
                CompiledAction::Call(c) => plan.calls.push(self.render_call(c, &ctx).map_err(poison)?),
            }
        }
        Ok(plan)
    }

    /// The data of `emit` encoded with its topic's schema, when this router
    /// was given encoders and its topic has one; otherwise none, whatever
    /// the plan said (a handler's bytes are never published as given).
    fn encode(&self, emit: &EmitSpec) -> Result<Option<crate::effects::EncodedData>, String> {
        self.encoders.as_ref().map_or(Ok(None), |encoders| encode_with(encoders, emit))
    }

    /// Render a text template of an outcome effect, or when it reads the
    /// provider's answer keep it in `deferred` for pointer `at`, its source
    /// standing in its place meanwhile.
    fn render_or_defer(
        &self,
        t: &TextTemplate,
        ctx: &crate::template::Context,
        at: String,
        deferred: &mut Vec<crate::template::Deferred>,
    ) -> Result<String, crate::template::RenderError> {
        if !self.templates.reads_answer(t) {
            return self.templates.render(t, ctx);
        }
        let d = self.templates.defer(t, false, at, ctx)?;
        let placeholder = d.source.clone();
        deferred.push(d);
        Ok(placeholder)
    }

    /// Render saga move `s`; `at`, `deferred`: as for [`Router::render_emit`].
    fn render_saga(
        &self,
        s: &CompiledSaga,
        ctx: &crate::template::Context,
        at: &str,
        deferred: &mut Vec<crate::template::Deferred>,
    ) -> Result<SagaMove, crate::template::RenderError> {
        Ok(SagaMove {
            action: s.name.clone(),
            saga_type: s.saga_type.clone(),
            saga_id: self.render_or_defer(&s.id, ctx, format!("{at}/saga_id"), deferred)?,
            from: s.from.clone(),
            to: s.to.clone(),
            start: s.start,
        })
    }

    /// Render emit `e`. Values that read the provider's answer (only a
    /// call's `on_success` has one: any other template reading it fails to
    /// compile) go to `deferred`, at pointers under `at`.
    fn render_emit(
        &self,
        e: &CompiledEmit,
        ctx: &crate::template::Context,
        at: &str,
        deferred: &mut Vec<crate::template::Deferred>,
    ) -> Result<EmitSpec, crate::template::RenderError> {
        let t = &self.templates;
        Ok(EmitSpec {
            action: e.name.clone(),
            event_type: e.event_type.clone(),
            topic: e.topic.clone(),
            key: e.key.as_ref().map(|k| self.render_or_defer(k, ctx, format!("{at}/key"), deferred)).transpose()?,
            subject: e
                .subject
                .as_ref()
                .map(|k| self.render_or_defer(k, ctx, format!("{at}/subject"), deferred))
                .transpose()?,
            data: match &e.data {
                Some(d) => t.render_json_deferring(d, ctx, &format!("{at}/data"), deferred)?,
                None => ctx.json().get("data").cloned().unwrap_or(Value::Null),
            },
            ordered: e.ordered,
            encoded: None,
        })
    }

    /// Render a call's outcome effects, keeping the values that read the
    /// provider's answer for when the call succeeds ([`Outcome::deferred`]).
    fn render_outcome(
        &self,
        o: &CompiledOutcome,
        ctx: &crate::template::Context,
    ) -> Result<Outcome, crate::template::RenderError> {
        let mut deferred = Vec::new();
        let mut emit = Vec::with_capacity(o.emit.len());
        for (i, e) in o.emit.iter().enumerate() {
            emit.push(self.render_emit(e, ctx, &format!("/emit/{i}"), &mut deferred)?);
        }
        let mut saga = Vec::with_capacity(o.saga.len());
        for (i, s) in o.saga.iter().enumerate() {
            saga.push(self.render_saga(s, ctx, &format!("/saga/{i}"), &mut deferred)?);
        }
        Ok(Outcome { emit, saga, deferred })
    }

    fn render_call(
        &self,
        c: &CompiledCall,
        ctx: &crate::template::Context,
    ) -> Result<CallSpec, crate::template::RenderError> {
        let t = &self.templates;
        Ok(CallSpec {
            action: c.name.clone(),
            endpoint: c.endpoint.clone(),
            method: c.method.clone(),
            path: t.render(&c.path, ctx)?,
            body: c.body.as_ref().map(|b| t.render_json(b, ctx)).transpose()?,
            headers: c
                .headers
                .iter()
                .map(|(k, v)| Ok((k.clone(), t.render(v, ctx)?)))
                .collect::<Result<_, crate::template::RenderError>>()?,
            idempotency_key: c.idempotency_key.as_ref().map(|k| t.render(k, ctx)).transpose()?,
            ordering_key: c.ordering_key.as_ref().map(|k| t.render(k, ctx)).transpose()?,
            fairness_key: c.fairness_key.as_ref().map(|k| t.render(k, ctx)).transpose()?,
            on_success: self.render_outcome(&c.on_success, ctx)?,
            on_dead: self.render_outcome(&c.on_dead, ctx)?,
        })
    }
}

fn missing_guard_field(route: &CompiledRoute, event: &InputEvent, guard: &str, what: &str) -> Poison {
    Poison::new(PoisonClass::BadField, format!("route {} has {guard} = true but the event has no {what}", route.name))
        .with_identity(Some(&event.id), Some(&event.event_type))
}

#[cfg(test)]
mod tests {
    use super::schema_errors::keyless_path;
    use super::*;
    use crate::config::ActionConfig;
    use crate::envelope::Header;

    fn cfg(extra: &str) -> RelayConfig {
        RelayConfig::from_toml(&format!(
            r#"
            [consumer]
            name = "c"
            [endpoints.psp]
            base_url = "http://127.0.0.1:1"
            [[routes]]
            topic = "orders"
            type = "order.placed"
            [[routes.actions]]
            kind = "call"
            name = "capture"
            endpoint = "psp"
            path = "/orders/{{{{ data.order_id }}}}/capture"
            body = {{ amount = "{{{{ data.amount }}}}" }}
            idempotency_key = "cap:{{{{ data.order_id }}}}"
            [[routes.actions.on_success.emit]]
            name = "captured"
            type = "payment.captured"
            topic = "payments"
            data = {{ order = "{{{{ data.order_id }}}}" }}
            {extra}
            "#
        ))
        .unwrap()
    }

    /// What `router` writes for an `order.placed` event of `data`.
    fn effects_of(router: &Router, data: &str) -> Result<Effects, Poison> {
        let rec = record("order.placed", data);
        let Routed::Route(route, event) = router.route(&rec).unwrap() else { panic!("not routed") };
        let plan = router.plan(route, &event, &rec).unwrap();
        router.effects(route, &event, plan, &router.provenance(&event), chrono::Utc::now())
    }

    fn record(ty: &str, data: &str) -> RawRecord {
        RawRecord {
            topic: "orders".into(),
            partition: 0,
            offset: 1,
            key: None,
            payload: Some(data.as_bytes().to_vec()),
            headers: vec![
                Header::text("ce_specversion", "1.0"),
                Header::text("ce_id", "e-1"),
                Header::text("ce_type", ty),
                Header::text("ce_source", "/s"),
            ],
        }
    }

    #[test]
    fn a_routed_event_renders_its_calls_and_outcome_events() {
        let router = Router::new(&cfg("")).unwrap();
        let rec = record("order.placed", r#"{"order_id":"o-1","amount":5}"#);
        let Routed::Route(route, event) = router.route(&rec).unwrap() else { panic!("not routed") };
        let plan = router.plan(route, &event, &rec).unwrap();
        assert_eq!(plan.calls.len(), 1);
        let call = &plan.calls[0];
        assert_eq!(call.path, "/orders/o-1/capture");
        assert_eq!(call.body, Some(json!({"amount": 5})));
        assert_eq!(call.idempotency_key.as_deref(), Some("cap:o-1"));
        assert_eq!(call.on_success.emit[0].data, json!({"order": "o-1"}));
    }

    #[test]
    fn a_route_s_call_never_renders_a_key_in_the_applications_key_space() {
        let extra = r#"
            [[routes.actions]]
            kind = "call"
            name = "note"
            endpoint = "psp"
            path = "/notes"
            idempotency_key = "{{ data.order_id }}"
            ordering_key = "{{ data.customer }}"
        "#;
        let router = Router::new(&cfg(extra)).unwrap();
        assert!(effects_of(&router, r#"{"order_id":"o-1","customer":"c-1","amount":5}"#).is_ok());
        for (data, what) in [
            (r#"{"order_id":"app:o-1","customer":"c-1","amount":5}"#, "idempotency key"),
            (r#"{"order_id":"o-1","customer":"app:c-1","amount":5}"#, "ordering key"),
        ] {
            let poison = effects_of(&router, data).unwrap_err();
            assert!(poison.reason.contains(what) && poison.reason.contains("\"app:\""), "{}", poison.reason);
        }
    }

    /// Takes data whose `order` is text and whose `payment`, if any,
    /// starts with `pi_`: a schema's stand-in.
    #[derive(Debug)]
    struct StandIn;

    impl crate::effects::DataEncoder for StandIn {
        fn encode(&self, data: &Value) -> Result<Vec<u8>, String> {
            if !data["order"].is_string() {
                return Err("/order is not a string".into());
            }
            if data.get("payment").is_some_and(|p| !p.as_str().is_some_and(|p| p.starts_with("pi_"))) {
                return Err("/payment is not a payment id".into());
            }
            Ok(serde_json::to_vec(data).unwrap())
        }
        fn content_type(&self) -> &str {
            "application/x-stand-in"
        }
        fn describe(&self) -> String {
            "the stand-in schema".into()
        }
    }

    #[test]
    fn an_outcome_event_whose_data_is_final_is_checked_against_its_schema_at_ingest() {
        let extra = r#"
            [[routes.actions.on_success.emit]]
            name = "recorded"
            type = "payment.recorded"
            topic = "payments"
            data = { order = "{{ data.order_id }}", payment = "{{ response.body.id }}" }
            [[routes.actions.on_dead.emit]]
            name = "failed"
            type = "payment.failed"
            topic = "payments"
            data = { order = "{{ data.order_id }}" }
        "#;
        let encoders: Encoders =
            [("payments".to_owned(), Arc::new(StandIn) as Arc<dyn crate::effects::DataEncoder>)].into_iter().collect();
        let router = Router::new(&cfg(extra)).unwrap().with_encoders(encoders);
        let effects = |data: &str| effects_of(&router, data);
        // Fits: the answer's placeholder is not checked, and nothing encoded is kept with the intent.
        let ok = effects(r#"{"order_id":"o-1","amount":5}"#).unwrap();
        let stored = ok.intents[0].intent.on_success.to_string();
        assert!(stored.contains("\"payment\":null") && !stored.contains("encoded"), "{stored}");
        // Does not fit: refused before the call, naming the call, the outcome and the emit.
        let err = effects(r#"{"order_id":7,"amount":5}"#).unwrap_err();
        assert_eq!(err.class, PoisonClass::SchemaInvalid);
        assert!(
            err.reason
                .starts_with("call \"capture\" on_success: the data of emit \"captured\" does not fit the stand-in")
                && err.reason.contains("/order is not a string"),
            "{}",
            err.reason
        );
        // The completer encodes with the same encoders, now that the answer is known.
        let spec = |payment: &str| EmitSpec {
            action: "recorded".into(),
            event_type: "payment.recorded".into(),
            topic: "payments".into(),
            key: None,
            subject: None,
            data: json!({"order": "o-1", "payment": payment}),
            ordered: false,
            encoded: None,
        };
        let encoded = encode_with(&router.encoders(), &spec("pi_1")).unwrap().unwrap();
        assert_eq!(encoded.content_type, "application/x-stand-in");
        let why = encode_with(&router.encoders(), &spec("oops")).unwrap_err();
        assert!(why.contains("emit \"recorded\"") && why.contains("/payment is not a payment id"), "{why}");
    }

    #[test]
    fn a_key_the_provider_cannot_take_is_poison_at_ingest_naming_why() {
        let effects = |c: &RelayConfig| effects_of(&Router::new(c).unwrap(), r#"{"order_id":"o-1","amount":5}"#);
        // The key in a body field: fine in an object body, poison in another.
        let mut c = cfg("");
        c.endpoints.get_mut("psp").unwrap().idempotency.body_field = Some("meta.key".into());
        effects(&c).unwrap();
        let ActionConfig::Call(call) = &mut c.routes[0].actions[0] else { panic!("a call") };
        call.body = Some(json!(["not", "an", "object"]));
        let why = effects(&c).unwrap_err().reason;
        assert!(why.contains("body field") && why.contains("not a JSON object"), "{why}");
        // Longer than the provider takes.
        let mut c = cfg("");
        c.endpoints.get_mut("psp").unwrap().idempotency.max_length = Some(4);
        let why = effects(&c).unwrap_err().reason;
        assert!(why.contains("7 characters") && why.contains("at most 4"), "{why}");
    }

    #[test]
    fn on_success_values_that_read_the_answer_are_kept_with_their_event_fields_and_rendered_from_it() {
        let extra = r#"
            [[routes.actions.on_success.emit]]
            name = "with-answer"
            type = "payment.recorded"
            topic = "payments"
            key = "{{ response.body.id }}"
            subject = "{{ data.order_id }} as {{ response.body.id }}"
            data = { order = "{{ data.order_id }}", payment = "{{ response.body.id }}", fee = "{{ response.body.fee }}", status = "{{ response.status }}", line = "{{ data.order_id }}/{{ response.headers['request-id'] }}" }
            [[routes.actions.on_success.saga]]
            name = "track"
            saga = "payment"
            id = "{{ response.body.id }}"
            to = "captured"
            start = true
        "#;
        let router = Router::new(&cfg(extra)).unwrap();
        let rec = record("order.placed", r#"{"order_id":"o-1","amount":5,"secret":"not kept"}"#);
        let Routed::Route(route, event) = router.route(&rec).unwrap() else { panic!("not routed") };
        let plan = router.plan(route, &event, &rec).unwrap();
        let outcome = &plan.calls[0].on_success;
        assert_eq!(outcome.emit[0].data, json!({"order": "o-1"}), "the event-only emit is rendered at once");
        let at: Vec<&str> = outcome.deferred.iter().map(|d| d.at.as_str()).collect();
        let fields = ["/emit/1/data/fee", "/emit/1/data/line", "/emit/1/data/payment", "/emit/1/data/status"];
        assert_eq!(at, [&["/emit/1/key", "/emit/1/subject"][..], &fields, &["/saga/0/saga_id"]].concat());
        // Only the event fields the templates read are kept.
        let kept = serde_json::to_string(&outcome.deferred).unwrap();
        assert!(kept.contains("o-1") && !kept.contains("not kept"), "{kept}");

        let stored = serde_json::to_value(outcome).unwrap();
        assert!(Outcome::reads_answer(&stored));
        let answer = crate::effects::answer(
            201,
            &[("Request-Id".into(), "req_9".into())],
            br#"{"id":"pi_1","fee":12}"#,
            false,
            "call",
        );
        let done: Outcome = serde_json::from_value(Outcome::answered(&stored, &answer).unwrap()).unwrap();
        assert!(done.deferred.is_empty());
        let e = &done.emit[1];
        assert_eq!((e.key.as_deref(), e.subject.as_deref()), (Some("pi_1"), Some("o-1 as pi_1")));
        assert_eq!(e.data, json!({"order": "o-1", "payment": "pi_1", "fee": 12, "status": 201, "line": "o-1/req_9"}));
        assert_eq!(done.saga[0].saga_id, "pi_1");

        // An answer without the field, or cut short, cannot render: the reason names the field.
        let cut = crate::effects::answer(201, &[], b"{\"id\":", true, "call");
        let why = Outcome::answered(&stored, &cut).unwrap_err().0;
        assert!(why.contains("response.body"), "{why}");
        let no_id = crate::effects::answer(201, &[], br#"{"id": null}"#, false, "call");
        let why = Outcome::answered(&stored, &no_id).unwrap_err().0;
        assert!(why.contains("response.body.id") && why.contains("null"), "{why}");
    }

    #[test]
    fn a_deferred_template_is_tried_with_the_event_before_the_call() {
        let plan = |emit: &str, data: &str| {
            let extra =
                format!("[[routes.actions.on_success.emit]]\nname = \"e\"\ntype = \"t\"\ntopic = \"p\"\n{emit}\n");
            let router = Router::new(&cfg(&extra)).unwrap();
            let rec = record("order.placed", data);
            let Routed::Route(route, event) = router.route(&rec).unwrap() else { panic!("not routed") };
            router.plan(route, &event, &rec).map(|p| p.calls[0].on_success.deferred.len())
        };
        // A null in a key is refused at ingest, before the money moves.
        let err = plan(r#"key = "{{ data.order_id }}-{{ response.body.id }}""#, r#"{"order_id": null, "amount": 1}"#)
            .unwrap_err();
        assert!(err.reason.contains("data.order_id") && err.reason.contains("null"), "{}", err.reason);
        let err = plan(r#"key = "{{ data.order_id }}-{{ response.body.id }}""#, r#"{"order_id": " ", "amount": 1}"#)
            .unwrap_err();
        assert!(err.reason.contains("data.order_id"), "{}", err.reason);
        // So is a field the event does not have.
        let err = plan(r#"subject = "{{ data.missing }} {{ response.body.id }}""#, r#"{"order_id": "o", "amount": 1}"#)
            .unwrap_err();
        assert!(err.reason.contains("data.missing"), "{}", err.reason);
        // But what strict rendering lets through passes: default, tests, globals,
        // and what only the real answer can decide.
        let ok = r#"{"order_id": "o-1", "amount": 1, "discount": null}"#;
        for emit in [
            r#"subject = "{{ subject | default('order') }} paid as {{ response.body.id }}""#,
            r#"subject = "{{ response.body.id if data.discount is none else data.discount.code }}""#,
            r#"subject = "{% for i in range(2) %}{{ response.body.id }}{% endfor %}""#,
            r#"data = { cents = "{{ response.body.amount / 100 }}" }"#,
        ] {
            assert_eq!(plan(emit, ok).map_err(|e| e.reason), Ok(1), "{emit}");
        }
    }

    #[test]
    fn reading_the_answer_outside_a_call_s_on_success_is_refused_naming_the_template() {
        let on_dead = r#"
            [[routes.actions.on_dead.emit]]
            name = "failed"
            type = "payment.failed"
            topic = "payments"
            data = { payment = "{{ response.body.id }}" }
        "#;
        let err = Router::new(&cfg(on_dead)).unwrap_err().to_string();
        assert!(
            err.contains("on_dead.emit[0].data.payment") && err.contains("only the effects of a call's on_success"),
            "{err}"
        );
        let mut c = cfg("");
        let ActionConfig::Call(call) = &mut c.routes[0].actions[0] else { panic!("a call") };
        call.path = "/x/{{ response.status }}".into();
        let err = Router::new(&c).unwrap_err().to_string();
        assert!(err.contains("actions[0].path") && err.contains("`response`"), "{err}");
    }

    #[test]
    fn unknown_types_are_unrouted_unless_strict() {
        let router = Router::new(&cfg("")).unwrap();
        let rec = record("order.cancelled", "{}");
        assert!(matches!(router.route(&rec).unwrap(), Routed::Unrouted(_)));
        let strict = Router::new(&RelayConfig {
            consumer: crate::config::ConsumerConfig { strict: true, ..cfg("").consumer },
            ..cfg("")
        })
        .unwrap();
        assert_eq!(strict.route(&rec).unwrap_err().class, PoisonClass::UnknownType);
    }

    #[test]
    fn a_template_over_a_missing_field_is_poison_naming_the_field() {
        let router = Router::new(&cfg("")).unwrap();
        let rec = record("order.placed", r#"{"amount":5}"#);
        let Routed::Route(route, event) = router.route(&rec).unwrap() else { panic!("not routed") };
        let err = router.plan(route, &event, &rec).unwrap_err();
        assert_eq!(err.class, PoisonClass::TemplateError);
        assert!(err.reason.contains("data.order_id"), "{err}");
        assert_eq!(err.event_id.as_deref(), Some("e-1"));
    }

    #[test]
    fn schema_invalid_data_is_poison_with_the_failing_path() {
        let mut c = cfg("");
        c.routes[0].schema_document = Some(
            serde_json::json!({"type":"object","required":["order_id"],"properties":{"amount":{"type":"integer"}}}),
        );
        let router = Router::new(&c).unwrap();
        let rec = record("order.placed", r#"{"order_id":"o","amount":"five"}"#);
        let err = router.route(&rec).unwrap_err();
        assert_eq!(err.class, PoisonClass::SchemaInvalid);
        assert!(err.reason.contains("/amount"), "{err}");
    }

    // Reasons name the path and the rule, never the value.
    #[test]
    fn schema_reasons_never_quote_the_data() {
        let mut c = cfg("");
        c.routes[0].schema_document = Some(serde_json::json!(
            {"type":"object","required":["order_id"],"properties":{"card":{"type":"integer"},"pin":{"maxLength":2}}}
        ));
        let router = Router::new(&c).unwrap();
        let secret = "4111-1111-1111-1111";
        let direct = format!(r#"{{"card":"{secret}","pin":"{secret}"}}"#);
        // Double-encoded: the data is one JSON string holding the whole payload.
        let double = serde_json::to_string(&format!(r#"{{"order_id":"o","card":"{secret}"}}"#)).unwrap();
        for data in [direct, double] {
            let err = router.route(&record("order.placed", &data)).unwrap_err();
            assert_eq!(err.class, PoisonClass::SchemaInvalid);
            assert!(!err.reason.contains(secret) && !err.reason.contains("4111"), "{}", err.reason);
        }
        let err = router.route(&record("order.placed", &format!(r#"{{"card":"{secret}"}}"#))).unwrap_err();
        assert!(err.reason.contains("/card") && err.reason.contains("type"), "{}", err.reason);
        assert!(err.reason.contains("order_id"), "{}", err.reason);
    }

    #[test]
    fn a_schema_reason_shows_a_map_s_keys_as_stars_and_declared_names_as_they_are() {
        let schema = json!({
            "type": "object",
            "properties": {
                "meta": {"type": "object", "additionalProperties": {"type": "integer"}},
                "tags": {"patternProperties": {"^[0-9]+$": {"type": "string"}}},
                "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}}
            },
            "$defs": {"line": {"type": "object", "properties": {"sku": {"type": "string"}}}}
        });
        let v = jsonschema::validator_for(&schema).unwrap();
        let reasons = |data: Value| v.iter_errors(&data).map(|e| schema_failure(&e)).collect::<Vec<_>>().join("; ");
        let card = "4111111111111111";
        let why = reasons(json!({"meta": {card: "x"}, "tags": {card: 5}, "lines": [{"sku": "a"}, {"sku": 7}]}));
        assert!(!why.contains("4111"), "{why}");
        for at in ["/meta/* fails \"type\"", "/tags/* fails \"type\"", "/lines/1/sku fails \"type\""] {
            assert!(why.contains(at), "{at:?} in {why}");
        }
        assert_eq!(keyless_path("", "/type"), "/");
        assert_eq!(keyless_path("/a/b", "/properties/a/unknownKeyword"), "/*/*", "what the walk cannot place");
        // An evaluation path a step ahead of the instance (nested $refs): nothing shown.
        let ahead = "/properties/x/$ref/properties/b/$ref/properties/a/$ref/items/additionalProperties/type";
        assert_eq!(keyless_path("/x/b/0/4111111111111111", ahead), "/*/*/*/*");
        assert_eq!(keyless_path("/lines/4111111111111111", "/properties/lines/items/type"), "/lines/*");
        assert_eq!(keyless_path("/meta", "/properties/meta/additionalProperties"), "/meta", "the object's own failure");
        assert_eq!(keyless_path("/tags/*", "/properties/tags/patternProperties/^[0-9]+$/type"), "/tags/*");
        let nested = json!({
            "properties": {"x": {"$ref": "#/$defs/X"}},
            "$defs": {
                "X": {"properties": {"a": {"$ref": "#/$defs/M"}, "b": {"$ref": "#/$defs/X/properties/a"}}},
                "M": {"items": {"additionalProperties": {"type": "string"}}}
            }
        });
        let v = jsonschema::validator_for(&nested).unwrap();
        let data = json!({"x": {"b": [{card: 5}]}});
        let why: Vec<String> = v.iter_errors(&data).map(|e| schema_failure(&e)).collect();
        assert!(!why.is_empty() && why.iter().all(|w| !w.contains("4111")), "{why:?}");
    }

    #[test]
    fn a_version_guarded_route_needs_a_version() {
        let mut c = cfg("");
        c.routes[0].version_guard = true;
        let router = Router::new(&c).unwrap();
        let err = router.route(&record("order.placed", r#"{"order_id":"o"}"#)).unwrap_err();
        assert_eq!(err.class, PoisonClass::BadField);
        assert!(err.reason.contains("version_guard"), "{err}");
    }

    #[test]
    fn template_syntax_errors_fail_at_start() {
        let mut c = cfg("");
        if let ActionConfig::Call(call) = &mut c.routes[0].actions[0] {
            call.path = "/x/{{ data.".into();
        }
        let err = Router::new(&c).unwrap_err().to_string();
        assert!(err.contains("routes[0].actions[0].path"), "{err}");
    }
}
