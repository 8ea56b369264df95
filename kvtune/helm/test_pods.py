"""The generated files of the chart's `helm test` pods (helm/kvtune/templates/tests/), written with the
chart's other generated files (`kvtune.helm.build.generated_files`):

- files/release-checks/*_checks.py: copies of kvtune/helm/release_checks/, the scripts the pods run;
- files/release-checks/queried-metrics.txt: every vLLM metric name kvtune's dashboards and alert rules
  query, one a line: the metrics pod wants each on /metrics, so an engine that renamed one fails `helm test`
  instead of leaving a panel on "No data";
- files/release-checks/queried-metrics-kv-cache-metrics.txt: the block residency names among them, which
  vLLM exports only with --kv-cache-metrics: wanted only when engine.kvCacheMetrics is on. The offload
  tier's names are wanted nowhere: vLLM exports them at the tier's first transfer, not before.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvtune import metrics
from kvtune.helm import release_checks
from kvtune.observability import alerts, dashboards

CHECKS_SOURCE = Path(release_checks.__file__).resolve().parent
CHECKS_IN_CHART = Path("files") / "release-checks"
METRICS_FILE = "queried-metrics.txt"
RESIDENCY_METRICS_FILE = "queried-metrics-kv-cache-metrics.txt"
# The engine's names; the router's (kvtune_router_*) come from kvtune's router, which the chart does not run.
ENGINE_METRIC = re.compile(r"vllm:[a-zA-Z0-9_:]+")


def dashboard_metrics() -> set[str]:
    """The vLLM metric names kvtune's dashboards query."""
    return {
        name
        for _board, _panel, expr in dashboards.dashboard_targets()
        for name in ENGINE_METRIC.findall(expr)
    }


def alert_metrics() -> set[str]:
    """The vLLM metric names kvtune's alert rules query."""
    return {name for _alert, expr in alerts.alert_expressions() for name in ENGINE_METRIC.findall(expr)}


def _of(names: tuple[str, ...], name: str) -> bool:
    """NAME is one of NAMES, or a histogram sample of one."""
    return any(name == base or name.startswith(f"{base}_") for base in names)


def queried_metrics() -> list[str]:
    """Every vLLM metric name the dashboards and alerts query that every engine exports, sorted."""
    optional = (*metrics.BLOCK_RESIDENCY, *metrics.KV_OFFLOAD)
    return sorted(name for name in dashboard_metrics() | alert_metrics() if not _of(optional, name))


def residency_metrics() -> list[str]:
    """The names queried that vLLM exports only with --kv-cache-metrics, sorted."""
    queried = dashboard_metrics() | alert_metrics()
    return sorted(name for name in queried if _of(metrics.BLOCK_RESIDENCY, name))


def generated_files(chart_dir: Path) -> dict[Path, str]:
    """The test pods' generated chart files and their content."""
    target = chart_dir / CHECKS_IN_CHART
    files = {
        target / METRICS_FILE: "".join(f"{name}\n" for name in queried_metrics()),
        target / RESIDENCY_METRICS_FILE: "".join(f"{name}\n" for name in residency_metrics()),
    }
    for source in sorted(CHECKS_SOURCE.glob("*_checks.py")):
        header = f"# Generated from kvtune/helm/release_checks/{source.name}; do not edit.\n"
        files[target / source.name] = header + source.read_text(encoding="utf-8")
    return files
