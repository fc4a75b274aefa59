"""Stand-ins with HOBBIT's preset against hobbit-cache-routing (λ), on the models cal.py calibrated,
with sweep.py's harness; bytes against lossless over lru.

    .venv/bin/python docs/bench-runs/stand-ins-2026-11-27/combo.py build/standin/demo.gguf build/standin/fine.gguf
"""
import sys

sys.path.insert(0, 'scripts')
from systems_report import BUDGET, fidelity  # noqa: E402

for m in sys.argv[1:]:
    runs = {"lossless": dict(expert_cache=BUDGET, system="lossless"),
            "hobbit": dict(expert_cache=BUDGET, system="hobbit"),
            "hobbit-cache-routing": dict(expert_cache=BUDGET, system="hobbit-cache-routing"),
            "hobbit + stand-in 0.25": dict(expert_cache=BUDGET, system="hobbit", stand_in=0.25),
            "hobbit + stand-in 0.2": dict(expert_cache=BUDGET, system="hobbit", stand_in=0.2)}
    rows = fidelity(m, runs)
    for r in rows[1:]:
        print(f"{m} {r['system']:<24} ppl {r['ppl'] / rows[0]['ppl'] - 1:+.2%} agree {r['agreement']:.2%} "
              f"bytes {1 - r['bytes_per_token'] / rows[1]['bytes_per_token']:+.1%} fewer than lossless", flush=True)
