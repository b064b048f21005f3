//! `relay check-config --explain ROUTE`: print what a route would write for
//! one event, rendered without I/O (`relay_core::explain`).

use std::path::Path;

use relay_core::RelayConfig;
use relay_core::effects::Outcome;
use relay_core::explain::{Explained, example_record, explain, find_route, placeholders, without_schema};
use serde_json::Value;

/// What the operator gives `--explain` instead of the example.
#[derive(Debug, Default)]
pub struct Given<'a> {
    /// The record value (as the topic carries it).
    pub event: Option<&'a Path>,
    /// The record key.
    pub key: Option<&'a str>,
    /// Record headers, `NAME=VALUE`.
    pub headers: &'a [String],
    /// The provider's answer ({status, headers, body}) for `on_success`.
    pub response: Option<&'a Path>,
}

/// Render route `name` against the given record, or an example. The
/// report, and whether the record would be applied (false: the report ends
/// with the consumer's dead-letter reason).
pub fn run(cfg: &RelayConfig, name: &str, given_record: &Given<'_>) -> anyhow::Result<(String, bool)> {
    let (event, response) = (given_record.event, given_record.response);
    let i = find_route(cfg, name).map_err(anyhow::Error::msg)?;
    let has_schema = cfg.routes[i].schema_document.is_some();
    // An example is not made to fit the route's patterns and formats: only
    // a given event goes through the route's JSON Schema.
    let given = cfg;
    let unchecked;
    let cfg = match event {
        Some(_) => cfg,
        None => {
            unchecked = without_schema(cfg, i);
            &unchecked
        }
    };
    let router = relay_core::Router::new(cfg)?;
    let mut out = String::new();
    let mut line = |s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    let record = match event {
        Some(path) => given_event(cfg, &router, i, path, given_record, &mut line)?,
        None => {
            let rec = example_record(given, &router, i).map_err(anyhow::Error::msg)?;
            introduce_example(cfg, &router, i, has_schema, &mut line);
            rec
        }
    };
    let answer: Option<Value> = match response {
        Some(p) => Some(serde_json::from_slice(&read(p, "response")?).map_err(|e| {
            anyhow::anyhow!(
                "--response: {} is not JSON ({e}); give {{\"status\": 200, \"headers\": {{}}, \"body\": …}}",
                p.display()
            )
        })?),
        None => None,
    };
    let payload = record.payload.as_deref().unwrap_or_default();
    let shown = serde_json::from_slice::<Value>(payload)
        .map(|v| pretty(&v, "    "))
        .unwrap_or_else(|_| String::from_utf8_lossy(payload).into_owned());
    line("  record value:".into());
    line(format!("    {shown}"));
    for h in &record.headers {
        line(format!("  header {}: {}", h.name, String::from_utf8_lossy(h.value.as_deref().unwrap_or_default())));
    }
    let x = match explain(cfg, &router, i, record) {
        Ok(x) => x,
        Err(why) if event.is_none() => {
            line(format!(
                "the example could not be rendered: {why}\n(its placeholders are text: a loop, a subscript, a number \
                 filter or a pattern may need a real value; give one with --event FILE)"
            ));
            return Ok((out, false));
        }
        Err(why) => {
            line(format!("this event would not be applied: {why}"));
            return Ok((out, false));
        }
    };
    describe(&x, answer.as_ref(), cfg, &mut line)?;
    Ok((out, true))
}

/// The file `--FLAG` names, or an error naming the flag and the file.
fn read(p: &Path, flag: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(p).map_err(|e| anyhow::anyhow!("--{flag}: cannot read {}: {e}", p.display()))
}

/// The record `--event FILE` (with `--key` and `--header`) makes for route
/// `i`, introduced by a line.
fn given_event(
    cfg: &RelayConfig,
    router: &relay_core::Router,
    i: usize,
    path: &Path,
    given: &Given<'_>,
    line: &mut impl FnMut(String),
) -> anyhow::Result<relay_core::RawRecord> {
    let r = &cfg.routes[i];
    let mut rec = example_record(cfg, router, i).map_err(anyhow::Error::msg)?;
    rec.payload = Some(read(path, "event")?);
    rec.headers.retain(|h| h.name == "content-type");
    rec.key = given.key.map(|k| k.as_bytes().to_vec());
    for h in given.headers {
        let (name, value) = h.split_once('=').ok_or_else(|| anyhow::anyhow!("--header {h:?}: give NAME=VALUE"))?;
        rec.headers.retain(|x| x.name != name);
        rec.headers.push(relay_core::envelope::Header::text(name, value));
    }
    line(format!(
        "route {}: topic {:?}, type {:?}, rendered against {} (no I/O)",
        r.display_name(),
        r.topic,
        r.event_type,
        path.display()
    ));
    Ok(rec)
}

/// The lines that introduce route `i`'s example event: what its templates
/// read, and that a schema's patterns are not followed.
fn introduce_example(
    cfg: &RelayConfig,
    router: &relay_core::Router,
    i: usize,
    has_schema: bool,
    line: &mut impl FnMut(String),
) {
    let r = &cfg.routes[i];
    let reads = router.route_at(cfg, i).map(|(_, reads)| placeholders(&reads)).unwrap_or_default();
    line(format!(
        "route {}: topic {:?}, type {:?}, rendered against an example event (no I/O; --event FILE renders your own \
         record value)",
        r.display_name(),
        r.topic,
        r.event_type
    ));
    if !reads.is_empty() {
        line(format!("  the templates read: {}", reads.join(", ")));
    }
    if has_schema {
        line("  the example's data follows the route's JSON Schema's types; it is not checked against it".into());
    }
}

fn describe(
    x: &Explained,
    answer: Option<&Value>,
    cfg: &RelayConfig,
    line: &mut impl FnMut(String),
) -> anyhow::Result<()> {
    line(format!("  event id {:?}, type {:?}, source {:?}", x.event.id, x.event.event_type, x.event.source));
    if let Some(a) = &x.event.aggregate_id {
        line(format!("  aggregate {a:?}, version {:?}, sequence {:?}", x.event.aggregate_version, x.event.sequence));
    }
    let formats = cfg.emit_formats();
    if x.effects.sagas.is_empty() && x.effects.intents.is_empty() && x.effects.events.is_empty() {
        line("it writes nothing but its inbox row".into());
    }
    for s in &x.effects.sagas {
        let how = if s.start {
            format!("starts at {:?}", s.to)
        } else {
            format!("moves from {} to {:?}", s.from.join(" | "), s.to)
        };
        line(format!("saga {:?}: {} {:?} {how}", s.action, s.saga_type, s.saga_id));
    }
    for n in &x.effects.intents {
        describe_intent(n, answer, cfg, &formats, line)?;
    }
    for e in &x.effects.events {
        let key =
            e.key.as_deref().map(|k| format!("{:?}", String::from_utf8_lossy(k))).unwrap_or_else(|| "none".into());
        line(format!(
            "emit {:?} -> topic {:?}, key {key}, type {:?}, outbox id {}",
            e.action,
            e.topic,
            e.event_type.as_deref().unwrap_or_default(),
            e.id
        ));
        let spec = x.plan.emits.iter().find(|s| s.action == e.action);
        if let Some(s) = spec {
            line(format!("  data {}", pretty(&s.data, "  ")));
        }
        if let Some((_, f)) = formats.iter().find(|(t, _)| *t == e.topic) {
            line(format!("  written {f} with the subject's latest schema, checked at ingest (not here: no I/O)"));
        }
    }
    if let Some(c) = &x.effects.counter {
        line(format!("counter {c:?} += 1"));
    }
    if let Some(h) = &x.handler {
        line(format!("code handler {h:?} also runs for this route: what it writes is not shown"));
    }
    Ok(())
}

/// The lines of one intent a route writes: the call, its key, what it
/// sends, what its outcomes write.
fn describe_intent(
    n: &relay_core::effects::NewIntent,
    answer: Option<&Value>,
    cfg: &RelayConfig,
    formats: &[(String, relay_core::config::EmitFormat)],
    line: &mut impl FnMut(String),
) -> anyhow::Result<()> {
    let i = &n.intent;
    let base = cfg.endpoints.get(&i.endpoint).map(|e| e.base_url.to_string()).unwrap_or_default();
    line(format!(
        "call {:?} -> endpoint {}: {} {}{}",
        i.action,
        i.endpoint,
        i.method,
        base.trim_end_matches('/'),
        i.path
    ));
    line(format!("  intent id {}, idempotency key {:?}", n.id, i.idempotency_key));
    if let Some(k) = &i.ordering_key {
        line(format!("  ordering key {k:?}: one call of this key at a time, in commit order"));
    }
    if i.headers.as_object().is_some_and(|h| !h.is_empty()) {
        line(format!("  headers {}", pretty(&i.headers, "  ")));
    }
    if let Some(b) = &i.body {
        line(format!("  body {}", pretty(b, "  ")));
    }
    for (when, stored) in [("on success", &i.on_success), ("on dead", &i.on_dead)] {
        if stored.is_null()
            || stored.as_object().is_some_and(|o| o.values().all(|v| v.as_array().is_some_and(Vec::is_empty)))
        {
            continue;
        }
        match answer {
            Some(a) if when == "on success" && Outcome::reads_answer(stored) => {
                let done = Outcome::answered(stored, a).map_err(|e| anyhow::anyhow!("--response: {e}"))?;
                line(format!("  {when} (with the --response answer) {}", pretty(&done, "  ")));
            }
            _ if Outcome::reads_answer(stored) => line(format!(
                "  {when} (templates reading `response` stay as written until the call succeeds; --response FILE \
                 renders them) {}",
                pretty(stored, "  ")
            )),
            _ => line(format!("  {when} {}", pretty(stored, "  "))),
        }
        let emits = serde_json::from_value::<Outcome>(stored.clone()).map(|o| o.emit).unwrap_or_default();
        for e in emits {
            if let Some((_, f)) = formats.iter().find(|(t, _)| *t == e.topic) {
                line(format!(
                    "  {when}: emit {:?} is written {f} with the subject's latest schema; its data is checked at \
                     ingest, or if it reads `response` when the call is done (not here: no I/O)",
                    e.action
                ));
            }
        }
    }
    Ok(())
}

/// `v` as indented JSON, its lines after the first indented by `indent`.
fn pretty(v: &Value, indent: &str) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default().replace('\n', &format!("\n{indent}"))
}
