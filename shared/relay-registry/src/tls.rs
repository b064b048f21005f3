//! The TLS of an HTTP client from a `tls` table; the endpoints' clients
//! use it too.

/// `b` with the TLS of `tls` (a private CA trusted alone, a client
/// certificate), its files read now; errors name the key under `at` (e.g.
/// `endpoints.psp.tls`) and the file. Shared by every HTTP client relay
/// makes: the endpoints' and the registry's.
pub fn with_tls(
    mut b: reqwest::ClientBuilder,
    at: &str,
    tls: &relay_core::config::EndpointTls,
) -> anyhow::Result<reqwest::ClientBuilder> {
    let read = |key: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| anyhow::anyhow!("{at}.{key}: cannot read {}: {e}", path.display()))
    };
    if let Some(path) = &tls.ca_file {
        let certs = reqwest::Certificate::from_pem_bundle(&read("ca_file", path)?)
            .map_err(|e| anyhow::anyhow!("{at}.ca_file: {} is not a PEM certificate bundle: {e}", path.display()))?;
        anyhow::ensure!(
            !certs.is_empty(),
            "{at}.ca_file: {} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
            path.display()
        );
        // Only these CAs: a server on a private PKI is not impersonated by any public one.
        b = b.tls_built_in_root_certs(false);
        for c in certs {
            b = b.add_root_certificate(c);
        }
    }
    if let (Some(cert), Some(key)) = (&tls.client_cert_file, &tls.client_key_file) {
        let mut pem = read("client_cert_file", cert)?;
        pem.push(b'\n');
        pem.extend(read("client_key_file", key)?);
        let identity = reqwest::Identity::from_pem(&pem).map_err(|e| {
            anyhow::anyhow!(
                "{at}: {} and {} are not a PEM certificate and its private key: {e}",
                cert.display(),
                key.display()
            )
        })?;
        b = b.identity(identity);
    }
    Ok(b)
}
