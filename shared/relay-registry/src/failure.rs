//! What goes wrong: a record that can never be decoded as it is, or a
//! registry that could not be asked.

/// Why a value could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// The record can never be decoded as it is: dead-letter it.
    #[error("{0}")]
    Poison(String),
    /// The registry does not have the schema the record names — yet, maybe:
    /// a replica behind the one the producer registered with, a registry
    /// restarted empty. Retried within the consumer's reference budget,
    /// then dead-lettered; once a record has been ([`Registry::gave_up`](crate::Registry::gave_up)),
    /// the records naming the same id are poison after one ask.
    #[error("{0}")]
    NotYet(String),
    /// The registry could not answer now: wait and try the record again.
    #[error("{0}")]
    Unavailable(String),
    /// The value decodes to more JSON than [`max_json_bytes`](crate::max_json_bytes) of its size:
    /// dead-letter it as oversized.
    #[error("{0}")]
    Oversized(String),
}

/// Why a value did not become JSON.
#[derive(Debug)]
pub(crate) enum Undecoded {
    /// It is not a value of its schema.
    Invalid(String),
    /// Its JSON would take more than this many bytes.
    TooLarge(usize),
}

impl From<String> for Undecoded {
    fn from(why: String) -> Self {
        Undecoded::Invalid(why)
    }
}

impl From<&str> for Undecoded {
    fn from(why: &str) -> Self {
        Undecoded::Invalid(why.to_owned())
    }
}

impl std::fmt::Display for Undecoded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Undecoded::Invalid(why) => f.write_str(why),
            Undecoded::TooLarge(limit) => write!(f, "oversized: its JSON is over {limit} bytes"),
        }
    }
}

/// `f` of a record of `topic`.
pub(crate) fn on_topic(f: Failure, topic: &str) -> Failure {
    match f {
        Failure::Unavailable(why) => Failure::Unavailable(format!("record of topic {topic:?}: {why}")),
        Failure::Poison(why) => Failure::Poison(format!("record of topic {topic:?}, {why}")),
        Failure::NotYet(why) => Failure::NotYet(format!("record of topic {topic:?}, {why}")),
        Failure::Oversized(why) => Failure::Oversized(format!("record of topic {topic:?}, {why}")),
    }
}
