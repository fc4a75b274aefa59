"""Tensor values a conversion must not change silently (docs/convert.md): a BF16 checkpoint's
non-expert matrices default to bf16 as in llama.cpp's `--outtype auto`, a value beyond the 16-bit
type it is written as (f16 ends at 65504) is refused naming the tensor, and so is NaN or Inf in
the checkpoint (a damaged file), for HF and GGUF sources alike.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from pyedgemoe.convert import convert
from pyedgemoe.convert.export import export
from pyedgemoe.errors import ConversionError

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"                # GGUF blk.0.attn_q.weight, a BASE matrix
EXPERT = "model.layers.1.mlp.experts.3.gate_proj.weight"         # in blk.1.ffn_gate_exps.weight
BIG = 2.0 ** 17  # beyond f16 (65504), exact in bf16


def checkpoint(tiny_model, tmp_path: Path, dtype: str, values: dict[str, float]) -> Path:
    """A copy of the tiny Qwen3-MoE checkpoint stored as `dtype`, with element [0, 0] of some tensors set."""
    import torch
    from safetensors.torch import load_file, save_file
    _, hf_dir = tiny_model("qwen3_moe")
    d = tmp_path / "hf"
    shutil.copytree(hf_dir, d)
    tensors = {k: v.to(getattr(torch, dtype)) for k, v in load_file(d / "model.safetensors").items()}
    for name, value in values.items():
        tensors[name][0, 0] = value
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def bf16_tensor(path: Path, name: str) -> np.ndarray:
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    assert t.tensor_type == gguf.GGMLQuantizationType.BF16
    return (np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def test_the_default_base_type_is_llama_cpps_auto_bf16_for_a_bf16_checkpoint(tiny_model, tmp_path):
    bf16 = checkpoint(tiny_model, tmp_path / "bf16", "bfloat16", {Q_PROJ: BIG})
    out = convert(bf16, tmp_path / "bf16.gguf", high="bf16", low="q4_0", progress=False)
    assert bf16_tensor(out, "blk.0.attn_q.weight")[0, 0] == BIG  # f16 would have made it inf
    f32 = convert(tiny_model("qwen3_moe")[1], tmp_path / "f32.gguf", dry_run=True, progress=False)
    assert f32.base_type == "f16"


@pytest.mark.parametrize("tensor, option, kwargs", [(Q_PROJ, "--base", {"base": "f16"}),
                                                    (EXPERT, "--high", {"high": "f16", "low": "q4_0"}),
                                                    (EXPERT, "--low", {"high": "f32", "low": "f16"})])
def test_a_value_beyond_f16_is_refused_naming_the_tensor(tiny_model, tmp_path, tensor, option, kwargs):
    d = checkpoint(tiny_model, tmp_path, "bfloat16", {tensor: -BIG})
    out = tmp_path / "out.gguf"
    with pytest.raises(ConversionError, match=rf"^tensor {tensor} holds -131072, beyond the range of f16, which "
                                              rf"would write it as inf; give {option} bf16 or f32$"):
        convert(d, out, progress=False, **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_value_beyond_f16_is_one_error_line_on_the_cli(tiny_model, tmp_path):
    d = checkpoint(tiny_model, tmp_path, "float32", {Q_PROJ: BIG})  # an F32 checkpoint's default is f16
    r = subprocess.run([sys.executable, "-m", "pyedgemoe", "convert", str(d), "-o", str(tmp_path / "out.gguf")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.splitlines()[-1] == (f"error: tensor {Q_PROJ} holds 131072, beyond the range of f16, which "
                                         f"would write it as inf; give --base bf16 or f32")
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize("tensor", [Q_PROJ, EXPERT])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nan_or_inf_in_the_checkpoint_is_refused_naming_the_tensor(tiny_model, tmp_path, tensor, value):
    d = checkpoint(tiny_model, tmp_path, "float32", {tensor: value})
    for kwargs in ({}, {"high": "f32", "low": "f32", "base": "f32"}):
        with pytest.raises(ConversionError, match=rf"^tensor {tensor} holds NaN or Inf values: the checkpoint "
                                                  rf"is damaged"):
            convert(d, tmp_path / "out.gguf", progress=False, **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_gguf_value_beyond_f16_is_refused_naming_the_tensor(tiny_model, tmp_path):
    d = checkpoint(tiny_model, tmp_path, "float32", {Q_PROJ: BIG})
    mp = convert(d, tmp_path / "mp.gguf", high="f32", low="f32", base="f32", progress=False)
    src = export(mp, tmp_path / "f32.gguf", progress=False)
    with pytest.raises(ConversionError, match=r"^tensor blk\.0\.attn_q\.weight holds 131072, beyond the range of "
                                              r"f16, which would write it as inf; give --base bf16 or f32$"):
        convert(src, tmp_path / "out.gguf", high="f32", low="q4_0", base="f16", progress=False)
    assert not (tmp_path / "out.gguf").exists()
