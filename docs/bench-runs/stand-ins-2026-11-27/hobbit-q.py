"""hobbit-stand-ins at lower q on the fidelity models scripts/systems_report.py calibrated
(build/systems/), bytes against lossless over lru:

    .venv/bin/python docs/bench-runs/stand-ins-2026-11-27/hobbit-q.py build/systems/demo-q2_K.mp.gguf build/systems/demo.gguf build/systems/fine.gguf
"""
import sys
sys.path.insert(0, 'scripts')
from systems_report import fidelity, BUDGET
for m in sys.argv[1:]:
    runs = {"lossless": dict(expert_cache=BUDGET, system="lossless")}
    for q in (0.1, 0.15):
        runs[f"hobbit-stand-ins {q}"] = dict(expert_cache=BUDGET, system="hobbit-stand-ins", stand_in=q)
    rows = fidelity(m, runs)
    for r in rows[2:]:
        print(f"{m} {r['system']:<22} ppl {r['ppl']/rows[0]['ppl']-1:+.2%} agree {r['agreement']:.2%} bytes {r['bytes_per_token']/rows[1]['bytes_per_token']-1:+.1%}", flush=True)
