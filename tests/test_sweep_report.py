"""Sweep summary and report from synthetic trials: ranking, confidence intervals, noise warnings, miss
explanations in engine figures, and the Markdown/HTML report with its inline SVG plots. No engines."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from markupsafe import escape

from kvtune import platform
from kvtune.loadgen.results import EngineDeltas, LatencySamples, LoadResult, Percentiles
from kvtune.profile import load_profile
from kvtune.sweep.confidence import combine
from kvtune.sweep.goodput import slo_misses, verdicts
from kvtune.sweep.plots import pareto_front
from kvtune.sweep.records import QualityRecord, StepRecord, TrialRecord, config_id
from kvtune.sweep.report import write_report
from kvtune.sweep.spec import Slo, SweepSpec
from kvtune.sweep.summary import build_summary, ci95, explain_miss, t95, ttft_breakdown

REPO = Path(__file__).resolve().parent.parent
BASE = REPO / "deploy" / "profiles" / "cpu-smollm2.yaml"
SLO = Slo(ttft_p99_s=1.0)
KV_TOKENS = 20_000


HOSTS = {"avx512": frozenset({"avx2", "avx512f"}), "avx2": frozenset({"avx2"})}


@pytest.fixture(autouse=True)
def avx512_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "host_cpu_flags", lambda: HOSTS["avx512"])


def make_spec(repeats: int = 1) -> SweepSpec:
    return SweepSpec.model_validate(
        {
            "name": "report-test",
            "base_profile": str(BASE),
            "space": {"max_num_seqs": [4, 8, 16], "enable_prefix_caching": [True, False]},
            "slo": SLO.model_dump(),
            "repeats": repeats,
        }
    )


def load(
    rate: float,
    ttft_p99: float,
    *,
    tokens: int | None = KV_TOKENS,
    achieved: float | None = None,
    unsent: int = 0,
    errors: int = 0,
    **engine: Any,
) -> LoadResult:
    """A realistic open-loop step: 30 s window, engine figures overridable, and at least the 299 requests a
    p99 verdict at 95% needs (every TTFT sample at `ttft_p99`)."""
    requests = max(300, round(rate * 30))
    ttft = Percentiles(
        count=requests,
        mean=ttft_p99 / 2,
        p50=ttft_p99 / 2,
        p90=ttft_p99 * 0.8,
        p95=ttft_p99 * 0.9,
        p99=ttft_p99,
    )
    capacity = (
        {
            "cache_dtype": "auto",
            "block_size": 32,
            "num_blocks": (tokens or 0) // 32,
            "tokens": tokens,
            "prefix_caching": True,
        }
        if tokens
        else None
    )
    deltas: dict[str, Any] = {
        "prefix_cache_queries": 60_000.0,
        "prefix_cache_hits": 36_000.0,
        "hit_rate": 0.6,
        "peak_kv_usage": 0.55,
        "peak_running": 6.0,
        "kv_capacity": capacity,
        "mean_queue_s": 0.02,
        "mean_prefill_s": 0.08,
        "mean_engine_ttft_s": 0.12,
    }
    return LoadResult(
        workload="shared_prefix",
        arrival="poisson",
        users=16,
        window_s=30,
        requests=requests,
        errors=errors,
        ttft=ttft,
        itl=Percentiles.of([0.02, 0.03, 0.04]),
        e2e=Percentiles.of([ttft_p99 + 1.5] * 5),
        request_rate=rate,
        output_token_rate=rate * 64,
        intended_rate=rate,
        achieved_rate=rate if achieved is None else achieved,
        unsent=unsent,
        engine=EngineDeltas.model_validate(deltas | engine),
        samples=LatencySamples.of(
            [ttft_p99] * requests, [0.02, 0.03, 0.04] * requests, [ttft_p99 + 1.5] * requests
        ),
    )


def step(rate: float, ttft_p99: float, **kwargs: Any) -> StepRecord:
    result = load(rate, ttft_p99, **kwargs)
    judged = verdicts(result, SLO)
    return StepRecord(
        rate=rate, passed=combine(judged) == "pass", decision=combine(judged), misses=slo_misses(judged),
        verdicts=judged, result=result,
    )  # fmt: skip


def trial(
    number: int,
    knobs: dict[str, Any],
    goodput: float,
    *,
    repeat: int = 1,
    quality: QualityRecord | None = None,
    **miss_engine: Any,
) -> TrialRecord:
    """A measured config: steps pass up to `goodput`, then one at twice it misses (engine overridable)."""
    steps = [step(goodput / 2, 0.3), step(goodput, 0.6)] if goodput else []
    # Past the edge a queue builds: the engine's own TTFT is mostly waiting for a slot.
    queued = {"mean_queue_s": 1.4, "mean_prefill_s": 0.2, "mean_engine_ttft_s": 1.7, "peak_waiting": 9.0}
    steps.append(step(goodput * 2 or 0.5, 2.5, **(queued | miss_engine)))
    return TrialRecord(
        trial=number,
        config_id=config_id(knobs),
        knobs=knobs,
        repeat=repeat,
        status="done",
        goodput=goodput,
        steps=steps,
        quality=quality,
    )


def pruned(knobs: dict[str, Any], reason: str, status: str = "pruned") -> TrialRecord:
    return TrialRecord.model_validate(
        {"trial": 0, "config_id": config_id(knobs), "knobs": knobs, "status": status, "reason": reason}
    )


def quality(passed: bool) -> QualityRecord:
    return QualityRecord(
        token_agreement=0.97 if passed else 0.812,
        logprob_divergence=0.021,
        min_token_agreement=0.95,
        max_logprob_divergence=0.05,
        passed=passed,
        kv_cache_dtype="fp8_e4m3",
        prompts=32,
    )


A = {"max_num_seqs": 4, "enable_prefix_caching": True}
B = {"max_num_seqs": 8, "enable_prefix_caching": True}
C = {"max_num_seqs": 16, "enable_prefix_caching": True}
D = {"max_num_seqs": 16, "enable_prefix_caching": False}
PRUNE_REASON = "KV pool holds 4,096 tokens; 16 requests in flight need 19,200: they would be preempted"


def summarize(trials: list[TrialRecord], repeats: int = 1, **kwargs: Any) -> Any:
    options: dict[str, Any] = {
        "finished": True,
        "stopped_because": None,
        "elapsed_s": 754.0,
        "host_note": "CPU host, 8 cores",
    } | kwargs
    return build_summary(make_spec(repeats), trials, **options)


# --- Summary -------------------------------------------------------------------------------------------


def test_best_is_the_highest_eligible_goodput_and_configs_keep_first_seen_order() -> None:
    trials = [
        trial(1, A, 2.0),
        trial(2, B, 4.0),
        trial(3, C, 8.0, quality=quality(passed=False)),  # highest, but the fp8 gate failed it
        pruned(D, PRUNE_REASON),
    ]
    summary = summarize(trials)
    assert [c.config_id for c in summary.configs] == [config_id(k) for k in (A, B, C, D)]
    assert summary.best is not None and summary.best.config_id == config_id(B)
    assert summary.best.mean_goodput == 4.0
    by_id = {c.config_id: c for c in summary.configs}
    assert by_id[config_id(C)].eligible is False and by_id[config_id(C)].status == "done"
    assert by_id[config_id(D)].status == "pruned" and by_id[config_id(D)].reason == PRUNE_REASON
    assert summary.trials_run == 3  # the pruned config never started an engine
    assert summary.within_noise is None  # 4.0 vs 2.0 with one repeat: a real difference


def test_no_best_when_nothing_met_the_slo() -> None:
    summary = summarize([trial(1, A, 0.0), trial(2, B, 0.0)])
    assert summary.best is None


def test_ci95_is_the_student_t_interval_of_the_mean() -> None:
    low, high = ci95([2.0, 2.2, 1.8]) or (0.0, 0.0)
    half = 4.303 * 0.2 / 3**0.5  # sd 0.2, 3 values, t(df=2)
    assert low == pytest.approx(2.0 - half) and high == pytest.approx(2.0 + half)
    assert ci95([2.0]) is None
    assert t95(1) == 12.706 and t95(30) == 2.042 and t95(100) == 1.96


def test_repeats_average_and_get_an_interval() -> None:
    trials = [trial(i + 1, A, g, repeat=i + 1) for i, g in enumerate([2.0, 2.2, 1.8])]
    config = summarize(trials, repeats=3).configs[0]
    assert config.goodputs == [2.0, 2.2, 1.8]
    assert config.mean_goodput == pytest.approx(2.0)
    assert config.ci95 is not None and config.ci95[0] < 2.0 < config.ci95[1]


def repeated(
    first: dict[str, Any], first_goodputs: list[float], second: dict[str, Any], second_goodputs: list[float]
) -> list[TrialRecord]:
    trials = [trial(i + 1, first, g, repeat=i + 1) for i, g in enumerate(first_goodputs)]
    return trials + [trial(i + 4, second, g, repeat=i + 1) for i, g in enumerate(second_goodputs)]


def test_overlapping_intervals_are_called_within_noise() -> None:
    summary = summarize(repeated(A, [2.0, 2.2, 1.8], B, [1.9, 2.1, 1.7]), repeats=3)
    assert summary.best is not None and summary.best.config_id == config_id(A)
    note = summary.within_noise
    assert note is not None
    assert note.startswith(f"The best two configs ({config_id(A)}: 2.00 req/s, 95% CI ")
    assert f"{config_id(B)}: 1.90 req/s, 95% CI " in note
    assert "are within noise of each other: their 95% intervals overlap" in note
    assert "Prefer the cheaper one or add repeats." in note


def test_separated_intervals_are_not_noise() -> None:
    summary = summarize(repeated(A, [4.0, 4.1, 3.9], B, [2.0, 2.1, 1.9]), repeats=3)
    assert summary.within_noise is None


def test_single_measurements_close_together_ask_for_repeats() -> None:
    note = summarize([trial(1, A, 2.0), trial(2, B, 1.9)]).within_noise
    assert note is not None
    assert f"({config_id(A)}: 2.00 req/s; {config_id(B)}: 1.90 req/s)" in note
    assert "cannot be told apart by a single measurement" in note
    assert "`repeats: 3`" in note
    assert summarize([trial(1, A, 2.0), trial(2, B, 1.5)]).within_noise is None


# --- Why a step missed ---------------------------------------------------------------------------------


def test_explain_miss_puts_preemptions_first_with_the_figures() -> None:
    # Queueing also dominates here; preemptions are the root cause and must win.
    missed = step(
        4.0,
        2.5,
        preemptions=37,
        peak_kv_usage=0.98,
        mean_queue_s=1.5,
        mean_engine_ttft_s=1.8,
        peak_waiting_by_reason={"capacity": 5.0},
    )
    assert explain_miss(missed) == (
        "37 preemptions: the KV pool (20,000 tokens) filled (peak usage 98%), requests were evicted and "
        "re-prefilled."
    )


def test_explain_miss_other_causes_in_order() -> None:
    waited = step(4.0, 2.5, peak_waiting_by_reason={"capacity": 5.0, "deferred": 0.0}, peak_kv_usage=0.9)
    assert explain_miss(waited).startswith("Up to 5 requests waited for KV capacity: the KV pool (20,000")
    queued = step(4.0, 2.5, mean_queue_s=1.2, mean_prefill_s=0.2, mean_engine_ttft_s=1.5, peak_running=4.0)
    assert explain_miss(queued).startswith(
        "First tokens waited 1.20 s in the queue for a slot (of 1.50 s engine TTFT, peak 4 running"
    )
    assert "max_num_seqs" in explain_miss(queued)
    prefill = step(4.0, 2.5, mean_queue_s=0.1, mean_prefill_s=1.1, mean_engine_ttft_s=1.3, hit_rate=0.05)
    assert explain_miss(prefill) == (
        "Prefill took 1.10 s per request (of 1.30 s engine TTFT): long prompts or little prefix-cache reuse "
        "(hit rate 5%)."
    )
    behind = step(
        4.0, 0.5, achieved=2.5, unsent=40, mean_queue_s=None, mean_prefill_s=None, mean_engine_ttft_s=None
    )
    assert explain_miss(behind).startswith(
        "The engine could not keep up: achieved 2.50 req/s of 4.00, 40 requests never sent"
    )


def itl_step(itl_gap: float, **engine: Any) -> StepRecord:
    """A step judged on TTFT and ITL whose every inter-token gap is `itl_gap` (TTFT well within target)."""
    result = load(1.0, 0.5, **engine)
    result = result.model_copy(
        update={"samples": LatencySamples.of([0.5] * 300, [itl_gap] * 9000, [2.0] * 300)}
    )
    judged = verdicts(result, Slo(ttft_p90_s=3.0, itl_p99_s=0.5, confidence=0.9))
    return StepRecord(
        rate=1.0, passed=combine(judged) == "pass", decision=combine(judged), misses=slo_misses(judged),
        verdicts=judged, result=result,
    )  # fmt: skip


def test_an_itl_miss_with_prefill_in_the_steps_names_the_step_budget() -> None:
    # Steps of up to 512 tokens with at most 6 streams decoding: prefill rode along with the decodes.
    wide = itl_step(0.8, largest_step_tokens=512.0, mean_step_tokens=140.0, mean_engine_itl_s=0.31)
    assert wide.misses and wide.misses[0].startswith("ITL")
    why = explain_miss(wide, {"max_num_batched_tokens": 2048})
    assert why == (
        "Streams paused while steps carried prefill: the largest engine steps held up to 512 tokens (mean "
        "140, max_num_batched_tokens 2,048) with at most 6 streams decoding, and every stream's next token "
        "waits for its whole step, engine mean ITL 0.31 s: a smaller max_num_batched_tokens splits "
        "prefills into shorter steps."
    )
    # Without the config's knobs the figures stay, and the budget is not guessed.
    assert "max_num_batched_tokens as the profile sets it" in explain_miss(wide)
    # Steps no wider than the decodes: the batch, not the budget, is named.
    narrow = itl_step(0.8, largest_step_tokens=8.0, peak_running=6.0)
    assert "max_num_seqs" in explain_miss(narrow) and "splits prefills" not in explain_miss(narrow)
    # A step that met the ITL target gets no ITL explanation.
    assert "Streams paused" not in explain_miss(itl_step(0.1, largest_step_tokens=512.0, mean_queue_s=1.2))


def test_a_queued_ttft_with_prefills_cut_by_a_small_budget_names_the_step_budget() -> None:
    # 300 requests, 120,000 prompt tokens of which 30,000 hit the cache: 300 uncached tokens each,
    # prefilled in steps of at most 128 tokens, so at least 3 steps each.
    queued = step(
        4.0, 2.5, mean_queue_s=1.2, mean_prefill_s=0.2, mean_engine_ttft_s=1.5, peak_running=4.0,
        prompt_tokens=120_000.0, prefix_cache_hits=30_000.0, largest_step_tokens=128.0,
    )  # fmt: skip
    why = explain_miss(queued, {"max_num_batched_tokens": 128})
    assert why.endswith(
        "; each request's ~300 uncached prompt tokens took at least 3 steps of at most 128 tokens "
        "(max_num_batched_tokens 128): a larger max_num_batched_tokens prefills in fewer steps."
    )
    # Prefills that fit one step: the budget did not cut them, and is not blamed.
    roomy = step(
        4.0, 2.5, mean_queue_s=1.2, mean_prefill_s=0.2, mean_engine_ttft_s=1.5, peak_running=4.0,
        prompt_tokens=120_000.0, prefix_cache_hits=30_000.0, largest_step_tokens=512.0,
    )  # fmt: skip
    assert "fewer steps" not in explain_miss(roomy, {"max_num_batched_tokens": 2048})


def test_ttft_breakdown_splits_the_engine_ttft() -> None:
    parts = ttft_breakdown(load(1.0, 0.5, mean_queue_s=0.3, mean_prefill_s=0.5, mean_engine_ttft_s=1.0))
    assert parts["queue"] == 0.3 and parts["prefill"] == 0.5
    assert parts["other"] == pytest.approx(0.2)
    assert ttft_breakdown(load(1.0, 0.5, mean_engine_ttft_s=None))["other"] is None


def test_pareto_front_keeps_undominated_points() -> None:
    points = [(0.5, 100.0), (0.4, 80.0), (0.9, 300.0), (0.6, 90.0), (1.2, 250.0)]
    assert pareto_front(points) == [(0.4, 80.0), (0.5, 100.0), (0.9, 300.0)]


# --- Report --------------------------------------------------------------------------------------------


def section(html: str, start: str, end: str) -> str:
    return html.split(start, 1)[1].split(end, 1)[0]


def test_report_shows_the_winner_plots_and_why_steps_missed(tmp_path: Path) -> None:
    trials = [
        trial(1, A, 2.0, preemptions=37, peak_kv_usage=0.98),
        trial(2, B, 4.0, quality=quality(passed=True)),
        trial(3, C, 8.0, quality=quality(passed=False)),
        pruned(D, PRUNE_REASON),
        pruned({"max_num_seqs": 32}, "engine exited: <b>CUDA</b> out of memory", status="failed"),
    ]
    summary = summarize(trials)
    md_path, html_path = write_report(tmp_path, make_spec(), summary, trials)
    assert (md_path, html_path) == (tmp_path / "report.md", tmp_path / "report.html")
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert plots == ["goodput.svg", "kv.svg", "pareto.svg"]

    html, md = html_path.read_text(), md_path.read_text()
    winner = config_id(B)
    assert f'<p class="verdict">Winner: <code>{winner}</code> (max_num_seqs=8' in html
    assert f"**Winner: `{winner}`** (max_num_seqs=8 enable_prefix_caching=True): goodput 4.00 req/s" in md
    # Self-contained: three inline SVGs, no XML prolog, no link to the files.
    assert html.count("<svg") == 3 and "<?xml" not in html and "plots/goodput.svg" not in html
    assert "![Goodput per config](plots/goodput.svg)" in md

    misses = section(html, '<table id="misses">', "</table>")
    preempted_row = next(
        row for row in misses.split("<tr>") if config_id(A) in row and "<td>fail</td>" in row
    )
    assert "37 preemptions: the KV pool (20,000 tokens) filled" in preempted_row
    assert "TTFT p99 ≥ 2.500 s &gt; 1.000 s (300 samples)" in preempted_row
    assert f"| `{config_id(A)}` | 1 | 4.00 | 300 | fail | TTFT p99 ≥ 2.500 s > 1.000 s (300 samples); " in md
    assert "error rate ≤ 0.99% ≤ 1.00% (300 samples) | 37 preemptions" in md
    # The configs table: 0 preemptions at goodput, but the worst step's 37 are shown too.
    assert (
        f"| `{config_id(A)}` | max_num_seqs=4 enable_prefix_caching=True | done | 2.00 req/s | 20,000 | "
        "60% | 0 (37 at 4.00 req/s) |" in md
    )

    # Quality-gate figures against their thresholds, and reasons verbatim (escaped in HTML).
    assert "FAILED: token agreement 0.812 (min 0.950), log-prob divergence 0.021 (max 0.050)" in html
    assert PRUNE_REASON in html and PRUNE_REASON in md
    assert "engine exited: &lt;b&gt;CUDA&lt;/b&gt; out of memory" in html and "<b>CUDA" not in html
    assert "Stopped early" not in html and "Finished: every planned trial ran." in html
    assert "Host: CPU host, 8 cores" in md


def test_report_says_plainly_when_no_config_met_the_slo(tmp_path: Path) -> None:
    close = trial(1, A, 0.0)  # misses at TTFT p99 2.5 s
    far = trial(2, B, 0.0, preemptions=12)
    far.steps[0] = step(0.5, 9.0, preemptions=12)
    summary = summarize([close, far], finished=False, stopped_because="interrupted (Ctrl-C)")
    md_path, html_path = write_report(tmp_path, make_spec(), summary, [close, far])
    md, html = md_path.read_text(), html_path.read_text()
    assert "No config met the SLO at any rate tried." in md and "No config met the SLO" in html
    assert (
        f"Closest: `{config_id(A)}` (max_num_seqs=4 enable_prefix_caching=True) at 0.50 req/s, "
        "where it missed TTFT p99 ≥ 2.500 s > 1.000 s (300 samples). First tokens waited 1.40 s in the queue"
        in md
    )
    assert "Winner" not in md
    assert "Stopped early: interrupted (Ctrl-C)." in html
    assert html.count("<svg") == 3


def test_report_carries_the_noise_warning(tmp_path: Path) -> None:
    trials = repeated(A, [2.0, 2.2, 1.8], B, [1.9, 2.1, 1.7])
    summary = summarize(trials, repeats=3)
    md_path, html_path = write_report(tmp_path, make_spec(repeats=3), summary, trials)
    assert summary.within_noise is not None
    assert f"> {summary.within_noise}" in md_path.read_text()
    assert re.search(r'<p class="noise">The best two configs \(\w{8}: 2\.00 req/s', html_path.read_text())


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_report_says_when_the_host_changed_the_shipped_profile(
    host: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped base profile asks for fp8 KV: kept with AVX-512, 32-bit KV without (the report says so)."""
    monkeypatch.setattr(platform, "host_cpu_flags", lambda: HOSTS[host])
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    spec = make_spec()
    _adapted, host_note = load_profile(spec.base_profile).adapted_to_host()  # as the sweep takes it
    trials = [trial(1, A, 2.0), trial(2, B, 4.0)]
    summary = summarize(trials, host_note=host_note)
    md_path, html_path = write_report(tmp_path, spec, summary, trials)
    md, html = md_path.read_text(), html_path.read_text()
    if host == "avx2":
        note = "kv_cache_dtype fp8 -> auto: vLLM keeps an fp8 KV cache on CPU only with AVX-512 or AMX"
        assert host_note is not None and host_note.startswith(note)
        assert f"- Host: {host_note}" in md
        assert f"<li>Host: {escape(host_note)}</li>" in html
    else:
        assert host_note is None
        assert "Host:" not in md and "Host:" not in html
