#!/usr/bin/env bash
# The end-to-end scenario suite on a real cluster: builds the release images (images/build.sh),
# brings a cluster up with them (kind: two nodes; local: one), checks the chart against its API server (every
# rendered object accepted by a server-side dry-run), runs the scenarios (each installs the
# operator with `helm install` and runs it in a pod), and tears the cluster down again,
# whatever happened.
#
#   .ci/e2e.sh [--kind | --local]
#
# The cluster: kind (e2e/kind/up, its node image built offline) when its node image can be
# built here, else the local cluster (e2e/local/up); --kind or --local (or WEIR_E2E_CLUSTER=
# kind|local) chooses. A cluster that does not come up stops the suite with its error.
set -euo pipefail
cd "$(dirname "$0")/.."
export WEIR_CACHE="${WEIR_CACHE:-$HOME/.cache/weir}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$WEIR_CACHE/target}"
cluster="${WEIR_E2E_CLUSTER:-auto}"
case "${1:-}" in --kind) cluster=kind ;; --local) cluster=local ;; "") ;; *) echo "usage: $0 [--kind|--local]" >&2; exit 2 ;; esac
images="$WEIR_CACHE/images"
mkdir -p "$images"
start=$(date +%s)

# Release images, as users get them. Their refs come from the build's output lines.
built="$(bash images/build.sh --out "$images")" || { echo "building the release images failed" >&2; exit 1; }
echo "$built" >&2
ref_of() { sed -n "s|^IMAGE=\([^ ]*/$1:[^ ]*\) ARCHIVE=.*|\1|p" <<<"$built"; }
archive_of() { sed -n "s|^IMAGE=[^ ]*/$1:[^ ]* ARCHIVE=\([^ ]*\) .*|\1|p" <<<"$built"; }
export WEIR_E2E_RUNTIME_IMAGE WEIR_E2E_OPERATOR_IMAGE
WEIR_E2E_RUNTIME_IMAGE="$(ref_of weir-runtime)" WEIR_E2E_OPERATOR_IMAGE="$(ref_of weir-operator)"
echo "release images built after $(( $(date +%s) - start ))s" >&2

if [[ "$cluster" == auto ]]; then
  if bash e2e/kind/build-node-image.sh >/dev/null; then
    cluster=kind
  else
    echo "the kind node image cannot be built here: running on the local cluster" >&2
    cluster=local
  fi
fi
cleanup() { "e2e/$cluster/down" >&2 || true; }
trap cleanup EXIT
# A cluster that does not come up stops the suite here, with up's own error.
if ! cluster_env="$("e2e/$cluster/up" --image "$(archive_of weir-runtime)" --image "$(archive_of weir-operator)")"; then
  echo "e2e/$cluster/up failed: the cluster did not come up (see its log above)" >&2
  exit 1
fi
eval "$cluster_env"
echo "$cluster cluster up after $(( $(date +%s) - start ))s" >&2

status=0
# The chart against this API server: every object it renders passes a server-side dry-run.
bash e2e/tools/chart-dry-run.sh || status=$?
skip=()
if [[ "$cluster" == local ]]; then
  # The local cluster has one node: the zombie scenario needs one to freeze and one to run on.
  echo "note: the zombie scenario (j) needs two nodes and runs on kind only: skipped on the local cluster" >&2
  skip=(--skip j_a_frozen_runtime)
fi
cargo test -p weir-e2e --test scenarios --locked -- --ignored --test-threads=1 "${skip[@]}" || status=$?
echo "e2e scenarios on $cluster took $(( $(date +%s) - start ))s (images and cluster bring-up included)" >&2
exit "$status"
