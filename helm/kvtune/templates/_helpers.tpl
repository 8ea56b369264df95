{{/* Names and labels. */}}
{{- define "kvtune.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvtune.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "kvtune.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvtune.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The engine pods: what the Service, monitors, InferencePool and autoscalers select. */}}
{{- define "kvtune.engineSelector" -}}
app.kubernetes.io/name: {{ include "kvtune.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: engine
{{- end }}

{{- define "kvtune.image" -}}
{{- printf "%s:%s" .repository .tag }}
{{- end }}

{{- define "kvtune.engineImage" -}}
{{- if eq .Values.engine.device "cpu" }}{{ toYaml .Values.images.cpu }}{{ else }}{{ toYaml .Values.images.cuda }}{{ end }}
{{- end }}

{{/* Where the weights are in the engine container. */}}
{{- define "kvtune.modelPath" -}}
{{- $source := .Values.modelSource.source }}
{{- if eq $source "pvc" }}
{{- printf "/models/%s" (.Values.modelSource.pvc.subPath | default .Values.engine.model) | trimSuffix "/" }}
{{- else if eq $source "embedded" }}
{{- printf "/opt/kvtune/models/%s" .Values.engine.model }}
{{- else }}
{{- .Values.engine.model }}
{{- end }}
{{- end }}

{{- define "kvtune.servedModelName" -}}
{{- .Values.engine.servedModelName | default .Values.engine.model }}
{{- end }}

{{/* A number as vLLM's flags take it: integers without an exponent (Helm reads YAML numbers as
floats: 1073741824 would print as 1.073741824e+09). */}}
{{- define "kvtune.number" -}}
{{- if eq .type "int" }}{{ .value | int64 | toString }}{{ else }}{{ .value | toString }}{{ end }}
{{- end }}

{{/* vLLM's arguments: the chart's address, then each engine value through the generated flag table,
in the order `kvtune render` writes them, then extraArgs. */}}
{{- define "kvtune.engineArgs" -}}
{{- $engine := .Values.engine }}
- --model
- {{ include "kvtune.modelPath" . | quote }}
- --served-model-name
- {{ include "kvtune.servedModelName" . | quote }}
- --host
- "0.0.0.0"
- --port
- "8000"
{{- range $row := include "kvtune.flagTable" . | fromYamlArray }}
{{- $value := index $engine $row.key }}
{{- if and (not (kindIs "invalid" $value)) (not (has $value $row.omit)) }}
{{- if eq $row.type "bool" }}
- {{ ternary (printf "--%s" $row.flag) (printf "--no-%s" $row.flag) $value | quote }}
{{- else }}
- {{ printf "--%s" $row.flag | quote }}
- {{ include "kvtune.number" (dict "type" $row.type "value" $value) | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- range $engine.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- if .Values.kvEvents.enabled }}
- --kv-events-config
- {{ include "kvtune.kvEventsConfig" . | quote }}
{{- end }}
{{- end }}

{{/* vLLM publishes KV-cache events on ZMQ; Kubernetes expands $(POD_IP) in args. */}}
{{- define "kvtune.kvEventsConfig" -}}
{{- $endpoint := .Values.kvEvents.endpoint | default (printf "tcp://*:%d" (.Values.kvEvents.port | int)) }}
{{- dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" $endpoint "topic" (printf "kv@$(POD_IP)@%s" (include "kvtune.servedModelName" .)) | toJson }}
{{- end }}

{{/* The engine's environment: what the profile renders (engine_env), then the chart's own. */}}
{{- define "kvtune.engineEnv" -}}
{{- $engine := .Values.engine }}
{{- if eq $engine.device "cpu" }}
- name: VLLM_TARGET_DEVICE
  value: cpu
{{- /* What vLLM's CPU build needs to start well (kvtune.platform.CPU_COMPILE_ENV: it cannot load its own
  AOT compile artefacts; torch's Inductor cache can). engine.env may set each otherwise. */}}
{{- range $row := include "kvtune.cpuEnv" . | fromYamlArray }}
{{- if not (hasKey ($engine.env | default dict) $row.name) }}
- name: {{ $row.name }}
  value: {{ $row.value | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- range $row := include "kvtune.envTable" . | fromYamlArray }}
{{- $value := index $engine $row.key }}
{{- if not (kindIs "invalid" $value) }}
- name: {{ $row.env }}
  value: {{ include "kvtune.number" (dict "type" (ternary "str" "int" (kindIs "string" $value)) "value" $value) | quote }}
{{- end }}
{{- end }}
{{- range $name, $value := $engine.env }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- range $engine.secretEnv }}
- name: {{ . }}
  valueFrom:
    secretKeyRef:
      name: {{ required (printf "engine.secretEnvSecret: name the Secret that holds %s (engine.secretEnv lists it)" .) $engine.secretEnvSecret }}
      key: {{ . }}
{{- end }}
{{- with $engine.apiKeySecret }}{{ if .name }}
- name: VLLM_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}{{ end }}
{{- with .Values.modelSource.hubTokenSecret }}{{ if and .name (eq $.Values.modelSource.source "hub") }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}{{ end }}
# Writable homes for a non-root user: the Hugging Face download cache and vLLM's compile caches.
- name: HOME
  value: /cache
- name: HF_HOME
  value: /cache/huggingface
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end }}

{{/* The container's resources: as given, else a GPU limit (cuda) or requests sized from the KV budget (cpu). */}}
{{- define "kvtune.engineResources" -}}
{{- if .Values.resources }}
{{- toYaml .Values.resources }}
{{- else if eq .Values.engine.device "cuda" }}
limits:
  nvidia.com/gpu: {{ .Values.gpusPerEngine }}
{{- else }}
{{- $kv := .Values.engine.kvCacheMemoryBytes | default 4294967296 | int64 }}
requests:
  cpu: "2"
  memory: {{ add $kv 4294967296 | toString }}
{{- end }}
{{- end }}

{{/* Rolls the pods when anything the engine reads from values changes. */}}
{{- define "kvtune.configChecksum" -}}
{{- dict "engine" .Values.engine "modelSource" .Values.modelSource "kvEvents" .Values.kvEvents | toJson | sha256sum }}
{{- end }}

{{- define "kvtune.engineUrl" -}}
{{- printf "http://%s.%s.svc:%d" (include "kvtune.fullname" .) .Release.Namespace (.Values.service.port | int) }}
{{- end }}

{{/* Locust's environment: the served name, the engine's API key and the hub token (for the tokenizer). */}}
{{- define "kvtune.locustEnv" -}}
# The tokenizer: the engine's model folder (embedded models sit at the same path in kvtune's image) or hub id.
- name: KVTUNE_MODEL
  value: {{ include "kvtune.servedModelName" . | quote }}
- name: HOME
  value: /tmp
{{- with .Values.engine.apiKeySecret }}{{ if .name }}
- name: KVTUNE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}{{ end }}
{{- with .Values.modelSource.hubTokenSecret }}{{ if .name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}{{ end }}
{{- end }}
