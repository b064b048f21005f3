//! The statements that run over and over — claims, finishes, retention
//! cleanup, the metrics gauges — read
//! only the rows they take, through an index in the order they take them,
//! whatever the planner's statistics say. A plan that reads every candidate
//! and sorts them passes every functional test and still makes each call cost
//! O(table): these tests read the plans (EXPLAIN, not timings) on tables big
//! enough for the planner to care.

use std::time::Duration;

use relay_store::intents::Scope;
use relay_store::ops::{self, Cleanup};
use relay_store::stats;
use relay_store::{ClaimCommit, ClaimConnection, ClaimPool, FinishPool, Position, begin_by_key, intents, outbox};
use relay_testkit::{TestDb, seed};
use serde_json::Value;
use sqlx::{Connection, PgConnection};

/// What the seeded intents' dispatcher claims: consumer `plans`, endpoint `psp`.
const PLANS: Scope<'static> = Scope { consumer: "plans", endpoints: &["psp"] };

const ROWS: i64 = 20_000;
/// Rows per table for the cleanup plans, and the batch size. The batch must
/// be a small part of the table, as in production (1000 of millions): with
/// PostgreSQL's default costs, reading the whole table is the cheaper plan up
/// to about 300 rows per row deleted, and that would not be a regression.
const OLD_ROWS: i64 = 50_000;
const CLEANUP_BATCH: i64 = 100;
/// Finished rows before a backlog is claimed and finished.
const HISTORY: usize = 100_000;

/// Every node type with the index or table it reads, from a JSON plan,
/// flattened: `["Limit", "LockRows", "Index Scan intents_due", …]`.
fn nodes(plan: &Value) -> Vec<String> {
    let mut out = Vec::new();
    fn walk(node: &Value, out: &mut Vec<String>) {
        let kind = node["Node Type"].as_str().unwrap_or("?");
        out.push(match node["Index Name"].as_str().or(node["Relation Name"].as_str()) {
            Some(name) => format!("{kind} {name}"),
            None => kind.to_owned(),
        });
        for child in node["Plans"].as_array().into_iter().flatten() {
            walk(child, out);
        }
    }
    walk(&plan[0]["Plan"], &mut out);
    out
}

/// Assert the plan reads `index`, sorts nothing and scans no whole table
/// (but `relay.pauses`, a handful of rows, may be read whole).
fn assert_index_order(what: &str, plan: &[String], index: &str) {
    let whole = |n: &&String| n.starts_with("Seq Scan") && n.as_str() != "Seq Scan pauses";
    assert!(!plan.iter().any(|n| whole(&n)), "{what} reads a whole table; plan: {plan:?}");
    assert!(
        plan.iter().any(|n| n.ends_with(&format!(" {index}"))),
        "{what} should read the index {index} in order; plan: {plan:?}"
    );
    assert!(!plan.iter().any(|n| n.contains("Sort")), "{what} sorts its candidates (reads them all); plan: {plan:?}");
}

/// Assert the plan reads `index` with no sort of what it reads unbounded:
/// a claim that reads each endpoint's rows apart sorts what their scans
/// gave, each scan stopped at the claim's limit.
fn assert_limited_scans(what: &str, plan: &Value, index: &str) {
    fn walk(node: &Value, sorted: bool, index: &str, found: &mut bool) -> Result<(), String> {
        let kind = node["Node Type"].as_str().unwrap_or("?");
        if kind.starts_with("Seq Scan") && node["Relation Name"].as_str() != Some("pauses") {
            return Err(format!("reads a whole table ({:?})", node["Relation Name"]));
        }
        if node["Index Name"].as_str() == Some(index) {
            *found = true;
            if sorted {
                return Err(format!("sorts what it reads of {index} with no limit between"));
            }
        }
        let sorted = match kind {
            "Sort" => true,
            "Limit" => false,
            _ => sorted,
        };
        node["Plans"].as_array().into_iter().flatten().try_for_each(|c| walk(c, sorted, index, found))
    }
    let mut found = false;
    if let Err(why) = walk(&plan[0]["Plan"], false, index, &mut found) {
        panic!("{what} {why}; plan: {:?}", nodes(plan));
    }
    assert!(found, "{what} should read the index {index}; plan: {:?}", nodes(plan));
}

/// `n` pending intents (events e-1 … e-`n`) and `n` pending outbox rows, due now.
async fn insert_backlog(pool: &sqlx::PgPool, n: i64) {
    seed::pending_intents(pool, "plans", "psp", "", n as usize).await.unwrap();
    seed::pending_outbox(pool, "plans", "out", n as usize).await.unwrap();
}

/// The plan of the intent claim for 50 rows of deployment `plans`, from the
/// start or after `after`, over `endpoints`.
async fn explain_claim(
    claims: &mut ClaimConnection,
    analyze: bool,
    after: Option<Position>,
    endpoints: &[&str],
) -> Value {
    let explain = if analyze { "ANALYZE, FORMAT JSON" } else { "FORMAT JSON" };
    sqlx::query_scalar(&format!("EXPLAIN ({explain}) {}", intents::CLAIM))
        .bind(50_i64)
        .bind("worker")
        .bind(30.0_f64)
        .bind(after.map(|p| p.due))
        .bind(after.map_or(0, |p| p.seq))
        .bind(endpoints)
        .bind("plans")
        .bind(i64::MAX)
        .bind(true)
        .bind(true)
        .fetch_one(claims.as_conn())
        .await
        .unwrap()
}

/// The plan of the outbox claim for `limit` rows of deployment `plans`,
/// from the start or after seq `after`.
async fn explain_outbox_claim(claims: &mut ClaimConnection, analyze: bool, limit: i64, after: Option<i64>) -> Value {
    let explain = if analyze { "ANALYZE, FORMAT JSON" } else { "FORMAT JSON" };
    sqlx::query_scalar(&format!("EXPLAIN ({explain}) {}", outbox::CLAIM))
        .bind(limit)
        .bind(30.0_f64)
        .bind(after.unwrap_or(i64::MIN))
        .bind("plans")
        .bind(limit * outbox::WINDOW)
        .fetch_one(claims.as_conn())
        .await
        .unwrap()
}

#[tokio::test]
async fn claims_take_rows_in_index_order_even_when_the_statistics_say_the_table_is_empty() {
    let db = TestDb::new().await.unwrap();
    // A burst on a table the planner has no statistics for (never analyzed):
    // it guesses few pending rows, and with its default settings reads them
    // all and sorts them on every claim.
    insert_backlog(&db.pool, ROWS).await;

    let mut claims = ClaimPool::beside(&db.pool, 1, ClaimCommit::Async).acquire().await.unwrap();
    let plan: Value = explain_claim(&mut claims, false, None, &["psp"]).await;
    assert_limited_scans("the intent claim", &plan, "intents_due");
    let plan: Value = explain_outbox_claim(&mut claims, false, 50, None).await;
    assert_index_order("the outbox claim", &nodes(&plan), "outbox_pending_by_seq");

    // And the claims do take the oldest rows first.
    let claimed = intents::claim(&mut claims, &PLANS, "worker", 3, Duration::from_secs(30)).await.unwrap().rows;
    let mut ids: Vec<&str> = claimed.iter().map(|c| c.intent.source_event_id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["e-1", "e-2", "e-3"]);
    let rows = outbox::claim(&mut claims, "plans", 3, Duration::from_secs(30)).await.unwrap().rows;
    assert_eq!(rows.iter().map(|r| r.seq).collect::<Vec<_>>(), [1, 2, 3]);
}

// A claim read the due intents in one run, whatever their endpoint or
// deployment: a paused endpoint's backlog, or another deployment's, was
// read again by every claim before the rows it could take.
#[tokio::test]
async fn a_claim_reads_no_due_row_of_a_paused_endpoint_or_another_deployment() {
    let db = TestDb::new().await.unwrap();
    seed::pending_intents(&db.pool, "plans", "paused", "p-", ROWS as usize).await.unwrap();
    seed::pending_intents(&db.pool, "elsewhere", "psp", "x-", ROWS as usize).await.unwrap();
    seed::pending_intents(&db.pool, "plans", "psp", "", 3).await.unwrap();
    sqlx::query("INSERT INTO relay.pauses (consumer, kind, name) VALUES ('plans', 'endpoint', 'paused')")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("ANALYZE relay.intents").execute(&db.pool).await.unwrap();
    let mut claims = ClaimPool::beside(&db.pool, 1, ClaimCommit::Async).acquire().await.unwrap();
    let plan: Value = explain_claim(&mut claims, true, None, &["paused", "psp"]).await;
    /// Rows the plan's scans of `relay.intents` and its index produced or
    /// filtered out.
    fn read(node: &Value) -> f64 {
        let scans =
            node["Relation Name"].as_str() == Some("intents") || node["Index Name"].as_str() == Some("intents_due");
        let here = if scans {
            let loops = node["Actual Loops"].as_f64().unwrap_or(1.0);
            (node["Actual Rows"].as_f64().unwrap_or(0.0) + node["Rows Removed by Filter"].as_f64().unwrap_or(0.0))
                * loops
        } else {
            0.0
        };
        here + node["Plans"].as_array().into_iter().flatten().map(read).sum::<f64>()
    }
    let rows = read(&plan[0]["Plan"]);
    assert!(rows < 100.0, "the claim read {rows} intents' rows to take 3; plan: {}", plan[0]["Plan"]);
}

// The first claim restarts an intent's age budget, and a give-back set
// `attempts` back to 0, so every claim after one restarted it again, each
// from the budget the last had grown: an intent given back while throttled
// kept living (and at last died, announcing on_dead) long after max_age.
#[tokio::test]
async fn a_claim_after_a_give_back_keeps_the_age_budget_the_first_claim_set() {
    let db = TestDb::new().await.unwrap();
    seed::pending_intents(&db.pool, "plans", "psp", "", 1).await.unwrap();
    sqlx::query(
        "UPDATE relay.intents SET created_at = now() - interval '1 hour', expires_at = now() + interval '1 hour'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut claims = ClaimPool::beside(&db.pool, 1, ClaimCommit::Durable).acquire().await.unwrap();
    let lease = Duration::from_secs(30);
    let expires = || async {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>("SELECT expires_at FROM relay.intents")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    let mut set = None;
    for _ in 0..3 {
        let claim = intents::claim(&mut claims, &PLANS, "worker", 1, lease).await.unwrap().rows;
        let at = expires().await;
        let first = *set.get_or_insert(at);
        assert_eq!(at, first, "the budget the first claim set (two hours from it) stays");
        let mut conn = db.conn().await.unwrap();
        intents::release(&mut conn, claim[0].id, claim[0].lease_token).await.unwrap();
    }
}

// Pauses were one per kind and name in the database: two deployments
// sharing it, each with an endpoint `psp`, paused each other's, and one's
// operator resumed the other's incident pause.
#[tokio::test]
async fn a_pause_is_its_deployment_s_and_another_deployment_neither_meets_nor_lifts_it() {
    use relay_store::ops::{self, PauseKind, Resumed};
    let db = TestDb::new().await.unwrap();
    seed::pending_intents(&db.pool, "plans", "psp", "", 2).await.unwrap();
    let mut conn = db.conn().await.unwrap();
    ops::pause(&mut conn, "other", PauseKind::Endpoint, "psp", Some("other's incident")).await.unwrap();
    let mut claims = ClaimPool::beside(&db.pool, 1, ClaimCommit::Durable).acquire().await.unwrap();
    let lease = Duration::from_secs(30);
    let taken = intents::claim(&mut claims, &PLANS, "worker", 1, lease).await.unwrap().rows;
    assert_eq!(taken.len(), 1, "another deployment's pause of its own psp stops nothing here");
    assert_eq!(ops::resume(&mut conn, "plans", PauseKind::Endpoint, "psp").await.unwrap(), Resumed::NotPaused);
    assert_eq!(ops::pauses(&mut conn, "other").await.unwrap().len(), 1, "its pause stands");
    assert!(ops::pauses(&mut conn, "plans").await.unwrap().is_empty());
    ops::pause(&mut conn, "plans", PauseKind::Endpoint, "psp", None).await.unwrap();
    let taken = intents::claim(&mut claims, &PLANS, "worker", 1, lease).await.unwrap().rows;
    assert!(taken.is_empty(), "its own pause holds its calls");
}

#[tokio::test]
async fn claims_after_a_position_start_reading_the_index_there_and_one_from_the_start_finds_what_they_passed() {
    let db = TestDb::new().await.unwrap();
    insert_backlog(&db.pool, ROWS).await;
    let mut claims = ClaimPool::beside(&db.pool, 1, ClaimCommit::Async).acquire().await.unwrap();
    let lease = Duration::from_secs(30);
    let first = intents::claim_after(&mut claims, &PLANS, "worker", 3, lease, None, intents::Room::ANY).await.unwrap();
    let mut ids: Vec<&str> = first.rows.iter().map(|c| c.intent.source_event_id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["e-1", "e-2", "e-3"]);
    let last = first.last.expect("a claim that took rows says where it stopped");
    let seq: i64 = sqlx::query_scalar("SELECT seq FROM relay.intents WHERE source_event_id = 'e-3'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(last.seq, seq, "the last row in claim order");

    // The position bounds the index scan (an Index Cond, where the scan
    // starts), not a filter over every entry before it.
    let plan: Value = explain_claim(&mut claims, false, Some(last), &["psp"]).await;
    fn index_cond(node: &Value, index: &str) -> Option<String> {
        if node["Index Name"].as_str() == Some(index) {
            return node["Index Cond"].as_str().map(str::to_owned);
        }
        node["Plans"].as_array()?.iter().find_map(|n| index_cond(n, index))
    }
    let cond = index_cond(&plan[0]["Plan"], "intents_due").expect("the claim reads intents_due");
    assert!(cond.contains("ROW(next_attempt_at, seq) >"), "the position is no scan bound: {cond}");

    // A row given back lies behind the position: a claim after it passes
    // it over, a claim from the start takes it first.
    let e2 = first.rows.iter().find(|c| c.intent.source_event_id == "e-2").unwrap();
    let mut conn = db.conn().await.unwrap();
    intents::release(&mut conn, e2.id, e2.lease_token).await.unwrap();
    let after =
        intents::claim_after(&mut claims, &PLANS, "worker", 2, lease, Some(last), intents::Room::ANY).await.unwrap();
    let mut ids: Vec<&str> = after.rows.iter().map(|c| c.intent.source_event_id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["e-4", "e-5"]);
    let again = intents::claim_after(&mut claims, &PLANS, "worker", 1, lease, None, intents::Room::ANY).await.unwrap();
    assert_eq!(again.rows.iter().map(|c| c.intent.source_event_id.as_str()).collect::<Vec<_>>(), ["e-2"]);

    // The outbox claim the same way, its position a seq.
    let first = outbox::claim_after(&mut claims, "plans", 3, lease, None).await.unwrap();
    assert_eq!(first.rows.iter().map(|r| r.seq).collect::<Vec<_>>(), [1, 2, 3]);
    let plan: Value = explain_outbox_claim(&mut claims, false, 50, Some(3)).await;
    let cond = index_cond(&plan[0]["Plan"], "outbox_pending_by_seq").expect("the claim reads outbox_pending_by_seq");
    assert!(cond.contains("seq >"), "the position is no scan bound: {cond}");
    let two = &first.rows[1];
    let mut finishes = FinishPool::beside(&db.pool, 1).acquire().await.unwrap();
    assert!(outbox::schedule_retry(&mut finishes, two.id, two.lease_token, Duration::ZERO, "again").await.unwrap());
    let after = outbox::claim_after(&mut claims, "plans", 2, lease, Some(3)).await.unwrap();
    assert_eq!(after.rows.iter().map(|r| r.seq).collect::<Vec<_>>(), [4, 5]);
    let again = outbox::claim_after(&mut claims, "plans", 1, lease, None).await.unwrap();
    assert_eq!(again.rows.iter().map(|r| r.seq).collect::<Vec<_>>(), [2]);
}

/// Rows of `plan` read from `index`, over all loops (EXPLAIN ANALYZE).
fn rows_read(node: &Value, index: &str) -> f64 {
    let own = if node["Index Name"].as_str() == Some(index) {
        node["Actual Rows"].as_f64().unwrap_or(0.0) * node["Actual Loops"].as_f64().unwrap_or(1.0)
            + node["Rows Removed by Filter"].as_f64().unwrap_or(0.0)
    } else {
        0.0
    };
    own + node["Plans"].as_array().map_or(0.0, |ps| ps.iter().map(|n| rows_read(n, index)).sum())
}

#[tokio::test]
async fn an_outbox_claim_examines_its_window_not_every_row_waiting_behind_its_key() {
    let db = TestDb::new().await.unwrap();
    // 64 keys of 100 rows each: once each key's first row is out, every
    // other row waits behind it.
    sqlx::query(
        "INSERT INTO relay.outbox (id, consumer, source_id, action, topic, key, ordering_key, headers, event_type)
         SELECT gen_random_uuid(), 'plans', 'e-' || g, 'placed', 'out', convert_to('k-' || (g % 64), 'UTF8'),
                'k-' || (g % 64), '[]', 'order.placed'
           FROM generate_series(1, 6400) g ORDER BY g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut claims = ClaimPool::beside(&db.pool, 1, ClaimCommit::Async).acquire().await.unwrap();
    let lease = Duration::from_secs(30);
    let heads = outbox::claim_after(&mut claims, "plans", 100, lease, None).await.unwrap();
    assert_eq!(heads.rows.len(), 64, "one row per key");
    assert_eq!(heads.passed, Some(100 * outbox::WINDOW), "a full window that left the batch short says where it ended");

    // Every pending row waits now. A claim of 10 examines its window of 40
    // rows, takes none, and says where it stopped; the next goes on there.
    let blocked = outbox::claim_after(&mut claims, "plans", 10, lease, None).await.unwrap();
    assert!(blocked.rows.is_empty());
    assert_eq!(blocked.passed, Some(64 + 10 * outbox::WINDOW), "the seq of the window's last row");
    let next = outbox::claim_after(&mut claims, "plans", 10, lease, blocked.passed).await.unwrap();
    assert_eq!(next.passed, Some(64 + 20 * outbox::WINDOW));
    // As the claim connection plans it (every row waits: it claims nothing).
    let plan: Value = explain_outbox_claim(&mut claims, true, 10, None).await;
    let read = rows_read(&plan[0]["Plan"], "outbox_pending_by_seq");
    assert!(
        read <= 3.0 * 10.0 * outbox::WINDOW as f64,
        "a blocked claim read {read} index entries of 6336 pending rows: {plan:#}"
    );
}

#[tokio::test]
async fn every_cleanup_batch_reads_the_oldest_rows_through_an_index() {
    let db = TestDb::new().await.unwrap();
    for sql in [
        "INSERT INTO relay.inbox (consumer, event_id, event_type, topic, partition, \"offset\", outcome, received_at)
         SELECT 'plans', 'e-' || g, 't', 'in', 0, g, 'applied', now() - interval '30 days' + g * interval '1 s'
           FROM generate_series(1, $1) g",
        "INSERT INTO relay.idempotency_keys (consumer, idempotency_key, event_id, created_at)
         SELECT 'plans', 'k-' || g, 'e-' || g, now() - interval '30 days' + g * interval '1 s' FROM generate_series(1, $1) g",
        "INSERT INTO relay.intents (id, consumer, source_event_id, action, endpoint, method, path, idempotency_key,
                                    max_attempts, expires_at, emit_source, state, finished_at)
         SELECT gen_random_uuid(), 'plans', 'e-' || g, 'capture', 'psp', 'POST', '/c', 'capture:' || g, 10, now(),
                'plans', CASE WHEN g % 100 = 0 THEN 'dead' ELSE 'succeeded' END,
                now() - interval '30 days' + g * interval '1 s'
           FROM generate_series(1, $1) g",
        // Their attempts, which go with them.
        "INSERT INTO relay.intent_attempts (intent_id, attempt, worker, lease_token, outcome)
         SELECT id, 1, 'w', gen_random_uuid(), 'succeeded' FROM relay.intents WHERE $1 > 0",
        "INSERT INTO relay.outbox (id, consumer, source_id, action, topic, state, published_at)
         SELECT gen_random_uuid(), 'plans', 'e-' || g, 'captured', 'out', 'published',
                now() - interval '30 days' + g * interval '1 s'
           FROM generate_series(1, $1) g",
        "INSERT INTO relay.dead_letters (consumer, topic, partition, \"offset\", error_class, reason, created_at)
         SELECT 'plans', 'in', 0, g, 'bad_json', 'bad', now() - interval '30 days' + g * interval '1 s'
           FROM generate_series(1, $1) g",
    ] {
        sqlx::query(sql).bind(OLD_ROWS).execute(&db.pool).await.unwrap();
    }
    sqlx::query("ANALYZE").execute(&db.pool).await.unwrap();

    let mut conn = db.conn().await.unwrap();
    for (what, index) in [
        (Cleanup::Inbox, "inbox_received_at"),
        (Cleanup::IdempotencyKeys, "idempotency_keys_created_at"),
        (Cleanup::SucceededIntents, "intents_succeeded_at"),
        (Cleanup::DeadIntents, "intents_dead"),
        (Cleanup::PublishedOutbox, "outbox_published_at"),
        (Cleanup::DeadLetters, "dead_letters_created_at"),
    ] {
        let plan: Value =
            sqlx::query_scalar(&format!("EXPLAIN (FORMAT JSON) {}", ops::delete_sql(what, CLEANUP_BATCH)))
                .bind("plans")
                .bind(Duration::from_secs(7 * 86_400).as_secs_f64())
                .fetch_one(&mut *conn)
                .await
                .unwrap();
        assert_index_order(&format!("cleanup of {}", what.label()), &nodes(&plan), index);
    }

    // The metrics gauges, refreshed every few seconds in every process, count
    // the backlog through the partial indexes and never the history.
    let plan: Value = sqlx::query_scalar(&format!("EXPLAIN (FORMAT JSON) {}", stats::GAUGE_COUNTS))
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let plan = nodes(&plan);
    assert!(
        !plan.iter().any(|n| n.starts_with("Seq Scan") && n.as_str() != "Seq Scan dead_letters"),
        "the gauges read a whole table; plan: {plan:?}"
    );
}

#[tokio::test]
async fn finishing_a_claim_probes_the_primary_key_when_the_statistics_say_nothing_is_running() {
    let db = TestDb::new().await.unwrap();
    // Mostly history, analyzed: the statistics say (rightly, for the table)
    // that almost no row is running. Then a backlog is claimed. (On a much
    // smaller table, reading it whole for a batch of 256 is a fair plan.)
    let history = seed::History { succeeded_intents: HISTORY, published_outbox: HISTORY, ..seed::History::default() };
    seed::history(&db.pool, "plans", history).await.unwrap();
    sqlx::query("ANALYZE").execute(&db.pool).await.unwrap();
    insert_backlog(&db.pool, 1000).await;
    let mut conn = db.conn().await.unwrap();
    let mut claims = ClaimPool::beside(&db.pool, 1, ClaimCommit::Async).acquire().await.unwrap();
    let claimed = intents::claim(&mut claims, &PLANS, "worker", 1000, Duration::from_secs(30)).await.unwrap().rows;
    let rows = outbox::claim(&mut claims, "plans", 1000, Duration::from_secs(30)).await.unwrap().rows;
    assert_eq!((claimed.len(), rows.len()), (1000, 1000));

    // One batch of finishes, as the dispatcher's finalizer writes it.
    let n = 256;
    let claimed = &claimed[..n];
    let plan: Value = sqlx::query_scalar(&format!("EXPLAIN (FORMAT JSON) {}", intents::FINISH))
        .bind(claimed.iter().map(|c| c.id).collect::<Vec<_>>())
        .bind(claimed.iter().map(|c| c.lease_token).collect::<Vec<_>>())
        .bind(vec!["succeeded"; n])
        .bind(vec![0.0_f64; n])
        .bind(vec![Some(200_i32); n])
        .bind(vec![None::<String>; n])
        .bind(vec![None::<String>; n])
        .bind(vec!["succeeded"; n])
        .bind(vec![Some(chrono::Utc::now()); n])
        .bind(vec![1_i32; n])
        .bind(vec!["worker"; n])
        .bind(vec![true; n])
        .bind(vec![false; n])
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_probes_the_key("finishing intents", &nodes(&plan), "intents_pkey", "intents_leases");
    let rows = &rows[..n];
    let plan: Value = sqlx::query_scalar(&format!("EXPLAIN (FORMAT JSON) {}", outbox::MARK_PUBLISHED))
        .bind(rows.iter().map(|r| r.id).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.lease_token).collect::<Vec<_>>())
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_probes_the_key("marking outbox rows published", &nodes(&plan), "outbox_pkey", "outbox_leases");

    // Which is only a fence because no row keeps a token once it stops running.
    for sql in [
        "UPDATE relay.intents SET state = 'succeeded' WHERE state = 'running'",
        "UPDATE relay.outbox SET state = 'published' WHERE state = 'running'",
    ] {
        let err = sqlx::query(sql).execute(&mut *conn).await.unwrap_err();
        assert!(err.to_string().contains("lease_only_while_running"), "{sql}: {err}");
    }
}

/// Which connection a statement runs on in the relay.
#[derive(Clone, Copy, PartialEq)]
enum On {
    Claims,
    Finishes,
}

struct Conns {
    claims: relay_store::ClaimConnection,
    finishes: relay_store::FinishConnection,
}

impl Conns {
    fn on(&mut self, which: On) -> &mut PgConnection {
        match which {
            On::Claims => self.claims.as_conn(),
            On::Finishes => &mut self.finishes,
        }
    }
}

#[tokio::test]
async fn a_plan_cached_while_the_table_was_small_still_probes_keys_once_it_has_grown() {
    let db = TestDb::new().await.unwrap();
    // A new deployment: the tables are tiny and analyzed as such, and no
    // autovacuum catches up during the test.
    for table in ["intents", "outbox"] {
        sqlx::query(&format!("ALTER TABLE relay.{table} SET (autovacuum_enabled = off)"))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    insert_backlog(&db.pool, 10).await;
    sqlx::query("ANALYZE").execute(&db.pool).await.unwrap();
    // What PostgreSQL does by itself from a statement's sixth run on: plan it
    // once for any parameters and keep that plan for the connection. Each on
    // the connection the relay runs it on: claims on a claim connection,
    // intents' finishes and outbox rows marked published on a finish
    // connection.
    let mut conns = Conns {
        claims: ClaimPool::beside(&db.pool, 1, ClaimCommit::Async).acquire().await.unwrap(),
        finishes: FinishPool::beside(&db.pool, 1).acquire().await.unwrap(),
    };
    for (which, sql) in [
        (On::Claims, "SET plan_cache_mode = force_generic_plan".to_owned()),
        (On::Finishes, "SET plan_cache_mode = force_generic_plan".to_owned()),
        (On::Claims, format!("PREPARE claim_intents AS {}", intents::CLAIM)),
        (On::Claims, format!("PREPARE claim_outbox AS {}", outbox::CLAIM)),
        (On::Finishes, format!("PREPARE finish_intents AS {}", intents::FINISH)),
        (On::Finishes, format!("PREPARE mark_published AS {}", outbox::MARK_PUBLISHED)),
    ] {
        sqlx::raw_sql(&sql).execute(conns.on(which)).await.unwrap();
    }
    // Each statement runs once while the table is small (rolled back here):
    // its plan is made and cached now.
    let execute = |name: &str, which: On| {
        let args = match name {
            "claim_intents" => "(2, 'worker', 30, NULL, 0, '{psp}', 'plans', 9223372036854775807, true, true)",
            "claim_outbox" => "(2, 30, -9223372036854775808, 'plans', 8)",
            "finish_intents" => "('{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}')",
            _ => "('{}', '{}')",
        };
        (format!("EXECUTE {name}{args}"), which)
    };
    let statements = [
        execute("claim_intents", On::Claims),
        execute("claim_outbox", On::Claims),
        execute("finish_intents", On::Finishes),
        execute("mark_published", On::Finishes),
    ];
    for (sql, which) in &statements {
        let mut tx = conns.on(*which).begin().await.unwrap();
        sqlx::raw_sql(sql).execute(&mut *tx).await.unwrap();
        tx.rollback().await.unwrap();
    }
    // The tables grow; nothing tells the cached plans.
    insert_backlog(&db.pool, ROWS).await;
    for ((sql, which), index) in statements.iter().zip(["intents_due", "outbox_pending_by_seq", "", ""]) {
        let mut tx = conns.on(*which).begin().await.unwrap();
        let plan: Value =
            sqlx::query_scalar(&format!("EXPLAIN (FORMAT JSON) {sql}")).fetch_one(&mut *tx).await.unwrap();
        tx.rollback().await.unwrap();
        let tree = plan;
        let plan = nodes(&tree);
        assert!(!plan.iter().any(|n| n.starts_with("Hash")), "{sql} hashes a whole table; plan: {plan:?}");
        if *which == On::Claims && index == "intents_due" {
            assert_limited_scans(sql, &tree, index);
        } else if *which == On::Claims {
            assert_index_order(sql, &plan, index);
        } else {
            let (key, leases) = if sql.contains("intents") {
                ("intents_pkey", "intents_leases")
            } else {
                ("outbox_pkey", "outbox_leases")
            };
            assert_probes_the_key(sql, &plan, key, leases);
        }
    }
}

#[tokio::test]
async fn only_outbox_claims_commit_without_waiting_for_the_disk() {
    // A lost outbox claim is a lease that expired early (relay_store::ClaimPool);
    // a lost intent claim would let a second call start while the first is
    // in flight (issue 28, D5), and a lost finish would be an outcome
    // recorded and then forgotten.
    let db = TestDb::new().await.unwrap();
    let mut claims = ClaimPool::beside(&db.pool, 1, ClaimCommit::Async).acquire().await.unwrap();
    let mut conn = db.conn().await.unwrap();
    let setting = "SELECT current_setting('synchronous_commit')";
    let claim: String = sqlx::query_scalar(setting).fetch_one(claims.as_conn()).await.unwrap();
    let mut durable = ClaimPool::beside(&db.pool, 1, ClaimCommit::Durable).acquire().await.unwrap();
    let intent_claim: String = sqlx::query_scalar(setting).fetch_one(durable.as_conn()).await.unwrap();
    assert_eq!(intent_claim, "on", "intent claims wait for the disk");
    let mut finishes = FinishPool::beside(&db.pool, 1).acquire().await.unwrap();
    let finish: String = sqlx::query_scalar(setting).fetch_one(&mut *finishes).await.unwrap();
    let mut tx = begin_by_key(&mut conn).await.unwrap();
    let by_key: String = sqlx::query_scalar(setting).fetch_one(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
    let after: String = sqlx::query_scalar(setting).fetch_one(&mut *conn).await.unwrap();
    assert_eq!((claim.as_str(), finish.as_str(), by_key.as_str(), after.as_str()), ("off", "on", "on", "on"));
}

#[tokio::test]
async fn the_unique_keys_that_stop_a_second_effect_compare_text_byte_by_byte() {
    // An index on text in a linguistic collation goes out of order when the
    // C library's or ICU's rules change under it, and a unique index then
    // misses a key it holds: a redelivered record would not be a duplicate
    // (migration 0007). Byte order never changes.
    let db = TestDb::new().await.unwrap();
    let keys: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT i.indexrelid::regclass::text, a.attname::text, c.collname::text
           FROM pg_index i
           JOIN pg_class t ON t.oid = i.indrelid
           JOIN pg_namespace n ON n.oid = t.relnamespace AND n.nspname = 'relay'
          CROSS JOIN LATERAL unnest(i.indkey::int2[], i.indcollation::oid[]) AS k(attnum, coll)
           JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = k.attnum
           JOIN pg_collation c ON c.oid = k.coll
          WHERE i.indisunique
          ORDER BY 1, 2",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let checked = |index: &str, column: &str| keys.iter().any(|(i, a, _)| i == index && a == column);
    assert!(checked("relay.inbox_pkey", "event_id") && checked("relay.history_pkey", "source_id"), "{keys:?}");
    let linguistic: Vec<_> = keys
        .iter()
        // Operators' pauses guard nothing, and the claim compares their names
        // with intents' endpoints (default collation): mixing two collations
        // in one comparison is an error.
        .filter(|(index, _, collation)| index != "relay.pauses_pkey" && collation != "C")
        .collect();
    assert!(linguistic.is_empty(), "unique keys compared through a collation: {linguistic:?}");
}

#[tokio::test]
async fn the_ordering_keys_a_claim_looks_up_compare_text_byte_by_byte() {
    // Ingest review "to check": the per-key ordering lookups (R13) went
    // through indexes in the default collation, which a C library upgrade
    // can put out of order; then a claim misses an earlier unfinished row of
    // its key (migration 0011).
    let db = TestDb::new().await.unwrap();
    let columns: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT table_name::text, column_name::text, collation_name::text FROM information_schema.columns
          WHERE table_schema = 'relay' AND column_name IN ('ordering_key', 'topic')
            AND table_name IN ('intents', 'outbox') ORDER BY 1, 2",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let c = Some("C".to_string());
    assert_eq!(
        columns,
        vec![
            ("intents".into(), "ordering_key".into(), c.clone()),
            ("outbox".into(), "ordering_key".into(), c.clone()),
            ("outbox".into(), "topic".into(), c),
        ]
    );
}

/// Assert the plan finds its rows through `key` and reads no table whole nor
/// the partial index `leases` (every running row, once per row finished).
fn assert_probes_the_key(what: &str, plan: &[String], key: &str, leases: &str) {
    assert!(
        plan.iter().any(|n| n == &format!("Index Scan {key}")),
        "{what} should find each row through {key}; plan: {plan:?}"
    );
    assert!(
        !plan.iter().any(|n| n.ends_with(&format!(" {leases}"))
            || n.starts_with("Seq Scan intents")
            || n.starts_with("Seq Scan outbox")),
        "{what} reads every running row; plan: {plan:?}"
    );
}

/// The console refreshes its counts every 3 s: a history table beyond the
/// threshold is not counted (that reads it whole) but taken from
/// PostgreSQL's running estimate of live rows, less the exact backlog, and
/// the API says which figures are estimates; a small one is counted exactly.
#[tokio::test]
async fn console_counts_estimate_big_history_tables_and_count_small_ones_exactly() {
    let db = TestDb::new().await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO relay.inbox (consumer, event_id, event_type, topic, partition, \"offset\", outcome)
         SELECT 'plans', 'e-' || g, 'order.placed', 'in', 0, g, CASE WHEN g <= 3 THEN 'stale' ELSE 'applied' END
           FROM generate_series(1, 1003) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    insert_backlog(&db.pool, 10).await;
    sqlx::query("UPDATE relay.intents SET state = 'succeeded', finished_at = now() WHERE source_event_id IN ('e-1', 'e-2', 'e-3', 'e-4')")
        .execute(&db.pool)
        .await
        .unwrap();
    // The statistics arrive when the writing sessions report them: at once
    // when told to (PostgreSQL 15), else within seconds of going idle. Every
    // connection of the pool (10) is one of them or a new one.
    let mut writers = Vec::new();
    for _ in 0..10 {
        let mut c = db.pool.acquire().await.unwrap();
        let _ = sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *c).await;
        writers.push(c);
    }
    drop(writers);
    relay_testkit::eventually("the inserts in pg_stat_user_tables", relay_testkit::DEADLINE, || async {
        let live: Vec<i64> = sqlx::query_scalar(
            "SELECT n_live_tup FROM pg_stat_user_tables WHERE schemaname = 'relay'
               AND relname IN ('inbox', 'intents', 'outbox') ORDER BY relname",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        (live == [1003, 10, 10]).then_some(())
    })
    .await;
    let mut conn = db.conn().await.unwrap();

    let (exact, estimated) = stats::overview(&mut conn, 100_000).await.unwrap();
    assert!(estimated.is_empty(), "{estimated:?}");
    assert_eq!(exact.inbox, [(relay_core::InboxOutcome::Applied, 1000), (relay_core::InboxOutcome::Stale, 3)]);
    assert_eq!(stats::Stats::count(&exact.intents, relay_core::IntentState::Succeeded), 4);
    assert_eq!(stats::Stats::count(&exact.intents, relay_core::IntentState::Pending), 6);

    let (big_inbox, estimated) = stats::overview(&mut conn, 500).await.unwrap();
    assert_eq!(estimated, ["inbox"]);
    assert_eq!((big_inbox.inbox.as_slice(), big_inbox.inbox_estimated), ([].as_slice(), Some(1003)));

    let (all_big, estimated) = stats::overview(&mut conn, 5).await.unwrap();
    assert_eq!(estimated, ["inbox", "intents.succeeded", "outbox.published"]);
    assert_eq!(
        stats::Stats::count(&all_big.intents, relay_core::IntentState::Succeeded),
        4,
        "10 live rows less 6 pending"
    );
    assert_eq!(stats::Stats::count(&all_big.intents, relay_core::IntentState::Pending), 6, "the backlog stays exact");
    assert_eq!(stats::Stats::count(&all_big.outbox, relay_core::OutboxState::Published), 0);
    assert_eq!(stats::Stats::count(&all_big.outbox, relay_core::OutboxState::Pending), 10);
}

#[tokio::test]
async fn intents_an_earlier_version_left_are_claimed_and_replayed_after_the_upgrade() {
    // Review of issue 28's first increment, F1: the error-class constraints
    // were added NOT VALID, which PostgreSQL still checks on every UPDATE of
    // an old row, so a pending intent an earlier version had tried as
    // `endpoint_unknown` made every claim statement fail.
    let db = TestDb::migrated_up_to(20261203000011).await.unwrap();
    sqlx::query(
        "INSERT INTO relay.intents (id, consumer, source_event_id, action, endpoint, method, path, idempotency_key,
                                    max_attempts, attempts, expires_at, emit_source, state, last_error_class)
         VALUES (gen_random_uuid(), 'plans', 'e-1', 'capture', 'psp', 'POST', '/c', 'capture:1', 5, 1,
                 now() + interval '1 day', 'plans', 'pending', 'endpoint_unknown'),
                (gen_random_uuid(), 'plans', 'e-2', 'capture', 'psp', 'POST', '/c', 'capture:2', 5, 5,
                 now() + interval '1 day', 'plans', 'dead', 'endpoint_unknown')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    relay_store::migrate(&db.pool).await.unwrap();
    // The earlier version's migrations table, in `public`, moved into relay's schema.
    assert!(relay_store::migrations_current(&db.pool).await.unwrap());
    let left: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('public._sqlx_migrations')::text").fetch_one(&db.pool).await.unwrap();
    assert_eq!(left, None, "the earlier migrations table is moved, not left beside relay's");
    let mut claims = ClaimPool::beside(&db.pool, 1, ClaimCommit::Durable).acquire().await.unwrap();
    let claimed = intents::claim(&mut claims, &PLANS, "worker", 10, Duration::from_secs(30)).await.unwrap().rows;
    assert_eq!(claimed.iter().map(|c| c.intent.source_event_id.as_str()).collect::<Vec<_>>(), ["e-1"]);
    let dead: uuid::Uuid = sqlx::query_scalar("SELECT id FROM relay.intents WHERE source_event_id = 'e-2'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let mut conn = db.conn().await.unwrap();
    assert_eq!(
        intents::requeue(&mut conn, "plans", dead, |_| intents::ReplayRules::ANY).await.unwrap(),
        intents::Requeue::Queued
    );
}

#[tokio::test]
async fn dead_outbox_rows_an_earlier_version_left_behind_published_ones_are_skipped_at_the_upgrade() {
    // Second review of issue 28, N7: once dead rows hold their key (0013), a
    // row that died before the upgrade, whose key's later rows were already
    // published, would hold up every row written after it — and a replay
    // would publish it after the rows it was meant to precede.
    let db = TestDb::migrated_up_to(20261204000016).await.unwrap();
    let row = |source: &str, key: &str, state: &str| {
        format!(
            "('{}'::uuid, 'plans', '{source}', 'accepted', 't', 'k', '{key}', '{state}', {})",
            uuid::Uuid::new_v4(),
            if state == "published" { "now()" } else { "NULL" }
        )
    };
    let rows = [
        row("overtaken", "A", "dead"),
        row("after", "A", "published"),
        row("alone", "B", "dead"),
        row("earlier", "C", "published"),
        row("last", "C", "dead"),
        row("unkeyed", "NULL", "dead"),
    ]
    .join(", ")
    .replace("'NULL'", "NULL");
    sqlx::query(&format!(
        "INSERT INTO relay.outbox (id, consumer, source_id, action, topic, key, ordering_key, state, published_at)
         VALUES {}",
        rows.replace(", 'k',", ", convert_to('k', 'UTF8'),")
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    relay_store::migrate(&db.pool).await.unwrap();
    let states: Vec<(String, String)> =
        sqlx::query_as("SELECT source_id, state FROM relay.outbox WHERE state <> 'published' ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let states: Vec<(&str, &str)> = states.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
    assert_eq!(states, [("overtaken", "skipped"), ("alone", "dead"), ("last", "dead"), ("unkeyed", "dead")]);
    let why: String = sqlx::query_scalar("SELECT last_error FROM relay.outbox WHERE source_id = 'overtaken'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(why.contains("later rows of its key were already published"), "{why}");
}

#[tokio::test]
async fn dead_letters_replayed_before_the_upgrade_keep_whether_they_were_resolved() {
    let db = TestDb::migrated_up_to(20261207000036).await.unwrap();
    let outcomes = [
        ("never", None),
        ("applied", Some("applied")),
        ("stale", Some("stale")),
        ("still", Some("failed: not processable yet (missing_reference): no saga o-1")),
        ("held", Some("failed: held behind dead letter 1 (offset 0) of its key")),
        ("skipped", Some("skipped")),
    ];
    for (offset, (reason, outcome)) in outcomes.iter().enumerate() {
        sqlx::query(
            "INSERT INTO relay.dead_letters (consumer, topic, partition, \"offset\", error_class, reason, replay_outcome)
             VALUES ('plans', 't', 0, $1, 'schema_invalid', $2, $3)",
        )
        .bind(offset as i64)
        .bind(reason)
        .bind(outcome)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    relay_store::migrate(&db.pool).await.unwrap();
    let states: Vec<(String, String)> =
        sqlx::query_as("SELECT reason, replay_state FROM relay.dead_letters ORDER BY \"offset\"")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let states: Vec<(&str, &str)> = states.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
    assert_eq!(
        states,
        [
            ("never", "open"),
            ("applied", "resolved"),
            ("stale", "resolved"),
            ("still", "open"),
            ("held", "open"),
            ("skipped", "skipped")
        ]
    );
}

#[tokio::test]
async fn sagas_an_earlier_version_shared_go_to_each_deployment_that_moved_them_at_the_upgrade() {
    let db = TestDb::migrated_up_to(20261207000032).await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO relay.inbox (consumer, event_id, event_type, topic, partition, \"offset\", outcome)
         VALUES ('a', 'e-1', 't', 'x', 0, 1, 'applied'), ('b', 'e-2', 't', 'x', 0, 2, 'applied');
         INSERT INTO relay.history (consumer, source_id, action, kind, subject)
         VALUES ('a', 'e-1', 'open', 'saga', 'order/o-1'), ('a', 'e-3', 'pay', 'saga', 'order/o-2'),
                ('b', 'e-2', 'pay', 'saga', 'order/o-2');
         INSERT INTO relay.sagas (saga_type, saga_id, state, last_event_id)
         VALUES ('order', 'o-1', 'pending', 'e-1'), ('order', 'o-2', 'paid', 'e-2'), ('order', 'o-3', 'new', 'e-0')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    relay_store::migrate(&db.pool).await.unwrap();
    let owners: Vec<(String, String, String)> =
        sqlx::query_as("SELECT consumer, saga_id, state FROM relay.sagas ORDER BY saga_id, consumer")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let owners: Vec<(&str, &str, &str)> = owners.iter().map(|(a, b, c)| (a.as_str(), b.as_str(), c.as_str())).collect();
    assert_eq!(
        owners,
        [
            // Moved by a alone.
            ("a", "o-1", "pending"),
            // Moved by both: a copy each.
            ("a", "o-2", "paid"),
            ("b", "o-2", "paid"),
            // Its history gone: every deployment that wrote to the database.
            ("a", "o-3", "new"),
            ("b", "o-3", "new"),
        ]
    );
}

#[tokio::test]
async fn every_check_constraint_on_names_accepts_exactly_its_enum_s_names() {
    // Each enum of stored names decides what a stored name means; the CHECK
    // constraint of its column must accept exactly those names, and a CHECK
    // on a list of names that no enum answers for fails this test.
    use relay_core::retry::{AttemptOutcome, ErrorClass};
    use relay_core::{
        HistoryKind, InboxOutcome, IntentState, OutboxState, PauseKind, ReplayState, profile::Reconciled,
    };
    fn names<T: std::fmt::Display>(all: impl IntoIterator<Item = T>) -> Vec<String> {
        let mut v: Vec<String> = all.into_iter().map(|x| x.to_string()).collect();
        v.sort();
        v
    }
    let mut attempt_outcomes = names(AttemptOutcome::ALL);
    attempt_outcomes.push("running".into()); // the default of a row being written, never an outcome
    attempt_outcomes.sort();
    let expected: std::collections::BTreeMap<&str, Vec<String>> = [
        ("intents_state_known", names(IntentState::ALL)),
        ("outbox_state_known", names(OutboxState::ALL)),
        ("intent_attempts_error_class_known", names(ErrorClass::ALL)),
        ("intents_last_error_class_known", names(ErrorClass::ALL)),
        ("intent_attempts_outcome_known", attempt_outcomes),
        ("intent_reconciliations_verdict_known", names(Reconciled::ALL)),
        ("inbox_outcome_known", names(InboxOutcome::ALL)),
        ("pauses_kind_known", names(PauseKind::ALL)),
        ("history_kind_known", names(HistoryKind::ALL)),
        ("dead_letters_replay_state_known", names(ReplayState::ALL)),
        ("dead_letters_error_class_known", names(relay_core::PoisonClass::ALL)),
    ]
    .into_iter()
    .collect();
    let db = TestDb::new().await.unwrap();
    let checks: Vec<(String, String)> = sqlx::query_as(
        "SELECT conname::text, pg_get_constraintdef(oid) FROM pg_constraint
          WHERE contype = 'c' AND connamespace = 'relay'::regnamespace AND pg_get_constraintdef(oid) LIKE '%ARRAY[%'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let mut seen = Vec::new();
    for (name, def) in &checks {
        let mut allowed: Vec<String> = def.split('\'').skip(1).step_by(2).map(str::to_owned).collect();
        allowed.sort();
        let Some(want) = expected.get(name.as_str()) else {
            panic!("CHECK {name} lists names no enum of relay_core::stored answers for: {def}");
        };
        assert_eq!(&allowed, want, "{name}");
        seen.push(name.as_str());
    }
    seen.sort();
    assert_eq!(seen, expected.keys().copied().collect::<Vec<_>>(), "every enum's constraint exists");
}
