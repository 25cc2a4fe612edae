#!/usr/bin/env bash
# The README's first command, exactly as written there, as a user runs it: it must build
# without any system library (no RocksDB, no librdkafka, no C++ runtime:
# `--no-default-features`), run the example job to its end and publish its output. The
# runtime it built must refuse a job that asks for the backend it leaves out, naming the field.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
start=$(date +%s)
cmd=$(grep -m1 '^cargo run --release -p weir-runtime --no-default-features -- run ' README.md || true)
if [ -z "$cmd" ]; then
  echo "readme-run: README.md has no 'cargo run --release -p weir-runtime --no-default-features -- run' line" >&2
  exit 1
fi
# The job writes ./.weir/ under the directory it runs in: a scratch directory inside the
# workspace (cargo finds the workspace from there), so that a checkout's own .weir/ (a
# developer's earlier run) is neither reused nor touched.
mkdir -p .weir
scratch=$(mktemp -d "$root/.weir/readme-run.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/examples"
cp examples/*.yaml "$scratch/examples/"
echo "readme-run: $cmd"
(cd "$scratch" && eval "$cmd")
if [ ! -d "$scratch/.weir" ]; then
  echo "readme-run: the job wrote nothing under ./.weir" >&2
  exit 1
fi
parts=$(find "$scratch/.weir" -path '*/output/*' -name 'part-*' -type f | wc -l)
records=$(find "$scratch/.weir" -path '*/output/*' -name 'part-*' -type f -exec cat {} + | wc -l)
if [ "$parts" -eq 0 ] || [ "$records" -eq 0 ]; then
  echo "readme-run: the job published nothing ($parts part files, $records records)" >&2
  exit 1
fi
bin="${CARGO_TARGET_DIR:-$root/target}/release/weir-runtime"
if [ ! -x "$bin" ]; then
  echo "readme-run: no runtime binary at $bin" >&2
  exit 1
fi
if ldd "$bin" | grep -E 'librocksdb|librdkafka|libstdc\+\+'; then
  echo "readme-run: the README's runtime links a system library it must not need" >&2
  exit 1
fi
# The same build refuses the rocksdb backend, naming the field; `validate` warns of it.
sed 's/^checkpointing:/stateBackend: rocksdb\ncheckpointing:/' examples/wordcount.yaml > "$scratch/rocksdb.yaml"
warned=$("$bin" validate "$scratch/rocksdb.yaml" 2>&1)
if ! grep -q 'warning: .*this build cannot run the job: stateBackend: .*`rocksdb` feature' <<<"$warned"; then
  echo "readme-run: validate does not warn that this build cannot run a rocksdb job:" >&2
  echo "$warned" >&2
  exit 1
fi
if refused=$(cd "$scratch" && "$bin" run rocksdb.yaml --fresh 2>&1); then
  echo "readme-run: a job with stateBackend: rocksdb ran on a runtime built without the backend" >&2
  exit 1
fi
if ! grep -q 'stateBackend: this weir-runtime was built without its `rocksdb` feature' <<<"$refused"; then
  echo "readme-run: the refusal does not name the field and the feature:" >&2
  echo "$refused" >&2
  exit 1
fi
echo "readme-run: built, ran and published $records records in $parts files; refused stateBackend: rocksdb ($(( $(date +%s) - start ))s)"
