"""No import loop between kvtune's folders: data flows one way (profile -> argv/values -> process -> metrics
-> results -> report), and a folder that imports another must not be imported back by it.

Every module of `kvtune/` is parsed (never imported): imports at any level count, inside functions and
under TYPE_CHECKING too, as do `from kvtune import x` and relative forms. Each module maps to a node: a
module inside a folder (`kvtune/sweep/...`) to its top folder, a module at the package's root
(`kvtune/engine.py`) to a node of its own. Root modules are the base the folders build on (errors, files,
HTTP, exit codes, the SLO defaults), so the graph of nodes must hold no cycle at all, and a root module may
import a feature folder only on a line that says why (`# import-graph: <reason>`).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvtune"
# The folders that do one job each for a user; the base (root modules, the profile model) never imports them.
FEATURE_FOLDERS = ("loadgen", "observability", "sweep", "router", "helm", "commands")
ALLOWED_MARK = "# import-graph:"


@dataclass(frozen=True)
class Edge:
    """One import from node `source` to node `target`, where it is written."""

    source: str
    target: str
    where: str  # path:line
    text: str  # the imported module


def _module_name(package: Path, path: Path) -> str:
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _node(package: Path, module: str) -> str:
    """`sweep` for kvtune.sweep.x (and kvtune.sweep itself), `engine.py` for kvtune.engine, `__init__.py`
    for kvtune."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    if (package / parts[0]).is_dir():
        return parts[0]
    return f"{parts[0]}.py"


def _imported(
    module: str, is_package: bool, statement: ast.Import | ast.ImportFrom, known: set[str]
) -> list[str]:
    """The modules of the package STATEMENT imports, as absolute names (a `from X import y` names X.y when
    that is a module, else X)."""
    if isinstance(statement, ast.Import):
        return [alias.name for alias in statement.names]
    if statement.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (statement.level - 1)]
        source = ".".join([*base, *([statement.module] if statement.module else [])])
    else:
        source = statement.module or ""
    submodules = [f"{source}.{alias.name}" for alias in statement.names if f"{source}.{alias.name}" in known]
    return submodules or [source]


def import_edges(package: Path) -> list[Edge]:
    """Every import between two different nodes of PACKAGE."""
    modules = {_module_name(package, path): path for path in sorted(package.rglob("*.py"))}
    known = set(modules)
    edges = []
    for module, path in modules.items():
        source_node = _node(package, module)
        lines = path.read_text(encoding="utf-8").splitlines()
        tree = ast.parse("\n".join(lines), filename=str(path))
        for statement in ast.walk(tree):
            if not isinstance(statement, ast.Import | ast.ImportFrom):
                continue
            targets = _imported(module, path.name == "__init__.py", statement, known)
            inside = [t for t in targets if t == package.name or t.startswith(f"{package.name}.")]
            for target_node in sorted({_node(package, target) for target in inside}):  # one edge a line
                if target_node != source_node:
                    where = f"{path.relative_to(package.parent)}:{statement.lineno}"
                    text = " ".join(lines[statement.lineno - 1 : statement.end_lineno or statement.lineno])
                    edges.append(Edge(source_node, target_node, where, text))
    return edges


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The groups of nodes that import each other around a loop (strongly connected components of more
    than one node), each sorted, by Tarjan's algorithm."""
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in edges:
        graph[edge.source].add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for after in sorted(graph[node]):
            if after not in index:
                visit(after)
                low[node] = min(low[node], low[after])
            elif after in on_stack:
                low[node] = min(low[node], index[after])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def loop_report(edges: list[Edge]) -> str:
    """Each loop's nodes and every import edge inside it, file:line first; "" when there is none."""
    parts = []
    for group in cycles(edges):
        members = set(group)
        inside = [e for e in edges if e.source in members and e.target in members]
        lines = [f"  {e.where}: {e.source} -> {e.target} ({e.text.strip()})" for e in inside]
        parts.append(f"import loop between {', '.join(group)}:\n" + "\n".join(lines))
    return "\n".join(parts)


def unexplained_base_imports(edges: list[Edge], package: Path) -> list[Edge]:
    """Root modules importing a feature folder on a line without an `# import-graph:` reason."""
    wrong = []
    for edge in edges:
        if edge.source.endswith(".py") and edge.target in FEATURE_FOLDERS:
            path, line = edge.where.rsplit(":", 1)
            text = (package.parent / path).read_text(encoding="utf-8").splitlines()
            nearby = text[max(int(line) - 2, 0) : int(line) + 1]  # the line, or the comment above it
            if not any(ALLOWED_MARK in source_line for source_line in nearby):
                wrong.append(edge)
    return wrong


def test_kvtune_has_no_import_loop_between_folders() -> None:
    report = loop_report(import_edges(PACKAGE))
    assert not report, report


def test_root_modules_import_no_feature_folder_without_a_reason() -> None:
    wrong = unexplained_base_imports(import_edges(PACKAGE), PACKAGE)
    assert not wrong, "\n".join(f"{e.where}: {e.source} imports {e.target} ({e.text.strip()})" for e in wrong)


def test_every_feature_folder_exists() -> None:
    """A renamed folder would leave the rule above checking nothing."""
    assert [name for name in FEATURE_FOLDERS if not (PACKAGE / name / "__init__.py").is_file()] == []


# ---- the checks on a made-up package ---------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    package = root / "kvtune"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return package


def test_a_loop_through_a_function_level_and_a_relative_import_is_named_with_its_lines(
    tmp_path: Path,
) -> None:
    package = _write(
        tmp_path,
        {
            "__init__.py": "",
            "sweep/__init__.py": "",
            "sweep/runner.py": "from kvtune.helm import values\n",
            "helm/__init__.py": "",
            "helm/values.py": "\n\ndef slo() -> None:\n    from ..observability.alerts import SLO\n",
            "observability/__init__.py": "",
            "observability/alerts.py": "SLO = 2\nfrom kvtune import sweep\n",
            "router/__init__.py": "",
            "router/server.py": "import kvtune.observability.alerts\n",
        },
    )
    report = loop_report(import_edges(package))
    assert "import loop between helm, observability, sweep:" in report
    assert "kvtune/sweep/runner.py:1: sweep -> helm" in report
    assert "kvtune/helm/values.py:4: helm -> observability" in report
    assert "kvtune/observability/alerts.py:2: observability -> sweep" in report
    assert "router" not in report, "router only imports the loop; it is not in it"


def test_from_kvtune_import_module_points_at_that_module(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "__init__.py": "",
            "files.py": "from kvtune import commands\n",
            "commands/__init__.py": "",
            "commands/common.py": "from kvtune import files\n",
        },
    )
    [group] = cycles(import_edges(package))
    assert group == ["commands", "files.py"]


def test_a_root_module_importing_a_feature_folder_needs_a_reason(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "__init__.py": "",
            "cli.py": f"{ALLOWED_MARK} the entry point\nfrom kvtune.commands import up\n",
            "engine.py": "from kvtune.sweep import trial\n",
            "commands/__init__.py": "",
            "commands/up.py": "",
            "sweep/__init__.py": "",
            "sweep/trial.py": "",
        },
    )
    edges = import_edges(package)
    assert not cycles(edges)
    assert [e.where for e in unexplained_base_imports(edges, package)] == ["kvtune/engine.py:1"]


@pytest.mark.parametrize("text", ["import kvtune.sweep.trial\n", "from .sweep import trial\n"])
def test_absolute_and_relative_imports_of_a_folder_are_the_same_edge(tmp_path: Path, text: str) -> None:
    package = _write(
        tmp_path, {"__init__.py": "", "engine.py": text, "sweep/__init__.py": "", "sweep/trial.py": ""}
    )
    assert [(e.source, e.target) for e in import_edges(package)] == [("engine.py", "sweep")]
