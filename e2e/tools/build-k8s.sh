#!/usr/bin/env bash
# Builds a real kube-apiserver and etcd from their published Go modules (nothing but the Go
# module proxy is needed) into a cache outside the clone, so reruns are instant:
#
#   $WEIR_CACHE/k8s/$K8S_VERSION/bin/{kube-apiserver,etcd}        always
#   ... kube-controller-manager, kube-scheduler, kubelet, kubectl,
#       kube-proxy, coredns                                          with --all (or by name)
#   ... kubeadm                                                      by name (kind node images)
#
# Usage:  e2e/tools/build-k8s.sh [--all | NAME...]      NAME: kube-apiserver etcd kubectl
#                                                              kube-controller-manager
#                                                              kube-scheduler kubelet
#                                                              kube-proxy kubeadm coredns
# The last line of stdout is `KUBEBUILDER_ASSETS=<bin dir>`; everything else goes to stderr.
# So `eval "$(e2e/tools/build-k8s.sh)"` sets KUBEBUILDER_ASSETS (export it yourself).
#
# Env: WEIR_CACHE (default $HOME/.cache/weir), K8S_VERSION (default below), BUILD_NICE (15),
#      BUILD_JOBS (go build -p; default: the number of CPUs).
# Needs only Go >= 1.21 (kubernetes 1.35 wants Go 1.25; an older Go fetches that toolchain
# from the module proxy by itself, GOTOOLCHAIN=auto). No cgo, no C compiler.
#
# How: k8s.io/kubernetes cannot be built as a dependency as-is, because its go.mod requires
# every k8s.io/* staging module at v0.0.0 and replaces it with ./staging/src/k8s.io/X, and
# replace directives of a dependency are ignored. So we make a throwaway main module that
# requires k8s.io/kubernetes and replaces each staging module with its published twin
# (k8s.io/X v0.35.N for kubernetes v1.35.N); the list is read from kubernetes' own go.mod.
# etcd is built in the same module at the version kubernetes itself pins (go.etcd.io/etcd/
# server/v3, whose root package is etcd's `main`), which avoids etcd's own replace directives.
# CoreDNS (the cluster DNS; its go.mod has no replace directives) is a plain `go install` of
# github.com/coredns/coredns at $COREDNS_VERSION, the version kubeadm 1.35 deploys.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.35.8}"   # newest v1.35.x the Go proxy serves (2026-07)
COREDNS_VERSION="${COREDNS_VERSION:-v1.13.1}"
CACHE="${WEIR_CACHE:-$HOME/.cache/weir}"
NICE="${BUILD_NICE:-15}"
JOBS="${BUILD_JOBS:-$(nproc)}"

exec 3>&1 1>&2   # stdout is only for the final KUBEBUILDER_ASSETS line
log() { echo "[build-k8s] $*" >&2; }
die() { log "error: $*"; exit 1; }

want=(kube-apiserver etcd)
for arg in "$@"; do
  case "$arg" in
    --all) want=(kube-apiserver etcd kubectl kube-controller-manager kube-scheduler kubelet kube-proxy coredns) ;;
    kube-apiserver|etcd|kubectl|kube-controller-manager|kube-scheduler|kubelet|kube-proxy|kubeadm|coredns)
      [[ " ${want[*]} " == *" $arg "* ]] || want+=("$arg") ;;
    -h|--help) sed -n '2,15p' "$0" >&2; exit 0 ;;
    *) die "unknown argument '$arg' (see --help)" ;;
  esac
done

root="$CACHE/k8s/$K8S_VERSION"
bin="$root/bin"
mod="$root/mod"

# One build at a time: two at once (two clones' CI, or a shell beside it) wrote the same
# temporary binaries, and one of them failed on the other's rename.
mkdir -p "$root"
exec 9>"$root/.build.lock"
flock 9

missing=()
for b in "${want[@]}"; do [[ -x "$bin/$b" ]] || missing+=("$b"); done
if [[ ${#missing[@]} -eq 0 ]]; then
  log "all of (${want[*]}) already built in $bin"
  echo "KUBEBUILDER_ASSETS=$bin" >&3
  exit 0
fi

command -v go >/dev/null || die "Go is not installed (need Go >= 1.21; kubernetes 1.35 builds with 1.25+)"
gov="$(go env GOVERSION)"; gov="${gov#go}"
IFS=. read -r gomaj gomin _ <<<"$gov"
(( gomaj > 1 || gomin >= 21 )) || die "Go $gov is too old (need >= 1.21 to fetch the 1.25 toolchain itself)"

# Everything Go writes goes under the cache, so a rerun after `rm -rf bin` is incremental.
export GOPATH="$CACHE/go"
export GOMODCACHE="$GOPATH/pkg/mod"
export GOCACHE="$GOPATH/cache"
export GOFLAGS="-buildvcs=false"
export CGO_ENABLED=0
export GOWORK=off
mkdir -p "$bin" "$mod" "$GOCACHE"
gorun() { nice -n "$NICE" go "$@"; }

start=$(date +%s)
# The tools of the build module; a change of this list re-resolves it.
k8s_tools=(kube-apiserver kubectl kube-controller-manager kube-scheduler kubelet kube-proxy kubeadm)
resolved_stamp="$K8S_VERSION ${k8s_tools[*]}"
if [[ ! -s "$mod/go.sum" ]] || [[ "$(cat "$mod/.resolved" 2>/dev/null)" != "$resolved_stamp" ]]; then
  log "downloading k8s.io/kubernetes@$K8S_VERSION (module proxy)"
  kgomod="$(cd "$root" && gorun mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
    | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
  [[ -f "$kgomod" ]] || die "could not download k8s.io/kubernetes@$K8S_VERSION"
  staging_version="v0.${K8S_VERSION#v1.}"      # v1.35.8 -> v0.35.8
  # Every `k8s.io/X => ./staging/src/k8s.io/X` line of kubernetes' go.mod, re-pointed at the
  # published module. Other replace lines (none in 1.35) would be copied verbatim.
  replaces="$(awk -v sv="$staging_version" '
      /^replace[[:space:]]*\(/ { inblk=1; next }
      inblk && /^\)/ { inblk=0; next }
      { line=$0; sub(/^replace[[:space:]]+/, "", line) }
      (inblk || /^replace[[:space:]]/) && line ~ /=>/ {
        split(line, f, /[[:space:]]*=>[[:space:]]*/); gsub(/[[:space:]]/, "", f[1]); gsub(/^[[:space:]]+|[[:space:]]+$/, "", f[2])
        if (f[2] ~ /^\.\/staging\//) print "\t" f[1] " => " f[1] " " sv
        else print "\t" f[1] " => " f[2]
      }' "$kgomod")"
  [[ "$(grep -c . <<<"$replaces")" -ge 20 ]] || die "found too few staging replaces in $kgomod"
  etcd_version="$(awk '$1=="go.etcd.io/etcd/server/v3" {print $2}' "$kgomod")"
  [[ -n "$etcd_version" ]] || die "kubernetes' go.mod does not name go.etcd.io/etcd/server/v3"
  {
    echo "// Generated by e2e/tools/build-k8s.sh: builds kubernetes $K8S_VERSION + etcd $etcd_version."
    echo "module weir.local/k8s-build"
    echo
    grep -E '^(go|godebug) ' "$kgomod"   # same language version and GODEBUG defaults as upstream
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo "require go.etcd.io/etcd/server/v3 $etcd_version"
    echo
    echo "replace ("
    echo "$replaces"
    echo ")"
    echo
    echo "tool ("
    for t in "${k8s_tools[@]}"; do
      echo "	k8s.io/kubernetes/cmd/$t"
    done
    echo "	go.etcd.io/etcd/server/v3"
    echo ")"
  } > "$mod/go.mod"
  rm -f "$mod/go.sum" "$mod/.resolved"
  log "resolving dependencies (go mod tidy; $(grep -c '=>' <<<"$replaces") staging replaces at $staging_version, etcd $etcd_version)"
  (cd "$mod" && gorun mod tidy) || die "go mod tidy failed in $mod"
  echo "$resolved_stamp" > "$mod/.resolved"
  log "dependencies resolved in $(( $(date +%s) - start ))s"
fi

# Version stamps, as kubernetes' hack/lib/version.sh sets them (kubectl version, /version).
minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

for b in "${missing[@]}"; do
  t0=$(date +%s)
  if [[ "$b" == coredns ]]; then
    log "building coredns $COREDNS_VERSION (go install) with nice -n $NICE, -p $JOBS"
    (cd "$root" && GOBIN="$bin/.coredns.d" gorun install -p "$JOBS" -trimpath -ldflags "-s -w" \
      "github.com/coredns/coredns@$COREDNS_VERSION") || die "building coredns failed"
    mv -f "$bin/.coredns.d/coredns" "$bin/coredns" && rmdir "$bin/.coredns.d"
    log "built coredns in $(( $(date +%s) - t0 ))s"
    continue
  fi
  case "$b" in
    etcd) pkg=go.etcd.io/etcd/server/v3 ;;
    *) pkg="k8s.io/kubernetes/cmd/$b" ;;
  esac
  log "building $b ($pkg) with nice -n $NICE, -p $JOBS"
  (cd "$mod" && gorun build -p "$JOBS" -trimpath -ldflags "$ldflags" -o "$bin/.$b.tmp" "$pkg") || die "building $b failed"
  mv -f "$bin/.$b.tmp" "$bin/$b"
  log "built $b in $(( $(date +%s) - t0 ))s"
done

log "done in $(( $(date +%s) - start ))s; $bin: $(cd "$bin" && ls | tr '\n' ' ')"
"$bin/kube-apiserver" --version >&2 2>&1 || true
[[ -x "$bin/etcd" ]] && { "$bin/etcd" --version | head -1 >&2 || true; }
echo "KUBEBUILDER_ASSETS=$bin" >&3
