//! The files in `contracts/` and the example configuration stay true: every
//! example event validates against the envelope schema and its data schema,
//! and the example configuration loads and compiles.

use std::path::{Path, PathBuf};

use relay_core::{RelayConfig, Router};
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

fn json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn validator(name: &str) -> jsonschema::Validator {
    let schema = json(&root().join("contracts/schemas").join(name));
    jsonschema::validator_for(&schema).unwrap_or_else(|e| panic!("{name} is not a valid schema: {e}"))
}

fn errors(v: &jsonschema::Validator, doc: &Value) -> Vec<String> {
    v.iter_errors(doc).map(|e| format!("{e} at {}", e.instance_path())).collect()
}

#[test]
fn every_example_event_validates_against_the_envelope_and_its_data_schema() {
    let envelope = validator("cloudevent.schema.json");
    let examples: Vec<PathBuf> = std::fs::read_dir(root().join("contracts/examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    assert!(examples.len() >= 4, "examples: {examples:?}");
    for path in examples {
        let doc = json(&path);
        let errs = errors(&envelope, &doc);
        assert!(errs.is_empty(), "{} does not match the envelope: {errs:?}", path.display());
        let data_schema = format!("{}.schema.json", path.file_stem().unwrap().to_str().unwrap());
        let errs = errors(&validator(&data_schema), &doc["data"]);
        assert!(errs.is_empty(), "{} data does not match {data_schema}: {errs:?}", path.display());
    }
}

#[test]
fn the_envelope_schema_rejects_events_the_relay_would_dead_letter() {
    let envelope = validator("cloudevent.schema.json");
    let mut doc = json(&root().join("contracts/examples/order-placed.json"));
    doc.as_object_mut().unwrap().remove("id");
    assert!(!errors(&envelope, &doc).is_empty(), "an event without id must not validate");
    let mut doc = json(&root().join("contracts/examples/order-placed.json"));
    doc["aggregateversion"] = Value::String("three".into());
    assert!(!errors(&envelope, &doc).is_empty(), "a non-integer version must not validate");
}

#[test]
fn the_data_schemas_reject_what_the_demo_sends_as_schema_invalid() {
    let v = validator("order-placed.schema.json");
    let bad = serde_json::json!({"order_id": "o", "customer_id": "c", "amount_cents": "ten", "currency": "EUR"});
    assert!(!errors(&v, &bad).is_empty());
}

#[test]
fn the_example_configuration_loads_and_its_routes_compile() {
    let path = root().join("relay.example.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let text = text.replace("schema = \"contracts/", &format!("schema = \"{}/contracts/", root().display()));
    let mut cfg = RelayConfig::from_toml(&text).unwrap();
    // What the service's loader does (relay::config::read_schemas): the router reads no files.
    for r in &mut cfg.routes {
        let path = r.schema.as_ref().expect("every example route names its schema");
        r.schema_document = Some(serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap());
    }
    Router::new(&cfg).unwrap();
    assert_eq!(cfg.subscribed_topics(), vec!["orders".to_string()]);
}
