//! Operating a running relay: the operator actions — dead letters, intents,
//! pauses, counts — as one service, [`admin::Operator`], which both the
//! `relay` command line and the HTTP admin API call; the HTTP admin API and
//! console over it ([`server`]); topic retention checks and inbox cleanup
//! ([`retention`]).

pub mod admin;
pub mod retention;
pub mod server;
