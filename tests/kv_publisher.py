"""vLLM's own KV-event publisher (ZmqEventPublisher: live PUB stream and replay buffer), driven from stdin.

Tests run it as `python -m tests.kv_publisher BLOCK_SIZE` so their own process does not load vLLM and
torch. One JSON command per line, each answered by one line on stdout once done:
- {"start": {"endpoint": ..., "replay": ..., "buffer_steps": N}}: a new publisher (its batches numbered from
  0, as a new engine process's are), the previous one shut down;
- {"publish": [event spec, ...]}: one batch, answered once it is sent (specs as tests/test_router_kv_events.py
  writes them: ["stored", hashes, parent, tokens], ["removed", hashes], ["cleared"]).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)


def event(spec: list[Any], block_size: int) -> Any:
    if spec[0] == "stored":
        _, hashes, parent, tokens = spec
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                           block_size=block_size, lora_id=None, medium="GPU", lora_name=None)  # fmt: skip
    if spec[0] == "removed":
        return BlockRemoved(block_hashes=spec[1], medium="GPU")
    return AllBlocksCleared()


def main() -> None:
    block_size = int(sys.argv[1])
    publisher: ZmqEventPublisher | None = None
    print("ready", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if "start" in command:
            if publisher is not None:
                publisher.shutdown()
            start = command["start"]
            publisher = ZmqEventPublisher(
                0, endpoint=start["endpoint"], replay_endpoint=start["replay"],
                buffer_steps=start.get("buffer_steps", 10_000), topic="kv@test",
            )  # fmt: skip
        elif publisher is not None:
            batch = KVEventBatch(ts=time.time(), events=[event(e, block_size) for e in command["publish"]])
            publisher.publish(batch)
            publisher._event_queue.join()  # sent (and buffered for replay) once its thread is done with it
        print("done", flush=True)
    if publisher is not None:
        publisher.shutdown()


if __name__ == "__main__":
    main()
