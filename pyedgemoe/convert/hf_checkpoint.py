"""A Hugging Face checkpoint directory read lazily: config.json plus safetensors shards.

Only the shard headers are parsed up front (names, dtypes, shapes, byte ranges, all validated);
tensor data is read with `os.pread`, one tensor (or a range of its rows) at a time, straight into
a float32 array. No mmap: pages of a mapped multi-GB shard would stay in the process's RSS
until the map is closed, and peak memory must not grow with model size (issue 3).

The safetensors format: 8 bytes little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the data;
offsets are relative to the end of the header.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

from pyedgemoe.errors import ConversionError

# safetensors dtype -> (numpy dtype of the stored elements, bytes per element). BF16 is read as
# uint16 and widened by hand: numpy has no bfloat16.
_DTYPES: dict[str, tuple[np.dtype, int]] = {
    "F64": (np.dtype("<f8"), 8),
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),
    "I64": (np.dtype("<i8"), 8),
    "I32": (np.dtype("<i4"), 4),
    "I16": (np.dtype("<i2"), 2),
    "I8": (np.dtype("i1"), 1),
    "U8": (np.dtype("u1"), 1),
    "BOOL": (np.dtype("?"), 1),
}
# Valid safetensors dtypes we refuse: their values need scales stored in other tensors.
_UNSUPPORTED_DTYPES = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "U16", "U32", "U64"}

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit

# config.json's hyperparameters as the families read them (family.py, the family modules): checked
# here, once, so that a value of the wrong type or range is one error naming its key, not a TypeError
# or ZeroDivisionError inside a family. Absent keys are the family's business (it knows which it needs).
# Sizes and counts the families divide by or allocate with: an integer >= 1.
_SIZE_KEYS = ("hidden_size", "n_embd", "dim", "num_attention_heads", "n_head", "n_heads", "num_hidden_layers",
              "n_layers", "n_layer", "num_layers", "num_local_experts", "num_experts", "n_routed_experts",
              "num_experts_per_tok", "num_experts_per_token", "top_k_experts", "intermediate_size",
              "moe_intermediate_size", "vocab_size", "max_position_embeddings", "n_positions", "n_ctx",
              "num_key_value_heads", "n_kv_heads", "n_head_kv", "head_dim", "v_head_dim", "qk_nope_head_dim",
              "qk_rope_head_dim", "kv_lora_rank", "q_lora_rank", "original_max_position_embeddings",
              "decoder_sparse_step", "moe_layer_freq", "n_group", "topk_group")
# counts that may be 0
_COUNT_KEYS = ("n_shared_experts", "shared_expert_intermediate_size", "first_k_dense_replace", "sliding_window")
# finite non-negative numbers (epsilons, rope bases and factors)
_NUMBER_KEYS = ("rms_norm_eps", "norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", "rope_theta",
                "rotary_emb_base", "global_rope_theta", "local_rope_theta", "partial_rotary_factor", "clip_qkv",
                "routed_scaling_factor")
# null means "absent" to the families for these (real configs write `"head_dim": null`)
_NULLABLE_KEYS = {"head_dim", "sliding_window", "q_lora_rank", "num_key_value_heads", "vocab_size", "clip_qkv",
                  "n_group", "topk_group", "decoder_sparse_step", "moe_layer_freq", "n_shared_experts",
                  "shared_expert_intermediate_size", "first_k_dense_replace", "rope_theta",
                  "partial_rotary_factor", "original_max_position_embeddings"}
# switches: true or false (a string "false" is true to Python; transformers refuses it)
_BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "lm_head_bias", "is_causal", "norm_topk_prob", "mlp_bias")
# special token ids (gguf-py's SpecialVocab reads them from config.json)
_TOKEN_ID_KEYS = tuple(f"{t}_token_id" for t in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"))
_MAX_SIZE = 2**31 - 1  # GGUF stores these as u32 (int32 in llama.cpp)
_READ_CHUNK_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: shard file, absolute offset, dtype, shape (numpy order)."""
    name: str
    shard: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def n_rows(self) -> int:
        return self.shape[0] if self.shape else 1


def _parse_header(path: Path) -> dict[str, TensorEntry]:
    """The tensor directory of one safetensors file; ConversionError if it is not one."""
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConversionError(f"corrupt safetensors file {path}: shorter than its 8-byte header length")
            n = int.from_bytes(head, "little")
            if n <= 1 or n > _MAX_HEADER_BYTES or 8 + n > file_size:
                raise ConversionError(f"corrupt safetensors header in {path}: header length {n} does not fit "
                                      f"a {file_size}-byte file")
            raw = f.read(n)
    except OSError as e:
        raise ConversionError(f"cannot read {path}: {e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"corrupt safetensors header in {path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ConversionError(f"corrupt safetensors header in {path}: JSON nested too deep") from None
    if not isinstance(header, dict):
        raise ConversionError(f"corrupt safetensors header in {path}: not a JSON object")

    data_start = 8 + n
    data_size = file_size - data_start
    entries: dict[str, TensorEntry] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        # the safetensors format: a dtype name, a list of integer dims, two integer offsets (a "64" or a
        # 64.5 is not read as something else)
        if not (isinstance(meta, dict) and isinstance(meta.get("dtype"), str) and _int_list(meta.get("shape"))
                and _int_list(meta.get("data_offsets")) and len(meta["data_offsets"]) == 2):
            raise ConversionError(f"corrupt safetensors header in {path}: bad entry for tensor {name!r}")
        dtype, shape, (begin, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        if dtype in _UNSUPPORTED_DTYPES:
            raise ConversionError(f"tensor {name} in {path.name} has dtype {dtype}, which pyedgemoe cannot "
                                  f"convert (only unquantized F32/F16/BF16 checkpoints are supported)")
        if dtype not in _DTYPES:
            raise ConversionError(f"tensor {name} in {path.name} has unknown dtype {dtype!r} "
                                  f"(known: {', '.join(_DTYPES)})")
        if any(d < 0 for d in shape):
            raise ConversionError(f"corrupt safetensors header in {path}: tensor {name} has shape {list(shape)}")
        expected = prod(shape) * _DTYPES[dtype][1]
        if not (0 <= begin <= end <= data_size) or end - begin != expected:
            raise ConversionError(f"corrupt safetensors header in {path}: tensor {name} ({dtype}, "
                                  f"{list(shape)}) claims bytes {begin}..{end} of {data_size}, "
                                  f"needs {expected}")
        entries[name] = TensorEntry(name, path, data_start + begin, end - begin, dtype, shape)
    return entries


def _int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)


def _check_config(config: dict, path: Path) -> None:
    """ConversionError naming the first hyperparameter of config.json that no family could use."""
    def bad(key: str, want: str) -> ConversionError:
        return ConversionError(f"{path}: {key} is {config[key]!r}, expected {want}")

    for keys, low, want in ((_SIZE_KEYS, 1, "an integer >= 1"), (_COUNT_KEYS, 0, "an integer >= 0")):
        for key in keys:
            value = config.get(key)
            if key not in config or (value is None and key in _NULLABLE_KEYS):
                continue
            if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= _MAX_SIZE):
                raise bad(key, want)
    for key in _NUMBER_KEYS:
        value = config.get(key)
        if key not in config or (value is None and key in _NULLABLE_KEYS):
            continue
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and value >= 0):
            raise bad(key, "a finite number >= 0")
    for key in _BOOL_KEYS:
        if config.get(key) is not None and not isinstance(config[key], bool):
            raise bad(key, "true or false")
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise bad("architectures", "a list of class names")
    for key in ("rope_parameters", "rope_scaling", "quantization_config", "text_config"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise bad(key, "an object")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    for part in ("full_attention", "sliding_attention"):  # per attention kind (Gemma-style), else top level
        if part in rope and not isinstance(rope[part], dict):  # the families read it when present, null too
            raise ConversionError(f"{path}: rope {part} is {rope[part]!r}, expected an object")
    for params in (rope, rope.get("full_attention", {}), rope.get("sliding_attention", {})):
        _check_rope(params, path)
    layers = config.get("mlp_only_layers")
    if layers is not None and not (isinstance(layers, list) and all(isinstance(i, int) for i in layers)):
        raise bad("mlp_only_layers", "a list of layer numbers")
    for key in _TOKEN_ID_KEYS:
        value = config.get(key)
        # gguf-py writes an integer id as u32 and skips anything else (a list of eos ids, null)
        if isinstance(value, bool) or (isinstance(value, int) and not 0 <= value <= _MAX_SIZE):
            raise bad(key, "a token id (an integer >= 0)")


def _check_rope(rope: dict, path: Path) -> None:
    """The numbers of one set of RoPE parameters that the families write into the GGUF."""
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    for key in ("rope_theta", "factor", "original_max_position_embeddings", "partial_rotary_factor"):
        value = rope.get(key)
        if value is not None and not (number(value) and value > 0):
            raise ConversionError(f"{path}: rope {key} is {value!r}, expected a finite number > 0")
    for key in ("extrapolation_factor", "attention_factor", "attn_factor", "beta_fast", "beta_slow",
                "mscale_all_dim"):
        value = rope.get(key)
        if value is not None and not number(value):
            raise ConversionError(f"{path}: rope {key} is {value!r}, expected a finite number")
    for key in ("long_factor", "short_factor"):
        value = rope.get(key)
        if value is not None and not (isinstance(value, list) and all(number(v) for v in value)):
            raise ConversionError(f"{path}: rope {key} is {value!r}, expected a list of numbers")


def _to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored elements -> float32 (exact for F32/F16/BF16, as torch's `.to(float32)`)."""
    if dtype == "F32":
        return raw
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


class HFCheckpoint:
    """config.json + safetensors shards of one model directory; tensors read on demand."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise ConversionError(f"{self.dir} is not a directory")
        self.config = self._read_config()
        self.shards = self._find_shards()
        self._tensors: dict[str, TensorEntry] = {}
        self._order: list[str] = []
        for shard in self.shards:
            entries = _parse_header(shard)
            # llama.cpp's converter walks shards in name order and each shard's tensors by name
            # (gguf.utility.SafetensorsLocal); we keep that order so files come out alike.
            for name in sorted(entries):
                if name in self._tensors:
                    raise ConversionError(f"tensor {name} is in both {self._tensors[name].shard.name} "
                                          f"and {shard.name}")
                self._tensors[name] = entries[name]
                self._order.append(name)
        self._check_index()
        self._fds: dict[Path, int] = {}

    # -- files -----------------------------------------------------------------------------------

    def _read_config(self) -> dict:
        path = self.dir / "config.json"
        if not path.is_file():
            raise ConversionError(f"{self.dir} has no config.json: not a Hugging Face model directory")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConversionError(f"cannot read {path}: {e}") from None
        except RecursionError:
            raise ConversionError(f"cannot read {path}: JSON nested too deep") from None
        if not isinstance(config, dict):
            raise ConversionError(f"{path} is not a JSON object")
        if "text_config" in config and isinstance(config["text_config"], dict):
            config = {**config, **config["text_config"]}  # as llama.cpp's TextModel does
        _check_config(config, path)
        return config

    def _index(self) -> dict | None:
        path = self.dir / "model.safetensors.index.json"
        if not path.is_file():
            return None
        try:
            index = json.loads(path.read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, KeyError, TypeError):
            raise ConversionError(f"{path} is not a valid safetensors index (no weight_map)") from None
        for name, shard in weight_map.items():
            # a shard is a file of this directory: a path elsewhere is refused, not followed
            if not (isinstance(shard, str) and shard and Path(shard).name == shard and shard not in (".", "..")):
                raise ConversionError(f"{path}: tensor {name} is in {shard!r}, not a file name of this directory")
        return weight_map

    def _find_shards(self) -> list[Path]:
        weight_map = self._index()
        if weight_map is not None:
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (self.dir / n).is_file()]
            if missing:
                raise ConversionError(f"{self.dir} is missing shard(s) {', '.join(missing)} listed in "
                                      f"model.safetensors.index.json; download the whole checkpoint")
            return [self.dir / n for n in names]
        shards = sorted(p for p in self.dir.glob("model*.safetensors") if p.is_file())
        if shards:
            return shards
        if any(self.dir.glob("pytorch_model*.bin")) or any(self.dir.glob("*.pt")):
            raise ConversionError(f"{self.dir} has only PyTorch pickle weights (.bin); pyedgemoe reads "
                                  f"safetensors only (re-save the model with save_pretrained, safe_serialization=True)")
        raise ConversionError(f"{self.dir} has no model weights (model*.safetensors)")

    def _check_index(self) -> None:
        weight_map = self._index()
        if weight_map is None:
            return
        listed, found = set(weight_map), set(self._tensors)
        missing = sorted(listed - found)
        if missing:
            raise ConversionError(f"{len(missing)} tensor(s) listed in model.safetensors.index.json are not in "
                                  f"the shards (first: {missing[0]}): incomplete download?")
        extra = sorted(found - listed)
        if extra:
            raise ConversionError(f"shards hold {len(extra)} tensor(s) not in model.safetensors.index.json "
                                  f"(first: {extra[0]})")

    # -- tensors ---------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """All tensor names, in llama.cpp's converter order."""
        return list(self._order)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def entry(self, name: str) -> TensorEntry:
        try:
            return self._tensors[name]
        except KeyError:
            raise ConversionError(f"tensor {name} not found in {self.dir}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self._tensors.values())

    def read(self, name: str) -> np.ndarray:
        """The whole tensor as float32, in its stored (numpy) shape."""
        e = self.entry(name)
        return self.read_rows(name, 0, e.n_rows)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows start..stop (along dim 0) as float32, shape (stop - start, *shape[1:])."""
        e = self.entry(name)
        np_dtype, itemsize = _DTYPES[e.dtype]
        if not e.shape:
            start, stop, row_shape = 0, 1, ()
        else:
            row_shape = e.shape[1:]
        if not (0 <= start <= stop <= e.n_rows):
            raise ConversionError(f"rows {start}..{stop} out of range for {name} {list(e.shape)}")
        row_bytes = prod(row_shape) * itemsize
        raw = self._pread(e.shard, e.offset + start * row_bytes, (stop - start) * row_bytes, name)
        data = _to_float32(np.frombuffer(raw, dtype=np_dtype), e.dtype)
        return data.reshape((stop - start, *row_shape) if e.shape else ())

    def _pread(self, shard: Path, offset: int, nbytes: int, name: str) -> bytearray:
        fd = self._fds.get(shard)
        if fd is None:
            try:
                fd = os.open(shard, os.O_RDONLY)
            except OSError as e:
                raise ConversionError(f"cannot open {shard}: {e}") from None
            self._fds[shard] = fd
        buf = bytearray(nbytes)
        view = memoryview(buf)
        done = 0
        try:
            while done < nbytes:
                n = os.preadv(fd, [view[done:done + _READ_CHUNK_BYTES]], offset + done)
                if n == 0:
                    raise ConversionError(f"{shard} is truncated: tensor {name} ends past the end of the file")
                done += n
        except OSError as e:
            raise ConversionError(f"cannot read tensor {name} from {shard}: {e}") from None
        return buf

    def close(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
