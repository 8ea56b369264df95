"""What tests share besides fixtures: the repository's paths, profiles derived from the shipped default, the
keyed engine's made-up credentials and the made-up CPU hosts kvtune.platform is shown."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune import platform
from kvtune.engine import free_port
from kvtune.profile import EngineProfile

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROFILE = REPO / "deploy" / "profiles" / "cpu-smollm2.yaml"
ARTIFACTS = REPO / "test-artifacts"

ProfileFactory = Callable[..., EngineProfile]


def default_profile_data(**overrides: Any) -> dict[str, Any]:
    """The shipped CPU profile as a dict, on a free port, with overrides."""
    data: dict[str, Any] = yaml.safe_load(DEFAULT_PROFILE.read_text())
    data["port"] = free_port()
    # Test engines start eager (~40 s, not ~2 min compiled): what they assert does not depend on speed.
    data["enforce_eager"] = True
    data.update(overrides)
    return data


def write_test_profile(path: Path, **overrides: Any) -> Path:
    """The shipped CPU profile as tests run it (eager, a free port), written to `path`."""
    path.write_text(yaml.safe_dump(default_profile_data(**overrides)))
    return path


# 16-bit weights and KV: the fp8 test's same-budget baseline and, where fp8 KV cannot run, the quality
# gate's benign precision change. One engine for both (bf16 starts slowly on CPUs without AVX-512 BF16).
SIXTEEN_BIT = {"dtype": "bfloat16", "kv_cache_dtype": "auto", "kv_cache_dtype_fallback": None}

# Made-up credentials of the keyed engine: an API key clients must send and a secret the engine gets.
KEYED_API_KEY = "kvtune-test-key-5b1f0c"
KEYED_SECRET = "kvtune-test-secret-9d2e7a"
KEYED_CREDENTIALS = {"KVTUNE_TEST_API_KEY": KEYED_API_KEY, "KVTUNE_TEST_SECRET": KEYED_SECRET}
KEYED_SYSTEM_PROMPT = "You answer in one short sentence about European capitals. " * 40  # > 2 KV blocks


def keyed_profile_data(**overrides: Any) -> dict[str, Any]:
    """The shipped profile with an API key, a secret and a warm-up prefix (credentials by name only)."""
    settings: dict[str, Any] = {
        "name": "keyed",
        "api_key_env": "KVTUNE_TEST_API_KEY",
        "secret_env": ["KVTUNE_TEST_SECRET"],
        "max_model_len": 2048,
        "kv_cache_memory_bytes": "256MiB",
        "warmup": [{"role": "system", "text": KEYED_SYSTEM_PROMPT}],
    }
    return default_profile_data(**(settings | overrides))


def files_holding(folder: Path, *values: str) -> list[str]:
    """Every file under `folder` whose bytes contain one of `values`."""
    found = []
    for path in folder.rglob("*"):
        if path.is_file() and any(value.encode() in path.read_bytes() for value in values):
            found.append(str(path))
    return found


# ---- the CPU host, real and made up ------------------------------------------------------------------------

# The feature flags kvtune reads from /proc/cpuinfo, by the host they stand for: only AVX-512 (or AMX) lets
# vLLM's CPU build keep an fp8 KV cache.
HOSTS = {"avx512": frozenset({"avx2", "avx512f"}), "avx2": frozenset({"avx2"})}


def vllm_keeps_fp8_kv() -> bool:
    """vLLM's own test for fp8 KV on CPU (`_get_attn_isa` in vllm/v1/attention/backends/cpu_attn.py, 0.32):
    torch's AVX-512 or AMX detection, independent of kvtune's reading of /proc/cpuinfo."""
    import torch  # slow to import: only the engine tests ask

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


@dataclass(frozen=True)
class FakeHost:
    """The CPU host kvtune.platform reports for one test (the `fake_host` fixture); `use` changes it."""

    monkeypatch: pytest.MonkeyPatch

    def use(self, cpu: str = "avx512", cores: Iterable[int] | None = None, device: str | None = None) -> None:
        """CPU: a key of HOSTS. CORES: the core ids the process may run on (else the real affinity).
        DEVICE: the vLLM build detect_device reports ("cpu" whatever is installed; else what is installed)."""
        flags = HOSTS[cpu]
        self.monkeypatch.setattr(platform, "host_cpu_flags", lambda: flags)
        if cores is not None:
            ids = frozenset(cores)
            self.monkeypatch.setattr(platform, "host_cpu_ids", lambda: ids)
        if device is not None:
            self.monkeypatch.setenv("VLLM_TARGET_DEVICE", device)
