"""A standard llama.cpp GGUF (or two: a HIGH and a LOW quant of one model) -> multi-precision GGUF.

Every metadata key (tokenizer arrays included) and every non-expert tensor is copied; each routed-expert
tensor is written in the HIGH type and, under the `.lowbit` name of docs/format.md, in the LOW type.
A tensor is requantized by dequantizing the source with ggml and quantizing it again with ggml's own
quantizer (via `pyedgemoe._native`), a bounded number of rows at a time, and streamed to the writer
piece by piece: peak memory is one chunk of rows (64 MiB of float32), independent of model size.

A source that already is multi-precision is refused: its HIGH experts would be requantized a second
time without the user noticing. `pyedgemoe export --precision high` first, then convert that.
"""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np

from pyedgemoe.convert.gguf_out import (
    GGUFOutput,
    edgemoe_metadata,
    ggml_type,
    ggml_type_name,
    llama_file_type,
    output_target,
    tensor_nbytes,
)
from pyedgemoe.convert.plan import (
    DEFAULT_HIGH, DEFAULT_LOW, check_precisions, check_type, fitting_type, type_of_most_bytes)
from pyedgemoe.convert.tensor_values import check_values
from pyedgemoe.errors import ConversionError, ModelLoadError
from pyedgemoe.gguf_format import FORMAT_VERSION_KEY, KEY_PREFIX, is_expert_tensor, is_low_copy, low_copy_name

# Float rows per requantization chunk: bounds the float32 scratch to 64 MiB whatever the tensor size.
_CHUNK_ELEMENTS = 16 * 1024 * 1024


# -- reading a source GGUF ------------------------------------------------------------------------

class GGUFSource:
    """A source GGUF as llama.cpp loads it: one file, or the shards of a split GGUF (llama.cpp's
    gguf-split: the first's keys, every shard's tensors), each memory-mapped (tensor bytes are read
    only when used). gguf-py's GGUFReader's fields, get_field and tensors, and each tensor's file."""

    def __init__(self, readers: list[gguf.GGUFReader], files: list[Path]):
        self._readers, self.files = readers, files
        self.fields = readers[0].fields
        self.tensors = [t for r in readers for t in r.tensors]
        self._file_of = {id(t): f for r, f in zip(readers, files) for t in r.tensors}

    def get_field(self, key: str):
        return self._readers[0].get_field(key)

    def file_of(self, tensor) -> Path:
        """The file (shard) that holds tensor's bytes, at tensor.data_offset."""
        return self._file_of[id(tensor)]

    def bytes_of(self, tensor) -> np.ndarray:
        """The raw bytes of a tensor, as a uint8 view into its file's memory map."""
        reader = self._readers[self.files.index(self.file_of(tensor))]
        return reader.data[tensor.data_offset: tensor.data_offset + tensor.n_bytes]


def open_gguf(path: Path, what: str = "GGUF") -> GGUFSource:
    """The GGUF at `path` (a split one's first shard: its shards found as llama.cpp finds them).

    Its header is checked first as `inspect` and `run` check it (model_info.read_model_info: ggml's
    own parser, which bounds every count and length by the file's size, and tensor data within the
    files): gguf-py's reader believes whatever a header claims, a 2^60-element array included."""
    from pyedgemoe.model_info import read_model_info

    path = Path(path)
    if not path.exists():
        raise ConversionError(f"{what} not found: {path}")
    try:
        files = [Path(f) for f in read_model_info(path).files]
    except ModelLoadError as e:
        raise ConversionError(str(e)) from None
    return GGUFSource([_open_file(f) for f in files], files)


def _open_file(path: Path) -> gguf.GGUFReader:
    """A GGUFReader over one file whose header ggml has read (open_gguf)."""
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf-py raises ValueError/struct.error/IndexError on damage
        raise ConversionError(f"corrupt or truncated GGUF {path}: {e}") from None
    for t in reader.tensors:
        # ggml reads a tensor of 0 dimensions as a scalar; gguf-py's shape is then empty
        if not 1 <= len(t.shape) <= 4:
            raise ConversionError(f"corrupt GGUF {path}: tensor {t.name} has {len(t.shape)} dimensions, "
                                  f"expected 1 to 4")
    _check_strings(reader, path)
    return reader


def _check_strings(reader: gguf.GGUFReader, path: Path) -> None:
    """ConversionError naming the first string value that is not UTF-8. gguf-py decodes key and
    tensor names as it reads the header, string values only when asked (field.contents()); ggml's
    header check (read_model_info) decodes the scalar ones, not the elements of arrays."""
    for field in reader.fields.values():
        if not field.types or gguf.GGUFValueType.STRING not in (field.types[0], field.types[-1]):
            continue
        for n, idx in enumerate(field.data):
            try:
                bytes(field.parts[idx]).decode("utf-8")
            except UnicodeDecodeError as e:
                what = (f"element {n} of key {field.name!r}" if field.types[0] == gguf.GGUFValueType.ARRAY
                        else f"the value of key {field.name!r}")
                raise ConversionError(f"corrupt GGUF {path}: {what} is not valid UTF-8 "
                                      f"({e.reason} at byte {e.start})") from None


def kv_value(reader: gguf.GGUFReader | GGUFSource, key: str, default=None):
    field = reader.get_field(key)
    if field is None or not field.types:
        return default
    return field.contents()


def is_multi_precision(reader: GGUFSource) -> bool:
    return (reader.get_field(FORMAT_VERSION_KEY) is not None
            or any(is_low_copy(t.name) for t in reader.tensors))


def copy_kv(reader: GGUFSource, writer: gguf.GGUFWriter, *, skip: Callable[[str], bool]) -> None:
    """Copy every metadata key of `reader` (arrays included) except the ones GGUFWriter writes itself
    (architecture, alignment, the GGUF.* header fields), a split GGUF's (the output is one file) and
    those `skip` names."""
    for field in reader.fields.values():
        name = field.name
        if name.startswith(("GGUF.", "split.")) or name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.ALIGNMENT):
            continue
        if skip(name):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if vtype == gguf.GGUFValueType.ARRAY and len(value) == 0:
            continue  # GGUFWriter cannot write an empty array; llama.cpp treats absent as empty
        writer.add_key_value(name, value, vtype, sub_type=sub_type)


def tensor_ne(tensor) -> list[int]:
    return [int(n) for n in tensor.shape]


def tensor_type_name(tensor) -> str:
    return ggml_type_name(tensor.tensor_type)


# -- requantizing ---------------------------------------------------------------------------------

def read_range(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """`nbytes` bytes of `path` from `offset`, read into a fresh buffer. Reading (rather than using
    the reader's memory map) keeps the source's pages out of this process's RSS once written."""
    out = np.empty(nbytes, dtype=np.uint8)
    view = memoryview(out)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        done = 0
        while done < nbytes:
            n = f.readinto(view[done:])
            if not n:
                raise ConversionError(f"{path} ends {nbytes - done} bytes early (truncated file?)")
            done += n
    return out


def copy_chunks(path: Path, tensor, chunk_bytes: int = 4 * _CHUNK_ELEMENTS) -> Iterator[np.ndarray]:
    """A tensor's bytes as they are, in pieces of at most `chunk_bytes`."""
    start, nbytes = int(tensor.data_offset), int(tensor.n_bytes)
    for off in range(0, nbytes, chunk_bytes):
        yield read_range(path, start + off, min(chunk_bytes, nbytes - off))


def dequantized_rows(path: Path, tensor, r0: int, r1: int) -> np.ndarray:
    """Rows r0..r1 of a tensor (rows of ne[0] values) as float32 [r1 - r0, ne[0]]: read from the
    file and dequantized with ggml (f32: as they are)."""
    from pyedgemoe import _native

    src_type, row_len = tensor_type_name(tensor), tensor_ne(tensor)[0]
    src_row = tensor_nbytes(src_type, [row_len])
    chunk = read_range(path, int(tensor.data_offset) + r0 * src_row, (r1 - r0) * src_row)
    if src_type == "f32":
        return chunk.view(np.float32).reshape(r1 - r0, row_len)
    return _native.dequantize(chunk, src_type, r1 - r0, row_len)


def requantize_chunks(path: Path, tensor, dst_type: str, n_threads: int, option: str) -> Iterator[np.ndarray]:
    """A tensor converted from its type to `dst_type`, a group of rows at a time: read the rows,
    dequantize them with ggml (f32: as they are), check their values (check_values; `option` gave
    the type), quantize them with ggml. ggml quantizes every row on its own, so the pieces are
    exactly the bytes of converting the whole tensor at once."""
    from pyedgemoe import _native

    row_len = tensor_ne(tensor)[0]
    n_rows = int(np.prod(tensor_ne(tensor)[1:]))
    dst_row = tensor_nbytes(dst_type, [row_len])
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // row_len)
    for r0 in range(0, n_rows, rows_per_chunk):
        r1 = min(n_rows, r0 + rows_per_chunk)
        rows = dequantized_rows(path, tensor, r0, r1)
        check_values(rows, dst_type, tensor.name, option)
        if dst_type == "f32":
            q = np.ascontiguousarray(rows, dtype=np.float32)
        else:
            q = _native.quantize(np.ascontiguousarray(rows, dtype=np.float32), dst_type, n_threads)
        if q.nbytes != (r1 - r0) * dst_row:
            raise ConversionError(f"quantizer returned {q.nbytes} bytes for {r1 - r0} rows of {dst_type}, "
                                  f"expected {(r1 - r0) * dst_row}")
        yield q


def _keep(path: Path, tensor) -> Callable[[], Iterator[np.ndarray]]:
    return lambda: copy_chunks(path, tensor)


def _convert(path: Path, tensor, dst_type: str, n_threads: int, option: str) -> Callable[[], Iterator[np.ndarray]]:
    return lambda: requantize_chunks(path, tensor, dst_type, n_threads, option)


def _base_type_for(tensor, base: str | None) -> tuple[str, str]:
    """(type, action) of a non-expert tensor. As llama.cpp's quantizer: only 2-D+ `.weight` matrices
    are requantized, norms and biases (1-D) and the router (`ffn_gate_inp`) keep their type, and a
    matrix whose rows do not fill `base`'s blocks gets llama.cpp's fallback type."""
    src_type = tensor_type_name(tensor)
    if base is None or src_type == base:
        return src_type, "copy"
    if not tensor.name.endswith(".weight") or len(tensor.shape) < 2 or "ffn_gate_inp" in tensor.name:
        return src_type, "copy (1-D or router)"
    row_len = int(tensor.shape[0])
    dst = fitting_type(base, row_len)
    if dst == base:
        return base, "requantize"
    why = f"{dst} instead of {base}: rows of {row_len} do not fill {base} blocks"
    return dst, ("copy, " if dst == src_type else "requantize, ") + why


# -- the conversion -------------------------------------------------------------------------------

def convert_gguf(src: Path, out: Path, *, high: str = DEFAULT_HIGH, low: str | None = None, base: str | None = None,
                 low_from: Path | None = None, force: bool = False, dry_run: bool = False,
                 progress: bool = True, n_threads: int | None = None, calibration: dict | None = None,
                 name: str | None = None) -> Path | dict:
    """Convert a standard llama.cpp GGUF into a multi-precision GGUF (docs/format.md).

    high, low: ggml type names of the expert copies. base: type of the non-expert weight matrices
    (None: keep the source's bytes). low_from: a lower quant of the same model whose expert tensors
    become the LOW copies as they are (then `low` is not given: the LOW type is that file's).
    dry_run: return the plan (a dict, see `format_plan`) and write nothing. calibration: a
    `pyedgemoe calibrate` sidecar's contents, embedded as `edgemoe.calibration.*` metadata. name:
    general.name (default: the source's). Raises ConversionError; never leaves a file under `out`
    unless it succeeds.
    """
    src, out = Path(src), Path(out)
    n_threads = n_threads or os.cpu_count() or 1
    high = check_type(high, "--high")
    base = check_type(base, "--base") if base is not None else None

    reader = open_gguf(src, "source GGUF")
    arch = kv_value(reader, gguf.Keys.General.ARCHITECTURE)
    if not arch:
        raise ConversionError(f"{src} has no general.architecture")
    if not isinstance(arch, str):
        raise ConversionError(f"{src}: general.architecture is {arch!r}, expected a string (llama.cpp's name of "
                              f"the architecture)")
    if is_multi_precision(reader):
        raise ConversionError(f"{src} already is a multi-precision GGUF; run `pyedgemoe export "
                              f"--precision high` on it and convert the export")
    experts = [t for t in reader.tensors if is_expert_tensor(t.name)]
    if not experts:
        raise ConversionError(f"{src} has no routed-expert tensors (blk.N.ffn_*_exps.weight): "
                              f"not a Mixture-of-Experts model")

    low_reader = None
    low_tensors: dict = {}
    if low_from is not None:
        if low is not None:
            raise ConversionError(f"--low {low} and --low-from both give the LOW copies; give one of them")
        low_reader, low_tensors, low = _open_low_from(Path(low_from), arch, experts)
        check_precisions(high, low, f"--low-from {low_from}'s type")
    else:
        named = "--low" if low else "the default --low"
        low = check_type(low or DEFAULT_LOW, "--low")
        check_precisions(high, low, named)

    if not dry_run:
        output_target(out, force, inputs=reader.files + (low_reader.files if low_reader else []))

    output = None if dry_run else GGUFOutput(out, arch=arch, force=force)
    writer = output.writer if output else gguf.GGUFWriter(None, arch)
    renamed = {gguf.Keys.General.NAME} if name is not None else set()
    copy_kv(reader, writer, skip=lambda k: k == gguf.Keys.General.FILE_TYPE or k.startswith(KEY_PREFIX) or k in renamed)
    if name is not None:
        writer.add_name(name)
    writer.add_file_type(llama_file_type(high))
    if kv_value(reader, gguf.Keys.General.QUANTIZATION_VERSION) is None:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    edgemoe_metadata(writer, high, low, {
        "source": str(src), "source_type": "gguf",
        "low_from": str(low_from) if low_from is not None else None}, calibration)

    plan: list[dict] = []

    def add(name: str, ne: list[int], type_name: str, produce, src_type: str, action: str, role: str):
        try:
            nbytes = tensor_nbytes(type_name, ne)
        except ConversionError as e:
            raise ConversionError(f"tensor {name} {ne}: {e}") from None
        plan.append({"name": name, "ne": ne, "type": type_name, "src_type": src_type,
                     "nbytes": nbytes, "action": action, "role": role})
        if output is not None:
            output.add_tensor(name, ne, type_name, produce)

    for t in reader.tensors:
        ne, src_type, file = tensor_ne(t), tensor_type_name(t), reader.file_of(t)
        if not is_expert_tensor(t.name):
            dst, action = _base_type_for(t, base)
            produce = _keep(file, t) if dst == src_type else _convert(file, t, dst, n_threads, "--base")
            add(t.name, ne, dst, produce, src_type, action, "base")
            continue
        if src_type == high:
            add(t.name, ne, high, _keep(file, t), src_type, "copy", "high")
        else:
            add(t.name, ne, high, _convert(file, t, high, n_threads, "--high"), src_type, "requantize", "high")
        if low_reader is not None:
            lt = low_tensors[t.name]
            add(low_copy_name(t.name), ne, tensor_type_name(lt), _keep(low_reader.file_of(lt), lt),
                tensor_type_name(lt), f"copy from {Path(low_from).name}", "low")
        elif src_type == low:
            add(low_copy_name(t.name), ne, low, _keep(file, t), src_type, "copy", "low")
        else:
            add(low_copy_name(t.name), ne, low, _convert(file, t, low, n_threads, "--low"), src_type, "requantize",
                "low")

    summary = _plan_summary(src, out, arch, high, low, base, low_from, plan)
    if dry_run:
        return summary
    assert output is not None
    if progress:
        import sys
        sys.stderr.write(f"converting {src} -> {out}: experts {high} + {low}, "
                         f"{_fmt(summary['bytes']['total'])} of tensor data\n")
    return output.finish(progress=progress)


def _open_low_from(path: Path, arch: str, experts: list) -> tuple[GGUFSource, dict, str]:
    reader = open_gguf(path, "--low-from GGUF")
    low_arch = kv_value(reader, gguf.Keys.General.ARCHITECTURE)
    if low_arch != arch:
        raise ConversionError(f"--low-from {path} is a {low_arch!r} model, the source is {arch!r}")
    if is_multi_precision(reader):
        raise ConversionError(f"--low-from {path} is a multi-precision GGUF; give a standard one")
    by_name = {t.name: t for t in reader.tensors if is_expert_tensor(t.name)}
    wanted = {t.name for t in experts}
    missing = sorted(wanted - set(by_name))
    if missing:
        raise ConversionError(f"--low-from {path} lacks expert tensor(s) {', '.join(missing[:3])}"
                              + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
    extra = sorted(set(by_name) - wanted)
    if extra:
        raise ConversionError(f"--low-from {path} has expert tensor(s) the source lacks: {', '.join(extra[:3])}")
    for t in experts:
        lt = by_name[t.name]
        if tensor_ne(lt) != tensor_ne(t):
            raise ConversionError(f"--low-from {path}: tensor {t.name} has shape {tensor_ne(lt)}, "
                                  f"the source has {tensor_ne(t)}; not the same model")
    # A k-quant "mix" (Q4_K_M) stores some expert tensors in a larger type; the tensor infos carry
    # each one's type, and edgemoe.low_type records the type of most LOW bytes.
    low = type_of_most_bytes((tensor_type_name(lt), int(lt.n_bytes)) for lt in by_name.values())
    return reader, by_name, low


def _plan_summary(src, out, arch, high, low, base, low_from, plan) -> dict:
    by_role = Counter()
    for p in plan:
        by_role[p["role"]] += p["nbytes"]
    return {
        "source": str(src), "out": str(out), "architecture": arch,
        "high_type": high, "low_type": low, "base_type": base or "source",
        "low_from": str(low_from) if low_from is not None else None,
        "tensors": plan,
        "bytes": {"high": by_role["high"], "low": by_role["low"], "non_expert": by_role["base"],
                  "total": sum(by_role.values())},
    }


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_plan(plan: dict) -> str:
    """The text `--dry-run` prints: one line per tensor, then the bytes of each precision."""
    lines = [f"{plan['source']} -> {plan['out']}  ({plan['architecture']})",
             f"HIGH {plan['high_type']}  LOW {plan['low_type']}  base {plan['base_type']}"
             + (f"  low copies from {plan['low_from']}" if plan.get("low_from") else "")]
    width = max((len(t["name"]) for t in plan["tensors"]), default=10)
    for t in plan["tensors"]:
        lines.append(f"  {t['name']:<{width}}  {str(t['ne']):<18} {t['src_type']:>5} -> {t['type']:<5} "
                     f"{_fmt(t['nbytes']):>10}  {t['action']}")
    b = plan["bytes"]
    lines.append(f"experts HIGH {_fmt(b['high'])}, experts LOW {_fmt(b['low'])}, "
                 f"non-expert {_fmt(b['non_expert'])}, total {_fmt(b['total'])}")
    return "\n".join(lines)
