"""A stand-in for llama.cpp's ``llama-server`` binary (for the bench's llama-server arms).

Why a fake: building the real server takes minutes of compiling that CI should not pay
for an optional arm. It speaks the part of the protocol the arm uses (``/health``,
``/completion`` with ``return_tokens`` and ``timings``), and it answers with the
synthetic models' exact greedy rule, so the bench's identity check against ``plain`` is
a real comparison. ``FAKE_LLAMA_SERVER_ARGV`` names a file that gets one JSON line of
argv per start; ``FAKE_LLAMA_SERVER_FAIL=1`` makes it die like a failed model load.
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from meshd.testing import testmodels


def main(argv: list[str]) -> int:
    if "--version" in argv:
        print("version: 9999 (fake)\nbuilt with a test", file=sys.stderr)
        return 0
    if os.environ.get("FAKE_LLAMA_SERVER_ARGV"):
        with open(os.environ["FAKE_LLAMA_SERVER_ARGV"], "a") as f:
            f.write(json.dumps(argv) + "\n")
    if os.environ.get("FAKE_LLAMA_SERVER_FAIL"):
        print("llama_model_load: error loading model: fake failure", file=sys.stderr)
        return 1
    port = int(argv[argv.index("--port") + 1])
    speculating = "--spec-type" in argv

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_args: object) -> None:
            pass

        def _send(self, status: int, body: object) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/completion" or not isinstance(req.get("prompt"), list):
                self._send(400, {"error": {"message": "bad request"}})
                return
            t0 = time.perf_counter()
            tokens = testmodels.reference_continuation(req["prompt"], req["n_predict"])
            time.sleep(0.001 * len(tokens))
            n = len(tokens)
            self._send(200, {
                "content": "", "tokens": tokens if req.get("return_tokens") else [],
                "timings": {"prompt_ms": 0.5, "predicted_ms": 1e3 * (time.perf_counter() - t0),
                            "predicted_n": n,
                            **({"draft_n": n, "draft_n_accepted": n // 2}
                               if speculating else {})},
            })

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
