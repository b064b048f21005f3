//! The admin server's socket: connections limited in number, time to send
//! headers, time to be answered and lifetime; and the headers every answer
//! carries.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// Connections served at once; more wait in the kernel's accept queue.
const MAX_CONNECTIONS: usize = 256;
/// Connections one peer address may hold at once; more are closed at once.
/// The liveness probe comes from its node's address: one client keeping
/// every connection alive must not leave it waiting unanswered, and the
/// orchestrator restarting a healthy relay.
const MAX_PER_PEER: usize = 32;
/// A client must send its request's headers within this.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// A request must be answered within this (a bulk replay of many dead
/// letters is paged by its caller).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest a connection is served (a keep-alive one is closed when
/// idle for [`HEADER_READ_TIMEOUT`] anyway).
const CONNECTION_LIFETIME: Duration = Duration::from_secs(300);

/// Serve `app` on `listener` until `shutdown`, then let the requests in
/// flight finish (up to [`REQUEST_TIMEOUT`]). Written out instead of
/// `axum::serve`, which sets no timer, so hyper would apply no header-read
/// timeout, and which limits neither connections nor request time: a few
/// thousand connections that never finish their headers would hold file
/// descriptors and tasks for ever.
pub(super) async fn accept_loop(listener: tokio::net::TcpListener, app: Router, shutdown: CancellationToken) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use tower::ServiceExt;
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let peers: Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>> = Arc::default();
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT);
    loop {
        let slot = tokio::select! {
            _ = shutdown.cancelled() => break,
            slot = slots.clone().acquire_owned() => slot.expect("never closed"),
        };
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, addr)) => (stream, addr.ip()),
                Err(e) => {
                    // Out of file descriptors, say: wait a little rather than spin.
                    warn!(error = %e, "admin server: accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Some(peer) = PeerShare::take(&peers, peer) else {
            // Closed unserved: this peer holds its share already.
            continue;
        };
        let app = app.clone();
        let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            let app = app.clone();
            async move {
                let answer = match tokio::time::timeout(REQUEST_TIMEOUT, app.oneshot(req)).await {
                    Ok(answered) => answered.unwrap_or_else(|never| match never {}),
                    Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "the request took too long\n").into_response(),
                };
                Ok::<_, std::convert::Infallible>(answer)
            }
        });
        let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            // A client that never reads its answers would otherwise keep its
            // slot for ever: the header timeout only covers reading requests.
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, conn).await;
            drop((slot, peer));
        });
    }
    drop(listener);
    if tokio::time::timeout(REQUEST_TIMEOUT, graceful.shutdown()).await.is_err() {
        warn!("admin server: connections still open at shutdown were dropped");
    }
}

/// Headers every admin answer carries: the console runs
/// only its own script and style, is never framed (clickjacking the Replay
/// and Purge buttons), and nothing of it is cached or sniffed.
pub(super) async fn hardened(mut resp: axum::response::Response) -> axum::response::Response {
    use axum::http::HeaderValue;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; \
             frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.entry(header::CACHE_CONTROL).or_insert(HeaderValue::from_static("no-store"));
    resp
}

/// One connection counted against its peer's share, until dropped.
struct PeerShare {
    peers: Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
    peer: std::net::IpAddr,
}

impl PeerShare {
    /// A share for a connection of `peer`, if it holds fewer than [`MAX_PER_PEER`].
    fn take(
        peers: &Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
        peer: std::net::IpAddr,
    ) -> Option<PeerShare> {
        let mut held = peers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = held.entry(peer).or_default();
        if *n >= MAX_PER_PEER {
            return None;
        }
        *n += 1;
        Some(PeerShare { peers: peers.clone(), peer })
    }
}

impl Drop for PeerShare {
    fn drop(&mut self) {
        let mut held = self.peers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = held.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.peer);
            }
        }
    }
}
