#!/usr/bin/env bash
# Run every test of the relay against real services:
#   * PostgreSQL (the local cluster; started if it is down, stopped again after),
#   * Apache Kafka 4.4 (single KRaft node from its Maven jars, on a free port).
# Each test creates its own database and its own topics, so tests run in
# parallel against one PostgreSQL and one broker.
#
# Usage: scripts/test.sh [cargo test args…]   e.g. scripts/test.sh -p relay-e2e -- c10
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"

cleanup() {
  local rc=$?
  stop_kafka
  if [ -n "${TEST_ROLE:-}" ]; then
    # Drop the per-test databases this run created.
    su postgres -c "psql -qAt -c \"SELECT datname FROM pg_database WHERE datname LIKE 'relay_test_%'\"" 2>/dev/null |
      while read -r db; do su postgres -c "psql -q -c 'DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)'" >/dev/null 2>&1 || true; done
  fi
  stop_postgres_if_started
  exit $rc
}
trap cleanup EXIT INT TERM

TEST_ROLE=relay_test
ensure_postgres "$TEST_ROLE"
export RELAY_TEST_DATABASE_URL="postgres://$TEST_ROLE:$TEST_ROLE@127.0.0.1:5432/postgres"
start_kafka
export RELAY_TEST_KAFKA_BOOTSTRAP="$KAFKA_BOOTSTRAP"
export RELAY_TEST_KAFKA_PID="$KAFKA_PID"
export RELAY_TEST_KAFKA_LIBS="$CACHE/kafka-libs"   # for tests that run a broker of their own

say "running cargo test (PostgreSQL at 127.0.0.1:5432, Kafka at $KAFKA_BOOTSTRAP)"
cargo test --workspace --locked "$@"
