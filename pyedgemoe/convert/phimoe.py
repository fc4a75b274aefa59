"""Phi-3.5-MoE (PhimoeForCausalLM; PhiMoEForCausalLM in its remote-code config).

Special cases (llama.cpp's Phi3MiniModel/PhiMoeModel): its own hparams (no generic ones; the
original context length and a sliding window of 0 for "none"); LayerNorm weights *and biases*,
attention and lm_head biases; long-context RoPE factors written as two tensors first; experts are
`block_sparse_moe.experts.E.w1|w2|w3`; a SentencePiece tokenizer with added tokens taken from
tokenizer_config.json and tokenizer.json. No q/k permutation (Phi-3 uses NEOX-style RoPE).
llama.cpp requires the attention output and lm_head biases and an untied output layer: a checkpoint
without them (attention_bias / lm_head_bias false, tie_word_embeddings true) gets zero biases and a
copy of the embedding matrix, which compute exactly what transformers computes.
"""
from __future__ import annotations

import re

import gguf
import numpy as np

from pyedgemoe.convert.family import Family, StandIn, longrope_attn_factor, phi3_rope_dims
from pyedgemoe.errors import ConversionError


class PhiMoE(Family):
    name = "phimoe"
    hf_architectures = ("PhimoeForCausalLM", "PhiMoEForCausalLM")
    gguf_arch = gguf.MODEL_ARCH.PHIMOE
    tokenizer_style = "phi3"
    expert_re = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
    expert_projs = ("w1", "w2", "w3")
    down_proj = "w2"
    n_expert_keys = ("num_local_experts", "num_experts")
    router_suffix = "block_sparse_moe.gate.weight"
    required_hparams = (*Family.required_hparams, ("intermediate_size",), ("num_key_value_heads", "n_head_kv"),
                        ("rms_norm_eps",), ("n_positions", "max_position_embeddings"),
                        ("num_experts_per_tok", "num_experts_per_token"))
    # src/models/phimoe.cpp: LayerNorm, attention-output and lm_head biases all required
    loader_required = ("token_embd.weight", "output_norm.weight", "output_norm.bias", "output.weight", "output.bias",
                       "blk.{bid}.attn_norm.weight", "blk.{bid}.attn_norm.bias", "blk.{bid}.attn_q.weight",
                       "blk.{bid}.attn_k.weight", "blk.{bid}.attn_v.weight", "blk.{bid}.attn_output.weight",
                       "blk.{bid}.attn_output.bias", "blk.{bid}.ffn_norm.weight", "blk.{bid}.ffn_norm.bias",
                       "blk.{bid}.ffn_gate_inp.weight", "blk.{bid}.ffn_gate_exps.weight",
                       "blk.{bid}.ffn_down_exps.weight", "blk.{bid}.ffn_up_exps.weight")
    loader_optional = ("rope_factors_long.weight", "rope_factors_short.weight",
                       "blk.{bid}.attn_q.bias", "blk.{bid}.attn_k.bias", "blk.{bid}.attn_v.bias")

    @property
    def expert_ff(self) -> int:
        return int(self.find(["intermediate_size"]))

    def merged_expert_name(self, bid: int, proj: str) -> str:
        return f"model.layers.{bid}.block_sparse_moe.experts.{proj}.weight"

    def stand_in(self, gguf_name: str) -> StandIn | None:
        # zeros only where config.json says the model has no such bias (nn.Linear(bias=False)),
        # never for a bias the checkpoint should have but lacks
        if gguf_name.endswith(".attn_output.bias") and not self.hparams.get("attention_bias", False):
            return StandIn("zeros (attention_bias is false)", shape=(self.hidden_size,))
        if gguf_name == "output.bias" and not self.hparams.get("lm_head_bias", False) and self.vocab_size:
            return StandIn("zeros (lm_head_bias is false)", shape=(self.vocab_size,))
        return super().stand_in(gguf_name)

    def check_hparams(self) -> None:
        super().check_hparams()
        if self.rope_parameters.get("full_attention", self.rope_parameters).get("rope_theta") is None:
            raise ConversionError("config.json has no rope_theta (nor rope_parameters.rope_theta), which "
                                  f"llama.cpp's {self.llama_arch} model needs")

    def _orig_ctx(self) -> int:
        # llama.cpp requires it (KeyError otherwise); without long-context RoPE it is the context.
        return int(self.rope_parameters.get("original_max_position_embeddings")
                   or self.find(["n_positions", "max_position_embeddings"]))

    def write_hparams(self, w: gguf.GGUFWriter, file_type: int) -> None:
        n_embd = self.find(["hidden_size", "n_embd"])
        w.add_context_length(self.find(["n_positions", "max_position_embeddings"]))
        w.add_rope_scaling_orig_ctx_len(self._orig_ctx())
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(self.find(["intermediate_size"]))
        w.add_block_count(self.n_layers)
        w.add_head_count(self.find(["num_attention_heads", "n_head"]))
        w.add_head_count_kv(self.find(["num_key_value_heads", "n_head_kv"]))
        w.add_layer_norm_rms_eps(self.find(["rms_norm_eps"]))
        w.add_rope_dimension_count(phi3_rope_dims(self))
        w.add_rope_freq_base(self.rope_parameters.get("full_attention", self.rope_parameters)["rope_theta"])
        w.add_file_type(file_type)
        w.add_sliding_window(self.hparams.get("sliding_window") or 0)
        w.add_expert_used_count(self.find(["num_experts_per_tok", "num_experts_per_token"]))
        w.add_expert_count(self.find(["num_local_experts", "num_experts"]))
        if self._long_factors() is not None:
            w.add_rope_scaling_attn_factors(self._attn_factor())

    def _long_factors(self):
        long_f = self.rope_parameters.get("long_factor")
        if not long_f:
            return None
        short_f = self.rope_parameters.get("short_factor")
        n = phi3_rope_dims(self) / 2
        if short_f is None or len(long_f) != len(short_f) or len(long_f) != n:
            raise ConversionError(f"rope long_factor/short_factor must both have {n} entries")
        return long_f, short_f

    def _attn_factor(self) -> float:
        scale = self.find(["n_positions", "max_position_embeddings"]) / self._orig_ctx()
        rope_type = str(self.rope_parameters.get("rope_type", "")).lower()
        if not rope_type:
            raise ConversionError("config.json rope scaling has long_factor but no type")
        return longrope_attn_factor(scale, self._orig_ctx(), rope_type)

    def extra_tensors(self):
        factors = self._long_factors()
        if factors is None:
            return []
        long_f, short_f = factors
        return [(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight", np.asarray(long_f, np.float32)),
                (gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight", np.asarray(short_f, np.float32))]


FAMILY = PhiMoE
