"""Each profile field carries its own facts (vLLM flag, chart key or why not, sweep knob), and the argv, the
flags extra_args may not repeat, the chart's engine values and flag table, and the sweep's knobs are all
derived from them: a field added in one place reaches every one of them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import pytest
from pydantic import Field

from kvtune.profile import MANAGED_ENV, MANAGED_FLAGS, EngineProfile, FieldFacts, facts_of, knobs
from kvtune.profile.fields import MissingFacts, chart_fields, chart_omissions
from kvtune.reference import profile_fields

REPO = Path(__file__).resolve().parent.parent
GPU_PROFILE = REPO / "deploy" / "profiles" / "gpu-qwen25-7b-a100.yaml"


# A real vLLM flag no profile field sets yet, added the way a developer would: one annotated field.
class WithNewField(EngineProfile):
    long_prefill_token_threshold: Annotated[
        int | None, FieldFacts(chart=True, flag="long-prefill-token-threshold", knob=True)
    ] = Field(None, gt=0, description="Prompts longer than this are prefilled in chunks.")


def test_every_field_declares_its_facts() -> None:
    facts = facts_of(EngineProfile)
    assert list(facts) == list(EngineProfile.model_fields)
    # The chart either carries a field or says what stands for it in a pod: nothing is left out silently.
    assert set(chart_fields(EngineProfile)) | set(chart_omissions(EngineProfile)) == set(facts)
    assert all(reason.strip() for reason in chart_omissions(EngineProfile).values())


def test_a_field_without_facts_is_refused_naming_it() -> None:
    class Careless(EngineProfile):
        new_setting: int | None = None

    with pytest.raises(MissingFacts, match=r"Careless\.new_setting: declare it as Annotated"):
        facts_of(Careless)


def test_the_derived_tables_hold_what_the_profile_renders() -> None:
    everything = EngineProfile(
        model="m", device="cuda", kv_cache_memory_bytes=1 << 30, num_gpu_blocks_override=9,
        max_num_seqs=4, max_num_batched_tokens=64, enable_chunked_prefill=True, enforce_eager=True,
        max_model_len=64, dtype="float16", block_size=16, kv_events_port=5557, revision="main",
        load_format="safetensors", tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2,
        kv_offloading_size=16, kv_offloading_backend="native", kv_cache_metrics=True,
        kv_cache_metrics_sample=0.1,
    )  # fmt: skip
    rendered = set(everything.vllm_options("/m"))
    # One KV budget at a time; the key goes in VLLM_API_KEY, never on argv.
    assert set(MANAGED_FLAGS) - rendered == {"gpu-memory-utilization", "api-key"}
    assert MANAGED_FLAGS["api-key"] == "api_key_env"
    assert set(MANAGED_ENV.values()) == {"cpu_threads_bind", "cpu_reserved_cores"}
    assert "max_num_seqs" in knobs(EngineProfile) and "port" not in knobs(EngineProfile)


def test_a_new_field_refuses_its_flag_in_extra_args() -> None:
    with pytest.raises(ValueError, match="the profile sets itself; remove it and set the profile field "
                       "'long_prefill_token_threshold'"):  # fmt: skip
        WithNewField(model="m", device="cuda", extra_args=["--long_prefill_token_threshold=9"])


# The chart values and the sweep spec read the profile class when they are imported: the new class stands in
# for EngineProfile before either is, as it would once written into kvtune/profile/model.py.
PROBE = """
import json, sys
from pathlib import Path
import kvtune.profile, kvtune.profile.model
from tests.test_profile_fields import WithNewField
kvtune.profile.EngineProfile = kvtune.profile.model.EngineProfile = WithNewField
from kvtune.helm import build, values
from kvtune.sweep import spec

base = kvtune.profile.load_profile(Path(sys.argv[1]))
profile = base.model_copy(update={"long_prefill_token_threshold": 512})
engine_values = values.chart_values(profile)["engine"]
sweep = spec.SweepSpec.model_validate({
    "name": "t", "base_profile": sys.argv[1], "slo": {"ttft_p99_s": 1.5},
    "space": {"long_prefill_token_threshold": [256, 512], "max_num_seqs": [8]},
})
trial = sweep.base().with_knobs(sweep.grid()[0])
print(json.dumps({
    "argv": profile.vllm_args(),
    "serve_yaml": profile.serve_yaml(),
    "schema": values.values_schema()["properties"]["engine"]["properties"].get("longPrefillTokenThreshold"),
    "chart_values": engine_values.get("longPrefillTokenThreshold"),
    "from_chart": values.profile_from_engine(engine_values).long_prefill_token_threshold,
    "flag_table": [row for row in build.flag_table() if row["key"] == "longPrefillTokenThreshold"],
    "knobs": list(spec.KNOBS),
    "grid": sweep.grid(),
    "trial_argv": trial.vllm_args(),
}))
"""


def test_a_new_field_reaches_argv_the_chart_and_the_sweep() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(GPU_PROFILE)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    # argv and the serve config
    assert seen["argv"][-2:] == ["--long-prefill-token-threshold", "512"]
    assert "long-prefill-token-threshold: 512" in seen["serve_yaml"]
    # the chart: its schema keeps the field's type and bounds, its values carry it, its template's flag table
    # passes it to vLLM, and the chart's engine section reads back as the same profile
    assert seen["schema"]["description"] == "Prompts longer than this are prefilled in chunks."
    assert seen["schema"]["type"] == ["integer", "null"] and seen["schema"]["exclusiveMinimum"] == 0
    assert seen["chart_values"] == 512 and seen["from_chart"] == 512
    assert seen["flag_table"] == [
        {
            "key": "longPrefillTokenThreshold",
            "flag": "long-prefill-token-threshold",
            "type": "int",
            "omit": [],
        }
    ]
    # the sweep: a knob, planned and applied to the trial's engine
    assert "long_prefill_token_threshold" in seen["knobs"]
    assert [config["long_prefill_token_threshold"] for config in seen["grid"]] == [256, 512]
    assert seen["trial_argv"][-2:] == ["--long-prefill-token-threshold", "256"]


def test_a_new_field_reaches_the_profile_reference_page() -> None:
    page = profile_fields.render(WithNewField)
    section = page.split("{#long_prefill_token_threshold}", 1)[1].split("\n## ", 1)[0]
    assert "Prompts longer than this are prefilled in chunks." in section
    assert "| `--long-prefill-token-threshold` | `engine.longPrefillTokenThreshold` | yes |" in section
    assert "| integer or null | `null` | > 0 |" in section
    # and in the page's summary table, linked to its section
    assert "[`long_prefill_token_threshold`](#long_prefill_token_threshold)" in page
