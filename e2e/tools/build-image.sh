#!/usr/bin/env bash
# Builds a single-layer OCI image archive (a tar in OCI image layout) from a local binary,
# without docker, buildah or a registry. `ctr -n k8s.io images import FILE` (and so
# e2e/local/up --image FILE) loads it under the given name.
#
#   e2e/tools/build-image.sh --name weir.local/weir-runtime:dev \
#       --binary /root/.cache/weir/target/debug/weir-runtime --out /tmp/weir-runtime.tar
#
# Options:
#   --name REF[:TAG]     image name (required); TAG defaults to "latest"
#   --binary PATH        the entrypoint binary (required); its shared libraries (ldd) and the
#                        dynamic loader go in at the paths ldd prints
#   --dest PATH          where the binary goes in the image (default /usr/local/bin/BASENAME)
#   --out FILE           the archive to write (default ./NAME_TAG.tar)
#   --file SRC[:DEST]    also copy a file or directory (repeatable; DEST defaults to SRC);
#                        shared libraries of copied executables are added too
#   --symlink LINK=TARGET  also create a symlink (repeatable), e.g. --symlink /bin/sh=busybox
#   --cmd ARG            append ARG to the image's Cmd (repeatable)
#   --env KEY=VALUE      add to the image's Env (repeatable)
#   --ca-certs           include the host's /etc/ssl/certs/ca-certificates.crt (TLS clients)
#   --user UID[:GID]     image User (default 65532:65532, the "nonroot" user)
#   --label KEY=VALUE    add to the image's Labels (repeatable), e.g. the OCI annotations
#                        org.opencontainers.image.{source,version,revision}
#   --no-compress        uncompressed layer (faster for big debug binaries, bigger archive)
#   --rootfs-only DIR    write only the image's root filesystem to DIR (no archive): a
#                        Dockerfile's build stage uses it, so both routes ship the same files
#
# The image holds: the binary, its libraries, /etc/passwd + /etc/group (root, nonroot 65532,
# nobody), /etc/nsswitch.conf, /tmp (1777), /home/nonroot (owned by 65532 when run as root).
# Output is reproducible for the same inputs: sorted entries, fixed mtimes
# (SOURCE_DATE_EPOCH, default 0), numeric owners, gzip -n. The last stdout line is
# `IMAGE=<name> ARCHIVE=<file> DIGEST=<manifest digest> UNPACKED=<bytes of the layer unpacked>`;
# progress goes to stderr.
set -euo pipefail

log() { echo "[build-image] $*" >&2; }
die() { log "error: $*"; exit 1; }

name="" binary="" dest="" out="" user="65532:65532" compress=1 ca_certs=0 rootfs_only=""
files=() links=() cmd=() envs=() labels=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="${2:?--name needs a value}"; shift 2 ;;
    --binary) binary="${2:?--binary needs a value}"; shift 2 ;;
    --dest) dest="${2:?--dest needs a value}"; shift 2 ;;
    --out) out="${2:?--out needs a value}"; shift 2 ;;
    --file) files+=("${2:?--file needs a value}"); shift 2 ;;
    --symlink) links+=("${2:?--symlink needs a value}"); shift 2 ;;
    --cmd) cmd+=("${2?--cmd needs a value}"); shift 2 ;;
    --env) envs+=("${2:?--env needs a value}"); shift 2 ;;
    --user) user="${2:?--user needs a value}"; shift 2 ;;
    --label) labels+=("${2:?--label needs a value}"); shift 2 ;;
    --rootfs-only) rootfs_only="${2:?--rootfs-only needs a value}"; shift 2 ;;
    --ca-certs) ca_certs=1; shift ;;
    --no-compress) compress=0; shift ;;
    -h|--help) sed -n '2,34p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ -n "$name" || -n "$rootfs_only" ]] || die "--name is required"
for l in ${labels[@]+"${labels[@]}"}; do [[ "$l" == ?*=* ]] || die "--label wants KEY=VALUE, got '$l'"; done
[[ -n "$binary" ]] || die "--binary is required"
[[ -f "$binary" && -x "$binary" ]] || die "'$binary' is not an executable file"
for tool in tar sha256sum gzip ldd; do command -v "$tool" >/dev/null || die "'$tool' is needed"; done

# A reference without a tag gets ":latest"; a ':' followed by a '/' belongs to a registry port.
last="${name##*/}"
[[ "$last" == *:* || "$last" == *@* ]] || name="$name:latest"
[[ -n "$dest" ]] || dest="/usr/local/bin/$(basename "$binary")"
[[ "$dest" == /* ]] || die "--dest must be absolute"
if [[ -z "$out" ]]; then out="$(echo "$name" | tr '/:@' '___').tar"; fi

case "$(uname -m)" in
  x86_64) arch=amd64 ;;
  aarch64) arch=arm64 ;;
  *) arch="$(uname -m)" ;;
esac
epoch="${SOURCE_DATE_EPOCH:-0}"
created="$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)"

work="$(mktemp -d "${TMPDIR:-/tmp}/build-image.XXXXXX")"
trap 'rm -rf "$work"' EXIT
root="$work/rootfs"
mkdir -p "$root" "$work/blobs/sha256"

# Copies SRC (dereferenced) to DEST inside the rootfs, keeping the mode.
put() {
  local src="$1" dst="$2"
  mkdir -p "$root$(dirname "$dst")"
  if [[ -d "$src" ]]; then
    mkdir -p "$root$dst"
    cp -a -L "$src/." "$root$dst/"
  else
    cp -L --preserve=mode "$src" "$root$dst"
  fi
}

# Adds the shared libraries of an ELF file (and the loader) at the paths ldd resolves them to.
# ldd lines: "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x..)", "/lib64/ld-linux-x86-64.so.2
# (0x..)", "linux-vdso.so.1 (0x..)" (in the kernel: skipped), "not a dynamic executable".
add_libs() {
  local f="$1" out line lib
  out="$(ldd "$f" 2>&1)" || return 0      # static binaries, scripts: nothing to add
  while IFS= read -r line; do
    lib=""
    if [[ "$line" =~ =\>\ (/[^ ]+)\ \( ]]; then lib="${BASH_REMATCH[1]}"
    elif [[ "$line" =~ ^[[:space:]]*(/[^ ]+)\ \( ]]; then lib="${BASH_REMATCH[1]}"
    elif [[ "$line" == *"not found"* ]]; then die "ldd $f: $line"
    fi
    [[ -n "$lib" && ! -e "$root$lib" ]] || continue
    put "$lib" "$lib"
    log "  + $lib"
  done <<<"$out"
}

log "image $name: $binary -> $dest"
put "$binary" "$dest"
chmod 0755 "$root$dest"
add_libs "$binary"
for spec in ${files[@]+"${files[@]}"}; do
  src="${spec%%:*}"; dst="${spec#*:}"
  [[ "$spec" == *:* ]] || dst="$src"
  [[ -e "$src" ]] || die "--file: '$src' does not exist"
  [[ "$dst" == /* ]] || die "--file: destination '$dst' must be absolute"
  put "$src" "$dst"
  log "  + $dst (from $src)"
  if [[ -f "$src" && -x "$src" ]]; then add_libs "$src"; fi
  # A directory of plugins (iptables' match modules): their libraries too (libxt_statistic
  # needs libm, which the binary itself does not).
  if [[ -d "$src" ]]; then
    while IFS= read -r -d '' plugin; do
      [[ "$(head -c4 "$plugin" | od -An -c | tr -d ' ')" == '177ELF' ]] && add_libs "$plugin"
    done < <(find "$src" -type f -print0)
  fi
done
for spec in ${links[@]+"${links[@]}"}; do
  link="${spec%%=*}"; target="${spec#*=}"
  [[ "$spec" == *=* && "$link" == /* ]] || die "--symlink wants /LINK=TARGET, got '$spec'"
  mkdir -p "$root$(dirname "$link")"
  ln -sfn "$target" "$root$link"
done
if (( ca_certs )); then
  [[ -f /etc/ssl/certs/ca-certificates.crt ]] || die "--ca-certs: no /etc/ssl/certs/ca-certificates.crt (apt-get install ca-certificates)"
  put /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
fi

# The minimal system files: users, groups, name service order, scratch and home directories.
mkdir -p "$root/etc" "$root/tmp" "$root/home/nonroot"
[[ -e "$root/etc/passwd" ]] || cat > "$root/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin
nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin
EOF
[[ -e "$root/etc/group" ]] || cat > "$root/etc/group" <<'EOF'
root:x:0:
nogroup:x:65534:
nonroot:x:65532:
EOF
[[ -e "$root/etc/nsswitch.conf" ]] || printf 'passwd: files\ngroup: files\nhosts: files dns\n' > "$root/etc/nsswitch.conf"
chmod 0644 "$root/etc/passwd" "$root/etc/group" "$root/etc/nsswitch.conf"
chmod 1777 "$root/tmp"
chmod 0755 "$root" "$root/etc" "$root/home"
if [[ "$(id -u)" == 0 ]]; then
  chown -R 0:0 "$root"
  chown 65532:65532 "$root/home/nonroot"
  chmod 0750 "$root/home/nonroot"
else
  chmod 1777 "$root/home/nonroot"   # cannot chown: make it writable for the image user
fi
# Every directory the copies created gets the usual mode, whatever umask said.
find "$root" -type d ! -path "$root/tmp" ! -path "$root/home/nonroot" -exec chmod 0755 {} +

if [[ -n "$rootfs_only" ]]; then
  mkdir -p "$rootfs_only"
  cp -a "$root/." "$rootfs_only/"
  log "wrote the root filesystem to $rootfs_only ($(find "$root" | wc -l) paths)"
  exit 0
fi

# The layer: a reproducible tar of the rootfs.
layer_tar="$work/layer.tar"
tar --create --file "$layer_tar" --directory "$root" --sort=name --numeric-owner \
  --mtime="@$epoch" --format=posix \
  --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime .
diff_id="$(sha256sum "$layer_tar" | cut -d' ' -f1)"
layer_raw_size="$(stat -c %s "$layer_tar")"
if (( compress )); then
  gzip -n -6 "$layer_tar"
  layer_file="$layer_tar.gz"
  layer_type="application/vnd.oci.image.layer.v1.tar+gzip"
else
  layer_file="$layer_tar"
  layer_type="application/vnd.oci.image.layer.v1.tar"
fi
layer_digest="$(sha256sum "$layer_file" | cut -d' ' -f1)"
layer_size="$(stat -c %s "$layer_file")"
mv "$layer_file" "$work/blobs/sha256/$layer_digest"

# JSON string escaping for the few strings we write (\, ", control characters).
jstr() {
  local s="$1"
  s="${s//\\/\\\\}"; s="${s//\"/\\\"}"
  s="${s//$'\n'/\\n}"; s="${s//$'\t'/\\t}"; s="${s//$'\r'/\\r}"
  printf '"%s"' "$s"
}
jarr() {
  local first=1 x
  printf '['
  for x in "$@"; do (( first )) || printf ','; first=0; jstr "$x"; done
  printf ']'
}

# Stores CONTENT as a blob; sets blob_digest and blob_size. (Synchronous on purpose: a
# `read < <(... | blob)` returns before the subshell has moved its file.)
blob() {
  local tmp="$work/blob.tmp"
  printf '%s' "$1" > "$tmp"
  blob_digest="$(sha256sum "$tmp" | cut -d' ' -f1)"
  blob_size="$(stat -c %s "$tmp")"
  mv "$tmp" "$work/blobs/sha256/$blob_digest"
}

env_list=("PATH=/usr/local/bin:/usr/bin:/bin" "HOME=/home/nonroot" ${envs[@]+"${envs[@]}"})
config="$(
  printf '{"created":"%s","architecture":"%s","os":"linux",' "$created" "$arch"
  printf '"config":{"User":%s,"Env":%s,"Entrypoint":%s,' "$(jstr "$user")" "$(jarr "${env_list[@]}")" "$(jarr "$dest")"
  if [[ ${#cmd[@]} -gt 0 ]]; then printf '"Cmd":%s,' "$(jarr "${cmd[@]}")"; fi
  printf '"WorkingDir":"/","Labels":{"org.opencontainers.image.title":%s' "$(jstr "$name")"
  for l in ${labels[@]+"${labels[@]}"}; do printf ',%s:%s' "$(jstr "${l%%=*}")" "$(jstr "${l#*=}")"; done
  printf '}},'
  printf '"rootfs":{"type":"layers","diff_ids":["sha256:%s"]},' "$diff_id"
  printf '"history":[{"created":"%s","created_by":"e2e/tools/build-image.sh"}]}' "$created"
)"
blob "$config"
config_digest="$blob_digest" config_size="$blob_size"

manifest="$(
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",'
  printf '"config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},' "$config_digest" "$config_size"
  printf '"layers":[{"mediaType":"%s","digest":"sha256:%s","size":%s}]}' "$layer_type" "$layer_digest" "$layer_size"
)"
blob "$manifest"
manifest_digest="$blob_digest" manifest_size="$blob_size"

# index.json names the image twice: containerd reads io.containerd.image.name (the full
# reference); the OCI annotation is the tag, as `skopeo`/`oci` layouts use it.
tag="${name##*:}"
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"platform":{"architecture":"%s","os":"linux"},"annotations":{"io.containerd.image.name":%s,"org.opencontainers.image.ref.name":%s}}]}' \
  "$manifest_digest" "$manifest_size" "$arch" "$(jstr "$name")" "$(jstr "$tag")" > "$work/index.json"
printf '{"imageLayoutVersion":"1.0.0"}' > "$work/oci-layout"

mkdir -p "$(dirname "$out")"
tar --create --file "$out.tmp" --directory "$work" --sort=name --owner=0 --group=0 --numeric-owner \
  --mtime="@$epoch" --format=posix \
  --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
  oci-layout index.json blobs
mv -f "$out.tmp" "$out"
log "wrote $out ($(du -h "$out" | cut -f1); layer $(( layer_size / 1024 )) KiB, $(find "$root" | wc -l) paths)"
echo "IMAGE=$name ARCHIVE=$out DIGEST=sha256:$manifest_digest UNPACKED=$layer_raw_size"
