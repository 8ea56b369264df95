"""The Grafana dashboards: committed JSON and the panel-table page match a fresh rendering, and every query
reads metric names vLLM 0.32 exports, counters through rate(), with the filters and thresholds specified."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvtune import metrics
from kvtune.observability import dashboards
from kvtune.observability.dashboards import all_dashboards, dashboard_targets, panel_table_markdown
from tools import generate

REPO = generate.REPO
REGENERATE = "run `make generate` and commit the result"
# Digits too: `vllm:e2e_request_latency_seconds`.
METRIC = re.compile(r"(?:vllm:|kvtune_router_)[a-z0-9_:]+")
# Router metrics carry no vLLM labels: their queries filter by these variables only.
ROUTER_VARIABLES = ("namespace", "job")
HISTOGRAMS = {metrics.QUEUE_TIME_SECONDS, metrics.PREFILL_TIME_SECONDS, metrics.TTFT_SECONDS}
HISTOGRAMS |= {metrics.ITL_SECONDS, metrics.E2E_SECONDS}
HISTOGRAMS |= {metrics.ROUTER_MATCHED_BLOCKS, metrics.ROUTER_OVERHEAD_SECONDS, *metrics.BLOCK_RESIDENCY}
KNOWN = {value for name, value in vars(metrics).items() if name.isupper() and isinstance(value, str)}
VARIABLES = {"namespace": "namespace", "job": "job", "model": "model_name", "engine": "instance"}


def panels(model: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in model["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return [panel for panel in found if panel["type"] != "row"]


def base_name(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name.removesuffix(suffix) in HISTOGRAMS:
            return name.removesuffix(suffix)
    return name


def is_counter(name: str) -> bool:
    return name.endswith("_total") or base_name(name) != name


def test_there_are_three_dashboards_with_unique_uids_and_titles() -> None:
    models = all_dashboards()
    assert list(models) == ["kvtune-kv-cache", "kvtune-latency-load", "kvtune-sweep"]
    uids = [model["uid"] for model in models.values()]
    assert len(set(uids)) == len(uids)
    assert all(re.fullmatch(r"[a-z0-9-]{8,40}", uid) for uid in uids)
    assert [model["title"] for model in models.values()] == [
        "kvtune / KV cache",
        "kvtune / Latency and load",
        "kvtune / Sweep",
    ]


def test_committed_json_and_panel_page_are_a_fresh_rendering() -> None:
    page = REPO / generate.REFERENCE / "dashboards.md"
    stale = [p for p in generate.stale_files() if p.parent == REPO / "dashboards" or p == page]
    assert not stale, f"stale: {[str(path) for path in stale]}; {REGENERATE}"
    committed = sorted(path.stem for path in (REPO / "dashboards").glob("*.json"))
    assert committed == sorted(all_dashboards()), f"dashboards/ holds {committed}; {REGENERATE}"
    text = page.read_text(encoding="utf-8")
    # Each dashboard a section of the page (the tables' headings two levels up), every panel's row kept.
    for model in all_dashboards().values():
        assert f"\n## {model['title']}\n" in text
    body = panel_table_markdown()
    rows = [line for line in body.splitlines() if line.startswith("| ") and not line.startswith("| Panel |")]
    assert rows and all(f"{row}\n" in text for row in rows)


def test_panel_table_lists_every_panel_with_three_cells() -> None:
    table = panel_table_markdown()
    for model in all_dashboards().values():
        assert f"#### {model['title']}\n" in table
        for panel in panels(model):
            rows = [line for line in table.splitlines() if line.startswith(f"| {panel['title']} |")]
            assert rows, f"no table row for panel {panel['title']!r}"
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    for row in rows:
        # Unescaped pipes only between cells: a query's `|` would split its cell.
        assert len(re.split(r"(?<!\\)\|", row)) == 5, row


def test_targets_cover_every_query_and_substitute_every_variable() -> None:
    targets = dashboard_targets()
    expected = sum(len(panel["targets"]) for model in all_dashboards().values() for panel in panels(model))
    assert len(targets) == expected > 20
    for dashboard, panel, expr in targets:
        assert "$" not in expr, f"{dashboard} / {panel}: {expr}"
    kv_panels = {panel for dashboard, panel, _ in targets if dashboard == "kvtune / KV cache"}
    assert {"Prefix-cache hit rate", "Preemptions/s", "KV cache usage"} <= kv_panels


def test_substitution_makes_filters_match_all() -> None:
    expr = 'sum (rate(vllm:x_total{job=~"$job", instance=~"$engine"}[$__rate_interval])) / $__range'
    assert dashboards.evaluable(expr) == 'sum (rate(vllm:x_total{job=~".*", instance=~".*"}[1m])) / 5m'


def test_every_query_reads_only_metric_names_kvtune_defines() -> None:
    for dashboard, panel, expr in dashboard_targets():
        names = METRIC.findall(expr)
        assert names, f"{dashboard} / {panel} reads no vLLM or router metric: {expr}"
        unknown = {name for name in names if base_name(name) not in KNOWN}
        assert not unknown, f"{dashboard} / {panel} reads {unknown}, not defined in kvtune.metrics"


@pytest.mark.parametrize(
    "removed",
    [r"vllm:gpu_cache_usage_perc", r"vllm:gpu_prefix_cache_", r"vllm:num_preemptions(?!_total)"],
)
def test_no_query_reads_a_removed_name(removed: str) -> None:
    for _, _, expr in dashboard_targets():
        assert not re.search(removed, expr), expr
    for model in all_dashboards().values():
        assert not re.search(removed, json.dumps(model))


def test_every_counter_is_read_through_rate_or_increase() -> None:
    counters = 0
    for dashboard, panel, expr in dashboard_targets():
        for found in METRIC.finditer(expr):
            if is_counter(found.group()):
                counters += 1
                before = expr[: found.start()]
                assert re.search(r"\b(rate|increase)\($", before), f"{dashboard} / {panel}: {expr}"
    assert counters > 10


def test_every_dashboard_has_the_five_template_variables() -> None:
    for model in all_dashboards().values():
        variables = {variable["name"]: variable for variable in model["templating"]["list"]}
        assert list(variables) == ["datasource", *VARIABLES]
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        for name, label in VARIABLES.items():
            variable = variables[name]
            assert variable["type"] == "query"
            assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert variable["includeAll"] is True and variable["allValue"] == ".*"
            assert variable["multi"] is True
            found = re.fullmatch(r"label_values\((vllm:[a-z0-9_:]+)(\{.*\})?, (\w+)\)", variable["query"])
            assert found is not None, variable["query"]
            assert found[1] in KNOWN and found[3] == label


def test_every_query_filters_by_the_template_variables() -> None:
    for model in all_dashboards().values():
        for panel in panels(model):
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            for target in panel["targets"]:
                for found in METRIC.finditer(target["expr"]):
                    selector = target["expr"][found.end() :].split("}", 1)[0]
                    for name, label in VARIABLES.items():
                        if label == "model_name" and found.group() == metrics.CACHE_CONFIG_INFO:
                            continue  # vLLM puts no model label on its cache config
                        if found.group().startswith("kvtune_router_") and name not in ROUTER_VARIABLES:
                            continue
                        assert f'{label}=~"${name}"' in selector, f"{panel['title']}: {target['expr']}"


def test_every_panel_says_what_a_bad_value_means_and_what_to_change() -> None:
    knobs = ("kv_cache_memory_bytes", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
             "block_size", "kv_events_port", "replicas", "kv_offloading_size")  # fmt: skip
    for model in all_dashboards().values():
        for panel in panels(model):
            description = panel.get("description", "")
            assert len(description) > 80, panel["title"]
            assert any(knob in description for knob in knobs), panel["title"]


def test_panel_ids_and_query_ref_ids_are_unique() -> None:
    for model in all_dashboards().values():
        ids = [panel["id"] for panel in model["panels"]]
        assert len(set(ids)) == len(ids) and 0 not in ids
        for panel in panels(model):
            refs = [target["refId"] for target in panel["targets"]]
            assert len(set(refs)) == len(refs) and all(refs)


def steps(panel: dict[str, Any]) -> list[tuple[float | None, str]]:
    thresholds = panel["fieldConfig"]["defaults"]["thresholds"]
    assert thresholds["mode"] == "absolute"
    return [(step["value"], step["color"]) for step in thresholds["steps"]]


def test_hit_rate_panels_are_red_below_90_and_green_from_95_percent() -> None:
    hit_rate_panels = [
        (model["title"], panel)
        for model in all_dashboards().values()
        for panel in panels(model)
        if metrics.PREFIX_CACHE_HITS in json.dumps(panel["targets"])
    ]
    assert [title for title, _ in hit_rate_panels].count("kvtune / KV cache") == 2  # graph and stat
    for _, panel in hit_rate_panels:
        defaults = panel["fieldConfig"]["defaults"]
        assert defaults["unit"] == "percentunit" and defaults["min"] == 0 and defaults["max"] == 1
        assert steps(panel) == [(None, "red"), (0.9, "yellow"), (0.95, "green")]


def test_kv_usage_panels_are_yellow_from_90_and_red_from_95_percent() -> None:
    usage = [
        panel
        for model in all_dashboards().values()
        for panel in panels(model)
        if metrics.KV_CACHE_USAGE in json.dumps(panel["targets"])
    ]
    assert len(usage) == 2
    for panel in usage:
        assert panel["fieldConfig"]["defaults"]["unit"] == "percentunit"
        assert steps(panel) == [(None, "green"), (0.9, "yellow"), (0.95, "red")]


def test_capacity_table_shows_cache_config_labels_vllm_exports() -> None:
    model = all_dashboards()["kvtune-kv-cache"]
    (panel,) = [panel for panel in panels(model) if panel["type"] == "table"]
    (target,) = panel["targets"]
    assert target["expr"].startswith(metrics.CACHE_CONFIG_INFO + "{")
    assert target["instant"] is True and target["format"] == "table"
    shown = panel["transformations"][0]["options"]["include"]["names"]
    wanted = {"cache_dtype", "block_size", "num_gpu_blocks", "kv_cache_size_tokens"}
    wanted |= {"enable_prefix_caching", "gpu_memory_utilization"}
    assert wanted <= set(shown)
    # vLLM turns every CacheConfig field into a cache_config_info label: each shown label is a field.
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "vLLM is not installed"
    source = (Path(spec.origin).parent / "config" / "cache.py").read_text(encoding="utf-8")
    assert "return {key: str(value) for key, value in self.__dict__.items()}" in source
    for label in set(shown) - {"job", "instance"}:
        assert re.search(rf"^    {label}: ", source, flags=re.MULTILINE), f"CacheConfig has no {label}"


def test_sweep_dashboard_shows_trials_as_tagged_grafana_annotations() -> None:
    model = all_dashboards()["kvtune-sweep"]
    (annotation,) = model["annotations"]["list"]
    assert annotation["datasource"] == {"type": "grafana", "uid": "-- Grafana --"}
    assert annotation["enable"] is True
    assert annotation["target"]["type"] == "tags"
    assert annotation["target"]["tags"] == ["kvtune", "sweep"]
    assert annotation["target"]["matchAny"] is False
    titles = {panel["title"] for panel in panels(model)}
    assert {"Request throughput", "TTFT p99", "KV cache usage", "Preemptions/s"} <= titles


def test_latency_dashboard_has_three_quantiles_of_each_histogram_in_seconds() -> None:
    model = all_dashboards()["kvtune-latency-load"]
    for histogram in (metrics.TTFT_SECONDS, metrics.ITL_SECONDS, metrics.E2E_SECONDS):
        (panel,) = [p for p in panels(model) if f"{histogram}_bucket" in json.dumps(p["targets"])]
        assert panel["fieldConfig"]["defaults"]["unit"] == "s"
        quantiles = [re.match(r"histogram_quantile\(([0-9.]+),", t["expr"]) for t in panel["targets"]]
        assert [float(q[1]) for q in quantiles if q] == [0.5, 0.95, 0.99]


def test_write_dashboards_writes_one_sorted_json_file_each(tmp_path: Path) -> None:
    written = dashboards.write_dashboards(tmp_path / "out")
    assert [path.name for path in written] == [f"{stem}.json" for stem in all_dashboards()]
    for path in written:
        text = path.read_text(encoding="utf-8")
        assert text.endswith("}\n")
        assert json.loads(text) == all_dashboards()[path.stem]
        assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"


# ---- queries no engine here can feed, evaluated by promtool on synthetic series ---------------------------

# The offload tier runs only on vLLM's CUDA (and XPU) builds: its series, and a KV connector's share of
# prompt tokens, are made up here (15 s apart, so a 1m rate holds five samples and is an exact slope).
ON_GPU, ON_CPU = 'job="vllm", instance="gpu:8000"', 'job="vllm", instance="cpu:8000"'
SYNTHETIC = {
    f"{metrics.KV_OFFLOAD_STORE_BYTES}{{{ON_GPU}}}": "0+1500x40",  # 100 B/s
    f"{metrics.KV_OFFLOAD_LOAD_BYTES}{{{ON_GPU}}}": "0+750x40",  # 50 B/s
    f"{metrics.EXTERNAL_PREFIX_CACHE_QUERIES}{{{ON_GPU}}}": "0+300x40",
    f"{metrics.EXTERNAL_PREFIX_CACHE_HITS}{{{ON_GPU}}}": "0+150x40",
    # A CPU engine: its connector counters exist and stay at 0, so it has no hit rate (not 0/0).
    f"{metrics.EXTERNAL_PREFIX_CACHE_QUERIES}{{{ON_CPU}}}": "0x40",
    f"{metrics.EXTERNAL_PREFIX_CACHE_HITS}{{{ON_CPU}}}": "0x40",
    f'{metrics.PROMPT_TOKENS_BY_SOURCE}{{{ON_GPU}, source="local_compute"}}': "0+600x40",
    f'{metrics.PROMPT_TOKENS_BY_SOURCE}{{{ON_GPU}, source="local_cache_hit"}}': "0+900x40",
    f'{metrics.PROMPT_TOKENS_BY_SOURCE}{{{ON_GPU}, source="external_kv_transfer"}}': "0+150x40",
    f'{metrics.PROMPT_TOKENS_CACHED_BY_SOURCE}{{{ON_GPU}, source="device"}}': "0+900x40",
    f'{metrics.PROMPT_TOKENS_CACHED_BY_SOURCE}{{{ON_GPU}, source="host"}}': "0+150x40",
}
GPU = {"job": "vllm", "instance": "gpu:8000"}
# Each such panel's queries, in order, and the series they give at 5m.
EXPECTED: dict[str, list[list[tuple[dict[str, str], float]]]] = {
    "KV offload traffic": [[(GPU, 100.0)], [(GPU, 50.0)]],
    "External prefix-cache hit rate": [[(GPU, 0.5)]],
    "Prompt tokens by source": [
        [
            (GPU | {"source": "external_kv_transfer"}, 10.0),
            (GPU | {"source": "local_cache_hit"}, 60.0),
            (GPU | {"source": "local_compute"}, 40.0),
        ]
    ],
    "Cached prompt tokens by tier": [[(GPU | {"source": "device"}, 60.0), (GPU | {"source": "host"}, 10.0)]],
}


def test_offload_and_source_queries_compute_on_synthetic_series(tmp_path: Path) -> None:
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    assert Path(promtool).is_file(), "promtool is missing: run `make sysdeps` (Debian's prometheus package)"
    queries = [(panel, expr) for board, panel, expr in dashboard_targets() if panel in EXPECTED]
    assert {panel for panel, _ in queries} == set(EXPECTED)
    tests = []
    for panel in EXPECTED:
        exprs = [expr for title, expr in queries if title == panel]
        assert len(exprs) == len(EXPECTED[panel]), panel
        for expr, samples in zip(exprs, EXPECTED[panel], strict=True):
            expected = [{"labels": _labels(labels), "value": value} for labels, value in samples]
            tests.append({"expr": expr, "eval_time": "5m", "exp_samples": expected})
    document = {
        "rule_files": [],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [
                    {"series": series, "values": values} for series, values in SYNTHETIC.items()
                ],
                "promql_expr_test": tests,
            }
        ],
    }
    path = tmp_path / "queries.test.yaml"
    path.write_text(json.dumps(document), encoding="utf-8")
    result = subprocess.run(
        [promtool, "test", "rules", path.name], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _labels(labels: dict[str, str]) -> str:
    return "{" + ", ".join(f'{name}="{value}"' for name, value in sorted(labels.items())) + "}"
