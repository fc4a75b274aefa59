"""Calibrates copies of the trained models with their stand-ins, as scripts/systems_report.py
calibrates its fidelity models (the training split, 4096 tokens, a 25 % cache).

    cp models/demo.gguf models/fine.gguf build/standin/
    .venv/bin/python docs/bench-runs/stand-ins-2026-11-27/cal.py build/standin/demo.gguf build/standin/fine.gguf
"""
import sys
import time

sys.path.insert(0, 'scripts')
from systems_report import corpus_texts  # noqa: E402

from pyedgemoe.calibration.run import calibrate  # noqa: E402

MAX_TOKENS = 4096
_, text = corpus_texts()
for m in sys.argv[1:]:
    t = time.time()
    r = calibrate(m, text, budget="25%", max_tokens=MAX_TOKENS, n_ctx=256, text_name="training split", n_threads=2,
                  stand_ins=True, force=True)
    print(m, "records", r.data["stand_ins"]["records"], "seconds", r.data["seconds"], f"{time.time() - t:.0f} s")
