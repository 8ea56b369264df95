"""Chart values that reach a container's command, args or env values hold no `$(`: Kubernetes expands
`$(NAME)` there from the container's environment, so a value could copy a secret of the pod's (HF_TOKEN, the
API key, object-storage keys) onto a command line or into another variable.

The values are not listed here but found: every free-text value of the chart's schema is set at once to a
probe of its own, the release rendered through Helm's engine (features on: Locust, KV events, the Gateway,
monitoring, the sweep Job, `helm test` pods) under each model source and the CPU build, and each value whose
probe lands in any container's command, args or env value is one the rule must hold for. For each, `$(`
inserted anywhere (generated) is refused by the schema at the value's path, top-level and in an item of
`engines`; the profile's fields among them are also held to it by tests/test_argv_text.py and
tests/test_env_text.py.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any

import helm_python as helm
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic.alias_generators import to_camel

from kvtune.helm.values import ENGINE_ITEM_SECTIONS, values_schema
from kvtune.profile.argv_text import VARIABLE_REFERENCE
from tests.helm_chart import manifests, merged, render_error

Path = tuple[str, ...]
# A value's kind: text, a list of texts, or a map of texts (probed under MAP_KEY).
Kind = str
MAP_KEY = "KVPROBE"
TAILS = st.sampled_from(["", "HF_TOKEN)", "VLLM_API_KEY)", ")", "X"])

# What turns every container of the release on, so each value has a container to reach.
FEATURES: dict[str, Any] = {
    "locust": {"enabled": True, "workers": 1},
    "kvEvents": {"enabled": True},
    "inferencePool": {
        "enabled": True,
        "endpointPicker": {"serviceName": "epp"},
        "httpRoute": {"enabled": True, "gatewayName": "gw"},
    },
    "monitoring": {
        "serviceMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "dashboards": {"enabled": True},
    },
    "sweep": {
        "enabled": True,
        "spec": {"name": "s"},
        "baseProfile": {"model": "m"},
        "storage": {"secretName": "study"},
    },
    "tests": {"enabled": True},
}
# Each model source puts different values into the engine's and Locust's containers.
CONTEXTS: dict[str, dict[str, Any]] = {
    "hub": {},
    "pvc": {"modelSource": {"source": "pvc", "pvc": {"claimName": "weights"}}},
    "s3": {
        "engine": {"model": "s3://bucket/model", "loadFormat": "runai_streamer"},
        "modelSource": {"source": "objectStorage", "objectStorage": {"credentialsSecret": "store"}},
    },
    "embedded": {"engine": {"model": "smollm2-135m"}, "modelSource": {"source": "embedded"}},
    "cpu": {"engine": {"device": "cpu", "kvCacheMemoryBytes": 2**30, "blockSize": 32}},
}
# Values whose format (a quantity, a duration, an extended resource's name, an engine's name; a CPU-only
# value under cuda) refuses the probe, and so any `$`: none can carry a reference. A value that joins them
# fails the test below until it is put here or given a format the probe fits.
FORMATTED: set[Path] = {
    ("cache", "size"),
    ("shmSize",),
    ("gpuResourceName",),
    ("monitoring", "serviceMonitor", "interval"),
    ("monitoring", "podMonitor", "interval"),
    ("inferencePool", "httpRoute", "requestTimeout"),
    ("locust", "engine"),
    ("engine", "cpuThreadsBind"),
    ("autoscaling", "window"),  # a Prometheus duration: ^[1-9][0-9]*(ms|s|m|h)$
}


def _leaves(node: dict[str, Any], path: Path = ()) -> Iterator[tuple[Path, Kind]]:
    """Every free-text value under NODE (a JSON Schema): its path and kind. Enums are not free text."""
    types = node.get("type")
    types = types if isinstance(types, list) else [types]
    for key, child in node.get("properties", {}).items():
        yield from _leaves(child, (*path, key))
    if "string" in types and not {"enum", "const"} & set(node):
        yield path, "text"
    items = node.get("items")
    if "array" in types and isinstance(items, dict) and items.get("type") == "string" and "enum" not in items:
        yield path, "list"
    extra = node.get("additionalProperties")
    if isinstance(extra, dict) and extra.get("type") == "string":
        yield path, "map"


def _shaped(kind: Kind, text: str) -> Any:
    return {"text": text, "list": [text], "map": {MAP_KEY: text}}[kind]


def _at(path: Path, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {path[-1]: value}
    for part in reversed(path[:-1]):
        out = {part: out}
    return out


def _json_path(path: Path, kind: Kind) -> str:
    return "/" + "/".join([*path, *{"text": [], "list": ["0"], "map": [MAP_KEY]}[kind]])


def _flat(values: dict[str, Any], path: Path = ()) -> Iterator[Path]:
    for key, value in values.items():
        if isinstance(value, dict) and value:
            yield from _flat(value, (*path, key))
        else:
            yield (*path, key)


def _container_texts(node: Any) -> Iterator[str]:
    """The command, args and env values of every container and init container in NODE (any object)."""
    if isinstance(node, list):
        for item in node:
            yield from _container_texts(item)
    elif isinstance(node, dict):
        for key in ("containers", "initContainers"):
            for container in node.get(key) or []:
                yield from map(str, container.get("command") or [])
                yield from map(str, container.get("args") or [])
                yield from (str(env.get("value", "")) for env in container.get("env") or [])
        for value in node.values():
            yield from _container_texts(value)


_REFUSED_AT = re.compile(r"at '(/[^']*)'")
# A check's message starts with the value it refuses: `shmSize "x" is not...`, `locust.engine: "x" is...`.
_CHECK_NAMES = re.compile(r"\): ([A-Za-z][A-Za-z0-9.]*)[: ]")


@functools.cache
def discovered() -> tuple[dict[Path, Kind], frozenset[Path], frozenset[Path]]:
    """The chart's free-text values outside `engines` (an item's are the same fields) and their kinds,
    those whose probe reached a container in some context, and those that refused the probe."""
    leaves = {path: kind for path, kind in _leaves(values_schema()) if path[0] != "engines"}
    probes = {path: f"kvprobe-{index}x" for index, path in enumerate(leaves)}
    reached: set[Path] = set()
    refused: set[Path] = set()
    for context in CONTEXTS.values():
        fixed = set(_flat(FEATURES)) | set(_flat(context))
        skip = {path for path in leaves if any(path[: len(f)] == f or f[: len(path)] == path for f in fixed)}
        for _ in range(len(leaves)):
            probed = [
                _at(path, _shaped(kind, probes[path])) for path, kind in leaves.items() if path not in skip
            ]
            try:
                docs = manifests(merged(*probed, FEATURES, context))
                break
            except helm.HelmError as exc:
                message = str(exc)
            named = [tuple(p.strip("/").split("/")) for p in _REFUSED_AT.findall(message)]
            named += [tuple(p.split(".")) for p in _CHECK_NAMES.findall(message)]
            hit = {path for path in leaves if path not in skip and any(n[: len(path)] == path for n in named)}
            assert hit, f"the probes were refused for no value of theirs: {message}"
            skip |= hit
            refused |= hit
        else:
            raise AssertionError("the probes never rendered")
        texts = " ".join(_container_texts(docs))
        reached |= {path for path in leaves if path not in skip and probes[path] in texts}
    return leaves, frozenset(reached), frozenset(refused)


def _item_path(path: Path) -> Path | None:
    """PATH inside an item of `engines`, or None when an item does not set it."""
    sections = {to_camel(section) for section in ENGINE_ITEM_SECTIONS}
    return ("engines", "items", *path) if path[0] in sections else None


def _schema_at(path: Path) -> dict[str, Any]:
    node: dict[str, Any] = values_schema()
    for part in path:
        node = node["items"] if part == "items" else node["properties"][part]
    return node


def _patterns(node: dict[str, Any], kind: Kind) -> list[str]:
    text = {"text": node, "list": node.get("items", {}), "map": node.get("additionalProperties", {})}[kind]
    found = [text["pattern"]] if "pattern" in text else []
    return found + [rule["pattern"] for rule in text.get("allOf", []) if "pattern" in rule]


# ---- which values: found by rendering ----------------------------------------------------------------


def test_the_values_that_reach_a_container_are_found_and_every_other_one_was_probed() -> None:
    _, reached, refused = discovered()
    assert refused <= FORMATTED, f"values refused the probe: can they reach a container? {refused}"
    # The probing found the values known to reach a container (the search itself works).
    assert {
        ("modelSource", "pvc", "subPath"),  # --model /models/SUBPATH, and Locust's tokenizer
        ("kvEvents", "endpoint"),  # --kv-events-config
        ("locust", "extraArgs"),  # Locust's args
        ("locust", "tokenizer"),  # KVTUNE_TOKENIZER
        ("modelSource", "objectStorage", "endpointUrl"),  # AWS_ENDPOINT_URL
        ("monitoring", "dashboards", "labels"),  # the objects test pod's RELEASE_OBJECTS
        ("engine", "model"),
        ("engine", "servedModelName"),
        ("engine", "revision"),
        ("engine", "extraArgs"),
        ("engine", "env"),
        ("engine", "cpuThreadsBind"),
    } <= reached, sorted(reached)
    # ...and not values that go elsewhere (an image, a label, a probe's path).
    elsewhere = {
        ("images", "cuda", "repository"),
        ("podLabels",),
        ("inferencePool", "httpRoute", "pathPrefix"),
    }
    assert not elsewhere & reached


def test_every_value_that_reaches_a_container_refuses_a_reference_in_its_schema_at_every_place() -> None:
    leaves, reached, _ = discovered()
    for path in sorted(reached):
        kind = leaves[path]
        places = [path] + ([item] if (item := _item_path(path)) else [])
        for place in places:
            patterns = _patterns(_schema_at(place), kind)
            assert patterns, f"{'/'.join(place)}: no pattern"
            probe = "kvprobe-1x"
            for at in range(len(probe) + 1):
                text = probe[:at] + VARIABLE_REFERENCE + probe[at:]
                assert any(re.fullmatch(p, text) is None for p in patterns), (place, text)
            assert all(re.fullmatch(p, probe) for p in patterns), place  # plain text passes


# ---- Helm's engine refuses each at its path ----------------------------------------------------------


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), in_engines=st.booleans())
def test_helm_refuses_a_reference_in_any_value_that_reaches_a_container(
    data: st.DataObject, in_engines: bool
) -> None:
    leaves, reached, _ = discovered()
    path = data.draw(st.sampled_from(sorted(reached)))
    kind = leaves[path]
    base = data.draw(st.sampled_from(["kvprobe-1x", "tcp://epp.ns.svc:5557", "org/model", "--seed"]))
    at = data.draw(st.integers(0, len(base)))
    text = base[:at] + VARIABLE_REFERENCE + data.draw(TAILS) + base[at:]
    values = _at(path, _shaped(kind, text))
    where = _json_path(path, kind)
    if in_engines and _item_path(path):
        engine = {"model": "m"} | values.pop("engine", {})
        values = {"engines": [{"name": "a", "engine": engine} | values]}
        where = "/engines/0" + where
    message = render_error(values)
    assert f"at '{where}': " in message, message
    assert "does not match pattern" in message or "Kubernetes" in message, message


@pytest.mark.parametrize(
    ("values", "texts"),
    [
        (
            {"modelSource": {"source": "pvc", "pvc": {"claimName": "w", "subPath": "price$/a$$b"}}},
            ["/models/price$/a$$b"],
        ),
        ({"kvEvents": {"enabled": True, "endpoint": "tcp://epp$:5557"}}, ["tcp://epp$:5557"]),
        ({"locust": {"enabled": True, "extraArgs": ["--tag", "$1", "(a)$"]}}, ["$1", "(a)$"]),
        ({"engine": {"env": {"PRICE": "$5 (a) $$"}}}, ["$5 (a) $$"]),
    ],
    ids=["subPath", "kvEvents.endpoint", "locust.extraArgs", "engine.env"],
)
def test_a_dollar_or_a_parenthesis_apart_renders_verbatim(values: dict[str, Any], texts: list[str]) -> None:
    rendered = list(_container_texts(manifests(values)))
    for text in texts:
        assert any(text in each for each in rendered), (text, rendered)
