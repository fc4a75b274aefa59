import sys
sys.path.insert(0, "scripts")
import numpy as np
from systems_report import TRAINED, BUDGET, PPL_CTX, PPL_CHUNKS
from fidelity_report import SETTINGS, corpus_texts
from pyedgemoe import Engine
from pyedgemoe.calibration.mobile import LITTLE_ONLY

heldout, _ = corpus_texts()
def nll_rows(model, **opts):
    out = []
    with Engine(model, **SETTINGS, **opts) as eng:
        ids = eng.tokenize(heldout, add_bos=False)
        for c in range(PPL_CHUNKS):
            chunk = ids[c * PPL_CTX:(c + 1) * PPL_CTX]
            lg = eng.logits(chunk, one_token_per_step=True)[:-1].astype(np.float64)
            tgt = np.array(chunk[1:])
            m = lg.max(axis=1, keepdims=True); lse = (m[:, 0] + np.log(np.exp(lg - m).sum(axis=1)))
            nll = lse - lg[np.arange(len(tgt)), tgt]
            s = np.sort(lg, axis=1)
            out.append(np.stack([nll, s[:, -1] - s[:, -2], np.exp(s[:, -1] - lse)], axis=1)[PPL_CTX // 2:])
    return np.concatenate(out)
for name, model in TRAINED.items():
    full = nll_rows(model, expert_cache=None)
    little = nll_rows(model, expert_cache=BUDGET, system="mobile", big_little=LITTLE_ONLY)
    base = np.exp(full[:, 0].mean())
    print(name, "little alone ppl", f"{np.exp(little[:, 0].mean()) / base - 1:+.2%}")
    for col, nm in ((1, "margin"), (2, "top")):
        order = np.argsort(little[:, col])
        line = []
        for frac in (0.2, 0.3, 0.5, 0.6, 0.7, 0.8):
            n = int(frac * len(little)); redo = np.zeros(len(little), bool); redo[order[:n]] = True
            line.append(f"{frac:.0%}:{np.exp(np.where(redo, full[:, 0], little[:, 0]).mean()) / base - 1:+.2%}")
        print(" ", nm, " ".join(line))
