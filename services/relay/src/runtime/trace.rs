//! Trace propagation: W3C `traceparent` from an input event to the intents
//! and outbox events it causes, to the outgoing HTTP call and Kafka record,
//! and to the events emitted when the call finishes — so one trace shows
//! event → inbox → intent → provider call → outcome event.
//!
//! Every hop is a child of the previous one: it keeps the trace id and gets a
//! new span id. With `telemetry.otlp_endpoint` set, each hop is also a span
//! exported over OTLP/HTTP (its id is the one sent on); without it, nothing is
//! exported and the child span ids are random, which is enough for the
//! provider's or the downstream consumer's own tracing to attach to the trace.
//!
//! The per-record line (`ingest::consumer`) and the per-attempt line
//! (`deliver::executor`) are `tracing` events carrying the R16 fields, not
//! `tracing` spans, by decision: a partition's records are written in one
//! transaction, so a span per record would not enclose the work it names
//! (the batch's commit is after every record's span would have closed), and
//! the JSON log format nests span fields under `span`/`spans`, which would
//! move `event_id`, `idempotency_key`, … away from the top level where
//! users' log queries find them today. `tracing` spans give context where
//! work does happen inside them: a partition's processing (`partition`:
//! consumer, topic, partition — a database error names its partition) and a
//! code handler's call (`handler`: event id, type, offset — the handler's
//! own lines name their record). The spans that follow a record across
//! processes are the OpenTelemetry hops here.

use std::collections::HashMap;
use std::sync::OnceLock;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, TraceContextExt, TraceState, Tracer, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use relay_core::config::TelemetryConfig;

static PROVIDER: OnceLock<Option<SdkTracerProvider>> = OnceLock::new();

/// Start the OTLP exporter if configured (once per process).
pub fn init(cfg: &TelemetryConfig) -> anyhow::Result<()> {
    if PROVIDER.get().is_some() {
        return Ok(());
    }
    let provider = match &cfg.otlp_endpoint {
        None => None,
        Some(endpoint) => {
            use opentelemetry_otlp::WithExportConfig;
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_endpoint(endpoint)
                .build()
                .map_err(|e| anyhow::anyhow!("telemetry.otlp_endpoint = {endpoint}: {e}"))?;
            let name = cfg.service_name.clone().unwrap_or_else(|| "relay".into());
            let resource = opentelemetry_sdk::Resource::builder().with_service_name(name).build();
            Some(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build())
        }
    };
    let _ = PROVIDER.set(provider);
    Ok(())
}

/// Flush exported spans (at shutdown).
pub fn shutdown() {
    if let Some(Some(p)) = PROVIDER.get() {
        let _ = p.force_flush();
    }
}

/// Parse a W3C `traceparent` with OpenTelemetry's W3C propagator; `None`
/// when it is malformed or invalid (all-zero ids, an unknown version).
pub fn parse(header: &str) -> Option<SpanContext> {
    let carrier = HashMap::from([(TRACEPARENT.to_owned(), header.to_owned())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    let span = cx.span().span_context().clone();
    span.is_valid().then_some(span)
}

/// Format a span context as a `traceparent`, with the same propagator.
pub fn format(cx: &SpanContext) -> String {
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&Context::new().with_remote_span_context(cx.clone()), &mut carrier);
    carrier.remove(TRACEPARENT).unwrap_or_default()
}

/// The W3C trace context header the relay carries from hop to hop.
const TRACEPARENT: &str = "traceparent";

/// A hop of the trace: a child of `parent`, exported when OTLP is on.
pub struct Hop {
    span: Option<opentelemetry::global::BoxedSpan>,
    /// The `traceparent` to send on from this hop.
    pub traceparent: Option<String>,
}

impl Hop {
    /// Start a hop named `name` under `parent` (`None` without a parent: no
    /// trace). `attributes` are only built when spans are exported: they
    /// cost allocations on every record and call.
    pub fn start(
        name: &'static str,
        kind: SpanKind,
        parent: Option<&str>,
        attributes: impl FnOnce() -> Vec<KeyValue>,
    ) -> Hop {
        let Some(parent_cx) = parent.and_then(parse) else { return Hop { span: None, traceparent: None } };
        if let Some(Some(provider)) = PROVIDER.get() {
            let tracer = opentelemetry::global::BoxedTracer::new(Box::new(provider.tracer("relay")));
            let cx = Context::new().with_remote_span_context(parent_cx);
            let span = tracer
                .span_builder(name)
                .with_kind(kind)
                .with_attributes(attributes())
                .start_with_context(&tracer, &cx);
            let traceparent = Some(format(span.span_context()));
            return Hop { span: Some(span), traceparent };
        }
        let child = SpanContext::new(
            parent_cx.trace_id(),
            SpanId::from_bytes(rand::random::<[u8; 8]>()),
            parent_cx.trace_flags(),
            false,
            TraceState::default(),
        );
        Hop { span: None, traceparent: Some(format(&child)) }
    }

    /// End the hop's span with an outcome attribute.
    pub fn end(mut self, outcome: &str) {
        if let Some(span) = self.span.as_mut() {
            span.set_attribute(KeyValue::new("relay.outcome", outcome.to_owned()));
            span.end();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_hop_keeps_the_trace_and_gets_a_span_of_its_own() {
        let hop = Hop::start("call", SpanKind::Client, Some(PARENT), Vec::new);
        let child = parse(hop.traceparent.as_deref().unwrap()).unwrap();
        let parent = parse(PARENT).unwrap();
        assert_eq!(child.trace_id(), parent.trace_id());
        assert_ne!(child.span_id(), parent.span_id());
        assert_eq!(child.trace_flags(), parent.trace_flags());
    }

    #[test]
    fn malformed_traceparents_start_no_trace() {
        for bad in [
            "",
            "00-zz-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(Hop::start("x", SpanKind::Internal, Some(bad), Vec::new).traceparent.is_none(), "{bad}");
        }
        assert_eq!(format(&parse(PARENT).unwrap()), PARENT);
    }
}
