# shellcheck shell=bash disable=SC2034  # (settings used by the scripts that source this)
# Shared by e2e/local/up, down and smoke: paths, settings and small helpers. Sourced, not run.
# Every setting can be overridden from the environment; up and down must see the same values.

WEIR_CACHE="${WEIR_CACHE:-$HOME/.cache/weir}"
K8S_VERSION="${K8S_VERSION:-v1.35.8}"

NODE_NAME="${WEIR_NODE_NAME:-weir-local}"
POD_CIDR="${WEIR_POD_CIDR:-10.244.0.0/24}"          # one /24: host-local IPAM on the bridge
NODE_IP="${WEIR_NODE_IP:-10.244.0.1}"               # the bridge's address: gateway + node IP
SERVICE_CIDR="${WEIR_SERVICE_CIDR:-10.96.0.0/24}"   # routed by kube-proxy (iptables)
BRIDGE="${WEIR_BRIDGE:-weir0}"
CNI_NETWORK="weir"                                  # the CNI network name (iptables comments)
API_PORT="${WEIR_API_PORT:-6443}"
ETCD_PORT="${WEIR_ETCD_PORT:-12379}"                # not 2379: e2e/tools/start-apiserver.sh
ETCD_PEER_PORT="${WEIR_ETCD_PEER_PORT:-12380}"
KCM_PORT=10257 SCHED_PORT=10259 KUBELET_PORT=10250 KUBELET_HEALTHZ_PORT=10248
PROXY_HEALTHZ_PORT=10256 PROXY_METRICS_PORT=10249 DNS_HEALTH_PORT=18080
PAUSE_IMAGE="weir.local/pause:1"
EGRESS_COMMENT="weir-local: pods may not leave the pod network"

# Daemons in start order; down stops them in the order it needs.
COMPONENTS=(containerd etcd kube-apiserver kube-controller-manager kube-scheduler kube-proxy coredns kubelet)

init_paths() {
  W="$1"
  case "$W" in
    /*) ;;
    *) W="$(pwd)/$W" ;;
  esac
  W="${W%/}"
  [[ -n "$W" && "$W" != / ]] || { echo "refusing to use '/' as the work dir" >&2; exit 1; }
  PKI="$W/pki" CONF="$W/config" RUN="$W/run" LOGS="$W/logs"
  CTRD="$W/containerd"
  CTRD_SOCK="$CTRD/containerd.sock"
  KUBELET_DIR="$W/kubelet"
  KUBECONFIG_FILE="$W/kubeconfig"
}

default_workdir() { echo "$WEIR_CACHE/cluster"; }

k8s_bin_dir() { echo "$WEIR_CACHE/k8s/$K8S_VERSION/bin"; }

ts() { date +%H:%M:%S; }

# pid of a component if it runs (pid file present, process alive and still that binary).
component_pid() {
  local name="$1" pidf="$RUN/$1.pid" pid exe
  [[ -f "$pidf" ]] || return 1
  pid="$(cat "$pidf" 2>/dev/null)" || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null)" || return 1
  [[ "$(basename "${exe% (deleted)}")" == "$name" ]] || return 1
  echo "$pid"
}

# Stops components by their pid files, all at once: SIGTERM, then SIGKILL after TIMEOUT s.
#   stop_components TIMEOUT NAME...
stop_components() {
  local timeout="$1" name pid i alive; shift
  local -A pids=()
  for name in "$@"; do
    if pid="$(component_pid "$name")"; then
      pids[$name]="$pid"
      kill -TERM "$pid" 2>/dev/null || true
    fi
  done
  for ((i = 0; i < timeout * 10; i++)); do
    alive=0
    for name in "${!pids[@]}"; do kill -0 "${pids[$name]}" 2>/dev/null && alive=1; done
    (( alive )) || break
    sleep 0.1
  done
  for name in "$@"; do
    [[ -n "${pids[$name]:-}" ]] || { rm -f "$RUN/$name.pid"; continue; }
    pid="${pids[$name]}"
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL "$pid" 2>/dev/null || true
      echo "[$(ts)] $name (pid $pid) did not stop in ${timeout}s: killed" >&2
    else
      echo "[$(ts)] stopped $name (pid $pid)" >&2
    fi
    rm -f "$RUN/$name.pid"
  done
}

ctr_local() { ctr --address "$CTRD_SOCK" --namespace k8s.io "$@"; }
