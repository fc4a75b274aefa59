"""Expert bytes read per generated token, and tokens per second, for C clients served by one
Engine with n_parallel = 1 (one generation at a time, the others wait) and n_parallel = C
(decoding together, one llama_decode per step): what `pyedgemoe serve --parallel` changes.

    python scripts/bench_parallel.py [--model models/demo.gguf] [--caches 25% 50% 75% resident]

Each run: a fresh Engine (lossless: every expert in HIGH), C client threads each generating
--tokens tokens (EOS ignored, temperature 0) from a prompt of their own; bytes: what the expert
cache read from the file (on demand and prefetched, prefill included) over the run. Medians of
--repeats runs; prints a markdown table.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from pyedgemoe import Engine

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["def add(a, b):", "class Node(object):", "import os\n", "# Copyright", "for i in range(10):",
           "while True:", "from typing import", "if __name__ =="]


def one_run(model: Path, cache: str, n_parallel: int, clients: int, tokens: int, threads: int) -> dict:
    resident = cache == "resident"
    with Engine(model, n_ctx=512 * n_parallel, n_parallel=n_parallel, expert_cache=None if resident else cache,
                system=None if resident else "lossless", n_threads=threads) as eng:
        def bytes_read() -> int:
            e = eng.stats().get("experts")  # none: every expert resident
            return e["total"]["bytes_read"] + e["prefetches"]["bytes_read"] if e else 0

        before = bytes_read()
        start = time.perf_counter()
        workers = [threading.Thread(target=eng.generate, args=(PROMPTS[i % len(PROMPTS)], tokens),
                                    kwargs=dict(temperature=0, ignore_eos=True)) for i in range(clients)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - start
        generated = clients * tokens
        return {"bytes_per_token": (bytes_read() - before) / generated, "tok_s": generated / seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=REPO / "models" / "demo.gguf")
    p.add_argument("--caches", nargs="+", default=["25%", "50%", "75%", "resident"],
                   help="expert caches to compare at; resident: every expert in memory")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    print(f"{args.model.name}: {args.clients} clients x {args.tokens} tokens, medians of {args.repeats}\n")
    print("| expert cache | n_parallel | KiB read per token | tok/s | bytes ratio (N/1) | tok/s ratio (N/1) |")
    print("|---|---|---|---|---|---|")
    for cache in args.caches:
        rows = {}
        for n in (1, args.clients):
            runs = [one_run(args.model, cache, n, args.clients, args.tokens, args.threads) for _ in range(args.repeats)]
            rows[n] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for n, r in rows.items():
            bytes_ratio = r["bytes_per_token"] / rows[1]["bytes_per_token"] if rows[1]["bytes_per_token"] else 0.0
            ratios = ("", "") if n == 1 else (f"{bytes_ratio:.2f}" if bytes_ratio else "-",
                                              f"{r['tok_s'] / rows[1]['tok_s']:.2f}")
            print(f"| {cache} | {n} | {r['bytes_per_token'] / 1024:.1f} | {r['tok_s']:.1f} | {ratios[0]} | {ratios[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
