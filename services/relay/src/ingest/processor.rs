//! One record, inside the caller's transaction: route, guard, write.
//!
//! The caller (the consumer's batch loop, or a dead-letter replay) owns the
//! transaction; each record runs in a savepoint of it, so a record that turns
//! out to be poison, a no-op or "not yet" rolls back only its own writes and
//! its neighbours in the batch are unaffected (R12).
//!
//! Order of work for a routed event, all in one transaction (R2–R7, R14, R20):
//!
//! 1. inbox row, `ON CONFLICT DO NOTHING` — zero rows: duplicate, done;
//! 2. business idempotency key — taken: `duplicate_key`;
//! 3. version guard / sequence guard — `stale`, `duplicate_version`,
//!    `duplicate_sequence`; a sequence gap is "retry later";
//! 4. saga moves — `duplicate_transition`, `invalid_transition`; a missing
//!    saga is "retry later" (R19);
//! 5. the code handler, if any;
//! 6. intents and outbox rows with derived ids, history rows, counters.
//!
//! A no-op from steps 2–4 rolls the savepoint back and records the inbox row
//! with the no-op's class, so every event is recorded once with what happened.

use std::sync::Arc;

use chrono::Utc;
use relay_core::effects::{encode_dead_letter, encode_event};
use relay_core::ids::derived_id;
use relay_core::{
    CallSpec, CompiledRoute, InputEvent, Plan, Poison, PoisonClass, Provenance, RawRecord, Routed, Router,
};
use relay_store::inbox::{self, InboxInsert, InboxOutcome, KeyClaim, NewInboxRow, SequenceCheck, VersionCheck};
use relay_store::intents::{self, ClaimedIntent, Hold, NewIntent};
use relay_store::sagas::{self, Transition};
use relay_store::{DbErrorKind, classify_error, dead_letters, effects, outbox};
use serde_json::json;
use sqlx::{Connection, PgConnection};

use crate::deliver::handoff::{Handed, Handoff};
use crate::ingest::handler::{HandlerError, Handlers};
use crate::runtime::faults::Sabotage;

/// The identity of a processed event, for logs (R16). Never the payload.
#[derive(Debug, Clone, Default)]
pub struct EventInfo {
    /// Event id.
    pub id: Option<String>,
    /// Event type.
    pub event_type: Option<String>,
    /// Route name.
    pub route: Option<String>,
    /// Business idempotency key.
    pub idempotency_key: Option<String>,
    /// Aggregate id.
    pub aggregate_id: Option<String>,
    /// Correlation id.
    pub correlation_id: Option<String>,
    /// Causation id.
    pub causation_id: Option<String>,
}

impl EventInfo {
    fn of(event: &InputEvent, route: Option<&CompiledRoute>) -> EventInfo {
        EventInfo {
            id: Some(event.id.clone()),
            event_type: Some(event.event_type.clone()),
            route: route.map(|r| r.name.clone()),
            idempotency_key: event.idempotency_key.clone(),
            aggregate_id: event.aggregate_id.clone(),
            correlation_id: event.correlation_id.clone(),
            causation_id: event.causation_id.clone(),
        }
    }

    fn of_poison(p: &Poison) -> EventInfo {
        EventInfo { id: p.event_id.clone(), event_type: p.event_type.clone(), ..EventInfo::default() }
    }
}

/// What processing a record decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// The effects were written.
    Applied {
        /// Intents written (new rows).
        intents: usize,
        /// Outbox events written (new rows).
        events: usize,
    },
    /// Already in the inbox: a duplicate delivery or replay; nothing written.
    Duplicate,
    /// Recorded in the inbox as a classified no-op (R5).
    NoOp {
        /// The class.
        outcome: InboxOutcome,
        /// Why, for the log line.
        detail: String,
    },
    /// Permanently unprocessable: the caller parks it.
    Poison(Poison),
    /// Not yet processable (missing reference, sequence gap): the caller
    /// retries it with backoff, then parks it.
    RetryLater(Poison),
    /// Its route is paused: the partition waits here, nothing is skipped.
    Paused {
        /// The paused route.
        route: String,
    },
}

impl Step {
    /// Short name for logs and counts.
    pub fn result(&self) -> &'static str {
        match self {
            Step::Applied { .. } => "applied",
            Step::Duplicate => "duplicate",
            Step::NoOp { outcome, .. } => outcome.as_str(),
            Step::Poison(_) => "poison",
            Step::RetryLater(_) => "retry_later",
            Step::Paused { .. } => "paused",
        }
    }
}

/// A processed record: the decision and who it was.
#[derive(Debug, Clone)]
pub struct Processed {
    /// The decision.
    pub step: Step,
    /// The event's identity, as far as it could be read.
    pub info: EventInfo,
}

enum Applied {
    Written { intents: usize, events: usize },
    Duplicate,
    NoOp(InboxOutcome, String),
}

enum ApplyError {
    RetryLater(Poison),
    Poison(Poison),
    Db(sqlx::Error),
}

impl From<sqlx::Error> for ApplyError {
    fn from(e: sqlx::Error) -> Self {
        ApplyError::Db(e)
    }
}

/// A record that can take the fast path, decoded and planned.
struct SimpleItem<'r> {
    record: &'r RawRecord,
    event: InputEvent,
    info: EventInfo,
    /// The plan and the route's counter; `None` for an unrouted event.
    plan: Option<(Plan, Option<String>)>,
}

/// Which way a record goes in [`Processor::process_batch`]. A short-lived
/// local moved once into the run: boxing the large variant would only add an
/// allocation per record.
#[allow(clippy::large_enum_variant)]
enum Prepared<'a, 'r> {
    /// Written with its neighbours in one multi-row run.
    Simple(SimpleItem<'r>),
    /// Processed on its own, with what routing found.
    Alone(Result<Routed<'a>, Poison>),
}

/// Turns records into database writes. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Processor {
    router: Arc<Router>,
    handlers: Handlers,
    sabotage: Sabotage,
    /// Names of paused routes, refreshed by the consumer from `relay.pauses`.
    paused: Arc<std::sync::RwLock<std::collections::HashSet<String>>>,
    /// The dispatcher of this process, when intents are claimed at ingest.
    handoff: Option<Handoff>,
}

impl Processor {
    /// A processor over compiled routes and registered handlers.
    pub fn new(router: Arc<Router>, handlers: Handlers) -> Processor {
        Processor { router, handlers, sabotage: Sabotage::default(), paused: Arc::default(), handoff: None }
    }

    /// The same processor, writing the intents of fast-path runs already
    /// claimed by the dispatcher behind `handoff` where it can
    /// ([`crate::deliver::handoff`]); the batch calls then return them, to hand over
    /// after the commit.
    pub fn claiming_for(mut self, handoff: Handoff) -> Processor {
        self.handoff = Some(handoff);
        self
    }

    /// Where intents claimed at ingest go, if they are.
    pub fn handoff(&self) -> Option<&Handoff> {
        self.handoff.as_ref()
    }

    /// The same processor, deliberately broken (see [`Sabotage`]).
    pub fn sabotaged(mut self, sabotage: Sabotage) -> Processor {
        self.sabotage = sabotage;
        self
    }

    /// Replace the set of paused routes.
    pub fn set_paused(&self, routes: impl IntoIterator<Item = String>) {
        let mut p = self.paused.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        p.clear();
        p.extend(routes);
    }

    fn is_paused(&self, route: &CompiledRoute) -> bool {
        self.paused.read().unwrap_or_else(std::sync::PoisonError::into_inner).contains(&route.name)
    }

    /// The consumer (inbox namespace) this processor writes for.
    pub fn consumer(&self) -> &str {
        self.router.consumer()
    }

    /// Process `record` inside the caller's transaction. `Err` only for
    /// transient database errors: the caller rolls back and retries the whole
    /// transaction later, committing no offset meanwhile.
    pub async fn process(&self, conn: &mut PgConnection, record: &RawRecord) -> Result<Processed, sqlx::Error> {
        self.process_routed(conn, record, self.router.route(record)).await
    }

    /// [`Processor::process`] for a record already routed (decoded).
    async fn process_routed(
        &self,
        conn: &mut PgConnection,
        record: &RawRecord,
        routed: Result<Routed<'_>, Poison>,
    ) -> Result<Processed, sqlx::Error> {
        let (route, event) = match routed {
            Err(p) => {
                return Ok(Processed { info: EventInfo::of_poison(&p), step: Step::Poison(p) });
            }
            Ok(Routed::Unrouted(event)) => {
                let info = EventInfo::of(&event, None);
                // In a savepoint like every other write: a value the database
                // rejects (a NUL in the id) aborts only this, and the record
                // is parked instead of failing the whole transaction (C7).
                let mut sp = conn.begin().await?;
                let step = match inbox::insert(&mut sp, &self.inbox_row(&event, record, InboxOutcome::Unrouted)).await {
                    Ok(InboxInsert::Inserted) => {
                        sp.commit().await?;
                        Step::NoOp { outcome: InboxOutcome::Unrouted, detail: "no route for this type".into() }
                    }
                    Ok(InboxInsert::Duplicate) => {
                        sp.commit().await?;
                        Step::Duplicate
                    }
                    Err(e) if classify_error(&e) == DbErrorKind::Permanent => {
                        sp.rollback().await?;
                        Step::Poison(rejected(&e, &event))
                    }
                    Err(e) => return Err(e),
                };
                return Ok(Processed { step, info });
            }
            Ok(Routed::Route(route, event)) => (route, event),
        };
        let info = EventInfo::of(&event, Some(route));
        if self.is_paused(route) {
            return Ok(Processed { step: Step::Paused { route: route.name.clone() }, info });
        }
        let plan = match self.router.plan(route, &event, record) {
            Ok(plan) => plan,
            Err(p) => {
                return Ok(Processed { step: Step::Poison(p), info });
            }
        };
        let mut sp = conn.begin().await?;
        let step = match self.apply(&mut sp, route, &event, record, plan).await {
            Ok(Applied::Written { intents, events }) => {
                sp.commit().await?;
                Step::Applied { intents, events }
            }
            Ok(Applied::Duplicate) => {
                sp.commit().await?;
                Step::Duplicate
            }
            Ok(Applied::NoOp(outcome, detail)) => {
                sp.rollback().await?;
                match inbox::insert(conn, &self.inbox_row(&event, record, outcome)).await? {
                    InboxInsert::Inserted => Step::NoOp { outcome, detail },
                    InboxInsert::Duplicate => Step::Duplicate,
                }
            }
            Err(ApplyError::RetryLater(p)) => {
                sp.rollback().await?;
                Step::RetryLater(p)
            }
            Err(ApplyError::Poison(p)) => {
                sp.rollback().await?;
                Step::Poison(p)
            }
            Err(ApplyError::Db(e)) if classify_error(&e) == DbErrorKind::Permanent => {
                sp.rollback().await?;
                Step::Poison(rejected(&e, &event))
            }
            Err(ApplyError::Db(e)) => return Err(e),
        };
        Ok(Processed { step, info })
    }

    /// Process the records of one partition, in order, inside the caller's
    /// transaction, and return one [`Processed`] per record handled. Stops
    /// after the first [`Step::RetryLater`] or [`Step::Paused`] (the records
    /// after it are left to the caller). `Err` only for transient database errors.
    ///
    /// Fast path: consecutive records whose route needs no guard, saga move or
    /// handler are written together — one multi-row statement each for inbox
    /// rows, idempotency keys, intents, outbox rows and counters — inside one
    /// savepoint. If the database rejects anything in such a run, the run is
    /// rolled back and its records go through [`Processor::process`] one by
    /// one, so a bad record still only affects itself (R12).
    ///
    /// Intents written already claimed ([`Processor::claiming_for`]) are
    /// added to `held`: hand them over once the transaction has committed,
    /// and drop them if it has not.
    pub async fn process_batch(
        &self,
        conn: &mut PgConnection,
        records: &[RawRecord],
        held: &mut Vec<Handed>,
    ) -> Result<Vec<Processed>, sqlx::Error> {
        let done = self.batch(conn, records, false, held).await?;
        Ok(done.expect("only a run written without a savepoint comes back rejected"))
    }

    /// [`Processor::process_batch`] as the first work of a fresh transaction:
    /// a fast-path run at the start of the batch is written straight into the
    /// transaction, without a savepoint around it, which saves two round
    /// trips (`SAVEPOINT`, `RELEASE`): with a steady stream of routine
    /// records the batch is that one run, and its transaction takes four —
    /// `BEGIN`, the inbox rows, the effects ([`relay_store::effects`]),
    /// `COMMIT` — instead of six. If the database rejects
    /// that run, the transaction holds nothing else, so the whole of it can
    /// go instead of the savepoint: `None` then means "roll the transaction
    /// back and call [`Processor::process_batch`] in a new one", which finds
    /// the bad record as before.
    pub async fn process_batch_first(
        &self,
        conn: &mut PgConnection,
        records: &[RawRecord],
        held: &mut Vec<Handed>,
    ) -> Result<Option<Vec<Processed>>, sqlx::Error> {
        self.batch(conn, records, true, held).await
    }

    /// `bare`: write a fast-path run that starts the batch without a
    /// savepoint, and return `None` if the database rejects it.
    async fn batch(
        &self,
        conn: &mut PgConnection,
        records: &[RawRecord],
        bare: bool,
        held: &mut Vec<Handed>,
    ) -> Result<Option<Vec<Processed>>, sqlx::Error> {
        let mut out = Vec::with_capacity(records.len());
        let mut i = 0;
        while i < records.len() {
            // The fast-path run from here, and the record that ends it (each
            // record is decoded once, whichever way it goes).
            let mut run = Vec::new();
            let mut alone = None;
            for record in &records[i..] {
                match self.prepare(record) {
                    Prepared::Simple(item) => run.push(item),
                    Prepared::Alone(routed) => {
                        alone = Some(routed);
                        break;
                    }
                }
            }
            if !run.is_empty() {
                let n = run.len();
                let bare = bare && i == 0;
                match self.write_run(conn, run, bare, held).await? {
                    Some(done) => out.extend(done),
                    None if bare => return Ok(None),
                    None => {
                        for record in &records[i..i + n] {
                            out.push(self.process(conn, record).await?);
                        }
                    }
                }
                i += n;
            }
            let Some(routed) = alone else { continue };
            let processed = self.process_routed(conn, &records[i], routed).await?;
            let stop = matches!(processed.step, Step::RetryLater(_) | Step::Paused { .. });
            out.push(processed);
            i += 1;
            if stop {
                break;
            }
        }
        Ok(Some(out))
    }

    /// Route `record` and decide its path: the fast path when it is routed
    /// (or unrouted) without guards, saga moves or a handler and its plan
    /// renders; otherwise alone, through [`Processor::process_routed`].
    fn prepare<'r>(&self, record: &'r RawRecord) -> Prepared<'_, 'r> {
        let (route, event) = match self.router.route(record) {
            Ok(Routed::Unrouted(event)) => {
                return Prepared::Simple(SimpleItem { record, info: EventInfo::of(&event, None), event, plan: None });
            }
            Ok(Routed::Route(route, event)) => (route, event),
            Err(p) => return Prepared::Alone(Err(p)),
        };
        if route.version_guard || route.sequence_guard || route.handler.is_some() || self.is_paused(route) {
            return Prepared::Alone(Ok(Routed::Route(route, event)));
        }
        let plan = match self.router.plan(route, &event, record) {
            Ok(plan)
                if plan.sagas.is_empty() && plan.calls.iter().all(|c| self.router.endpoint(&c.endpoint).is_some()) =>
            {
                plan
            }
            _ => return Prepared::Alone(Ok(Routed::Route(route, event))),
        };
        Prepared::Simple(SimpleItem {
            record,
            info: EventInfo::of(&event, Some(route)),
            event,
            plan: Some((plan, route.counter.clone())),
        })
    }

    /// Write a run of fast-path records in one savepoint, or with none when
    /// `bare` (the caller then drops the whole transaction if it fails).
    /// `None` when the database rejected the run's data (the caller retries
    /// one by one).
    async fn write_run(
        &self,
        conn: &mut PgConnection,
        run: Vec<SimpleItem<'_>>,
        bare: bool,
        held: &mut Vec<Handed>,
    ) -> Result<Option<Vec<Processed>>, sqlx::Error> {
        fn done(run: Vec<SimpleItem<'_>>, steps: Vec<Step>) -> Vec<Processed> {
            run.into_iter().zip(steps).map(|(item, step)| Processed { step, info: item.info }).collect()
        }
        if bare {
            return match self.write_run_in(conn, &run, held).await {
                Ok(steps) => Ok(Some(done(run, steps))),
                Err(e) if classify_error(&e) == DbErrorKind::Permanent => Ok(None),
                Err(e) => Err(e),
            };
        }
        let mut sp = conn.begin().await?;
        match self.write_run_in(&mut sp, &run, held).await {
            Ok(steps) => {
                sp.commit().await?;
                Ok(Some(done(run, steps)))
            }
            Err(e) if classify_error(&e) == DbErrorKind::Permanent => {
                sp.rollback().await?;
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Write a run; the intents it wrote already claimed go to `held`, and
    /// only once nothing in it can fail any more (the effects statement is
    /// its last), so a run the database rejects adds none.
    async fn write_run_in(
        &self,
        tx: &mut PgConnection,
        run: &[SimpleItem<'_>],
        held: &mut Vec<Handed>,
    ) -> Result<Vec<Step>, sqlx::Error> {
        let consumer = self.router.consumer();
        let mut steps: Vec<Option<Step>> = vec![None; run.len()];
        // 1. Inbox rows; a second occurrence of an id in the run is a duplicate.
        let mut first = std::collections::HashSet::new();
        let mut rows = Vec::with_capacity(run.len());
        for (k, item) in run.iter().enumerate() {
            if first.insert(item.event.id.as_str()) {
                let outcome = if item.plan.is_some() { InboxOutcome::Applied } else { InboxOutcome::Unrouted };
                rows.push(self.inbox_row(&item.event, item.record, outcome));
            } else if !self.sabotage.no_inbox_dedup {
                steps[k] = Some(Step::Duplicate);
            }
        }
        let inserted: std::collections::HashSet<String> = inbox::insert_many(tx, &rows).await?.into_iter().collect();
        let mut claimed_in_run = std::collections::HashSet::new();
        let mut keyed = Vec::new();
        for (k, item) in run.iter().enumerate() {
            if steps[k].is_some() {
                continue;
            }
            if !inserted.contains(&item.event.id) && !self.sabotage.no_inbox_dedup {
                steps[k] = Some(Step::Duplicate);
            } else if item.plan.is_none() {
                steps[k] =
                    Some(Step::NoOp { outcome: InboxOutcome::Unrouted, detail: "no route for this type".into() });
            } else if let Some(key) = item.event.idempotency_key.as_deref() {
                if claimed_in_run.insert(key) {
                    keyed.push((key, item.event.id.as_str()));
                } else {
                    steps[k] = Some(Step::NoOp {
                        outcome: InboxOutcome::DuplicateKey,
                        detail: format!("idempotency key {key:?} was taken by an earlier event of this batch"),
                    });
                }
            }
        }
        // 2. Business idempotency keys (R4).
        let won: std::collections::HashSet<String> =
            inbox::claim_idempotency_keys(tx, consumer, &keyed).await?.into_iter().collect();
        let mut lost_keys = Vec::new();
        for (k, item) in run.iter().enumerate() {
            if steps[k].is_none()
                && let Some(key) = item.event.idempotency_key.as_deref()
                && !won.contains(key)
            {
                lost_keys.push(item.event.id.as_str());
                steps[k] = Some(Step::NoOp {
                    outcome: InboxOutcome::DuplicateKey,
                    detail: format!("idempotency key {key:?} was taken by an earlier event"),
                });
            }
        }
        let dup_key_ids: Vec<&str> = run
            .iter()
            .zip(&steps)
            .filter(|(item, s)| {
                matches!(s, Some(Step::NoOp { outcome: InboxOutcome::DuplicateKey, .. }))
                    && inserted.contains(&item.event.id)
            })
            .map(|(item, _)| item.event.id.as_str())
            .collect();
        inbox::set_outcome_many(tx, consumer, &dup_key_ids, InboxOutcome::DuplicateKey).await?;
        // 3. Effects of the applied ones: intents, outbox rows, counters.
        let now = Utc::now();
        let mut intents_new = Vec::new();
        let mut outbox_new = Vec::new();
        let mut counters: std::collections::BTreeMap<(&str, i32), i64> = std::collections::BTreeMap::new();
        for (k, item) in run.iter().enumerate() {
            if steps[k].is_some() {
                continue;
            }
            let Some((plan, counter)) = &item.plan else { continue };
            let (prov, hop) = self.provenance_hop(&item.event, item.info.route.as_deref());
            hop.end("applied");
            for call in &plan.calls {
                // `simple` only admits plans whose endpoints are configured.
                if let Ok(intent) = self.new_intent(&item.event, call, &prov) {
                    intents_new.push((k, intent));
                }
            }
            for emit in &plan.emits {
                let rec = encode_event(derived_id(consumer, &item.event.id, &emit.action), emit, &prov, now);
                outbox_new.push((k, rec));
            }
            if let Some(c) = counter {
                *counters.entry((c.as_str(), item.record.partition)).or_default() += 1;
            }
        }
        let intents_rows: Vec<NewIntent> = intents_new.iter().map(|(_, i)| i.clone()).collect();
        let outbox_rows: Vec<(&str, &relay_core::OutboxRecord)> =
            outbox_new.iter().map(|(k, r)| (run[*k].event.id.as_str(), r)).collect();
        let adds: Vec<(&str, i32, i64)> = counters.into_iter().map(|((name, shard), n)| (name, shard, n)).collect();
        // Claim at ingest: room for the intents that can be held, first come first.
        let mut room = self
            .handoff
            .as_ref()
            .and_then(|h| h.reserve(intents_rows.iter().filter(|i| i.ordering_key.is_none()).count()).map(|r| (h, r)));
        let take: Vec<bool> = match &room {
            Some((_, r)) => {
                let mut left = r.len();
                intents_rows
                    .iter()
                    .map(|i| {
                        let take = i.ordering_key.is_none() && left > 0;
                        left -= usize::from(take);
                        take
                    })
                    .collect()
            }
            None => Vec::new(),
        };
        let hold = room.as_ref().map(|(h, _)| Hold { worker: h.worker(), lease: h.lease(), take: &take });
        let mut new = effects::insert(tx, consumer, &intents_rows, hold, &outbox_rows, &adds).await?;
        let mut written = vec![(0usize, 0usize); run.len()];
        for (k, i) in &intents_new {
            written[*k].0 += usize::from(new.intents.contains(&i.id));
        }
        if let Some((_, reserved)) = &mut room {
            for intent in intents_rows {
                // `remove`: one hand-over per row, whatever the list repeats.
                if let Some(h) = new.held.remove(&intent.id)
                    && let Some(handed) = reserved.hand(ClaimedIntent::held_at_insert(intent, h))
                {
                    held.push(handed);
                }
            }
        }
        for (k, r) in &outbox_new {
            written[*k].1 += usize::from(new.outbox.contains(&r.id));
        }
        Ok(steps
            .into_iter()
            .zip(written)
            .map(|(s, (intents, events))| s.unwrap_or(Step::Applied { intents, events }))
            .collect())
    }

    fn inbox_row<'a>(&'a self, event: &'a InputEvent, record: &'a RawRecord, outcome: InboxOutcome) -> NewInboxRow<'a> {
        NewInboxRow {
            consumer: self.router.consumer(),
            event_id: &event.id,
            event_type: &event.event_type,
            topic: &record.topic,
            partition: record.partition,
            offset: record.offset,
            idempotency_key: event.idempotency_key.as_deref(),
            aggregate_id: event.aggregate_id.as_deref(),
            correlation_id: event.correlation_id.as_deref(),
            outcome,
        }
    }

    async fn apply(
        &self,
        tx: &mut PgConnection,
        route: &CompiledRoute,
        event: &InputEvent,
        record: &RawRecord,
        mut plan: Plan,
    ) -> Result<Applied, ApplyError> {
        let consumer = self.router.consumer();
        if inbox::insert(tx, &self.inbox_row(event, record, InboxOutcome::Applied)).await? == InboxInsert::Duplicate
            && !self.sabotage.no_inbox_dedup
        {
            return Ok(Applied::Duplicate);
        }
        if let Some(key) = &event.idempotency_key
            && let KeyClaim::Duplicate { first_event_id } =
                inbox::claim_idempotency_key(tx, consumer, key, &event.id).await?
        {
            let detail = format!("idempotency key {key:?} was taken by event {first_event_id}");
            return Ok(Applied::NoOp(InboxOutcome::DuplicateKey, detail));
        }
        // The router guarantees aggregate id and version/sequence exist when a guard is on.
        let aggregate = event.aggregate_id.as_deref().unwrap_or_default();
        if route.version_guard {
            let version = event.aggregate_version.unwrap_or_default();
            match inbox::check_version(tx, consumer, aggregate, version).await? {
                VersionCheck::Applied => {}
                VersionCheck::Duplicate => {
                    return Ok(Applied::NoOp(
                        InboxOutcome::DuplicateVersion,
                        format!("version {version} of {aggregate} was applied already"),
                    ));
                }
                VersionCheck::Stale { current } => {
                    return Ok(Applied::NoOp(
                        InboxOutcome::Stale,
                        format!("version {version} of {aggregate} is older than applied version {current}"),
                    ));
                }
            }
        }
        if route.sequence_guard {
            let seq = event.sequence.unwrap_or_default();
            match inbox::check_sequence(tx, consumer, aggregate, seq).await? {
                SequenceCheck::Applied => {}
                SequenceCheck::Duplicate { last } => {
                    return Ok(Applied::NoOp(
                        InboxOutcome::DuplicateSequence,
                        format!("sequence {seq} of {aggregate} is at or below the last applied {last}"),
                    ));
                }
                SequenceCheck::Gap { last } => {
                    return Err(ApplyError::RetryLater(identified(
                        Poison::new(
                            PoisonClass::SequenceGap,
                            format!(
                                "sequence {seq} of {aggregate} arrived while the last applied is {last}; waiting for {}",
                                last + 1
                            ),
                        ),
                        event,
                    )));
                }
            }
        }
        for m in &plan.sagas {
            let t = if m.start {
                sagas::start(tx, &m.saga_type, &m.saga_id, &m.to, &event.id).await?
            } else {
                sagas::transition(tx, &m.saga_type, &m.saga_id, &m.from, &m.to, &event.id).await?
            };
            let subject = format!("{}/{}", m.saga_type, m.saga_id);
            match t {
                Transition::Applied => {
                    let detail = json!({"from": m.from, "to": m.to, "start": m.start});
                    inbox::record_history(tx, consumer, &event.id, &m.action, "saga", Some(&subject), &detail).await?;
                }
                Transition::AlreadyThere => {
                    let detail = format!("saga {subject} is already {:?}", m.to);
                    return Ok(Applied::NoOp(InboxOutcome::DuplicateTransition, detail));
                }
                Transition::Invalid { current } => {
                    let detail =
                        format!("saga {subject} is {current:?}; {} may only move it from {:?}", m.action, m.from);
                    return Ok(Applied::NoOp(InboxOutcome::InvalidTransition, detail));
                }
                Transition::Missing => {
                    return Err(ApplyError::RetryLater(identified(
                        Poison::new(PoisonClass::MissingReference, format!("saga {subject} does not exist (yet)")),
                        event,
                    )));
                }
            }
        }
        if let Some(name) = &route.handler {
            let handler = self.handlers.get(name).ok_or_else(|| {
                ApplyError::Poison(identified(
                    Poison::new(PoisonClass::Rejected, format!("handler {name:?} is not registered")),
                    event,
                ))
            })?;
            match handler.handle(tx, event).await {
                Ok(more) => plan.extend(more),
                Err(HandlerError::NotYet(why)) => {
                    return Err(ApplyError::RetryLater(identified(
                        Poison::new(PoisonClass::MissingReference, why),
                        event,
                    )));
                }
                Err(HandlerError::Reject(why)) => {
                    return Err(ApplyError::Poison(identified(Poison::new(PoisonClass::Rejected, why), event)));
                }
                Err(HandlerError::Db(e)) => return Err(ApplyError::Db(e)),
            }
        }
        let (prov, hop) = self.provenance_hop(event, Some(&route.name));
        let mut written = (0, 0);
        for call in &plan.calls {
            let intent = self.new_intent(event, call, &prov).map_err(|p| ApplyError::Poison(identified(p, event)))?;
            written.0 += usize::from(intents::insert(tx, &intent).await?);
        }
        let now = Utc::now();
        for emit in &plan.emits {
            let rec = encode_event(derived_id(consumer, &event.id, &emit.action), emit, &prov, now);
            written.1 += usize::from(outbox::insert(tx, consumer, &event.id, &rec).await?);
        }
        if let Some(counter) = &route.counter {
            inbox::increment_counter(tx, consumer, counter, record.partition).await?;
        }
        hop.end("applied");
        Ok(Applied::Written { intents: written.0, events: written.1 })
    }

    /// Provenance of what `event` causes, as a child hop of its trace: the
    /// intents and events written carry the hop's `traceparent`.
    fn provenance_hop(&self, event: &InputEvent, route: Option<&str>) -> (Provenance, crate::runtime::trace::Hop) {
        let mut prov = self.router.provenance(event);
        let attrs = || {
            vec![
                opentelemetry::KeyValue::new("relay.consumer", self.router.consumer().to_owned()),
                opentelemetry::KeyValue::new("relay.event_id", event.id.clone()),
                opentelemetry::KeyValue::new("relay.event_type", event.event_type.clone()),
                opentelemetry::KeyValue::new("relay.route", route.unwrap_or_default().to_owned()),
            ]
        };
        let hop = crate::runtime::trace::Hop::start(
            "relay.inbox",
            opentelemetry::trace::SpanKind::Consumer,
            prov.traceparent.as_deref(),
            attrs,
        );
        if let Some(tp) = &hop.traceparent {
            prov.traceparent = Some(tp.clone());
        }
        (prov, hop)
    }

    fn new_intent(&self, event: &InputEvent, call: &CallSpec, prov: &Provenance) -> Result<NewIntent, Poison> {
        let consumer = self.router.consumer();
        let endpoint = self.router.endpoint(&call.endpoint).ok_or_else(|| {
            Poison::new(
                PoisonClass::Rejected,
                format!("call {:?} names unknown endpoint {:?}", call.action, call.endpoint),
            )
        })?;
        let id = derived_id(consumer, &event.id, &call.action);
        let to_json = |v: &relay_core::Outcome| serde_json::to_value(v).unwrap_or_default();
        Ok(NewIntent {
            id,
            consumer: consumer.to_owned(),
            source_event_id: event.id.clone(),
            action: call.action.clone(),
            endpoint: call.endpoint.clone(),
            method: call.method.clone(),
            path: call.path.clone(),
            body: call.body.clone(),
            headers: json!(call.headers),
            idempotency_key: call.idempotency_key.clone().unwrap_or_else(|| id.to_string()),
            ordering_key: call.ordering_key.clone(),
            max_attempts: i32::try_from(endpoint.max_attempts).unwrap_or(i32::MAX),
            max_age: endpoint.max_age,
            on_success: to_json(&call.on_success),
            on_dead: to_json(&call.on_dead),
            emit_source: prov.source.clone(),
            aggregate_id: prov.aggregate_id.clone(),
            correlation_id: prov.correlation_id.clone(),
            causation_id: prov.causation_id.clone(),
            traceparent: prov.traceparent.clone(),
        })
    }

    /// Park `record` as a dead letter (and queue its copy to the dead-letter
    /// topic) in the caller's transaction. `false` if it was parked already.
    pub async fn park(
        &self,
        conn: &mut PgConnection,
        record: &RawRecord,
        poison: &Poison,
        attempts: u32,
    ) -> Result<bool, sqlx::Error> {
        let consumer = self.router.consumer();
        let clean = sanitized(poison);
        let attempts_i32 = i32::try_from(attempts).unwrap_or(i32::MAX);
        let Some(_) = dead_letters::insert(conn, consumer, record, &clean, attempts_i32).await? else {
            return Ok(false);
        };
        if let Some(topic) = self.router.dead_letter_topic() {
            let copy = encode_dead_letter(consumer, topic, record, &clean, attempts, self.router.max_record_bytes());
            outbox::insert(conn, consumer, &format!("{}/{}/{}", record.topic, record.partition, record.offset), &copy)
                .await?;
        }
        Ok(true)
    }
}

fn identified(p: Poison, event: &InputEvent) -> Poison {
    p.with_identity(Some(&event.id), Some(&event.event_type))
}

fn rejected(e: &sqlx::Error, event: &InputEvent) -> Poison {
    identified(Poison::new(PoisonClass::Rejected, format!("the database rejected the event: {e}")), event)
}

/// PostgreSQL text cannot hold U+0000; a dead letter must always be storable.
fn sanitized(p: &Poison) -> Poison {
    let clean = |s: &str| s.replace('\0', "\u{fffd}");
    Poison {
        class: p.class,
        reason: clean(&p.reason),
        event_id: p.event_id.as_deref().map(clean),
        event_type: p.event_type.as_deref().map(clean),
    }
}
