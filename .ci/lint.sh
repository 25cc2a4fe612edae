#!/usr/bin/env bash
# Style gates, run by .ci/run before the tests: formatting, clippy with warnings as errors
# (the workspace, and the runtime without its default `cloud` feature),
# no line of Rust over 120 characters (rustfmt cannot break long strings by itself), no
# `unsafe` outside runtime/src/malloc.rs and runtime/src/prefetch.rs, and cargo-deny's license,
# ban and source checks (deny.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
# rustup's default profile has both; a minimal toolchain gets them added.
cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
cargo clippy --version >/dev/null 2>&1 || rustup component add clippy
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# The README's first command builds the runtime without cloud storage: it must stay clean too.
cargo clippy -p weir-runtime --no-default-features --all-targets --locked -- -D warnings
long=$(git ls-files --cached --others --exclude-standard '*.rs' | xargs awk 'length > 120 { print FILENAME ":" FNR ": " length " characters" }')
if [ -n "$long" ]; then
  echo "lines over 120 characters:" >&2
  echo "$long" >&2
  exit 1
fi
# unsafe_code is denied in the workspace; two modules allow it: one calls into the C library,
# one issues prefetch hints (an intrinsic declared unsafe that cannot fault).
unsafe=$(git grep -l -E 'allow\(unsafe_code\)' -- '*.rs' | grep -v -E '^runtime/src/(malloc|prefetch)\.rs$' || true)
if [ -n "$unsafe" ]; then
  echo "only runtime/src/malloc.rs and runtime/src/prefetch.rs may allow unsafe_code; also: $unsafe" >&2
  exit 1
fi
# Licenses, banned crates and sources (deny.toml); cargo-deny comes from .ci/install-tools.sh.
deny="${WEIR_CARGO_DENY:-$(command -v cargo-deny || true)}"
if [ -z "$deny" ] || [ ! -x "$deny" ]; then
  echo "cargo-deny not found: run .ci/install-tools.sh (it prints WEIR_CARGO_DENY) or install cargo-deny" >&2
  exit 1
fi
PATH="$(dirname "$deny"):$PATH" cargo deny --locked check --hide-inclusion-graph licenses bans sources
echo "lint: fmt, clippy, line lengths, unsafe, licenses, bans and sources clean"
