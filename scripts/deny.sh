#!/usr/bin/env bash
# Dependency policy (deny.toml): licences, banned crates, sources, and — when
# the RustSec advisory database on GitHub can be reached — advisories.
# Installs cargo-deny once (from crates.io).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
if ! command -v cargo-deny >/dev/null; then
  say "installing cargo-deny (once)"
  cargo install --locked cargo-deny
fi
checks=(licenses bans sources)
advisories="checked"
if curl -fsS -m 10 -o /dev/null https://github.com/rustsec/advisory-db; then
  checks+=(advisories)
else
  advisories="NOT CHECKED: github.com (the RustSec advisory database) cannot be reached from this machine"
fi
cargo deny --locked check "${checks[@]}"
# Said last, where CI's summary shows it, not only among the check's output
# (security review L6): a run that could not check advisories says so.
say "dependency policy: licenses, bans and sources checked; advisories ${advisories}"
