"""HOBBIT ablation: pyedgemoe configurations on one multi-precision GGUF under one memory cap.

Like the paper's Figures 16-18, each configuration adds one technique to the one before:

    lossless LRU  ->  + dynamic loading (HIGH/LOW/SKIP)  ->  + prefetch (hobbit)  ->  + hobbit cache

Each run is a fresh worker process in a cgroup v1 memory cap (pyedgemoe.bench.runner), greedy,
medians over repeats; each round runs every configuration once, in an order rotated per round.
Reported per configuration: decode tok/s, prefill seconds, expert bytes read
per decode step, hit rate, next-layer top-1 prediction accuracy; and the ratios to lossless LRU.

    python scripts/bench_hobbit.py build/bench/olmoe-1b-7b-L16-q8_0-q2_K.mp.gguf --mem-cap 25% \\
        --expert-cache 15% --repeats 3 --json build/bench/hobbit-cap25.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from pyedgemoe.bench.runner import OURS, run_benchmark
from pyedgemoe.sysmem import parse_size

# name -> Engine options added on top of the common ones
CONFIGURATIONS = {
    "lossless LRU": dict(low_precision=False, skip=False, cache_policy="lru", prefetch="none"),
    "+ dynamic loading": dict(cache_policy="lru", prefetch="none"),
    "+ prefetch": dict(cache_policy="lru", prefetch="hobbit"),
    "+ hobbit cache (HOBBIT)": dict(cache_policy="hobbit", prefetch="hobbit"),
}


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(name: str, runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    return {
        "configuration": name,
        "runs": len(ok),
        "errors": [r["error"] for r in runs if "error" in r],
        "decode_tokens_per_second": median_of(ok, "decode_tokens_per_second"),
        "prefill_seconds": median_of(ok, "prefill_seconds"),
        "decode_expert_bytes_per_token": median_of(ok, "decode_expert_bytes_per_token"),
        "expert_hit_rate": median_of(ok, "expert_hit_rate"),
        "next_layer_top1_accuracy": median_of(ok, "next_layer_top1_accuracy"),
        "roofline_tokens_per_second": median_of(ok, "roofline_tokens_per_second"),
    }


def format_table(rows: list[dict]) -> str:
    base = rows[0]
    lines = ["| configuration | decode tok/s | × lossless LRU | MiB read / decode step | vs LRU | "
             "hit rate | prefill s | next-layer top-1 | roofline tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    fmt = (lambda v, spec: "n/a" if v is None else format(v, spec))
    for r in rows:
        speed = (r["decode_tokens_per_second"] / base["decode_tokens_per_second"]
                 if r["decode_tokens_per_second"] and base["decode_tokens_per_second"] else None)
        mib = r["decode_expert_bytes_per_token"] / 2**20 if r["decode_expert_bytes_per_token"] is not None else None
        less = (1 - r["decode_expert_bytes_per_token"] / base["decode_expert_bytes_per_token"]
                if mib is not None and base["decode_expert_bytes_per_token"] else None)
        lines.append(f"| {r['configuration']} | {fmt(r['decode_tokens_per_second'], '.2f')} | "
                     f"{fmt(speed, '.2f')}× | {fmt(mib, '.1f')} | {fmt(less and -less, '+.0%')} | "
                     f"{fmt(r['expert_hit_rate'], '.1%')} | {fmt(r['prefill_seconds'], '.2f')} | "
                     f"{fmt(r['next_layer_top1_accuracy'], '.1%')} | {fmt(r['roofline_tokens_per_second'], '.2f')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--mem-cap", default=None, help="cgroup memory cap: bytes with unit or %% of the file")
    p.add_argument("--expert-cache", default="15%", help="the expert cache of every configuration")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", nargs="+", choices=list(CONFIGURATIONS), help="run these configurations only")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    model = Path(args.model)
    cap = parse_size(args.mem_cap, percent_of=model.stat().st_size) if args.mem_cap else None
    names = [n for n in CONFIGURATIONS if not args.only or n in args.only]
    raw = {name: [] for name in names}
    # one run of each configuration per round, the order rotated from round to round: the shared
    # virtual disk gets faster as the host caches the file, which would favour whichever runs last
    for round_index in range(args.repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            raw[name] += run_benchmark(model, engines=[OURS], prompt_tokens=args.prompt_tokens,
                                       output_tokens=args.output_tokens, repeats=1, threads=args.threads,
                                       mem_cap_bytes=cap,
                                       ours_options={"expert_cache": args.expert_cache, **CONFIGURATIONS[name]},
                                       log=lambda line, name=name: print(f"{name}: {line}", file=sys.stderr, flush=True))
    rows = [summarize(name, raw[name]) for name in names]
    print(f"{model.name}, cap {args.mem_cap or 'none'}, expert cache {args.expert_cache}, "
          f"prompt {args.prompt_tokens} / output {args.output_tokens}, median of {args.repeats}\n")
    print(format_table(rows), end="")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": rows, "runs": raw}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
