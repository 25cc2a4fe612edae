#!/usr/bin/env bash
# Builds Weir's release images, weir-runtime and weir-operator, without Docker or a registry:
# binaries of the `dist` profile (release, with startup code optimized for size), stripped, each in a single-layer OCI image archive made by
# e2e/tools/build-image.sh (non-root user 65532, CA certificates, the binary's shared libraries
# and nothing else), labelled with the OCI source, version and revision. Reproducible: the
# same commit gives byte-identical archives (fixed mtimes from the commit's time, sorted
# entries, gzip -n). `images/*.Dockerfile` build the same root filesystems with Docker.
#
#   images/build.sh [--registry REG] [--tag TAG] [--out DIR] [--profile dist|release|dev]
#
#   --registry   image name prefix (default weir.local): REG/weir-runtime, REG/weir-operator
#   --tag        image tag (default: the workspace version from Cargo.toml)
#   --out        where the archives go (default $WEIR_CACHE/images)
#   --profile    cargo profile (default dist, see Cargo.toml; `dev` is for quick local iterations)
#
# stdout: one line per image, `IMAGE=<ref> ARCHIVE=<file> DIGEST=<digest> UNPACKED=<bytes>
# SIZE=<archive bytes>`. Fails when the runtime image unpacks to 48 MiB or more (its budget; RocksDB
# and its C++ and compression libraries are 15 MB of it).
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "[images] $*" >&2; }
die() { log "error: $*"; exit 1; }

registry="weir.local" tag="" profile="dist"
out="${WEIR_CACHE:-$HOME/.cache/weir}/images"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --registry) registry="${2:?}"; shift 2 ;;
    --tag) tag="${2:?}"; shift 2 ;;
    --out) out="${2:?}"; shift 2 ;;
    --profile) profile="${2:?}"; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
case "$profile" in dist | release) dir="$profile" ;; dev) dir=debug ;; *) die "--profile dist, release or dev" ;; esac

version="$(sed -n '/^\[workspace.package\]/,/^\[/ s/^version = "\(.*\)"/\1/p' Cargo.toml)"
[[ -n "$version" ]] || die "no version in Cargo.toml [workspace.package]"
tag="${tag:-$version}"
revision="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
git diff --quiet HEAD 2>/dev/null || revision="$revision-dirty"
source_url="$(sed -n 's/^home: //p' charts/weir-operator/Chart.yaml)"
# Reproducible: every timestamp in the archive is the commit's.
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}"

target="${CARGO_TARGET_DIR:-target}"
t0=$(date +%s)
# One package at a time, as each Dockerfile builds it: built together, cargo unifies their
# dependencies' features and the runtime binary grows by about 1 MB of the operator's needs.
for package in weir-runtime weir-operator; do
  log "cargo build --profile $profile -p $package"
  cargo build --profile "$profile" --locked -p "$package" >&2 || die "cargo build of $package failed"
done
log "built in $(( $(date +%s) - t0 ))s"
mkdir -p "$out"

for name in weir-runtime weir-operator; do
  stripped="$out/$name.$profile.stripped"
  objcopy --strip-all "$target/$dir/$name" "$stripped"
  line="$(bash e2e/tools/build-image.sh --name "$registry/$name:$tag" --binary "$stripped" \
    --dest "/usr/local/bin/$name" --ca-certs --out "$out/$name-$tag.tar" \
    --label "org.opencontainers.image.title=$name" \
    --label "org.opencontainers.image.source=$source_url" \
    --label "org.opencontainers.image.version=$version" \
    --label "org.opencontainers.image.revision=$revision" \
    --label "org.opencontainers.image.licenses=Apache-2.0" | tail -1)"
  echo "$line SIZE=$(stat -c %s "$out/$name-$tag.tar")"
  unpacked="${line##*UNPACKED=}"
  if [[ "$name" == weir-runtime && "$profile" != dev ]] && (( unpacked >= 48 * 1024 * 1024 )); then
    die "the runtime image unpacks to $unpacked bytes: over its 48 MiB budget"
  fi
done
log "done in $(( $(date +%s) - t0 ))s"
