#!/usr/bin/env bash
# Installs, with apt, the Debian packages that building weir-runtime with its default features
# and running its tests need, when any is missing (a fresh machine): openssl and curl
# (e2e/tools/start-apiserver.sh), Java 17 and Maven (the Kafka broker of the tests, Flink of
# runtime/benches/flink-peer.sh), libssl-dev, zlib1g-dev and pkg-config (librdkafka's build),
# strace (the test that checks local storage fsyncs before it publishes), librocksdb-dev and
# libclang-dev (the rocksdb state backend: Debian's RocksDB is linked, .cargo/config.toml, and
# bindgen reads its headers with libclang). Called by .ci/install-tools.sh and by the bench
# scripts that build the release binary.
set -euo pipefail
missing=()
for tool in openssl curl java mvn; do command -v "$tool" >/dev/null || missing+=("$tool"); done
missing=("${missing[@]/java/openjdk-17-jre-headless}")
missing=("${missing[@]/mvn/maven}")
# strace: the runtime test that checks local storage fsyncs before it publishes.
for pkg in libssl-dev zlib1g-dev pkg-config strace librocksdb-dev libclang-dev; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]} (apt)" >&2
  apt-get update >&2 && apt-get install -y "${missing[@]}" >&2
fi
