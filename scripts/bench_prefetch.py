#!/usr/bin/env python3
"""Prefetch that never costs (docs/benchmarks.md): expert bytes per decoded token and decode speed
with the default options, without prefetch, and with Fate's prefetch asked for, on each model,
in rounds that run every variant once (the order rotated per round), each run a fresh process of
`pyedgemoe bench --ours-only`; medians over the rounds.

    .venv/bin/python scripts/bench_prefetch.py [--rounds 3] [--output 64] [--variant NAME=FLAGS ...] MODEL:CACHE[:fixed] ...

CACHE is the expert cache (25%); `fixed` decodes a fixed token sequence (random-weight models,
whose greedy output repeats itself). `--variant` (repeated) runs these variants instead, each its
`pyedgemoe bench` flags, the first the reference of the bytes column (e.g. the cache policies:
`--variant "lru=--system lossless" --variant "decay=--system lossless --cache-policy decay"`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {"default": [], "--prefetch none": ["--prefetch", "none"], "--prefetch fate": ["--prefetch", "fate"]}


def run(model: str, cache: str, decode_input: str, flags: list[str], output: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        subprocess.run([sys.executable, "-m", "pyedgemoe", "bench", model, "--ours-only", "--repeats", "1",
                        "--warmup", "0", "--output-tokens", str(output), "--expert-cache", cache,
                        "--decode-input", decode_input, "--json", str(out), *flags],
                       check=True, capture_output=True, text=True)
        (r,) = json.loads(out.read_text())
    p = r["engine_stats"]["experts"]["prefetches"]
    return {"tok_s": r["n_output_tokens"] / r["decode_seconds"], "bytes": r["decode_expert_bytes_per_token"],
            "prefetch": r["engine_stats"]["experts"]["prefetch"], "stopped": p["stopped"],
            "issued": p["issued"], "tokens": r["tokens"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="MODEL:CACHE[:fixed]")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS")
    args = p.parse_args()
    variants = {name: flags.split() for name, flags in (v.split("=", 1) for v in args.variant)} or VARIANTS
    reference_name = next(iter(variants)) if args.variant else "--prefetch none"
    print("| model, cache | variant | prefetch in effect | decode tok/s (median) | range | expert KiB / token (median) "
          f"| vs {reference_name} | stopped itself | same tokens |")
    print("|---|---|---|---:|---|---:|---:|---|---|")
    for spec in args.models:
        model, cache, *rest = spec.split(":")
        decode_input = rest[0] if rest else "greedy"
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                runs[name].append(run(model, cache, decode_input, variants[name], args.output))
        reference = statistics.median(x["bytes"] for x in runs[reference_name])
        for name, rs in runs.items():
            speeds = [x["tok_s"] for x in rs]
            size = statistics.median(x["bytes"] for x in rs)
            print(f"| {Path(model).name}, {cache} | {name} | {rs[0]['prefetch']} | {statistics.median(speeds):.2f} | "
                  f"{min(speeds):.2f}-{max(speeds):.2f} | {size / 1024:.1f} | {size / reference - 1:+.1%} | "
                  f"{sum(x['stopped'] for x in rs)}/{len(rs)} | "
                  f"{'yes' if all(x['tokens'] == runs[reference_name][0]['tokens'] for x in rs) else 'no'} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
