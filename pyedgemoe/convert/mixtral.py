"""Mixtral (MixtralForCausalLM): llama.cpp runs it as "llama" with stacked experts.

Special cases (llama.cpp's LlamaModel): q/k rows (and biases) are permuted from HF's rotate-half
RoPE layout to ggml's; experts are `block_sparse_moe.experts.E.w1|w2|w3` (gate, down, up);
vocab_size and rope.dimension_count are written; the tokenizer is SentencePiece (tokenizer.model)
when there is one.
"""
from __future__ import annotations

import re

import gguf

from pyedgemoe.convert.family import Family, rope_dim_from_head


class Mixtral(Family):
    name = "mixtral"
    hf_architectures = ("MixtralForCausalLM",)
    gguf_arch = gguf.MODEL_ARCH.LLAMA
    tokenizer_style = "llama"
    expert_re = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
    expert_projs = ("w1", "w2", "w3")
    down_proj = "w2"
    n_expert_keys = ("num_local_experts",)
    permute_qk = True
    permute_biases = True
    router_suffix = "block_sparse_moe.gate.weight"
    required_hparams = (*Family.required_hparams, ("intermediate_size",), ("vocab_size",))
    # src/models/llama.cpp with n_expert > 0; output.weight falls back to the embedding matrix
    loader_required = ("token_embd.weight", "output_norm.weight",
                       "blk.{bid}.attn_norm.weight", "blk.{bid}.attn_q.weight", "blk.{bid}.attn_k.weight",
                       "blk.{bid}.attn_v.weight", "blk.{bid}.attn_output.weight", "blk.{bid}.ffn_norm.weight",
                       "blk.{bid}.ffn_gate_inp.weight", "blk.{bid}.ffn_down_exps.weight",
                       "blk.{bid}.ffn_up_exps.weight")
    loader_optional = ("output.weight", "rope_freqs.weight",
                       "blk.{bid}.attn_q.bias", "blk.{bid}.attn_k.bias", "blk.{bid}.attn_v.bias",
                       "blk.{bid}.attn_output.bias", "blk.{bid}.ffn_gate_exps.weight")

    @property
    def expert_ff(self) -> int:
        return int(self.find(["intermediate_size"]))

    def merged_expert_name(self, bid: int, proj: str) -> str:
        return f"layers.{bid}.feed_forward.experts.{proj}.weight"

    def write_hparams(self, w: gguf.GGUFWriter, file_type: int) -> None:
        super().write_hparams(w, file_type)
        w.add_vocab_size(self.hparams["vocab_size"])
        w.add_rope_dimension_count(rope_dim_from_head(self))


FAMILY = Mixtral
