//! Publish: outbox rows to Kafka, against the raw producer.

use super::*;

/// The publisher draining `k` outbox rows; with `snapshot`, while another
/// transaction holds a snapshot open (as in the growth section).
pub(super) async fn publish_relay(env: &Env, k: usize, snapshot: bool) -> anyhow::Result<(f64, Option<(f64, f64)>)> {
    let s = setup(env, 4).await?;
    seed::pending_outbox(&s.db.pool, "bench", &s.out, k).await?;
    let holder = if snapshot { Some(seed::hold_snapshot(&s.db.url).await?) } else { None };
    let relay = Relay::new(config(env, &s, 64)?, Handlers::default(), Faults::none()).await?;
    let t0 = Instant::now();
    let mut relay = UnderTest::start(relay, PUBLISH);
    let took = wait_drained(&mut relay, &s.db.pool, Work::Outbox, "published", k as i64, t0).await?;
    let rate = k as f64 / took.as_secs_f64();
    relay.stop().await?;
    if let Some(conn) = holder {
        seed::release_snapshot(conn).await?;
    }
    Ok((rate, None))
}

/// The limit: the same records through an idempotent producer with the same settings, no database.
pub(super) async fn publish_limit(env: &Env, k: usize) -> anyhow::Result<(f64, Option<(f64, f64)>)> {
    let topic = unique("bench-raw");
    create_topics(&env.bootstrap, &[&topic], 4).await?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &env.bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("compression.type", "lz4")
        .create()?;
    let t0 = Instant::now();
    // Everything handed to the producer at once (its queue holds 100 000), then awaited.
    let sends = (0..k).map(|i| {
        let key = format!("o-{i}");
        let payload = serde_json::json!({"order_id": key}).to_string();
        let id = uuid::Uuid::new_v4().to_string();
        let producer = &producer;
        let topic = &topic;
        async move {
            let headers = OwnedHeaders::new()
                .insert(KHeader { key: "ce_specversion", value: Some("1.0") })
                .insert(KHeader { key: "ce_type", value: Some("order.accepted") })
                .insert(KHeader { key: "relay_outbox_id", value: Some(id.as_str()) });
            producer
                .send(FutureRecord::to(topic).key(&key).payload(&payload).headers(headers), Duration::from_secs(30))
                .await
                .map_err(|(e, _)| e)
        }
    });
    for r in futures::future::join_all(sends).await {
        r?;
    }
    Ok((k as f64 / t0.elapsed().as_secs_f64(), None))
}

/// The publish section of the report.
pub(super) async fn publish_section(env: &Env) -> anyhow::Result<Section> {
    eprintln!("bench: relay to Kafka");
    let k = env.size(2_000, 50_000);
    let mut publish =
        Section::new(&format!("3. Relay to Kafka ({k} outbox rows → acknowledged → marked published)"), "events/s");
    publish.rows.push(row(
        "relay publisher",
        median(env, || publish_relay(env, k, false)).await?,
        "batches of up to 2000, 2 lanes",
    ));
    publish.rows.push(row(
        "limit: the same records produced directly",
        median(env, || publish_limit(env, k)).await?,
        "idempotent producer, acks=all",
    ));
    let held = row(
        "relay publisher, a snapshot held open",
        median(env, || publish_relay(env, k, true)).await?,
        "another transaction holds a snapshot for the whole run (see 5. Growth)",
    );
    publish.verdicts.push(format!(
        "with a snapshot held open the publisher made {:.0} % of its rate without",
        100.0 * held.rate / publish.rate("relay publisher").max(1.0)
    ));
    publish.rows.push(held);
    Ok(publish)
}
