"""OLMoE (OlmoeForCausalLM, e.g. OLMoE-1B-7B): experts of intermediate_size, q/k RMS norms over
the whole projection. Special case (llama.cpp's OlmoeModel): the RMS-norm epsilon is written as
1e-5 whatever config.json says, as llama.cpp does. No q/k permutation (NEOX-style RoPE).
Refused: attention biases (llama.cpp has no attention output bias) and clip_qkv (it does not clamp).
A tied output layer is written as a copy of the embedding matrix (llama.cpp requires output.weight).
"""
from __future__ import annotations

import gguf

from pyedgemoe.convert.family import Family


class Olmoe(Family):
    name = "olmoe"
    hf_architectures = ("OlmoeForCausalLM",)
    gguf_arch = gguf.MODEL_ARCH.OLMOE
    normalizes_top_k = False
    n_expert_keys = ("num_local_experts", "num_experts")
    required_hparams = (*Family.required_hparams, ("intermediate_size",))
    # src/models/olmoe.cpp: no attention output bias, no tied output layer
    loader_required = ("token_embd.weight", "output_norm.weight", "output.weight",
                       "blk.{bid}.attn_norm.weight", "blk.{bid}.attn_q.weight", "blk.{bid}.attn_k.weight",
                       "blk.{bid}.attn_v.weight", "blk.{bid}.attn_output.weight", "blk.{bid}.attn_q_norm.weight",
                       "blk.{bid}.attn_k_norm.weight", "blk.{bid}.ffn_norm.weight", "blk.{bid}.ffn_gate_inp.weight",
                       "blk.{bid}.ffn_gate_exps.weight", "blk.{bid}.ffn_down_exps.weight",
                       "blk.{bid}.ffn_up_exps.weight")
    loader_optional = ("blk.{bid}.attn_q.bias", "blk.{bid}.attn_k.bias", "blk.{bid}.attn_v.bias")

    @property
    def expert_ff(self) -> int:
        return int(self.find(["intermediate_size"]))

    def check_config(self) -> None:
        if self.hparams.get("attention_bias"):
            raise self.refuse("attention_bias=true", f"llama.cpp's {self.llama_arch} model has no attention "
                              f"output bias (self_attn.o_proj.bias)")
        if (clip := self.hparams.get("clip_qkv")) is not None:
            raise self.refuse(f"clip_qkv={clip}", f"llama.cpp's {self.llama_arch} model does not clamp q/k/v "
                              f"as transformers does")

    def attention_shapes(self):
        shapes = super().attention_shapes()
        shapes.update({"self_attn.q_norm.weight": (self.n_head * self.head_dim,),
                       "self_attn.k_norm.weight": (self.n_head_kv * self.head_dim,)})
        return shapes

    def write_hparams(self, w: gguf.GGUFWriter, file_type: int) -> None:
        super().write_hparams(w, file_type)
        w.add_layer_norm_rms_eps(1e-5)


FAMILY = Olmoe
