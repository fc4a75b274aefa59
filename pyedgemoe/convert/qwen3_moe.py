"""Qwen3-MoE (Qwen3MoeForCausalLM, e.g. Qwen3-30B-A3B): Qwen2-MoE without the shared expert,
with per-head q/k RMS norms (`self_attn.q_norm`/`k_norm` -> `attn_q_norm`/`attn_k_norm`) and an
explicit head_dim (written as attention.key_length/value_length). llama.cpp converts it with its
Qwen2-MoE code, so does this module. llama.cpp's loader ties a missing output.weight to the
embedding matrix (tie_word_embeddings) but has no attention output bias: attention_bias is refused.
"""
from __future__ import annotations

import gguf

from pyedgemoe.convert.family import Family
from pyedgemoe.convert.qwen2_moe import Qwen2Moe


class Qwen3Moe(Qwen2Moe):
    name = "qwen3_moe"
    hf_architectures = ("Qwen3MoeForCausalLM",)
    gguf_arch = gguf.MODEL_ARCH.QWEN3MOE
    # src/models/qwen3moe.cpp: q/k norms required, no shared expert, output.weight optional (tied)
    loader_required = ("token_embd.weight", "output_norm.weight",
                       "blk.{bid}.attn_norm.weight", "blk.{bid}.attn_q.weight", "blk.{bid}.attn_k.weight",
                       "blk.{bid}.attn_v.weight", "blk.{bid}.attn_output.weight", "blk.{bid}.attn_q_norm.weight",
                       "blk.{bid}.attn_k_norm.weight", "blk.{bid}.ffn_norm.weight", "blk.{bid}.ffn_gate_inp.weight",
                       "blk.{bid}.ffn_gate_exps.weight", "blk.{bid}.ffn_down_exps.weight",
                       "blk.{bid}.ffn_up_exps.weight")
    loader_optional = ("output.weight", "blk.{bid}.attn_q.bias", "blk.{bid}.attn_k.bias", "blk.{bid}.attn_v.bias")
    required_hparams = Family.required_hparams  # no shared expert
    normalizes_top_k = True

    def check_config(self) -> None:
        super().check_config()
        if self.hparams.get("attention_bias"):
            raise self.refuse("attention_bias=true", f"llama.cpp's {self.llama_arch} model has no attention "
                              f"output bias (self_attn.o_proj.bias)")

    def attention_shapes(self):
        shapes = super().attention_shapes()
        shapes.update({"self_attn.q_norm.weight": (self.head_dim,), "self_attn.k_norm.weight": (self.head_dim,)})
        return shapes


FAMILY = Qwen3Moe
