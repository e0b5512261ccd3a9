"""A stand-in for vLLM's OpenAI server, for fast launcher lifecycle tests.

It takes the same command line as `python -m vllm.entrypoints.openai.api_server`
(only --host, --port, --model and --kv-transfer-config are read), starts in
well under a second, and, like vLLM, runs a child process in its process
group (vLLM's engine core) that it stops on SIGTERM, so the tests see whether
a teardown leaves it behind. Answers:
- GET /health: 200;  GET /metrics: the few vLLM gauges the tools read;
- POST /v1/completions and /v1/chat/completions: a fixed JSON answer
  `{"city": "paris", "items": [1]}` (decode) or `{` with kv_transfer_params
  (prefill), and `"served_by": {"pid", "role", "port"}`.
Env: STANDIN_CRASH_AFTER_S=x exits with code 3 after x seconds (a dying
instance); STANDIN_START_DELAY_S=x waits x seconds before listening;
STANDIN_STOP_DELAY_S=x takes x seconds to stop on SIGTERM (a slow shutdown).
Not a model: nothing here is under test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ANSWER = {"city": "paris", "items": [1]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="standin")
    ap.add_argument("--kv-transfer-config", default="{}")
    args, _unknown = ap.parse_known_args(argv)
    role = "prefill" if json.loads(args.kv_transfer_config).get("kv_role") == "kv_producer" \
        else "decode"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(10**6)"])
    delay = float(os.environ.get("STANDIN_START_DELAY_S", "0"))
    time.sleep(delay)
    crash = os.environ.get("STANDIN_CRASH_AFTER_S")
    if crash is not None:
        threading.Timer(float(crash), lambda: os._exit(3)).start()
    served_by = {"pid": os.getpid(), "role": role, "port": args.port,
                 "child_pid": child.pid}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/metrics":
                self._send(200, b"vllm:kv_cache_usage_perc 0.0\n"
                           b"vllm:num_requests_running 0.0\n"
                           b"vllm:num_requests_waiting 0.0\n", "text/plain")
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            text = "{" if role == "prefill" else json.dumps(ANSWER)
            chat = self.path.endswith("/chat/completions")
            choice = {"index": 0, "finish_reason": "length" if role == "prefill" else "stop"}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            out = {"id": "standin", "choices": [choice], "served_by": served_by,
                   "received_kv_transfer_params": body.get("kv_transfer_params")}
            if role == "prefill":
                out["kv_transfer_params"] = {"remote_port": args.port, "standin": True}
            self._send(200, json.dumps(out).encode())

    def on_sigterm(signum: int, frame: object) -> None:  # like vLLM: children go too
        time.sleep(float(os.environ.get("STANDIN_STOP_DELAY_S", "0")))
        child.kill()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    try:
        server.serve_forever()
    finally:
        child.kill()


if __name__ == "__main__":
    main()
