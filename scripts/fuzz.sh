#!/usr/bin/env bash
# Coverage-guided fuzzing (libFuzzer via cargo-fuzz) of envelope decoding and
# template rendering, each target for SECONDS (default 30).
#
#   scripts/fuzz.sh            # CI: 30 s per target
#   scripts/fuzz.sh 3600       # by hand; record the run counts in EVIDENCE.md
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
for target in envelope template; do
  say "fuzzing $target for ${secs}s"
  out=$(cargo +stable fuzz run "$target" --sanitizer none -- -max_total_time="$secs" 2>&1) || {
    echo "$out" | tail -40 >&2
    die "fuzz target $target failed: the crashing input is under fuzz/artifacts/$target/"
  }
  echo "$out" | grep -E "^Done [0-9]+ runs" | sed "s/^/[relay] $target: /" >&2
done
