//! A stand-in for a third-party HTTP API (a payment service provider, a
//! notification gateway) that behaves the way the good ones do:
//!
//! * every request must carry an idempotency key (header `Idempotency-Key`);
//! * the first request with a key applies the effect once and stores the
//!   response; later requests with the key get the stored response back
//!   (`Idempotent-Replayed: true`) and apply nothing;
//! * a request whose key is still being processed gets `409 Conflict`;
//! * as a [`Dialect`] says: a key reused with another body gets the answer
//!   the IETF draft (`422`) or Stripe (`400`, `idempotency_error`) gives, or
//!   the provider has no keys at all and applies every request.
//!
//! It counts every request and every applied effect per key, so tests check
//! "exactly one effect" at the provider instead of inferring it from the
//! relay's own tables, and it can be told to misbehave (status codes,
//! `Retry-After`, timeouts before or after applying) through `/_control/faults`.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// How a faulty request behaves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum FaultKind {
    /// Answer with `status` (and `Retry-After`, if set) without applying.
    Status {
        /// HTTP status.
        status: u16,
        /// `Retry-After` seconds.
        #[serde(default)]
        retry_after_secs: Option<u64>,
    },
    /// Apply the effect, then answer only after `delay_ms` (the client times out).
    TimeoutAfterApply {
        /// Delay before answering.
        delay_ms: u64,
    },
    /// Apply the effect and keep the request in progress for `delay_ms`
    /// even after the client hangs up (a provider still processing after
    /// the caller's timeout: retries meet "in progress"), then answer.
    StillRunningAfterApply {
        /// How long the request stays in progress.
        delay_ms: u64,
    },
    /// Wait `delay_ms`, then answer 503 without applying.
    TimeoutBeforeApply {
        /// Delay before answering.
        delay_ms: u64,
    },
    /// Answer with an HTML page instead of JSON: applied when `status` is
    /// 2xx, not applied otherwise (a misconfigured gateway, a maintenance page).
    Html {
        /// HTTP status.
        status: u16,
    },
    /// Answer `status` (a 3xx) with `Location: location`, without applying:
    /// a misrouted base URL, or a gateway sending a login page.
    Redirect {
        /// HTTP status.
        status: u16,
        /// Where to.
        location: String,
    },
    /// Apply the effect, then fail answering `status` (a 5xx): the failure
    /// is the stored answer, replayed to every retry with the key, as Stripe
    /// documents for a 500 ("treat the result as indeterminate").
    AppliedThenFail {
        /// HTTP status.
        status: u16,
    },
    /// Apply the effect, then answer only once the test calls
    /// [`Provider::release_held`]: stalled requests that all answer at once.
    HoldUntilReleased,
    /// Answer `status` with a body that never ends, without applying: a
    /// client must read a bounded start of an error page, not wait for its end.
    EndlessBody {
        /// HTTP status.
        status: u16,
    },
    /// Answer `status` and the start of a JSON body at once, the rest after
    /// `delay_ms`, without applying: an answer cut off by the client's timeout.
    StalledBody {
        /// HTTP status.
        status: u16,
        /// How long the rest of the body takes.
        delay_ms: u64,
    },
    /// Answer `status` with `body` as it is (`text/plain`), without applying:
    /// error texts a client must store safely (control bytes, NUL).
    Body {
        /// HTTP status.
        status: u16,
        /// The body, byte for byte.
        body: String,
    },
    /// Misbehave at random (deterministically per key and request number):
    /// out of every 1000 requests, about `per_mille_503` get 503, `per_mille_429`
    /// get 429 with `Retry-After: 1`, `per_mille_timeout` are applied and then
    /// answered only after `timeout_ms`.
    Chaos {
        /// 503s per 1000 requests.
        per_mille_503: u16,
        /// 429s per 1000 requests.
        per_mille_429: u16,
        /// Timeouts after applying per 1000 requests.
        per_mille_timeout: u16,
        /// How late a timed-out request is answered.
        timeout_ms: u64,
    },
}

/// A number in 0..1000 fixed by (key, request number).
fn dice(key: &str, nth: u32) -> u16 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (key, nth).hash(&mut h);
    (h.finish() % 1000) as u16
}

/// A fault rule: which requests misbehave, how, and how often.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultRule {
    /// Only paths starting with this.
    #[serde(default)]
    pub path_prefix: Option<String>,
    /// Only idempotency keys starting with this.
    #[serde(default)]
    pub key_prefix: Option<String>,
    /// The first `times` requests of each key misbehave; `None` = all of them.
    #[serde(default)]
    pub times: Option<u32>,
    /// How.
    #[serde(flatten)]
    pub kind: FaultKind,
}

/// Counts for one idempotency key.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyStats {
    /// Requests received with the key.
    pub requests: u32,
    /// Effects applied for the key (must never exceed 1).
    pub applied: u32,
    /// Requests that arrived while another with the key was in progress.
    pub concurrent: u32,
}

/// What the provider has seen.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Requests in total.
    pub requests: u64,
    /// Effects applied in total.
    pub applied: u64,
    /// Requests answered from the stored response.
    pub replayed: u64,
    /// Requests refused for want of an idempotency key.
    pub missing_key: u64,
    /// Most requests being applied at the same moment.
    pub max_in_flight: u32,
    /// Tokens handed out by `/oauth/token`.
    pub token_fetches: u64,
    /// Calls refused 401 for want of a valid token.
    pub unauthorized: u64,
    /// Calls refused for a signature that does not verify.
    pub bad_signatures: u64,
    /// Calls refused 429 over the rate limit.
    pub throttled: u64,
    /// Per key.
    pub by_key: BTreeMap<String, KeyStats>,
}

impl Stats {
    /// Keys whose effect was applied more than once (must be empty).
    pub fn double_applied(&self) -> Vec<String> {
        self.by_key.iter().filter(|(_, s)| s.applied > 1).map(|(k, _)| k.clone()).collect()
    }

    /// Effects applied for `key`.
    pub fn applied_for(&self, key: &str) -> u32 {
        self.by_key.get(key).map_or(0, |s| s.applied)
    }

    /// Requests received for `key`.
    pub fn requests_for(&self, key: &str) -> u32 {
        self.by_key.get(key).map_or(0, |s| s.requests)
    }
}

#[derive(Default)]
struct Inner {
    stats: Stats,
    stored: HashMap<String, (u16, serde_json::Value)>,
    /// The body first sent with each key (for a [`Dialect`] that compares them).
    bodies: HashMap<String, Bytes>,
    in_progress: HashMap<String, u32>,
    in_flight: u32,
    rules: Vec<FaultRule>,
    /// Applied effects in order: (key, method, path, body).
    log: Vec<Applied>,
    /// Tokens it handed out, and when each expires.
    tokens: HashMap<String, std::time::Instant>,
    /// When each call arrived (for the rate limit and the tests).
    arrivals: Vec<std::time::Instant>,
    /// When each call under the rate limit was taken, the last second's.
    taken: std::collections::VecDeque<std::time::Instant>,
}

/// One applied effect.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Applied {
    /// Idempotency key.
    pub key: String,
    /// Method.
    pub method: String,
    /// Path.
    pub path: String,
    /// Body (JSON, or null).
    pub body: serde_json::Value,
    /// The relay's `X-Relay-Intent-Id` header, if sent: lets a checker tie
    /// effects to intents even when keys differ.
    #[serde(default)]
    pub intent_id: Option<String>,
    /// The W3C `traceparent` the request carried.
    #[serde(default)]
    pub traceparent: Option<String>,
}

/// Provider settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Header carrying the idempotency key.
    pub idempotency_header: String,
    /// How it answers about keys.
    pub dialect: Dialect,
    /// Calls need a bearer token from its OAuth2 token endpoint
    /// (`POST /oauth/token`, client credentials); others get 401.
    pub oauth: Option<OAuthSettings>,
    /// Calls must carry a Standard Webhooks signature made with this secret
    /// (`whsec_…`); others get 400.
    pub webhook_secret: Option<String>,
    /// Calls must carry an AWS SigV4 signature made with these credentials;
    /// others get 403, as AWS answers.
    pub aws_sigv4: Option<SigV4Settings>,
    /// At most this many calls are taken in any second; the others get 429
    /// (with `Retry-After: 1`) and are not applied.
    pub rate_limit: Option<u32>,
}

/// What an AWS SigV4 signature must be made with.
#[derive(Debug, Clone)]
pub struct SigV4Settings {
    /// The access key id.
    pub access_key_id: String,
    /// The secret access key.
    pub secret_access_key: String,
    /// The region.
    pub region: String,
    /// The service's signing name.
    pub service: String,
}

/// The provider's OAuth2 token endpoint.
#[derive(Debug, Clone)]
pub struct OAuthSettings {
    /// The one client it knows.
    pub client_id: String,
    /// Its secret.
    pub client_secret: String,
    /// How long a token lives (`expires_in`).
    pub token_lifetime: std::time::Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            idempotency_header: "Idempotency-Key".into(),
            dialect: Dialect::Lenient,
            oauth: None,
            webhook_secret: None,
            aws_sigv4: None,
            rate_limit: None,
        }
    }
}

/// How a provider answers about idempotency keys, as the named ones do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Dialect {
    /// 409 while in progress; a reused key gets the stored answer whatever
    /// the body.
    #[default]
    Lenient,
    /// The IETF `Idempotency-Key` draft: 409 while in progress, 422 for a
    /// key reused with another body.
    Ietf,
    /// Stripe: 409 with `error.type = "idempotency_error"` while in
    /// progress, 400 with the same type (after a long message) for a key
    /// reused with other parameters.
    Stripe,
    /// No keys (an e-mail or SMS API): every request is applied; counted
    /// per `X-Relay-Intent-Id` so double effects show.
    Keyless,
}

impl Dialect {
    fn compares_bodies(self) -> bool {
        matches!(self, Dialect::Ietf | Dialect::Stripe)
    }
}

/// Stripe's answer to a key reused with other parameters; its `type` comes
/// after a message of more than 256 bytes, as in Stripe's own bodies.
fn stripe_error(status: StatusCode, message: &str) -> Response {
    let message = format!(
        "{message} Keys for idempotent requests can only be used with the same parameters they were first used \
         with. Try using a key other than the one you sent if you meant to execute a different request; see \
         https://docs.stripe.com/api/idempotent_requests for how keys are compared and how long they are kept."
    );
    let body = json!({"error": {"message": message, "request_log_url": "https://dashboard.example/logs/req_1", "type": "idempotency_error"}});
    (status, axum::Json(body)).into_response()
}

#[derive(Clone)]
struct AppState {
    inner: Arc<Mutex<Inner>>,
    settings: Arc<Settings>,
    /// `true` once held requests ([`FaultKind::HoldUntilReleased`]) may answer.
    released: tokio::sync::watch::Sender<bool>,
}

impl AppState {
    /// A fresh state, its routes, and a listener bound to `bind`.
    async fn bound(
        bind: SocketAddr,
        settings: Settings,
    ) -> anyhow::Result<(AppState, Router, tokio::net::TcpListener, SocketAddr)> {
        let state = AppState {
            inner: Arc::default(),
            settings: Arc::new(settings),
            released: tokio::sync::watch::channel(false).0,
        };
        let app = router(state.clone());
        let listener = tokio::net::TcpListener::bind(bind).await?;
        let addr = listener.local_addr()?;
        Ok((state, app, listener, addr))
    }
}

/// A running provider.
#[derive(Clone)]
pub struct Provider {
    state: AppState,
    addr: SocketAddr,
    /// `https` when started with [`Provider::start_tls`].
    scheme: &'static str,
}

/// The PEM files of [`Provider::start_tls`].
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Server certificate (and chain).
    pub cert: std::path::PathBuf,
    /// Its private key.
    pub key: std::path::PathBuf,
    /// With a CA here, clients must present a certificate it signed (mutual TLS).
    pub client_ca: Option<std::path::PathBuf>,
}

impl TlsFiles {
    fn server_config(&self) -> anyhow::Result<tokio_rustls::rustls::ServerConfig> {
        use tokio_rustls::rustls::pki_types::pem::PemObject;
        use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
        use tokio_rustls::rustls::{RootCertStore, ServerConfig, server::WebPkiClientVerifier};
        let certs = CertificateDer::pem_file_iter(&self.cert)?.collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_file(&self.key)?;
        let builder = ServerConfig::builder();
        Ok(match &self.client_ca {
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for c in CertificateDer::pem_file_iter(ca)? {
                    roots.add(c?)?;
                }
                let verifier = WebPkiClientVerifier::builder(Arc::new(roots)).build()?;
                builder.with_client_cert_verifier(verifier).with_single_cert(certs, key)?
            }
            None => builder.with_no_client_auth().with_single_cert(certs, key)?,
        })
    }
}

impl Provider {
    /// Start on `bind` (use port 0 for a free port) in the current runtime.
    pub async fn start(bind: SocketAddr, settings: Settings) -> anyhow::Result<Provider> {
        let (state, app, listener, addr) = AppState::bound(bind, settings).await?;
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "provider server stopped");
            }
        });
        Ok(Provider { state, addr, scheme: "http" })
    }

    /// Start on `bind` serving HTTPS (HTTP/1.1) with `tls`: a handshake the
    /// provider refuses (no client certificate, one of another CA) never
    /// reaches a route, so it counts no request.
    pub async fn start_tls(bind: SocketAddr, settings: Settings, tls: &TlsFiles) -> anyhow::Result<Provider> {
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls.server_config()?));
        let (state, app, listener, addr) = AppState::bound(bind, settings).await?;
        tokio::spawn(async move {
            loop {
                let tcp = match listener.accept().await {
                    Ok((tcp, _)) => tcp,
                    Err(e) => {
                        tracing::warn!(error = %e, "provider accept failed");
                        continue;
                    }
                };
                let (acceptor, app) = (acceptor.clone(), app.clone());
                tokio::spawn(async move {
                    let tls = match acceptor.accept(tcp).await {
                        Ok(tls) => tls,
                        Err(e) => return tracing::info!(error = %e, "provider refused a TLS handshake"),
                    };
                    let svc = hyper_util::service::TowerToHyperService::new(app);
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), svc);
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "provider connection ended");
                    }
                });
            }
        });
        Ok(Provider { state, addr, scheme: "https" })
    }

    /// Base URL, e.g. `http://127.0.0.1:41234` (`https://` with TLS).
    pub fn url(&self) -> String {
        format!("{}://{}", self.scheme, self.addr)
    }

    /// A snapshot of the counts.
    pub fn stats(&self) -> Stats {
        self.state.inner.lock().expect("provider lock").stats.clone()
    }

    /// Applied effects, in order.
    pub fn applied(&self) -> Vec<Applied> {
        self.state.inner.lock().expect("provider lock").log.clone()
    }

    /// Let every request held by [`FaultKind::HoldUntilReleased`] answer,
    /// all at once (and later ones answer at once too).
    pub fn release_held(&self) {
        self.state.released.send_replace(true);
    }

    /// The most calls that arrived within any one second, counting only
    /// calls that arrived at or after `from`.
    pub fn peak_per_second(&self, from: std::time::Instant) -> usize {
        let g = self.state.inner.lock().expect("provider lock");
        let times: Vec<_> = g.arrivals.iter().copied().filter(|t| *t >= from).collect();
        let mut peak = 0;
        let mut start = 0;
        for (end, t) in times.iter().enumerate() {
            while *t - times[start] >= Duration::from_secs(1) {
                start += 1;
            }
            peak = peak.max(end - start + 1);
        }
        peak
    }

    /// Stop taking every token handed out so far.
    pub fn revoke_tokens(&self) {
        self.state.inner.lock().expect("provider lock").tokens.clear();
    }

    /// Replace the fault rules.
    pub fn set_faults(&self, rules: Vec<FaultRule>) {
        self.state.inner.lock().expect("provider lock").rules = rules;
    }
}

/// The provider's routes (also used by the binary).
fn router(state: AppState) -> Router {
    Router::new()
        .route("/_control/stats", get(stats))
        .route("/_control/faults", post(set_faults))
        .route("/_control/effects", get(effects))
        .route("/_control/revoke", post(revoke))
        .route("/oauth/token", post(token))
        .fallback(call)
        .with_state(state)
}

async fn stats(State(s): State<AppState>) -> impl IntoResponse {
    axum::Json(s.inner.lock().expect("provider lock").stats.clone())
}

/// Every applied effect, in order (the provider's record for `relay verify`).
async fn effects(State(s): State<AppState>) -> impl IntoResponse {
    axum::Json(s.inner.lock().expect("provider lock").log.clone())
}

/// Every token handed out stops working (a provider rotating its keys).
async fn revoke(State(s): State<AppState>) -> impl IntoResponse {
    s.inner.lock().expect("provider lock").tokens.clear();
    StatusCode::NO_CONTENT
}

/// RFC 6749 client credentials, client authenticated by HTTP Basic or in the form.
async fn token(
    State(s): State<AppState>,
    headers: HeaderMap,
    axum::Form(form): axum::Form<HashMap<String, String>>,
) -> Response {
    use base64::Engine as _;
    let Some(oauth) = &s.settings.oauth else { return StatusCode::NOT_FOUND.into_response() };
    let basic = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .and_then(|b| String::from_utf8(b).ok());
    let (id, secret) = match basic.as_deref().and_then(|b| b.split_once(':')) {
        Some((id, secret)) => (id.to_owned(), secret.to_owned()),
        None => {
            (form.get("client_id").cloned().unwrap_or_default(), form.get("client_secret").cloned().unwrap_or_default())
        }
    };
    if form.get("grant_type").map(String::as_str) != Some("client_credentials") {
        return (StatusCode::BAD_REQUEST, axum::Json(json!({"error": "unsupported_grant_type"}))).into_response();
    }
    if id != oauth.client_id || secret != oauth.client_secret {
        return (StatusCode::UNAUTHORIZED, axum::Json(json!({"error": "invalid_client"}))).into_response();
    }
    let mut g = s.inner.lock().expect("provider lock");
    g.stats.token_fetches += 1;
    let token = format!("tok_{}", g.stats.token_fetches);
    g.tokens.insert(token.clone(), std::time::Instant::now() + oauth.token_lifetime);
    let body = json!({"access_token": token, "token_type": "Bearer", "expires_in": oauth.token_lifetime.as_secs()});
    axum::Json(body).into_response()
}

/// The refusal of a call without a valid bearer token (when the provider
/// wants one) or without a verifying signature (when it wants one).
fn refused(s: &AppState, method: &Method, uri: &Uri, headers: &HeaderMap, body: &[u8]) -> Option<Response> {
    {
        let mut g = s.inner.lock().expect("provider lock");
        let now = std::time::Instant::now();
        g.arrivals.push(now);
        if let Some(limit) = s.settings.rate_limit {
            while g.taken.front().is_some_and(|t| now - *t >= Duration::from_secs(1)) {
                g.taken.pop_front();
            }
            if g.taken.len() >= limit as usize {
                g.stats.throttled += 1;
                let body = axum::Json(json!({"error": "rate limit exceeded"}));
                return Some((StatusCode::TOO_MANY_REQUESTS, [("retry-after", "1")], body).into_response());
            }
            g.taken.push_back(now);
        }
    }
    if let Some(aws) = &s.settings.aws_sigv4
        && let Err(why) = sigv4_verified(aws, method, uri, headers, body)
    {
        s.inner.lock().expect("provider lock").stats.bad_signatures += 1;
        return Some((StatusCode::FORBIDDEN, axum::Json(json!({"message": why}))).into_response());
    }
    if s.settings.oauth.is_some() {
        let mut g = s.inner.lock().expect("provider lock");
        let bearer = headers.get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        let valid = bearer.and_then(|t| g.tokens.get(t)).is_some_and(|exp| std::time::Instant::now() < *exp);
        if !valid {
            g.stats.unauthorized += 1;
            return Some((StatusCode::UNAUTHORIZED, axum::Json(json!({"error": "invalid_token"}))).into_response());
        }
    }
    if let Some(secret) = &s.settings.webhook_secret {
        let hook = standardwebhooks::Webhook::new(secret).expect("a base64 webhook secret");
        if hook.verify(body, headers).is_err() {
            s.inner.lock().expect("provider lock").stats.bad_signatures += 1;
            return Some(
                (StatusCode::BAD_REQUEST, axum::Json(json!({"error": "signature does not verify"}))).into_response(),
            );
        }
    }
    None
}

/// Check an AWS Signature Version 4 the way AWS does, written from the
/// published algorithm (not with the signing crate relay uses, so a
/// mistake there is not repeated here): the canonical request rebuilt from
/// what arrived, the string to sign, the derived key, the signature.
/// (Without the clock-skew check: the tests' clocks are one.)
fn sigv4_verified(
    aws: &SigV4Settings,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(), String> {
    use hmac::{Hmac, Mac};
    use sha2::{Digest, Sha256};
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let mac = |key: &[u8], data: &str| {
        let mut m = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key");
        m.update(data.as_bytes());
        m.finalize().into_bytes().to_vec()
    };
    let auth = headers.get("authorization").and_then(|v| v.to_str().ok()).ok_or("no Authorization header")?;
    let fields = auth.strip_prefix("AWS4-HMAC-SHA256 ").ok_or("not an AWS4-HMAC-SHA256 Authorization")?;
    let field = |name: &str| {
        fields.split(',').map(str::trim).find_map(|f| f.strip_prefix(name)?.strip_prefix('=')).map(str::to_owned)
    };
    let (credential, signed, signature) = match (field("Credential"), field("SignedHeaders"), field("Signature")) {
        (Some(c), Some(h), Some(s)) => (c, h, s),
        _ => return Err("Authorization lacks Credential, SignedHeaders or Signature".into()),
    };
    let scope: Vec<&str> = credential.split('/').collect();
    let [key_id, date, region, service, "aws4_request"] = scope[..] else { return Err("malformed credential".into()) };
    if key_id != aws.access_key_id || region != aws.region || service != aws.service {
        return Err(format!("credential {key_id}/{region}/{service} is not the expected one"));
    }
    let amz_date = headers.get("x-amz-date").and_then(|v| v.to_str().ok()).ok_or("no x-amz-date")?;
    if !amz_date.starts_with(date) {
        return Err("x-amz-date is not the credential's date".into());
    }
    let signed_names: Vec<&str> = signed.split(';').collect();
    if !signed_names.contains(&"host") || !signed_names.contains(&"x-amz-date") {
        return Err("host and x-amz-date must be signed".into());
    }
    // Path segments encoded once more (as received, already encoded once);
    // the query's pairs sorted.
    let encode = |seg: &str| {
        seg.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect::<String>()
    };
    let path = uri.path().split('/').map(encode).collect::<Vec<_>>().join("/");
    let mut query: Vec<&str> =
        uri.query().map(|q| q.split('&').filter(|p| !p.is_empty()).collect()).unwrap_or_default();
    query.sort_unstable();
    let mut canonical_headers = String::new();
    for name in &signed_names {
        let values: Vec<String> = headers
            .get_all(*name)
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).split_whitespace().collect::<Vec<_>>().join(" "))
            .collect();
        canonical_headers.push_str(&format!("{name}:{}\n", values.join(",")));
    }
    let payload = hex(&Sha256::digest(body));
    let canonical = format!("{method}\n{path}\n{}\n{canonical_headers}\n{signed}\n{payload}", query.join("&"));
    let to_sign = format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{date}/{region}/{service}/aws4_request\n{}",
        hex(&Sha256::digest(canonical.as_bytes()))
    );
    let k_date = mac(format!("AWS4{}", aws.secret_access_key).as_bytes(), date);
    let key = mac(&mac(&mac(&k_date, region), service), "aws4_request");
    if hex(&mac(&key, &to_sign)) != signature {
        return Err("The request signature we calculated does not match the signature you provided.".into());
    }
    Ok(())
}

async fn set_faults(State(s): State<AppState>, axum::Json(rules): axum::Json<Vec<FaultRule>>) -> impl IntoResponse {
    s.inner.lock().expect("provider lock").rules = rules;
    StatusCode::NO_CONTENT
}

enum Plan {
    Replay(u16, serde_json::Value),
    Conflict,
    Mismatch,
    Applied { response: serde_json::Value, delay_after: Option<u64>, html: bool, hold: bool, running: bool },
    HtmlFail(u16),
    Redirect(u16, String),
    Body(u16, String),
    EndlessBody(u16),
    Stalled(u16, u64),
    Fail(u16, Option<u64>),
    SlowFail(u64),
}

async fn call(State(s): State<AppState>, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let path = uri.path().to_owned();
    if let Some(refused) = refused(&s, &method, &uri, &headers, &body) {
        return refused;
    }
    if method == Method::GET && path.starts_with("/lookup/") {
        return lookup(&s, &path);
    }
    let dialect = s.settings.dialect;
    let header = if dialect == Dialect::Keyless { "x-relay-intent-id" } else { s.settings.idempotency_header.as_str() };
    let Some(key) = headers.get(header).and_then(|v| v.to_str().ok()).map(str::to_owned) else {
        s.inner.lock().expect("provider lock").stats.missing_key += 1;
        let msg = format!("{} header is required", s.settings.idempotency_header);
        return (StatusCode::BAD_REQUEST, axum::Json(json!({"error": msg}))).into_response();
    };
    let plan = 'plan: {
        let mut g = s.inner.lock().expect("provider lock");
        let inner = &mut *g;
        inner.stats.requests += 1;
        let ks = inner.stats.by_key.entry(key.clone()).or_default();
        ks.requests += 1;
        let nth = ks.requests;
        let known = inner.in_progress.get(&key).copied().unwrap_or(0) > 0 || inner.stored.contains_key(&key);
        if dialect.compares_bodies() && known && inner.bodies.get(&key).is_some_and(|b| *b != body) {
            Plan::Mismatch
        } else if dialect != Dialect::Keyless && inner.in_progress.get(&key).copied().unwrap_or(0) > 0 {
            // (A provider without keys remembers nothing: straight to the effect.)
            ks.concurrent += 1;
            Plan::Conflict
        } else if let Some((status, body)) = inner.stored.get(&key).filter(|_| dialect != Dialect::Keyless) {
            inner.stats.replayed += 1;
            Plan::Replay(*status, body.clone())
        } else {
            let rule = inner.rules.iter().find(|r| {
                r.path_prefix.as_deref().is_none_or(|p| path.starts_with(p))
                    && r.key_prefix.as_deref().is_none_or(|p| key.starts_with(p))
                    && r.times.is_none_or(|t| nth <= t)
            });
            let kind = match rule.map(|r| r.kind.clone()) {
                Some(FaultKind::Chaos { per_mille_503, per_mille_429, per_mille_timeout, timeout_ms }) => {
                    let d = dice(&key, nth);
                    if d < per_mille_503 {
                        Some(FaultKind::Status { status: 503, retry_after_secs: None })
                    } else if d < per_mille_503 + per_mille_429 {
                        Some(FaultKind::Status { status: 429, retry_after_secs: Some(1) })
                    } else if d < per_mille_503 + per_mille_429 + per_mille_timeout {
                        Some(FaultKind::TimeoutAfterApply { delay_ms: timeout_ms })
                    } else {
                        None
                    }
                }
                other => other,
            };
            let mut html = false;
            let mut running = false;
            let mut failed = None;
            let hold = kind == Some(FaultKind::HoldUntilReleased);
            let delay_after = match kind {
                Some(FaultKind::Status { status, retry_after_secs }) => {
                    break 'plan Plan::Fail(status, retry_after_secs);
                }
                Some(FaultKind::Html { status }) if !(200..300).contains(&status) => {
                    break 'plan Plan::HtmlFail(status);
                }
                Some(FaultKind::Html { .. }) => {
                    html = true;
                    None
                }
                Some(FaultKind::Redirect { status, location }) => break 'plan Plan::Redirect(status, location),
                Some(FaultKind::Body { status, body }) => break 'plan Plan::Body(status, body),
                Some(FaultKind::EndlessBody { status }) => break 'plan Plan::EndlessBody(status),
                Some(FaultKind::StalledBody { status, delay_ms }) => break 'plan Plan::Stalled(status, delay_ms),
                Some(FaultKind::Chaos { .. }) => None,
                Some(FaultKind::TimeoutBeforeApply { delay_ms }) => {
                    break 'plan Plan::SlowFail(delay_ms);
                }
                Some(FaultKind::TimeoutAfterApply { delay_ms }) => Some(delay_ms),
                Some(FaultKind::StillRunningAfterApply { delay_ms }) => {
                    running = true;
                    Some(delay_ms)
                }
                Some(FaultKind::AppliedThenFail { status }) => {
                    failed = Some(status);
                    None
                }
                Some(FaultKind::HoldUntilReleased) | None => None,
            };
            // The effect is applied and its response stored in the same
            // critical section that checked the key: a concurrent request with
            // the key sees it in progress (409), a later one gets the replay.
            let body_json: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
            *inner.in_progress.entry(key.clone()).or_default() += 1;
            inner.in_flight += 1;
            inner.stats.max_in_flight = inner.stats.max_in_flight.max(inner.in_flight);
            let resource =
                json!({"id": format!("res_{}", inner.stats.applied + 1), "idempotency_key": key, "path": path});
            inner.stats.applied += 1;
            inner.stats.by_key.entry(key.clone()).or_default().applied += 1;
            inner.stored.insert(key.clone(), (201, resource.clone()));
            if let Some(status) = failed {
                let error = json!({"error": {"type": "api_error", "message": "An unknown error occurred"}});
                inner.stored.insert(key.clone(), (status, error));
            }
            inner.bodies.insert(key.clone(), body.clone());
            let intent_id = headers.get("x-relay-intent-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
            let traceparent = headers.get("traceparent").and_then(|v| v.to_str().ok()).map(str::to_owned);
            inner.log.push(Applied {
                key: key.clone(),
                method: method.to_string(),
                path: path.clone(),
                body: body_json,
                intent_id,
                traceparent,
            });
            match failed {
                Some(status) => {
                    // Answered at once: no longer in progress.
                    *inner.in_progress.entry(key.clone()).or_default() -= 1;
                    inner.in_flight -= 1;
                    Plan::Fail(status, None)
                }
                None => Plan::Applied { response: resource, delay_after, html, hold, running },
            }
        }
    };
    match plan {
        Plan::Mismatch if dialect == Dialect::Stripe => stripe_error(StatusCode::BAD_REQUEST, ""),
        Plan::Mismatch => {
            let body = axum::Json(json!({"error": "this idempotency key was used with a different request body"}));
            (StatusCode::UNPROCESSABLE_ENTITY, body).into_response()
        }
        Plan::Conflict if dialect == Dialect::Stripe => stripe_error(
            StatusCode::CONFLICT,
            "There is currently another in-progress request using this idempotency key; try again later.",
        ),
        Plan::Conflict => {
            // As the IETF Idempotency-Key draft asks: 409 while the first request is in progress.
            let body = axum::Json(json!({"error": "a request with this key is in progress"}));
            let mut r = (StatusCode::CONFLICT, body).into_response();
            r.headers_mut().insert("retry-after", "1".parse().expect("digits"));
            r
        }
        Plan::Replay(status, body) => {
            let mut r = (StatusCode::from_u16(status).unwrap_or(StatusCode::OK), axum::Json(body)).into_response();
            r.headers_mut().insert("idempotent-replayed", "true".parse().expect("static header"));
            r
        }
        Plan::Fail(status, retry_after) => fail(status, retry_after),
        Plan::EndlessBody(status) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
            let chunks =
                futures::stream::repeat_with(|| Ok::<_, std::convert::Infallible>(Bytes::from(vec![b'x'; 8192])));
            (status, [("content-type", "text/plain")], axum::body::Body::from_stream(chunks)).into_response()
        }
        Plan::Stalled(status, ms) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
            let start = futures::stream::once(async { Ok::<_, std::convert::Infallible>(Bytes::from("{\"id\":")) });
            let rest = futures::stream::once(async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok::<_, std::convert::Infallible>(Bytes::from("\"late\"}"))
            });
            let body = axum::body::Body::from_stream(futures::StreamExt::chain(start, rest));
            (status, [("content-type", "application/json")], body).into_response()
        }
        Plan::Body(status, body) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST);
            (status, [("content-type", "text/plain")], body).into_response()
        }
        Plan::SlowFail(ms) => delay_then_fail(ms).await,
        Plan::HtmlFail(status) => html_page(status),
        Plan::Redirect(status, location) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::FOUND);
            (status, [("location", location)], "").into_response()
        }
        Plan::Applied { response, delay_after, html, hold, running } => {
            // Ends "in progress" even when the client hangs up first and the
            // server drops this future mid-sleep (a timeout after applying)…
            let in_progress = InProgress { inner: s.inner.clone(), key };
            if let Some(ms) = delay_after.filter(|_| running) {
                // …unless the work goes on without the client.
                let work = tokio::spawn(async move {
                    let _in_progress = in_progress;
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                });
                let _ = work.await;
                return (StatusCode::CREATED, axum::Json(response)).into_response();
            }
            let _in_progress = in_progress;
            if let Some(ms) = delay_after {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            if hold {
                // Err only if the provider is gone: answer then.
                let _ = s.released.subscribe().wait_for(|released| *released).await;
            }
            if html {
                return html_page(200);
            }
            (StatusCode::CREATED, axum::Json(response)).into_response()
        }
    }
}

/// `GET /lookup/INTENT_ID`: what became of the call of relay intent
/// `INTENT_ID` (its `X-Relay-Intent-Id`), as a provider's status API says
/// it: `200 {"state": "applied", "id": …}` or `404 {"state": "unknown"}`.
/// A `Status` fault rule whose path prefix matches answers instead (a
/// status API that is down).
fn lookup(s: &AppState, path: &str) -> Response {
    let inner = s.inner.lock().expect("provider lock");
    let down = inner.rules.iter().find_map(|r| match &r.kind {
        FaultKind::Status { status, retry_after_secs }
            if r.path_prefix.as_deref().is_some_and(|p| path.starts_with(p)) =>
        {
            Some((*status, *retry_after_secs))
        }
        _ => None,
    });
    if let Some((status, retry_after)) = down {
        return fail(status, retry_after);
    }
    let intent = path.trim_start_matches("/lookup/");
    let applied = inner.log.iter().position(|a| a.intent_id.as_deref() == Some(intent));
    match applied {
        Some(n) => axum::Json(json!({"state": "applied", "id": format!("res_{}", n + 1)})).into_response(),
        None => (StatusCode::NOT_FOUND, axum::Json(json!({"state": "unknown"}))).into_response(),
    }
}

fn html_page(status: u16) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    let body = format!("<html><body><h1>{status}</h1><p>upstream says no</p></body></html>");
    (status, [("content-type", "text/html")], body).into_response()
}

struct InProgress {
    inner: Arc<Mutex<Inner>>,
    key: String,
}

impl Drop for InProgress {
    fn drop(&mut self) {
        if let Ok(mut g) = self.inner.lock() {
            g.in_flight = g.in_flight.saturating_sub(1);
            if let Some(n) = g.in_progress.get_mut(&self.key) {
                *n = n.saturating_sub(1);
            }
        }
    }
}

fn fail(status: u16, retry_after: Option<u64>) -> Response {
    let mut r = (
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        axum::Json(json!({"error": format!("injected {status}")})),
    )
        .into_response();
    if let Some(secs) = retry_after {
        r.headers_mut().insert("retry-after", secs.to_string().parse().expect("digits"));
    }
    r
}

async fn delay_then_fail(ms: u64) -> Response {
    tokio::time::sleep(Duration::from_millis(ms)).await;
    (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"error": "injected slow failure"}))).into_response()
}

/// Serve on `bind` until the process ends (the binary's main).
pub async fn serve(bind: SocketAddr, settings: Settings) -> anyhow::Result<()> {
    let p = Provider::start(bind, settings).await?;
    tracing::info!(url = %p.url(), "example provider listening");
    std::future::pending::<()>().await;
    Ok(())
}
