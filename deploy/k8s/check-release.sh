#!/usr/bin/env bash
# Checks a live kvtune Helm release end to end: the engine rolls out and answers the OpenAI API, exports
# the metrics kvtune's dashboards and alerts query, and each optional object the release turned on is
# there and working. One PASS/FAIL/SKIP line per check; exit 1 if any check failed, 2 on a usage error.
#
# Written for bash 3.2 and later (macOS' /bin/bash too): no associative arrays, no empty arrays under set -u.
set -euo pipefail

PROG=$(basename "$0")
KUBECTL=${KUBECTL:-kubectl}
HELM=${HELM:-helm}
TIMEOUT=${TIMEOUT:-1800s}
LOCUST_TIMEOUT=${LOCUST_TIMEOUT:-300s}
REQUEST_TIMEOUT=${REQUEST_TIMEOUT:-120}
PORT_FORWARD_WAIT=${PORT_FORWARD_WAIT:-30}
KUBECTL_REQUEST_TIMEOUT=${KUBECTL_REQUEST_TIMEOUT:-30s}

CHART=kvtune
# The chart's files/dashboards/*.json: one ConfigMap each, named FULLNAME-STEM.
DASHBOARD_STEMS="kvtune-kv-cache kvtune-latency-load kvtune-sweep"
# What kvtune's dashboards and alerts query: an engine without one of them shows empty panels.
REQUIRED_METRICS="vllm:prefix_cache_queries_total vllm:kv_cache_usage_perc vllm:num_preemptions_total
vllm:time_to_first_token_seconds_bucket"
ALERT_GROUP=kvtune
ALERT_NAME=KvtuneTtftP99AboveSlo

usage() {
    cat <<EOF
usage: $PROG RELEASE [NAMESPACE]

Checks a live kvtune Helm release end to end and prints one PASS/FAIL/SKIP line per check:
  helm values      which optional features the release turned on (helm get values; without helm,
                   detected from the objects present)
  rollout          the engine Deployment rolls out and every engine pod is Ready
  engine API       through a port-forward: /health, /v1/models lists the served model, /v1/completions
                   answers, the API key is enforced (when one is configured), /metrics has the metrics
                   kvtune's dashboards and alerts query
  optional objects ServiceMonitor/PodMonitor/PrometheusRule, dashboard ConfigMaps, HPA or KEDA
                   ScaledObject, InferencePool and HTTPRoute, Locust master and its web UI
Exits 0 when every check passed or was skipped, 1 when one failed, 2 on a usage error.

NAMESPACE defaults to the current kubectl context's namespace, else "default".

Environment:
  KUBECTL            kubectl binary (default: kubectl)
  HELM               helm binary (default: helm; optional)
  TIMEOUT            how long the engine Deployment may take to roll out (default: 1800s; model loads are slow)
  LOCUST_TIMEOUT     how long the Locust Deployments may take to roll out (default: 300s)
  REQUEST_TIMEOUT    seconds each HTTP request may take (default: 120)
  PORT_FORWARD_WAIT  seconds a port-forward may take to start (default: 30)

Needs kubectl, curl and python3.
EOF
}

usage_error() {
    printf '%s: %s\n\n' "$PROG" "$1" >&2
    usage >&2
    exit 2
}

die() {
    printf '%s: %s\n' "$PROG" "$1" >&2
    exit 2
}

# ---- results ---------------------------------------------------------------------------------------------

PASSED=0
FAILED=0
SKIPPED=0

# One line per check, whatever the command printed: newlines folded, long output cut.
oneline() {
    tr '\n\t' '  ' | sed 's/  */ /g; s/ $//' | cut -c1-400
}

report() {
    printf '%s  %s: %s\n' "$1" "$2" "$(printf '%s' "$3" | oneline)"
}
pass() { PASSED=$((PASSED + 1)); report PASS "$1" "$2"; }
fail() { FAILED=$((FAILED + 1)); report FAIL "$1" "$2"; }
skip() { SKIPPED=$((SKIPPED + 1)); report SKIP "$1" "$2"; }

# ---- running commands ------------------------------------------------------------------------------------

# Runs a command, leaving its stdout in OUT and the last line of its stderr in ERR (kubectl logs its
# retries first and says what went wrong last); returns its status.
capture() {
    local rc=0
    OUT=$("$@" 2>"$WORK/stderr") || rc=$?
    ERR=$(grep -v '^[[:space:]]*$' "$WORK/stderr" | tail -n 1 | oneline || true)
    return "$rc"
}

# kubectl in the release's namespace.
k() {
    "$KUBECTL" -n "$NAMESPACE" "$@"
}

# A kubectl read: bounded, so an unreachable API server fails the check instead of hanging it.
kget() {
    "$KUBECTL" -n "$NAMESPACE" --request-timeout="$KUBECTL_REQUEST_TIMEOUT" get "$@"
}

# Runs a Python snippet, mostly on JSON from kubectl, helm or the engine: python3 is about everywhere,
# jq often is not.
py() {
    python3 -c "$@"
}

# ---- port-forwards ---------------------------------------------------------------------------------------

PF_PIDS=""

cleanup() {
    local pid
    # Only the port-forwards this script started, by PID.
    for pid in $PF_PIDS; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    if [ -n "${WORK:-}" ]; then rm -rf "$WORK"; fi
}

free_port() {
    py 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# Starts `kubectl port-forward TARGET LOCAL:REMOTE` in the background; sets PF_PORT, or PF_ERR and returns 1.
# Not called in $(...): the background process must belong to this shell for the trap to stop it.
start_port_forward() {
    local target=$1 remote=$2 log pid tries=0
    PF_PORT=$(free_port)
    PF_ERR=""
    log="$WORK/port-forward-$PF_PORT.log"
    # kubectl itself, not through the k function: a function in the background runs in a subshell, and
    # $! would be that subshell's PID, leaving kubectl running when the trap kills it.
    "$KUBECTL" -n "$NAMESPACE" port-forward --address 127.0.0.1 "$target" "$PF_PORT:$remote" >"$log" 2>&1 &
    pid=$!
    PF_PIDS="$PF_PIDS $pid"
    # kubectl prints this line once it listens; before that a request would be refused.
    until grep -q 'Forwarding from' "$log"; do
        if ! kill -0 "$pid" 2>/dev/null; then
            PF_ERR="kubectl port-forward $target exited: $(oneline <"$log")"
            return 1
        fi
        if [ "$tries" -ge $((PORT_FORWARD_WAIT * 2)) ]; then
            PF_ERR="kubectl port-forward $target not listening after ${PORT_FORWARD_WAIT}s: $(oneline <"$log")"
            return 1
        fi
        sleep 0.5
        tries=$((tries + 1))
    done
}

# ---- HTTP ------------------------------------------------------------------------------------------------

AUTH_HEADER_FILE=""
API_KEY_ERR=""

# http METHOD URL BODY_FILE [curl args...]: prints the status code (000 when nothing answered; the reason
# is in $WORK/curl.err). The API key, when there is one, goes in a header file, not on curl's command line.
http() {
    local method=$1 url=$2 body=$3
    shift 3
    curl -sS -X "$method" -o "$body" -w '%{http_code}' --max-time "$REQUEST_TIMEOUT" \
        "$@" "$url" 2>"$WORK/curl.err" || true
}

# The same with the API key, when one is configured.
api() {
    if [ -n "$AUTH_HEADER_FILE" ]; then
        http "$@" -H "@$AUTH_HEADER_FILE"
    else
        http "$@"
    fi
}

# What came back: the status and the start of the body, or curl's complaint.
seen() {
    local code=$1 body=$2
    if [ "$code" = 000 ]; then
        printf 'no answer (%s)' "$(oneline <"$WORK/curl.err")"
    else
        printf 'HTTP %s: %s' "$code" "$(head -c 200 "$body" | oneline)"
    fi
}

# ---- the release -----------------------------------------------------------------------------------------

# kvtune.fullname in helm/kvtune/templates/_helpers.tpl: trunc 63, then one trailing "-" dropped.
fullname() {
    local name
    case "$1" in
        *"$CHART"*) name=$1 ;;
        *) name="$1-$CHART" ;;
    esac
    name=${name:0:63}
    printf '%s' "${name%-}"
}

dashboard_configmap() {
    local name="$FULLNAME-$1"
    name=${name:0:63}
    printf '%s' "${name%-}"
}

resolve_namespace() {
    if [ -n "${NAMESPACE:-}" ]; then return; fi
    NAMESPACE=$("$KUBECTL" config view --minify -o 'jsonpath={..namespace}' 2>/dev/null || true)
    NAMESPACE=${NAMESPACE:-default}
}

# Feature flags: FEAT_<name> is on or off. FEATURES_FROM says where they came from, for the SKIP lines.
FEATURE_NAMES="servicemonitor podmonitor prometheusrule dashboards hpa keda inferencepool httproute locust"
FEAT_dashboard_labels="grafana_dashboard=1"
FEAT_locust_workers=0
FEATURES_FROM=values

set_feature() {
    case "$1" in
        servicemonitor | podmonitor | prometheusrule | dashboards | hpa | keda | inferencepool | httproute | \
            locust | dashboard_labels | locust_workers) printf -v "FEAT_$1" '%s' "$2" ;;
        *) die "internal error: unknown feature $1" ;;
    esac
}

feature() {
    local var="FEAT_$1"
    printf '%s' "${!var:-off}"
}

features_on() {
    local name list=""
    for name in $FEATURE_NAMES; do
        if [ "$(feature "$name")" = on ]; then list="$list $name"; fi
    done
    printf '%s' "${list# }"
}

# The values the chart was rendered with (-a: defaults included), as "feature value" lines.
VALUES_TO_FEATURES='
import json, sys

values = json.load(sys.stdin)

def get(*path, default=None):
    node = values
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node

def flag(name, *path):
    print(name, "on" if get(*path, default=False) is True else "off")

flag("servicemonitor", "monitoring", "serviceMonitor", "enabled")
flag("podmonitor", "monitoring", "podMonitor", "enabled")
flag("prometheusrule", "monitoring", "prometheusRule", "enabled")
flag("dashboards", "monitoring", "dashboards", "enabled")
flag("hpa", "autoscaling", "hpa", "enabled")
flag("keda", "autoscaling", "keda", "enabled")
flag("inferencepool", "inferencePool", "enabled")
print("httproute", "on" if get("inferencePool", "enabled") and get("inferencePool", "httpRoute", "enabled")
      else "off")
flag("locust", "locust", "enabled")
labels = get("monitoring", "dashboards", "labels", default={}) or {}
print("dashboard_labels", ",".join(f"{key}={value}" for key, value in labels.items()))
print("locust_workers", int(get("locust", "workers", default=0) or 0))
'

features_from_helm() {
    local key value
    if ! capture "$HELM" get values "$RELEASE" -n "$NAMESPACE" -a -o json; then
        return 1
    fi
    if ! printf '%s' "$OUT" | py "$VALUES_TO_FEATURES" >"$WORK/features" 2>"$WORK/stderr"; then
        ERR="unreadable values ($(tail -n 1 "$WORK/stderr")): $(printf '%s' "$OUT" | head -c 200)"
        return 1
    fi
    while read -r key value; do
        set_feature "$key" "${value:-}"
    done <"$WORK/features"
}

exists() {
    kget "$1" "$2" -o name >/dev/null 2>&1
}

# Without helm: a feature is on when its object is there (a missing CRD reads as off too).
features_from_objects() {
    FEATURES_FROM=objects
    local pair on_off kind name
    for pair in servicemonitor:servicemonitors.monitoring.coreos.com \
        podmonitor:podmonitors.monitoring.coreos.com \
        prometheusrule:prometheusrules.monitoring.coreos.com \
        hpa:horizontalpodautoscalers.autoscaling \
        keda:scaledobjects.keda.sh \
        inferencepool:inferencepools.inference.networking.k8s.io \
        httproute:httproutes.gateway.networking.k8s.io; do
        name=${pair%%:*}
        kind=${pair#*:}
        if exists "$kind" "$FULLNAME"; then on_off=on; else on_off=off; fi
        set_feature "$name" "$on_off"
    done
    if exists configmap "$(dashboard_configmap "${DASHBOARD_STEMS%% *}")"; then set_feature dashboards on; fi
    if exists deployment "$FULLNAME-locust-master"; then set_feature locust on; fi
    if capture kget deployment "$FULLNAME-locust-worker" -o 'jsonpath={.spec.replicas}'; then
        set_feature locust_workers "${OUT:-0}"
    fi
}

check_values() {
    local on
    if ! command -v "$HELM" >/dev/null 2>&1; then
        features_from_objects
        on=$(features_on)
        skip "helm values" "$HELM not on PATH; features detected from the objects present, on: ${on:-none}"
    elif features_from_helm; then
        on=$(features_on)
        pass "helm values" "release $RELEASE, features on: ${on:-none}"
    else
        # Without the values the checks below still run, on what is there.
        local why=$ERR
        features_from_objects
        on=$(features_on)
        fail "helm values" "helm get values $RELEASE -n $NAMESPACE: $why; features detected from the objects present, on: ${on:-none}"
    fi
}

# Why a feature's checks are skipped; $1 names the object that would have turned it on.
off_reason() {
    if [ "$FEATURES_FROM" = values ]; then
        printf "off in the release's values"
    else
        printf 'no %s found' "$1"
    fi
}

# ---- the engine ------------------------------------------------------------------------------------------

ENGINE_SELECTOR=""
ENGINE_SPEC_ERR=""
SERVED_MODEL=""
API_KEY_SECRET=""
API_KEY_KEY=""

# From the live Deployment (what runs, whatever the values say): the served name and the API key's Secret.
DEPLOYMENT_TO_ENGINE='
import json, sys

spec = json.load(sys.stdin)["spec"]["template"]["spec"]
vllm = next((c for c in spec.get("containers", []) if c.get("name") == "vllm"), None)
if vllm is None:
    sys.exit("no container named vllm")
args = list(vllm.get("command", [])) + list(vllm.get("args", []))

def flag(name):
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return ""

print("served", flag("--served-model-name") or flag("--model"))
for env in vllm.get("env", []):
    ref = (env.get("valueFrom") or {}).get("secretKeyRef") or {}
    if env.get("name") == "VLLM_API_KEY" and ref:
        print("secret", ref["name"])
        print("key", ref["key"])
'

read_engine_spec() {
    local key value
    if ! capture kget deployment "$FULLNAME" -o json; then
        return 1
    fi
    if ! printf '%s' "$OUT" | py "$DEPLOYMENT_TO_ENGINE" >"$WORK/engine" 2>"$WORK/stderr"; then
        ERR=$(oneline <"$WORK/stderr")
        return 1
    fi
    while read -r key value; do
        case "$key" in
            served) SERVED_MODEL=$value ;;
            secret) API_KEY_SECRET=$value ;;
            key) API_KEY_KEY=$value ;;
        esac
    done <"$WORK/engine"
}

PODS_READY='
import json, sys

pods = [p for p in json.load(sys.stdin)["items"] if not p["metadata"].get("deletionTimestamp")]
def ready(pod):
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
waiting = [p["metadata"]["name"] + " (" + p.get("status", {}).get("phase", "?") + ")"
           for p in pods if not ready(p)]
print(f"{len(pods) - len(waiting)}/{len(pods)} engine pods Ready" + (": not Ready " + ", ".join(waiting)
      if waiting else ""))
sys.exit(0 if pods and not waiting else 1)
'

check_rollout() {
    if capture k rollout status "deployment/$FULLNAME" --timeout="$TIMEOUT"; then
        pass rollout "deployment/$FULLNAME: $(printf '%s' "$OUT" | tail -n 1)"
    else
        fail rollout "deployment/$FULLNAME not rolled out (waited up to $TIMEOUT): $ERR $(printf '%s' "$OUT" |
            tail -n 1)"
        return 1
    fi
}

check_engine_pods() {
    local summary
    if ! capture kget pods -l "$ENGINE_SELECTOR" -o json; then
        fail "engine pods" "kubectl get pods -l $ENGINE_SELECTOR failed: $ERR"
        return 1
    fi
    if summary=$(printf '%s' "$OUT" | py "$PODS_READY" 2>&1); then
        pass "engine pods" "$summary"
    else
        fail "engine pods" "${summary:-no pods match $ENGINE_SELECTOR}"
        return 1
    fi
}

check_health() {
    local code
    code=$(http GET "$1/health" "$WORK/health")
    if [ "$code" = 200 ]; then pass "GET /health" "HTTP 200"; else fail "GET /health" "$(seen "$code" "$WORK/health")"; fi
}

MODELS_LISTS='
import json, sys

ids = [m.get("id") for m in json.load(open(sys.argv[1])).get("data", [])]
print("lists " + ", ".join(map(str, ids)))
sys.exit(0 if sys.argv[2] in ids else 1)
'

check_models() {
    local code listed
    if [ -z "$SERVED_MODEL" ]; then
        fail "GET /v1/models" "served model name unknown: ${ENGINE_SPEC_ERR:-no --served-model-name or --model}"
        return
    fi
    code=$(api GET "$1/v1/models" "$WORK/models")
    if [ "$code" != 200 ]; then
        fail "GET /v1/models" "$(seen "$code" "$WORK/models")"
    elif listed=$(py "$MODELS_LISTS" "$WORK/models" "$SERVED_MODEL" 2>&1); then
        pass "GET /v1/models" "$listed"
    else
        fail "GET /v1/models" "$SERVED_MODEL not listed: $listed"
    fi
}

# The key as vLLM reads it (VLLM_API_KEY from the Secret), into a header file only this user can read.
load_api_key() {
    local encoded path
    # jsonpath needs the dots in a key escaped (sed: bash versions differ on backslashes in ${x//./...}).
    path=$(printf '%s' "$API_KEY_KEY" | sed 's/\./\\./g')
    if ! capture kget secret "$API_KEY_SECRET" -o "jsonpath={.data.$path}"; then
        return 1
    fi
    encoded=$OUT
    if [ -z "$encoded" ]; then
        ERR="secret/$API_KEY_SECRET has no key $API_KEY_KEY"
        return 1
    fi
    (
        umask 077
        printf 'Authorization: Bearer %s\n' "$(printf '%s' "$encoded" | base64 -d)" >"$WORK/auth-header"
    )
    AUTH_HEADER_FILE="$WORK/auth-header"
}

check_api_key() {
    local without with
    if [ -z "$API_KEY_SECRET" ]; then
        skip "API key" "none configured (deployment/$FULLNAME sets no VLLM_API_KEY from a Secret)"
        return
    fi
    if [ -z "$AUTH_HEADER_FILE" ]; then
        fail "API key" "could not read key $API_KEY_KEY of secret/$API_KEY_SECRET: $API_KEY_ERR"
        return
    fi
    without=$(http GET "$1/v1/models" "$WORK/no-key")
    with=$(api GET "$1/v1/models" "$WORK/with-key")
    if [ "$without" = 401 ] && [ "$with" = 200 ]; then
        pass "API key" "/v1/models without the key: HTTP 401, with the key from secret/$API_KEY_SECRET: HTTP 200"
    else
        fail "API key" "/v1/models without the key: $(seen "$without" "$WORK/no-key") (want 401); with it: $(seen "$with" "$WORK/with-key") (want 200)"
    fi
}

COMPLETION_REQUEST='
import json, sys

print(json.dumps({"model": sys.argv[1], "prompt": "The capital of France is", "max_tokens": 8}))
'

COMPLETION_CHOICES='
import json, sys

choices = json.load(open(sys.argv[1])).get("choices") or []
if not choices:
    sys.exit("no choices in the answer")
text = choices[0].get("text")
print(f"{len(choices)} choice(s), text {text!r}")
'

check_completion() {
    local code result
    if [ -z "$SERVED_MODEL" ]; then
        fail "POST /v1/completions" "served model name unknown: ${ENGINE_SPEC_ERR:-no --served-model-name or --model}"
        return
    fi
    py "$COMPLETION_REQUEST" "$SERVED_MODEL" >"$WORK/completion-request"
    code=$(api POST "$1/v1/completions" "$WORK/completion" -H 'Content-Type: application/json' \
        --data-binary "@$WORK/completion-request")
    if [ "$code" != 200 ]; then
        fail "POST /v1/completions" "$(seen "$code" "$WORK/completion")"
    elif result=$(py "$COMPLETION_CHOICES" "$WORK/completion" 2>&1); then
        pass "POST /v1/completions" "max_tokens 8: $result"
    else
        fail "POST /v1/completions" "$result: $(seen "$code" "$WORK/completion")"
    fi
}

check_metrics() {
    local code metric missing=""
    code=$(api GET "$1/metrics" "$WORK/metrics")
    if [ "$code" != 200 ]; then
        fail "GET /metrics" "$(seen "$code" "$WORK/metrics")"
        return
    fi
    for metric in $REQUIRED_METRICS; do
        # A sample line: the name, then its labels or its value.
        if ! grep -q "^${metric}[{ ]" "$WORK/metrics"; then missing="$missing $metric"; fi
    done
    if [ -z "$missing" ]; then
        pass "GET /metrics" "has $(printf '%s' "$REQUIRED_METRICS" | tr '\n' ' ')"
    else
        fail "GET /metrics" "missing:$missing"
    fi
}

check_engine_api() {
    local port base check
    if [ "${1:-}" = skip ]; then
        for check in "GET /health" "GET /v1/models" "API key" "POST /v1/completions" "GET /metrics"; do
            skip "$check" "the engine is not rolled out and Ready"
        done
        return
    fi
    if ! capture kget service "$FULLNAME" -o 'jsonpath={.spec.ports[?(@.name=="http")].port}'; then
        fail "engine port-forward" "could not read service/$FULLNAME: $ERR"
        return
    fi
    port=${OUT:-8000}
    if ! start_port_forward "service/$FULLNAME" "$port"; then
        fail "engine port-forward" "$PF_ERR"
        return
    fi
    pass "engine port-forward" "service/$FULLNAME:$port on 127.0.0.1:$PF_PORT"
    base="http://127.0.0.1:$PF_PORT"
    # Every /v1 request needs the key when vLLM has one: read it before the first.
    if [ -n "$API_KEY_SECRET" ] && ! load_api_key; then API_KEY_ERR=$ERR; fi
    check_health "$base"
    check_models "$base"
    check_api_key "$base"
    check_completion "$base"
    check_metrics "$base"
}

# ---- optional objects ------------------------------------------------------------------------------------

check_exists() {
    local check=$1 feature=$2 kind=$3 label=$4
    if [ "$(feature "$feature")" != on ]; then
        skip "$check" "$(off_reason "$label $FULLNAME")"
        return 1
    fi
    if capture kget "$kind" "$FULLNAME" -o json; then
        return 0
    fi
    fail "$check" "$label $FULLNAME: $ERR"
    return 1
}

check_monitors() {
    if check_exists servicemonitor servicemonitor servicemonitors.monitoring.coreos.com ServiceMonitor; then
        pass servicemonitor "ServiceMonitor $FULLNAME exists"
    fi
    if check_exists podmonitor podmonitor podmonitors.monitoring.coreos.com PodMonitor; then
        pass podmonitor "PodMonitor $FULLNAME exists"
    fi
}

RULE_HAS_ALERT='
import json, sys

group_name, alert = sys.argv[1], sys.argv[2]
groups = json.load(sys.stdin).get("spec", {}).get("groups", [])
group = next((g for g in groups if g.get("name") == group_name), None)
if group is None:
    names = [g.get("name") for g in groups]
    sys.exit(f"no group {group_name} (groups: {names})")
alerts = [r["alert"] for r in group.get("rules", []) if "alert" in r]
print(f"group {group_name}: {len(alerts)} alerts, among them {alert}" if alert in alerts
      else f"group {group_name} lacks {alert} (has {alerts})")
sys.exit(0 if alert in alerts else 1)
'

check_prometheus_rule() {
    local result
    if ! check_exists prometheusrule prometheusrule prometheusrules.monitoring.coreos.com PrometheusRule; then
        return
    fi
    if result=$(printf '%s' "$OUT" | py "$RULE_HAS_ALERT" "$ALERT_GROUP" "$ALERT_NAME" 2>&1); then
        pass prometheusrule "PrometheusRule $FULLNAME: $result"
    else
        fail prometheusrule "PrometheusRule $FULLNAME: $result"
    fi
}

check_dashboards() {
    local stem name selector found missing="" names=""
    if [ "$(feature dashboards)" != on ]; then
        skip dashboards "$(off_reason "ConfigMap $(dashboard_configmap "${DASHBOARD_STEMS%% *}")")"
        return
    fi
    # The labels Grafana's sidecar selects on, with the release's own so other releases do not count.
    selector="app.kubernetes.io/instance=$RELEASE${FEAT_dashboard_labels:+,$FEAT_dashboard_labels}"
    if ! capture kget configmap -l "$selector" -o 'jsonpath={range .items[*]}{.metadata.name}{"\n"}{end}'; then
        fail dashboards "kubectl get configmap -l $selector failed: $ERR"
        return
    fi
    found=$OUT
    for stem in $DASHBOARD_STEMS; do
        name=$(dashboard_configmap "$stem")
        if printf '%s\n' "$found" | grep -qx -- "$name"; then
            names="$names $name"
        else
            missing="$missing $name"
        fi
    done
    if [ -z "$missing" ]; then
        pass dashboards "ConfigMaps labelled $selector:$names"
    else
        fail dashboards "missing, or not labelled $selector:$missing"
    fi
}

check_hpa() {
    local current desired active reason message
    if [ "$(feature hpa)" != on ]; then
        skip hpa "$(off_reason "HorizontalPodAutoscaler $FULLNAME")"
        return
    fi
    # Fields joined by "|": an empty one (no status yet) keeps its place, as a space would not under read.
    local fields='{.status.currentReplicas}|{.status.desiredReplicas}'
    fields+='|{.status.conditions[?(@.type=="ScalingActive")].status}'
    fields+='|{.status.conditions[?(@.type=="ScalingActive")].reason}'
    fields+='|{.status.conditions[?(@.type=="ScalingActive")].message}'
    if ! capture kget horizontalpodautoscalers.autoscaling "$FULLNAME" -o "jsonpath=$fields"; then
        fail hpa "HorizontalPodAutoscaler $FULLNAME: $ERR"
        return
    fi
    IFS='|' read -r current desired active reason message <<<"$OUT" || true
    # ScalingActive is False while the HPA cannot read its metric (no custom-metrics adapter serving it).
    if [ "$active" = True ]; then
        pass hpa "HorizontalPodAutoscaler $FULLNAME: replicas $current, desired $desired, ScalingActive ($reason)"
    else
        fail hpa "HorizontalPodAutoscaler $FULLNAME: replicas ${current:-?}, desired ${desired:-?}, ScalingActive=${active:-unset} ${reason:-} ${message:-}"
    fi
}

check_scaled_object() {
    local ready active hpa message
    if [ "$(feature keda)" != on ]; then
        skip keda "$(off_reason "ScaledObject $FULLNAME")"
        return
    fi
    local fields='{.status.conditions[?(@.type=="Ready")].status}'
    fields+='|{.status.conditions[?(@.type=="Active")].status}'
    fields+='|{.status.hpaName}'
    fields+='|{.status.conditions[?(@.type=="Ready")].message}'
    if ! capture kget scaledobjects.keda.sh "$FULLNAME" -o "jsonpath=$fields"; then
        fail keda "ScaledObject $FULLNAME: $ERR"
        return
    fi
    IFS='|' read -r ready active hpa message <<<"$OUT" || true
    if [ "$ready" = True ]; then
        pass keda "ScaledObject $FULLNAME: Ready, Active=${active:-unset}, HPA ${hpa:-none yet}"
    else
        fail keda "ScaledObject $FULLNAME: Ready=${ready:-unset} ${message:-}"
    fi
}

ROUTE_ACCEPTED='
import json, sys

parents = json.load(sys.stdin).get("status", {}).get("parents", [])
if not parents:
    sys.exit("no status from any Gateway yet (is a Gateway controller running, and the Gateway named right?)")
seen, ok = [], True
for parent in parents:
    accepted = next((c for c in parent.get("conditions", []) if c.get("type") == "Accepted"), {})
    ok = ok and accepted.get("status") == "True"
    gateway = parent.get("parentRef", {}).get("name")
    status, reason = accepted.get("status", "unset"), accepted.get("reason", "")
    seen.append(f"{gateway}: Accepted={status} {reason}")
print("; ".join(seen))
sys.exit(0 if ok else 1)
'

check_inference_pool() {
    local result
    if check_exists inferencepool inferencepool inferencepools.inference.networking.k8s.io InferencePool; then
        pass inferencepool "InferencePool $FULLNAME exists"
    fi
    if ! check_exists httproute httproute httproutes.gateway.networking.k8s.io HTTPRoute; then
        return
    fi
    if result=$(printf '%s' "$OUT" | py "$ROUTE_ACCEPTED" 2>&1); then
        pass httproute "HTTPRoute $FULLNAME: $result"
    else
        fail httproute "HTTPRoute $FULLNAME: $result"
    fi
}

LOCUST_STATS='
import json, sys

try:
    stats = json.load(open(sys.argv[1]))
except ValueError as error:
    sys.exit(f"not JSON ({error})")
if not isinstance(stats, dict):
    sys.exit("not a JSON object")
state, users, workers = stats.get("state"), stats.get("user_count"), stats.get("worker_count")
print(f"JSON: state {state}, users {users}, workers {workers}")
'

check_locust() {
    local port code result
    if [ "$(feature locust)" != on ]; then
        skip locust "$(off_reason "Deployment $FULLNAME-locust-master")"
        return
    fi
    if capture k rollout status "deployment/$FULLNAME-locust-master" --timeout="$LOCUST_TIMEOUT"; then
        pass "locust master" "deployment/$FULLNAME-locust-master Ready"
    else
        fail "locust master" "deployment/$FULLNAME-locust-master not Ready within $LOCUST_TIMEOUT: $ERR"
        return
    fi
    if [ "${FEAT_locust_workers:-0}" -gt 0 ]; then
        if capture k rollout status "deployment/$FULLNAME-locust-worker" --timeout="$LOCUST_TIMEOUT"; then
            pass "locust workers" "deployment/$FULLNAME-locust-worker: $FEAT_locust_workers worker(s) rolled out"
        else
            fail "locust workers" "deployment/$FULLNAME-locust-worker not rolled out within $LOCUST_TIMEOUT: $ERR"
        fi
    fi
    if ! capture kget service "$FULLNAME-locust" -o 'jsonpath={.spec.ports[?(@.name=="web")].port}'; then
        fail "locust web UI" "could not read service/$FULLNAME-locust: $ERR"
        return
    fi
    port=${OUT:-8089}
    if ! start_port_forward "service/$FULLNAME-locust" "$port"; then
        fail "locust web UI" "$PF_ERR"
        return
    fi
    code=$(http GET "http://127.0.0.1:$PF_PORT/" "$WORK/locust-index")
    if [ "$code" = 200 ]; then
        pass "locust web UI" "GET / on service/$FULLNAME-locust:$port: HTTP 200"
    else
        fail "locust web UI" "GET /: $(seen "$code" "$WORK/locust-index")"
    fi
    code=$(http GET "http://127.0.0.1:$PF_PORT/stats/requests" "$WORK/locust-stats")
    if [ "$code" != 200 ]; then
        fail "locust stats" "GET /stats/requests: $(seen "$code" "$WORK/locust-stats")"
    elif result=$(py "$LOCUST_STATS" "$WORK/locust-stats" 2>&1); then
        pass "locust stats" "GET /stats/requests: $result"
    else
        fail "locust stats" "GET /stats/requests: $result"
    fi
}

# ---- main ------------------------------------------------------------------------------------------------

parse_args() {
    RELEASE=""
    NAMESPACE=""
    local positional=0 arg
    for arg in "$@"; do
        case "$arg" in
            -h | --help)
                usage
                exit 0
                ;;
            -*) usage_error "unknown option $arg" ;;
            *)
                positional=$((positional + 1))
                case $positional in
                    1) RELEASE=$arg ;;
                    2) NAMESPACE=$arg ;;
                    *) usage_error "too many arguments" ;;
                esac
                ;;
        esac
    done
    if [ -z "$RELEASE" ]; then usage_error "RELEASE is required"; fi
    # kubectl wants a unit; a bare number means seconds.
    case "$TIMEOUT" in *[!0-9]*) ;; *) TIMEOUT="${TIMEOUT}s" ;; esac
    case "$LOCUST_TIMEOUT" in *[!0-9]*) ;; *) LOCUST_TIMEOUT="${LOCUST_TIMEOUT}s" ;; esac
    case "$REQUEST_TIMEOUT$PORT_FORWARD_WAIT" in
        *[!0-9]*) usage_error "REQUEST_TIMEOUT and PORT_FORWARD_WAIT are whole seconds" ;;
    esac
}

require_tools() {
    command -v "$KUBECTL" >/dev/null 2>&1 || die "kubectl not found ($KUBECTL): install it, or set KUBECTL"
    command -v curl >/dev/null 2>&1 || die "curl not found: install it (Debian/Ubuntu: apt-get install curl)"
    command -v python3 >/dev/null 2>&1 || die "python3 not found: install it"
}

main() {
    parse_args "$@"
    require_tools
    WORK=$(mktemp -d)
    trap cleanup EXIT
    # Turn Ctrl-C and kill into an ordinary exit, so the EXIT trap stops the port-forwards.
    trap 'exit 130' INT
    trap 'exit 143' TERM
    resolve_namespace
    FULLNAME=$(fullname "$RELEASE")
    ENGINE_SELECTOR="app.kubernetes.io/instance=$RELEASE,app.kubernetes.io/component=engine"
    echo "Checking kvtune release $RELEASE in namespace $NAMESPACE (objects named $FULLNAME)"

    check_values
    if ! read_engine_spec; then ENGINE_SPEC_ERR="could not read deployment/$FULLNAME: $ERR"; fi
    # Both, even when the rollout failed: the pods' phases say why.
    local engine_up=yes
    check_rollout || engine_up=no
    check_engine_pods || engine_up=no
    if [ "$engine_up" = yes ]; then check_engine_api; else check_engine_api skip; fi
    check_monitors
    check_prometheus_rule
    check_dashboards
    check_hpa
    check_scaled_object
    check_inference_pool
    check_locust

    echo "$PASSED passed, $FAILED failed, $SKIPPED skipped"
    if [ "$FAILED" -gt 0 ]; then exit 1; fi
}

main "$@"
