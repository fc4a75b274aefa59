"""Qwen1.5-MoE / Qwen2-MoE (Qwen2MoeForCausalLM): routed experts plus one shared expert behind a
sigmoid gate (`mlp.shared_expert.*`, `mlp.shared_expert_gate` -> `*_shexp`, `ffn_gate_inp_shexp`).

Special cases (llama.cpp's Qwen2MoeModel): expert and shared-expert feed-forward lengths;
checkpoints that store experts fused (`mlp.experts.gate_up_proj` [E, 2*ff, n_embd],
`mlp.experts.down_proj` [E, n_embd, ff]) are split/stacked like per-expert ones. llama.cpp's
model has a MoE block with a shared expert in every layer and requires output.weight: dense layers
(mlp_only_layers, decoder_sparse_step) and a zero-size shared expert are refused; a tied output
layer is written as a copy of the embedding matrix.
"""
from __future__ import annotations

import re

import gguf

from pyedgemoe.convert.family import ExpertSource, ExpertStack, Family

_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(\.weight)?$")


class Qwen2Moe(Family):
    name = "qwen2_moe"
    hf_architectures = ("Qwen2MoeForCausalLM",)
    gguf_arch = gguf.MODEL_ARCH.QWEN2MOE
    # src/models/qwen2moe.cpp: q/k/v biases optional (qkv_bias), shared expert and its gate required
    loader_required = ("token_embd.weight", "output_norm.weight", "output.weight",
                       "blk.{bid}.attn_norm.weight", "blk.{bid}.attn_q.weight", "blk.{bid}.attn_k.weight",
                       "blk.{bid}.attn_v.weight", "blk.{bid}.attn_output.weight", "blk.{bid}.ffn_norm.weight",
                       "blk.{bid}.ffn_gate_inp.weight", "blk.{bid}.ffn_gate_exps.weight",
                       "blk.{bid}.ffn_down_exps.weight", "blk.{bid}.ffn_up_exps.weight",
                       "blk.{bid}.ffn_gate_inp_shexp.weight", "blk.{bid}.ffn_gate_shexp.weight",
                       "blk.{bid}.ffn_down_shexp.weight", "blk.{bid}.ffn_up_shexp.weight")
    loader_optional = ("blk.{bid}.attn_q.bias", "blk.{bid}.attn_k.bias", "blk.{bid}.attn_v.bias")
    required_hparams = (*Family.required_hparams, ("shared_expert_intermediate_size",))  # the shared expert's shape
    normalizes_top_k = False

    def is_moe_layer(self, bid: int) -> bool:
        step = int(self.hparams.get("decoder_sparse_step", 1) or 1)
        return (bid not in (self.hparams.get("mlp_only_layers") or [])
                and self.n_experts > 0 and (bid + 1) % step == 0)

    def check_config(self) -> None:
        dense = [bid for bid in range(self.n_layers) if not self.is_moe_layer(bid)]
        if dense:
            setting = " ".join(f"{k}={self.hparams[k]}" for k in ("mlp_only_layers", "decoder_sparse_step")
                               if self.hparams.get(k) not in (None, [], 1))
            raise self.refuse(setting, f"it makes layer(s) {dense[:5]} dense, and llama.cpp's {self.llama_arch} "
                                       f"model has a MoE block in every layer")
        if "shared_expert_intermediate_size" in self.hparams and not self.hparams["shared_expert_intermediate_size"]:
            raise self.refuse("shared_expert_intermediate_size=0", f"llama.cpp's {self.llama_arch} model requires "
                                                                   f"a shared expert in every layer")

    def expected_shape(self, name: str):
        shape = super().expected_shape(name)
        if shape is None and (shared := self.hparams.get("shared_expert_intermediate_size")):
            h = self.hidden_size
            for suffix, s in (("mlp.shared_expert.gate_proj.weight", (shared, h)),
                              ("mlp.shared_expert.up_proj.weight", (shared, h)),
                              ("mlp.shared_expert.down_proj.weight", (h, shared)),
                              ("mlp.shared_expert_gate.weight", (1, h))):
                if name.endswith(suffix):
                    return s
        return shape

    def fused_experts(self, name, shape):
        m = _FUSED.match(name)
        if not m:
            return None
        bid, which = int(m.group(1)), m.group(2)
        if len(shape) != 3:
            return []  # caught by the shape check of the caller
        n, rows, cols = shape
        if which == "down_proj":
            return [ExpertStack(bid, "down_proj", self.merged_expert_name(bid, "down_proj"), (rows, cols),
                                [ExpertSource(name, e) for e in range(n)])]
        ff = rows // 2
        return [ExpertStack(bid, proj, self.merged_expert_name(bid, proj), (ff, cols),
                            [ExpertSource(name, e, r0, r0 + ff) for e in range(n)])
                for proj, r0 in (("gate_proj", 0), ("up_proj", ff))]

    def write_hparams(self, w: gguf.GGUFWriter, file_type: int) -> None:
        super().write_hparams(w, file_type)
        if (moe_ff := self.hparams.get("moe_intermediate_size")) is not None:
            w.add_expert_feed_forward_length(moe_ff)
        if (shared_ff := self.hparams.get("shared_expert_intermediate_size")) is not None:
            w.add_expert_shared_feed_forward_length(shared_ff)


FAMILY = Qwen2Moe
