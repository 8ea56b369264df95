"""A wheel of the repository, installed in a fresh venv, runs `kvtune load` and `kvtune sweep --dry-run`.

Nothing is downloaded: the wheel is built without build isolation from a copy of the source, and the fresh
venv sees the dependencies already installed here through a .pth file (which adds that folder to sys.path
but does not run the editable-install hooks inside it, so the checkout's kvtune stays invisible).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from kvtune.engine import Engine
from tests.helpers import REPO

pytestmark = pytest.mark.engine


def run(argv: list[str | Path], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    # No PYTHONPATH: only what the venv itself finds may be imported.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with kvtune installed from its wheel; returns the venv folder."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    # A copy, so the build's egg-info and build/ folders never land in the checkout.
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "kvtune", source / "kvtune", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip"]
    built = run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", root / "dist",
                 source], cwd=root)  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (root / "dist").glob("kvtune-*.whl")

    venv = root / "venv"
    made = run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    site = Path(
        run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=root).stdout.strip()
    )
    (site / "kvtune-test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    install = run([*pip, "--python", python, "install", "--no-deps", "--no-index", wheel], cwd=root)
    assert install.returncode == 0, install.stdout + install.stderr
    return venv


def test_the_wheel_ships_the_locust_files_and_imports_from_the_venv(installed: Path, tmp_path: Path) -> None:
    probe = (
        "import kvtune, kvtune.loadgen.runner as r; print(kvtune.__file__); "
        "print(r._locust_argv(r.LoadSpec(url='x'))[4])"  # the file after `-m locust -f`
    )
    result = run([installed / "bin" / "python", "-c", probe], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    package, locustfile = (Path(line) for line in result.stdout.splitlines())
    assert package.is_relative_to(installed) and not package.is_relative_to(REPO), package
    assert (
        locustfile.is_relative_to(installed)
        and locustfile.name == "shared_prefix.py"
        and locustfile.is_file()
    )


def test_installed_kvtune_load_runs_against_an_engine(
    installed: Path, default_engine: Engine, tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    result = run([installed / "bin" / "kvtune", "load", "--url", default_engine.url, "--users", "1",
                  "--duration", "3", "--warmup", "0", "--max-tokens", "4", "--arg", "system-tokens=64",
                  "--arg", "user-tokens=16", "--json", out], cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TTFT" in result.stdout and "engine hit rate" in result.stdout
    data = json.loads(out.read_text())
    assert data["requests"] > 0 and data["errors"] == 0 and data["workload"] == "shared_prefix"


def test_installed_kvtune_sweep_dry_run(installed: Path, tmp_path: Path) -> None:
    spec = REPO / "deploy" / "sweeps" / "cpu-quick.yaml"
    result = run([installed / "bin" / "kvtune", "sweep", "--dry-run", spec.resolve()], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cpu-quick: 2 configs" in result.stdout and "trial(s)" in result.stdout + result.stderr
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing
