{{/* The release's engines. Without `engines`, one engine from the top-level values, named as the release;
with it, one engine per item: the top-level values overlaid by the item's own (maps merged key by key, a
value the item sets, null included, wins), its objects named RELEASE-kvtune-NAME. Each per-engine template
ranges over these and renders with a context like the root's whose .Values are that engine's values.

Values that belong to the top-level engine's model are not laid under an item that names its own model: it
serves under its own name (engine.servedModelName, else its model; the top-level one names another model, and
two engines under one name are one model to clients and to the Gateway's X-Gateway-Model-Name route), and
its revision and folder on the model volume are its own. */}}

{{- define "kvtune.modelTiedKeys" -}}
[[engine, servedModelName], [engine, revision], [modelSource, pvc, subPath]]
{{- end }}

{{- define "kvtune.engines" -}}
{{- $base := .Values }}
{{- $engines := list }}
{{- $tied := include "kvtune.modelTiedKeys" . | fromYamlArray }}
{{- range $item := .Values.engines | default list }}
{{- $values := include "kvtune.overlay" (dict "base" $base "top" (omit $item "name")) | fromJson }}
{{- if hasKey ($item.engine | default dict) "model" }}
{{- range $path := $tied }}
{{- $given := $item }}{{ $into := $values }}
{{- range $part := initial $path }}
{{- $given = index ($given | default dict) $part }}{{ $into = index $into $part }}
{{- end }}
{{- if not (hasKey ($given | default dict) (last $path)) }}{{ $_ := unset $into (last $path) }}{{ end }}
{{- end }}
{{- end }}
{{- $engines = append $engines (dict "name" $item.name "values" $values) }}
{{- end }}
{{- if not $engines }}{{ $engines = list (dict "name" "" "values" $base) }}{{ end }}
{{- toJson $engines }}
{{- end }}

{{/* BASE with TOP laid over it: maps merge key by key, anything else (a list, a null) replaces. (Sprig's
merge would keep a base value where the top one is false or null.) */}}
{{- define "kvtune.overlay" -}}
{{- $out := deepCopy .base }}
{{- range $key, $value := .top }}
{{- if and (kindIs "map" $value) (kindIs "map" (index $out $key)) }}
{{- $_ := set $out $key (include "kvtune.overlay" (dict "base" (index $out $key) "top" $value) | fromJson) }}
{{- else }}
{{- $_ := set $out $key $value }}
{{- end }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* A name made of BASE and SUFFIX that fits Kubernetes' 63 characters: as it is when it fits, else BASE
shortened and an 8-character hash of it in between, so two long release names never share a name. */}}
{{- define "kvtune.childName" -}}
{{- $name := printf "%s-%s" .base .suffix }}
{{- if le (len $name) 63 }}
{{- $name }}
{{- else }}
{{- $keep := sub 63 (add (len .suffix) 10) | int }}
{{- printf "%s-%s-%s" (trunc $keep .base | trimSuffix "-") (sha256sum .base | trunc 8) .suffix }}
{{- end }}
{{- end }}

{{/* The name of an engine's objects (its Deployment, Service, monitors, pool): the release's for the single
engine, RELEASE-kvtune-NAME for an item of `engines`. */}}
{{- define "kvtune.engineFullname" -}}
{{- if .engineName }}
{{- include "kvtune.childName" (dict "base" (include "kvtune.fullname" .) "suffix" .engineName) }}
{{- else }}
{{- include "kvtune.fullname" . }}
{{- end }}
{{- end }}

{{/* The engine Locust drives: locust.engine, else the first. */}}
{{- define "kvtune.locustEngine" -}}
{{- $engines := include "kvtune.engines" . | fromJsonArray }}
{{- $wanted := .Values.locust.engine }}
{{- $found := "" }}
{{- range $engines }}{{ if and (not $found) (or (not $wanted) (eq .name $wanted)) }}{{ $found = toJson . }}{{ end }}{{ end }}
{{- if not $found }}
{{- $names := list }}{{ range $engines }}{{ $names = append $names .name }}{{ end }}
{{- fail (printf "locust.engine: %q is not one of the release's engines (%s); name one of them, or leave it empty for the first" $wanted (join ", " $names)) }}
{{- end }}
{{- $found }}
{{- end }}

{{/* An engine's objects' labels. */}}
{{- define "kvtune.engineLabels" -}}
{{ include "kvtune.labels" . }}
app.kubernetes.io/component: engine
{{- if .engineName }}
kvtune.io/engine: {{ .engineName }}
{{- end }}
{{- end }}

{{/* The engine pods' nodeSelector: nodeSelector, plus node-feature-discovery's AVX-512 label for an fp8 KV
cache on vLLM's CPU build (it needs AVX-512; elsewhere vLLM refuses to start), unless
cpuFeatureNodeSelector is false. */}}
{{- define "kvtune.nodeSelector" -}}
{{- $selector := deepCopy (.Values.nodeSelector | default dict) }}
{{- $engine := .Values.engine }}
{{- if and (eq $engine.device "cpu") (hasPrefix "fp8" $engine.kvCacheDtype) .Values.cpuFeatureNodeSelector }}
{{- $_ := set $selector "feature.node.kubernetes.io/cpu-cpuid.AVX512F" "true" }}
{{- end }}
{{- toYaml $selector }}
{{- end }}
