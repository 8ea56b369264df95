"""Several engines from one profile, and what engines behind one router must share."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from kvtune.config_errors import ConfigError
from kvtune.engine import free_port
from kvtune.profile import EngineProfile
from kvtune.router.fleet import check_fleet, expand_replicas
from kvtune.router.proxy import ProxySettings
from kvtune.router.server import RouterOptions, RouterServer, RouterTarget, router_options_for
from tests.helpers import default_profile_data


def profile(**overrides: Any) -> EngineProfile:
    return EngineProfile.model_validate(default_profile_data(**overrides))


def test_replicas_get_their_own_port_kv_events_port_and_cores() -> None:
    base = profile(port=9100, kv_events_port=5600, replicas=2, name="smol")
    first, second = expand_replicas(base, cores=frozenset({0, 1}))
    assert [(p.name, p.port, p.kv_events_port) for p in (first, second)] == [
        ("smol-0", 9100, 5600),
        ("smol-1", 9101, 5601),
    ]
    assert (first.cpu_threads_bind, second.cpu_threads_bind) == ("0", "1")
    assert first.engine_env()["VLLM_CPU_OMP_THREADS_BIND"] == "0" and first.cpu_reserved_cores is None
    config = json.loads(second.vllm_args()[second.vllm_args().index("--kv-events-config") + 1])
    assert config["endpoint"] == "tcp://127.0.0.1:5601" and config["enable_kv_cache_events"] is True
    single = profile()
    assert expand_replicas(single) == [single]


def test_replicas_are_refused_where_they_cannot_have_their_own_cores() -> None:
    with pytest.raises(ConfigError, match="need a core each"):
        expand_replicas(profile(replicas=3), cores=frozenset({0, 1}))
    with pytest.raises(ConfigError, match="remove cpu_threads_bind"):
        expand_replicas(
            profile(replicas=2, cpu_threads_bind="0-1", cpu_reserved_cores=None), cores=frozenset({0, 1})
        )


def test_engines_behind_one_router_share_model_name_and_block_size() -> None:
    check_fleet([profile(name="a"), profile(name="b")])
    with pytest.raises(ConfigError, match="same served_model_name"):
        check_fleet([profile(name="a"), profile(name="b", served_model_name="other")])
    with pytest.raises(ConfigError, match="same block_size"):
        check_fleet([profile(name="a"), profile(name="b", block_size=64)])


def test_the_router_policy_follows_the_engines() -> None:
    plain = [profile(name="a"), profile(name="b")]
    events = [profile(name="a", kv_events_port=5600), profile(name="b", kv_events_port=5601)]
    assert router_options_for("auto", plain[:1], 8080, 1.5) is None, "one engine needs no router"
    assert router_options_for("none", plain, 8080, 1.5) is None
    for engines, policy in ((plain, "prefix"), (events, "kv_events")):
        options = router_options_for("auto", engines, 8080, 1.5)
        assert options is not None and options.policy == policy
    with pytest.raises(ConfigError, match="set kv_events_port"):
        router_options_for("kv_events", plain, 8080, 1.5)
    with pytest.raises(ConfigError, match="must be above 1"):
        router_options_for("prefix", plain, 8080, 0.5)


def test_the_router_says_which_engines_its_own_checks_do_not_see_ready(model_path: str) -> None:
    targets = [RouterTarget("a", "http://127.0.0.1:9"), RouterTarget("b", "http://127.0.0.1:10")]
    router = RouterServer(
        RouterOptions(policy="round_robin", port=free_port(), health_period_s=0.1),
        targets,
        ProxySettings(served_model_name="m", block_size=16),
        tokenizer_path=model_path,
    )  # never started: nothing marks the engines ready but the test
    router.engines[0].ready = True
    assert router.wait_seen_ready(["a"]) == []
    started = time.monotonic()
    assert router.wait_seen_ready(["a", "b"]) == ["b"]
    assert time.monotonic() - started < 5, "it waits a few health periods, not forever"
