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
//! over after its commit ([`crate::deliver::handoff`]); from the call on they go the
//! same way.
//!
//! If this process dies anywhere in that sequence, the lease expires, any
//! dispatcher's rescuer returns the intent to pending, and it is sent again
//! with the same key (C9, C10). A worker that finishes after its lease was
//! rescued finds its token gone and records nothing (C17).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use relay_core::config::{DispatcherConfig, EndpointConfig};
use relay_core::retry::BackoffPolicy;
use relay_store::intents::{self, ClaimedIntent, Room, Scope};
use relay_store::{Claim, ClaimCommit, ClaimPool, Claimer, Position, Unreadable};
use sqlx::PgPool;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::completer::Completer;
use super::executor::Executor;
use super::outcome::{Completion, Finished};
use super::reconciler::Reconcilers;
use crate::deliver::handoff::{self, Desk, Handed, Handoff};
use crate::runtime::claim_loop::{Resume, default_worker_id, listen, notified, until_due};
use crate::runtime::faults::{FaultInjected, Faults, point};

/// Channel the intents trigger notifies.
pub const CHANNEL: &str = "relay_intents";

/// The intent dispatcher of one process.
#[derive(Clone)]
pub struct Dispatcher {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) pool: PgPool,
    /// The claim loop's connection ([`ClaimPool`]: one round trip a claim).
    pub(super) claims: ClaimPool,
    pub(super) settings: DispatcherConfig,
    pub(super) worker: String,
    /// The consumer whose intents this dispatcher calls ([`Scope`]).
    pub(super) consumer: String,
    /// Makes the calls.
    pub(super) executor: Executor,
    /// Records their outcomes.
    pub(super) completer: Arc<Completer>,
    /// Per endpoint, its calls started and not ended, and how many there
    /// may be before its intents are left out of claims and of holds at
    /// ingest ([`Busy`]).
    pub(super) busy: Arc<HashMap<String, Busy>>,
    pub(super) faults: Faults,
    /// Signalled when this worker made intents claimable that no NOTIFY
    /// announces: an outcome recorded for an intent with an ordering key (its
    /// successor may be due now), a retry scheduled, a claim given back,
    /// expired leases rescued, a full endpoint's call ended.
    pub(super) progress: Arc<tokio::sync::Notify>,
    /// Where a consumer of this process hands over what it claimed at
    /// ingest, once [`Dispatcher::handoff`] opened it; taken by the claim loop.
    pub(super) desk: std::sync::Mutex<Option<Desk>>,
    /// The endpoints that reconcile uncertain intents, if any do.
    pub(super) reconcilers: Option<Arc<Reconcilers>>,
    /// JSON bytes ([`relay_core::Intent::json_bytes`]) of the claimed
    /// intents whose tasks run, bounded by `max_claimed_bytes` through each
    /// claim's room.
    pub(super) held_bytes: Arc<AtomicU64>,
    /// JSON bytes of outcomes the completer holds for an ordering key another
    /// transaction holds (an application's): a room of their own, which only
    /// applications' calls can fill, so that one application holding a key
    /// stops its own calls once it is full, and no one else's.
    pub(super) held_outcomes: Arc<AtomicU64>,
    /// Tasks of intents handed over at ingest, running: bounded by the
    /// hand-over's room, and not by the claim loop's (see `run`).
    pub(super) handed_running: Arc<AtomicU64>,
}

/// A share of a count ([`Inner::held_bytes`], [`Inner::held_outcomes`],
/// [`Inner::handed_running`]), given back when it is dropped: when its task
/// ends, or when the outcome it travels with is recorded.
pub(super) struct Counted(Arc<AtomicU64>, u64);

impl Counted {
    pub(super) fn add(count: &Arc<AtomicU64>, n: u64) -> Counted {
        count.fetch_add(n, Ordering::Relaxed);
        Counted(count.clone(), n)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::Relaxed);
    }
}

impl Dispatcher {
    /// A dispatcher of `consumer`'s intents over `endpoints`, writing
    /// outcome events with a `format` with `encoders` (by topic). Must be
    /// called inside a tokio runtime.
    pub fn new(
        pool: PgPool,
        settings: DispatcherConfig,
        consumer: &str,
        endpoints: &std::collections::BTreeMap<String, EndpointConfig>,
        encoders: relay_core::router::Encoders,
        faults: Faults,
    ) -> anyhow::Result<Dispatcher> {
        let worker = settings.worker_id.clone().unwrap_or_else(default_worker_id);
        let batch = settings.claim_batch as usize;
        let executor = Executor::new(endpoints, settings.lease, faults.clone())?;
        let adaptive: HashMap<&str, Arc<super::throttle::Adaptive>> =
            executor.adaptive().map(|(name, a)| (name, a.clone())).collect();
        let busy = Arc::new(
            endpoints
                .iter()
                .map(|(name, cfg)| (name.clone(), Busy::new(cfg, batch, adaptive.get(name.as_str()).cloned())))
                .collect(),
        );
        let progress = Arc::new(tokio::sync::Notify::new());
        let (held_bytes, held_outcomes) = (Arc::<AtomicU64>::default(), Arc::<AtomicU64>::default());
        let completer = Arc::new(Completer::new(
            &pool,
            &worker,
            settings.lease,
            faults.clone(),
            progress.clone(),
            encoders,
            held_outcomes.clone(),
        ));
        // Intent claims wait for the disk (D5): see ClaimCommit. Deliberately
        // wrong when sabotaged.
        let commit = if faults.sabotage().claims_async { ClaimCommit::Async } else { ClaimCommit::Durable };
        let claims = ClaimPool::beside(&pool, 1, commit);
        let desk = std::sync::Mutex::default();
        let consumer = consumer.to_owned();
        let reconcilers = Reconcilers::new(endpoints)?.map(Arc::new);
        let inner = Inner {
            pool,
            claims,
            settings,
            worker,
            consumer,
            executor,
            completer,
            busy,
            faults,
            progress,
            desk,
            reconcilers,
            held_bytes,
            held_outcomes,
            handed_running: Arc::default(),
        };
        Ok(Dispatcher { inner: Arc::new(inner) })
    }

    /// This dispatcher's worker id.
    pub fn worker(&self) -> &str {
        &self.inner.worker
    }

    /// Open the hand-over of intents that a consumer of this process, with
    /// batches of up to `consumer_batch` records, claims at ingest for this
    /// dispatcher ([`crate::deliver::handoff`]). The dispatcher keeps the
    /// receiving end; the consumer's processor holds the returned sender.
    pub fn handoff(&self, consumer_batch: usize) -> Handoff {
        let s = &self.inner.settings;
        let room = handoff::room(s.claim_batch as usize, consumer_batch);
        // An endpoint without a rate limit may also have a consumer batch
        // held beyond its bound, as the room above allows: holding is what
        // keeps calls at peak load off the claim path (BENCHMARKS.md), and
        // only a throttled endpoint's intents would wait at its limits.
        let busy = self.inner.busy.clone();
        let endpoint_room: handoff::EndpointRoom = Arc::new(move |e: &str| {
            busy.get(e).map_or(0, |b| if b.rate_limited { b.room() } else { b.room() + consumer_batch })
        });
        let (sender, desk) = handoff::channel(&self.inner.worker, s.lease, room, endpoint_room);
        *self.inner.desk.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(desk);
        sender
    }

    /// Run until `shutdown`: stop claiming, let calls in flight finish and
    /// record their outcome, then return. A fault point that fails stops the
    /// loop at once, leaving claimed intents to the rescuer (like a crash).
    /// Once [`Dispatcher::handoff`] was opened, also call the intents a
    /// consumer claimed at ingest for us; stopping, it gives back to pending
    /// what was handed over and not started.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let mut desk = self.inner.desk.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        let s = &self.inner.settings;
        info!(worker = %self.inner.worker, concurrency = s.concurrency, lease = ?s.lease, "dispatcher started");
        self.warn_of_intents_it_cannot_call().await;
        let mut listener = listen(&self.inner.pool, CHANNEL).await;
        let rescuer = tokio::spawn(self.clone().rescue_loop(shutdown.clone()));
        let (done_tx, done_rx) = mpsc::channel::<Completion>(s.concurrency * 2);
        let finalizer = tokio::spawn(self.inner.completer.clone().run(done_rx));
        let permits = Arc::new(Semaphore::new(s.concurrency));
        let reconciler = tokio::spawn(self.clone().reconcile_loop(shutdown.clone(), permits.clone()));
        let rates = tokio::spawn(self.clone().rate_loop(shutdown.clone()));
        let mut tasks: JoinSet<Result<(), FaultInjected>> = JoinSet::new();
        let mut failures = 0u32;
        let mut claimer = self.inner.claims.claimer();
        // Where the next claim may start (see `crate::runtime::claim_loop`).
        let mut resume: Resume<Position> = Resume::default();
        let mut out_of_room = false;
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
            // And claim only what fits in the byte room: after a claim cut
            // short by it, wait for a call to end first.
            // Handed-over calls do not count: they have a room of their own,
            // and intents of one slow endpoint handed over faster than it
            // answers would otherwise fill this one and stop every claim —
            // keyed intents, retries and the other endpoints' with them.
            if out_of_room && tasks.is_empty() {
                // The room is held by outcomes the completer has not recorded
                // yet (waiting for a commit, or for a key another transaction
                // holds): no call of ours will end to free it, so wait for
                // an outcome to be recorded, or the poll interval, rather
                // than claim again at once, and again.
                tokio::select! {
                    _ = shutdown.cancelled() => break Ok(()),
                    _ = self.inner.progress.notified() => resume.back_to(None),
                    _ = tokio::time::sleep(s.poll_interval) => {}
                    handed = handed_over(&mut desk) => self.start_handed(&mut tasks, handed, &done_tx, &permits),
                }
                out_of_room = false;
                continue;
            }
            let handed = usize::try_from(self.inner.handed_running.load(Ordering::Relaxed)).unwrap_or(usize::MAX);
            let claimed = tasks.len().saturating_sub(handed);
            let free = (s.concurrency + s.claim_batch as usize).saturating_sub(claimed);
            if free < (s.claim_batch as usize / 4).max(1) || (out_of_room && !tasks.is_empty()) {
                tokio::select! {
                    _ = shutdown.cancelled() => break Ok(()),
                    done = tasks.join_next() => {
                        if let Some(Ok(Err(f))) = done { break Err(f.into()); }
                    }
                    handed = handed_over(&mut desk) => self.start_handed(&mut tasks, handed, &done_tx, &permits),
                }
                out_of_room = false;
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
            // The lease clock starts before the claim is sent (D2): the
            // database's lease starts at the statement, and every moment the
            // claim takes to come back is a moment less of it.
            let claimed_at = std::time::Instant::now();
            let Claim { rows: claimed, unreadable, next_due, last, cut, .. } =
                match self.claim(&mut claimer, want, after).await {
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
            // Rows that cannot be read count as claimed: a claim that took
            // `want` rows was full, whatever it could read of them.
            let n = claimed.len() + unreadable.len();
            if n > 0 {
                crate::runtime::metrics::claimed("claim", n as u64);
                if let Err(f) = self.inner.faults.hit(point::DISPATCHER_AFTER_CLAIM).await {
                    break Err(f.into());
                }
            }
            // Deliberately wrong (D2): the lease clock starts after the claim.
            let claimed_at = if self.inner.faults.sabotage().lease_clock_after_claim {
                std::time::Instant::now()
            } else {
                claimed_at
            };
            for intent in claimed {
                self.start(&mut tasks, intent, claimed_at, None, &done_tx, &permits);
            }
            if !unreadable.is_empty() {
                self.finish_unreadable(&unreadable).await;
            }
            if n == want || cut {
                // A full claim has rows, so a last one (one cut by its room
                // may have none).
                if let Some(last) = last {
                    resume.claimed(back, last);
                }
                out_of_room = cut;
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
            info!(worker = %self.inner.worker, in_flight = tasks.len(),
                  "dispatcher stopping; finishing calls in flight, giving back those not sent yet");
            self.inner.executor.stop();
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
        if result.is_ok() {
            let _ = reconciler.await;
        } else {
            reconciler.abort();
        }
        rescuer.abort();
        rates.abort();
        info!(worker = %self.inner.worker, "dispatcher stopped");
        result
    }

    /// Start a task that calls `intent` when a call slot is free, then hands
    /// its outcome to the finalizer. `room`: the handed-over intent's unit of
    /// room, given back when the task ends.
    pub(super) fn start(
        &self,
        tasks: &mut JoinSet<Result<(), FaultInjected>>,
        intent: ClaimedIntent,
        claimed_at: std::time::Instant,
        room: Option<OwnedSemaphorePermit>,
        done_tx: &mpsc::Sender<Completion>,
        permits: &Arc<Semaphore>,
    ) {
        let (me, done_tx, permits) = (self.clone(), done_tx.clone(), permits.clone());
        let busy = self.inner.busy.get(&intent.intent.endpoint).map(|b| b.enter(&self.inner.progress));
        // What was claimed counts against the claims' room; what was handed
        // over has the hand-over's own (counted in intents), and counted here
        // too, a slow endpoint's handed calls would leave no room for claims.
        let counted = match room {
            None => Counted::add(&self.inner.held_bytes, intent.intent.json_bytes() as u64),
            Some(_) => Counted::add(&self.inner.handed_running, 1),
        };
        // A claimed intent's bytes stay counted until its outcome is recorded.
        let keeps_bytes = room.is_none();
        tasks.spawn(async move {
            let _room = room;
            let mut completion = {
                let _busy = busy;
                let send_by = me.inner.executor.send_by(&intent, claimed_at);
                match me.inner.executor.execute(intent, send_by, &permits).await? {
                    Ok(completion) => completion,
                    Err(intent) => {
                        // Waited so long at the endpoint's limits or for a
                        // call slot that the call might outlive the lease and
                        // overlap a rescued copy: give the claim back.
                        me.release(&intent).await;
                        return Ok(());
                    }
                }
            };
            // The call slot is free before the hand-over: a finalizer
            // busy with a slow commit holds up the outcomes, not the
            // next calls. This task still counts against the claim
            // loop's bound until its outcome is handed over, and its
            // bytes against the claims' room until the outcome is recorded.
            if keeps_bytes {
                completion.counted = Some(counted);
            }
            me.hand_over(completion, &done_tx).await;
            Ok(())
        });
    }

    /// Start the calls of intents claimed at ingest and handed over.
    pub(super) fn start_handed(
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

    /// Hand an attempt's outcome to the completer, waiting while its queue
    /// is full.
    async fn hand_over(&self, completion: Completion, done: &mpsc::Sender<Completion>) {
        if let Err(lost) = done.send(completion).await {
            lost.0.log(&self.inner.worker, Finished::LeaseLost);
        }
    }

    /// Record a batch of outcomes as the completer does (public for tests).
    pub async fn finalize(&self, batch: &mut [Completion]) -> Vec<Finished> {
        self.inner.completer.finalize(batch).await
    }

    /// Say so when this consumer has pending intents of endpoints this
    /// dispatcher does not have: it never claims them (D3), so they would
    /// wait unnoticed but for `relay verify`'s stuck check.
    async fn warn_of_intents_it_cannot_call(&self) {
        let ours: Vec<&str> = self.inner.executor.endpoints().collect();
        let found = match self.inner.pool.acquire().await {
            Ok(mut conn) => intents::pending_elsewhere(&mut conn, &self.inner.consumer, &ours).await,
            Err(e) => Err(e),
        };
        match found {
            Ok(elsewhere) => {
                for (endpoint, n) in elsewhere {
                    warn!(consumer = %self.inner.consumer, %endpoint, pending = n,
                          "pending intents of an endpoint this dispatcher does not have: they wait (and hold their \
                           ordering keys) until a dispatcher with that endpoint runs; add it to [endpoints] if it \
                           was renamed or removed by mistake");
                }
            }
            Err(e) => debug!(error = %e, "could not look for intents of endpoints this dispatcher does not have"),
        }
    }

    /// Return an unstarted claim to pending (its attempt is not counted).
    pub(super) async fn release(&self, intent: &ClaimedIntent) {
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

    /// Record claimed intents whose stored columns cannot be read as dead,
    /// never sent: one such row must not hold up the rest of its claim, nor
    /// be claimed again and again. If that fails, their lease runs out and
    /// the next claim to take them tries again.
    async fn finish_unreadable(&self, unreadable: &[Unreadable]) {
        for u in unreadable {
            error!(worker = %self.inner.worker, intent_id = %u.id, error = %u.error,
                   "a claimed intent cannot be read: it ends dead, never sent, without its on_dead effects");
        }
        let finished = match self.inner.pool.acquire().await {
            Ok(mut conn) => intents::finish_unreadable(&mut conn, unreadable).await,
            Err(e) => Err(e),
        };
        match finished {
            Ok(_) => self.inner.progress.notify_one(),
            Err(e) => warn!(worker = %self.inner.worker, error = %e,
                            "recording unreadable intents dead failed; they are claimed again when their lease expires"),
        }
    }

    /// Claim up to `limit` intents; a short claim also says when the next one
    /// not due yet comes due, for the sleep after it (at most the poll
    /// interval; NOTIFY wakes us earlier for new intents, and `progress` for
    /// what our own outcomes made due).
    pub(super) async fn claim(
        &self,
        claimer: &mut Claimer,
        limit: usize,
        after: Option<Position>,
    ) -> Result<Claim<ClaimedIntent>, sqlx::Error> {
        let (worker, lease) = (&self.inner.worker, self.inner.settings.lease);
        let endpoints = self.claimable_endpoints();
        if endpoints.is_empty() {
            // Every endpoint is full: a claim could take nothing, and would
            // read every due row to find that out. A call ending wakes the
            // loop (Busy).
            return Ok(Claim {
                rows: Vec::new(),
                unreadable: Vec::new(),
                next_due: None,
                last: None,
                passed: None,
                cut: false,
            });
        }
        let scope = Scope { consumer: &self.inner.consumer, endpoints: &endpoints };
        let held = self.inner.held_bytes.load(Ordering::Relaxed);
        let max = self.inner.settings.max_claimed_bytes;
        let waiting = self.inner.held_outcomes.load(Ordering::Relaxed);
        let room = Room { bytes: max.saturating_sub(held), first_always: held == 0, applications: waiting < max };
        claimer
            .claim(async |conn| intents::claim_after(conn, &scope, worker, limit as i64, lease, after, room).await)
            .await
    }

    /// The endpoints whose intents the next claim may take: ours, less those
    /// with as many calls started and not ended as they may have (D10).
    fn claimable_endpoints(&self) -> Vec<&str> {
        self.inner.busy.iter().filter(|(_, b)| b.has_room()).map(|(name, _)| name.as_str()).collect()
    }

    pub(super) async fn rescue_loop(self, shutdown: CancellationToken) {
        let every = self.inner.settings.rescue_interval;
        loop {
            tokio::select! { _ = shutdown.cancelled() => return, _ = tokio::time::sleep(every) => {} }
            match self.rescue_once().await {
                Ok(ids) if !ids.is_empty() => {
                    self.inner.progress.notify_one();
                    crate::runtime::metrics::rescued("intent", ids.len() as u64);
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
}

/// An endpoint's calls started and not ended in this dispatcher. Once there
/// are as many as it can make at once and a claim batch more — or, rate
/// limited (a fixed or an adaptive rate), as many as it may start in two
/// seconds at its rate now — claims leave its intents out: more of them
/// would only wait at its limits while other endpoints' intents stay
/// unclaimed behind them (D10). A call ending at the bound wakes the claim loop.
#[derive(Debug)]
pub(super) struct Busy {
    now: Arc<std::sync::atomic::AtomicUsize>,
    /// The bound, as last computed (an adaptive rate moves it).
    most: Arc<std::sync::atomic::AtomicUsize>,
    at_once: usize,
    rate_limited: bool,
    adaptive: Option<Arc<super::throttle::Adaptive>>,
}

/// As many calls as start in two seconds at `rate` calls/s: at least one
/// and at most `at_once`, twice.
fn two_seconds_at(rate: f64, at_once: usize) -> usize {
    (rate.ceil().clamp(1.0, at_once as f64) as usize).saturating_mul(2)
}

impl Busy {
    fn new(cfg: &EndpointConfig, claim_batch: usize, adaptive: Option<Arc<super::throttle::Adaptive>>) -> Busy {
        let at_once = cfg.concurrency.max(1);
        let most = match (cfg.rate_limit_per_second, &adaptive) {
            (Some(r), _) => two_seconds_at(r as f64, at_once),
            (None, Some(a)) => two_seconds_at(a.share(), at_once),
            (None, None) => at_once.saturating_add(claim_batch),
        };
        Busy {
            now: Arc::default(),
            most: Arc::new(most.into()),
            at_once,
            rate_limited: cfg.rate_limit_per_second.is_some() || adaptive.is_some(),
            adaptive,
        }
    }

    fn has_room(&self) -> bool {
        self.room() > 0
    }

    /// How many more calls may start before the endpoint is full.
    fn room(&self) -> usize {
        use std::sync::atomic::Ordering::Relaxed;
        if let Some(a) = &self.adaptive {
            self.most.store(two_seconds_at(a.share(), self.at_once), Relaxed);
        }
        self.most.load(Relaxed).saturating_sub(self.now.load(Relaxed))
    }

    /// Count one call of this endpoint in until the returned guard is
    /// dropped, which notifies `progress` if the endpoint was full.
    fn enter(&self, progress: &Arc<tokio::sync::Notify>) -> BusyGuard {
        self.now.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        BusyGuard { now: self.now.clone(), most: self.most.clone(), progress: progress.clone() }
    }
}

/// One call counted in [`Busy`]; dropped, it counts the call out and wakes
/// the claim loop if the endpoint was full until then.
pub(super) struct BusyGuard {
    now: Arc<std::sync::atomic::AtomicUsize>,
    most: Arc<std::sync::atomic::AtomicUsize>,
    progress: Arc<tokio::sync::Notify>,
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.now.fetch_sub(1, Relaxed) >= self.most.load(Relaxed) {
            self.progress.notify_one();
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

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(extra: serde_json::Value) -> EndpointConfig {
        let mut v = serde_json::json!({"base_url": "http://provider.test/", "concurrency": 16});
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_throttled_adaptive_endpoint_counts_as_rate_limited_at_its_rate_now() {
        let cfg = endpoint(serde_json::json!({"adaptive": {"start": 50, "min": 1, "max": 50}}));
        let adaptive = Arc::new(super::super::throttle::Adaptive::new(cfg.adaptive.unwrap()));
        let busy = Busy::new(&cfg, 64, Some(adaptive.clone()));
        assert!(busy.rate_limited, "its calls wait at its rate line: no hand-over room beyond its own");
        assert_eq!(busy.room(), 32, "two seconds at 50/s, at most its concurrency (16), twice");
        adaptive.set(1.0);
        assert_eq!(busy.room(), 2, "throttled down to 1/s: two seconds' calls, not 16 + a claim batch");
        let unlimited = Busy::new(&endpoint(serde_json::json!({})), 64, None);
        assert!(!unlimited.rate_limited);
        assert_eq!(unlimited.room(), 16 + 64);
        let fixed = Busy::new(&endpoint(serde_json::json!({"rate_limit_per_second": 5})), 64, None);
        assert_eq!((fixed.rate_limited, fixed.room()), (true, 10));
    }
}
