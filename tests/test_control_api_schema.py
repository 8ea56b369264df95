"""The control API driven from its own OpenAPI schema (schemathesis, in-process ASGI, no engines).

schemathesis generates requests for every operation (`MAX_EXAMPLES` per operation and phase) and checks that
no answer is a server error, that every status code, content type and body conforms to the schema, and that no
answer holds a secret value. The engines are real `Engine` objects that are never started: the supervisor
builds their statuses as it does for running ones.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import settings
from schemathesis import Case, CheckContext, Response

from kvtune.control_api import create_app
from kvtune.engine import Engine
from kvtune.profile import EngineProfile
from kvtune.supervisor import EngineStatus, State, Supervisor

MAX_EXAMPLES = 60
SECRET_VALUES = {"HF_TOKEN": "hf_fuzz_secret_7Q2x9", "KVTUNE_TEST_API_KEY": "sk-fuzz-api-key-3Vb8"}

# Names a generated path parameter meets: real ones (every character a name may hold) and near misses.
ENGINE_NAMES = ("ready-engine", "failed.engine", "under_score", "starting")


def _supervisor(tmp: Path) -> Supervisor:
    profiles = [
        EngineProfile(
            name=name,
            device="cpu",
            model="fake-model",
            port=8100 + index,
            secret_env=["HF_TOKEN"],
            api_key_env="KVTUNE_TEST_API_KEY",
        )
        for index, name in enumerate(ENGINE_NAMES)
    ]
    supervisor = Supervisor([Engine(profile, tmp / f"{profile.name[:3]}.log") for profile in profiles])
    ready, failed, odd, _starting = supervisor.engines
    # Every state and every optional field filled in somewhere, as a running controller would report them.
    ready.status = dataclasses.replace(
        ready.status,
        state=State.READY,
        pid=4242,
        warmup_done=True,
        warmup_seconds=0.25,
        kv_capacity={"cache_dtype": "auto", "block_size": 32, "num_blocks": 10, "tokens": 320},
        host_note="kv_cache_dtype fp8 -> auto: no AVX-512",
    )
    failed.status = dataclasses.replace(
        failed.status, state=State.FAILED, restarts=5, last_exit_code=-9, last_failure="ValueError: boom"
    )
    odd.status = dataclasses.replace(odd.status, state=State.RESTARTING, restarts=1)
    return supervisor


@pytest.fixture(autouse=True)
def secrets_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The secrets the profiles name are set, as where `kvtune up` runs; no answer may hold their values."""
    for name, value in SECRET_VALUES.items():
        monkeypatch.setenv(name, value)


@schemathesis.check
def no_secret_values(ctx: CheckContext, response: Response, case: Case[Any]) -> bool | None:
    text = response.content.decode("utf-8", "replace")
    leaked = [name for name, value in SECRET_VALUES.items() if value in text]
    if leaked:
        raise AssertionError(f"the answer holds the value of {', '.join(leaked)}")
    return None


# Built at import: schemathesis parametrizes the test from the schema at collection time (its fixture-based
# loader, `schemathesis.pytest.from_fixture`, fails under pytest 9: "'Function' object has no attribute
# '_nodeid'"). Nothing is started and no file is written: the engines are never started.
schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(_supervisor(Path("kvtune-logs"))))


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None)
def test_control_api_conforms_to_its_schema(case: Case[Any]) -> None:
    case.call_and_validate(additional_checks=[no_secret_values])


# The same API when the engines have a key: the schema declares it, and no request without it gets status
# (schemathesis's own checks include that a route declaring authentication refuses a request without it).
keyed_schema = schemathesis.openapi.from_asgi(
    "/openapi.json",
    create_app(_supervisor(Path("kvtune-logs")), api_keys=[SECRET_VALUES["KVTUNE_TEST_API_KEY"]]),
)


@keyed_schema.parametrize()
@settings(max_examples=MAX_EXAMPLES // 3, deadline=None)
def test_keyed_control_api_conforms_to_its_schema(case: Case[Any]) -> None:
    case.call_and_validate(additional_checks=[no_secret_values])


def test_schema_documents_every_answer(tmp_path: Path) -> None:
    """The schema says what each operation returns, from the supervisor's own status type."""
    spec = create_app(_supervisor(tmp_path)).openapi()
    components = spec["components"]["schemas"]
    responses = {path: ops["get"]["responses"] for path, ops in spec["paths"].items()}
    assert responses["/health"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Health"
    }
    listing = responses["/engines"]["200"]["content"]["application/json"]["schema"]
    assert listing["type"] == "array" and listing["items"] == {"$ref": "#/components/schemas/EngineStatus"}
    one = responses["/engines/{name}"]
    assert one["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/EngineStatus"
    }
    assert one["404"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/NotFound"}
    status_fields = {field.name for field in dataclasses.fields(EngineStatus)}
    assert set(components["EngineStatus"]["properties"]) == status_fields
    assert components["State"]["enum"] == [state.value for state in State]
