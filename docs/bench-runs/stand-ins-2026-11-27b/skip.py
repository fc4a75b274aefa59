"""Dropping a missed selection against standing in for it: HOBBIT's skip alone (t1 = t2 = t, no LOW
copies: a selection ranked below the top t of the token's weight is skipped where the cache does
not hold it, and computed in HIGH otherwise), over decay's cache at 25 %, beside the shipped
stand-ins (q 0.28), through scripts/systems_report.py's fidelity harness.

    .venv/bin/python docs/bench-runs/stand-ins-2026-11-27b/skip.py build/standin/demo.gguf,build/standin/fine.gguf 0.6 0.7 0.8
"""
import json, sys
sys.path.insert(0, 'scripts')
from systems_report import fidelity, BUDGET

out = {}
ts = [float(x) for x in sys.argv[2:]]
for m in sys.argv[1].split(","):
    runs = {"lossless": dict(expert_cache=BUDGET, system="lossless"),
            "stand-in 0.28": dict(expert_cache=BUDGET, system="lossless", cache_policy="decay", stand_in=0.28)}
    for t in ts:
        runs[f"skip t {t:g}"] = dict(expert_cache=BUDGET, system="lossless", cache_policy="decay", skip=True,
                                     low_precision=False, t1=t, t2=t)
    rows = fidelity(m, runs)
    out[m] = rows
    base = rows[1]
    for r in rows:
        if "bytes_per_token" in r:
            print(f"{m} {r['system']:<16} ppl {r['ppl']/rows[0]['ppl']-1:+.2%} agree {r['agreement']:.2%} "
                  f"bytes {1 - r['bytes_per_token']/base['bytes_per_token']:+.1%} fewer than lossless skip {r['skip_fraction']:.1%}", flush=True)
json.dump(out, open(sys.argv[0].replace(".py", ".json"), "w"), indent=1)
