//! Calls to one external endpoint: reqwest under tower layers (concurrency
//! limit, per-request timeout) plus an optional rate limit, the idempotency
//! key on every attempt (R8), and the outcome reduced to an [`AttemptResult`].
//!
//! Why the rate limit is `governor` and not tower's `RateLimit`: tower's
//! limiter needs `&mut self` and is not `Clone`, so sharing it between
//! concurrent calls needs a `Buffer`, and the buffer's response future fails
//! rustc's higher-ranked `Send` check when the dispatcher spawns the call.
//! governor's limiter is shared behind an `Arc` and awaited before the call.

use relay_core::config::EndpointConfig;
use relay_core::profile::{KeyAnswer, KeyPlacement, Profile};
use relay_core::retry::{AttemptResult, ErrorClass, parse_retry_after};
use relay_core::sabotage::{Sabotage, Sabotaged};
use reqwest::header::{AUTHORIZATION, HeaderName, HeaderValue, RETRY_AFTER};
use secrecy::{ExposeSecret, SecretString};
use std::sync::Arc;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};

pub use super::call_result::{CallResult, KEPT_HEADER_BYTES, KEPT_HEADERS, NotSent};
use super::call_result::{classify_transport, inexpressible, unauthenticated};

type HttpService = tower::limit::ConcurrencyLimit<tower::timeout::Timeout<reqwest::Client>>;

/// One request to make: what the endpoint's client sends, described apart
/// from where it came from (an intent's row).
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// HTTP method.
    pub method: &'a str,
    /// Path under the endpoint's base URL.
    pub path: &'a str,
    /// JSON body.
    pub body: Option<&'a serde_json::Value>,
    /// Extra headers, a JSON object of strings.
    pub headers: &'a serde_json::Value,
    /// Sent where the endpoint's profile says (a header, a body field), the
    /// same on every attempt (R8); `None` for a lookup, which changes nothing.
    pub idempotency_key: Option<&'a str>,
    /// Sent as `traceparent`, when there is one.
    pub traceparent: Option<&'a str>,
    /// Sent as `x-correlation-id`, when there is one.
    pub correlation_id: Option<&'a str>,
    /// Sent as `x-relay-intent-id`.
    pub intent_id: uuid::Uuid,
    /// Sent as `x-relay-attempt`.
    pub attempt: i32,
    /// Keep up to this many bytes of the answer's body, whatever its status
    /// (0: only an error's start, for its text).
    pub keep_body: usize,
}

/// The client of one endpoint. Cheap to clone.
#[derive(Clone)]
pub struct EndpointClient {
    name: String,
    cfg: EndpointConfig,
    profile: Profile,
    /// [`EndpointConfig::also_retry`], computed once.
    also_retry: Vec<u16>,
    /// The headers the endpoint sets itself, as configured now (its static
    /// headers and the key's): a call's own value of one is not sent beside
    /// the endpoint's. An application's call is checked against the
    /// endpoint's headers when it is queued; one queued before a credential
    /// header was added would otherwise send two values of it.
    own_headers: Vec<String>,
    token: Option<SecretString>,
    /// OAuth2 client credentials, shared by the clones (one token, one refresh).
    oauth2: Option<Arc<super::auth::OAuth2>>,
    /// How requests are signed, if they are.
    signer: Option<Arc<super::auth::Signer>>,
    http: reqwest::Client,
    svc: HttpService,
    limiter: Option<Arc<DefaultDirectRateLimiter>>,
    /// The line for the rate limiter's tokens, shared by the clones: governor
    /// wakes its waiters all at once and the first to run wins, so without it
    /// a call could lose to later ones again and again, and a fair share's
    /// early slot start behind a burst it was scheduled ahead of.
    rate_line: Arc<tokio::sync::Mutex<()>>,
    /// The adaptive rate, shared by every process, instead of `limiter`.
    adaptive: Option<Arc<super::throttle::Adaptive>>,
    /// Defects put back on purpose, for the tests that prove they are caught
    /// (none outside them): tokens before permits, a slot kept for a token,
    /// key answers ignored, redirects followed.
    sabotage: Sabotaged,
}

impl std::fmt::Debug for EndpointClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointClient")
            .field("name", &self.name)
            .field("base_url", &self.cfg.base_url.as_str())
            .finish()
    }
}

impl EndpointClient {
    /// Build the client for endpoint `name`. Must be called inside a tokio runtime.
    pub fn new(name: &str, cfg: &EndpointConfig, sabotage: Sabotaged) -> anyhow::Result<EndpointClient> {
        let token = crate::config::endpoint_token(cfg).map_err(|e| anyhow::anyhow!("endpoints.{name}: {e}"))?;
        let oauth2 = match &cfg.oauth2 {
            Some(o) => {
                // The token endpoint through the endpoint's TLS settings (an
                // identity provider on the same private PKI, or wanting mTLS).
                let http = client_builder(name, cfg)?
                    .redirect(reqwest::redirect::Policy::none())
                    .timeout(cfg.timeout)
                    .build()?;
                Some(Arc::new(super::auth::OAuth2::from_env(name, o, http)?))
            }
            None => None,
        };
        let signer = match &cfg.signing {
            Some(s) => Some(Arc::new(super::auth::Signer::new(name, s)?)),
            None => None,
        };
        // A redirect is an answer, classified like any other 3xx (permanent):
        // followed, a 302 to a login page would count as the call's success,
        // and a 307 would re-send the body and the idempotency key to another
        // host. Deliberately wrong when sabotaged: followed.
        let redirects = match sabotage.has(Sabotage::RedirectsFollowed) {
            true => reqwest::redirect::Policy::default(),
            false => reqwest::redirect::Policy::none(),
        };
        let http = client_builder(name, cfg)?.redirect(redirects).build()?;
        let svc = ServiceBuilder::new().concurrency_limit(cfg.concurrency).timeout(cfg.timeout).service(http.clone());
        let limiter = cfg
            .rate_limit_per_second
            .and_then(|n| std::num::NonZeroU32::new(u32::try_from(n).unwrap_or(u32::MAX)))
            // Evenly spaced (no burst), and taken after the concurrency permit
            // (so tokens are not spent by calls queued behind a stalled
            // provider, all sent at once when it recovers): a provider's "n
            // per second" is never exceeded in any window.
            .map(|n| Arc::new(RateLimiter::direct(Quota::per_second(n).allow_burst(std::num::NonZeroU32::MIN))));
        let profile = cfg.profile();
        if let KeyPlacement::Header(h) = &profile.key {
            HeaderName::from_bytes(h.as_bytes())
                .map_err(|e| anyhow::anyhow!("endpoints.{name}: idempotency key header {h:?}: {e}"))?;
        }
        Ok(EndpointClient {
            name: name.to_owned(),
            cfg: cfg.clone(),
            profile,
            also_retry: cfg.also_retry(),
            own_headers: {
                let mut names: Vec<String> = cfg.headers.keys().map(|h| h.to_ascii_lowercase()).collect();
                if let KeyPlacement::Header(h) = &cfg.profile().key {
                    names.push(h.to_ascii_lowercase());
                }
                names
            },
            token,
            oauth2,
            signer,
            adaptive: cfg.adaptive.map(|a| Arc::new(super::throttle::Adaptive::new(a))),
            http,
            svc,
            limiter,
            rate_line: Arc::default(),
            sabotage,
        })
    }

    /// Whether calls wait for a rate token.
    fn rate_limited(&self) -> bool {
        self.adaptive.is_some() || self.limiter.is_some()
    }

    /// A rate token, in the order the calls asked (tokio's mutex queues its
    /// waiters first come, first served). The limiter is read once a call's
    /// turn comes: an adaptive rate that moved applies to the whole line
    /// then, not to each call that had read the old one before it queued.
    async fn rate_token(&self) {
        let _turn = self.rate_line.lock().await;
        let adapted = self.adaptive.as_ref().map(|a| a.limiter());
        if let Some(limiter) = adapted.as_deref().or(self.limiter.as_deref()) {
            limiter.until_ready().await;
        }
    }

    /// The endpoint's configuration.
    pub fn config(&self) -> &EndpointConfig {
        &self.cfg
    }

    /// Sign `req` if the endpoint signs its requests.
    fn sign(&self, req: &mut reqwest::Request, message_id: &str) -> Result<(), String> {
        match &self.signer {
            Some(signer) => signer.sign(req, message_id),
            None => Ok(()),
        }
    }

    /// The endpoint's adaptive rate, if it has one.
    pub fn adaptive(&self) -> Option<&Arc<super::throttle::Adaptive>> {
        self.adaptive.as_ref()
    }

    /// The endpoint's profile, overrides applied.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// Statuses retried besides the ones every endpoint retries.
    pub fn also_retry(&self) -> &[u16] {
        &self.also_retry
    }

    fn request(&self, r: Request<'_>) -> Result<reqwest::Request, String> {
        let base = self.cfg.base_url.as_str().trim_end_matches('/');
        let path = r.path.trim_start_matches('/');
        let url = format!("{base}/{path}");
        let method =
            reqwest::Method::from_bytes(r.method.as_bytes()).map_err(|e| format!("method {:?}: {e}", r.method))?;
        if let Some(why) = r.idempotency_key.and_then(|k| self.profile.key_refused(k)) {
            return Err(why);
        }
        let mut req = self
            .http
            .request(method, &url)
            .header("x-relay-intent-id", r.intent_id.to_string())
            .header("x-relay-attempt", r.attempt.to_string());
        if let Some(t) = r.traceparent {
            req = req.header("traceparent", t);
        }
        if let Some(c) = r.correlation_id {
            req = req.header("x-correlation-id", c);
        }
        for (k, v) in &self.cfg.headers {
            req = req.header(k, v);
        }
        if let Some(obj) = r.headers.as_object() {
            for (k, v) in obj {
                if is_reserved(&self.own_headers, k) {
                    tracing::warn!(intent_id = %r.intent_id, header = %k,
                                   "the endpoint sets this header itself now (a configured header, or the key's): \
                                    the call's own value of it is not sent");
                    continue;
                }
                let name = HeaderName::from_bytes(k.as_bytes()).map_err(|e| format!("header name {k:?}: {e}"))?;
                let value =
                    HeaderValue::from_str(v.as_str().unwrap_or_default()).map_err(|e| format!("header {k}: {e}"))?;
                req = req.header(name, value);
            }
        }
        if let Some(token) = &self.token {
            req = req.bearer_auth(token.expose_secret());
        }
        match (&self.profile.key, r.idempotency_key, r.body) {
            (KeyPlacement::Header(h), Some(key), body) => {
                req = req.header(h.as_str(), key);
                if let Some(body) = body {
                    req = req.json(body);
                }
            }
            (KeyPlacement::BodyField(field), Some(key), body) => {
                let mut body = body.cloned().unwrap_or_else(|| serde_json::json!({}));
                put_field(&mut body, field, key)?;
                req = req.json(&body);
            }
            (_, _, Some(body)) => req = req.json(body),
            (_, _, None) => {}
        }
        req.build().map_err(|e| format!("cannot build the request: {e}"))
    }

    /// Make one attempt of `request`, if it can be sent by `send_by`, once
    /// the endpoint lets it and then a call slot of `slots` is free.
    ///
    /// C17: the caller's lease must outlive the whole exchange, so the
    /// request is sent only if it starts by `send_by` (the lease's end less
    /// [`EndpointConfig::call_bound`] and a spare): every wait ends there,
    /// and `Err(NotSent)` says the request never left. From the send on,
    /// `timeout` bounds connect, response and body together.
    ///
    /// The waits come in this order: the endpoint's concurrency permit, its
    /// rate limit, then the dispatcher's call slot. A call waiting at its own
    /// endpoint's limits holds no slot that another endpoint's calls need,
    /// and a rate token is only taken by a call that holds its endpoint's
    /// permit. Calls that waited for slots together may then leave close
    /// together: at most the endpoint's `concurrency`.
    ///
    /// `stop` ends the waits too: a dispatcher stopping gives back what has
    /// not been sent rather than wait at a throttled endpoint until the
    /// lease runs out.
    pub async fn call(
        &self,
        request: Request<'_>,
        send_by: tokio::time::Instant,
        slots: &tokio::sync::Semaphore,
        stop: &tokio_util::sync::CancellationToken,
    ) -> Result<CallResult, NotSent> {
        let waits = Waits { send_by, stop };
        let keep_body = request.keep_body;
        let message_id = message_id(&request);
        let req = match self.request(request) {
            Ok(r) => r,
            // The request cannot be expressed at all: as permanent as a 400.
            Err(e) => return Ok(inexpressible(e)),
        };
        let turn = match self.wait_for_turn(&waits, slots).await? {
            Ok(turn) => turn,
            Err(answer) => return Ok(answer),
        };
        let req = match self.authorize(req, turn.token.as_ref(), &message_id) {
            Ok(req) => req,
            Err(answer) => return Ok(answer),
        };
        let sent = match self.send_once(turn, req, &message_id, &waits).await? {
            Ok(sent) => sent,
            Err(answer) => return Ok(answer),
        };
        let Sent { response, at, started_at, _slot } = sent;
        Ok(match response {
            Ok(resp) => self.read_answer(resp, at, started_at, keep_body).await,
            Err(e) => classify_transport(e, self.cfg.timeout, started_at),
        })
    }

    /// Wait for the call's turn: the endpoint's concurrency permit, then its
    /// rate token, then an OAuth2 token, then a call slot of `slots` — each
    /// wait bounded by `w`. `Ok(Err(answer))`: the call ends here with that
    /// answer (no connection, no token).
    async fn wait_for_turn<'s>(
        &self,
        w: &Waits<'_>,
        slots: &'s tokio::sync::Semaphore,
    ) -> Result<Result<Turn<'s>, CallResult>, NotSent> {
        let limited = self.rate_limited();
        // Deliberately wrong when sabotaged: the token before the permit.
        let token_first = self.sabotage.has(Sabotage::TokenBeforePermit);
        if limited && token_first {
            w.bounded(self.rate_token()).await?;
        }
        let svc = match w.bounded(self.svc.clone().ready_oneshot()).await? {
            Ok(svc) => svc,
            Err(e) => return Ok(Err(classify_transport(e, self.cfg.timeout, None))),
        };
        if limited && !token_first {
            w.bounded(self.rate_token()).await?;
        }
        // The token before the slot: a wait for the token endpoint holds no
        // slot that another endpoint's calls need.
        let token = match &self.oauth2 {
            None => None,
            Some(o) => match w.bounded(o.token()).await? {
                Ok(t) => Some(t),
                Err(why) => return Ok(Err(unauthenticated(why, None))),
            },
        };
        // The slot, with the token taken before it: a call never waits for a
        // token while holding a slot another endpoint needs, and the slots'
        // queue is first come, first served, so a throttled call gets its
        // turn however busy the other endpoints keep it. (Giving the slot
        // back to wait for a fresher token sent the call to the queue's end
        // each time: it was never made while other endpoints kept waiters.)
        // Calls that waited for slots together may then go close together:
        // at most the endpoint's `concurrency`, whose permits they hold.
        let slot = match slots.try_acquire() {
            Ok(slot) => slot,
            Err(_) => {
                let free = w.bounded(slots.acquire()).await?.expect("the call slots are never closed");
                if limited && self.sabotage.has(Sabotage::SlotKeptForToken) {
                    // Deliberately wrong: a second token waited for while holding the slot.
                    w.bounded(self.rate_token()).await?;
                }
                free
            }
        };
        Ok(Ok(Turn { svc, token, slot }))
    }

    /// The request with its bearer token, signed last, just before it leaves:
    /// a signature's timestamp must not have aged in the waits (receivers
    /// allow minutes, leases may be longer).
    fn authorize(
        &self,
        mut req: reqwest::Request,
        token: Option<&super::auth::Token>,
        message_id: &str,
    ) -> Result<reqwest::Request, CallResult> {
        if let Some(t) = token {
            let header = t.header().map_err(|why| unauthenticated(why, None))?;
            req.headers_mut().insert(AUTHORIZATION, header);
        }
        self.sign(&mut req, message_id).map_err(inexpressible)?;
        Ok(req)
    }

    /// Send the request, if it can still leave by the deadline; after a 401
    /// to an OAuth2 token the provider no longer takes (revoked, or expired
    /// early), once more with a new token, within the same bound: a 401 then
    /// counts as the answer. The first 401 means not applied, so an attempt
    /// that cannot go on is retried.
    async fn send_once<'s>(
        &self,
        turn: Turn<'s>,
        req: reqwest::Request,
        message_id: &str,
        w: &Waits<'_>,
    ) -> Result<Result<Sent<'s>, CallResult>, NotSent> {
        let Turn { mut svc, token, slot } = turn;
        // Kept to be sent once more, with a new token, after a 401.
        let again = token.as_ref().and_then(|_| req.try_clone());
        if tokio::time::Instant::now() > w.send_by {
            return Err(NotSent);
        }
        let at = tokio::time::Instant::now();
        let started_at = Some(chrono::Utc::now());
        let response = svc.call(req).await;
        let unauthorized = matches!(&response, Ok(r) if r.status() == reqwest::StatusCode::UNAUTHORIZED);
        if let (Some(o), Some(used), true) = (&self.oauth2, &token, unauthorized) {
            o.refused(used).await;
        }
        let (Some(o), Some(mut again), true) = (&self.oauth2, again, unauthorized) else {
            return Ok(Ok(Sent { response, at, started_at, _slot: slot }));
        };
        let refused = |why: &str| unauthenticated(format!("HTTP 401 with the cached token; {why}"), started_at);
        let fresh = match w.bounded(o.token()).await {
            Ok(Ok(t)) => t,
            Ok(Err(why)) => return Ok(Err(refused(&why))),
            Err(NotSent) => return Ok(Err(refused("no new token by the lease's deadline"))),
        };
        match fresh.header() {
            Ok(v) => again.headers_mut().insert(AUTHORIZATION, v),
            Err(why) => return Ok(Err(refused(&why))),
        };
        if let Err(why) = self.sign(&mut again, message_id) {
            return Ok(Err(refused(&why)));
        }
        let mut svc = match w.bounded(self.svc.clone().ready_oneshot()).await {
            Ok(Ok(svc)) => svc,
            Ok(Err(e)) => return Ok(Err(classify_transport(e, self.cfg.timeout, started_at))),
            Err(NotSent) => return Ok(Err(refused("not sent again by the lease's deadline"))),
        };
        if tokio::time::Instant::now() > w.send_by {
            return Ok(Err(refused("not sent again by the lease's deadline")));
        }
        let at = tokio::time::Instant::now();
        Ok(Ok(Sent { response: svc.call(again).await, at, started_at, _slot: slot }))
    }

    /// What the provider answered: its status, `Retry-After`, what the
    /// profile reads about the key, and as much of the body and headers as
    /// the caller keeps (`keep_body`) or the error's text needs, read within
    /// the response's timeout from `sent_at`.
    async fn read_answer(
        &self,
        resp: reqwest::Response,
        sent_at: tokio::time::Instant,
        started_at: Option<chrono::DateTime<chrono::Utc>>,
        keep_body: usize,
    ) -> CallResult {
        let status = resp.status().as_u16();
        if let (Some(a), 429 | 503) = (&self.adaptive, status) {
            a.throttled();
        }
        let retry_after = resp
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, chrono::Utc::now()));
        let success = resp.status().is_success();
        // An error's headline, with where a redirect would have gone.
        let headline = (!success).then(|| {
            let reason = resp.status().canonical_reason().unwrap_or("");
            let redirect = resp
                .status()
                .is_redirection()
                .then(|| resp.headers().get(reqwest::header::LOCATION))
                .flatten()
                .map(|l| format!(" (redirect to {:?} not followed)", String::from_utf8_lossy(l.as_bytes())));
            (format!("HTTP {status} {reason}"), redirect.unwrap_or_default())
        });
        let headers = if keep_body > 0 { kept_headers(resp.headers()) } else { Vec::new() };
        // Within the same timeout as the response, not a second one; an
        // error's start for its text, further when the profile looks into
        // it or the caller keeps it.
        let reads = self.profile.reads_body(status);
        let limit = match (success, reads) {
            (true, _) => keep_body,
            (false, true) => KEY_ANSWER_BYTES.max(keep_body),
            (false, false) => ERROR_BODY_BYTES.max(keep_body),
        };
        // What arrived by the deadline is kept, even if the rest never
        // comes; one byte more than kept tells a body that was longer.
        let mut body = Vec::new();
        let mut complete = false;
        if limit > 0 {
            let read = body_start(resp, limit + 1, &mut body);
            complete = tokio::time::timeout_at(sent_at + self.cfg.timeout, read).await.unwrap_or(false);
            if body.len() > limit {
                body.truncate(limit);
                complete = false;
            }
        }
        // Deliberately wrong when sabotaged: what the profile says of keys ignored.
        let ignored = self.sabotage.has(Sabotage::KeyAnswersIgnored);
        let mut key = None;
        let error = headline.map(|(headline, redirect)| {
            let json = reads.then(|| serde_json::from_slice(&body).ok()).flatten();
            key = self.profile.key_answer(status, json.as_ref()).filter(|_| !ignored);
            let snippet = text(&body[..body.len().min(ERROR_BODY_BYTES)]);
            format!("{headline}: {redirect}{snippet}").trim_end_matches([' ', ':']).to_owned()
        });
        let class = if key == Some(KeyAnswer::Mismatch) { ErrorClass::KeyMismatch } else { ErrorClass::HttpStatus };
        CallResult {
            attempt: AttemptResult::Response { status, retry_after, key },
            status: Some(status),
            error_class: error.as_ref().map(|_| class),
            error,
            started_at,
            body_complete: complete && body.len() <= keep_body,
            body: (keep_body > 0).then_some(body),
            headers,
        }
    }
}

/// The bounds of every wait before a request is sent: `send_by`, or `stop`.
struct Waits<'a> {
    send_by: tokio::time::Instant,
    stop: &'a tokio_util::sync::CancellationToken,
}

impl Waits<'_> {
    /// `wait`, unless the deadline passes or the dispatcher stops first.
    async fn bounded<T>(&self, wait: impl std::future::Future<Output = T>) -> Result<T, NotSent> {
        tokio::select! {
            done = tokio::time::timeout_at(self.send_by, wait) => done.map_err(|_| NotSent),
            _ = self.stop.cancelled() => Err(NotSent),
        }
    }
}

/// A call whose turn came: the endpoint's permit (in its ready service), its
/// OAuth2 token if it has one, and a call slot, held until it is sent.
struct Turn<'s> {
    svc: HttpService,
    token: Option<super::auth::Token>,
    slot: tokio::sync::SemaphorePermit<'s>,
}

/// A request sent: its response or transport error, when it left, and its
/// call slot, held until the answer is read.
struct Sent<'s> {
    response: Result<reqwest::Response, BoxError>,
    at: tokio::time::Instant,
    started_at: Option<chrono::DateTime<chrono::Utc>>,
    _slot: tokio::sync::SemaphorePermit<'s>,
}

/// A signature's message id (Standard Webhooks `webhook-id`): the
/// idempotency key, the same on every attempt and across versions of relay
/// (receivers deduplicate on it: one changed between two attempts would be
/// taken as a new message), else the intent's id. An application's keys
/// are stored as `app:KEY`, which no route key may start with, so an
/// application cannot choose the id of a route's call. An empty key is no
/// key: as an id it would make every such message one.
fn message_id(request: &Request<'_>) -> String {
    request.idempotency_key.filter(|k| !k.is_empty()).map_or_else(|| request.intent_id.to_string(), str::to_owned)
}

/// The HTTP client settings of endpoint `name` but for redirects: timeouts,
/// pool, user agent, and its TLS (`[endpoints.NAME.tls]`).
fn client_builder(name: &str, cfg: &EndpointConfig) -> anyhow::Result<reqwest::ClientBuilder> {
    let b = reqwest::Client::builder()
        .connect_timeout(cfg.connect_timeout)
        .pool_max_idle_per_host(cfg.concurrency)
        .user_agent(concat!("relay/", env!("CARGO_PKG_VERSION")));
    relay_registry::with_tls(b, &format!("endpoints.{name}.tls"), &cfg.tls)
}

/// Read the first `limit` bytes of a response's body into `kept`; the rest
/// is never read (a provider streaming gigabytes of error page costs one
/// chunk, not the whole stream). Into a buffer of the caller's, so that
/// what arrived before a deadline cut this short is kept. True when the
/// body ended within `limit`.
async fn body_start(mut resp: reqwest::Response, limit: usize, kept: &mut Vec<u8>) -> bool {
    while kept.len() < limit {
        match resp.chunk().await {
            Ok(Some(chunk)) => kept.extend_from_slice(&chunk[..chunk.len().min(limit - kept.len())]),
            Ok(None) => return true,
            Err(_) => return false,
        }
    }
    false
}

/// The headers kept with an answer's body ([`CallResult::headers`]).
fn kept_headers(headers: &reqwest::header::HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(name, v)| *name != reqwest::header::SET_COOKIE && v.len() <= KEPT_HEADER_BYTES)
        .take(KEPT_HEADERS)
        .map(|(name, v)| (name.as_str().to_owned(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
        .collect()
}

/// Bytes as text for an attempt's error. PostgreSQL text cannot hold NUL:
/// an error body with one would make the attempt's outcome unrecordable
/// (rescued, called again, uncertain).
fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).replace('\0', "\u{FFFD}")
}

/// Request headers an application's `relay.call` may not set, lower-case (a
/// trailing `*` is a prefix): those relay or its HTTP client set on every
/// call (a second value would go beside relay's, or replace it), and those
/// some servers and proxies take to re-route a request past the
/// endpoint's `base_url`. Hop-by-hop and framing headers are the client's;
/// signing adds `webhook-*` or `authorization` and `x-amz-*`; an OAuth2
/// token is an `authorization`.
pub const RESERVED_HEADERS: &[&str] = &[
    "host",
    "authorization",
    "proxy-authorization",
    "content-type",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "user-agent",
    "accept",
    "accept-encoding",
    "traceparent",
    "tracestate",
    "x-correlation-id",
    "x-relay-*",
    "webhook-*",
    "x-amz-*",
    "forwarded",
    "x-forwarded-*",
    "x-original-url",
    "x-rewrite-url",
    "x-http-method",
    "x-http-method-override",
    "x-method-override",
];

/// The request headers an application may not set on `cfg`'s calls:
/// [`RESERVED_HEADERS`], the endpoint's key header and its static headers;
/// lower-case, a trailing `*` a prefix.
pub fn reserved_headers(cfg: &EndpointConfig) -> Vec<String> {
    let mut names: Vec<String> = RESERVED_HEADERS.iter().map(|h| (*h).to_owned()).collect();
    if let KeyPlacement::Header(h) = &cfg.profile().key {
        names.push(h.to_ascii_lowercase());
    }
    names.extend(cfg.headers.keys().map(|h| h.to_ascii_lowercase()));
    names.sort();
    names.dedup();
    names
}

/// Whether `name` is one of `reserved` (see [`reserved_headers`]).
pub fn is_reserved(reserved: &[String], name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    reserved.iter().any(|r| match r.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == *r,
    })
}

/// Put `key` at the dotted `field` of a JSON object body, making the
/// objects on the way; a body that is not an object cannot carry it.
fn put_field(body: &mut serde_json::Value, field: &str, key: &str) -> Result<(), String> {
    let mut at = body;
    let mut parts = field.split('.').peekable();
    while let Some(part) = parts.next() {
        let obj = at.as_object_mut().ok_or_else(|| {
            format!("the idempotency key goes in the body field {field:?}, but the body there is not a JSON object")
        })?;
        if parts.peek().is_none() {
            obj.insert(part.to_owned(), serde_json::Value::String(key.to_owned()));
            return Ok(());
        }
        at = obj.entry(part).or_insert_with(|| serde_json::json!({}));
    }
    Ok(())
}

/// How much of an error response's body is kept for the attempt's error.
pub const ERROR_BODY_BYTES: usize = 256;

/// How much of an error response's body is read when the profile looks
/// into it for what it says about the key (Stripe's `error.type` comes
/// after a long message).
pub const KEY_ANSWER_BYTES: usize = 16 * 1024;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn an_endpoint_ca_file_without_a_certificate_is_refused_naming_the_key_and_the_file() {
        let path = std::env::temp_dir().join(format!("relay-empty-ca-{}.pem", std::process::id()));
        std::fs::write(&path, "not a certificate\n").unwrap();
        let cfg: EndpointConfig = serde_json::from_value(serde_json::json!({
            "base_url": "https://provider.test/api/",
            "tls": {"ca_file": path},
        }))
        .unwrap();
        let err = EndpointClient::new("psp", &cfg, Sabotaged::default()).unwrap_err().to_string();
        assert!(err.contains("endpoints.psp.tls.ca_file") && err.contains("holds no PEM certificate"), "{err}");
        std::fs::remove_file(&path).unwrap();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn rate_tokens_go_to_calls_in_the_order_they_asked() {
        let cfg: EndpointConfig = serde_json::from_value(
            serde_json::json!({"base_url": "http://provider.test/api/", "rate_limit_per_second": 200}),
        )
        .unwrap();
        let client = EndpointClient::new("psp", &cfg, Sabotaged::default()).unwrap();
        let passed = Arc::new(std::sync::Mutex::new(Vec::new()));
        // Spawned in order on one thread: each asks in its first poll, in
        // spawn order, before the next runs.
        let calls: Vec<_> = (0..30)
            .map(|n| {
                let (client, passed) = (client.clone(), passed.clone());
                tokio::spawn(async move {
                    client.rate_token().await;
                    passed.lock().unwrap().push(n);
                })
            })
            .collect();
        for c in calls {
            c.await.unwrap();
        }
        let passed = passed.lock().unwrap().clone();
        assert_eq!(passed, (0..30).collect::<Vec<_>>(), "tokens in the order asked");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn calls_in_line_take_an_adaptive_rate_that_rose_while_they_waited() {
        let adaptive = serde_json::json!({"start": 2.0, "min": 1.0, "max": 1000.0, "increase": 1.0, "decrease": 0.5});
        let cfg: EndpointConfig =
            serde_json::from_value(serde_json::json!({"base_url": "http://provider.test/api/", "adaptive": adaptive}))
                .unwrap();
        let client = EndpointClient::new("psp", &cfg, Sabotaged::default()).unwrap();
        client.rate_token().await; // the one token a fresh limiter has
        let started = std::time::Instant::now();
        let calls: Vec<_> = (0..6)
            .map(|_| {
                let client = client.clone();
                tokio::spawn(async move { client.rate_token().await })
            })
            .collect();
        tokio::task::yield_now().await; // all six in line, the first waiting at 2/s
        client.adaptive().unwrap().set(1000.0);
        for c in calls {
            c.await.unwrap();
        }
        // The first waits out its 0.5 s at the old rate; the five behind it
        // take the new one. Read before queueing, they would wait 0.5 s each.
        let took = started.elapsed();
        assert!(took < Duration::from_millis(1500), "six tokens took {took:?}");
    }

    fn client() -> EndpointClient {
        let cfg: EndpointConfig = serde_json::from_value(serde_json::json!({"base_url": "http://provider.test/api/"}))
            .expect("an endpoint with defaults");
        EndpointClient::new("psp", &cfg, Sabotaged::default()).unwrap()
    }

    fn request<'a>(headers: &'a serde_json::Value, body: Option<&'a serde_json::Value>) -> Request<'a> {
        Request {
            method: "POST",
            path: "/captures/o-1",
            body,
            headers,
            idempotency_key: Some("capture:o-1"),
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            correlation_id: Some("corr-1"),
            intent_id: uuid::Uuid::nil(),
            attempt: 3,
            keep_body: 0,
        }
    }

    #[tokio::test]
    async fn a_request_carries_the_key_the_trace_and_the_intent_on_the_endpoint_url() {
        let headers = serde_json::json!({"x-tenant": "t-1"});
        let body = serde_json::json!({"amount": 5});
        let req = client().request(request(&headers, Some(&body))).unwrap();
        assert_eq!(req.method(), reqwest::Method::POST);
        assert_eq!(req.url().as_str(), "http://provider.test/api/captures/o-1", "one slash between base and path");
        let h = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        assert_eq!(h("idempotency-key").as_deref(), Some("capture:o-1"));
        assert_eq!(h("traceparent").as_deref(), Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
        assert_eq!(h("x-correlation-id").as_deref(), Some("corr-1"));
        assert_eq!(h("x-relay-attempt").as_deref(), Some("3"));
        assert_eq!(h("x-tenant").as_deref(), Some("t-1"));
        assert_eq!(req.body().and_then(|b| b.as_bytes()), Some(&br#"{"amount":5}"#[..]));
    }

    // An application's call queued before the endpoint got a credential
    // header of its own: sent as queued, it carried two values of it.
    #[tokio::test]
    async fn a_call_s_own_header_reserved_by_its_endpoint_since_is_not_sent() {
        let cfg: EndpointConfig = serde_json::from_value(serde_json::json!({
            "base_url": "http://provider.test/api/", "headers": {"X-Api-Key": "from-the-endpoint"},
        }))
        .unwrap();
        let headers = serde_json::json!({"x-api-key": "from-the-call", "x-tenant": "t-1"});
        let req =
            EndpointClient::new("psp", &cfg, Sabotaged::default()).unwrap().request(request(&headers, None)).unwrap();
        let values = |name: &str| -> Vec<String> {
            req.headers().get_all(name).iter().map(|v| v.to_str().unwrap().to_owned()).collect()
        };
        assert_eq!(values("x-api-key"), ["from-the-endpoint"]);
        assert_eq!(values("x-tenant"), ["t-1"]);
    }

    #[tokio::test]
    async fn every_header_relay_puts_on_a_request_is_reserved_from_applications() {
        let none = serde_json::json!({});
        let body = serde_json::json!({"amount": 5});
        // Secrets from variables every environment has: only the headers matter.
        let endpoints = [
            serde_json::json!({"profile": "paypal", "headers": {"X-Api-Version": "2"}}),
            serde_json::json!({"signing": {"scheme": "aws_sigv4", "region": "eu-west-1", "service": "execute-api",
                "access_key_id_env": "PATH", "secret_access_key_env": "PATH", "session_token_env": "PATH"}}),
            serde_json::json!({"token_env": "PATH", "idempotency": {"header": "X-Request-Id"}}),
            serde_json::json!({}),
        ];
        for endpoint in endpoints {
            let mut e = serde_json::json!({"base_url": "http://provider.test/api/"});
            e.as_object_mut().unwrap().extend(endpoint.as_object().unwrap().clone());
            let cfg: EndpointConfig = serde_json::from_value(e).unwrap();
            let mut client = EndpointClient::new("psp", &cfg, Sabotaged::default()).unwrap();
            if cfg.signing.is_none() && cfg.token_env.is_none() && cfg.profile.is_none() {
                let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
                let hooks =
                    super::super::auth::Signer::StandardWebhooks(standardwebhooks::Webhook::new(secret).unwrap());
                client.signer = Some(Arc::new(hooks));
            }
            let mut req = client.request(request(&none, Some(&body))).unwrap();
            if let Some(signer) = &client.signer {
                signer.sign(&mut req, "capture:o-1").unwrap();
            }
            let reserved = reserved_headers(&cfg);
            for name in req.headers().keys() {
                assert!(is_reserved(&reserved, name.as_str()), "{endpoint}: relay sets {name}, not in {reserved:?}");
            }
        }
        let plain: EndpointConfig =
            serde_json::from_value(serde_json::json!({"base_url": "http://provider.test/"})).unwrap();
        assert!(!is_reserved(&reserved_headers(&plain), "X-Tenant"));
        // Added when the request is sent, not built: the client's user agent
        // and content negotiation, an OAuth2 token; and headers that re-route.
        for name in ["User-Agent", "Accept", "Accept-Encoding", "Authorization", "X-Original-URL", "X-Forwarded-Host"] {
            assert!(is_reserved(&reserved_headers(&plain), name), "{name}");
        }
        assert!(
            is_reserved(&reserved_headers(&plain), "Idempotency-Key")
                && is_reserved(&reserved_headers(&plain), "X-Relay-Forged")
        );
    }

    fn client_with(endpoint: serde_json::Value) -> EndpointClient {
        let mut e = serde_json::json!({"base_url": "http://provider.test/api/"});
        e.as_object_mut().unwrap().extend(endpoint.as_object().unwrap().clone());
        EndpointClient::new("psp", &serde_json::from_value(e).unwrap(), Sabotaged::default()).unwrap()
    }

    #[tokio::test]
    async fn a_profile_puts_the_key_in_its_header_in_a_body_field_or_nowhere() {
        let none = serde_json::json!({});
        let body = serde_json::json!({"amount": 5, "meta": {"tenant": "t-1"}});
        let paypal = client_with(serde_json::json!({"profile": "paypal"}));
        let req = paypal.request(request(&none, Some(&body))).unwrap();
        assert_eq!(req.headers().get("paypal-request-id").unwrap(), "capture:o-1");
        assert!(req.headers().get("idempotency-key").is_none());

        let in_body = client_with(serde_json::json!({"idempotency": {"body_field": "meta.idempotency_key"}}));
        let req = in_body.request(request(&none, Some(&body))).unwrap();
        let sent: serde_json::Value = serde_json::from_slice(req.body().unwrap().as_bytes().unwrap()).unwrap();
        assert_eq!(sent, serde_json::json!({"amount": 5, "meta": {"tenant": "t-1", "idempotency_key": "capture:o-1"}}));
        assert!(req.headers().get("idempotency-key").is_none());
        let list = serde_json::json!([1, 2]);
        let err = in_body.request(request(&none, Some(&list))).unwrap_err();
        assert!(err.contains("not a JSON object"), "{err}");

        let keyless = client_with(serde_json::json!({"profile": "none"}));
        let req = keyless.request(request(&none, Some(&body))).unwrap();
        assert!(req.headers().get("idempotency-key").is_none());

        let adyen = client_with(serde_json::json!({"profile": "adyen"}));
        let long = "k".repeat(65);
        let err = adyen.request(Request { idempotency_key: Some(&long), ..request(&none, None) }).unwrap_err();
        assert!(err.contains("at most 64"), "{err}");
    }

    #[test]
    fn a_signature_s_message_id_is_the_key_every_attempt_sends() {
        let none = serde_json::json!({});
        let r = Request { intent_id: uuid::Uuid::from_u128(7), ..request(&none, None) };
        assert_eq!(message_id(&r), "capture:o-1");
        let keyless = Request { idempotency_key: None, ..r };
        assert_eq!(message_id(&keyless), "00000000-0000-0000-0000-000000000007");
    }

    #[tokio::test]
    async fn a_request_that_cannot_be_expressed_says_why() {
        let headers = serde_json::json!({"bad header": "x"});
        let err = client().request(request(&headers, None)).unwrap_err();
        assert!(err.contains("header name \"bad header\""), "{err}");
        let none = serde_json::json!({});
        let err = client().request(Request { method: "PO ST", ..request(&none, None) }).unwrap_err();
        assert!(err.contains("method"), "{err}");
    }
}
