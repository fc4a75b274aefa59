"""scripts/make_synthetic_gguf.py: two files of one seed and row pool in different types are two
quants of one model, so the lower one serves as the other's LOW copies (--low-from), as the GPU
check's mixed-precision cells use them (docs/gpu.md)."""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np

from pyedgemoe import Engine, _native

ROOT = Path(__file__).resolve().parent.parent


def writer():
    spec = importlib.util.spec_from_file_location("make_synthetic_gguf", ROOT / "scripts" / "make_synthetic_gguf.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen
    spec.loader.exec_module(gen)
    # Qwen3-30B-A3B's structure at a small size (K-quant rows: multiples of 256 weights)
    gen.GEOMETRIES["qwen3-small"] = dataclasses.replace(
        gen.GEOMETRIES["qwen3-30b-a3b"], n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=16,
        n_expert_used=4, n_ff_exp=256, n_ff=1024)
    return gen


def experts(path: Path, name: str) -> np.ndarray:
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    n_per_row = int(t.shape[0])
    n_rows = int(np.prod(t.shape)) // n_per_row
    return _native.dequantize(np.ascontiguousarray(t.data).reshape(-1).view(np.uint8), t.tensor_type.name.lower()
                              .replace("_k", "_K"), n_rows, n_per_row)


def test_a_lower_type_of_the_same_seed_and_pool_is_the_low_copy_of_the_same_model(tmp_path, tiny_model):
    gen = writer()
    vocab = tiny_model("qwen3_moe")[0]
    paths = {}
    for type_name in ("q4_k", "q2_k"):
        paths[type_name] = tmp_path / f"small-{type_name}.gguf"
        gen.write_synthetic_gguf(paths[type_name], "qwen3-small", 2, type_name, seed=0, vocab_path=vocab, row_pool=512,
                                 log=lambda s: None)
    high, low = (experts(paths[t], "blk.1.ffn_up_exps.weight") for t in ("q4_k", "q2_k"))
    # the same weights at two precisions: Q2_K's error is a fraction of the weights' spread, where
    # unrelated random matrices would be apart by more than the spread itself
    assert high.shape == low.shape
    assert np.std(low - high) < 0.5 * np.std(high)
    assert np.corrcoef(low.ravel(), high.ravel())[0, 1] > 0.9

    prompt = [1, 17, 42, 99, 5, 230, 64, 7]
    with Engine(paths["q4_k"], n_ctx=64, expert_cache="50%", low_from=str(paths["q2_k"]), t1=0.0, t2=1.0) as eng:
        eng.time_generation(prompt, 8)
        total = eng.stats()["experts"]["total"]
    assert total["selections_low"] > 0 and total["loads_low"] > 0
