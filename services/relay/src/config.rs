//! Loading the configuration: `relay.toml`, then the environment, then every
//! check — relay-core's validation (no I/O) and the ones that need the file
//! system.
//!
//! * Layering is [figment](https://docs.rs/figment): the file, then
//!   `RELAY_SECTION__KEY=value` (double underscore between levels, e.g.
//!   `RELAY_KAFKA__BOOTSTRAP_SERVERS`), then `DATABASE_URL` for the database.
//! * A route's `schema` path is relative to the configuration file; the
//!   file is read here ([`read_schemas`]) and compiled by the router.
//! * Secrets are read from the environment here too, when a client is
//!   built: Kafka's `secret_properties` and an endpoint's `token_env`.
//! * An endpoint's TLS files are made absolute here and read when its client
//!   is built (a dispatcher, `relay check-config`): commands that make no
//!   calls run without them.
//! * Every problem is reported at once, each naming its key.

use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use relay_core::RelayConfig;
use relay_core::config::{ConfigError, EndpointConfig, KafkaConfig};
use secrecy::SecretString;

/// Load `path` (if given), then the environment, then validate.
pub fn load(path: Option<&Path>) -> Result<RelayConfig, ConfigError> {
    let mut fig = Figment::new();
    if let Some(p) = path {
        if !p.exists() {
            return Err(ConfigError::Load(format!(
                "{} does not exist (pass --config PATH or set RELAY_CONFIG)",
                p.display()
            )));
        }
        fig = fig.merge(Toml::file(p));
    }
    fig = fig
        // Only RELAY_SECTION__KEY variables configure the relay; others with
        // the prefix (RELAY_CONFIG, RELAY_FAULTS, RELAY_LOG_FORMAT) are not config keys.
        .merge(Env::prefixed("RELAY_").filter(|k| k.as_str().contains("__")).split("__"))
        .merge(Env::raw().only(&["DATABASE_URL"]).map(|_| "database.url".into()));
    let mut cfg: RelayConfig = fig
        .extract()
        .map_err(|e| ConfigError::Load(e.into_iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")))?;
    if let Some(dir) = path.and_then(Path::parent) {
        for r in &mut cfg.routes {
            if let Some(s) = &mut r.schema
                && s.is_relative()
            {
                *s = dir.join(&*s);
            }
        }
        let registry = cfg.schema_registry.iter_mut().map(|r| &mut r.tls);
        for tls in cfg.endpoints.values_mut().map(|e| &mut e.tls).chain(registry) {
            for f in tls.files_mut().filter(|f| f.is_relative()) {
                *f = dir.join(&*f);
            }
        }
    }
    let mut problems = Vec::new();
    for checked in [cfg.validate(), read_schemas(&mut cfg)] {
        match checked {
            Ok(()) => {}
            Err(ConfigError::Invalid { problems: p }) => problems.extend(p),
            Err(e) => return Err(e),
        }
    }
    if problems.is_empty() { Ok(cfg) } else { Err(ConfigError::Invalid { problems }) }
}

/// Read each route's `schema` file into its `schema_document`, which the
/// router compiles (relay-core does no I/O). A document already there is
/// kept, so calling this again costs nothing; [`load`] calls it, and so does
/// `Relay::new` for a configuration built another way.
pub fn read_schemas(cfg: &mut RelayConfig) -> Result<(), ConfigError> {
    let mut problems = Vec::new();
    for (i, r) in cfg.routes.iter_mut().enumerate() {
        let (Some(path), None) = (&r.schema, &r.schema_document) else { continue };
        let read = if path.exists() {
            std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display())).and_then(|text| {
                serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))
            })
        } else {
            Err(format!("{} does not exist", path.display()))
        };
        match read {
            Ok(doc) => r.schema_document = Some(doc),
            Err(why) => problems.push(format!("routes[{i}].schema: {why}")),
        }
    }
    if problems.is_empty() { Ok(()) } else { Err(ConfigError::Invalid { problems }) }
}

/// Kafka's secret properties, read from the environment variables
/// `kafka.secret_properties` names. Missing variables are errors.
pub fn kafka_secrets(kafka: &KafkaConfig) -> Result<Vec<(String, SecretString)>, ConfigError> {
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for (prop, var) in &kafka.secret_properties {
        match std::env::var(var) {
            Ok(v) => out.push((prop.clone(), SecretString::from(v))),
            Err(_) => problems.push(format!("kafka.secret_properties.{prop:?}: environment variable {var} is not set")),
        }
    }
    if problems.is_empty() { Ok(out) } else { Err(ConfigError::Invalid { problems }) }
}

/// An endpoint's bearer token, read from the variable its `token_env` names.
pub fn endpoint_token(endpoint: &EndpointConfig) -> Result<Option<SecretString>, String> {
    match &endpoint.token_env {
        None => Ok(None),
        Some(var) => std::env::var(var)
            .map(|v| Some(SecretString::from(v)))
            .map_err(|_| format!("environment variable {var} (token_env) is not set")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schema_path_is_read_relative_to_the_file_and_a_missing_one_is_named_with_the_rest() {
        let dir = std::env::temp_dir().join(format!("relay-config-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("schemas")).unwrap();
        std::fs::write(dir.join("schemas/placed.json"), "{}").unwrap();
        let route = |topic: &str, schema: &str| {
            format!(
                "[[routes]]\ntopic = \"{topic}\"\ntype = \"t\"\nschema = \"{schema}\"\n\
                 [[routes.actions]]\nkind = \"emit\"\nname = \"e\"\ntype = \"x\"\ntopic = \"out\"\n"
            )
        };
        let file = dir.join("relay.toml");
        let text =
            format!("[consumer]\nname = \"c\"\n{}{}", route("a", "schemas/placed.json"), route("b", "gone.json"));
        std::fs::write(&file, &text).unwrap();
        let err = load(Some(&file)).unwrap_err().to_string();
        assert!(
            err.contains(&format!("routes[1].schema: {} does not exist", dir.join("gone.json").display())),
            "{err}"
        );
        assert!(!err.contains("routes[0]"), "the schema beside the file is found: {err}");

        std::fs::write(&file, text.replace("gone.json", "schemas/placed.json")).unwrap();
        let cfg = load(Some(&file)).unwrap();
        assert_eq!(cfg.routes[1].schema.as_deref(), Some(dir.join("schemas/placed.json").as_path()));
        assert_eq!(cfg.routes[1].schema_document, Some(serde_json::json!({})), "read, for the router to compile");
        let missing = load(Some(&dir.join("nope.toml"))).unwrap_err().to_string();
        assert!(missing.contains("nope.toml does not exist (pass --config PATH"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
