"""The one strict reader of kvtune's documents (kvtune.documents), against hostile input.

Pinned: special files (a FIFO, a symlink to one, a socket, /dev/zero, /dev/null, a folder) refused at once
with the path named; YAML 1.1 scalars read as YAML 1.2 and then refused or accepted by the models by name;
a key written twice named with both lines; an alias bomb refused in milliseconds and a few MB; .inf and .nan
refused in number fields; repeated sweep values refused after coercion; a model's config.json with 0 heads
or Infinity named by field; a trial record damaged since it was written named on resume; a spec whose
base profile is some other file never quoting that file.

Properties (hypothesis, derandomized): the shipped profile and spec rendered as YAML text with aliases,
nested bombs, alias loops, duplicate keys, YAML 1.1 scalars, merge keys, tags and version directives
spliced in, loaded as a profile or a spec: a model or a ConfigError naming the file, in bounded time and
memory, as a bounded message; with a hostile base profile, the spec's error never quotes it. libyaml's
parser and PyYAML's own agree on every such document, and what kvtune writes reads back the same.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from kvtune import kv_math
from kvtune.config_errors import MAX_LINE_CHARS, MAX_LINES, ConfigError, DocumentError
from kvtune.documents import (
    MAX_DOCUMENT_VALUES,
    PARSERS,
    dump_yaml,
    parse_json,
    parse_yaml,
    read_bytes,
    read_json,
)
from kvtune.loadgen.workload_args import WorkloadError
from kvtune.loadgen.workloads import MAX_REPLAY_LINE_BYTES, load_replay
from kvtune.model_store import MARKER, is_prepared, model_dir
from kvtune.profile import EngineProfile, load_profile
from kvtune.sweep.records import MAX_RECORD_BYTES
from kvtune.sweep.run_dir import RESULT_FILE, finished_trials
from kvtune.sweep.spec import SweepSpec, load_spec

REPO = Path(__file__).resolve().parent.parent
PROFILE_FILE = REPO / "deploy" / "profiles" / "cpu-smollm2.yaml"
SPEC_FILE = REPO / "deploy" / "sweeps" / "cpu-quick.yaml"
PROFILE: dict[str, Any] = yaml.safe_load(PROFILE_FILE.read_text())
SPEC: dict[str, Any] = yaml.safe_load(SPEC_FILE.read_text())

# Generous: a shipped document loads in ~20 ms, the 824-byte bomb used to take 104 s and 3.3 GB.
LOAD_SECONDS = 20.0
LOAD_BYTES = 64 * 2**20
# Special files must be refused, never waited on: a read that blocks fails the test after this.
NO_BLOCK_SECONDS = 30.0
CANARY = "CANARY-sk-7f3a"

FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
Loader = Callable[[Path], BaseModel]


# ---- helpers -----------------------------------------------------------------------------------------------


def refusal(load: Callable[[Path], Any], path: Path) -> str:
    """The ConfigError `load` raises for `path`, checked to name it, in few bounded lines."""
    with pytest.raises(ConfigError) as info:
        load(path)
    message = str(info.value)
    assert str(path) in message, message
    assert "Traceback" not in message
    lines = message.splitlines()
    assert len(lines) <= MAX_LINES + 1, message
    assert all(len(line) <= len(str(path)) + MAX_LINE_CHARS + 60 for line in lines), message
    return message


def without_blocking(call: Callable[[], Any], unblock: Path | None = None) -> Any:
    """`call()`'s result or exception, failing (instead of hanging the suite) when it blocks. A FIFO a read
    waits on is opened for writing afterwards, which releases the thread."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(("value", call()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(NO_BLOCK_SECONDS)
    if thread.is_alive():
        if unblock is not None:
            os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"blocked for more than {NO_BLOCK_SECONDS} s")
    kind, value = outcome[0]
    if kind == "raised":
        raise value
    return value


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "profile.yaml"
    os.mkfifo(path)
    return path


@pytest.fixture(scope="module")
def deploy_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/ as shipped (the specs' relative base_profile paths resolve); documents are written inside.
    Each shipped document is loaded once first, so lazy imports are not counted against the first example."""
    root = tmp_path_factory.mktemp("deploy")
    shutil.copytree(REPO / "deploy", root, dirs_exist_ok=True)
    load_profile(root / "profiles" / PROFILE_FILE.name)
    load_spec(root / "sweeps" / SPEC_FILE.name)
    return root


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def profile_text(**changes: str) -> str:
    """The shipped profile as YAML text, with some values replaced by raw YAML (`on`, `.inf`, `010`)."""
    lines = [f"{key}: {json.dumps(value)}" for key, value in PROFILE.items() if key not in changes]
    return "\n".join(lines + [f"{key}: {raw}" for key, raw in changes.items()]) + "\n"


def spec_text(base: Path, **changes: str) -> str:
    data = SPEC | {"base_profile": str(base)}
    lines = [f"{key}: {json.dumps(value)}" for key, value in data.items() if key not in changes]
    return "\n".join(lines + [f"{key}: {raw}" for key, raw in changes.items()]) + "\n"


def measured(call: Callable[[], Any]) -> tuple[Any, float, int]:
    """(result or the exception raised, seconds, peak bytes allocated meanwhile)."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        result: Any = call()
    except Exception as exc:  # noqa: BLE001 - returned for the test to judge
        result = exc
    finally:
        seconds = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return result, seconds, peak


def laughs(levels: int, fanout: int, leaf: str = "lol") -> str:
    """A "billion laughs" as one flow sequence: each level holds `fanout` aliases of the one before."""
    parts = [f"&l0 [{', '.join([leaf] * fanout)}]"]
    parts += [f"&l{i} [{', '.join([f'*l{i - 1}'] * fanout)}]" for i in range(1, levels)]
    return f"[{', '.join(parts)}]"


# ---- special files: refused at once, the path named --------------------------------------------------------

LOADERS = pytest.mark.parametrize("load", [load_profile, load_spec], ids=["profile", "spec"])


@LOADERS
def test_a_fifo_nobody_writes_to_is_refused_at_once(load: Loader, fifo: Path) -> None:
    message = without_blocking(lambda: refusal(load, fifo), unblock=fifo)
    assert message == f"{fifo}: is a pipe nobody wrote to; give the path of a YAML file"


@LOADERS
def test_a_symlink_to_a_fifo_is_refused_naming_the_link(load: Loader, fifo: Path, tmp_path: Path) -> None:
    link = tmp_path / "link.yaml"
    link.symlink_to(fifo)
    message = without_blocking(lambda: refusal(load, link), unblock=fifo)
    assert message.startswith(f"{link}: is a pipe nobody wrote to")


def test_a_pipe_whose_writer_never_finishes_is_given_up(fifo: Path) -> None:
    writer = os.open(fifo, os.O_RDWR)  # a writer that holds the pipe open and never writes
    try:
        with pytest.raises(ConfigError) as info:
            without_blocking(lambda: read_bytes(fifo, pipe_seconds=0.5))
    finally:
        os.close(writer)
    assert str(info.value) == (
        f"{fifo}: is a pipe whose writer did not finish within 0.5 s; give the path of a YAML file"
    )


@LOADERS
@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null", "/dev/urandom"])
def test_devices_are_refused_not_read(load: Loader, device: str) -> None:
    message = without_blocking(lambda: refusal(load, Path(device)))
    assert message == f"{device}: is a device, not a file; give the path of a YAML file"


@LOADERS
def test_a_folder_and_a_socket_are_refused(load: Loader, tmp_path: Path) -> None:
    assert refusal(load, tmp_path) == f"{tmp_path}: is a folder, not a file; give the path of a YAML file"
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        message = without_blocking(lambda: refusal(load, path))
    assert message == f"{path}: is a socket or a device, not a file; give the path of a YAML file"


def test_a_replay_trace_that_is_a_fifo_a_device_or_one_huge_line_is_refused(
    fifo: Path, tmp_path: Path
) -> None:
    with pytest.raises(WorkloadError, match="is a pipe, which can be read only once; save it to a file"):
        without_blocking(lambda: load_replay(fifo, 8), unblock=fifo)
    with pytest.raises(WorkloadError, match="/dev/zero: is a device, not a file"):
        without_blocking(lambda: load_replay(Path("/dev/zero"), 8))
    huge = tmp_path / "trace.jsonl"
    huge.write_bytes(b'{"prompt": "a"}\n{"prompt": "' + b"x" * MAX_REPLAY_LINE_BYTES + b'"}\n')
    with pytest.raises(WorkloadError, match=r"trace.jsonl:2: longer than 4 MiB; each line must be one JSON"):
        load_replay(huge, 8)


def test_a_model_marker_that_is_a_fifo_counts_as_not_prepared(tmp_path: Path) -> None:
    marker = model_dir("smollm2-135m", tmp_path) / MARKER
    marker.parent.mkdir(parents=True)
    os.mkfifo(marker)
    assert without_blocking(lambda: is_prepared("smollm2-135m", tmp_path), unblock=marker) is False


def test_a_trial_record_damaged_since_it_was_written_is_named_on_resume(tmp_path: Path) -> None:
    record = tmp_path / "trials" / "001-abc-r1" / RESULT_FILE
    record.parent.mkdir(parents=True)
    record.write_text('{"status": "done"')
    with pytest.raises(ConfigError) as info:
        finished_trials(tmp_path)
    assert str(info.value).startswith(
        f"{record}: is not a trial record kvtune wrote (the document: Invalid JSON"
    )
    assert str(info.value).endswith("; remove it to measure again")
    os.truncate(record, MAX_RECORD_BYTES + 1)  # sparse: refused from its size, before a byte is read
    with pytest.raises(ConfigError, match="is larger than 256 MiB, the most kvtune reads as a trial record"):
        finished_trials(tmp_path)


# ---- YAML 1.2: what YAML 1.1 coerced silently, the models now see as written -------------------------------


@pytest.mark.parametrize("parser", PARSERS, ids=[p.__name__ for p in PARSERS])
def test_plain_scalars_are_yaml_1_2_core(parser: type) -> None:
    text = (
        "a: on\nb: yes\nc: 010\nd: 1:30:00\ne: 2001-12-01\nf: 0o17\ng: 0x1F\nh: 0b101\ni: 1_000\nj: y\n"
        "k: True\nl: FALSE\nm: ~\nn: 1e3\no: .inf\np: -.Inf\nq: 3.\nr: '010'\ns: !!str 5\nt: !!int 010\n"
    )
    data = parse_yaml(text, Path("doc.yaml"), parser)
    assert data == {
        "a": "on", "b": "yes", "c": 10, "d": "1:30:00", "e": "2001-12-01", "f": 15, "g": 31, "h": "0b101",
        "i": "1_000", "j": "y", "k": True, "l": False, "m": None, "n": 1000.0, "o": math.inf,
        "p": -math.inf, "q": 3.0, "r": "010", "s": "5", "t": 10,
    }  # fmt: skip
    assert math.isnan(parse_yaml("a: .nan\n", Path("doc.yaml"), parser)["a"])


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("port: on", "port: 'on' is not valid: Input should be a valid integer"),
        ("max_num_seqs: yes", "max_num_seqs: 'yes' is not valid: Input should be a valid integer"),
        (
            "ready_timeout_s: 1:30:00",
            "ready_timeout_s: '1:30:00' is not valid: Input should be a valid number",
        ),
        ("ready_timeout_s: .inf", "ready_timeout_s: inf is not valid: Input should be a finite number"),
        ("ready_timeout_s: .nan", "ready_timeout_s: nan is not valid: Input should be a finite number"),
        ("ready_timeout_s: 86401", "ready_timeout_s: 86401 is not valid: Input should be less than or equal"),
        ("shutdown_timeout: 1e9", "shutdown_timeout: 1000000000.0 is not valid: Input should be less than"),
        (
            "gpu_memory_utilization: .nan",
            "gpu_memory_utilization: nan is not valid: Input should be a finite",
        ),
        ("port: true", "port: true/false is a boolean where a number belongs; write the number"),
        ("max_num_seqs: false", "max_num_seqs: true/false is a boolean where a number belongs"),
        ("ready_timeout_s: true", "ready_timeout_s: true/false is a boolean"),
    ],
)
def test_yaml_1_1_scalars_and_non_finite_numbers_are_refused_by_field(
    tmp_path: Path, raw: str, expected: str
) -> None:
    key = raw.split(":", 1)[0]
    path = write(tmp_path, "p.yaml", profile_text(**{key: raw.split(": ", 1)[1]}))
    assert expected in refusal(load_profile, path)


def test_yaml_1_2_values_reach_the_profile_as_written(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "p.yaml",
        profile_text(max_num_seqs="010", served_model_name="2001-12-01", enable_prefix_caching="false"),
    )
    profile = load_profile(path)
    assert profile.enable_prefix_caching is False  # a boolean where one belongs is still one
    assert profile.max_num_seqs == 10  # YAML 1.1 read 010 as octal 8
    assert profile.served_model_name == "2001-12-01"  # YAML 1.1 made it a date


@pytest.mark.parametrize(
    ("field", "raw", "expected"),
    [
        (
            "load",
            "{step_seconds: .nan}",
            "load.step_seconds: nan is not valid: Input should be a finite number",
        ),
        ("load", "{warmup_seconds: 86401}", "load.warmup_seconds: 86401 is not valid: Input should be less"),
        ("budget", "{wall_minutes: .inf}", "budget.wall_minutes: inf is not valid: Input should be a finite"),
        (
            "budget",
            "{wall_minutes: 1e6}",
            "budget.wall_minutes: 1000000.0 is not valid: Input should be less",
        ),
        ("slo", "{ttft_p90_s: .inf}", "slo.ttft_p90_s: inf is not valid: Input should be a finite number"),
        ("workload", "{args: {system-tokens: .inf}}", "workload.args.system-tokens: inf is not valid"),
    ],
)
def test_spec_numbers_are_finite_and_durations_bounded(
    tmp_path: Path, field: str, raw: str, expected: str
) -> None:
    path = write(tmp_path, "s.yaml", spec_text(PROFILE_FILE, **{field: raw}))
    assert expected in refusal(load_spec, path)


def test_a_key_written_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "p.yaml", "name: a\nhost: 0.0.0.0\nport: 8000\nmodel: m\nhost: 0.0.0.0\n")
    assert refusal(load_profile, path) == f"{path}: key 'host' appears twice: lines 2 and 5; keep one"
    path = write(tmp_path, "p.yaml", "model: m\nport: 1\n'port': 2\n")
    assert refusal(load_profile, path) == f"{path}: key 'port' appears twice: lines 2 and 3; keep one"
    path = write(tmp_path, "s.yaml", "space: {max_num_seqs: [1], 1: x, 1.0: y}\n")
    assert refusal(load_spec, path) == (
        f"{path}: key '1.0' appears twice on line 1 (as '1' and '1.0'); keep one"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("&a [1, *a]\n", "alias *a at line 1 is inside its own anchor (a loop that never ends)"),
        ("base: &b {model: m}\n<<: *b\n", "line 2: '<<' merge keys are YAML 1.1, which kvtune does not read"),
        ("%YAML 1.1\n---\nmodel: m\n", "declares YAML 1.1, but kvtune reads YAML 1.2"),
        ("model: !!binary aGk=\n", "line 1: the tag !!binary is not one kvtune reads; remove it"),
        ("model: !!python/object:os.system x\n", "line 1: the tag !!python/object:os.system is not one"),
        ("model: !!bool yes\n", "line 1: 'yes' tagged !!bool is not true or false in YAML 1.2"),
        ("? [a]\n: b\n", "line 1: a key is a list or a mapping; write keys as plain names"),
        ("a: " + "[" * 60 + "]" * 60 + "\n", "is nested too deeply to read; flatten the document"),
    ],
    ids=["loop", "merge", "version", "binary", "python", "bool", "list-key", "deep"],
)
def test_yaml_only_kvtune_refuses(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, "p.yaml", text)
    message = refusal(load_profile, path)
    assert "\n" not in message and expected in message, message


# ---- alias bombs: refused while composing, before anything is built ----------------------------------------


@LOADERS
def test_a_billion_laughs_is_refused_quickly_in_little_memory(load: Loader, tmp_path: Path) -> None:
    bomb = laughs(levels=9, fanout=10)  # 10**9 values once expanded, ~0.5 KB
    if load is load_spec:
        path = write(tmp_path, "s.yaml", spec_text(PROFILE_FILE, space=f"{{max_num_seqs: {bomb}}}"))
    else:
        path = write(tmp_path, "p.yaml", profile_text(extra_args=bomb))
    result, seconds, peak = measured(lambda: load(path))
    assert isinstance(result, ConfigError), result
    assert str(result) == (
        f"{path}: holds more than {MAX_DOCUMENT_VALUES:,} values once its aliases are expanded (at line "
        f"{len(path.read_text().splitlines())}); a profile or spec holds a few hundred: write repeated "
        "values out instead of nesting aliases"
    )
    assert seconds < 5 and peak < 8 * 2**20, (seconds, peak)  # it took 104 s and 3.3 GB


def test_aliases_within_the_bound_still_work(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "s.yaml",
        spec_text(
            PROFILE_FILE,
            space="{max_num_seqs: &seqs [8, 16], max_num_batched_tokens: [512]}",
            validation="{repeats: 1, candidates: &two 2}",
            budget="{trials: *two, wall_minutes: 12}",
        ),
    )
    spec = load_spec(path)
    assert spec.space["max_num_seqs"] == [8, 16] and spec.budget.trials == 2


# ---- the sweep space: one value once -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("space", "expected"),
    [
        ("{max_num_seqs: [2, 2.0, '2']}", "space.max_num_seqs: 2 appears 3 times (as 2, 2.0 and '2')"),
        ("{max_num_seqs: [4, 8, 4]}", "space.max_num_seqs: 4 appears twice; list each value once"),
        (
            "{kv_cache_memory_bytes: ['1GiB', 1073741824]}",
            "space.kv_cache_memory_bytes: 1073741824 appears twice (as '1GiB' and 1073741824)",
        ),
        ("{enable_prefix_caching: [true, 'true']}", "space.enable_prefix_caching: True appears twice"),
        ("{cpu_threads_bind: [0-1, '0-1']}", "space.cpu_threads_bind: '0-1' appears twice"),
    ],
)
def test_a_value_listed_twice_after_coercion_is_refused(tmp_path: Path, space: str, expected: str) -> None:
    path = write(tmp_path, "s.yaml", spec_text(PROFILE_FILE, space=space))
    message = refusal(load_spec, path)
    assert expected in message and message.rstrip().endswith("list each value once"), message


def test_values_of_any_shape_are_compared(tmp_path: Path) -> None:
    space = "{max_num_seqs: [{1: a, b: c}, [1, {2: x}], {1: a, b: c}]}"  # keys no sort can order
    path = write(tmp_path, "s.yaml", spec_text(PROFILE_FILE, space=space))
    assert "space.max_num_seqs: {1: 'a', 'b': 'c'} appears twice; list each value once" in refusal(
        load_spec, path
    )


def test_values_that_differ_are_all_planned(tmp_path: Path) -> None:
    path = write(tmp_path, "s.yaml", spec_text(PROFILE_FILE, space="{max_num_seqs: [2, '4', 8.0]}"))
    assert len(load_spec(path).grid()) == 3


# ---- a model's config.json ---------------------------------------------------------------------------------

CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "max_position_embeddings": 512}


@pytest.mark.parametrize(
    ("config_text", "expected"),
    [
        (json.dumps(CONFIG | {"num_attention_heads": 0}), "num_attention_heads is 0, not a positive whole"),
        (json.dumps(CONFIG | {"num_hidden_layers": -3}), "num_hidden_layers is -3, not a positive whole"),
        (json.dumps(CONFIG | {"hidden_size": 2.5}), "hidden_size is 2.5, not a positive whole number"),
        (json.dumps(CONFIG | {"head_dim": "64"}), "head_dim is a string, not a positive whole number"),
        (json.dumps(CONFIG | {"hidden_size": 2}), "hidden_size 2 is smaller than num_attention_heads 4"),
        ('{"num_hidden_layers": Infinity}', "holds Infinity"),
        ('{"num_hidden_layers": NaN}', "holds NaN"),
        ('{"num_hidden_layers": 1e999}', "a number too large"),
        ('{"hidden_size": 64, "hidden_size": 32}', "twice"),
        ("[1, 2]", "is not a JSON object"),
        ('{"hidden_size": ', "not valid JSON at line 1, column 17"),
    ],
)
def test_a_model_config_it_cannot_use_is_named_by_field(
    tmp_path: Path, config_text: str, expected: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(config_text)
    with pytest.raises(ConfigError) as info:
        kv_math.lookup_geometry(str(model))
    assert str(info.value).startswith(f"{model / 'config.json'}: ") and expected in str(info.value)
    path = write(tmp_path, "p.yaml", profile_text(model=json.dumps(str(model))))
    message = refusal(load_profile, path)
    assert f"{model / 'config.json'} (named in it) cannot be used: " in message and expected in message


def test_a_whole_model_config_gives_its_geometry(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG | {"head_dim": None}))
    geometry = kv_math.lookup_geometry(str(tmp_path))
    assert geometry is not None and (geometry.num_kv_heads, geometry.head_dim) == (4, 16)
    assert kv_math.lookup_geometry(str(tmp_path / "absent")) is None


def test_config_values_that_are_not_sizes_are_refused_in_memory_too() -> None:
    for value in (0, -1, math.inf, math.nan, True, "32", [32]):
        with pytest.raises(DocumentError, match=r"num_attention_heads is .*, not a positive whole number"):
            kv_math.geometry_from_config(CONFIG | {"num_attention_heads": value})


def test_json_documents_refuse_what_the_standard_parser_lets_through() -> None:
    assert parse_json('{"a": [1, 2.5, "x", null, true]}', "d.json") == {"a": [1, 2.5, "x", None, True]}
    for text, problem in [
        ('{"a": -Infinity}', "d.json: holds -Infinity, which is not a number; write a finite number"),
        ('{"a": 1, "a": 2}', "d.json: an object holds the key 'a' twice; keep one"),
        ("[" * 100_000, "d.json: is nested too deeply to read"),
    ]:
        with pytest.raises(DocumentError) as info:
            parse_json(text, "d.json")
        assert str(info.value) == problem


# ---- another file's content is never quoted ----------------------------------------------------------------

HOSTILE_BASES = {
    "env file": f"API_KEY={CANARY}\n",
    "mapping": f"token: {CANARY}\n",
    "bad values": f"model: {CANARY}\nport: {CANARY}\nname: {CANARY}\n",
    "syntax": f"key: {CANARY}\n  - {CANARY}: [\n",
    "duplicate": f"{CANARY}: 1\n{CANARY}: 2\n",
    "tag": f"model: !{CANARY} x\n",
    "bomb": laughs(8, 10, CANARY),
    "not utf-8": f"model: {CANARY}\xe9\n",
}


@pytest.mark.parametrize("content", HOSTILE_BASES.values(), ids=HOSTILE_BASES.keys())
def test_a_base_profile_that_is_some_other_file_is_never_quoted(tmp_path: Path, content: str) -> None:
    secrets = tmp_path / "secrets.env"
    secrets.write_bytes(content.encode("latin-1" if "\xe9" in content else "utf-8"))
    spec = write(tmp_path, "s.yaml", spec_text(secrets))
    message = refusal(load_spec, spec)
    assert message.startswith(f"{spec}: {secrets} (named in it) cannot be used: "), message
    assert CANARY not in message and "\n" not in message


def test_the_base_profile_alone_shows_what_the_spec_does_not(tmp_path: Path) -> None:
    secrets = write(tmp_path, "secrets.env", f"API_KEY={CANARY}\n")
    assert CANARY in refusal(load_profile, secrets)  # loaded on its own, a file's own text helps its author
    spec = write(tmp_path, "s.yaml", spec_text(secrets))
    assert refusal(load_spec, spec) == (
        f"{spec}: {secrets} (named in it) cannot be used: holds a single value, not a mapping of "
        "EngineProfile fields; fix that file or name another"
    )


# ---- properties --------------------------------------------------------------------------------------------

YAML_1_1_SCALARS = [
    "on", "off", "On", "OFF", "yes", "no", "Yes", "NO", "y", "n", "Y", "N", "010", "0b101", "0o17", "0x1F",
    "1:30:00", "190:20:30", "2001-12-01", "2001-12-14t21:59:43.10-05:00", ".inf", "-.inf", ".nan", ".NaN",
    "1e3", "1_000", "~", "null", "True", "FALSE", "+12", "-0", "0.", ".5", "=", "<<", "''", "!!str 010",
    "!!int 010", "!!float 1", "!!bool yes", "!!binary aGk=", "!!timestamp 2001-12-01", "!custom x",
]  # fmt: skip


def render(value: Any, raw: dict[tuple[Any, ...], str], at: tuple[Any, ...] = ()) -> str:
    """`value` as flow YAML (JSON is YAML 1.2), with raw YAML text at the paths in `raw`."""
    if at in raw:
        return raw[at]
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {render(v, raw, (*at, k))}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(render(v, raw, (*at, i)) for i, v in enumerate(value)) + "]"
    return json.dumps(value)


def _paths(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield (*at, key)
        yield from _paths(child, (*at, key))


@st.composite
def hostile_yaml(draw: st.DrawFn, shipped: dict[str, Any]) -> str:
    """`shipped` as YAML text (one top-level key a line, values in flow style) with one to three hostile
    splices: YAML 1.1 scalars, aliases, bombs (nested, in any field or knob), loops, duplicate keys, merge
    keys, tags, a version directive."""
    doc = copy.deepcopy(shipped)
    raw: dict[tuple[Any, ...], str] = {}
    extra: list[str] = []
    head = ""
    paths = list(_paths(doc))
    for number in range(draw(st.integers(1, 3))):
        at = draw(st.sampled_from(paths))
        action = draw(
            st.sampled_from(["scalar", "scalar", "bomb", "alias", "loop", "duplicate", "merge", "version"])
        )
        if action == "scalar":
            raw[at] = draw(st.sampled_from(YAML_1_1_SCALARS))
        elif action == "bomb":
            levels, fanout = draw(st.integers(1, 12)), draw(st.integers(2, 10))
            leaf = draw(st.sampled_from(["lol", "8", "on", "{a: 1}", "[1, 2]"]))
            raw[at] = laughs(levels, fanout, leaf).replace("&l", f"&b{number}l").replace("*l", f"*b{number}l")
        elif action == "alias":  # anchor the first top-level value, repeat it at another top-level key
            keys = list(doc)
            pair = draw(st.lists(st.integers(0, len(keys) - 1), min_size=2, max_size=2, unique=True))
            first, later = keys[min(pair)], keys[max(pair)]
            raw[(first,)] = f"&a{number} {render(doc[first], raw, (first,))}"
            raw[(later,)] = f"*a{number}"
        elif action == "loop":
            raw[at] = f"&o{number} [1, *o{number}]"
        elif action == "duplicate":
            key = draw(st.sampled_from(list(doc)))
            extra.append(f"{json.dumps(key)}: {draw(st.sampled_from(YAML_1_1_SCALARS[:20]))}")
        elif action == "merge":
            extra.append(f"<<: {{{json.dumps(draw(st.sampled_from(list(doc))))}: 1}}")
        else:
            head = draw(st.sampled_from(["%YAML 1.1\n---\n", "%YAML 1.2\n---\n"]))
    lines = [f"{json.dumps(key)}: {render(value, raw, (key,))}" for key, value in doc.items()]
    return head + "\n".join(lines + extra) + "\n"


def check(load: Loader, path: Path, model: type[BaseModel], others: tuple[str, ...] = ()) -> None:
    """A model or a bounded ConfigError naming `path`, in bounded time and memory, quoting no other file."""
    note(path.read_text(encoding="utf-8", errors="replace")[:3000])
    result, seconds, peak = measured(lambda: load(path))
    assert seconds < LOAD_SECONDS and peak < LOAD_BYTES, (seconds, peak)
    if isinstance(result, ConfigError):
        message = str(result)
        lines = message.splitlines()
        assert str(path) in lines[0] and len(lines) <= MAX_LINES + 1, message
        assert all(len(line) <= len(str(path)) + MAX_LINE_CHARS + 60 for line in lines), message
        assert not any(other in message for other in others), message
    else:
        assert isinstance(result, model), result


@settings(FUZZ, max_examples=300)
@given(text=hostile_yaml(PROFILE))
def test_hostile_profiles_are_a_model_or_a_bounded_named_error(deploy_copy: Path, text: str) -> None:
    check(load_profile, write(deploy_copy / "profiles", "hostile.yaml", text), EngineProfile)


@settings(FUZZ, max_examples=300)
@given(text=hostile_yaml(SPEC))
def test_hostile_specs_are_a_model_or_a_bounded_named_error(deploy_copy: Path, text: str) -> None:
    check(load_spec, write(deploy_copy / "sweeps", "hostile.yaml", text), SweepSpec)


@settings(FUZZ, max_examples=200)
@given(
    base=hostile_yaml(PROFILE | {"served_model_name": CANARY}),
    junk=st.sampled_from([*HOSTILE_BASES.values()]),
)
def test_a_spec_on_a_hostile_base_profile_never_quotes_it(deploy_copy: Path, base: str, junk: str) -> None:
    """The base profile carries the canary in a field (then maybe a valid profile: its values may be used)
    and in a stray line that always makes it invalid: then the spec's error must not quote it."""
    base_path = write(deploy_copy / "profiles", "hostile-base.yaml", base + junk.replace("\xe9", ""))
    spec = write(deploy_copy / "sweeps", "on-hostile.yaml", spec_text(Path("../profiles/hostile-base.yaml")))
    with pytest.raises(ConfigError):
        load_profile(base_path)
    check(load_spec, spec, SweepSpec, others=(CANARY,))


@pytest.mark.skipif(len(PARSERS) < 2, reason="PyYAML was built without libyaml: there is one parser")
@settings(FUZZ, max_examples=300)
@given(text=hostile_yaml(PROFILE) | hostile_yaml(SPEC))
def test_libyaml_and_pyyaml_read_the_same_values(text: str) -> None:
    results = []
    for parser in PARSERS:
        try:
            results.append(repr(parse_yaml(text, Path("doc.yaml"), parser)))
        except DocumentError:
            results.append("refused")
    assert results[0] == results[1]


SCALAR_VALUES = st.one_of(
    st.text(max_size=20),
    st.sampled_from([s.split(" ")[-1] for s in YAML_1_1_SCALARS] + ["0o7", "0xF", "1e-3", "-1E+2", "+.5"]),
    st.integers(),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
)


@settings(FUZZ, max_examples=300)
@given(data=st.dictionaries(st.text(max_size=10), SCALAR_VALUES | st.lists(SCALAR_VALUES, max_size=3)))
def test_what_kvtune_writes_reads_back_the_same(data: dict[str, Any]) -> None:
    text = dump_yaml(data)
    for parser in PARSERS:
        assert parse_yaml(text, Path("out.yaml"), parser) == data, text
    assert yaml.safe_load(text) == data, text  # and so does a YAML 1.1 reader (vLLM's --config)


def test_json_reads_regular_files_only(fifo: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a pipe nobody wrote to; give the path of a JSON file"):
        without_blocking(lambda: read_json(fifo), unblock=fifo)
    path = tmp_path / "d.json"
    path.write_text('{"a": 1}')
    assert read_json(path) == {"a": 1}
