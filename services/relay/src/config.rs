//! Loading the configuration: `relay.toml`, then the environment, then every
//! check — relay-core's validation (no I/O) and the ones that need the file
//! system.
//!
//! * Layering is [figment](https://docs.rs/figment): the file, then
//!   `RELAY_SECTION__KEY=value` (double underscore between levels, e.g.
//!   `RELAY_KAFKA__BOOTSTRAP_SERVERS`), then `DATABASE_URL` for the database.
//! * A route's `schema` path is relative to the configuration file.
//! * Every problem is reported at once, each naming its key.

use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use relay_core::RelayConfig;
use relay_core::config::ConfigError;

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
    }
    let mut problems = match cfg.validate() {
        Ok(()) => Vec::new(),
        Err(ConfigError::Invalid { problems }) => problems,
        Err(e) => return Err(e),
    };
    for (i, r) in cfg.routes.iter().enumerate() {
        if let Some(s) = &r.schema
            && !s.exists()
        {
            problems.push(format!("routes[{i}].schema: {} does not exist", s.display()));
        }
    }
    if problems.is_empty() { Ok(cfg) } else { Err(ConfigError::Invalid { problems }) }
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
        let missing = load(Some(&dir.join("nope.toml"))).unwrap_err().to_string();
        assert!(missing.contains("nope.toml does not exist (pass --config PATH"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
