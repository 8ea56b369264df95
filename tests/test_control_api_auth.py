"""The control API shows engine status only to whom may see it: the engines' key when they have one, and
never to a network without one; what it shows of a profile holds no value a credential could be in."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvtune.config_errors import ConfigError
from kvtune.control_api import check_exposure, create_app
from kvtune.engine import Engine
from kvtune.profile import EngineProfile
from kvtune.supervisor import HIDDEN, Supervisor, shown_profile

KEY = "sk-control-test-" + "k" * 16


def profile(**fields: object) -> EngineProfile:
    return EngineProfile.model_validate({"name": "e1", "device": "cpu", "model": "fake-model"} | fields)


def supervisor(tmp_path: Path, engine: EngineProfile | None = None) -> Supervisor:
    """Engines that are never started: the supervisor reports their statuses as for running ones."""
    return Supervisor([Engine(engine or profile(), tmp_path / "e1.log")])


def test_with_keys_the_engine_routes_need_one_of_them_and_health_stays_open(tmp_path: Path) -> None:
    client = TestClient(create_app(supervisor(tmp_path), api_keys=["other-key-1", KEY]))
    assert client.get("/health").status_code == 200
    for path in ("/engines", "/engines/e1"):
        missing = client.get(path)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get(path, headers={"Authorization": f"Basic {KEY}"}).status_code == 401
        assert client.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert client.get(path, headers={"Authorization": "Bearer other-key-1"}).status_code == 200
    assert KEY not in client.get("/engines", headers={"Authorization": f"Bearer {KEY}"}).text


def test_without_keys_loopback_answers_freely(tmp_path: Path) -> None:
    client = TestClient(create_app(supervisor(tmp_path)))
    assert client.get("/engines").status_code == 200
    check_exposure("127.0.0.1", [])
    check_exposure("::1", [])


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.org"])  # noqa: S104 - refused
def test_a_network_address_without_a_key_is_refused(host: str) -> None:
    with pytest.raises(ConfigError, match=f"--control-host {host}: .* set api_key_env"):
        check_exposure(host, [])
    check_exposure(host, [KEY])


def test_extra_args_values_are_never_shown(tmp_path: Path) -> None:
    engine = profile(extra_args=["--seed", "1234567", "--max-logprobs=987654", "-O3"])
    shown = shown_profile(engine)
    assert shown["extra_args"] == ["--seed", HIDDEN, f"--max-logprobs={HIDDEN}", HIDDEN]
    text = str(shown)
    assert "1234567" not in text and "987654" not in text
    answer = TestClient(create_app(supervisor(tmp_path, engine))).get("/engines")
    assert answer.json()[0]["profile"]["extra_args"] == shown["extra_args"]
