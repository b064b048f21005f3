//! Provider profiles: where a provider wants the idempotency key, how long
//! it remembers one, and what its answers about a key mean.
//!
//! An endpoint names a built-in [`ProfileName`] (`profile = "stripe"`) and
//! may override any part under `[endpoints.NAME.idempotency]`
//! ([`KeyOverrides`]); [`Profile::resolve`] makes the one value the
//! dispatcher, the router and the checks read. The figures are the
//! providers' public documentation (December 2026); where a provider does not
//! document something (a key length, a window) the profile leaves it unset
//! rather than guess, and the checks say so.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::stored::stored_names;

/// A built-in profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProfileName {
    /// Stripe: `Idempotency-Key` (≤ 255 characters), kept at least 24 h;
    /// `409` while a request with the key is in progress; `400` with
    /// `error.type = "idempotency_error"` when the key was used with other
    /// parameters.
    Stripe,
    /// Adyen: `Idempotency-Key` (≤ 64 characters), kept at least 31 days.
    Adyen,
    /// PayPal: `PayPal-Request-Id` (≤ 108 characters in the Orders v2
    /// reference). How long it is kept depends on the API (Orders v2: 6 h,
    /// the shortest documented, is the default here; set
    /// `idempotency.window` for an API that keeps it longer).
    Paypal,
    /// Checkout.com: `Cko-Idempotency-Key`, kept 24 h by default in
    /// production; concurrent requests with one key get `429` (retried like
    /// any 429).
    Checkout,
    /// The IETF `Idempotency-Key` header draft: `409` while in progress,
    /// `422` when the key was used with another request body. The draft
    /// leaves the window to the server: set `idempotency.window`.
    Ietf,
    /// A provider without idempotency keys (most e-mail and SMS APIs): no
    /// key is sent, and an attempt whose outcome is unknown is never sent
    /// again blindly — the intent waits, uncertain, for an operator.
    None,
    /// Nothing built in: a key in `Idempotency-Key`, no window, no answers
    /// of its own; say the rest under `[endpoints.NAME.idempotency]`.
    Custom,
}

impl ProfileName {
    /// The configured name.
    pub fn as_str(self) -> &'static str {
        match self {
            ProfileName::Stripe => "stripe",
            ProfileName::Adyen => "adyen",
            ProfileName::Paypal => "paypal",
            ProfileName::Checkout => "checkout",
            ProfileName::Ietf => "ietf",
            ProfileName::None => "none",
            ProfileName::Custom => "custom",
        }
    }
}

/// Overrides of a profile (`[endpoints.NAME.idempotency]`): each one set
/// replaces the profile's value.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KeyOverrides {
    /// The header carrying the key.
    pub header: Option<String>,
    /// A field of the JSON body carrying the key instead of a header
    /// (dotted for nested objects: `meta.idempotency_key`).
    pub body_field: Option<String>,
    /// The longest key the provider accepts, in characters.
    pub max_length: Option<usize>,
    /// How long the provider remembers a key after its first use.
    #[serde(default, with = "humantime_serde::option")]
    pub window: Option<Duration>,
    /// Statuses meaning "a request with this key is still being processed":
    /// retried later; the call may have been applied.
    pub in_progress: Option<Vec<u16>>,
    /// Answers meaning "this key was used with a different request": never
    /// retried, the intent dead (a bug upstream: two calls share a key).
    pub mismatch: Option<Vec<AnswerRule>>,
}

/// An answer of a given meaning: a status, and optionally something at a
/// JSON Pointer of the body (the string `equals`, or anything).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AnswerRule {
    /// HTTP status.
    pub status: u16,
    /// A JSON Pointer (RFC 6901) into the response body, e.g. `/error/type`.
    pub pointer: Option<String>,
    /// The value that must be there (a string, a number, a boolean).
    pub equals: Option<serde_json::Value>,
    /// Whether what is there must be empty (`true`: an empty list, object
    /// or string, or null; `false`: anything else).
    pub empty: Option<bool>,
}

impl AnswerRule {
    /// Whether an answer with `status` and JSON `body` is this one.
    pub fn matches(&self, status: u16, body: Option<&serde_json::Value>) -> bool {
        if self.status != status {
            return false;
        }
        let Some(ptr) = &self.pointer else { return true };
        let Some(found) = body.and_then(|b| b.pointer(ptr)) else { return false };
        let empty = match found {
            serde_json::Value::Null => true,
            serde_json::Value::Array(a) => a.is_empty(),
            serde_json::Value::Object(o) => o.is_empty(),
            serde_json::Value::String(s) => s.is_empty(),
            _ => false,
        };
        self.equals.as_ref().is_none_or(|want| found == want) && self.empty.is_none_or(|e| e == empty)
    }

    /// The problems of this rule at `at`.
    pub fn problems(&self, at: &str) -> Vec<String> {
        let mut p = Vec::new();
        if self.pointer.as_deref().is_some_and(|ptr| !ptr.is_empty() && !ptr.starts_with('/')) {
            p.push(format!("{at}.pointer: a JSON Pointer starts with / (e.g. /error/type)"));
        }
        if (self.equals.is_some() || self.empty.is_some()) && self.pointer.is_none() {
            p.push(format!("{at}: equals and empty need a pointer (where in the body to look)"));
        }
        p
    }
}

/// Where the key goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPlacement {
    /// In this header.
    Header(String),
    /// In this field of the JSON body (dotted for nested objects).
    BodyField(String),
    /// Nowhere: the provider has no keys.
    Omitted,
}

/// What a provider's answer says about the key, when it says something.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyAnswer {
    /// A request with the key is still being processed.
    InProgress,
    /// The key was used with a different request.
    Mismatch,
}

/// An endpoint's profile with its overrides applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Profile {
    /// The built-in it starts from.
    pub name: ProfileName,
    /// Where the key goes.
    pub key: KeyPlacement,
    /// The longest key accepted, in characters.
    pub max_length: Option<usize>,
    /// How long the provider remembers a key; `None`: not known.
    pub window: Option<Duration>,
    /// Statuses meaning "still in progress".
    pub in_progress: Vec<u16>,
    /// Answers meaning "same key, different request".
    pub mismatch: Vec<AnswerRule>,
}

const HOUR: Duration = Duration::from_secs(3600);

impl Profile {
    /// A built-in profile as documented.
    pub fn builtin(name: ProfileName) -> Profile {
        let header = |h: &str| KeyPlacement::Header(h.to_owned());
        let base = Profile {
            name,
            key: header("Idempotency-Key"),
            max_length: None,
            window: None,
            in_progress: Vec::new(),
            mismatch: Vec::new(),
        };
        match name {
            ProfileName::Stripe => Profile {
                max_length: Some(255),
                window: Some(24 * HOUR),
                in_progress: vec![409],
                mismatch: vec![AnswerRule {
                    status: 400,
                    pointer: Some("/error/type".into()),
                    equals: Some("idempotency_error".into()),
                    empty: None,
                }],
                ..base
            },
            ProfileName::Adyen => Profile { max_length: Some(64), window: Some(31 * 24 * HOUR), ..base },
            ProfileName::Paypal => {
                Profile { key: header("PayPal-Request-Id"), max_length: Some(108), window: Some(6 * HOUR), ..base }
            }
            ProfileName::Checkout => Profile { key: header("Cko-Idempotency-Key"), window: Some(24 * HOUR), ..base },
            ProfileName::Ietf => Profile {
                in_progress: vec![409],
                mismatch: vec![AnswerRule { status: 422, pointer: None, equals: None, empty: None }],
                ..base
            },
            ProfileName::None => Profile { key: KeyPlacement::Omitted, ..base },
            ProfileName::Custom => base,
        }
    }

    /// `name` with `overrides` applied.
    pub fn resolve(name: ProfileName, overrides: &KeyOverrides) -> Profile {
        let mut p = Profile::builtin(name);
        if let Some(h) = &overrides.header {
            p.key = KeyPlacement::Header(h.clone());
        }
        if let Some(f) = &overrides.body_field {
            p.key = KeyPlacement::BodyField(f.clone());
        }
        if let Some(n) = overrides.max_length {
            p.max_length = Some(n);
        }
        if let Some(w) = overrides.window {
            p.window = Some(w);
        }
        if let Some(s) = &overrides.in_progress {
            p.in_progress = s.clone();
        }
        if let Some(m) = &overrides.mismatch {
            p.mismatch = m.clone();
        }
        p
    }

    /// Whether the provider has forgotten a key first used at `created_at`
    /// by `now`: sent again, the call would be a new request to it.
    pub fn key_forgotten(&self, created_at: chrono::DateTime<chrono::Utc>, now: chrono::DateTime<chrono::Utc>) -> bool {
        let window = self.window.and_then(|w| chrono::Duration::from_std(w).ok());
        window.is_some_and(|w| now - created_at > w)
    }

    /// Whether an attempt whose outcome is unknown may be sent again: only
    /// with a key the provider deduplicates on.
    pub fn resends_unknown(&self) -> bool {
        self.key != KeyPlacement::Omitted
    }

    /// Whether an answer with `status` is read beyond its first bytes to
    /// tell what it says about the key.
    pub fn reads_body(&self, status: u16) -> bool {
        self.mismatch.iter().any(|m| m.status == status && m.pointer.is_some())
    }

    /// What an answer with `status` and (for [`Profile::reads_body`]) its
    /// JSON `body` says about the key.
    pub fn key_answer(&self, status: u16, body: Option<&serde_json::Value>) -> Option<KeyAnswer> {
        // The mismatch rules first: they may look into the body to tell a
        // mismatch from "in progress" under one status.
        if self.mismatch.iter().any(|m| m.matches(status, body)) {
            return Some(KeyAnswer::Mismatch);
        }
        self.in_progress.contains(&status).then_some(KeyAnswer::InProgress)
    }

    /// Why `key` cannot be sent to this provider, if it cannot.
    pub fn key_refused(&self, key: &str) -> Option<String> {
        let len = key.chars().count();
        match self.max_length {
            Some(max) if len > max => Some(format!(
                "the idempotency key is {len} characters long; the provider (profile {}, or its \
                 idempotency.max_length) accepts at most {max}: shorten the key where it comes from (the call's \
                 idempotency_key template, the event's idempotencykey, or the handler)",
                self.name.as_str()
            )),
            _ if len == 0 && self.key != KeyPlacement::Omitted => {
                Some("the idempotency key is empty; the provider could not deduplicate retries".into())
            }
            _ => None,
        }
    }
}

/// How to ask a provider what became of a call whose outcome is unknown
/// (`[endpoints.NAME.reconcile]`): a lookup request, or the call itself
/// sent again with its key where the provider answers a stored result.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReconcileConfig {
    /// Lookup method.
    #[serde(default = "default_lookup_method")]
    pub method: String,
    /// Lookup path template over the intent: `intent_id`,
    /// `idempotency_key`, `endpoint`, `method`, `path`, `body`.
    pub path: Option<String>,
    /// Instead of a lookup, send the intent's own request again with its
    /// key: for providers that answer a known key with the stored result
    /// (Stripe, the IETF draft). A 2xx means it was applied.
    #[serde(default)]
    pub resend: bool,
    /// The first reconciliation this long after the intent became uncertain.
    #[serde(default = "default_reconcile_after", with = "humantime_serde")]
    pub after: Duration,
    /// Between reconciliations that learnt nothing.
    #[serde(default = "default_reconcile_interval", with = "humantime_serde")]
    pub interval: Duration,
    /// Reconciliations per uncertain intent; then it waits for an operator.
    #[serde(default = "default_reconcile_attempts")]
    pub max_attempts: u32,
    /// Answers meaning the call was applied.
    #[serde(default)]
    pub succeeded: Vec<AnswerRule>,
    /// Answers meaning it was not, so it is safe to send again.
    #[serde(default)]
    pub not_applied: Vec<AnswerRule>,
}

fn default_lookup_method() -> String {
    "GET".into()
}
fn default_reconcile_after() -> Duration {
    Duration::from_secs(30)
}
fn default_reconcile_interval() -> Duration {
    Duration::from_secs(60)
}
fn default_reconcile_attempts() -> u32 {
    5
}

stored_names! {
    /// What a reconciliation learnt (`intent_reconciliations.verdict`; a CHECK
    /// constraint holds the same names).
    pub enum Reconciled ("reconciliation verdict") {
        /// The provider applied the call.
        Succeeded = "succeeded",
        /// The provider did not apply it: it may be sent again.
        NotApplied = "not_applied",
        /// Still not known.
        Unknown = "unknown",
    }
}

impl ReconcileConfig {
    /// What an answer with `status` and JSON `body` says; `None` status: no
    /// answer (a timeout, a transport error). A resend's "in progress" is
    /// not a 2xx, so it stays unknown.
    pub fn verdict(&self, status: Option<u16>, body: Option<&serde_json::Value>) -> Reconciled {
        let Some(status) = status else { return Reconciled::Unknown };
        let any = |rules: &[AnswerRule]| rules.iter().any(|r| r.matches(status, body));
        if any(&self.succeeded) || (self.resend && (200..300).contains(&status)) {
            Reconciled::Succeeded
        } else if any(&self.not_applied) {
            Reconciled::NotApplied
        } else {
            // "Still in progress", a 5xx, anything not said: ask again later.
            Reconciled::Unknown
        }
    }

    /// The problems of endpoint `at`'s reconciliation under `profile`.
    pub fn problems(&self, at: &str, profile: &Profile) -> Vec<String> {
        let mut p = Vec::new();
        match (&self.path, self.resend) {
            (Some(_), true) => p.push(format!("{at}: path and resend = true both say how to ask; keep one")),
            (None, false) => p.push(format!(
                "{at}: say how to ask the provider: a lookup path (e.g. path = \"/v1/payments?key={{{{ idempotency_key }}}}\") \
                 or resend = true"
            )),
            (None, true) if !profile.resends_unknown() => p.push(format!(
                "{at}: resend = true sends the call again, but profile {} has no keys to deduplicate it; use a lookup path",
                profile.name.as_str()
            )),
            _ => {}
        }
        if self.path.is_some() && self.succeeded.is_empty() && self.not_applied.is_empty() {
            p.push(format!(
                "{at}: a lookup needs succeeded and/or not_applied answers (e.g. succeeded = [{{ status = 200 }}], \
                 not_applied = [{{ status = 404 }}]); every other answer leaves the intent uncertain"
            ));
        }
        if self.max_attempts == 0 {
            p.push(format!("{at}.max_attempts: must be at least 1 (or remove [{at}])"));
        }
        if http::Method::from_bytes(self.method.as_bytes()).is_err() {
            p.push(format!("{at}.method: {:?} is not an HTTP method", self.method));
        }
        if self.interval.is_zero() {
            p.push(format!("{at}.interval: must be longer than zero"));
        }
        for (i, r) in self.succeeded.iter().enumerate() {
            p.extend(r.problems(&format!("{at}.succeeded[{i}]")));
        }
        for (i, r) in self.not_applied.iter().enumerate() {
            p.extend(r.problems(&format!("{at}.not_applied[{i}]")));
        }
        p
    }
}

/// Why a replay of an intent created at `created_at`, whose attempts would
/// then run until `runs_until`, needs `--past-key-window`: the provider's
/// `window` would close before, so a later attempt could be taken for a
/// new request and applied again.
pub fn replay_past_window(
    created_at: chrono::DateTime<chrono::Utc>,
    runs_until: chrono::DateTime<chrono::Utc>,
    window: Duration,
) -> Option<String> {
    // A window too long to add to a date never closes.
    let closes = chrono::Duration::from_std(window).ok().and_then(|w| created_at.checked_add_signed(w))?;
    (runs_until > closes).then(|| {
        format!(
            "the provider remembers a key for {} after its first use (from {created_at}), so its window closes \
             at {closes}, and the replay's attempts could run until {runs_until}: an attempt after the window \
             would be taken as a new request and could be applied twice. Check with the provider that the call \
             was not applied, then replay with --past-key-window",
            humantime::format_duration(window)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn stripe_says_in_progress_with_409_and_mismatch_with_an_idempotency_error() {
        let p = Profile::builtin(ProfileName::Stripe);
        assert_eq!(p.key_answer(409, None), Some(KeyAnswer::InProgress));
        assert!(p.reads_body(400) && !p.reads_body(422));
        let mismatch = json!({"error": {"message": "Keys for idempotent requests …", "type": "idempotency_error"}});
        assert_eq!(p.key_answer(400, Some(&mismatch)), Some(KeyAnswer::Mismatch));
        let invalid = json!({"error": {"type": "invalid_request_error"}});
        assert_eq!(p.key_answer(400, Some(&invalid)), None, "an ordinary 400 is an ordinary 400");
        assert_eq!(p.key_answer(400, None), None);
        assert_eq!(p.key_answer(422, None), None);
    }

    #[test]
    fn ietf_says_in_progress_with_409_and_mismatch_with_422() {
        let p = Profile::builtin(ProfileName::Ietf);
        assert_eq!(p.key_answer(409, None), Some(KeyAnswer::InProgress));
        assert_eq!(p.key_answer(422, None), Some(KeyAnswer::Mismatch));
        assert_eq!(p.key_answer(400, None), None);
        assert_eq!(p.window, None, "the draft leaves the window to the server");
    }

    #[test]
    fn a_mismatch_rule_that_looks_into_the_body_wins_over_in_progress_under_one_status() {
        let o = KeyOverrides {
            in_progress: Some(vec![409]),
            mismatch: Some(vec![AnswerRule {
                status: 409,
                pointer: Some("/code".into()),
                equals: Some("mismatch".into()),
                empty: None,
            }]),
            ..KeyOverrides::default()
        };
        let p = Profile::resolve(ProfileName::Custom, &o);
        assert_eq!(p.key_answer(409, Some(&json!({"code": "mismatch"}))), Some(KeyAnswer::Mismatch));
        assert_eq!(p.key_answer(409, Some(&json!({"code": "busy"}))), Some(KeyAnswer::InProgress));
    }

    #[test]
    fn overrides_replace_the_profiles_parts() {
        let o = KeyOverrides {
            body_field: Some("meta.key".into()),
            window: Some(Duration::from_secs(7200)),
            in_progress: Some(vec![423]),
            ..KeyOverrides::default()
        };
        let p = Profile::resolve(ProfileName::Stripe, &o);
        assert_eq!(p.key, KeyPlacement::BodyField("meta.key".into()));
        assert_eq!(p.window, Some(Duration::from_secs(7200)));
        assert_eq!(p.key_answer(423, None), Some(KeyAnswer::InProgress));
        assert_eq!(p.key_answer(409, None), None);
        assert_eq!(p.max_length, Some(255), "what is not overridden stays");
    }

    #[test]
    fn only_a_profile_without_keys_refuses_to_resend_an_unknown_outcome() {
        assert!(!Profile::builtin(ProfileName::None).resends_unknown());
        for n in [ProfileName::Stripe, ProfileName::Adyen, ProfileName::Ietf, ProfileName::Custom] {
            assert!(Profile::builtin(n).resends_unknown(), "{n:?}");
        }
    }

    #[test]
    fn a_key_longer_than_the_provider_takes_is_refused_naming_both_lengths() {
        let adyen = Profile::builtin(ProfileName::Adyen);
        assert_eq!(adyen.key_refused(&"k".repeat(64)), None);
        let why = adyen.key_refused(&"é".repeat(65)).unwrap();
        assert!(why.contains("65 characters") && why.contains("at most 64"), "{why}");
        assert!(adyen.key_refused("").unwrap().contains("empty"));
        assert_eq!(Profile::builtin(ProfileName::None).key_refused(""), None);
    }

    fn reconcile(toml_text: &str) -> ReconcileConfig {
        toml::from_str(toml_text).unwrap()
    }

    #[test]
    fn a_lookup_s_answer_says_applied_not_applied_or_still_unknown() {
        let r = reconcile(
            "path = \"/lookup/{{ intent_id }}\"\nsucceeded = [{ status = 200, pointer = \"/state\", equals = \"applied\" }]\n\
             not_applied = [{ status = 404 }]",
        );
        let p = Profile::builtin(ProfileName::None);
        assert_eq!(r.verdict(Some(200), Some(&json!({"state": "applied"}))), Reconciled::Succeeded);
        assert_eq!(r.verdict(Some(200), Some(&json!({"state": "processing"}))), Reconciled::Unknown);
        assert_eq!(r.verdict(Some(404), None), Reconciled::NotApplied);
        assert_eq!(r.verdict(Some(503), None), Reconciled::Unknown);
        assert_eq!(r.verdict(None, None), Reconciled::Unknown, "no answer says nothing");
        assert!(r.problems("endpoints.sms.reconcile", &p).is_empty());
    }

    #[test]
    fn an_answer_rule_tells_an_empty_search_and_non_string_values() {
        let r = reconcile(
            "path = \"/v1/payment_intents?q={{ intent_id }}\"\n\
             succeeded = [{ status = 200, pointer = \"/data/0/status\", equals = \"succeeded\" }]\n\
             not_applied = [{ status = 200, pointer = \"/data\", empty = true }, { status = 200, pointer = \"/found\", equals = false }]",
        );
        assert_eq!(r.verdict(Some(200), Some(&json!({"data": []}))), Reconciled::NotApplied);
        assert_eq!(r.verdict(Some(200), Some(&json!({"data": [{"status": "succeeded"}]}))), Reconciled::Succeeded);
        assert_eq!(r.verdict(Some(200), Some(&json!({"data": [{"status": "processing"}]}))), Reconciled::Unknown);
        assert_eq!(r.verdict(Some(200), Some(&json!({"found": false}))), Reconciled::NotApplied);
        assert_eq!(r.verdict(Some(200), Some(&json!({"found": true}))), Reconciled::Unknown);
        assert_eq!(r.verdict(Some(200), None), Reconciled::Unknown, "an answer cut short or not JSON says nothing");
    }

    #[test]
    fn a_resend_s_2xx_is_the_stored_answer_of_an_applied_call() {
        let r = reconcile("resend = true");
        let p = Profile::builtin(ProfileName::Stripe);
        assert_eq!(r.verdict(Some(201), None), Reconciled::Succeeded);
        assert_eq!(r.verdict(Some(409), None), Reconciled::Unknown, "still in progress");
        assert!(r.problems("endpoints.psp.reconcile", &p).is_empty());
        let none = Profile::builtin(ProfileName::None);
        assert!(r.problems("endpoints.sms.reconcile", &none)[0].contains("no keys"));
    }

    #[test]
    fn a_reconciliation_that_cannot_work_is_refused_naming_its_key() {
        let p = Profile::builtin(ProfileName::Ietf);
        let problems = |t: &str| reconcile(t).problems("endpoints.psp.reconcile", &p).join("\n");
        assert!(problems("").contains("say how to ask"));
        assert!(problems("path = \"/x\"\nresend = true").contains("keep one"));
        assert!(problems("path = \"/x\"").contains("needs succeeded and/or not_applied"));
        assert!(problems("resend = true\nmax_attempts = 0").contains("max_attempts: must be at least 1"));
        assert!(problems("resend = true\nmethod = \"GE T\"").contains("not an HTTP method"));
    }

    #[test]
    fn a_replay_whose_attempts_would_outlive_the_window_needs_the_flag() {
        let t = |h: i64| chrono::DateTime::UNIX_EPOCH + chrono::Duration::hours(h);
        let day = Duration::from_secs(86_400);
        assert_eq!(replay_past_window(t(0), t(24), day), None);
        let why = replay_past_window(t(0), t(25), day).unwrap();
        assert!(why.contains("1day") && why.contains("--past-key-window"), "{why}");
        assert_eq!(replay_past_window(t(0), t(25), Duration::from_secs(u64::MAX / 4)), None, "never closes");
    }
}
