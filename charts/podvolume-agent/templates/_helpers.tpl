{{/* Name of the namespaced and cluster-wide objects other than the DaemonSet and ServiceAccount. */}}
{{- define "podvolume-agent.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object. `name` and `component` as daemonset/ (and Velero) label them. */}}
{{- define "podvolume-agent.labels" -}}
component: velero
app.kubernetes.io/name: podvolume-agent
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/*
The DaemonSet's selector: the same as daemonset/'s, so a DaemonSet applied from there can be
taken over by the chart (a selector cannot change). Fixed: Velero finds the pods by these labels.
*/}}
{{- define "podvolume-agent.selectorLabels" -}}
name: node-agent
{{- end -}}

{{- define "podvolume-agent.serviceAccountName" -}}
{{- required "serviceAccount.name is required" .Values.serviceAccount.name -}}
{{- end -}}

{{/* The port of agent.listenAddress (host:port or [v6]:port). */}}
{{- define "podvolume-agent.port" -}}
{{- $port := .Values.agent.listenAddress | toString | splitList ":" | last -}}
{{- if not (regexMatch "^[0-9]+$" $port) -}}
{{- fail (printf "agent.listenAddress must end with :<port>, got %q" .Values.agent.listenAddress) -}}
{{- end -}}
{{- $port -}}
{{- end -}}

{{- define "podvolume-agent.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (required "image.tag (or image.digest) is required" (toString .Values.image.tag)) -}}
{{- end -}}
{{- end -}}
