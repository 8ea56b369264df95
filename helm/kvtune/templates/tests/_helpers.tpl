{{/* The chart's `helm test` pods (hooks: `helm test RELEASE` creates them, `helm install` does not). Each
runs one check script of files/release-checks/ (kvtune/helm/release_checks/) with the image's python3 and
prints PASS or FAIL lines; `helm test` runs them one at a time by hook weight and stops at the first that
fails. A re-run replaces them (before-hook-creation); a pod that passed is deleted once `helm test --logs`
has printed its log (Helm 4 applies delete policies after the logs), one that failed stays to be looked at. */}}

{{- define "kvtune.testName" -}}
{{- include "kvtune.childName" (dict "base" (include "kvtune.engineFullname" .root) "suffix" (printf "test-%s" .name)) }}
{{- end }}

{{- define "kvtune.testObjectMetadata" -}}
name: {{ include "kvtune.testName" . }}
labels:
  {{- include "kvtune.labels" .root | nindent 2 }}
  app.kubernetes.io/component: release-test
{{- end }}

{{- define "kvtune.testMetadata" -}}
{{ include "kvtune.testObjectMetadata" . }}
annotations:
  helm.sh/hook: test
  helm.sh/hook-weight: {{ .weight | quote }}
  helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
{{- end }}

{{/* The engine's address and served name, for the HTTP checks. */}}
{{- define "kvtune.testEngineEnv" -}}
- name: ENGINE_URL
  value: {{ include "kvtune.engineUrl" . | quote }}
- name: SERVED_MODEL
  value: {{ include "kvtune.servedModelName" . | quote }}
- name: REQUEST_TIMEOUT_SECONDS
  value: {{ .Values.tests.requestTimeoutSeconds | int | toString | quote }}
{{- end }}

{{/* The API key, for the checks that call /v1 (vLLM wants it there). Optional here, so a missing key is a
FAIL line naming the Secret rather than a pod that never starts. */}}
{{- define "kvtune.testApiKeyEnv" -}}
{{- with .Values.engine.apiKeySecret }}{{ if .name }}
- name: KVTUNE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
      optional: true
- name: API_KEY_SOURCE
  value: {{ printf "key %s of secret/%s" .key .name | quote }}
{{- end }}{{ end }}
{{- end }}

{{/* The objects the optional features made, as the objects check reads them (RELEASE_OBJECTS) and the test
Role grants them: check -> {"name"} or, for the dashboards, {"names", "labels"}. */}}
{{- define "kvtune.testObjects" -}}
{{- $fullname := include "kvtune.engineFullname" . }}
{{- $release := include "kvtune.fullname" . }}
{{- $monitoring := .Values.monitoring }}
{{- $pool := .Values.inferencePool }}
{{- $objects := dict }}
{{- if $monitoring.serviceMonitor.enabled }}{{ $_ := set $objects "serviceMonitor" (dict "name" $fullname) }}{{ end }}
{{- if $monitoring.podMonitor.enabled }}{{ $_ := set $objects "podMonitor" (dict "name" $fullname) }}{{ end }}
{{- if $monitoring.prometheusRule.enabled }}
{{- $rules := .Files.Get "files/kvtune-alerts.yaml" | fromYaml }}
{{- $alerts := dict }}
{{- range $rules.groups }}
{{- $names := list }}
{{- range .rules }}{{ if .alert }}{{ $names = append $names .alert }}{{ end }}{{ end }}
{{- $_ := set $alerts .name $names }}
{{- end }}
{{- $_ := set $objects "prometheusRule" (dict "name" $release "alerts" $alerts) }}
{{- end }}
{{- if $monitoring.dashboards.enabled }}
{{- $names := list }}
{{- range $path, $_ := .Files.Glob "files/dashboards/*.json" }}
{{- $names = append $names (include "kvtune.childName" (dict "base" $release "suffix" (base $path | trimSuffix ".json"))) }}
{{- end }}
{{- $labels := merge (dict "app.kubernetes.io/instance" .Release.Name) $monitoring.dashboards.labels }}
{{- $_ := set $objects "dashboards" (dict "names" $names "labels" $labels) }}
{{- end }}
{{- if .Values.autoscaling.hpa.enabled }}{{ $_ := set $objects "hpa" (dict "name" $fullname) }}{{ end }}
{{- if .Values.autoscaling.keda.enabled }}{{ $_ := set $objects "keda" (dict "name" $fullname) }}{{ end }}
{{- if $pool.enabled }}{{ $_ := set $objects "inferencePool" (dict "name" $fullname) }}{{ end }}
{{- if and $pool.enabled $pool.httpRoute.enabled }}{{ $_ := set $objects "httpRoute" (dict "name" $fullname) }}{{ end }}
{{- toJson $objects }}
{{- end }}

{{/* The Deployments the rollout check waits for: the engine's first, then Locust's when it drives this
engine. */}}
{{- define "kvtune.testDeployments" -}}
{{- $release := include "kvtune.fullname" . }}
{{- $names := list (include "kvtune.engineFullname" .) }}
{{- if and .Values.locust.enabled (eq (include "kvtune.locustEngine" . | fromJson).name .engineName) }}
{{- $names = append $names (include "kvtune.childName" (dict "base" $release "suffix" "locust-master")) }}
{{- if gt (int .Values.locust.workers) 0 }}{{ $names = append $names (include "kvtune.childName" (dict "base" $release "suffix" "locust-worker")) }}{{ end }}
{{- end }}
{{- toJson $names }}
{{- end }}

{{/* One check pod. Takes root, name, weight, script (a file of files/release-checks/), args, env (YAML) and
reader (true: runs as the test ServiceAccount, which may read the release's objects; else no token). */}}
{{- define "kvtune.testPod" -}}
{{- $root := .root }}
{{- $image := $root.Values.images.kvtune }}
{{- if eq $root.Values.tests.image "engine" }}{{ $image = include "kvtune.engineImage" $root | fromYaml }}{{ end -}}
apiVersion: v1
kind: Pod
metadata:
  {{- include "kvtune.testMetadata" . | nindent 2 }}
spec:
  restartPolicy: Never
  {{- if .reader }}
  serviceAccountName: {{ include "kvtune.testName" (dict "root" $root "name" "reader") }}
  {{- else }}
  automountServiceAccountToken: false
  {{- end }}
  {{- with $root.Values.images.pullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
    {{- end }}
  {{- end }}
  {{- /* The engine's nodes (and their taints): where its image is pulled already. */}}
  {{- with $root.Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    runAsNonRoot: true
    runAsUser: 1000
    runAsGroup: 1000
    seccompProfile:
      type: RuntimeDefault
  containers:
    - name: check
      image: {{ include "kvtune.image" $image }}
      imagePullPolicy: {{ $image.pullPolicy }}
      # Isolated, without site-packages: the check needs the standard library only.
      command:
        - python3
        - -I
        - -S
        - -B
        - -c
        - {{ $root.Files.Get (printf "files/release-checks/%s" .script) | toJson }}
      args:
        {{- range .args }}
        - {{ . | quote }}
        {{- end }}
      env:
        {{- .env | trim | nindent 8 }}
      resources:
        requests:
          cpu: 10m
          memory: 32Mi
        limits:
          cpu: 500m
          memory: 128Mi
      securityContext:
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: [ALL]
{{- end }}
