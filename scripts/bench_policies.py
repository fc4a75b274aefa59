#!/usr/bin/env python3
"""What a cache policy's bookkeeping costs a decode token (docs/benchmarks.md): a random routing of
a geometry's MoE layers replayed through the runtime's own cache code (_native.ExpertCache), the
budget's share of the experts as slots, one token at a time; milliseconds of CPU per token for each
policy, the median of --repeats runs. Random routing misses most: every miss asks the policy for a
victim.

With --model, the same policies in a real decode of that file instead: the expert cache at --share,
prefetch off, --warmup tokens decoded first (at a share of 1.0 every expert is then cached), then
--tokens more; the op's microseconds a MoE layer (the layer's op up to its slot ids: planning, the
policy, loads; `op_ms` of the expert counters). A decode's matrices evict the bookkeeping from the
CPU's caches between layers, which the replay above does not.

    .venv/bin/python scripts/bench_policies.py [--layers 48 --experts 128 --used 8 --share 0.25]
    .venv/bin/python scripts/bench_policies.py --model FILE.gguf --share 1.0 [--warmup 300 --tokens 64]
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


def op_us_per_layer(model: str, policy: str, share: float, warmup: int, tokens: int) -> float:
    from pyedgemoe import Engine
    with Engine(model, expert_cache=f"{share:.0%}", cache_policy=policy, prefetch="none") as engine:
        prompt = engine.tokenize("The quick brown fox jumps over the lazy dog")
        engine.time_generation(prompt, warmup)
        before = engine.stats()["experts"]["total"]["op_ms"]
        engine.time_generation(prompt, tokens)
        experts = engine.stats()["experts"]
        calls = (tokens + 1) * len(experts["layers"])  # the prompt's ubatch and each decode step, a call a layer
        return (experts["total"]["op_ms"] - before) / calls * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--used", type=int, default=8)
    p.add_argument("--share", type=float, default=0.25, help="slots as a share of all experts")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", help="a GGUF: the op's time in a real decode instead of the replay")
    p.add_argument("--warmup", type=int, default=300, help="with --model: tokens decoded before measuring")
    p.add_argument("--policies", default=",".join(POLICIES))
    a = p.parse_args()
    policies = a.policies.split(",")
    if a.model:
        print(f"{a.model}, expert cache {a.share:.0%}, {a.tokens} tokens after {a.warmup}")
        print("| policy | op us per MoE layer |\n|---|---:|")
        for policy in policies:
            runs = [op_us_per_layer(a.model, policy, a.share, a.warmup, a.tokens) for _ in range(a.repeats)]
            print(f"| {policy} | {statistics.median(runs):.1f} |", flush=True)
        return 0
    rng = random.Random(0)
    routing = [[rng.sample(range(a.experts), a.used) for _ in range(a.layers)] for _ in range(a.tokens)]
    slots = int(a.share * a.layers * a.experts)
    print(f"{a.layers} layers, {a.experts} experts, top-{a.used}, {slots} slots, {a.tokens} tokens of random routing")
    print("| policy | ms per token |\n|---|---:|")
    for policy in policies:
        runs = [ms_per_token(policy, routing, slots, a.experts, a.used) for _ in range(a.repeats)]
        print(f"| {policy} | {statistics.median(runs):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
