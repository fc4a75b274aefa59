"""LoRA adapters, as llama.cpp loads them (`--lora FNAME[,FNAME...]`, `--lora-scaled FNAME:SCALE,...`;
llama-cpp-python's `Llama(lora_path=..., lora_scale=...)`): GGUF adapters (llama.cpp's
convert_lora_to_gguf.py writes them) applied by llama.cpp at every matrix they change. Checked here
before the load: the file is an adapter for the model's architecture, of tensors ggml multiplies
and a float32 alpha (llama.cpp loads others, then crashes or stops on its check). An adapter that
changes the routed experts' matrices needs them computed by llama.cpp's own graph, every expert
resident (or mapped): the expert cache computes them itself (its pools), and would leave the
adapter out."""
from __future__ import annotations

import math
import os

import gguf
import numpy as np

from pyedgemoe.errors import InvalidOptionError

EXPERT_TENSOR_MARK = "_exps."  # a routed experts' matrix: blk.N.ffn_up_exps.weight
ALPHA_KEY = "adapter.lora.alpha"
_FLOAT_MAX = float(np.finfo(np.float32).max)  # a scale is a C float: a larger one is infinite there
# types ggml's matrix product does not take as a weight: llama.cpp loads such an adapter, and the
# first token's product reads it as another type (a segmentation fault, stock's too)
_NOT_MULTIPLIED = {gguf.GGMLQuantizationType[name] for name in ("F64", "I8", "I16", "I32", "I64")}


def adapters(lora: str | None, lora_scaled: str | list | None) -> list[tuple[str, float]]:
    """(path, scale) of each adapter of --lora (scale 1) and --lora-scaled (its text, or from Python
    a list of (path, scale) pairs), in that order."""
    out = [(path, 1.0) for path in _items(lora, "lora")]
    if isinstance(lora_scaled, (list, tuple)):
        for pair in lora_scaled:
            path, scale = pair if isinstance(pair, (list, tuple)) and len(pair) == 2 else (None, None)
            if not isinstance(path, (str, os.PathLike)) or isinstance(scale, bool) or \
                    not isinstance(scale, (int, float)) or not abs(scale) <= _FLOAT_MAX:
                raise InvalidOptionError(f"a LoRA adapter is a path and a scale (a finite C float), got {pair!r}")
            out.append((os.fspath(path), float(scale)))
        return out
    for item in _items(lora_scaled, "lora_scaled"):
        path, _, scale = item.rpartition(":")
        try:
            value = float(scale)
        except ValueError:
            value = math.nan
        if not path or not abs(value) <= _FLOAT_MAX:
            raise InvalidOptionError(f"--lora-scaled takes FNAME:SCALE[,FNAME:SCALE...], a SCALE a finite C float, "
                                     f"got {item!r}")
        out.append((path, value))
    return out


def _items(text: str | None, name: str) -> list[str]:
    if text is None:
        return []
    if not isinstance(text, str):
        raise InvalidOptionError(f"{name} must be a path (or several, comma-separated), got {text!r}")
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise InvalidOptionError(f"--{name.replace('_', '-')}: an empty path in {text!r}")
    return items


def check(path: str, architecture: str) -> list[str]:
    """The names of the model's matrices the adapter at path changes; InvalidOptionError where it is
    no LoRA adapter for this architecture (llama.cpp would refuse it at load, after the model)."""
    if not os.path.isfile(path):
        raise InvalidOptionError(f"LoRA adapter not found: {path}")
    try:
        reader = gguf.GGUFReader(path)
        fields = {key: reader.fields[key].contents() for key in ("general.type", "general.architecture",
                                                                  "adapter.type", ALPHA_KEY) if key in reader.fields}
        alpha_types = reader.fields[ALPHA_KEY].types if ALPHA_KEY in reader.fields else [gguf.GGUFValueType.FLOAT32]
        names = [t.name for t in reader.tensors]
        odd = [(t.name, t.tensor_type.name) for t in reader.tensors if t.tensor_type in _NOT_MULTIPLIED]
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise InvalidOptionError(f"{path} is not a GGUF LoRA adapter: {e}") from None
    if fields.get("general.type") != "adapter" or fields.get("adapter.type") != "lora":
        raise InvalidOptionError(f"{path} is not a LoRA adapter (its general.type is {fields.get('general.type')!r}, "
                                 f"adapter.type {fields.get('adapter.type')!r}): llama.cpp's convert_lora_to_gguf.py "
                                 "makes one")
    if fields.get("general.architecture") != architecture:
        raise InvalidOptionError(f"{path} is a LoRA adapter for {fields.get('general.architecture')!r}, the model is "
                                 f"{architecture!r}")
    # llama.cpp reads alpha as a float32 (another type ends the process on its internal check)
    if alpha_types != [gguf.GGUFValueType.FLOAT32] or not math.isfinite(fields.get(ALPHA_KEY, 0.0)):
        raise InvalidOptionError(f"{path}: {ALPHA_KEY} must be a finite float32, got {fields[ALPHA_KEY]!r}")
    if odd:
        raise InvalidOptionError(f"{path}: tensor {odd[0][0]} is of type {odd[0][1]}; llama.cpp applies adapters of "
                                 "float (f32, f16, bf16) or quantized tensors")
    return sorted({name.rsplit(".lora_", 1)[0] for name in names if ".lora_" in name})


def expert_matrices(changed: list[str]) -> list[str]:
    """Those of changed that are routed experts' matrices."""
    return [name for name in changed if EXPERT_TENSOR_MARK in name]


def as_llama_cpp_python(options: dict) -> dict:
    """llama-cpp-python's Llama arguments of the adapters in `options` (by name, as given): it takes one."""
    given = adapters(options.get("lora"), options.get("lora_scaled"))
    if len(given) > 1:
        raise InvalidOptionError(f"stock llama-cpp-python takes one LoRA adapter, {len(given)} are given")
    return {"lora_path": given[0][0], "lora_scale": given[0][1]} if given else {}
