"""reference/metrics.md: every Prometheus metric kvtune reads and every one it exports, each with where it is
used.

The names are kvtune.metrics' (their one home). Where each is read comes from the code that reads it: the
dashboards' and the alert rules' own queries, the facts of a metrics window (kvtune.metrics_window:
`kvtune doctor`, `kvtune load`, the sweep) and the modules that name it. What kvtune exports is found where
the code creates its prometheus_client metrics, so a new one is listed without being typed here.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from kvtune import metrics as names
from kvtune import metrics_window
from kvtune.observability import alerts, dashboards
from kvtune.reference import markdown

PACKAGE = Path(names.__file__).resolve().parent
REPO = PACKAGE.parent
SOURCE = "kvtune/metrics.py, the dashboards, the alert rules, kvtune/metrics_window.py and kvtune's exporters"
# A metric's name as kvtune.metrics holds it: vLLM's (`vllm:`) and kvtune's own (`kvtune_`).
METRIC_NAME = re.compile(r"(?:vllm:|kvtune_)[A-Za-z0-9_:]+")
# A name in PromQL, and the samples a histogram's base name stands for.
_PROMQL_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
HISTOGRAM_SAMPLES = ("_bucket", "_sum", "_count")
# prometheus_client's metric types, and the word Prometheus gives each.
METRIC_TYPES = {
    "Counter": "counter",
    "Gauge": "gauge",
    "Histogram": "histogram",
    "Summary": "summary",
    "Info": "info",
    "Enum": "stateset",
}
# This package renders the page; its own mentions of a name are not uses.
_NOT_USERS = (PACKAGE / "metrics.py", PACKAGE / "reference")


@dataclass
class Uses:
    """Where one metric is read."""

    panels: list[str] = field(default_factory=list)  # "dashboard: panel"
    alerts: list[str] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)  # a metric window's facts
    modules: list[str] = field(default_factory=list)  # modules of kvtune/ naming it


@dataclass(frozen=True)
class Exported:
    """A metric kvtune itself exports, as its code creates it."""

    name: str  # as scraped: a counter with `_total`
    kind: str
    labels: tuple[str, ...]
    help: str
    module: str


def known_names() -> dict[str, str]:
    """Each metric name kvtune.metrics holds, and the constant holding it."""
    return {
        value: constant
        for constant, value in vars(names).items()
        if constant.isupper() and isinstance(value, str) and METRIC_NAME.fullmatch(value)
    }


def _groups() -> dict[str, tuple[str, ...]]:
    """Constants of kvtune.metrics holding several names (`BLOCK_RESIDENCY`): a use of one uses each."""
    known = known_names()
    return {
        constant: value
        for constant, value in vars(names).items()
        if constant.isupper() and isinstance(value, tuple) and value and all(item in known for item in value)
    }


def names_in(promql: str, known: set[str] | dict[str, str]) -> list[str]:
    """The known metrics a query reads, in order, a histogram's samples as its base name."""
    found: dict[str, None] = {}
    for token in _PROMQL_NAME.findall(promql):
        if token in known:
            found[token] = None
            continue
        for suffix in HISTOGRAM_SAMPLES:
            if token.endswith(suffix) and token.removesuffix(suffix) in known:
                found[token.removesuffix(suffix)] = None
    return list(found)


def uses() -> dict[str, Uses]:
    """Where each metric of kvtune.metrics is read, by dashboards, alerts, window facts and modules."""
    known = known_names()
    found: dict[str, Uses] = {name: Uses() for name in sorted(known)}
    for board, panel, expr in dashboards.dashboard_targets():
        for name in names_in(expr, known):
            _add(found[name].panels, f"{board}: {panel}")
    for alert, expr in alerts.alert_expressions():
        for name in names_in(expr, known):
            _add(found[name].alerts, alert)
    for fact, samples in metrics_window.FACT_SOURCES.items():
        for name in names_in(" ".join(samples), known):
            _add(found[name].facts, fact)
    for module, constants in _modules_naming().items():
        for constant in constants:
            for name in _names_of(constant, known):
                _add(found[name].modules, module)
    return found


def _add(items: list[str], item: str) -> None:
    if item not in items:
        items.append(item)


def _names_of(constant: str, known: dict[str, str]) -> tuple[str, ...]:
    by_constant = {value: key for key, value in known.items()}
    if constant in by_constant:
        return (by_constant[constant],)
    return _groups().get(constant, ())


def _python_files() -> list[Path]:
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if not any(path == skip or skip in path.parents for skip in _NOT_USERS)
    ]


def _metrics_aliases(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """The local names a module binds to kvtune.metrics, and to each constant it imports from it."""
    modules: set[str] = set()
    constants: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            if node.module == "kvtune" and alias.name == "metrics":
                modules.add(alias.asname or alias.name)
            elif node.module == "kvtune.metrics":
                constants[alias.asname or alias.name] = alias.name
    return modules, constants


def _named_constant(node: ast.AST, modules: set[str], constants: dict[str, str]) -> str | None:
    """The kvtune.metrics constant NODE names (`metrics.KV_CACHE_USAGE`, an imported name), or None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
        return node.attr
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    return None


@functools.cache
def _trees() -> tuple[tuple[str, ast.Module], ...]:
    return tuple(
        (path.relative_to(REPO).as_posix(), ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        for path in _python_files()
    )


def _modules_naming() -> dict[str, list[str]]:
    """Each module of kvtune/ and the kvtune.metrics constants it names, in order."""
    naming: dict[str, list[str]] = defaultdict(list)
    for module, tree in _trees():
        modules, constants = _metrics_aliases(tree)
        for node in ast.walk(tree):
            constant = _named_constant(node, modules, constants)
            if constant is not None and constant not in naming[module]:
                naming[module].append(constant)
    return dict(naming)


def exported_metrics() -> list[Exported]:
    """Every metric kvtune's code creates with prometheus_client, by name; ValueError naming the line of one
    whose name or help cannot be read from the code."""
    found: list[Exported] = []
    for module, tree in _trees():
        modules, constants = _metrics_aliases(tree)
        classes = {
            alias.asname or alias.name: METRIC_TYPES[alias.name]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "prometheus_client"
            for alias in node.names
            if alias.name in METRIC_TYPES
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in classes:
                found.append(_exported(node, classes[node.func.id], module, modules, constants))
    return sorted(found, key=lambda metric: metric.name)


def _argument(call: ast.Call, position: int, keyword: str) -> ast.expr | None:
    if len(call.args) > position:
        return call.args[position]
    return next((item.value for item in call.keywords if item.arg == keyword), None)


def _exported(
    call: ast.Call, kind: str, module: str, modules: set[str], constants: dict[str, str]
) -> Exported:
    where = f"{module}:{call.lineno}"
    name = _name_value(_argument(call, 0, "name"), modules, constants)
    text = _argument(call, 1, "documentation")
    if name is None or not (isinstance(text, ast.Constant) and isinstance(text.value, str)):
        raise ValueError(
            f"{where}: a metric whose name or help is not written out; name it with a kvtune.metrics "
            "constant and give its help as a string"
        )
    labels = _argument(call, 2, "labelnames")
    label_names = (
        tuple(str(item.value) for item in labels.elts if isinstance(item, ast.Constant))
        if isinstance(labels, ast.List | ast.Tuple)
        else ()
    )
    if kind == "counter":  # prometheus_client adds `_total` to a counter's name itself
        name = name.removesuffix("_total") + "_total"
    return Exported(name, kind, label_names, text.value, module)


def _name_value(node: ast.expr | None, modules: set[str], constants: dict[str, str]) -> str | None:
    """A metric's name as the code gives it: a string, a kvtune.metrics constant, or one passed through a
    one-argument helper (`_counter(names.ROUTER_REQUESTS)`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
        return _name_value(node.args[0], modules, constants)
    constant = None if node is None else _named_constant(node, modules, constants)
    value = getattr(names, constant, None) if constant else None
    return value if isinstance(value, str) else None


def render() -> str:
    found = uses()
    exported = exported_metrics()
    exported_names = {metric.name for metric in exported}
    lines = markdown.page_head(
        "Metrics",
        "Every Prometheus metric kvtune reads (vLLM's, in the dashboards, the alert rules and the metrics "
        "window `kvtune doctor`, `kvtune load` and the sweep read) and every metric kvtune itself exports, "
        "each with where it is used.",
        SOURCE,
    )
    lines += [
        "Names are as scraped from `/metrics`: counters end in `_total`; a histogram is named by its base "
        "name, whose samples are `_bucket`, `_sum` and `_count`. Window facts are the figures "
        "`kvtune/metrics_window.py` reads from two scrapes or from Prometheus over a window: `kvtune doctor` "
        "judges them, `kvtune load` prints them and the sweep's report explains its verdicts with them.",
        "",
        markdown.heading(2, "Metrics kvtune reads", "read"),
        "",
        *markdown.table(
            ("Metric", "Dashboard panels", "Alerts", "Window facts", "Named in"),
            (_read_row(name, use) for name, use in found.items() if name not in exported_names),
        ),
        "",
        markdown.heading(2, "Metrics kvtune exports", "exported"),
        "",
        "kvtune's router (`kvtune up` with several engines, and each router worker) serves these on its "
        "`/metrics`.",
        "",
        *markdown.table(
            ("Metric", "Type", "Labels", "Help", "Exported by", "Read by"),
            (_exported_row(metric, found.get(metric.name, Uses())) for metric in exported),
        ),
        "",
    ]
    return markdown.page(lines)


def _listed(items: list[str], as_code: bool = False) -> str:
    return "<br>".join(markdown.code(item) if as_code else markdown.cell(item) for item in items)


def _read_row(name: str, use: Uses) -> list[str]:
    return [
        markdown.code(name),
        _listed(use.panels),
        _listed(use.alerts, as_code=True),
        ", ".join(markdown.code(fact) for fact in use.facts),
        _listed(use.modules, as_code=True),
    ]


def _exported_row(metric: Exported, use: Uses) -> list[str]:
    readers = [f"dashboard panel {panel}" for panel in use.panels] + [
        f"alert {alert}" for alert in use.alerts
    ]
    return [
        markdown.code(metric.name),
        metric.kind,
        ", ".join(markdown.code(label) for label in metric.labels),
        markdown.cell(metric.help),
        markdown.code(metric.module),
        _listed(readers),
    ]
