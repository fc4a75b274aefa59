#!/usr/bin/env python3
"""What a cache policy's bookkeeping costs a decode token (docs/benchmarks.md): a random routing of
a geometry's MoE layers replayed through the runtime's own cache code (_native.ExpertCache), the
budget's share of the experts as slots, one token at a time; milliseconds of CPU per token for each
policy, the median of --repeats runs. Random routing misses most: every miss asks the policy for a
victim.

    .venv/bin/python scripts/bench_policies.py [--layers 48 --experts 128 --used 8 --share 0.25]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from pyedgemoe import _native

POLICIES = ("lru", "lfu", "decay", "adaptive", "hobbit", "edgemoe", "fate")


def ms_per_token(policy: str, routing: list, slots: int, n_expert: int, n_used: int) -> float:
    cache = _native.ExpertCache(high_slots=slots, policy=policy, n_layers=len(routing[0]), n_expert=n_expert,
                                n_expert_used=n_used)
    t0 = time.perf_counter()
    for token in routing:
        cache.advance_tokens(1)
        for il, experts in enumerate(token):
            cache.place(il, [(e, "high") for e in experts])
    return (time.perf_counter() - t0) / len(routing) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--used", type=int, default=8)
    p.add_argument("--share", type=float, default=0.25, help="slots as a share of all experts")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    rng = random.Random(0)
    routing = [[rng.sample(range(a.experts), a.used) for _ in range(a.layers)] for _ in range(a.tokens)]
    slots = int(a.share * a.layers * a.experts)
    print(f"{a.layers} layers, {a.experts} experts, top-{a.used}, {slots} slots, {a.tokens} tokens of random routing")
    print("| policy | ms per token |\n|---|---:|")
    for policy in POLICIES:
        runs = [ms_per_token(policy, routing, slots, a.experts, a.used) for _ in range(a.repeats)]
        print(f"| {policy} | {statistics.median(runs):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
