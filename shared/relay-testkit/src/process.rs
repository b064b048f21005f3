//! Real processes for crash tests and the soak: relay processes that can be
//! killed with SIGKILL and restarted, and private PostgreSQL and Kafka
//! servers that a test may restart without disturbing the shared ones.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// Where the soak and the benchmarks find the services and the relay binary.
#[derive(Debug, Clone, clap::Args)]
pub struct Services {
    /// The relay binary (default: next to this program).
    #[arg(long)]
    pub relay_bin: Option<PathBuf>,
    /// PostgreSQL URL of a role that may create databases.
    #[arg(long, env = "RELAY_TEST_DATABASE_URL")]
    pub database_url: String,
    /// Kafka bootstrap servers.
    #[arg(long, env = "RELAY_TEST_KAFKA_BOOTSTRAP")]
    pub bootstrap: String,
}

impl Services {
    /// The relay binary: `--relay-bin`, else `relay` beside the running program.
    pub fn relay_bin(&self) -> PathBuf {
        self.relay_bin.clone().unwrap_or_else(|| {
            std::env::current_exe()
                .ok()
                .and_then(|p| p.parent().map(|d| d.join("relay")))
                .unwrap_or_else(|| "relay".into())
        })
    }
}

/// Send `signal` (e.g. "KILL", "TERM") to `pid`.
pub fn signal(pid: u32, signal: &str) -> anyhow::Result<()> {
    let status = Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status()?;
    if !status.success() {
        bail!("kill -{signal} {pid} failed");
    }
    Ok(())
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

/// How to start a relay process.
#[derive(Debug, Clone)]
pub struct RelaySpec {
    /// The `relay` binary.
    pub bin: PathBuf,
    /// Configuration file.
    pub config: PathBuf,
    /// Subcommand and its arguments, e.g. `["dispatch", "--intents-only"]`.
    pub args: Vec<String>,
    /// Extra environment (DATABASE_URL, RELAY_FAULTS, RUST_LOG, …).
    pub env: Vec<(String, String)>,
    /// Where stderr goes (appended across restarts).
    pub log: PathBuf,
}

/// A running (or stopped) relay process.
pub struct RelayProcess {
    spec: RelaySpec,
    child: Option<Child>,
    /// How many times it was started.
    pub starts: u32,
}

impl RelayProcess {
    /// Start it.
    pub fn start(spec: RelaySpec) -> anyhow::Result<RelayProcess> {
        let mut p = RelayProcess { spec, child: None, starts: 0 };
        p.restart()?;
        Ok(p)
    }

    /// Start it again (after it exited or was killed).
    pub fn restart(&mut self) -> anyhow::Result<()> {
        if self.is_running() {
            bail!("{:?} is still running", self.spec.args);
        }
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.spec.log)?;
        let mut cmd = Command::new(&self.spec.bin);
        cmd.arg("--config").arg(&self.spec.config).args(&self.spec.args);
        cmd.env("NO_COLOR", "1").env_remove("RELAY_FAULTS").env_remove("RELAY_SABOTAGE");
        for (k, v) in &self.spec.env {
            cmd.env(k, v);
        }
        let child =
            cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::from(log)).spawn().with_context(|| {
                format!("start {} (build it with `cargo build -p relay-cli`)", self.spec.bin.display())
            })?;
        self.child = Some(child);
        self.starts += 1;
        Ok(())
    }

    /// Process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The most memory it has held resident so far (Linux's `VmHWM`), while
    /// running.
    pub fn peak_resident_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()?)).ok()?;
        let line = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?;
        let kib: u64 = line.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kib * 1024)
    }

    /// Whether it is running.
    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// SIGKILL: no cleanup, no commit, like a crash or an OOM kill.
    pub fn kill9(&mut self) -> anyhow::Result<()> {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            c.wait()?;
        }
        Ok(())
    }

    /// SIGTERM, then wait up to `timeout` for a clean exit.
    pub fn terminate(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let Some(pid) = self.pid() else { bail!("not running") };
        signal(pid, "TERM")?;
        self.wait(timeout)
    }

    /// Wait up to `timeout` for it to exit by itself.
    pub fn wait(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let Some(c) = self.child.as_mut() else { bail!("not running") };
        let end = Instant::now() + timeout;
        loop {
            if let Some(status) = c.try_wait()? {
                self.child = None;
                return Ok(status);
            }
            if Instant::now() > end {
                bail!("{:?} did not exit within {timeout:?} (log: {})", self.spec.args, self.spec.log.display());
            }
            #[allow(
                clippy::disallowed_methods,
                reason = "a test helper polling a child process with a deadline, synchronously"
            )]
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What it runs.
    pub fn spec(&self) -> &RelaySpec {
        &self.spec
    }

    /// The log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.spec.log).unwrap_or_default()
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.kill9();
    }
}

fn run_as_postgres(cmd: &str) -> anyhow::Result<()> {
    let out = Command::new("su").args(["postgres", "-c", cmd]).output()?;
    if !out.status.success() {
        bail!("`{cmd}` failed: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

fn pg_bin() -> anyhow::Result<PathBuf> {
    let base = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<PathBuf> = std::fs::read_dir(base)
        .context("PostgreSQL server binaries not found under /usr/lib/postgresql")?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("pg_ctl").exists())
        .collect();
    versions.sort();
    versions.pop().context("no pg_ctl under /usr/lib/postgresql/*/bin")
}

/// A PostgreSQL server of a test's own (initdb in a temp dir, its own port),
/// so the test may restart or crash it. Trust authentication on 127.0.0.1.
pub struct PrivatePostgres {
    dir: PathBuf,
    port: u16,
    bin: PathBuf,
    /// With [`PrivatePostgres::start_tls`]: it serves TLS with this certificate and key.
    tls: bool,
}

impl PrivatePostgres {
    /// initdb and start.
    pub fn start() -> anyhow::Result<PrivatePostgres> {
        Self::start_with(None)
    }

    /// initdb and start with `ssl = on`, serving `pki`'s server certificate
    /// (for 127.0.0.1): clients may then ask for `sslmode=verify-full`.
    pub fn start_tls(pki: &crate::tls::TestPki) -> anyhow::Result<PrivatePostgres> {
        Self::start_with(Some(pki))
    }

    fn start_with(pki: Option<&crate::tls::TestPki>) -> anyhow::Result<PrivatePostgres> {
        let bin = pg_bin()?;
        let dir = std::env::temp_dir().join(format!("relay-pg-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir)?;
        Command::new("chown").args(["postgres:postgres", dir.to_str().unwrap_or_default()]).status()?;
        let data = dir.join("data");
        run_as_postgres(&format!(
            "{} -D {} -U postgres --auth=trust --no-sync -E UTF8 >/dev/null",
            bin.join("initdb").display(),
            data.display()
        ))?;
        if let Some(pki) = pki {
            // The server reads its key only if the key is its own and private.
            std::fs::copy(pki.server_cert(), dir.join("server.pem"))?;
            std::fs::copy(pki.server_key(), dir.join("server.key"))?;
            let key = dir.join("server.key");
            Command::new("chmod").arg("600").arg(&key).status()?;
            Command::new("chown").args(["postgres:postgres"]).arg(&key).arg(dir.join("server.pem")).status()?;
        }
        let pg = PrivatePostgres { dir, port: free_port(), bin, tls: pki.is_some() };
        pg.pg_ctl("start")?;
        Ok(pg)
    }

    fn pg_ctl(&self, action: &str) -> anyhow::Result<()> {
        let mut opts = format!("-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off", self.port, self.dir.display());
        if self.tls {
            opts += &format!(
                " -c ssl=on -c ssl_cert_file={} -c ssl_key_file={}",
                self.dir.join("server.pem").display(),
                self.dir.join("server.key").display()
            );
        }
        run_as_postgres(&format!(
            "{} -D {} -l {} -w -t 60 -o '{opts}' {action} >/dev/null",
            self.bin.join("pg_ctl").display(),
            self.dir.join("data").display(),
            self.dir.join("server.log").display()
        ))
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Crash it (immediate shutdown: no checkpoint, clients cut off).
    pub fn stop_immediately(&self) -> anyhow::Result<()> {
        run_as_postgres(&format!(
            "{} -D {} -m immediate -w stop >/dev/null",
            self.bin.join("pg_ctl").display(),
            self.dir.join("data").display()
        ))
    }

    /// Start it again (crash recovery runs).
    pub fn start_again(&self) -> anyhow::Result<()> {
        self.pg_ctl("start")
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = self.stop_immediately();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// An Apache Kafka broker of a test's own (single KRaft node), so the test
/// may kill -9 and restart it. Needs `RELAY_TEST_KAFKA_LIBS` (the jars dir,
/// exported by scripts/test.sh).
pub struct PrivateKafka {
    dir: PathBuf,
    port: u16,
    /// With [`PrivateKafka::start_secure`]: the `SSL` (mutual TLS) and `SASL_SSL` ports.
    secure: Option<(u16, u16)>,
    libs: PathBuf,
    child: Option<Child>,
}

/// The SASL user of [`PrivateKafka::start_secure`] (SCRAM-SHA-256, SCRAM-SHA-512 and PLAIN).
pub const SASL_USER: &str = "relay";
/// Its password.
pub const SASL_PASSWORD: &str = "relay-secret";

impl PrivateKafka {
    /// Format storage and start, with a PLAINTEXT listener.
    pub fn start() -> anyhow::Result<PrivateKafka> {
        Self::start_with(None)
    }

    /// Format storage and start with three listeners: PLAINTEXT, `SSL` with
    /// client certificates required (mutual TLS), and `SASL_SSL` taking
    /// SCRAM-SHA-256, SCRAM-SHA-512 and PLAIN for [`SASL_USER`]; the broker's
    /// certificate is `pki`'s server certificate.
    pub fn start_secure(pki: &crate::tls::TestPki) -> anyhow::Result<PrivateKafka> {
        Self::start_with(Some(pki))
    }

    fn start_with(pki: Option<&crate::tls::TestPki>) -> anyhow::Result<PrivateKafka> {
        let libs = PathBuf::from(
            std::env::var("RELAY_TEST_KAFKA_LIBS").context("RELAY_TEST_KAFKA_LIBS is not set: run scripts/test.sh")?,
        );
        let dir = std::env::temp_dir().join(format!("relay-kafka-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir)?;
        let (port, ctl) = (free_port(), free_port());
        let secure = pki.map(|_| (free_port(), free_port()));
        let mut listeners = format!("PLAINTEXT://127.0.0.1:{port}");
        let mut protocols = "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT".to_owned();
        let mut tls = String::new();
        if let (Some(pki), Some((ssl, sasl_ssl))) = (pki, secure) {
            listeners += &format!(",SSL://127.0.0.1:{ssl},SASL_SSL://127.0.0.1:{sasl_ssl}");
            protocols += ",SSL:SSL,SASL_SSL:SASL_SSL";
            let scram = |m: &str| {
                format!(
                    "listener.name.sasl_ssl.{m}.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;\n"
                )
            };
            tls = format!(
                "ssl.keystore.type=PKCS12\nssl.keystore.location={}\nssl.keystore.password={pw}\nssl.key.password={pw}\n\
                 ssl.truststore.type=PEM\nssl.truststore.location={}\n\
                 listener.name.ssl.ssl.client.auth=required\n\
                 listener.name.sasl_ssl.sasl.enabled.mechanisms=SCRAM-SHA-256,SCRAM-SHA-512,PLAIN\n\
                 {}{}\
                 listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule \
                 required user_{SASL_USER}=\"{SASL_PASSWORD}\";\n",
                pki.server_keystore().display(),
                pki.ca().display(),
                scram("scram-sha-256"),
                scram("scram-sha-512"),
                pw = crate::tls::KEYSTORE_PASSWORD,
            );
        }
        std::fs::write(
            dir.join("server.properties"),
            format!(
                "process.roles=broker,controller\nnode.id=1\ncontroller.quorum.bootstrap.servers=127.0.0.1:{ctl}\n\
                 listeners={listeners},CONTROLLER://127.0.0.1:{ctl}\n\
                 advertised.listeners={listeners}\ncontroller.listener.names=CONTROLLER\n\
                 listener.security.protocol.map={protocols}\n\
                 inter.broker.listener.name=PLAINTEXT\nlog.dirs={}\nnum.partitions=1\n\
                 offsets.topic.replication.factor=1\noffsets.topic.num.partitions=2\n\
                 transaction.state.log.replication.factor=1\ntransaction.state.log.min.isr=1\n\
                 group.initial.rebalance.delay.ms=0\ncompression.type=snappy\n{tls}",
                dir.join("data").display()
            ),
        )?;
        let cluster_id = base64_uuid();
        let mut format = Command::new("java");
        format
            .arg("-cp")
            .arg(format!("{}/*", libs.display()))
            .args(["kafka.tools.StorageTool", "format", "--standalone", "-t", &cluster_id, "-c"])
            .arg(dir.join("server.properties"));
        if pki.is_some() {
            for mechanism in ["SCRAM-SHA-256", "SCRAM-SHA-512"] {
                format.arg("--add-scram").arg(format!("{mechanism}=[name={SASL_USER},password={SASL_PASSWORD}]"));
            }
        }
        let out = format.output()?;
        if !out.status.success() {
            bail!(
                "kafka storage format failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let mut k = PrivateKafka { dir, port, secure, libs, child: None };
        k.start_again()?;
        Ok(k)
    }

    /// Bootstrap address (PLAINTEXT).
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Bootstrap address of the `SSL` listener (mutual TLS), if started secure.
    pub fn ssl_bootstrap(&self) -> Option<String> {
        self.secure.map(|(ssl, _)| format!("127.0.0.1:{ssl}"))
    }

    /// Bootstrap address of the `SASL_SSL` listener, if started secure.
    pub fn sasl_ssl_bootstrap(&self) -> Option<String> {
        self.secure.map(|(_, sasl_ssl)| format!("127.0.0.1:{sasl_ssl}"))
    }

    /// Start (again) on the same data and port; waits until it serves.
    pub fn start_again(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("broker.log"))?;
        let child = Command::new("java")
            .args(["-Xms128m", "-Xmx512m", "-cp"])
            .arg(format!("{}/*", self.libs.display()))
            .arg("kafka.Kafka")
            .arg(self.dir.join("server.properties"))
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .spawn()?;
        self.child = Some(child);
        let end = Instant::now() + Duration::from_secs(90);
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                // The listener is up; metadata requests may still fail for a moment.
                return Ok(());
            }
            // The directory goes with the test: say in the failure what the broker said.
            let exited = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() > end {
                let log = std::fs::read_to_string(self.dir.join("broker.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect::<Vec<_>>().into_iter().rev().collect();
                let how = exited.map_or_else(|| "within 90 s".to_owned(), |s| format!("(it exited: {s})"));
                bail!("private Kafka did not start {how}; the end of its log:\n{}", tail.join("\n"));
            }
            #[allow(
                clippy::disallowed_methods,
                reason = "a test helper polling a child process with a deadline, synchronously"
            )]
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stop the broker cleanly (SIGTERM, then wait): its log is flushed and
    /// needs no recovery at the next start.
    pub fn terminate(&mut self) -> anyhow::Result<()> {
        if let Some(mut c) = self.child.take() {
            signal(c.id(), "TERM")?;
            c.wait()?;
        }
        Ok(())
    }

    /// The broker's data directory (its log segments live under `topic-partition/`).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// SIGKILL the broker.
    pub fn kill9(&mut self) -> anyhow::Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }
}

impl Drop for PrivateKafka {
    fn drop(&mut self) {
        let _ = self.kill9();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn base64_uuid() -> String {
    // Kafka cluster ids are 16 random bytes in URL-safe base64 without padding,
    // never starting with '-' (the storage tool would read "-t -xyz…" as a
    // missing argument: 1 start in 64 failed). Kafka's own Uuid.randomUuid()
    // draws again in that case too.
    use base64::Engine;
    loop {
        let id = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(uuid::Uuid::new_v4().into_bytes());
        if !id.starts_with('-') {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cluster_ids_never_start_with_a_dash() {
        // One in 64 draws starts with '-'; 4 000 draws miss that with odds of 1e-27.
        for _ in 0..4_000 {
            let id = super::base64_uuid();
            assert_eq!(id.len(), 22, "{id}");
            assert!(!id.starts_with('-'), "{id}");
        }
    }
}
