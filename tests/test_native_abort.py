"""llama.cpp's own aborts (GGML_ASSERT / GGML_ABORT deep in a kernel) end the process with one
`error:` line and exit status 1: no gdb backtrace, no SIGABRT (native/bindings/errors.cpp)."""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

MXFP4 = 39  # a ggml type the CPU's element-wise ops refuse


def with_tensor_type(src: Path, dst: Path, name: bytes, ggml_type: int) -> None:
    """A copy of a GGUF whose tensor `name` says it holds ggml_type: its directory entry is
    name, n_dims (u32), n_dims dims (u64), type (u32), offset (u64)."""
    data = bytearray(src.read_bytes())
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, ggml_type)
    dst.write_bytes(bytes(data))


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyedgemoe.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_an_abort_inside_llama_cpp_is_one_error_line_and_exit_1(mixtral_gguf, tmp_path):
    # output_norm.weight as MXFP4: the file loads (the bytes fit), the first decode's RMS norm
    # multiply hits ggml-cpu's "unsupported types" abort
    bad = tmp_path / "bad-norm-type.gguf"
    with_tensor_type(mixtral_gguf, bad, b"output_norm.weight", MXFP4)
    r = run("run", str(bad), "-p", "hi", "-n", "2", "--no-display-prompt")
    assert r.returncode == 1, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip() and not l.startswith("note: ")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: llama.cpp stopped on an internal check") and "unsupported types" in lines[0]
    assert "backtrace" not in r.stderr.lower() and "Traceback" not in r.stderr
