#!/usr/bin/env bash
# Installs the tools the test suite needs, into a cache outside the clone so reruns are fast:
#   s3s-fs                a real S3-compatible server (from crates.io) for the object-storage tests;
#   kube-apiserver, etcd  built from the Kubernetes Go modules (e2e/tools/build-k8s.sh) for the
#                         operator's tests against a real API server;
#   openssl, curl         used by e2e/tools/start-apiserver.sh (Debian packages).
# Prints the environment to use (WEIR_S3S_BIN=..., KUBEBUILDER_ASSETS=...).
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
missing=()
for tool in openssl curl; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]} (apt)" >&2
  apt-get update >&2 && apt-get install -y "${missing[@]}" >&2
fi
assets=$(WEIR_CACHE="$cache" bash "$(dirname "$0")/../e2e/tools/build-k8s.sh" | sed -n 's/^KUBEBUILDER_ASSETS=//p' | tail -1)
echo "WEIR_S3S_BIN=$tools/bin/s3s-fs"
echo "KUBEBUILDER_ASSETS=$assets"
