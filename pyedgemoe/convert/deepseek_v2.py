"""DeepSeek-V2 and V2-Lite (DeepseekV2ForCausalLM): multi-head latent attention (MLA), shared
experts, and `first_k_dense_replace` leading dense layers.

Special cases (llama.cpp's DeepseekV2Model): MLA is written as MQA (head_count_kv = 1) with
key/value lengths of the compressed cache, and `kv_b_proj` is split into `attn_k_b` (transposed)
and `attn_v_b` for the absorption optimisation; lm_head is dropped when tied; layers past
num_hidden_layers (multi-token prediction) are skipped; leading dense layer count, LoRA ranks,
expert counts/scales and YaRN's log multiplier are written. V2-Lite has no q LoRA (q_proj): its
q_lora_rank is written as 0, as llama.cpp's loader reads the key for every layer count but 26/27.
Refused (llama.cpp's model has no such tensors or layers): attention and MLP biases, no shared
experts, moe_layer_freq > 1, and a q LoRA in a model llama.cpp takes for a "lite" one by its size.
"""
from __future__ import annotations

import re

import gguf
import numpy as np

from pyedgemoe.convert.family import Family, TensorOut


class DeepseekV2(Family):
    name = "deepseek_v2"
    hf_architectures = ("DeepseekV2ForCausalLM",)
    gguf_arch = gguf.MODEL_ARCH.DEEPSEEK2
    n_expert_keys = ("n_routed_experts",)
    required_hparams = (*Family.required_hparams, ("vocab_size",), ("qk_nope_head_dim",), ("qk_rope_head_dim",),
                        ("v_head_dim",))
    # src/models/deepseek2.cpp (loader_tensors adds the per-layer ones, which depend on the layer)
    loader_required = ("token_embd.weight", "output_norm.weight")
    loader_optional = ("output.weight",)
    _attention = ("blk.{bid}.attn_norm.weight", "blk.{bid}.attn_kv_a_norm.weight", "blk.{bid}.attn_kv_a_mqa.weight",
                  "blk.{bid}.attn_k_b.weight", "blk.{bid}.attn_v_b.weight", "blk.{bid}.attn_output.weight",
                  "blk.{bid}.ffn_norm.weight")
    _q_lora = ("blk.{bid}.attn_q_a_norm.weight", "blk.{bid}.attn_q_a.weight", "blk.{bid}.attn_q_b.weight")
    _dense = ("blk.{bid}.ffn_gate.weight", "blk.{bid}.ffn_down.weight", "blk.{bid}.ffn_up.weight")
    _moe = ("blk.{bid}.ffn_gate_inp.weight", "blk.{bid}.ffn_gate_exps.weight", "blk.{bid}.ffn_down_exps.weight",
            "blk.{bid}.ffn_up_exps.weight", "blk.{bid}.ffn_gate_shexp.weight", "blk.{bid}.ffn_down_shexp.weight",
            "blk.{bid}.ffn_up_shexp.weight")

    def __init__(self, config: dict):
        super().__init__(config)
        # read before write_hparams replaces it with 1 (MLA as MQA)
        self.n_kv_heads_hf = int(self.hparams.get("num_key_value_heads") or self.n_head)

    @property
    def first_dense(self) -> int:
        v = self.hparams.get("first_k_dense_replace")
        return int(v) if v is not None else 0

    def is_moe_layer(self, bid: int) -> bool:
        freq = int(self.hparams.get("moe_layer_freq", 1) or 1)
        return bid >= self.first_dense and bid % freq == 0

    def _is_lite(self) -> bool:
        # llama.cpp's llama_model_deepseek2::load_arch_hparams: these sizes never read q_lora_rank
        vocab = self.vocab_size
        return self.n_layers in (26, 27) or (self.n_layers == 48 and vocab == 128256)

    def check_config(self) -> None:
        hp = self.hparams
        if hp.get("attention_bias"):
            raise self.refuse("attention_bias=true", f"llama.cpp's {self.llama_arch} model has no attention biases "
                                                     f"(q_a_proj, kv_a_proj_with_mqa, o_proj)")
        if hp.get("mlp_bias"):
            raise self.refuse("mlp_bias=true", f"llama.cpp's {self.llama_arch} model has no feed-forward biases")
        if not hp.get("n_shared_experts"):
            raise self.refuse(f"n_shared_experts={hp.get('n_shared_experts')}",
                              f"llama.cpp's {self.llama_arch} model requires shared experts in every MoE layer")
        if int(hp.get("moe_layer_freq", 1) or 1) != 1:
            raise self.refuse(f"moe_layer_freq={hp['moe_layer_freq']}",
                              f"llama.cpp's {self.llama_arch} model has a MoE block in every layer after the dense ones")
        if hp.get("q_lora_rank") is not None and self._is_lite():
            raise self.refuse(f"q_lora_rank={hp['q_lora_rank']}", f"llama.cpp takes a {self.n_layers}-layer "
                              f"{self.llama_arch} model for DeepSeek-V2-Lite, which has no q LoRA")

    def loader_tensors(self):
        required, optional = super().loader_tensors()
        moe = [bid for bid in range(self.n_layers) if bid >= self.first_dense]
        required |= self.expand(self._attention)
        has_q_lora = self.hparams.get("q_lora_rank") is not None
        required |= self.expand(self._q_lora if has_q_lora else ("blk.{bid}.attn_q.weight",))
        required |= self.expand(self._dense, range(self.first_dense)) | self.expand(self._moe, moe)
        optional |= self.expand(("blk.{bid}.exp_probs_b.bias",), moe)
        return required, optional

    def rename(self, name: str) -> str | None:
        name = super().rename(name)
        if name is None or "sam_model" in name or "qwen2_model" in name:
            return None
        if self.hparams.get("tie_word_embeddings", False) and name in ("lm_head.weight", "model.lm_head.weight"):
            return None
        m = re.match(r"model\.layers\.(\d+)", name)
        if m and int(m.group(1)) >= self.n_layers:
            return None  # multi-token-prediction layers: llama.cpp does not run them
        return name

    def outputs(self, name, shape):
        if not name.endswith("kv_b_proj.weight"):
            return super().outputs(name, shape)
        h = self.n_kv_heads_hf
        v_dim, nope = int(self.hparams["v_head_dim"]), int(self.hparams["qk_nope_head_dim"])
        kv_lora = shape[-1]

        def k_b(w: np.ndarray) -> np.ndarray:
            kv = w.reshape(h, v_dim + nope, kv_lora)
            return np.ascontiguousarray(kv[:, :nope, :].transpose(0, 2, 1))

        def v_b(w: np.ndarray) -> np.ndarray:
            kv = w.reshape(h, v_dim + nope, kv_lora)
            return np.ascontiguousarray(kv[:, nope:, :])

        return [TensorOut(name.replace("kv_b_proj", "k_b_proj"), (h, kv_lora, nope), k_b),
                TensorOut(name.replace("kv_b_proj", "v_b_proj"), (h, v_dim, kv_lora), v_b)]

    def attention_shapes(self):
        hp, h, n = self.hparams, self.hidden_size, self.n_head
        nope, rope, v_dim = int(hp["qk_nope_head_dim"]), int(hp["qk_rope_head_dim"]), int(hp["v_head_dim"])
        kv_lora = int(hp.get("kv_lora_rank", 512))
        shapes = {"self_attn.kv_a_proj_with_mqa.weight": (kv_lora + rope, h),
                  "self_attn.kv_a_layernorm.weight": (kv_lora,),
                  "self_attn.kv_b_proj.weight": (self.n_kv_heads_hf * (nope + v_dim), kv_lora),
                  "self_attn.o_proj.weight": (h, n * v_dim)}
        if (q_lora := hp.get("q_lora_rank")) is not None:
            shapes.update({"self_attn.q_a_proj.weight": (q_lora, h), "self_attn.q_a_layernorm.weight": (q_lora,),
                           "self_attn.q_b_proj.weight": (n * (nope + rope), q_lora)})
        else:
            shapes["self_attn.q_proj.weight"] = (n * (nope + rope), h)
        return shapes

    def expected_shape(self, name: str):
        shape = super().expected_shape(name)
        if shape is not None:
            return shape
        h = self.hidden_size
        # the shared experts, and the MLP of a leading dense layer (first_k_dense_replace)
        for part, ff in (("mlp.shared_experts.", self.expert_ff * int(self.hparams.get("n_shared_experts") or 0)),
                         ("mlp.", self.hparams.get("intermediate_size"))):
            for suffix, s in (("gate_proj.weight", (ff, h)), ("up_proj.weight", (ff, h)),
                              ("down_proj.weight", (h, ff))):
                if ff and name.endswith(part + suffix):
                    return s
        return None

    def write_hparams(self, w: gguf.GGUFWriter, file_type: int) -> None:
        hp = self.hparams
        hp["num_key_value_heads"] = 1  # MLA converts into MQA (GQA with 1 group)
        hp["rms_norm_eps"] = hp.get("rms_norm_eps", 1e-6)
        super().write_hparams(w, file_type)

        has_moe = hp.get("n_routed_experts") is not None
        first_dense = hp.get("first_k_dense_replace")
        if first_dense is None:
            first_dense = hp["num_hidden_layers"] if not has_moe else 0
        w.add_leading_dense_block_count(first_dense)
        kv_lora = hp.get("kv_lora_rank", 512)
        w.add_vocab_size(hp["vocab_size"])
        # 0 for none (V2-Lite): llama.cpp reads the key unless the layer count is a known lite one,
        # and 0 makes both its loader and its graph use q_proj (llama.cpp's converter omits the key)
        w.add_q_lora_rank(hp.get("q_lora_rank") or 0)
        w.add_kv_lora_rank(kv_lora)
        w.add_key_length(kv_lora + hp["qk_rope_head_dim"])
        w.add_value_length(kv_lora)
        w.add_key_length_mla(hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"])
        w.add_value_length_mla(hp["v_head_dim"])
        w.add_expert_feed_forward_length(self.find(["moe_intermediate_size", "intermediate_size"]))
        if (n := hp.get("n_routed_experts")) is not None:
            w.add_expert_count(n)
        w.add_expert_shared_count(hp.get("n_shared_experts", 0))
        if (scale := hp.get("routed_scaling_factor")) is not None:
            w.add_expert_weights_scale(scale)
        if hp.get("norm_topk_prob"):
            w.add_expert_weights_norm(hp["norm_topk_prob"])
        w.add_rope_dimension_count(hp["qk_rope_head_dim"])
        if (mscale_all := self.rope_parameters.get("mscale_all_dim")) is not None:
            # llama.cpp's [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]: 0.1 * mscale_all_dim, for legacy reasons
            w.add_rope_scaling_yarn_log_mul(0.1 * mscale_all)


FAMILY = DeepseekV2
