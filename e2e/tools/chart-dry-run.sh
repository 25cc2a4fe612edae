#!/usr/bin/env bash
# Renders charts/weir-operator (cluster-wide and with watchNamespace) and submits every object
# to the API server KUBECONFIG names as a server-side dry-run: schema, defaulting, admission and
# Pod Security all judge them without anything being created. Fails naming the object refused.
set -euo pipefail
cd "$(dirname "$0")/../.."
helm="${WEIR_HELM_BIN:-helm}"
kubectl="${KUBECTL:-kubectl}"
: "${KUBECONFIG:?KUBECONFIG names the cluster}"
ns="weir-dry-run"
"$kubectl" create namespace "$ns" --dry-run=client -o yaml | "$kubectl" apply -f - >/dev/null
"$kubectl" label namespace "$ns" pod-security.kubernetes.io/enforce=restricted --overwrite >/dev/null
# helm renders offline for Kubernetes 1.20 unless told the server's version.
server_version="$("$kubectl" version -o json | sed -n '/"serverVersion"/,/}/ s/.*"gitVersion": "\(v[^"]*\)".*/\1/p')"
[[ -n "$server_version" ]] || { echo "cannot read the API server's version" >&2; exit 1; }
status=0
for extra in "" "--set watchNamespace=$ns"; do
  # shellcheck disable=SC2086  # $extra is word-split on purpose
  if ! out="$("$helm" template weir charts/weir-operator --namespace "$ns" --include-crds \
      --kube-version "$server_version" \
      --set defaultStorage=s3://weir-state/prod $extra | "$kubectl" apply --dry-run=server -f - 2>&1)"; then
    echo "chart dry-run ($extra) refused:" >&2; echo "$out" >&2; status=1
  else
    echo "chart dry-run ${extra:+($extra) }accepted by the $server_version API server: $(grep -c 'server dry run' <<<"$out") objects" >&2
  fi
done
"$kubectl" delete namespace "$ns" --wait=false >/dev/null
exit "$status"
