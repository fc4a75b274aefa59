"""Multi-precision GGUF -> a standard llama.cpp GGUF of one precision (docs/format.md).

Stock llama.cpp refuses a file with tensors it does not expect, so `.lowbit` copies must go:
- precision "high": the file without its `.lowbit` tensors;
- precision "low": each routed-expert tensor's bytes and type replaced by its `.lowbit` copy.
The `edgemoe.*` keys are dropped and `general.file_type` describes the expert type written.
A standard input exported at "high" is copied byte for byte; a split one (llama.cpp's gguf-split)
is written as one file.
"""
from __future__ import annotations

import errno
import os
import shutil
import sys
from pathlib import Path

import gguf

from pyedgemoe.convert.from_gguf import (
    copy_chunks,
    copy_kv,
    is_multi_precision,
    kv_value,
    open_gguf,
    tensor_ne,
    tensor_type_name,
)
from pyedgemoe.convert.gguf_out import (
    GGUFOutput,
    create_partial_file,
    llama_file_type,
    output_path,
    output_target,
)
from pyedgemoe.errors import ConversionError
from pyedgemoe.gguf_format import (
    HIGH_TYPE_KEY,
    KEY_PREFIX,
    LOW_TYPE_KEY,
    is_expert_tensor,
    is_low_copy,
    low_copy_name,
)
from pyedgemoe.output_files import terminate_cleanly

PRECISIONS = ("high", "low")


def export(model: Path, out: Path, *, precision: str = "high", force: bool = False,
           progress: bool = True) -> Path:
    """Write the `precision` ("high" or "low") experts of `model` as a standard GGUF at `out`."""
    model, out = Path(model), output_path(out)
    if precision not in PRECISIONS:
        raise ConversionError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    reader = open_gguf(model, "model")
    output_target(out, force, reader.files)  # refused before the work: one of the inputs, or there without --force
    arch = kv_value(reader, gguf.Keys.General.ARCHITECTURE)
    if not arch:
        raise ConversionError(f"{model} has no general.architecture")

    if not is_multi_precision(reader):
        if precision == "low":
            raise ConversionError(f"{model} is a standard GGUF: it has no LOW expert copies to export")
        if len(reader.files) == 1:
            del reader
            return _copy_file(model, out, force=force, progress=progress)
        # a split one is written as one file (llama-gguf-split --merge's)

    # open_gguf's header check refused a format version this pyedgemoe does not read, and an expert
    # tensor without its LOW copy or with one of another shape
    by_name = {t.name: t for t in reader.tensors}
    expert_type = kv_value(reader, {"high": HIGH_TYPE_KEY, "low": LOW_TYPE_KEY}[precision])

    output = GGUFOutput(out, arch=arch, force=force)
    copy_kv(reader, output.writer,
            skip=lambda k: (k == gguf.Keys.General.FILE_TYPE and expert_type) or k.startswith(KEY_PREFIX))
    if expert_type:
        output.writer.add_file_type(llama_file_type(expert_type))

    for t in reader.tensors:
        if is_low_copy(t.name):
            continue
        source = t
        if precision == "low" and is_expert_tensor(t.name):
            source = by_name[low_copy_name(t.name)]  # of t's shape: open_gguf's header check
        output.add_tensor(t.name, tensor_ne(t), tensor_type_name(source),
                          (lambda s=source: copy_chunks(reader.file_of(s), s)))
    return output.finish(progress=progress)


def _copy_file(src: Path, out: Path, *, force: bool, progress: bool) -> Path:
    """Copy `src` to `out` through a temp file in out's directory (no partial file on failure)."""
    target = output_target(out, force)
    directory = target.parent
    if not directory.is_dir():
        raise ConversionError(f"output directory {directory} does not exist")
    tmp = None
    try:
        with terminate_cleanly():
            tmp = create_partial_file(target)
            with open(src, "rb") as fin, open(tmp, "wb") as fout:
                shutil.copyfileobj(fin, fout, 16 * 1024 * 1024)
                fout.flush()
                os.fsync(fout.fileno())
            if target.exists() and not force:
                raise ConversionError(f"{out} appeared while writing; pass --force to overwrite it")
            os.replace(tmp, target)
            tmp = None
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ConversionError(f"disk full while writing {out}; no output file was left behind") from None
        raise ConversionError(f"cannot write {out}: {e}") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
    if progress:
        sys.stderr.write(f"{src} is a standard GGUF: copied it to {out}\n")
    return out
