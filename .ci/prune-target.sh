#!/usr/bin/env bash
# Removes, from the shared target directory, the artifacts of this workspace's own crates and
# test binaries that earlier clones left there. Every clone builds them anew (their hashes
# include the clone's path), so old ones only fill the disk (2-3 GB per run); the
# dependencies' artifacts, the cache that makes reruns fast, stay. Artifacts touched in the
# last 30 minutes stay too.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:?CARGO_TARGET_DIR must be set}"
[ -d "$target" ] || exit 0
if ! command -v python3 >/dev/null; then
  echo "prune-target: no python3, nothing pruned" >&2
  exit 0
fi
# The workspace's target names as rustc writes them (lib names, tests, benches, bins: - → _).
names="$(cargo metadata --no-deps --format-version 1 --offline 2>/dev/null | python3 -c '
import json, sys
meta = json.load(sys.stdin)
names = {t["name"].replace("-", "_") for p in meta["packages"] for t in p["targets"]}
names |= {p["name"] for p in meta["packages"]}
print("\n".join(sorted(names)))')" || { echo "prune-target: cargo metadata failed, nothing pruned" >&2; exit 0; }
before="$(du -sm "$target" | cut -f1)"
for profile in "$target"/*/; do
  for name in $names; do
    find "$profile"deps "$profile"incremental "$profile"build "$profile".fingerprint -maxdepth 1 -mmin +30 \
      \( -name "$name-*" -o -name "lib$name-*" \) -exec rm -rf {} + 2>/dev/null || true
  done
done
echo "prune-target: $target from ${before} MB to $(du -sm "$target" | cut -f1) MB" >&2
