#!/usr/bin/env bash
# Builds images/weir-{runtime,operator}.Dockerfile with Docker and checks that they ship what
# images/build.sh ships for the same commit: the same paths, modes and owners, byte-identical
# files except the binary itself (built in another directory, so its embedded source paths
# differ), the same user, entrypoint, environment and OCI labels. The binary must run as
# 65532 and print its usage.
#
#   images/check-dockerfiles.sh [--builder IMAGE]
#
#   --builder   the Dockerfiles' build image (their BUILD_IMAGE argument). Default: the
#               official docker.io/library/rust:1-bookworm when a registry answers, else a
#               stand-in made here without one, weir.local/rust:1-bookworm: Debian 12 from
#               mmdebstrap (with the updates and security suites, as Debian's image has them)
#               with the packages of buildpack-deps:bookworm the build uses, and this
#               host's stable Rust toolchain laid out as the official image has it
#               (RUSTUP_HOME=/usr/local/rustup, CARGO_HOME=/usr/local/cargo). Cached in Docker.
#
# Needs the network to Debian's mirror and crates.io (the Dockerfiles run apt-get and cargo).
# Starts dockerd like e2e/kind/up when none runs (e2e/kind/down stops it). Prints one line per
# image: `DOCKERFILE=<file> IMAGE=<ref> BUILD_SECONDS=<s> FILES=<n> BINARY_BYTES=<docker>/<build.sh>
# SAME=yes`; exits non-zero with the differences otherwise. Not part of .ci/run (two cold release
# builds in Docker take about 11 minutes here); see images/README.md for the last run's figures.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
# shellcheck source=../e2e/kind/lib.sh
source e2e/kind/lib.sh
log() { echo "[check-dockerfiles $(date +%H:%M:%S)] $*" >&2; }
die() { log "error: $*"; exit 1; }

builder=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --builder) builder="${2:?--builder needs an image}"; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
ensure_dockerd
work="$(mktemp -d "${TMPDIR:-/tmp}/check-dockerfiles.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# ---------------------------------------------------------------------------- the build image
standin=weir.local/rust:1-bookworm
if [[ -z "$builder" ]]; then
  if timeout 60 docker pull -q docker.io/library/rust:1-bookworm >/dev/null 2>&1; then
    builder=docker.io/library/rust:1-bookworm
  else
    builder="$standin"
  fi
fi
if [[ "$builder" == "$standin" ]] && ! docker image inspect "$standin" >/dev/null 2>&1; then
  command -v mmdebstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq --no-install-recommends mmdebstrap >&2; }
  toolchain="$(rustc --print sysroot)"
  log "no registry: making $standin from Debian 12 and the toolchain $(rustc --version)"
  root="$work/builder"
  # What buildpack-deps:bookworm (rust:1-bookworm's base) has that a Rust build needs.
  mmdebstrap --variant=minbase --include=ca-certificates,curl,gcc,g++,libc6-dev,make,git,xz-utils \
    --dpkgopt='path-exclude=/usr/share/{doc,man,locale}/*' bookworm "$root" \
    "deb http://deb.debian.org/debian bookworm main" "deb http://deb.debian.org/debian bookworm-updates main" \
    "deb http://deb.debian.org/debian-security bookworm-security main" >&2 \
    || die "mmdebstrap failed"
  # This host's TLS trust: where egress goes through an intercepting proxy, its CA is in
  # /usr/local/share/ca-certificates and cargo in the build would not reach crates.io without it.
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
  chroot "$root" update-ca-certificates >&2 || die "update-ca-certificates in the stand-in failed"
  mkdir -p "$root/usr/local/rustup/toolchains" "$root/usr/local/cargo/bin"
  tc="$root/usr/local/rustup/toolchains/$(basename "$toolchain")"
  cp -a "$toolchain" "$tc"
  rm -rf "$tc/share/doc" "$tc/lib/rustlib/src"
  for b in cargo rustc rustdoc; do ln -s "../../rustup/toolchains/$(basename "$toolchain")/bin/$b" "$root/usr/local/cargo/bin/$b"; done
  tar -C "$root" --numeric-owner -c . | docker import \
    --change 'ENV RUSTUP_HOME=/usr/local/rustup' --change 'ENV CARGO_HOME=/usr/local/cargo' \
    --change 'ENV PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    - "$standin" >/dev/null || die "docker import of the stand-in failed"
  rm -rf "$root"
fi
log "build image: $builder"

# ---------------------------------------------------------------------------- the reference
line_of() { grep "^IMAGE=.*/$1:" "$work/build.out" | tail -1; }
field() { sed -n "s/.* $2=\([^ ]*\).*/\1/p" <<<" $1"; }
log "images/build.sh (the reference)"
bash images/build.sh --out "$work/ref" > "$work/build.out" || die "images/build.sh failed"
revision="$(git rev-parse HEAD)"
git diff --quiet HEAD || revision="$revision-dirty"
epoch="$(git log -1 --format=%ct)"

# Lists a root filesystem directory as `type mode uid:gid path [sha256]`, the binary's hash
# left out (its size is compared, and it is run).
listing() {  # DIR BINARY_PATH
  (cd "$1" && find . -mindepth 1 | LC_ALL=C sort | while read -r p; do
    if [[ -L "$p" ]]; then echo "l $(stat -c '%a %u:%g' "$p") ${p#.} -> $(readlink "$p")"
    elif [[ -d "$p" ]]; then echo "d $(stat -c '%a %u:%g' "$p") ${p#.}"
    elif [[ "${p#.}" == "$2" ]]; then echo "f $(stat -c '%a %u:%g' "$p") ${p#.} (the binary)"
    else echo "f $(stat -c '%a %u:%g' "$p") ${p#.} $(sha256sum < "$p" | cut -c1-16)"
    fi
  done)
}
unpack_oci() {  # ARCHIVE DIR: the single layer of images/build.sh's archive, and its config
  local a="$1" d="$2" m c l
  mkdir -p "$d/oci" "$d/root"
  tar -xf "$a" -C "$d/oci"
  m="$(jq -r '.manifests[0].digest' "$d/oci/index.json" | sed 's/sha256://')"
  c="$(jq -r '.config.digest' "$d/oci/blobs/sha256/$m" | sed 's/sha256://')"
  l="$(jq -r '.layers[0].digest' "$d/oci/blobs/sha256/$m" | sed 's/sha256://')"
  tar -xzf "$d/oci/blobs/sha256/$l" -C "$d/root" --numeric-owner --same-owner
  jq -S '{User: .config.User, Entrypoint: .config.Entrypoint, Env: .config.Env, Labels: .config.Labels}' \
    "$d/oci/blobs/sha256/$c" > "$d/config.json"
}

# Which Debian package a file of the image comes from, and that package's version here and in
# the Dockerfile's build stage (its own image, as `docker build --target build` tags it).
package_of() {
  case "$1" in
    /etc/ssl/certs/ca-certificates.crt) echo ca-certificates ;;
    *) { dpkg -S "$1" 2>/dev/null || dpkg -S "/usr$1" 2>/dev/null; } | head -1 | cut -d: -f1 ;;
  esac
}
version_here() { dpkg-query -W -f '${Version}' "$1" 2>/dev/null; }
version_in_build_stage() { awk -v p="$1" '$1 == p {print $2}' "$d/build-stage-packages"; }
strip_hash() { sed 's/ [0-9a-f]\{16\}$//' "$1"; }
failed=0 explained=0
for name in weir-runtime weir-operator; do
  ref_line="$(line_of "$name")"
  [[ -n "$ref_line" ]] || die "images/build.sh printed no line for $name"
  d="$work/$name"
  unpack_oci "$(field "$ref_line" ARCHIVE)" "$d/ref"
  image="weir.local/$name:dockerfile"
  log "docker build -f images/$name.Dockerfile (build image $builder)"
  t0=$(date +%s)
  args=(--network host -f "images/$name.Dockerfile" --build-arg "BUILD_IMAGE=$builder"
    --build-arg "REVISION=$revision" --build-arg "SOURCE_DATE_EPOCH=$epoch")
  docker build "${args[@]}" -t "$image" . > "$d/docker-build.log" 2>&1 \
    || { tail -30 "$d/docker-build.log" >&2; die "docker build of $name failed (log above)"; }
  seconds=$(( $(date +%s) - t0 ))
  # The build stage's packages, from its layers that the build above cached.
  docker build "${args[@]}" --target build -t "$image-build-stage" . > "$d/docker-build-stage.log" 2>&1 \
    || { tail -30 "$d/docker-build-stage.log" >&2; die "tagging the build stage of $name failed"; }
  docker run --rm --entrypoint dpkg-query "$image-build-stage" -W -f '${Package} ${Version}\n' \
    | sed 's/:amd64 / /' > "$d/build-stage-packages"
  # The image's own layers (docker save), not a container's file system (docker export adds
  # /etc/hosts, /etc/mtab and the like).
  mkdir -p "$d/docker/saved" "$d/docker/root"
  docker save "$image" | tar -x -C "$d/docker/saved"
  for layer in $(jq -r '.[0].Layers[]' "$d/docker/saved/manifest.json"); do
    tar -xf "$d/docker/saved/$layer" -C "$d/docker/root" --numeric-owner --same-owner
  done
  docker image inspect "$image" | jq -S '.[0].Config | {User, Entrypoint, Env, Labels}' > "$d/docker/config.json"
  binary="/usr/local/bin/$name"
  listing "$d/ref/root" "$binary" > "$d/ref/files"
  listing "$d/docker/root" "$binary" > "$d/docker/files"
  same=yes
  # Paths, types, modes and owners must match exactly. A file's bytes may differ only when it
  # comes from a Debian package at another version in the build image than here (the shared
  # libraries and CA certificates come from each route's build environment).
  if ! diff -u <(strip_hash "$d/ref/files") <(strip_hash "$d/docker/files") >&2; then
    same=no; log "$name: the file lists differ (above: - build.sh, + Dockerfile)"
  fi
  while read -r path; do
    package="$(package_of "$path")"
    here="$(version_here "$package")" there="$(version_in_build_stage "$package")"
    if [[ -n "$package" && "$here" != "$there" ]]; then
      log "$name: $path differs: Debian package $package is $here here, $there in the build stage"
      explained=$((explained + 1))
    else
      same=no; log "$name: $path differs, and not by a package version (${package:-no package}: $here / $there)"
    fi
  done < <(LC_ALL=C join -j1 <(awk '/^f / && NF == 5 {print $4, $5}' "$d/ref/files") \
                    <(awk '/^f / && NF == 5 {print $4, $5}' "$d/docker/files") | awk '$2 != $3 {print $1}')
  # The labels' source and version come from Chart.yaml and Cargo.toml in build.sh and from the
  # Dockerfile's defaults; they must agree.
  if ! diff -u "$d/ref/config.json" "$d/docker/config.json" >&2; then same=no; log "$name: the image configs differ"; fi
  # The binary: built from the same sources, lock file and profile; its bytes differ by the
  # build directory and registry paths embedded in it, so its size must agree within 1%.
  sizes="$(stat -c %s "$d/docker/root$binary")/$(stat -c %s "$d/ref/root$binary")"
  awk -F/ '{ d = $1 - $2; if (d < 0) d = -d; exit !(d * 100 < $2) }' <<<"$sizes" \
    || { same=no; log "$name: the binaries' sizes (Dockerfile/build.sh) differ by 1% or more: $sizes"; }
  usage="$(docker run --rm "$image" --help 2>&1 | head -3 || true)"
  uid="$(docker image inspect -f '{{.Config.User}}' "$image")"
  [[ "$uid" == 65532:65532 ]] || { same=no; log "$name: runs as '$uid', not 65532:65532"; }
  grep -qi "usage" <<<"$usage" || { same=no; log "$name: --help printed no usage: $usage"; }
  [[ "$same" == yes ]] || failed=1
  echo "DOCKERFILE=images/$name.Dockerfile IMAGE=$image BUILD_SECONDS=$seconds FILES=$(wc -l < "$d/ref/files") BINARY_BYTES=$sizes SAME=$same"
  echo "  (files whose bytes differ by a Debian package version so far: $explained)"
done
[[ "$failed" == 0 ]] || die "the Dockerfiles' images differ from images/build.sh's (see above)"
