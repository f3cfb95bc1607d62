{{/* Names, labels and the per-pool pieces every template shares. */}}

{{- define "tokenmill.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* release-chart, or the release name alone when it already holds the chart name */}}
{{- define "tokenmill.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* the pools, in start order */}}
{{- define "tokenmill.roles" -}}
router tokenizer prefill decode gateway
{{- end -}}

{{- define "tokenmill.labels" -}}
app.kubernetes.io/name: {{ include "tokenmill.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* selector labels of one pool: call with (dict "root" $ "role" "decode") */}}
{{- define "tokenmill.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tokenmill.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{/* the gRPC port of a pool */}}
{{- define "tokenmill.port" -}}
{{- index .root.Values.ports .role -}}
{{- end -}}

{{/* the /metrics port of a pool: gRPC port + offset; the gateway's sits 1400 above the router's gRPC port */}}
{{- define "tokenmill.metricsPort" -}}
{{- if eq .role "gateway" -}}
{{- add .root.Values.ports.router .root.Values.ports.metricsOffset 400 -}}
{{- else -}}
{{- add (index .root.Values.ports .role) .root.Values.ports.metricsOffset -}}
{{- end -}}
{{- end -}}

{{- define "tokenmill.secretName" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-api-keys" (include "tokenmill.fullname" .)) -}}
{{- end -}}

{{- define "tokenmill.apiKeysEnabled" -}}
{{- if or .Values.apiKeys.existingSecret .Values.apiKeys.keys -}}true{{- end -}}
{{- end -}}
