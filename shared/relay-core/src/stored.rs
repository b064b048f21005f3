//! Names the database stores: every lifecycle state and classification the
//! relay keeps in a text column is an enum declared with `stored_names!`,
//! which gives it its list of values, its stored name, parsing, serde in the
//! same names and (with the `sqlx` feature) binding to and reading from a
//! `text` column. A CHECK constraint in the migrations holds the same names;
//! the parity test in `tests/e2e/plans.rs` compares each constraint with its enum.
//!
//! Written here rather than derived: `sqlx::Type`'s derive binds an enum as a
//! PostgreSQL `ENUM` type of its own name, and relay's columns are `text` with
//! CHECK constraints (a new name is a constraint swap, not an `ALTER TYPE`
//! that cannot run in a transaction).

/// A name read from the database or typed by an operator that is none of its
/// enum's names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {name:?} (one of: {})", known.join(", "))]
pub struct UnknownName {
    /// What kind of name it should have been ("intent state").
    pub what: &'static str,
    /// The name given.
    pub name: String,
    /// The names that would have been accepted.
    pub known: Vec<&'static str>,
}

/// Declares an enum of stored names: `Variant = "name"` for each value, and
/// in parentheses after the enum's name what a value is called in errors.
macro_rules! stored_names {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident ($what:literal) {
            $( $(#[$vmeta:meta])* $variant:ident = $stored:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
        $vis enum $name {
            $( $(#[$vmeta])* #[serde(rename = $stored)] $variant, )+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: [$name; [$($stored),+].len()] = [$($name::$variant),+];

            /// The name stored and logged.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $stored, )+
                }
            }
        }

        // Written out: utoipa's derive does not see a `serde(rename)` whose
        // name came through this macro, and described the variants' Rust names.
        #[cfg(feature = "openapi")]
        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                utoipa::openapi::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::schema::Type::String)
                    .enum_values(Some([$($stored),+]))
                    .into()
            }
        }

        #[cfg(feature = "openapi")]
        impl utoipa::ToSchema for $name {}

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.pad(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = $crate::stored::UnknownName;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                $name::ALL.into_iter().find(|v| v.as_str() == s).ok_or_else(|| $crate::stored::UnknownName {
                    what: $what,
                    name: s.to_owned(),
                    known: $name::ALL.iter().map(|v| v.as_str()).collect(),
                })
            }
        }

        #[cfg(feature = "sqlx")]
        impl sqlx::Type<sqlx::Postgres> for $name {
            fn type_info() -> sqlx::postgres::PgTypeInfo {
                <str as sqlx::Type<sqlx::Postgres>>::type_info()
            }
            fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
                <str as sqlx::Type<sqlx::Postgres>>::compatible(ty)
            }
        }

        #[cfg(feature = "sqlx")]
        impl sqlx::postgres::PgHasArrayType for $name {
            fn array_type_info() -> sqlx::postgres::PgTypeInfo {
                <&str as sqlx::postgres::PgHasArrayType>::array_type_info()
            }
            fn array_compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
                <&str as sqlx::postgres::PgHasArrayType>::array_compatible(ty)
            }
        }

        #[cfg(feature = "sqlx")]
        impl<'q> sqlx::Encode<'q, sqlx::Postgres> for $name {
            fn encode_by_ref(
                &self,
                buf: &mut sqlx::postgres::PgArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <&str as sqlx::Encode<'q, sqlx::Postgres>>::encode(self.as_str(), buf)
            }
        }

        #[cfg(feature = "sqlx")]
        impl<'r> sqlx::Decode<'r, sqlx::Postgres> for $name {
            fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
                Ok(<&str as sqlx::Decode<'r, sqlx::Postgres>>::decode(value)?.parse::<$name>()?)
            }
        }
    };
}
pub(crate) use stored_names;

stored_names! {
    /// Where an intent is (`intents.state`).
    pub enum IntentState ("intent state") {
        /// Waiting for a claim (new, or scheduled for another attempt).
        Pending = "pending",
        /// Claimed by a worker under a lease.
        Running = "running",
        /// The call took effect.
        Succeeded = "succeeded",
        /// Never again: a permanent error or a spent budget.
        Dead = "dead",
        /// Budget spent on an attempt whose outcome is unknown.
        Uncertain = "uncertain",
    }
}

stored_names! {
    /// Where an outbox row is (`outbox.state`).
    pub enum OutboxState ("outbox state") {
        /// Waiting for a publisher.
        Pending = "pending",
        /// Claimed by a publisher under a lease.
        Running = "running",
        /// Acknowledged by the broker.
        Published = "published",
        /// The broker refuses it for good (too large, …): never retried as it
        /// is, and the later rows of its key wait until an operator replays or
        /// skips it.
        Dead = "dead",
        /// A dead row an operator chose not to publish: the rows after it go on.
        Skipped = "skipped",
    }
}

stored_names! {
    /// What an operator paused (`pauses.kind`).
    pub enum PauseKind ("pause kind") {
        /// A route: its records wait on their partition.
        Route = "route",
        /// An endpoint: its intents are not claimed.
        Endpoint = "endpoint",
    }
}

stored_names! {
    /// What a `relay.history` row records (`history.kind`).
    pub enum HistoryKind ("history kind") {
        /// A saga moved.
        Saga = "saga",
        /// An intent was written.
        Intent = "intent",
        /// An event was emitted.
        Emit = "emit",
        /// A call's outcome effects were written.
        Outcome = "outcome",
    }
}

stored_names! {
    /// What became of a dead letter (`dead_letters.replay_state`).
    pub enum ReplayState ("dead-letter replay state") {
        /// Not resolved: never replayed, or replayed and still failing.
        Open = "open",
        /// A replay went through (applied, a duplicate or a classified no-op).
        Resolved = "resolved",
        /// An operator skipped it (it held its key): never applied.
        Skipped = "skipped",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_name_parses_back_to_its_value_and_an_unknown_one_lists_the_known() {
        for s in IntentState::ALL {
            assert_eq!(s.as_str().parse::<IntentState>(), Ok(s));
            assert_eq!(serde_json::to_value(s).unwrap(), serde_json::json!(s.as_str()));
        }
        let err = "done".parse::<OutboxState>().unwrap_err().to_string();
        assert_eq!(err, "unknown outbox state \"done\" (one of: pending, running, published, dead, skipped)");
    }
}
