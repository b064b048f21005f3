//! The chaos soak, small: a clean run passes with zero lost and zero double
//! effects; the same soak with a guard disabled on purpose is caught by the
//! checker. (The long run is `scripts/soak.sh --long`; see EVIDENCE.md.)

use std::time::Duration;

use relay_soak::{SoakOptions, run};

fn options(events: usize, kills: usize) -> SoakOptions {
    SoakOptions {
        events,
        topics: 2,
        partitions: 3,
        kills,
        duplicate_ratio: 0.07,
        retry_ratio: 0.02,
        poison_ratio: 0.01,
        replay: true,
        sabotage: None,
        consumer_faults: None,
        relay_bin: env!("CARGO_BIN_EXE_relay").into(),
        database_url: std::env::var("RELAY_TEST_DATABASE_URL").expect("run with scripts/test.sh"),
        bootstrap: std::env::var("RELAY_TEST_KAFKA_BOOTSTRAP").expect("run with scripts/test.sh"),
        seed: 20261130,
        drain_deadline: Duration::from_secs(240),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_soak_with_random_kills_ends_with_nothing_lost_and_nothing_applied_twice() {
    let (summary, report) = run(&options(1500, 20)).await.unwrap();
    println!("{}\n{}", report.render(), summary.render(&report));
    assert!(report.ok(), "{}", report.render());
    assert!(summary.kills >= 20);
    // The kills test crashes mid-work only if they land while there is work.
    assert!(
        summary.kills_under_load * 4 >= summary.kills * 3,
        "{} of {} kills under load",
        summary.kills_under_load,
        summary.kills
    );
    assert_eq!(summary.effects, 1500, "every order captured once");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_soak_and_checker_catch_an_offset_committed_before_the_database() {
    let mut o = options(800, 10);
    o.replay = false;
    o.sabotage = Some("offset-before-commit".into());
    // Crash in the window between the (sabotaged) offset commit and the DB
    // commit: every consumer aborts at its 2nd batch and is restarted.
    o.consumer_faults = Some("consumer.before_db_commit=abort@2".into());
    let (_, report) = run(&o).await.unwrap();
    assert!(report.violations.iter().any(|v| v.check == "lost" && v.count > 0), "{}", report.render());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_soak_and_checker_catch_a_new_idempotency_key_per_attempt() {
    let mut o = options(800, 5);
    o.replay = false;
    o.sabotage = Some("fresh-idempotency-key".into());
    let (_, report) = run(&o).await.unwrap();
    assert!(report.violations.iter().any(|v| v.check == "intent_applied_twice"), "{}", report.render());
}
