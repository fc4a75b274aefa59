"""The stand-ins' sweep: scripts/systems_report.py's fidelity harness (decode-mode perplexity over 8
chunks of 256 held-out tokens, top-1 agreement over 16 prompts x 128 tokens against HIGH only,
expert bytes per token) at a 25 % cache: lossless over LRU and over decay, and --stand-in q over
decay for each q given.

    .venv/bin/python docs/bench-runs/stand-ins-2026-11-27b/sweep.py build/standin-drop/demo.gguf,build/standin-drop/fine.gguf 0.2 0.25 0.3 0.35
"""
import json, sys
sys.path.insert(0, 'scripts')
from systems_report import fidelity, BUDGET
out = {}
qs = [float(x) for x in sys.argv[2:]] or [0.25, 0.3, 0.35, 0.4]
for m in sys.argv[1].split(","):
    runs = {"lossless": dict(expert_cache=BUDGET, system="lossless"),
            "lossless, decay": dict(expert_cache=BUDGET, system="lossless", cache_policy="decay")}
    for q in qs:
        runs[f"stand-in {q:g}"] = dict(expert_cache=BUDGET, system="lossless", cache_policy="decay", stand_in=q)
    rows = fidelity(m, runs)
    out[m] = rows
    base = rows[1]
    for r in rows:
        if "bytes_per_token" in r:
            print(f"{m} {r['system']:<18} ppl {r['ppl']:.4f} ({r['ppl']/rows[0]['ppl']-1:+.2%}) agree {r['agreement']:.2%} bytes {1 - r['bytes_per_token']/base['bytes_per_token']:+.1%} fewer than LRU", flush=True)
json.dump(out, open(sys.argv[0].replace("sweep.py", "sweep.json"), "w"), indent=1)
