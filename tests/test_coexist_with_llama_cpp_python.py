"""Our static llama.cpp/ggml and llama-cpp-python's shared ones live in one process without
clashing, whichever is imported first, and both compute the same logits there."""
from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys
import numpy as np
first, second = sys.argv[1], sys.argv[2]
path = sys.argv[3]
ids = [1, 2, 3, 4, 5, 6]
mods = {}
for name in (first, second):
    mods[name] = __import__(name)
from pyedgemoe import Engine
import llama_cpp
with Engine(path, n_ctx=64, n_threads=2, flash_attn=False) as eng:
    ours = eng.logits(ids)
llm = llama_cpp.Llama(model_path=path, n_ctx=64, logits_all=True, n_threads=2, flash_attn=False, verbose=False)
llm.eval(ids)
theirs = np.array(llm.scores[:len(ids)], dtype=np.float32)
print(float(np.max(np.abs(ours - theirs))))
"""


@pytest.mark.parametrize("order", [("llama_cpp", "pyedgemoe._native"), ("pyedgemoe._native", "llama_cpp")])
def test_both_import_orders(mixtral_gguf, order):
    r = subprocess.run([sys.executable, "-c", SCRIPT, *order, str(mixtral_gguf)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout.strip().splitlines()[-1]) <= 1e-4


def test_module_exports_no_llama_or_ggml_symbols():
    import pyedgemoe._native as native
    nm = subprocess.run(["nm", "-D", "--defined-only", native.__file__], capture_output=True, text=True)
    assert nm.returncode == 0
    leaked = [l for l in nm.stdout.splitlines() if " llama_" in l or " ggml_" in l or " gguf_" in l]
    assert leaked == []
