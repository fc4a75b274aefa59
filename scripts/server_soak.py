"""A soak of `pyedgemoe serve` on localhost: many requests from concurrent clients, with streams, clients
that leave mid-stream and bad requests mixed in; the server's memory must stay flat and every error must
be one the client caused (docs/server.md, "Soak").

    python scripts/server_soak.py                       # 10,000 requests, 16 clients, the demo model

The server runs as a user starts it (`pyedgemoe serve MODEL --expert-cache 25% --port 0`). Request i is
of kind KINDS[i % len(KINDS)] (a fixed mix), sent over its own connection with http.client. Reported:
the count of each kind and status, latency p50/p99 (seconds, to the last byte; for the streams also to
the first event), the server's RSS after the warm-up and at the end. Exits non-zero on an error the
client did not cause (an answer other than the kind's, a reset, a timeout), or when the RSS at the end
is above 1.1 x the RSS after the warm-up.
"""
from __future__ import annotations

import argparse
import http.client
import json
import signal
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from urllib.parse import urlparse

from server_load import REPO, rss_bytes, start

CHAT = {"messages": [{"role": "user", "content": "Write a Python function that"}], "max_tokens": 8}
# kind -> (method, path, body (bytes) or None, extra headers, expected status); a body of None with
# "stream" in the kind is CHAT streamed
BAD_BODIES = {
    "bad_json": b'{"messages": [',
    "unknown_parameter": json.dumps({**CHAT, "temprature": 0.5}).encode(),
    "out_of_range": json.dumps({**CHAT, "temperature": 5}).encode(),
    "lone_surrogate": b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    "too_deep": b'{"messages": ' + b"[" * 2000 + b"]" * 2000 + b"}",
}
KINDS = (["chat"] * 8 + ["chat_stream"] * 4 + ["stream_then_leave"] * 2 + ["completion_tokens"]
         + list(BAD_BODIES) + ["too_large", "health", "experts"])
WARM_UP = 500  # requests before the RSS reference


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


class Soak:
    def __init__(self, url: str, pid: int, n_requests: int, n_clients: int, deadline_s: float) -> None:
        u = urlparse(url)
        self.host, self.port, self.pid = u.hostname, u.port, pid
        self.n_requests, self.n_clients = n_requests, n_clients
        self.deadline = time.monotonic() + deadline_s
        self.next_i = 0
        self.lock = threading.Lock()
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.first_event: list[float] = []
        self.statuses: Counter = Counter()
        self.errors: list[str] = []  # the ones the client did not cause
        self.rss_warm: int | None = None

    def take(self) -> int | None:
        with self.lock:
            if self.next_i >= self.n_requests or time.monotonic() > self.deadline:
                return None
            self.next_i += 1
            if self.next_i == WARM_UP + 1:
                self.rss_warm = rss_bytes(self.pid)
            return self.next_i - 1

    def one(self, kind: str) -> int:
        """Sends one request of kind; its status (the client's own leaving: 0)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        headers = {"Content-Type": "application/json"}
        try:
            if kind in ("health", "experts"):
                conn.request("GET", "/health" if kind == "health" else "/metrics/experts")
            elif kind == "too_large":  # refused from its Content-Length, before the body is sent
                conn.putrequest("POST", "/v1/chat/completions")
                conn.putheader("Content-Type", "application/json")
                conn.putheader("Content-Length", str(100 * 2**20))
                conn.endheaders()
            elif kind == "completion_tokens":
                conn.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": 8}), headers)
            elif kind in BAD_BODIES:
                conn.request("POST", "/v1/chat/completions", BAD_BODIES[kind], headers)
            else:
                conn.request("POST", "/v1/chat/completions", json.dumps({**CHAT, "stream": kind != "chat"}), headers)
            started = time.monotonic()
            response = conn.getresponse()
            if kind == "stream_then_leave":
                response.readline()  # the first event, then the client goes
                self.first_event.append(time.monotonic() - started)
                conn.sock.shutdown(2)
                return 0
            body = response.read()
            if response.status >= 400:
                error = json.loads(body)["error"]  # OpenAI's shape, or this raises
                assert set(error) == {"message", "type", "param", "code"}
            elif kind == "chat_stream":
                assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
            return response.status
        finally:
            conn.close()

    def expected(self, kind: str) -> int:
        return {"too_large": 413, "stream_then_leave": 0}.get(kind, 400 if kind in BAD_BODIES else 200)

    def client(self) -> None:
        while (i := self.take()) is not None:
            kind = KINDS[i % len(KINDS)]
            started = time.monotonic()
            try:
                status = self.one(kind)
            except Exception as e:  # noqa: BLE001 - a reset, a timeout, a malformed answer: counted
                status = f"{type(e).__name__}: {e}"
            with self.lock:
                self.statuses[(kind, status)] += 1
                if status != self.expected(kind):
                    self.errors.append(f"request {i} ({kind}): {status}")
                else:
                    self.latency[kind].append(time.monotonic() - started)

    def run(self) -> float:
        started = time.monotonic()
        threads = [threading.Thread(target=self.client) for _ in range(self.n_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=REPO / "models" / "demo.gguf")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--deadline", type=float, default=3600, help="seconds: no request starts after this")
    p.add_argument("--server-args", default="--expert-cache 25%", help="extra `pyedgemoe serve` arguments")
    args = p.parse_args(argv)

    log = REPO / "build" / "server-soak.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    proc, url = start(args.model, log, args.server_args.split())
    soak = Soak(url, proc.pid, args.requests, args.clients, args.deadline)
    try:
        seconds = soak.run()
        rss_end = rss_bytes(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)

    print(f"{soak.next_i} requests from {args.clients} clients in {seconds:.1f} s "
          f"({soak.next_i / seconds:.1f} requests/s); server: {args.server_args}")
    print("| kind | answered | p50 | p99 |\n|---|---|---:|---:|")
    for kind in dict.fromkeys(KINDS):
        done = soak.latency[kind]
        answered = ", ".join(f"{n} x {status}" for (k, status), n in sorted(soak.statuses.items(), key=str) if k == kind)
        if done:
            print(f"| {kind} | {answered} | {percentile(done, 50):.3f} s | {percentile(done, 99):.3f} s |")
    if soak.first_event:
        print(f"streams' first event: p50 {percentile(soak.first_event, 50):.3f} s, "
              f"p99 {percentile(soak.first_event, 99):.3f} s")
    rss_warm = soak.rss_warm or rss_end
    print(f"RSS after the warm-up ({WARM_UP} requests) {rss_warm / 2**20:.1f} MiB, at the end "
          f"{rss_end / 2**20:.1f} MiB ({rss_end / rss_warm:.3f} x)")
    print(f"errors the client did not cause: {len(soak.errors)}")
    for line in soak.errors[:20]:
        print("  " + line)
    return 1 if soak.errors or rss_end > 1.1 * rss_warm else 0


if __name__ == "__main__":
    sys.exit(main())
