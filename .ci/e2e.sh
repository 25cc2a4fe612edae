#!/usr/bin/env bash
# The end-to-end scenario suite on a real single-node cluster (e2e/local/up): builds the
# runtime image from the debug binary `cargo test --workspace` built, brings the cluster up with
# it, runs the scenarios (the operator runs out of cluster, as a process of the suite), and
# tears the cluster down again, whatever happened.
set -euo pipefail
cd "$(dirname "$0")/.."
export WEIR_CACHE="${WEIR_CACHE:-$HOME/.cache/weir}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$WEIR_CACHE/target}"
images="$WEIR_CACHE/images"
mkdir -p "$images"
start=$(date +%s)

# The debug runtime without its debug info: a quarter of the size to import.
cargo build -p weir-runtime -p weir-operator --locked >&2
objcopy --strip-debug "$CARGO_TARGET_DIR/debug/weir-runtime" "$images/weir-runtime.stripped"
bash e2e/tools/build-image.sh --name weir.local/weir-runtime:dev --binary "$images/weir-runtime.stripped" \
  --dest /usr/local/bin/weir-runtime --out "$images/weir-runtime.tar" --no-compress >&2

cleanup() { e2e/local/down >&2 || true; }
trap cleanup EXIT
eval "$(e2e/local/up --image "$images/weir-runtime.tar")"
echo "cluster up after $(( $(date +%s) - start ))s" >&2

status=0
cargo test -p weir-e2e --test scenarios --locked -- --ignored --test-threads=1 || status=$?
echo "e2e scenarios took $(( $(date +%s) - start ))s (cluster bring-up included)" >&2
exit "$status"
