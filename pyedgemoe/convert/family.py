"""What every model family shares: hparams, tensor-name mapping, expert stacking, shape checks.

A family module (mixtral.py, qwen2_moe.py, ...) is a subclass of `Family` holding a table of
names plus its few special cases. The behaviour copied is llama.cpp's converter's
(convert_hf_to_gguf.py + conversion/*.py of the vendored llama.cpp): same tensor names, shapes,
order, types and metadata, so a file we write is the file llama.cpp would write, plus the
`.lowbit` expert copies of docs/format.md.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import gguf
import numpy as np

from pyedgemoe.errors import ConversionError

Transform = Callable[[np.ndarray], np.ndarray]


@dataclass
class TensorOut:
    """One output tensor made from one HF tensor: the name TensorNameMap maps (llama.cpp's
    renamed HF name), its numpy shape after `transform`, and the transform (None: as stored)."""
    hf_name: str
    shape: tuple[int, ...]
    transform: Transform | None = None


@dataclass
class StandIn:
    """An exact equivalent of a tensor llama.cpp's loader requires but the checkpoint does not
    have: a copy of HF tensor `copy_of` (a tied output layer is the embedding matrix), or zeros of
    numpy `shape` (a bias the model does not have adds nothing). `why` says which, for the plan."""
    why: str
    copy_of: str | None = None
    shape: tuple[int, ...] | None = None


@dataclass
class ExpertSource:
    """Expert e of a stack: HF tensor `name`; with `index` set, expert `index` of a fused
    [n_expert, rows, cols] tensor, rows `row_start:row_stop` of it."""
    name: str
    index: int | None = None
    row_start: int = 0
    row_stop: int | None = None


@dataclass
class ExpertStack:
    """One stacked routed-expert tensor: n_expert matrices of `shape` (numpy order, rows x cols)."""
    bid: int
    proj: str
    merged_name: str               # the HF-style name llama.cpp maps to blk.N.ffn_*_exps.weight
    shape: tuple[int, int]
    sources: list[ExpertSource]


def permute_rope(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF's rotate-half q/k rows -> ggml's interleaved RoPE order."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


# config.json's names of the number of experts each token uses (llama.cpp's find_hparam order)
EXPERTS_USED_KEYS = ("num_experts_per_tok", "num_experts_per_token", "top_k_experts")
LAYER_KEYS = ("n_layers", "num_hidden_layers", "n_layer", "num_layers")
# the context the model was trained for (llama.cpp's loader requires it)
CONTEXT_KEYS = ("max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length",
                "model_max_length")

_MULTIMODAL_PREFIXES = ("mlp", "vit.", "vpm.", "siglip2.", "conformer.", "merger.", "resampler.",
                        "sound_encoder.", "sound_projection.", "speech_embeddings.")
_MULTIMODAL_PARTS = ("visual.", "vision.", "audio.", "talker.", "vision_", "audio_", "token2wav.",
                     "code2wav.", "projector.", "pre_mm_projector_norm", "image_newline",
                     "view_seperator", "patch_embed", "patch_embedding", "patch_merger.",
                     "patch_merge_mlp.", "model.connector.")


class Family:
    """Base class; subclasses set the class attributes and override the hooks they need."""

    name: str = ""                              # our name, e.g. "mixtral"
    hf_architectures: tuple[str, ...] = ()      # config.json "architectures" values
    gguf_arch: gguf.MODEL_ARCH
    tokenizer_style: str = "bpe"                # see tokenizer.write_vocab
    # per-expert HF tensors: groups (bid, expert index, projection)
    expert_re = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    expert_projs: tuple[str, ...] = ("down_proj", "gate_proj", "up_proj")  # the order llama.cpp writes them
    down_proj: str = "down_proj"                # the projection whose rows are n_embd
    n_expert_keys: tuple[str, ...] = ("num_local_experts", "num_experts", "n_routed_experts")
    # config.json keys the family cannot do without, each a group of alternative names (llama.cpp's
    # find_hparam): checked once, when the family is made (`check_hparams`), so that a config without
    # one is an error naming it, not a KeyError where a family first reads it. Families add theirs.
    required_hparams: tuple[tuple[str, ...], ...] = (
        LAYER_KEYS, ("hidden_size", "n_embd", "dim"), ("num_attention_heads", "n_head", "n_heads"),
        ("moe_intermediate_size", "intermediate_size"), CONTEXT_KEYS, EXPERTS_USED_KEYS)
    permute_qk: bool = False                    # undo HF's RoPE permutation of q/k (llama-style)
    permute_biases: bool = False
    router_suffix: str = "mlp.gate.weight"
    # whether llama.cpp's model renormalizes a token's top-k routing weights (build_moe_ffn's norm_w),
    # where config.json's norm_topk_prob may say otherwise (None: the family has no such switch)
    normalizes_top_k: bool | None = None
    # llama.cpp's llama_model_<arch>::load_arch_tensors (src/models/<arch>.cpp) as GGUF names,
    # "{bid}" standing for every layer: the tensors it requires (flags 0) and those it takes when
    # present (TENSOR_NOT_REQUIRED). It refuses a file that lacks a required tensor ("tensor ...
    # not found") or holds one it does not create ("wrong number of tensors"), so every file we
    # write has exactly such a tensor set (from_hf.check_loadable).
    loader_required: tuple[str, ...] = ()
    loader_optional: tuple[str, ...] = ()

    def __init__(self, config: dict):
        self.config = dict(config)
        self.hparams = self.config  # llama.cpp's name; set_gguf_parameters may edit it
        self.n_layers = int(self.find(LAYER_KEYS))
        self.n_experts = int(self.find(self.n_expert_keys))
        self.tensor_map = gguf.get_tensor_name_map(self.gguf_arch, self.n_layers)
        self.rope_parameters = self._rope_parameters()
        self.check_hparams()

    # -- config ----------------------------------------------------------------------------------

    def find(self, keys: Iterable[str], optional: bool = False) -> Any:
        """llama.cpp's find_hparam: the first of `keys` in config.json."""
        keys = list(keys)
        for k in keys:
            if k in self.hparams:
                return self.hparams[k]
        if optional:
            return None
        raise ConversionError(f"config.json has none of {', '.join(keys)}")

    def check_hparams(self) -> None:
        """ConversionError naming the first hyperparameter the family needs that config.json lacks
        (null counts as absent). The types and ranges of those present were checked when config.json
        was read (hf_checkpoint)."""
        for keys in self.required_hparams:
            if all(self.hparams.get(k) is None for k in keys):
                raise ConversionError(f"config.json has no {' / '.join(keys)}, which llama.cpp's "
                                      f"{self.llama_arch} model needs")
        n_used = self.find(EXPERTS_USED_KEYS, optional=True)
        if n_used is not None and n_used > self.n_experts:
            # llama.cpp's loader asserts n_expert_used <= n_expert; transformers' topk fails too
            raise ConversionError(f"config.json says {n_used} experts per token, but the model has "
                                  f"{self.n_experts} experts")
        act, norm = self.hparams.get("hidden_act"), self.hparams.get("norm_topk_prob")
        if act not in (None, "silu", "swish"):
            raise self.refuse(f"hidden_act={act}", f"llama.cpp's {self.llama_arch} model computes its FFNs with SiLU")
        if None not in (norm, self.normalizes_top_k) and norm != self.normalizes_top_k:
            raise self.refuse(f"norm_topk_prob={str(norm).lower()}", f"llama.cpp's {self.llama_arch} model "
                              f"{'always' if self.normalizes_top_k else 'never'} renormalizes a token's top-k weights")
        rope = self.rope_parameters.get("full_attention", self.rope_parameters)
        if rope.get("rope_type") == "llama3":  # transformers scales every frequency; llama.cpp's converter drops it
            raise self.refuse("rope_type=llama3",
                              f"llama.cpp's {self.llama_arch} model has no llama3 frequency scaling")
        if rope.get("rope_type") == "yarn" and rope.get("factor") is not None \
                and rope.get("original_max_position_embeddings") is None:
            raise ConversionError("config.json has YaRN rope scaling without original_max_position_embeddings")

    def _rope_parameters(self) -> dict:
        # llama.cpp's TextModel.__init__: top-level rope keys mirrored into rope_parameters
        params, scaling = self.hparams.get("rope_parameters") or {}, self.hparams.get("rope_scaling") or {}
        if params and any(params.get("rope_type" if k == "type" else k) != v for k, v in scaling.items()):
            # transformers (whose AutoConfig llama.cpp's converter reads) takes rope_scaling alone and
            # the model class's default rope_theta in place of rope_parameters': not the file's numbers
            raise ConversionError(
                f"config.json has rope_scaling {scaling} beside rope_parameters {params}, and they disagree; "
                f"transformers would take rope_scaling alone, with its class's default rope_theta: move "
                f"the scaling into rope_parameters and remove rope_scaling")
        rp = dict(params or scaling)
        rope_theta = self.find(["global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta",
                                "rotary_emb_base"], optional=True)
        local_theta = self.find(["local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta",
                                 "rope_local_base_freq"], optional=True)
        partial = self.find(["partial_rotary_factor", "rope_pct", "rope_percent"], optional=True)
        orig_ctx = self.find(["original_max_position_embeddings"], optional=True)
        if "full_attention" not in rp and "sliding_attention" not in rp:
            if local_theta is not None:
                rp["sliding_attention"] = {"rope_theta": local_theta}
            if "rope_theta" not in rp and rope_theta is not None:
                rp["rope_theta"] = rope_theta
            if "rope_type" not in rp and (rope_type := rp.get("type")) is not None:
                rp["rope_type"] = rope_type
            if "partial_rotary_factor" not in rp and partial is not None:
                rp["partial_rotary_factor"] = partial
            if "original_max_position_embeddings" not in rp and orig_ctx is not None:
                rp["original_max_position_embeddings"] = orig_ctx
        return rp

    @property
    def hidden_size(self) -> int:
        return int(self.find(["hidden_size", "n_embd", "dim"]))

    @property
    def vocab_size(self) -> int | None:
        v = self.hparams.get("vocab_size")
        return int(v) if v is not None else None

    @property
    def n_head(self) -> int:
        return int(self.find(["num_attention_heads", "n_head", "n_heads"]))

    @property
    def n_head_kv(self) -> int:
        v = self.find(["num_key_value_heads", "n_kv_heads"], optional=True)
        return int(v) if v is not None else self.n_head

    @property
    def head_dim(self) -> int:
        return int(self.hparams.get("head_dim") or self.hidden_size // self.n_head)

    @property
    def expert_ff(self) -> int:
        """Rows of one expert's gate/up matrix."""
        return int(self.find(["moe_intermediate_size", "intermediate_size"]))

    def is_moe_layer(self, bid: int) -> bool:
        return True

    @property
    def llama_arch(self) -> str:
        """llama.cpp's name of the architecture (general.architecture), for messages."""
        return gguf.MODEL_ARCH_NAMES[self.gguf_arch]

    @property
    def tied_embeddings(self) -> bool:
        # every supported family's config class defaults to an untied output layer
        return bool(self.hparams.get("tie_word_embeddings", False))

    def check_config(self) -> None:
        """ConversionError for a config.json setting llama.cpp's model cannot reproduce: tensors it
        has no place for, or a computation it does not do. Families add theirs; the tensor set
        itself is checked against `loader_tensors` once the plan is made."""

    def refuse(self, setting: str, why: str) -> ConversionError:
        """The one error of an unsupported config.json setting; `why` names what llama.cpp lacks."""
        return ConversionError(f"config.json {setting} is not supported: {why}")

    # -- what llama.cpp's loader accepts ---------------------------------------------------------

    def loader_tensors(self) -> tuple[set[str], set[str]]:
        """(required, optional) GGUF tensor names llama.cpp's loader creates for this config."""
        return self.expand(self.loader_required), self.expand(self.loader_optional)

    def expand(self, templates: Iterable[str], bids: Iterable[int] | None = None) -> set[str]:
        """GGUF names from templates: "{bid}" ones for each layer of `bids` (default all)."""
        bids = list(range(self.n_layers) if bids is None else bids)
        names: set[str] = set()
        for t in templates:
            if "{bid}" in t:
                names.update(t.format(bid=b) for b in bids)
            else:
                names.add(t)
        return names

    def stand_in(self, gguf_name: str) -> StandIn | None:
        """An exact equivalent for the required tensor `gguf_name` that the checkpoint lacks, or
        None (the conversion is refused). A tied output layer is a copy of the embedding matrix."""
        if gguf_name == "output.weight" and self.tied_embeddings:
            return StandIn("copy of the embedding matrix (tie_word_embeddings)", copy_of="model.embed_tokens.weight")
        return None

    # -- tensor names ----------------------------------------------------------------------------

    def rename(self, name: str) -> str | None:
        """llama.cpp's filter_tensors: None drops the tensor, else its (possibly renamed) name."""
        if name.startswith(_MULTIMODAL_PREFIXES) or any(p in name for p in _MULTIMODAL_PARTS):
            return None
        if name.endswith("e_score_correction_bias"):
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if "language_model." in name:
            name = name.replace("language_model.", "")
        if name.endswith((".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")):
            return None
        return name

    def merged_expert_name(self, bid: int, proj: str) -> str:
        return f"model.layers.{bid}.mlp.experts.{proj}.weight"

    def expert_shape(self, proj: str) -> tuple[int, int]:
        """(rows, cols) of one expert matrix per config.json."""
        return (self.hidden_size, self.expert_ff) if proj == self.down_proj else (self.expert_ff, self.hidden_size)

    def fused_experts(self, name: str, shape: tuple[int, ...]) -> list[ExpertStack] | None:
        """Stacks from one HF tensor that already holds all experts, or None if `name` is not one."""
        return None

    def outputs(self, name: str, shape: tuple[int, ...]) -> list[TensorOut]:
        """The output tensor(s) one non-expert HF tensor becomes (llama.cpp's modify_tensors)."""
        if self.permute_qk:
            suffixes = ("q_proj.weight", "q_proj.bias") if self.permute_biases else ("q_proj.weight",)
            ksuffixes = ("k_proj.weight", "k_proj.bias") if self.permute_biases else ("k_proj.weight",)
            if name.endswith(suffixes):
                n = self.n_head
                return [TensorOut(name, shape, lambda w: permute_rope(w, n, n))]
            if name.endswith(ksuffixes):
                n, nkv = self.n_head, self.hparams.get("num_key_value_heads", self.hparams.get("n_kv_heads"))
                return [TensorOut(name, shape, lambda w: permute_rope(w, n, nkv))]
        return [TensorOut(name, shape)]

    def map_name(self, hf_name: str) -> str:
        new = self.tensor_map.get_name(key=hf_name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ConversionError(f"cannot map tensor {hf_name!r} to a llama.cpp {self.gguf_arch.name.lower()} "
                                  f"tensor: not a {self.name} checkpoint, or a variant llama.cpp does not know")
        return new

    def is_f32_tensor(self, gguf_name: str, bid: int | None) -> bool:
        """Tensors llama.cpp's converter always writes as F32 whatever the output type (besides
        1-D tensors and norms): routers and the other small ones listed in its prepare_tensors."""
        keys = (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP,
                gguf.MODEL_TENSOR.POS_EMBD, gguf.MODEL_TENSOR.TOKEN_TYPES)
        for key in keys:
            if key not in gguf.MODEL_TENSORS[self.gguf_arch]:
                continue
            key_name = gguf.TENSOR_NAMES[key]
            if "{bid}" in key_name:
                if bid is None:
                    continue
                key_name = key_name.format(bid=bid)
            elif bid is not None:
                continue
            if gguf_name == key_name + ".weight":
                return True
        return not gguf_name.endswith((".weight", ".lora_a", ".lora_b"))

    def extra_tensors(self) -> list[tuple[str, np.ndarray]]:
        """Tensors made from config.json alone (llama.cpp's generate_extra_tensors), written first."""
        return []

    # -- shapes ----------------------------------------------------------------------------------

    def attention_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected shapes of one layer's attention tensors, by name suffix after model.layers.N (the
        biases where a family has them: Qwen2-MoE's q/k/v, Mixtral's and Phi-MoE's optional ones)."""
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.n_head * hd, self.n_head_kv * hd
        return {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
                "self_attn.o_proj.bias": (h,)}

    def expected_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape config.json implies for an HF tensor, or None if we do not check it."""
        h = self.hidden_size
        top = {"model.embed_tokens.weight": (self.vocab_size, h), "lm_head.weight": (self.vocab_size, h),
               "model.norm.weight": (h,)}
        if name in top:
            shape = top[name]
            return None if None in shape else shape
        m = re.match(r"^model\.layers\.(\d+)\.(.*)$", name)
        if not m:
            return None
        suffix = m.group(2)
        per_layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                     self.router_suffix: (self.n_experts, h), **self.attention_shapes()}
        return per_layer.get(suffix)

    # -- metadata --------------------------------------------------------------------------------

    def write_hparams(self, w: gguf.GGUFWriter, file_type: int) -> None:
        """llama.cpp's TextModel.set_gguf_parameters; families add theirs after calling it."""
        w.add_block_count(self.n_layers)
        if (n_ctx := self.find(CONTEXT_KEYS, optional=True)) is not None:
            w.add_context_length(n_ctx)
        if (n_embd := self.find(["hidden_size", "n_embd", "dim"], optional=True)) is not None:
            w.add_embedding_length(n_embd)
        if (n_ff := self.find(["prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size",
                               "n_inner", "hidden_dim"], optional=True)) is not None:
            w.add_feed_forward_length(n_ff)
        if (n_head := self.find(["num_attention_heads", "n_head", "n_heads"], optional=True)) is not None:
            w.add_head_count(n_head)
        if (n_head_kv := self.find(["num_key_value_heads", "n_kv_heads"], optional=True)) is not None:
            w.add_head_count_kv(n_head_kv)
        if self.hparams.get("is_causal") is False:
            w.add_causal_attention(False)

        rope = self.rope_parameters.get("full_attention", self.rope_parameters)
        if (rope_type := rope.get("rope_type")) is not None:
            factor = rope.get("factor")
            if rope_type == "linear" and factor is not None:
                w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
                w.add_rope_scaling_factor(factor)
            elif rope_type == "yarn" and factor is not None:
                w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
                w.add_rope_scaling_factor(factor)
                w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
                if (v := rope.get("extrapolation_factor")) is not None:
                    w.add_rope_scaling_yarn_ext_factor(v)
                if (v := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
                    w.add_rope_scaling_yarn_attn_factor(v)
                if (v := rope.get("beta_fast")) is not None:
                    w.add_rope_scaling_yarn_beta_fast(v)
                if (v := rope.get("beta_slow")) is not None:
                    w.add_rope_scaling_yarn_beta_slow(v)
            elif rope_type in ("su", "longrope"):
                w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        if (theta := rope.get("rope_theta")) is not None:
            w.add_rope_freq_base(theta)
        if (local_theta := self.rope_parameters.get("sliding_attention", {}).get("rope_theta")) is not None:
            w.add_rope_freq_base_swa(local_theta)
        if (eps := self.find(["rms_norm_eps", "norm_eps"], optional=True)) is not None:
            w.add_layer_norm_rms_eps(eps)
        if (eps := self.find(["layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"], optional=True)) is not None:
            w.add_layer_norm_eps(eps)
        if (n := self.find(["num_local_experts", "num_experts", "n_routed_experts"], optional=True)) is not None:
            w.add_expert_count(n)
        if (n := self.find(EXPERTS_USED_KEYS, optional=True)) is not None:
            w.add_expert_used_count(n)
        if (n := self.hparams.get("n_group")) is not None:
            w.add_expert_group_count(n)
        if (n := self.hparams.get("topk_group")) is not None:
            w.add_expert_group_used_count(n)
        score_func = self.find(["score_function", "scoring_func", "score_func", "moe_router_activation",
                                "moe_router_activation_func", "expert_selection_fn"], optional=True)
        if score_func is not None:
            funcs = {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID, "softmax": gguf.ExpertGatingFuncType.SOFTMAX}
            if hasattr(gguf.ExpertGatingFuncType, "SQRTSOFTPLUS"):
                funcs["sqrtsoftplus"] = gguf.ExpertGatingFuncType.SQRTSOFTPLUS
            if not isinstance(score_func, str) or score_func not in funcs:
                raise ConversionError(f"unsupported expert gating function {score_func!r} in config.json")
            w.add_expert_gating_func(funcs[score_func])
        if (head_dim := self.hparams.get("head_dim")) is not None:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        w.add_file_type(file_type)


def rope_dim_from_head(family: Family) -> int:
    return int(family.hparams.get("head_dim") or family.hidden_size // family.n_head)


def phi3_rope_dims(family: Family) -> int:
    rot_pct = family.rope_parameters.get("partial_rotary_factor", 1.0)
    return int(rot_pct * family.hidden_size) // family.n_head


def longrope_attn_factor(scale: float, orig_ctx: int, rope_type: str) -> float:
    """Phi-3's attention factor for long-context RoPE (llama.cpp's Phi3MiniModel)."""
    if rope_type in ("su", "longrope"):
        return math.sqrt(1 + math.log(scale) / math.log(orig_ctx)) if scale > 1.0 else 1.0
    if rope_type == "yarn":
        return 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
    raise ConversionError(f"RoPE scaling type {rope_type!r} is not supported for this model")
