#!/usr/bin/env python3
"""The online source's own ceiling on the CPU: a stand-in server that answers from memory.

A real server on a CPU cannot produce states as fast as a GPU server does, so this measures
the client alone: a small HTTP server (its own process) forwards each request to a real
layertap server once, keeps the answer's bytes, and from then on answers the same request
from memory. A first pass of `online_bench.py` fills it; the passes after it see a server
that answers as fast as the socket goes, and their figures (tokens/s, the consumer's wait,
the client's CPU seconds per GB, peak memory) are the client's.

    python3 bench/online_replay.py --upstream http://127.0.0.1:8080 --port 8090

Serves until killed. Requests are keyed by their body and `accept-encoding` (identity or
zstd); the upstream's status, content-encoding, content-type and retry-after are replayed.
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import sys
import threading
import urllib.error
import urllib.request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="a layertap server's URL")
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    cache: dict = {}
    lock = threading.Lock()
    stats = {"hits": 0, "misses": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _forward(self, method: str, body: bytes | None):
            enc = self.headers.get("accept-encoding", "identity")
            key = (method, self.path, enc, hashlib.sha256(body or b"").hexdigest())
            with lock:
                hit = cache.get(key)
            if hit is None:
                req = urllib.request.Request(a.upstream + self.path, data=body, method=method)
                req.add_header("accept-encoding", enc)
                if body is not None:
                    req.add_header("content-type", self.headers.get("content-type", "application/json"))
                try:
                    with urllib.request.urlopen(req, timeout=3600) as r:
                        hit = (r.status, dict(r.headers), r.read())
                except urllib.error.HTTPError as e:
                    hit = (e.code, dict(e.headers), e.read())
                with lock:
                    stats["misses"] += 1
                    if hit[0] == 200:
                        cache[key] = hit
            else:
                with lock:
                    stats["hits"] += 1
            status, headers, data = hit
            self.send_response(status)
            for h in ("content-encoding", "content-type", "retry-after"):
                for k, v in headers.items():
                    if k.lower() == h:
                        self.send_header(h, v)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._forward("GET", None)

        def do_POST(self) -> None:
            n = int(self.headers.get("content-length", "0"))
            self._forward("POST", self.rfile.read(n))

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    srv.daemon_threads = True
    print(f"replaying {a.upstream} on http://127.0.0.1:{a.port}", file=sys.stderr, flush=True)
    try:
        srv.serve_forever()
    finally:
        print(f"replay: {stats}", file=sys.stderr)


if __name__ == "__main__":
    main()
