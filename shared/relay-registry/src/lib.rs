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
//! Schemas under an id never change, so each is fetched once and kept (the
//! oldest let go past a bound of count and bytes); records that need one
//! while it is being fetched wait for that one ask. What cannot change
//! either is remembered for a while: a schema relay cannot use, and an id
//! a record was dead-lettered for after the consumer's budget for "not
//! yet" ([`Registry::gave_up`]).
//!
//! What goes wrong is one of two things ([`Failure`]): the record can never
//! be decoded as it is (poison, naming the id and the topic), or the
//! registry could not be asked (the partition waits and asks again; a
//! registry outage never dead-letters a record).
//!
//! [`with_tls`], the TLS of an HTTP client from a `tls` table, lives here
//! and the endpoints' clients use it too.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use relay_core::config::SchemaRegistryConfig;
use relay_core::envelope::TopicFormat;
use serde::Deserialize;
use serde_json::Value;

mod avro;
mod failure;
mod json_schema;
mod json_text;
mod protobuf;
mod tls;
mod wire;

pub use failure::Failure;
use failure::{Undecoded, on_topic};
use json_schema::json_validator;
use json_text::json_text;
pub use json_text::{JSON_EXPANSION, JSON_SLACK_BYTES, max_json_bytes};
pub use tls::with_tls;
pub use wire::split;
use wire::{JsonEncoder, header};

/// The wire format's first byte.
pub const MAGIC: u8 = 0;

/// Schemas kept at most; past it the oldest go first (ids of live topics
/// come back within a batch or two).
const CACHED_SCHEMAS: usize = 10_000;

/// The bytes of registry answers the kept schemas were parsed from, at
/// most: a schema may take 8 MiB, so a count alone would not bound the
/// memory. Past it the oldest go first, though the newest is always kept.
const CACHED_BYTES: usize = 64 * 1024 * 1024;

/// How long what was learnt of an id without a usable schema holds: a
/// schema relay cannot use is not asked for again within it, and an id
/// given up on ([`Registry::gave_up`]) dead-letters its records at once.
const REMEMBERED_FOR: Duration = Duration::from_secs(60);

/// Ids without a usable schema remembered at most, of each kind (the oldest
/// go first): a producer naming random ids cannot grow it.
const REMEMBERED_IDS: usize = 1_000;

/// How many times in a row the registry may give the same JSON that is not
/// a schema for an id before it is taken for what the registry holds there
/// rather than an outage: from then on the id is "not yet", so a record
/// naming it is dead-lettered within the consumer's budget.
const SAME_ANSWERS: u32 = 3;

/// The largest registry answer read: a schema, with room to spare.
const MAX_ANSWER_BYTES: usize = 8 * 1024 * 1024;

/// Schemas one schema may bring in through its references, all levels.
const MAX_REFERENCES: usize = 100;

/// The most text a schema and every schema it refers to may hold together:
/// each is parsed and kept while the schema is, so a hundred references to
/// one 8 MiB schema under a hundred names would otherwise be a hundred trees.
const MAX_IMPORT_BYTES: usize = MAX_ANSWER_BYTES;

/// A client of one Schema Registry, with the schemas it has fetched.
pub struct Registry {
    http: reqwest::Client,
    base: url::Url,
    auth: Auth,
    known: Mutex<Known>,
    /// Decode values to JSON of any size, as before they were bounded: only
    /// for the tests that prove the budget harness catches it.
    unbounded: bool,
}

/// What the client knows of schema ids; its lock is never held across an
/// await.
#[derive(Default)]
struct Known {
    /// Parsed schemas, each with the bytes of the answers it came from.
    schemas: HashMap<u32, (Arc<Registered>, usize)>,
    /// The ids of `schemas`, oldest first.
    order: VecDeque<u32>,
    /// The bytes of `schemas` together.
    bytes: usize,
    /// Why a schema cannot be used on a topic of a format (poison, without
    /// the topic), by id and format, and since when.
    refused: HashMap<(u32, &'static str), (Instant, String)>,
    /// Ids the registry gave no schema for at their last ask.
    missing: HashMap<u32, Missing>,
    /// Asks in flight by id and format: a record needing the same schema
    /// meanwhile waits for the answer instead of asking again.
    flights: HashMap<(u32, &'static str), Flight>,
}

/// One ask of the registry, its answer shared by all who wait for it.
type Flight = Arc<tokio::sync::OnceCell<Result<Arc<Registered>, Failure>>>;

/// An id the registry gave no schema for at its last ask.
struct Missing {
    /// When it was asked last.
    at: Instant,
    /// Whether that answer was "not yet" (an outage otherwise).
    not_yet: bool,
    /// An answer that is not a schema, and how many times in a row it came.
    odd: Option<(String, u32)>,
    /// When a record naming it was dead-lettered after the consumer's budget.
    gave_up: Option<Instant>,
}

impl Missing {
    /// When it was last learnt of.
    fn latest(&self) -> Instant {
        self.gave_up.map_or(self.at, |g| g.max(self.at))
    }
}

/// Make room for one more entry in `map` (at most [`REMEMBERED_IDS`]):
/// entries learnt over [`REMEMBERED_FOR`] ago go, then the oldest.
fn make_room<K: Copy + Eq + std::hash::Hash, V>(map: &mut HashMap<K, V>, now: Instant, at: impl Fn(&V) -> Instant) {
    if map.len() < REMEMBERED_IDS {
        return;
    }
    map.retain(|_, v| now.duration_since(at(v)) < REMEMBERED_FOR);
    while map.len() >= REMEMBERED_IDS {
        let Some(oldest) = map.iter().min_by_key(|(_, v)| at(v)).map(|(k, _)| *k) else { break };
        map.remove(&oldest);
    }
}

impl Known {
    /// Keep `schema` of `bytes` under `id`, letting the oldest go past the
    /// bounds.
    fn keep(&mut self, id: u32, schema: Arc<Registered>, bytes: usize) {
        match self.schemas.insert(id, (schema, bytes)) {
            Some((_, replaced)) => self.bytes -= replaced,
            None => self.order.push_back(id),
        }
        self.bytes += bytes;
        while self.schemas.len() > CACHED_SCHEMAS || (self.bytes > CACHED_BYTES && self.order.len() > 1) {
            let Some(oldest) = self.order.pop_front() else { break };
            if let Some((_, b)) = self.schemas.remove(&oldest) {
                self.bytes -= b;
            }
        }
    }

    /// Learn what the registry answered for `id` on a topic of `format`:
    /// what the records that waited for it get.
    fn learn(
        &mut self,
        id: u32,
        format: TopicFormat,
        fetched: Result<(Registered, usize), Unfetched>,
    ) -> Result<Arc<Registered>, Failure> {
        let now = Instant::now();
        let why = match fetched {
            Ok((schema, bytes)) => {
                self.missing.remove(&id);
                let schema = Arc::new(schema);
                self.keep(id, schema.clone(), bytes);
                return Ok(schema);
            }
            Err(Unfetched::Failed(Failure::Poison(why))) => {
                self.missing.remove(&id);
                make_room(&mut self.refused, now, |(at, _)| *at);
                self.refused.insert((id, format.as_str()), (now, why.clone()));
                return Err(Failure::Poison(why));
            }
            // An outage says nothing of the id: what was learnt of it stays.
            Err(Unfetched::Failed(f @ (Failure::Unavailable(_) | Failure::Oversized(_)))) => return Err(f),
            Err(Unfetched::Failed(Failure::NotYet(why))) => Ok(why),
            Err(Unfetched::Odd(why)) => Err(why),
        };
        if !self.missing.contains_key(&id) {
            make_room(&mut self.missing, now, Missing::latest);
        }
        let m = self.missing.entry(id).or_insert(Missing { at: now, not_yet: false, odd: None, gave_up: None });
        let fresh = now.duration_since(m.at) < REMEMBERED_FOR;
        m.at = now;
        let why = match why {
            Ok(not_yet) => {
                m.odd = None;
                not_yet
            }
            Err(odd) => {
                let times = match &m.odd {
                    Some((same, times)) if fresh && *same == odd => times + 1,
                    _ => 1,
                };
                m.odd = Some((odd.clone(), times));
                if times < SAME_ANSWERS {
                    m.not_yet = false;
                    return Err(Failure::Unavailable(odd));
                }
                format!(
                    "schema id {id}: the registry gave the same answer {times} times, which is not a schema, so it \
                     is taken for what the registry holds under this id rather than an outage: {odd}"
                )
            }
        };
        m.not_yet = true;
        match m.gave_up {
            Some(at) if now.duration_since(at) < REMEMBERED_FOR => Err(Failure::Poison(format!(
                "{why}; a record naming it was dead-lettered after the consumer's budget for \"not yet\" \
                 (consumer.reference_retry) less than {}s ago, so this one is dead-lettered at once, after one ask",
                REMEMBERED_FOR.as_secs()
            ))),
            _ => Err(Failure::NotYet(why)),
        }
    }
}

/// Why [`Registry::fetch`] gave no schema.
enum Unfetched {
    /// As it will be told (its reason without the topic).
    Failed(Failure),
    /// The registry's answer is JSON but not a schema: an outage, unless
    /// the same comes again ([`SAME_ANSWERS`]).
    Odd(String),
}

impl From<Failure> for Unfetched {
    fn from(f: Failure) -> Self {
        Unfetched::Failed(f)
    }
}

/// Why [`Registry::get`] gave no answer.
struct Unanswered {
    why: String,
    /// A success whose answer is larger than relay reads: what the registry
    /// holds there, which will never be smaller.
    too_large: bool,
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
        Ok(Registry { http: b.build()?, base, auth, known: Mutex::default(), unbounded: false })
    }

    /// The same client, decoding values to JSON without [`max_json_bytes`]'s
    /// bound (with the `sabotage` feature, for the tests that prove the
    /// budget harness catches a value expanded without bound).
    #[cfg(feature = "sabotage")]
    pub fn unbounded(mut self) -> Registry {
        self.unbounded = true;
        self
    }

    /// Takes `schema`, the registry's text of a schema without references,
    /// as its schema `id` for `format`, as if fetched: the budget tests and
    /// fuzz targets decode values in process, without a registry.
    pub fn know(&self, id: u32, format: TopicFormat, schema: &str) -> Result<(), String> {
        let parsed = match format {
            TopicFormat::Avro => avro::Decoder::parse_with(schema, &[]).map(Registered::Avro)?,
            TopicFormat::Protobuf => protobuf::Schema::parse(schema, &HashMap::new()).map(Registered::Protobuf)?,
            TopicFormat::JsonSchema => json_validator(schema, HashMap::new()).map(Registered::Json)?,
            other => return Err(format!("format {:?} has no registered schema", other.as_str())),
        };
        self.known().keep(id, Arc::new(parsed), schema.len());
        Ok(())
    }

    /// The registry's URL, for logs.
    pub fn url(&self) -> &str {
        self.base.as_str()
    }

    /// The value of a record of `topic`, in `format`, as JSON text of at
    /// most [`max_json_bytes`] of the value's size. A tombstone (no value)
    /// is `null`, as on a JSON topic.
    pub async fn decode(&self, format: TopicFormat, topic: &str, payload: Option<&[u8]>) -> Result<Vec<u8>, Failure> {
        let Some(bytes) = payload else { return Ok(b"null".to_vec()) };
        let (id, body) = split(bytes).map_err(|why| Failure::Poison(format!("record of topic {topic:?}: {why}")))?;
        let schema = self.schema(id, format, topic).await?;
        let poison = |why: String| Failure::Poison(format!("record of topic {topic:?}, schema id {id}: {why}"));
        let limit = if self.unbounded { usize::MAX } else { max_json_bytes(bytes.len()) };
        let failed = |kind: &str, e: Undecoded| match e {
            Undecoded::Invalid(why) => poison(format!("does not decode with the registry's {kind} schema: {why}")),
            Undecoded::TooLarge(limit) => Failure::Oversized(format!(
                "record of topic {topic:?}, schema id {id}: its value of {} bytes decodes to more than {limit} bytes \
                 of JSON, the most relay builds from a value ({JSON_EXPANSION} times its size plus \
                 {JSON_SLACK_BYTES} bytes) so that none can exhaust its memory; Protobuf writes every default of \
                 each item of a repeated field, Avro each field's name: have the producer send fewer items per \
                 record",
                bytes.len()
            )),
        };
        match (&*schema, format) {
            (Registered::Avro(d), TopicFormat::Avro) => d.decode(body, limit).map_err(|e| failed("Avro", e)),
            (Registered::Protobuf(p), TopicFormat::Protobuf) => {
                p.decode(body, limit).map_err(|e| failed("Protobuf", e))
            }
            (Registered::Json(v), TopicFormat::JsonSchema) => {
                let value: Value =
                    serde_json::from_slice(body).map_err(|e| poison(format!("the value is not JSON: {e}")))?;
                let errors: Vec<String> =
                    v.iter_errors(&value).take(5).map(|e| relay_core::router::schema_failure(&e)).collect();
                if errors.is_empty() {
                    json_text(limit, |out| serde::Serialize::serialize(&value, out)).map_err(|e| failed("JSON", e))
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

    /// Say that a record with value `payload` was dead-lettered because its
    /// budget for "not yet" ran out. If the registry did not have the
    /// schema its id names at the last ask, the records naming that id for
    /// a minute from now are poison after one ask each instead of
    /// a budget each: otherwise a producer writing against another registry
    /// would hold its partition for the whole budget per record. The one
    /// ask still decodes a record once the registry has the schema.
    pub fn gave_up(&self, payload: Option<&[u8]>) {
        let Some(Ok((id, _))) = payload.map(split) else { return };
        if let Some(m) = self.known().missing.get_mut(&id)
            && m.not_yet
        {
            m.gave_up = Some(Instant::now());
        }
    }

    fn known(&self) -> MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The schema under `id`: fetched once and kept, refused for a while if
    /// it cannot be used, and asked for once by the records that need it
    /// at the same time.
    async fn schema(&self, id: u32, format: TopicFormat, topic: &str) -> Result<Arc<Registered>, Failure> {
        let key = (id, format.as_str());
        let flight = {
            let mut known = self.known();
            if let Some((schema, _)) = known.schemas.get(&id) {
                return Ok(schema.clone());
            }
            if let Some((at, why)) = known.refused.get(&key)
                && at.elapsed() < REMEMBERED_FOR
            {
                return Err(on_topic(Failure::Poison(why.clone()), topic));
            }
            known.flights.entry(key).or_default().clone()
        };
        let answer = flight
            .get_or_init(|| async {
                let fetched = self.fetch(id, format).await;
                self.known().learn(id, format, fetched)
            })
            .await
            .clone();
        let mut known = self.known();
        if known.flights.get(&key).is_some_and(|f| Arc::ptr_eq(f, &flight)) {
            known.flights.remove(&key);
        }
        answer.map_err(|f| on_topic(f, topic))
    }

    /// `GET` `path` under the base URL: the status and the answer (at most
    /// [`MAX_ANSWER_BYTES`]), or why there is none.
    async fn get(&self, path: &str) -> Result<(reqwest::StatusCode, String), Unanswered> {
        let failed = |why: String| Unanswered { why, too_large: false };
        let url = self.base.join(path).map_err(|e| failed(e.to_string()))?;
        let mut req = self.http.get(url).header("accept", "application/vnd.schemaregistry.v1+json, application/json");
        req = match &self.auth {
            Auth::None => req,
            Auth::Basic { user, password } => req.basic_auth(user, Some(password)),
            Auth::Bearer(token) => req.bearer_auth(token),
        };
        let mut resp = req.send().await.map_err(|e| failed(relay_core::error_chain(&e)))?;
        let status = resp.status();
        let mut bytes = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| failed(relay_core::error_chain(&e)))? {
            if bytes.len() + chunk.len() > MAX_ANSWER_BYTES {
                return Err(Unanswered {
                    why: format!("its answer is over {MAX_ANSWER_BYTES} bytes, the most relay reads for a schema"),
                    too_large: status.is_success(),
                });
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
        let (status, body) = self.get(&path).await.map_err(|e| {
            format!(
                "the schema registry at {} could not give the latest schema of subject {subject}: {}",
                self.base, e.why
            )
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
                    .map(|validator| Arc::new(JsonEncoder::new(latest.id, validator, describe)) as Arc<_>)
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
        let mut bytes = 0usize;
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
            let (status, body) = self.get(&path).await.map_err(|e| match e.too_large {
                true => ImportError::Invalid(format!("{what}: {}", e.why)),
                false => ImportError::Unavailable(format!("{what}: {}", e.why)),
            })?;
            if status == reqwest::StatusCode::NOT_FOUND {
                return Err(ImportError::Missing(format!(
                    "{what}: the registry does not have it ({})",
                    snippet(&body)
                )));
            }
            if !status.is_success() {
                return Err(ImportError::Unavailable(format!("{what}: HTTP {status}: {}", snippet(&body))));
            }
            let found: Version = serde_json::from_str(&body).map_err(|e| {
                let why = format!("{what}: the answer is not a schema version ({e}): {}", snippet(&body));
                match serde_json::from_str::<serde::de::IgnoredAny>(&body) {
                    Ok(_) => ImportError::Odd(why),
                    Err(_) => ImportError::Unavailable(why),
                }
            })?;
            bytes += found.schema.len();
            if bytes > MAX_IMPORT_BYTES {
                return Err(ImportError::Invalid(format!(
                    "the schemas it refers to hold over {MAX_IMPORT_BYTES} bytes together (at {what}), the most relay \
                     reads for one schema"
                )));
            }
            queue.extend(found.references);
            out.insert(r.name, found.schema);
        }
        Ok(out)
    }

    /// Schema `id` as the registry holds it, parsed for a topic of
    /// `format`, and the bytes of the answers it came from; reasons name
    /// the id, not the topic (the answer is shared by the records waiting
    /// for it).
    async fn fetch(&self, id: u32, format: TopicFormat) -> Result<(Registered, usize), Unfetched> {
        let not_given =
            |why: String| format!("the schema registry at {} could not give schema id {id}: {why}", self.base);
        let unavailable = |why: String| Failure::Unavailable(not_given(why));
        let poison = |why: String| Failure::Poison(format!("schema id {id}: {why}"));
        let (status, body) = self.get(&format!("schemas/ids/{id}")).await.map_err(|e| match e.too_large {
            true => poison(e.why),
            false => unavailable(e.why),
        })?;
        if let Some(refused) = self.refusal(id, status, &body) {
            return Err(refused);
        }
        let found: SchemaById = serde_json::from_str(&body).map_err(|e| {
            // JSON of another shape is what the registry holds under this id
            // when it keeps coming; what is not JSON at all is a wrong url or
            // a proxy's page, which never makes a record poison.
            match serde_json::from_str::<serde::de::IgnoredAny>(&body) {
                Ok(_) => Unfetched::Odd(not_given(format!("its answer is not a schema ({e}): {}", snippet(&body)))),
                Err(_) => unavailable(format!(
                    "its answer is not JSON, so not a schema ({e}) — is schema_registry.url the API's base? {}",
                    snippet(&body)
                ))
                .into(),
            }
        })?;
        let kind = found.schema_type.as_deref().unwrap_or("AVRO");
        let imported = |e: ImportError| match e {
            ImportError::Missing(why) => {
                Failure::NotYet(format!("schema id {id}: a schema it refers to is missing: {why}")).into()
            }
            ImportError::Unavailable(why) => unavailable(format!("a schema it refers to: {why}")).into(),
            ImportError::Odd(why) => Unfetched::Odd(not_given(format!("a schema it refers to: {why}"))),
            ImportError::Invalid(why) => poison(why).into(),
        };
        let size = |imports: &HashMap<String, String>| body.len() + imports.values().map(String::len).sum::<usize>();
        let parsed = match kind {
            "AVRO" => {
                // No references: no request.
                let imports = self.imports(found.references).await.map_err(imported)?;
                let bytes = size(&imports);
                avro::Decoder::parse_with(&found.schema, &imports.into_values().collect::<Vec<_>>())
                    .map(|d| (Registered::Avro(d), bytes))
                    .map_err(|e| poison(format!("the registry's Avro schema cannot be used: {e}")))
            }
            "PROTOBUF" if format == TopicFormat::Protobuf => {
                let imports = self.imports(found.references).await.map_err(imported)?;
                protobuf::Schema::parse(&found.schema, &imports)
                    .map(|p| (Registered::Protobuf(p), size(&imports)))
                    .map_err(|e| poison(format!("the registry's Protobuf schema cannot be used: {e}")))
            }
            "JSON" if format == TopicFormat::JsonSchema => {
                let imports = self.imports(found.references).await.map_err(imported)?;
                let bytes = size(&imports);
                json_validator(&found.schema, imports)
                    .map(|v| (Registered::Json(v), bytes))
                    .map_err(|e| poison(format!("the registry's JSON Schema cannot be used: {e}")))
            }
            other => {
                Err(poison(format!("the schema is of type {other}, and the topic has format = {:?}", format.as_str())))
            }
        };
        Ok(parsed?)
    }

    /// Why an answer of `status` holds no schema id `id`, if it does not.
    fn refusal(&self, id: u32, status: reqwest::StatusCode, body: &str) -> Option<Unfetched> {
        let unavailable = |why: String| {
            Failure::Unavailable(format!("the schema registry at {} could not give schema id {id}: {why}", self.base))
        };
        if status == reqwest::StatusCode::NOT_FOUND {
            // 40403: no schema under this id. A registry that answers 404
            // for its whole API (a wrong url) says so in another code.
            let code = serde_json::from_str::<Value>(body).ok().and_then(|v| v.get("error_code")?.as_i64());
            if code == Some(40403) {
                return Some(
                    Failure::NotYet(format!(
                        "schema id {id}: the schema registry at {} does not have it (error 40403): produced against \
                     another registry, the schema deleted, or a registry that has not caught up",
                        self.base
                    ))
                    .into(),
                );
            }
            return Some(
                unavailable(format!(
                    "HTTP 404 without error code 40403 — is schema_registry.url the API's base (for Apicurio, \
                 .../apis/ccompat/v7)? {}",
                    snippet(body)
                ))
                .into(),
            );
        }
        if status == reqwest::StatusCode::UNAUTHORIZED || status == reqwest::StatusCode::FORBIDDEN {
            return Some(
                unavailable(format!(
                    "HTTP {status}: check schema_registry.username/password_env or token_env; {}",
                    snippet(body)
                ))
                .into(),
            );
        }
        (!status.is_success()).then(|| unavailable(format!("HTTP {status}: {}", snippet(body))).into())
    }
}

/// Why the schemas a schema refers to could not all be had.
enum ImportError {
    /// The registry does not have one.
    Missing(String),
    /// The registry could not answer.
    Unavailable(String),
    /// They cannot be used (too many, one too large).
    Invalid(String),
    /// The registry's answer for one is JSON but not a schema version.
    Odd(String),
}

impl ImportError {
    fn why(&self) -> &str {
        match self {
            ImportError::Missing(w) | ImportError::Unavailable(w) | ImportError::Invalid(w) | ImportError::Odd(w) => w,
        }
    }
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

fn snippet(body: &str) -> String {
    body.chars().take(300).collect()
}

#[cfg(test)]
impl Registry {
    /// [`Registry::decode`], read back as a JSON value.
    async fn decode_value(&self, format: TopicFormat, topic: &str, payload: Option<&[u8]>) -> Result<Value, Failure> {
        let text = self.decode(format, topic, payload).await?;
        Ok(serde_json::from_slice(&text).expect("decoded to JSON"))
    }
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
                // A hundred references, under a hundred names, to one large schema.
                31 => {
                    let refs: Vec<Value> = (0..100)
                        .map(|n| serde_json::json!({"name": format!("big{n}.json"), "subject": "big", "version": 1}))
                        .collect();
                    let body =
                        serde_json::json!({"schema": r#"{"type":"object"}"#, "schemaType": "JSON", "references": refs});
                    (StatusCode::OK, body.to_string())
                }
                // An order of lines of eight fields, none with presence.
                30 => (
                    StatusCode::OK,
                    serde_json::json!({"schemaType": "PROTOBUF", "schema": "syntax = \"proto3\"; \
                        message Order { string order_id = 1; repeated Line lines = 2; } \
                        message Line { string sku = 1; string name = 2; int64 quantity = 3; int64 unit_minor = 4; \
                        string currency = 5; int64 tax_minor = 6; string warehouse = 7; bool gift = 8; }"})
                    .to_string(),
                ),
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
                ("big", 1) => {
                    let big = format!(r#"{{"type":"object","description":"{}"}}"#, "x".repeat(1024 * 1024));
                    let body = serde_json::json!({"id": 200, "schema": big, "schemaType": "JSON", "references": []});
                    return (StatusCode::OK, body.to_string());
                }
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
            async move { r.decode_value(TopicFormat::Avro, "t", Some(&datum(id, &[4]))).await }
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
        // Larger than relay reads: a schema that will never be smaller.
        assert!(matches!(decode(9).await, Err(Failure::Poison(why)) if why.contains("over 8388608 bytes")));
        wait(decode(10).await, "not a schema");
        assert!(matches!(decode(11).await, Err(Failure::Poison(why)) if why.contains("cannot be used")));
        // Nothing listens there.
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
        let gone = registry(&format!("http://{closed}"));
        match gone.decode_value(TopicFormat::Avro, "t", Some(&datum(1, &[4]))).await {
            Err(Failure::Unavailable(why)) => assert!(why.contains("could not give schema id 1"), "{why}"),
            other => panic!("{other:?}"),
        }
        // References: followed breadth first, a missing one not yet, a registry that cannot answer a wait.
        let proto = |id: u32, body: Vec<u8>| {
            let r = &r;
            async move { r.decode_value(TopicFormat::Protobuf, "t", Some(&datum(id, &body))).await }
        };
        // M { a: A { new: "x" } }: field 1 of M, then field 1 of A.
        let body = [0u8, 0x0a, 3, 0x0a, 1, b'x'];
        assert_eq!(proto(20, body.to_vec()).await.unwrap(), serde_json::json!({"a": {"new": "x"}}));
        assert!(
            matches!(proto(21, body.to_vec()).await, Err(Failure::NotYet(why)) if why.contains("\"a.proto\" (subject gone")),
            "a missing reference"
        );
        wait(proto(22, body.to_vec()).await, "a schema it refers to");
        // Each reference is parsed and kept with the schema: a hundred of
        // one megabyte were a hundred trees held at once.
        let json = r.decode_value(TopicFormat::JsonSchema, "t", Some(&datum(31, b"{}"))).await;
        assert!(
            matches!(&json, Err(Failure::Poison(why)) if why.contains("hold over 8388608 bytes together")),
            "{json:?}"
        );
        // What parsed is kept (ids 1 and 20); what could not be used is remembered apart, for a while.
        let mut kept: Vec<u32> = r.known().schemas.keys().copied().collect();
        kept.sort_unstable();
        assert_eq!(kept, [1, 20]);
    }

    #[tokio::test]
    async fn a_value_decoding_to_more_json_than_its_bound_is_oversized_naming_the_bound() {
        let r = registry(&stand_in().await);
        // Indexes [0], order_id "o-1", then 490 000 empty lines: under 1 MB on the wire.
        let mut body = vec![0u8, 0x0a, 3, b'o', b'-', b'1'];
        for _ in 0..490_000 {
            body.extend([0x12, 0x00]);
        }
        let value = datum(30, &body);
        let started = std::time::Instant::now();
        match r.decode(TopicFormat::Protobuf, "t", Some(&value)).await {
            Err(Failure::Oversized(why)) => {
                let bound = max_json_bytes(value.len());
                assert_eq!(bound, value.len() * JSON_EXPANSION + JSON_SLACK_BYTES);
                assert!(why.contains(&format!("more than {bound} bytes of JSON")), "{why}");
                assert!(why.contains("schema id 30") && why.contains("fewer items per record"), "{why}");
            }
            Ok(json) => panic!("{} bytes decoded to {} bytes of JSON", value.len(), json.len()),
            Err(other) => panic!("{other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(30), "{:?}", started.elapsed());
        // A few lines are within it, every default written out.
        let json = r.decode_value(TopicFormat::Protobuf, "t", Some(&datum(30, &body[..10]))).await.unwrap();
        let line = serde_json::json!({"sku": "", "name": "", "quantity": 0, "unit_minor": 0, "currency": "",
                                      "tax_minor": 0, "warehouse": "", "gift": false});
        assert_eq!(json, serde_json::json!({"order_id": "o-1", "lines": [line, line]}));
    }

    #[test]
    fn a_pattern_that_backtracks_past_its_limit_does_not_match() {
        // Exponentially many paths to a match: a string that takes up to the
        // engine's default of 1 000 000 steps matches, and a value may hold
        // tens of thousands of such strings.
        let schema = r#"{"type": "array", "items": {"type": "string", "pattern": "^(?:(a|a)*\\1b|a*)$"}}"#;
        let bounded = json_validator(schema, HashMap::new()).unwrap();
        assert!(bounded.is_valid(&serde_json::json!(["aaa"])), "a short string still matches");
        let engine_default = jsonschema::options().build(&serde_json::from_str(schema).unwrap()).unwrap();
        let refused = (8..24).find(|&n| {
            let value = serde_json::json!(["a".repeat(n)]);
            engine_default.is_valid(&value) && !bounded.is_valid(&value)
        });
        assert!(refused.is_some(), "no string the engine's default matches after many steps is refused");
    }

    #[test]
    fn a_json_schema_that_unfolds_exponentially_is_refused_and_a_deep_one_that_does_not_is_kept() {
        // Level n is an anyOf of two $refs to level n - 1: 2^n subschemas
        // for a value that matches no branch.
        let levels = |n: usize| {
            let mut defs = serde_json::Map::new();
            defs.insert("d0".into(), serde_json::json!({"type": "null"}));
            for i in 1..=n {
                let below = format!("#/$defs/d{}", i - 1);
                defs.insert(format!("d{i}"), serde_json::json!({"anyOf": [{"$ref": below}, {"$ref": below}]}));
            }
            serde_json::json!({"$defs": defs})
        };
        let mut forty = levels(40);
        forty["allOf"] = serde_json::json!([{"$ref": "#/$defs/d40"}]);
        let err = json_validator(&forty.to_string(), HashMap::new()).unwrap_err();
        assert!(err.contains("unfolds to over 100000 subschemas"), "{err}");
        // Through a schema it refers to by name, the same.
        let imports = HashMap::from([("levels.json".to_owned(), levels(40).to_string())]);
        let err = json_validator(r##"{"$ref": "levels.json#/$defs/d40"}"##, imports).unwrap_err();
        assert!(err.contains("unfolds to over"), "{err}");
        // Ten levels, and a chain of 200 single $refs, are kept.
        let mut ten = levels(10);
        ten["allOf"] = serde_json::json!([{"$ref": "#/$defs/d10"}]);
        assert!(json_validator(&ten.to_string(), HashMap::new()).is_ok());
        let mut chain = serde_json::Map::new();
        chain.insert("c0".into(), serde_json::json!({"type": "integer"}));
        for i in 1..200 {
            chain.insert(format!("c{i}"), serde_json::json!({"$ref": format!("#/$defs/c{}", i - 1)}));
        }
        let chained = serde_json::json!({"$defs": chain, "$ref": "#/$defs/c199"});
        assert!(json_validator(&chained.to_string(), HashMap::new()).unwrap().is_valid(&serde_json::json!(1)));
        // Small, but two branches recurse at every level of the value: 2^depth.
        let doubling = r##"{"type": "array", "anyOf": [{"items": {"$ref": "#"}}, {"items": {"$ref": "#"}}]}"##;
        let err = json_validator(doubling, HashMap::new()).unwrap_err();
        assert!(err.contains("unfolds to over"), "{err}");
        // A tree recursing in one branch, or in two properties, is kept.
        let tree = r##"{"anyOf": [{"type": "string"}, {"type": "array", "items": {"$ref": "#"}}]}"##;
        assert!(json_validator(tree, HashMap::new()).is_ok());
        let binary = r##"{"type": "object", "properties": {"left": {"$ref": "#"}, "right": {"$ref": "#"}}}"##;
        assert!(json_validator(binary, HashMap::new()).is_ok());
        // Many $refs to types bundled under their own $id are not taken
        // for the whole schema each.
        let mut bundled = serde_json::Map::new();
        let mut props = serde_json::Map::new();
        for i in 0..40 {
            let id = format!("https://example.com/t{i}");
            bundled.insert(format!("t{i}"), serde_json::json!({"$id": id, "type": "string"}));
            props.insert(format!("p{i}"), serde_json::json!({"$ref": id}));
        }
        let schema = serde_json::json!({"$schema": "https://json-schema.org/draft/2020-12/schema",
                                        "$defs": bundled, "properties": props});
        assert!(json_validator(&schema.to_string(), HashMap::new()).is_ok());
    }

    #[test]
    fn json_text_stops_at_its_bound_and_writes_as_a_value_would() {
        let value = serde_json::json!({"a": "x".repeat(100), "b": [1, 2.5, null]});
        let whole = json_text(1_000, |out| serde::Serialize::serialize(&value, out)).unwrap();
        assert_eq!(whole, serde_json::to_vec(&value).unwrap());
        let cut = json_text(50, |out| serde::Serialize::serialize(&value, out));
        assert!(matches!(cut, Err(Undecoded::TooLarge(50))), "{cut:?}");
        // An f32 reads as the f64 a serde_json::Value holds for it.
        let f = json_text(100, |out| serde::Serialize::serialize(&0.1f32, out)).unwrap();
        assert_eq!(f, serde_json::to_vec(&serde_json::to_value(0.1f32).unwrap()).unwrap());
    }

    #[tokio::test]
    async fn a_json_schema_s_references_are_checked_through_every_level_with_or_without_an_id() {
        let r = registry(&stand_in().await);
        for id in [23, 24] {
            let json = |body: &'static str| {
                let r = &r;
                async move { r.decode_value(TopicFormat::JsonSchema, "t", Some(&datum(id, body.as_bytes()))).await }
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
            async move { r.decode_value(format, "t", Some(&datum(id, body.as_bytes()))).await }
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

/// What the client remembers of each id: answers that can never change are
/// asked for once, asks in flight are shared, and the cache has a bound.
#[cfg(test)]
mod remembered {
    use super::*;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// What the stand-in registry was asked, and whether id 2 is there yet.
    #[derive(Default)]
    struct Asked {
        ids: Mutex<HashMap<u32, u32>>,
        present: AtomicBool,
    }

    impl Asked {
        fn times(&self, id: u32) -> u32 {
            self.ids.lock().unwrap().get(&id).copied().unwrap_or(0)
        }
    }

    const AVRO: &str = r#"{"type":"record","name":"R","fields":[{"name":"a","type":"long"}]}"#;

    /// A stand-in registry counting the asks for each id.
    async fn counting() -> (String, Arc<Asked>) {
        use axum::extract::{Path, State};
        use axum::http::StatusCode;
        async fn by_id(State(asked): State<Arc<Asked>>, Path(id): Path<u32>) -> (StatusCode, String) {
            *asked.ids.lock().unwrap().entry(id).or_default() += 1;
            let ok = |schema: &str| (StatusCode::OK, serde_json::json!({ "schema": schema }).to_string());
            match id {
                1 => ok(AVRO),
                2 if asked.present.load(Ordering::SeqCst) => ok(AVRO),
                2 | 9 => {
                    (StatusCode::NOT_FOUND, format!(r#"{{"error_code":40403,"message":"Schema {id} not found"}}"#))
                }
                // Avro relay cannot use: a type that does not exist.
                3 => ok(r#"{"type":"nope"}"#),
                4 => {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    ok(AVRO)
                }
                5 => {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    (StatusCode::SERVICE_UNAVAILABLE, "busy".into())
                }
                // JSON, but not a schema; not JSON at all (a web page where the API was meant); too large.
                6 => (StatusCode::OK, r#"{"unexpected":true}"#.into()),
                7 => (StatusCode::OK, "<html>the registry's console</html>".into()),
                8 => (StatusCode::OK, " ".repeat(MAX_ANSWER_BYTES + 1)),
                // Schemas of about 7 MiB each (a long doc).
                100.. => {
                    let doc = "x".repeat(7 * 1024 * 1024);
                    ok(&format!(
                        r#"{{"type":"record","name":"R{id}","doc":"{doc}","fields":[{{"name":"a","type":"long"}}]}}"#
                    ))
                }
                _ => (StatusCode::NOT_FOUND, r#"{"error_code":40403}"#.into()),
            }
        }
        let asked = Arc::new(Asked::default());
        let app = axum::Router::new().route("/schemas/ids/{id}", axum::routing::get(by_id)).with_state(asked.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (format!("http://{addr}"), asked)
    }

    fn registry(url: &str) -> Registry {
        Registry::new(&SchemaRegistryConfig {
            url: url.parse().unwrap(),
            username: None,
            password_env: None,
            token_env: None,
            timeout: Duration::from_secs(5),
            tls: Default::default(),
        })
        .unwrap()
    }

    fn datum(id: u32) -> Vec<u8> {
        let mut v = header(id);
        v.push(4);
        v
    }

    #[tokio::test]
    async fn a_schema_relay_cannot_use_is_asked_for_once_and_each_record_names_its_own_topic() {
        let (url, asked) = counting().await;
        let r = registry(&url);
        for topic in ["t0", "t1", "t2", "t3", "t4"] {
            match r.decode(TopicFormat::Avro, topic, Some(&datum(3))).await {
                Err(Failure::Poison(why)) => {
                    assert!(why.contains(&format!("topic {topic:?}")) && why.contains("cannot be used"), "{why}")
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(asked.times(3), 1, "the registry was asked once for a schema that cannot be used");
        // For a while: then it is asked for again.
        for (at, _) in r.known().refused.values_mut() {
            *at = Instant::now().checked_sub(REMEMBERED_FOR).unwrap();
        }
        assert!(matches!(r.decode(TopicFormat::Avro, "t", Some(&datum(3))).await, Err(Failure::Poison(_))));
        assert_eq!(asked.times(3), 2);
    }

    #[tokio::test]
    async fn an_id_given_up_on_dead_letters_its_records_after_one_ask_until_the_registry_has_it() {
        let (url, asked) = counting().await;
        let r = registry(&url);
        let decode = |id: u32| {
            let r = &r;
            async move { r.decode(TopicFormat::Avro, "t", Some(&datum(id))).await }
        };
        let not_yet = |f: Result<Vec<u8>, Failure>| matches!(f, Err(Failure::NotYet(why)) if why.contains("40403"));
        // Until a record naming it is given up on, each ask is "not yet": the consumer's budget applies.
        for _ in 0..3 {
            assert!(not_yet(decode(2).await));
        }
        // Giving up on a record whose schema was found, or not in the wire format, changes nothing.
        r.gave_up(Some(&datum(1)));
        r.gave_up(Some(b"{}"));
        r.gave_up(None);
        assert!(decode(1).await.is_ok());
        r.gave_up(Some(&datum(2)));
        let before = asked.times(2);
        match decode(2).await {
            Err(Failure::Poison(why)) => assert!(
                why.contains("\"t\"")
                    && why.contains("schema id 2")
                    && why.contains("40403")
                    && why.contains("dead-lettered at once"),
                "{why}"
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(asked.times(2), before + 1, "one ask");
        assert!(not_yet(decode(9).await), "another id has its budget");
        // For a while: then a record has the budget again.
        r.known().missing.get_mut(&2).unwrap().gave_up = Instant::now().checked_sub(REMEMBERED_FOR);
        assert!(not_yet(decode(2).await));
        // The one ask finds the schema once the registry has it.
        r.gave_up(Some(&datum(2)));
        asked.present.store(true, Ordering::SeqCst);
        assert!(decode(2).await.is_ok());
        assert!(!r.known().missing.contains_key(&2));
    }

    #[test]
    fn what_is_remembered_of_ids_without_a_schema_is_bounded_in_count_oldest_first() {
        let now = Instant::now();
        let old = now.checked_sub(REMEMBERED_FOR).unwrap();
        let mut map: HashMap<u32, Instant> = HashMap::new();
        for id in 0..REMEMBERED_IDS as u32 {
            map.insert(id, if id % 2 == 0 { old } else { now - Duration::from_millis(u64::from(id)) });
        }
        make_room(&mut map, now, |at| *at);
        assert_eq!(map.len(), REMEMBERED_IDS / 2, "what is older than it holds goes first");
        for id in 0..REMEMBERED_IDS as u32 / 2 {
            map.insert(REMEMBERED_IDS as u32 + id, now);
        }
        make_room(&mut map, now, |at| *at);
        assert_eq!(map.len(), REMEMBERED_IDS - 1, "then the oldest");
        assert!(!map.contains_key(&(REMEMBERED_IDS as u32 - 1)));
    }

    #[tokio::test]
    async fn records_asking_for_one_id_at_once_share_one_ask_whatever_it_answers() {
        let (url, asked) = counting().await;
        let r = Arc::new(registry(&url));
        for id in [4, 5] {
            let mut asks = tokio::task::JoinSet::new();
            for _ in 0..10 {
                let r = r.clone();
                asks.spawn(async move { r.decode(TopicFormat::Avro, "t", Some(&datum(id))).await });
            }
            let answers = asks.join_all().await;
            match id {
                4 => assert!(answers.iter().all(Result::is_ok), "{answers:?}"),
                _ => assert!(answers.iter().all(|a| matches!(a, Err(Failure::Unavailable(_)))), "{answers:?}"),
            }
            assert_eq!(asked.times(id), 1, "id {id}: ten records at once, one ask");
        }
        assert!(r.known().flights.is_empty(), "no ask is left in flight");
    }

    #[tokio::test]
    async fn the_cache_keeps_a_bounded_number_of_bytes_letting_the_oldest_go() {
        let (url, asked) = counting().await;
        let r = registry(&url);
        // Ten schemas of 7 MiB: over 64 MiB together.
        for id in 100..110 {
            r.decode(TopicFormat::Avro, "t", Some(&datum(id))).await.unwrap();
        }
        r.decode(TopicFormat::Avro, "t", Some(&datum(109))).await.unwrap();
        assert_eq!(asked.times(109), 1, "the newest is kept");
        r.decode(TopicFormat::Avro, "t", Some(&datum(100))).await.unwrap();
        assert_eq!(asked.times(100), 2, "the oldest was let go and is asked for again");
    }

    #[tokio::test]
    async fn an_answer_that_never_changes_is_not_an_outage_for_ever() {
        let (url, asked) = counting().await;
        let r = registry(&url);
        let decode = |id: u32| {
            let r = &r;
            async move { r.decode(TopicFormat::Avro, "t", Some(&datum(id))).await }
        };
        // JSON that is not a schema: a wait at first, then the same answer again is not yet.
        for _ in 1..SAME_ANSWERS {
            assert!(matches!(decode(6).await, Err(Failure::Unavailable(why)) if why.contains("not a schema")));
        }
        match decode(6).await {
            Err(Failure::NotYet(why)) => {
                assert!(why.contains("not a schema") && why.contains(&format!("{SAME_ANSWERS} times")), "{why}")
            }
            other => panic!("{other:?}"),
        }
        // So a record naming it is dead-lettered after the budget, and the records after it at once.
        r.gave_up(Some(&datum(6)));
        assert!(matches!(decode(6).await, Err(Failure::Poison(why)) if why.contains("dead-lettered at once")));
        // Larger than relay reads: that schema will never be smaller.
        for _ in 0..2 {
            match decode(8).await {
                Err(Failure::Poison(why)) => {
                    assert!(why.contains("over 8388608 bytes") && why.contains("\"t\""), "{why}")
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(asked.times(8), 1);
        // What is not JSON at all is what a wrong url gives, not the schema: always a wait.
        for _ in 0..SAME_ANSWERS + 2 {
            assert!(matches!(decode(7).await, Err(Failure::Unavailable(why)) if why.contains("not JSON")));
        }
    }
}
