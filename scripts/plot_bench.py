"""Plot decode tok/s against the memory cap from benchmark JSON files (docs/benchmarks.md).

    python scripts/plot_bench.py build/bench/L16-*.json build/bench/hobbit-*.json \\
        [--prompt-tokens 128 --output-tokens 128] -o docs/bench-decode-vs-cap.png

Inputs: the measurement lists `pyedgemoe bench ... --json` writes, and the
`{"runs": {configuration: [...]}}` files of scripts/bench_hobbit.py. One line per engine (or
pyedgemoe configuration); x is the cap as a share of the standard (HIGH-only) model file, with
"no cap" drawn right of the largest cap; each point is the median over repeats of the cells kept
(--prompt-tokens / --output-tokens keep one cell). Needs matplotlib (the `bench` extra).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def measurements(path: Path) -> list[tuple[str, dict]]:
    """(series name, measurement) pairs of one JSON file."""
    data = json.loads(path.read_text())
    if isinstance(data, dict) and "runs" in data:
        # one line per configuration across the files (e.g. one file per cap)
        return [(f"HOBBIT ablation: {name}", r) for name, runs in data["runs"].items() for r in runs]
    def name(r: dict) -> str:
        if r["engine"] == "llama_cpp":
            no_repack = (r.get("options") or {}).get("repack") is False
            return "stock llama.cpp (mmap, --no-repack)" if no_repack else "stock llama.cpp (mmap)"
        return "pyedgemoe (resident; lossless LRU cache under a cap)" if r["engine"] == "pyedgemoe" else r["engine"]
    return [(name(r), r) for r in data]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+", type=Path)
    p.add_argument("--reference-bytes", type=int, default=None,
                   help="file size the caps are a share of (default: the smallest model in the inputs)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="keep only runs with this prompt length")
    p.add_argument("--output-tokens", type=int, default=None, help="keep only runs with this output length")
    p.add_argument("--title", default="Synthetic OLMoE-1B-7B geometry (16 layers), 2 threads")
    p.add_argument("-o", "--out", type=Path, required=True)
    args = p.parse_args(argv)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    rows = [(name, r) for path in args.json for name, r in measurements(path) if "error" not in r
            and args.prompt_tokens in (None, r.get("prompt_tokens"))
            and args.output_tokens in (None, r.get("output_tokens"))]
    if not rows:
        p.error("no measurement in the inputs matches --prompt-tokens / --output-tokens")
    reference = args.reference_bytes or min(r["model_bytes"] for _, r in rows)
    shares = {r["mem_cap_bytes"]: 100.0 * r["mem_cap_bytes"] / reference for _, r in rows if r.get("mem_cap_bytes")}
    no_cap = 1.25 * max(shares.values(), default=80.0)  # "no cap" sits one step right of the caps
    for name, r in rows:
        points[name][shares.get(r.get("mem_cap_bytes"), no_cap)].append(r["decode_tokens_per_second"])

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, by_cap in sorted(points.items()):
        caps = sorted(by_cap)
        ax.plot(caps, [statistics.median(by_cap[c]) for c in caps], marker="o", label=name)
    ticks = {share: f"{share:.0f} %" for share in shares.values()}
    if any(no_cap in by_cap for by_cap in points.values()):
        ticks[no_cap] = "no cap"
    ax.set_xticks(list(ticks), list(ticks.values()))
    ax.set_xlabel("memory cap (% of the standard model file)")
    ax.set_ylabel("decode tokens / s (median)")
    ax.set_yscale("log")
    ax.set_title(args.title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
