"""Tiny random models (scripts/tiny_moe.py) are faithful references.

For every family: llama.cpp's converter turns the transformers checkpoint into a standard GGUF
that stock llama.cpp (llama-cpp-python) runs with transformers' logits and the model's tokenization. The
models are built once into tests/.models and reused.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest

from conftest import MODELS_DIR, REPO, tiny_moe

# 16 fixed ids across the vocabulary (0 is <|endoftext|>, 1 <|im_start|>, 3.. bytes, 259.. merges).
TOKEN_IDS = [1, 57, 300, 12, 259, 383, 100, 7, 7, 201, 150, 42, 2, 330, 64, 99]
# Both sides compute in float32; what is left is summation order (observed: ~1e-5).
LOGITS_ATOL = 1e-3

SENTENCES = [
    "Hello world!",
    "The expert router picks 2 of 8 experts, doesn't it?",
    "  Leading and trailing spaces  ",
    "Numbers: 12345 and 3.14159; code(x) = y['key'] + 1",
    "Line one.\nLine two\n\n\tTabbed -- dashes ... done",
    "I'll say it's THEIR model's cache; we've read 100%.",
]


@dataclass(frozen=True)
class TinyModel:
    arch: str
    gguf_path: Path

    @property
    def hf_dir(self) -> Path:
        return self.gguf_path.parent / "hf"


def load_llama(path: Path, **kwargs):
    # The KV cache must be F32: llama.cpp's default F16 cache alone moves these logits by ~5e-3.
    return llama_cpp.Llama(
        model_path=str(path), logits_all=True, n_ctx=256, verbose=False, n_threads=2,
        type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, **kwargs,
    )


def gguf_fields(path: Path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith(("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"))}


def gguf_tensors(path: Path) -> dict[str, str]:
    """tensor name -> ggml type name"""
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


@pytest.fixture(scope="session", params=tiny_moe.ARCHITECTURES + tiny_moe.LLAMA_CPP_ONLY)
def tiny(request, tiny_model) -> TinyModel:
    return TinyModel(request.param, tiny_model(request.param)[0])


@pytest.fixture(scope="session", params=tiny_moe.MOE_ARCHITECTURES + tiny_moe.LLAMA_CPP_ONLY)
def tiny_moe_model(request, tiny_model) -> TinyModel:
    return TinyModel(request.param, tiny_model(request.param)[0])


def test_llama_cpp_logits_match_transformers(tiny):
    expected = tiny_moe.transformers_logits(tiny.hf_dir, TOKEN_IDS)
    llm = load_llama(tiny.gguf_path)
    llm.eval(TOKEN_IDS)
    got = np.asarray(llm.scores[: len(TOKEN_IDS)], dtype=np.float32)

    n_vocab = tiny_moe.VOCAB_SIZE + len(tiny_moe.EXTRA_SPECIAL_TOKENS.get(tiny.arch, ()))
    assert got.shape == expected.shape == (len(TOKEN_IDS), n_vocab)
    assert np.abs(got - expected).max() < tiny_moe.TRANSFORMERS_GAP.get(tiny.arch, LOGITS_ATOL)
    # The models are random but not degenerate: logits vary across the vocabulary.
    assert expected.std(axis=1).min() > 0.3


def test_llama_cpp_tokenizes_as_the_model_s_tokenizer(tiny):
    tokenize = tiny_moe.reference_tokenize(tiny.hf_dir)
    llm = load_llama(tiny.gguf_path, vocab_only=True)
    for text in SENTENCES:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tokenize(text), text


def test_gguf_carries_special_tokens_and_chat_template(tiny):
    fields = gguf_fields(tiny.gguf_path)
    if tiny.arch in tiny_moe.SENTENCEPIECE:  # llama.cpp's SentencePiece vocabularies (Gemma 4's its own)
        assert fields["tokenizer.ggml.model"] == ("gemma4" if tiny.arch == "gemma4" else "llama")
    else:
        assert fields["tokenizer.ggml.model"] == "gpt2"
        model_type = json.loads((tiny.hf_dir / "config.json").read_text())["model_type"]
        assert fields["tokenizer.ggml.pre"] == tiny_moe.tokenizer_pre(model_type)
    assert fields["tokenizer.ggml.bos_token_id"] == tiny_moe.SPECIAL_TOKENS.index(tiny_moe.BOS_TOKEN)
    assert fields["tokenizer.ggml.eos_token_id"] == tiny_moe.SPECIAL_TOKENS.index(tiny_moe.EOS_TOKEN)
    assert fields["tokenizer.chat_template"] == tiny_moe.CHAT_TEMPLATE


def test_moe_gguf_has_llama_cpp_arch_and_stacked_expert_tensors(tiny_moe_model):
    fields = gguf_fields(tiny_moe_model.gguf_path)
    arch = tiny_moe.GGUF_ARCH[tiny_moe_model.arch]
    assert fields["general.architecture"] == arch
    assert fields[f"{arch}.expert_used_count"] == 2
    names = gguf_tensors(tiny_moe_model.gguf_path)
    last = fields[f"{arch}.block_count"] - 1
    # Nemotron-H's experts: squared ReLU, no gate; Gemma 4's gate and up in one tensor
    gate_up = {"nemotron_h": ("ffn_up_exps",), "gemma4": ("ffn_gate_up_exps",)}
    for kind in (*gate_up.get(tiny_moe_model.arch, ("ffn_gate_exps", "ffn_up_exps")), "ffn_down_exps", "ffn_gate_inp"):
        assert f"blk.{last}.{kind}.weight" in names


def test_dense_llama_gguf_has_no_experts(tiny_model):
    path, _ = tiny_model("llama")
    names = gguf_tensors(path)
    assert gguf_fields(path)["general.architecture"] == "llama"
    assert not any("exps" in n for n in names)
    assert "blk.0.ffn_gate.weight" in names


def test_routers_spread_tokens_over_experts(tiny_moe_model):
    """Random routers must really route: across 16 tokens every MoE layer uses most experts."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_moe_model.hf_dir), dtype=torch.float32)
    chosen: dict[str, set[int]] = {}

    def record(name):
        def hook(_module, _inputs, output):
            # a router that returns its choices (logits, weights, expert ids) is taken at its word:
            # sigmoid routers with a correction bias do not choose by the logits alone
            ids = [t for t in output if not t.is_floating_point()] if isinstance(output, tuple) else []
            logits = output[0] if isinstance(output, tuple) else output
            picked = ids[0] if ids else logits.reshape(-1, logits.shape[-1]).topk(2, dim=-1).indices
            chosen[name] = set(picked.flatten().tolist())
        return hook

    for name, module in model.named_modules():
        # and gpt-oss's, AFMoE's, granite's, Jamba's and Gemma 4's (".router"), lfm2's, Nemotron-H's
        if name.endswith((".mlp.gate", ".router", ".feed_forward.gate", ".mixer.gate")):
            module.register_forward_hook(record(name))
    with torch.no_grad():
        model(torch.tensor([TOKEN_IDS]))

    n_experts = gguf_fields(tiny_moe_model.gguf_path)[f"{tiny_moe.GGUF_ARCH[tiny_moe_model.arch]}.expert_count"]
    assert chosen, "no router found"
    for name, experts in chosen.items():
        assert len(experts) >= n_experts // 2 + 1, (name, experts)


def test_qwen2_moe_keeps_shared_expert_and_its_gate(tiny_model):
    names = gguf_tensors(tiny_model("qwen2_moe")[0])
    for kind in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp"):
        assert f"blk.0.{kind}.weight" in names


def test_deepseek_v2_has_mla_shared_experts_and_one_leading_dense_layer(tiny_model):
    path, _ = tiny_model("deepseek_v2")
    fields = gguf_fields(path)
    names = gguf_tensors(path)
    assert fields["deepseek2.leading_dense_block_count"] == 1
    assert fields["deepseek2.attention.kv_lora_rank"] == 32
    assert fields["deepseek2.expert_shared_count"] == 1
    assert "blk.0.ffn_gate.weight" in names and "blk.0.ffn_gate_exps.weight" not in names
    for kind in ("attn_q_a", "attn_q_b", "attn_kv_a_mqa", "attn_k_b", "attn_v_b", "ffn_gate_exps", "ffn_up_shexp"):
        assert f"blk.1.{kind}.weight" in names


def test_cli_writes_a_q8_0_gguf_and_prints_its_path():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "tiny_moe.py"), "qwen3_moe", "--out", str(MODELS_DIR), "--outtype", "q8_0"],
        capture_output=True, text=True, check=True,
    )
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert path == MODELS_DIR / "qwen3_moe" / "qwen3_moe-q8_0.gguf" and path.is_file()
    assert gguf_tensors(path)["blk.0.ffn_down_exps.weight"] == "Q8_0"
