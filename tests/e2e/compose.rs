//! `compose.yaml` cannot run here (no Docker engine), so this keeps it honest
//! instead: it must bring up the same pieces on the same ports with the same
//! variables and configuration keys as the scripts and the example
//! configuration, and its relay environment must load into a valid configuration.

use std::path::Path;

use yaml_rust2::{Yaml, YamlLoader};

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn compose() -> Yaml {
    let text = std::fs::read_to_string(root().join("compose.yaml")).expect("compose.yaml exists");
    YamlLoader::load_from_str(&text).expect("compose.yaml is YAML").remove(0)
}

fn ports(service: &Yaml) -> Vec<String> {
    service["ports"]
        .as_vec()
        .map(|v| v.iter().filter_map(|p| p.as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

fn env(service: &Yaml) -> Vec<(String, String)> {
    service["environment"]
        .as_hash()
        .map(|h| {
            h.iter()
                .filter_map(|(k, v)| {
                    let v = match v {
                        Yaml::String(s) => s.clone(),
                        Yaml::Integer(i) => i.to_string(),
                        other => format!("{other:?}"),
                    };
                    Some((k.as_str()?.to_owned(), v))
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn compose_runs_postgres_kafka_the_provider_and_the_relay_on_the_ports_the_configuration_uses() {
    let c = compose();
    let services = &c["services"];
    for name in ["postgres", "kafka", "provider", "migrate", "relay"] {
        assert!(!services[name].is_badvalue(), "compose.yaml has no service {name}");
    }
    let example = std::fs::read_to_string(root().join("relay.example.toml")).unwrap();
    let lib = std::fs::read_to_string(root().join("scripts/lib.sh")).unwrap();

    assert!(ports(&services["postgres"]).contains(&"127.0.0.1:5432:5432".to_string()));
    assert!(lib.contains("127.0.0.1:5432") || lib.contains("127.0.0.1 5432"), "the scripts use PostgreSQL on 5432");
    assert!(ports(&services["kafka"]).contains(&"127.0.0.1:9092:9092".to_string()));
    assert!(example.contains("bootstrap_servers = \"127.0.0.1:9092\""), "the example configuration uses Kafka on 9092");
    assert!(ports(&services["provider"]).contains(&"127.0.0.1:8081:8081".to_string()));
    assert!(
        example.contains("base_url = \"http://127.0.0.1:8081\""),
        "the example configuration calls the provider on 8081"
    );
    assert!(
        ports(&services["relay"]).contains(&"127.0.0.1:9090:9090".to_string()),
        "the console and metrics are published"
    );
    assert!(example.contains("listen = \"0.0.0.0:9090\"") || example.contains("listen = \"127.0.0.1:9090\""));
    // Issue 22 item 19: nothing is published beyond this host's loopback.
    for (name, service) in services.as_hash().unwrap() {
        for p in ports(service) {
            assert!(p.starts_with("127.0.0.1:"), "{name:?} publishes {p} on every interface");
        }
    }
    let provider_cmd = format!("{:?}", services["provider"]["entrypoint"]);
    assert!(provider_cmd.contains("0.0.0.0:8081"), "{provider_cmd}");
}

#[test]
fn the_relay_environment_in_compose_names_real_configuration_keys() {
    let c = compose();
    for service in ["migrate", "relay"] {
        let vars = env(&c["services"][service]);
        assert!(vars.iter().any(|(k, _)| k == "DATABASE_URL"), "{service}: DATABASE_URL");
        assert!(
            vars.iter().any(|(k, _)| k == "RELAY_ADMIN_TOKEN"),
            "{service}: the admin token comes from the environment"
        );
        let token = vars.iter().find(|(k, _)| k == "RELAY_ADMIN_TOKEN").map(|(_, v)| v.as_str()).unwrap_or("");
        assert!(
            token.starts_with("${RELAY_ADMIN_TOKEN:?"),
            "{service}: the token must be the user's own (compose refuses to start without it), not {token:?}"
        );
        // Every RELAY_SECTION__KEY override must load into the example configuration.
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_relay"));
        cmd.current_dir(root()).args(["--config", "relay.example.toml", "check-config"]).env_remove("DATABASE_URL");
        for (k, v) in &vars {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{service}: compose's environment does not load: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("endpoint payments: http://provider:8081/"), "{service}: {stdout}");
    }
}

#[test]
fn the_relay_s_containers_run_read_only_with_no_capability_and_no_privilege_gain() {
    // Security review L10.
    let c = compose();
    for service in ["provider", "migrate", "relay"] {
        let s = &c["services"][service];
        assert_eq!(s["read_only"].as_bool(), Some(true), "{service}: read_only");
        let dropped: Vec<&str> =
            s["cap_drop"].as_vec().map(|v| v.iter().filter_map(Yaml::as_str).collect()).unwrap_or_default();
        assert_eq!(dropped, ["ALL"], "{service}: cap_drop");
        let opts: Vec<&str> =
            s["security_opt"].as_vec().map(|v| v.iter().filter_map(Yaml::as_str).collect()).unwrap_or_default();
        assert!(opts.contains(&"no-new-privileges:true"), "{service}: security_opt");
    }
    let ignored = std::fs::read_to_string(root().join(".dockerignore")).expect(".dockerignore exists");
    for entry in [".git", "target", ".env"] {
        assert!(ignored.lines().any(|l| l.trim() == entry), ".dockerignore leaves out {entry}");
    }
}

// Issue 28, L10: every base image names an exact release, never a moving tag
// (`rust:1.95-bookworm`, `postgres:15`, `latest`): a rebuild months later must
// not pick up another toolchain, libc or server. (Digests need a registry
// lookup these machines cannot make: the Dockerfile says so.)
#[test]
fn every_image_is_pinned_to_an_exact_release() {
    let dockerfile = std::fs::read_to_string(root().join("Dockerfile")).expect("Dockerfile exists");
    let mut images: Vec<String> = dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("FROM "))
        .map(|l| l.split_whitespace().find(|w| !w.starts_with("--")).unwrap_or_default().to_owned())
        .collect();
    let c = compose();
    for (_, service) in c["services"].as_hash().expect("services") {
        if let Some(image) = service["image"].as_str() {
            images.push(image.to_owned());
        }
    }
    assert!(images.len() >= 4, "{images:?}");
    for image in &images {
        // A digest may follow the tag (`postgres:15.18@sha256:…`): the tag is what is checked.
        let named = image.split('@').next().unwrap_or_default();
        let (name, tag) = named.rsplit_once(':').unwrap_or((named, "latest"));
        let version = tag.split('-').next().unwrap_or_default();
        let parts: Vec<&str> = version.split('.').collect();
        // Rust, Kafka and Debian release x.y.z / x.y; PostgreSQL x.y.
        let least = if name.ends_with("postgres") || name.ends_with("debian") { 2 } else { 3 };
        assert!(
            parts.len() >= least && parts.iter().all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit())),
            "{image}: pin an exact release (e.g. rust:1.95.0-bookworm, postgres:15.18), not {tag:?}"
        );
    }
}

// relay refuses input topics kept in a codec that inflates without a bound
// per fetch, and an inbox window shorter than a record's time in the log
// (retention.ms + segment.ms); it reads the topics' configuration at start.
// compose's broker must keep topics relay accepts, made before it starts.
#[test]
fn compose_s_broker_keeps_topics_the_relay_accepts_and_makes_them_before_it_starts() {
    let c = compose();
    let services = &c["services"];
    let kafka = env(&services["kafka"]);
    let get = |k: &str| kafka.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let codec = get("KAFKA_COMPRESSION_TYPE").unwrap_or_else(|| "producer".into());
    assert!(["snappy", "uncompressed"].contains(&codec.as_str()), "compose's topics keep {codec}, which relay refuses");
    // Kafka's defaults: 168 hours of retention, segments rolled weekly.
    let hours = |k: &str| get(k).map_or(168, |v| v.parse::<u64>().expect("a number of hours"));
    let in_log =
        std::time::Duration::from_secs(3600 * (hours("KAFKA_LOG_RETENTION_HOURS") + hours("KAFKA_LOG_ROLL_HOURS")));
    let example = std::fs::read_to_string(root().join("relay.example.toml")).unwrap();
    let cfg = relay_core::RelayConfig::from_toml(&example).expect("the example configuration loads");
    let inbox = cfg.retention.inbox.expect("the example keeps its inbox for a while");
    assert!(inbox >= in_log, "the example's inbox window {inbox:?} is shorter than compose's {in_log:?} in the log");
    let made = format!("{:?}", services["topics"]["command"]);
    for topic in cfg.subscribed_topics().iter().chain(cfg.consumer.dead_letter_topic.iter()) {
        assert!(made.contains(topic.as_str()), "compose does not make topic {topic} before relay starts: {made}");
    }
    let waits = format!("{:?}", services["relay"]["depends_on"]);
    assert!(waits.contains("topics"), "relay does not wait for the topics: {waits}");
}
