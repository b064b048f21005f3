//! Test harness for the relay: one fresh PostgreSQL database per test, topics
//! with random names on the test broker, a producer for CloudEvents (and the
//! records a consumer would receive, for tests without a broker), a reader
//! for what the relay published, a polling helper with a deadline, relay
//! processes and private servers ([`process`]), and rows written straight
//! into the relay's tables plus the probes the benchmark polls ([`seed`]).
//!
//! The services come from `scripts/test.sh`, which exports
//! `RELAY_TEST_DATABASE_URL` (a role that may create databases) and
//! `RELAY_TEST_KAFKA_BOOTSTRAP` (an Apache Kafka broker). Tests fail with a
//! message saying so when they are missing: a test that needs a broker never
//! silently passes without one.

pub mod process;
pub mod routes;
pub mod seed;
pub mod tls;

use std::collections::HashMap;
use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header as KHeader, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::Value;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

/// How long helpers wait for the system under test before failing.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// A random name with a readable prefix, for topics, groups and consumers.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", &Uuid::new_v4().simple().to_string()[..12])
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run the tests with scripts/test.sh, which starts PostgreSQL and Kafka")
    })
}

/// The test broker's bootstrap address.
pub fn kafka_bootstrap() -> String {
    env("RELAY_TEST_KAFKA_BOOTSTRAP")
}

/// Set to keep every test database after its test (they are dropped when the
/// `TestDb` goes out of scope unless the test panicked).
pub const KEEP_DATABASES_VAR: &str = "RELAY_TEST_KEEP_DATABASES";

/// A fresh, migrated database owned by one test.
///
/// Dropped (its sessions ended, then `DROP DATABASE`) when the value goes out of scope,
/// so a test run or a benchmark does not leave gigabytes behind; kept, with
/// its name on stderr, when the thread is panicking (a failed test's data is
/// the evidence) or when [`KEEP_DATABASES_VAR`] is set.
pub struct TestDb {
    /// Pool on the database.
    pub pool: PgPool,
    /// Its URL (for relay processes under test).
    pub url: String,
    /// Its name.
    pub name: String,
    /// The role that created it, to drop it.
    admin_url: String,
}

impl TestDb {
    /// Create and migrate a new database on the test server.
    pub async fn new() -> anyhow::Result<TestDb> {
        TestDb::create_in(&env("RELAY_TEST_DATABASE_URL")).await
    }

    /// Create and migrate a new database through `admin_url` (a role that may create databases).
    pub async fn create_in(admin_url: &str) -> anyhow::Result<TestDb> {
        let admin_url = admin_url.to_owned();
        let name = format!("relay_test_{}", Uuid::new_v4().simple());
        let mut admin = PgConnection::connect(&admin_url).await.context("connect as the test role")?;
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut admin).await?;
        admin.close().await?;
        let url = replace_db(&admin_url, &name);
        let pool = PgPoolOptions::new().max_connections(10).connect(&url).await?;
        relay_store::migrate(&pool).await?;
        Ok(TestDb { pool, url, name, admin_url })
    }

    /// A new database migrated only up to `version` (a migration's number,
    /// e.g. `20261203000011`), as a relay of that version left it: a test
    /// writes rows of that version, then runs the rest
    /// ([`relay_store::migrate`]) as an upgrade would.
    pub async fn migrated_up_to(version: i64) -> anyhow::Result<TestDb> {
        let admin_url = env("RELAY_TEST_DATABASE_URL");
        let name = format!("relay_test_{}", Uuid::new_v4().simple());
        let mut admin = PgConnection::connect(&admin_url).await.context("connect as the test role")?;
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut admin).await?;
        admin.close().await?;
        let url = replace_db(&admin_url, &name);
        let pool = PgPoolOptions::new().max_connections(10).connect(&url).await?;
        // The same files in a directory of their own: the same checksums, so
        // the full migrator later takes them as applied.
        let all = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../migrations");
        let dir = std::env::temp_dir().join(format!("{name}-migrations"));
        std::fs::create_dir_all(&dir)?;
        for entry in std::fs::read_dir(&all)? {
            let path = entry?.path();
            let file = path.file_name().and_then(|f| f.to_str()).unwrap_or_default().to_owned();
            let number = file.split('_').next().and_then(|n| n.parse::<i64>().ok());
            if number.is_some_and(|n| n <= version) {
                std::fs::copy(&path, dir.join(&file))?;
            }
        }
        sqlx::migrate::Migrator::new(dir.as_path()).await?.run(&pool).await?;
        let _ = std::fs::remove_dir_all(&dir);
        Ok(TestDb { pool, url, name, admin_url })
    }

    /// A connection from the pool.
    pub async fn conn(&self) -> anyhow::Result<sqlx::pool::PoolConnection<sqlx::Postgres>> {
        Ok(self.pool.acquire().await?)
    }

    /// `SELECT count(*)` with a WHERE clause over a relay table.
    pub async fn count(&self, table: &str, filter: &str) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM relay.{table} WHERE {filter}"))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("count relay.{table} WHERE {filter}: {e}"))
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        if std::thread::panicking() || std::env::var_os(KEEP_DATABASES_VAR).is_some() {
            eprintln!("kept test database {name}");
            return;
        }
        // Drop runs inside the test's runtime, which cannot be blocked on from
        // its own thread: the DROP gets a thread and a runtime of its own.
        // The connections still open (the pool's, a child process's) are the
        // test role's: it ends them and waits. Not `DROP … WITH (FORCE)`: for a
        // role that is not a superuser it fails while an autovacuum worker is
        // in the database, while a plain DROP stops autovacuum by itself.
        let admin_url = self.admin_url.clone();
        let dropped = std::thread::spawn(move || -> anyhow::Result<()> {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(async {
                let mut admin = PgConnection::connect(&admin_url).await?;
                let mut tries = 0;
                loop {
                    sqlx::query(
                        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity
                          WHERE datname = $1 AND usename = current_user AND pid <> pg_backend_pid()",
                    )
                    .bind(&name)
                    .execute(&mut admin)
                    .await?;
                    match sqlx::query(&format!("DROP DATABASE IF EXISTS {name}")).execute(&mut admin).await {
                        Ok(_) => break,
                        // A connection opened between the two statements.
                        Err(e) if tries < 3 => {
                            tries += 1;
                            eprintln!("dropping test database {name}: {e}; trying again");
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                admin.close().await?;
                Ok(())
            })
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("warning: could not drop test database {}: {e:#}", self.name),
            Err(_) => eprintln!("warning: dropping test database {} panicked", self.name),
        }
    }
}

fn replace_db(url: &str, db: &str) -> String {
    let (base, query) = url.split_once('?').map_or((url, None), |(b, q)| (b, Some(q)));
    let cut = base.rfind('/').expect("database URL has a path");
    let mut out = format!("{}/{db}", &base[..cut]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// A TCP proxy a test can cut and restore, to take a dependency "down" for
/// one component without touching the shared server.
pub struct TcpProxy {
    addr: std::net::SocketAddr,
    open: std::sync::Arc<std::sync::atomic::AtomicBool>,
    attempts: std::sync::Arc<std::sync::atomic::AtomicU64>,
    kill: tokio::sync::watch::Sender<u64>,
    /// Whether connections are held open and silent (see [`TcpProxy::stall`]).
    stalled: std::sync::Arc<std::sync::atomic::AtomicBool>,
    stall: tokio::sync::watch::Sender<u64>,
}

impl TcpProxy {
    /// Proxy 127.0.0.1:<free port> to `target`.
    pub async fn start(target: std::net::SocketAddr) -> anyhow::Result<TcpProxy> {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let open = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let attempts = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (kill, _) = tokio::sync::watch::channel(0u64);
        let stalled = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (stall, _) = tokio::sync::watch::channel(0u64);
        let (o, a, k, st, sl) = (open.clone(), attempts.clone(), kill.clone(), stalled.clone(), stall.clone());
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                if !o.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let (mut killed, mut stalling) = (k.subscribe(), sl.subscribe());
                let silent = st.load(Ordering::SeqCst);
                tokio::spawn(async move {
                    if silent {
                        // Accepted, and never a byte back: held until cut.
                        let _ = killed.changed().await;
                        drop(client);
                        return;
                    }
                    let Ok(mut server) = tokio::net::TcpStream::connect(target).await else { return };
                    let stalled = tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => false,
                        _ = killed.changed() => false,
                        _ = stalling.changed() => true,
                    };
                    if stalled {
                        // Both ends stay open and nothing moves: a peer gone
                        // without a reset. Restoring does not revive it.
                        let _ = killed.changed().await;
                    }
                });
            }
        });
        Ok(TcpProxy { addr, open, attempts, kill, stalled, stall })
    }

    /// The proxy's address.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// Drop every open connection and refuse new ones.
    pub fn cut(&self) {
        self.open.store(false, std::sync::atomic::Ordering::SeqCst);
        self.kill.send_modify(|n| *n += 1);
    }

    /// Go silent without a reset, as a database host that vanishes in a
    /// failover or freezes: open connections stay open and nothing more
    /// moves on them, and new ones are accepted and never answered.
    pub fn stall(&self) {
        self.stalled.store(true, std::sync::atomic::Ordering::SeqCst);
        self.stall.send_modify(|n| *n += 1);
    }

    /// Accept (and forward) connections again; connections stalled stay so.
    pub fn restore(&self) {
        self.open.store(true, std::sync::atomic::Ordering::SeqCst);
        self.stalled.store(false, std::sync::atomic::Ordering::SeqCst);
    }

    /// Connection attempts so far.
    pub fn attempts(&self) -> u64 {
        self.attempts.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Replace the host:port of a PostgreSQL URL.
pub fn url_via(url: &str, addr: std::net::SocketAddr) -> String {
    let (scheme, rest) = url.split_once("://").expect("URL has a scheme");
    let (auth, after) = rest.rsplit_once('@').map_or(("", rest), |(a, b)| (a, b));
    let path = after.find('/').map_or("", |i| &after[i..]);
    let auth = if auth.is_empty() { String::new() } else { format!("{auth}@") };
    format!("{scheme}://{auth}{addr}{path}")
}

/// Poll `check` until it returns `Some`, or fail after `deadline` with `what`.
pub async fn eventually<T, F, Fut>(what: &str, deadline: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let end = Instant::now() + deadline;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if Instant::now() > end {
            panic!("timed out after {deadline:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn client(bootstrap: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap);
    c
}

/// Create topics with `partitions` partitions and wait until they are usable.
pub async fn create_topics(bootstrap: &str, names: &[&str], partitions: i32) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> = client(bootstrap).create()?;
    let topics: Vec<NewTopic> =
        names.iter().map(|n| NewTopic::new(n, partitions, TopicReplication::Fixed(1))).collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    for r in admin.create_topics(&topics, &opts).await? {
        if let Err((topic, code)) = r
            && code != rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists
        {
            bail!("create topic {topic}: {code}");
        }
    }
    // Wait until every partition has a leader.
    let probe: BaseConsumer = client(bootstrap).create()?;
    let end = Instant::now() + Duration::from_secs(30);
    for name in names {
        loop {
            let md = probe.fetch_metadata(Some(name), Duration::from_secs(5))?;
            let ready = md.topics().first().is_some_and(|t| {
                t.error().is_none()
                    && t.partitions().len() == partitions as usize
                    && t.partitions().iter().all(|p| p.leader() >= 0)
            });
            if ready {
                break;
            }
            if Instant::now() > end {
                bail!("topic {name} not ready after 30 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// A CloudEvent to produce in binary mode.
#[derive(Debug, Clone)]
pub struct TestEvent {
    /// `ce_id`; `None` produces a record without one.
    pub id: Option<String>,
    /// `ce_type`.
    pub event_type: String,
    /// Data (JSON).
    pub data: Value,
    /// Extensions (`ce_<name>` headers).
    pub extensions: Vec<(String, String)>,
    /// Record key.
    pub key: Option<String>,
    /// Explicit partition.
    pub partition: Option<i32>,
}

impl TestEvent {
    /// A new event.
    pub fn new(id: &str, event_type: &str, data: Value) -> TestEvent {
        TestEvent {
            id: Some(id.into()),
            event_type: event_type.into(),
            data,
            extensions: Vec::new(),
            key: None,
            partition: None,
        }
    }

    /// Add an extension attribute.
    pub fn ext(mut self, name: &str, value: impl ToString) -> TestEvent {
        self.extensions.push((name.into(), value.to_string()));
        self
    }

    /// Set the key.
    pub fn key(mut self, key: &str) -> TestEvent {
        self.key = Some(key.into());
        self
    }

    /// Set the partition.
    pub fn partition(mut self, p: i32) -> TestEvent {
        self.partition = Some(p);
        self
    }

    /// Its Kafka headers, in the order they are produced.
    pub fn headers(&self) -> Vec<(String, Vec<u8>)> {
        let mut headers = vec![
            ("ce_specversion".to_string(), b"1.0".to_vec()),
            ("ce_type".to_string(), self.event_type.as_bytes().to_vec()),
            ("ce_source".to_string(), b"/tests".to_vec()),
            ("content-type".to_string(), b"application/json".to_vec()),
        ];
        if let Some(id) = &self.id {
            headers.push(("ce_id".into(), id.as_bytes().to_vec()));
        }
        for (k, v) in &self.extensions {
            headers.push((format!("ce_{k}"), v.as_bytes().to_vec()));
        }
        headers
    }

    /// The record a consumer would receive for it at `offset` of `topic`
    /// (its partition, or 0), for tests that route records without a broker.
    pub fn record(&self, topic: &str, offset: i64) -> relay_core::RawRecord {
        relay_core::RawRecord {
            topic: topic.into(),
            partition: self.partition.unwrap_or(0),
            offset,
            key: self.key.as_ref().map(|k| k.as_bytes().to_vec()),
            payload: Some(serde_json::to_vec(&self.data).expect("JSON data serializes")),
            headers: self
                .headers()
                .into_iter()
                .map(|(name, value)| relay_core::Header::new(name, Some(value)))
                .collect(),
        }
    }
}

/// A producer for tests.
pub struct TestProducer {
    inner: FutureProducer,
}

impl TestProducer {
    /// Connect.
    pub fn new(bootstrap: &str) -> anyhow::Result<TestProducer> {
        Self::with_properties(bootstrap, &[])
    }

    /// Connect with librdkafka `properties` on top (e.g. `compression.type`).
    pub fn with_properties(bootstrap: &str, properties: &[(&str, &str)]) -> anyhow::Result<TestProducer> {
        let mut c = client(bootstrap);
        c.set("message.timeout.ms", "30000");
        for (k, v) in properties {
            c.set(*k, *v);
        }
        Ok(TestProducer { inner: c.create()? })
    }

    /// Produce a CloudEvent in binary mode; returns (partition, offset).
    pub async fn event(&self, topic: &str, e: &TestEvent) -> anyhow::Result<(i32, i64)> {
        let payload = serde_json::to_vec(&e.data)?;
        self.raw(topic, e.partition, e.key.as_deref().map(str::as_bytes), &e.headers(), Some(&payload)).await
    }

    /// Produce any record; returns (partition, offset).
    pub async fn raw(
        &self,
        topic: &str,
        partition: Option<i32>,
        key: Option<&[u8]>,
        headers: &[(String, Vec<u8>)],
        payload: Option<&[u8]>,
    ) -> anyhow::Result<(i32, i64)> {
        let mut hs = OwnedHeaders::new();
        for (k, v) in headers {
            hs = hs.insert(KHeader { key: k, value: Some(v) });
        }
        let mut rec: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(hs);
        if let Some(p) = partition {
            rec = rec.partition(p);
        }
        if let Some(k) = key {
            rec = rec.key(k);
        }
        if let Some(p) = payload {
            rec = rec.payload(p);
        }
        let delivery = self
            .inner
            .send(rec, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| anyhow::anyhow!("produce to {topic}: {e}"))?;
        Ok((delivery.partition, delivery.offset))
    }
}

/// Produce a record whose headers' names are any bytes, as Go's sarama or
/// librdkafka's C API can (rdkafka's safe API only takes `&str` names);
/// waits until the producer has delivered it. A producer of its own: a
/// `FutureProducer` expects a reply slot with every record.
pub fn produce_with_raw_header_names(
    bootstrap: &str,
    topic: &str,
    partition: i32,
    headers: &[(&[u8], &[u8])],
    payload: &[u8],
) -> anyhow::Result<()> {
    use rdkafka::bindings as rd;
    use rdkafka::producer::{BaseProducer, Producer};
    let producer: BaseProducer = client(bootstrap).create()?;
    let topic_c = std::ffi::CString::new(topic)?;
    // SAFETY: a fresh headers list; librdkafka copies each name and value
    // (with its length) in; on success produceva takes the list over.
    let hdrs = unsafe { rd::rd_kafka_headers_new(headers.len()) };
    for (name, value) in headers {
        // SAFETY: pointers and lengths of live slices, copied by librdkafka.
        unsafe {
            rd::rd_kafka_header_add(
                hdrs,
                name.as_ptr().cast(),
                name.len() as isize,
                value.as_ptr().cast(),
                value.len() as isize,
            )
        };
    }
    let vu = |vtype, u| rd::rd_kafka_vu_t { vtype, u };
    let args = [
        vu(rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_TOPIC, rd::rd_kafka_vu_s__bindgen_ty_1 { cstr: topic_c.as_ptr() }),
        vu(rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_PARTITION, rd::rd_kafka_vu_s__bindgen_ty_1 { i32_: partition }),
        vu(
            rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_VALUE,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                mem: rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 {
                    ptr: payload.as_ptr() as *mut _,
                    size: payload.len(),
                },
            },
        ),
        // RD_KAFKA_MSG_F_COPY: the payload is copied before produceva returns.
        vu(rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_MSGFLAGS, rd::rd_kafka_vu_s__bindgen_ty_1 { i: 2 }),
        vu(rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_HEADERS, rd::rd_kafka_vu_s__bindgen_ty_1 { headers: hdrs }),
    ];
    // SAFETY: the producer's live handle and a well-formed argument array.
    let err = unsafe { rd::rd_kafka_produceva(producer.client().native_ptr(), args.as_ptr(), args.len()) };
    if !err.is_null() {
        // SAFETY: an error object produceva returned, read then freed once;
        // on failure the headers stay ours to free.
        let text = unsafe {
            let text = std::ffi::CStr::from_ptr(rd::rd_kafka_error_string(err)).to_string_lossy().into_owned();
            rd::rd_kafka_error_destroy(err);
            rd::rd_kafka_headers_destroy(hdrs);
            text
        };
        bail!("produce to {topic}: {text}");
    }
    producer.flush(Duration::from_secs(30))?;
    Ok(())
}

/// A record read back from a topic.
#[derive(Debug, Clone)]
pub struct ReadRecord {
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Key.
    pub key: Option<Vec<u8>>,
    /// Headers (UTF-8 values; non-UTF-8 lossily).
    pub headers: HashMap<String, String>,
    /// Value.
    pub payload: Option<Vec<u8>>,
}

impl ReadRecord {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    /// The value as JSON.
    pub fn json(&self) -> Value {
        self.payload.as_deref().and_then(|p| serde_json::from_slice(p).ok()).unwrap_or(Value::Null)
    }
}

/// Read every record of `topic` from the beginning until at least `min`
/// records arrived and no more come for a moment, or the deadline passes.
pub async fn read_topic(bootstrap: &str, topic: &str, min: usize) -> anyhow::Result<Vec<ReadRecord>> {
    let bootstrap = bootstrap.to_owned();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || read_topic_blocking(&bootstrap, &topic, min)).await?
}

fn read_topic_blocking(bootstrap: &str, topic: &str, min: usize) -> anyhow::Result<Vec<ReadRecord>> {
    let consumer: BaseConsumer = client(bootstrap)
        .set("group.id", unique("reader"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()?;
    let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let mut tpl = TopicPartitionList::new();
    for p in md.topics().first().map(|t| t.partitions()).unwrap_or_default() {
        tpl.add_partition_offset(topic, p.id(), Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let mut out = Vec::new();
    let end = Instant::now() + DEADLINE;
    let mut quiet_since = Instant::now();
    loop {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                let headers = m
                    .headers()
                    .map(|hs| {
                        hs.iter()
                            .map(|h| {
                                (
                                    h.key.to_owned(),
                                    h.value.map(|v| String::from_utf8_lossy(v).into_owned()).unwrap_or_default(),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                out.push(ReadRecord {
                    partition: m.partition(),
                    offset: m.offset(),
                    key: m.key().map(<[u8]>::to_vec),
                    headers,
                    payload: m.payload().map(<[u8]>::to_vec),
                });
                quiet_since = Instant::now();
            }
            Some(Err(e)) => bail!("reading {topic}: {e}"),
            None => {
                if out.len() >= min && quiet_since.elapsed() > Duration::from_millis(500) {
                    return Ok(out);
                }
            }
        }
        if Instant::now() > end {
            bail!("read {} records from {topic}, expected at least {min}", out.len());
        }
    }
}

/// Raise a librdkafka fatal error on `client`, as an idempotent producer
/// gets when it can no longer keep order (librdkafka's own test hook: real
/// ones cannot be provoked from outside).
pub fn raise_fatal_error<C: rdkafka::client::ClientContext>(
    client: &rdkafka::client::Client<C>,
    reason: &str,
) -> anyhow::Result<()> {
    use rdkafka::bindings as rd;
    let reason = std::ffi::CString::new(reason)?;
    let code = rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER;
    // SAFETY: the client's live handle and a NUL-terminated string librdkafka copies.
    let err = unsafe { rd::rd_kafka_test_fatal_error(client.native_ptr(), code, reason.as_ptr()) };
    anyhow::ensure!(err == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR, "rd_kafka_test_fatal_error: {err:?}");
    Ok(())
}

/// Committed offsets of `group` on `topic`, by partition (`None` = nothing committed).
pub async fn committed_offsets(bootstrap: &str, group: &str, topic: &str) -> anyhow::Result<HashMap<i32, Option<i64>>> {
    OffsetWatch::new(bootstrap, group, topic).await?.committed().await
}

/// Reads a group's committed offsets on one topic again and again through
/// one client, for loops that poll them: a new client per read would cost a
/// connection, a metadata request and a coordinator lookup every time.
pub struct OffsetWatch {
    consumer: std::sync::Arc<BaseConsumer>,
    partitions: TopicPartitionList,
}

impl OffsetWatch {
    /// A client for `group`, and the partitions `topic` has now.
    pub async fn new(bootstrap: &str, group: &str, topic: &str) -> anyhow::Result<Self> {
        let (bootstrap, group, topic) = (bootstrap.to_owned(), group.to_owned(), topic.to_owned());
        tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer = client(&bootstrap).set("group.id", &group).create()?;
            let md = consumer.fetch_metadata(Some(&topic), Duration::from_secs(10))?;
            let mut partitions = TopicPartitionList::new();
            for p in md.topics().first().map(|t| t.partitions()).unwrap_or_default() {
                partitions.add_partition(&topic, p.id());
            }
            Ok(Self { consumer: std::sync::Arc::new(consumer), partitions })
        })
        .await?
    }

    /// Committed offsets by partition (`None` = nothing committed).
    pub async fn committed(&self) -> anyhow::Result<HashMap<i32, Option<i64>>> {
        let (consumer, partitions) = (self.consumer.clone(), self.partitions.clone());
        tokio::task::spawn_blocking(move || {
            let committed = consumer.committed_offsets(partitions, Duration::from_secs(10))?;
            Ok(committed
                .elements()
                .iter()
                .map(|e| (e.partition(), if let Offset::Offset(o) = e.offset() { Some(o) } else { None }))
                .collect())
        })
        .await?
    }

    /// The committed offsets summed over the partitions (nothing committed counts 0).
    pub async fn total(&self) -> anyhow::Result<i64> {
        Ok(self.committed().await?.values().map(|o| o.unwrap_or(0)).sum())
    }
}
