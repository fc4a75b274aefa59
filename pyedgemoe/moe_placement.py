"""llama.cpp's flags that keep a MoE's experts in host memory, as the guides to large MoEs give them
(`-ot ".ffn_.*_exps.=CPU"`, `--cpu-moe`, `--n-cpu-moe N`): taken, with a note, because pyedgemoe
places experts itself, by a byte budget (--expert-cache; with a GPU its memory, and --host-cache the
RAM behind it), and experts in host memory is where that budget keeps those it does not hold on a
device. On a CPU they change nothing in llama.cpp either. A tensor override of anything but experts,
or to a buffer type but llama.cpp's CPU, is refused: pyedgemoe does not place tensors one by one.
"""
from __future__ import annotations

import functools
import re

import gguf

from pyedgemoe.errors import InvalidOptionError

WAY_HERE = ("pyedgemoe places experts by a byte budget, not by tensor or layer: --expert-cache SIZE (with a GPU: its "
            "memory, --host-cache the RAM behind it, --mode where the misses are computed; docs/gpu.md)")
_TAKEN = "experts stay in host memory where pyedgemoe's expert cache does not hold them (--expert-cache; docs/gpu.md)"
_MAX_LAYERS = 256  # the layers a pattern is tried on


@functools.cache
def _tensor_names() -> tuple[tuple[str, bool], ...]:
    """Every tensor name llama.cpp's GGUFs use (gguf-py's table), of layers 0 to _MAX_LAYERS - 1, with
    whether it is an expert's (its kind ends in exps: the routed experts' weights, biases and norms)."""
    kinds = {name.format(bid=layer) for name in gguf.TENSOR_NAMES.values() for layer in range(_MAX_LAYERS)}
    return tuple((f"{kind}.{part}", kind.endswith("exps")) for kind in sorted(kinds) for part in ("weight", "bias"))


def override_tensor(value: str) -> str:
    """The note for -ot PATTERN=CPU[,...] whose patterns match experts' tensors alone (regex search, as
    llama.cpp's loader matches them); InvalidOptionError for any other override."""
    for override in value.split(","):
        pattern, equals, buffer_type = override.partition("=")
        if not equals or not pattern:
            raise InvalidOptionError(f"-ot takes <tensor name pattern>=<buffer type>,..., got {override!r}")
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise InvalidOptionError(f"-ot {override!r}: not a regular expression: {e}") from None
        matched = [expert for name, expert in _tensor_names() if regex.search(name)]
        if buffer_type != "CPU" or not matched or not all(matched):
            what = f"places tensors in {buffer_type!r}, not in llama.cpp's CPU" if buffer_type != "CPU" else \
                "matches no tensor" if not matched else "matches tensors that are not experts"
            raise InvalidOptionError(f"-ot {override!r} {what}: {WAY_HERE}")
    return f"-ot {value}: {_TAKEN}"


def cpu_moe(value: bool) -> str:
    return f"--cpu-moe: {_TAKEN}"


def n_cpu_moe(value: int) -> str:
    if value < 0:
        raise InvalidOptionError(f"--n-cpu-moe takes a number of layers >= 0, got {value}")
    return f"--n-cpu-moe {value}: {_TAKEN}"
