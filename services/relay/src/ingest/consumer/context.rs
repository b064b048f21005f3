//! The consumer's librdkafka context: commits what was processed on a
//! revoke, forwards the client's logs and statistics to tracing.

use std::sync::{Arc, Mutex};

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::{Offset, TopicPartitionList};
use tracing::{info, warn};

use crate::ingest::partitions::{Partitions, TopicPartition};
use crate::runtime::kafka::{forward_error, forward_log};

/// Consumer context: commits on revoke, forwards librdkafka logs to tracing.
pub struct RelayContext {
    state: Arc<Mutex<Partitions>>,
    name: String,
}

impl RelayContext {
    /// The context of consumer `name`, whose partitions are `state`.
    pub(super) fn new(state: Arc<Mutex<Partitions>>, name: String) -> Self {
        RelayContext { state, name }
    }
}

pub(super) fn tps(tpl: &TopicPartitionList) -> Vec<TopicPartition> {
    tpl.elements().iter().map(|e| TopicPartition::new(e.topic(), e.partition())).collect()
}

pub(super) fn tpl_of<'a>(tps: impl IntoIterator<Item = &'a TopicPartition>) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::new();
    for tp in tps {
        let _ = tpl.add_partition(&tp.topic, tp.partition);
    }
    tpl
}

impl ClientContext for RelayContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        forward_log(&self.name, level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        forward_error(&self.name, &error, reason);
    }

    /// librdkafka's statistics (every `statistics.interval.ms`): the consumer
    /// lag it computes per assigned partition becomes the `relay_consumer_lag` gauge.
    fn stats(&self, statistics: rdkafka::Statistics) {
        for (topic, t) in &statistics.topics {
            for (partition, p) in &t.partitions {
                if *partition >= 0 && p.consumer_lag >= 0 {
                    crate::runtime::metrics::lag(&self.name, topic, *partition, p.consumer_lag);
                }
            }
        }
    }
}

impl ConsumerContext for RelayContext {
    fn pre_rebalance(&self, base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => {
                let revoked = tps(tpl);
                let offsets = self.state.lock().expect("partition state lock").revoke(&revoked);
                let mut commit = TopicPartitionList::new();
                for (tp, next) in &offsets {
                    let _ = commit.add_partition_offset(&tp.topic, tp.partition, Offset::Offset(*next));
                }
                if commit.count() > 0
                    && let Err(e) = base.commit(&commit, CommitMode::Sync)
                {
                    warn!(consumer = %self.name, error = %e, "committing offsets of revoked partitions failed; \
                              their records will be redelivered and deduplicated by the inbox");
                }
                let names: Vec<String> = revoked.iter().map(ToString::to_string).collect();
                info!(consumer = %self.name, partitions = ?names, "partitions revoked; processed offsets committed");
            }
            Rebalance::Assign(_) => {}
            Rebalance::Error(e) => warn!(consumer = %self.name, error = %e, "rebalance error"),
        }
    }

    /// A partition paused at the broker stays paused in librdkafka across a
    /// revoke and a new assignment, while the revoke forgot why it was
    /// paused: nothing would ever resume it. So every partition assigned
    /// that is not paused by the relay is resumed here; what was waiting or
    /// held for it is fetched again from the committed offset.
    fn post_rebalance(&self, base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            let assigned = tps(tpl);
            let resume = self.state.lock().expect("partition state lock").assigned(&assigned);
            if !resume.is_empty()
                && let Err(e) = base.resume(&tpl_of(&resume))
            {
                warn!(consumer = %self.name, error = %e, "resuming assigned partitions failed; a partition paused before the rebalance may stay paused");
            }
            let names: Vec<String> = assigned.iter().map(ToString::to_string).collect();
            info!(consumer = %self.name, partitions = ?names, "partitions assigned");
        }
    }
}
