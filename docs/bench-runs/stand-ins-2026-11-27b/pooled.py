"""One tau for every layer: the q-quantile of all layers' swap costs pooled (each layer's quantile
function mixed with equal weight, as each layer has one record a token), against each layer's own
q-quantile (the shipped taus). Both through scripts/systems_report.py's fidelity harness at 25 %.

    .venv/bin/python docs/bench-runs/stand-ins-2026-11-27b/pooled.py build/standin/demo.gguf,build/standin/fine.gguf 0.25 0.3
"""
import json, sys
import numpy as np
sys.path.insert(0, 'scripts')
from systems_report import fidelity, BUDGET
from pyedgemoe.calibration import stand_ins

shipped = stand_ins.taus
points = np.linspace(0, 1, stand_ins.QUANTILE_POINTS)


def pooled(table, q):
    layers = shipped(table, q)
    quantiles = [np.asarray(t["swap_cost_quantiles"]) for t in table["layers"].values()]
    cdf = lambda x: np.mean([np.interp(x, qs, points) for qs in quantiles])
    lo, hi = 0.0, max(qs[-1] for qs in quantiles)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
    return {il: (costs, hi) for il, (costs, _) in layers.items()}


out = {}
qs = [float(x) for x in sys.argv[2:]]
for m in sys.argv[1].split(","):
    rows = []
    for name, rule in (("per layer", shipped), ("pooled", pooled)):
        stand_ins.taus = rule
        runs = {f"{name} {q:g}": dict(expert_cache=BUDGET, system="lossless", cache_policy="decay", stand_in=q) for q in qs}
        if name == "per layer":
            runs = {"lossless": dict(expert_cache=BUDGET, system="lossless"), **runs}
        got = fidelity(m, runs)
        rows += got if not rows else got[1:]
    out[m] = rows
    base = next(r for r in rows if r["system"] == "lossless")
    for r in rows:
        if "bytes_per_token" in r:
            print(f"{m} {r['system']:<16} ppl {r['ppl']/rows[0]['ppl']-1:+.2%} agree {r['agreement']:.2%} "
                  f"bytes {1 - r['bytes_per_token']/base['bytes_per_token']:+.1%} fewer than lossless", flush=True)
json.dump(out, open(sys.argv[0].replace(".py", ".json"), "w"), indent=1)
