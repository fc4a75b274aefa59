"""OLMoE (OlmoeForCausalLM, e.g. OLMoE-1B-7B): experts of intermediate_size, q/k RMS norms over
the whole projection. Special case (llama.cpp's OlmoeModel): the RMS-norm epsilon is written as
1e-5 whatever config.json says, as llama.cpp does. No q/k permutation (NEOX-style RoPE).
"""
from __future__ import annotations

import gguf

from pyedgemoe.convert.family import Family


class Olmoe(Family):
    name = "olmoe"
    hf_architectures = ("OlmoeForCausalLM",)
    gguf_arch = gguf.MODEL_ARCH.OLMOE
    n_expert_keys = ("num_local_experts", "num_experts")

    @property
    def expert_ff(self) -> int:
        return int(self.find(["intermediate_size"]))

    def attention_shapes(self):
        shapes = super().attention_shapes()
        shapes.update({"self_attn.q_norm.weight": (self.n_head * self.head_dim,),
                       "self_attn.k_norm.weight": (self.n_head_kv * self.head_dim,)})
        return shapes

    def write_hparams(self, w: gguf.GGUFWriter, file_type: int) -> None:
        super().write_hparams(w, file_type)
        w.add_layer_norm_rms_eps(1e-5)


FAMILY = Olmoe
