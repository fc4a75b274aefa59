"""What the device tier moves, on whatever GPU the native module has (docs/gpu.md: lavapipe's
numbers). Counts and bytes only: on lavapipe timings mean nothing.

    PYEDGEMOE_NATIVE=build/vulkan-native/_native*.so GGML_VK_VISIBLE_DEVICES=0 \\
        python scripts/device_counts.py models/demo.gguf

Greedy decode of a fixed prompt in each mode at device budgets of 50 % and 25 % of the HIGH expert
bytes, with low precision off (lossless: the tokens are compared with the all-resident device
run) and on; prints one markdown table row per run."""
from __future__ import annotations

import argparse
import contextlib
import os

from pyedgemoe import Engine

PROMPT = "The history of the printing press begins"
MIB = 1024**2


def run(model: str, n: int, **options) -> tuple[list[int], dict]:
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        with Engine(model, n_ctx=512, **options) as eng:
            tokens = eng.time_generation(eng.tokenize(PROMPT), n)["tokens"]
            return tokens, eng.stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("-n", type=int, default=64, help="tokens to generate")
    args = parser.parse_args()
    resident, stats = run(args.model, args.n, mode="gpu")
    print(f"device {stats['device']}, {args.n} tokens after a {len(PROMPT.split())}-word prompt\n")
    print("| mode | budget | low precision | tokens as all-resident | misses | uploaded | read from storage | host hits / reads | CPU experts |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for low in (False, True):
        for budget in ("50%", "25%"):
            for mode in ("gpu", "coop"):
                tokens, stats = run(args.model, args.n, mode=mode, expert_cache=budget, low_precision=low)
                t = stats["experts"]["total"]
                first = next((i for i, (a, b) in enumerate(zip(tokens, resident)) if a != b), None)
                same = "yes" if first is None else f"up to token {first}"
                print(f"| {mode} | {budget} | {'on' if low else 'off'} | {same} | {t['misses']} | "
                      f"{t['uploads']} experts, {t['bytes_uploaded'] / MIB:.1f} MiB | {t['bytes_read'] / MIB:.1f} MiB | "
                      f"{t['host_hits']} / {t['host_loads']} | {t['cpu_experts']} |")


if __name__ == "__main__":
    main()
