"""Standard GGUF -> multi-precision GGUF (docs/format.md), and the streaming writer under it.

The tiny models' rows are 16-64 elements long, so the LOW types tested are q8_0 and q4_0 (blocks
of 32); K-quants (blocks of 256) are tested only for the clear error they must give. Quantized
bytes are checked against gguf-py's numpy implementation of Q8_0/Q4_0, which is independent of
the ggml quantizer the converter calls.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import rewrite_gguf
from pyedgemoe import Engine
from pyedgemoe.convert import convert
from pyedgemoe.convert.from_gguf import convert_gguf, open_gguf, tensor_ne
from pyedgemoe.convert.gguf_out import GGUFOutput
from pyedgemoe.errors import ConversionError
from pyedgemoe.gguf_format import (
    FORMAT_VERSION_KEY,
    HIGH_TYPE_KEY,
    LOW_COPY_SUFFIX,
    LOW_TYPE_KEY,
    PROVENANCE_KEY,
    expert_tensor_name,
    is_expert_tensor,
    is_low_copy,
    low_copy_name,
)
from pyedgemoe.model_info import read_model_info

SAME_SETTINGS = dict(n_ctx=256, n_threads=2, flash_attn=False, kv_type="f32")
IDS = [1, 17, 42, 99, 5, 230, 64, 7, 150, 33, 12, 201, 88, 3, 120, 45]
# Architectures whose expert rows (32 and 64 elements) fit 32-element blocks. Mixtral's down
# projection has 48-element rows: it is the case for the "type cannot quantize this row" error.
BLOCK32_ARCHS = ["qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v2"]


def tensors(path: Path) -> dict:
    reader = open_gguf(path)
    return {t.name: (t, reader) for t in reader.tensors}


def raw(entry) -> np.ndarray:
    t, reader = entry
    return np.array(reader.bytes_of(t))


def kv(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}


def logits(path: Path) -> np.ndarray:
    with Engine(path, **SAME_SETTINGS) as eng:
        return eng.logits(IDS)


def reference_quant(f32_bytes: np.ndarray, ne: list[int], qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    rows = f32_bytes.view(np.float32).reshape(-1, ne[0])
    return gguf.quants.quantize(rows, qtype).reshape(-1).view(np.uint8)


def files_in(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# -- conversion ----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", BLOCK32_ARCHS)
def test_high_f32_gives_the_source_logits_exactly(tiny_model, tmp_path, arch):
    src, _ = tiny_model(arch)
    out = convert_gguf(src, tmp_path / "mp.gguf", high="f32", low="q4_0", progress=False)
    assert np.array_equal(logits(out), logits(src))


def test_every_routed_expert_tensor_gets_a_lowbit_copy_of_the_same_shape(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe")
    out = convert_gguf(src, tmp_path / "mp.gguf", high="f32", low="q4_0", progress=False)
    got = tensors(out)
    source = tensors(src)
    experts = [n for n in source if is_expert_tensor(n)]
    assert len(experts) == 2 * 3
    for name in experts:
        low = got[low_copy_name(name)][0]
        assert tensor_ne(low) == tensor_ne(got[name][0])
        assert low.tensor_type == gguf.GGMLQuantizationType.Q4_0
    copies = [n for n in got if is_low_copy(n)]
    assert len(copies) == len(experts)
    assert set(got) - set(copies) == set(source)


def test_non_expert_tensors_and_f32_high_experts_keep_the_source_bytes(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe")
    out = convert_gguf(src, tmp_path / "mp.gguf", high="f32", low="q4_0", progress=False)
    got, source = tensors(out), tensors(src)
    for name, entry in source.items():
        assert got[name][0].tensor_type == entry[0].tensor_type
        assert np.array_equal(raw(got[name]), raw(entry)), name


@pytest.mark.parametrize("low,qtype", [("q8_0", gguf.GGMLQuantizationType.Q8_0),
                                       ("q4_0", gguf.GGMLQuantizationType.Q4_0)])
def test_lowbit_bytes_equal_an_independent_quantization_of_the_source(tiny_model, tmp_path, low, qtype):
    src, _ = tiny_model("qwen3_moe")
    out = convert_gguf(src, tmp_path / "mp.gguf", high="f32", low=low, progress=False)
    got, source = tensors(out), tensors(src)
    for name in (n for n in source if is_expert_tensor(n)):
        expected = reference_quant(raw(source[name]), tensor_ne(source[name][0]), qtype)
        assert np.array_equal(raw(got[low_copy_name(name)]), expected), name


def test_high_q8_0_experts_equal_an_independent_quantization(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe")
    out = convert_gguf(src, tmp_path / "mp.gguf", high="q8_0", low="q4_0", progress=False)
    got, source = tensors(out), tensors(src)
    name = expert_tensor_name(1, "down")
    expected = reference_quant(raw(source[name]), tensor_ne(source[name][0]), gguf.GGMLQuantizationType.Q8_0)
    assert got[name][0].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert np.array_equal(raw(got[name]), expected)


def test_experts_already_in_the_high_type_are_copied_not_requantized(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe", "q8_0")
    out = convert_gguf(src, tmp_path / "mp.gguf", high="q8_0", low="q4_0", progress=False)
    got, source = tensors(out), tensors(src)
    for name in (n for n in source if is_expert_tensor(n)):
        assert np.array_equal(raw(got[name]), raw(source[name]))
    assert np.array_equal(logits(out), logits(src))


def test_metadata_keys_alignment_and_tokenizer(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe")
    out = convert_gguf(src, tmp_path / "mp.gguf", high="f32", low="q8_0", progress=False)
    meta, source_meta = kv(out), kv(src)
    assert meta[FORMAT_VERSION_KEY] == 1
    assert meta[HIGH_TYPE_KEY] == "f32"
    assert meta[LOW_TYPE_KEY] == "q8_0"
    provenance = json.loads(meta[PROVENANCE_KEY])
    assert provenance["source"] == str(src) and provenance["source_type"] == "gguf"
    assert provenance["low_from"] is None and provenance["tool"].startswith("pyedgemoe ")
    assert meta["general.alignment"] == 4096
    assert meta["general.file_type"] == gguf.LlamaFileType.ALL_F32
    for key, value in source_meta.items():
        if key not in ("general.alignment", "general.file_type"):
            assert meta[key] == value, key
    assert len(meta["tokenizer.ggml.tokens"]) == 384
    reader = gguf.GGUFReader(out)
    assert reader.data_offset % 4096 == 0
    assert all(t.data_offset % 4096 == 0 for t in reader.tensors)


def test_base_type_requantizes_matrices_but_keeps_norms_and_router(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe")
    out = convert_gguf(src, tmp_path / "mp.gguf", high="f32", low="q4_0", base="f16", progress=False)
    got = tensors(out)
    F16, F32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
    assert got["blk.0.attn_q.weight"][0].tensor_type == F16
    assert got["token_embd.weight"][0].tensor_type == F16
    assert got["blk.0.attn_norm.weight"][0].tensor_type == F32
    assert got["blk.0.ffn_gate_inp.weight"][0].tensor_type == F32
    assert got["blk.0.ffn_up_exps.weight"][0].tensor_type == F32
    q = raw(got["blk.0.attn_q.weight"]).view(np.float16)
    assert np.array_equal(q, raw(tensors(src)["blk.0.attn_q.weight"]).view(np.float32).astype(np.float16))
    assert np.max(np.abs(logits(out) - logits(src))) < 0.05


def test_base_type_too_wide_for_the_rows_falls_back_as_llama_cpp_does(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe")
    plan = convert_gguf(src, tmp_path / "mp.gguf", high="f32", low="q4_0", base="q4_K", dry_run=True)
    attn_q = next(t for t in plan["tensors"] if t["name"] == "blk.0.attn_q.weight")
    # rows of 64 do not fill q4_K's 256-element blocks; llama.cpp's fallback for q4_K is q5_0
    assert attn_q["type"] == "q5_0" and "instead of q4_K" in attn_q["action"]


def test_dry_run_returns_the_plan_and_writes_nothing(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe")
    plan = convert_gguf(src, tmp_path / "mp.gguf", high="q8_0", low="q4_0", dry_run=True)
    assert files_in(tmp_path) == []
    # 2 layers x 3 tensors x 8 experts x 64x32 elements, 32-element blocks of 34 (q8_0) / 18 (q4_0) bytes
    n_blocks = 2 * 3 * 8 * 64 * 32 // 32
    assert plan["bytes"]["high"] == n_blocks * 34
    assert plan["bytes"]["low"] == n_blocks * 18
    assert plan["high_type"] == "q8_0" and plan["low_type"] == "q4_0"
    assert sum(t["role"] == "low" for t in plan["tensors"]) == 6


# -- --low-from ----------------------------------------------------------------------------------

def test_low_from_takes_the_low_copies_from_the_second_file(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe")
    low_src, _ = tiny_model("qwen3_moe", "q8_0")
    out = convert_gguf(src, tmp_path / "mp.gguf", high="f32", low_from=low_src, progress=False)
    got, lows = tensors(out), tensors(low_src)
    for name in (n for n in lows if is_expert_tensor(n)):
        low = got[low_copy_name(name)]
        assert low[0].tensor_type == gguf.GGMLQuantizationType.Q8_0
        assert np.array_equal(raw(low), raw(lows[name]))
    meta = kv(out)
    assert meta[LOW_TYPE_KEY] == "q8_0"
    assert json.loads(meta[PROVENANCE_KEY])["low_from"] == str(low_src)
    assert np.array_equal(logits(out), logits(src))


def test_low_from_with_a_different_shape_is_refused_and_writes_nothing(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe")
    bad = rewrite_gguf(tiny_model("qwen3_moe", "q8_0")[0], tmp_path / "bad.gguf", shrink="blk.1.ffn_up_exps.weight")
    with pytest.raises(ConversionError, match=r"blk\.1\.ffn_up_exps\.weight has shape \[64, 32, 4\]"):
        convert_gguf(src, tmp_path / "mp.gguf", high="f32", low_from=bad, progress=False)
    assert files_in(tmp_path) == ["bad.gguf"]


def test_low_from_of_another_architecture_is_refused(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe")
    other = rewrite_gguf(tiny_model("qwen3_moe", "q8_0")[0], tmp_path / "other.gguf", arch="olmoe")
    with pytest.raises(ConversionError, match="'olmoe' model, the source is 'qwen3moe'"):
        convert_gguf(src, tmp_path / "mp.gguf", high="f32", low_from=other, progress=False)
    assert files_in(tmp_path) == ["other.gguf"]


def test_low_beside_low_from_is_refused(tiny_model, tmp_path):
    """Both name the LOW copies; --low was ignored beside --low-from."""
    src, _ = tiny_model("qwen3_moe")
    with pytest.raises(ConversionError, match="^--low q4_0 and --low-from both give the LOW copies"):
        convert_gguf(src, tmp_path / "mp.gguf", low="q4_0", low_from=tiny_model("qwen3_moe", "q8_0")[0],
                     progress=False)
    assert files_in(tmp_path) == []


def test_low_copies_larger_than_high_ones_are_refused(tiny_model, tmp_path):
    """LOW is the copy read for an unimportant miss: one larger than HIGH was taken without a word."""
    src, hf_dir = tiny_model("qwen3_moe")
    for source in (src, hf_dir):
        with pytest.raises(ConversionError, match=r"^--low q8_0 \(8\.5 bits per weight\) is larger than "
                                                  r"--high q4_0 \(4\.5\)"):
            convert(source, tmp_path / "mp.gguf", high="q4_0", low="q8_0", progress=False)
    with pytest.raises(ConversionError, match=r"^--low-from .*q8_0\.gguf's type q8_0 \(8\.5 bits per weight\) "
                                              r"is larger than --high q4_0"):
        convert_gguf(src, tmp_path / "mp.gguf", high="q4_0", low_from=tiny_model("qwen3_moe", "q8_0")[0],
                     progress=False)
    for source in (src, hf_dir):  # --low not given: its default is named
        with pytest.raises(ConversionError, match=r"^the default --low q4_K \(4\.5 bits per weight\) is larger than "
                                                  r"--high q2_K \(2\.625\)"):
            convert(source, tmp_path / "mp.gguf", high="q2_K", progress=False)
    assert files_in(tmp_path) == []
    same = convert(src, tmp_path / "same.gguf", high="q8_0", low="q8_0", progress=False)
    assert read_model_info(same).multi_precision


# -- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("high,low", [("f32", "q4_K"), ("q6_K", "q4_0")])
def test_a_type_whose_blocks_do_not_fit_the_rows_is_a_clear_error(tiny_model, tmp_path, high, low):
    src, _ = tiny_model("qwen3_moe")
    with pytest.raises(ConversionError, match=r"exps.* blocks of 256 elements, but the row length is (32|64)"):
        convert_gguf(src, tmp_path / "mp.gguf", high=high, low=low, progress=False)
    assert files_in(tmp_path) == []


def test_mixtral_48_element_rows_do_not_fit_q4_0(tiny_model, tmp_path):
    src, _ = tiny_model("mixtral")
    low_copy = re.escape(f"ffn_down_exps{LOW_COPY_SUFFIX} [48, 64, 4]")
    with pytest.raises(ConversionError, match=low_copy + ".*blocks of 32"):
        convert_gguf(src, tmp_path / "mp.gguf", high="f32", low="q4_0", progress=False)
    out = convert_gguf(src, tmp_path / "mp.gguf", high="f32", low="f16", progress=False)
    assert np.array_equal(logits(out), logits(src))


def test_unknown_or_imatrix_types_are_refused(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe")
    with pytest.raises(ConversionError, match="unknown ggml type 'q5_x'"):
        convert_gguf(src, tmp_path / "mp.gguf", high="q5_x", low="q4_0", progress=False)
    with pytest.raises(ConversionError, match="importance matrix"):
        convert_gguf(src, tmp_path / "mp.gguf", high="f32", low="iq2_xxs", progress=False)


def test_a_multi_precision_source_is_refused(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe")
    mp = convert_gguf(src, tmp_path / "mp.gguf", high="f32", low="q4_0", progress=False)
    with pytest.raises(ConversionError, match="already is a multi-precision GGUF"):
        convert_gguf(mp, tmp_path / "again.gguf", high="f32", low="q8_0", progress=False)


def test_a_dense_model_is_refused(tiny_model, tmp_path):
    src, _ = tiny_model("llama")
    with pytest.raises(ConversionError, match="not a Mixture-of-Experts model"):
        convert_gguf(src, tmp_path / "mp.gguf", progress=False)


def test_existing_output_needs_force(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe")
    (tmp_path / "mp.gguf").write_bytes(b"keep me")
    with pytest.raises(ConversionError, match="exists; pass --force"):
        convert_gguf(src, tmp_path / "mp.gguf", high="f32", low="q4_0", progress=False)
    assert (tmp_path / "mp.gguf").read_bytes() == b"keep me"
    convert_gguf(src, tmp_path / "mp.gguf", high="f32", low="q4_0", force=True, progress=False)
    assert kv(tmp_path / "mp.gguf")[LOW_TYPE_KEY] == "q4_0"


# -- the writer ----------------------------------------------------------------------------------

def small_output(path: Path, produce_second, **kw) -> GGUFOutput:
    o = GGUFOutput(path, arch="llama", **kw)
    o.add_tensor("a.weight", [32, 4], "f32", lambda: np.ones((4, 32), np.float32))
    o.add_tensor("b.weight", [32, 4], "q8_0", produce_second)
    return o


def test_writer_streams_tensors_in_add_order_at_4096_byte_offsets(tmp_path):
    calls = []

    def make(name, arr):
        def produce():
            calls.append(name)
            return arr
        return produce
    o = GGUFOutput(tmp_path / "w.gguf", arch="llama")
    o.add_tensor("a", [32, 2], "f16", make("a", np.full((2, 32), 0.5, np.float16)))
    o.add_tensor("b", [64], "q4_0", make("b", np.arange(36, dtype=np.uint8)))
    assert calls == []
    o.finish(progress=False)
    assert calls == ["a", "b"]
    reader = gguf.GGUFReader(tmp_path / "w.gguf")
    a, b = reader.tensors
    assert [int(n) for n in a.shape] == [32, 2] and a.data_offset % 4096 == 0
    assert b.tensor_type == gguf.GGMLQuantizationType.Q4_0 and b.data_offset % 4096 == 0
    assert np.array_equal(np.array(b.data).reshape(-1).view(np.uint8), np.arange(36, dtype=np.uint8))


def test_writer_accepts_a_tensor_in_pieces_and_reports_progress_on_stderr(tmp_path, capsys):
    rows = np.arange(8 * 32, dtype=np.float32).reshape(8, 32)
    o = GGUFOutput(tmp_path / "w.gguf", arch="llama")
    o.add_tensor("pieces.weight", [32, 8], "f32", lambda: (rows[i: i + 3] for i in range(0, 8, 3)))
    out = o.finish(progress=True)
    t = gguf.GGUFReader(out).tensors[0]
    assert np.array_equal(np.array(t.data), rows)
    err = capsys.readouterr().err
    assert "pieces.weight" in err and "1.0 KiB/1.0 KiB" in err and "ETA" in err
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask


def test_writer_failing_produce_leaves_no_file(tmp_path):
    def boom():
        raise RuntimeError("source went away")
    with pytest.raises(ConversionError, match="source went away"):
        small_output(tmp_path / "w.gguf", boom).finish(progress=False)
    assert files_in(tmp_path) == []


def test_writer_wrong_size_from_produce_leaves_no_file(tmp_path):
    with pytest.raises(ConversionError, match="returned 10 bytes, expected 136"):
        small_output(tmp_path / "w.gguf", lambda: np.zeros(10, np.uint8)).finish(progress=False)
    assert files_in(tmp_path) == []


def test_writer_keyboard_interrupt_leaves_no_file(tmp_path):
    def interrupted():
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        small_output(tmp_path / "w.gguf", interrupted).finish(progress=False)
    assert files_in(tmp_path) == []


def test_writer_refuses_to_overwrite_without_force(tmp_path):
    (tmp_path / "w.gguf").write_bytes(b"old")
    with pytest.raises(ConversionError, match="exists"):
        GGUFOutput(tmp_path / "w.gguf", arch="llama")
    small_output(tmp_path / "w.gguf", lambda: np.zeros(136, np.uint8), force=True).finish(progress=False)
    assert files_in(tmp_path) == ["w.gguf"] and (tmp_path / "w.gguf").stat().st_size > 4096


def test_writer_rejects_a_row_length_the_type_cannot_block(tmp_path):
    o = GGUFOutput(tmp_path / "w.gguf", arch="llama")
    with pytest.raises(ConversionError, match="t.weight \\[48, 2\\].*blocks of 32 elements"):
        o.add_tensor("t.weight", [48, 2], "q8_0", lambda: None)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 200 KiB tmpfs (needs root); skipped where mounting is not allowed."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to simulate a full disk: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_known_in_advance_is_a_clear_error_and_no_file(tiny_disk):
    o = GGUFOutput(tiny_disk / "w.gguf", arch="llama")
    o.add_tensor("big.weight", [256, 256], "f32", lambda: np.zeros((256, 256), np.float32))  # 256 KiB
    with pytest.raises(ConversionError, match="disk full"):
        o.finish(progress=False)
    assert files_in(tiny_disk) == []


def test_disk_full_while_writing_is_a_clear_error_and_no_file(tiny_disk):
    # Tensor data fits the free space, so only the write itself can find the disk full.
    o = GGUFOutput(tiny_disk / "w.gguf", arch="llama")
    o.writer.add_string("general.description", "x" * 150_000)
    o.add_tensor("t.weight", [4096, 4], "f32", lambda: np.zeros((4, 4096), np.float32))  # 64 KiB
    with pytest.raises(ConversionError, match="disk full"):
        o.finish(progress=False)
    assert files_in(tiny_disk) == []


# -- model_info / inspect ------------------------------------------------------------------------

def test_model_info_reports_the_bytes_of_each_precision(tiny_model, tmp_path):
    src, _ = tiny_model("qwen3_moe")
    out = convert_gguf(src, tmp_path / "mp.gguf", high="q8_0", low="q4_0", progress=False)
    info = read_model_info(out)
    # per layer: 3 tensors x 8 experts x 64x32 elements = 192 blocks of 32 per tensor-expert
    blocks_per_layer = 3 * 8 * 64 * 32 // 32
    assert info.multi_precision and info.format_version == 1
    assert (info.high_type, info.low_type) == ("q8_0", "q4_0")
    assert info.high_expert_bytes_per_layer == {0: blocks_per_layer * 34, 1: blocks_per_layer * 34}
    assert info.low_expert_bytes_per_layer == {0: blocks_per_layer * 18, 1: blocks_per_layer * 18}
    assert info.expert_bytes == info.high_expert_bytes + info.low_expert_bytes
    d = info.to_dict()
    assert d["high_expert_bytes"] == 2 * blocks_per_layer * 34 and d["low_type"] == "q4_0"
    plain = read_model_info(src)
    assert not plain.multi_precision and plain.high_type is None and plain.low_expert_bytes == 0


def test_inspect_shows_both_precisions_and_their_sizes(tiny_model, tmp_path):
    import sys
    src, _ = tiny_model("qwen3_moe")
    out = convert_gguf(src, tmp_path / "mp.gguf", high="f32", low="q4_0", progress=False)
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "inspect", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "HIGH f32" in r.stdout and "384.00 KiB" in r.stdout  # 2 x 3 x 8 x 64 x 32 x 4 bytes
    assert "LOW  q4_0" in r.stdout and "54.00 KiB" in r.stdout  # 2 x 3 x 8 x 64 blocks x 18 bytes
    assert "multi-precision yes (format 1): HIGH f32, LOW q4_0" in r.stdout
