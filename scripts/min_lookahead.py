#!/usr/bin/env python3
"""What MIN knows (docs/benchmarks.md): how far ahead a cache policy would have to see the routing
to come near Belady's MIN. On the decode-mode routing of held-out text (recorded as `calibrate`
records it: one token per step, lossless), per model and cache size, the lossless loads of lru
and decay (the runtime's own cache code, replayed) and of a policy that knows each expert's uses
1, 2, 4, 8 and 16 tokens ahead and nothing further (calibration.belady.lookahead_loads), over
MIN's. An online policy sees none of the next token's routing: it is chosen by a token not sampled
yet. Last, MIN allowed to bypass (calibration.belady.bypass_loads: a miss used again later than
every evictable cached expert is not cached): what not caching some misses could gain at most.

    .venv/bin/python scripts/min_lookahead.py [--tokens 2048] [--budget 25% --budget 50%] MODEL ...
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from fidelity_report import corpus_texts  # noqa: E402
from pyedgemoe import Engine  # noqa: E402
from pyedgemoe.calibration.belady import bypass_loads, lookahead_loads, min_loads  # noqa: E402
from pyedgemoe.calibration.replay import CacheSetup, replay, replay_steps  # noqa: E402
from pyedgemoe.calibration.run import lossless_slots  # noqa: E402
from pyedgemoe.calibration.trace import record_trace  # noqa: E402

AHEAD_TOKENS = (1, 2, 4, 8, 16)
N_CTX = 256  # the trained models' context


def measure(model: str, budget: str, text: str, max_tokens: int) -> dict:
    with Engine(model, n_ctx=N_CTX, n_batch=1, expert_cache=budget, t1=1.0, t2=1.0,
                fill_cache=False, trace_routing=True) as eng:
        tokens = eng.tokenize(text, add_bos=True, special=False)[:max_tokens]
        residency = dict(eng.expert_residency)
        routing = record_trace(eng, tokens, N_CTX)
    # lossless: every byte of the budget in HIGH slots, as calibrate's comparison with MIN
    slots = lossless_slots(residency)
    steps = replay_steps(routing, 1.0, 1.0, use_low=False, use_skip=False)
    n_layers = len({s.layer for s in steps})
    setup = replace(CacheSetup(high_slots=slots, low_slots=0, n_layers=residency["n_layers"], low_cost=0.0),
                    n_expert=residency["n_expert"], n_expert_used=residency["n_expert_used"])
    best = min_loads(steps, slots).loads
    row = {"slots": slots, "min": best, "requests": sum(len(s.wanted) for s in steps)}
    for policy in ("lru", "decay"):
        row[policy] = replay(steps, setup, policy).loads_high / best
    for ahead in AHEAD_TOKENS:
        row[f"{ahead} ahead"] = lookahead_loads(steps, slots, ahead * n_layers) / best
    row["MIN, bypass"] = bypass_loads(steps, slots) / best
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--budget", action="append", dest="budgets")
    p.add_argument("--tokens", type=int, default=2048)
    a = p.parse_args()
    heldout, _ = corpus_texts()
    columns = ["lru", "decay", *(f"{n} ahead" for n in AHEAD_TOKENS), "MIN, bypass"]
    print("| model | cache | MIN's loads (of requests) | " + " | ".join(columns) + " |")
    print("|---|---|---:|" + "---:|" * len(columns))
    for model in a.models:
        for budget in a.budgets or ["25%", "50%"]:
            r = measure(model, budget, heldout, a.tokens)
            cells = " | ".join(f"{r[c]:.2f}x" for c in columns)
            print(f"| {Path(model).name} | {budget} ({r['slots']} slots) | {r['min']} (of {r['requests']}) | {cells} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
