"""The names of the multi-precision GGUF format (docs/format.md): expert tensors, their LOW copies
and the `edgemoe.*` metadata keys. Everything in Python that reads or writes these names takes
them from here.

Expert tensors are the stacked routed experts llama.cpp's MoE path multiplies with
ggml_mul_mat_id, `blk.<layer>.ffn_<projection>_exps.weight` with projection up, gate, down or
gate_up (where an architecture fuses gate and up). Shared experts (`_shexp`) and routers
(`ffn_gate_inp`) are not expert tensors: every token uses them.
"""
from __future__ import annotations

import re

EXPERT_PROJECTIONS = ("up", "gate", "down", "gate_up")
_EXPERT_STACK = r"blk\.(\d+)\.ffn_(" + "|".join(EXPERT_PROJECTIONS) + r")_exps"
_EXPERT_TENSOR = re.compile(_EXPERT_STACK + r"\.weight")
# the copies of an expert stack the cache holds: its weights and their LOW copy (a stack's bias,
# GPT-OSS's, stays resident: the FFN adds it by expert id, docs/expert-residency.md)
_EXPERT_STACK_TENSOR = re.compile(_EXPERT_STACK + r"\.(weight|lowbit)")

# The LOW copy of `blk.N.ffn_up_exps.weight` is `blk.N.ffn_up_exps.lowbit`: this suffix in place
# of `.weight`. Our patched llama.cpp loader skips tensors named so.
LOW_COPY_SUFFIX = ".lowbit"

FORMAT_VERSION = 1  # the version this pyedgemoe writes, and the newest it reads

KEY_PREFIX = "edgemoe."
FORMAT_VERSION_KEY = KEY_PREFIX + "format_version"
HIGH_TYPE_KEY = KEY_PREFIX + "high_type"  # ggml type name of the HIGH expert copies
LOW_TYPE_KEY = KEY_PREFIX + "low_type"  # ggml type name of (most of) the LOW expert copies
PROVENANCE_KEY = KEY_PREFIX + "provenance"  # JSON: tool, source, source_type, low_from
CALIBRATION_KEY_PREFIX = KEY_PREFIX + "calibration."  # `pyedgemoe calibrate` results (t1, t2, json, ...)


def expert_tensor_name(layer: int, projection: str) -> str:
    """(3, "up") -> `blk.3.ffn_up_exps.weight`."""
    return f"blk.{layer}.ffn_{projection}_exps.weight"


def parse_expert_tensor(name: str) -> tuple[int, str] | None:
    """`blk.3.ffn_up_exps.weight` -> (3, "up"); None for any other name (LOW copies included)."""
    match = _EXPERT_TENSOR.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else None


def is_expert_tensor(name: str) -> bool:
    return parse_expert_tensor(name) is not None


def expert_stack_layer(name: str) -> int | None:
    """The layer of an expert stack's cached copies (`blk.3.ffn_up_exps.weight`, its LOW copy
    `blk.3.ffn_up_exps.lowbit` -> 3); None for other tensors (a stack's bias among them)."""
    match = _EXPERT_STACK_TENSOR.fullmatch(name)
    return int(match.group(1)) if match else None


def low_copy_name(name: str) -> str:
    """`blk.3.ffn_up_exps.weight` -> `blk.3.ffn_up_exps.lowbit`."""
    return name.removesuffix(".weight") + LOW_COPY_SUFFIX


def is_low_copy(name: str) -> bool:
    return name.endswith(LOW_COPY_SUFFIX)
