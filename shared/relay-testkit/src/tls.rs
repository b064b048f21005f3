//! Certificates for TLS tests, made with the `openssl` command line (on every
//! Debian machine): a CA, a server certificate for 127.0.0.1 and localhost
//! signed by it (PEM and a PKCS#12 keystore for Kafka), a client certificate
//! for mutual TLS, and a second CA that signed none of them (the "wrong CA").

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// Password of the PKCS#12 keystore (test material only).
pub const KEYSTORE_PASSWORD: &str = "relay-test";

/// A throwaway public key infrastructure in a directory.
#[derive(Debug, Clone)]
pub struct TestPki {
    dir: PathBuf,
}

impl TestPki {
    /// Make every file under `dir` (created if missing).
    pub fn generate(dir: &Path) -> anyhow::Result<TestPki> {
        std::fs::create_dir_all(dir)?;
        let pki = TestPki { dir: dir.to_owned() };
        pki.make_ca("ca", "relay test CA")?;
        pki.make_ca("wrong-ca", "a CA that signed nothing here")?;
        pki.signed("server", "127.0.0.1", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth")?;
        pki.signed("client", "relay-client", "extendedKeyUsage=clientAuth")?;
        pki.openssl(&[
            "pkcs12",
            "-export",
            "-in",
            "server.pem",
            "-inkey",
            "server.key",
            "-certfile",
            "ca.pem",
            "-name",
            "server",
            "-out",
            "server.p12",
            "-passout",
            &format!("pass:{KEYSTORE_PASSWORD}"),
        ])?;
        Ok(pki)
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CA certificate that signed the server and client certificates.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// A CA certificate that signed nothing here.
    pub fn wrong_ca(&self) -> PathBuf {
        self.dir.join("wrong-ca.pem")
    }

    /// Server certificate (PEM), for 127.0.0.1 and localhost.
    pub fn server_cert(&self) -> PathBuf {
        self.dir.join("server.pem")
    }

    /// Server private key (PEM, unencrypted).
    pub fn server_key(&self) -> PathBuf {
        self.dir.join("server.key")
    }

    /// Server key and certificate chain as a PKCS#12 keystore ([`KEYSTORE_PASSWORD`]).
    pub fn server_keystore(&self) -> PathBuf {
        self.dir.join("server.p12")
    }

    /// Client certificate (PEM) for mutual TLS.
    pub fn client_cert(&self) -> PathBuf {
        self.dir.join("client.pem")
    }

    /// Client private key (PEM, unencrypted).
    pub fn client_key(&self) -> PathBuf {
        self.dir.join("client.key")
    }

    fn make_ca(&self, name: &str, cn: &str) -> anyhow::Result<()> {
        self.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={cn}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
        ])
    }

    fn signed(&self, name: &str, cn: &str, extensions: &str) -> anyhow::Result<()> {
        std::fs::write(self.dir.join(format!("{name}.ext")), format!("{extensions}\n"))?;
        self.openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            &format!("/CN={cn}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
        ])?;
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
            "-out",
            &format!("{name}.pem"),
        ])
    }

    fn openssl(&self, args: &[&str]) -> anyhow::Result<()> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(&self.dir)
            .output()
            .context("running `openssl` (apt-get install openssl)")?;
        if !out.status.success() {
            bail!("openssl {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }
}
