"""Every shipped profile renders exactly as its golden file says: the engine's command, its sh script, its
`vllm serve` YAML, its environment and the chart values (`kvtune render` and `--as helm-values`).

A change to how profiles render shows up here as a diff to review; when it is meant, regenerate the golden
files with `KVTUNE_UPDATE_GOLDEN=1 pytest tests/test_render_golden.py` and commit them with the change.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from kvtune.helm.values import chart_values, chart_values_header
from kvtune.model_store import EMBEDDED_MODELS, model_dir
from kvtune.profile import load_profile

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden" / "render"
# The shipped profiles, and two that set every field that renders: on the CPU build, and the fields only a
# CUDA build takes.
EVERY_FLAG = sorted((GOLDEN.parent / "profiles").glob("every-flag*.yaml"))
PROFILES = [*sorted((ROOT / "deploy" / "profiles").glob("*.yaml")), *EVERY_FLAG]
# Where the rendering host keeps things, replaced by fixed words so the files read the same everywhere.
MODEL_CACHE = Path("/models")


def rendered(profile_path: Path) -> str:
    # The profile as written, not adapted to this host (an AVX2-only host would fall back from fp8 KV).
    profile = load_profile(profile_path)
    model_path = str(model_dir(profile.model, MODEL_CACHE)) if profile.model in EMBEDDED_MODELS else None
    values = chart_values(profile, ttft_p99_slo_seconds=None)
    parts = {
        "command": shlex.join(profile.launch_command(model_path)),
        "script": profile.serve_script(model_path),
        "serve yaml": profile.serve_yaml(model_path),
        "env": "\n".join(f"{k}={shlex.quote(v)}" for k, v in profile.engine_env().items()),
        "capacity": str(profile.kv_capacity_tokens()),
        "helm values": "".join(f"# {line}\n" for line in chart_values_header(profile))
        + yaml.safe_dump(values, sort_keys=False),
    }
    text = "".join(f"=== {name}\n{body.rstrip()}\n" for name, body in parts.items())
    return text.replace(sys.executable, "PYTHON")


@pytest.mark.parametrize("profile_path", PROFILES, ids=[p.stem for p in PROFILES])
def test_shipped_profile_renders_as_its_golden_file(profile_path: Path) -> None:
    golden = GOLDEN / f"{profile_path.stem}.txt"
    text = rendered(profile_path)
    if os.environ.get("KVTUNE_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text, encoding="utf-8")
    assert golden.exists(), f"no golden file {golden}; create it with KVTUNE_UPDATE_GOLDEN=1"
    assert text == golden.read_text(encoding="utf-8")


def test_every_golden_file_has_its_profile() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.txt")) == sorted(p.stem for p in PROFILES)
