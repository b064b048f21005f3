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
    let took =
        wait_drained(&mut relay, &s.db.pool, Work::Outbox, relay_core::OutboxState::Published.as_str(), k as i64, t0)
            .await?;
    let rate = k as f64 / took.as_secs_f64();
    relay.stop().await?;
    if let Some(conn) = holder {
        seed::release_snapshot(conn).await?;
    }
    Ok((rate, None))
}

/// The limit: the same records through an idempotent producer with the same settings, no database.
pub(super) async fn publish_limit(env: &Env, k: usize) -> anyhow::Result<(f64, Option<f64>)> {
    let topic = unique("bench-raw");
    create_topics(&env.bootstrap, &[&topic], 4).await?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &env.bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("compression.type", "lz4")
        .create()?;
    let (t0, cpu) = (Instant::now(), CpuClock::now());
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
    let rate = k as f64 / t0.elapsed().as_secs_f64();
    Ok((rate, cpu.and_then(CpuClock::busy_since)))
}

/// What the database alone allows: the publisher's statements — claim a
/// batch of up to 2000 after the lanes' shared position, mark it published
/// in one fenced statement — with no broker in between, two lanes side by
/// side as the publisher runs them. It bounds the publisher on this
/// machine whatever the broker does.
pub(super) async fn publish_database_only(env: &Env, k: usize) -> anyhow::Result<(f64, Option<(f64, f64)>)> {
    use relay::runtime::claim_loop::Resume;
    use relay_store::outbox;
    let s = setup(env, 1).await?;
    seed::pending_outbox(&s.db.pool, "bench", &s.out, k).await?;
    let resume = std::sync::Mutex::new(Resume::<i64>::default());
    let t0 = Instant::now();
    let lanes = (0..2).map(|_| {
        let (pool, resume) = (s.db.pool.clone(), &resume);
        async move {
            let mut marks = relay_store::FinishPool::beside(&pool, 1).acquire().await?;
            let mut claims =
                relay_store::ClaimPool::beside(&pool, 1, relay_store::ClaimCommit::Async).acquire().await?;
            loop {
                let (after, back) = resume.lock().unwrap().next(Duration::MAX);
                let claim = outbox::claim_after(&mut claims, "bench", 2000, Duration::from_secs(30), after).await?;
                match outbox::resume_after(&claim, 2000) {
                    Some(at) => resume.lock().unwrap().claimed(back, at),
                    None => resume.lock().unwrap().back_to(None),
                }
                if claim.rows.is_empty() {
                    if after.is_none() && claim.passed.is_none() {
                        return anyhow::Ok(());
                    }
                    continue;
                }
                let ids: Vec<uuid::Uuid> = claim.rows.iter().map(|r| r.id).collect();
                let tokens: Vec<uuid::Uuid> = claim.rows.iter().map(|r| r.lease_token).collect();
                outbox::mark_published(&mut marks, &ids, &tokens).await?;
            }
        }
    });
    for r in futures::future::join_all(lanes).await {
        r?;
    }
    let took = t0.elapsed();
    let done = seed::in_state(&s.db.pool, Work::Outbox, relay_core::OutboxState::Published.as_str()).await?;
    anyhow::ensure!(done == k as i64, "database-only publishing marked {done} of {k} rows");
    Ok((k as f64 / took.as_secs_f64(), None))
}

/// What an append-only outbox would allow (issue 30's publisher goal): the
/// rows after a lane's cursor read in `seq` order, batch by batch, the
/// cursor moved by one UPDATE per batch, and no row written again — one
/// lane, no broker, no snapshot bookkeeping (which adds a constant per
/// batch). It bounds a design not built yet, next to the claim-and-mark
/// bound above.
pub(super) async fn publish_cursor_bound(env: &Env, k: usize) -> anyhow::Result<(f64, Option<(f64, f64)>)> {
    use sqlx::Row;
    let s = setup(env, 1).await?;
    seed::pending_outbox(&s.db.pool, "bench", &s.out, k).await?;
    let token = cursor_lane(&s.db.pool).await?;
    let mut conn = s.db.pool.acquire().await?;
    let t0 = Instant::now();
    let (mut read, mut cursor) = (0usize, 0i64);
    loop {
        let rows = sqlx::query(
            "SELECT o.id, o.seq, o.topic, o.key, o.headers, o.payload FROM relay.outbox o
              WHERE o.state = 'pending' AND o.seq > $1 AND o.consumer = 'bench' ORDER BY o.seq LIMIT 2000",
        )
        .bind(cursor)
        .fetch_all(&mut *conn)
        .await?;
        let Some(last) = rows.last() else { break };
        cursor = last.try_get("seq")?;
        read += rows.len();
        let moved = sqlx::query("UPDATE public.bench_cursor SET seq = $1 WHERE lane = 0 AND token = $2")
            .bind(cursor)
            .bind(token)
            .execute(&mut *conn)
            .await?;
        anyhow::ensure!(moved.rows_affected() == 1, "the lane's cursor did not move");
    }
    let took = t0.elapsed();
    anyhow::ensure!(read == k, "the cursor read {read} of {k} rows");
    Ok((k as f64 / took.as_secs_f64(), None))
}

/// What an append-only outbox would allow with the broker in the loop: the
/// cursor read above, each batch of `batch_rows` handed to the idempotent
/// producer as soon as it is read (up to `depth` batches in flight), and the cursor moved, in
/// order, once a batch is acknowledged. No lease, no snapshot bookkeeping,
/// no dead rows: a prototype's best case, to tell whether the design can
/// reach issue 30's goal before it is built. With the share of the
/// machine's time busy meanwhile ([`CpuClock`]).
pub(super) async fn publish_cursor_produce_bound(
    env: &Env,
    k: usize,
    (batch_rows, depth): (i64, usize),
) -> anyhow::Result<(f64, Option<f64>)> {
    use futures::stream::FuturesOrdered;
    use sqlx::Row;
    let s = setup(env, 4).await?;
    seed::pending_outbox(&s.db.pool, "bench", &s.out, k).await?;
    let token = cursor_lane(&s.db.pool).await?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &env.bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("compression.type", "lz4")
        .create()?;
    type Read = (uuid::Uuid, i64, String, Option<Vec<u8>>, serde_json::Value, Option<Vec<u8>>);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<Read>>(2);
    let mut reader = s.db.pool.acquire().await?;
    let mut mover = s.db.pool.acquire().await?;
    let (t0, cpu) = (Instant::now(), CpuClock::now());
    let read = tokio::spawn(async move {
        let mut cursor = 0i64;
        loop {
            let rows = sqlx::query(
                "SELECT o.id, o.seq, o.topic, o.key, o.headers, o.payload FROM relay.outbox o
                  WHERE o.state = 'pending' AND o.seq > $1 AND o.consumer = 'bench' ORDER BY o.seq LIMIT $2",
            )
            .bind(cursor)
            .bind(batch_rows)
            .fetch_all(&mut *reader)
            .await?;
            let Some(last) = rows.last() else { return anyhow::Ok(()) };
            cursor = last.try_get("seq")?;
            let batch = rows
                .into_iter()
                .map(|r| {
                    Ok((
                        r.try_get("id")?,
                        r.try_get("seq")?,
                        r.try_get("topic")?,
                        r.try_get("key")?,
                        r.try_get("headers")?,
                        r.try_get("payload")?,
                    ))
                })
                .collect::<Result<Vec<Read>, sqlx::Error>>()?;
            if tx.send(batch).await.is_err() {
                return Ok(());
            }
        }
    });
    let producer = &producer;
    let produce = |batch: Vec<Read>| async move {
        let last = batch.last().map_or(0, |r| r.1);
        let sends = batch.iter().map(|(id, _, topic, key, headers, payload)| {
            let mut hs = OwnedHeaders::new();
            for h in relay_store::headers::from_json(headers) {
                hs = hs.insert(KHeader { key: &h.name, value: h.value.as_deref() });
            }
            let id = id.to_string();
            hs = hs.insert(KHeader { key: "relay_outbox_id", value: Some(id.as_bytes()) });
            let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(hs);
            if let Some(k) = key {
                record = record.key(k.as_slice());
            }
            if let Some(p) = payload {
                record = record.payload(p.as_slice());
            }
            producer.send(record, Duration::from_secs(30))
        });
        for r in futures::future::join_all(sends).await {
            r.map_err(|(e, _)| e)?;
        }
        anyhow::Ok((last, batch.len()))
    };
    let (mut in_flight, mut published, mut open) = (FuturesOrdered::new(), 0usize, true);
    while open || !in_flight.is_empty() {
        tokio::select! {
            batch = rx.recv(), if open && in_flight.len() < depth => match batch {
                Some(batch) => in_flight.push_back(produce(batch)),
                None => open = false,
            },
            Some(done) = in_flight.next(), if !in_flight.is_empty() => {
                let (last, n) = done?;
                published += n;
                let moved = sqlx::query("UPDATE public.bench_cursor SET seq = $1 WHERE lane = 0 AND token = $2")
                    .bind(last)
                    .bind(token)
                    .execute(&mut *mover)
                    .await?;
                anyhow::ensure!(moved.rows_affected() == 1, "the lane's cursor did not move");
            }
        }
    }
    read.await??;
    let took = t0.elapsed();
    anyhow::ensure!(published == k, "the cursor published {published} of {k} rows");
    Ok((k as f64 / took.as_secs_f64(), cpu.and_then(CpuClock::busy_since)))
}

/// The table of the cursor bounds' one lane, at the start; the lane's token.
async fn cursor_lane(pool: &PgPool) -> anyhow::Result<uuid::Uuid> {
    sqlx::query(
        "CREATE TABLE public.bench_cursor (lane integer PRIMARY KEY, seq bigint NOT NULL, token uuid NOT NULL)",
    )
    .execute(pool)
    .await?;
    let token = uuid::Uuid::new_v4();
    sqlx::query("INSERT INTO public.bench_cursor VALUES (0, 0, $1)").bind(token).execute(pool).await?;
    Ok(token)
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
    // The raw producer and the prototype alternate within each run, so
    // each ratio compares two figures taken moments apart: a burst of
    // 50 000 records swings with whatever else the machine does.
    let (mut raws, mut prototypes, mut ratios, mut raw_busy, mut prototype_busy) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..env.runs.max(1) {
        let (raw, busy) = publish_limit(env, k).await?;
        raw_busy.extend(busy);
        let (prototype, busy) = publish_cursor_produce_bound(env, k, (5000, 4)).await?;
        prototype_busy.extend(busy);
        ratios.push(prototype / raw.max(1.0));
        raws.push(raw);
        prototypes.push(prototype);
    }
    let measured = |v: Vec<f64>| {
        let (mid, spread) = median_spread(v);
        (mid, spread, None)
    };
    publish.rows.push(row(
        "limit: the same records produced directly",
        measured(raws),
        "idempotent producer, acks=all; each run paired with the prototype below",
    ));
    publish.rows.push(row(
        "bound: the publisher's statements alone",
        median(env, || publish_database_only(env, k)).await?,
        "claim 2000 and mark them published, 2 lanes, no broker",
    ));
    publish.rows.push(row(
        "bound: rows read after a cursor (append-only, not built)",
        median(env, || publish_cursor_bound(env, k)).await?,
        "read 2000 in seq order, one cursor UPDATE per batch, 1 lane, no broker",
    ));
    publish.rows.push(row(
        "bound: a cursor read and produced, overlapped (prototype)",
        measured(prototypes),
        "the read above, 5000 a batch, up to 4 at the producer, cursor moved on ack; no lease, no dead rows",
    ));
    let (ratio, (low, high)) = median_spread(ratios);
    let busy = |v: Vec<f64>| if v.is_empty() { "?".to_owned() } else { format!("{:.0} %", 100.0 * median_spread(v).0) };
    publish.verdicts.push(format!(
        "the prototype made {ratio:.2}× the raw producer run beside it (median of {} pairs, {low:.2}–{high:.2}); \
         the machine (all processes, both cores) was {} busy during the raw producer and {} during the prototype",
        env.runs.max(1),
        busy(raw_busy),
        busy(prototype_busy),
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
