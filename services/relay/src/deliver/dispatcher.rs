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
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use relay_core::config::{DispatcherConfig, EndpointConfig};
use relay_core::retry::BackoffPolicy;
use relay_store::intents::{self, ClaimedIntent, Room, Scope};
use relay_store::{Claim, ClaimCommit, ClaimPool, Claimer, Position, Unreadable};
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::busy::Busy;
use super::completer::Completer;
use super::counted::Counted;
use super::executor::Executor;
use super::outcome::{Completion, Finished};
use super::reconciler::{Reconciler, Reconcilers};
use super::rescuer::{Rescuer, rescue_once};
use super::throttle::RateSync;
use crate::deliver::handoff::{self, Desk, Handed, Handoff};
use crate::runtime::claim_loop::{Resume, default_worker_id, listen, notified, until_due};
use crate::runtime::faults::{FaultInjected, Faults, Sabotage, point};

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
    settings: DispatcherConfig,
    worker: String,
    /// The consumer whose intents this dispatcher calls ([`Scope`]).
    consumer: String,
    /// Makes the calls.
    executor: Arc<Executor>,
    /// Records their outcomes.
    completer: Arc<Completer>,
    /// Per endpoint, its calls started and not ended, and how many there
    /// may be before its intents are left out of claims and of holds at
    /// ingest ([`Busy`]).
    busy: Arc<HashMap<String, Busy>>,
    faults: Faults,
    /// Signalled when this worker made intents claimable that no NOTIFY
    /// announces: an outcome recorded for an intent with an ordering key (its
    /// successor may be due now), a retry scheduled, a claim given back,
    /// expired leases rescued, a full endpoint's call ended.
    progress: Arc<tokio::sync::Notify>,
    /// Where a consumer of this process hands over what it claimed at
    /// ingest, once [`Dispatcher::handoff`] opened it; taken by the claim loop.
    desk: std::sync::Mutex<Option<Desk>>,
    /// The endpoints that reconcile uncertain intents, if any do.
    reconcilers: Option<Arc<Reconcilers>>,
    /// JSON bytes ([`relay_core::Intent::json_bytes`]) of the claimed
    /// intents whose tasks run, bounded by `max_claimed_bytes` through each
    /// claim's room.
    held_bytes: Arc<AtomicU64>,
    /// JSON bytes of outcomes the completer holds for an ordering key another
    /// transaction holds (an application's): a room of their own, which only
    /// applications' calls can fill, so that one application holding a key
    /// stops its own calls once it is full, and no one else's.
    held_outcomes: Arc<AtomicU64>,
    /// Tasks of intents handed over at ingest, running: bounded by the
    /// hand-over's room, and not by the claim loop's (see `run`).
    handed_running: Arc<AtomicU64>,
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
        let executor = Arc::new(Executor::new(endpoints, settings.lease, faults.clone())?);
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
        // Intent claims wait for the disk: see ClaimCommit. Deliberately
        // wrong when sabotaged.
        let commit =
            if faults.sabotage().has(Sabotage::ClaimsAsync) { ClaimCommit::Async } else { ClaimCommit::Durable };
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
        let desk = self.inner.desk.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        let s = &self.inner.settings;
        info!(worker = %self.inner.worker, concurrency = s.concurrency, lease = ?s.lease, "dispatcher started");
        self.warn_of_intents_it_cannot_call().await;
        let (done, done_rx) = mpsc::channel::<Completion>(s.concurrency * 2);
        let finalizer = tokio::spawn(self.inner.completer.clone().run(done_rx));
        let slots = Arc::new(Semaphore::new(s.concurrency));
        let helpers = self.spawn_helpers(&shutdown, &slots);
        let mut calls = Calls { tasks: JoinSet::new(), desk, done, slots };
        let result = self.claim_loop(&mut calls, &shutdown).await;
        self.stop(calls, result.is_ok()).await;
        let _ = finalizer.await;
        helpers.stop(result.is_ok()).await;
        info!(worker = %self.inner.worker, "dispatcher stopped");
        result
    }

    /// The rescuer, the reconciler (if an endpoint reconciles) and the
    /// rate sync, each a task of its own until `shutdown`.
    fn spawn_helpers(&self, shutdown: &CancellationToken, slots: &Arc<Semaphore>) -> Helpers {
        let i = &self.inner;
        let rescuer = Rescuer {
            pool: i.pool.clone(),
            worker: i.worker.clone(),
            every: i.settings.rescue_interval,
            progress: i.progress.clone(),
        };
        let reconciler = i.reconcilers.clone().map(|reconcilers| {
            let r = Reconciler {
                pool: i.pool.clone(),
                worker: i.worker.clone(),
                consumer: i.consumer.clone(),
                lease: i.settings.lease,
                every: i.settings.poll_interval,
                executor: i.executor.clone(),
                completer: i.completer.clone(),
                progress: i.progress.clone(),
                reconcilers,
            };
            tokio::spawn(Arc::new(r).run(shutdown.clone(), slots.clone()))
        });
        let rates = RateSync {
            pool: i.pool.clone(),
            worker: i.worker.clone(),
            endpoints: i.executor.adaptive().map(|(n, a)| (n.to_owned(), a.clone())).collect(),
        };
        Helpers {
            rescuer: tokio::spawn(rescuer.run(shutdown.clone())),
            reconciler,
            rates: tokio::spawn(rates.run(shutdown.clone())),
        }
    }

    /// Claim and start calls until `shutdown` (`Ok`) or a fault point fails
    /// (`Err`: a crash).
    async fn claim_loop(&self, calls: &mut Calls, shutdown: &CancellationToken) -> anyhow::Result<()> {
        let mut at = Between {
            listener: listen(&self.inner.pool, CHANNEL).await,
            claimer: self.inner.claims.claimer(),
            resume: Resume::default(),
            failures: 0,
            out_of_room: false,
        };
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            calls.reap()?;
            while let Some(handed) = calls.desk.as_mut().and_then(Desk::try_recv) {
                self.start_handed(calls, handed);
            }
            let step = if at.out_of_room && calls.tasks.is_empty() {
                self.wait_for_an_outcome(calls, &mut at, shutdown).await
            } else if let Some(want) = self.room_to_claim(calls, at.out_of_room) {
                self.claim_and_start(calls, &mut at, want, shutdown).await
            } else {
                self.wait_for_a_call_to_end(calls, &mut at, shutdown).await
            };
            if let ControlFlow::Break(result) = step {
                return result;
            }
        }
    }

    /// How many intents the next claim may take, if it should claim now.
    ///
    /// Claim ahead: up to one claim batch waits for a free call slot, so the
    /// next calls start the moment slots free up instead of after a round
    /// trip to the database. And claim only once a quarter of a batch has
    /// room: until then at least three quarters of one wait for slots,
    /// enough to cover the claim's round trip, and a claim for every call or
    /// two that ends cost a statement and a commit each (at concurrency 1:
    /// 0.25 commits per call, 0.12 with this; BENCHMARKS.md). After a claim
    /// cut short by the byte room, wait for a call to end first.
    /// Handed-over calls do not count: they have a room of their own, and
    /// intents of one slow endpoint handed over faster than it answers would
    /// otherwise fill this one and stop every claim — keyed intents, retries
    /// and the other endpoints' with them.
    fn room_to_claim(&self, calls: &Calls, out_of_room: bool) -> Option<usize> {
        let s = &self.inner.settings;
        let handed = usize::try_from(self.inner.handed_running.load(Ordering::Relaxed)).unwrap_or(usize::MAX);
        let claimed = calls.tasks.len().saturating_sub(handed);
        let free = (s.concurrency + s.claim_batch as usize).saturating_sub(claimed);
        let wait = free < (s.claim_batch as usize / 4).max(1) || (out_of_room && !calls.tasks.is_empty());
        (!wait).then(|| free.min(s.claim_batch as usize))
    }

    /// The byte room is held by outcomes the completer has not recorded yet
    /// (waiting for a commit, or for a key another transaction holds): no
    /// call of ours will end to free it, so wait for an outcome to be
    /// recorded, or the poll interval, rather than claim again at once.
    async fn wait_for_an_outcome(&self, calls: &mut Calls, at: &mut Between, shutdown: &CancellationToken) -> Step {
        tokio::select! {
            _ = shutdown.cancelled() => return ControlFlow::Break(Ok(())),
            _ = self.inner.progress.notified() => at.resume.back_to(None),
            _ = tokio::time::sleep(self.inner.settings.poll_interval) => {}
            handed = handed_over(&mut calls.desk) => self.start_handed(calls, handed),
        }
        at.out_of_room = false;
        ControlFlow::Continue(())
    }

    /// Too many calls wait for a slot to claim more: wait for one to end (or
    /// for intents handed over).
    async fn wait_for_a_call_to_end(&self, calls: &mut Calls, at: &mut Between, shutdown: &CancellationToken) -> Step {
        tokio::select! {
            _ = shutdown.cancelled() => return ControlFlow::Break(Ok(())),
            done = calls.tasks.join_next() => {
                if let Some(Ok(Err(f))) = done { return ControlFlow::Break(Err(f.into())); }
            }
            handed = handed_over(&mut calls.desk) => self.start_handed(calls, handed),
        }
        at.out_of_room = false;
        ControlFlow::Continue(())
    }

    /// Claim up to `want` due intents and start their calls; after a claim
    /// that found fewer, wait for more to come due.
    async fn claim_and_start(
        &self,
        calls: &mut Calls,
        at: &mut Between,
        want: usize,
        shutdown: &CancellationToken,
    ) -> Step {
        let s = &self.inner.settings;
        // Our own progress (a retry scheduled, a key's earlier intent
        // finished, a claim given back) may have made rows due behind the
        // position: look from the start.
        if futures::FutureExt::now_or_never(self.inner.progress.notified()).is_some() {
            at.resume.back_to(None);
        }
        let (after, back) = at.resume.next(s.poll_interval);
        // The lease clock starts before the claim is sent: the
        // database's lease starts at the statement, and every moment the
        // claim takes to come back is a moment less of it.
        let claimed_at = std::time::Instant::now();
        let Claim { rows: claimed, unreadable, next_due, last, cut, .. } =
            match self.claim(&mut at.claimer, want, after).await {
                Ok(c) => {
                    at.failures = 0;
                    c
                }
                Err(e) => {
                    at.resume.back_to(None);
                    at.failures += 1;
                    let delay = s.poll_interval.min(BackoffPolicy::DATABASE.delay(at.failures, &mut rand::rng()));
                    error!(worker = %self.inner.worker, error = %e, "claiming intents failed; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return ControlFlow::Break(Ok(())),
                        _ = tokio::time::sleep(delay) => return ControlFlow::Continue(()),
                    }
                }
            };
        // Rows that cannot be read count as claimed: a claim that took
        // `want` rows was full, whatever it could read of them.
        let n = claimed.len() + unreadable.len();
        if n > 0 {
            crate::runtime::metrics::claimed("claim", n as u64);
            if let Err(f) = self.inner.faults.hit(point::DISPATCHER_AFTER_CLAIM).await {
                return ControlFlow::Break(Err(f.into()));
            }
        }
        // Deliberately wrong: the lease clock starts after the claim.
        let claimed_at = if self.inner.faults.sabotage().has(Sabotage::LeaseClockAfterClaim) {
            std::time::Instant::now()
        } else {
            claimed_at
        };
        for intent in claimed {
            self.start(calls, intent, claimed_at, None);
        }
        if !unreadable.is_empty() {
            self.finish_unreadable(&unreadable).await;
        }
        if n == want || cut {
            // A full claim has rows, so a last one (one cut by its room may have none).
            if let Some(last) = last {
                at.resume.claimed(back, last);
            }
            at.out_of_room = cut;
            return ControlFlow::Continue(()); // more may be due right now
        }
        // Nothing more after the position either: the next claim looks from
        // the start. Not at once: what a claim after the position passed
        // over is a row whose wake-up is still to come (a NOTIFY buffered
        // while this loop claimed without waiting, our own progress) or one
        // the poll interval covers, as before.
        at.resume.back_to(None);
        self.wait_for_work(calls, at, next_due, shutdown).await
    }

    /// Nothing more is due: wait for new intents (NOTIFY), for our own
    /// progress, or for the next retry to come due. A call ending does not
    /// wake the claim by itself: the claim just took fewer than it had room
    /// for, so a freed slot changes nothing, and re-claiming after every call
    /// would cost two queries per call under a steady load.
    async fn wait_for_work(
        &self,
        calls: &mut Calls,
        at: &mut Between,
        next_due: Option<chrono::DateTime<chrono::Utc>>,
        shutdown: &CancellationToken,
    ) -> Step {
        let until = tokio::time::Instant::now() + until_due(next_due, self.inner.settings.poll_interval);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return ControlFlow::Break(Ok(())),
                _ = notified(&mut at.listener) => return ControlFlow::Continue(()),
                _ = self.inner.progress.notified() => return ControlFlow::Continue(()),
                _ = tokio::time::sleep_until(until) => return ControlFlow::Continue(()),
                Some(done) = calls.tasks.join_next(), if !calls.tasks.is_empty() => {
                    if let Ok(Err(f)) = done { return ControlFlow::Break(Err(f.into())); }
                }
                // Already claimed: no reason to claim again.
                handed = handed_over(&mut calls.desk) => self.start_handed(calls, handed),
            }
        }
    }

    /// Stopping: after a clean end, give back what was handed over and not
    /// started, let the calls in flight finish and those not sent come back
    /// unsent; after a crash, drop every call where it is.
    async fn stop(&self, calls: Calls, clean: bool) {
        let Calls { mut tasks, desk, done, .. } = calls;
        if clean {
            if let Some(desk) = desk {
                desk.close(&self.inner.pool).await;
            }
            info!(worker = %self.inner.worker, in_flight = tasks.len(),
                  "dispatcher stopping; finishing calls in flight, giving back those not sent yet");
            self.inner.executor.stop();
            while let Some(ended) = tasks.join_next().await {
                if let Ok(Err(f)) = ended {
                    warn!(error = %f, "fault during shutdown");
                }
            }
        } else {
            tasks.abort_all();
        }
        // The completer ends once every sender is gone.
        drop(done);
    }

    /// Start a task that calls `intent` when a call slot is free, then hands
    /// its outcome to the finalizer. `room`: the handed-over intent's unit of
    /// room, given back when the task ends.
    fn start(
        &self,
        calls: &mut Calls,
        intent: ClaimedIntent,
        claimed_at: std::time::Instant,
        room: Option<OwnedSemaphorePermit>,
    ) {
        let (me, done_tx, permits) = (self.clone(), calls.done.clone(), calls.slots.clone());
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
        calls.tasks.spawn(async move {
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
    fn start_handed(&self, calls: &mut Calls, handed: Vec<Handed>) {
        for Handed { intent, since, room } in handed {
            self.start(calls, intent, since, Some(room));
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
    /// dispatcher does not have: it never claims them, so they would
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
    async fn claim(
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
    /// with as many calls started and not ended as they may have.
    fn claimable_endpoints(&self) -> Vec<&str> {
        self.inner.busy.iter().filter(|(_, b)| b.has_room()).map(|(name, _)| name.as_str()).collect()
    }

    /// Return intents with expired leases to pending (normally run by the rescue loop).
    pub async fn rescue_once(&self) -> Result<Vec<uuid::Uuid>, sqlx::Error> {
        rescue_once(&self.inner.pool).await
    }
}

/// What a step of the claim loop says: go on, or stop with this result.
type Step = ControlFlow<anyhow::Result<()>>;

/// The calls the claim loop started, and what each needs: a call slot, and
/// the way to the completer.
struct Calls {
    tasks: JoinSet<Result<(), FaultInjected>>,
    /// Where a consumer of this process hands over what it claimed at ingest.
    desk: Option<Desk>,
    done: mpsc::Sender<Completion>,
    slots: Arc<Semaphore>,
}

impl Calls {
    /// Reap the ended calls; one whose fault point failed means "crash now".
    fn reap(&mut self) -> Result<(), FaultInjected> {
        let mut crashed = None;
        while let Some(done) = self.tasks.try_join_next() {
            if let Ok(Err(f)) = done {
                crashed = Some(f);
            }
        }
        crashed.map_or(Ok(()), Err)
    }
}

/// Where the claim loop stands between two claims.
struct Between {
    listener: Option<PgListener>,
    claimer: Claimer,
    /// Where the next claim may start (see `crate::runtime::claim_loop`).
    resume: Resume<Position>,
    /// Claims failed in a row, for the backoff.
    failures: u32,
    /// The last claim was cut short by the byte room.
    out_of_room: bool,
}

/// The dispatcher's helper tasks.
struct Helpers {
    rescuer: JoinHandle<()>,
    reconciler: Option<JoinHandle<()>>,
    rates: JoinHandle<()>,
}

impl Helpers {
    /// After a clean stop the reconciler finishes the questions it asked;
    /// after a crash it is dropped where it is, as the others always are.
    async fn stop(self, clean: bool) {
        if let Some(reconciler) = self.reconciler {
            if clean {
                let _ = reconciler.await;
            } else {
                reconciler.abort();
            }
        }
        self.rescuer.abort();
        self.rates.abort();
    }
}

/// The next intents handed over at `desk` (never, without one).
async fn handed_over(desk: &mut Option<Desk>) -> Vec<Handed> {
    match desk {
        Some(d) => d.recv().await,
        None => std::future::pending().await,
    }
}
