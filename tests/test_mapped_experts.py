"""expert_cache "mmap": no expert cache, the experts are computed from the mapped file as llama.cpp
does without repacked copies (--no-repack), so the page cache holds what memory allows, and the
other weights are read into memory; "auto" picks it near fit for experts the CPU repacks
(memory_budget.NEAR_FIT_MAPPED_SHARE).

The logits equal stock llama.cpp's with --no-repack on a Q4_K model (which this CPU repacks) and
the resident run's on an F32 one; the choice of "auto" follows the memory it sees. An expert cache
in host memory computes without repacked copies too (repack off by default), as stock does.
"""
from __future__ import annotations

import os
import shutil

import gguf
import llama_cpp
import numpy as np
import pytest

from pyedgemoe import Engine, memory_budget
from pyedgemoe.bench.worker import stock_without_repack
from pyedgemoe.convert.export import export
from pyedgemoe.errors import ExpertLoadError, InvalidOptionError
from pyedgemoe.load_plan import LoadOptions, context_memory_bytes
from pyedgemoe.memory_budget import MAPPED, RUN_ALLOWANCE_BYTES
from pyedgemoe.model_info import read_model_info
from test_expert_residency import DEMO, IDS, SETTINGS, _mapping_rss_bytes, _read_chars, rewrite_in_place, tied_copy

GIB = 1024**3


@pytest.fixture(scope="module")
def q4_k_model(tmp_path_factory):
    return export(DEMO, tmp_path_factory.mktemp("q4_k") / "demo-q4_k.gguf", precision="low", progress=False)


def stock_logits_without_repack(path) -> np.ndarray:
    with stock_without_repack():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, n_threads=2, n_threads_batch=2,
                              flash_attn=False, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                              verbose=False)
    try:
        llm.eval(IDS)
        return np.array(llm.scores[: len(IDS)], dtype=np.float32)
    finally:
        llm.close()


def test_mapped_experts_compute_as_stock_llama_cpp_without_repacking(q4_k_model):
    info = read_model_info(q4_k_model)
    assert info.repacked_expert_bytes == info.high_expert_bytes > 0  # Q4_K: this CPU repacks it
    with Engine(q4_k_model, expert_cache=MAPPED, **SETTINGS) as eng:
        assert eng.experts_mapped and eng.expert_residency is None and eng.stats()["experts_mapped"]
        ours = eng.logits(IDS)
    assert np.array_equal(ours, stock_logits_without_repack(q4_k_model))


def test_the_staging_buffers_of_repacked_reads_are_sized_to_one_experts_projection(q4_k_model):
    info = read_model_info(q4_k_model)
    stacks = [t for t in gguf.GGUFReader(q4_k_model).tensors if "_exps." in t.name]
    assert info.largest_repacked_projection == max(int(t.n_bytes) // info.n_experts for t in stacks) > 0


def test_streamed_experts_compute_as_stock_llama_cpp_without_repacking(q4_k_model):
    with Engine(q4_k_model, expert_cache="50%", **SETTINGS) as eng:
        assert not eng.repack and not eng.stats()["repack"]
        ours = eng.logits(IDS)
    assert np.array_equal(ours, stock_logits_without_repack(q4_k_model))


def test_mapped_experts_cannot_be_repacked(q4_k_model):
    with pytest.raises(InvalidOptionError, match="repack"):
        Engine(q4_k_model, expert_cache=MAPPED, repack=True, **SETTINGS)


def test_mapped_experts_equal_the_resident_run_where_nothing_is_repacked(tiny_model):
    path = tiny_model("qwen3_moe", "f32")[0]
    assert read_model_info(path).repacked_expert_bytes == 0
    with Engine(path, **SETTINGS) as resident, Engine(path, expert_cache="mmap", **SETTINGS) as mapped:
        assert not resident.experts_mapped and mapped.experts_mapped
        assert np.array_equal(mapped.logits(IDS), resident.logits(IDS))
        assert mapped.time_generation(IDS[:8], 16)["tokens"] == resident.time_generation(IDS[:8], 16)["tokens"]


def available_for_share(path, share: float, n_logits: int = 0, resident: bool = False) -> int:
    """The memory available at which "auto" would give a cache of `share` of the model's experts
    (beside n_logits tokens' logits); resident: where share >= 1 keeps every expert in llama.cpp's
    own mapped file, which counts the whole input embedding."""
    info = read_model_info(path)
    kv = context_memory_bytes(info, LoadOptions(**SETTINGS))
    context = memory_budget.context_bytes(info.metadata, kv, SETTINGS["n_ctx"], 512, SETTINGS["flash_attn"],
                                          n_logits=n_logits)
    # the input embedding's rows stay in the mapped file beside a cache
    cold = 0 if resident else info.cold_embedding_bytes
    return int(info.non_expert_bytes - cold + context + RUN_ALLOWANCE_BYTES + share * info.high_expert_bytes)


def test_auto_maps_repacked_experts_near_fit(q4_k_model, monkeypatch):
    # this model's context (n_ctx 256 and a ubatch's logits) takes more than its experts: a cache
    # of 30 % of them leaves the page cache room for all of them until the context fills
    available = available_for_share(q4_k_model, 0.3, n_logits=len(IDS))
    monkeypatch.setattr(memory_budget, "available_memory", lambda: (available, "in this test"))
    with Engine(q4_k_model, **SETTINGS, n_logits=len(IDS)) as eng:
        assert eng.experts_mapped and eng.expert_residency is None
        assert MAPPED in eng.expert_cache_note and "until the context fills" in eng.expert_cache_note
        assert eng.logits(IDS).shape[0] == len(IDS)


def test_auto_caches_experts_the_cpu_does_not_repack_even_near_fit(tiny_model, monkeypatch):
    path = tiny_model("qwen3_moe", "f32")[0]
    available = available_for_share(path, 0.98)  # near fit: a repacked type would be mapped here
    monkeypatch.setattr(memory_budget, "available_memory", lambda: (available, "in this test"))
    with Engine(path, **SETTINGS) as eng:
        assert not eng.experts_mapped and eng.expert_residency is not None


def test_auto_leaves_repacking_off_where_the_copies_would_not_fit_beside_the_mapped_experts(q4_k_model, monkeypatch):
    assert read_model_info(q4_k_model).repacked_expert_bytes == read_model_info(q4_k_model).high_expert_bytes
    # every expert fits, resident; their repacked copies fit beside them from twice their bytes
    tight = available_for_share(q4_k_model, 1.9, resident=True)
    monkeypatch.setattr(memory_budget, "available_memory", lambda: (tight, "in this test"))
    with Engine(q4_k_model, **SETTINGS) as eng:
        assert eng.expert_residency is None and not eng.experts_mapped and not eng.repack
        assert "repack off" in eng.expert_cache_note
        ours = eng.logits(IDS)
    assert np.array_equal(ours, stock_logits_without_repack(q4_k_model))
    roomy = available_for_share(q4_k_model, 2.0, resident=True)
    monkeypatch.setattr(memory_budget, "available_memory", lambda: (roomy, "in this test"))
    with Engine(q4_k_model, **SETTINGS) as eng:
        assert eng.repack and "repack off" not in eng.expert_cache_note


def test_auto_near_fit_choice_from_the_numbers():
    # 4 GiB of experts, all repacked, 1 GiB of context: mapped when the page cache could hold all of
    # them until the context fills (a cache would get 76 %), cached at 97 % (the cache 72 %)
    cached = int(0.97 * 4 * GIB) - GIB
    for share, expected in ((1.01, MAPPED), (0.97, cached - cached % memory_budget.AUTO_CACHE_STEP_BYTES)):
        available = 1 * GIB + RUN_ALLOWANCE_BYTES + int(share * 4 * GIB)
        budget, note = memory_budget.parse_expert_cache("auto", 4 * GIB, 1 * GIB, context=1 * GIB, available=available,
                                                        repacked_expert_bytes=4 * GIB)
        assert budget == expected, note
    # at 97 %, an input embedding of 0.2 GiB of the non-expert weights that the run does not read
    # leaves the page cache room for every expert: mapped
    available = 1 * GIB + RUN_ALLOWANCE_BYTES + int(0.97 * 4 * GIB)
    budget, note = memory_budget.parse_expert_cache("auto", 4 * GIB, 1 * GIB, context=1 * GIB, available=available,
                                                    repacked_expert_bytes=4 * GIB, cold_bytes=GIB // 5)
    assert budget == MAPPED, note
    # none repacked: a cache even at 97 %, of what is left after the weights and the context
    available = 1 * GIB + RUN_ALLOWANCE_BYTES + int(0.97 * 4 * GIB)
    budget, note = memory_budget.parse_expert_cache("auto", 4 * GIB, 1 * GIB, context=1 * GIB, available=available)
    cached = int(0.97 * 4 * GIB) - GIB
    assert budget == cached - cached % memory_budget.AUTO_CACHE_STEP_BYTES, note


def test_auto_maps_the_experts_where_the_room_is_below_the_caches_minimum(tiny_model, monkeypatch):
    # stock llama.cpp runs from its mapped file in any memory that holds the rest; a cache needs one
    # layer's top-k experts at once: below that, auto maps the experts instead of refusing
    budget, note = memory_budget.parse_expert_cache("auto", 4 * GIB, 1 * GIB, context=1 * GIB,
                                                    available=2 * GIB + RUN_ALLOWANCE_BYTES + GIB // 8,
                                                    minimum_bytes=GIB // 4)
    assert budget == MAPPED and "below its minimum of 256.00 MiB" in note, note
    budget, _ = memory_budget.parse_expert_cache("auto", 4 * GIB, 1 * GIB, context=1 * GIB,
                                                 available=2 * GIB + RUN_ALLOWANCE_BYTES + GIB // 2, minimum_bytes=GIB // 4)
    assert budget == GIB // 2
    path = tiny_model("mixtral", "f32")[0]
    info = read_model_info(path)
    top_k = info.n_experts_used * max(info.expert_bytes_per_layer.values()) // info.n_experts
    assert info.minimum_cache_bytes() == top_k
    below = available_for_share(path, 0.9 * info.minimum_cache_bytes() / info.high_expert_bytes, n_logits=len(IDS))
    monkeypatch.setattr(memory_budget, "available_memory", lambda: (below, "in this test"))
    with Engine(path, **SETTINGS, n_logits=len(IDS)) as eng:
        assert eng.experts_mapped and "below its minimum" in eng.expert_cache_note
        mapped = eng.logits(IDS)
    monkeypatch.undo()
    with Engine(path, **SETTINGS, expert_cache="100%") as eng:  # every expert resident
        np.testing.assert_array_equal(mapped, eng.logits(IDS))


def test_mmap_is_refused_when_the_non_expert_weights_and_context_do_not_fit():
    with pytest.raises(InvalidOptionError, match="not enough memory"):
        memory_budget.parse_expert_cache("mmap", 4 * GIB, 1 * GIB, context=1 * GIB, available=1 * GIB)
    budget, note = memory_budget.parse_expert_cache(" MMAP ", 4 * GIB, 1 * GIB, context=1 * GIB, available=3 * GIB)
    assert budget == MAPPED and "page cache" in note


def test_the_input_embedding_is_cold_unless_it_is_also_the_output(tiny_model, tmp_path):
    """A run reads only the embedding rows of its tokens, so their page-cache room counts near fit; a
    model whose output matrix is the embedding (no output.weight: tied) reads all of it each token."""
    from pyedgemoe.convert.from_gguf import open_gguf
    src = tiny_model("qwen3_moe", "f32")[0]
    embedding = next(int(t.n_bytes) for t in open_gguf(src, "model").tensors if t.name == "token_embd.weight")
    assert read_model_info(src).cold_embedding_bytes == embedding > 0
    info = read_model_info(tied_copy(src, tmp_path))
    assert info.cold_embedding_bytes == 0 and info.non_expert_bytes == read_model_info(src).non_expert_bytes - embedding


@pytest.mark.parametrize("expert_cache", [MAPPED, "50%"])
def test_only_the_experts_and_the_embedding_stay_in_the_mapped_file(tiny_model, tmp_path, expert_cache):
    """Mapped experts or an expert cache: the other weights are read into memory at load, where under
    a memory cap the kernel cannot drop them to make room for an expert's pages; the input
    embedding's rows are read from the mapping (the embedding is read too where it is also the
    output), and so are mapped experts; the logits are the resident run's."""
    src = tiny_model("qwen3_moe", "f32")[0]
    for path in (src, tied_copy(src, tmp_path)):
        info = read_model_info(path)
        before = _read_chars()
        with Engine(path, **SETTINGS) as resident:  # everything mapped: the reads of loading it
            resident_loaded = _read_chars() - before
            expected = resident.logits(IDS)
        before = _read_chars()
        with Engine(path, expert_cache=expert_cache, fill_cache=False, **SETTINGS) as eng:
            weights_read = _read_chars() - before - resident_loaded
            np.testing.assert_array_equal(eng.logits(IDS), expected)
            n_maps, rss = _mapping_rss_bytes(path)
        # the mapping's pages: mapped experts', or the embedding rows of the tokens seen
        assert n_maps >= 1 and (rss > 0) == (expert_cache == MAPPED or info.cold_embedding_bytes > 0), (path, rss)
        # llama.cpp reads a small tensor through a 4 KiB buffer, so its reads exceed the bytes read
        assert weights_read >= info.non_expert_bytes - info.cold_embedding_bytes, (path, weights_read)
        if info.cold_embedding_bytes:
            assert weights_read < info.non_expert_bytes, (path, weights_read)


def test_a_mapped_file_changed_while_running_is_a_clear_error_not_sigbus_or_another_models_bytes(tiny_model, tmp_path):
    """The experts are computed from the mapping: each decode first checks that the file is as
    loaded. Written in place (`cp other.gguf model.gguf` keeps the inode), its pages would be another
    model's weights; truncated, touching a page past its end kills the process (SIGBUS)."""
    src = tiny_model("qwen3_moe", "f32")[0]
    path = tmp_path / "model.gguf"
    shutil.copyfile(src, path)
    with Engine(path, expert_cache=MAPPED, **SETTINGS) as eng:
        eng.logits(IDS[:4])
        rewrite_in_place(path)
        with pytest.raises(ExpertLoadError, match="model.gguf: the file was modified while running"):
            eng.logits(IDS)
    shutil.copyfile(src, path)
    with Engine(path, expert_cache=MAPPED, **SETTINGS) as eng:
        eng.logits(IDS[:4])
        os.truncate(path, 4096)
        for _ in range(2):  # and again, while it stays truncated
            with pytest.raises(ExpertLoadError, match="model.gguf: the file was truncated while running"):
                eng.logits(IDS)


def test_a_resident_models_file_truncated_while_running_is_a_clear_error_not_sigbus(tiny_model, tmp_path):
    """Every expert resident is llama.cpp's own mapping of the whole file, checked the same way."""
    path = tmp_path / "model.gguf"
    shutil.copyfile(tiny_model("qwen3_moe", "f32")[0], path)
    with Engine(path, **SETTINGS) as eng:
        assert eng.expert_residency is None and not eng.experts_mapped
        eng.logits(IDS[:4])
        os.truncate(path, 4096)
        with pytest.raises(ExpertLoadError, match="model.gguf: the file was truncated while running"):
            eng.logits(IDS)
