"""Shared fixtures: tiny random models built locally (transformers -> llama.cpp's converter),
cached in tests/.models so a second run does not rebuild them."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# ggml's OpenMP threads wait passively here (before the native module loads libgomp; subprocesses
# inherit it). The tests run on 2 workers (make test) and ask for 2 threads: on 2 cores two spinning
# teams wait a time slice at every graph node, and a test of a second took 60-100 s (docs/benchmarks.md,
# "A busy machine"). Passive waits cost about 10 % in one process; a test given OMP_WAIT_POLICY keeps it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import tiny_moe  # noqa: E402

MODELS_DIR = REPO / "tests" / ".models"
MOE_ARCHITECTURES = [a for a in tiny_moe.ARCHITECTURES if a != "llama"]


@pytest.fixture(scope="session")
def tiny_model():
    """tiny_model(arch, outtype="f32") -> (gguf path, HF checkpoint dir)."""
    def build(arch: str, outtype: str = "f32") -> tuple[Path, Path]:
        gguf = tiny_moe.tiny_gguf(arch, MODELS_DIR, outtype=outtype)
        return gguf, MODELS_DIR / arch / "hf"
    return build


def rewrite_gguf(src: Path, out: Path, *, arch: str | None = None, shrink: str | None = None,
                 chat_template: str | None = None, keys: dict[str, bool | int | str | None] | None = None) -> Path:
    """A copy of `src` with another architecture name, with tensor `shrink` cut to half its experts,
    with another chat template, or with `keys` set (an int as a uint32, as llama.cpp's counts and ids,
    a str as a string) or, None, removed."""
    keys = keys or {}
    import gguf
    from pyedgemoe.convert.from_gguf import copy_kv, open_gguf, tensor_ne
    from pyedgemoe.convert.gguf_out import GGUFOutput
    reader = open_gguf(src)
    o = GGUFOutput(out, arch=arch or reader.get_field("general.architecture").contents())
    copy_kv(reader, o.writer, skip=lambda k: chat_template is not None and k == gguf.Keys.Tokenizer.CHAT_TEMPLATE
            or k in keys)
    if chat_template is not None:
        o.writer.add_chat_template(chat_template)
    for key, value in keys.items():
        if value is not None:
            add = o.writer.add_bool if isinstance(value, bool) else \
                o.writer.add_string if isinstance(value, str) else o.writer.add_uint32
            add(key, value)
    for t in reader.tensors:
        ne = tensor_ne(t)
        data = reader.bytes_of(t)
        if t.name == shrink:
            data = data[: len(data) // 2]
            ne = ne[:2] + [ne[2] // 2]
        o.add_tensor(t.name, ne, gguf.GGMLQuantizationType(t.tensor_type).name, lambda d=data: np.array(d))
    return o.finish(progress=False)


@pytest.fixture(scope="session")
def mixtral_gguf(tiny_model) -> Path:
    return tiny_model("mixtral")[0]


@pytest.fixture(scope="session")
def shim(tmp_path_factory) -> Path:
    """tests/faults/eio_shim.c built: an LD_PRELOAD that makes reads of one file fail or slow."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler for the fault shim")
    out = tmp_path_factory.mktemp("shim") / "eio_shim.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(out), str(REPO / "tests" / "faults" / "eio_shim.c"),
                    "-ldl"], check=True)
    return out


def recording_completions(llm):
    """llm (ours or llama-cpp-python's Llama), its create_completion calls recorded in llm.calls (a
    grammar as its GBNF text, stripped): what a chat handler made of a chat."""
    llm.calls = []
    create_completion = llm.create_completion

    def recorded(**kwargs):
        grammar = kwargs.get("grammar")
        llm.calls.append({**kwargs, "grammar": grammar and getattr(grammar, "_grammar", grammar).strip()})
        return create_completion(**kwargs)
    llm.create_completion = recorded
    return llm


@contextlib.contextmanager
def in_process_server(engine, model_id: str):
    """A client of the server's app over engine, in this process (FastAPI's TestClient, no socket)."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from pyedgemoe.server.app import create_app

    app = create_app(engine, model_id=model_id)
    with TestClient(app) as client:
        yield client
    app.state.engine_queue.close()


def latin_square(rows, a, b) -> list[tuple]:
    """(row, x, y) for each row and each x of a, with y going round b by row and x (a and b of one
    length, rows at least as many): every pair of any two of the three factors is met, in
    len(rows) * len(a) cases where the whole product has len(b) times more."""
    assert len(a) == len(b) <= len(rows)
    return [(row, x, b[(i + j) % len(b)]) for i, row in enumerate(rows) for j, x in enumerate(a)]
