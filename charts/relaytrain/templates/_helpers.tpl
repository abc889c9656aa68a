{{/* Names and labels shared by every template; all helpers are prefixed `relaytrain.`. */}}

{{- define "relaytrain.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's base name: the release name, with the chart name added if missing. */}}
{{- define "relaytrain.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "relaytrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "relaytrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "relaytrain.labels" -}}
{{ include "relaytrain.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "relaytrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "relaytrain.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* An image by digest when one is given (what a release pins), else by tag (the appVersion). */}}
{{- define "relaytrain.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "relaytrain.workerImage" -}}
{{- if .Values.workerImage.digest -}}
{{- printf "%s@%s" .Values.workerImage.repository .Values.workerImage.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.workerImage.repository (default .Chart.AppVersion .Values.workerImage.tag) -}}
{{- end -}}
{{- end -}}

{{/* ClusterRole for what is cluster-scoped or read across namespaces (nodes, GPU accounting). */}}
{{- define "relaytrain.clusterRoleName" -}}
{{- printf "%s-cluster" (include "relaytrain.fullname" .) -}}
{{- end -}}

{{/* ClusterRole for the job-level work, bound cluster-wide or per watched namespace. */}}
{{- define "relaytrain.jobsRoleName" -}}
{{- printf "%s-jobs" (include "relaytrain.fullname" .) -}}
{{- end -}}

{{- define "relaytrain.catalogName" -}}
{{- printf "%s-gpu-catalog" (include "relaytrain.fullname" .) -}}
{{- end -}}
