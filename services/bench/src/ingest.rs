//! Ingest: the relay consumer against the same rows inserted directly and a naive consumer.

use super::*;

/// Ingest through the relay into `s` (which may hold rows already): records/s
/// from the first row recorded to the last offset committed.
pub(super) async fn ingest_into(env: &Env, s: &Setup, n: usize, first: usize) -> anyhow::Result<f64> {
    produce(env, &s.topic, first..first + n).await?;
    ingest_produced(env, s, n, first, config(env, s, 64)?).await
}

/// [`ingest_into`] of records produced already, by a relay over `cfg`.
async fn ingest_produced(env: &Env, s: &Setup, n: usize, first: usize, cfg: RelayConfig) -> anyhow::Result<f64> {
    let offsets = OffsetWatch::new(&env.bootstrap, &s.group, &s.topic).await?;
    let since = seed::db_now(&s.db.pool).await?;
    let relay = Relay::new(cfg, Handlers::default(), Faults::none()).await?;
    let mut relay = UnderTest::start(relay, CONSUME);
    wait_until(&mut relay, "the first record", Duration::from_secs(120), async || {
        seed::inbox_since(&s.db.pool, since).await.unwrap_or(-1) > 0
    })
    .await?;
    let t0 = Instant::now();
    let c0 = seed::inbox_since(&s.db.pool, since).await?;
    let total = (first + n) as i64;
    wait_until(&mut relay, "every offset committed", Duration::from_secs(600), async || {
        offsets.total().await.is_ok_and(|t| t >= total)
    })
    .await?;
    let elapsed = t0.elapsed().as_secs_f64();
    relay.stop().await?;
    Ok((n as f64 - c0 as f64) / elapsed)
}

/// Partitions of the ingest runs, and writers of the limit they are measured against.
const PARTITIONS: usize = 4;
const LIMIT: &str = "limit: the same rows, batched inserts, no Kafka";
const LIMIT_ONE: &str = "limit, one writer: the same rows, batched inserts, no Kafka";

pub(super) async fn ingest_relay(env: &Env, n: usize) -> anyhow::Result<(f64, Option<(f64, f64)>)> {
    let s = setup(env, PARTITIONS as i32).await?;
    Ok((ingest_into(env, &s, n, 0).await?, None))
}

/// The same records as [`ingest_relay`], their values Avro in the Schema
/// Registry wire format (the producer's schema registered under
/// `<topic>-value`): what decoding each value with its schema costs.
pub(super) async fn ingest_relay_avro(env: &Env, n: usize) -> anyhow::Result<(f64, Option<(f64, f64)>)> {
    const ORDER: &str = r#"{"type":"record","name":"OrderPlaced","namespace":"bench","fields":[
      {"name":"event_id","type":"string"},{"name":"order_id","type":"string"},
      {"name":"amount","type":"long"},{"name":"produced_at_us","type":"long"}]}"#;
    let registry = env.registry.as_deref().ok_or_else(|| {
        anyhow::anyhow!(
            "the ingest section's Avro row needs a Schema Registry: pass --schema-registry URL or set \
             RELAY_TEST_SCHEMA_REGISTRY_URL (scripts/bench.sh starts one)"
        )
    })?;
    let s = setup(env, PARTITIONS as i32).await?;
    let registered: serde_json::Value = reqwest::Client::new()
        .post(format!("{registry}/subjects/{}-value/versions", s.topic))
        .json(&serde_json::json!({"schema": ORDER}))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let id = u32::try_from(registered["id"].as_u64().ok_or_else(|| anyhow::anyhow!("no id in {registered}"))?)?;
    let schema = apache_avro::Schema::parse_str(ORDER)?;
    let writer = apache_avro::writer::datum::GenericDatumWriter::builder(&schema).build()?;
    let p = TestProducer::new(&env.bootstrap)?;
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let mut values = Vec::with_capacity(chunk.len());
        for &i in chunk {
            use apache_avro::types::Value as A;
            let order = format!("o-{i}");
            let datum = A::Record(vec![
                ("event_id".into(), A::String(format!("e-{i}"))),
                ("order_id".into(), A::String(order.clone())),
                ("amount".into(), A::Long(i64::try_from(i)?)),
                ("produced_at_us".into(), A::Long(now_us())),
            ]);
            let mut value = vec![0];
            value.extend(id.to_be_bytes());
            value.extend(writer.write_value_to_vec(datum)?);
            values.push((order, value));
        }
        let sends = values.iter().map(|(key, value)| p.raw(&s.topic, None, Some(key.as_bytes()), &[], Some(value)));
        for r in futures::future::join_all(sends).await {
            r?;
        }
    }
    let text = format!(
        "{}\n[schema_registry]\nurl = \"{registry}\"\n[topics.\"{}\"]\nformat = \"avro\"\n\
         fields.id = {{ pointer = \"/event_id\" }}\nfields.type = {{ value = \"order.placed\" }}\n",
        config_text(env, &s, 64),
        s.topic
    );
    let mut cfg = RelayConfig::from_toml(&text)?;
    cfg.database.url = Some(s.db.url.clone().into());
    cfg.dispatcher.claim_at_ingest = env.claim_at_ingest;
    Ok((ingest_produced(env, &s, n, 0, cfg).await?, None))
}

/// The limit: the same rows the relay writes for these records (same
/// content, same multi-row `UNNEST` statements), built beforehand and
/// inserted in transactions of `batch` records by `writers` connections at
/// once, record `i` by writer `i % writers` — no Kafka, no routing. With as
/// many writers as the relay has partitions it compares like with like
/// (the relay writes its partitions in parallel); one writer is the figure
/// reported before issue 27, kept for history.
pub(super) async fn ingest_limit(
    env: &Env,
    n: usize,
    batch: usize,
    writers: usize,
) -> anyhow::Result<(f64, Option<(f64, f64)>)> {
    use relay_core::effects::{EmitSpec, Provenance, encode_event};
    use relay_store::inbox::{InboxOutcome, NewInboxRow};
    use relay_store::intents::{Intent, NewIntent};
    let s = setup(env, 1).await?;
    let ids: Vec<String> = (0..n).map(|i| format!("e-{i}")).collect();
    let topic = s.topic.clone();
    let inbox_rows: Vec<NewInboxRow<'_>> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| NewInboxRow {
            consumer: CONSUMER,
            event_id: id,
            event_type: "order.placed",
            topic: &topic,
            partition: (i % writers) as i32,
            offset: (i / writers) as i64,
            idempotency_key: None,
            aggregate_id: None,
            correlation_id: None,
            outcome: InboxOutcome::Applied,
        })
        .collect();
    let empty_outcome = serde_json::json!({"emit": [], "saga": []});
    let intents: Vec<NewIntent> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let order = format!("o-{i}");
            let iid = relay_core::ids::derived_id(CONSUMER, id, "capture");
            NewIntent {
                id: iid,
                max_age: Duration::from_secs(86_400),
                fair_spacing: None,
                intent: Intent {
                    consumer: CONSUMER.into(),
                    source_event_id: id.clone(),
                    action: "capture".into(),
                    endpoint: "sink".into(),
                    method: "POST".into(),
                    path: "/captures".into(),
                    body: Some(serde_json::json!({"order_id": order, "amount": i, "produced_at_us": now_us()})),
                    headers: serde_json::json!({}),
                    idempotency_key: format!("capture:{order}"),
                    ordering_key: None,
                    holds_key: false,
                    fairness_key: None,
                    max_attempts: 10,
                    on_success: empty_outcome.clone(),
                    on_dead: empty_outcome.clone(),
                    emit_source: format!("relay/{CONSUMER}"),
                    aggregate_id: None,
                    correlation_id: Some(id.clone()),
                    causation_id: Some(id.clone()),
                    traceparent: None,
                },
            }
        })
        .collect();
    let now = chrono::Utc::now();
    let outbox: Vec<relay_core::OutboxRecord> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let order = format!("o-{i}");
            let spec = EmitSpec {
                action: "accepted".into(),
                event_type: "order.accepted".into(),
                topic: s.out.clone(),
                key: Some(order.clone()),
                subject: None,
                data: serde_json::json!({"order_id": order}),
                ordered: true,
                encoded: None,
            };
            let prov = Provenance {
                source: format!("relay/{CONSUMER}"),
                correlation_id: Some(id.clone()),
                causation_id: Some(id.clone()),
                traceparent: None,
                aggregate_id: None,
            };
            encode_event(
                relay_core::ids::derived_id(CONSUMER, id, "accepted"),
                &spec,
                &prov,
                relay_core::ids::KeySpace::Routes,
                now,
            )
        })
        .collect();
    // Each writer's records, in its own connection, as a partition's would be.
    let mut conns = Vec::with_capacity(writers);
    for _ in 0..writers {
        conns.push(s.db.pool.acquire().await?);
    }
    let (inbox_rows, intents, outbox, ids) = (&inbox_rows, &intents, &outbox, &ids);
    let t0 = Instant::now();
    let writes = conns.into_iter().enumerate().map(|(w, mut conn)| async move {
        let mine: Vec<usize> = (w..n).step_by(writers).collect();
        for chunk in mine.chunks(batch) {
            let inbox: Vec<NewInboxRow<'_>> = chunk.iter().map(|&i| inbox_rows[i].clone()).collect();
            let calls: Vec<&NewIntent> = chunk.iter().map(|&i| &intents[i]).collect();
            let rows: Vec<(&str, &relay_core::OutboxRecord)> =
                chunk.iter().map(|&i| (ids[i].as_str(), &outbox[i])).collect();
            let counted = [("orders", w as i32, chunk.len() as i64)];
            let mut tx = conn.begin().await?;
            relay_store::inbox::insert_many(&mut tx, &inbox).await?;
            relay_store::effects::insert(&mut tx, CONSUMER, &calls, None, &rows, &counted).await?;
            tx.commit().await?;
        }
        anyhow::Ok(())
    });
    futures::future::try_join_all(writes).await?;
    Ok((n as f64 / t0.elapsed().as_secs_f64(), None))
}

/// The floor: one transaction per record, check before insert, offset stored per record.
/// Its SQL is its own on purpose: it is the hand-rolled inbox the relay is
/// measured against, not a use of the relay's store.
pub(super) async fn ingest_floor(env: &Env, n: usize) -> anyhow::Result<(f64, Option<(f64, f64)>)> {
    let s = setup(env, 1).await?;
    produce(env, &s.topic, 0..n).await?;
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &env.bootstrap)
        .set("group.id", &s.group)
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .create()?;
    consumer.subscribe(&[&s.topic])?;
    let mut conn = s.db.pool.acquire().await?;
    let mut stream = consumer.stream();
    let mut t0 = None;
    for i in 0..n {
        let m = stream.next().await.ok_or_else(|| anyhow::anyhow!("stream ended"))??;
        t0.get_or_insert_with(Instant::now);
        let id = format!("e-{i}");
        let mut tx = conn.begin().await?;
        let seen: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM relay.inbox WHERE consumer = 'bench' AND event_id = $1)")
                .bind(&id)
                .fetch_one(&mut *tx)
                .await?;
        if !seen {
            sqlx::query(r#"INSERT INTO relay.inbox (consumer, event_id, event_type, topic, partition, "offset", outcome) VALUES ('bench', $1, 'order.placed', 't', 0, $2, 'applied')"#)
                .bind(&id)
                .bind(m.offset())
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "INSERT INTO relay.intents (id, consumer, source_event_id, action, endpoint, method, path, idempotency_key, max_attempts, expires_at, emit_source)
                 VALUES (gen_random_uuid(), 'bench', $1, 'capture', 'sink', 'POST', '/captures', 'capture:' || $1, 10, now() + interval '1 day', 'bench')",
            )
            .bind(&id)
            .execute(&mut *tx)
            .await?;
            sqlx::query("INSERT INTO relay.outbox (id, consumer, source_id, action, topic) VALUES (gen_random_uuid(), 'bench', $1, 'accepted', 'out')")
                .bind(&id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        consumer.store_offset_from_message(&m)?;
    }
    let rate = n as f64 / t0.map_or(1.0, |t| t.elapsed().as_secs_f64());
    Ok((rate, None))
}

/// The ingest section of the report.
pub(super) async fn ingest_section(env: &Env) -> anyhow::Result<Section> {
    let n = env.size(2_000, 50_000);
    let batch = 500;
    eprintln!("bench: ingest");
    let mut ingest =
        Section::new(&format!("1. Ingest ({n} records, 4 partitions, 1 intent + 1 outbox row each)"), "records/s");
    ingest.rows.push(row(
        "relay consumer",
        median(env, || ingest_relay(env, n)).await?,
        "offsets committed after each batch",
    ));
    ingest.rows.push(row(
        "relay consumer, Avro values (Schema Registry)",
        median(env, || ingest_relay_avro(env, n)).await?,
        "the same records in the registry's wire format, decoded with the registered schema",
    ));
    ingest.rows.push(row(
        LIMIT,
        median(env, || ingest_limit(env, n, batch, PARTITIONS)).await?,
        format!("{batch} records per transaction, {PARTITIONS} writers as the relay has partitions"),
    ));
    ingest.rows.push(row(
        LIMIT_ONE,
        median(env, || ingest_limit(env, n, batch, 1)).await?,
        format!("{batch} records per transaction, one writer (the limit reported before issue 27)"),
    ));
    let nf = env.size(200, 3_000);
    ingest.rows.push(row(
        "floor: naive consumer",
        median(env, || ingest_floor(env, nf)).await?,
        format!("1 transaction per record, check-then-insert ({nf} records)"),
    ));
    let (relay, limit, limit_one, floor) = (
        ingest.rate("relay consumer"),
        ingest.rate(LIMIT),
        ingest.rate(LIMIT_ONE),
        ingest.rate("floor: naive consumer"),
    );
    ingest.verdicts.push(format!(
        "Avro values decoded with the registry's schema: {:.0} % of the JSON rate",
        100.0 * ingest.rate("relay consumer, Avro values (Schema Registry)") / relay.max(1.0)
    ));
    ingest.verdicts.push(format!(
        "relay / limit = **{:.2}** (goal ≥ 0.5; {PARTITIONS} writers); relay / one-writer limit = {:.2} (as reported \
         before issue 27); relay / floor = **{:.1}** (goal ≥ 10)",
        relay / limit,
        relay / limit_one,
        relay / floor
    ));
    Ok(ingest)
}
