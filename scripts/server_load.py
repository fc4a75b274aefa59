"""A bounded load test of `pyedgemoe serve` on localhost: N requests from C concurrent clients.

    python scripts/server_load.py                      # 200 requests, 8 clients, the demo model, 25 % cache

The server runs as a user would start it (`pyedgemoe serve MODEL --expert-cache 25% --port 0`);
each client thread sends chat completions of a few tokens with OpenAI's client, one after the
other. Reported: errors, latency p50/p95 (seconds per request), generated tokens per second over
the run, and the server's RSS (from /proc) after the first request and at the end.
"""
from __future__ import annotations

import argparse
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parent.parent


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def start(model: Path, log: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "pyedgemoe.cli", "serve", str(model), "--port", "0", *extra],
                            stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = re.search(r"serving \S+ on (http://\S+) ", log.read_text())
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the server did not start:\n{log.read_text()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=REPO / "models" / "demo.gguf")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--server-args", default="--expert-cache 25%", help="extra `pyedgemoe serve` arguments")
    args = p.parse_args(argv)

    log = REPO / "build" / "server-load.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    proc, url = start(args.model, log, args.server_args.split())
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    prompts = [f"Write a Python function number {i} that" for i in range(args.requests)]

    def ask(prompt: str) -> int:
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=args.max_tokens, temperature=0.7, seed=len(prompt))
        return r.usage.completion_tokens

    try:
        ask(prompts[0])
        rss_first = rss_bytes(proc.pid)
        latencies, tokens, errors = [], [], []
        lock = threading.Lock()
        todo = iter(prompts)

        def worker():
            while True:
                with lock:
                    prompt = next(todo, None)
                if prompt is None:
                    return
                t0 = time.perf_counter()
                try:
                    n = ask(prompt)
                except Exception as e:  # counted, not raised: the test reports every failure
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")
                    continue
                with lock:
                    latencies.append(time.perf_counter() - t0)
                    tokens.append(n)

        start_time = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start_time
        rss_end = rss_bytes(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)

    q = statistics.quantiles(latencies, n=20) if len(latencies) > 1 else [float("nan")] * 19
    print(f"{args.requests} requests from {args.clients} clients on {args.model.name} ({args.server_args}), "
          f"max_tokens {args.max_tokens}: {len(errors)} errors, {len(latencies)} answered in {seconds:.1f} s")
    print(f"latency p50 {statistics.median(latencies):.2f} s, p95 {q[18]:.2f} s; "
          f"{sum(tokens) / seconds:.1f} generated tok/s; "
          f"RSS after the first request {rss_first / 2**20:.1f} MiB, at the end {rss_end / 2**20:.1f} MiB "
          f"({rss_end / rss_first - 1:+.1%})")
    for e in errors[:5]:
        print("error:", e)
    return 1 if errors or rss_end > 1.1 * rss_first else 0


if __name__ == "__main__":
    sys.exit(main())
