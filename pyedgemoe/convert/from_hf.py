"""A Hugging Face checkpoint directory -> multi-precision GGUF (docs/format.md).

The file is what llama.cpp's converter writes (tensor names, shapes, order, types, hparams,
tokenizer) with the routed experts in the HIGH type, plus each stacked expert tensor's LOW copy
under its `.lowbit` name right after it. Non-expert matrices are in BASE (default as llama.cpp's:
bf16 for a BF16 checkpoint, else f16); 1-D tensors, norms, biases and routers stay F32, as
llama.cpp writes them. Every value is checked as it passes (tensor_values.py): NaN or Inf, or one a
16-bit type would write as inf, is refused naming the tensor.

Memory: the plan is built from the safetensors headers alone. At write time each tensor is
produced when the writer reaches it: a non-expert tensor is read (a chunk of rows at a time when
it needs no transform) and quantized; a stacked expert tensor is built one expert at a time,
each expert quantized into its slot of the output (ggml quantizes rows independently, so this
equals quantizing the stack). Peak memory is one output tensor plus one expert in float32,
whatever the model size.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import logging
import os
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from pyedgemoe.convert import tokenizer as tokenizer_mod
from pyedgemoe.convert.deepseek_v2 import DeepseekV2
from pyedgemoe.convert.family import LAYER_KEYS, ExpertSource, ExpertStack, Family, StandIn, TensorOut
from pyedgemoe.convert.gguf_out import (
    GGUFOutput,
    edgemoe_metadata,
    llama_file_type,
    output_target,
    row_nbytes,
    tensor_nbytes,
)
from pyedgemoe.convert.hf_checkpoint import HFCheckpoint
from pyedgemoe.convert.mixtral import Mixtral
from pyedgemoe.convert.olmoe import Olmoe
from pyedgemoe.convert.phimoe import PhiMoE
from pyedgemoe.convert.plan import DEFAULT_HIGH, DEFAULT_LOW, Plan, check_precisions, check_type, fitting_type
from pyedgemoe.convert.qwen2_moe import Qwen2Moe
from pyedgemoe.convert.qwen3_moe import Qwen3Moe
from pyedgemoe.convert.tensor_values import check_values
from pyedgemoe.errors import ConversionError
from pyedgemoe.gguf_format import low_copy_name
from pyedgemoe.sysmem import format_bytes

FAMILIES: tuple[type[Family], ...] = (Mixtral, PhiMoE, Qwen2Moe, Qwen3Moe, Olmoe, DeepseekV2)
# config.json "architectures" value -> family
SUPPORTED_ARCHITECTURES: dict[str, type[Family]] = {a: f for f in FAMILIES for a in f.hf_architectures}

_CHUNK_ELEMENTS = 16 * 1024 * 1024  # float32 elements per read chunk of a plain tensor (64 MiB)


def family_for(config: dict, n_tensors: int) -> Family:
    """The family object for a config.json of a checkpoint of n_tensors tensors; ConversionError
    listing the supported ones otherwise, or for more layers than tensors (gguf-py's name map of
    a million layers took gigabytes before a tensor was looked at)."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    if arch is None:
        raise ConversionError(f"config.json names no architecture (\"architectures\"); supported: {supported}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(f"unsupported architecture {arch!r}; supported: {supported} (other families: llama.cpp's "
                              f"convert_hf_to_gguf.py first, then convert its GGUF)")
    if config.get("quantization_config"):
        method = (config["quantization_config"] or {}).get("quant_method", "?")
        raise ConversionError(f"the checkpoint is already quantized ({method}); convert an unquantized "
                              f"(F32/F16/BF16) checkpoint")
    layers = next((config[k] for k in LAYER_KEYS if config.get(k) is not None), 0)
    if layers > n_tensors:
        raise ConversionError(f"config.json says {layers} layers, but the checkpoint has only {n_tensors} tensors")
    return SUPPORTED_ARCHITECTURES[arch](config)


def _bid(name: str) -> int | None:
    """llama.cpp's block id of a tensor: the first number-like part of its name."""
    for part in name.split("."):
        if part.isdecimal():
            return int(part)
    return None


# ---------------------------------------------------------------------------------------------
# producing tensor data


def _encode(data: np.ndarray, type_name: str, n_threads: int, tensor: str, option: str) -> np.ndarray:
    """float32 data of the checkpoint's `tensor` -> the bytes of `type_name` (an f32 array for f32),
    through ggml's quantizer; refused if its values do not fit (check_values; `option` gave the type)."""
    check_values(data, type_name, tensor, option)
    if type_name == "f32":
        return np.ascontiguousarray(data, dtype=np.float32)
    from pyedgemoe import _native
    rows = np.ascontiguousarray(data, dtype=np.float32).reshape(-1, data.shape[-1] if data.ndim else 1)
    return _native.quantize(rows, type_name, n_threads)


def _plain_producer(ckpt: HFCheckpoint, src: str, out: TensorOut, type_name: str,
                    n_threads: int) -> Callable[[], np.ndarray]:
    """The data of a non-expert tensor (of the --base type, or f32)."""
    shape = tuple(out.shape)

    def produce() -> np.ndarray:
        if out.transform is None and len(shape) >= 2:
            return _encode_by_rows(ckpt, src, shape, type_name, n_threads)
        data = ckpt.read(src)
        if out.transform is not None:
            data = out.transform(data)
        if tuple(data.shape) != shape:
            raise ConversionError(f"tensor {src}: got shape {list(data.shape)}, expected {list(shape)}")
        return _encode(data, type_name, n_threads, src, "--base")
    return produce


def _encode_by_rows(ckpt: HFCheckpoint, src: str, shape: tuple[int, ...], type_name: str,
                    n_threads: int) -> np.ndarray:
    """A plain tensor read and quantized a chunk of dim-0 rows at a time (bounded scratch)."""
    n_rows = shape[0]
    inner = int(np.prod(shape[1:]))
    step = max(1, _CHUNK_ELEMENTS // max(inner, 1))
    if type_name == "f32":
        out = np.empty(shape, dtype=np.float32)
        for r0 in range(0, n_rows, step):
            r1 = min(n_rows, r0 + step)
            out[r0:r1] = _encode(ckpt.read_rows(src, r0, r1), type_name, n_threads, src, "--base")
        return out
    row_bytes = tensor_nbytes(type_name, list(reversed(shape[1:])))
    out = np.empty(n_rows * row_bytes, dtype=np.uint8)
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        out[r0 * row_bytes:r1 * row_bytes] = _encode(ckpt.read_rows(src, r0, r1), type_name, n_threads, src,
                                                     "--base")
    return out


def _read_expert(ckpt: HFCheckpoint, src: ExpertSource) -> np.ndarray:
    if src.index is None:
        return ckpt.read(src.name)
    return ckpt.read_rows(src.name, src.index, src.index + 1)[0][src.row_start:src.row_stop]


def _stack_producer(ckpt: HFCheckpoint, stack: ExpertStack, type_name: str, n_threads: int,
                    option: str) -> Callable[[], np.ndarray]:
    def produce() -> np.ndarray:
        rows, cols = stack.shape
        n = len(stack.sources)
        if type_name == "f32":
            out = np.empty((n, rows, cols), dtype=np.float32)
        else:
            per_expert = row_nbytes(type_name, cols) * rows
            out = np.empty(n * per_expert, dtype=np.uint8)
        for e, src in enumerate(stack.sources):
            m = _read_expert(ckpt, src)
            if m.shape != (rows, cols):
                raise ConversionError(f"expert {e} of {stack.merged_name}: shape {list(m.shape)}, "
                                      f"expected {[rows, cols]}")
            data = _encode(m, type_name, n_threads, src.name, option)
            if type_name == "f32":
                out[e] = data
            else:
                out[e * per_expert:(e + 1) * per_expert] = data
            del m, data
        return out
    return produce


# ---------------------------------------------------------------------------------------------
# the plan


def _type_for(requested: str, row_len: int) -> tuple[str, str]:
    t = fitting_type(requested, row_len)
    if t == requested:
        return t, ""
    return t, f"{t} instead of {requested}: rows of {row_len} do not fill {requested} blocks"


def _base_type(family: Family, gname: str, shape: tuple[int, ...], bid: int | None, base: str) -> tuple[str, str]:
    """(type, plan action) of a non-expert tensor: F32 where llama.cpp's converter keeps it so."""
    if len(shape) <= 1 or gname.endswith("_norm.weight") or family.is_f32_tensor(gname, bid):
        return "f32", "f32 (1-D, norm, bias or router)"
    t, why = _type_for(base, shape[-1])
    return t, why or "base"


def build_plan(ckpt: HFCheckpoint, family: Family, *, high: str, low: str, base: str, n_threads: int,
               source: str, out: str) -> Plan:
    """Every tensor of the output with its type, size and data producer; checks names and shapes,
    and that llama.cpp's loader accepts the tensor set (check_loadable)."""
    family.check_config()
    plan = Plan(source=source, out=out, architecture=gguf.MODEL_ARCH_NAMES[family.gguf_arch],
                high_type=high, low_type=low, base_type=base)
    n_experts = family.n_experts
    hf_source: dict[str, str] = {}  # output tensor -> the HF tensor it is made from, for messages

    for gname, arr in family.extra_tensors():
        plan.add(gname, list(reversed(arr.shape)), "f32", "base", src_type="config",
                 action="f32, from config.json", produce=lambda a=arr: a)

    def add_stack(stack: ExpertStack, src_dtype: str) -> None:
        gname = family.map_name(stack.merged_name)
        if not gname.endswith(".weight"):
            raise ConversionError(f"expert tensor {stack.merged_name} maps to {gname}, not a weight")
        rows, cols = stack.shape
        ne = [cols, rows, len(stack.sources)]
        hf_source[gname] = stack.sources[0].name
        (high_t, high_why), (low_t, low_why) = _type_for(high, cols), _type_for(low, cols)
        check_precisions(high_t, low_t, f"{gname}'s LOW copy", "its HIGH copy",
                         why="; ".join(w for w in (high_why, low_why) if w))
        for role, t, why, name in (("high", high_t, high_why, gname),
                                   ("low", low_t, low_why, low_copy_name(gname))):
            action = why or f"{n_experts} experts stacked, {role.upper()}"
            plan.add(name, ne, t, role, src_type=src_dtype, action=action,
                     produce=_stack_producer(ckpt, stack, t, n_threads, f"--{role}"))
        stacks_done[stack.bid].add(stack.proj)

    pending: dict[int, dict[str, dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
    stacks_done: dict[int, set[str]] = defaultdict(set)
    seen_layers: set[int] = set()

    for src in ckpt.names():
        name = family.rename(src)
        if name is None:
            continue
        entry = ckpt.entry(src)
        shape = entry.shape
        bid = _bid(name)
        if bid is not None and name.startswith(("model.layers.", "layers.")):
            if bid >= family.n_layers:
                raise ConversionError(f"tensor {src} is in layer {bid}, but config.json says "
                                      f"num_hidden_layers={family.n_layers}")
            seen_layers.add(bid)

        if m := family.expert_re.match(name):
            bid, xid, proj = int(m.group(1)), int(m.group(2)), m.group(3)
            if xid >= n_experts:
                raise ConversionError(f"tensor {src}: expert {xid}, but config.json says {n_experts} experts")
            want = family.expert_shape(proj)
            if tuple(shape) != want:
                raise ConversionError(f"tensor {src} has shape {list(shape)}, config.json implies {list(want)}")
            layer = pending[bid]
            if xid in layer[proj]:
                raise ConversionError(f"tensor {src} appears twice")
            layer[proj][xid] = src
            if sum(len(v) for v in layer.values()) >= n_experts * len(family.expert_projs):
                # the whole layer is there: stack it now, where llama.cpp writes it
                for p in family.expert_projs:
                    if len(layer[p]) != n_experts:
                        raise ConversionError(f"layer {bid} has {len(layer[p])} of {n_experts} experts' {p}")
                    add_stack(ExpertStack(bid, p, family.merged_expert_name(bid, p), family.expert_shape(p),
                                          [ExpertSource(layer[p][x]) for x in range(n_experts)]), entry.dtype)
                del pending[bid]
            continue

        stacks = family.fused_experts(name, shape)
        if stacks is not None:
            for s in stacks:
                want = family.expert_shape(s.proj)
                if len(shape) != 3 or shape[0] != n_experts or s.shape != want:
                    raise ConversionError(f"tensor {src} has shape {list(shape)}, config.json implies "
                                          f"{n_experts} experts of {list(want)}")
                add_stack(s, entry.dtype)
            if not stacks:
                raise ConversionError(f"tensor {src} has shape {list(shape)}, expected [n_expert, rows, cols]")
            continue

        want = family.expected_shape(name)
        if want is not None and tuple(shape) != tuple(want):
            raise ConversionError(f"tensor {src} has shape {list(shape)}, config.json implies {list(want)}")
        for o in family.outputs(name, shape):
            gname = family.map_name(o.hf_name)
            t, action = _base_type(family, gname, o.shape, bid, base)
            plan.add(gname, list(reversed(o.shape)), t, "base", src_type=entry.dtype, action=action,
                     produce=_plain_producer(ckpt, src, o, t, n_threads))
            hf_source[gname] = src

    if pending:
        bid, layer = next(iter(sorted(pending.items())))
        have = {p: len(v) for p, v in layer.items()}
        raise ConversionError(f"layer {bid} is missing experts: found {have} of {n_experts} each of "
                              f"{', '.join(family.expert_projs)} (missing or incomplete shard?)")
    missing = sorted(set(range(family.n_layers)) - seen_layers)
    if missing:
        raise ConversionError(f"no tensors for layer(s) {missing[:5]} but config.json says "
                              f"num_hidden_layers={family.n_layers} (missing or incomplete shard?)")
    for bid in range(family.n_layers):
        if family.is_moe_layer(bid) and stacks_done[bid] != set(family.expert_projs):
            raise ConversionError(f"layer {bid} should be a MoE layer but has no routed experts")
    names = [t.name for t in plan.tensors]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConversionError(f"two tensors map to {dup}")
    check_loadable(plan, family, ckpt, hf_source, base=base, n_threads=n_threads)
    return plan


def check_loadable(plan: Plan, family: Family, ckpt: HFCheckpoint, hf_source: dict[str, str], *,
                   base: str, n_threads: int) -> None:
    """Make the plan's tensor set one llama.cpp's loader accepts, or refuse: a tensor its model has
    no place for is a ConversionError; a required one the checkpoint lacks gets the family's exact
    stand-in (appended to the plan), else a ConversionError. The `.lowbit` copies are ours."""
    required, optional = family.loader_tensors()
    names = {t.name for t in plan.tensors if t.role != "low"}
    for t in plan.tensors:
        if t.role != "low" and t.name not in required | optional:
            raise ConversionError(f"tensor {hf_source.get(t.name, t.name)} (GGUF {t.name}) has no place in "
                                  f"llama.cpp's {family.llama_arch} model, which would refuse the file; this "
                                  f"{family.name} variant is not supported")
    if "output.weight" not in names and not family.tied_embeddings:
        # llama.cpp would quietly use the embedding matrix; transformers would give lm_head random weights
        raise ConversionError("the checkpoint has no lm_head.weight, and config.json does not tie the output "
                              "layer to the embeddings (tie_word_embeddings is false)")
    for gname in sorted(required - names, key=lambda n: (-1 if _bid(n) is None else _bid(n), n)):
        stand_in = family.stand_in(gname)
        if stand_in is None:
            raise ConversionError(f"the checkpoint has no tensor for {gname}, which llama.cpp's "
                                  f"{family.llama_arch} model requires")
        _add_stand_in(plan, family, ckpt, gname, stand_in, base=base, n_threads=n_threads)


def _add_stand_in(plan: Plan, family: Family, ckpt: HFCheckpoint, gname: str, stand_in: StandIn, *,
                  base: str, n_threads: int) -> None:
    if stand_in.copy_of is not None:
        src = next((s for s in ckpt.names() if family.rename(s) == stand_in.copy_of), None)
        if src is None:
            raise ConversionError(f"the checkpoint has no {stand_in.copy_of} to write {gname} from")
        entry = ckpt.entry(src)
        (o,) = family.outputs(stand_in.copy_of, entry.shape)
        t, action = _base_type(family, gname, o.shape, None, base)
        plan.add(gname, list(reversed(o.shape)), t, "base", src_type=entry.dtype,
                 action=f"{stand_in.why}; {action}", produce=_plain_producer(ckpt, src, o, t, n_threads))
    else:
        zeros = np.zeros(stand_in.shape, dtype=np.float32)
        plan.add(gname, list(reversed(zeros.shape)), "f32", "base", src_type="none",
                 action=f"f32 {stand_in.why}", produce=lambda z=zeros: z)


# ---------------------------------------------------------------------------------------------
# metadata


def _parameter_counts(plan: Plan) -> tuple[int, int, int, int]:
    """gguf-py's GGUFWriter.get_total_parameter_count over the HIGH file (no .lowbit copies)."""
    total = shared = expert = expert_sum = n_expert_tensors = 0
    for t in plan.tensors:
        if t.role == "low":
            continue
        shape = list(reversed(t.ne))
        size = int(np.prod(shape))
        if "_exps." in t.name and len(shape) >= 3:
            count = shape[-2 if ".bias" in t.name else -3]
            expert += size // count
            expert_sum += count
            n_expert_tensors += 1
        else:
            shared += size
        total += size
    return total, shared, expert, (expert_sum // n_expert_tensors) if n_expert_tensors else 0


class _QuietOverwrites(logging.Filter):
    """Families overwrite a few keys on purpose, as llama.cpp's classes do (a subclass's value
    replaces the generic one in place); gguf-py logs each overwrite as a warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Duplicated key name")


def write_metadata(writer: gguf.GGUFWriter, plan: Plan, family: Family, hf_dir: Path, *,
                   model_name: str | None, provenance: dict, calibration: dict | None = None) -> None:
    """general.*, hparams, tokenizer and edgemoe.* keys, in llama.cpp's order."""
    log = logging.getLogger("gguf.gguf_writer")
    quiet = _QuietOverwrites()
    log.addFilter(quiet)
    try:
        _write_metadata(writer, plan, family, hf_dir, model_name=model_name, provenance=provenance,
                        calibration=calibration)
    finally:
        log.removeFilter(quiet)


def _write_metadata(writer: gguf.GGUFWriter, plan: Plan, family: Family, hf_dir: Path, *,
                    model_name: str | None, provenance: dict, calibration: dict | None = None) -> None:
    writer.add_type(gguf.GGUFType.MODEL)
    total, shared, expert, count = _parameter_counts(plan)
    try:
        metadata = gguf.Metadata.load(None, hf_dir, model_name, total)
    except Exception:  # a model card gguf-py cannot parse: fall back to the plain name
        metadata = gguf.Metadata(name=model_name)
    if model_name is None:
        metadata.name = _model_name(hf_dir, total) or _file_name(plan.out)
    if metadata.size_label is None and total > 0:
        metadata.size_label = gguf.size_label(total, shared, expert, count)
    _typed(metadata).set_gguf_meta_model(writer)
    family.write_hparams(writer, llama_file_type(plan.high_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokenizer_mod.write_vocab(writer, hf_dir, family.vocab_size, family.tokenizer_style)
    edgemoe_metadata(writer, plan.type_of_most_bytes("high"), plan.type_of_most_bytes("low"), provenance,
                     calibration)


def _typed(metadata: gguf.Metadata) -> gguf.Metadata:
    """metadata with each field of the type gguf-py's writer takes for it: a model card's YAML
    gives what it holds (`license: 5`, `model_name: [1, 2]`), which the writer raised on. A number
    where text goes becomes its text; what cannot be, nothing."""
    def scalar(v) -> bool:
        return isinstance(v, (str, int, float)) and not isinstance(v, bool)
    for field in dataclasses.fields(metadata):
        value, kind = getattr(metadata, field.name), field.type
        if value is None:
            continue
        if kind == "Optional[str]":
            value = str(value) if scalar(value) else None
        elif kind in ("Optional[int]", "Optional[float]"):
            value = value if scalar(value) and not isinstance(value, str) else None
        elif kind == "Optional[list[str]]":
            value = [str(v) for v in value if scalar(v)] if isinstance(value, list) else None
        elif kind == "Optional[list[dict]]":
            value = [v for v in value if isinstance(v, dict)] if isinstance(value, list) else None
        setattr(metadata, field.name, value)
    return metadata


def _model_name(hf_dir: Path, total_params: int) -> str | None:
    """general.name as gguf-py's heuristics take it from the model card and config.json
    (`_name_or_path` when it is a repo id), as llama.cpp's convert_hf_to_gguf does, but not from the
    directory's name, which llama.cpp falls back to: a checkpoint's folder is often "hf", "model"
    or a snapshot's hash."""
    try:
        card, config = gguf.Metadata.load_model_card(hf_dir), gguf.Metadata.load_hf_parameters(hf_dir)
        name = gguf.Metadata.apply_metadata_heuristic(gguf.Metadata(), card, config, None, total_params).name
        return name if isinstance(name, str) else None  # a card's YAML may give a list
    except Exception:  # a model card gguf-py cannot parse
        return None


def auto_base_type(ckpt: HFCheckpoint) -> str:
    """The --base type when none is given: llama.cpp's `--outtype auto` (convert_hf_to_gguf.py,
    ModelBase.__init__), the type of the first matrix stored as BF16 or F16, else f16. A BF16
    checkpoint's weights may lie beyond f16's range."""
    for name in ckpt.names():
        entry = ckpt.entry(name)
        if len(entry.shape) >= 2 and entry.dtype in ("BF16", "F16"):
            return entry.dtype.lower()
    return "f16"


def files_read(hf_dir: Path) -> list[Path]:
    """The files of a checkpoint directory a conversion reads (those a download fetches): the
    output must not replace one of them."""
    from pyedgemoe.convert import HF_ALLOW_PATTERNS
    if not hf_dir.is_dir():
        return []
    return [p for p in hf_dir.iterdir() if any(fnmatch.fnmatch(p.name, pattern) for pattern in HF_ALLOW_PATTERNS)]


def _file_name(out: str) -> str:
    """The output file's name as a model name: "qwen3-30b.mp.gguf" -> "qwen3-30b"."""
    return Path(out).name.removesuffix(".gguf").removesuffix(".mp")


# ---------------------------------------------------------------------------------------------
# the conversion


def convert_hf(src: str | os.PathLike, out: str | os.PathLike, *, high: str = DEFAULT_HIGH, low: str | None = None,
               base: str | None = None, force: bool = False, dry_run: bool = False, progress: bool = True,
               n_threads: int | None = None, source_label: str | None = None,
               model_name: str | None = None, calibration: dict | None = None) -> Path | Plan:
    """Convert the HF checkpoint directory `src` into the multi-precision GGUF `out`.

    high/low: ggml types of the expert copies; base: type of the other weight matrices (default
    auto_base_type's: bf16 for a BF16 checkpoint, else f16). dry_run: return the Plan, write
    nothing. source_label/model_name: what provenance and general.name say (a repo id, when `src`
    is its download). calibration: a sidecar's contents,
    embedded as `edgemoe.calibration.*` metadata. Raises ConversionError and leaves
    no file under `out` unless it succeeds.
    """
    src, out = Path(src), Path(out)
    n_threads = n_threads or os.cpu_count() or 1
    high = check_type(high, "--high")
    named = "--low" if low else "the default --low"
    low = check_type(low or DEFAULT_LOW, "--low")
    check_precisions(high, low, named)
    base = check_type(base, "--base") if base is not None else None
    if not dry_run:
        output_target(out, force, inputs=files_read(src))

    with HFCheckpoint(src) as ckpt:
        base = base or auto_base_type(ckpt)
        family = family_for(ckpt.config, len(ckpt.names()))
        plan = build_plan(ckpt, family, high=high, low=low, base=base, n_threads=n_threads,
                          source=source_label or str(src), out=str(out))
        provenance = {"source": source_label or str(src), "source_type": "hf", "low_from": None}
        if dry_run:
            # metadata into a scratch writer: tokenizer and hparams errors show up in a dry run too
            write_metadata(gguf.GGUFWriter(None, plan.architecture), plan, family, src,
                           model_name=model_name, provenance=provenance, calibration=calibration)
            return plan

        output = GGUFOutput(out, arch=plan.architecture, force=force)
        try:
            write_metadata(output.writer, plan, family, src, model_name=model_name, provenance=provenance,
                           calibration=calibration)
            for t in plan.tensors:
                output.add_tensor(t.name, t.ne, t.type, t.produce)
        except BaseException:
            output.abort()
            raise
        if progress:
            b = plan.bytes_by_role()
            sys.stderr.write(f"converting {plan.source} ({family.name}) -> {out}: experts "
                             f"{plan.types_written('high')} {format_bytes(b['high'], decimals=1)} + "
                             f"{plan.types_written('low')} {format_bytes(b['low'], decimals=1)}, non-expert "
                             f"{plan.types_written('base')} {format_bytes(b['base'], decimals=1)}\n")
            fallbacks = plan.fallbacks()
            if fallbacks:
                sys.stderr.write(f"note: {len(fallbacks)} tensor(s) use a fallback type, e.g. "
                                 f"{fallbacks[0].name}: {fallbacks[0].action}\n")
        return output.finish(progress=progress)


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def looks_like_repo_id(s: str) -> bool:
    """"org/name" that is not an existing path: what a Hugging Face repo id looks like."""
    return bool(_REPO_ID.match(s)) and not Path(s).exists() and ".." not in s
