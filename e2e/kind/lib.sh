# shellcheck shell=bash disable=SC2034  # (settings used by the scripts that source this)
# Shared by e2e/kind/up and down: settings and helpers. Sourced, not run.
WEIR_CACHE="${WEIR_CACHE:-$HOME/.cache/weir}"
K8S_VERSION="${K8S_VERSION:-v1.35.8}"
KIND_VERSION="${KIND_VERSION:-v0.33.0}"
CLUSTER="${WEIR_KIND_CLUSTER:-weir}"
KIND_DIR="$WEIR_CACHE/kind"
KIND_BIN="$KIND_DIR/bin/kind"
KUBECONFIG_FILE="$KIND_DIR/kubeconfig"
DOCKERD_PID="$KIND_DIR/dockerd.pid"
DOCKERD_LOG="$KIND_DIR/dockerd.log"
POD_ROUTE="10.244.0.0/16"
# Workers join with this taint until their CNI config names their pod CIDR.
CNI_TAINT="weir.dev/cni-pending"
WRAPPER=/usr/local/sbin/runc-without-sys-resource

log() { echo "[kind $(date +%H:%M:%S)] $*" >&2; }
die() { log "error: $*"; exit 1; }
