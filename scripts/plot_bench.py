"""Plot decode tok/s against the memory cap from benchmark JSON files (docs/benchmarks.md).

    python scripts/plot_bench.py build/bench/L16-*.json build/bench/hobbit-*.json \\
        [--prompt-tokens 128 --output-tokens 128] -o docs/bench-decode-vs-cap.png
    python scripts/plot_bench.py --ratio build/bench/m19/M-*.json -o docs/bench-ratio-vs-cap.png

--ratio plots ours/stock instead, per model file: decode speed and time to the first token (load
+ prefill, stock's over ours), each the median over the cells (prompt x output) of a cap of the
cells' median ratios, with the cap as a share of that model's file.

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
    p.add_argument("--ratio", action="store_true", help="plot ours/stock per model file (above)")
    p.add_argument("-o", "--out", type=Path, required=True)
    args = p.parse_args(argv)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if args.ratio:
        return plot_ratios(args, plt)

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
    return finish(fig, ax, args, "memory cap (% of the standard model file)", "decode tokens / s (median)")


def finish(fig, ax, args, xlabel: str, ylabel: str) -> int:
    """Labels, a log y axis, the title and the legend; writes args.out."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    ax.set_title(args.title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


def plot_ratios(args, plt) -> int:
    runs = [r for path in args.json for _, r in measurements(path) if "error" not in r and "engine" in r]
    cells: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        key = (Path(r["model"]).name, r["model_bytes"], r.get("mem_cap_bytes"), r["prompt_tokens"], r["output_tokens"])
        cells[key][r["engine"]].append(r)
    ratios: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    no_cap = 125.0
    for (model, size, cap, _, _), by_engine in cells.items():
        ours, stock = by_engine.get("pyedgemoe"), by_engine.get("llama_cpp")
        if not ours or not stock:
            continue
        x = float(round(100.0 * cap / size)) if cap else no_cap

        def median(rs: list[dict], f) -> float:
            return statistics.median(f(r) for r in rs)
        decode = median(ours, lambda r: r["decode_tokens_per_second"]) / median(stock, lambda r: r["decode_tokens_per_second"])
        first = median(stock, lambda r: r["load_seconds"] + r["prefill_seconds"]) / \
            median(ours, lambda r: r["load_seconds"] + r["prefill_seconds"])
        ratios[f"{model}: decode"][x].append(decode)
        ratios[f"{model}: first token"][x].append(first)
    if not ratios:
        print("no cell has both engines", file=sys.stderr)
        return 1
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, by_cap in sorted(ratios.items()):
        caps = sorted(by_cap)
        ax.plot(caps, [statistics.median(by_cap[c]) for c in caps], marker="o" if "decode" in name else "s",
                linestyle="-" if "decode" in name else "--", label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    caps = sorted({c for by_cap in ratios.values() for c in by_cap})
    ax.set_xticks(caps, ["no cap" if c == no_cap else f"{c:.0f} %" for c in caps])
    return finish(fig, ax, args, "memory cap (% of the model file)", "ours / stock llama.cpp (median over cells)")


if __name__ == "__main__":
    sys.exit(main())
