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
say "building the relay (first build compiles librdkafka: a few minutes)"
cargo build -q --locked -p relay-cli
# RUST_LOG=info shows every record and call as it is processed.
RUST_LOG="${RUST_LOG:-error}" target/debug/relay demo
