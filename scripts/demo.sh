#!/usr/bin/env bash
# The relay end to end on this machine: starts PostgreSQL if needed, creates a
# fresh database, and runs `relay demo`, which brings up an embedded Kafka
# (librdkafka's mock cluster) and a fake payment provider in-process, pushes
# example orders with duplicates, an upstream retry, a stale event and poison
# records, and prints what happened.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
trap 'stop_postgres_if_started' EXIT INT TERM

ensure_postgres relay_demo
fresh_database relay_demo relay_demo
export DATABASE_URL="postgres://relay_demo:relay_demo@127.0.0.1:5432/relay_demo"
say "building the relay (the first build compiles librdkafka and ~400 crates: a few minutes; cargo shows each)"
cargo build --locked -p relay-cli
# The narrative on stdout; the relay's own log lines go to a file, so they
# do not cut into it (RUST_LOG=info puts every record and call there).
log=$(mktemp /tmp/relay-demo.XXXXXX.log)
say "relay's log: $log"
if ! RUST_LOG="${RUST_LOG:-warn}" NO_COLOR=1 target/debug/relay demo 2>"$log"; then
  tail -30 "$log" >&2
  die "the demo failed; its log above (all of it in $log)"
fi
