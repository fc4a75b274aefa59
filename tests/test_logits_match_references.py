"""Our build of llama.cpp computes what stock llama.cpp and transformers compute.

For each architecture (GPT-OSS and DeepSeek-V3 too, from llama.cpp's converter), on the same F32 GGUF: Engine.logits equals stock llama-cpp-python's
(same kernels: max abs diff <= 1e-4), is within 1e-3 of transformers' logits for the HF
checkpoint, and greedy generation gives the same 32 tokens as stock llama-cpp-python.
Both engines run with the same settings: no flash attention (llama-cpp-python's default)
and an F32 KV cache (an F16 one alone moves logits by ~1e-3, more than the tolerance).
"""
from __future__ import annotations

import llama_cpp
import numpy as np
import pytest

from conftest import MOE_ARCHITECTURES, tiny_moe
from pyedgemoe import Engine
from test_memory_honesty import two_layer_olmoe

SAME_SETTINGS = dict(n_ctx=256, n_threads=2, flash_attn=False, kv_type="f32")
IDS = [1, 17, 42, 99, 5, 230, 64, 7, 150, 33, 12, 201, 88, 3, 120, 45]
ARCHS = MOE_ARCHITECTURES + list(tiny_moe.LLAMA_CPP_ONLY) + ["llama"]


def stock_llama(path, n_ctx=256):
    f32 = llama_cpp.GGML_TYPE_F32
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, n_threads=2,
                           n_threads_batch=2, flash_attn=False, type_k=f32, type_v=f32, verbose=False)


def stock_logits(path, ids) -> np.ndarray:
    llm = stock_llama(path)
    llm.eval(ids)
    out = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_stock_llama_cpp(tiny_model, arch):
    gguf, _ = tiny_model(arch)
    with Engine(gguf, **SAME_SETTINGS) as eng:
        ours = eng.logits(IDS)
    theirs = stock_logits(gguf, IDS)
    assert ours.shape == theirs.shape == (len(IDS), ours.shape[1])
    assert np.max(np.abs(ours - theirs)) <= 1e-4


@pytest.mark.slow  # the 224 MB model takes ~6 s to write
def test_products_on_amx_tiles_equal_stock_llama_cpp(tmp_path_factory, tiny_model):
    """Q8_0 matrices of 1024 columns: on a CPU with AMX (Sapphire Rapids and later) ggml computes a
    batch's products on its AMX tiles, which GCC left unconfigured, so every run of a prompt crashed,
    ours and stock's (native/toolchain/gcc-tile-config.h); elsewhere its AVX kernels compute them."""
    model = two_layer_olmoe(tmp_path_factory.mktemp("amx"), tiny_model("olmoe")[0], "olmoe-amx", 512, "q8_0")
    with Engine(model, **SAME_SETTINGS) as eng:
        ours = eng.logits(IDS)
    assert np.array_equal(ours, stock_logits(model, IDS))


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tiny_model, arch):
    gguf, hf_dir = tiny_model(arch)
    with Engine(gguf, **SAME_SETTINGS) as eng:
        ours = eng.logits(IDS)
    reference = tiny_moe.transformers_logits(hf_dir, IDS)
    assert ours.shape == reference.shape
    assert np.max(np.abs(ours - reference)) <= tiny_moe.TRANSFORMERS_GAP.get(arch, 1e-3)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_stock_llama_cpp(tiny_model, arch):
    gguf, _ = tiny_model(arch)
    prompt = IDS[:8]
    with Engine(gguf, **SAME_SETTINGS) as eng:
        ours = eng.time_generation(prompt, 32)["tokens"]
    llm = stock_llama(gguf)
    llm.eval(prompt)
    theirs = []
    for _ in range(32):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        theirs.append(token)
        llm.eval([token])
    llm.close()
    assert ours == theirs


def test_logits_are_the_same_in_one_batch_and_token_by_token(mixtral_gguf):
    """The KV cache path (decode one token at a time) agrees with a single prefill."""
    with Engine(mixtral_gguf, **SAME_SETTINGS) as eng:
        whole = eng.logits(IDS)
    with Engine(mixtral_gguf, **SAME_SETTINGS, n_batch=1) as eng:
        stepwise = eng.logits(IDS)
    assert np.max(np.abs(whole - stepwise)) <= 1e-4
