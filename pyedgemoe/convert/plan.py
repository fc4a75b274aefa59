"""What a conversion will write: every tensor with its ggml shape, type and bytes, by role.

`--dry-run` prints a Plan and writes nothing; a real run hands the same entries to GGUFOutput
(whose progress bar counts their bytes). Roles: "base" (non-expert tensors), "high" (routed
experts, HIGH copy), "low" (their `.lowbit` LOW copy).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

import gguf
import numpy as np

from pyedgemoe.convert.gguf_out import block_size, ggml_type, ggml_type_name, tensor_nbytes
from pyedgemoe.errors import ConversionError
from pyedgemoe.sysmem import format_bytes

ROLES = ("base", "high", "low")
DEFAULT_HIGH, DEFAULT_LOW = "q8_0", "q4_K"  # the expert copies' types when --high / --low are not given

# The types ggml's quantizer writes (ggml_quantize_chunk); it ends the process on any other (f64, the
# integers, the q8_1/q8_K of its dot products) with a failed GGML_ASSERT.
_QUANTIZER_TYPES = ("f32", "f16", "bf16", "q8_0", "q6_K", "q5_K", "q5_1", "q5_0", "q4_K", "q4_1", "q4_0",
                    "q3_K", "q2_K", "iq4_xs", "iq4_nl", "iq3_s", "iq3_xxs", "mxfp4", "nvfp4", "tq2_0",
                    "tq1_0", "q1_0", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s")
# Quantizing these in ggml needs an importance matrix (ggml_quantize_requires_imatrix); we have none.
_NEEDS_IMATRIX = {"iq2_xxs", "iq2_xs", "iq2_s", "iq1_s", "iq1_m"}

# llama.cpp's quantizer (src/llama-quant.cpp, tensor_type_fallback): a tensor whose row length is
# not a multiple of the type's block size gets this type instead, and F16 if that does not fit either.
_FALLBACK = {
    "q2_K": "q4_0", "q3_K": "q4_0", "tq1_0": "q4_0", "tq2_0": "q4_0",
    "q4_K": "q5_0", "q5_K": "q5_1", "q6_K": "q8_0",
    "iq3_xxs": "iq4_nl", "iq3_s": "iq4_nl", "iq4_xs": "iq4_nl",
}


def check_type(type_name: str, option: str) -> str:
    """A user-given type name in ggml's spelling ("q4_k" -> "q4_K"); ConversionError naming
    `option` ("--high", "--low", "--base") if ggml's quantizer cannot produce it without an
    importance matrix."""
    try:
        name = ggml_type_name(ggml_type(type_name))
    except ConversionError as e:
        raise ConversionError(f"{option} type: {e}") from None
    if name not in _QUANTIZER_TYPES:
        takes = ", ".join(t for t in _QUANTIZER_TYPES if t not in _NEEDS_IMATRIX)
        raise ConversionError(f"{option} {name}: ggml's quantizer does not write this type; {option} takes {takes}")
    if name in _NEEDS_IMATRIX:
        raise ConversionError(f"{option} type {name} needs an importance matrix, which pyedgemoe does not "
                              f"compute; choose q2_K or larger")
    if name != "f32":
        from pyedgemoe import _native
        try:
            _native.quantize(np.zeros((1, block_size(name)), dtype=np.float32), name, 1)
        except Exception as e:
            raise ConversionError(f"{option} type {name} is not supported by ggml's quantizer: {e}") from None
    return name


def bits_per_weight(type_name: str) -> float:
    blck, type_size = gguf.GGML_QUANT_SIZES[ggml_type(type_name)]
    return 8 * type_size / blck


def check_precisions(high: str, low: str, low_named_by: str = "--low", high_named_by: str = "--high",
                     why: str = "") -> None:
    """ConversionError if the LOW copies would take more bytes than the HIGH ones: LOW is the small
    copy read for an unimportant miss (equal types are taken: a lossless second copy). `why` ends
    the message (a row-length fallback that made the types what they are)."""
    if bits_per_weight(low) > bits_per_weight(high):
        raise ConversionError(f"{low_named_by} {low} ({bits_per_weight(low):g} bits per weight) is larger than "
                              f"{high_named_by} {high} ({bits_per_weight(high):g}): LOW is the smaller copy, read "
                              f"for unimportant misses" + (f" ({why})" if why else ""))


def fitting_type(type_name: str, row_len: int) -> str:
    """`type_name`, or llama.cpp's fallback when rows of `row_len` elements do not fill its blocks."""
    if row_len % block_size(type_name) == 0:
        return type_name
    fallback = _FALLBACK.get(type_name)
    if fallback is not None and row_len % block_size(fallback) == 0:
        return fallback
    return "f16"


def types_by_bytes(sizes: Iterable[tuple[str, int]]) -> list[str]:
    """Of (type, nbytes) pairs, the types, the one that holds the most bytes first."""
    by_type: Counter = Counter()
    for type_name, nbytes in sizes:
        by_type[type_name] += nbytes
    return [type_name for type_name, _ in by_type.most_common()]


def type_of_most_bytes(sizes: Iterable[tuple[str, int]]) -> str:
    """Of (type, nbytes) pairs, the type that holds the most bytes: what `edgemoe.high_type` and
    `edgemoe.low_type` name (docs/format.md) where row-length fallbacks or a k-quant mix give a
    precision's tensors more than one type."""
    return types_by_bytes(sizes)[0]


@dataclass
class PlannedTensor:
    name: str
    ne: list[int]                 # ggml order: ne[0] is the row length
    type: str                     # ggml type name written
    nbytes: int
    role: str                     # "base" | "high" | "low"
    src_type: str = ""            # what it is made from (safetensors dtype, or the source GGUF's type)
    action: str = ""              # one line: how (and, after a fallback, why this type)
    produce: Callable[[], np.ndarray] | None = field(default=None, repr=False, compare=False)

    @property
    def fell_back(self) -> bool:
        return "instead of" in self.action


@dataclass
class Plan:
    """Everything a conversion writes, before it writes it."""
    source: str
    out: str
    architecture: str             # general.architecture of the output
    high_type: str
    low_type: str
    base_type: str
    low_from: str | None = None
    tensors: list[PlannedTensor] = field(default_factory=list)

    def add(self, name: str, ne: list[int], type_name: str, role: str, *, src_type: str = "",
            action: str = "", produce: Callable[[], np.ndarray] | None = None) -> PlannedTensor:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        ne = [int(n) for n in ne]
        try:
            nbytes = tensor_nbytes(type_name, ne)
        except ConversionError as e:
            raise ConversionError(f"tensor {name} {ne}: {e}") from None
        t = PlannedTensor(name, ne, type_name, nbytes, role, src_type, action, produce)
        self.tensors.append(t)
        return t

    # -- totals ----------------------------------------------------------------------------------

    def bytes_by_role(self) -> dict[str, int]:
        c = Counter({r: 0 for r in ROLES})
        for t in self.tensors:
            c[t.role] += t.nbytes
        return dict(c)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def type_of_most_bytes(self, role: str) -> str:
        """The type of most of the bytes of the tensors of `role` (the requested one unless fallbacks)."""
        return type_of_most_bytes((t.type, t.nbytes) for t in self.tensors if t.role == role)

    def types_written(self, role: str) -> str:
        """The types of the tensors of `role`, most bytes first ("q5_0/f16" after fallbacks)."""
        return "/".join(types_by_bytes((t.type, t.nbytes) for t in self.tensors if t.role == role))

    def fallbacks(self) -> list[PlannedTensor]:
        return [t for t in self.tensors if t.fell_back]

    def by_name(self) -> dict[str, PlannedTensor]:
        return {t.name: t for t in self.tensors}

    # -- presentation ----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """Plain data (JSON-able); the same keys `from_gguf.convert_gguf` returns for a dry run."""
        b = self.bytes_by_role()
        return {
            "source": self.source, "out": self.out, "architecture": self.architecture,
            "high_type": self.high_type, "low_type": self.low_type, "base_type": self.base_type,
            "low_from": self.low_from,
            "tensors": [{"name": t.name, "ne": list(t.ne), "type": t.type, "src_type": t.src_type,
                         "nbytes": t.nbytes, "action": t.action, "role": t.role} for t in self.tensors],
            "bytes": {"high": b["high"], "low": b["low"], "non_expert": b["base"], "total": self.total_bytes},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """A Plan from `to_dict()`'s shape (what `from_gguf.convert_gguf(dry_run=True)` returns)."""
        plan = cls(source=str(d["source"]), out=str(d["out"]), architecture=str(d["architecture"]),
                   high_type=d["high_type"], low_type=d["low_type"], base_type=str(d["base_type"]),
                   low_from=d.get("low_from"))
        for t in d["tensors"]:
            plan.tensors.append(PlannedTensor(t["name"], list(t["ne"]), t["type"], int(t["nbytes"]),
                                              t["role"], t.get("src_type", ""), t.get("action", "")))
        return plan

    def format(self, per_tensor: bool = True) -> str:
        """The text `--dry-run` prints: one line per tensor, then the bytes of each precision."""
        lines = [f"{self.source} -> {self.out}  ({self.architecture})",
                 f"HIGH {self.high_type}  LOW {self.low_type}  base {self.base_type}"
                 + (f"  low copies from {self.low_from}" if self.low_from else "")]
        if per_tensor:
            width = max((len(t.name) for t in self.tensors), default=10)
            for t in self.tensors:
                lines.append(f"  {t.name:<{width}}  {str(t.ne):<18} {t.src_type:>5} -> {t.type:<6} "
                             f"{format_bytes(t.nbytes, decimals=1):>10}  {t.action}")
        b = self.bytes_by_role()
        lines.append(f"{len(self.tensors)} tensors: experts HIGH {format_bytes(b['high'], decimals=1)}, "
                     f"experts LOW {format_bytes(b['low'], decimals=1)}, "
                     f"non-expert {format_bytes(b['base'], decimals=1)}, "
                     f"total {format_bytes(self.total_bytes, decimals=1)}")
        n_fallback = len(self.fallbacks())
        if n_fallback:
            lines.append(f"{n_fallback} tensor(s) use a fallback type: their row length does not fill the "
                         f"requested type's blocks (as llama.cpp's quantizer does)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()
