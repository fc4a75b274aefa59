#!/usr/bin/env python3
"""`make demo`: generate Python code with the shipped demo MoE, its experts read from disk on demand.

models/demo.gguf is a small Qwen3-MoE (6 layers, 16 experts of which 2 per token) trained on the
Python standard library's sources by scripts/train_demo_moe.py (models/README.md). The demo shows
what the file holds (`pyedgemoe inspect`), then continues the start of a Python method greedily
with an expert cache of a quarter of the expert bytes: most experts are not resident, so routed
experts are read from the file when missing, and `--stats` prints the cache's hits and misses.
"""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "demo.gguf"
PROMPT = "    def close(self):\n        \"\"\"Close the file.\"\"\"\n"
# A quarter of the experts fit: a token's 2 experts per layer are often not cached, so they are
# read from disk (misses > 0 in the statistics).
EXPERT_CACHE = "25%"


def main() -> int:
    if not MODEL.exists():
        print(f"demo: {MODEL} is missing (it is committed; see models/README.md to rebuild it)", file=sys.stderr)
        return 1
    pyedgemoe = [sys.executable, "-m", "pyedgemoe.cli"]
    subprocess.run(pyedgemoe + ["inspect", str(MODEL)], check=True)
    args = ["run", str(MODEL), "-p", PROMPT, "-n", "64", "--temp", "0", "--expert-cache", EXPERT_CACHE, "--stats"]
    print(f"\n$ pyedgemoe {shlex.join(args)}\n", flush=True)
    return subprocess.run(pyedgemoe + args).returncode  # `run` prints the prompt, then its continuation


if __name__ == "__main__":
    sys.exit(main())
