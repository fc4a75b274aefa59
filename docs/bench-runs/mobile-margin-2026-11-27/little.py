import sys, json
sys.path.insert(0, "scripts")
import numpy as np
from systems_report import TRAINED, BUDGET, N_PROMPTS, CONTINUATION
from fidelity_report import SETTINGS, PROMPT_TOKENS, corpus_texts
from pyedgemoe import Engine
from pyedgemoe.calibration.mobile import LITTLE_ONLY

out = {}
heldout, _ = corpus_texts()
for (name, model), key in zip(TRAINED.items(), ["demo", "fine"]):
    with Engine(model, **SETTINGS) as eng:
        ids = eng.tokenize(heldout, add_bos=False)
        step = len(ids) // N_PROMPTS
        prompts = [ids[i * step:i * step + PROMPT_TOKENS] for i in range(N_PROMPTS)]
        refs = [eng.time_generation(p, CONTINUATION)["tokens"] for p in prompts]
    rows = []
    with Engine(model, **SETTINGS, expert_cache=BUDGET, system="mobile", big_little=LITTLE_ONLY) as eng:
        for p, r in zip(prompts, refs):
            lg = eng.logits(p + r[:-1], one_token_per_step=True)[len(p) - 1:]
            s = np.sort(lg, axis=1)
            z = lg - lg.max(axis=1, keepdims=True)
            rows.append(np.stack([s[:, -1] - s[:, -2], 1.0 / np.exp(z).sum(axis=1), lg.argmax(axis=1) == np.array(r)], axis=1))
    a = np.concatenate(rows)
    out[key] = a.tolist()
    dis = a[:, 2] == 0
    print(key, "little agreement", a[:, 2].mean())
    for col, nm in ((0, "margin"), (1, "top")):
        order = np.argsort(a[:, col])
        for frac in (0.1, 0.2, 0.3, 0.5, 0.7, 0.85):
            n = int(frac * len(a)); redo = np.zeros(len(a), bool); redo[order[:n]] = True
            print(f"  {nm} redo {frac:.0%}: agreement {np.where(redo, 1, a[:, 2]).mean():.3f}")
json.dump(out, open("build/exp/little.json", "w"))
