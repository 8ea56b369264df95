"""A load run asked for a count of requests keeps its window open until the count is in, then stops sending:
a slower host gives the same sample, later. Against a scripted server whose answers take 0.4 s each, so a
1-second window alone would hold two or three of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtune.loadgen.runner import MEASURED_PATIENCE, LoadSpec, run_load
from kvtune.loadgen.workload_args import STOP_FILE
from tests.hostile_servers import HostileServer
from tests.test_load_hostile import COUNTS, content, event, serve_openai, streamed
from tests.test_load_hostile import tokenizer_root as tokenizer_root

SLOW = streamed(*(event(content(f"w{i} ")) for i in range(4)), event({"choices": [], "usage": COUNTS}),
                b"data: [DONE]\n\n", every_s=0.08)  # fmt: skip
SIZES: dict[str, str | int | float] = {"system-tokens": 16, "user-tokens": 8}


def run(url: str, tmp_path: Path, measured: int | None) -> tuple[float, int, int, list[float]]:
    spec = LoadSpec(url=url, workload_args=SIZES, users=1, duration_s=1.0, warmup_s=0.0, max_tokens=4,
                    measured_requests=measured)  # fmt: skip
    result = run_load(spec, log_dir=tmp_path)
    (work,) = tmp_path.iterdir()
    intended = [json.loads(line)["intended"] for p in work.glob("samples.*.jsonl") for line in p.open()]
    assert (work / STOP_FILE).exists() == (measured is not None)
    return result.window_s, result.requests, result.errors, sorted(intended)


def test_the_window_stays_open_until_the_count_is_in_then_sending_stops(
    tokenizer_root: str,
    tmp_path: Path,
) -> None:
    with HostileServer() as server:
        serve_openai(server, tokenizer_root, SLOW)
        url = f"http://127.0.0.1:{server.port}"
        (tmp_path / "timed").mkdir()
        (tmp_path / "counted").mkdir()
        timed_window, timed, _, _ = run(url, tmp_path / "timed", None)
        window, counted, errors, intended = run(url, tmp_path / "counted", 8)
    assert timed_window == pytest.approx(1.0) and timed < 8, "a 1-second window alone holds fewer"
    assert errors == 0 and counted >= 8
    # The window grew past its second to take the count in, within the patience it is allowed...
    assert 1.0 < window <= MEASURED_PATIENCE * 1.0
    # ...and closed once it had them: one user sends one request at a time, so at most one request was
    # intended after the count was in (the one in flight when the runner looked), and none after the stop.
    assert len(intended) <= counted + 2, (len(intended), counted)


def test_a_count_needs_a_window_to_extend() -> None:
    with pytest.raises(ValueError, match="measured_requests"):
        LoadSpec(url="http://127.0.0.1:1", workload="trace", workload_args={"trace": "x.jsonl"},
                 measured_requests=5)  # fmt: skip
