#!/usr/bin/env python3
"""Fate's shallow-favoring split against an even one (docs/systems.md, the fate preset): a
calibration's routing trace (`pyedgemoe calibrate --trace`) replayed lossless through the
runtime's cache code with lru and with the fate policy (ARC per layer) at each cache size, the
fate policy's slots split as its default does (shallow layers first where the deep ones keep a
token's top-k each) and evenly (`--fate-shallow 0`). Loads; fewer is better.

    .venv/bin/python scripts/fate_split.py build/demo.routing-trace.npz build/fine.routing-trace.npz
"""
from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np

from pyedgemoe import _native
from pyedgemoe.calibration.replay import CacheSetup, replay, replay_steps
from pyedgemoe.calibration.trace import load_trace

SHARES = (0.2, 0.25, 0.3, 0.4, 0.5, 0.6)


def main() -> int:
    print("| trace | cache | slots | lru | fate, shallow first (layers) | fate, even split |")
    print("|---|---:|---:|---:|---:|---:|")
    for path in sys.argv[1:]:
        trace = load_trace(path)
        steps = replay_steps(trace, 1.0, 1.0, use_low=False, use_skip=False)
        layers = sorted({s.layer for s in steps})
        n_expert, k = int(np.asarray(trace["ids"]).max()) + 1, np.asarray(trace["ids"]).shape[1]
        for share in SHARES:
            setup = CacheSetup(high_slots=int(share * len(layers) * n_expert), low_slots=0, n_layers=max(layers) + 1,
                               low_cost=0.0, layers=tuple(layers), n_expert=n_expert, n_expert_used=k)
            shallow = sum(1 for n in _native.shallow_favoring_split(setup.high_slots, layers, n_expert, -1, k)
                          if n == n_expert) if setup.high_slots > n_expert else 0
            loads = [replay(steps, setup, "lru").loads_high, replay(steps, setup, "fate").loads_high,
                     replay(steps, replace(setup, fate_shallow=0), "fate").loads_high]
            print(f"| {path} | {share:.0%} | {setup.high_slots} | {loads[0]} | {loads[1]} ({shallow}) | {loads[2]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
