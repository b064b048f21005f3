#!/usr/bin/env bash
# Benchmarks against real PostgreSQL and Apache Kafka (started here), each
# figure next to its reference (limit / floor) in the same run.
#
#   scripts/bench.sh            # full run (3 runs per figure), rewrites the results in BENCHMARKS.md
#   scripts/bench.sh --quick    # small sizes, 1 run: checks the harness works (CI); writes nothing
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
if [ "${1:-}" = "--quick" ]; then
  shift
  # Only checks that the harness runs: the debug build the tests already made is enough.
  cargo build -q --locked -p relay-cli -p relay-bench
  start_test_services
  target/debug/relay-bench --quick "$@"
else
  say "building relay and relay-bench (release)"
  cargo build -q --locked --release -p relay-cli -p relay-bench
  start_test_services
  target/release/relay-bench --out BENCHMARKS.md "$@"
fi
