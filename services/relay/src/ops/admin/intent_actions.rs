//! Intents: listed, shown with their history, queued again within the
//! rules of their provider's key window, resolved or skipped by hand.

use relay_store::intents::{self, AttemptView, IntentFilter, IntentState, IntentView, Requeue};
use uuid::Uuid;

use super::{Operator, OpsError, PAGE};

/// Which intents to queue again.
#[derive(Debug, Clone)]
pub enum Intents {
    /// These ids.
    Ids(Vec<Uuid>),
    /// Every dead intent, of one endpoint if given.
    Dead {
        /// Only this endpoint's.
        endpoint: Option<String>,
    },
}

/// What queuing intents again did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Requeued {
    /// How many were asked for.
    pub asked: usize,
    /// How many were queued again.
    pub queued: usize,
    /// Those neither dead nor uncertain (or unknown), left as they are.
    pub left: Vec<Uuid>,
    /// Dead ones whose `on_dead` effects were recorded, left dead
    /// ([`Requeue::OnDeadRecorded`]).
    pub refused: Vec<Uuid>,
    /// Of those queued, dead ones with an ordering key, queued behind the
    /// intents of their key written after them ([`Requeue::QueuedBehindItsKey`]).
    pub behind_their_key: Vec<Uuid>,
    /// Left as they are, each with why: their attempts could outlive the
    /// provider's key window and `--past-key-window` was not given
    /// ([`Requeue::PastKeyWindow`]), or they are uncertain at a provider
    /// without keys ([`Requeue::UncertainWithoutKeys`]).
    pub not_replayed: Vec<(Uuid, String)>,
}

/// Whether a replay may run attempts past the provider's key window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyWindow {
    /// No: such intents are left as they are, with the reason.
    #[default]
    Within,
    /// Yes: the operator checked with the provider (`--past-key-window`).
    PastAllowed,
}

impl KeyWindow {
    /// The choice a `--past-key-window` flag (or its API field) makes.
    pub fn past_allowed(yes: bool) -> Self {
        if yes { KeyWindow::PastAllowed } else { KeyWindow::Within }
    }
}

/// An intent and what was done about it.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct IntentHistory {
    pub intent: IntentView,
    /// Its call attempts, oldest first.
    pub attempts: Vec<AttemptView>,
    /// The questions to its provider about an unknown outcome, oldest first.
    pub reconciliations: Vec<relay_store::reconciliations::ReconciliationView>,
    /// The provider's answer its `on_success` effects were rendered from,
    /// if they read one.
    pub response: Option<serde_json::Value>,
}

/// What an operator found out about an uncertain intent from the provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum IntentResolution {
    /// The provider applied it: record its `on_success` effects.
    Succeeded,
    /// The provider did not apply it: record its `on_dead` effects.
    Failed,
}

/// Why an uncertain intent of a provider without keys is not replayed.
pub const UNCERTAIN_WITHOUT_KEYS: &str = "its provider keeps no idempotency keys (profile none), so sending it again \
     could apply it twice; ask the provider, then `relay intents resolve ID --succeeded` or `--failed`";

/// Why an uncertain intent whose key the provider has forgotten is not replayed.
pub const UNCERTAIN_KEY_FORGOTTEN: &str = "the provider's key window has closed since the intent was written, so no \
     attempt would be sent (sent again, it would be taken for a new request), with or without --past-key-window; ask \
     the provider, then `relay intents resolve ID --succeeded` or `--failed`";

/// Why a replay left an intent as it was, for the refusals that come
/// from its provider (its key window, or no keys at all).
fn not_replayed_why(r: Requeue) -> String {
    match r {
        Requeue::PastKeyWindow(why) => why,
        Requeue::UncertainWithoutKeys => UNCERTAIN_WITHOUT_KEYS.into(),
        Requeue::UncertainKeyForgotten => UNCERTAIN_KEY_FORGOTTEN.into(),
        // Not a provider's refusal; the callers match those themselves.
        other => format!("{other:?}"),
    }
}

/// Why a dead intent whose `on_dead` effects were recorded is not replayed.
pub fn on_dead_recorded(id: Uuid) -> String {
    format!(
        "intent {id} is dead and its on_dead effects were recorded (its failure events were emitted, its saga moved, \
         unless its last error says they were not recorded: then emit them by hand): a replay that succeeded would \
         tell the opposite story beside them, so it is refused. Handle it as the failure it was announced as (a new \
         event starts a new call), or see docs/CONTRACT.md, \"Replaying intents\""
    )
}

impl Operator {
    /// This consumer's intents in `state` (any, if `None`) of `endpoint`
    /// (any) created before `before`, newest first.
    pub async fn intents(
        &self,
        state: Option<IntentState>,
        endpoint: Option<String>,
        before: Option<chrono::DateTime<chrono::Utc>>,
        limit: i64,
    ) -> Result<Vec<IntentView>, OpsError> {
        let f = IntentFilter { consumer: self.consumer.clone(), state, endpoint };
        Ok(intents::list(&mut *self.pool.acquire().await?, &f, before, limit).await?)
    }

    /// Intent `id`, its attempts and its reconciliations.
    pub async fn intent(&self, id: Uuid) -> Result<IntentHistory, OpsError> {
        let mut conn = self.pool.acquire().await?;
        let Some(intent) = intents::get(&mut conn, &self.consumer, id).await? else {
            return Err(OpsError::NotFound(format!("no intent {id} (list them with `relay intents list`)")));
        };
        let attempts = intents::attempts(&mut conn, id).await?;
        let reconciliations = relay_store::reconciliations::list(&mut conn, id).await?;
        let response = intents::answer(&mut conn, id).await?;
        Ok(IntentHistory { intent, attempts, reconciliations, response })
    }

    /// Queue intent `id` again (same id, same idempotency key); only a dead
    /// or uncertain intent of this consumer is, and a dead one only if it
    /// recorded no `on_dead` effects ([`intents::requeue`]).
    pub async fn requeue(&self, id: Uuid, window: KeyWindow) -> Result<(), OpsError> {
        match intents::requeue(&mut *self.pool.acquire().await?, &self.consumer, id, self.window(window)).await? {
            Requeue::Queued | Requeue::QueuedBehindItsKey => Ok(()),
            Requeue::NotDeadOrUncertain => Err(OpsError::Conflict(format!(
                "intent {id} is neither dead nor uncertain (or is not one of consumer {:?}'s): only those are replayed",
                self.consumer
            ))),
            Requeue::OnDeadRecorded => Err(OpsError::Conflict(on_dead_recorded(id))),
            r @ (Requeue::PastKeyWindow(_) | Requeue::UncertainWithoutKeys | Requeue::UncertainKeyForgotten) => {
                Err(OpsError::Conflict(format!("intent {id} not replayed: {}", not_replayed_why(r))))
            }
        }
    }

    /// What a replay must respect, per endpoint: its key window unless
    /// the operator allowed a replay past it.
    fn window(&self, w: KeyWindow) -> impl Fn(&str) -> intents::ReplayRules + '_ {
        move |endpoint| {
            let mut rules = self.replay_rules.get(endpoint).copied().unwrap_or(intents::ReplayRules::ANY);
            if w == KeyWindow::PastAllowed {
                rules.key_window = None;
            }
            rules
        }
    }

    /// Queue every intent `which` selects again (the dead ones as they are
    /// when it starts: one that dies again meanwhile waits for the next
    /// replay); `progress(done so far)` every thousand.
    pub async fn requeue_all(
        &self,
        which: Intents,
        window: KeyWindow,
        mut progress: impl FnMut(usize),
    ) -> Result<Requeued, OpsError> {
        let mut conn = self.pool.acquire().await?;
        let ids = match which {
            Intents::Ids(ids) => ids,
            Intents::Dead { endpoint } => {
                let f = IntentFilter { consumer: self.consumer.clone(), state: Some(IntentState::Dead), endpoint };
                intents::ids(&mut conn, &f).await?
            }
        };
        let mut done = Requeued { asked: ids.len(), ..Requeued::default() };
        for (n, id) in ids.iter().enumerate() {
            match intents::requeue(&mut conn, &self.consumer, *id, self.window(window)).await? {
                Requeue::Queued => done.queued += 1,
                Requeue::QueuedBehindItsKey => {
                    done.queued += 1;
                    done.behind_their_key.push(*id);
                }
                Requeue::NotDeadOrUncertain => done.left.push(*id),
                Requeue::OnDeadRecorded => done.refused.push(*id),
                r @ (Requeue::PastKeyWindow(_) | Requeue::UncertainWithoutKeys | Requeue::UncertainKeyForgotten) => {
                    done.not_replayed.push((*id, not_replayed_why(r)))
                }
            }
            if (n + 1) % PAGE as usize == 0 {
                progress(n + 1);
            }
        }
        Ok(done)
    }

    /// Resolve uncertain intent `id` as the provider says it ended: it
    /// becomes succeeded or dead with the matching outcome effects, recorded
    /// as a call's outcome is (fenced, in one transaction). For an intent
    /// whose attempts ran out after an unknown outcome, once someone asked
    /// the provider; `note` (who, what the provider said) goes into its last
    /// error. Returns why its outcome's effects were not recorded: its
    /// `on_success` ones read the provider's answer, which relay then does
    /// not have, or an event does not fit its topic's schema.
    pub async fn resolve(
        &self,
        id: Uuid,
        resolution: IntentResolution,
        note: Option<&str>,
    ) -> Result<Option<String>, OpsError> {
        use crate::deliver::completer::Completer;
        use crate::deliver::outcome::{Completion, Finished};
        // Without its encoder, an outcome event would go out as JSON to a
        // topic its readers decode with a schema: refused before anything changes.
        if let Some(topic) = self.formatted.iter().find(|t| !self.encoders.contains_key(*t)) {
            return Err(OpsError::Other(anyhow::anyhow!(
                "topic {topic} is written with a schema, but this operator has no encoder for it: build it with \
                 Operator::with_encoders(relay::app::emit_encoders(..)), as `relay intents resolve` does"
            )));
        }
        let worker = format!("operator@{}", crate::runtime::claim_loop::default_worker_id());
        let lease = std::time::Duration::from_secs(60);
        let mut conn = self.pool.acquire().await?;
        let Some(intent) = intents::take_uncertain(&mut conn, &self.consumer, id, &worker, lease).await? else {
            return Err(OpsError::Conflict(format!(
                "intent {id} is not uncertain (or is not consumer {:?}'s): only uncertain intents are resolved",
                self.consumer
            )));
        };
        let (intent_id, token, endpoint) = (intent.id, intent.lease_token, intent.intent.endpoint.clone());
        let (next, said) = match resolution {
            IntentResolution::Succeeded => (intents::NextState::Succeeded, "succeeded"),
            IntentResolution::Failed => (intents::NextState::Dead, "failed"),
        };
        // PostgreSQL text cannot hold NUL; a note with one must not make the
        // resolution unrecordable.
        let note = note.map(|n| n.replace('\0', "\u{FFFD}"));
        let why = format!("resolved as {said} by an operator{}", note.map(|n| format!(": {n}")).unwrap_or_default());
        let why_logged = why.clone();
        // The outcome goes the way a call's does: fenced by the operator's
        // lease, its effects recorded in the same transaction.
        let progress = std::sync::Arc::new(tokio::sync::Notify::new());
        let completer = Completer::new(
            &self.pool,
            &worker,
            lease,
            crate::Faults::none(),
            progress,
            self.encoders.clone(),
            Default::default(),
        );
        let mut done = [Completion::resolved(intent, next, why)];
        let finished = completer.finalize(&mut done).await;
        let dropped = done[0].effects_dropped().map(str::to_owned);
        match finished.as_slice() {
            [Finished::Succeeded | Finished::Dead] => {
                tracing::info!(intent_id = %id, consumer = %self.consumer, resolution = ?resolution, why = %why_logged,
                               "uncertain intent resolved by an operator");
                if let Some(why) = &dropped {
                    crate::runtime::metrics::effects_dropped(&endpoint);
                    tracing::error!(intent_id = %id, "resolved as {said}, but its events are not emitted and its sagas not moved: {why}");
                }
                Ok(dropped)
            }
            other => {
                // Back to uncertain at once (the rescuer would do it too when
                // the operator lease expires: never to pending, never a call).
                let back = intents::give_back_uncertain(&mut conn, intent_id, token).await;
                Err(OpsError::Other(anyhow::anyhow!(
                    "intent {id}: the resolution could not be recorded ({other:?}; given back: {back:?}); it is \
                     uncertain as before, try again"
                )))
            }
        }
    }

    /// Let dead intent `id`, which holds its ordering key (its route's
    /// `on_poison = "hold_key"`), release it: it stays dead, and the key's
    /// later intents go on. Returns the key and how many wait behind it.
    pub async fn intent_skip(&self, id: Uuid) -> Result<(String, i64), OpsError> {
        match intents::skip(&mut *self.pool.acquire().await?, &self.consumer, id).await? {
            intents::Skip::Released { key, waiting } => {
                tracing::info!(intent_id = %id, ordering_key = %key, waiting, "dead intent skipped: its key goes on");
                Ok((key, waiting))
            }
            intents::Skip::NotHolding => Err(OpsError::Conflict(format!(
                "intent {id} is not a dead intent holding its ordering key (or is not consumer {:?}'s): only those \
                 are skipped",
                self.consumer
            ))),
        }
    }
}
