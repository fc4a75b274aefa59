"""Qwen3-MoE (Qwen3MoeForCausalLM, e.g. Qwen3-30B-A3B): Qwen2-MoE without the shared expert,
with per-head q/k RMS norms (`self_attn.q_norm`/`k_norm` -> `attn_q_norm`/`attn_k_norm`) and an
explicit head_dim (written as attention.key_length/value_length). llama.cpp converts it with its
Qwen2-MoE code, so does this module.
"""
from __future__ import annotations

import gguf

from pyedgemoe.convert.qwen2_moe import Qwen2Moe


class Qwen3Moe(Qwen2Moe):
    name = "qwen3_moe"
    hf_architectures = ("Qwen3MoeForCausalLM",)
    gguf_arch = gguf.MODEL_ARCH.QWEN3MOE

    def attention_shapes(self):
        shapes = super().attention_shapes()
        shapes.update({"self_attn.q_norm.weight": (self.head_dim,), "self_attn.k_norm.weight": (self.head_dim,)})
        return shapes


FAMILY = Qwen3Moe
