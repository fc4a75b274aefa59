#!/usr/bin/env python3
"""`make demo`: generate text with a MoE model through pyedgemoe, and show what it holds.

Until the trained demo model ships in models/ (issue 6), the demo builds a small synthetic
MoE GGUF (OLMoE layout, random weights, so the text is gibberish) with
scripts/make_synthetic_gguf.py, then runs `pyedgemoe inspect` and `pyedgemoe run` on it with an
expert cache of a quarter of the experts, so experts are read from disk on demand.
"""
from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "models" / "demo.gguf"
SYNTHETIC = REPO / "build" / "demo" / "olmoe-mini-q8_0.gguf"
PROMPT = "The quick brown fox"
# Small enough that experts are read from disk on demand: a quarter of them fit in the cache.
EXPERT_CACHE = "25%"


def write_synthetic_demo_model(path: Path) -> None:
    """OLMoE's layout at a tenth of its width (4 layers, 16 experts of which 4 per token)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import make_synthetic_gguf as gen

    gen.GEOMETRIES["olmoe-mini"] = dataclasses.replace(
        gen.GEOMETRIES["olmoe-1b-7b"], n_layer=4, n_embd=512, n_head=8, n_head_kv=8, head_dim=64,
        n_expert=16, n_expert_used=4, n_ff_exp=512, n_ff=512)
    gen.write_synthetic_gguf(path, "olmoe-mini", None, "q8_0", seed=0)


def demo_model() -> Path:
    if SHIPPED.exists():
        return SHIPPED
    if not SYNTHETIC.exists():
        SYNTHETIC.parent.mkdir(parents=True, exist_ok=True)
        print(f"demo: no trained demo model yet; writing a synthetic one to {SYNTHETIC}", flush=True)
        write_synthetic_demo_model(SYNTHETIC)
    return SYNTHETIC


def main() -> int:
    model = demo_model()
    pyedgemoe = [sys.executable, "-m", "pyedgemoe.cli"]
    subprocess.run(pyedgemoe + ["inspect", str(model)], check=True)
    args = ["run", str(model), "-p", PROMPT, "-n", "32", "--temp", "0", "--expert-cache", EXPERT_CACHE, "--stats"]
    print(f"\n$ pyedgemoe {shlex.join(args)}\n", flush=True)
    return subprocess.run(pyedgemoe + args).returncode


if __name__ == "__main__":
    sys.exit(main())
