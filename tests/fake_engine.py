"""A stand-in for a vLLM server, for fault-injection tests of the controller (never proof of a feature).

python tests/fake_engine.py --port P --served-model-name NAME [--die-after S] [--fail-start MSG]
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument(
        "--die-after", type=float, default=None, help="crash (exit 3) after this many seconds"
    )
    parser.add_argument("--fail-start", default=None, help="print this error and exit 1 before serving")
    args, _unknown = parser.parse_known_args()
    if args.fail_start:
        print(f"ValueError: {args.fail_start}", flush=True)
        return 1
    name = args.served_model_name

    class Handler(BaseHTTPRequestHandler):
        def _send(self, body: str, content_type: str = "application/json") -> None:
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send("{}")
            elif self.path == "/v1/models":
                self._send(json.dumps({"data": [{"id": name}]}))
            elif self.path == "/metrics":
                self._send(
                    'vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",'
                    'num_gpu_blocks="10",kv_cache_size_tokens="320"} 1.0\n',
                    "text/plain",
                )
            else:
                self.send_error(404)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            self.rfile.read(length)
            self._send(json.dumps({"choices": [{"message": {"content": "ok"}}]}))

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    if args.die_after is not None:

        def die() -> None:
            time.sleep(args.die_after)
            print("RuntimeError: injected crash", flush=True)
            sys.stdout.flush()
            import os

            os._exit(3)

        threading.Thread(target=die, daemon=True).start()
    print(f"serving {name} on {args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ---- in-process, for the router's fault-injection tests ---------------------------------------------------

HEALTHY_METRICS = (
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
    'vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",'
    'num_gpu_blocks="10",kv_cache_size_tokens="320"} 1.0\n'
)
# What ScriptedEngine's /metrics answers, by `metrics_mode`.
METRICS_MODES = (
    "healthy", "garbage", "html", "non_finite", "error", "slow", "endless", "huge_declared", "redirect",
    "gzip_bomb",
)  # fmt: skip
# How ScriptedEngine answers a POST, by `answer_mode`: whole JSON, an SSE stream spread over ~2 s, an answer
# trickled a byte at a time, or one without end.
ANSWER_MODES = ("ok", "stream", "slow", "endless")


@functools.cache
def gzip_bomb() -> bytes:
    return gzip.compress(b"\0" * (64 << 20), compresslevel=9)


class ScriptedEngine:
    """A stand-in for one vLLM server in this process, on 127.0.0.1, whose faults are switched at run time:
    what /metrics answers (`metrics_mode`), how a POST is answered (`answer_mode`); the bodies POSTed to it
    are kept in `posts`. `stop()` is the engine dying; a new one on the same port is it coming back."""

    def __init__(self, port: int = 0) -> None:
        self.metrics_mode = "healthy"
        self.answer_mode = "ok"
        self.posts: list[bytes] = []
        self.redirects_followed = 0
        self._stopping = threading.Event()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def _head(
                self,
                status: int,
                content_type: str,
                length: int | None,
                headers: dict[str, str] | None = None,
            ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                if length is not None:
                    self.send_header("Content-Length", str(length))
                self.end_headers()

            def _send(self, body: bytes, content_type: str = "application/json", status: int = 200) -> None:
                self._head(status, content_type, len(body))
                self.wfile.write(body)

            def _trickle(self, content_type: str) -> None:
                """Declare 1,000 bytes and send one every 0.2 s: a slow-loris answer."""
                self._head(200, content_type, 1000)
                for _ in range(1000):
                    if engine._stopping.wait(0.2):
                        return
                    self.wfile.write(b"#")

            def _endless(self, content_type: str) -> None:
                self._head(200, content_type, None)
                line = b'vllm:num_requests_waiting{engine="0"} 0.0\n' * 1000
                while not engine._stopping.is_set():
                    self.wfile.write(line)

            def _metrics(self) -> None:
                mode = engine.metrics_mode
                if mode == "healthy":
                    self._send(HEALTHY_METRICS.encode(), "text/plain")
                elif mode == "garbage":
                    self._send(b"\x00\xff{{{ not an exposition\n", "text/plain")
                elif mode == "html":
                    self._send(b"<!DOCTYPE html><html><body><h1>Welcome</h1></body></html>\n", "text/html")
                elif mode == "non_finite":
                    self._send(
                        b"vllm:num_requests_waiting NaN\nvllm:kv_cache_usage_perc +Inf\n", "text/plain"
                    )
                elif mode == "error":
                    self._send(b"Internal Server Error", "text/plain", status=500)
                elif mode == "slow":
                    self._trickle("text/plain")
                elif mode == "endless":
                    self._endless("text/plain")
                elif mode == "redirect":  # elsewhere: to the engine's own healthy text, under another path
                    self.send_response(302)
                    self.send_header("Location", "/metrics-elsewhere")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif mode == "gzip_bomb":  # 64 KiB on the wire, 64 MiB once inflated
                    self._head(200, "text/plain", len(gzip_bomb()), {"Content-Encoding": "gzip"})
                    self.wfile.write(gzip_bomb())
                else:  # huge_declared
                    self._head(200, "text/plain", 10**12)
                    self.wfile.write(HEALTHY_METRICS.encode())

            def do_GET(self) -> None:
                try:
                    if self.path == "/health":
                        self._send(b"")
                    elif self.path == "/metrics":
                        self._metrics()
                    elif self.path == "/metrics-elsewhere":
                        engine.redirects_followed += 1
                        self._send(HEALTHY_METRICS.encode(), "text/plain")
                    else:
                        self.send_error(404)
                except OSError:  # the router hung up on a faulty answer, as it should
                    pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                engine.posts.append(body)
                try:
                    if engine.answer_mode == "stream":
                        self._head(200, "text/event-stream", None)
                        for index in range(8):
                            time.sleep(0.25)
                            self.wfile.write(f'data: {{"choices": [{{"text": "{index}"}}]}}\n\n'.encode())
                        self.wfile.write(b"data: [DONE]\n\n")
                    elif engine.answer_mode == "slow":
                        self._trickle("application/json")
                    elif engine.answer_mode == "endless":
                        self._endless("application/json")
                    else:
                        self._send(json.dumps({"choices": [{"text": "ok"}]}).encode())
                except OSError:
                    pass

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port: int = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"engine-{self.port}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
