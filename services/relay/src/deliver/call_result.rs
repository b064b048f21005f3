//! What one attempt at a call produced ([`CallResult`]), and how an answer
//! that never came is classified: a timeout may have been applied, a refused
//! connection or handshake was not.

use std::time::Duration;

use relay_core::retry::{AttemptResult, ErrorClass};
use tower::BoxError;

/// What one attempt produced, for classification, the audit row and the log.
#[derive(Debug, Clone)]
pub struct CallResult {
    /// For [`relay_core::retry::classify`].
    pub attempt: AttemptResult,
    /// HTTP status, if the provider answered.
    pub status: Option<u16>,
    /// What went wrong, for the audit row.
    pub error_class: Option<ErrorClass>,
    /// Short error text (a status line and at most 256 bytes of the response body).
    pub error: Option<String>,
    /// When the request was handed to the HTTP client (`None`: never sent).
    pub started_at: Option<chrono::DateTime<chrono::Utc>>,
    /// The start of the answer's body, whatever its status, when the
    /// request asked for it ([`super::http::Request::keep_body`]).
    pub body: Option<Vec<u8>>,
    /// Whether `body` is the whole body: not cut at the limit, nor by the
    /// deadline.
    pub body_complete: bool,
    /// The answer's headers when the request asked for its body (at most
    /// [`KEPT_HEADERS`], none longer than [`KEPT_HEADER_BYTES`], never
    /// `Set-Cookie`).
    pub headers: Vec<(String, String)>,
}

/// How many of an answer's headers are kept with its body.
pub const KEPT_HEADERS: usize = 64;
/// The longest header value kept with an answer's body.
pub const KEPT_HEADER_BYTES: usize = 1024;

impl CallResult {
    /// A result for an attempt that made no request.
    pub fn not_sent() -> CallResult {
        CallResult {
            attempt: AttemptResult::Connect,
            status: None,
            error_class: None,
            error: None,
            started_at: None,
            body: None,
            body_complete: false,
            headers: Vec::new(),
        }
    }
}

/// The request was not sent: it could not start in time to end within the lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotSent;

/// A request that cannot be expressed (a bad header, a signing failure):
/// never sent, as permanent as a 400.
pub(super) fn inexpressible(why: String) -> CallResult {
    CallResult {
        attempt: AttemptResult::Response { status: 400, retry_after: None, key: None },
        status: None,
        error_class: Some(ErrorClass::Request),
        error: Some(why),
        ..CallResult::not_sent()
    }
}

/// An attempt that could not authenticate: retried, as nothing was applied
/// (no token, so not sent; or a 401, which is a refusal).
pub(super) fn unauthenticated(why: String, started_at: Option<chrono::DateTime<chrono::Utc>>) -> CallResult {
    CallResult {
        attempt: AttemptResult::Connect,
        error_class: Some(ErrorClass::Connect),
        error: Some(why),
        started_at,
        ..CallResult::not_sent()
    }
}

/// What a transport error (no answer) says about an attempt sent within
/// `timeout`.
pub(super) fn classify_transport(
    e: BoxError,
    timeout: Duration,
    started_at: Option<chrono::DateTime<chrono::Utc>>,
) -> CallResult {
    let (attempt, class, text) = if e.is::<tower::timeout::error::Elapsed>() {
        (
            AttemptResult::Timeout { sent: true },
            ErrorClass::Timeout,
            format!("no response within {timeout:?}; the request may have been applied (uncertain)"),
        )
    } else if let Some(re) = e.downcast_ref::<reqwest::Error>() {
        if refused_handshake(re) {
            // TLS 1.3 clients send the request before the server has checked
            // their certificate, so this is not a connect error to reqwest;
            // but a server that refuses the handshake processes nothing.
            let why =
                format!("the server refused the TLS handshake (client certificate?): {}", relay_core::error_chain(re));
            (AttemptResult::Connect, ErrorClass::Connect, format!("could not connect: {why}"))
        } else if re.is_connect() {
            (AttemptResult::Connect, ErrorClass::Connect, format!("could not connect: {}", relay_core::error_chain(re)))
        } else if re.is_timeout() {
            (
                AttemptResult::Timeout { sent: true },
                ErrorClass::Timeout,
                format!("timed out: {}", relay_core::error_chain(re)),
            )
        } else {
            (
                AttemptResult::Transport,
                ErrorClass::Transport,
                format!("transport error: {}", relay_core::error_chain(re)),
            )
        }
    } else {
        (AttemptResult::Transport, ErrorClass::Transport, format!("transport error: {e}"))
    };
    CallResult {
        attempt,
        status: None,
        error_class: Some(class),
        error: Some(text),
        started_at,
        ..CallResult::not_sent()
    }
}

/// Whether `e` carries a TLS alert only a handshake sends (the server
/// refused our certificate, or the handshake itself): the request was never
/// processed, whatever reached the socket. rustls clients support neither
/// renegotiation nor post-handshake authentication, so such an alert can
/// only answer the connection's handshake. rustls errors travel inside
/// `io::Error`s, whose `source` skips them, so those are opened too.
fn refused_handshake(e: &(dyn std::error::Error + 'static)) -> bool {
    use rustls::AlertDescription as A;
    let mut cur = Some(e);
    while let Some(err) = cur {
        let tls = err.downcast_ref::<rustls::Error>().or_else(|| {
            err.downcast_ref::<std::io::Error>().and_then(std::io::Error::get_ref).and_then(|i| i.downcast_ref())
        });
        if let Some(rustls::Error::AlertReceived(alert)) = tls
            && matches!(
                alert,
                A::CertificateRequired
                    | A::BadCertificate
                    | A::UnsupportedCertificate
                    | A::CertificateRevoked
                    | A::CertificateExpired
                    | A::CertificateUnknown
                    | A::UnknownCA
                    | A::HandshakeFailure
            )
        {
            return true;
        }
        cur = err.source();
    }
    false
}
