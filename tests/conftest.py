"""Shared fixtures: tiny random models built locally (transformers -> llama.cpp's converter),
cached in tests/.models so a second run does not rebuild them."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
