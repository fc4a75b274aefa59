"""The demo's agreement at the stand-ins' q over 48 held-out prompts x 128 tokens (6144 tokens, a
standard error of about 0.2 %) instead of the fidelity tables' 16: with the drop costs.

    .venv/bin/python docs/bench-runs/stand-ins-2026-11-27b/agreement48.py build/standin-drop/demo.gguf 0.2 0.22
"""
import sys

sys.path.insert(0, 'scripts')
import systems_report  # noqa: E402

systems_report.N_PROMPTS = 48
model, qs = sys.argv[1], [float(q) for q in sys.argv[2:]]
runs = {"lossless": dict(expert_cache=systems_report.BUDGET, system="lossless")}
runs.update({f"stand-ins {q:g}": dict(expert_cache=systems_report.BUDGET, system="stand-ins", stand_in=q) for q in qs})
rows = systems_report.fidelity(model, runs)
for r in rows[1:]:
    print(f"{r['system']:<16} agreement {r['agreement']:.2%}, perplexity {r['ppl'] / rows[0]['ppl'] - 1:+.2%}, "
          f"bytes {r['bytes_per_token'] / rows[1]['bytes_per_token'] - 1:+.1%} against lossless", flush=True)
