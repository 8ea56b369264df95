"""A stand-in for a vLLM server, for fault-injection tests of the controller (never proof of a feature).

python tests/fake_engine.py --port P --served-model-name NAME [--die-after S] [--fail-start MSG]
"""

from __future__ import annotations

import argparse
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
