"""The router against hostile clients and faulty engines: bodies and prompts too large to read, engines whose
/metrics lies, stalls or never ends, answers that never finish, malformed KV events, background tasks that
fail. Engines are ScriptedEngine stand-ins (tests/fake_engine.py), the tokenizer a real (tiny) byte-level
BPE whose calls are counted; everything binds 127.0.0.1. Real engines behind the router: test_router_real.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry
from tokenizers import Encoding, Tokenizer, decoders, models, pre_tokenizers

from kvtune import metrics
from kvtune.config_errors import ConfigError
from kvtune.engine import free_port
from kvtune.profile import EngineProfile
from kvtune.router.engine_watch import WatchLimits, apply_message, watch_engine
from kvtune.router.kv_events import MAX_EVENT_BLOCKS, RejectedEvent, SequenceTracker
from kvtune.router.policies import EngineState
from kvtune.router.prefix_index import block_hashes
from kvtune.router.proxy import ProxySettings
from kvtune.router.request_limits import UNKNOWN_CONTEXT_BODY_BYTES, default_max_body_bytes
from kvtune.router.router_metrics import RouterMetrics
from kvtune.router.server import (
    RouterOptions,
    RouterServer,
    RouterTarget,
    kv_events_endpoint,
    router_options_for,
)
from kvtune.router.supervise import Backoff, supervise
from kvtune.router.token_bytes import TokenBytes, bound_of, token_bytes_of
from kvtune.router.upstream import Upstream
from tests.fake_engine import ScriptedEngine
from tests.helpers import default_profile_data

MODEL = "m"
MAX_MODEL_LEN = 32
LONGEST_TOKEN = 4  # the counting tokenizer's: "ĠĠĠĠ", four spaces
BLOCK = 4


def eventually(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.02)


def byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return tokenizer


class CountingBackend:
    """A real byte-level BPE (every byte a token, runs of spaces merged up to four), calls counted."""

    def __init__(self) -> None:
        vocab = {char: index for index, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
        self.vocab = vocab | {"ĠĠ": len(vocab), "ĠĠĠĠ": len(vocab) + 1}
        self._tokenizer = byte_level_bpe(self.vocab, [("Ġ", "Ġ"), ("ĠĠ", "ĠĠ")])
        self._tokenizer.decoder = decoders.ByteLevel()
        self.calls = 0

    def encode(self, sequence: str, add_special_tokens: bool = True) -> Encoding:
        self.calls += 1
        return self._tokenizer.encode(sequence, add_special_tokens=add_special_tokens)

    def encode_batch(self, sequences: list[str], add_special_tokens: bool = True) -> list[Encoding]:
        self.calls += len(sequences)
        return list(self._tokenizer.encode_batch(sequences, add_special_tokens=add_special_tokens))

    def to_str(self) -> str:
        return self._tokenizer.to_str()


class CountingTokenizer:
    """What the router needs of a Hugging Face tokenizer: encode, a chat template and the fast backend."""

    def __init__(self) -> None:
        self.backend_tokenizer = CountingBackend()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend_tokenizer.encode(text, add_special_tokens).ids)

    def apply_chat_template(
        self, conversation: Any, add_generation_prompt: bool = False, tokenize: bool = False, **_: Any
    ) -> Any:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in conversation)
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text, add_special_tokens=False) if tokenize else text


@dataclass
class Fleet:
    """A router started in this process in front of one scripted engine, e0."""

    router: RouterServer
    engines: list[ScriptedEngine]
    tokenizer: CountingTokenizer
    client: httpx.Client
    kv_events_url: str | None = None

    @property
    def engine(self) -> ScriptedEngine:
        return self.engines[-1]

    @property
    def state(self) -> EngineState:
        return self.router.engines[0]

    def metric(self, name: str, **labels: str) -> float:
        return self.router.registry.get_sample_value(name, labels) or 0.0

    def complete(self, prompt: Any, **extra: Any) -> httpx.Response:
        return self.client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, **extra})

    def restart_engine(self) -> None:
        self.engines.append(ScriptedEngine(port=self.engine.port))


@dataclass
class FleetFactory:
    started: list[Fleet] = field(default_factory=list)

    def __call__(self, kv_events_url: str | None = None, api_key: str | None = None, **options: Any) -> Fleet:
        """A fleet whose router takes OPTIONS (RouterOptions fields) and, with API_KEY, asks for it."""
        engine, tokenizer = ScriptedEngine(), CountingTokenizer()
        base = RouterOptions(
            policy="round_robin", port=free_port(), health_period_s=0.05, watch_deadline_s=1.0
        )
        router = RouterServer(
            dataclasses.replace(base, **options),
            [RouterTarget("e0", engine.url, kv_events_url, capacity_blocks=64)],
            ProxySettings(served_model_name=MODEL, block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
                          answer_deadline_s=1.0, max_answer_bytes=1 << 20, api_key=api_key),
            tokenizer_path="unused: the tokenizer is given",
            tokenizer=tokenizer,
        )  # fmt: skip
        tokenizer.backend_tokenizer.calls = 0  # what the router's setup used it for: samples, not prompts
        fleet = Fleet(
            router, [engine], tokenizer, httpx.Client(base_url=router.url, timeout=60), kv_events_url
        )
        self.started.append(fleet)
        router.start()
        eventually(lambda: fleet.state.ready, "the router sees e0 ready")
        return fleet

    def stop(self) -> None:
        for fleet in self.started:
            fleet.client.close()
            fleet.router.stop()
            for engine in fleet.engines:
                engine.stop()


@pytest.fixture
def make_fleet() -> Iterator[FleetFactory]:
    factory = FleetFactory()
    yield factory
    factory.stop()


@pytest.fixture
def fleet(make_fleet: FleetFactory) -> Fleet:
    return make_fleet()


# ---- hostile clients -----------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_refused_whether_its_length_is_declared_or_chunked(fleet: Fleet) -> None:
    limit = fleet.router.settings.max_body_bytes
    assert limit == default_max_body_bytes(MAX_MODEL_LEN, LONGEST_TOKEN), "sized from the tokenizer's bound"
    body = json.dumps({"model": MODEL, "prompt": "a" * (limit + 1024)}).encode()

    def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked
        for start in range(0, len(body), 1 << 16):
            yield body[start : start + (1 << 16)]

    declared = fleet.client.post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
    chunked = fleet.client.post("/v1/completions", content=chunks())
    for response in (declared, chunked):
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
    assert fleet.engine.posts == [], "nothing reached the engine"
    assert fleet.tokenizer.backend_tokenizer.calls == 0, "nothing was tokenised"
    assert fleet.metric(metrics.ROUTER_REFUSED, reason="too_large") == 2
    assert fleet.complete("hello").status_code == 200 and len(fleet.engine.posts) == 1


def test_a_prompt_too_long_by_its_bytes_is_refused_before_it_is_tokenised(fleet: Fleet) -> None:
    backend = fleet.tokenizer.backend_tokenizer
    bound = MAX_MODEL_LEN * LONGEST_TOKEN  # bytes from which a prompt has MAX_MODEL_LEN tokens or more
    assert fleet.complete("a" * 20).status_code == 200
    assert backend.calls >= 1
    measured = fleet.complete("a" * (bound - 28))  # 100 bytes, 100 tokens: too long, found by tokenising
    assert measured.status_code == 400 and "has 100 tokens" in measured.json()["error"]["message"]
    tokenised = backend.calls
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "b" * bound}]}
    for response in (
        fleet.complete("a" * bound),
        fleet.complete("x" * 1_000_000),
        fleet.client.post("/v1/chat/completions", json=chat),
    ):
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and "has at least" in error["message"]
    assert backend.calls == tokenised, "the tokenizer was not called for prompts proved too long"
    assert fleet.metric(metrics.ROUTER_REFUSED, reason="too_long") == 4
    assert len(fleet.engine.posts) == 1


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "not_json"),  # deeper than Python's JSON reader goes
        (json.dumps({"model": MODEL, "prompt": [1, 2**40]}).encode(), "bad_prompt"),
        (json.dumps({"model": MODEL, "prompt": [1, -3]}).encode(), "bad_prompt"),
        (json.dumps({"model": MODEL, "prompt": [True, False]}).encode(), "bad_prompt"),
        (b'{"model": "m", "prompt": "\\ud800 a lone surrogate"}', "bad_prompt"),
    ],
)
def test_hostile_json_is_refused_not_crashed_on(fleet: Fleet, content: bytes, reason: str) -> None:
    response = fleet.client.post("/v1/completions", content=content)
    assert response.status_code == 400 and response.json()["error"]["message"]
    assert fleet.metric(metrics.ROUTER_REFUSED, reason=reason) == 1
    assert fleet.engine.posts == []


# ---- faulty engines: answers ------------------------------------------------------------------------------


def test_a_whole_answer_has_a_deadline_and_a_size_cap_and_a_stream_only_per_read_timeouts(
    fleet: Fleet,
) -> None:
    fleet.engine.answer_mode = "slow"  # a byte every 0.2 s: 200 s for the whole answer
    slow = fleet.complete("hello")
    assert slow.status_code == 504
    assert fleet.metric(metrics.ROUTER_UPSTREAM_ERRORS, engine="e0", kind="timeout") == 1
    fleet.engine.answer_mode = "endless"
    endless = fleet.complete("hello")
    assert endless.status_code == 502 and "answered too much" in endless.json()["error"]["message"]
    assert fleet.metric(metrics.ROUTER_UPSTREAM_ERRORS, engine="e0", kind="too_large") == 1
    # A stream lasting twice the whole-answer deadline is a long generation, passed through to its end.
    fleet.engine.answer_mode = "stream"
    with fleet.client.stream(
        "POST", "/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True}
    ) as r:
        streamed = b"".join(r.iter_raw())
    assert streamed.count(b"data: ") == 9 and streamed.endswith(b"data: [DONE]\n\n")
    assert fleet.state.in_flight == 0


# ---- faulty engines: the health watcher ------------------------------------------------------------------

UNHEALTHY_METRICS = {
    "garbage": "watch_malformed",
    "html": "watch_malformed",
    "non_finite": "watch_malformed",
    "error": "watch_malformed",
    "slow": "watch_timeout",  # a slow-loris past the 1 s deadline
    "endless": "watch_too_large",
    "huge_declared": "watch_too_large",
    "redirect": "watch_malformed",  # not followed: an engine cannot send the router elsewhere
    "gzip_bomb": "watch_malformed",  # not inflated: its 64 KiB are not text
}


def test_malformed_metrics_make_the_engine_unready_are_counted_and_it_recovers(fleet: Fleet) -> None:
    def failures(kind: str) -> float:
        return fleet.metric(metrics.ROUTER_UPSTREAM_ERRORS, engine="e0", kind=kind)

    def unready_and_counted(kind: str, before: float) -> bool:
        return not fleet.state.ready and failures(kind) > before

    for mode, kind in UNHEALTHY_METRICS.items():
        before = failures(kind)
        fleet.engine.metrics_mode = mode
        eventually(
            functools.partial(unready_and_counted, kind, before),
            f"/metrics {mode}: e0 unready and a {kind} counted",
        )
        refused = fleet.complete("hello")
        assert refused.status_code == 503, f"/metrics {mode}: an unready engine gets no traffic"
        fleet.engine.metrics_mode = "healthy"
        eventually(lambda: fleet.state.ready, f"/metrics healthy again after {mode}: e0 ready")
    assert fleet.engine.posts == [] and fleet.engine.redirects_followed == 0
    assert fleet.metric(metrics.ROUTER_BACKGROUND_FAILURES, engine="e0", task="watch") == 0, "never died"
    assert fleet.complete("hello").status_code == 200


def test_an_engine_that_dies_is_unready_until_it_answers_again(fleet: Fleet) -> None:
    fleet.engine.stop()
    eventually(lambda: not fleet.state.ready, "a dead engine is seen unready")
    assert fleet.complete("hello").status_code == 503
    fleet.restart_engine()
    eventually(lambda: fleet.state.ready, "the engine back on its port is seen ready")
    assert fleet.complete("hello").status_code == 200


class FlakyUpstream(Upstream):
    """The router's HTTP session, whose first read fails in a way nobody foresaw."""

    def __init__(self) -> None:
        super().__init__(connect_timeout_s=2.0, read_timeout_s=10.0)
        self.faults = 1

    async def get_whole(self, url: str, limit_bytes: int, deadline_s: float) -> tuple[int, bytes]:
        if self.faults:
            self.faults -= 1
            raise RuntimeError("a fault nobody foresaw")
        return await super().get_whole(url, limit_bytes, deadline_s)


def test_a_failed_watcher_is_logged_counted_and_restarted(caplog: pytest.LogCaptureFixture) -> None:
    engine = ScriptedEngine()
    state = EngineState(name="e0", url=engine.url, capacity_blocks=8, ready=True)
    registry = CollectorRegistry()
    router_metrics, upstream = RouterMetrics(registry), FlakyUpstream()
    seen_unready: list[bool] = []

    async def scenario() -> None:
        run = functools.partial(watch_engine, state, upstream, router_metrics, WatchLimits(period_s=0.05))

        def on_failure(failed: EngineState) -> None:
            seen_unready.append(not failed.ready)

        task = asyncio.create_task(
            supervise("watch", state, run, router_metrics, Backoff(first_s=0.2), on_failure=on_failure)
        )
        try:
            while not (state.ready and upstream.faults == 0):
                await asyncio.sleep(0.02)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await upstream.close()

    try:
        with caplog.at_level(logging.ERROR, logger="kvtune.router.supervise"):
            asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    finally:
        engine.stop()
    assert seen_unready == [True], "the engine was marked unready when its watcher failed"
    assert (
        registry.get_sample_value(metrics.ROUTER_BACKGROUND_FAILURES, {"engine": "e0", "task": "watch"}) == 1
    )
    [line] = [record.getMessage() for record in caplog.records]
    assert "engine e0" in line and "RuntimeError: a fault nobody foresaw" in line and "\n" not in line
    assert state.ready, "the restarted watcher read the engine healthy"


# ---- faulty engines: KV events ---------------------------------------------------------------------------

TOKENS = list(range(100, 100 + 3 * BLOCK))


def stored(hashes: list[Any], parent: Any, tokens: list[Any], block_size: Any = BLOCK) -> dict[str, Any]:
    """A BlockStored event as vLLM 0.32.0 writes it (a map tagged by its class name)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip


def batch(*events: Any) -> bytes:
    return msgspec.msgpack.encode([1.5, list(events), None])


def frames(sequence: int, payload: bytes) -> list[bytes]:
    return [b"kv@e0", sequence.to_bytes(8, "big"), payload]


FIRST = stored([11], None, TOKENS[:BLOCK])
SECOND = stored([12], 11, TOKENS[BLOCK : 2 * BLOCK])
WITHOUT_SIZE = {key: value for key, value in stored([12], 11, TOKENS[:BLOCK]).items() if key != "block_size"}
# (event, the reason it is skipped for, whether skipping it makes the view stale)
MALFORMED: dict[str, tuple[Any, str, bool]] = {
    "block_size 0": (stored([12], 11, [], block_size=0), "block_size", False),
    "hashes of the wrong type": (stored(["twelve"], 11, TOKENS[:BLOCK]), "wrong_fields", False),
    "token ids of the wrong type": (stored([12], 11, ["a"] * BLOCK), "wrong_fields", False),
    "a missing field": (WITHOUT_SIZE, "wrong_fields", False),
    "a huge hash list": (stored(list(range(MAX_EVENT_BLOCKS + 1)), 11, []), "too_large", False),
    "tokens not filling the blocks": (stored([12], 11, TOKENS[:3]), "token_ids", False),
    "a negative token id": (stored([12], 11, [-1, 1, 2, 3]), "token_ids", False),
    "a huge hash": (stored([b"h" * 100], 11, TOKENS[:BLOCK]), "hash", False),
    "an unknown kind": ({"type": "BlockTouched", "block_hashes": [11]}, "unknown_kind", False),
    "a removal of the wrong type": ({"type": "BlockRemoved", "block_hashes": "all"}, "wrong_fields", True),
    "an event with no kind": ({"block_hashes": [11]}, "wrong_fields", True),
    "an event that is not a map": (42, "wrong_fields", True),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_kv_event_is_counted_and_skipped_and_the_next_good_one_applied(case: str) -> None:
    event, reason, stale = MALFORMED[case]
    state = EngineState(name="e0", url="http://127.0.0.1:9", capacity_blocks=64, ready=True)
    tracker, rejected = SequenceTracker(), list[RejectedEvent]()
    chain = block_hashes(TOKENS, BLOCK)
    assert apply_message(state, frames(0, batch(FIRST)), tracker, rejected.append) is None
    problem = apply_message(state, frames(1, batch(event, SECOND)), tracker, rejected.append)
    assert [r.reason for r in rejected] == [reason]
    if not stale:  # skipping it leaves the view holding no block the engine lacks
        assert problem is None and state.reported_fresh
        assert state.reported.match(chain) == 2, "the good event after it was applied"
        return
    assert problem is not None and problem.startswith(f"malformed event ({reason}")
    state.reported.cleared()  # what the follower does with a problem: the view is rebuilt
    state.reported_fresh = False
    cleared = batch({"type": "AllBlocksCleared"}, FIRST)
    assert apply_message(state, frames(2, cleared), tracker, rejected.append) is None
    assert state.reported_fresh and state.reported.match(chain) == 1, "fresh again once the cache was cleared"


def test_a_view_claiming_more_than_the_engine_can_hold_is_rebuilt() -> None:
    state = EngineState(name="e0", url="http://127.0.0.1:9", capacity_blocks=2, ready=True)
    roots = [stored([1000 + index], None, [index] * BLOCK) for index in range(9)]
    problem = apply_message(state, frames(0, batch(*roots)), SequenceTracker())
    assert problem is not None and problem.startswith("view larger than the engine's KV pool")


def test_the_follower_survives_malformed_events_and_counts_them(make_fleet: FleetFactory) -> None:
    # An engine serving on 0.0.0.0 sends its events to tcp://0.0.0.0:PORT; the router listens on loopback.
    profile = EngineProfile.model_validate(
        default_profile_data(name="e0", host="0.0.0.0", kv_events_port=free_port())  # noqa: S104
    )
    listen = kv_events_endpoint(profile)
    assert listen is not None and listen.startswith("tcp://127.0.0.1:")
    fleet = make_fleet(kv_events_url=listen)
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    publisher.connect(json.loads(profile.kv_events_config() or "{}")["endpoint"])
    chain = block_hashes(TOKENS, BLOCK)
    try:
        # A publisher's first messages are lost until the subscription reaches it: batch 0 again and again.
        deadline = time.monotonic() + 60
        while fleet.state.reported.match(chain) < 1:
            publisher.send_multipart(frames(0, batch(stored([12], 11, [], block_size=0), FIRST)))
            assert time.monotonic() < deadline, "the follower never applied the good event"
            time.sleep(0.05)
        publisher.send_multipart(frames(1, batch({"type": "BlockTouched"}, SECOND)))
        eventually(lambda: fleet.state.reported.match(chain) == 2, "the follower applies the next batch")
    finally:
        publisher.close()
        context.term()
    assert fleet.state.reported_fresh
    assert fleet.metric(metrics.ROUTER_KV_EVENTS_REJECTED, engine="e0", reason="block_size") >= 1
    assert fleet.metric(metrics.ROUTER_KV_EVENTS_REJECTED, engine="e0", reason="unknown_kind") == 1
    assert fleet.metric(metrics.ROUTER_BACKGROUND_FAILURES, engine="e0", task="kv_events") == 0


def test_the_kv_event_socket_stays_on_loopback_unless_opted_out() -> None:
    def profile(host: str, name: str = "a") -> EngineProfile:
        return EngineProfile.model_validate(default_profile_data(name=name, host=host, kv_events_port=5600))

    assert kv_events_endpoint(profile("127.0.0.1")) == "tcp://127.0.0.1:5600"
    assert kv_events_endpoint(profile("0.0.0.0")) == "tcp://127.0.0.1:5600"  # noqa: S104
    with pytest.raises(ConfigError, match=r"host '10\.1\.2\.3'.*off loopback"):
        kv_events_endpoint(profile("10.1.2.3"))
    assert kv_events_endpoint(profile("10.1.2.3"), off_loopback=True) == "tcp://10.1.2.3:5600"
    with pytest.raises(ConfigError, match="IPv6"):
        kv_events_endpoint(profile("::1"))
    fleet = [profile("10.1.2.3"), profile("127.0.0.1", name="b")]
    with pytest.raises(ConfigError, match="off loopback"):
        router_options_for("auto", fleet, 8080, 1.5)
    options = router_options_for("auto", fleet, 8080, 1.5, kv_events_off_loopback=True)
    assert options is not None and options.kv_events_off_loopback


# ---- the byte bound --------------------------------------------------------------------------------------


TEXT_PIECES = [" ", "    ", "\n", "a", "é", "日本", "😀", "\t\t", "\x04", "\U00040000"]


@pytest.mark.parametrize("dropped", ["", "\x04"])
def test_the_byte_bound_holds_for_the_tokenizer_it_was_read_from(dropped: str) -> None:
    """On random texts, no fewer tokens than the bound says; a byte the vocabulary cannot spell (as
    SmolLM2's cannot spell \\x04) is dropped by the tokenizer and not counted."""
    vocab = CountingBackend().vocab
    if dropped:
        del vocab["Ą"]  # GPT-2's byte-level character for the byte 0x04
    vocab = {piece: index for index, piece in enumerate(vocab)}
    tokenizer = byte_level_bpe(vocab, [("Ġ", "Ġ"), ("ĠĠ", "ĠĠ")])
    bound = token_bytes_of(tokenizer)
    assert bound == TokenBytes(LONGEST_TOKEN, unspelled_ascii=dropped)
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(TEXT_PIECES) for _ in range(rng.randint(1, 200)))
        tokens = tokenizer.encode(text, add_special_tokens=False).ids
        assert len(tokens) * bound.longest >= bound.spelled_bytes(text), repr(text)
    assert bound.spelled_bytes("\x04" * 1000) == (0 if dropped else 1000)


def spec(**overrides: Any) -> dict[str, Any]:
    """A tokenizer.json like Llama 3's: byte-level BPE, no normalizer, a regex split kept whole."""
    vocab = {char: index for index, char in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab |= {"ab": len(vocab), "ĠĠĠ": len(vocab) + 1}
    return {
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Isolated"},
            {"type": "ByteLevel", "add_prefix_space": False}]},
        "model": {"type": "BPE", "vocab": vocab, "byte_fallback": False, "unk_token": None},
        "added_tokens": [{"content": "<|begin_of_text|>", "lstrip": False, "rstrip": False}],
    } | overrides  # fmt: skip


def test_a_tokenizer_that_may_lose_bytes_gets_no_bound() -> None:
    assert bound_of(spec()) == TokenBytes(len("<|begin_of_text|>")), "the longest token, added ones included"
    assert bound_of(spec(normalizer={"type": "NFC"})) == TokenBytes(3 * len("<|begin_of_text|>"))
    spells_nothing = bound_of(spec(model={"type": "BPE", "vocab": {"ab": 0}, "unk_token": None}))
    assert spells_nothing is not None and spells_nothing.spelled_bytes("any text, ünïcode too") == 0
    for lossy in (
        {"normalizer": {"type": "Lowercase"}},
        {"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}]}},
        {"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": ""}},
        {"pre_tokenizer": {"type": "Whitespace"}},
        {"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "x"}, "behavior": "Removed"}},
        {"model": {"type": "WordPiece", "vocab": {"ab": 0}, "unk_token": "[UNK]"}},
        {
            "model": {"type": "BPE", "vocab": {"ab": 0}, "unk_token": "<unk>", "fuse_unk": True},
            "pre_tokenizer": {"type": "Metaspace"},
        },
        {"added_tokens": [{"content": "<mask>", "lstrip": True, "rstrip": False}]},
    ):
        assert bound_of(spec(**lossy)) is None, lossy


def test_the_body_limit_is_sized_from_the_context() -> None:
    smollm2 = default_max_body_bytes(8192, 81)
    assert 6 * 8192 * 81 < smollm2 < 10 << 20, "room for a whole context of the longest tokens, JSON-escaped"
    assert default_max_body_bytes(8192, None) > smollm2, "no bound from the tokenizer: a generous one"
    assert default_max_body_bytes(None, 81) == UNKNOWN_CONTEXT_BODY_BYTES
