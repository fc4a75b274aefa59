"""`export`: a multi-precision GGUF -> a standard GGUF of either precision that stock llama.cpp
(llama-cpp-python) loads and that computes what our runtime computes.

Both runtimes run with the same settings (no flash attention, F32 KV cache), as in
test_logits_match_references.py.
"""
from __future__ import annotations

import filecmp
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from pyedgemoe import Engine
from pyedgemoe.convert.export import export
from pyedgemoe.convert.from_gguf import convert_gguf, copy_kv, open_gguf, tensor_ne
from pyedgemoe.convert.gguf_out import GGUFOutput
from pyedgemoe.errors import ConversionError
from pyedgemoe.gguf_format import FORMAT_VERSION_KEY, KEY_PREFIX, is_expert_tensor, is_low_copy, low_copy_name

SAME_SETTINGS = dict(n_ctx=256, n_threads=2, flash_attn=False, kv_type="f32")
IDS = [1, 17, 42, 99, 5, 230, 64, 7, 150, 33, 12, 201, 88, 3, 120, 45]


def ours(path: Path) -> np.ndarray:
    with Engine(path, **SAME_SETTINGS) as eng:
        return eng.logits(IDS)


def stock(path: Path) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp")
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, n_threads=2, n_threads_batch=2,
                          flash_attn=False, type_k=f32, type_v=f32, verbose=False)
    llm.eval(IDS)
    out = np.array(llm.scores[: len(IDS)], dtype=np.float32)
    llm.close()
    return out


def tensors(path: Path) -> dict:
    reader = open_gguf(path)
    return {t.name: (t, np.array(reader.bytes_of(t))) for t in reader.tensors}


def kv(path: Path) -> dict:
    return {f.name: f.contents() for f in gguf.GGUFReader(path).fields.values() if not f.name.startswith("GGUF.")}


@pytest.fixture(scope="module")
def multi(tiny_model, tmp_path_factory) -> Path:
    """qwen3_moe: experts f32 (HIGH) + q4_0 (LOW)."""
    src, _ = tiny_model("qwen3_moe")
    return convert_gguf(src, tmp_path_factory.mktemp("mp") / "mp.gguf", high="f32", low="q4_0", progress=False)


def test_high_export_loads_in_stock_llama_cpp_with_our_logits_on_the_multi_precision_file(multi, tmp_path):
    high = export(multi, tmp_path / "high.gguf", precision="high", progress=False)
    assert np.max(np.abs(stock(high) - ours(multi))) <= 1e-4


def test_low_export_loads_in_stock_llama_cpp_with_our_logits(multi, tmp_path):
    low = export(multi, tmp_path / "low.gguf", precision="low", progress=False)
    theirs = stock(low)
    assert np.max(np.abs(theirs - ours(low))) <= 1e-4
    # and the LOW experts are really in use: q4_0 moves the logits away from the f32 ones
    assert np.max(np.abs(theirs - ours(multi))) > 1e-3


def test_high_export_is_the_multi_precision_file_without_lowbit_tensors_and_edgemoe_keys(multi, tmp_path):
    high = export(multi, tmp_path / "high.gguf", precision="high", progress=False)
    got, src = tensors(high), tensors(multi)
    assert set(got) == {n for n in src if not is_low_copy(n)}
    for name, (t, data) in got.items():
        assert t.tensor_type == src[name][0].tensor_type and np.array_equal(data, src[name][1]), name
    meta, src_meta = kv(high), kv(multi)
    assert not any(k.startswith(KEY_PREFIX) for k in meta)
    assert meta["general.file_type"] == gguf.LlamaFileType.ALL_F32
    assert meta["tokenizer.ggml.tokens"] == src_meta["tokenizer.ggml.tokens"]
    assert meta["tokenizer.ggml.merges"] == src_meta["tokenizer.ggml.merges"]


def test_low_export_puts_the_lowbit_copies_under_the_standard_names(multi, tmp_path):
    low = export(multi, tmp_path / "low.gguf", precision="low", progress=False)
    got, src = tensors(low), tensors(multi)
    assert not any(is_low_copy(n) for n in got)
    experts = [n for n in got if is_expert_tensor(n)]
    assert len(experts) == 6
    for name in experts:
        copy = src[low_copy_name(name)]
        assert got[name][0].tensor_type == gguf.GGMLQuantizationType.Q4_0
        assert tensor_ne(got[name][0]) == tensor_ne(copy[0])
        assert np.array_equal(got[name][1], copy[1])
    assert np.array_equal(got["blk.0.attn_q.weight"][1], src["blk.0.attn_q.weight"][1])
    assert kv(low)["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_0


def test_high_export_of_a_standard_file_is_a_plain_copy(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe")
    out = export(src, tmp_path / "copy.gguf", precision="high", progress=False)
    assert filecmp.cmp(src, out, shallow=False)


def test_low_export_of_a_standard_file_is_refused(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe")
    with pytest.raises(ConversionError, match="no LOW expert copies"):
        export(src, tmp_path / "low.gguf", precision="low", progress=False)
    assert os.listdir(tmp_path) == []


def test_export_refuses_overwrite_without_force_and_bad_precision(multi, tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"keep")
    with pytest.raises(ConversionError, match="exists; pass --force"):
        export(multi, tmp_path / "x.gguf", progress=False)
    assert (tmp_path / "x.gguf").read_bytes() == b"keep"
    with pytest.raises(ConversionError, match="precision must be one of high, low"):
        export(multi, tmp_path / "y.gguf", precision="medium", progress=False)
    export(multi, tmp_path / "x.gguf", force=True, progress=False)
    assert FORMAT_VERSION_KEY not in kv(tmp_path / "x.gguf")
    # the input as the output: refused as such, not as a file --force would overwrite
    before = Path(multi).read_bytes()
    with pytest.raises(ConversionError, match="is one of the command's inputs"):
        export(multi, multi, progress=False)
    assert Path(multi).read_bytes() == before


def test_a_newer_format_version_is_refused(multi, tmp_path):
    reader = open_gguf(multi)
    o = GGUFOutput(tmp_path / "v2.gguf", arch=reader.get_field("general.architecture").contents())
    copy_kv(reader, o.writer, skip=lambda k: k == FORMAT_VERSION_KEY)
    o.writer.add_uint32(FORMAT_VERSION_KEY, 2)
    for t in reader.tensors:
        o.add_tensor(t.name, tensor_ne(t), gguf.GGMLQuantizationType(t.tensor_type).name,
                     lambda t=t: np.array(reader.bytes_of(t)))
    o.finish(progress=False)
    # the refusal of `inspect` and `run` (model_info)
    with pytest.raises(ConversionError, match="multi-precision GGUF of format version 2; .* upgrade pyedgemoe"):
        export(tmp_path / "v2.gguf", tmp_path / "out.gguf", progress=False)
    assert not (tmp_path / "out.gguf").exists()
