//! The outbox publisher: claim pending outbox rows, produce them with an
//! idempotent producer (`acks=all`), and mark them published only after the
//! broker acknowledged them (R10).
//!
//! A crash between the acknowledgement and the mark republishes the same
//! record with the same CloudEvents id after the lease expires (C14);
//! consumers downstream dedup on that id, as the relay's own inbox does.

use futures::future::join_all;
use rdkafka::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header as KHeader, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer, ProducerContext};
use rdkafka::util::Timeout;
use relay_core::config::{KafkaConfig, PublisherConfig};
use relay_core::retry::BackoffPolicy;
use relay_store::outbox::{self, ClaimedRow};
use relay_store::{Claim, ClaimCommit, ClaimPool, Claimer, FinishPool};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::runtime::claim_loop::{Resume, listen, notified, until_due};
use crate::runtime::faults::{Faults, point};
use crate::runtime::kafka::{Role, client_config, forward_error, forward_log};

/// Claim-and-produce loops per publisher process.
const LANES: usize = 2;

/// Header carrying the outbox row id on every published record.
pub const OUTBOX_ID_HEADER: &str = "relay_outbox_id";

/// Channel the outbox trigger notifies.
pub const CHANNEL: &str = "relay_outbox";

/// Forwards librdkafka's logs to tracing.
pub struct LogContext;

impl ClientContext for LogContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        forward_log("producer", level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        forward_error("producer", &error, reason);
    }
}

impl ProducerContext for LogContext {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &rdkafka::message::DeliveryResult<'_>, _: Self::DeliveryOpaque) {}
}

/// The outbox publisher of one process.
pub struct Publisher {
    pool: PgPool,
    /// The lanes' claim connections ([`ClaimPool`]: one round trip a claim).
    claims: ClaimPool,
    /// The lanes' connections to mark rows ([`FinishPool`]: one round trip a batch).
    marks: FinishPool,
    producer: FutureProducer<LogContext>,
    settings: PublisherConfig,
    /// The consumer whose outbox rows these are: publishers of other
    /// consumers sharing the database publish theirs with their own Kafka
    /// configuration.
    consumer: String,
    faults: Faults,
    /// Where the lanes' next claim may start, shared by the lanes: after
    /// the last row of the latest full claim ([`outbox::claim_after`]) or
    /// the end of the window a short one examined; back
    /// to the start after a short claim, a rescue or a database error; back
    /// to the lowest `seq` of keyed rows just published (the next row of
    /// each key has a higher one).
    resume: std::sync::Mutex<Resume<i64>>,
}

impl Publisher {
    /// Create the producer.
    pub fn new(
        pool: PgPool,
        kafka: &KafkaConfig,
        settings: PublisherConfig,
        consumer: &str,
        faults: Faults,
    ) -> anyhow::Result<Publisher> {
        let mut cfg = client_config(kafka, Role::Producer)?;
        cfg.set("message.timeout.ms", settings.delivery_timeout.as_millis().to_string());
        cfg.set_log_level(RDKafkaLogLevel::Warning);
        let producer = cfg.create_with_context(LogContext)?;
        let claims = ClaimPool::beside(&pool, LANES as u32, ClaimCommit::Async);
        let marks = FinishPool::beside(&pool, LANES as u32);
        let resume = std::sync::Mutex::new(Resume::default());
        let consumer = consumer.to_owned();
        Ok(Publisher { pool, claims, marks, producer, settings, consumer, faults, resume })
    }

    /// The producer, for tests that raise librdkafka's fatal errors on it
    /// (only in builds with the `faults` feature).
    #[cfg(feature = "faults")]
    pub fn producer(&self) -> &FutureProducer<LogContext> {
        &self.producer
    }

    /// Run until `shutdown`: finish the batch in flight, flush, return.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        info!(batch = self.settings.batch_size, lanes = LANES, "outbox publisher started");
        // Several lanes claim and produce at once, so one batch's wait for
        // acknowledgements overlaps the next batch's claim. Order per key still
        // holds: a row is only claimable once every earlier row of its topic
        // and ordering key is published, whichever lane had it.
        let me = std::sync::Arc::new(self);
        let mut lanes = tokio::task::JoinSet::new();
        for lane in 0..LANES {
            let (me, token) = (me.clone(), shutdown.clone());
            lanes.spawn(async move { me.lane(lane, token).await });
        }
        let mut result = Ok(());
        while let Some(done) = lanes.join_next().await {
            if let Ok(Err(e)) = done {
                shutdown.cancel();
                result = Err(e);
            }
        }
        if result.is_ok() {
            let _ = me.producer.flush(Timeout::After(me.settings.delivery_timeout));
        }
        info!("outbox publisher stopped");
        result
    }

    async fn lane(&self, lane: usize, shutdown: CancellationToken) -> anyhow::Result<()> {
        let mut listener = listen(&self.pool, CHANNEL).await;
        let mut last_rescue = std::time::Instant::now();
        let mut failures = 0u32;
        let mut claimer = self.claims.claimer();
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            if lane == 0 && last_rescue.elapsed() >= self.settings.lease / 4 {
                last_rescue = std::time::Instant::now();
                match self.rescue().await {
                    Ok(0) => {}
                    Ok(n) => {
                        self.resume().back_to(None);
                        crate::runtime::metrics::rescued("outbox", n);
                        warn!(
                            rescued = n,
                            "outbox rows whose publisher lost its lease are pending again; they will be republished under the same ids"
                        )
                    }
                    Err(e) => warn!(error = %e, "rescuing outbox leases failed"),
                }
            }
            let wait = match self.publish_batch(&mut claimer).await {
                Ok(b) if b.claimed == self.settings.batch_size as usize || b.unblocked.is_some() || b.swept => {
                    // A full batch may have left more, and so may a claim
                    // that stopped at its window; a published row with an
                    // ordering key made the next row of its key publishable,
                    // and nothing else announces that.
                    failures = 0;
                    continue;
                }
                Ok(b) => {
                    failures = 0;
                    until_due(b.next_due.into_iter().chain(b.retry_at).min(), self.settings.poll_interval)
                }
                Err(PublishError::Fault(f)) => return Err(anyhow::Error::from(f)),
                Err(e @ PublishError::Fatal(_)) => {
                    error!(error = %e, "outbox publisher stopping");
                    return Err(e.into());
                }
                Err(PublishError::Db(e)) => {
                    self.resume().back_to(None);
                    failures += 1;
                    error!(error = %e, attempt = failures, "outbox database error; retrying");
                    let delay = BackoffPolicy::DATABASE.delay(failures, &mut rand::rng());
                    tokio::select! { _ = shutdown.cancelled() => return Ok(()), _ = tokio::time::sleep(delay) => {} }
                    continue;
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = notified(&mut listener) => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// The lanes' shared position (held for no await).
    fn resume(&self) -> std::sync::MutexGuard<'_, Resume<i64>> {
        self.resume.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    async fn rescue(&self) -> Result<u64, sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        outbox::rescue_expired(&mut conn, 1000).await
    }

    /// Claim (on the lane's `claimer`), produce and mark one batch.
    async fn publish_batch(&self, claimer: &mut Claimer) -> Result<Batch, PublishError> {
        let (limit, lease) = (i64::from(self.settings.batch_size), self.settings.lease);
        let (after, back) = self.resume().next(self.settings.poll_interval);
        let claim =
            claimer.claim(async |conn| outbox::claim_after(conn, &self.consumer, limit, lease, after).await).await?;
        match outbox::resume_after(&claim, self.settings.batch_size as usize) {
            Some(at) if claim.passed.is_some() => self.resume().passed(back, at),
            Some(at) => self.resume().claimed(back, at),
            None => self.resume().back_to(None),
        }
        let Claim { rows, unreadable, next_due, passed, .. } = claim;
        let mut batch = Batch {
            claimed: rows.len() + unreadable.len(),
            unblocked: None,
            retry_at: None,
            next_due,
            swept: passed.is_some(),
        };
        if !unreadable.is_empty() {
            self.bury_unreadable(&unreadable).await?;
        }
        if rows.is_empty() {
            return Ok(batch);
        }
        // Enqueue in seq order (the idempotent producer keeps per-partition order), then await all.
        let deliveries = join_all(rows.iter().map(|row| self.produce(row))).await;
        if deliveries.iter().any(Result::is_err)
            && let Some((code, reason)) = self.producer.client().fatal_error()
        {
            // Nothing was marked: the rows' leases expire and another
            // process publishes them under the same ids.
            return Err(PublishError::Fatal(format!("{code:?}: {reason}")));
        }
        self.faults.hit(point::PUBLISHER_AFTER_ACK).await.map_err(PublishError::Fault)?;
        let mut ok_ids = Vec::new();
        let mut ok_tokens = Vec::new();
        let mut conn = self.marks.acquire().await?;
        for (row, result) in rows.iter().zip(deliveries) {
            match result {
                Ok((partition, offset)) => {
                    crate::runtime::metrics::published(&row.topic, true);
                    debug!(outbox_id = %row.id, topic = %row.topic, partition, offset, event_type = row.event_type.as_deref().unwrap_or(""), "published");
                    ok_ids.push(row.id);
                    ok_tokens.push(row.lease_token);
                    if row.ordering_key.is_some() {
                        batch.unblocked = Some(batch.unblocked.map_or(row.seq, |s| s.min(row.seq)));
                    }
                }
                Err(e) => {
                    if let Some(at) = self.failed(&mut conn, row, &e).await? {
                        batch.retry_at = Some(batch.retry_at.map_or(at, |t| t.min(at)));
                    }
                }
            }
        }
        if !ok_ids.is_empty() {
            let marked = outbox::mark_published(&mut conn, &ok_ids, &ok_tokens).await?;
            if batch.unblocked.is_some() {
                // The next row of each key published has a higher seq.
                self.resume().back_to(batch.unblocked);
            }
            if marked < ok_ids.len() as u64 {
                warn!(
                    published = ok_ids.len(),
                    marked,
                    "some rows' leases expired during delivery; they will be published again under the same ids"
                );
            }
        }
        Ok(batch)
    }

    /// A row the broker did not take: dead if it never can (the later rows
    /// of its key wait for it), else retried later; when, if retried.
    async fn failed(
        &self,
        conn: &mut relay_store::FinishConnection,
        row: &ClaimedRow,
        e: &KafkaError,
    ) -> Result<Option<chrono::DateTime<chrono::Utc>>, PublishError> {
        if is_permanent(e) {
            crate::runtime::metrics::published(&row.topic, false);
            crate::runtime::metrics::publish_dead(&row.topic);
            error!(outbox_id = %row.id, topic = %row.topic, attempt = row.attempts, error = %e,
                   ordering_key = row.ordering_key.as_deref().unwrap_or(""),
                   "the broker can never take this record (size limit, invalid topic, policy): the row is dead, \
                    and the later rows of its key wait for it; fix the cause (e.g. raise the topic's \
                    max.message.bytes and the producer's message.max.bytes), then `relay outbox replay ID`, \
                    or `relay outbox skip ID` to let the later rows go without it");
            outbox::mark_dead(conn, row.id, row.lease_token, &format!("permanent: {e}")).await?;
            return Ok(None);
        }
        crate::runtime::metrics::published(&row.topic, false);
        let delay = self.settings.backoff.delay(u32::try_from(row.attempts).unwrap_or(1), &mut rand::rng());
        warn!(outbox_id = %row.id, topic = %row.topic, attempt = row.attempts, retry_in_ms = delay.as_millis() as u64,
              error = %e, "publishing failed; it will be retried under the same id");
        outbox::schedule_retry(conn, row.id, row.lease_token, delay, &e.to_string()).await?;
        Ok(Some(chrono::Utc::now() + delay))
    }

    /// End claimed rows that cannot be read dead, saying why: left running,
    /// each would be rescued and claimed again every lease, forever. An
    /// operator sees them in `relay outbox list --state dead`.
    async fn bury_unreadable(&self, unreadable: &[relay_store::Unreadable]) -> Result<(), PublishError> {
        let mut conn = self.marks.acquire().await?;
        for u in unreadable {
            error!(outbox_id = %u.id, error = %u.error,
                   "a claimed outbox row cannot be read: it ends dead, never published, and the later rows of \
                    its key wait for it; `relay outbox skip ID` lets them go");
            outbox::mark_dead(&mut conn, u.id, u.lease_token, &u.reason()).await?;
        }
        Ok(())
    }

    async fn produce(&self, row: &ClaimedRow) -> Result<(i32, i64), KafkaError> {
        let headers = row.headers();
        let mut hs = OwnedHeaders::new_with_capacity(headers.len() + 1);
        for h in &headers {
            hs = hs.insert(KHeader { key: &h.name, value: h.value.as_deref() });
        }
        // Lets anyone (and `relay verify`) match a record to its outbox row,
        // dead-letter copies included; for events it equals `ce_id`.
        let id = row.id.to_string();
        hs = hs.insert(KHeader { key: OUTBOX_ID_HEADER, value: Some(id.as_bytes()) });
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&row.topic).headers(hs);
        if let Some(k) = &row.key {
            record = record.key(k.as_slice());
        }
        if let Some(p) = &row.payload {
            record = record.payload(p.as_slice());
        }
        self.producer
            // The queue wait is bounded apart from the delivery: both are in
            // the row's lease (`PublisherConfig::in_flight_bound`).
            .send(record, Timeout::After(self.settings.queue_wait()))
            .await
            .map(|d| (d.partition, d.offset))
            .map_err(|(e, _)| e)
    }
}

/// Whether a produce error will come back on every attempt until an
/// operator acts: the record is larger than the producer or the topic
/// allows, the topic or the record is invalid for the broker, the topic does
/// not exist (librdkafka reports that only after waiting
/// `topic.metadata.propagation.max.ms` for it), or the principal may not
/// write to it. Such a row ends dead, holding its key, until an operator
/// fixes the cause and replays it (`relay outbox replay`), instead of being
/// retried forever with the rows of its key stuck behind it. Anything else
/// (timeouts, brokers down, leaders moving) is retried.
fn is_permanent(e: &KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode as C;
    matches!(
        e.rdkafka_error_code(),
        Some(
            C::MessageSizeTooLarge
                | C::InvalidMessageSize
                | C::InvalidRecord
                | C::InvalidTopic
                | C::PolicyViolation
                | C::UnknownTopic
                | C::UnknownPartition
                | C::UnknownTopicOrPartition
                | C::TopicAuthorizationFailed
                | C::ClusterAuthorizationFailed
        )
    )
}

/// What one publish round did, for the lane's next step.
#[derive(Debug, Clone, Copy)]
pub struct Batch {
    /// Rows claimed.
    pub claimed: usize,
    /// The lowest `seq` of a published row with an ordering key: the next
    /// row of its key (a higher `seq`) may be publishable now.
    pub unblocked: Option<i64>,
    /// When the earliest publish that failed in this round is retried.
    pub retry_at: Option<chrono::DateTime<chrono::Utc>>,
    /// When the next row not due yet comes due (only after a short claim).
    pub next_due: Option<chrono::DateTime<chrono::Utc>>,
    /// The claim stopped at its window before the end of the pending rows.
    pub swept: bool,
}

/// Why a publish round failed.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// Database error: the round is retried.
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    /// A fault point fired.
    #[error(transparent)]
    Fault(crate::runtime::faults::FaultInjected),
    /// The producer hit a fatal error: it will never deliver again, so the
    /// publisher stops (and the process with it) instead of retrying forever
    /// while looking alive.
    #[error(
        "the Kafka producer failed for good ({0}): librdkafka raises this when the idempotent producer \
         can no longer guarantee order or exactly-once delivery (e.g. the cluster refused its producer id: \
         check the principal's IdempotentWrite / ClusterAction ACLs); restart the relay once the cause is fixed"
    )]
    Fatal(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::types::RDKafkaErrorCode as C;

    #[test]
    fn errors_that_never_go_away_by_themselves_end_the_row_and_the_others_are_retried() {
        let permanent = [
            C::MessageSizeTooLarge,
            C::InvalidTopic,
            C::PolicyViolation,
            C::UnknownTopic,
            C::UnknownTopicOrPartition,
            C::TopicAuthorizationFailed,
            C::ClusterAuthorizationFailed,
        ];
        for code in permanent {
            assert!(is_permanent(&KafkaError::MessageProduction(code)), "{code:?}");
        }
        for code in [C::MessageTimedOut, C::BrokerTransportFailure, C::NotLeaderForPartition, C::RequestTimedOut] {
            assert!(!is_permanent(&KafkaError::MessageProduction(code)), "{code:?}");
        }
    }
}
