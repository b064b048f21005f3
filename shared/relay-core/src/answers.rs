//! What an attempt's answer means: the one table of outcome semantics.
//!
//! Every answer an attempt can get falls into one [`Answer`] kind, and
//! [`Answer::meaning`] reads its [`Meaning`] from [`TABLE`]: whether it is
//! tried again, and whether the provider may have applied the call although
//! the answer is not a success. [`crate::retry::classify`] takes its verdicts
//! from here and nowhere else, and [`contract_table`] renders the same table,
//! per built-in profile, for docs/CONTRACT.md (a test keeps the two equal).
//!
//! "May have applied" is what matters for money: once an attempt may have
//! been applied, the intent ends `succeeded` or `uncertain`, never `dead`, so
//! no `on_dead` effect (`payment.failed`) is recorded for a call that may
//! have gone through. A 5xx is such an answer under every profile: Stripe
//! documents a 500 as indeterminate and replays it to every retry with the
//! same key, and a gateway's 502, 503 or 504 can follow a request it passed
//! on. A provider's "a request with this key is still in progress" proves
//! that a request with the key reached it.

use std::time::Duration;

use crate::profile::{KeyAnswer, Profile, ProfileName};
use crate::stored::IntentState;

/// What one attempt at an external call produced, as far as retrying cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptResult {
    /// The provider answered.
    Response {
        /// HTTP status code.
        status: u16,
        /// `Retry-After`, when present and parseable.
        retry_after: Option<Duration>,
        /// What the answer says about the idempotency key, by the
        /// endpoint's profile ([`crate::profile::Profile::key_answer`]).
        key: Option<KeyAnswer>,
    },
    /// No answer in time. `sent` is true when the request may have reached the
    /// provider (the connection was up): the outcome is then unknown.
    Timeout {
        /// Whether the request may have been delivered.
        sent: bool,
    },
    /// The connection could not be made: the request was not delivered.
    Connect,
    /// Any other transport error (reset mid-response, TLS, …): may have been delivered.
    Transport,
}

/// The kinds of answer the outcome table tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Answer {
    /// A 2xx.
    Success,
    /// The profile's "this key was used with a different request".
    KeyMismatch,
    /// The profile's "a request with this key is still in progress".
    KeyInProgress,
    /// 408, 425 or 429: the provider did not take the request on.
    Throttled,
    /// A status the endpoint retries besides those (`retryable_statuses`;
    /// 409 without a profile): a conflict, not an unknown outcome.
    AlsoRetried,
    /// A 5xx, first or replayed.
    ServerError,
    /// Any other status (3xx and 4xx): the provider's definitive refusal.
    ClientError,
    /// The request never left: the connection was refused, the name did not
    /// resolve, the TLS handshake was refused, or the timeout came first.
    NotSent,
    /// The request may have left and no answer came: a timeout after
    /// sending, a connection reset mid-exchange.
    Lost,
}

/// What an answer means for the intent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meaning {
    /// Tried again (with the same key) while the budget lasts.
    pub retried: bool,
    /// The provider may have applied the call although this is no success.
    pub may_have_applied: bool,
}

const fn meaning(retried: bool, may_have_applied: bool) -> Meaning {
    Meaning { retried, may_have_applied }
}

/// The table: every answer kind and what it means.
pub const TABLE: [(Answer, Meaning); 9] = [
    (Answer::Success, meaning(false, false)),
    (Answer::KeyMismatch, meaning(false, false)),
    (Answer::KeyInProgress, meaning(true, true)),
    (Answer::Throttled, meaning(true, false)),
    (Answer::AlsoRetried, meaning(true, false)),
    (Answer::ServerError, meaning(true, true)),
    (Answer::ClientError, meaning(false, false)),
    (Answer::NotSent, meaning(true, false)),
    (Answer::Lost, meaning(true, true)),
];

impl Answer {
    /// The kind of `result`, for an endpoint retrying `also_retry` besides
    /// the statuses every endpoint retries. The profile's key answers
    /// (already in `result`) come before the status.
    pub fn of(result: &AttemptResult, also_retry: &[u16]) -> Answer {
        match *result {
            // A 5xx before the endpoint's own list: listing one there
            // (`retryable_statuses = [502, 503]`, as other retry libraries
            // do) must not make it an answer that proves nothing was applied.
            AttemptResult::Response { status, key, .. } => match status {
                200..=299 => Answer::Success,
                _ if key == Some(KeyAnswer::Mismatch) => Answer::KeyMismatch,
                _ if key == Some(KeyAnswer::InProgress) => Answer::KeyInProgress,
                500..=599 => Answer::ServerError,
                s if also_retry.contains(&s) => Answer::AlsoRetried,
                408 | 425 | 429 => Answer::Throttled,
                _ => Answer::ClientError,
            },
            AttemptResult::Timeout { sent: false } | AttemptResult::Connect => Answer::NotSent,
            AttemptResult::Timeout { sent: true } | AttemptResult::Transport => Answer::Lost,
        }
    }

    /// What this answer means, from [`TABLE`].
    pub fn meaning(self) -> Meaning {
        TABLE.iter().find(|(a, _)| *a == self).map(|(_, m)| *m).expect("every answer kind is in the table")
    }
}

/// The statuses that may follow an applied call on an endpoint of `profile`
/// retrying `also_retry`, by [`TABLE`]: what an audit of stored attempts
/// (which keep the status, not the answer's kind) looks for.
pub fn statuses_that_may_have_applied(profile: &Profile, also_retry: &[u16]) -> Vec<u16> {
    (100..=599)
        .filter(|&status| {
            let r = AttemptResult::Response { status, retry_after: None, key: profile.key_answer(status, None) };
            Answer::of(&r, also_retry).meaning().may_have_applied
        })
        .collect()
}

/// One cell of the contract's table: what `answer` does under `profile`.
fn cell(profile: &Profile, answer: Answer) -> String {
    let m = answer.meaning();
    // Where the intent ends when this answer comes with no attempt left (or
    // at once, for an answer not retried), no earlier attempt having applied.
    let ends = match answer {
        Answer::Success => IntentState::Succeeded,
        _ if m.may_have_applied => IntentState::Uncertain,
        _ => IntentState::Dead,
    };
    match (answer, ends) {
        (Answer::Success, _) => ends.to_string(),
        (Answer::KeyMismatch, _) => format!("not retried · key used by another request · {ends}"),
        (_, IntentState::Uncertain) if !profile.resends_unknown() => {
            format!("not sent again · may have applied · {ends}")
        }
        (_, IntentState::Uncertain) => format!("retried · may have applied · {ends}"),
        _ if m.retried => format!("retried · not applied · {ends}"),
        _ => format!("not retried · not applied · {ends}"),
    }
}

/// The answers the contract's table lists, as a reader names them, each with
/// the attempt result it stands for (and for a status, a JSON body).
fn rows() -> Vec<(String, AttemptResult, Option<serde_json::Value>)> {
    let status = |s: u16| AttemptResult::Response { status: s, retry_after: None, key: None };
    let mut rows = vec![("2xx".to_string(), status(200), None)];
    for s in [400, 401, 403, 404, 409, 422, 429] {
        rows.push((s.to_string(), status(s), None));
    }
    rows.push((
        "400, `error.type` = `idempotency_error`".into(),
        status(400),
        Some(serde_json::json!({"error": {"type": "idempotency_error"}})),
    ));
    for s in [500, 502, 503, 504] {
        rows.push((format!("{s}, first or replayed"), status(s), None));
    }
    rows.push(("timeout before the request left".into(), AttemptResult::Timeout { sent: false }, None));
    rows.push(("timeout after the request left".into(), AttemptResult::Timeout { sent: true }, None));
    rows.push(("connection refused".into(), AttemptResult::Connect, None));
    rows.push(("TLS handshake refused".into(), AttemptResult::Connect, None));
    rows.push(("connection reset".into(), AttemptResult::Transport, None));
    rows
}

/// The profiles' columns: each built-in, resolved with no overrides, with
/// the statuses its endpoints retry by default.
fn columns() -> Vec<(&'static str, Profile, Vec<u16>)> {
    use ProfileName as P;
    [P::Stripe, P::Adyen, P::Paypal, P::Checkout, P::Ietf, P::Custom, P::None]
        .into_iter()
        .map(|n| {
            // As `EndpointConfig::also_retry`: 409 is "in progress" only where no profile says otherwise.
            let also = if n == P::Custom { vec![409] } else { Vec::new() };
            (n.as_str(), Profile::builtin(n), also)
        })
        .collect()
}

/// The outcome table of docs/CONTRACT.md, rendered from [`TABLE`] for each
/// built-in profile; profiles whose columns agree share one.
pub fn contract_table() -> String {
    let rows = rows();
    let mut groups: Vec<(Vec<&str>, Vec<String>)> = Vec::new();
    for (name, profile, also) in columns() {
        let cells: Vec<String> = rows
            .iter()
            .map(|(_, result, body)| {
                let result = match *result {
                    AttemptResult::Response { status, retry_after, .. } => {
                        AttemptResult::Response { status, retry_after, key: profile.key_answer(status, body.as_ref()) }
                    }
                    ref other => other.clone(),
                };
                cell(&profile, Answer::of(&result, &also))
            })
            .collect();
        match groups.iter_mut().find(|(_, c)| *c == cells) {
            Some((names, _)) => names.push(name),
            None => groups.push((vec![name], cells)),
        }
    }
    let mut out = String::from("| answer |");
    for (names, _) in &groups {
        out.push_str(&format!(" {} |", names.join(", ")));
    }
    out.push_str("\n|---|");
    out.push_str(&"---|".repeat(groups.len()));
    out.push('\n');
    for (i, (label, _, _)) in rows.iter().enumerate() {
        out.push_str(&format!("| {label} |"));
        for (_, cells) in &groups {
            out.push_str(&format!(" {} |", cells[i]));
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_answer_kind_has_one_meaning() {
        for (i, (a, _)) in TABLE.iter().enumerate() {
            assert!(TABLE[i + 1..].iter().all(|(b, _)| b != a), "{a:?} twice");
        }
    }

    #[test]
    fn the_contract_s_outcome_table_is_the_code_s() {
        let doc = include_str!("../../../docs/CONTRACT.md");
        let (start, end) = ("<!-- outcome-table:start -->\n", "<!-- outcome-table:end -->");
        let from = doc.find(start).expect("docs/CONTRACT.md marks its outcome table") + start.len();
        let to = doc[from..].find(end).expect("the outcome table's end marker") + from;
        let table = contract_table();
        assert_eq!(
            doc[from..to].trim(),
            table.trim(),
            "docs/CONTRACT.md's outcome table differs from the code's; replace it with:\n{table}"
        );
    }

    #[test]
    fn a_5xx_may_have_applied_the_call_under_every_profile() {
        for (_, profile, also) in columns() {
            for s in [500, 502, 503, 504] {
                let r = AttemptResult::Response { status: s, retry_after: None, key: profile.key_answer(s, None) };
                assert!(Answer::of(&r, &also).meaning().may_have_applied, "{:?} {s}", profile.name);
                // Also where the endpoint lists it among the statuses it retries.
                assert!(Answer::of(&r, &[409, 502, 503, 504]).meaning().may_have_applied, "{:?} {s}", profile.name);
            }
        }
    }
}
