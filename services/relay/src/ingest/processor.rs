//! Where a record becomes rows: route and plan it (relay-core), write it
//! ([`relay_store::write`]), inside the caller's transaction.
//!
//! The caller (the consumer's batch loop, or a dead-letter replay) owns the
//! transaction. Records go to [`relay_store::write`] in runs: consecutive
//! records of a partition batch that need no check (guard, saga move) and no
//! code handler share one run and one savepoint — four round trips however
//! many they are; a record with checks or a handler is a run of its own, so
//! that a no-op, a "not yet" or a rejection found in it rolls back only its
//! own writes and its neighbours are unaffected (R12). A run the database
//! rejects is rolled back and its records are written one by one, so a bad
//! record still only affects itself.
//!
//! Order of work for one record, all in one transaction (R2–R7, R14, R20):
//! inbox row; business idempotency key; version and sequence guards; saga
//! moves; the code handler, if any; intents and outbox rows with derived ids,
//! and counters. A no-op found by a check rolls the record back and records
//! its inbox row with the no-op's class, so every event is recorded once
//! with what happened.

use std::sync::Arc;

use chrono::Utc;
use futures::FutureExt;
use relay_core::{
    CompiledRoute, Disposition, Effects, InputEvent, Poison, PoisonClass, Provenance, RawRecord, Routed, Router,
};
use relay_store::inbox::{self, InboxInsert, InboxOutcome, NewInboxRow};
use relay_store::write::{self, HoldRoom, Planned};
use relay_store::{DbErrorKind, classify_error, holds};
use sqlx::{Connection, PgConnection};
use tracing::{Instrument, warn};

use crate::deliver::handoff::{Handed, Handoff, Reserved};
use crate::ingest::decode::{Decoder, View};
use crate::ingest::handler::{HandlerError, Handlers};
use crate::ingest::held::HeldKeys;
use crate::ingest::park::{identified, rejected};
use crate::ingest::pauses::PausedRoutes;
use crate::runtime::faults::Faults;
use crate::runtime::trace::Hop;

/// The identity of a processed event, for logs (R16). Never the payload.
#[derive(Debug, Clone, Default)]
// Fields named for what they hold carry no doc that would repeat the name.
#[allow(missing_docs)]
pub struct EventInfo {
    /// Event id.
    pub id: Option<String>,
    pub event_type: Option<String>,
    /// Route name.
    pub route: Option<String>,
    /// Business idempotency key.
    pub idempotency_key: Option<String>,
    pub aggregate_id: Option<String>,
    pub correlation_id: Option<String>,
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

/// A processed record: the decision and who it was.
#[derive(Debug, Clone)]
pub struct Processed {
    /// The decision.
    pub disposition: Disposition,
    /// The event's identity, as far as it could be read.
    pub info: EventInfo,
}

/// The search path a code handler's SQL runs with: PostgreSQL's default.
const HANDLER_SEARCH_PATH: &str = r#"SET LOCAL search_path = "$user", public"#;
/// Back to the search path of relay's own statements: the session's, set
/// when `app::connect` opened it, so it is written in one place.
const RELAY_SEARCH_PATH: &str = "SET LOCAL search_path TO DEFAULT";

/// A record routed and planned, ready to write.
struct Item<'a, 'r> {
    record: &'r RawRecord,
    event: InputEvent,
    info: EventInfo,
    /// Its route; `None` for an unrouted event.
    route: Option<&'a CompiledRoute>,
    /// What it writes (a code handler adds to it); `None` when unrouted.
    effects: Option<Effects>,
    /// The provenance of what it causes (a code handler's effects need it).
    prov: Option<Provenance>,
    /// Its hop of the trace; its intents and events carry the hop's `traceparent`.
    hop: Option<Hop>,
}

impl Item<'_, '_> {
    /// How many of its intents could be claimed at ingest (no ordering key).
    fn unkeyed_intents(&self) -> usize {
        self.effects.iter().flat_map(|e| &e.intents).filter(|i| i.intent.ordering_key.is_none()).count()
    }

    /// The record processed, with what writing it decided.
    fn done(self, disposition: Disposition) -> Processed {
        let disposition = match disposition {
            Disposition::RetryLater(p) => Disposition::RetryLater(identified(p, &self.event)),
            Disposition::DeadLetter(p) => Disposition::DeadLetter(identified(p, &self.event)),
            d => d,
        };
        if let (Disposition::Applied { .. }, Some(hop)) = (&disposition, self.hop) {
            hop.end("applied");
        }
        Processed { disposition, info: self.info }
    }
}

/// What routing and planning a record found. A short-lived local moved once
/// into its run: boxing the large variant would only add an allocation per
/// record.
#[allow(clippy::large_enum_variant)]
enum Prepared<'a, 'r> {
    /// To write.
    Ready(Item<'a, 'r>),
    /// Nothing to write: poison, or its route is paused.
    Done(Processed),
}

impl Prepared<'_, '_> {
    /// About what it holds until its batch ends, in bytes: its effects'
    /// JSON, and the data a code handler will read, as trees.
    fn holds(&self) -> usize {
        use relay_core::limits::MEMORY_PER_WIRE_BYTE;
        let Prepared::Ready(item) = self else { return 0 };
        let data = if item.event.data.is_null() { 0 } else { item.record.size() };
        let effects = item.effects.as_ref().map_or(0, |e| {
            let intents: usize = e.intents.iter().map(|i| i.intent.json_bytes()).sum();
            let events: usize = e.events.iter().map(|r| r.payload.as_ref().map_or(0, Vec::len)).sum();
            intents.saturating_mul(MEMORY_PER_WIRE_BYTE).saturating_add(events)
        });
        data.saturating_mul(MEMORY_PER_WIRE_BYTE).saturating_add(effects)
    }
}

/// Turns records into database writes. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Processor {
    router: Arc<Router>,
    handlers: Handlers,
    /// The paused routes, refreshed by the consumer from `relay.pauses`.
    paused: PausedRoutes,
    /// The dispatcher of this process, when intents are claimed at ingest.
    handoff: Option<Handoff>,
    faults: Faults,
    /// Decodes the values of topics in a Schema Registry format.
    decoder: Decoder,
}

impl Processor {
    /// A processor over compiled routes and registered handlers.
    pub fn new(router: Arc<Router>, handlers: Handlers) -> Processor {
        let decoder = Decoder::new(router.clone(), None);
        Processor { router, handlers, paused: PausedRoutes::default(), handoff: None, faults: Faults::none(), decoder }
    }

    /// The same processor, decoding topics in a Schema Registry format
    /// with `registry`.
    pub fn with_registry(mut self, registry: Option<Arc<relay_registry::Registry>>) -> Processor {
        self.decoder = Decoder::new(self.router.clone(), registry);
        self
    }

    /// The same processor, passing the fault points of a batch (tests).
    pub fn with_faults(mut self, faults: Faults) -> Processor {
        self.faults = faults;
        self
    }

    /// The same processor, writing intents already claimed by the dispatcher
    /// behind `handoff` where it can ([`crate::deliver::handoff`]); the batch
    /// calls then return them, to hand over after the commit.
    pub fn claiming_for(mut self, handoff: Handoff) -> Processor {
        self.handoff = Some(handoff);
        self
    }

    /// Where intents claimed at ingest go, if they are.
    pub fn handoff(&self) -> Option<&Handoff> {
        self.handoff.as_ref()
    }

    /// How it reads records in a Schema Registry format.
    pub fn decoder(&self) -> &Decoder {
        &self.decoder
    }

    /// The paused routes it leaves records of waiting.
    pub fn paused(&self) -> &PausedRoutes {
        &self.paused
    }

    /// The fault points it passes (tests).
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// The compiled routes.
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// The consumer (inbox namespace) this processor writes for.
    pub fn consumer(&self) -> &str {
        self.router.consumer()
    }

    /// Process `record` inside the caller's transaction. `Err` only for
    /// transient database errors: the caller rolls back and retries the whole
    /// transaction later, committing no offset meanwhile. Its intents are
    /// written pending, never claimed at ingest.
    pub async fn process(
        &self,
        conn: &mut PgConnection,
        record: &RawRecord,
        view: &View,
    ) -> Result<Processed, sqlx::Error> {
        match self.prepare(record, view) {
            Prepared::Done(p) => self.unless_applied(conn, p).await,
            Prepared::Ready(item) => self.write_alone(conn, item, None).await,
        }
    }

    /// Process the records of one partition, in order, inside the caller's
    /// transaction, and return one [`Processed`] per record handled, each
    /// routed as its `views` entry reads it ([`Decoder::views_within`]). Stops
    /// after the first [`Disposition::RetryLater`] or [`Disposition::Paused`] (the records
    /// after it are left to the caller). `Err` only for transient database errors.
    ///
    /// `keys_held`: some key of the partition is held
    /// ([`relay_store::ops::BatchGates`]); if not, no key is looked up.
    ///
    /// Intents written already claimed ([`Processor::claiming_for`]) are
    /// added to `held`: hand them over once the transaction has committed,
    /// and drop them if it has not.
    pub async fn process_batch(
        &self,
        conn: &mut PgConnection,
        records: &[RawRecord],
        views: &[View],
        budget: usize,
        keys_held: bool,
        held: &mut Vec<Handed>,
    ) -> Result<Vec<Processed>, sqlx::Error> {
        let done = self.batch(conn, records, views, budget, false, keys_held, held).await?;
        Ok(done.expect("only a run written without a savepoint comes back rejected"))
    }

    /// [`Processor::process_batch`] as the first work of a fresh transaction:
    /// a run at the start of the batch is written straight into the
    /// transaction, without a savepoint around it, which saves two round
    /// trips (`SAVEPOINT`, `RELEASE`): with a steady stream of routine
    /// records the batch is that one run, and its transaction takes four —
    /// `BEGIN`, the inbox rows, the effects, `COMMIT` — instead of six. If
    /// the database rejects that run, the transaction holds nothing else, so
    /// the whole of it can go instead of the savepoint: `None` then means
    /// "roll the transaction back and call [`Processor::process_batch`] in a
    /// new one", which finds the bad record as before.
    pub async fn process_batch_first(
        &self,
        conn: &mut PgConnection,
        records: &[RawRecord],
        views: &[View],
        budget: usize,
        keys_held: bool,
        held: &mut Vec<Handed>,
    ) -> Result<Option<Vec<Processed>>, sqlx::Error> {
        self.batch(conn, records, views, budget, true, keys_held, held).await
    }

    /// `records` routed and planned from the start while what they hold
    /// (their effects' JSON, and the data a code handler will read, counted
    /// as the trees they are: [`relay_core::limits::MEMORY_PER_WIRE_BYTE`]
    /// a byte) fits `budget`, and always the first. A batch prepares its
    /// records before it writes any, so each one's effects live until the
    /// batch ends: a call body that renders a large part of the data would
    /// otherwise hold a tree per record. The records left out go into the
    /// next batch.
    fn prepared_within<'r>(&self, records: &'r [RawRecord], views: &[View], budget: usize) -> Vec<Prepared<'_, 'r>> {
        let mut out = Vec::with_capacity(records.len());
        let mut holds = 0usize;
        for (record, view) in records.iter().zip(views) {
            let p = self.prepare(record, view);
            holds = holds.saturating_add(p.holds());
            if holds > budget && !out.is_empty() {
                break;
            }
            out.push(p);
        }
        out
    }

    /// `bare`: write a run that starts the batch without a savepoint, and
    /// return `None` if the database rejects it.
    #[allow(clippy::too_many_arguments)]
    async fn batch(
        &self,
        conn: &mut PgConnection,
        records: &[RawRecord],
        views: &[View],
        budget: usize,
        bare: bool,
        keys_held: bool,
        held: &mut Vec<Handed>,
    ) -> Result<Option<Vec<Processed>>, sqlx::Error> {
        assert_eq!(records.len(), views.len(), "one view per record");
        let mut out = Vec::with_capacity(records.len());
        // Each record is routed and planned once, whichever way it goes.
        let mut prepared: Vec<Option<Prepared<'_, '_>>> =
            self.prepared_within(records, views, budget).into_iter().map(Some).collect();
        let (records, views) = (&records[..prepared.len()], &views[..prepared.len()]);
        self.lock_keys(conn, &prepared).await?;
        let mut holds = HeldKeys::read(conn, &self.router, &self.faults, records, keys_held).await?;
        let mut i = 0;
        while i < records.len() {
            // The run from here, and the record that ends it.
            let mut run = Vec::new();
            let mut next = None;
            for (j, (record, view)) in records.iter().zip(views).enumerate().skip(i) {
                let ready = prepared[j].take().expect("each record is taken once");
                if holds.holds(record) {
                    next = Some(Prepared::Done(self.held(record, view)));
                    break;
                }
                match ready {
                    Prepared::Ready(item) if !self.alone(&item) => run.push(item),
                    other => {
                        next = Some(other);
                        break;
                    }
                }
            }
            if !run.is_empty() {
                let n = run.len();
                let bare = bare && i == 0;
                match self.write_run(conn, run, bare, held).await? {
                    Ok(done) => out.extend(done),
                    Err(_) if bare => return Ok(None),
                    Err(rejected) => out.extend(self.write_each(conn, rejected, &mut holds, held).await?),
                }
                i += n;
            }
            let processed = match next {
                None => continue,
                Some(Prepared::Done(p)) => self.unless_applied(conn, p).await?,
                Some(Prepared::Ready(item)) => self.write_alone(conn, item, Some(&mut *held)).await?,
            };
            holds
                .note(conn, &self.router, &records[i], &processed.disposition, processed.info.route.as_deref())
                .await?;
            let stop = matches!(processed.disposition, Disposition::RetryLater(_) | Disposition::Paused { .. });
            out.push(processed);
            i += 1;
            if stop {
                break;
            }
        }
        Ok(Some(out))
    }

    /// Lock every ordering key the batch writes, in one statement before
    /// anything is written: batches of two partitions then wait for each
    /// other's keys in one global order instead of deadlocking, as they did
    /// taking each run's keys as it was written.
    async fn lock_keys(
        &self,
        conn: &mut PgConnection,
        prepared: &[Option<Prepared<'_, '_>>],
    ) -> Result<(), sqlx::Error> {
        let keys = prepared
            .iter()
            .filter_map(|p| match p {
                Some(Prepared::Ready(item)) => item.effects.as_ref(),
                _ => None,
            })
            .flat_map(relay_store::ordering::keys_of);
        relay_store::ordering::lock(&mut *conn, self.router.consumer(), keys).await
    }

    /// The records of a run the database refused as a whole, each written
    /// alone (or held behind its key), noting what became of each.
    async fn write_each(
        &self,
        conn: &mut PgConnection,
        rejected: Vec<Item<'_, '_>>,
        holds: &mut HeldKeys,
        held: &mut Vec<Handed>,
    ) -> Result<Vec<Processed>, sqlx::Error> {
        let mut out = Vec::with_capacity(rejected.len());
        for item in rejected {
            let record = item.record;
            let processed = if holds.holds(record) {
                Self::held_as(item.info)
            } else {
                self.write_alone(conn, item, Some(&mut *held)).await?
            };
            holds.note(conn, &self.router, record, &processed.disposition, processed.info.route.as_deref()).await?;
            out.push(processed);
        }
        Ok(out)
    }

    /// `p`, found poison before the inbox was asked, unless its event is in
    /// the inbox already: then it was applied, and its effects written, by an
    /// earlier delivery, before the route or the schema it is checked
    /// against changed (a restart after a crash between the database commit
    /// and the offset commit). A duplicate then, not a dead letter holding
    /// its key for a record nothing is left to do for.
    async fn unless_applied(&self, conn: &mut PgConnection, p: Processed) -> Result<Processed, sqlx::Error> {
        let (Disposition::DeadLetter(poison), Some(id)) = (&p.disposition, &p.info.id) else { return Ok(p) };
        // Where the id is what was wrong, it names no inbox row: cut to fit
        // a dead letter (another id may share the cut), or holding a
        // control character (a NUL would abort the transaction).
        let id_wrong = matches!(poison.class, PoisonClass::BadField | PoisonClass::MissingId);
        if id_wrong || relay_core::limits::check_key("event id", id).is_err() {
            return Ok(p);
        }
        let consumer = self.router.consumer();
        if inbox::outcome_of(conn, consumer, id).await?.is_none() {
            return Ok(p);
        }
        // Said, since a change of config or schema made it: the next event
        // like it is dead-lettered.
        warn!(consumer, event_id = %id, class = poison.class.as_str(), reason = %poison.reason,
              "an event applied before no longer passes its route (its config or schema changed since): \
               counted as a duplicate, not dead-lettered");
        Ok(Processed { disposition: Disposition::Duplicate, ..p })
    }

    /// `record`, held behind an earlier dead letter of its key.
    fn held(&self, record: &RawRecord, view: &View) -> Processed {
        let info = match view.of(record).and_then(|r| self.router.route(r)) {
            Ok(Routed::Route(route, event) | Routed::Paused(route, event)) => EventInfo::of(&event, Some(route)),
            Ok(Routed::Unrouted(event)) => EventInfo::of(&event, None),
            Err(p) => EventInfo::of_poison(&p),
        };
        Self::held_as(info)
    }

    /// A record of `info`, held behind an earlier dead letter of its key.
    fn held_as(info: EventInfo) -> Processed {
        let poison = Poison::new(PoisonClass::Held, holds::HELD_REASON)
            .with_identity(info.id.as_deref(), info.event_type.as_deref());
        Processed { disposition: Disposition::Held(poison), info }
    }

    /// Route and plan `record` (its effects with derived ids): ready to
    /// write, or done already (poison, a paused route).
    fn prepare<'r>(&self, record: &'r RawRecord, view: &View) -> Prepared<'_, 'r> {
        if let View::NotYet(p) = view {
            let disposition = Disposition::RetryLater(p.clone());
            return Prepared::Done(Processed { info: EventInfo::of_poison(p), disposition });
        }
        let routed =
            view.of(record).and_then(|r| self.router.route_unless_paused(r, |r| self.paused.contains(&r.name)));
        let (route, event) = match routed {
            Err(p) => {
                return Prepared::Done(Processed {
                    info: EventInfo::of_poison(&p),
                    disposition: Disposition::DeadLetter(p),
                });
            }
            Ok(Routed::Unrouted(mut event)) => {
                let info = EventInfo::of(&event, None);
                event.data = serde_json::Value::Null;
                let item = Item { record, event, info, route: None, effects: None, prov: None, hop: None };
                return Prepared::Ready(item);
            }
            Ok(Routed::Paused(route, event)) => {
                let info = EventInfo::of(&event, Some(route));
                return Prepared::Done(Processed {
                    disposition: Disposition::Paused { route: route.name.clone() },
                    info,
                });
            }
            Ok(Routed::Route(route, event)) => (route, event),
        };
        let info = EventInfo::of(&event, Some(route));
        let (prov, hop) = self.provenance_hop(&event, Some(&route.name));
        let effects = self
            .router
            .plan(route, &event, record)
            .and_then(|plan| self.router.effects(route, &event, plan, &prov, Utc::now()));
        // A batch prepares all its records before it writes any, and a
        // parsed tree takes up to ~90 times its bytes on the wire: only a
        // code handler reads the data once the effects are planned.
        let mut event = event;
        if route.handler.is_none() {
            event.data = serde_json::Value::Null;
        }
        match effects {
            Ok(effects) => Prepared::Ready(Item {
                record,
                event,
                info,
                route: Some(route),
                effects: Some(effects),
                prov: Some(prov),
                hop: Some(hop),
            }),
            Err(p) => Prepared::Done(Processed { disposition: Disposition::DeadLetter(p), info }),
        }
    }

    /// What [`relay_store::write`] needs of `item`, with `effects`.
    fn planned<'i>(&'i self, item: &'i Item<'_, '_>, effects: Option<&'i Effects>) -> Planned<'i> {
        let (event, record, route) = (&item.event, item.record, item.route);
        Planned {
            inbox: NewInboxRow {
                consumer: self.router.consumer(),
                event_id: &event.id,
                event_type: &event.event_type,
                topic: &record.topic,
                partition: record.partition,
                offset: record.offset,
                idempotency_key: event.idempotency_key.as_deref(),
                aggregate_id: event.aggregate_id.as_deref(),
                correlation_id: event.correlation_id.as_deref(),
                outcome: if route.is_some() { InboxOutcome::Applied } else { InboxOutcome::Unrouted },
            },
            // The router guarantees the version and sequence exist when a guard is on.
            version: route.filter(|r| r.version_guard).map(|_| event.aggregate_version.unwrap_or_default()),
            sequence: route.filter(|r| r.sequence_guard).map(|_| event.sequence.unwrap_or_default()),
            effects,
        }
    }

    /// Whether `item` must be written in a run of its own: the write path
    /// runs checks for it, or it has a code handler.
    fn alone(&self, item: &Item<'_, '_>) -> bool {
        item.route.is_some_and(|r| r.handler.is_some()) || self.planned(item, item.effects.as_ref()).has_checks()
    }

    /// Room at the dispatcher for up to `intents` intents claimed at ingest.
    fn reserve(&self, intents: usize) -> Option<(HoldRoom<'_>, Reserved)> {
        let h = self.handoff.as_ref()?;
        let reserved = h.reserve(intents)?;
        let endpoint_room = h.endpoint_room();
        Some((HoldRoom { worker: h.worker(), lease: h.lease(), room: reserved.len(), endpoint_room }, reserved))
    }

    /// Hand the intents `batch` wrote claimed over to `reserved` room (to
    /// `held`, for after the commit).
    fn keep_held(batch: &mut write::Batch, room: Option<(HoldRoom<'_>, Reserved)>, held: &mut Vec<Handed>) {
        if let Some((_, mut reserved)) = room {
            held.extend(std::mem::take(&mut batch.held).into_iter().filter_map(|claimed| reserved.hand(claimed)));
        }
    }

    /// Write a run of records without checks in one savepoint, or with none
    /// when `bare` (the caller then drops the whole transaction if it
    /// fails). `Err(run)` when the database rejected the run's data: its
    /// items come back, routed and planned, for the caller to write one by
    /// one. The intents it wrote claimed go to `held` only once nothing in
    /// it can fail any more.
    async fn write_run<'a, 'r>(
        &self,
        conn: &mut PgConnection,
        run: Vec<Item<'a, 'r>>,
        bare: bool,
        held: &mut Vec<Handed>,
    ) -> Result<Result<Vec<Processed>, Vec<Item<'a, 'r>>>, sqlx::Error> {
        let consumer = self.router.consumer();
        let planned: Vec<Planned<'_>> = run.iter().map(|item| self.planned(item, item.effects.as_ref())).collect();
        let room = self.reserve(run.iter().map(Item::unkeyed_intents).sum());
        let hold = room.as_ref().map(|(h, _)| *h);
        let written = if bare {
            write::write(conn, consumer, &planned, hold).await
        } else {
            let mut sp = conn.begin().await?;
            let written = write::write(&mut sp, consumer, &planned, hold).await;
            match &written {
                Ok(_) => sp.commit().await?,
                Err(e) if classify_error(e) == DbErrorKind::Permanent => sp.rollback().await?,
                // Transient: the caller rolls the whole transaction back.
                Err(_) => {}
            }
            written
        };
        drop(planned);
        let mut batch = match written {
            Ok(batch) => batch,
            Err(e) if classify_error(&e) == DbErrorKind::Permanent => return Ok(Err(run)),
            Err(e) => return Err(e),
        };
        Self::keep_held(&mut batch, room, held);
        Ok(Ok(run.into_iter().zip(batch.written).map(|(item, w)| item.done(w)).collect()))
    }

    /// Write one record in a savepoint of its own, its code handler between
    /// the checks and the effects. A no-op found by a check, a "not yet" or
    /// a rejection rolls the savepoint back; a no-op then records its inbox
    /// row with its class. With `held`, its intents may be claimed at ingest.
    async fn write_alone(
        &self,
        conn: &mut PgConnection,
        item: Item<'_, '_>,
        held: Option<&mut Vec<Handed>>,
    ) -> Result<Processed, sqlx::Error> {
        let room = if held.is_some() { self.reserve(item.unkeyed_intents()) } else { None };
        let mut sp = conn.begin().await?;
        let outcome = match self.write_checked(&mut sp, &item, room.as_ref().map(|(h, _)| *h)).await {
            Ok(Ok(batch)) if !batch.written[0].undo() => match sp.commit().await {
                Ok(()) => Ok(batch),
                // The savepoint cannot be released: a code handler swallowed
                // an error (25P02). Dropped, the savepoint is rolled back.
                Err(e) if classify_error(&e) == DbErrorKind::Permanent => Err(Disposition::DeadLetter(rejected(
                    &e,
                    item.route.and_then(|r| r.handler.as_deref()),
                    &item.event,
                ))),
                Err(e) => return Err(e),
            },
            Ok(Ok(mut batch)) => {
                sp.rollback().await?;
                Err(batch.written.pop().unwrap_or(Disposition::Duplicate))
            }
            Ok(Err(disposition)) => {
                sp.rollback().await?;
                Err(disposition)
            }
            Err(e) if classify_error(&e) == DbErrorKind::Permanent => {
                sp.rollback().await?;
                Err(Disposition::DeadLetter(rejected(&e, item.route.and_then(|r| r.handler.as_deref()), &item.event)))
            }
            Err(e) => return Err(e),
        };
        let disposition = match outcome {
            Ok(mut batch) => {
                if let Some(held) = held {
                    Self::keep_held(&mut batch, room, held);
                }
                batch.written.pop().unwrap_or(Disposition::Duplicate)
            }
            // Rolled back: recorded again with its class alone.
            Err(Disposition::NoOp { outcome, detail }) => {
                let row = NewInboxRow { outcome, ..self.planned(&item, None).inbox };
                match inbox::insert(conn, &row).await? {
                    InboxInsert::Inserted => Disposition::NoOp { outcome, detail },
                    InboxInsert::Duplicate => Disposition::Duplicate,
                }
            }
            Err(other) => other,
        };
        Ok(item.done(disposition))
    }

    /// The writes of [`Processor::write_alone`], inside its savepoint.
    async fn write_checked(
        &self,
        tx: &mut PgConnection,
        item: &Item<'_, '_>,
        hold: Option<HoldRoom<'_>>,
    ) -> Result<Result<write::Batch, Disposition>, sqlx::Error> {
        let consumer = self.router.consumer();
        let planned = self.planned(item, item.effects.as_ref());
        let admitted = write::admit(tx, consumer, std::slice::from_ref(&planned)).await?;
        let mut merged = None;
        if admitted[0].is_none()
            && let Some(route) = item.route
            && let Some(name) = &route.handler
        {
            match self.run_handler(tx, item, route, name).await? {
                Ok(all) => merged = Some(all),
                Err(disposition) => return Ok(Err(disposition)),
            }
        }
        let planned = Planned { effects: merged.as_ref().or(planned.effects), ..planned };
        let batch = write::finish(tx, consumer, std::slice::from_ref(&planned), admitted, hold).await?;
        Ok(Ok(batch))
    }

    /// Run route `route`'s code handler `name` on `item`, in the record's
    /// transaction: the route's effects with the handler's added, or what
    /// became of the record instead (a dead letter, "not yet"). `Err` only
    /// for an outage.
    async fn run_handler(
        &self,
        tx: &mut PgConnection,
        item: &Item<'_, '_>,
        route: &CompiledRoute,
        name: &str,
    ) -> Result<Result<Effects, Disposition>, sqlx::Error> {
        let poison = |class, why: String| identified(Poison::new(class, why), &item.event);
        let Some(handler) = self.handlers.get(name) else {
            let why = format!("handler {name:?} is not registered");
            return Ok(Err(Disposition::DeadLetter(poison(PoisonClass::Rejected, why))));
        };
        // The handler's own log lines carry the record they handle.
        let span = tracing::info_span!(
            "handler",
            handler = %name,
            event_id = %item.event.id,
            event_type = %item.event.event_type,
            topic = %item.record.topic,
            partition = item.record.partition,
            offset = item.record.offset,
        );
        // A panic is this record's, like an error: unwinding out of the
        // consumer would crash-loop every member given the partition.
        // A handler's SQL finds its own tables on the database's default
        // path; relay's statements search pg_catalog alone
        // (app::connect), and do so again after it (a savepoint rolled
        // back undoes the change too).
        sqlx::query(HANDLER_SEARCH_PATH).execute(&mut *tx).await?;
        let handled = std::panic::AssertUnwindSafe(handler.handle(tx, &item.event)).catch_unwind();
        let handled = handled.instrument(span).await;
        let _ = sqlx::query(RELAY_SEARCH_PATH).execute(&mut *tx).await;
        let Ok(handled) = handled else {
            let why = format!("handler {name:?} panicked; its message is in the process log");
            return Ok(Err(Disposition::DeadLetter(poison(PoisonClass::Rejected, why))));
        };
        let more = match handled {
            Ok(more) => more,
            Err(HandlerError::NotYet(why)) => {
                return Ok(Err(Disposition::RetryLater(poison(PoisonClass::MissingReference, why))));
            }
            Err(HandlerError::Reject(why)) => {
                return Ok(Err(Disposition::DeadLetter(poison(PoisonClass::Rejected, why))));
            }
            // An outage is retried; any other database error is the
            // handler's own (its SQL, a constraint): its record's.
            Err(HandlerError::Db(e)) if relay_store::is_outage(&e) => return Err(e),
            Err(HandlerError::Db(e)) => {
                let why = format!("handler {name:?} failed with a database error: {}", relay_store::rejection(&e));
                return Ok(Err(Disposition::DeadLetter(poison(PoisonClass::Rejected, why))));
            }
        };
        if !more.sagas.is_empty() {
            let why = format!(
                "handler {name:?} returned saga moves: a handler returns calls and events; saga moves belong in the route"
            );
            return Ok(Err(Disposition::DeadLetter(poison(PoisonClass::Rejected, why))));
        }
        let prov = item.prov.clone().unwrap_or_default();
        let extra = match self.router.effects(route, &item.event, more, &prov, Utc::now()) {
            Ok(extra) => extra,
            Err(p) => {
                let why = format!("handler {name:?} returned effects that cannot be made: {}", p.reason);
                return Ok(Err(Disposition::DeadLetter(poison(PoisonClass::Rejected, why))));
            }
        };
        let mut all = item.effects.clone().unwrap_or_default();
        if let Some(action) = crate::ingest::handler::reused_action(&all, &extra) {
            let why = format!(
                "handler {name:?} returned an action named {action:?}, a name the route or the handler already \
                 uses: both would get one derived id and one would be lost; give each action its own name"
            );
            return Ok(Err(Disposition::DeadLetter(poison(PoisonClass::Rejected, why))));
        }
        all.intents.extend(extra.intents);
        all.events.extend(extra.events);
        Ok(Ok(all))
    }

    /// Provenance of what `event` causes, as a child hop of its trace: the
    /// intents and events written carry the hop's `traceparent`.
    fn provenance_hop(&self, event: &InputEvent, route: Option<&str>) -> (Provenance, Hop) {
        let mut prov = self.router.provenance(event);
        let attrs = || {
            vec![
                opentelemetry::KeyValue::new("relay.consumer", self.router.consumer().to_owned()),
                opentelemetry::KeyValue::new("relay.event_id", event.id.clone()),
                opentelemetry::KeyValue::new("relay.event_type", event.event_type.clone()),
                opentelemetry::KeyValue::new("relay.route", route.unwrap_or_default().to_owned()),
            ]
        };
        let hop =
            Hop::start("relay.inbox", opentelemetry::trace::SpanKind::Consumer, prov.traceparent.as_deref(), attrs);
        if let Some(tp) = &hop.traceparent {
            prov.traceparent = Some(tp.clone());
        }
        (prov, hop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_core::RelayConfig;
    use relay_testkit::TestEvent;
    use serde_json::json;

    /// A plain route with a call, a version-guarded one, one with a code handler.
    const ROUTES: &str = r#"
        consumer = { name = "c" }
        endpoints = { psp = { base_url = "http://127.0.0.1:1" } }
        [[routes]]
        name = "placed"
        topic = "orders"
        type = "order.placed"
        actions = [{ kind = "call", name = "capture", endpoint = "psp", path = "/captures/{{ data.order_id }}",
                     idempotency_key = "capture:{{ data.order_id }}" }]
        [[routes]]
        name = "shipped"
        topic = "orders"
        type = "order.shipped"
        version_guard = true
        actions = [{ kind = "emit", name = "shipped", type = "order.dispatched", topic = "out" }]
        [[routes]]
        name = "coded"
        topic = "orders"
        type = "order.coded"
        handler = "h"
    "#;

    fn processor() -> Processor {
        let cfg = RelayConfig::from_toml(ROUTES).unwrap();
        Processor::new(Arc::new(Router::new(&cfg).unwrap()), Handlers::default())
    }

    fn record(ty: &str, id: &str, extra: &[(&str, &str)]) -> RawRecord {
        let event = extra.iter().fold(TestEvent::new(id, ty, json!({"order_id": "o-1"})), |e, (k, v)| e.ext(k, v));
        event.record("orders", 7)
    }

    fn ready<'a, 'r>(p: Prepared<'a, 'r>) -> Item<'a, 'r> {
        match p {
            Prepared::Ready(item) => item,
            Prepared::Done(done) => panic!("expected a record to write, got {:?}", done.disposition),
        }
    }

    fn done(p: Prepared<'_, '_>) -> Disposition {
        match p {
            Prepared::Done(done) => done.disposition,
            Prepared::Ready(item) => panic!("expected nothing to write, got route {:?}", item.info.route),
        }
    }

    #[test]
    fn a_routed_record_is_planned_with_ids_derived_from_its_event_id_alone() {
        let p = processor();
        let rec = record("order.placed", "evt-1", &[]);
        let (first, again) = (ready(p.prepare(&rec, &View::Raw)), ready(p.prepare(&rec, &View::Raw)));
        let intent = &first.effects.as_ref().unwrap().intents[0];
        assert_eq!(
            (intent.intent.idempotency_key.as_str(), intent.intent.path.as_str()),
            ("capture:o-1", "/captures/o-1")
        );
        assert_eq!(intent.id, again.effects.as_ref().unwrap().intents[0].id, "the same record, the same intent id");
        let rec2 = record("order.placed", "evt-2", &[]);
        let other = ready(p.prepare(&rec2, &View::Raw));
        assert_ne!(intent.id, other.effects.as_ref().unwrap().intents[0].id, "another event, another intent");
        let row = p.planned(&first, first.effects.as_ref()).inbox;
        assert_eq!((row.consumer, row.event_id, row.offset, row.outcome), ("c", "evt-1", 7, InboxOutcome::Applied));
    }

    #[test]
    fn a_prepared_record_keeps_its_parsed_data_only_for_a_code_handler() {
        let p = processor();
        let (plain, unrouted, coded) = (
            record("order.placed", "evt-1", &[]),
            record("order.exploded", "evt-2", &[]),
            record("order.coded", "evt-3", &[]),
        );
        assert_eq!(ready(p.prepare(&plain, &View::Raw)).event.data, serde_json::Value::Null);
        assert_eq!(ready(p.prepare(&unrouted, &View::Raw)).event.data, serde_json::Value::Null);
        assert_eq!(ready(p.prepare(&coded, &View::Raw)).event.data, json!({"order_id": "o-1"}));
    }

    #[test]
    fn a_batch_prepares_records_while_their_effects_fit_its_budget_and_always_the_first() {
        let p = processor();
        let records: Vec<RawRecord> = (0..10).map(|n| record("order.placed", &format!("evt-{n}"), &[])).collect();
        let views = vec![View::Raw; records.len()];
        let one = p.prepare(&records[0], &View::Raw).holds();
        assert!(one > 0, "a planned call holds its JSON");
        assert_eq!(p.prepared_within(&records, &views, one * 5 / 2).len(), 2);
        assert_eq!(p.prepared_within(&records, &views, 0).len(), 1, "the first always");
        assert_eq!(p.prepared_within(&records, &views, usize::MAX).len(), 10);
    }

    #[test]
    fn poison_and_a_paused_route_are_done_before_any_write_and_an_unknown_type_is_recorded_unrouted() {
        let p = processor();
        let mut no_id = record("order.placed", "evt-1", &[]);
        no_id.headers.retain(|h| h.name != "ce_id");
        assert!(matches!(done(p.prepare(&no_id, &View::Raw)), Disposition::DeadLetter(_)));

        let unknown = record("order.exploded", "evt-2", &[]);
        let item = ready(p.prepare(&unknown, &View::Raw));
        assert!(item.route.is_none() && item.effects.is_none());
        assert_eq!(p.planned(&item, None).inbox.outcome, InboxOutcome::Unrouted);

        p.paused().set(["placed".to_string()]);
        let paused = done(p.prepare(&record("order.placed", "evt-3", &[]), &View::Raw));
        assert_eq!(paused, Disposition::Paused { route: "placed".into() });
        p.paused().set(Vec::new());
        ready(p.prepare(&record("order.placed", "evt-3", &[]), &View::Raw));
    }

    #[test]
    fn a_record_with_a_guard_or_a_handler_is_written_alone_and_the_others_share_runs() {
        let p = processor();
        let (plain, unrouted, coded) = (
            record("order.placed", "evt-1", &[]),
            record("order.exploded", "evt-2", &[]),
            record("order.coded", "evt-4", &[]),
        );
        let plain = ready(p.prepare(&plain, &View::Raw));
        assert!(!p.alone(&plain));
        let unrouted = ready(p.prepare(&unrouted, &View::Raw));
        assert!(!p.alone(&unrouted));
        let guarded = record("order.shipped", "evt-3", &[("aggregateid", "o-1"), ("aggregateversion", "3")]);
        let guarded = ready(p.prepare(&guarded, &View::Raw));
        assert!(p.alone(&guarded));
        assert_eq!(p.planned(&guarded, guarded.effects.as_ref()).version, Some(3));
        assert_eq!(p.planned(&plain, plain.effects.as_ref()).version, None, "no guard, no version written");
        let coded = ready(p.prepare(&coded, &View::Raw));
        assert!(p.alone(&coded), "a code handler runs between admit and finish, alone");
    }

    #[test]
    fn a_dead_letter_names_its_event_and_stores_without_nul_bytes() {
        let p = processor();
        let rec = record("order.placed", "evt-1", &[]);
        let item = ready(p.prepare(&rec, &View::Raw));
        let bad = Poison::new(PoisonClass::Rejected, "bad\0byte");
        let Disposition::DeadLetter(named) = item.done(Disposition::DeadLetter(bad)).disposition else {
            panic!("a dead letter stays one");
        };
        assert_eq!((named.event_id.as_deref(), named.event_type.as_deref()), (Some("evt-1"), Some("order.placed")));
        assert_eq!(crate::ingest::park::sanitized(&named).reason, "bad\u{fffd}byte");
    }

    // Every partition task stores the pause set it read
    // into one shared set; a slow read from before a pause could undo it.
    #[test]
    fn a_pause_set_read_before_a_newer_one_does_not_replace_it() {
        let p = processor();
        let (older, newer) =
            (std::time::Instant::now(), std::time::Instant::now() + std::time::Duration::from_millis(5));
        p.paused().set_as_of(["placed".to_string()], newer);
        p.paused().set_as_of(Vec::new(), older);
        let paused = done(p.prepare(&record("order.placed", "evt-1", &[]), &View::Raw));
        assert_eq!(paused, Disposition::Paused { route: "placed".into() }, "the newer read stands");
    }
}
