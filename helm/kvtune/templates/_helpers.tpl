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

{{/* One engine's pods: what its Service, monitors, InferencePool and autoscaler select. */}}
{{- define "kvtune.engineSelector" -}}
app.kubernetes.io/name: {{ include "kvtune.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: engine
{{- if .engineName }}
kvtune.io/engine: {{ .engineName }}
{{- end }}
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
{{- /* hub: the id (vLLM downloads it, at engine.revision); objectStorage: the s3:// or gs:// URL vLLM's
Run:ai streamer reads. */}}
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

{{/* The engine's environment: what the profile renders (engine_env), then the chart's own. The chart's
variables are kvtune.chartEnv's; engine.env and engine.secretEnv may not name one (templates/checks.yaml
refuses them: the later entry would silently win). */}}
{{- define "kvtune.engineEnv" -}}
{{- $engine := .Values.engine }}
{{- include "kvtune.chartEnv" (dict "root" . "part" "profile") }}
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
{{- include "kvtune.chartEnv" (dict "root" . "part" "chart") }}
{{- end }}

{{/* The variables the chart sets itself, in two parts: "profile" (what the engine values render, before
engine.env) and "chart" (credentials, homes, the pod's address, after it). */}}
{{- define "kvtune.chartEnv" -}}
{{- $root := .root }}
{{- $engine := $root.Values.engine }}
{{- if eq .part "profile" }}
{{- if eq $engine.device "cpu" }}
- name: VLLM_TARGET_DEVICE
  value: cpu
{{- /* What vLLM's CPU build needs to start well (kvtune.platform.CPU_COMPILE_ENV: it cannot load its own
  AOT compile artefacts; torch's Inductor cache can). engine.env may set each otherwise. */}}
{{- range $row := include "kvtune.cpuEnv" $root | fromYamlArray }}
{{- if not (hasKey ($engine.env | default dict) $row.name) }}
- name: {{ $row.name }}
  value: {{ $row.value | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- range $row := include "kvtune.envTable" $root | fromYamlArray }}
{{- $value := index $engine $row.key }}
{{- if not (kindIs "invalid" $value) }}
- name: {{ $row.env }}
  value: {{ include "kvtune.number" (dict "type" (ternary "str" "int" (kindIs "string" $value)) "value" $value) | quote }}
{{- end }}
{{- end }}
{{- else }}
{{- with $engine.apiKeySecret }}{{ if .name }}
- name: VLLM_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}{{ end }}
{{- with $root.Values.modelSource.hubTokenSecret }}{{ if and .name (eq $root.Values.modelSource.source "hub") }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}{{ end }}
{{- with $root.Values.modelSource.objectStorage }}{{ if eq $root.Values.modelSource.source "objectStorage" }}
{{- /* The credentials the model URL's store reads (kvtune.objectStorage, by scheme): S3's are the AWS
SDK's variables, Google Cloud Storage's a key file. */}}
{{- $store := include "kvtune.objectStore" $root | fromYaml }}
{{- if .credentialsSecret }}
{{- range $store.envKeys }}
- name: {{ . }}
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.modelSource.objectStorage.credentialsSecret }}
      key: {{ . }}
{{- end }}
{{- if $store.fileEnv }}
- name: {{ $store.fileEnv }}
  value: {{ printf "%s/%s" $store.mountPath $store.fileKey | quote }}
{{- end }}
{{- end }}
{{- if and .endpointUrl $store.endpointEnv }}
- name: {{ $store.endpointEnv }}
  value: {{ .endpointUrl | quote }}
{{- end }}
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
{{- end }}

{{/* The object store holding the weights, by engine.model's URL scheme (a row of kvtune.objectStorage; an
empty map for a scheme the chart does not know, which templates/checks.yaml refuses). */}}
{{- define "kvtune.objectStore" -}}
{{- $scheme := regexFind "^[a-z0-9]+://" (.Values.engine.model | toString) | trimSuffix "://" }}
{{- index (include "kvtune.objectStorage" . | fromYaml) $scheme | default dict | toYaml }}
{{- end }}

{{/* The chart's own volumes of an engine pod, and their mounts in the vLLM container (extraVolumes and
extraVolumeMounts come after them, and templates/checks.yaml matches those against these). */}}
{{- define "kvtune.engineVolumes" -}}
{{- $fullname := include "kvtune.engineFullname" . }}
{{- $source := .Values.modelSource.source }}
- name: cache
  {{- if .Values.cache.enabled }}
  persistentVolumeClaim:
    claimName: {{ .Values.cache.existingClaim | default (include "kvtune.childName" (dict "base" $fullname "suffix" "cache")) }}
  {{- else }}
  emptyDir: {}
  {{- end }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shmSize }}
{{- if eq $source "embedded" }}
- name: models
  emptyDir: {}
{{- else if eq $source "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ required "modelSource.pvc.claimName: name the PersistentVolumeClaim holding the weights (modelSource.source is pvc)" .Values.modelSource.pvc.claimName }}
    readOnly: true
{{- end }}
{{- if .Values.engine.warmup }}
- name: warmup
  configMap:
    name: {{ include "kvtune.childName" (dict "base" $fullname "suffix" "warmup") }}
{{- end }}
{{- $store := include "kvtune.objectStore" . | fromYaml }}
{{- if and (eq $source "objectStorage") .Values.modelSource.objectStorage.credentialsSecret $store.fileKey }}
- name: object-storage-credentials
  secret:
    secretName: {{ .Values.modelSource.objectStorage.credentialsSecret }}
    items:
      - key: {{ $store.fileKey }}
        path: {{ $store.fileKey }}
{{- end }}
{{- end }}

{{- define "kvtune.engineVolumeMounts" -}}
{{- $source := .Values.modelSource.source }}
- name: cache
  mountPath: /cache
- name: shm
  mountPath: /dev/shm
{{- if eq $source "embedded" }}
- name: models
  mountPath: /opt/kvtune/models
  readOnly: true
{{- else if eq $source "pvc" }}
- name: models
  mountPath: /models
  readOnly: true
{{- end }}
{{- if .Values.engine.warmup }}
- name: warmup
  mountPath: /etc/kvtune/warmup
  readOnly: true
{{- end }}
{{- $store := include "kvtune.objectStore" . | fromYaml }}
{{- if and (eq $source "objectStorage") .Values.modelSource.objectStorage.credentialsSecret $store.fileKey }}
- name: object-storage-credentials
  mountPath: {{ $store.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* A Kubernetes quantity (8Gi, 500m, 2, 1.5G, or a number) in base units (bytes, cores), as a number; the
schema admits these forms only (kvtune.helm.k8s_types.QUANTITY). */}}
{{- define "kvtune.quantity" -}}
{{- if or (kindIs "float64" .) (kindIs "int" .) (kindIs "int64" .) }}
{{- float64 . }}
{{- else }}
{{- $text := toString . }}
{{- $suffix := regexFind "[a-zA-Z]+$" $text }}
{{- $scale := dict "" 1.0 "n" 1e-9 "u" 1e-6 "m" 1e-3 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 }}
{{- mulf (float64 (trimSuffix $suffix $text)) (index $scale $suffix) }}
{{- end }}
{{- end }}

{{/* GPUs per engine pod: one per rank, tensor x pipeline x data parallel (not a value of its own that
could disagree with the flags). */}}
{{- define "kvtune.gpusPerPod" -}}
{{- $engine := .Values.engine }}
{{- mul ($engine.tensorParallelSize | default 1) ($engine.pipelineParallelSize | default 1) ($engine.dataParallelSize | default 1) }}
{{- end }}

{{/* What kvtune knows of the engine's model (kvtune.models: its weights and geometry; empty when unknown). */}}
{{- define "kvtune.model" -}}
{{- index (include "kvtune.models" . | fromYaml) (.Values.engine.model | toString) | default dict | toYaml }}
{{- end }}

{{/* The weights' bytes in memory, from kvtune's table of known models (0: not known). */}}
{{- define "kvtune.weightBytes" -}}
{{- $bytes := (include "kvtune.model" . | fromYaml).weightBytes | default 0 }}
{{- mul $bytes (ternary 2 1 (eq .Values.engine.dtype "float32")) | int64 }}
{{- end }}

{{/* Requests sized from the model when `resources` gives none (documented in values.yaml): the weights pass
through host memory on load, so a node without room for them is not picked. cuda: weights + 4 GiB + 2 GiB
per GPU (one worker process each), 2 CPUs per GPU + 2; cpu: KV pool + weights + 2 GiB, 2 CPUs. A model not
in the table counts as 16 GiB of weights. */}}
{{- define "kvtune.defaultRequests" -}}
{{- $gib := 1073741824 }}
{{- $weights := include "kvtune.weightBytes" . | int64 | default (mul 16 $gib) }}
{{- if eq .Values.engine.device "cuda" }}
{{- $gpus := include "kvtune.gpusPerPod" . | int64 }}
cpu: {{ add 2 (mul 2 $gpus) | quote }}
memory: {{ printf "%dGi" (add (div (add $weights (sub $gib 1)) $gib) 4 (mul 2 $gpus)) | quote }}
{{- else }}
{{- $kv := .Values.engine.kvCacheMemoryBytes | default (mul 4 $gib) | int64 }}
cpu: "2"
memory: {{ printf "%dMi" (div (add $kv $weights (mul 2 $gib) 1048575) 1048576) | quote }}
{{- end }}
{{- end }}

{{/* The container's resources: `resources` as given, with the GPU limit (cuda) always set from the
parallel sizes, and the requests sized from the model where `resources` gives none. */}}
{{- define "kvtune.engineResources" -}}
{{- $resources := deepCopy (.Values.resources | default dict) }}
{{- if not $resources.requests }}
{{- $_ := set $resources "requests" (include "kvtune.defaultRequests" . | fromYaml) }}
{{- end }}
{{- if eq .Values.engine.device "cuda" }}
{{- $name := .Values.gpuResourceName }}
{{- $gpus := include "kvtune.gpusPerPod" . | int64 }}
{{- $limits := $resources.limits | default dict }}
{{- if and (hasKey $limits $name) (ne (toString (index $limits $name)) (toString $gpus)) }}
{{- fail (printf "resources.limits.%s is %v, but the engine runs %d rank(s) (engine.tensorParallelSize x pipelineParallelSize x dataParallelSize), one GPU each: remove it from resources (the chart sets it) or change the parallel sizes" $name (index $limits $name) $gpus) }}
{{- end }}
{{- $_ := set $limits $name $gpus }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/* Rolls the pods when anything the engine reads from values changes. */}}
{{- define "kvtune.configChecksum" -}}
{{- dict "engine" .Values.engine "modelSource" .Values.modelSource "kvEvents" .Values.kvEvents | toJson | sha256sum }}
{{- end }}

{{- define "kvtune.engineUrl" -}}
{{- printf "http://%s.%s.svc:%d" (include "kvtune.engineFullname" .) .Release.Namespace (.Values.service.port | int) }}
{{- end }}

{{/* The tokenizer Locust counts tokens with: the engine's own (its folder on the same volume, or its hub id
at its revision), unless locust.tokenizer names another. */}}
{{- define "kvtune.locustTokenizer" -}}
{{- $source := .Values.modelSource.source }}
{{- if .Values.locust.tokenizer }}
{{- .Values.locust.tokenizer }}
{{- else if eq $source "objectStorage" }}
{{- fail "locust.tokenizer: Locust cannot read the weights' object storage; name the model's tokenizer as a hub id (e.g. the model's own id)" }}
{{- else }}
{{- include "kvtune.modelPath" . }}
{{- end }}
{{- end }}

{{/* Locust's environment: the served name, the tokenizer (and the token a gated one needs, from the Secret
the engine gets it from), the engine's API key. */}}
{{- define "kvtune.locustEnv" -}}
- name: KVTUNE_MODEL
  value: {{ include "kvtune.servedModelName" . | quote }}
- name: KVTUNE_TOKENIZER
  value: {{ include "kvtune.locustTokenizer" . | quote }}
{{- if and .Values.engine.revision (not .Values.locust.tokenizer) (eq .Values.modelSource.source "hub") }}
- name: KVTUNE_TOKENIZER_REVISION
  value: {{ .Values.engine.revision | quote }}
{{- end }}
- name: HOME
  value: /tmp
{{- with .Values.engine.apiKeySecret }}{{ if .name }}
- name: KVTUNE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}{{ end }}
{{- if has "HF_TOKEN" (.Values.engine.secretEnv | default list) }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.engine.secretEnvSecret }}
      key: HF_TOKEN
{{- else }}
{{- with .Values.modelSource.hubTokenSecret }}{{ if .name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}{{ end }}
{{- end }}
{{- end }}

{{/* The model's volume in Locust's pods, read-only, when the tokenizer is read from it. */}}
{{- define "kvtune.locustModelVolume" -}}
{{- if and (eq .Values.modelSource.source "pvc") (not .Values.locust.tokenizer) }}
mounts:
  - name: models
    mountPath: /models
    readOnly: true
volumes:
  - name: models
    persistentVolumeClaim:
      claimName: {{ .Values.modelSource.pvc.claimName }}
      readOnly: true
{{- end }}
{{- end }}
