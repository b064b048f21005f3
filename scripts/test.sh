#!/usr/bin/env bash
# Run every test of the relay against real services:
#   * PostgreSQL (the local cluster; started if it is down, stopped again after),
#   * Apache Kafka 4.4 (single KRaft node from its Maven jars, on a free port),
#   * Apicurio Registry (a Confluent-compatible Schema Registry, from Maven Central),
# then a short chaos soak (SIGKILLs of relay processes under load, then
# `relay verify`) whose summary table ends the output.
# Each test creates its own database and its own topics, so tests run in
# parallel against one PostgreSQL and one broker; crash tests that restart a
# server start a private one.
#
# Usage: scripts/test.sh [cargo test args…]   e.g. scripts/test.sh -p relay-cli --test e2e -- crash_matrix::c10
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
ensure_console_test_deps
start_test_services

say "running cargo test (PostgreSQL at 127.0.0.1:5432, Kafka at $KAFKA_BOOTSTRAP)"
cargo test --workspace --locked "$@"

if [ $# -eq 0 ]; then
  say "short chaos soak (the long one: scripts/soak.sh --long, results in EVIDENCE.md)"
  cargo build -q --locked -p relay-cli -p relay-soak
  target/debug/relay-soak --events 3000 --kills 50 --seed 42
fi
