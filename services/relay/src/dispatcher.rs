//! The intent dispatcher: claim due intents, call the provider outside any
//! transaction, record the outcome in a second short transaction that checks
//! the lease is still ours (fencing).
//!
//! ```text
//! claim (1 statement: SKIP LOCKED + lease + attempts+1)  -- commit
//! HTTP call with the intent's idempotency key            -- no transaction open
//! finalize (fenced UPDATE + outcome effects)             -- commit
//! ```
//!
//! Retry schedule (per endpoint, stored with the intent as `next_attempt_at`):
//! full-jitter exponential backoff from [`relay_core::retry::BackoffPolicy`],
//! at least the provider's `Retry-After`, until `max_attempts` attempts or
//! `max_age` since the intent was written; then the intent is dead with its
//! last status and error, and its `on_dead` effects are recorded.
//!
//! Beside a consumer in the same process, most intents skip the claim: the
//! consumer writes them already claimed for this dispatcher and hands them
//! over after its commit ([`crate::handoff`]); from the call on they go the
//! same way.
//!
//! If this process dies anywhere in that sequence, the lease expires, any
//! dispatcher's rescuer returns the intent to pending, and it is sent again
//! with the same key (C9, C10). A worker that finishes after its lease was
//! rescued finds its token gone and records nothing (C17).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use relay_core::config::{DispatcherConfig, EndpointConfig, LEASE_SPARE};
use relay_core::effects::encode_event;
use relay_core::ids::outcome_id;
use relay_core::retry::{self, BackoffPolicy, Decision, Tried, classify};
use relay_core::{Outcome, Provenance};
use relay_store::intents::{self, AttemptRecord, ClaimedIntent, Finish, NextState};
use relay_store::sagas::{self, Transition};
use relay_store::{Claim, ClaimPool, Claimer, FinishPool, Position, inbox, outbox};
use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::faults::{FaultInjected, Faults, point};
use crate::handoff::{Desk, Handed};
use crate::http::{CallResult, EndpointClient, Sent};
use crate::resume::Resume;

/// How many batches of outcomes are written at once ([`Dispatcher::finalize_loop`]).
const FINALIZERS: usize = 2;

/// Channel the intents trigger notifies.
pub const CHANNEL: &str = "relay_intents";

/// The intent dispatcher of one process.
#[derive(Clone)]
pub struct Dispatcher {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    /// The claim loop's connection ([`ClaimPool`]: one round trip a claim).
    claims: ClaimPool,
    /// The finalizers' connections ([`FinishPool`]: one round trip a batch
    /// of outcomes that records nothing but states).
    finishes: FinishPool,
    settings: DispatcherConfig,
    worker: String,
    endpoints: HashMap<String, EndpointClient>,
    faults: Faults,
    /// Signalled when this worker made intents claimable that no NOTIFY
    /// announces: an outcome recorded for an intent with an ordering key (its
    /// successor may be due now), a retry scheduled, a claim given back,
    /// expired leases rescued.
    progress: tokio::sync::Notify,
}

/// How an intent's claim ended, for the log and the tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    /// Succeeded.
    Succeeded,
    /// Scheduled for another attempt.
    Retrying,
    /// Dead.
    Dead,
    /// Out of budget after an attempt whose outcome is unknown.
    Uncertain,
    /// The lease was lost before the outcome was recorded.
    LeaseLost,
}

impl Dispatcher {
    /// A dispatcher over `endpoints`. Must be called inside a tokio runtime.
    pub fn new(
        pool: PgPool,
        settings: DispatcherConfig,
        endpoints: &std::collections::BTreeMap<String, EndpointConfig>,
        faults: Faults,
    ) -> anyhow::Result<Dispatcher> {
        let worker = settings.worker_id.clone().unwrap_or_else(default_worker_id);
        let endpoints = endpoints
            .iter()
            .map(|(name, cfg)| Ok((name.clone(), EndpointClient::new(name, cfg)?)))
            .collect::<anyhow::Result<_>>()?;
        let progress = tokio::sync::Notify::new();
        let claims = ClaimPool::beside(&pool, 1);
        let finishes = FinishPool::beside(&pool, FINALIZERS as u32);
        let inner = Inner { pool, claims, finishes, settings, worker, endpoints, faults, progress };
        Ok(Dispatcher { inner: Arc::new(inner) })
    }

    /// This dispatcher's worker id.
    pub fn worker(&self) -> &str {
        &self.inner.worker
    }

    /// Run until `shutdown`: stop claiming, let calls in flight finish and
    /// record their outcome, then return. A fault point that fails stops the
    /// loop at once, leaving claimed intents to the rescuer (like a crash).
    /// With a `desk`, also call the intents a consumer of this process
    /// claimed at ingest for us and hands over there ([`crate::handoff`]);
    /// stopping, it gives back to pending what was handed over and not started.
    pub async fn run_with(self, shutdown: CancellationToken, mut desk: Option<Desk>) -> anyhow::Result<()> {
        let s = &self.inner.settings;
        info!(worker = %self.inner.worker, concurrency = s.concurrency, lease = ?s.lease, "dispatcher started");
        let mut listener = listen(&self.inner.pool, CHANNEL).await;
        let rescuer = tokio::spawn(self.clone().rescue_loop(shutdown.clone()));
        let (done_tx, done_rx) = mpsc::channel::<Completion>(s.concurrency * 2);
        let finalizer = tokio::spawn(self.clone().finalize_loop(done_rx));
        let permits = Arc::new(Semaphore::new(s.concurrency));
        let mut tasks: JoinSet<Result<(), FaultInjected>> = JoinSet::new();
        let mut failures = 0u32;
        let mut claimer = self.inner.claims.claimer();
        // Where the next claim may start (see `crate::resume`).
        let mut resume: Resume<Position> = Resume::default();
        let result = 'claiming: loop {
            if shutdown.is_cancelled() {
                break Ok(());
            }
            // Reap finished calls; a failed fault point means "crash now".
            let mut crashed = None;
            while let Some(done) = tasks.try_join_next() {
                if let Ok(Err(f)) = done {
                    crashed = Some(f);
                }
            }
            if let Some(f) = crashed {
                break Err(f.into());
            }
            while let Some(handed) = desk.as_mut().and_then(Desk::try_recv) {
                self.start_handed(&mut tasks, handed, &done_tx, &permits);
            }
            // Claim ahead: up to one claim batch waits for a free call slot, so
            // the next calls start the moment slots free up instead of after a
            // round trip to the database. And claim only once a quarter of a
            // batch has room: until then at least three quarters of one wait
            // for slots, enough to cover the claim's round trip, and a claim
            // for every call or two that ends cost a statement and a commit
            // each (at concurrency 1: 0.25 commits per call, 0.12 with this;
            // 9 800 → 16 800 calls/s in one bench run, BENCHMARKS.md).
            let free = (s.concurrency + s.claim_batch as usize).saturating_sub(tasks.len());
            if free < (s.claim_batch as usize / 4).max(1) {
                tokio::select! {
                    _ = shutdown.cancelled() => break Ok(()),
                    done = tasks.join_next() => {
                        if let Some(Ok(Err(f))) = done { break Err(f.into()); }
                    }
                    handed = handed_over(&mut desk) => self.start_handed(&mut tasks, handed, &done_tx, &permits),
                }
                continue;
            }
            let want = free.min(s.claim_batch as usize);
            // Our own progress (a retry scheduled, a key's earlier intent
            // finished, a claim given back) may have made rows due behind
            // the position: look from the start.
            if futures::FutureExt::now_or_never(self.inner.progress.notified()).is_some() {
                resume.back_to(None);
            }
            let (after, back) = resume.next(s.poll_interval);
            let Claim { rows: claimed, next_due, last } = match self.claim(&mut claimer, want, after).await {
                Ok(c) => {
                    failures = 0;
                    c
                }
                Err(e) => {
                    resume.back_to(None);
                    failures += 1;
                    let delay = s.poll_interval.min(BackoffPolicy::DATABASE.delay(failures, &mut rand::rng()));
                    error!(worker = %self.inner.worker, error = %e, "claiming intents failed; retrying");
                    tokio::select! { _ = shutdown.cancelled() => break Ok(()), _ = tokio::time::sleep(delay) => {} }
                    continue;
                }
            };
            let n = claimed.len();
            if n > 0 {
                crate::metrics::claimed("claim", n as u64);
                if let Err(f) = self.inner.faults.hit(point::DISPATCHER_AFTER_CLAIM).await {
                    break Err(f.into());
                }
            }
            let claimed_at = std::time::Instant::now();
            for intent in claimed {
                self.start(&mut tasks, intent, claimed_at, None, &done_tx, &permits);
            }
            if n == want {
                // A full claim has rows, so a last one.
                if let Some(last) = last {
                    resume.claimed(back, last);
                }
                continue; // more may be due right now
            }
            // Nothing more after the position either: the next claim looks
            // from the start. Not at once: what a claim after the position
            // passed over is a row whose wake-up is still to come (a NOTIFY
            // buffered while this loop claimed without waiting, our own
            // progress) or one the poll interval covers, as before.
            resume.back_to(None);
            // Nothing more is due: wait for new intents (NOTIFY), for our own
            // progress, or for the next retry to come due. A call ending does not
            // wake the claim by itself: the claim just took fewer than it had
            // room for, so a freed slot changes nothing, and re-claiming after
            // every call would cost two queries per call under a steady load.
            let until = tokio::time::Instant::now() + until_due(next_due, s.poll_interval);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break 'claiming Ok(()),
                    _ = notified(&mut listener) => break,
                    _ = self.inner.progress.notified() => break,
                    _ = tokio::time::sleep_until(until) => break,
                    Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                        if let Ok(Err(f)) = done { break 'claiming Err(f.into()); }
                    }
                    // Already claimed: no reason to claim again.
                    handed = handed_over(&mut desk) => self.start_handed(&mut tasks, handed, &done_tx, &permits),
                }
            }
        };
        if result.is_ok() {
            if let Some(desk) = desk {
                desk.close(&self.inner.pool).await;
            }
            info!(worker = %self.inner.worker, in_flight = tasks.len(), "dispatcher stopping; finishing calls in flight");
            while let Some(done) = tasks.join_next().await {
                if let Ok(Err(f)) = done {
                    warn!(error = %f, "fault during shutdown");
                }
            }
        } else {
            tasks.abort_all();
        }
        drop(done_tx);
        let _ = finalizer.await;
        rescuer.abort();
        info!(worker = %self.inner.worker, "dispatcher stopped");
        result
    }

    /// Start a task that calls `intent` when a call slot is free, then hands
    /// its outcome to the finalizer. `room`: the handed-over intent's unit of
    /// room, given back when the task ends.
    fn start(
        &self,
        tasks: &mut JoinSet<Result<(), FaultInjected>>,
        intent: ClaimedIntent,
        claimed_at: std::time::Instant,
        room: Option<OwnedSemaphorePermit>,
        done_tx: &mpsc::Sender<Completion>,
        permits: &Arc<Semaphore>,
    ) {
        let (me, done_tx, permits) = (self.clone(), done_tx.clone(), permits.clone());
        tasks.spawn(async move {
            let _room = room;
            let completion = {
                let _slot = permits.acquire_owned().await.expect("semaphore never closed");
                let send_by = me.send_by(&intent, claimed_at);
                if tokio::time::Instant::now() > send_by {
                    // Waited for a slot so long that the call might outlive the
                    // lease and overlap a rescued copy: give the claim back.
                    me.release(&intent).await;
                    return Ok(());
                }
                match me.execute(intent, send_by).await? {
                    Ok(completion) => completion,
                    Err(intent) => {
                        // The same, after waiting at the endpoint's rate limit or concurrency limit.
                        me.release(&intent).await;
                        return Ok(());
                    }
                }
            };
            // The call slot is free before the hand-over: a finalizer
            // busy with a slow commit holds up the outcomes, not the
            // next calls. This task still counts against the claim
            // loop's bound until its outcome is handed over.
            me.hand_over(completion, &done_tx).await;
            Ok(())
        });
    }

    /// Start the calls of intents claimed at ingest and handed over.
    fn start_handed(
        &self,
        tasks: &mut JoinSet<Result<(), FaultInjected>>,
        handed: Vec<Handed>,
        done_tx: &mpsc::Sender<Completion>,
        permits: &Arc<Semaphore>,
    ) {
        for Handed { intent, since, room } in handed {
            self.start(tasks, intent, since, Some(room), done_tx, permits);
        }
    }

    /// The latest moment a request for `intent`, claimed at `claimed_at`, may
    /// be sent: the lease's end less the whole attempt
    /// ([`EndpointConfig::call_bound`]) and [`LEASE_SPARE`] — the check that
    /// configuration validation makes too ([`EndpointConfig::min_lease`]).
    /// `claimed_at` is taken after the claim's commit, so this end comes
    /// before the database's.
    fn send_by(&self, intent: &ClaimedIntent, claimed_at: std::time::Instant) -> tokio::time::Instant {
        let call = self.inner.endpoints.get(&intent.endpoint).map_or(Duration::ZERO, |e| e.config().call_bound());
        let lease_end = tokio::time::Instant::from_std(claimed_at) + self.inner.settings.lease;
        lease_end.checked_sub(call + LEASE_SPARE).unwrap_or_else(|| tokio::time::Instant::from_std(claimed_at))
    }

    /// Return an unstarted claim to pending (its attempt is not counted).
    async fn release(&self, intent: &ClaimedIntent) {
        let released = match self.inner.pool.acquire().await {
            Ok(mut conn) => intents::release(&mut conn, intent.id, intent.lease_token).await,
            Err(e) => Err(e),
        };
        match released {
            Ok(_) => {
                self.inner.progress.notify_one();
                debug!(intent_id = %intent.id, "claim given back unstarted: not enough lease left for a call")
            }
            Err(e) => {
                warn!(intent_id = %intent.id, error = %e, "giving a claim back failed; it is rescued when its lease expires")
            }
        }
    }

    /// Claim up to `limit` intents; a short claim also says when the next one
    /// not due yet comes due, for the sleep after it (at most the poll
    /// interval; NOTIFY wakes us earlier for new intents, and `progress` for
    /// what our own outcomes made due).
    async fn claim(
        &self,
        claimer: &mut Claimer,
        limit: usize,
        after: Option<Position>,
    ) -> Result<Claim<ClaimedIntent>, sqlx::Error> {
        let (worker, lease) = (&self.inner.worker, self.inner.settings.lease);
        claimer.claim(async |conn| intents::claim_after(conn, worker, limit as i64, lease, after).await).await
    }

    async fn rescue_loop(self, shutdown: CancellationToken) {
        let every = self.inner.settings.rescue_interval;
        loop {
            tokio::select! { _ = shutdown.cancelled() => return, _ = tokio::time::sleep(every) => {} }
            match self.rescue_once().await {
                Ok(ids) if !ids.is_empty() => {
                    self.inner.progress.notify_one();
                    crate::metrics::rescued("intent", ids.len() as u64);
                    warn!(worker = %self.inner.worker, rescued = ids.len(), intents = ?ids,
                          "rescued intents whose lease expired; they will be sent again with the same idempotency key")
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(worker = %self.inner.worker, error = %e, "rescuing expired leases failed; retrying")
                }
            }
        }
    }

    /// Return intents with expired leases to pending (normally run by the rescue loop).
    pub async fn rescue_once(&self) -> Result<Vec<uuid::Uuid>, sqlx::Error> {
        let mut conn = self.inner.pool.acquire().await?;
        intents::rescue_expired(&mut conn, 500).await
    }

    /// Make one attempt of a claimed intent, if its request can be sent by
    /// `send_by`, and decide where the intent goes next (`Err(intent)`: not
    /// sent, to give back). The caller holds a call slot only for this; the
    /// outcome then goes to the finalizer (`hand_over`), which records it
    /// batched with other calls' outcomes and logs it.
    pub async fn execute(
        &self,
        intent: ClaimedIntent,
        send_by: tokio::time::Instant,
    ) -> Result<Result<Completion, ClaimedIntent>, FaultInjected> {
        let started = std::time::Instant::now();
        let endpoint = self.inner.endpoints.get(&intent.endpoint);
        let now = Utc::now();
        let budget = intent.budget();
        let (tried, result) = if budget.spent(now).is_some() {
            let r =
                CallResult { error_class: Some("budget"), error: intent.last_error.clone(), ..CallResult::not_sent() };
            (Tried::Spent, r)
        } else if let Some(client) = endpoint {
            let attrs = || {
                vec![
                    opentelemetry::KeyValue::new("relay.intent_id", intent.id.to_string()),
                    opentelemetry::KeyValue::new("relay.endpoint", intent.endpoint.clone()),
                    opentelemetry::KeyValue::new("relay.attempt", i64::from(intent.attempts)),
                    opentelemetry::KeyValue::new("relay.idempotency_key", intent.idempotency_key.clone()),
                ]
            };
            let hop = crate::trace::Hop::start(
                "relay.call",
                opentelemetry::trace::SpanKind::Client,
                intent.traceparent.as_deref(),
                attrs,
            );
            let fresh_key = self
                .inner
                .faults
                .sabotage()
                .fresh_idempotency_key
                // Deliberately wrong (R8): a new key per attempt.
                .then(|| format!("{}:{}", intent.idempotency_key, uuid::Uuid::new_v4()));
            let sent = Sent {
                idempotency_key: fresh_key.as_deref().unwrap_or(&intent.idempotency_key),
                traceparent: hop.traceparent.as_deref().or(intent.traceparent.as_deref()),
            };
            // Deliberately wrong (C17): the waits at the endpoint's limits are not bounded by the lease.
            let send_by = if self.inner.faults.sabotage().lease_checked_before_wait {
                tokio::time::Instant::now() + Duration::from_secs(86_400)
            } else {
                send_by
            };
            let Ok(r) = client.call(&intent, sent, send_by).await else {
                hop.end("not_sent");
                return Ok(Err(intent));
            };
            hop.end(r.status.map_or_else(|| r.error_class.unwrap_or("error").to_owned(), |s| s.to_string()).as_str());
            self.inner.faults.hit(point::DISPATCHER_AFTER_CALL).await?;
            (Tried::Attempt(classify(&r.attempt, &client.config().retryable_statuses)), r)
        } else {
            let why = format!("endpoint {:?} is not configured in this dispatcher", intent.endpoint);
            let r = CallResult { error_class: Some("endpoint_unknown"), error: Some(why), ..CallResult::not_sent() };
            (Tried::Attempt(classify(&r.attempt, &[])), r)
        };
        let policy = endpoint.map(|e| e.config().backoff).unwrap_or_default();
        let decision = retry::decide(&budget, tried, &policy, Utc::now(), &mut rand::rng());
        let attempt = attempt_record(&decision, &result);
        Ok(Ok(Completion { intent, next: decision.next, attempt, result, started }))
    }

    /// Hand an attempt's outcome to the finalizer, waiting while its queue
    /// is full.
    async fn hand_over(&self, completion: Completion, done: &mpsc::Sender<Completion>) {
        if let Err(lost) = done.send(completion).await {
            self.log_attempt(&lost.0, Finished::LeaseLost);
        }
    }

    fn log_attempt(&self, c: &Completion, finished: Finished) {
        let (intent, result, took) = (&c.intent, &c.result, c.started.elapsed());
        let label = match finished {
            Finished::Succeeded => "succeeded",
            Finished::Retrying => "retrying",
            Finished::Dead => "dead",
            Finished::Uncertain => "uncertain",
            Finished::LeaseLost => "lease_lost",
        };
        // The attempt's outcome as classified when it ended (`uncertain` for a
        // timeout after sending, even when it left the intent dead).
        let outcome = if finished == Finished::LeaseLost { "" } else { c.attempt.outcome };
        crate::metrics::call(&intent.endpoint, label, outcome, took.as_secs_f64());
        let status = result.status.map(i64::from).unwrap_or(-1);
        let class = result.error_class.unwrap_or("");
        let error = result.error.as_deref().unwrap_or("");
        let (agg, corr) =
            (intent.aggregate_id.as_deref().unwrap_or(""), intent.correlation_id.as_deref().unwrap_or(""));
        let ms = took.as_millis() as u64;
        macro_rules! emit {
            ($lvl:expr, $result:expr, $($msg:tt)+) => {
                tracing::event!(
                    $lvl, worker = %self.inner.worker, intent_id = %intent.id, endpoint = %intent.endpoint,
                    action = %intent.action, event_id = %intent.source_event_id, idempotency_key = %intent.idempotency_key,
                    aggregate_id = agg, correlation_id = corr, attempt = intent.attempts, status, error_class = class,
                    result = $result, duration_ms = ms, $($msg)+
                )
            };
        }
        match finished {
            Finished::Succeeded => emit!(tracing::Level::DEBUG, "succeeded", "call succeeded"),
            Finished::Retrying => {
                emit!(tracing::Level::WARN, "retrying", "call failed; retrying with the same idempotency key: {error}")
            }
            Finished::Dead => emit!(
                tracing::Level::ERROR,
                "dead",
                "intent is dead and will not be retried (replay it once the cause is fixed): {error}"
            ),
            Finished::Uncertain => emit!(
                tracing::Level::ERROR,
                "uncertain",
                "intent is out of budget and its last attempt may have been applied: left uncertain for an \
                 operator to decide (replay asks again with the same idempotency key): {error}"
            ),
            Finished::LeaseLost => emit!(
                tracing::Level::WARN,
                "lease_lost",
                "lease lost before the outcome was recorded; another worker owns this intent now, nothing recorded"
            ),
        }
    }

    /// Record completions in batches: whatever has arrived while earlier
    /// batches were written goes into the next one (up to 256), with one
    /// fenced statement for all of them (one round trip when that is all
    /// the batch records: [`FinishPool`]). Two batches are
    /// written at once, so one commit's WAL flush does not hold up the next
    /// batch. (With four, each writer took what had arrived the moment it was
    /// free, batches averaged 13 outcomes and per-statement costs dominated:
    /// the dispatch benchmark ran 10–30 % slower than with two; with one,
    /// concurrency 1 ran 25 % slower.)
    async fn finalize_loop(self, mut rx: mpsc::Receiver<Completion>) {
        let slots = Arc::new(Semaphore::new(FINALIZERS));
        let mut writers = JoinSet::new();
        while let Some(first) = rx.recv().await {
            let slot = slots.clone().acquire_owned().await.expect("semaphore never closed");
            let mut batch = vec![first];
            while batch.len() < 256 {
                match rx.try_recv() {
                    Ok(c) => batch.push(c),
                    Err(_) => break,
                }
            }
            let me = self.clone();
            writers.spawn(async move {
                let results = me.finalize(&batch).await;
                let unblocks = |(c, r): (&Completion, &Finished)| {
                    *r == Finished::Retrying || (*r != Finished::LeaseLost && c.intent.ordering_key.is_some())
                };
                if batch.iter().zip(&results).any(unblocks) {
                    me.inner.progress.notify_one();
                }
                for (c, r) in batch.iter().zip(results) {
                    me.log_attempt(c, r);
                }
                drop(slot);
            });
            while writers.try_join_next().is_some() {}
        }
        while writers.join_next().await.is_some() {}
    }

    /// Record a batch, retrying database errors until the leases would
    /// expire. An outcome the database rejects (a permanent error) must not
    /// cost the others theirs: the batch is then recorded one by one, and
    /// only the rejected one is left to the rescuer.
    async fn finalize(&self, batch: &[Completion]) -> Vec<Finished> {
        if self.inner.faults.hit(point::DISPATCHER_BEFORE_FINISH).await.is_err() {
            return vec![Finished::LeaseLost; batch.len()];
        }
        let deadline = std::time::Instant::now() + self.inner.settings.lease;
        match self.finalize_until(batch, deadline).await {
            Ok(f) => f,
            Err(_) if batch.len() > 1 => {
                let mut out = Vec::with_capacity(batch.len());
                for c in batch {
                    match self.finalize_until(std::slice::from_ref(c), deadline).await {
                        Ok(f) => out.extend(f),
                        Err(e) => {
                            error!(intent_id = %c.intent.id, error = %e, "the database rejected this outcome; the intent is rescued when its lease expires");
                            out.push(Finished::LeaseLost);
                        }
                    }
                }
                out
            }
            Err(e) => {
                error!(intent_id = %batch[0].intent.id, error = %e, "the database rejected this outcome; the intent is rescued when its lease expires");
                vec![Finished::LeaseLost]
            }
        }
    }

    /// [`Dispatcher::finalize_once`], retrying transient errors until
    /// `deadline` (then every intent counts as lost); `Err` for a permanent one.
    async fn finalize_until(
        &self,
        batch: &[Completion],
        deadline: std::time::Instant,
    ) -> Result<Vec<Finished>, sqlx::Error> {
        let mut attempt = 0u32;
        loop {
            match self.finalize_once(batch).await {
                Ok(f) => return Ok(f),
                Err(e) if relay_store::classify_error(&e) == relay_store::DbErrorKind::Permanent => return Err(e),
                Err(e) => {
                    attempt += 1;
                    let delay = BackoffPolicy::DATABASE.delay(attempt, &mut rand::rng());
                    if std::time::Instant::now() + delay >= deadline {
                        error!(intents = batch.len(), error = %e,
                               "could not record outcomes before the leases expire; the intents will be rescued and re-sent with the same keys");
                        return Ok(vec![Finished::LeaseLost; batch.len()]);
                    }
                    warn!(intents = batch.len(), error = %e, "recording outcomes failed; retrying");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    async fn finalize_once(&self, batch: &[Completion]) -> Result<Vec<Finished>, sqlx::Error> {
        let items: Vec<Finish> = batch
            .iter()
            .map(|c| Finish {
                id: c.intent.id,
                token: c.intent.lease_token,
                next: c.next,
                attempt: c.attempt.clone(),
                attempt_no: c.intent.attempts,
                worker: self.inner.worker.clone(),
                attempted: c.attempt.error_class.as_deref() != Some("budget"),
            })
            .collect();
        // What each outcome records besides the intent's state, if its lease still holds.
        let outcomes: Vec<Option<(Outcome, &str)>> = batch
            .iter()
            .map(|c| match c.next {
                NextState::Succeeded => outcome_effects(&c.intent, &c.intent.on_success).map(|o| (o, "succeeded")),
                NextState::Dead => outcome_effects(&c.intent, &c.intent.on_dead).map(|o| (o, "dead")),
                // Nothing is known, so nothing is told: no on_dead, no on_success.
                NextState::Retry(_) | NextState::Uncertain => None,
            })
            .collect();
        let finished = |c: &Completion, ours: &HashSet<uuid::Uuid>| match c.next {
            _ if !ours.contains(&c.intent.id) => Finished::LeaseLost,
            NextState::Succeeded => Finished::Succeeded,
            NextState::Dead => Finished::Dead,
            NextState::Uncertain => Finished::Uncertain,
            NextState::Retry(_) => Finished::Retrying,
        };
        let mut conn = self.inner.finishes.acquire().await?;
        if outcomes.iter().all(Option::is_none) {
            // Only states and audit rows: one statement, its own transaction (FinishPool).
            let ours = intents::finish_many(&mut conn, &items).await?.into_iter().collect();
            return Ok(batch.iter().map(|c| finished(c, &ours)).collect());
        }
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        let ours: HashSet<uuid::Uuid> = intents::finish_many(&mut tx, &items).await?.into_iter().collect();
        let now = Utc::now();
        let mut records = Vec::new();
        for (c, outcome) in batch.iter().zip(&outcomes) {
            let Some((outcome, label)) = outcome.as_ref().filter(|_| ours.contains(&c.intent.id)) else { continue };
            let source_id = format!("{}:{label}", c.intent.id);
            let prov = Provenance {
                source: c.intent.emit_source.clone(),
                correlation_id: c.intent.correlation_id.clone(),
                causation_id: c.intent.causation_id.clone(),
                traceparent: c.intent.traceparent.clone(),
                aggregate_id: c.intent.aggregate_id.clone(),
            };
            for emit in &outcome.emit {
                records.push((
                    c.intent.consumer.as_str(),
                    source_id.clone(),
                    encode_event(outcome_id(c.intent.id, label, &emit.action), emit, &prov, now),
                ));
            }
            for m in &outcome.saga {
                self.move_saga(&mut tx, &c.intent, m, &source_id, label).await?;
            }
        }
        // Outcome events, grouped per consumer (one statement per consumer in the batch).
        let mut consumers: Vec<&str> = records.iter().map(|r| r.0).collect();
        consumers.sort_unstable();
        consumers.dedup();
        for consumer in consumers {
            let rows: Vec<(&str, &relay_core::OutboxRecord)> =
                records.iter().filter(|r| r.0 == consumer).map(|r| (r.1.as_str(), &r.2)).collect();
            outbox::insert_many(&mut tx, consumer, &rows).await?;
        }
        tx.commit().await?;
        Ok(batch.iter().map(|c| finished(c, &ours)).collect())
    }

    async fn move_saga(
        &self,
        tx: &mut PgConnection,
        intent: &ClaimedIntent,
        m: &relay_core::SagaMove,
        source_id: &str,
        label: &str,
    ) -> Result<(), sqlx::Error> {
        let t = if m.start {
            sagas::start(tx, &m.saga_type, &m.saga_id, &m.to, source_id).await?
        } else {
            sagas::transition(tx, &m.saga_type, &m.saga_id, &m.from, &m.to, source_id).await?
        };
        let subject = format!("{}/{}", m.saga_type, m.saga_id);
        match t {
            Transition::Applied => {
                let detail = serde_json::json!({"from": m.from, "to": m.to, "intent": intent.id, "outcome": label});
                inbox::record_history(tx, &intent.consumer, source_id, &m.action, "outcome", Some(&subject), &detail)
                    .await?;
            }
            other => {
                warn!(intent_id = %intent.id, saga = %subject, action = %m.action, result = ?other, "outcome saga move was a no-op")
            }
        }
        Ok(())
    }
}

/// An attempt's outcome on its way to the finalizer.
pub struct Completion {
    intent: ClaimedIntent,
    next: NextState,
    attempt: AttemptRecord,
    result: CallResult,
    started: std::time::Instant,
}

/// The stored outcome effects of an intent, if any.
fn outcome_effects(intent: &ClaimedIntent, effects: &serde_json::Value) -> Option<Outcome> {
    match serde_json::from_value::<Outcome>(effects.clone()) {
        Ok(o) if !o.is_empty() => Some(o),
        Ok(_) => None,
        Err(e) => {
            error!(intent_id = %intent.id, error = %e, "stored outcome effects are unreadable; none recorded");
            None
        }
    }
}

/// What to record about an attempt: its outcome class, status and error,
/// with the decision's reason in front when the budget ended the intent.
fn attempt_record(d: &Decision, r: &CallResult) -> AttemptRecord {
    let error = match &d.why {
        Some(why) => Some(format!("{why}; last error: {}", r.error.as_deref().unwrap_or("none"))),
        None => r.error.clone(),
    };
    AttemptRecord {
        started_at: r.started_at,
        outcome: d.outcome,
        status: r.status.map(i32::from),
        error_class: r.error_class.map(str::to_owned),
        error,
    }
}

/// The sleep before the next claim when the earliest pending row not due yet
/// is due at `next_due` (rows already due but not claimed wait for an earlier
/// row of their key or another worker, and are not counted). A time already
/// past (the row came due since) means re-claim soon, not spin: 5 ms at least.
pub(crate) fn until_due(next_due: Option<chrono::DateTime<Utc>>, poll: Duration) -> Duration {
    const SOON: Duration = Duration::from_millis(5);
    match next_due.map(|at| at - Utc::now()) {
        Some(ahead) => ahead.to_std().unwrap_or(SOON).clamp(SOON, poll.max(SOON)),
        None => poll,
    }
}

/// `<hostname>-<pid>`.
pub fn default_worker_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_owned()).unwrap_or_else(|_| "host".into());
    format!("{host}-{}", std::process::id())
}

/// LISTEN on `channel`; `None` (polling only) if it cannot be set up.
pub(crate) async fn listen(pool: &PgPool, channel: &str) -> Option<PgListener> {
    match PgListener::connect_with(pool).await {
        Ok(mut l) => match l.listen(channel).await {
            Ok(()) => Some(l),
            Err(e) => {
                warn!(error = %e, channel, "LISTEN failed; falling back to polling");
                None
            }
        },
        Err(e) => {
            warn!(error = %e, channel, "could not open a LISTEN connection; falling back to polling");
            None
        }
    }
}

/// The next intents handed over at `desk` (never, without one).
async fn handed_over(desk: &mut Option<Desk>) -> Vec<Handed> {
    match desk {
        Some(d) => d.recv().await,
        None => std::future::pending().await,
    }
}

/// Resolve on the next notification (never, without a listener).
pub(crate) async fn notified(listener: &mut Option<PgListener>) {
    match listener {
        Some(l) => {
            if let Err(e) = l.recv().await {
                debug!(error = %e, "LISTEN connection error; it reconnects on the next wait");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_due_later_is_waited_for_but_never_longer_than_the_poll_interval() {
        let poll = Duration::from_secs(1);
        let soon = until_due(Some(Utc::now() + chrono::Duration::milliseconds(300)), poll);
        assert!(soon <= Duration::from_millis(300) && soon >= Duration::from_millis(200), "{soon:?}");
        assert_eq!(until_due(Some(Utc::now() + chrono::Duration::seconds(30)), poll), poll);
        assert_eq!(until_due(None, poll), poll);
    }

    #[test]
    fn a_row_that_came_due_since_it_was_looked_up_is_claimed_soon_without_spinning() {
        // next_due_at only returns future times; one already past came due
        // in between. Rows due but blocked are never returned, so no spin.
        let poll = Duration::from_millis(700);
        assert_eq!(until_due(Some(Utc::now() - chrono::Duration::seconds(5)), poll), Duration::from_millis(5));
    }
}
