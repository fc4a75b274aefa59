"""Streaming GGUF writer: the one place that puts a multi-precision (or standard) GGUF on disk.

Tensors are declared up front (name, ggml shape, type, and a `produce` callback); `finish()` writes
the header, metadata and tensor infos, then calls each `produce` in order and streams its bytes out,
so at most one tensor's data is in memory at any time. Everything goes to a temporary file in the
output directory, which is renamed to the final name only after a successful fsync: a failed or
interrupted write never leaves a file under the final name (docs/format.md, issue 3).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import sys
import time
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Callable, Sequence

import gguf
import numpy as np

from pyedgemoe.errors import ConversionError, InvalidOptionError
from pyedgemoe.gguf_format import FORMAT_VERSION, FORMAT_VERSION_KEY, HIGH_TYPE_KEY, LOW_TYPE_KEY, PROVENANCE_KEY
from pyedgemoe.output_files import check_output, terminate_cleanly
from pyedgemoe.sysmem import format_bytes

ALIGNMENT = 4096
_PARTIAL_TAG_BYTES = 4  # random bytes in a temp file's name (hex), beside the writer's PID

# numpy dtypes a produce() callback may return instead of raw bytes, per ggml type.
_NUMPY_DTYPE_OF_TYPE = {
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.float16),
    "f64": np.dtype(np.float64),
    "i8": np.dtype(np.int8),
    "i16": np.dtype(np.int16),
    "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64),
}


def ggml_type(type_name: str) -> gguf.GGMLQuantizationType:
    """The gguf-py enum member of a ggml type name ("q4_K", "f16", ...); case-insensitive."""
    try:
        return gguf.GGMLQuantizationType[type_name.upper()]
    except KeyError:
        known = ", ".join(ggml_type_name(t) for t in gguf.GGMLQuantizationType)
        raise ConversionError(f"unknown ggml type {type_name!r} (known: {known})") from None


def ggml_type_name(qtype: gguf.GGMLQuantizationType | int) -> str:
    """ggml's own spelling of a type (`ggml_type_name`): lower case except the K of K-quants."""
    name = gguf.GGMLQuantizationType(qtype).name.lower()
    return name[:-2] + "_K" if name.endswith("_k") else name


def block_size(type_name: str) -> int:
    """Elements per quantization block of a type (1 for f32/f16/bf16)."""
    return gguf.GGML_QUANT_SIZES[ggml_type(type_name)][0]


def row_nbytes(type_name: str, row_len: int) -> int:
    """Bytes of one row of `row_len` elements; ConversionError if the type cannot hold such a row."""
    qtype = ggml_type(type_name)
    blck, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if row_len % blck != 0:
        raise ConversionError(
            f"type {ggml_type_name(qtype)} quantizes rows in blocks of {blck} elements, "
            f"but the row length is {row_len}; choose a type whose block size divides it "
            f"(q8_0/q4_0 need a multiple of 32, K-quants a multiple of 256, f32/f16/bf16 any)")
    return row_len // blck * type_size


def tensor_nbytes(type_name: str, ne: list[int] | tuple[int, ...]) -> int:
    """Bytes of a tensor of ggml shape `ne` (ne[0] = row length) in `type_name`."""
    return row_nbytes(type_name, int(ne[0])) * prod(int(n) for n in ne[1:])


def llama_file_type(type_name: str) -> int:
    """`general.file_type` llama.cpp writes for a file whose main weights are `type_name`."""
    special = {"q2_K": "MOSTLY_Q2_K", "q3_K": "MOSTLY_Q3_K_M", "q4_K": "MOSTLY_Q4_K_M",
               "q5_K": "MOSTLY_Q5_K_M", "q6_K": "MOSTLY_Q6_K", "f32": "ALL_F32"}
    name = ggml_type_name(ggml_type(type_name))
    member = special.get(name, "MOSTLY_" + name.upper())
    try:
        return int(gguf.LlamaFileType[member])
    except KeyError:
        return int(gguf.LlamaFileType.GUESSED)


def edgemoe_metadata(writer: gguf.GGUFWriter, high_type: str, low_type: str, provenance: dict,
                     calibration: dict | None = None) -> None:
    """Write the `edgemoe.*` keys of docs/format.md. `provenance` gets a `tool` entry if it has none;
    `calibration` (a `pyedgemoe calibrate` sidecar's contents) becomes the `edgemoe.calibration.*` keys."""
    prov = {"tool": f"pyedgemoe {_tool_version()}", "source": None, "source_type": None, "low_from": None}
    prov.update(provenance)
    writer.add_uint32(FORMAT_VERSION_KEY, FORMAT_VERSION)
    writer.add_string(HIGH_TYPE_KEY, ggml_type_name(ggml_type(high_type)))
    writer.add_string(LOW_TYPE_KEY, ggml_type_name(ggml_type(low_type)))
    writer.add_string(PROVENANCE_KEY, json.dumps(prov, sort_keys=True))
    if calibration is not None:
        from pyedgemoe.calibration.sidecar import calibration_metadata, of_the_model
        kv = {key: v.value for shard in writer.kv_data for key, v in shard.items()}  # the model's, written already
        try:
            of_the_model(calibration, kv, "--calibration")
        except InvalidOptionError as e:
            raise ConversionError(str(e)) from None
        add = {"f32": writer.add_float32, "f32_array": writer.add_array, "string": writer.add_string}
        for key, value, kind in calibration_metadata(calibration):
            add[kind](key, value)


def _tool_version() -> str:
    try:
        from importlib.metadata import version
        return version("pyedgemoe")
    except Exception:
        import pyedgemoe
        return getattr(pyedgemoe, "__version__", "dev")


@dataclass
class _PlannedTensor:
    name: str
    ne: list[int]
    type_name: str
    nbytes: int
    produce: Callable[[], np.ndarray]


class GGUFOutput:
    """A GGUF file being written: declare KV (via `writer`) and tensors, then `finish()`.

    `writer` is a gguf-py GGUFWriter with the architecture and `general.alignment` = 4096 already
    set; use its `add_*` methods for metadata, never its tensor or file methods.
    """

    def __init__(self, out_path: Path, *, arch: str, force: bool = False):
        self.out_path = Path(out_path)  # as given: what messages name and finish() returns
        self.force = force
        self._target = output_target(self.out_path, force)
        directory = self._target.parent
        if not directory.is_dir():
            raise ConversionError(f"output directory {directory} does not exist")
        if not os.access(directory, os.W_OK):
            raise ConversionError(f"output directory {directory} is not writable")
        self.writer = gguf.GGUFWriter(None, arch)
        self.writer.add_custom_alignment(ALIGNMENT)
        self._tensors: list[_PlannedTensor] = []
        self._names: set[str] = set()
        self._tmp_path: Path | None = None
        self._finished = False
        self._bar: _Progress | None = None

    # -- declaring tensors ---------------------------------------------------------------------

    def add_tensor(self, name: str, ne: list[int], type_name: str,
                   produce: Callable[[], np.ndarray]) -> None:
        """Declare a tensor of ggml shape `ne` (ne[0] = row length) and type `type_name`.

        `produce()` is called once, during `finish()`, in add order; it returns the final bytes
        (uint8, already quantized) or, for f32/f16 (and integer types), an array of that dtype.
        It may instead return an iterator of such arrays (consecutive pieces of the tensor, e.g.
        groups of rows), so that not even one whole tensor has to be in memory.
        """
        if self._finished:
            raise ConversionError("GGUFOutput.add_tensor after finish()")
        if name in self._names:
            raise ConversionError(f"duplicate tensor name {name!r}")
        ne = [int(n) for n in ne]
        if not ne or any(n <= 0 for n in ne) or len(ne) > 4:
            raise ConversionError(f"tensor {name}: invalid shape {ne}")
        qtype = ggml_type(type_name)
        try:
            nbytes = tensor_nbytes(type_name, ne)
        except ConversionError as e:
            raise ConversionError(f"tensor {name} {ne}: {e}") from None
        # gguf-py takes the numpy-order shape and, with a non-uint8 dtype, keeps it as given.
        self.writer.add_tensor_info(name, list(reversed(ne)), np.dtype(np.float32), nbytes, raw_dtype=qtype)
        self._names.add(name)
        self._tensors.append(_PlannedTensor(name, ne, ggml_type_name(qtype), nbytes, produce))

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data (before alignment padding)."""
        return sum(t.nbytes for t in self._tensors)

    def plan(self) -> list[dict]:
        """The declared tensors: name, ne, type, nbytes (what --dry-run prints)."""
        return [{"name": t.name, "ne": list(t.ne), "type": t.type_name, "nbytes": t.nbytes}
                for t in self._tensors]

    # -- writing -------------------------------------------------------------------------------

    def finish(self, progress: bool = True) -> Path:
        """Write everything to a temp file, fsync, rename to `out_path`; return `out_path`."""
        if self._finished:
            raise ConversionError("GGUFOutput.finish called twice")
        self._finished = True
        with terminate_cleanly():
            self._write_and_rename(progress)
        return self.out_path

    def _write_and_rename(self, progress: bool) -> None:
        directory = self._target.parent
        try:
            self._tmp_path = create_partial_file(self._target)
            self._check_free_space(directory)
            self._write_all(progress)
            if self._target.exists() and not self.force:
                raise ConversionError(f"{self.out_path} appeared while writing; pass --force to overwrite it")
            os.replace(self._tmp_path, self._target)
            self._tmp_path = None
            _fsync_dir(directory)
        except ConversionError:
            self.abort()
            raise
        except OSError as e:
            self.abort()
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ConversionError(
                    f"disk full while writing {self.out_path} ({self.total_bytes:,} bytes of tensor data "
                    f"needed); no output file was left behind" + _stale_note(self._target)) from None
            raise ConversionError(f"cannot write {self.out_path}: {e}") from None
        except BaseException as e:  # KeyboardInterrupt included: never leave the temp file
            self.abort()
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            if isinstance(e, MemoryError):
                raise ConversionError(f"out of memory while writing {self.out_path}") from None
            raise ConversionError(f"writing {self.out_path} failed: {type(e).__name__}: {e}") from e

    def abort(self) -> None:
        """Close and remove the temp file, if any. Safe to call more than once."""
        if self._bar is not None:
            self._bar.interrupted()
            self._bar = None
        w = self.writer
        try:
            w.close()
        except Exception:
            pass
        if self._tmp_path is not None:
            try:
                self._tmp_path.unlink()
            except FileNotFoundError:
                pass
            self._tmp_path = None
        self._finished = True

    def _check_free_space(self, directory: Path) -> None:
        # Fail before writing gigabytes if the data cannot fit; the ENOSPC handler covers the rest
        # (metadata, padding, other writers filling the disk meanwhile).
        need = sum(gguf.GGUFWriter.ggml_pad(t.nbytes, ALIGNMENT) for t in self._tensors)
        try:
            st = os.statvfs(directory)
        except OSError:
            return
        free = st.f_bavail * st.f_frsize
        if need > free:
            raise OSError(errno.ENOSPC, "No space left on device")

    def _write_all(self, progress: bool) -> None:
        w = self.writer
        assert self._tmp_path is not None
        w.open_output_file(self._tmp_path)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None and len(w.fout) == 1
        fout = w.fout[0]
        w.write_padding(fout, fout.tell())
        bar = self._bar = _Progress(self.total_bytes, enabled=progress)
        for t in self._tensors:
            result = t.produce()
            pieces = [result] if _is_single(result) else result
            written = 0
            for piece in pieces:
                data = _as_bytes(t, piece)
                if written + data.nbytes > t.nbytes:
                    raise ConversionError(f"tensor {t.name} ({t.type_name}, ne={t.ne}): produce() returned "
                                          f"more than the expected {t.nbytes} bytes")
                fout.write(data)
                written += data.nbytes
                bar.update(t.name, data.nbytes)
                del data, piece
            if written != t.nbytes:
                raise ConversionError(f"tensor {t.name} ({t.type_name}, ne={t.ne}): produce() returned "
                                      f"{written} bytes, expected {t.nbytes}")
            w.write_padding(fout, t.nbytes)
            del result, pieces
            t.produce = _consumed
        fout.flush()
        os.fsync(fout.fileno())
        w.close()
        bar.done()
        bar.enabled = False


def output_path(out: str | os.PathLike, inputs: Sequence[str | os.PathLike] = ()) -> Path:
    """out as a Path. A Path drops a trailing separator, and `-o new/` would write the file `new`:
    such a path is refused here, as is one of inputs (check_output says why)."""
    if os.fspath(out).endswith(os.sep) or inputs:
        _check_output(out, inputs)
    return Path(out)


def _check_output(out: str | os.PathLike, inputs: Sequence[str | os.PathLike]) -> None:
    try:
        check_output(out, "output", list(inputs))
    except InvalidOptionError as e:
        raise ConversionError(str(e)) from None


def output_target(out: Path, force: bool, inputs: Sequence[str | os.PathLike] = ()) -> Path:
    """The file to write for the output path `out`: a symlink's target, as llama.cpp's tools write
    through the path. ConversionError if it is not a regular file (the finished file replaces the
    target, and a device (as root, /dev/null), a FIFO or a directory must not become a regular
    file), if it is one of the files the conversion reads, `inputs` (also with `force`), or if it
    exists and `force` is not given."""
    target = Path(os.path.realpath(out))
    if target.exists() and not target.is_file():
        raise ConversionError(f"{out} exists and is not a regular file; give a file's path as the output")
    _check_output(out, inputs)
    if target.exists() and not force:
        raise ConversionError(f"{out} exists; pass --force to overwrite it")
    return target


def create_partial_file(out_path: Path) -> Path:
    """Create an empty, uniquely named temp file next to `out_path` (same file system, so the final
    rename is atomic), with the permissions a plain open() would give (mkstemp's are 0600)."""
    for _ in range(100):
        tmp = out_path.parent / f".{out_path.name}.{os.getpid()}.{secrets.token_hex(_PARTIAL_TAG_BYTES)}.partial"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise ConversionError(f"cannot create a temporary file next to {out_path}")


def stale_partial_files(out_path: Path) -> list[Path]:
    """The temp files (create_partial_file's) of earlier writes of `out_path` whose process is gone:
    what a SIGKILL, a crash or a power cut leaves. Only named, never removed: a process of another
    machine sharing the folder (NFS) may be writing one, and its PID means nothing here."""
    name = re.compile(rf"\.{re.escape(out_path.name)}\.(\d+)\.[0-9a-f]{{{2 * _PARTIAL_TAG_BYTES}}}\.partial")
    try:
        entries = sorted(os.listdir(out_path.parent))
    except OSError:
        return []
    return [out_path.parent / e for e in entries if (m := name.fullmatch(e)) and not _alive(int(m.group(1)))]


def _alive(pid: int) -> bool:
    """Whether a process of this PID runs on this machine (another user's too)."""
    try:
        os.kill(pid, 0)
    except PermissionError:  # another user's
        return True
    except (ProcessLookupError, OverflowError):  # none; a number no PID can be
        return False
    return True


def _consumed() -> np.ndarray:
    raise ConversionError("tensor already written")


def _is_single(result) -> bool:
    return isinstance(result, (np.ndarray, bytes, bytearray, memoryview)) or not hasattr(result, "__iter__")


def _as_bytes(t: _PlannedTensor, arr: np.ndarray) -> memoryview:
    """Validate one piece of what produce() returned for `t` and view it as bytes."""
    if not isinstance(arr, np.ndarray):
        try:
            arr = np.frombuffer(arr, dtype=np.uint8)
        except TypeError:
            raise ConversionError(f"tensor {t.name}: produce() returned {type(arr).__name__}, "
                                  f"not a numpy array") from None
    if arr.dtype != np.uint8:
        want = _NUMPY_DTYPE_OF_TYPE.get(t.type_name)
        if want is None or arr.dtype != want:
            raise ConversionError(f"tensor {t.name} ({t.type_name}): produce() returned dtype {arr.dtype}; "
                                  f"expected uint8 bytes" + (f" or {want}" if want is not None else ""))
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr)
    return memoryview(arr.reshape(-1).view(np.uint8))


def _stale_note(target: Path) -> str:
    stale = stale_partial_files(target)
    if not stale:
        return ""
    nbytes = 0
    for p in stale:
        with contextlib.suppress(OSError):  # removed meanwhile
            nbytes += p.stat().st_size
    return (f"; {len(stale)} temporary file(s) of earlier writes that did not finish (their process is gone) "
            f"hold {format_bytes(nbytes, decimals=1)}: {', '.join(str(p) for p in stale)}; remove them if no "
            f"other machine is writing them")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _Progress:
    """One status line on stderr: tensor name, bytes done/total, ETA. Redrawn in place on a
    terminal, at most once every 2 s as separate lines otherwise (logs stay short)."""

    def __init__(self, total: int, enabled: bool):
        self.total = max(total, 1)
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.done_bytes = 0
        self.t0 = time.monotonic()
        self.last = 0.0

    def update(self, name: str, nbytes: int) -> None:
        self.done_bytes += nbytes
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last < (0.2 if self.tty else 2.0) and self.done_bytes < self.total:
            return
        self.last = now
        elapsed = now - self.t0
        rate = self.done_bytes / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done_bytes) / rate if rate > 0 else 0.0
        line = (f"{100 * self.done_bytes / self.total:5.1f}%  {format_bytes(self.done_bytes, decimals=1)}/"
                f"{format_bytes(self.total, decimals=1)}  ETA {eta:5.0f}s  {name}")
        if self.tty:
            sys.stderr.write("\r\x1b[K" + line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def interrupted(self) -> None:
        # end the in-place status line so an error message starts on a line of its own
        if self.tty and self.done_bytes:
            sys.stderr.write("\n")
            sys.stderr.flush()
        self.enabled = False

    def done(self) -> None:
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write("\n")
        elapsed = time.monotonic() - self.t0
        sys.stderr.write(f"wrote {format_bytes(self.done_bytes, decimals=1)} of tensor data in {elapsed:.1f}s\n")
        sys.stderr.flush()
