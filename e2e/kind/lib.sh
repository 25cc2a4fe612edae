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
KIND_LIB_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

log() { echo "[kind $(date +%H:%M:%S)] $*" >&2; }
die() { log "error: $*"; exit 1; }

# Installs Docker (Debian's docker.io) and jq when missing and starts dockerd when none runs,
# with runc called through runc-without-sys-resource (see README.md). Used by e2e/kind/up and
# images/check-dockerfiles.sh.
ensure_dockerd() {
  mkdir -p "$KIND_DIR"
  local need=()
  command -v dockerd >/dev/null || need+=(docker.io)
  command -v jq >/dev/null || need+=(jq)
  if [[ ${#need[@]} -gt 0 ]]; then
    log "installing ${need[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"; } >&2 || die "apt-get install failed"
  fi
  install -m 0755 "$KIND_LIB_DIR/runc-without-sys-resource" "$WRAPPER"
  if ! docker info >/dev/null 2>&1; then
    mkdir -p /etc/docker
    if [[ ! -f /etc/docker/daemon.json ]] || grep -q weir-runc /etc/docker/daemon.json; then
      # oom-score-adjust 0: dockerd may not lower its own score without CAP_SYS_RESOURCE.
      cat > /etc/docker/daemon.json <<JSON
  {
    "runtimes": {"weir-runc": {"path": "$WRAPPER"}},
    "default-runtime": "weir-runc",
    "oom-score-adjust": 0
  }
JSON
    else
      log "note: /etc/docker/daemon.json is not ours; privileged containers need the runtime in README.md"
    fi
    iptables -S FORWARD | head -1 | awk '{print $3}' > "$KIND_DIR/forward-policy.orig"
    log "starting dockerd (log $DOCKERD_LOG)"
    setsid dockerd </dev/null >"$DOCKERD_LOG" 2>&1 3>&- &
    echo $! > "$DOCKERD_PID"
    for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
    docker info >/dev/null 2>&1 || { tail -20 "$DOCKERD_LOG" >&2; die "dockerd did not start"; }
  fi
}
