#!/usr/bin/env python3
"""`make demo`: generate text with a MoE model through pyedgemoe, and show what it holds.

Until the trained demo model ships in models/ (issue 6), the demo builds a small synthetic
MoE GGUF (OLMoE layout, random weights, so the text is gibberish) with
scripts/make_synthetic_gguf.py, then runs `pyedgemoe inspect` and `pyedgemoe run` on it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "models" / "demo.gguf"
SYNTHETIC = REPO / "build" / "demo" / "olmoe-mini-q8_0.gguf"
PROMPT = "The quick brown fox"


def demo_model() -> Path:
    if SHIPPED.exists():
        return SHIPPED
    if not SYNTHETIC.exists():
        SYNTHETIC.parent.mkdir(parents=True, exist_ok=True)
        print(f"demo: no trained demo model yet; writing a synthetic one to {SYNTHETIC}", flush=True)
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_synthetic_gguf.py"),
                        "--geometry", "olmoe-mini", "--type", "q8_0", "-o", str(SYNTHETIC)], check=True)
    return SYNTHETIC


def main() -> int:
    model = demo_model()
    pyedgemoe = [sys.executable, "-m", "pyedgemoe.cli"]
    subprocess.run(pyedgemoe + ["inspect", str(model)], check=True)
    print(f"\n$ pyedgemoe run {model.name} -p {PROMPT!r} -n 32 --temp 0 --stats\n", flush=True)
    return subprocess.run(pyedgemoe + ["run", str(model), "-p", PROMPT, "-n", "32", "--temp", "0",
                                       "--stats"]).returncode


if __name__ == "__main__":
    sys.exit(main())
