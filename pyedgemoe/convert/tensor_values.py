"""What a tensor's values must be to be converted, checked on each chunk of float32 data as it
passes to the quantizer (its max and min: no copy).

- Finite: NaN or Inf in a checkpoint is a damaged file, and ggml's quantizers turn them into
  arbitrary blocks.
- Within the range of the 16-bit float they are written as: f16 ends at 65504, and a BF16
  checkpoint's larger weights would become inf.
"""
from __future__ import annotations

import math

import numpy as np

from pyedgemoe.errors import ConversionError

# The smallest magnitude a float32 rounds to inf in each 16-bit type (round to nearest even, as
# ggml's fp32 -> f16/bf16 conversions): half-way past the largest finite value, 65504 for f16.
_OVERFLOW_AT = {"f16": 65520.0, "bf16": float(np.array(0x7F7F8000, dtype=np.uint32).view(np.float32))}


def check_values(data: np.ndarray, type_name: str, tensor: str, option: str) -> None:
    """ConversionError naming `tensor` if `data` holds NaN or Inf, or a value that `type_name`
    (given or implied by `option`) would write as inf."""
    if data.size == 0:
        return
    hi, lo = float(data.max()), float(data.min())  # NaN and Inf propagate into them
    if not (math.isfinite(hi) and math.isfinite(lo)):
        raise ConversionError(f"tensor {tensor} holds NaN or Inf values: the checkpoint is damaged "
                              f"(download or save it again)")
    overflow_at = _OVERFLOW_AT.get(type_name)
    extreme = hi if hi >= -lo else lo
    if overflow_at is not None and abs(extreme) >= overflow_at:
        wider = " or ".join(t for t in ("bf16", "f32") if t != type_name)
        raise ConversionError(f"tensor {tensor} holds {extreme:g}, beyond the range of {type_name}, which would "
                              f"write it as inf; give {option} {wider}")
