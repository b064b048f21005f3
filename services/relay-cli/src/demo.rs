//! `relay demo`: the whole pipeline on one machine, with what it needs
//! brought up in-process — an embedded Kafka (librdkafka's mock cluster), the
//! example provider on a free port — and PostgreSQL from `DATABASE_URL`
//! (`scripts/demo.sh` starts a local one).
//!
//! It runs the example configuration (`relay.example.toml`), produces example
//! orders including duplicates, an upstream retry under a new event id, a
//! stale cancellation, an order the provider rejects and poison records, then
//! prints what happened and checks the invariants: every order captured once
//! at the provider, every duplicate suppressed, every poison record parked.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use example_provider::{FaultKind, FaultRule, Provider, Settings};
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header as KHeader, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};
use relay_core::{InboxOutcome, RelayConfig};
use relay_store::audit;
use relay_store::intents::IntentState;
use relay_store::outbox::OutboxState;
use relay_store::stats::{self, Stats};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use relay::app::{Components, Relay};
use relay::ingest::handler::Handlers;
use relay::runtime::faults::Faults;

const CONFIG: &str = include_str!("../../../relay.example.toml");
const SCHEMAS: &[(&str, &str)] = &[
    ("contracts/schemas/order-placed.schema.json", include_str!("../../../contracts/schemas/order-placed.schema.json")),
    (
        "contracts/schemas/order-cancelled.schema.json",
        include_str!("../../../contracts/schemas/order-cancelled.schema.json"),
    ),
];

struct Input {
    what: &'static str,
    key: String,
    headers: Vec<(String, String)>,
    value: Vec<u8>,
}

fn order_placed(id: &str, order: &str, customer: &str, amount: i64, idem: &str) -> Input {
    let data = json!({"order_id": order, "customer_id": customer, "amount_cents": amount, "currency": "EUR"});
    Input {
        what: "order placed",
        key: order.into(),
        headers: ce_headers(
            id,
            "com.example.order.placed",
            &[("aggregateid", order), ("idempotencykey", idem), ("correlationid", &format!("checkout-{order}"))],
        ),
        value: data.to_string().into_bytes(),
    }
}

fn ce_headers(id: &str, ty: &str, ext: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut h = vec![
        ("ce_specversion".to_string(), "1.0".to_string()),
        ("ce_id".into(), id.into()),
        ("ce_type".into(), ty.into()),
        ("ce_source".into(), "/shop/orders".into()),
        ("content-type".into(), "application/json".into()),
    ];
    h.extend(ext.iter().map(|(k, v)| (format!("ce_{k}"), (*v).to_string())));
    h
}

fn inputs() -> Vec<Input> {
    let mut v = Vec::new();
    for i in 1..=5 {
        let order = format!("order-{}", 1000 + i);
        v.push(order_placed(&format!("evt-{i}"), &order, &format!("cust-{i}"), 1000 * i, &format!("place:{order}")));
    }
    // The provider declines this one's card (402, a business decline, never
    // retried): its intent dies and payment.failed is emitted.
    v.push(order_placed("evt-6", "order-1006", "cust-6", 999_999, "place:order-1006"));
    // Duplicates: the same event ids again, at later offsets.
    let mut dup = order_placed("evt-2", "order-1002", "cust-2", 2000, "place:order-1002");
    dup.what = "duplicate delivery (same event id)";
    v.push(dup);
    let mut dup = order_placed("evt-3", "order-1003", "cust-3", 3000, "place:order-1003");
    dup.what = "duplicate delivery (same event id)";
    v.push(dup);
    // An upstream retry: new event id, same business idempotency key.
    let mut retry = order_placed("evt-4-retry", "order-1004", "cust-4", 4000, "place:order-1004");
    retry.what = "upstream retry (new id, same idempotency key)";
    v.push(retry);
    // Cancellations with versions: v3 applies; v2 arrives late and is stale.
    let cancel = |id: &str, version: &str, what: &'static str| Input {
        what,
        key: "order-1006".into(),
        headers: ce_headers(
            id,
            "com.example.order.cancelled",
            &[("aggregateid", "order-1006"), ("aggregateversion", version)],
        ),
        value: json!({"order_id": "order-1006", "reason": "customer request"}).to_string().into_bytes(),
    };
    v.push(cancel("evt-7", "3", "order cancelled (version 3)"));
    v.push(cancel("evt-8", "2", "late cancellation (version 2: stale)"));
    // Poison.
    v.push(Input {
        what: "poison: bad JSON",
        key: "order-1001".into(),
        headers: ce_headers("evt-9", "com.example.order.placed", &[]),
        value: b"{\"order_id\": ".to_vec(),
    });
    let mut no_id = ce_headers("x", "com.example.order.placed", &[]);
    no_id.retain(|(k, _)| k != "ce_id");
    v.push(Input { what: "poison: no event id", key: "order-1002".into(), headers: no_id, value: b"{}".to_vec() });
    v.push(Input {
        what: "poison: schema-invalid (amount is a string)",
        key: "order-1003".into(),
        headers: ce_headers("evt-10", "com.example.order.placed", &[]),
        value: json!({"order_id": "order-1010", "customer_id": "c", "amount_cents": "ten", "currency": "EUR"})
            .to_string()
            .into_bytes(),
    });
    v
}

/// Run the demo. `DATABASE_URL` must point at an empty database.
pub async fn run() -> anyhow::Result<()> {
    let db_url = std::env::var("DATABASE_URL").map_err(|_| {
        anyhow::anyhow!("DATABASE_URL is not set; run scripts/demo.sh, which starts PostgreSQL and sets it")
    })?;
    println!("relay demo\n==========");
    let mock = MockCluster::new(1)?;
    let bootstrap = mock.bootstrap_servers();
    for (topic, partitions) in [("orders", 3), ("payments.events", 3), ("relay.dead-letters", 1)] {
        mock.create_topic(topic, partitions, 1)?;
    }
    println!("* embedded Kafka (librdkafka mock cluster) at {bootstrap}");
    let provider = Provider::start(SocketAddr::from(([127, 0, 0, 1], 0)), Settings::default()).await?;
    provider.set_faults(vec![FaultRule {
        path_prefix: None,
        key_prefix: Some("capture:order-1006".into()),
        times: None,
        kind: FaultKind::Body {
            status: 402,
            body:
                json!({"error": {"type": "card_error", "code": "card_declined", "message": "Your card was declined."}})
                    .to_string(),
        },
    }]);
    println!("* example payment provider at {}", provider.url());

    let dir = std::env::temp_dir().join(format!("relay-demo-{}", std::process::id()));
    for (path, text) in SCHEMAS {
        let p = dir.join(path);
        std::fs::create_dir_all(p.parent().expect("schema path has a parent"))?;
        std::fs::write(&p, text)?;
    }
    let mut cfg = RelayConfig::from_toml(
        &CONFIG.replace("schema = \"contracts/", &format!("schema = \"{}/contracts/", dir.display())),
    )?;
    cfg.kafka.bootstrap_servers = bootstrap.clone();
    // The mock cluster has no admin API to read topic retention from, and the
    // demo needs no console or cleanup.
    cfg.retention.inbox = None;
    cfg.admin.listen = None;
    cfg.database.url = Some(db_url.into());
    cfg.dispatcher.poll_interval = Duration::from_millis(200);
    cfg.publisher.poll_interval = Duration::from_millis(200);
    cfg.endpoints.get_mut("payments").expect("example config has the payments endpoint").base_url =
        provider.url().parse()?;
    let pool = relay::app::connect(&cfg).await?;
    relay_store::migrate(&pool).await?;
    println!("* PostgreSQL migrated");

    let consumer = cfg.consumer.name.clone();
    let relay = Relay::new(cfg, Handlers::default(), Faults::none()).await?;
    let shutdown = CancellationToken::new();
    let running = {
        let relay = relay.clone();
        let token = shutdown.clone();
        tokio::spawn(async move { relay.run(Components::ALL, token).await })
    };

    produce_inputs(&bootstrap).await?;
    let started = Instant::now();
    let snapshot = match settled(&pool).await {
        Ok(s) => s,
        Err(e) => {
            shutdown.cancel();
            return Err(e);
        }
    };
    println!("\nsettled after {:.1}s", started.elapsed().as_secs_f64());
    shutdown.cancel();
    running.await??;

    report(&pool, &consumer, &provider, &snapshot).await
}

/// Produce the example records to topic `orders`, a line each.
async fn produce_inputs(bootstrap: &str) -> anyhow::Result<()> {
    let producer: FutureProducer = ClientConfig::new().set("bootstrap.servers", bootstrap).create()?;
    let inputs = inputs();
    println!("\nproducing {} records to topic \"orders\":", inputs.len());
    for input in &inputs {
        let mut hs = OwnedHeaders::new();
        for (k, v) in &input.headers {
            hs = hs.insert(KHeader { key: k, value: Some(v.as_bytes()) });
        }
        let rec = FutureRecord::to("orders").key(input.key.as_bytes()).payload(&input.value).headers(hs);
        let d = producer.send(rec, Duration::from_secs(10)).await.map_err(|(e, _)| e)?;
        let id = input.headers.iter().find(|(k, _)| k == "ce_id").map_or("-", |(_, v)| v.as_str());
        println!("  [{}@{:<2}] {:<12} {}", d.partition, d.offset, id, input.what);
    }
    Ok(())
}

/// The counts once everything has settled (all recorded or parked, calls
/// finished, outbox published), or an error after 90 s.
async fn settled(pool: &sqlx::PgPool) -> anyhow::Result<Stats> {
    let started = Instant::now();
    // 6 orders + 1 upstream retry (duplicate_key) + 2 cancellations; the 2 duplicate deliveries add no row.
    let expected_inbox = 9;
    loop {
        let s = stats::snapshot(&mut *pool.acquire().await?).await?;
        let inbox: i64 = s.inbox.iter().map(|(_, n)| n).sum();
        let unfinished =
            Stats::count(&s.intents, IntentState::Pending) + Stats::count(&s.intents, IntentState::Running);
        let unpublished = Stats::count(&s.outbox, OutboxState::Pending) + Stats::count(&s.outbox, OutboxState::Running);
        let done = inbox >= expected_inbox
            && s.dead_letters_total >= 3
            && unfinished == 0
            && unpublished == 0
            && Stats::count(&s.intents, IntentState::Succeeded) + Stats::count(&s.intents, IntentState::Dead) >= 6;
        if done {
            return Ok(s);
        }
        if started.elapsed() > Duration::from_secs(90) {
            anyhow::bail!("the demo did not settle within 90 s: {s:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn report(pool: &sqlx::PgPool, consumer: &str, provider: &Provider, s: &Stats) -> anyhow::Result<()> {
    println!("\ninbox (one row per unique event id, with what the guards decided):");
    for (outcome, n) in &s.inbox {
        println!("  {outcome:<22} {n}");
    }
    // From the same counters /metrics serves.
    let metrics = relay::runtime::metrics::install().render();
    let counted = |layer: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with("relay_duplicates_total{") && l.contains(&format!("layer=\"{layer}\"")))
            .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
            .sum()
    };
    println!("\nduplicates suppressed (relay_duplicates_total):");
    println!("  by the inbox           {}", counted("inbox"));
    println!("  by idempotency key     {}", counted("idempotency_key"));
    let p = provider.stats();
    println!("\nprovider (counts at the fake payment API):");
    println!("  requests received      {}", p.requests);
    println!("  captures applied       {}", p.applied);
    println!("  replays (same key)     {}", p.replayed);
    println!("  keys applied twice     {}", p.double_applied().len());
    println!(
        "\nintents: {} succeeded, {} dead",
        Stats::count(&s.intents, IntentState::Succeeded),
        Stats::count(&s.intents, IntentState::Dead)
    );
    let dead = audit::dead_intents(pool).await?;
    for (key, status, err) in &dead {
        println!(
            "  dead: {key} (HTTP {}) {}",
            status.map_or("-".into(), |s| s.to_string()),
            err.as_deref().unwrap_or("")
        );
    }
    if !dead.is_empty() {
        println!(
            "  (the provider declined order-1006's card, a business decline: the call is not retried, and its\n   \
             route's on_dead announces payment.failed)"
        );
    }
    let published = audit::published_by_type(pool).await?;
    println!("\npublished to Kafka (acknowledged by the broker):");
    for (topic, ty, n) in &published {
        println!("  {topic:<20} {ty:<42} {n}");
    }
    let dls = audit::dead_letters_brief(pool).await?;
    println!("\ndead letters (also copied to topic relay.dead-letters; `relay dead-letters list` shows them):");
    for (id, topic, part, off, class, reason) in &dls {
        let reason: String = reason.chars().take(90).collect();
        println!("  #{id} {topic}[{part}]@{off} {class}: {reason}");
    }
    let sagas = audit::sagas_of(pool, consumer, "order").await?;
    println!("\norder sagas:");
    let by_state: BTreeMap<&str, Vec<&str>> = sagas.iter().fold(BTreeMap::new(), |mut m, (id, st)| {
        m.entry(st.as_str()).or_insert_with(Vec::new).push(id.as_str());
        m
    });
    for (state, ids) in &by_state {
        println!("  {state:<16} {}", ids.join(", "));
    }
    println!("\nbusiness counters (unique effects, not deliveries):");
    for (_, name, v) in &s.counters {
        println!("  {name:<22} {v}");
    }

    check_invariants(s, &p, dls.len())
}

/// The demo's invariants, checked against the counts, the provider's
/// record and the dead letters parked.
fn check_invariants(s: &Stats, p: &example_provider::Stats, dead_letters: usize) -> anyhow::Result<()> {
    let mut problems = Vec::new();
    let captured: Value = json!(p.by_key.keys().filter(|k| k.starts_with("capture:")).count());
    if !p.double_applied().is_empty() {
        problems.push(format!("keys applied more than once at the provider: {:?}", p.double_applied()));
    }
    if p.applied != 5 {
        problems.push(format!("expected 5 captures applied at the provider, saw {} (keys: {captured})", p.applied));
    }
    if Stats::count(&s.intents, IntentState::Succeeded) != 5 || Stats::count(&s.intents, IntentState::Dead) != 1 {
        problems.push(format!("expected 5 succeeded and 1 dead intent, saw {:?}", s.intents));
    }
    if dead_letters != 3 {
        problems.push(format!("expected 3 dead letters, saw {}", dead_letters));
    }
    if Stats::count(&s.inbox, InboxOutcome::DuplicateKey) != 1 || Stats::count(&s.inbox, InboxOutcome::Stale) != 1 {
        problems.push(format!("expected 1 duplicate_key and 1 stale inbox row, saw {:?}", s.inbox));
    }
    if problems.is_empty() {
        println!(
            "\nOK: every order captured exactly once at the provider; 2 duplicate deliveries and 1 upstream retry suppressed; 1 stale event ignored; 3 poison records parked while the partition kept moving."
        );
        Ok(())
    } else {
        anyhow::bail!("the demo found violations:\n  - {}", problems.join("\n  - "))
    }
}
