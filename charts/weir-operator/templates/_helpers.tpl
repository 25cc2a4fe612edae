{{/* The release's full name, at most 63 characters. */}}
{{- define "weir-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object. app.kubernetes.io/name=weir-operator is what the jobs'
     NetworkPolicies admit to the runtime control API: keep it on the pods. */}}
{{- define "weir-operator.labels" -}}
app.kubernetes.io/name: weir-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "weir-operator.selectorLabels" -}}
app.kubernetes.io/name: weir-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "weir-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "weir-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The rules on StreamJobs and their children: in a ClusterRole, or a Role in watchNamespace. */}}
{{- define "weir-operator.jobRules" -}}
# Watch StreamJobs; add and remove the stop-with-savepoint finalizer (a merge patch).
- apiGroups: ["weir.dev"]
  resources: ["streamjobs"]
  verbs: ["get", "list", "watch", "patch"]
# Write status by server-side apply.
- apiGroups: ["weir.dev"]
  resources: ["streamjobs/status"]
  verbs: ["patch"]
# Children carry an ownerReference with blockOwnerDeletion to their StreamJob; the API server
# requires this permission for that.
- apiGroups: ["weir.dev"]
  resources: ["streamjobs/finalizers"]
  verbs: ["update"]
# Runtime pods: watched (cache and triggers), created by server-side apply, deleted on
# upgrade, stop and kill (grace 0). No exec, no logs.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The job file ConfigMap (server-side apply) and a job given by configMapRef (get).
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
# The control API Service of each job (server-side apply).
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch"]
# The per-job control token Secret (created once, read back), and a job's
# checkpointing.credentialsSecret, read only when the operator must list its checkpoints.
# No list or watch: the operator reads Secrets by name only.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
# The NetworkPolicy guarding each job's control API (server-side apply).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch"]
# Events on StreamJobs for every transition (a repeated event is patched as a series).
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}
