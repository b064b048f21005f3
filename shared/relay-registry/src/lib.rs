//! Records in the Confluent Schema Registry wire format — a magic byte 0, a
//! 4-byte big-endian schema id, then the encoded value — decoded with the
//! schema registered under that id into the JSON value routes, templates
//! and guards see.
//!
//! The registry client is written here, over the workspace's reqwest: the
//! one maintained Rust client (`schema_registry_converter`) needs reqwest
//! 0.13 and another TLS stack, and relay needs two calls of the API.
//! Schemas under an id never change, so each is fetched once and kept.
//!
//! What goes wrong is one of two things ([`Failure`]): the record can never
//! be decoded as it is (poison, naming the id and the topic), or the
//! registry could not be asked (the partition waits and asks again; a
//! registry outage never dead-letters a record).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use relay_core::config::SchemaRegistryConfig;
use relay_core::envelope::TopicFormat;
use serde::Deserialize;
use serde_json::Value;

mod avro;

/// The wire format's first byte.
pub const MAGIC: u8 = 0;

/// Schemas kept at most; past it the cache is emptied and refilled (ids of
/// live topics come back within a batch or two).
const CACHED_SCHEMAS: usize = 10_000;

/// Why a value could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// The record can never be decoded as it is: dead-letter it.
    #[error("{0}")]
    Poison(String),
    /// The registry could not answer now: wait and try the record again.
    #[error("{0}")]
    Unavailable(String),
}

/// A client of one Schema Registry, with the schemas it has fetched.
pub struct Registry {
    http: reqwest::Client,
    base: url::Url,
    auth: Auth,
    schemas: RwLock<HashMap<u32, Arc<Registered>>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("url", &self.base.as_str()).finish_non_exhaustive()
    }
}

enum Auth {
    None,
    Basic { user: String, password: String },
    Bearer(String),
}

/// A schema as the registry holds it, parsed.
enum Registered {
    Avro(avro::Decoder),
}

/// `GET /schemas/ids/{id}`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SchemaById {
    schema: String,
    /// Absent for Avro (Confluent's registry leaves it out).
    schema_type: Option<String>,
    #[serde(default)]
    references: Vec<Value>,
}

impl Registry {
    /// A client for `cfg`; reads its secrets from the environment now, so
    /// a missing one stops the start rather than every record.
    pub fn new(cfg: &SchemaRegistryConfig) -> anyhow::Result<Registry> {
        let secret = |var: &str, what: &str| {
            std::env::var(var).map_err(|_| {
                anyhow::anyhow!("schema_registry.{what}: the environment variable {var} is not set (or not UTF-8)")
            })
        };
        let auth = match (&cfg.username, &cfg.password_env, &cfg.token_env) {
            (Some(user), Some(var), _) => Auth::Basic { user: user.clone(), password: secret(var, "password_env")? },
            (_, _, Some(var)) => Auth::Bearer(secret(var, "token_env")?),
            _ => Auth::None,
        };
        let mut b = reqwest::Client::builder()
            .timeout(cfg.timeout)
            .connect_timeout(cfg.timeout.min(Duration::from_secs(5)))
            .user_agent(concat!("relay/", env!("CARGO_PKG_VERSION")));
        let read = |key: &str, path: &std::path::Path| {
            std::fs::read(path)
                .map_err(|e| anyhow::anyhow!("schema_registry.tls.{key}: cannot read {}: {e}", path.display()))
        };
        if let Some(path) = &cfg.tls.ca_file {
            let certs = reqwest::Certificate::from_pem_bundle(&read("ca_file", path)?).map_err(|e| {
                anyhow::anyhow!("schema_registry.tls.ca_file: {} is not a PEM certificate bundle: {e}", path.display())
            })?;
            anyhow::ensure!(
                !certs.is_empty(),
                "schema_registry.tls.ca_file: {} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
                path.display()
            );
            // Only these CAs, as for endpoints: a registry on a private PKI.
            b = b.tls_built_in_root_certs(false);
            for c in certs {
                b = b.add_root_certificate(c);
            }
        }
        if let (Some(cert), Some(key)) = (&cfg.tls.client_cert_file, &cfg.tls.client_key_file) {
            let mut pem = read("client_cert_file", cert)?;
            pem.push(b'\n');
            pem.extend(read("client_key_file", key)?);
            b = b.identity(reqwest::Identity::from_pem(&pem).map_err(|e| {
                anyhow::anyhow!(
                    "schema_registry.tls: {} and {} are not a PEM certificate and its key: {e}",
                    cert.display(),
                    key.display()
                )
            })?);
        }
        let mut base = cfg.url.clone();
        if !base.path().ends_with('/') {
            base.set_path(&format!("{}/", base.path()));
        }
        Ok(Registry { http: b.build()?, base, auth, schemas: RwLock::new(HashMap::new()) })
    }

    /// The registry's URL, for logs.
    pub fn url(&self) -> &str {
        self.base.as_str()
    }

    /// The value of a record of `topic`, in `format`, as JSON. A tombstone
    /// (no value) is `null`, as on a JSON topic.
    pub async fn decode(&self, format: TopicFormat, topic: &str, payload: Option<&[u8]>) -> Result<Value, Failure> {
        let Some(bytes) = payload else { return Ok(Value::Null) };
        let (id, body) = split(bytes).map_err(|why| Failure::Poison(format!("record of topic {topic:?}: {why}")))?;
        let schema = self.schema(id, format, topic).await?;
        match (&*schema, format) {
            (Registered::Avro(d), TopicFormat::Avro) => d.decode(body).map_err(|why| {
                Failure::Poison(format!(
                    "record of topic {topic:?} does not decode with Avro schema id {id} of the registry: {why}"
                ))
            }),
            (Registered::Avro(_), other) => Err(Failure::Poison(format!(
                "record of topic {topic:?} has Avro schema id {id}, but the topic has format = {:?}",
                other.as_str()
            ))),
        }
    }

    /// The schema under `id`, fetched once.
    async fn schema(&self, id: u32, format: TopicFormat, topic: &str) -> Result<Arc<Registered>, Failure> {
        if let Some(s) = self.schemas.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(&id) {
            return Ok(s.clone());
        }
        let fetched = Arc::new(self.fetch(id, format, topic).await?);
        let mut cache = self.schemas.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if cache.len() >= CACHED_SCHEMAS {
            cache.clear();
        }
        cache.insert(id, fetched.clone());
        Ok(fetched)
    }

    async fn fetch(&self, id: u32, format: TopicFormat, topic: &str) -> Result<Registered, Failure> {
        let url = self.base.join(&format!("schemas/ids/{id}")).map_err(|e| Failure::Unavailable(e.to_string()))?;
        let mut req =
            self.http.get(url.clone()).header("accept", "application/vnd.schemaregistry.v1+json, application/json");
        req = match &self.auth {
            Auth::None => req,
            Auth::Basic { user, password } => req.basic_auth(user, Some(password)),
            Auth::Bearer(token) => req.bearer_auth(token),
        };
        let unavailable = |why: String| {
            Failure::Unavailable(format!(
                "the schema registry at {} could not give schema id {id} (topic {topic:?}): {why}",
                self.base
            ))
        };
        let resp = req.send().await.map_err(|e| unavailable(transport(&e)))?;
        let status = resp.status();
        let body = resp.text().await.map_err(|e| unavailable(transport(&e)))?;
        if status == reqwest::StatusCode::NOT_FOUND {
            // 40403: no schema under this id. A registry that answers 404
            // for its whole API (a wrong url) says so in another code.
            let code = serde_json::from_str::<Value>(&body).ok().and_then(|v| v.get("error_code")?.as_i64());
            if code == Some(40403) {
                return Err(Failure::Poison(format!(
                    "record of topic {topic:?} names schema id {id}, which the schema registry at {} does not have \
                     (error 40403): produced against another registry, or the schema was deleted",
                    self.base
                )));
            }
            return Err(unavailable(format!(
                "HTTP 404 without error code 40403 — is schema_registry.url the API's base (for Apicurio, \
                 .../apis/ccompat/v7)? {}",
                snippet(&body)
            )));
        }
        if status == reqwest::StatusCode::UNAUTHORIZED || status == reqwest::StatusCode::FORBIDDEN {
            return Err(unavailable(format!(
                "HTTP {status}: check schema_registry.username/password_env or token_env; {}",
                snippet(&body)
            )));
        }
        if !status.is_success() {
            return Err(unavailable(format!("HTTP {status}: {}", snippet(&body))));
        }
        let found: SchemaById = serde_json::from_str(&body)
            .map_err(|e| unavailable(format!("its answer is not a schema ({e}): {}", snippet(&body))))?;
        let kind = found.schema_type.as_deref().unwrap_or("AVRO");
        let poison = |why: String| Failure::Poison(format!("record of topic {topic:?}, schema id {id}: {why}"));
        if !found.references.is_empty() {
            return Err(poison(format!(
                "the schema refers to {} other schema(s); schema references are not supported yet",
                found.references.len()
            )));
        }
        match kind {
            "AVRO" => avro::Decoder::parse(&found.schema)
                .map(Registered::Avro)
                .map_err(|e| poison(format!("the registry's Avro schema does not parse: {e}"))),
            other => {
                Err(poison(format!("the schema is of type {other}, and the topic has format = {:?}", format.as_str())))
            }
        }
    }
}

/// The schema id and the encoded value of a value in the wire format.
pub fn split(bytes: &[u8]) -> Result<(u32, &[u8]), String> {
    match bytes {
        [MAGIC, a, b, c, d, rest @ ..] => Ok((u32::from_be_bytes([*a, *b, *c, *d]), rest)),
        [MAGIC, ..] => Err(format!(
            "value of {} byte(s) is too short for the Schema Registry wire format (magic byte, 4-byte schema id)",
            bytes.len()
        )),
        [first, ..] => Err(format!(
            "value starts with byte {first:#04x}, not the Schema Registry wire format's magic byte 0x00 \
             (produced without a registry serializer?)"
        )),
        [] => Err("value is empty, not in the Schema Registry wire format".into()),
    }
}

fn transport(e: &reqwest::Error) -> String {
    use std::error::Error as _;
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}

fn snippet(body: &str) -> String {
    body.chars().take(300).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_format_is_a_zero_byte_a_big_endian_id_and_the_value() {
        assert_eq!(split(&[0, 0, 0, 1, 2, 9, 9]).unwrap(), (258, &[9u8, 9][..]));
        assert_eq!(split(&[0, 0, 0, 0, 7]).unwrap(), (7, &[][..]));
        assert!(split(&[0, 0, 1]).unwrap_err().contains("too short"));
        assert!(split(b"{\"a\":1}").unwrap_err().contains("0x7b"));
        assert!(split(&[]).unwrap_err().contains("empty"));
    }
}
