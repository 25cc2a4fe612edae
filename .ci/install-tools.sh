#!/usr/bin/env bash
# Installs the tools the test suite needs, into a cache outside the clone so reruns are fast:
#   s3s-fs  a real S3-compatible server (from crates.io) for the object-storage tests.
# Prints the environment to use (WEIR_S3S_BIN=...).
set -euo pipefail
cache="${WEIR_CACHE:-$HOME/.cache/weir}"
tools="$cache/tools"
mkdir -p "$tools"
# s3s-fs 0.14.1 is the newest release that builds with Rust 1.95 (0.17 needs 1.96).
S3S_VERSION=0.14.1
if [ ! -x "$tools/bin/s3s-fs" ] || ! grep -q "$S3S_VERSION" "$tools/.s3s-version" 2>/dev/null; then
  echo "installing s3s-fs $S3S_VERSION into $tools (once)" >&2
  CARGO_TARGET_DIR="$cache/tools-target" cargo install s3s-fs@"$S3S_VERSION" --features binary --locked --root "$tools" >&2
  echo "$S3S_VERSION" > "$tools/.s3s-version"
fi
echo "WEIR_S3S_BIN=$tools/bin/s3s-fs"
