#!/usr/bin/env bash
# Installs the tools the test suite needs, into a cache outside the clone so reruns are fast:
#   s3s-fs                a real S3-compatible server (from crates.io) for the object-storage tests;
#   kube-apiserver, etcd  built from the Kubernetes Go modules (e2e/tools/build-k8s.sh) for the
#                         operator's tests against a real API server;
#   helm                  built from its Go module, for the chart's lint and render tests;
#   cargo-deny            (from crates.io) the license, ban and source checks of .ci/lint.sh;
#   openssl, curl         used by e2e/tools/start-apiserver.sh (Debian packages);
#   libssl-dev, zlib1g-dev, cmake  librdkafka's build (the runtime's `kafka` feature);
#   librocksdb-dev, libclang-dev   the rocksdb state backend: Debian's RocksDB 7.8 is linked
#                         (.cargo/config.toml) and bindgen reads its headers with libclang;
#   Apache Kafka          the broker's jars from Maven Central (.ci/kafka/pom.xml), run with Java
#                         17 by the Kafka tests (a real broker, KRaft mode, single node).
# Prints the environment to use (WEIR_S3S_BIN=..., WEIR_HELM_BIN=..., WEIR_CARGO_DENY=...,
# KUBEBUILDER_ASSETS=..., WEIR_KAFKA_LIBS=...).
set -euo pipefail
cache="${WEIR_CACHE:-$HOME/.cache/weir}"
tools="$cache/tools"
mkdir -p "$tools"
# One install at a time (two clones' CI, or a shell beside it, would build the same tools into
# the same places). The Kubernetes build below takes a lock of its own.
exec 8>"$tools/.install.lock"
flock 8
# s3s-fs 0.14.1 is the newest release that builds with Rust 1.95 (0.17 needs 1.96).
S3S_VERSION=0.14.1
if [ ! -x "$tools/bin/s3s-fs" ] || ! grep -q "$S3S_VERSION" "$tools/.s3s-version" 2>/dev/null; then
  echo "installing s3s-fs $S3S_VERSION into $tools (once)" >&2
  CARGO_TARGET_DIR="$cache/tools-target" cargo install s3s-fs@"$S3S_VERSION" --features binary --locked --root "$tools" >&2
  echo "$S3S_VERSION" > "$tools/.s3s-version"
fi
# cargo-deny, for the license, ban and source checks of .ci/lint.sh (deny.toml).
DENY_VERSION=0.20.2
if [ ! -x "$tools/bin/cargo-deny" ] || ! grep -q "$DENY_VERSION" "$tools/.deny-version" 2>/dev/null; then
  echo "installing cargo-deny $DENY_VERSION into $tools (once)" >&2
  CARGO_TARGET_DIR="$cache/tools-target" cargo install cargo-deny@"$DENY_VERSION" --locked --root "$tools" >&2
  echo "$DENY_VERSION" > "$tools/.deny-version"
fi
# helm, for `helm lint` and `helm template` of charts/weir-operator (built from its Go module).
HELM_VERSION=v3.22.0
if [ ! -x "$tools/bin/helm" ] || ! grep -q "$HELM_VERSION" "$tools/.helm-version" 2>/dev/null; then
  echo "building helm $HELM_VERSION into $tools (once)" >&2
  GOPATH="$cache/go" GOMODCACHE="$cache/go/pkg/mod" GOCACHE="$cache/go/cache" GOFLAGS=-buildvcs=false GOBIN="$tools/bin" \
    go install helm.sh/helm/v3/cmd/helm@"$HELM_VERSION" >&2
  echo "$HELM_VERSION" > "$tools/.helm-version"
fi
# The Debian packages (openssl, curl, Java, Maven, librdkafka's and RocksDB's build needs).
bash "$(dirname "$0")/install-packages.sh"
# The Kafka broker: its jars (and their dependencies) resolved by Maven into the cache.
kafka_pom="$(dirname "$0")/kafka/pom.xml"
kafka_libs="$cache/kafka/lib"
kafka_stamp="$cache/kafka/.pom-$(sha256sum "$kafka_pom" | cut -c1-16)"
if [ ! -f "$kafka_stamp" ]; then
  echo "resolving the Kafka broker's jars into $kafka_libs (once)" >&2
  rm -rf "$cache/kafka" && mkdir -p "$kafka_libs"
  mvn -q -B -f "$kafka_pom" -Dmaven.repo.local="$cache/m2" dependency:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$kafka_libs" >&2
  touch "$kafka_stamp"
fi
assets=$(WEIR_CACHE="$cache" bash "$(dirname "$0")/../e2e/tools/build-k8s.sh" | sed -n 's/^KUBEBUILDER_ASSETS=//p' | tail -1)
echo "WEIR_S3S_BIN=$tools/bin/s3s-fs"
echo "WEIR_HELM_BIN=$tools/bin/helm"
echo "WEIR_CARGO_DENY=$tools/bin/cargo-deny"
echo "KUBEBUILDER_ASSETS=$assets"
echo "WEIR_KAFKA_LIBS=$kafka_libs"
