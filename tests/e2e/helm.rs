//! The Helm chart (`deploy/helm/relay`), rendered by a real Helm (built from
//! its Go module by `ensure_helm` in `scripts/lib.sh`) with the default
//! values and a production-shaped values file (`tests/helm/production.yaml`),
//! its manifests validated against Kubernetes' own schemas
//! (`kubernetes-validate` from PyPI, which bundles them), and the relay.toml
//! it mounts checked by `relay check-config` with only the variables the
//! Deployment sets. No cluster is needed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use yaml_rust2::{Yaml, YamlLoader};

fn chart() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/helm/relay")
}

fn production() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/helm/production.yaml")
}

/// `helm ARGS`: success, stdout, stderr.
fn helm(args: &[&str]) -> (bool, String, String) {
    let bin = std::env::var("RELAY_TEST_HELM").expect(
        "RELAY_TEST_HELM is not set: run the tests with scripts/test.sh, which builds Helm into .cache (ensure_helm \
         in scripts/lib.sh) and sets it",
    );
    let out = Command::new(bin).args(args).output().expect("run helm");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The manifests `helm template` renders with `values` (helm flags).
fn render(values: &[&str]) -> (String, Vec<Yaml>) {
    let chart = chart();
    let mut args = vec!["template", "payments", chart.to_str().unwrap(), "--namespace", "payments"];
    args.extend(values);
    let (ok, stdout, stderr) = helm(&args);
    assert!(ok, "helm template {values:?} failed: {stderr}");
    let docs = YamlLoader::load_from_str(&stdout).expect("helm renders YAML");
    (stdout, docs.into_iter().filter(|d| !d.is_null()).collect())
}

fn default_values() -> Vec<&'static str> {
    vec!["--set", "database.existingSecret=relay-db"]
}

fn production_values() -> Vec<String> {
    vec!["-f".into(), production().display().to_string()]
}

fn of_kind<'a>(docs: &'a [Yaml], kind: &str) -> Vec<&'a Yaml> {
    docs.iter().filter(|d| d["kind"].as_str() == Some(kind)).collect()
}

fn one<'a>(docs: &'a [Yaml], kind: &str) -> &'a Yaml {
    let found = of_kind(docs, kind);
    assert_eq!(found.len(), 1, "one {kind}");
    found[0]
}

/// The release's ConfigMap (not the migration hook's copy).
fn release_config_map(docs: &[Yaml]) -> &Yaml {
    of_kind(docs, "ConfigMap")
        .into_iter()
        .find(|c| c["metadata"]["annotations"]["helm.sh/hook"].is_badvalue())
        .expect("the release's ConfigMap")
}

fn text(y: &Yaml) -> String {
    match y {
        Yaml::String(s) => s.clone(),
        Yaml::Integer(i) => i.to_string(),
        Yaml::Boolean(b) => b.to_string(),
        other => panic!("not a scalar: {other:?}"),
    }
}

#[test]
fn the_chart_lints_and_renders_manifests_kubernetes_accepts() {
    let chart = chart();
    let prod = production_values();
    let prod: Vec<&str> = prod.iter().map(String::as_str).collect();
    for values in [default_values(), prod.clone()] {
        let mut args = vec!["lint", "--strict", chart.to_str().unwrap()];
        args.extend(&values);
        let (ok, stdout, stderr) = helm(&args);
        assert!(ok, "helm lint {values:?}: {stdout}{stderr}");

        let (manifests, docs) = render(&values);
        let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
        for kind in ["Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "ServiceAccount", "Job"] {
            assert!(kinds.contains(&kind), "{kind} in {kinds:?}");
        }
        let file = std::env::temp_dir().join(format!("{}.yaml", relay_testkit::unique("chart")));
        std::fs::write(&file, &manifests).unwrap();
        let python = std::env::var("RELAY_TEST_PYTHON").expect("RELAY_TEST_PYTHON is not set: run scripts/test.sh");
        // The oldest Kubernetes the chart admits (Chart.yaml kubeVersion) and the newest the schemas know.
        for version in ["1.25.0", "1.37.0"] {
            let out = Command::new(&python)
                .args(["-m", "kubernetes_validate", "--strict", "--no-warn", "-k", version])
                .arg(&file)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "Kubernetes {version} refuses the manifests of {values:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

#[test]
fn the_deployment_probes_health_reads_secrets_from_secrets_and_has_a_disruption_budget() {
    let mut prod = production_values();
    // A pod label cannot take the selector's place; the account's annotations
    // (workload identity) reach the hook's account too.
    prod.extend(["--set".into(), "podLabels.app\\.kubernetes\\.io/instance=other".into()]);
    prod.extend(["--set".into(), "serviceAccount.annotations.iam\\.example\\.com/role=relay".into()]);
    let (_, docs) = render(&prod.iter().map(String::as_str).collect::<Vec<_>>());
    let deployment = one(&docs, "Deployment");
    assert_eq!(deployment["spec"]["replicas"].as_i64(), Some(3));
    // Old pods stop before new ones start: relay's upgrades do not mix versions.
    assert_eq!(deployment["spec"]["strategy"]["type"].as_str(), Some("Recreate"));
    let pod = &deployment["spec"]["template"];
    let container = &pod["spec"]["containers"][0];
    assert_eq!(container["image"].as_str(), Some("registry.example.com/payments/relay:0.1.0"));
    let args: Vec<String> = container["args"].as_vec().unwrap().iter().map(text).collect();
    assert_eq!(args, ["--config", "/etc/relay/relay.toml", "run"]);
    assert_eq!(container["livenessProbe"]["httpGet"]["path"].as_str(), Some("/healthz"));
    assert_eq!(container["readinessProbe"]["httpGet"]["path"].as_str(), Some("/readyz"));
    assert_eq!(container["ports"][0]["containerPort"].as_i64(), Some(9090));
    let annotations = &pod["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"].as_str(), Some("true"));
    assert_eq!(annotations["prometheus.io/port"].as_str(), Some("9090"));
    assert_eq!(annotations["prometheus.io/path"].as_str(), Some("/metrics"));
    assert!(annotations["checksum/config"].as_str().is_some_and(|c| c.len() == 64), "a changed config rolls the pods");
    let security = &container["securityContext"];
    assert_eq!(security["readOnlyRootFilesystem"].as_bool(), Some(true));
    assert_eq!(security["runAsNonRoot"].as_bool(), Some(true));

    // Every secret comes from a Secret, never a literal; the admin API listens on the probed port.
    let env: BTreeMap<String, &Yaml> =
        container["env"].as_vec().unwrap().iter().map(|e| (text(&e["name"]), e)).collect();
    for (name, secret, key) in [
        ("DATABASE_URL", "relay-db", "DATABASE_URL"),
        ("RELAY_ADMIN_TOKEN", "relay-admin", "RELAY_ADMIN_TOKEN"),
        ("KAFKA_SASL_PASSWORD", "relay-kafka", "password"),
        ("PSP_TOKEN", "psp-api", "token"),
        ("REGISTRY_PASSWORD", "schema-registry", "password"),
    ] {
        let from = &env[name]["valueFrom"]["secretKeyRef"];
        assert_eq!((from["name"].as_str(), from["key"].as_str()), (Some(secret), Some(key)), "{name}");
        assert!(env[name]["value"].is_badvalue(), "{name} has no literal value");
    }
    assert_eq!(env["RELAY_ADMIN__LISTEN"]["value"].as_str(), Some("0.0.0.0:9090"));

    // The config comes from the release's ConfigMap; the budget covers the pods.
    let config_map = release_config_map(&docs);
    assert_eq!(pod["spec"]["volumes"][0]["configMap"]["name"], config_map["metadata"]["name"]);
    let pdb = one(&docs, "PodDisruptionBudget");
    assert_eq!(pdb["spec"]["minAvailable"].as_i64(), Some(2));
    assert_eq!(pdb["spec"]["selector"]["matchLabels"], deployment["spec"]["selector"]["matchLabels"]);
    let labels = pod["metadata"]["labels"].as_hash().unwrap();
    for (k, v) in deployment["spec"]["selector"]["matchLabels"].as_hash().unwrap() {
        assert_eq!(labels.get(k), Some(v), "the pods carry the selector's labels");
    }
    let service = one(&docs, "Service");
    assert_eq!(service["spec"]["ports"][0]["targetPort"].as_str(), Some("admin"));

    for account in of_kind(&docs, "ServiceAccount") {
        assert_eq!(account["metadata"]["annotations"]["iam.example.com/role"].as_str(), Some("relay"), "{account:?}");
    }
    // Migrations run before an install or upgrade, with the same database secret.
    let job = one(&docs, "Job");
    assert_eq!(job["metadata"]["annotations"]["helm.sh/hook"].as_str(), Some("pre-install,pre-upgrade"));
    let migrate = &job["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(migrate["args"][2].as_str(), Some("migrate"));
    assert!(migrate["env"].as_vec().unwrap().iter().any(|e| e["name"].as_str() == Some("DATABASE_URL")));
}

#[test]
fn the_mounted_relay_toml_passes_check_config_with_only_the_variables_the_deployment_sets() {
    let prod = production_values();
    for values in [default_values(), prod.iter().map(String::as_str).collect()] {
        let (_, docs) = render(&values);
        let config = release_config_map(&docs);
        let toml = config["data"]["relay.toml"].as_str().expect("relay.toml in the ConfigMap");
        let file = std::env::temp_dir().join(format!("{}.toml", relay_testkit::unique("chart-config")));
        std::fs::write(&file, toml).unwrap();
        // The Deployment's variables, a stand-in for each secret one.
        let container = &one(&docs, "Deployment")["spec"]["template"]["spec"]["containers"][0];
        let env: Vec<(String, String)> = container["env"]
            .as_vec()
            .unwrap()
            .iter()
            .map(|e| (text(&e["name"]), e["value"].as_str().map_or_else(|| "s".repeat(32), str::to_owned)))
            .collect();
        let check = |without: Option<&str>| {
            let mut c = Command::new(env!("CARGO_BIN_EXE_relay"));
            c.env_clear().env("PATH", std::env::var("PATH").unwrap_or_default());
            c.envs(env.iter().filter(|(n, _)| Some(n.as_str()) != without).map(|(n, v)| (n, v)));
            c.arg("--config").arg(&file).arg("check-config").output().unwrap()
        };
        let out = check(None);
        assert!(
            out.status.success(),
            "relay check-config refuses the chart's relay.toml ({values:?}): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if values.contains(&"-f") {
            // The check would see a variable the Deployment did not set.
            let out = check(Some("PSP_TOKEN"));
            assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("PSP_TOKEN"));
        }
    }
}

#[test]
fn values_that_cannot_work_are_refused_naming_what_to_set() {
    let chart = chart();
    let chart = chart.to_str().unwrap();
    let (ok, _, stderr) = helm(&["template", "r", chart]);
    assert!(!ok && stderr.contains("database.existingSecret: name the Secret holding DATABASE_URL"), "{stderr}");
    for (set, says) in [("role=consumer", "role"), ("surprise=1", "surprise"), ("admin.port=0", "port")] {
        let (ok, _, stderr) = helm(&["template", "r", chart, "--set", "database.existingSecret=db", "--set", set]);
        assert!(!ok && stderr.contains(says), "{set}: {stderr}");
    }
}

/// What a pre-install hook uses must exist before the release's own
/// resources do (Helm creates those after its pre-install hooks): every
/// ServiceAccount and ConfigMap the migrate Job names is a hook of a lower
/// weight, or not the release's at all.
#[test]
fn the_migration_hook_uses_only_what_exists_before_the_release() {
    let prod = production_values();
    for values in [default_values(), prod.iter().map(String::as_str).collect()] {
        let (_, docs) = render(&values);
        let weight =
            |d: &Yaml| d["metadata"]["annotations"]["helm.sh/hook-weight"].as_str().map(|w| w.parse::<i64>().unwrap());
        let job = one(&docs, "Job");
        let job_weight = weight(job).expect("the Job is a weighted hook");
        let spec = &job["spec"]["template"]["spec"];
        let mut used = vec![("ServiceAccount", text(&spec["serviceAccountName"]))];
        for v in spec["volumes"].as_vec().unwrap() {
            if let Some(name) = v["configMap"]["name"].as_str() {
                used.push(("ConfigMap", name.to_owned()));
            }
        }
        for (kind, name) in used {
            let Some(found) = of_kind(&docs, kind).into_iter().find(|d| d["metadata"]["name"].as_str() == Some(&*name))
            else {
                continue; // Not the release's: the user's, or the namespace's default.
            };
            let hook = found["metadata"]["annotations"]["helm.sh/hook"].as_str().unwrap_or_default();
            assert!(hook.contains("pre-install"), "{kind} {name} is created after the pre-install Job that uses it");
            assert!(weight(found).is_some_and(|w| w < job_weight), "{kind} {name} comes before the Job");
        }
    }
}
