#!/usr/bin/env bash
# Checks a live kvtune Helm release with the chart's own test pods (helm/kvtune/templates/tests/): `helm test`
# runs them inside the cluster, so nothing needs a port-forward. Each prints PASS/FAIL lines: the Deployments
# roll out and the engine pods are Ready; /health; /v1/models lists the served name; the API key is enforced
# (when one is set); a completion; /metrics has every metric kvtune's dashboards and alerts query; each
# optional object that is on (monitors, PrometheusRule, dashboards, HPA/KEDA, InferencePool, HTTPRoute);
# Locust's web UI. This wrapper adds what only a client can say: a release without test pods, and a summary.
#
# Written for bash 3.2 and later (macOS' /bin/bash too).
set -euo pipefail

PROG=$(basename "$0")
HELM=${HELM:-helm}
# helm test's wait for each pod; the rollout pod alone may wait tests.rolloutTimeoutSeconds (default 1800).
TIMEOUT=${TIMEOUT:-40m}

usage() {
    cat <<EOF
usage: $PROG RELEASE [NAMESPACE]

Runs \`helm test RELEASE --logs\`: the kvtune chart's test pods check the release from inside the cluster
and print one PASS/FAIL line per check (rollout and engine pods Ready, /health, /v1/models, the API key,
a completion, the metrics the dashboards and alerts query, each optional object, Locust's web UI).
helm test runs the pods one at a time and stops at the first that fails.
Exits 0 when every test pod passed, 1 when one failed or the release has none, 2 on a usage error.

NAMESPACE defaults to the current kubectl context's namespace, as with helm.

Environment:
  HELM     helm binary (default: helm)
  TIMEOUT  how long helm waits for each test pod (default: 40m; the rollout pod waits up to the chart's
           tests.rolloutTimeoutSeconds for the model to load)

Needs helm (4 prints every pod's log; with helm 3, read a failed pod's with kubectl logs).
EOF
}

usage_error() {
    printf '%s: %s\n\n' "$PROG" "$1" >&2
    usage >&2
    exit 2
}

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
    # helm wants a unit; a bare number means seconds.
    case "$TIMEOUT" in
        "" | *[!0-9a-z.]*) usage_error "TIMEOUT is a duration such as 40m or 2400s" ;;
        *[!0-9]*) ;;
        *) TIMEOUT="${TIMEOUT}s" ;;
    esac
}

helm_test() {
    # helm 3 deletes a passed pod (hook-succeeded) before --logs reads it: ask for logs from helm 4 on only.
    local logs=--logs
    case "$("$HELM" version --template '{{.Version}}' 2>/dev/null || true)" in v3.*) logs="" ;; esac
    if [ -n "$NAMESPACE" ]; then
        "$HELM" test "$RELEASE" --namespace "$NAMESPACE" --timeout "$TIMEOUT" ${logs:+"$logs"}
    else
        "$HELM" test "$RELEASE" --timeout "$TIMEOUT" ${logs:+"$logs"}
    fi
}

main() {
    parse_args "$@"
    command -v "$HELM" >/dev/null 2>&1 || {
        printf '%s: helm not found (%s): install it, or set HELM\n' "$PROG" "$HELM" >&2
        exit 2
    }
    local log rc=0 passed failed
    log=$(mktemp)
    # shellcheck disable=SC2064 # the file's name is known now
    trap "rm -f '$log'" EXIT
    echo "Checking kvtune release $RELEASE${NAMESPACE:+ in namespace $NAMESPACE} with its test pods (helm test)"
    helm_test 2>&1 | tee "$log" || rc=$?
    passed=$(grep -c '^PASS  ' "$log" || true)
    failed=$(grep -c '^FAIL  ' "$log" || true)
    if grep -q '^TEST SUITE: *None' "$log"; then
        echo "$PROG: release $RELEASE has no test pods: upgrade it with --set tests.enabled=true" >&2
        exit 1
    fi
    echo "$passed passed, $failed failed"
    if [ "$rc" -ne 0 ] || [ "$failed" -gt 0 ]; then
        echo "$PROG: helm test failed (exit $rc); the pods after the first that failed did not run" >&2
        exit 1
    fi
}

main "$@"
