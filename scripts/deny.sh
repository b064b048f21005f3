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
if curl -fsS -m 10 -o /dev/null https://github.com/rustsec/advisory-db; then
  checks+=(advisories)
else
  say "github.com cannot be reached from here: the advisories check (RustSec database) is skipped; licenses, bans and sources are checked"
fi
cargo deny --locked check "${checks[@]}"
