"""Counts vLLM engine starts in a test session: a vLLM OpenAI server appends one JSON line (time, the test
that started it, its flags) to the file $KVTUNE_TEST_ENGINE_LEDGER names. The test session puts this folder
on PYTHONPATH (tests/conftest.py); any other process only pays an environment lookup. It never raises, and
runs the sitecustomize this one shadows, if there is one."""

# Every Python process the tests start runs this: os.path and plain open(), already loaded at this point,
# rather than pathlib or contextlib, which would cost each of them an import.
# ruff: noqa: PTH100, PTH120, PTH123, SIM105

import os
import sys

_LEDGER_ENV = "KVTUNE_TEST_ENGINE_LEDGER"  # tests/helpers_ledger.py reads what is written here
_SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # how kvtune starts an engine (kvtune.profile)


def _record_engine_start() -> None:
    ledger = os.environ.get(_LEDGER_ENV)
    if not ledger:
        return
    # sys.argv holds only ['-m'] this early; the interpreter's own argv is whole.
    argv = list(getattr(sys, "orig_argv", ()))
    if _SERVER_MODULE not in argv:
        return
    import json
    import time

    line = {
        "time": time.time(),
        "pid": os.getpid(),
        "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
        "flags": argv[argv.index(_SERVER_MODULE) + 1 :],
    }
    with open(ledger, "a", encoding="utf-8") as handle:  # one short append: lines never interleave
        handle.write(json.dumps(line) + "\n")


def _run_shadowed_sitecustomize() -> None:
    """Python imports one sitecustomize, the first on sys.path: run the next one, as it would have been."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin == __file__:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


for _step in (_record_engine_start, _run_shadowed_sitecustomize):
    try:
        _step()
    except Exception:  # noqa: BLE001, S110 - counting must never stop a process from starting
        pass
