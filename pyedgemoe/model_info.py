"""What a GGUF file holds, read from its header alone: architecture, experts and bytes.

Expert bytes are those of the stacked routed experts (pyedgemoe/gguf_format.py); shared experts
(`_shexp`) run for every token, so they count as non-expert (always resident) bytes.

A multi-precision file (docs/format.md) holds each expert tensor twice: the HIGH copy under the
standard name and the LOW copy under the `.lowbit` name; `expert_bytes_per_layer` counts both,
`high_expert_bytes_per_layer` / `low_expert_bytes_per_layer` each one.
"""
from __future__ import annotations

import math
import os
import struct
from collections import defaultdict
from dataclasses import dataclass, field

from pyedgemoe import _native, kv_overrides
from pyedgemoe.errors import InvalidOptionError, ModelLoadError
from pyedgemoe.gguf_format import (
    FORMAT_VERSION,
    FORMAT_VERSION_KEY,
    HIGH_TYPE_KEY,
    LOW_COPY_SUFFIX,
    LOW_TYPE_KEY,
    expert_stack_layer,
    is_low_copy,
    low_copy_name,
    parse_expert_tensor,
)


@dataclass
class ModelInfo:
    path: str  # the file given: a split GGUF's first shard
    files: tuple[str, ...]  # the GGUF's files: path, or a split GGUF's shards (llama.cpp's gguf-split)
    file_bytes: int  # of them all
    architecture: str
    name: str
    n_layers: int
    n_experts: int
    n_experts_used: int
    n_experts_shared: int
    expert_bytes_per_layer: dict[int, int]
    non_expert_bytes: int
    tensor_types: dict[str, int]  # ggml type name -> bytes of tensors of that type
    multi_precision: bool
    metadata: dict = field(repr=False, default_factory=dict)  # the header's key-values, --override-kv's in place
    metadata_as_made: dict = field(repr=False, default_factory=dict)  # the header's own, without them
    # Multi-precision files only (None / empty for a standard file).
    format_version: int | None = None
    high_type: str | None = None  # edgemoe.high_type: ggml type of the HIGH expert copies
    low_type: str | None = None  # edgemoe.low_type: ggml type of (most of) the LOW expert copies
    high_expert_bytes_per_layer: dict[int, int] = field(default_factory=dict)
    low_expert_bytes_per_layer: dict[int, int] = field(default_factory=dict)
    # of the HIGH expert copies, the bytes llama.cpp's CPU backend keeps a repacked copy of here
    repacked_expert_bytes: int = 0
    # the largest one expert's projection of a type the CPU repacks (HIGH or LOW): a read into a
    # repacked cache slot goes through a staging buffer of its size (ggml converts a tensor whole)
    largest_repacked_projection: int = 0
    # the input embedding's, where it is not also the output matrix: a run reads only the rows of
    # the tokens it sees, so mapped, most of it never takes a page
    cold_embedding_bytes: int = 0
    # the largest stacked HIGH expert tensor's share of its layer's HIGH expert bytes: of an expert
    # cache, the share its largest pool takes (one tensor per projection)
    largest_projection_share: float = 0.0
    # biases of the expert stacks (GPT-OSS's): resident, added by expert id, so no mixed precision
    expert_biases: bool = False
    # why the FFN needs the router's own choice of experts ('' where any choice serves): what
    # cache-aware routing and stand-ins cannot run on (native/src/expert-layout.cpp's reasons)
    fixed_routing: str = ""
    # recurrent layers (alone or beside attention): their state cannot drop the last tokens it took
    recurrent: bool = False

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0 and bool(self.expert_bytes_per_layer)

    @property
    def expert_bytes(self) -> int:
        return sum(self.expert_bytes_per_layer.values())

    @property
    def high_expert_bytes(self) -> int:
        return sum(self.high_expert_bytes_per_layer.values())

    @property
    def low_expert_bytes(self) -> int:
        return sum(self.low_expert_bytes_per_layer.values())

    def minimum_cache_bytes(self, low: bool = True) -> int:
        """The smallest expert cache the runtime takes (native/src/expert-budget.cpp): per pool of
        layers with one expert shape, one layer's top-k experts in HIGH, and with LOW copies (low:
        low precision on) all but one of them in LOW too."""
        if not self.is_moe:
            return 0
        k, n = self.n_experts_used, self.n_experts
        shapes = {(self.high_expert_bytes_per_layer.get(l, b), self.low_expert_bytes_per_layer.get(l, 0) if low else 0)
                  for l, b in self.expert_bytes_per_layer.items()}
        return sum(k * high // n + (k - 1) * low_bytes // n for high, low_bytes in shapes)

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "files": list(self.files),
            "file_bytes": self.file_bytes,
            "architecture": self.architecture,
            "name": self.name,
            "n_layers": self.n_layers,
            "is_moe": self.is_moe,
            "n_experts": self.n_experts,
            "n_experts_used": self.n_experts_used,
            "n_experts_shared": self.n_experts_shared,
            "expert_bytes": self.expert_bytes,
            "expert_bytes_per_layer": {str(k): v for k, v in sorted(self.expert_bytes_per_layer.items())},
            "non_expert_bytes": self.non_expert_bytes,
            "tensor_types": self.tensor_types,
            "multi_precision": self.multi_precision,
            "format_version": self.format_version,
            "high_type": self.high_type,
            "low_type": self.low_type,
            "high_expert_bytes": self.high_expert_bytes,
            "low_expert_bytes": self.low_expert_bytes,
            "high_expert_bytes_per_layer": {str(k): v for k, v in sorted(self.high_expert_bytes_per_layer.items())},
            "low_expert_bytes_per_layer": {str(k): v for k, v in sorted(self.low_expert_bytes_per_layer.items())},
            "repacked_expert_bytes": self.repacked_expert_bytes,
            "largest_repacked_projection": self.largest_repacked_projection,
            "cold_embedding_bytes": self.cold_embedding_bytes,
            "largest_projection_share": self.largest_projection_share,
        }


def read_model_info(path: str | os.PathLike, overrides: str | None = None) -> ModelInfo:
    """Parse a GGUF header; ModelLoadError if the file is missing, not a GGUF, or truncated.
    overrides: --override-kv's text (kv_overrides.canonical), applied to the metadata."""
    if not isinstance(path, (str, os.PathLike)):
        raise ModelLoadError(f"the model must be a file's path, got {path!r}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"model file not found: {path}")
    if not os.path.isfile(path):
        raise ModelLoadError(f"not a file: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"not a GGUF file (bad magic): {path}")
    try:
        info = _native.read_gguf_info(path)
    except (RuntimeError, UnicodeDecodeError) as e:
        # ggml's parser takes any bytes; the binding's conversion to str is what refuses non-UTF-8
        where = non_utf8_string(path)
        if where is not None:
            raise ModelLoadError(f"corrupt GGUF header in {path}: {where} is not valid UTF-8") from None
        raise ModelLoadError(f"corrupt GGUF header: {e}" if str(path) in str(e) else
                             f"corrupt GGUF header in {path}: {e}") from None

    sizes = [os.path.getsize(f) for f in info["files"]]
    for i, (shard, size) in enumerate(zip(info["files"], sizes)):
        data_end = max((t["offset"] + t["nbytes"] for t in info["tensors"] if t["file"] == i), default=0)
        if data_end > size:
            raise ModelLoadError(f"truncated GGUF: {shard} has {size} bytes but its tensors need {data_end}")

    for t in info["tensors"]:
        if t["type"] in _NOT_WEIGHT_TYPES:
            # llama.cpp loads such a file and crashes in the first matmul (SIGSEGV), stock too
            raise ModelLoadError(f"tensor {t['name']!r} in {path} has type {t['type']}: model weights are float or "
                                 "quantized types, which llama.cpp computes with")

    problem = _hyperparameter_problem(info["kv"])
    if problem:
        raise ModelLoadError(f"corrupt GGUF header in {path}: {problem}")
    kv = kv_overrides.applied(info["kv"], overrides)
    arch = str(kv.get("general.architecture", "unknown"))
    problem = _hyperparameter_problem(kv)
    if problem:
        raise InvalidOptionError(f"--override-kv: {problem}")
    _check_experts(path, kv, arch)

    def arch_int(key: str) -> int:
        return _integer(kv.get(f"{arch}.{key}")) or 0

    expert_bytes: dict[int, int] = defaultdict(int)
    high_bytes: dict[int, int] = defaultdict(int)
    low_bytes: dict[int, int] = defaultdict(int)
    tensor_types: dict[str, int] = defaultdict(int)
    total = repacked = repacked_projection = 0
    for t in info["tensors"]:
        total += t["nbytes"]
        tensor_types[t["type"]] += t["nbytes"]
        layer = expert_stack_layer(t["name"])
        if layer is not None:
            expert_bytes[layer] += t["nbytes"]
            copies = low_bytes if is_low_copy(t["name"]) else high_bytes
            copies[layer] += t["nbytes"]
            if _native.cpu_repacks(t["type"], t["shape"]):
                repacked += 0 if is_low_copy(t["name"]) else t["nbytes"]
                repacked_projection = max(repacked_projection, t["nbytes"] // t["shape"][2])  # ne[2]: experts
    n_expert_total = sum(expert_bytes.values())
    largest_share = max((t["nbytes"] / high_bytes[expert_stack_layer(t["name"])] for t in info["tensors"]
                         if expert_stack_layer(t["name"]) is not None and not is_low_copy(t["name"])), default=0.0)
    by_name = {t["name"]: t["nbytes"] for t in info["tensors"]}
    cold_embedding = by_name.get("token_embd.weight", 0) if "output.weight" in by_name else 0  # tied: read whole
    multi_precision = FORMAT_VERSION_KEY in kv
    version = _checked_format(path, kv) if multi_precision else None
    _check_low_copies(path, {t["name"]: tuple(t["shape"]) for t in info["tensors"]}, multi_precision)
    return ModelInfo(
        path=path,
        files=tuple(info["files"]),
        file_bytes=sum(sizes),
        architecture=arch,
        name=str(kv.get("general.name", "")),
        n_layers=arch_int("block_count"),
        n_experts=arch_int("expert_count"),
        n_experts_used=arch_int("expert_used_count"),
        # Qwen2-MoE and its kin have one shared expert (ffn_*_shexp) and no count of them in the file
        n_experts_shared=arch_int("expert_shared_count") or int(any("_shexp." in t["name"] for t in info["tensors"])),
        expert_bytes_per_layer=dict(expert_bytes),
        non_expert_bytes=total - n_expert_total,
        tensor_types=dict(tensor_types),
        multi_precision=multi_precision,
        metadata=kv,
        metadata_as_made=info["kv"],
        format_version=version,
        high_type=kv.get(HIGH_TYPE_KEY) if multi_precision else None,
        low_type=kv.get(LOW_TYPE_KEY) if multi_precision else None,
        high_expert_bytes_per_layer=dict(high_bytes) if multi_precision else dict(expert_bytes),  # all HIGH
        low_expert_bytes_per_layer=dict(low_bytes) if multi_precision else {},
        repacked_expert_bytes=repacked,
        largest_repacked_projection=repacked_projection,
        cold_embedding_bytes=cold_embedding,
        largest_projection_share=largest_share,
        expert_biases=any(t["name"].endswith("_exps.bias") for t in info["tensors"]),
        fixed_routing=_fixed_routing(arch, [t["name"] for t in info["tensors"]]),
        recurrent=_native.architecture_is_recurrent(arch),
    )


def _fixed_routing(arch: str, names: list[str]) -> str:
    """ModelInfo.fixed_routing of a model of these tensors."""
    if arch == "llama4":
        return "llama4 applies its routing weights before the experts, not to their outputs"
    if any(name.endswith("_exps.bias") for name in names):
        return "expert biases (*_exps.bias), which the FFN adds by expert id"
    scales = [name for name in names if name.endswith("_exps.scale")]
    return f"per-expert scales ({scales[0]})" if scales else ""


# ggml's types that hold no weights (integer indices, f64): no matmul or norm of llama.cpp takes them
_NOT_WEIGHT_TYPES = {"i8", "i16", "i32", "i64", "f64"}


def _integer(value) -> int | None:
    """value if it is an integer (a float with an integral value counts), else None."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


# The architecture's numbers that pyedgemoe computes with before llama.cpp sees the file (expert
# bytes, the KV cache and compute buffers: memory_budget.py): llama.cpp stores them as unsigned
# integers, or as per-layer arrays. ModelInfo.metadata hands them on checked.
_HYPERPARAMETERS = ("block_count", "expert_count", "expert_used_count", "expert_shared_count", "context_length",
                    "embedding_length", "feed_forward_length", "expert_feed_forward_length",
                    "expert_shared_feed_forward_length", "vocab_size", "attention.head_count",
                    "attention.head_count_kv", "attention.key_length", "attention.value_length")
_TOKENS_KEY = "tokenizer.ggml.tokens"


def _hyperparameter_problem(kv: dict) -> str | None:
    """What is wrong with the _HYPERPARAMETERS and the vocabulary of kv (a file's, or with
    --override-kv's in place), if anything."""
    arch = str(kv.get("general.architecture", "unknown"))
    for name in _HYPERPARAMETERS:
        key = f"{arch}.{name}"
        value = kv.get(key)
        if value is None or isinstance(value, dict):  # absent, or an array (model_info gives its length)
            continue
        if _integer(value) is None or value < 0:
            return f"{key} is {value!r}, not a count"
    if _TOKENS_KEY in kv and not isinstance(kv[_TOKENS_KEY], dict):
        return f"{_TOKENS_KEY} is {kv[_TOKENS_KEY]!r}, not an array"
    return None


LLAMA_MAX_EXPERTS = 1024  # llama.cpp's (src/llama-hparams.h)


def _check_experts(path: str, kv: dict, arch: str) -> None:
    """llama.cpp's checks of the experts' counts at load (llama-model.cpp's GGML_ASSERTs, which end
    the process), made first: a file that fails one is a ModelLoadError. A per-layer array is left
    to llama.cpp."""
    def count(name: str) -> int | None:
        value = kv.get(f"{arch}.{name}", 0)
        return None if isinstance(value, dict) else _integer(value)
    n_expert, used, groups, groups_used = (count(name) for name in ("expert_count", "expert_used_count",
                                                                    "expert_group_count", "expert_group_used_count"))
    if None in (n_expert, used, groups, groups_used):
        return
    key = f"{arch}.expert"
    problems = (
        (n_expert > LLAMA_MAX_EXPERTS, f"{key}_count is {n_expert}, more than llama.cpp takes ({LLAMA_MAX_EXPERTS})"),
        (used > n_expert, f"{key}_used_count is {used}, more than {key}_count ({n_expert})"),
        (n_expert and not used, f"{key}_used_count is 0 (or absent) with {n_expert} experts"),
        (n_expert and groups >= n_expert, f"{key}_group_count is {groups}, not fewer than the experts ({n_expert})"),
        (groups > 1 and (n_expert % groups or groups_used >= groups), f"{key}_group_count {groups} does not divide "
         f"the experts ({n_expert}) or is not more than {key}_group_used_count ({groups_used})"),
        (not n_expert and groups, f"{key}_group_count is {groups} without experts"),
    )
    problem = next((text for failed, text in problems if failed), None)
    if problem is not None:
        raise ModelLoadError(f"corrupt GGUF header in {path}: {problem}")


def _checked_format(path: str, kv: dict) -> int:
    """The multi-precision format version (docs/format.md), refused when it is not an integer this
    pyedgemoe reads; and the type names, which must be strings."""
    value = kv[FORMAT_VERSION_KEY]
    version = _integer(value)
    if version is None or version < 1:
        raise ModelLoadError(f"corrupt GGUF header in {path}: {FORMAT_VERSION_KEY} is {value!r}, not a version number")
    if version > FORMAT_VERSION:
        raise ModelLoadError(f"{path} is a multi-precision GGUF of format version {version}; this pyedgemoe reads "
                             f"version {FORMAT_VERSION} and older: upgrade pyedgemoe")
    for key in (HIGH_TYPE_KEY, LOW_TYPE_KEY):
        if key in kv and not isinstance(kv[key], str):
            raise ModelLoadError(f"corrupt GGUF header in {path}: {key} is {kv[key]!r}, not a ggml type name")
    return version


def _check_low_copies(path: str, shapes: dict[str, tuple], multi_precision: bool) -> None:
    """docs/format.md: a multi-precision file has a LOW copy of every expert tensor, of its shape; a
    standard one none. shapes: each tensor's, by name."""
    for name in shapes:
        if is_low_copy(name):
            if not multi_precision:
                raise ModelLoadError(f"corrupt GGUF header in {path}: it has the LOW expert copy {name} but no "
                                     f"{FORMAT_VERSION_KEY} (docs/format.md)")
            high = name.removesuffix(LOW_COPY_SUFFIX) + ".weight"
            if expert_stack_layer(name) is None or high not in shapes:
                raise ModelLoadError(f"corrupt GGUF header in {path}: {name} is not the LOW copy of an expert tensor")
            if shapes[name] != shapes[high]:
                raise ModelLoadError(f"corrupt GGUF header in {path}: the LOW copy {name} has shape "
                                     f"{list(shapes[name])}, its tensor {list(shapes[high])}")
        elif multi_precision and parse_expert_tensor(name) is not None and low_copy_name(name) not in shapes:
            raise ModelLoadError(f"corrupt GGUF header in {path}: multi-precision, but the expert tensor {name} "
                                 f"has no LOW copy {low_copy_name(name)}")


def non_utf8_string(path: str) -> str | None:
    """Where the GGUF header holds a string that is not UTF-8 ("key 'general.name'", "the key
    b'...'", "tensor name b'...'"), or None if none is found before the header ends or stops making
    sense. Walks the header as ggml's gguf.cpp reads it (docs/format.md); used only to explain an error."""
    try:
        with open(path, "rb") as f:
            return _Walker(f, os.fstat(f.fileno()).st_size).first_non_utf8()
    except (OSError, ValueError, struct.error):
        return None


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9


class _Walker:
    def __init__(self, f, size: int):
        self.f, self.size = f, size

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def read(self, n: int) -> bytes:
        if n > self.size - self.f.tell():
            raise ValueError("past the end of the file")
        return self.f.read(n)

    def string(self) -> bytes:
        return self.read(self.u64())

    def first_non_utf8(self) -> str | None:
        self.read(4)  # magic
        _version, n_tensors, n_kv = self.u32(), self.u64(), self.u64()
        for _ in range(min(n_kv, self.size)):
            key = self.string()
            if not _utf8(key):
                return f"the key {key!r}"
            name = key.decode()
            vtype = self.u32()
            if vtype == _STRING and not _utf8(self.string()):
                return f"the value of key {name!r}"
            if vtype == _ARRAY:
                item_type, n = self.u32(), self.u64()
                if n > self.size:
                    return None
                for i in range(n):
                    if item_type == _STRING:
                        if not _utf8(self.string()):
                            return f"item {i} of key {name!r}"
                    elif item_type in _SCALAR_SIZES:
                        self.read(_SCALAR_SIZES[item_type] * (n - i))
                        break
                    else:
                        return None
            elif vtype in _SCALAR_SIZES:
                self.read(_SCALAR_SIZES[vtype])
            elif vtype != _STRING:
                return None
        for _ in range(min(n_tensors, self.size)):
            name = self.string()
            if not _utf8(name):
                return f"the tensor name {name!r}"
            self.read(8 * self.u32() + 4 + 8)  # dims, type, offset
        return None


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
