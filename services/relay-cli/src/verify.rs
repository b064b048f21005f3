//! `relay verify`: an independent check of the final state against the
//! invariants of docs/CONTRACT.md, from the outside — what is on the input
//! topics, what is in the database, what reached the output topics, and what
//! the provider says it applied.
//!
//! * every valid input record below the group's committed offset has its inbox
//!   row (or is parked as a dead letter with its reason); every poison record
//!   is parked at its position (R1, R2, R3, R11);
//! * every applied event of a route has each of its call intents (R7);
//! * every provider effect is applied once: no idempotency key twice, no
//!   intent under two keys, no succeeded intent without its effect (R8);
//! * every published outbox row is on its topic, found by its
//!   `relay_outbox_id` header (R10);
//! * nothing is stuck past its lease or due time (R9);
//! * every business counter equals the number of unique applied events (R20).
//!
//! It only reads. Violations name the event ids, keys or rows involved.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use relay_core::config::ActionConfig;
use relay_core::ids::derived_id;
use relay_core::{RawRecord, RelayConfig, Routed, Router};
use relay_store::audit::{self, Claimed};
use relay_store::inbox;
use relay_store::intents::IntentState;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use relay::publish::publisher::OUTBOX_ID_HEADER;
use relay::runtime::kafka::{Role, client_config};

/// One effect the provider says it applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderEffect {
    /// The idempotency key it was applied under.
    #[serde(alias = "key")]
    pub idempotency_key: String,
    /// The relay's intent id (`X-Relay-Intent-Id`), when the provider recorded it.
    #[serde(default)]
    pub intent_id: Option<String>,
}

/// Read the provider's record: a URL answering a JSON array (the example
/// provider's `/_control/effects`), or a file with a JSON array or JSON lines.
pub async fn load_effects(source: &str) -> anyhow::Result<Vec<ProviderEffect>> {
    let text = if source.starts_with("http://") || source.starts_with("https://") {
        reqwest::get(source).await?.error_for_status()?.text().await?
    } else {
        std::fs::read_to_string(source).map_err(|e| anyhow::anyhow!("cannot read {source}: {e}"))?
    };
    let trimmed = text.trim_start();
    if trimmed.starts_with('[') {
        return Ok(serde_json::from_str(trimmed)?);
    }
    trimmed
        .lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| anyhow::anyhow!("{source} line {}: {e}", i + 1)))
        .collect()
}

/// What to check against.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// The provider's applied effects, if available.
    pub effects: Option<Vec<ProviderEffect>>,
    /// Rows past their lease or due time by more than this are stuck.
    pub grace: Duration,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        VerifyOptions { effects: None, grace: Duration::from_secs(60) }
    }
}

/// A broken invariant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// Which check.
    pub check: &'static str,
    /// What is wrong.
    pub message: String,
    /// How many event ids, keys or rows are involved.
    pub count: usize,
    /// Event ids, keys or row ids involved (at most 20 listed).
    pub ids: Vec<String>,
}

/// The checker's findings.
#[derive(Debug, Clone, Default, Serialize)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct Report {
    /// Records read from the input topics.
    pub input_records: usize,
    /// Records at or after the group's committed offset (not yet due to be processed).
    pub not_yet_committed: usize,
    /// Distinct valid event ids among the committed records.
    pub unique_events: usize,
    /// Records whose event id was already seen at an earlier position.
    pub duplicate_deliveries: usize,
    /// Poison records among the committed ones.
    pub poison_records: usize,
    /// Inbox rows by outcome.
    pub inbox_by_outcome: BTreeMap<String, i64>,
    /// Valid events parked as dead letters (missing reference, sequence gap, …).
    pub parked_events: usize,
    /// Dead letters in total.
    pub dead_letters: usize,
    pub intents_by_state: BTreeMap<String, i64>,
    /// Effects in the provider's record.
    pub provider_effects: Option<usize>,
    /// Published outbox rows.
    pub published_rows: usize,
    /// Records carrying an outbox id found on the output topics.
    pub output_records: usize,
    /// Outbox rows found more than once on their topic (republished after a crash; allowed).
    pub republished_rows: usize,
    /// Notes that are not violations.
    pub warnings: Vec<String>,
    /// Broken invariants.
    pub violations: Vec<Violation>,
}

impl Report {
    /// No violations.
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    fn violate(&mut self, check: &'static str, message: String, ids: impl IntoIterator<Item = String>) {
        let mut ids: Vec<String> = ids.into_iter().collect();
        let count = ids.len();
        ids.sort();
        ids.truncate(20);
        self.violations.push(Violation { check, message, count, ids });
    }

    /// Human-readable report.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let mut line = |k: &str, v: String| s.push_str(&format!("  {k:<38} {v}\n"));
        line("input records read", self.input_records.to_string());
        line("  not yet committed by the group", self.not_yet_committed.to_string());
        line("unique valid events", self.unique_events.to_string());
        line("duplicate deliveries (same event id)", self.duplicate_deliveries.to_string());
        line("poison records", self.poison_records.to_string());
        for (outcome, n) in &self.inbox_by_outcome {
            line(&format!("inbox: {outcome}"), n.to_string());
        }
        line("valid events parked as dead letters", self.parked_events.to_string());
        line("dead letters", self.dead_letters.to_string());
        for (state, n) in &self.intents_by_state {
            line(&format!("intents: {state}"), n.to_string());
        }
        if let Some(n) = self.provider_effects {
            line("effects in the provider's record", n.to_string());
        }
        line("published outbox rows", self.published_rows.to_string());
        line("outbox records on the output topics", self.output_records.to_string());
        line("  rows published more than once", self.republished_rows.to_string());
        for w in &self.warnings {
            s.push_str(&format!("  note: {}\n", crate::printable(w)));
        }
        if self.violations.is_empty() {
            s.push_str("OK: no invariant is violated\n");
        } else {
            s.push_str(&format!("{} VIOLATION(S):\n", self.violations.len()));
            for v in &self.violations {
                s.push_str(&format!("  [{}] {}\n", v.check, crate::printable(&v.message)));
                if !v.ids.is_empty() {
                    s.push_str(&format!("      {}\n", crate::printable(&v.ids.join(", "))));
                }
            }
        }
        s
    }
}

/// Read every record of `topics` up to their current end.
pub async fn read_topics(cfg: &RelayConfig, topics: Vec<String>) -> anyhow::Result<Vec<RawRecord>> {
    relay::runtime::kafka::preflight(&cfg.kafka).await?;
    let kafka = cfg.kafka.clone();
    tokio::task::spawn_blocking(move || {
        let mut c = client_config(&kafka, Role::Consumer)?;
        c.set("group.id", format!("relay-verify-{}", uuid::Uuid::new_v4()));
        let consumer: BaseConsumer = c.create()?;
        let mut tpl = TopicPartitionList::new();
        let mut remaining: HashMap<(String, i32), i64> = HashMap::new();
        for topic in &topics {
            let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
            for p in md.topics().first().map(|t| t.partitions()).unwrap_or_default() {
                let (low, high) = consumer.fetch_watermarks(topic, p.id(), Duration::from_secs(10))?;
                if high > low {
                    tpl.add_partition_offset(topic, p.id(), Offset::Beginning)?;
                    remaining.insert((topic.clone(), p.id()), high);
                }
            }
        }
        let mut out = Vec::new();
        if remaining.is_empty() {
            return Ok(out);
        }
        consumer.assign(&tpl)?;
        let deadline = std::time::Instant::now() + Duration::from_secs(300);
        while !remaining.is_empty() {
            if std::time::Instant::now() > deadline {
                anyhow::bail!("reading the topics did not reach their end within 5 minutes: {remaining:?}");
            }
            let Some(m) = consumer.poll(Duration::from_millis(500)) else { continue };
            let m = m?;
            let key = (m.topic().to_owned(), m.partition());
            if let Some(high) = remaining.get(&key)
                && m.offset() + 1 >= *high
            {
                remaining.remove(&key);
            }
            // Names as bytes: an input record may carry a name that is not UTF-8.
            let headers = relay_kafka_raw::headers(&m);
            out.push(RawRecord {
                topic: key.0,
                partition: key.1,
                offset: m.offset(),
                key: m.key().map(<[u8]>::to_vec),
                payload: m.payload().map(<[u8]>::to_vec),
                headers,
            });
        }
        Ok(out)
    })
    .await?
}

async fn committed(cfg: &RelayConfig, topics: &[String]) -> anyhow::Result<HashMap<(String, i32), i64>> {
    let kafka = cfg.kafka.clone();
    let group = cfg.consumer.group().to_owned();
    let topics = topics.to_vec();
    tokio::task::spawn_blocking(move || {
        let mut c = client_config(&kafka, Role::Consumer)?;
        c.set("group.id", &group);
        let consumer: BaseConsumer = c.create()?;
        let mut tpl = TopicPartitionList::new();
        for topic in &topics {
            let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
            for p in md.topics().first().map(|t| t.partitions()).unwrap_or_default() {
                tpl.add_partition(topic, p.id());
            }
        }
        let done = consumer.committed_offsets(tpl, Duration::from_secs(10))?;
        Ok(done
            .elements()
            .iter()
            .filter_map(|e| match e.offset() {
                Offset::Offset(o) => Some(((e.topic().to_owned(), e.partition()), o)),
                _ => None,
            })
            .collect())
    })
    .await?
}

/// Check everything; reads the input and output topics from the beginning.
pub async fn verify(cfg: &RelayConfig, pool: &PgPool, opts: &VerifyOptions) -> anyhow::Result<Report> {
    let consumer = cfg.consumer.name.as_str();
    let mut report = Report::default();
    check_inputs(cfg, pool, &mut report).await?;
    let intents = check_intents(cfg, pool, &mut report).await?;
    if let Some(effects) = &opts.effects {
        check_provider(consumer, effects, &intents, &mut report);
    }
    check_outbox(cfg, pool, &mut report).await?;
    check_stuck(pool, consumer, opts.grace, &mut report).await?;
    check_failing(cfg, pool, &mut report).await?;
    check_counters(cfg, pool, &mut report).await?;
    Ok(report)
}

/// Every valid input record below the committed offset is in the inbox or
/// parked, and every poison one is parked (`lost`, `poison_not_parked`).
async fn check_inputs(cfg: &RelayConfig, pool: &PgPool, report: &mut Report) -> anyhow::Result<()> {
    // The routes as the consumer compiled them, schemas read (if the caller has not).
    let mut routes = cfg.clone();
    relay::config::read_schemas(&mut routes)?;
    let router = Router::new(&routes)?;
    // Values in a Schema Registry format are read as the consumer reads them.
    let registry = cfg.schema_registry.as_ref().map(relay_registry::Registry::new).transpose()?;
    let consumer = cfg.consumer.name.as_str();
    let input_topics = cfg.subscribed_topics();
    let committed = committed(cfg, &input_topics).await?;
    let inbox: HashSet<String> = audit::inbox_ids(pool, consumer).await?.into_iter().collect();
    let dead = audit::parked_positions(pool, consumer).await?;
    report.dead_letters = dead.len();
    let parked_at: HashSet<(String, i32, i64)> = dead.iter().map(|(t, p, o, _)| (t.clone(), *p, *o)).collect();
    let parked_ids: HashSet<&str> = dead.iter().filter_map(|(_, _, _, id)| id.as_deref()).collect();
    let mut seen = HashSet::new();
    let (mut lost, mut unparked, mut parked_events) = (Vec::new(), Vec::new(), HashSet::new());
    let records = read_topics(cfg, input_topics.clone()).await?;
    report.input_records = records.len();
    for r in &records {
        let done = committed.get(&(r.topic.clone(), r.partition)).is_some_and(|c| r.offset < *c);
        if !done {
            report.not_yet_committed += 1;
            continue;
        }
        let position = format!("{}[{}]@{}", r.topic, r.partition, r.offset);
        let view = relay::ingest::decode::view_of(&router, registry.as_ref(), r).await.map_err(|why| {
            anyhow::anyhow!("cannot verify {position}: {why}; run relay verify again when the registry answers")
        })?;
        let event_id = match view.of(r).and_then(|r| router.route(r)) {
            Err(_) => None,
            Ok(Routed::Unrouted(e)) => Some(e.id),
            Ok(Routed::Route(route, e)) => router.plan(route, &e, r).ok().map(|_| e.id),
            // `route` pauses no route; a held record is not done either way.
            Ok(Routed::Paused(_, e)) => Some(e.id),
        };
        match event_id {
            None => {
                report.poison_records += 1;
                if !parked_at.contains(&(r.topic.clone(), r.partition, r.offset)) {
                    unparked.push(position);
                }
            }
            Some(id) => {
                if !seen.insert(id.clone()) {
                    report.duplicate_deliveries += 1;
                    continue;
                }
                if inbox.contains(&id) {
                    continue;
                }
                // By id, or by position: an id the database cannot store
                // (a NUL) is parked with the NUL replaced.
                if parked_ids.contains(id.as_str()) || parked_at.contains(&(r.topic.clone(), r.partition, r.offset)) {
                    parked_events.insert(id);
                } else {
                    lost.push(format!("{id} ({position})"));
                }
            }
        }
    }
    report.unique_events = seen.len();
    report.parked_events = parked_events.len();
    report_inputs(report, lost, unparked);
    let by_outcome = audit::inbox_by_outcome(pool, consumer).await?;
    report.inbox_by_outcome = by_outcome.into_iter().collect();
    Ok(())
}

/// What the input check found, as a warning and violations.
fn report_inputs(report: &mut Report, lost: Vec<String>, unparked: Vec<String>) {
    if report.not_yet_committed > 0 {
        report.warnings.push(format!(
            "{} input record(s) are at or past the group's committed offset (still being processed?); they were not checked",
            report.not_yet_committed
        ));
    }
    if !lost.is_empty() {
        report.violate(
            "lost",
            format!("{} valid event(s) below the committed offset have no inbox row and no dead letter", lost.len()),
            lost,
        );
    }
    if !unparked.is_empty() {
        report.violate(
            "poison_not_parked",
            format!("{} poison record(s) below the committed offset are not in the dead letters", unparked.len()),
            unparked,
        );
    }
}

/// An intent (its id, state, idempotency key and source event), as the checks read it.
type IntentRow = (uuid::Uuid, String, String, String);

/// Every applied event has the intents its route requires (`missing_intent`).
async fn check_intents(cfg: &RelayConfig, pool: &PgPool, report: &mut Report) -> anyhow::Result<Vec<IntentRow>> {
    let consumer = cfg.consumer.name.as_str();
    let intents: Vec<IntentRow> = audit::intents_brief(pool, consumer).await?;
    let intent_ids: HashSet<uuid::Uuid> = intents.iter().map(|i| i.0).collect();
    for (state, n) in intents.iter().fold(BTreeMap::new(), |mut m, i| {
        *m.entry(i.1.clone()).or_insert(0i64) += 1;
        m
    }) {
        report.intents_by_state.insert(state, n);
    }
    let mut missing_intents = Vec::new();
    for route in &cfg.routes {
        let calls: Vec<&str> = route
            .actions
            .iter()
            .filter_map(|a| match a {
                ActionConfig::Call(c) => Some(c.name.as_str()),
                _ => None,
            })
            .collect();
        if calls.is_empty() {
            continue;
        }
        let applied = audit::applied_ids(pool, consumer, &route.topic, &route.event_type).await?;
        for event_id in applied {
            for action in &calls {
                if !intent_ids.contains(&derived_id(consumer, &event_id, action)) {
                    missing_intents.push(format!("{event_id}/{action}"));
                }
            }
        }
    }
    if !missing_intents.is_empty() {
        report.violate(
            "missing_intent",
            format!("{} applied event(s) lack an intent their route requires", missing_intents.len()),
            missing_intents,
        );
    }
    Ok(intents)
}

/// The provider applied each idempotency key once and each intent under one
/// key, and every succeeded intent has its effect (`double_effect`,
/// `intent_applied_twice`, `succeeded_without_effect`).
fn check_provider(consumer: &str, effects: &[ProviderEffect], intents: &[IntentRow], report: &mut Report) {
    report.provider_effects = Some(effects.len());
    let mut per_key: HashMap<&str, usize> = HashMap::new();
    let mut keys_per_intent: HashMap<&str, HashSet<&str>> = HashMap::new();
    for e in effects {
        *per_key.entry(e.idempotency_key.as_str()).or_default() += 1;
        if let Some(i) = &e.intent_id {
            keys_per_intent.entry(i.as_str()).or_default().insert(e.idempotency_key.as_str());
        }
    }
    let twice: Vec<String> = per_key.iter().filter(|(_, n)| **n > 1).map(|(k, n)| format!("{k} ×{n}")).collect();
    if !twice.is_empty() {
        report.violate("double_effect", format!("{} idempotency key(s) applied more than once", twice.len()), twice);
    }
    let several: Vec<String> = keys_per_intent
        .iter()
        .filter(|(_, keys)| keys.len() > 1)
        .map(|(i, keys)| format!("{i} ({} keys)", keys.len()))
        .collect();
    if !several.is_empty() {
        report.violate(
            "intent_applied_twice",
            format!("{} intent(s) were applied under more than one idempotency key", several.len()),
            several,
        );
    }
    let ours: HashSet<&str> = intents.iter().map(|i| i.2.as_str()).collect();
    let no_effect: Vec<String> = intents
        .iter()
        .filter(|i| i.1 == IntentState::Succeeded.as_str() && !per_key.contains_key(i.2.as_str()))
        .map(|i| format!("{} (event {})", i.2, i.3))
        .collect();
    if !no_effect.is_empty() {
        report.violate(
            "succeeded_without_effect",
            format!("{} succeeded intent(s) have no effect in the provider's record", no_effect.len()),
            no_effect,
        );
    }
    let dead_with_effect =
        intents.iter().filter(|i| i.1 == IntentState::Dead.as_str() && per_key.contains_key(i.2.as_str())).count();
    if dead_with_effect > 0 {
        report.warnings.push(format!(
            "{dead_with_effect} dead intent(s) have an effect at the provider (the call took effect but its \
             outcome was never seen, e.g. the budget ran out on timeouts): check them with the provider"
        ));
    }
    let foreign = per_key.keys().filter(|k| !ours.contains(*k)).count();
    if foreign > 0 {
        report.warnings.push(format!("{foreign} provider key(s) belong to no intent of consumer {consumer}"));
    }
}

/// Every outbox row marked published is on its topic (`published_not_on_topic`).
async fn check_outbox(cfg: &RelayConfig, pool: &PgPool, report: &mut Report) -> anyhow::Result<()> {
    let consumer = cfg.consumer.name.as_str();
    let published = audit::published_rows(pool, consumer).await?;
    report.published_rows = published.len();
    let mut out_topics: Vec<String> = published.iter().map(|p| p.1.clone()).collect();
    out_topics.sort();
    out_topics.dedup();
    let mut on_topic: HashMap<String, usize> = HashMap::new();
    for r in read_topics(cfg, out_topics).await? {
        if let Some(id) = r.header(OUTBOX_ID_HEADER).and_then(|h| h.value.as_deref()) {
            *on_topic.entry(String::from_utf8_lossy(id).into_owned()).or_default() += 1;
            report.output_records += 1;
        }
    }
    report.republished_rows = on_topic.values().filter(|n| **n > 1).count();
    let missing: Vec<String> = published
        .iter()
        .filter(|p| !on_topic.contains_key(&p.0.to_string()))
        .map(|p| format!("{} ({})", p.0, p.1))
        .collect();
    if !missing.is_empty() {
        report.violate(
            "published_not_on_topic",
            format!("{} outbox row(s) are marked published but are not on their topic", missing.len()),
            missing,
        );
    }
    Ok(())
}

/// No row is past its lease or due time with nobody on it (`stuck_intent`, `stuck_outbox`).
async fn check_stuck(pool: &PgPool, consumer: &str, grace: Duration, report: &mut Report) -> anyhow::Result<()> {
    let tables = [
        (Claimed::Intents, "stuck_intent", "intent(s)", "worker"),
        (Claimed::Outbox, "stuck_outbox", "outbox row(s)", "publisher"),
    ];
    for (table, check, rows, who) in tables {
        let stuck = audit::stuck(pool, table, consumer, grace).await?;
        if !stuck.is_empty() {
            let summary = format!("{} {rows} are past their lease or due time with no {who}", stuck.len());
            report.violate(check, summary, stuck);
        }
    }
    Ok(())
}

/// No row keeps failing unnoticed, no outbox row is dead, and no intent
/// ended dead after an attempt that may have been applied (`failing`,
/// `dead_outbox`, `dead_after_uncertain`).
async fn check_failing(cfg: &RelayConfig, pool: &PgPool, report: &mut Report) -> anyhow::Result<()> {
    let consumer = cfg.consumer.name.as_str();
    let may_apply: Vec<(String, u16)> = cfg
        .endpoints
        .iter()
        .flat_map(|(name, e)| {
            relay_core::answers::statuses_that_may_have_applied(&e.profile(), &e.also_retry())
                .into_iter()
                .map(move |s| (name.clone(), s))
        })
        .collect();
    let lied = audit::dead_after_uncertain(pool, consumer, &may_apply).await?;
    if !lied.is_empty() {
        report.violate(
            "dead_after_uncertain",
            format!(
                "{} intent(s) ended dead after an attempt that may have been applied: their on_dead effects \
                 announced a failure for a call that may have gone through",
                lied.len()
            ),
            lied,
        );
    }
    let failing = audit::failing(pool, consumer, FAILING_AFTER).await?;
    if !failing.is_empty() {
        report.violate(
            "failing",
            format!("{} row(s) have failed {FAILING_AFTER} attempts or more and are still retried", failing.len()),
            failing,
        );
    }
    let dead_outbox = audit::dead_outbox(pool, consumer).await?;
    if !dead_outbox.is_empty() {
        report.violate(
            "dead_outbox",
            format!("{} outbox row(s) can never be published as they are (see their errors)", dead_outbox.len()),
            dead_outbox,
        );
    }
    Ok(())
}

/// Each business counter equals the unique events applied (`counter_mismatch`).
async fn check_counters(cfg: &RelayConfig, pool: &PgPool, report: &mut Report) -> anyhow::Result<()> {
    let consumer = cfg.consumer.name.as_str();
    let mut expected: BTreeMap<&str, i64> = BTreeMap::new();
    for route in &cfg.routes {
        let Some(counter) = &route.counter else { continue };
        let n = audit::applied_count(pool, consumer, &route.topic, &route.event_type).await?;
        *expected.entry(counter.as_str()).or_default() += n;
    }
    for (name, want) in expected {
        let got = inbox::counter(&mut *pool.acquire().await?, consumer, name).await?;
        if got != want {
            report.violate(
                "counter_mismatch",
                format!("business counter {name:?} is {got} but {want} unique event(s) were applied"),
                Vec::new(),
            );
        }
    }
    Ok(())
}

/// Attempts after which a row still being retried is reported as failing.
/// Intents end by their budget (dead or uncertain); outbox rows are retried
/// until the broker takes them, so only this notices one that never will.
pub const FAILING_AFTER: i32 = 10;
