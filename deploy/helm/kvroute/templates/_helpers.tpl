{{/* Chart name, truncated to the 63 characters Kubernetes names allow. */}}
{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name. */}}
{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvroute.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Router pods: selector labels (stable across upgrades). */}}
{{- define "kvroute.routerSelector" -}}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end }}

{{/* Worker pods: selector labels; kvroute.io/role=worker is what discovery selects. */}}
{{- define "kvroute.workerSelector" -}}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: worker
kvroute.io/role: worker
{{- end }}

{{- define "kvroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-router" (include "kvroute.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvroute.discoveryNamespace" -}}
{{- default .Release.Namespace .Values.discovery.namespace }}
{{- end }}

{{- define "kvroute.discoverySelector" -}}
{{- default (printf "kvroute.io/role=worker,app.kubernetes.io/instance=%s" .Release.Name) .Values.discovery.selector }}
{{- end }}

{{/* The router config file: the user's config plus what the chart owns. */}}
{{- define "kvroute.routerConfig" -}}
{{- $cfg := deepCopy .Values.router.config }}
{{- $_ := set $cfg "host" "0.0.0.0" }}
{{- $_ := set $cfg "port" (int .Values.router.port) }}
{{- if .Values.discovery.enabled }}
{{- $kube := dict
    "namespace" (include "kvroute.discoveryNamespace" .)
    "selector" (include "kvroute.discoverySelector" .)
    "engine_port" (int .Values.discovery.engine_port)
    "bridge_port" (int .Values.discovery.bridge_port)
    "watch_timeout_seconds" (int .Values.discovery.watch_timeout_seconds)
    "max_workers" (int .Values.discovery.max_workers) }}
{{- $_ := set $cfg "discovery" (dict "kubernetes" $kube) }}
{{- end }}
{{- if .Values.worker.bridge.tokenSecret }}
{{- $events := deepCopy (default dict $cfg.events) }}
{{- $_ := set $events "bridge_token_file" "/etc/kvroute-bridge/token" }}
{{- $_ := set $cfg "events" $events }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}
