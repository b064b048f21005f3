#!/usr/bin/env bash
# Coverage-guided fuzzing (libFuzzer via cargo-fuzz) of envelope decoding and
# template rendering for SECONDS each (default 30), then of the memory budget
# of each decoder (`budget_*`: a counting allocator fails an input that holds
# more than its target may, see shared/relay-budget) for two thirds of that.
#
#   scripts/fuzz.sh            # CI: 30 s per target, 20 s per budget target
#   scripts/fuzz.sh 3600       # by hand; record the run counts in EVIDENCE.md
#
# `budget_avro` is not in the loop until the Avro decoder bounds the items a
# value claims (run it by hand: cargo fuzz run budget_avro --sanitizer none).
#
# Runs on the stable toolchain: RUSTC_BOOTSTRAP=1 lets cargo-fuzz pass its
# instrumentation flags, and `--sanitizer none` because the fuzzed crates
# forbid unsafe code (the question here is panics, not memory errors).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT/fuzz"
secs="${1:-30}"
if ! cargo fuzz --version >/dev/null 2>&1; then
  say "installing cargo-fuzz (once)"
  cargo install --locked cargo-fuzz
fi
export RUSTC_BOOTSTRAP=1
budget_secs=$(( secs * 2 / 3 > 0 ? secs * 2 / 3 : 1 ))
for target in envelope template budget_record budget_registry budget_template budget_jsonb; do
  t=$secs
  [[ "$target" == budget_* ]] && t=$budget_secs
  say "fuzzing $target for ${t}s"
  out=$(cargo +stable fuzz run "$target" --sanitizer none -- -max_total_time="$t" 2>&1) || {
    echo "$out" | tail -40 >&2
    die "fuzz target $target failed: the crashing input is under fuzz/artifacts/$target/"
  }
  echo "$out" | grep -E "^Done [0-9]+ runs" | sed "s/^/[relay] $target: /" >&2
done
