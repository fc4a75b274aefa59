"""hobbit-stand-ins with the drop costs at several q on the three fidelity models (copies of
scripts/systems_report.py's build/systems/ whose sidecars took the stand-ins of build/standin-drop/:
the same costs, the drop costs added), bytes against lossless over lru:

    .venv/bin/python docs/bench-runs/stand-ins-2026-11-27b/hobbit-q.py build/systems-drop/demo-q2_K.mp.gguf,build/systems-drop/demo.gguf,build/systems-drop/fine.gguf 0.1 0.15 0.2
"""
import sys
sys.path.insert(0, 'scripts')
from systems_report import fidelity, BUDGET
for m in sys.argv[1].split(","):
    runs = {"lossless": dict(expert_cache=BUDGET, system="lossless"), "hobbit": dict(expert_cache=BUDGET, system="hobbit")}
    for q in (float(x) for x in sys.argv[2:]):
        runs[f"hobbit-stand-ins {q:g}"] = dict(expert_cache=BUDGET, system="hobbit-stand-ins", stand_in=q)
    rows = fidelity(m, runs)
    for r in rows[2:]:
        print(f"{m} {r['system']:<22} ppl {r['ppl']/rows[0]['ppl']-1:+.2%} agree {r['agreement']:.2%} bytes {r['bytes_per_token']/rows[1]['bytes_per_token']-1:+.1%}", flush=True)
