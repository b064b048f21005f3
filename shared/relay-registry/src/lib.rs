//! Records in the Confluent Schema Registry wire format — a magic byte 0, a
//! 4-byte big-endian schema id, then the encoded value — decoded with the
//! schema registered under that id into the JSON value routes, templates
//! and guards see: an Avro datum mapped to JSON (module `avro`), a Protobuf
//! message in the Protobuf JSON mapping (module `protobuf`), a JSON Schema
//! value checked against its schema.
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
//!
//! [`with_tls`], the TLS of an HTTP client from a `tls` table, lives here
//! and the endpoints' clients use it too.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use relay_core::config::SchemaRegistryConfig;
use relay_core::envelope::TopicFormat;
use serde::Deserialize;
use serde_json::Value;

mod avro;
mod protobuf;

/// The wire format's first byte.
pub const MAGIC: u8 = 0;

/// Schemas kept at most; past it the cache is emptied and refilled (ids of
/// live topics come back within a batch or two).
const CACHED_SCHEMAS: usize = 10_000;

/// The largest registry answer read: a schema, with room to spare.
const MAX_ANSWER_BYTES: usize = 8 * 1024 * 1024;

/// Schemas one schema may bring in through its references, all levels.
const MAX_REFERENCES: usize = 100;

/// Why a value could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// The record can never be decoded as it is: dead-letter it.
    #[error("{0}")]
    Poison(String),
    /// The registry does not have the schema the record names — yet, maybe:
    /// a replica behind the one the producer registered with, a registry
    /// restarted empty. Retried within the consumer's reference budget,
    /// then dead-lettered.
    #[error("{0}")]
    NotYet(String),
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
    Protobuf(protobuf::Schema),
    Json(jsonschema::Validator),
}

impl Registered {
    /// The registry's name of its type.
    fn kind(&self) -> &'static str {
        match self {
            Registered::Avro(_) => "Avro",
            Registered::Protobuf(_) => "PROTOBUF",
            Registered::Json(_) => "JSON",
        }
    }
}

/// `GET /schemas/ids/{id}`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SchemaById {
    schema: String,
    /// Absent for Avro (Confluent's registry leaves it out).
    schema_type: Option<String>,
    #[serde(default)]
    references: Vec<Reference>,
}

/// A schema another one refers to: a Protobuf import by its file name, an
/// Avro schema by the full name of the type it defines.
#[derive(Deserialize, Clone)]
struct Reference {
    name: String,
    subject: String,
    version: i64,
}

/// `GET /subjects/{subject}/versions/{version}`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Version {
    id: u32,
    schema: String,
    /// Absent for Avro.
    schema_type: Option<String>,
    #[serde(default)]
    references: Vec<Reference>,
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
        let b = reqwest::Client::builder()
            .timeout(cfg.timeout)
            .connect_timeout(cfg.timeout.min(Duration::from_secs(5)))
            .user_agent(concat!("relay/", env!("CARGO_PKG_VERSION")));
        let b = with_tls(b, "schema_registry.tls", &cfg.tls)?;
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
        let poison = |why: String| Failure::Poison(format!("record of topic {topic:?}, schema id {id}: {why}"));
        match (&*schema, format) {
            (Registered::Avro(d), TopicFormat::Avro) => {
                d.decode(body).map_err(|why| poison(format!("does not decode with the registry's Avro schema: {why}")))
            }
            (Registered::Protobuf(p), TopicFormat::Protobuf) => p
                .decode(body)
                .map_err(|why| poison(format!("does not decode with the registry's Protobuf schema: {why}"))),
            (Registered::Json(v), TopicFormat::JsonSchema) => {
                let value: Value =
                    serde_json::from_slice(body).map_err(|e| poison(format!("the value is not JSON: {e}")))?;
                let errors: Vec<String> =
                    v.iter_errors(&value).take(5).map(|e| relay_core::router::schema_failure(&e)).collect();
                if errors.is_empty() {
                    Ok(value)
                } else {
                    Err(poison(format!("does not match its registered JSON Schema: {}", errors.join("; "))))
                }
            }
            (found, other) => Err(poison(format!(
                "the schema is of type {}, and the topic has format = {:?}",
                found.kind(),
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

    /// `GET` `path` under the base URL: the status and the answer (at most
    /// [`MAX_ANSWER_BYTES`]), or why there is none.
    async fn get(&self, path: &str) -> Result<(reqwest::StatusCode, String), String> {
        let url = self.base.join(path).map_err(|e| e.to_string())?;
        let mut req = self.http.get(url).header("accept", "application/vnd.schemaregistry.v1+json, application/json");
        req = match &self.auth {
            Auth::None => req,
            Auth::Basic { user, password } => req.basic_auth(user, Some(password)),
            Auth::Bearer(token) => req.bearer_auth(token),
        };
        let mut resp = req.send().await.map_err(|e| relay_core::error_chain(&e))?;
        let status = resp.status();
        let mut bytes = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| relay_core::error_chain(&e))? {
            if bytes.len() + chunk.len() > MAX_ANSWER_BYTES {
                return Err(format!("its answer is over {MAX_ANSWER_BYTES} bytes"));
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
    }

    /// An encoder of data into the latest schema of the emit's subject, in
    /// its format (and, for Protobuf, its message). Its schema is read
    /// once: a start after a new version is registered takes that one.
    pub async fn encoder(
        &self,
        emit: &relay_core::config::EmitFormat,
    ) -> Result<Arc<dyn relay_core::effects::DataEncoder>, String> {
        let (format, subject) = (emit.format, emit.subject.as_str());
        let path = format!("subjects/{}/versions/latest", utf8_percent(subject));
        let (status, body) = self.get(&path).await.map_err(|why| {
            format!("the schema registry at {} could not give the latest schema of subject {subject}: {why}", self.base)
        })?;
        if status == reqwest::StatusCode::NOT_FOUND {
            return Err(format!(
                "the schema registry at {} has no latest schema of subject {subject:?} (HTTP 404: {}); \
                 register the schema the emit writes (e.g. with the producer's serializer, or \
                 POST {}subjects/{subject}/versions) before starting",
                self.base,
                snippet(&body),
                self.base
            ));
        }
        if !status.is_success() {
            return Err(format!(
                "the schema registry at {} could not give the latest schema of subject {subject:?} (HTTP {status}: \
                 {}); check that it is up and schema_registry's credentials",
                self.base,
                snippet(&body)
            ));
        }
        let latest: Version = serde_json::from_str(&body)
            .map_err(|e| format!("subject {subject}: the registry's answer is not a schema version ({e})"))?;
        let kind = latest.schema_type.as_deref().unwrap_or("AVRO");
        let describe = format!("subject {subject}, schema id {}", latest.id);
        match (format, kind) {
            (TopicFormat::Avro, "AVRO") => self
                .imports(latest.references)
                .await
                .map_err(|e| format!("the schemas it refers to: {}", e.why()))
                .and_then(|imports| {
                    avro::Decoder::parse_with(&latest.schema, &imports.into_values().collect::<Vec<_>>())
                })
                .and_then(|schema| avro::Encoder::new(latest.id, schema, describe))
                .map(|e| Arc::new(e) as Arc<_>)
                .map_err(|e| format!("subject {subject}: its Avro schema cannot be used: {e}")),
            (TopicFormat::Protobuf, "PROTOBUF") => {
                let imports = self.imports(latest.references).await.map_err(|e| {
                    format!("subject {subject}: the schemas its Protobuf schema refers to: {}", e.why())
                })?;
                protobuf::Schema::parse(&latest.schema, &imports)
                    .and_then(|schema| protobuf::Encoder::new(latest.id, &schema, emit.message.as_deref(), describe))
                    .map(|e| Arc::new(e) as Arc<_>)
                    .map_err(|e| format!("subject {subject}: its Protobuf schema cannot be used: {e}"))
            }
            (TopicFormat::JsonSchema, "JSON") => {
                let imports = self
                    .imports(latest.references)
                    .await
                    .map_err(|e| format!("subject {subject}: the schemas its JSON Schema refers to: {}", e.why()))?;
                json_validator(&latest.schema, imports)
                    .map(|validator| Arc::new(JsonEncoder { id: latest.id, validator, describe }) as Arc<_>)
                    .map_err(|e| format!("subject {subject}: its JSON Schema cannot be used: {e}"))
            }
            (format, kind) => Err(format!(
                "subject {subject}'s latest schema is of type {kind}, and the emit has format = {:?}",
                format.as_str()
            )),
        }
    }

    /// The schemas `refs` names and those they name in turn, as text by
    /// the name they are imported under.
    /// Breadth first, so a name the schema itself refers to takes the
    /// version it names, whatever version a deeper schema names.
    async fn imports(&self, refs: Vec<Reference>) -> Result<HashMap<String, String>, ImportError> {
        let mut out = HashMap::new();
        let mut queue: std::collections::VecDeque<Reference> = refs.into();
        while let Some(r) = queue.pop_front() {
            if out.contains_key(&r.name) {
                continue;
            }
            if out.len() >= MAX_REFERENCES {
                return Err(ImportError::Invalid(format!("more than {MAX_REFERENCES} schemas through references")));
            }
            let version = if r.version < 0 { "latest".to_owned() } else { r.version.to_string() };
            let path = format!("subjects/{}/versions/{version}", utf8_percent(&r.subject));
            let what = format!("{:?} (subject {}, version {version})", r.name, r.subject);
            let (status, body) =
                self.get(&path).await.map_err(|why| ImportError::Unavailable(format!("{what}: {why}")))?;
            if status == reqwest::StatusCode::NOT_FOUND {
                return Err(ImportError::Missing(format!(
                    "{what}: the registry does not have it ({})",
                    snippet(&body)
                )));
            }
            if !status.is_success() {
                return Err(ImportError::Unavailable(format!("{what}: HTTP {status}: {}", snippet(&body))));
            }
            let found: Version = serde_json::from_str(&body)
                .map_err(|e| ImportError::Unavailable(format!("{what}: the answer is not a schema version ({e})")))?;
            queue.extend(found.references);
            out.insert(r.name, found.schema);
        }
        Ok(out)
    }

    async fn fetch(&self, id: u32, format: TopicFormat, topic: &str) -> Result<Registered, Failure> {
        let unavailable = |why: String| {
            Failure::Unavailable(format!(
                "the schema registry at {} could not give schema id {id} (topic {topic:?}): {why}",
                self.base
            ))
        };
        let (status, body) = self.get(&format!("schemas/ids/{id}")).await.map_err(unavailable)?;
        if status == reqwest::StatusCode::NOT_FOUND {
            // 40403: no schema under this id. A registry that answers 404
            // for its whole API (a wrong url) says so in another code.
            let code = serde_json::from_str::<Value>(&body).ok().and_then(|v| v.get("error_code")?.as_i64());
            if code == Some(40403) {
                return Err(Failure::NotYet(format!(
                    "record of topic {topic:?} names schema id {id}, which the schema registry at {} does not have \
                     (error 40403): produced against another registry, the schema deleted, or a registry that \
                     has not caught up",
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
        let imported = |e: ImportError| match e {
            ImportError::Missing(why) => Failure::NotYet(format!(
                "record of topic {topic:?}, schema id {id}: a schema it refers to is missing: {why}"
            )),
            ImportError::Unavailable(why) => unavailable(format!("a schema it refers to: {why}")),
            ImportError::Invalid(why) => poison(why),
        };
        match kind {
            "AVRO" => {
                // No references: no request.
                let imports = self.imports(found.references).await.map_err(imported)?;
                avro::Decoder::parse_with(&found.schema, &imports.into_values().collect::<Vec<_>>())
                    .map(Registered::Avro)
                    .map_err(|e| poison(format!("the registry's Avro schema cannot be used: {e}")))
            }
            "PROTOBUF" if format == TopicFormat::Protobuf => {
                let imports = self.imports(found.references).await.map_err(imported)?;
                protobuf::Schema::parse(&found.schema, &imports)
                    .map(Registered::Protobuf)
                    .map_err(|e| poison(format!("the registry's Protobuf schema cannot be used: {e}")))
            }
            "JSON" if format == TopicFormat::JsonSchema => {
                let imports = self.imports(found.references).await.map_err(imported)?;
                json_validator(&found.schema, imports)
                    .map(Registered::Json)
                    .map_err(|e| poison(format!("the registry's JSON Schema cannot be used: {e}")))
            }
            other => {
                Err(poison(format!("the schema is of type {other}, and the topic has format = {:?}", format.as_str())))
            }
        }
    }
}

/// Why the schemas a schema refers to could not all be had.
enum ImportError {
    /// The registry does not have one.
    Missing(String),
    /// The registry could not answer.
    Unavailable(String),
    /// They cannot be used (too many).
    Invalid(String),
}

impl ImportError {
    fn why(&self) -> &str {
        match self {
            ImportError::Missing(w) | ImportError::Unavailable(w) | ImportError::Invalid(w) => w,
        }
    }
}

/// `b` with the TLS of `tls` (a private CA trusted alone, a client
/// certificate), its files read now; errors name the key under `at` (e.g.
/// `endpoints.psp.tls`) and the file. Shared by every HTTP client relay
/// makes: the endpoints' and the registry's.
pub fn with_tls(
    mut b: reqwest::ClientBuilder,
    at: &str,
    tls: &relay_core::config::EndpointTls,
) -> anyhow::Result<reqwest::ClientBuilder> {
    let read = |key: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| anyhow::anyhow!("{at}.{key}: cannot read {}: {e}", path.display()))
    };
    if let Some(path) = &tls.ca_file {
        let certs = reqwest::Certificate::from_pem_bundle(&read("ca_file", path)?)
            .map_err(|e| anyhow::anyhow!("{at}.ca_file: {} is not a PEM certificate bundle: {e}", path.display()))?;
        anyhow::ensure!(
            !certs.is_empty(),
            "{at}.ca_file: {} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
            path.display()
        );
        // Only these CAs: a server on a private PKI is not impersonated by any public one.
        b = b.tls_built_in_root_certs(false);
        for c in certs {
            b = b.add_root_certificate(c);
        }
    }
    if let (Some(cert), Some(key)) = (&tls.client_cert_file, &tls.client_key_file) {
        let mut pem = read("client_cert_file", cert)?;
        pem.push(b'\n');
        pem.extend(read("client_key_file", key)?);
        let identity = reqwest::Identity::from_pem(&pem).map_err(|e| {
            anyhow::anyhow!(
                "{at}: {} and {} are not a PEM certificate and its private key: {e}",
                cert.display(),
                key.display()
            )
        })?;
        b = b.identity(identity);
    }
    Ok(b)
}

/// A subject as one path segment.
fn utf8_percent(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>().replace('+', "%20")
}

/// A key of the data as a reason shows it, quoted: as it is where it could
/// be a field's name (a letter or `_`, then letters, digits and `_`, as Avro
/// and Protobuf name fields: a misspelt field is named), else `*`: a key no
/// field can have came with the data (an answer's object passed whole) and
/// may be a card number.
fn shown_key(k: &str) -> String {
    let mut bytes = k.bytes();
    let first = bytes.next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
    if first && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_') { format!("{k:?}") } else { "*".to_owned() }
}

/// A validator of JSON Schema `schema`, the schemas it refers to
/// (`imports`, by reference name) in its registry, read as Confluent's
/// Python serializer reads them: a reference's name is the `$ref` that
/// reaches it, and `$ref`s inside it resolve against that name (its own
/// top-level `$id` is set aside, as `referencing` looks resources up by
/// the name they were registered under); one without `$schema` is read in
/// the schema's draft. A relative name is also found against the schema's
/// own `$id`. Nothing is fetched ([`NoFetch`]).
fn json_validator(schema: &str, imports: HashMap<String, String>) -> Result<jsonschema::Validator, String> {
    use jsonschema::Draft;
    let doc: Value = serde_json::from_str(schema).map_err(|e| e.to_string())?;
    if imports.is_empty() {
        return jsonschema::options().with_retriever(NoFetch).build(&doc).map_err(|e| e.to_string());
    }
    let draft = match Draft::default().detect(&doc) {
        Draft::Unknown => Draft::default(),
        known => known,
    };
    let base = doc.get("$id").and_then(Value::as_str).and_then(|id| jsonschema::uri::from_str(id).ok());
    let mut imports: Vec<(String, String)> = imports.into_iter().collect();
    imports.sort_unstable();
    let (mut aliases, mut named) = (Vec::new(), Vec::with_capacity(imports.len()));
    for (name, text) in imports {
        let mut contents: Value = serde_json::from_str(&text)
            .map_err(|e| format!("the schema it refers to as {name:?} is not JSON ({e})"))?;
        let draft = draft.detect(&contents);
        if let Some(top) = contents.as_object_mut() {
            top.remove(draft.id_keyword());
        }
        let resource = draft.create_resource(contents);
        if let Some(at) = base.as_ref().and_then(|b| jsonschema::uri::resolve_against(&b.borrow(), &name).ok()) {
            aliases.push((at.to_string(), resource.clone()));
        }
        named.push((name, resource));
    }
    // Added later, a name wins over another's alias at the same address.
    let registry = jsonschema::Registry::new()
        .retriever(NoFetch)
        .extend(aliases.into_iter().chain(named))
        .and_then(jsonschema::RegistryBuilder::prepare)
        .map_err(|e| format!("the schemas it refers to: {e}"))?;
    jsonschema::options().with_retriever(NoFetch).with_registry(&registry).build(&doc).map_err(|e| e.to_string())
}

/// What a JSON Schema `$ref` no reference names gets: no schema is fetched
/// from a URL or a file (Confluent's Python serializer would fetch a URL;
/// a relay that did would let a registry entry make it call anywhere).
struct NoFetch;

impl jsonschema::Retrieve for NoFetch {
    fn retrieve(&self, _uri: &jsonschema::Uri<String>) -> Result<Value, Box<dyn std::error::Error + Send + Sync>> {
        Err("relay fetches no schema: a $ref reaches only the schema's references, by their names (register the \
             schema it names and list it among the references)"
            .into())
    }
}

/// The wire format's header for schema `id`.
fn header(id: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity(64);
    v.push(MAGIC);
    v.extend(id.to_be_bytes());
    v
}

/// JSON checked against a JSON Schema, in the wire format.
struct JsonEncoder {
    id: u32,
    validator: jsonschema::Validator,
    describe: String,
}

impl std::fmt::Debug for JsonEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe)
    }
}

impl relay_core::effects::DataEncoder for JsonEncoder {
    fn encode(&self, data: &Value) -> Result<Vec<u8>, String> {
        let errors: Vec<String> =
            self.validator.iter_errors(data).take(5).map(|e| relay_core::router::schema_failure(&e)).collect();
        if !errors.is_empty() {
            return Err(errors.join("; "));
        }
        let mut v = header(self.id);
        serde_json::to_writer(&mut v, data).map_err(|e| e.to_string())?;
        Ok(v)
    }

    fn content_type(&self) -> &str {
        "application/json"
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}

/// The schema id and the encoded value of a value in the wire format.
pub fn split(bytes: &[u8]) -> Result<(u32, &[u8]), String> {
    match bytes {
        // Registries take ids as 32-bit signed integers: one above that is
        // no id (Confluent's and Apicurio's APIs answer it with a bare 404).
        [MAGIC, a, b, c, d, rest @ ..] => match u32::from_be_bytes([*a, *b, *c, *d]) {
            id if i32::try_from(id).is_err() => {
                Err(format!("value names schema id {id}, above the largest a registry gives (2^31 - 1)"))
            }
            id => Ok((id, rest)),
        },
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
        assert!(split(&[0, 0x80, 0, 0, 0, 2]).unwrap_err().contains("schema id 2147483648, above the largest"));
        assert!(split(b"{\"a\":1}").unwrap_err().contains("0x7b"));
        assert!(split(&[]).unwrap_err().contains("empty"));
    }

    /// A stand-in registry answering each id as the test says.
    async fn stand_in() -> String {
        use axum::extract::Path;
        use axum::http::StatusCode;
        async fn by_id(Path(id): Path<u32>) -> (StatusCode, String) {
            let avro =
                serde_json::json!({"schema": r#"{"type":"record","name":"R","fields":[{"name":"a","type":"long"}]}"#});
            match id {
                1 => (StatusCode::OK, avro.to_string()),
                2 => (StatusCode::NOT_FOUND, r#"{"error_code":40403,"message":"Schema 2 not found"}"#.into()),
                3 => (StatusCode::NOT_FOUND, "<html>no such page</html>".into()),
                4 => (StatusCode::UNAUTHORIZED, r#"{"error_code":401}"#.into()),
                5 => (StatusCode::INTERNAL_SERVER_ERROR, "boom".into()),
                6 => {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    (StatusCode::OK, avro.to_string())
                }
                7 => (StatusCode::OK, serde_json::json!({"schema": "{}", "schemaType": "JSON"}).to_string()),
                8 => (
                    StatusCode::OK,
                    serde_json::json!({"schema": "syntax = \"proto3\";", "schemaType": "PROTOBUF"}).to_string(),
                ),
                9 => (StatusCode::OK, "x".repeat(MAX_ANSWER_BYTES + 1)),
                10 => (StatusCode::OK, "not json".into()),
                // Protobuf with references: a diamond, a missing one, one the registry cannot give now.
                20..=22 => {
                    let (main, refs) = match id {
                        20 => (
                            "syntax = \"proto3\"; import \"a.proto\"; import \"b.proto\"; message M { A a = 1; B b = 2; }",
                            serde_json::json!([{"name": "a.proto", "subject": "a", "version": 2},
                                               {"name": "b.proto", "subject": "b", "version": 1}]),
                        ),
                        21 => (
                            "syntax = \"proto3\"; import \"a.proto\"; message M { A a = 1; }",
                            serde_json::json!([{"name": "a.proto", "subject": "gone", "version": 1}]),
                        ),
                        _ => (
                            "syntax = \"proto3\"; import \"a.proto\"; message M { A a = 1; }",
                            serde_json::json!([{"name": "a.proto", "subject": "down", "version": 1}]),
                        ),
                    };
                    let body = serde_json::json!({"schema": main, "schemaType": "PROTOBUF", "references": refs});
                    (StatusCode::OK, body.to_string())
                }
                // JSON Schema with references, one of them nested: by name, and under the schema's `$id`.
                23 | 24 => {
                    let id = if id == 24 { r#""$id":"https://schemas.example/shop/order.json","# } else { "" };
                    let main = format!(
                        r#"{{{id}"type":"object","properties":{{"total":{{"$ref":"money.json"}}}},"required":["total"]}}"#
                    );
                    let refs = serde_json::json!([{"name": "money.json", "subject": "money", "version": 1}]);
                    let body = serde_json::json!({"schema": main, "schemaType": "JSON", "references": refs});
                    (StatusCode::OK, body.to_string())
                }
                // A reference with an `$id` of its own; a draft-07 one; a `$ref` no reference names; a reference the registry cannot give now.
                25..=28 => {
                    let (main, refs) = match id {
                        25 => (
                            r#"{"type":"object","properties":{"total":{"$ref":"money.json"}}}"#,
                            serde_json::json!([{"name": "money.json", "subject": "money-with-id", "version": 1}]),
                        ),
                        26 => (
                            r#"{"$schema":"http://json-schema.org/draft-07/schema#","type":"object","properties":{"total":{"$ref":"d7.json"}}}"#,
                            serde_json::json!([{"name": "d7.json", "subject": "d7", "version": 1}]),
                        ),
                        27 => (
                            r#"{"type":"object","properties":{"total":{"$ref":"https://schemas.example/nowhere.json"}}}"#,
                            serde_json::json!([]),
                        ),
                        _ => (
                            r#"{"type":"object","properties":{"total":{"$ref":"money.json"}}}"#,
                            serde_json::json!([{"name": "money.json", "subject": "down", "version": 1}]),
                        ),
                    };
                    let body = serde_json::json!({"schema": main, "schemaType": "JSON", "references": refs});
                    (StatusCode::OK, body.to_string())
                }
                _ => (StatusCode::OK, serde_json::json!({"schema": "{\"type\": \"nope\"}"}).to_string()),
            }
        }
        async fn version(Path((subject, version)): Path<(String, u32)>) -> (StatusCode, String) {
            let (schema, kind) = match (subject.as_str(), version) {
                ("a", 1) => ("syntax = \"proto3\"; message A { string old = 1; }", "PROTOBUF"),
                ("a", 2) => ("syntax = \"proto3\"; message A { string new = 1; }", "PROTOBUF"),
                ("b", 1) => ("syntax = \"proto3\"; import \"a.proto\"; message B { A a = 1; }", "PROTOBUF"),
                ("money", 1) => (
                    r#"{"type":"object","properties":{"minor":{"type":"integer"},"currency":{"$ref":"currency.json"}},"required":["minor"]}"#,
                    "JSON",
                ),
                ("currency", 1) => (r#"{"type":"string","maxLength":3}"#, "JSON"),
                ("money-with-id", 1) => (
                    r#"{"$id":"https://other.example/m/money.json","type":"object","properties":{"currency":{"$ref":"currency.json"}}}"#,
                    "JSON",
                ),
                // Draft 7 reads no keyword beside a `$ref`: `required` here is not checked.
                ("d7", 1) => (
                    r##"{"$ref":"#/definitions/b","definitions":{"b":{"type":"object"}},"required":["currency"]}"##,
                    "JSON",
                ),
                ("down", _) => return (StatusCode::SERVICE_UNAVAILABLE, "busy".into()),
                _ => return (StatusCode::NOT_FOUND, r#"{"error_code":40401}"#.into()),
            };
            // b.proto names a.proto at version 1: the schema's own reference (version 2) wins.
            let refs = match subject.as_str() {
                "b" => serde_json::json!([{"name": "a.proto", "subject": "a", "version": 1}]),
                "money" | "money-with-id" => {
                    serde_json::json!([{"name": "currency.json", "subject": "currency", "version": 1}])
                }
                _ => serde_json::json!([]),
            };
            let body =
                serde_json::json!({"id": 100 + version, "schema": schema, "schemaType": kind, "references": refs});
            (StatusCode::OK, body.to_string())
        }
        let app = axum::Router::new()
            .route("/schemas/ids/{id}", axum::routing::get(by_id))
            .route("/subjects/{subject}/versions/{version}", axum::routing::get(version));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}")
    }

    fn registry(url: &str) -> Registry {
        Registry::new(&SchemaRegistryConfig {
            url: url.parse().unwrap(),
            username: None,
            password_env: None,
            token_env: None,
            timeout: Duration::from_millis(500),
            tls: Default::default(),
        })
        .unwrap()
    }

    fn datum(id: u32, body: &[u8]) -> Vec<u8> {
        let mut v = vec![MAGIC];
        v.extend(id.to_be_bytes());
        v.extend(body);
        v
    }

    #[tokio::test]
    async fn what_the_registry_answers_decides_between_poison_not_yet_and_a_wait() {
        let r = registry(&stand_in().await);
        let decode = |id: u32| {
            let r = &r;
            async move { r.decode(TopicFormat::Avro, "t", Some(&datum(id, &[4]))).await }
        };
        assert_eq!(decode(1).await.unwrap(), serde_json::json!({"a": 2}));
        let wait = |f: Result<Value, Failure>, says: &str| match f {
            Err(Failure::Unavailable(why)) => {
                assert!(why.contains(says) && why.contains("schema id"), "{says:?} in {why}")
            }
            other => panic!("{says}: {other:?}"),
        };
        assert!(matches!(decode(2).await, Err(Failure::NotYet(why)) if why.contains("40403") && why.contains("\"t\"")));
        wait(decode(3).await, "without error code 40403");
        wait(decode(4).await, "check schema_registry.username");
        wait(decode(5).await, "HTTP 500");
        wait(decode(6).await, "timed out");
        assert!(matches!(decode(7).await, Err(Failure::Poison(why)) if why.contains("of type JSON")));
        assert!(matches!(decode(8).await, Err(Failure::Poison(why)) if why.contains("of type PROTOBUF")));
        wait(decode(9).await, "over 8388608 bytes");
        wait(decode(10).await, "not a schema");
        assert!(matches!(decode(11).await, Err(Failure::Poison(why)) if why.contains("cannot be used")));
        // Nothing listens there.
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
        let gone = registry(&format!("http://{closed}"));
        match gone.decode(TopicFormat::Avro, "t", Some(&datum(1, &[4]))).await {
            Err(Failure::Unavailable(why)) => assert!(why.contains("could not give schema id 1"), "{why}"),
            other => panic!("{other:?}"),
        }
        // References: followed breadth first, a missing one not yet, a registry that cannot answer a wait.
        let proto = |id: u32, body: Vec<u8>| {
            let r = &r;
            async move { r.decode(TopicFormat::Protobuf, "t", Some(&datum(id, &body))).await }
        };
        // M { a: A { new: "x" } }: field 1 of M, then field 1 of A.
        let body = [0u8, 0x0a, 3, 0x0a, 1, b'x'];
        assert_eq!(proto(20, body.to_vec()).await.unwrap(), serde_json::json!({"a": {"new": "x"}}));
        assert!(
            matches!(proto(21, body.to_vec()).await, Err(Failure::NotYet(why)) if why.contains("\"a.proto\" (subject gone")),
            "a missing reference"
        );
        wait(proto(22, body.to_vec()).await, "a schema it refers to");
        // What parsed is kept (ids 1 and 20); what failed, or is of another format, is asked again.
        let mut kept: Vec<u32> = r.schemas.read().unwrap().keys().copied().collect();
        kept.sort_unstable();
        assert_eq!(kept, [1, 20]);
    }

    #[tokio::test]
    async fn a_json_schema_s_references_are_checked_through_every_level_with_or_without_an_id() {
        let r = registry(&stand_in().await);
        for id in [23, 24] {
            let json = |body: &'static str| {
                let r = &r;
                async move { r.decode(TopicFormat::JsonSchema, "t", Some(&datum(id, body.as_bytes()))).await }
            };
            let fits = json(r#"{"total":{"minor":5,"currency":"EUR"}}"#).await;
            assert_eq!(fits.unwrap(), serde_json::json!({"total": {"minor": 5, "currency": "EUR"}}), "id {id}");
            // money.json's own field, and currency.json's (a reference of the reference).
            for (body, says) in [
                (r#"{"total":{"minor":"5"}}"#, "/total/minor"),
                (r#"{"total":{"minor":5,"currency":"EURO"}}"#, "/total/currency"),
            ] {
                match json(body).await {
                    Err(Failure::Poison(why)) => assert!(why.contains(says), "id {id}: {says:?} in {why}"),
                    other => panic!("id {id}, {body}: {other:?}"),
                }
            }
        }
        let decode = |format: TopicFormat, id: u32, body: &'static str| {
            let r = &r;
            async move { r.decode(format, "t", Some(&datum(id, body.as_bytes()))).await }
        };
        // Inside a reference, `$ref`s resolve against its name, not its own `$id` (as Confluent's Python
        // serializer reads it), and a reference without `$schema` is read in the schema's draft.
        let euro = decode(TopicFormat::JsonSchema, 25, r#"{"total":{"currency":"EURO"}}"#).await;
        assert!(matches!(euro, Err(Failure::Poison(why)) if why.contains("/total/currency")));
        assert!(decode(TopicFormat::JsonSchema, 25, r#"{"total":{"currency":"EUR"}}"#).await.is_ok());
        assert!(decode(TopicFormat::JsonSchema, 26, r#"{"total":{"minor":5}}"#).await.is_ok(), "draft 7");
        // A `$ref` no reference names is not fetched: the schema is refused, saying so.
        match decode(TopicFormat::JsonSchema, 27, "{}").await {
            Err(Failure::Poison(why)) => {
                assert!(why.contains("nowhere.json") && why.contains("relay fetches no schema"), "{why}")
            }
            other => panic!("{other:?}"),
        }
        // On a topic of another format, a JSON Schema is poison before its references are asked for.
        let avro = decode(TopicFormat::Avro, 28, "{}").await;
        assert!(matches!(&avro, Err(Failure::Poison(why)) if why.contains("of type JSON")), "{avro:?}");
        let json = decode(TopicFormat::JsonSchema, 28, "{}").await;
        assert!(matches!(&json, Err(Failure::Unavailable(why)) if why.contains("refers to")), "{json:?}");
    }
}
