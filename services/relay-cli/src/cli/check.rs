//! `relay check-config`: the configuration summarized, every endpoint's and
//! the registry's client built as a running relay would build it, and
//! `--explain`, a route's dry run.

use relay_core::RelayConfig;
use relay_core::config::EndpointConfig;

use crate::printable as safe;

/// `relay check-config --explain ROUTE`: print what the route would write
/// for the event; an error (exit status 1) if it would write nothing.
pub(super) fn explain(cfg: &RelayConfig, route: &str, given: &crate::explain::Given<'_>) -> anyhow::Result<()> {
    let (report, applied) = crate::explain::run(cfg, route, given)?;
    print!("{report}");
    // A script running the dry run sees a dead letter in the exit status.
    anyhow::ensure!(applied, "route {route}: nothing would be written for this event (see above)");
    Ok(())
}

/// `relay check-config`: an error naming every endpoint whose client could
/// not be built, and the registry's.
pub(super) fn check_config(cfg: &RelayConfig) -> anyhow::Result<()> {
    relay_core::Router::new(cfg)?;
    println!("configuration is valid");
    println!(
        "  consumer {:?} (group {:?}), topics: {}",
        cfg.consumer.name,
        cfg.consumer.group(),
        cfg.subscribed_topics().join(", ")
    );
    for r in &cfg.routes {
        println!("  route {} -> {} action(s)", r.display_name(), r.actions.len());
    }
    let mut problems = Vec::new();
    for (name, e) in &cfg.endpoints {
        describe_endpoint(name, e);
        // Build its client as a dispatcher would: TLS files parsed, the
        // token's variable read.
        if let Err(err) = relay::deliver::http::EndpointClient::new(name, e, Default::default()) {
            problems.push(format!("{err:#}"));
        }
    }
    if let Some(r) = &cfg.schema_registry {
        println!("schema registry {}", r.url);
        for (key, path) in r.tls.files() {
            println!("    tls.{key} {}", path.display());
        }
        // Its client as a consumer builds it: TLS files parsed, secrets read.
        if let Err(err) = relay_registry::Registry::new(r) {
            problems.push(format!("{err:#}"));
        }
    }
    for warning in cfg.warnings() {
        println!("warning: {warning}");
    }
    anyhow::ensure!(
        problems.is_empty(),
        "a dispatcher could not call every endpoint, or a consumer could not reach the schema registry:\n  {}",
        problems.join("\n  ")
    );
    Ok(())
}

/// The lines `check-config` prints for an endpoint.
fn describe_endpoint(name: &str, e: &EndpointConfig) {
    println!(
        "  endpoint {name}: {} (timeout {:?}, {} attempts, max age {:?})",
        e.base_url, e.timeout, e.max_attempts, e.max_age
    );
    println!("    {}", key_window_line(name, e));
    if let Some(r) = &e.reconcile {
        let how = match &r.path {
            Some(p) => format!("by a lookup {} {}", r.method, safe(p)),
            None => "by sending the call again with its key".into(),
        };
        let d = |d: std::time::Duration| humantime::format_duration(d).to_string();
        println!(
            "    uncertain intents reconciled {how}, {} after, every {}, at most {} times",
            d(r.after),
            d(r.interval),
            r.max_attempts
        );
    }
    for (key, path) in e.tls.files() {
        println!("    tls.{key} {}", path.display());
    }
}

/// What `check-config` says of an endpoint's key: where it goes, and its
/// provider's window beside relay's retry horizon.
fn key_window_line(name: &str, e: &EndpointConfig) -> String {
    use relay_core::profile::KeyPlacement;
    let p = e.profile();
    let d = |d: std::time::Duration| humantime::format_duration(d).to_string();
    let key = match &p.key {
        KeyPlacement::Header(h) => format!("key in header {h}"),
        KeyPlacement::BodyField(f) => format!("key in body field {f}"),
        KeyPlacement::Omitted => {
            return format!("profile {}: no idempotency key; an unknown outcome is never re-sent", p.name.as_str());
        }
    };
    let horizon = format!(
        "retry horizon {} (max_age {} + replay_window {})",
        d(e.retry_horizon()),
        d(e.max_age),
        d(e.replay_window)
    );
    match p.window {
        Some(w) if e.key_window_shortfall(name).is_some() => {
            format!("profile {}, {key}; key window {} is SHORTER than the {horizon}", p.name.as_str(), d(w))
        }
        Some(w) => format!("profile {}, {key}; key window {} covers the {horizon}", p.name.as_str(), d(w)),
        None => format!(
            "profile {}, {key}; key window unknown, so the {horizon} is not checked (set idempotency.window)",
            p.name.as_str()
        ),
    }
}
