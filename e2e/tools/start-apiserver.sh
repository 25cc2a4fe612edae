#!/usr/bin/env bash
# Runs a real etcd + kube-apiserver on loopback only (no kubelet, no controllers), as built by
# build-k8s.sh, for end-to-end tests of the operator.
#
#   e2e/tools/start-apiserver.sh start  [DIR]  start both, wait for /readyz, print env lines
#   e2e/tools/start-apiserver.sh verify [DIR]  curl checks: /readyz, create a namespace and a
#                                              CRD, then a custom object of that CRD
#   e2e/tools/start-apiserver.sh stop   [DIR]  stop both (by the pids recorded in DIR)
#
# DIR (default $WEIR_K8S_DIR or ${TMPDIR:-/tmp}/weir-k8s) holds etcd's data, the generated
# serving certs, the service-account key pair, the token file, logs, pids and a kubeconfig.
# `start` prints, on stdout, lines to eval:
#   KUBECONFIG=DIR/kubeconfig  WEIR_APISERVER=https://127.0.0.1:PORT  WEIR_APISERVER_TOKEN=...
#   WEIR_APISERVER_CA=DIR/certs/apiserver.crt
# Env: KUBEBUILDER_ASSETS (default: whatever build-k8s.sh prints, building if needed),
#      APISERVER_PORT (6443), ETCD_PORT (2379), ETCD_PEER_PORT (2380).
set -euo pipefail

cmd="${1:-start}"
dir="${2:-${WEIR_K8S_DIR:-${TMPDIR:-/tmp}/weir-k8s}}"
api_port="${APISERVER_PORT:-6443}"
etcd_port="${ETCD_PORT:-2379}"
peer_port="${ETCD_PEER_PORT:-2380}"
here="$(cd "$(dirname "$0")" && pwd)"
log() { echo "[start-apiserver] $*" >&2; }
die() { log "error: $*"; exit 1; }

stop() {
  for name in kube-apiserver etcd; do
    local pidf="$dir/$name.pid"
    [[ -f "$pidf" ]] || continue
    local pid; pid="$(cat "$pidf")"
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
      log "stopped $name (pid $pid)"
    fi
    rm -f "$pidf"
  done
}

# curl against the apiserver as the admin token user; trusts only the generated serving cert.
kcurl() {
  curl -sS --fail-with-body --cacert "$dir/certs/apiserver.crt" \
    -H "Authorization: Bearer $(cat "$dir/token")" "$@"
}

start() {
  if [[ -z "${KUBEBUILDER_ASSETS:-}" ]]; then
    KUBEBUILDER_ASSETS="$("$here/build-k8s.sh" | sed -n 's/^KUBEBUILDER_ASSETS=//p' | tail -1)"
  fi
  local bin="$KUBEBUILDER_ASSETS"
  [[ -x "$bin/etcd" && -x "$bin/kube-apiserver" ]] || die "no etcd/kube-apiserver in '$bin'"
  command -v openssl >/dev/null || die "openssl is needed (apt-get install openssl)"
  stop   # a previous run in the same DIR
  mkdir -p "$dir/certs"

  # Service-account token signing key (required flags since 1.20), and a static bearer token
  # for an admin user: --token-auth-file still exists in 1.35. CSV: token,user,uid,"groups".
  [[ -f "$dir/sa.key" ]] || openssl genrsa -out "$dir/sa.key" 2048 2>/dev/null
  openssl rsa -in "$dir/sa.key" -pubout -out "$dir/sa.pub" 2>/dev/null
  [[ -f "$dir/token" ]] || openssl rand -hex 24 > "$dir/token"
  echo "$(cat "$dir/token"),weir-admin,weir-admin,\"system:masters\"" > "$dir/tokens.csv"

  log "starting etcd on 127.0.0.1:$etcd_port (log: $dir/etcd.log)"
  "$bin/etcd" --name weir --data-dir "$dir/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" \
    --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-cluster "weir=http://127.0.0.1:$peer_port" \
    --unsafe-no-fsync \
    >"$dir/etcd.log" 2>&1 &
  echo $! > "$dir/etcd.pid"
  # Healthy only once *this* etcd serves: tests start several servers on free ports, and a port
  # can be taken between choosing it and binding it. /health alone would then be answered by
  # another test's etcd (and this API server would share its data); this etcd logs that it
  # serves client traffic only after binding the port, and exits when the bind fails.
  for i in $(seq 100); do
    grep -q '"serving client traffic' "$dir/etcd.log" 2>/dev/null \
      && curl -sf "http://127.0.0.1:$etcd_port/health" >/dev/null 2>&1 && break
    kill -0 "$(cat "$dir/etcd.pid")" 2>/dev/null || { tail -20 "$dir/etcd.log" >&2; die "etcd exited"; }
    (( i < 100 )) || die "etcd not healthy after 20s"
    sleep 0.2
  done

  log "starting kube-apiserver on https://127.0.0.1:$api_port (log: $dir/apiserver.log)"
  # With --cert-dir and no --tls-cert-file, kube-apiserver writes a self-signed serving cert
  # (for localhost, 127.0.0.1 and the first service IP) to certs/apiserver.{crt,key}.
  "$bin/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
    --cert-dir "$dir/certs" \
    --service-cluster-ip-range 10.0.0.0/24 \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$dir/sa.pub" \
    --service-account-signing-key-file "$dir/sa.key" \
    --token-auth-file "$dir/tokens.csv" \
    --authorization-mode RBAC \
    --allow-privileged=true \
    >"$dir/apiserver.log" 2>&1 &
  echo $! > "$dir/kube-apiserver.pid"
  # /readyz is checked against this server's own generated cert and token, so another test's
  # API server on a reused port cannot answer for it.
  for i in $(seq 300); do
    [[ -f "$dir/certs/apiserver.crt" ]] && kcurl -o /dev/null "https://127.0.0.1:$api_port/readyz" 2>/dev/null && break
    kill -0 "$(cat "$dir/kube-apiserver.pid")" 2>/dev/null || { tail -20 "$dir/apiserver.log" >&2; die "kube-apiserver exited"; }
    (( i < 300 )) || die "kube-apiserver not ready after 60s"
    sleep 0.2
  done

  cat > "$dir/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: weir
  cluster:
    server: https://127.0.0.1:$api_port
    certificate-authority-data: $(base64 -w0 < "$dir/certs/apiserver.crt")
users:
- name: weir-admin
  user:
    token: $(cat "$dir/token")
contexts:
- name: weir
  context: {cluster: weir, user: weir-admin}
current-context: weir
EOF
  echo "$api_port" > "$dir/apiserver.port"
  log "ready in ${SECONDS}s; stop with: $0 stop $dir"
  echo "KUBECONFIG=$dir/kubeconfig"
  echo "WEIR_APISERVER=https://127.0.0.1:$api_port"
  echo "WEIR_APISERVER_TOKEN=$(cat "$dir/token")"
  echo "WEIR_APISERVER_CA=$dir/certs/apiserver.crt"
}

verify() {
  [[ -f "$dir/apiserver.port" ]] && api_port="$(cat "$dir/apiserver.port")"
  local api="https://127.0.0.1:$api_port" code ns="weir-verify-$(date +%s)-$$"
  log "GET /readyz: $(kcurl "$api/readyz")"
  log "GET /version: $(kcurl "$api/version" | tr -d ' \n' | cut -c1-120)..."
  # A fresh namespace each run, never deleted: without kube-controller-manager (its namespace
  # controller) a deleted namespace stays Terminating forever and refuses new objects.
  code="$(kcurl -X POST -H 'Content-Type: application/json' -o /dev/null -w '%{http_code}' \
    "$api/api/v1/namespaces" -d '{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"'"$ns"'"}}')"
  log "POST namespace $ns: HTTP $code"
  # 409: the CRD was left by an earlier run.
  code="$(curl -sS --cacert "$dir/certs/apiserver.crt" -H "Authorization: Bearer $(cat "$dir/token")" -X POST -H 'Content-Type: application/json' -o /dev/null -w '%{http_code}' \
    "$api/apis/apiextensions.k8s.io/v1/customresourcedefinitions" -d '{
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.verify.weir.dev"},
    "spec": {"group": "verify.weir.dev", "scope": "Namespaced",
      "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
      "versions": [{"name": "v1", "served": true, "storage": true,
        "schema": {"openAPIV3Schema": {"type": "object", "properties": {
          "spec": {"type": "object", "properties": {"size": {"type": "integer"}}}}}}}]}}')"
  [[ "$code" == 201 || "$code" == 409 ]] || die "creating CRD: HTTP $code"
  log "POST CRD widgets.verify.weir.dev: HTTP $code"
  # The new resource is served once the CRD reports Established.
  local i
  for i in $(seq 50); do
    kcurl "$api/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.verify.weir.dev" \
      | grep -q '"type": "Established"' && break
    (( i < 50 )) || die "CRD not Established after 10s"
    sleep 0.2
  done
  log "CRD Established"
  code="$(kcurl -X POST -H 'Content-Type: application/json' -o /dev/null -w '%{http_code}' \
    "$api/apis/verify.weir.dev/v1/namespaces/$ns/widgets" \
    -d '{"apiVersion":"verify.weir.dev/v1","kind":"Widget","metadata":{"name":"w1"},"spec":{"size":3}}')"
  log "POST widgets/w1: HTTP $code"
  log "GET widgets/w1: $(kcurl "$api/apis/verify.weir.dev/v1/namespaces/$ns/widgets/w1" \
    | grep -E '"(name|namespace|size)"' | tr -d ' \n')"
  # The CRD is kept (a deleted CRD stays Terminating for a moment and a rerun would race it).
  log "verify: OK"
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  verify) verify ;;
  *) die "usage: $0 start|verify|stop [DIR]" ;;
esac
