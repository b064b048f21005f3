//! A real `relay run` process with its admin server, the `relay` command
//! line beside it, and reading its metrics.

use relay_testkit::process::{RelayProcess, free_port};
use serde_json::Value;

use super::{DEADLINE, Harness, eventually};

/// The admin API token the processes are given.
pub const TOKEN: &str = "test-admin-token-7f3a";

/// A running relay's admin server.
pub struct Admin {
    /// Base URL.
    pub url: String,
    /// A client.
    pub http: reqwest::Client,
}

impl Admin {
    /// GET `path`: status and body.
    pub async fn get(&self, path: &str, token: Option<&str>) -> (u16, String) {
        let mut req = self.http.get(format!("{}{path}", self.url));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let res = req.send().await.expect("admin server answers");
        (res.status().as_u16(), res.text().await.unwrap_or_default())
    }

    /// A token-protected API call that must succeed; its JSON.
    pub async fn api(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut req = self.http.request(method, format!("{}{path}", self.url)).bearer_auth(TOKEN);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let res = req.send().await.expect("admin server answers");
        let status = res.status();
        let v: Value = res.json().await.unwrap_or(Value::Null);
        assert!(status.is_success(), "{path}: {status} {v}");
        v
    }
}

/// `relay run` with the admin server on a free port; waits until it answers.
pub async fn run_with_admin(h: &Harness, routes: &str) -> (RelayProcess, Admin) {
    run_with_admin_config(h, &h.config_text(routes)).await.0
}

/// `relay run` on configuration `text` with the admin server added; also
/// returns the configuration file (for CLI commands beside it).
pub async fn run_with_admin_config(h: &Harness, text: &str) -> ((RelayProcess, Admin), std::path::PathBuf) {
    let port = free_port();
    let text = format!("{text}\n[admin]\nlisten = \"127.0.0.1:{port}\"\ngauge_interval = \"200ms\"\n");
    let config = h.write_config(&text);
    let p = h.process(&config, &["run"], &[("RELAY_ADMIN_TOKEN", TOKEN)]);
    let admin = Admin { url: format!("http://127.0.0.1:{port}"), http: reqwest::Client::new() };
    eventually("the admin server to answer", DEADLINE, || async {
        admin
            .http
            .get(format!("{}/healthz", admin.url))
            .send()
            .await
            .ok()
            .filter(|r| r.status().is_success())
            .map(|_| ())
    })
    .await;
    ((p, admin), config)
}

/// `relay ARGS` on `config`, run to its end: whether it succeeded, and what
/// it printed (stdout, then stderr).
pub async fn cli(h: &Harness, config: &std::path::Path, args: &[&str]) -> (bool, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_relay"))
        .arg("--config")
        .arg(config)
        .args(args)
        .env("DATABASE_URL", &h.db.url)
        .env("NO_COLOR", "1")
        .env_remove("RELAY_FAULTS")
        .env_remove("RELAY_SABOTAGE")
        .output();
    let out = tokio::time::timeout(DEADLINE, out).await.expect("the command ends").expect("relay runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// The value of metric `name` with `labels` in a Prometheus text body.
pub fn metric(body: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    body.lines().filter(|l| l.starts_with(name) && !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let ok = series[name.len()..].starts_with(['{', ' ']) || series.len() == name.len();
        (ok && labels.iter().all(|(k, v)| series.contains(&format!("{k}=\"{v}\""))))
            .then(|| value.parse().ok())
            .flatten()
    })
}
