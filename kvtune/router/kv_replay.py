"""vLLM's KV-event replay, as a router that starts (or restarts) reads it to rebuild an engine's view.

vLLM keeps its last `buffer_steps` event batches (10,000 by default) and serves them on the KV events
config's `replay_endpoint` (a ZMQ ROUTER socket): a client sends the first sequence number it wants as 8
big-endian bytes and receives every buffered batch from there as (topic, sequence, payload), the frames
the live stream carries, then an end marker whose sequence is -1. The router asks for everything (from
0): applied in order, that is the engine's cache as of now when the buffer still holds batch 0; when it
does not (more batches since the engine started than the buffer keeps), the view stays stale until the
engine clears its cache, exactly as after a gap in the live stream.

The live stream is subscribed before the replay is asked for, so no batch falls between the two; the
batches the replay already applied arrive live too and are skipped (`ReplayedBatches`).
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

END_SEQUENCE = -1
# A replay is local and at most buffer_steps batches of kilobytes, but vLLM sends it from its publisher
# thread, which a busy engine's own work slows (a replay of ~1,200 batches took over 10 s on one busy core):
# it is given up when no batch comes for REPLAY_IDLE_S, or after REPLAY_DEADLINE_S in all (the view then
# waits for the live stream, as it would without replay).
REPLAY_IDLE_S = 10.0
REPLAY_DEADLINE_S = 60.0
# vLLM's default buffer_steps; a publisher sending more batches than a replay could hold is not believed.
MAX_REPLAY_BATCHES = 100_000


class ReplayUnavailable(Exception):
    """The replay endpoint did not answer in time, or answered with something that is not a replay."""


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


@dataclass
class ReplayedBatches:
    """The batches a replay applied, by sequence: the same batches arriving live afterwards are skipped."""

    _digests: dict[int, bytes] = field(default_factory=dict)

    def add(self, frames: list[bytes]) -> None:
        _topic, sequence, payload = frames
        self._digests[int.from_bytes(sequence, "big", signed=True)] = _digest(payload)

    def already_applied(self, frames: list[bytes]) -> bool:
        """True for a live batch (FRAMES) the replay applied. The first one it did not ends the overlap:
        from then on every batch is new (a restarted engine's batch 0 included)."""
        if not self._digests:
            return False
        if len(frames) == 3 and self._digests.get(int.from_bytes(frames[1], "big", signed=True)) == _digest(
            frames[2]
        ):
            return True
        self._digests.clear()
        return False


async def fetch_replay(
    endpoint: str,
    max_message_bytes: int,
    context: zmq.asyncio.Context | None = None,
    deadline_s: float = REPLAY_DEADLINE_S,
    idle_s: float = REPLAY_IDLE_S,
) -> list[list[bytes]]:
    """Every batch ENDPOINT's replay buffer holds, as live-stream frames [topic, sequence, payload]."""
    context = context or zmq.asyncio.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    batches: list[list[bytes]] = []
    try:
        socket.connect(endpoint)
        await socket.send_multipart([b"", (0).to_bytes(8, "big")])
        async with asyncio.timeout(deadline_s):
            while True:
                try:
                    frames = await asyncio.wait_for(socket.recv_multipart(), idle_s)
                except TimeoutError:
                    raise ReplayUnavailable(
                        f"the replay from {endpoint} stopped: no batch for {idle_s:g} s "
                        f"after {len(batches):,}"
                    ) from None
                if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                    raise ReplayUnavailable(f"a replay answer of {len(frames)} frames is not vLLM's")
                _empty, topic, sequence, payload = frames
                if int.from_bytes(sequence, "big", signed=True) == END_SEQUENCE:
                    return batches
                if len(batches) >= MAX_REPLAY_BATCHES:
                    raise ReplayUnavailable(f"a replay of more than {MAX_REPLAY_BATCHES:,} batches")
                batches.append([topic, sequence, payload])
    except TimeoutError:
        raise ReplayUnavailable(f"no complete replay from {endpoint} within {deadline_s:g} s") from None
    finally:
        socket.close()
