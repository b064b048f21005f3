//! Operating a running relay: dead-letter replay and the other operator
//! actions ([`admin`]), the HTTP admin API and console ([`server`]), and
//! topic retention checks and inbox cleanup ([`retention`]).

pub mod admin;
pub mod retention;
pub mod server;
