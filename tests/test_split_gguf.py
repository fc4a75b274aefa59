"""A GGUF split into shards (llama.cpp's gguf-split: NAME-00001-of-0000N.gguf), as the large MoE
models on the Hub come: given its first shard, every command reads all of it, as llama.cpp does.
The experts of every shard are read on demand from their own shard; the tokens and logits are those
of the same model in one file, and of stock llama.cpp on the shards."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from gguf_splits import write_split, write_tensors
from pyedgemoe import Engine
from pyedgemoe.bench.runner import model_files
from pyedgemoe.convert.export import export
from pyedgemoe.convert.from_gguf import convert_gguf, copy_kv, open_gguf
from pyedgemoe.errors import ConversionError, ModelLoadError
from pyedgemoe.model_info import read_model_info

SETTINGS = dict(n_ctx=256, n_threads=2, flash_attn=False, kv_type="f32")
IDS = [1, 17, 42, 99, 5, 230, 64, 7, 150, 33, 12, 201, 88, 3, 120, 45]
N_SHARDS = 3


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    """(a standard q8_0 GGUF of the tiny Qwen3-MoE, its shards, a q4_0 one of the same model in
    shards) in a folder of their own."""
    src, _ = tiny_model("qwen3_moe")
    d = tmp_path_factory.mktemp("split")
    mp = convert_gguf(src, d / "mp.gguf", high="q8_0", low="q4_0", progress=False)
    whole = export(mp, d / "model.gguf", precision="high", progress=False)
    low = export(mp, d / "low.gguf", precision="low", progress=False)
    shards = write_split(whole, d / "shards" / "model.gguf", N_SHARDS)
    low_shards = write_split(low, d / "low-shards" / "low.gguf", N_SHARDS)
    return whole, shards, low_shards, low


def run(path, **options):
    with Engine(path, **SETTINGS, **options) as eng:
        return eng.logits(IDS), eng.time_generation(IDS[:6], 24)["tokens"], eng.stats()


def test_the_shards_are_one_model(models):
    whole, shards, _, _ = models
    info, one = read_model_info(shards[0]), read_model_info(whole)
    assert info.files == tuple(str(s) for s in shards)
    assert info.file_bytes == sum(s.stat().st_size for s in shards)
    assert info.expert_bytes_per_layer == one.expert_bytes_per_layer and info.non_expert_bytes == one.non_expert_bytes
    assert model_files(shards[0]) == shards
    # the split puts expert tensors in more than one shard, so more than one is read from
    source = open_gguf(shards[0])
    assert len({source.file_of(t) for t in source.tensors if "_exps" in t.name}) > 1


@pytest.mark.parametrize("budget", [None, "50%", "25%", "minimum"])
def test_experts_read_from_every_shard_give_the_whole_files_logits(models, budget):
    whole, shards, _, _ = models
    if budget == "minimum":
        with Engine(whole, **SETTINGS, expert_cache="50%") as eng:
            budget = eng.expert_residency["minimum_bytes"]
    options = {} if budget is None else {"expert_cache": budget}
    ref_logits, ref_tokens, _ = run(whole)
    logits, tokens, stats = run(shards[0], **options)
    assert np.array_equal(logits, ref_logits)
    assert tokens == ref_tokens
    if budget is not None:
        assert stats["experts"]["total"]["bytes_read"] > 0


def test_stock_llama_cpp_on_the_shards_gives_the_same_tokens(models):
    llama_cpp = pytest.importorskip("llama_cpp")
    _, shards, _, _ = models
    llm = llama_cpp.Llama(model_path=str(shards[0]), n_ctx=256, n_threads=2, verbose=False)
    stock = llm.create_completion(IDS[:6], max_tokens=24, temperature=0)["choices"][0]["text"]
    llm.close()
    with Engine(shards[0], **SETTINGS, expert_cache="25%") as eng:
        ours = eng.create_completion(IDS[:6], max_tokens=24, temperature=0)["choices"][0]["text"]
    assert ours == stock


def test_low_copies_from_a_split_lower_quant(models):
    whole, _, low_shards, low = models
    options = dict(expert_cache="50%", t1=0.3, t2=0.95)
    a_logits, a_tokens, a_stats = run(whole, low_from=low, **options)
    b_logits, b_tokens, b_stats = run(whole, low_from=low_shards[0], **options)
    assert b_stats["experts"]["total"]["loads_low"] > 0
    assert np.array_equal(a_logits, b_logits) and a_tokens == b_tokens


def test_convert_and_export_read_every_shard(models, tmp_path):
    whole, shards, _, _ = models
    # export of a split standard GGUF: one file, byte for byte the GGUF it was split from
    merged = export(shards[0], tmp_path / "merged.gguf", progress=False)
    assert merged.read_bytes() == whole.read_bytes()
    # convert: the same tensors as from the whole file
    a = convert_gguf(whole, tmp_path / "a.gguf", high="q8_0", low="q4_0", progress=False)
    b = convert_gguf(shards[0], tmp_path / "b.gguf", high="q8_0", low="q4_0", progress=False)
    ra, rb = open_gguf(a), open_gguf(b)
    assert [t.name for t in ra.tensors] == [t.name for t in rb.tensors]
    assert all(np.array_equal(ra.bytes_of(x), rb.bytes_of(y)) for x, y in zip(ra.tensors, rb.tensors))
    assert rb.get_field("split.count") is None  # one file, which llama.cpp must not take for a shard


def test_bad_shards_are_one_clear_error(models, tmp_path):
    _, shards, _, _ = models
    with pytest.raises(ModelLoadError, match="shard 2 of 3 of a split GGUF: give its first shard"):
        read_model_info(shards[1])
    with pytest.raises(ModelLoadError, match="shard 2 of 3 of a split GGUF: give its first shard"):
        Engine(shards[1], **SETTINGS)
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(shards[0], lone / shards[0].name)
    with pytest.raises(ModelLoadError, match=f"shard 2 of 3 of .* is missing or not a GGUF: .*{shards[1].name}"):
        read_model_info(lone / shards[0].name)
    with pytest.raises(ConversionError, match="is missing or not a GGUF"):
        export(lone / shards[0].name, tmp_path / "out.gguf", progress=False)
    renamed = tmp_path / "renamed.gguf"
    shutil.copy(shards[0], renamed)
    with pytest.raises(ModelLoadError, match="not named as one"):
        read_model_info(renamed)


def test_split_keys_of_another_type_are_an_error_not_an_abort(models, tmp_path):
    """ggml's uint16 getter aborts on another type: a crafted split.count of int32 is refused first."""
    whole = models[0]
    reader = open_gguf(whole)
    writer = gguf.GGUFWriter(tmp_path / "crafted-00001-of-00002.gguf", reader.get_field("general.architecture").contents())
    copy_kv(reader, writer, skip=lambda key: False)
    writer.add_key_value("split.count", 2, gguf.GGUFValueType.INT32)
    write_tensors(reader, writer)
    with pytest.raises(ModelLoadError, match="its split.count is not a uint16"):
        read_model_info(tmp_path / "crafted-00001-of-00002.gguf")


def test_the_cli_runs_and_inspects_the_first_shard(models):
    _, shards, _, _ = models
    cli = [sys.executable, "-m", "pyedgemoe"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([*cli, "inspect", str(shards[0])], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert f"in {N_SHARDS} shards)" in r.stdout.splitlines()[0]
    r = subprocess.run([*cli, "inspect", "--json", str(shards[0])], capture_output=True, text=True, env=env)
    assert json.loads(r.stdout)["files"] == [str(s) for s in shards]
    r = subprocess.run([*cli, "run", str(shards[1]), "-p", "hi", "-n", "4"], capture_output=True, text=True, env=env)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and "give its first shard" in r.stderr
