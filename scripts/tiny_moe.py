#!/usr/bin/env python3
"""Tiny random Hugging Face MoE checkpoints, converted to GGUF by llama.cpp's own converter.

Everything is built locally (no hub access): a small byte-level BPE tokenizer (or, for the
families whose vocabulary is SentencePiece's, a SentencePiece one) trained on a deterministic text,
a transformers model of each family built from a config with seeded random
weights, and a standard GGUF written by the vendored `convert_hf_to_gguf.py`. They are the
independent reference for correctness tests: transformers' logits vs llama.cpp's on the same
weights.

    python scripts/tiny_moe.py qwen3_moe --out /tmp/tiny [--outtype f32|f16|q8_0]
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
LLAMA_CPP = REPO / "native" / "vendor" / "llama.cpp"
CONVERTER = LLAMA_CPP / "convert_hf_to_gguf.py"
GGUF_PY = LLAMA_CPP / "gguf-py"

ARCHITECTURES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "llama")
# Families pyedgemoe's own HF converter does not take (pyedgemoe/convert), built here the same way
# (llama.cpp's converter): the runtime is tested on them from llama.cpp's GGUF. GPT-OSS: experts
# with biases and the clamped SwiGLU, attention sinks, sliding-window layers; DeepSeek-V3: sigmoid
# routing with a score-correction bias and group-limited top-k; Qwen3-Next: linear-attention
# (gated delta net) layers between full-attention ones, a gated shared expert; LFM2-MoE (an edge
# MoE): short-convolution layers, a dense first layer, tied embeddings; GLM-4.5: partial rotary,
# q/k norms, sigmoid routing, a dense first layer. Granite-MoE (IBM's edge MoEs): scaled
# embeddings, residuals, attention and logits. Granite-4.0-H (granitemoehybrid): Mamba-2 layers
# beside attention, a shared expert, no positions. MiniMax-M2: sigmoid routing with a correction
# bias, partial rotary, q/k norms over all heads. dots.llm1: DeepSeek-V3's router on Qwen's
# attention. Qwen3.5-MoE: Qwen3-Next's layers with interleaved multimodal rotary sections.
# Nemotron-H MoE (Nemotron 3 Nano): Mamba-2, attention and MoE each a layer of its own, squared-ReLU
# experts without a gate, sigmoid routing with a selection bias. AFMoE (Arcee's Trinity): scaled
# embeddings, gated attention with q/k norms, sliding windows with unrotated global layers, norms
# before and after attention and FFN, sigmoid routing with a selection bias. ERNIE-4.5-MoE: a dense
# first layer, shared experts, a selection bias, tied embeddings. Jamba: Mamba (1) layers with norms
# inside, attention every fourth layer, MoE every second. Gemma 4 (its 26B-A4B): a dense MLP beside
# the experts in every layer, fused gate/up experts with a scale each, a scaled router input,
# proportional rotary on global layers of wider heads, sliding windows, logits soft-capped. (ERNIE,
# Jamba and Gemma 4 have SentencePiece vocabularies.) GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's
# attention (MLA) and router under GLM's vocabulary.
LLAMA_CPP_ONLY: tuple[str, ...] = ("gpt_oss", "deepseek_v3", "qwen3_next", "lfm2_moe", "glm4_moe", "granitemoe",
                                   "granitemoehybrid", "minimax_m2", "dots1", "qwen3_5_moe", "nemotron_h",
                                   "afmoe", "ernie4_5_moe", "jamba", "gemma4", "glm4_moe_lite")
# families whose converter reads a SentencePiece model (tokenizer.model, or transformers' tokenizer.json
# of it), by whether their tokenizer puts a space before a text (Llama's and ERNIE's do, Gemma's not);
# the others get a byte-level BPE (tokenizer.json) and llama.cpp's "gpt2" vocabulary
SENTENCEPIECE: dict[str, bool] = {"ernie4_5_moe": True, "jamba": True, "gemma4": False}
# the converter's arguments a family needs, by its config's model_type: Qwen3-Next's and Qwen3.5's
# configs name no multi-token-prediction layers, which the converter then asks for unless told there
# are none
CONVERTER_ARGS: dict[str, list[str]] = {"qwen3_next": ["--no-mtp"], "qwen3_5_moe_text": ["--no-mtp"]}
# config.json's keys as the released checkpoints have them, where transformers writes them otherwise
# and llama.cpp's converter reads only the released form (Granite-4.0-H's layer types)
RELEASED_CONFIG: dict[str, dict] = {"granitemoehybrid": {"layer_types": ["mamba", "attention"]}}
# how far llama.cpp's CPU logits may be from transformers', where more than float32's summation order
# parts them (about 1e-5): ggml's GELU reads a table of fp16 inputs and outputs, 2e-3 apart on the
# tiny Gemma 4 (4e-5 with transformers' GELU rounded the same way)
TRANSFORMERS_GAP: dict[str, float] = {"gemma4": 5e-3}
# the special tokens a family's vocabulary must have for the converter (GLM's: its BOS, end of turn
# and end of message), added after the trained ones
EXTRA_SPECIAL_TOKENS: dict[str, tuple[str, ...]] = {"glm4_moe": ("[gMASK]", "<|user|>", "<|observation|>")}
EXTRA_SPECIAL_TOKENS["glm4_moe_lite"] = EXTRA_SPECIAL_TOKENS["glm4_moe"]
# Not here: "phimoe". The converter handles it, but transformers routes Phi-3.5-MoE with
# sparsemixer (top-1 by a relative-threshold mask, then the runner-up among the rest) while
# llama.cpp routes it like Mixtral (softmax, top-k, renormalise): no config makes them agree.
# Nor Hunyuan-MoE (its converter reads the tokenizer of the model's own code: tiktoken ranks), Llama 4
# (stock llama.cpp stops on the tiny file: "tensor buffer not set") and Qwen3-VL-MoE (transformers
# saves its experts in another layout than the released checkpoints', which the converter reads).

# The llama.cpp architecture name each family converts to (`general.architecture`).
GGUF_ARCH: dict[str, str] = {
    "mixtral": "llama",  # llama.cpp runs Mixtral as "llama" with expert tensors
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
    "deepseek_v2": "deepseek2",
    "llama": "llama",
    "gpt_oss": "gpt-oss",
    "deepseek_v3": "deepseek2",
    "qwen3_next": "qwen3next",
    "lfm2_moe": "lfm2moe",
    "glm4_moe": "glm4moe",
    "granitemoe": "granitemoe",
    "granitemoehybrid": "granitehybrid",
    "minimax_m2": "minimax-m2",
    "dots1": "dots1",
    "qwen3_5_moe": "qwen35moe",
    "nemotron_h": "nemotron_h_moe",
    "afmoe": "afmoe",
    "ernie4_5_moe": "ernie4_5-moe",
    "jamba": "jamba",
    "gemma4": "gemma4",
    "glm4_moe_lite": "deepseek2",
}
MOE_ARCHITECTURES: tuple[str, ...] = tuple(a for a in ARCHITECTURES if a != "llama")

OUTTYPES = ("f32", "f16", "q8_0")

# Tokenizer. A locally trained tokenizer has no pre-tokenizer hash known to the converter, so
# the converter is told which llama.cpp pre-tokenizer to use. "gpt-2" is exactly the regex of
# the `tokenizers` ByteLevel pre-tokenizer; "default" would also split punctuation runs and
# three-digit groups first, so it would not reproduce HF's ids.
LLAMA_CPP_TOKENIZER_PRE = "gpt-2"
# by config model_type, where transformers tokenizes a family with its own regex (Qwen3.5's class
# splits as llama.cpp's "qwen35" does)
FAMILY_TOKENIZER_PRE: dict[str, str] = {"qwen3_5_moe_text": "qwen35"}
VOCAB_SIZE = 384
BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Weights. A wider init than transformers' 0.02 so logits differ from token to token and
# routers really pick different experts; norm weights and biases are randomised too, so a
# converter that dropped or mis-shifted one would show up in the logits.
INIT_STD = 0.15
ROUTER_STD = 0.3
NORM_WEIGHT_STD = 0.1
BIAS_STD = 0.1
# the routers' selection biases randomised as well (Nemotron-H's, AFMoE's, ERNIE's), so that a
# runtime that chose by the scores alone would show; the earlier families' stay at transformers' zeros
SELECTION_BIASES = ("mixer.gate.e_score_correction_bias", "mlp.expert_bias", "moe_statics.e_score_correction_bias")

_COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    max_position_embeddings=512,
    initializer_range=INIT_STD,
    tie_word_embeddings=False,
    bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
    eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
    pad_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
)

# Per family: the transformers config class and its arguments beyond _COMMON.
_CONFIGS: dict[str, tuple[str, dict]] = {
    "mixtral": ("MixtralConfig", dict(
        num_hidden_layers=2, num_key_value_heads=2, intermediate_size=48,
        num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        # Qwen1.5-MoE layout: qkv bias, a shared expert behind a sigmoid gate, no top-k renorm.
        num_hidden_layers=2, num_key_value_heads=2, intermediate_size=128,
        moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, qkv_bias=True,
        decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        # Qwen3-30B-A3B layout: per-head q/k RMS norms, top-k weights renormalised.
        num_hidden_layers=2, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )),
    "olmoe": ("OlmoeConfig", dict(
        # OLMoE-1B-7B layout: q/k RMS norms over the whole projection, experts of
        # intermediate_size, no top-k renorm.
        num_hidden_layers=2, num_key_value_heads=4, intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=None,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )),
    "deepseek_v2": ("DeepseekV2Config", dict(
        # MLA attention plus one leading dense layer, then routed + shared experts.
        # q_lora_rank is set: llama.cpp only allows q_lora_rank = 0 ("lite") for models whose
        # layer count matches DeepSeek-V2-Lite (27) or a few other known sizes.
        num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=64,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
        topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=2.0, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )),
    "gpt_oss": ("GptOssConfig", dict(
        # gpt-oss-20b's layout: alternating sliding-window and full attention, YaRN over a 4096
        # context (truncate: llama.cpp's YaRN is the truncated one; the released config says false,
        # with which transformers' logits part from llama.cpp's by about 2e-2 here)
        num_hidden_layers=2, num_key_value_heads=2, head_dim=16, intermediate_size=32,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=8, max_position_embeddings=131072,
        layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": True},
    )),
    "deepseek_v3": ("DeepseekV3Config", dict(
        # as deepseek_v2's, with DeepSeek-V3's router: sigmoid scores plus a correction bias, the top
        # group of two, the top-k renormalised and scaled. scoring_func / topk_method are the
        # released config's keys, which llama.cpp's converter reads (transformers' class does not
        # write them: without them the converter writes softmax routing)
        num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=64,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
        n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        scoring_func="sigmoid", topk_method="noaux_tc", rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )),
    "qwen3_next": ("Qwen3NextConfig", dict(
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], full_attention_interval=2,
        num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=64,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
    )),
    "lfm2_moe": ("Lfm2MoeConfig", dict(
        num_hidden_layers=2, layer_types=["conv", "full_attention"], num_dense_layers=1,
        num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, tie_word_embeddings=True, norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )),
    "glm4_moe": ("Glm4MoeConfig", dict(
        # GLM-4.5's layout (its multi-token-prediction layer left out, as transformers' class has none)
        num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=2, head_dim=16,
        partial_rotary_factor=0.5, use_qk_norm=True, intermediate_size=64, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=0, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
    )),
    "granitemoe": ("GraniteMoeConfig", dict(
        # granite-3.1-3b-a800m's multipliers (its logits' divisor left at 1, for logits that vary)
        num_hidden_layers=2, num_key_value_heads=2, intermediate_size=32, num_local_experts=8,
        num_experts_per_tok=2, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
        logits_scaling=1.0, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )),
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(
        num_hidden_layers=2, layer_types=RELEASED_CONFIG["granitemoehybrid"]["layer_types"], num_key_value_heads=2,
        intermediate_size=32, shared_intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=1.0,
        mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16, mamba_d_head=16, mamba_d_conv=4, mamba_expand=2,
        position_embedding_type="nope", rms_norm_eps=1e-6,
    )),
    "minimax_m2": ("MiniMaxM2Config", dict(
        # rotary_dim and scoring_func: the released config's keys, which llama.cpp's converter reads
        num_hidden_layers=2, num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=8,
        num_experts_per_tok=2, rotary_dim=8, scoring_func="sigmoid", use_routing_bias=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
    )),
    "dots1": ("Dots1Config", dict(
        # as many key/value heads as heads, as the released model (llama.cpp's dots1 assumes it)
        num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=4, intermediate_size=64,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, scoring_func="sigmoid", rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(
        # the rotary sections sum to half the rotated dimensions (4 of 16). With these weights no
        # token's routing is a near-tie that the device's and the CPU's arithmetic break differently
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, moe_intermediate_size=64, shared_expert_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    )),
    "nemotron_h": ("NemotronHConfig", dict(
        # Nemotron 3 Nano's layer kinds, one each and a second MoE
        layers_block_type=["mamba", "moe", "attention", "moe"], num_key_value_heads=2, head_dim=16,
        intermediate_size=64, ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=1, conv_kernel=4,
        expand=2, chunk_size=16, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=64, num_experts_per_tok=2, routed_scaling_factor=2.5, n_group=1,
        topk_group=1, norm_topk_prob=True, layer_norm_epsilon=1e-5,
    )),
    "afmoe": ("AfmoeConfig", dict(
        # route_norm and mup_enabled as the released configs (llama.cpp always scales the embeddings);
        # a global layer every 4, as llama.cpp assumes
        num_hidden_layers=4, num_dense_layers=1, num_key_value_heads=2, head_dim=16, intermediate_size=64,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_shared_experts=1, route_scale=2.5,
        route_norm=True, mup_enabled=True, global_attn_every_n_layers=4, sliding_window=8, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(
        num_hidden_layers=3, num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=32, moe_k=2,
        moe_num_experts=8, moe_num_shared_experts=1, moe_layer_start_index=1, tie_word_embeddings=True,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )),
    "jamba": ("JambaConfig", dict(
        num_hidden_layers=4, num_key_value_heads=2, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=4, attn_layer_offset=2, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, rms_norm_eps=1e-6,
    )),
    "gemma4": ("Gemma4TextConfig", dict(
        # the soft cap as the released configs (llama.cpp applies 30 where the file names none); the
        # global layer's heads twice the sliding ones' (512 and 256 there)
        num_hidden_layers=2, num_key_value_heads=2, head_dim=16, per_layer_config={"1": {"head_dim": 32}},
        intermediate_size=64, enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
        layer_types=["sliding_attention", "full_attention"], sliding_window=8, hidden_size_per_layer_input=0,
        final_logit_softcapping=30.0, rms_norm_eps=1e-6,
    )),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(
        # first_k_dense_replace, scoring_func and topk_method: the keys llama.cpp's converter reads (it
        # tells the released file's sigmoid routing by its layer count and vocabulary otherwise)
        num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"], first_k_dense_replace=1,
        num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, routed_scaling_factor=1.8, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1, norm_topk_prob=True, scoring_func="sigmoid",
        topk_method="noaux_tc", rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )),
    "llama": ("LlamaConfig", dict(
        num_hidden_layers=2, num_key_value_heads=2, intermediate_size=128, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )),
}


def _check_arch(arch: str) -> None:
    known = ARCHITECTURES + LLAMA_CPP_ONLY
    if arch not in known:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {', '.join(known)}")


# ---------------------------------------------------------------------------------------------
# Tokenizer


def training_text(seed: int = 1234, n_sentences: int = 400) -> list[str]:
    """A few KB of English-like text with digits and punctuation, the same on every machine."""
    words = (
        "the a an of to in and or for with on at by from as is are was were be been has have "
        "had do does did can could will would should may might must not no yes this that these "
        "those it its he she they we you I me my your our their his her them us who what which "
        "when where why how all any each few more most other some such only own same so than too "
        "very just now then here there up down out over under again once model expert experts "
        "router token tokens layer layers memory cache disk read write load store page budget "
        "time speed fast slow small large tiny big test tests value values weight weights matrix "
        "vector number numbers text word words line lines file files code data run runs running "
        "python llama mixture sparse dense hidden state attention head heads query key output "
        "input batch prompt answer question world hello good bad new old first last next long "
        "short high low right left open close start stop make made take took give gave find found "
        "think know see look use used work works call calls return returns people year day way"
    ).split()
    punct = [".", ".", ".", "!", "?", ",", ";", ":"]
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        n = rng.randint(4, 14)
        parts = []
        for i in range(n):
            w = rng.choice(words)
            r = rng.random()
            if r < 0.08:
                w = str(rng.randint(0, 99999))
            elif r < 0.12:
                w = f"'{w}'" if rng.random() < 0.5 else f"({w})"
            elif r < 0.16:
                w = w + rng.choice(["'s", "'t", "'ll", "'re"])
            if i == 0 or rng.random() < 0.05:
                w = w.capitalize()
            parts.append(w)
            if i < n - 1 and rng.random() < 0.1:
                parts[-1] += ","
        lines.append(" ".join(parts) + rng.choice(punct))
    return lines


def train_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE (`tokenizers.Tokenizer`) with SPECIAL_TOKENS at ids 0..2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer)
    return tokenizer


def save_tokenizer(out_dir: Path, extra_special: tuple[str, ...] = ()) -> int:
    """Write tokenizer.json + tokenizer_config.json into out_dir (extra_special: special tokens after
    the trained ones); returns the vocabulary size."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=BOS_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (BOS_TOKEN, EOS_TOKEN)] + list(extra_special),
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))
    # The converter picks its vocabulary reader from tokenizer_class for some families, and
    # llama.cpp reads add_bos_token: keep both explicit (no BOS added, as HF's encode does here).
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", add_bos_token=False, add_eos_token=False)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return len(fast)


def save_sentencepiece_tokenizer(out_dir: Path, extra_special: tuple[str, ...] = (), space_prefix: bool = True) -> int:
    """Write tokenizer.model (a SentencePiece BPE trained on the same text, SPECIAL_TOKENS at ids
    0..2, byte fallback), its transformers files and tokenizer_config.json into out_dir (extra_special:
    control tokens after the trained ones); returns the vocabulary size. No normalisation and
    whitespace kept, as Llama's, ERNIE's and Gemma's tokenizers are trained; space_prefix: a space
    before the text."""
    import io

    import sentencepiece
    from transformers import AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text()), model_writer=model, vocab_size=VOCAB_SIZE, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=space_prefix, split_digits=False,
        bos_id=SPECIAL_TOKENS.index(BOS_TOKEN), bos_piece=BOS_TOKEN, eos_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        eos_piece=EOS_TOKEN, unk_id=len(SPECIAL_TOKENS), pad_id=-1,
        control_symbols=[t for t in SPECIAL_TOKENS if t not in (BOS_TOKEN, EOS_TOKEN)] + list(extra_special),
        minloglevel=2)
    (out_dir / "tokenizer.model").write_bytes(model.getvalue())
    # transformers converts tokenizer.model at load; add_prefix_space is what the converter reads
    # (llama.cpp's add_space_prefix)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="LlamaTokenizer", bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=BOS_TOKEN,
        add_bos_token=False, add_eos_token=False, legacy=False, add_prefix_space=space_prefix)))
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir), chat_template=CHAT_TEMPLATE)
    tokenizer.save_pretrained(str(out_dir))
    return len(tokenizer)


def reference_tokenize(hf_dir: Path):
    """text -> ids, as the model's own tokenizer does (no special tokens added or parsed):
    SentencePiece's where the checkpoint has a tokenizer.model (transformers' conversion of it does
    not add the space before a text that starts with one), else transformers'."""
    spm_path = Path(hf_dir) / "tokenizer.model"
    if spm_path.is_file():
        import sentencepiece
        return sentencepiece.SentencePieceProcessor(model_file=str(spm_path)).encode
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(hf_dir))
    return lambda text: hf.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------------------------
# Model


def make_config(arch: str, vocab_size: int, overrides: dict | None = None):
    """The tiny `arch` config; `overrides` replaces or adds config arguments (e.g. the optional
    tensors a family's config can switch on or off: attention_bias, tie_word_embeddings, ...)."""
    import transformers

    _check_arch(arch)
    class_name, kwargs = _CONFIGS[arch]
    config = getattr(transformers, class_name)(vocab_size=vocab_size, **{**_COMMON, **kwargs, **(overrides or {})})
    config.dtype = "float32"
    return config


def _randomise_(model, seed: int) -> None:
    """Routers, norm weights and biases get random values (transformers sets zeros/ones)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight", "feed_forward.gate.weight",
                              "shared_expert_gate.weight", "block_sparse_moe.router.weight", "mixer.gate.weight",
                              "mlp.router.gate.weight", "feed_forward.router.weight", "router.proj.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * ROUTER_STD)
            elif name.endswith(("router.scale", "router.per_expert_scale")):  # Gemma 4's, ones otherwise
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * NORM_WEIGHT_STD)
            elif name.endswith(SELECTION_BIASES):
                p.copy_(torch.randn(p.shape, generator=gen) * BIAS_STD)
            elif p.ndim == 1 and name.endswith("norm.weight"):
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * NORM_WEIGHT_STD)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * BIAS_STD)


def build_hf_checkpoint(arch: str, out_dir: Path, seed: int = 0, overrides: dict | None = None) -> Path:
    """Write config.json, model.safetensors (float32) and tokenizer files of a tiny `arch` model
    (with `overrides` applied to its config, see make_config)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    _check_arch(arch)
    hf_logging.disable_progress_bar()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if arch in SENTENCEPIECE:
        vocab_size = save_sentencepiece_tokenizer(out_dir, EXTRA_SPECIAL_TOKENS.get(arch, ()), SENTENCEPIECE[arch])
    else:
        vocab_size = save_tokenizer(out_dir, EXTRA_SPECIAL_TOKENS.get(arch, ()))
    config = make_config(arch, vocab_size, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise_(model, seed)
    model.save_pretrained(str(out_dir))
    if arch in RELEASED_CONFIG:
        saved = json.loads((out_dir / "config.json").read_text())
        (out_dir / "config.json").write_text(json.dumps({**saved, **RELEASED_CONFIG[arch]}, indent=2))
    return out_dir


def transformers_logits(hf_dir: Path, ids: list[int]) -> np.ndarray:
    """float32 [len(ids), n_vocab] logits of the checkpoint in hf_dir (eager attention, fp32)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([list(ids)], dtype=torch.long))
    return out.logits[0].to(torch.float32).numpy()


# ---------------------------------------------------------------------------------------------
# Conversion

# Runs the vendored converter unmodified except for the pre-tokenizer name (see
# LLAMA_CPP_TOKENIZER_PRE): argv[1] is the vendored tree, argv[2] the name, the rest its arguments.
_CONVERTER_SHIM = """
import runpy, sys
root, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [root + '/convert_hf_to_gguf.py'] + sys.argv[3:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def tokenizer_pre(model_type: str) -> str:
    """The llama.cpp pre-tokenizer a family's GGUF names (config model_type)."""
    return FAMILY_TOKENIZER_PRE.get(model_type, LLAMA_CPP_TOKENIZER_PRE)


def convert_to_gguf(hf_dir: Path, out_path: Path, outtype: str = "f32", model_name: str | None = None) -> Path:
    """Convert hf_dir to out_path with llama.cpp's convert_hf_to_gguf.py (in a subprocess)."""
    if outtype not in OUTTYPES:
        raise ValueError(f"unknown outtype {outtype!r}; expected one of {', '.join(OUTTYPES)}")
    if not CONVERTER.is_file():
        raise RuntimeError(f"llama.cpp converter not found at {CONVERTER}; run native/fetch_llama.py")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(GGUF_PY), env.get("PYTHONPATH")) if p)
    env.pop("NO_LOCAL_GGUF", None)
    model_type = json.loads((Path(hf_dir) / "config.json").read_text())["model_type"]
    cmd = [
        sys.executable, "-c", _CONVERTER_SHIM, str(LLAMA_CPP), tokenizer_pre(model_type),
        str(hf_dir), "--outfile", str(out_path), "--outtype", outtype,
    ]
    if model_name:
        cmd += ["--model-name", model_name]
    cmd += CONVERTER_ARGS.get(model_type, [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out_path.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir} (exit {proc.returncode}):\n{proc.stderr}")
    return out_path


def _sha256(parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else str(part).encode())
        h.update(b"\0")
    return h.hexdigest()


def _converter_sources() -> list[Path]:
    return sorted([CONVERTER, *(LLAMA_CPP / "conversion").glob("*.py"), *(GGUF_PY / "gguf").glob("*.py")])


def tiny_gguf(arch: str, cache_dir: Path, outtype: str = "f32", seed: int = 0) -> Path:
    """The GGUF of the tiny `arch` model, built and converted once under cache_dir/<arch>/.

    The HF checkpoint is cache_dir/<arch>/hf (for `transformers_logits`). Each is rebuilt when
    what made it changed: this file for the checkpoint, plus the converter's sources for the GGUF.
    """
    _check_arch(arch)
    if outtype not in OUTTYPES:
        raise ValueError(f"unknown outtype {outtype!r}; expected one of {', '.join(OUTTYPES)}")
    arch_dir = Path(cache_dir) / arch
    arch_dir.mkdir(parents=True, exist_ok=True)
    hf_dir = arch_dir / "hf"
    gguf_path = arch_dir / f"{arch}-{outtype}.gguf"
    hf_key = _sha256([Path(__file__).read_bytes(), arch, seed])
    gguf_key = _sha256([hf_key, outtype, *(p.read_bytes() for p in _converter_sources())])
    hf_stamp, gguf_stamp = arch_dir / "hf.stamp", arch_dir / f"{gguf_path.name}.stamp"

    def fresh(stamp: Path, key: str, product: Path) -> bool:
        return stamp.is_file() and stamp.read_text() == key and product.exists()

    with open(arch_dir / ".lock", "w") as lock:  # several test processes may share one cache
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not fresh(hf_stamp, hf_key, hf_dir / "config.json"):
            tmp = Path(tempfile.mkdtemp(prefix="hf.", dir=arch_dir))
            build_hf_checkpoint(arch, tmp, seed)
            tmp.chmod(0o755)
            shutil.rmtree(hf_dir, ignore_errors=True)
            os.replace(tmp, hf_dir)
            hf_stamp.write_text(hf_key)
        if not fresh(gguf_stamp, gguf_key, gguf_path):
            tmp_path = arch_dir / f".{gguf_path.name}.tmp"
            convert_to_gguf(hf_dir, tmp_path, outtype, model_name=f"tiny-{arch}")
            os.replace(tmp_path, gguf_path)
            gguf_stamp.write_text(gguf_key)
    return gguf_path


def repacking_gguf(out: Path) -> Path:
    """A tiny Qwen3-MoE whose HIGH expert copies are Q4_K (rows of 256 weights) and LOW ones Q4_0
    (pyedgemoe's converter): llama.cpp's CPU backend repacks Q4_K on AVX2, so split's host tier
    keeps such experts in both layouts (docs/gpu.md). Built in out, a fresh directory."""
    from pyedgemoe.convert import convert

    hf = build_hf_checkpoint("qwen3_moe", out / "hf", overrides=dict(hidden_size=256, moe_intermediate_size=256))
    return convert(hf, out / "q4k-qwen3_moe.gguf", high="q4_K", low="q4_0", progress=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arch", choices=ARCHITECTURES + LLAMA_CPP_ONLY)
    parser.add_argument("--out", type=Path, required=True, help="cache directory (the model goes in OUT/ARCH/)")
    parser.add_argument("--outtype", choices=OUTTYPES, default="f32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        print(tiny_gguf(args.arch, args.out, args.outtype, args.seed))
    except RuntimeError as e:
        print(f"tiny_moe: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
