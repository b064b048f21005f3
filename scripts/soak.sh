#!/usr/bin/env bash
# The chaos soak against real PostgreSQL and Apache Kafka (started here):
# load with duplicates, upstream retries, poison and a final replay, random
# SIGKILLs of consumer, dispatcher and publisher processes, then `relay verify`.
#
#   scripts/soak.sh                 # 5 000 orders, 50 kills
#   scripts/soak.sh --long          # 100 000 orders, 3 topics x 4 partitions, 60 kills
#   scripts/soak.sh -- --sabotage offset-before-commit --consumer-faults consumer.before_db_commit=pause:200ms
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
args=()
if [ "${1:-}" = "--long" ]; then
  args=(--events 100000 --kills 60 --drain-deadline 30m)
  shift
fi
[ "${1:-}" = "--" ] && shift
say "building relay and relay-soak"
cargo build -q --locked -p relay-cli -p relay-soak
start_test_services
target/debug/relay-soak "${args[@]}" "$@"
