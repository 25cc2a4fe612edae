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
