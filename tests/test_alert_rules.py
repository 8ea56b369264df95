"""The alert rules: the committed file and the runbook page match their definitions, promtool accepts the
file and its unit tests pass, and every query reads metrics vLLM exports, counters through rate()."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune import cli, metrics
from kvtune.observability import alerts
from kvtune.profile import EngineProfile
from tools import generate

RULES_FILE = generate.REPO / alerts.RULES_PATH
RULES_TESTS = RULES_FILE.with_name("kvtune-alerts.test.yaml")
METRIC = re.compile(r"vllm:[a-z_:]+")
HISTOGRAM_SAMPLE = re.compile(r"_(bucket|count|sum)$")
DEFINED = {value for value in vars(metrics).values() if isinstance(value, str) and value.startswith("vllm:")}
KNOBS = (
    "kv_cache_memory_bytes",
    "gpu_memory_utilization",
    "kv_cache_dtype",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
)


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool") or "/usr/bin/promtool"
    assert Path(path).is_file(), "promtool is missing: run `make sysdeps` (Debian's prometheus package)"
    return path


def run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, cwd=cwd)


def rules_of(text: str) -> list[dict[str, Any]]:
    document = yaml.safe_load(text)
    assert [group["name"] for group in document["groups"]] == ["kvtune"]
    rules: list[dict[str, Any]] = document["groups"][0]["rules"]
    return rules


def is_counter_sample(name: str) -> bool:
    return name.endswith("_total") or HISTOGRAM_SAMPLE.search(name) is not None


def misread_metrics(expr: str) -> list[str]:
    """Counters read without rate()/increase() (a lifetime total), and gauges read through them."""
    wrong = []
    for found in METRIC.finditer(expr):
        through_rate = re.search(r"\b(rate|increase)\($", expr[: found.start()]) is not None
        if through_rate != is_counter_sample(found.group()):
            wrong.append(found.group())
    return wrong


def test_committed_rules_and_runbook_page_match_their_definitions() -> None:
    page = generate.REPO / generate.REFERENCE / "alerts.md"
    stale = set(generate.stale_files()) & {RULES_FILE, page}
    assert not stale, f"stale: {sorted(map(str, stale))}; run `make generate`"
    text = page.read_text(encoding="utf-8")
    # Each alert a section of the page (the runbook's subsections, two levels up), its query shown.
    names = [name for name, _ in alerts.alert_expressions()]
    assert re.findall(r"^## (\w+)$", text, flags=re.MULTILINE) == names
    for _name, expr in alerts.alert_expressions():
        assert f"```promql\n{expr}\n```" in text


def test_runbook_has_a_subsection_per_alert_naming_profile_fields() -> None:
    runbook = alerts.runbook_markdown()
    names = [name for name, _ in alerts.alert_expressions()]
    assert re.findall(r"^#### (\w+)$", runbook, flags=re.MULTILINE) == names
    for knob in KNOBS:
        assert f"`{knob}" in runbook, knob
    # Every backticked snake_case word of the advice is a real profile field.
    advice = "\n".join(re.findall(r"^\*\*What to change\.\*\* .*$", runbook, flags=re.MULTILINE))
    assert advice.count("What to change") == len(names)
    words = set(re.findall(r"`([a-z]+(?:_[a-z0-9]+)+)[`:]", advice))
    assert set(KNOBS) <= words
    assert words <= set(EngineProfile.model_fields), words - set(EngineProfile.model_fields)


def test_promtool_accepts_the_rules(promtool: str) -> None:
    result = run(promtool, "check", "rules", str(RULES_FILE))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts.alert_rules())} rules found" in result.stdout


def test_promtool_unit_tests_pass(promtool: str) -> None:
    result = run(promtool, "test", "rules", RULES_TESTS.name, cwd=RULES_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize(
    ("field", "broken", "complaint"),
    [
        ("expr", "sum by (job, instance) (rate(vllm:num_preemptions_total[5m]) >", "parse error"),
        ("summary", "Preempted on {{ $labels.instance }", "template"),
    ],
)
def test_promtool_rejects_a_broken_rule(
    promtool: str, tmp_path: Path, field: str, broken: str, complaint: str
) -> None:
    rule = next(rule for rule in alerts.alert_rules() if rule.name == "KvtunePreemptions")
    path = tmp_path / "broken.yaml"
    if field == "expr":
        rule = dataclasses.replace(rule, expr=broken)
    else:
        rule = dataclasses.replace(rule, summary=broken)
    path.write_text(alerts.rules_yaml([rule]), encoding="utf-8")
    result = run(promtool, "check", "rules", str(path))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "KvtunePreemptions" in output
    assert complaint in output.lower()


def test_slo_sets_the_ttft_threshold_and_summary_only() -> None:
    default = {rule["alert"]: rule for rule in rules_of(alerts.render_rules())}
    strict = {rule["alert"]: rule for rule in rules_of(alerts.render_rules(0.75))}
    ttft_default, ttft_strict = default.pop("KvtuneTtftP99AboveSlo"), strict.pop("KvtuneTtftP99AboveSlo")
    assert "\n> 2\n" in ttft_default["expr"]
    assert "\n> 0.75\n" in ttft_strict["expr"]
    assert ttft_strict["expr"].replace("> 0.75", "> 2") == ttft_default["expr"]
    assert "the 2s SLO" in ttft_default["annotations"]["summary"]
    assert "the 0.75s SLO" in ttft_strict["annotations"]["summary"]
    assert strict == default


@pytest.mark.parametrize("slo", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_slo_is_refused(slo: float) -> None:
    with pytest.raises(ValueError, match="ttft_p99_slo_seconds"):
        alerts.render_rules(slo)


def test_kvtune_alerts_refuses_a_bad_slo_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["alerts", "--ttft-slo", "0"])
    assert exited.value.code == 2
    assert "--ttft-slo" in capsys.readouterr().err


def test_kvtune_alerts_prints_the_rules_at_the_given_slo(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["alerts", "--ttft-slo", "1.5"]) == 0
    assert capsys.readouterr().out == alerts.render_rules(1.5)
    assert cli.main(["alerts"]) == 0
    assert capsys.readouterr().out == RULES_FILE.read_text(encoding="utf-8")


def test_rules_carry_severity_for_and_templated_annotations() -> None:
    rules = rules_of(alerts.render_rules())
    assert [(rule["alert"], rule["expr"]) for rule in rules] == alerts.alert_expressions()
    durations = {rule["alert"]: rule["for"] for rule in rules}
    assert durations == {
        "KvtunePrefixCacheHitRateLow": alerts.PREFIX_CACHE_FOR,
        "KvtunePreemptions": alerts.PREEMPTION_FOR,
        "KvtuneKvCacheNearlyFull": alerts.KV_CACHE_FOR,
        "KvtuneRequestsWaitingForCapacity": alerts.WAITING_FOR_CAPACITY_FOR,
        "KvtuneTtftP99AboveSlo": alerts.TTFT_FOR,
        "KvtuneEvictionsBeforeReuse": alerts.RESIDENCY_FOR,
    }
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        summary, description = rule["annotations"]["summary"], rule["annotations"]["description"]
        assert "{{ $labels.instance }}" in summary, rule["alert"]
        assert "$value" in description, rule["alert"]
        assert re.search(r"KV budget|fp8|max_num_seqs|max_num_batched_tokens", summary), rule["alert"]


def test_traffic_guards_are_explicit() -> None:
    expressions = dict(alerts.alert_expressions())
    assert (
        "\nand\nsum by (job, instance) (rate(vllm:prefix_cache_queries_total[10m])) > 0"
        in (expressions["KvtunePrefixCacheHitRateLow"])
    )
    assert (
        "\nand\nsum by (job, instance) (rate(vllm:time_to_first_token_seconds_count[5m])) > 0"
        in (expressions["KvtuneTtftP99AboveSlo"])
    )


def test_every_metric_queried_is_one_kvtune_defines() -> None:
    for name, expr in alerts.alert_expressions():
        found = METRIC.findall(expr)
        assert found, name
        for metric in found:
            assert metric in DEFINED or HISTOGRAM_SAMPLE.sub("", metric) in DEFINED, (name, metric)


def test_counters_are_read_through_rate_or_increase() -> None:
    for name, expr in alerts.alert_expressions():
        assert misread_metrics(expr) == [], name


def test_the_rate_check_catches_a_lifetime_counter_and_a_rated_gauge() -> None:
    assert misread_metrics("sum(vllm:num_preemptions_total) > 0") == ["vllm:num_preemptions_total"]
    assert misread_metrics("rate(vllm:kv_cache_usage_perc[5m])") == ["vllm:kv_cache_usage_perc"]
    assert misread_metrics("vllm:time_to_first_token_seconds_bucket") == [
        "vllm:time_to_first_token_seconds_bucket"
    ]
