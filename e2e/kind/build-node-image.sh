#!/usr/bin/env bash
# Builds a kind node image for Kubernetes $K8S_VERSION without any image registry, into a
# rootfs archive cached outside the clone ($WEIR_CACHE/kind/node-<version>-<inputs hash>.tar):
#
#   - a Debian 12 root filesystem from mmdebstrap (systemd 252 still runs on cgroup v1) with
#     containerd, runc and the CNI plugins from Debian, as kind's base image has them;
#   - kind's own node files (entrypoint, /kind/bin, the kubelet unit and drop-ins) from the kind
#     Go module, the source kind builds its base image from;
#   - kubeadm, kubelet and kubectl built from the Kubernetes Go modules (e2e/tools/build-k8s.sh);
#   - the control-plane, kube-proxy, etcd, CoreDNS and pause images built from those binaries
#     (e2e/tools/build-image.sh), tagged as `kubeadm config images list` names them, imported at
#     boot by weir-import-images.service;
#   - a fixed bridge CNI config instead of kindnetd, and runc called through
#     runc-without-sys-resource (see e2e/kind/README.md).
#
#   e2e/kind/build-node-image.sh        prints NODE_TAR=<archive> on its last stdout line
#
# e2e/kind/up imports the archive with `docker import` (entrypoint, env and stop signal as
# kind's base image sets them). Env: WEIR_CACHE, K8S_VERSION, KIND_VERSION.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
exec 3>&1 1>&2
log() { echo "[kind-node $(date +%H:%M:%S)] $*" >&2; }
die() { log "error: $*"; exit 1; }

WEIR_CACHE="${WEIR_CACHE:-$HOME/.cache/weir}"
K8S_VERSION="${K8S_VERSION:-v1.35.8}"
KIND_VERSION="${KIND_VERSION:-v0.33.0}"
cache="$WEIR_CACHE/kind"
mkdir -p "$cache"

# Inputs: a change to any of them makes a new archive.
inputs_hash="$( (echo "$K8S_VERSION $KIND_VERSION"; cat "$0" "$here"/node/* "$here/runc-without-sys-resource" \
  "$repo/e2e/tools/build-image.sh" "$repo/e2e/tools/pause/pause.c") | sha256sum | cut -c1-12)"
out="$cache/node-$K8S_VERSION-$inputs_hash.tar"
if [[ -s "$out" ]]; then
  log "node image archive cached: $out"
  echo "NODE_TAR=$out" >&3
  exit 0
fi
start=$(date +%s)

# ---------------------------------------------------------------------------- tools and sources
need=()
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v jq >/dev/null || need+=(jq)
command -v gcc >/dev/null || need+=(gcc libc6-dev)
# kube-proxy's image carries the host's iptables (nft) binary and its modules; a fresh machine
# has none until the local cluster or dockerd installs it, which happens after this build.
[[ -x /usr/sbin/xtables-nft-multi ]] || need+=(iptables)
if [[ ${#need[@]} -gt 0 ]]; then
  log "installing ${need[*]} (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >&2 || die "apt-get install failed"
fi
bin="$(WEIR_CACHE="$WEIR_CACHE" K8S_VERSION="$K8S_VERSION" bash "$repo/e2e/tools/build-k8s.sh" \
  kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubelet kubectl kubeadm etcd coredns |
  sed -n 's/^KUBEBUILDER_ASSETS=//p' | tail -1)"
[[ -x "$bin/kubeadm" ]] || die "kubeadm was not built"
export GOPATH="$WEIR_CACHE/go" GOMODCACHE="$WEIR_CACHE/go/pkg/mod" GOFLAGS=-buildvcs=false GOWORK=off
kind_src="$(cd "$cache" && go mod download -json "sigs.k8s.io/kind@$KIND_VERSION" | jq -r .Dir)"
[[ -f "$kind_src/images/base/files/usr/local/bin/entrypoint" ]] || die "kind $KIND_VERSION sources lack the node entrypoint"

# ---------------------------------------------------------------------------- images
work="$(mktemp -d "${TMPDIR:-/tmp}/kind-node.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/images"
image_ref() { "$bin/kubeadm" config images list --kubernetes-version "$K8S_VERSION" 2>/dev/null | grep "/$1:"; }
etcd_version="$("$bin/etcd" --version | sed -n 's/^etcd Version: //p')"
etcd_ref="registry.k8s.io/etcd:$etcd_version-0"
build() {  # NAME REF BINARY DEST [build-image args...]
  local name="$1" ref="$2" binary="$3" dest="$4"; shift 4
  [[ -n "$ref" ]] || die "kubeadm names no image for $name"
  bash "$repo/e2e/tools/build-image.sh" --name "$ref" --binary "$binary" --dest "$dest" \
    --out "$work/images/$name.tar" "$@" >/dev/null || die "building the $name image failed"
  log "image $ref"
}
# Control-plane components run as root in kubeadm's static pods, as upstream's images allow.
for c in kube-apiserver kube-controller-manager kube-scheduler; do
  build "$c" "$(image_ref "$c")" "$bin/$c" "/usr/local/bin/$c" --user 0:0
done
build etcd "$etcd_ref" "$bin/etcd" /usr/local/bin/etcd --user 0:0
# kube-proxy programs iptables (nft backend, as this host and Debian 12 default to).
xt=/usr/sbin/xtables-nft-multi
[[ -x "$xt" ]] || die "no $xt (apt-get install iptables)"
links=()
for t in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
  links+=(--symlink "/usr/local/bin/$t=/usr/sbin/xtables-nft-multi")
done
xt_ext="$(readlink -f "$(dirname "$(ldd "$xt" | awk '/libxtables/ {print $3}')")/xtables")"   # match/target modules
[[ -d "$xt_ext" ]] || die "no iptables extensions at $xt_ext"
build kube-proxy "$(image_ref kube-proxy)" "$bin/kube-proxy" /usr/local/bin/kube-proxy --user 0:0 \
  --file "$xt:$xt" --file "$xt_ext:$xt_ext" "${links[@]}"
# CoreDNS binds :53: root in its image, as kubeadm's Deployment adds NET_BIND_SERVICE only.
build coredns "$(image_ref coredns)" "$bin/coredns" /coredns --user 0:0
gcc -static -O2 -s -o "$work/pause" "$repo/e2e/tools/pause/pause.c" || die "compiling pause failed"
build pause "$(image_ref pause)" "$work/pause" /pause

# ---------------------------------------------------------------------------- root filesystem
pkgs=systemd,systemd-sysv,dbus,containerd,runc,containernetworking-plugins,iptables,iproute2,conntrack
pkgs+=,ethtool,util-linux,mount,kmod,bash,ca-certificates,procps,jq,libseccomp2,socat,ebtables
base="$work/base"
log "mmdebstrap bookworm (Debian 12) with $pkgs"
mmdebstrap --variant=minbase --include="$pkgs" --dpkgopt='path-exclude=/usr/share/{doc,man,locale}/*' \
  bookworm "$base" http://deb.debian.org/debian >&2 || die "mmdebstrap failed"

log "node files"
f="$kind_src/images/base/files"
install -D -m 0755 "$f/usr/local/bin/entrypoint" "$base/usr/local/bin/entrypoint"
mkdir -p "$base/kind/bin" "$base/etc/systemd/system/kubelet.service.d" "$base/etc/kubernetes/manifests" \
  "$base/etc/cni/net.d" "$base/kind/images"
install -m 0755 "$f"/kind/bin/* "$base/kind/bin/"
install -m 0644 "$f/etc/systemd/system/kubelet.service" "$f/etc/systemd/system/kubelet.slice" \
  "$f/etc/systemd/system/undo-mount-hacks.service" "$base/etc/systemd/system/"
install -m 0644 "$f"/etc/systemd/system/kubelet.service.d/* "$base/etc/systemd/system/kubelet.service.d/"
install -m 0644 "$f/etc/crictl.yaml" "$base/etc/crictl.yaml"
install -D -m 0644 "$f/etc/default/kubelet" "$base/etc/default/kubelet"
install -m 0644 "$f"/etc/sysctl.d/* "$base/etc/sysctl.d/"
install -D -m 0644 "$here/node/containerd.toml" "$base/etc/containerd/config.toml"
install -m 0644 "$here/node/10-weir-bridge.conflist" "$base/etc/cni/net.d/"
install -m 0644 "$here/node/weir-import-images.service" "$base/etc/systemd/system/"
install -m 0755 "$here/runc-without-sys-resource" "$base/usr/local/sbin/runc-without-sys-resource"
for b in kubeadm kubelet kubectl; do install -m 0755 "$bin/$b" "$base/usr/bin/$b"; done
cp "$work"/images/*.tar "$base/kind/images/"
echo "$K8S_VERSION" > "$base/kind/version"
# kind's unit trimming: only what a node needs starts.
find "$base/lib/systemd/system/sysinit.target.wants/" -name "systemd-tmpfiles-setup.service" -delete
rm -f "$base"/lib/systemd/system/multi-user.target.wants/* "$base"/etc/systemd/system/*.wants/* \
  "$base"/lib/systemd/system/local-fs.target.wants/* "$base"/lib/systemd/system/sockets.target.wants/*udev* \
  "$base"/lib/systemd/system/sockets.target.wants/*initctl* "$base"/lib/systemd/system/basic.target.wants/*
echo "ReadKMsg=no" >> "$base/etc/systemd/journald.conf"
chroot "$base" systemctl enable kubelet.service containerd.service undo-mount-hacks.service \
  weir-import-images.service >&2
chroot "$base" systemctl mask systemd-binfmt.service >&2
rm -f "$base/etc/machine-id" && touch "$base/etc/machine-id"

log "packing $(du -sh "$base" | cut -f1) into $out"
tar --create --file "$out.tmp" --directory "$base" --numeric-owner --xattrs --sort=name . || die "tar failed"
mv "$out.tmp" "$out"
# Older archives of other inputs go.
find "$cache" -maxdepth 1 -name "node-*.tar" ! -path "$out" -delete
log "built in $(( $(date +%s) - start ))s: $out ($(du -h "$out" | cut -f1))"
echo "NODE_TAR=$out" >&3
