//! Per-endpoint authentication and signing of calls: OAuth2 client
//! credentials (the `oauth2` crate makes the token request; the cache, the
//! single refresh and the re-authentication after a 401 are ours, since the
//! crate leaves them to the caller) and Standard Webhooks signatures (the
//! `standardwebhooks` crate).

use std::sync::Arc;
use std::time::Duration;

use oauth2::basic::BasicClient;
use oauth2::{AuthType, ClientId, ClientSecret, EndpointNotSet, EndpointSet, Scope, TokenResponse, TokenUrl};
use relay_core::config::{ClientAuth, OAuth2Config, SigningConfig};
use secrecy::{ExposeSecret, SecretString};

type TokenClient = BasicClient<EndpointNotSet, EndpointNotSet, EndpointNotSet, EndpointNotSet, EndpointSet>;

/// An endpoint's OAuth2 client credentials: one token shared by all its
/// calls, fetched by one call at a time.
pub struct OAuth2 {
    endpoint: String,
    client: TokenClient,
    /// Its own client, with the endpoint's TLS settings; never follows redirects.
    http: reqwest::Client,
    scopes: Vec<Scope>,
    refresh_before: Duration,
    /// Held while a token is fetched, so calls that find it stale wait for
    /// that one fetch instead of each making their own.
    cached: tokio::sync::Mutex<Option<Token>>,
}

/// A bearer token as a call uses it.
#[derive(Clone)]
pub struct Token {
    secret: Arc<SecretString>,
    /// When to stop using it (its expiry less `refresh_before`); `None`: the
    /// server gave no lifetime, so it is used until refused.
    use_until: Option<tokio::time::Instant>,
    /// Which fetch it came from: a 401 discards the token only if no other
    /// call has replaced it meanwhile.
    fetch: u64,
}

impl Token {
    /// The `Authorization` header value.
    pub fn header(&self) -> Result<reqwest::header::HeaderValue, String> {
        let mut v = reqwest::header::HeaderValue::from_str(&format!("Bearer {}", self.secret.expose_secret()))
            .map_err(|_| "the token endpoint gave a token that cannot be an HTTP header".to_owned())?;
        v.set_sensitive(true);
        Ok(v)
    }
}

impl OAuth2 {
    /// The client of endpoint `endpoint` for `cfg`, its secret read from the
    /// environment now (a missing one fails the start, naming the variable);
    /// `http` asks the token endpoint (the endpoint's TLS settings, no redirects).
    pub fn from_env(endpoint: &str, cfg: &OAuth2Config, http: reqwest::Client) -> anyhow::Result<OAuth2> {
        let secret = std::env::var(&cfg.client_secret_env).map_err(|_| {
            anyhow::anyhow!(
                "endpoints.{endpoint}.oauth2: environment variable {} (client_secret_env) is not set",
                cfg.client_secret_env
            )
        })?;
        OAuth2::new(endpoint, cfg, SecretString::from(secret), http)
    }

    /// The client of endpoint `endpoint` for `cfg` with client secret
    /// `secret`, asking the token endpoint through `http`, which must not
    /// follow redirects (the `oauth2` crate's advice: a redirect could carry
    /// the credentials away).
    pub fn new(
        endpoint: &str,
        cfg: &OAuth2Config,
        secret: SecretString,
        http: reqwest::Client,
    ) -> anyhow::Result<OAuth2> {
        let secret = secret.expose_secret().to_owned();
        let token_url = TokenUrl::from_url(cfg.token_url.clone());
        let client = BasicClient::new(ClientId::new(cfg.client_id.clone()))
            .set_client_secret(ClientSecret::new(secret))
            .set_token_uri(token_url)
            .set_auth_type(match cfg.client_auth {
                ClientAuth::Basic => AuthType::BasicAuth,
                ClientAuth::Body => AuthType::RequestBody,
            });
        Ok(OAuth2 {
            endpoint: endpoint.to_owned(),
            client,
            http,
            scopes: cfg.scopes.iter().cloned().map(Scope::new).collect(),
            refresh_before: cfg.refresh_before,
            cached: tokio::sync::Mutex::new(None),
        })
    }

    /// A token that is not about to expire: the cached one, or a new one.
    pub async fn token(&self) -> Result<Token, String> {
        let mut cached = self.cached.lock().await;
        let now = tokio::time::Instant::now();
        if let Some(t) = cached.as_ref().filter(|t| t.use_until.is_none_or(|u| now < u)) {
            return Ok(t.clone());
        }
        let fetch = cached.as_ref().map_or(1, |t| t.fetch + 1);
        let token = self.fetch(fetch).await;
        crate::runtime::metrics::token_fetch(&self.endpoint, token.is_ok());
        let token = token?;
        *cached = Some(token.clone());
        Ok(token)
    }

    /// `refused` was answered 401: forget it, unless another call already
    /// replaced it (then that newer one is used).
    pub async fn refused(&self, refused: &Token) {
        let mut cached = self.cached.lock().await;
        if cached.as_ref().is_some_and(|t| t.fetch == refused.fetch) {
            // Keep the count going, so a later 401 of an older token is told apart.
            if let Some(t) = cached.as_mut() {
                t.use_until = Some(tokio::time::Instant::now());
            }
        }
    }

    async fn fetch(&self, fetch: u64) -> Result<Token, String> {
        let asked = tokio::time::Instant::now();
        let answer =
            self.client.exchange_client_credentials().add_scopes(self.scopes.clone()).request_async(&self.http).await;
        let answer = answer.map_err(|e| {
            use oauth2::RequestTokenError as E;
            let why = match &e {
                E::ServerResponse(r) => format!("the token endpoint refused: {}", r.error()),
                E::Request(e) => format!("the token endpoint could not be reached: {}", relay_core::error_chain(e)),
                E::Parse(e, _) => format!("the token endpoint's answer is not a token response: {e}"),
                E::Other(e) => e.clone(),
            };
            format!("no OAuth2 token for endpoint {}: {why}", self.endpoint)
        })?;
        let use_until = answer.expires_in().map(|life| asked + life.saturating_sub(self.refresh_before));
        let secret = Arc::new(SecretString::from(answer.access_token().secret().clone()));
        Ok(Token { secret, use_until, fetch })
    }
}

/// The bytes of `req`'s body to sign (none: empty); a streamed one cannot be.
fn signable_body(req: &reqwest::Request) -> Result<&[u8], String> {
    match req.body() {
        None => Ok(&[]),
        Some(b) => b.as_bytes().ok_or_else(|| "a streamed request body cannot be signed".to_owned()),
    }
}

/// How an endpoint signs its requests.
pub enum Signer {
    /// Standard Webhooks.
    StandardWebhooks(standardwebhooks::Webhook),
    /// AWS Signature Version 4.
    AwsSigv4 {
        /// The credentials.
        identity: aws_smithy_runtime_api::client::identity::Identity,
        /// The region.
        region: String,
        /// The service's signing name.
        service: String,
    },
}

impl Signer {
    /// The signer of endpoint `endpoint` for `cfg`, its secret read from the
    /// environment now.
    pub fn new(endpoint: &str, cfg: &SigningConfig) -> anyhow::Result<Signer> {
        let at = format!("endpoints.{endpoint}.signing");
        match cfg {
            SigningConfig::StandardWebhooks { secret_env } => {
                let secret = std::env::var(secret_env)
                    .map_err(|_| anyhow::anyhow!("{at}: environment variable {secret_env} (secret_env) is not set"))?;
                let hook = standardwebhooks::Webhook::new(&secret).map_err(|_| {
                    anyhow::anyhow!("{at}: the secret in {secret_env} is not base64 (with or without whsec_)")
                })?;
                Ok(Signer::StandardWebhooks(hook))
            }
            SigningConfig::AwsSigv4 {
                region,
                service,
                access_key_id_env,
                secret_access_key_env,
                session_token_env,
            } => {
                let var = |name: &str, key: &str| {
                    std::env::var(name)
                        .map_err(|_| anyhow::anyhow!("{at}: environment variable {name} ({key}) is not set"))
                };
                let token = match session_token_env {
                    Some(name) => Some(var(name, "session_token_env")?),
                    None => None,
                };
                let credentials = aws_credential_types::Credentials::new(
                    var(access_key_id_env, "access_key_id_env")?,
                    var(secret_access_key_env, "secret_access_key_env")?,
                    token,
                    None,
                    "relay-endpoint-config",
                );
                Ok(Signer::AwsSigv4 { identity: credentials.into(), region: region.clone(), service: service.clone() })
            }
        }
    }

    /// Sign `req`, whose message id is `id` (stable across its attempts).
    pub fn sign(&self, req: &mut reqwest::Request, id: &str) -> Result<(), String> {
        match self {
            Signer::StandardWebhooks(hook) => {
                let body = signable_body(req)?;
                let now = chrono::Utc::now().timestamp();
                let signature =
                    hook.sign(id, now, body).map_err(|_| "a Standard Webhooks body must be UTF-8".to_owned())?;
                let h = req.headers_mut();
                let value = |v: &str| reqwest::header::HeaderValue::from_str(v).map_err(|e| format!("webhook-id: {e}"));
                h.insert(standardwebhooks::HEADER_WEBHOOK_ID, value(id)?);
                h.insert(standardwebhooks::HEADER_WEBHOOK_TIMESTAMP, value(&now.to_string())?);
                h.insert(standardwebhooks::HEADER_WEBHOOK_SIGNATURE, value(&signature)?);
                Ok(())
            }
            Signer::AwsSigv4 { identity, region, service } => {
                use aws_sigv4::http_request::{SignableBody, SignableRequest, SigningSettings, sign};
                let params = aws_sigv4::sign::v4::SigningParams::builder()
                    .identity(identity)
                    .region(region)
                    .name(service)
                    .time(std::time::SystemTime::now())
                    .settings(SigningSettings::default())
                    .build()
                    .map_err(|e| format!("AWS SigV4 parameters: {e}"))?
                    .into();
                let instructions = {
                    let body = signable_body(req)?;
                    // Headers that are not text cannot be signed; they go unsigned.
                    let headers = req.headers().iter().filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?)));
                    let signable = SignableRequest::new(
                        req.method().as_str(),
                        req.url().as_str(),
                        headers,
                        SignableBody::Bytes(body),
                    )
                    .map_err(|e| format!("AWS SigV4: {e}"))?;
                    sign(signable, &params).map_err(|e| format!("AWS SigV4: {e}"))?.into_parts().0
                };
                let (headers, _) = instructions.into_parts();
                for h in headers {
                    let mut value = reqwest::header::HeaderValue::from_str(h.value())
                        .map_err(|e| format!("AWS SigV4 header {}: {e}", h.name()))?;
                    value.set_sensitive(h.sensitive());
                    req.headers_mut().insert(h.name(), value);
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A token endpoint that counts its fetches, answers after `delay` (so
    /// concurrent askers overlap) and gives tokens of `lifetime` seconds.
    async fn token_server(lifetime: u64, delay: Duration) -> (url::Url, Arc<AtomicU64>) {
        let fetches = Arc::new(AtomicU64::new(0));
        let counted = fetches.clone();
        let app = axum::Router::new().route(
            "/token",
            axum::routing::post(move || {
                let counted = counted.clone();
                async move {
                    tokio::time::sleep(delay).await;
                    let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
                    axum::Json(serde_json::json!({
                        "access_token": format!("tok_{n}"), "token_type": "Bearer", "expires_in": lifetime
                    }))
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (format!("http://{addr}/token").parse().unwrap(), fetches)
    }

    fn client(url: url::Url, refresh_before: Duration) -> OAuth2 {
        let cfg = OAuth2Config {
            token_url: url,
            client_id: "relay".into(),
            client_secret_env: "UNUSED".into(),
            scopes: vec!["payments".into()],
            refresh_before,
            client_auth: ClientAuth::Basic,
        };
        let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
        OAuth2::new("psp", &cfg, SecretString::from("s3cret"), http).unwrap()
    }

    #[tokio::test]
    async fn concurrent_calls_share_one_fetch_and_a_refused_token_is_replaced_once() {
        let (url, fetches) = token_server(3600, Duration::from_millis(200)).await;
        let auth = Arc::new(client(url, Duration::from_secs(30)));
        let ask = |n: usize| {
            let tasks: Vec<_> = (0..n)
                .map(|_| {
                    let auth = auth.clone();
                    tokio::spawn(async move { auth.token().await.unwrap() })
                })
                .collect();
            futures::future::join_all(tasks)
        };
        let first: Vec<Token> = ask(16).await.into_iter().map(Result::unwrap).collect();
        assert_eq!(fetches.load(Ordering::SeqCst), 1, "16 calls at once, one fetch");
        assert!(first.iter().all(|t| t.fetch == 1));
        // Every call's token refused at once (revoked): each says so, then asks again.
        let refused = first[0].clone();
        let tasks: Vec<_> = (0..16)
            .map(|_| {
                let (auth, refused) = (auth.clone(), refused.clone());
                tokio::spawn(async move {
                    auth.refused(&refused).await;
                    auth.token().await.unwrap()
                })
            })
            .collect();
        let again: Vec<Token> = futures::future::join_all(tasks).await.into_iter().map(Result::unwrap).collect();
        assert_eq!(fetches.load(Ordering::SeqCst), 2, "16 refusals of one token, one new fetch");
        assert!(again.iter().all(|t| t.fetch == 2 && t.header().unwrap().to_str().unwrap() == "Bearer tok_2"));
        // A late refusal of the old token does not throw the new one away.
        auth.refused(&refused).await;
        assert_eq!(auth.token().await.unwrap().fetch, 2);
        assert_eq!(fetches.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_token_is_replaced_refresh_before_its_expiry() {
        // Lives 60 s, replaced 60 s before: every call fetches.
        let (url, fetches) = token_server(60, Duration::ZERO).await;
        let auth = client(url, Duration::from_secs(60));
        auth.token().await.unwrap();
        auth.token().await.unwrap();
        assert_eq!(fetches.load(Ordering::SeqCst), 2);
        // Replaced 10 s before: the same token all along.
        let (url, fetches) = token_server(60, Duration::ZERO).await;
        let auth = client(url, Duration::from_secs(10));
        for _ in 0..5 {
            auth.token().await.unwrap();
        }
        assert_eq!(fetches.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_standard_webhooks_signature_verifies_with_the_secret_and_keeps_the_message_id() {
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let signer = Signer::StandardWebhooks(standardwebhooks::Webhook::new(secret).unwrap());
        let client = reqwest::Client::new();
        let mut req = client.post("http://hooks.test/").json(&serde_json::json!({"a": 1})).build().unwrap();
        signer.sign(&mut req, "capture:o-1").unwrap();
        let mut headers = http::HeaderMap::new();
        for (k, v) in req.headers() {
            headers.insert(k.clone(), v.clone());
        }
        let body = req.body().and_then(|b| b.as_bytes()).unwrap();
        standardwebhooks::Webhook::new(secret).unwrap().verify(body, &headers).unwrap();
        assert_eq!(headers.get("webhook-id").unwrap(), "capture:o-1");
        let other = standardwebhooks::Webhook::new("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD").unwrap();
        assert!(other.verify(body, &headers).is_err(), "another secret does not verify");
        assert!(
            standardwebhooks::Webhook::new(secret).unwrap().verify(br#"{"a":2}"#, &headers).is_err(),
            "another body does not verify"
        );
    }
}
