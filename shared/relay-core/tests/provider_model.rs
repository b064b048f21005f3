//! Outcome semantics against a provider model: sequences of attempts under
//! every built-in profile, each answered by a provider that behaves as real
//! ones document — it may apply a call and still answer a 5xx, time out or
//! reset the connection; it replays the stored answer to a known key;
//! it answers "in progress" while a call with the key runs; it applies
//! nothing it answers with a definitive 4xx; without keys, every request it
//! receives is a new one. The relay's side is the real [`classify`] and
//! [`decide`], with the sticky "may have applied" the database keeps.
//!
//! Checked after every sequence: an intent that ends dead (its `on_dead`
//! effects recorded) was never applied by the provider; every applied call
//! ends succeeded or uncertain; a success was applied; and the provider
//! applied the call at most once.

use proptest::prelude::*;
use relay_core::profile::{Profile, ProfileName};
use relay_core::retry::{AttemptResult, BackoffPolicy, Budget, NextState, Tried, classify, decide};

/// What the provider does with a request that reaches it and finds no
/// answer stored under its key.
#[derive(Debug, Clone, Copy)]
enum Work {
    /// Applies the call and answers 2xx.
    Apply,
    /// Applies the call, then fails answering this 5xx (stored: replayed
    /// to every retry with the key, as Stripe documents).
    ApplyThenFail(u16),
    /// Fails with this 5xx before doing anything (a gateway that never
    /// passed the request on, an overloaded front end): nothing stored.
    FailBefore(u16),
    /// Refuses for good with this 4xx (a decline, a validation error):
    /// stored, nothing applied.
    Refuse(u16),
    /// Throttles (429): nothing stored, nothing applied.
    Throttle,
    /// Starts the call and is still working on it past the request's
    /// timeout, and for this many more requests, which it answers "in
    /// progress"; then it has applied it (or refused it, when `refuse` is set).
    Slow { requests: u8, refuse: bool },
}

/// What happens on the wire to one attempt.
#[derive(Debug, Clone, Copy)]
enum Wire {
    /// The request reaches the provider and its answer comes back.
    Delivered,
    /// The connection is refused (or the TLS handshake, or the timeout hits
    /// before the request left): the provider never sees it.
    NotSent,
    /// The request reaches the provider, which does its work, but the
    /// answer is lost: a timeout after sending, or a reset.
    AnswerLost { reset: bool },
}

/// What the provider keeps under a key.
#[derive(Debug, Clone, Copy)]
enum Stored {
    Answer(u16),
    InProgress { left: u8, refuse: bool },
}

#[derive(Debug)]
struct Provider {
    /// Whether it deduplicates on the key (every profile but `none`).
    keyed: bool,
    /// Its "in progress" status.
    in_progress: u16,
    stored: Option<Stored>,
    applied: u32,
}

impl Provider {
    /// One request; the status it answers, or `None` when it is still
    /// working when the request times out.
    fn receive(&mut self, work: Work) -> Option<u16> {
        if self.keyed {
            match self.stored {
                Some(Stored::Answer(status)) => return Some(status),
                Some(Stored::InProgress { left, refuse }) => {
                    if left == 0 {
                        let status = if refuse { 402 } else { 201 };
                        if !refuse {
                            self.applied += 1;
                        }
                        self.stored = Some(Stored::Answer(status));
                        return Some(status);
                    }
                    self.stored = Some(Stored::InProgress { left: left - 1, refuse });
                    return Some(self.in_progress);
                }
                None => {}
            }
        }
        let (status, store) = match work {
            Work::Apply => {
                self.applied += 1;
                (201, true)
            }
            Work::ApplyThenFail(s) => {
                self.applied += 1;
                (s, true)
            }
            Work::FailBefore(s) => (s, false),
            Work::Refuse(s) => (s, true),
            Work::Throttle => (429, false),
            Work::Slow { requests, refuse } => {
                if self.keyed {
                    self.stored = Some(Stored::InProgress { left: requests, refuse });
                } else if !refuse {
                    // Without keys nothing tells a later request: the call is done, late.
                    self.applied += 1;
                }
                return None;
            }
        };
        if self.keyed && store {
            self.stored = Some(Stored::Answer(status));
        }
        Some(status)
    }

    /// Calls applied, counting one still in progress that will be.
    fn applied_in_the_end(&self) -> u32 {
        let pending = matches!(self.stored, Some(Stored::InProgress { refuse: false, .. }));
        self.applied + u32::from(pending)
    }
}

fn work() -> impl Strategy<Value = Work> {
    prop_oneof![
        Just(Work::Apply),
        prop::sample::select(vec![500u16, 502, 503, 504]).prop_map(Work::ApplyThenFail),
        prop::sample::select(vec![500u16, 502, 503, 504]).prop_map(Work::FailBefore),
        prop::sample::select(vec![400u16, 401, 402, 403, 404, 422]).prop_map(Work::Refuse),
        Just(Work::Throttle),
        (0u8..4, any::<bool>()).prop_map(|(requests, refuse)| Work::Slow { requests, refuse }),
    ]
}

fn wire() -> impl Strategy<Value = Wire> {
    prop_oneof![
        3 => Just(Wire::Delivered),
        1 => Just(Wire::NotSent),
        1 => any::<bool>().prop_map(|reset| Wire::AnswerLost { reset }),
    ]
}

/// Every built-in profile, with the statuses its endpoints retry by default.
fn profiles() -> Vec<(Profile, Vec<u16>)> {
    use ProfileName as P;
    [P::Stripe, P::Adyen, P::Paypal, P::Checkout, P::Ietf, P::Custom, P::None]
        .into_iter()
        .map(|n| (Profile::builtin(n), if n == P::Custom { vec![409] } else { Vec::new() }))
        .collect()
}

/// Runs one intent to its end against a fresh provider; returns how it
/// ended and how often the provider applied the call.
fn run(profile: &Profile, also_retry: &[u16], max_attempts: u32, steps: &[(Work, Wire)]) -> (NextState, u32) {
    let now = chrono::DateTime::parse_from_rfc3339("2026-12-07T12:00:00Z").unwrap().to_utc();
    let mut provider = Provider {
        keyed: profile.resends_unknown(),
        in_progress: profile.in_progress.first().copied().unwrap_or(429),
        stored: None,
        applied: 0,
    };
    let mut uncertain_before = false;
    let mut rng = rand::rng();
    for attempts in 1.. {
        let budget = Budget {
            attempts,
            max_attempts,
            expires_at: now + chrono::Duration::days(1),
            uncertain_before,
            resends_unknown: profile.resends_unknown(),
            key_forgotten: false,
        };
        let tried = if budget.spent(now).is_some() {
            Tried::Spent
        } else {
            // A sequence shorter than the budget repeats its last step.
            let (work, wire) = steps[(attempts as usize - 1).min(steps.len() - 1)];
            let result = match wire {
                Wire::NotSent => AttemptResult::Connect,
                Wire::AnswerLost { reset } => {
                    provider.receive(work);
                    if reset { AttemptResult::Transport } else { AttemptResult::Timeout { sent: true } }
                }
                Wire::Delivered => match provider.receive(work) {
                    Some(status) => {
                        AttemptResult::Response { status, retry_after: None, key: profile.key_answer(status, None) }
                    }
                    None => AttemptResult::Timeout { sent: true },
                },
            };
            Tried::Attempt(classify(&result, also_retry))
        };
        let d = decide(&budget, tried, &BackoffPolicy::default(), now, &mut rng);
        // As the finish writes `ever_uncertain`.
        uncertain_before |= d.outcome.may_have_applied();
        if !matches!(d.next, NextState::Retry(_)) {
            return (d.next, provider.applied_in_the_end());
        }
    }
    unreachable!("the budget ends every intent")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn an_intent_that_ends_dead_was_never_applied_and_an_applied_one_never_ends_dead(
        profile in 0usize..7,
        max_attempts in 1u32..8,
        steps in prop::collection::vec((work(), wire()), 1..10),
    ) {
        let (profile, also_retry) = &profiles()[profile];
        let (end, applied) = run(profile, also_retry, max_attempts, &steps);
        let name = profile.name.as_str();
        prop_assert!(applied <= 1, "{name}: the provider applied the call {applied} times");
        match end {
            NextState::Dead => prop_assert_eq!(applied, 0, "{}: ended dead (on_dead recorded) for an applied call", name),
            NextState::Succeeded => prop_assert_eq!(applied, 1, "{}: succeeded without being applied", name),
            NextState::Uncertain => {}
            NextState::Retry(_) => prop_assert!(false, "a run ends"),
        }
    }
}

/// The case that made this model: a Stripe-like provider applies the
/// charge, answers 500, and replays the stored 500 to every retry.
#[test]
fn a_replayed_500_after_an_applied_charge_ends_uncertain_not_dead() {
    let (stripe, also) = &profiles()[0];
    let (end, applied) = run(stripe, also, 10, &[(Work::ApplyThenFail(500), Wire::Delivered)]);
    assert_eq!((end, applied), (NextState::Uncertain, 1));
}
