#!/usr/bin/env python3
"""Write a standard llama.cpp GGUF with the real geometry of a known MoE model and random weights.

Speed benchmarks (docs/benchmarks.md) need models whose per-layer shapes, expert sizes and file
layout match the real checkpoints, but not their weights. This script writes such a file straight
to GGUF, streaming: the header, metadata and tensor index go first, then every tensor's data in
row chunks of 4 M weights, so peak memory does not grow with the model: 0.2 GB for OLMoE geometry
(16 layers, 7.4 GB written), 0.56 GB for Qwen3's (its 152k-token vocabulary is most of that).

    python scripts/make_synthetic_gguf.py --geometry olmoe-1b-7b --layers 4 --type q8_0 \\
        -o build/bench/olmoe-L4-q8_0.gguf

Each geometry is one table entry (GEOMETRIES); tensor names and shapes follow the vendored
llama.cpp loaders (src/models/<arch>.cpp). The tokenizer is copied from one of llama.cpp's
vocab-only GGUFs (native/vendor/llama.cpp/models/ggml-vocab-*.gguf), and the embedding and
output matrices are sized to its token count.

Weights are N(0, 0.02), token embeddings N(0, 1), attn_output and ffn_down_exps N(0, 0.02/sqrt(2L))
(L = the real model's layer count), norm weights 1: with RMS norms (and, where the model has them,
q/k norms) activations stay O(1), so greedy generation runs without NaN. The router is random
and the current token dominates the residual stream, so expert choice is close to uniform over
tokens: the worst case for an expert cache, which is what the memory-capped benchmarks want to
stress (EMBEDDING_STD says why embeddings and output projections are not simply 0.02).

Types: f32, f16, q8_0 and q4_0 are written with gguf-py's numpy quantizer; q4_k (the type a 30B
model needs to fit in RAM, which gguf-py cannot write), q3_k and q2_k go through ggml's own
quantizer in pyedgemoe._native, so they need the built package (make setup). All weight matrices
get the one type (like llama-quantize --pure); norms and routers stay f32. The random values
depend on the seed, the geometry, the layers and the row pool alone, not on the type: two files
that differ only in type are two quants of one model (a q2_k file is a `--low-from` for a q4_k one).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QType
from gguf import MODEL_TENSOR as T

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB_DIR = REPO_ROOT / "native" / "vendor" / "llama.cpp" / "models"

WEIGHT_STD = 0.02
# The residual stream must stay dominated by the current token. With every weight N(0, 0.02) the
# token embedding is tiny next to what attention adds (an average over the context, alike for all
# tokens) and layer outputs pile up the same way: every token's residual looks alike, routing
# collapses onto a few experts (an LRU cache of 15% of the experts hit 64-73% on 4 layers of
# OLMoE geometry) and greedy decoding cycles through 3-5 tokens. So token embeddings are N(0, 1),
# and the residual-branch output projections (attn_output, ffn_down_exps) N(0, 0.02/sqrt(2 L)).
# Then routing is close to uniform (LRU hit rate at 15% of the experts: 10-15% in every layer)
# and greedy output does not cycle: routing spread over all the experts, as the benchmarks'
# roofline assumes (docs/benchmarks.md).
EMBEDDING_STD = 1.0
# Row chunk written at a time: bounds peak memory (f32 chunk + its quantized copy) to ~32 MB.
CHUNK_ELEMENTS = 4 * 1024 * 1024
DEFAULT_ROW_POOL = 16384  # rows per (row length, type) when a pool is used: ~20-130 MB at q4_k
GGUF_ALIGNMENT = 4096  # lets an expert's bytes be read with O_DIRECT (docs/format.md, "Alignment")

# name on the command line -> (ggml type, general.file_type)
TYPES: dict[str, tuple[QType, gguf.LlamaFileType]] = {
    "f32": (QType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (QType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (QType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (QType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    # No file type says "all q4_K"; Q4_K_S is the closest (llama-quantize mixes in a little q5_K).
    "q4_k": (QType.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_S),
    # LOW copies for --low-from (docs/mixed-precision.md): a file of the same seed and row pool holds
    # the same random weights, so it is a lower quant of the same model
    "q3_k": (QType.Q3_K, gguf.LlamaFileType.MOSTLY_Q3_K_S),
    "q2_k": (QType.Q2_K, gguf.LlamaFileType.MOSTLY_Q2_K),
}
# Types gguf-py cannot quantize: ggml's quantizer through our native module, by ggml type name.
NATIVE_QUANTIZER_TYPES = {QType.Q4_K: "q4_K", QType.Q3_K: "q3_K", QType.Q2_K: "q2_K"}


@dataclass(frozen=True)
class Geometry:
    """Shapes and hyper-parameters of one real model, as its HF config and llama.cpp see them."""

    arch: gguf.MODEL_ARCH
    source: str  # HF model the numbers come from (provenance only)
    n_layer: int  # layers of the real model (default for --layers)
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int  # intermediate size of one expert
    n_ff: int  # value written to {arch}.feed_forward_length
    write_expert_ff_length: bool  # arch reads n_ff_exp from {arch}.expert_feed_forward_length
    qk_norm: str | None  # "full": over all q (or k) rows (OLMoE); "head": per head (Qwen3); None
    context_length: int
    rope_theta: float
    rms_eps: float
    vocab_file: str  # under native/vendor/llama.cpp/models/
    tokenizer_pre: str | None  # tokenizer.ggml.pre to set when the vocab file has none
    types: tuple[str, ...]  # --type values allowed for this geometry


GEOMETRIES: dict[str, Geometry] = {
    # allenai/OLMoE-1B-7B-0924 config.json; real vocab 50304 (50280 used), the gpt-neox-20b
    # vocab file has 50432 entries: 128 extra rows, 0.5 MB in all.
    "olmoe-1b-7b": Geometry(
        arch=gguf.MODEL_ARCH.OLMOE, source="allenai/OLMoE-1B-7B-0924",
        n_layer=16, n_embd=2048, n_head=16, n_head_kv=16, head_dim=128,
        n_expert=64, n_expert_used=8, n_ff_exp=1024, n_ff=1024, write_expert_ff_length=False,
        qk_norm="full", context_length=4096, rope_theta=10000.0, rms_eps=1e-5,
        vocab_file="ggml-vocab-gpt-neox.gguf", tokenizer_pre="olmo",
        types=("q8_0", "f16", "f32", "q4_0", "q4_k", "q3_k", "q2_k"),
    ),
    # Qwen/Qwen3-30B-A3B config.json. 48 layers: q4_k 17 GB (the usual benchmark file, needs
    # pyedgemoe._native), q4_0 17 GB, q8_0 32 GB, f16 61 GB; f32 (122 GB) is not offered.
    "qwen3-30b-a3b": Geometry(
        arch=gguf.MODEL_ARCH.QWEN3MOE, source="Qwen/Qwen3-30B-A3B",
        n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
        n_expert=128, n_expert_used=8, n_ff_exp=768, n_ff=6144, write_expert_ff_length=True,
        qk_norm="head", context_length=40960, rope_theta=1000000.0, rms_eps=1e-6,
        vocab_file="ggml-vocab-qwen2.gguf", tokenizer_pre=None,
        types=("q8_0", "f16", "q4_0", "q4_k", "q3_k", "q2_k"),
    ),
    # mistralai/Mixtral-8x7B-v0.1 config.json; llama.cpp runs it as arch "llama" with experts.
    # One layer's stacked experts are 1.4 G weights (1.5 GB at q8_0): use few layers.
    "mixtral-8x7b": Geometry(
        arch=gguf.MODEL_ARCH.LLAMA, source="mistralai/Mixtral-8x7B-v0.1",
        n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128,
        n_expert=8, n_expert_used=2, n_ff_exp=14336, n_ff=14336, write_expert_ff_length=False,
        qk_norm=None, context_length=32768, rope_theta=1000000.0, rms_eps=1e-5,
        vocab_file="ggml-vocab-llama-spm.gguf", tokenizer_pre=None,
        types=("q8_0", "f16", "q4_0", "q4_k"),
    ),
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the contiguous row length
    role: str  # "weight" (random, in --type), "router" (random, f32), "norm" (ones, f32)
    std: float = WEIGHT_STD  # of the random values


def tensor_specs(geo: Geometry, n_layer: int, n_vocab: int,
                 embedding_std: float = EMBEDDING_STD) -> list[TensorSpec]:
    """Tensors in the order llama.cpp's converter writes them, shapes as the loader checks them."""

    def name(t: T, bid: int | None = None) -> str:
        base = gguf.TENSOR_NAMES[t]
        return (base.format(bid=bid) if bid is not None else base) + ".weight"

    n_q = geo.n_head * geo.head_dim
    # GPT-2's scaled init for the projections that write into the residual stream, over the real
    # model's depth (so a file with fewer layers has the same per-layer weights): see EMBEDDING_STD.
    out_std = WEIGHT_STD / math.sqrt(2 * geo.n_layer)
    n_kv = geo.n_head_kv * geo.head_dim
    qk_norm_len = {"full": (n_q, n_kv), "head": (geo.head_dim, geo.head_dim)}.get(geo.qk_norm or "")

    specs = [TensorSpec(name(T.TOKEN_EMBD), (geo.n_embd, n_vocab), "weight", embedding_std)]
    for i in range(n_layer):
        specs += [
            TensorSpec(name(T.ATTN_NORM, i), (geo.n_embd,), "norm"),
            TensorSpec(name(T.ATTN_Q, i), (geo.n_embd, n_q), "weight"),
            TensorSpec(name(T.ATTN_K, i), (geo.n_embd, n_kv), "weight"),
            TensorSpec(name(T.ATTN_V, i), (geo.n_embd, n_kv), "weight"),
            TensorSpec(name(T.ATTN_OUT, i), (n_q, geo.n_embd), "weight", out_std),
        ]
        if qk_norm_len is not None:
            specs += [
                TensorSpec(name(T.ATTN_Q_NORM, i), (qk_norm_len[0],), "norm"),
                TensorSpec(name(T.ATTN_K_NORM, i), (qk_norm_len[1],), "norm"),
            ]
        specs += [
            TensorSpec(name(T.FFN_NORM, i), (geo.n_embd,), "norm"),
            # llama-quantize keeps the router in f32; so do we.
            TensorSpec(name(T.FFN_GATE_INP, i), (geo.n_embd, geo.n_expert), "router"),
            TensorSpec(name(T.FFN_GATE_EXP, i), (geo.n_embd, geo.n_ff_exp, geo.n_expert), "weight"),
            TensorSpec(name(T.FFN_DOWN_EXP, i), (geo.n_ff_exp, geo.n_embd, geo.n_expert), "weight", out_std),
            TensorSpec(name(T.FFN_UP_EXP, i), (geo.n_embd, geo.n_ff_exp, geo.n_expert), "weight"),
        ]
    specs += [
        TensorSpec(name(T.OUTPUT_NORM), (geo.n_embd,), "norm"),
        TensorSpec(name(T.OUTPUT), (geo.n_embd, n_vocab), "weight"),
    ]
    return specs


def tensor_type(spec: TensorSpec, weight_type: QType) -> QType:
    return weight_type if spec.role == "weight" else QType.F32


def tensor_nbytes(spec: TensorSpec, qtype: QType) -> int:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_rows = int(np.prod(spec.ne[1:], dtype=np.int64))
    assert spec.ne[0] % block_size == 0, f"{spec.name}: row length {spec.ne[0]} not a multiple of {block_size}"
    return n_rows * (spec.ne[0] // block_size) * type_size


def convert_rows(x: np.ndarray, qtype: QType) -> np.ndarray:
    """float32 [n, row] -> [n, bytes or elements per row] in qtype."""
    if qtype == QType.F32:
        return x
    if qtype == QType.F16:
        return x.astype(np.float16)
    if qtype in NATIVE_QUANTIZER_TYPES:
        q = _native_module().quantize(x, NATIVE_QUANTIZER_TYPES[qtype], os.cpu_count() or 1)
        return q.reshape(x.shape[0], -1)
    return gguf.quants.quantize(x, qtype)


class RowSource:
    """Rows of random weights, already in the tensor's type.

    By default every row is drawn fresh. With a row pool of R, `R` random rows per (row length,
    type) are converted once and every row written is a randomly picked copy of one of them: the
    matrices still look random (and experts differ), but writing runs at disk speed instead of
    quantizer speed. That matters for K-quants: ggml's reference Q4_K quantizer manages ~2 M
    weights/s on 2 cores, hours for a 30B model.
    """

    def __init__(self, rng: np.random.Generator, row_pool: int):
        self.rng = rng
        self.row_pool = row_pool
        self._pools: dict[tuple[int, QType, float], np.ndarray] = {}

    def _fresh(self, n: int, row: int, qtype: QType, std: float) -> np.ndarray:
        x = self.rng.standard_normal((n, row), dtype=np.float32)
        x *= std
        return convert_rows(x, qtype)

    def chunks(self, spec: TensorSpec, qtype: QType) -> Iterator[np.ndarray]:
        """The tensor's bytes as a sequence of row chunks."""
        row = spec.ne[0]
        n_rows = int(np.prod(spec.ne[1:], dtype=np.int64))
        rows_per_chunk = max(1, CHUNK_ELEMENTS // row)
        pooled = self.row_pool > 0 and spec.role == "weight"
        key = (row, qtype, spec.std)
        if pooled and key not in self._pools:
            self._pools[key] = np.concatenate(
                [self._fresh(min(rows_per_chunk, self.row_pool - i), row, qtype, spec.std)
                 for i in range(0, self.row_pool, rows_per_chunk)])
        for start in range(0, n_rows, rows_per_chunk):
            n = min(rows_per_chunk, n_rows - start)
            if spec.role == "norm":
                yield convert_rows(np.ones((n, row), dtype=np.float32), qtype)
            elif pooled:
                yield self._pools[key][self.rng.integers(0, self.row_pool, size=n)]
            else:
                yield self._fresh(n, row, qtype, spec.std)


def _native_module():
    try:
        from pyedgemoe import _native
    except ImportError as e:
        raise SystemExit(f"error: this type needs ggml's quantizer from pyedgemoe._native ({e}); "
                         "build the package first (make setup)") from None
    return _native


def copy_tokenizer(writer: gguf.GGUFWriter, vocab_path: Path, tokenizer_pre: str | None) -> int:
    """Copy every tokenizer.* entry of a vocab-only GGUF; returns its token count."""
    reader = gguf.GGUFReader(vocab_path)
    n_vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        writer.add_key_value(key, value, vtype, sub_type)
        if key == gguf.Keys.Tokenizer.LIST:
            n_vocab = len(value)
    if tokenizer_pre is not None and gguf.Keys.Tokenizer.PRE not in reader.fields:
        writer.add_tokenizer_pre(tokenizer_pre)
    if n_vocab == 0:
        raise SystemExit(f"error: {vocab_path} has no {gguf.Keys.Tokenizer.LIST}")
    return n_vocab


def add_hparams(writer: gguf.GGUFWriter, geo: Geometry, geometry_name: str, n_layer: int,
                type_name: str, seed: int, row_pool: int, embedding_std: float) -> None:
    writer.add_name(f"synthetic-{geometry_name}-L{n_layer}-{type_name}")
    rows = f"rows drawn from a pool of {row_pool} per shape" if row_pool else "every row fresh"
    writer.add_description(
        f"random weights (N(0,{WEIGHT_STD}), token embeddings N(0,{embedding_std}), residual output "
        f"projections N(0,{WEIGHT_STD}/sqrt({2 * geo.n_layer})), seed {seed}, "
        f"{rows}) with the geometry of {geo.source}, "
        f"{n_layer} of {geo.n_layer} layers; written by pyedgemoe scripts/make_synthetic_gguf.py")
    writer.add_custom_alignment(GGUF_ALIGNMENT)
    writer.add_file_type(TYPES[type_name][1])
    if TYPES[type_name][0] not in (QType.F32, QType.F16):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    writer.add_block_count(n_layer)
    writer.add_context_length(geo.context_length)
    writer.add_embedding_length(geo.n_embd)
    writer.add_feed_forward_length(geo.n_ff)
    writer.add_head_count(geo.n_head)
    writer.add_head_count_kv(geo.n_head_kv)
    writer.add_key_length(geo.head_dim)
    writer.add_value_length(geo.head_dim)
    writer.add_rope_dimension_count(geo.head_dim)
    writer.add_rope_freq_base(geo.rope_theta)
    writer.add_layer_norm_rms_eps(geo.rms_eps)
    writer.add_expert_count(geo.n_expert)
    writer.add_expert_used_count(geo.n_expert_used)
    if geo.write_expert_ff_length:
        writer.add_expert_feed_forward_length(geo.n_ff_exp)


def write_padding(fout, align: int) -> None:
    pad = (-fout.tell()) % align
    if pad:
        fout.write(b"\0" * pad)


def default_row_pool(type_name: str) -> int:
    """0 (every row fresh) where the quantizer is fast enough, a pool where it is not."""
    return DEFAULT_ROW_POOL if TYPES[type_name][0] in NATIVE_QUANTIZER_TYPES else 0


def write_synthetic_gguf(out: Path, geometry_name: str, n_layer: int | None, type_name: str,
                         seed: int, vocab_path: Path | None = None, row_pool: int | None = None,
                         embedding_std: float = EMBEDDING_STD, log=print) -> int:
    """Writes the file; returns its size in bytes."""
    geo = GEOMETRIES[geometry_name]
    if type_name not in geo.types:
        raise SystemExit(f"error: --type {type_name} is not offered for {geometry_name} "
                         f"(choose from {', '.join(geo.types)})")
    n_layer = geo.n_layer if n_layer is None else n_layer
    if n_layer < 1:
        raise SystemExit("error: --layers must be at least 1")
    vocab_path = vocab_path or VOCAB_DIR / geo.vocab_file
    if not vocab_path.is_file():
        raise SystemExit(f"error: vocab file {vocab_path} not found "
                         "(fetch the vendored llama.cpp first, or pass --vocab)")
    weight_type = TYPES[type_name][0]
    row_pool = default_row_pool(type_name) if row_pool is None else row_pool
    if row_pool < 0:
        raise SystemExit("error: --row-pool must be >= 0")
    if weight_type in NATIVE_QUANTIZER_TYPES:
        _native_module()  # fail before writing anything

    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[geo.arch])
    add_hparams(writer, geo, geometry_name, n_layer, type_name, seed, row_pool, embedding_std)
    n_vocab = copy_tokenizer(writer, vocab_path, geo.tokenizer_pre)

    specs = tensor_specs(geo, n_layer, n_vocab, embedding_std)
    for spec in specs:
        qtype = tensor_type(spec, weight_type)
        # gguf-py wants the numpy (reversed) shape of the logical elements.
        writer.add_tensor_info(spec.name, tuple(reversed(spec.ne)), np.dtype(np.float32),
                               tensor_nbytes(spec, qtype), raw_dtype=qtype)
    total = sum(tensor_nbytes(s, tensor_type(s, weight_type)) for s in specs)
    log(f"{out}: {geometry_name}, {n_layer} layers, {type_name}, vocab {n_vocab}, "
        f"{len(specs)} tensors, {total / 1e9:.2f} GB of tensor data")

    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file(out)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()

    # Tensor data: gguf-py's write_tensor_data needs the whole tensor in memory, so write the
    # chunks ourselves with the same layout (each tensor starts on an alignment boundary).
    fout = writer.fout[0]
    rows = RowSource(np.random.default_rng(seed), row_pool)
    t0 = time.monotonic()
    for spec in specs:
        qtype = tensor_type(spec, weight_type)
        write_padding(fout, writer.data_alignment)
        written = 0
        for chunk in rows.chunks(spec, qtype):
            chunk.tofile(fout)
            written += chunk.nbytes
        assert written == tensor_nbytes(spec, qtype), spec.name
        if spec.name.endswith("ffn_up_exps.weight"):
            log(f"  {int(spec.name.split('.')[1]) + 1:>3}/{n_layer} layers  {time.monotonic() - t0:7.1f} s")
    write_padding(fout, writer.data_alignment)
    writer.close()
    return out.stat().st_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="olmoe-1b-7b")
    p.add_argument("--layers", type=int, default=None,
                   help="number of layers (default: the real model's, 16 for olmoe-1b-7b)")
    p.add_argument("--type", dest="type_name", choices=sorted(TYPES), default="q8_0",
                   help="type of the weight matrices; norms and router stay f32 (default q8_0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=Path, default=None,
                   help="vocab-only GGUF to copy the tokenizer from (default per geometry)")
    p.add_argument("--row-pool", type=int, default=None,
                   help="draw weight rows from a pool of N converted random rows instead of fresh "
                        f"(0 = fresh; default 0, or {DEFAULT_ROW_POOL} for q4_k whose quantizer is slow)")
    p.add_argument("--embedding-std", type=float, default=EMBEDDING_STD,
                   help=f"std of the token embeddings (default {EMBEDDING_STD}; other weights {WEIGHT_STD})")
    p.add_argument("-o", "--output", type=Path, required=True)
    args = p.parse_args(argv)

    t0 = time.monotonic()
    size = write_synthetic_gguf(args.output, args.geometry, args.layers, args.type_name, args.seed,
                                args.vocab, args.row_pool, args.embedding_std, log=lambda s: print(s, file=sys.stderr, flush=True))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"wrote {args.output}: {size} bytes ({size / 2**30:.2f} GiB) in "
          f"{time.monotonic() - t0:.0f} s, peak RSS {peak_rss / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
