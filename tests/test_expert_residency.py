"""Expert residency is lossless: with the experts read on demand into a byte-budgeted cache, the
logits and greedy tokens are bit-identical to the run with every expert resident, at every budget
and with every io mode; experts are never read wholesale; bad budgets and a truncated file give
clear errors.

The reference runs with the same ubatch size as the offloaded run (a budget below one layer's
experts caps n_ubatch, docs/expert-residency.md), so both use exactly the same kernels.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import MOE_ARCHITECTURES, latin_square, tiny_moe
from pyedgemoe import Engine
from pyedgemoe.convert.export import export
from pyedgemoe.errors import ExpertLoadError, InvalidOptionError
from pyedgemoe.model_info import read_model_info

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"
SETTINGS = dict(n_ctx=256, n_threads=2, flash_attn=False, kv_type="f32")
IDS = [1, 17, 42, 99, 5, 230, 64, 7, 150, 33, 12, 201, 88, 3, 120, 45]
N_GREEDY = 32
MODELS = [(arch, "f32") for arch in [*MOE_ARCHITECTURES, *tiny_moe.LLAMA_CPP_ONLY]] + [("qwen3_moe", "q8_0")]
IO_MODES = ["direct", "buffered", "mmap"]


def minimum_budget(path) -> int:
    """One layer's top-k experts, computed from the file's tensor directory."""
    info = read_model_info(path)
    per_expert = max(info.expert_bytes_per_layer.values()) // info.n_experts
    return info.n_experts_used * per_expert


def budget_bytes(path, budget: str) -> int | str:
    return minimum_budget(path) if budget == "minimum" else budget


def run(path, trace: bool = False, **options) -> tuple:
    """(logits of IDS, greedy tokens after IDS[:8], stats, n_ubatch[, the routing trace])"""
    with Engine(path, **SETTINGS, **options) as eng:
        if trace:
            eng.record_routing()
        logits = eng.logits(IDS)
        tokens = eng.time_generation(IDS[:8], N_GREEDY)["tokens"]
        out = (logits, tokens, eng.stats(), eng.n_ubatch)
        return out + (eng.take_routing_trace(),) if trace else out


def distinct_experts(trace) -> tuple[int, int]:
    """(the distinct experts each ubatch routed to in each layer, summed over ubatches and layers;
    the distinct (layer, expert) pairs of the whole run), counted from a routing trace."""
    per_ubatch = {(u, l, e) for u, l, row in zip(trace["ubatch"].tolist(), trace["layer"].tolist(),
                                                  trace["ids"].tolist()) for e in row}
    return len(per_ubatch), len({(l, e) for _, l, e in per_ubatch})


@pytest.fixture(scope="module")
def resident_cache():
    """resident(path, n_batch, repack): the logits and tokens of every expert resident. An expert
    cache computes without repacked copies unless asked for, so its reference does too (repack
    moves the last bits where the CPU repacks a weight's type: Q4_K on AVX2, Q8_0 and others on
    AMX's tiles)."""
    cache = {}

    def resident(path, n_batch: int, repack: bool = False):
        key = (str(path), n_batch, repack)
        if key not in cache:
            cache[key] = run(path, n_batch=n_batch, repack=repack)[:2]
        return cache[key]
    return resident


# every model at every budget, every io mode at every budget and with every model (all pairs of
# the three: the io modes read the same bytes whatever the model)
OFFLOADED_RUNS = latin_square(MODELS, ["100%", "50%", "minimum"], IO_MODES)


@pytest.mark.parametrize("arch,outtype,budget,io", [(*m, b, io) for m, b, io in OFFLOADED_RUNS],
                         ids=[f"{a}-{t}-{b}-{io}" for (a, t), b, io in OFFLOADED_RUNS])
def test_offloaded_run_equals_resident_run(tiny_model, resident_cache, arch, outtype, budget, io):
    check_offloaded_equals_resident(tiny_model(arch, outtype)[0], budget, io, resident_cache)


@pytest.fixture(scope="module")
def q4_k_model(tmp_path_factory):
    """The demo model's Q4_K expert copies as a standard GGUF. llama.cpp repacks Q4_K expert tensors
    for its faster kernels (CPU_REPACK, on x86 AVX2 and ARM), so the slot pools must too."""
    out = tmp_path_factory.mktemp("q4_k") / "demo-q4_k.gguf"
    return export(DEMO, out, precision="low", progress=False)


def test_repacked_and_plain_kernels_compute_differently_on_q4_k(q4_k_model, resident_cache):
    """What makes the next test able to fail: the two layouts' logits differ in the last bits."""
    assert read_model_info(q4_k_model).tensor_types.get("q4_K", 0) > 0
    assert not np.array_equal(resident_cache(q4_k_model, 512, True)[0], resident_cache(q4_k_model, 512, False)[0])


@pytest.mark.parametrize("repack", [None, True])
@pytest.mark.parametrize("io", IO_MODES)
@pytest.mark.parametrize("budget", ["50%", "minimum"])
def test_offloaded_run_equals_resident_run_with_repacked_expert_types(q4_k_model, resident_cache, budget, io, repack):
    """By default the slots hold the file's layout, as llama.cpp --no-repack computes; with repack,
    the repacked one, as llama.cpp's default."""
    check_offloaded_equals_resident(q4_k_model, budget, io, resident_cache, repack)


# expert types of the Hub's MoE GGUFs besides Q8_0 and Q4_K (unsloth's dynamic quants, GPT-OSS's MXFP4,
# llama.cpp's legacy and ternary types) that ggml quantizes without an importance matrix
EXPERT_TYPES = ["iq4_xs", "iq4_nl", "mxfp4", "q4_0", "q4_1", "q5_0", "q5_1", "q2_K", "q3_K", "q5_K", "q6_K", "tq2_0"]


@pytest.fixture(scope="module")
def typed_model(tmp_path_factory):
    """typed_model(T): the demo model with its experts in T (its HIGH copies requantized) as a
    standard GGUF."""
    from pyedgemoe.convert import convert
    folder = tmp_path_factory.mktemp("typed")
    high = export(DEMO, folder / "demo-high.gguf", precision="high", progress=False)

    def make(expert_type: str) -> Path:
        out = folder / f"demo-{expert_type}.gguf"
        if not out.exists():
            both = convert(high, folder / f"demo-{expert_type}.mp.gguf", high=expert_type, low=expert_type,
                           progress=False)  # the HIGH copies are the point; a LOW of more bits is refused
            export(both, out, precision="high", progress=False)
            assert read_model_info(out).tensor_types.get(expert_type, 0) > 0
        return out
    return make


@pytest.fixture(scope="module")
def large_expert_model(tmp_path_factory) -> Path:
    """A Qwen3-MoE whose expert projections are 2 MiB each (f32, hidden 256, expert FFN 2048), in a
    file llama.cpp's converter writes: tensors 32-byte aligned, as the Hub's GGUFs are."""
    folder = tmp_path_factory.mktemp("large_experts")
    hf = tiny_moe.build_hf_checkpoint("qwen3_moe", folder / "hf", overrides=dict(
        hidden_size=256, moe_intermediate_size=2048, num_experts=4))
    return tiny_moe.convert_to_gguf(hf, folder / "large.gguf", "f32")


def test_direct_reads_of_experts_off_the_page_grid_and_larger_than_a_bounce_piece_are_exact(large_expert_model,
                                                                                            resident_cache):
    """O_DIRECT reads of a range not on 4 KiB pages go through a bounce buffer of 1 MiB pieces (one
    the size of an expert on every loader thread was memory no budget counted: an OOM kill)."""
    info = read_model_info(large_expert_model)
    assert max(info.expert_bytes_per_layer.values()) // info.n_experts // 3 == 2 * 2**20
    offsets = [t.data_offset for t in gguf.GGUFReader(large_expert_model).tensors if "_exps" in t.name]
    assert any(offset % 4096 for offset in offsets)  # experts off the page grid: every read bounces
    check_offloaded_equals_resident(large_expert_model, "minimum", "direct", resident_cache)


@pytest.mark.parametrize("repack", [None, True])
@pytest.mark.parametrize("expert_type", EXPERT_TYPES)
def test_offloaded_run_equals_resident_run_for_every_expert_type(typed_model, resident_cache, expert_type, repack):
    """The slots and their reads know each type's rows (blocks of 32 and 256 weights; with repack, the
    layouts of the types the CPU repacks: Q4_0, Q2_K, Q5_K, Q6_K, IQ4_NL, MXFP4): the same logits and
    tokens."""
    check_offloaded_equals_resident(typed_model(expert_type), "50%", "direct", resident_cache, repack)


def check_offloaded_equals_resident(path, budget: str, io: str, resident_cache, repack: bool | None = None) -> None:
    # an empty cache at the start, so that every budget loads experts on demand (filled: below)
    logits, tokens, stats, n_ubatch, trace = run(path, trace=True, expert_cache=budget_bytes(path, budget), io=io,
                                                 fill_cache=False, repack=repack)
    assert stats["repack"] is bool(repack)  # streamed experts: no repacked copies unless asked for
    ref_logits, ref_tokens = resident_cache(path, n_ubatch, bool(repack))
    assert np.array_equal(logits, ref_logits), np.max(np.abs(logits - ref_logits))
    assert tokens == ref_tokens
    total = stats["experts"]["total"]
    requests, routed = distinct_experts(trace)
    # each ubatch asks each layer once for each distinct expert its tokens route to; a
    # single-precision file skips none: each request is a hit or a read
    assert total["requests"] == requests
    assert total["hits"] + total["misses"] == requests
    assert total["misses"] > 0 and total["bytes_read"] > 0
    if budget == "minimum":
        assert total["hits"] < total["misses"]  # the cache holds one layer's top-k: mostly streaming
    if budget == "100%":
        # every routed expert is read once, then stays: on demand, or ahead of its layer in a
        # prefill ubatch that needs nearly all experts (prefill_ahead)
        assert total["misses"] + stats["experts"]["prefetches"]["used"] == routed


@pytest.mark.parametrize("budget", ["100%", "50%"])
@pytest.mark.parametrize("arch,outtype", MODELS, ids=[f"{a}-{t}" for a, t in MODELS])
def test_filled_cache_is_lossless_and_spares_the_first_tokens_misses(tiny_model, resident_cache, arch, outtype, budget):
    path = tiny_model(arch, outtype)[0]
    logits, tokens, stats, n_ubatch = run(path, expert_cache=budget, fill_background=False)
    ref_logits, ref_tokens = resident_cache(path, n_ubatch)
    assert np.array_equal(logits, ref_logits), np.max(np.abs(logits - ref_logits))
    assert tokens == ref_tokens
    experts = stats["experts"]
    fill, total = experts["fill"], experts["total"]
    assert fill["experts"] == experts["high_slots"] == experts["resident_experts"]
    assert fill["bytes_read"] >= experts["high_pool_bytes"]
    if budget == "100%":
        assert total["misses"] == 0 and total["bytes_read"] == 0
    else:  # fewer experts read on demand while the tokens run. Ubatches of 2 tokens read no
        # layer ahead (prefill read-ahead wants t*k >= 2n), so the counts do not depend on timing.
        def misses(**fill) -> int:
            e = run(path, expert_cache=budget, n_batch=2, **fill)[2]["experts"]
            assert e["prefetches"]["issued"] == 0
            return e["total"]["misses"]
        assert misses(fill_background=False) < misses(fill_cache=False)


@pytest.mark.parametrize("arch,outtype", MODELS, ids=[f"{a}-{t}" for a, t in MODELS])
def test_background_fill_is_lossless_and_fills_the_cache_while_tokens_run(tiny_model, resident_cache, arch, outtype):
    path = tiny_model(arch, outtype)[0]
    with Engine(path, **SETTINGS, expert_cache="50%") as eng:  # fill_background: the default
        assert eng.stats()["experts"]["fill_background"]
        # the reads queued at load finish on the loader threads meanwhile; the next layer to run
        # takes them in (a prompt needing more experts than the free slots left may cancel those
        # still queued: it comes first)
        time.sleep(0.5)
        eng.logits(IDS[:1])
        assert eng.stats()["experts"]["fill"]["experts"] > 0
        logits = eng.logits(IDS)
        tokens = eng.time_generation(IDS[:8], N_GREEDY)["tokens"]
        experts = eng.stats()["experts"]
    ref_logits, ref_tokens = resident_cache(path, eng.n_ubatch)
    assert np.array_equal(logits, ref_logits), np.max(np.abs(logits - ref_logits))
    assert tokens == ref_tokens
    # the reads went on while the layers ran, into free slots only: by the end every slot is taken
    assert 0 < experts["fill"]["experts"] <= experts["high_slots"] == experts["resident_experts"]


def test_fill_takes_each_layers_most_routed_experts_from_the_calibration(tiny_model, tmp_path):
    """With a calibration sidecar, the fill reads each layer's most routed experts first: a cache
    just large enough for the experts a prompt routes to then serves that prompt without a miss,
    where the fill by expert id does not."""
    src, _ = tiny_model("olmoe")
    path = tmp_path / "model.gguf"
    shutil.copyfile(src, path)
    info = read_model_info(path)
    k = info.n_experts_used
    with Engine(path, **SETTINGS, expert_cache="100%", fill_cache=False) as eng:
        eng.record_routing()
        for token in IDS:  # a one-token prompt that routes to experts other than 0..k-1 somewhere
            eng.logits([token])
            trace = eng.take_routing_trace()
            if any(set(row) != set(range(k)) for row in trace["ids"].tolist()):
                break
    usage = {str(int(l)): np.bincount(trace["ids"][trace["layer"] == l].ravel(), minlength=info.n_experts).tolist()
             for l in np.unique(trace["layer"])}
    budget = len(usage) * minimum_budget(path)  # k experts per layer
    misses = {}
    for calibrated in (False, True):
        if calibrated:
            sidecar = {"version": 1, "t1": 0.6, "t2": 0.9, "expert_usage": usage}
            Path(str(path) + ".calibration.json").write_text(json.dumps(sidecar))
        with Engine(path, **SETTINGS, expert_cache=budget, fill_background=False) as eng:
            assert eng.stats()["experts"]["fill"]["experts"] == len(usage) * k
            eng.logits([token])
            misses[calibrated] = eng.stats()["experts"]["total"]["misses"]
    assert misses[True] == 0 < misses[False], misses


def test_prefill_beyond_the_cache_runs_in_waves_loading_each_expert_once_per_layer(tiny_model):
    """At the minimum budget (one token's top-k experts) a 16-token prefill still runs as one
    ubatch: each layer computes its distinct experts in waves, so each is read once per layer,
    where one-token ubatches read every token's experts. Lossless: see the test above."""
    path, _ = tiny_model("olmoe")
    prompt = IDS[:16]
    misses = {}
    for n_batch in (512, 1):
        with Engine(path, **{**SETTINGS, "n_batch": n_batch}, expert_cache=minimum_budget(path),
                    fill_cache=False) as eng:
            assert eng.n_ubatch == min(n_batch, SETTINGS["n_ctx"])  # llama.cpp: a batch within the context
            eng.logits(prompt)
            experts = eng.stats()["experts"]
            misses[n_batch] = experts["total"]["misses"]
            if n_batch == 512:
                # each distinct expert read once per layer: on demand, or while the wave before
                # computed (pipelined waves: a prefetch used)
                ahead = experts["prefetches"]["layers"]
                assert all(0 < s["requests"] == s["misses"] + ahead[il]["used"] <= experts["n_expert"]
                           for il, s in experts["layers"].items())
                assert sum(a["used"] for a in ahead.values()) > 0
    assert misses[512] * 3 < misses[1], misses


def test_budget_below_minimum_is_refused_with_the_minimum(tiny_model):
    path, _ = tiny_model("mixtral")
    minimum = minimum_budget(path)
    with pytest.raises(InvalidOptionError, match=f"minimum of {minimum} bytes"):
        Engine(path, **SETTINGS, expert_cache=minimum - 1)


@pytest.mark.parametrize("value", ["lots", "-5MiB", "0%", "150%", "12XB", 0])
def test_invalid_budget_is_refused(tiny_model, value):
    path, _ = tiny_model("mixtral")
    with pytest.raises(InvalidOptionError):
        Engine(path, **SETTINGS, expert_cache=value)


def test_invalid_io_and_policy_are_refused(tiny_model):
    path, _ = tiny_model("mixtral")
    with pytest.raises(InvalidOptionError):
        Engine(path, **SETTINGS, expert_cache="50%", io="async")
    with pytest.raises(InvalidOptionError):
        Engine(path, **SETTINGS, expert_cache="50%", cache_policy="fifo")


@pytest.mark.parametrize("policy", ["lru", "lfu", "decay", "adaptive"])
def test_the_cache_policies_are_lossless(tiny_model, resident_cache, policy):
    path, _ = tiny_model("qwen2_moe")
    logits, tokens, stats, n_ubatch = run(path, expert_cache="50%", cache_policy=policy, io_threads=2)
    ref_logits, ref_tokens = resident_cache(path, n_ubatch)
    assert np.array_equal(logits, ref_logits) and tokens == ref_tokens
    assert stats["experts"]["cache_policy"] == policy


def test_page_aligned_experts_read_straight_into_slots_are_lossless(tiny_model, resident_cache, tmp_path):
    """Our converter writes 4 KiB-aligned tensors; f32 experts of this model are whole pages, so
    O_DIRECT reads go straight into the page-aligned slots (no bounce copy), here also from three
    prefetch threads at once. The tokens and logits stay those of the resident run."""
    from gguf import GGUFReader

    from pyedgemoe.convert.from_gguf import convert_gguf
    src, _ = tiny_model("qwen3_moe")
    path = convert_gguf(src, tmp_path / "f32-aligned.gguf", high="f32", low="q8_0", progress=False)
    experts = [t for t in GGUFReader(path).tensors if t.name.endswith("_exps.weight")]
    assert experts and all(t.data_offset % 4096 == 0 and (t.n_bytes // t.shape[-1]) % 4096 == 0 for t in experts)
    for options in (dict(), dict(prefetch="hobbit", io_threads=3)):
        logits, tokens, stats, n_ubatch = run(path, expert_cache=minimum_budget(path), io="direct",
                                              low_precision=False, **options)
        ref_logits, ref_tokens = resident_cache(path, n_ubatch)
        assert np.array_equal(logits, ref_logits) and tokens == ref_tokens
        assert stats["experts"]["io"] == "direct" and stats["experts"]["total"]["misses"] > 0


def _mapping_rss_bytes(path) -> tuple[int, int]:
    """(number of mappings of path, their resident bytes) in this process."""
    real = os.path.realpath(path)
    n, rss, current = 0, 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                current = len(fields) >= 6 and fields[5] == real
                n += current
            elif current and fields[0] == "Rss:":
                rss += int(fields[1]) * 1024
    return n, rss


def _read_chars() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def tied_copy(src, tmp_path):
    """src without its output matrix: llama.cpp then uses the input embedding as the output (tied)."""
    from pyedgemoe.convert.from_gguf import copy_chunks, copy_kv, kv_value, open_gguf, tensor_ne, tensor_type_name
    from pyedgemoe.convert.gguf_out import GGUFOutput
    reader = open_gguf(src, "model")
    tied = GGUFOutput(tmp_path / "tied.gguf", arch=kv_value(reader, "general.architecture"), force=True)
    copy_kv(reader, tied.writer, skip=lambda key: False)
    for t in reader.tensors:
        if t.name != "output.weight":
            tied.add_tensor(t.name, tensor_ne(t), tensor_type_name(t), lambda s=t: copy_chunks(src, s))
    return tied.finish(progress=False)


def test_expert_pages_are_never_touched(tiny_model, tmp_path):
    """Loading (without filling the cache) reads only the non-expert bytes; the experts' mapping stays unfaulted even after
    generating; all expert bytes come through the store's counters. The model is tied, so its input
    embedding is read into memory too (an untied one's rows stay mapped: test_mapped_experts)."""
    src, _ = tiny_model("mixtral")
    path = tied_copy(src, tmp_path)
    info = read_model_info(path)
    before = _read_chars()
    with Engine(path, **SETTINGS, expert_cache="50%", io="buffered", fill_cache=False) as eng:
        loaded = _read_chars() - before
        eng.time_generation(IDS[:8], 16)
        n_maps, rss = _mapping_rss_bytes(path)
        bytes_read = eng.stats()["experts"]["total"]["bytes_read"]
    # model_info and the residency layer parse the header; llama.cpp reads the non-expert tensors
    header_bytes = info.file_bytes - info.non_expert_bytes - info.expert_bytes
    assert loaded <= info.non_expert_bytes + 4 * header_bytes + 65536, loaded
    assert loaded < info.non_expert_bytes + info.expert_bytes // 2, loaded
    assert n_maps >= 1 and rss == 0
    assert bytes_read > 0


@pytest.mark.parametrize("io", IO_MODES)
def test_truncated_file_while_running_is_a_clear_error(tiny_model, tmp_path, io):
    # tied: the expert read finds it; untied, the input embedding's rows are read from the mapped
    # file, so each decode checks the file first (a page past its end would be SIGBUS)
    src, _ = tiny_model("qwen3_moe")
    path = tied_copy(src, tmp_path)
    with Engine(path, **SETTINGS, expert_cache=minimum_budget(path), io=io) as eng:
        eng.logits(IDS[:4])
        os.truncate(path, os.path.getsize(path) // 2)
        with pytest.raises(ExpertLoadError, match=r"expert \d+ of layer \d+ .*file offset \d+"):
            eng.logits(IDS)
        # the engine stays usable for a clear error again, not garbage
        with pytest.raises(ExpertLoadError):
            eng.logits(IDS)
    path = tmp_path / "model.gguf"
    shutil.copyfile(src, path)
    with Engine(path, **SETTINGS, expert_cache=minimum_budget(path), io=io) as eng:
        eng.logits(IDS[:4])
        os.truncate(path, 4096)  # the embedding too
        with pytest.raises(ExpertLoadError, match=r"model.gguf: the file was truncated while running \(\d+ -> 4096"):
            eng.logits(IDS)
        # the engine stays usable for a clear error again, not garbage
        with pytest.raises(ExpertLoadError):
            eng.logits(IDS)


def rewrite_in_place(path) -> None:
    """4 KiB of other bytes over path's experts, its inode and size kept, as `cp other.gguf
    model.gguf` would."""
    info = read_model_info(path)
    with open(path, "r+b") as f:
        f.seek(info.file_bytes - info.expert_bytes // 2)
        f.write(os.urandom(4096))


@pytest.mark.parametrize("io", IO_MODES)
def test_file_written_in_place_while_running_is_a_clear_error(tiny_model, tmp_path, io):
    # `cp other.gguf model.gguf` keeps the inode: the experts read afterwards would be another
    # model's bytes. Same size, new bytes: the store sees the modification time change.
    src, _ = tiny_model("qwen3_moe")
    path = tmp_path / "model.gguf"
    shutil.copyfile(src, path)
    with Engine(path, **SETTINGS, expert_cache=minimum_budget(path), io=io) as eng:
        eng.logits(IDS[:4])
        rewrite_in_place(path)
        with pytest.raises(ExpertLoadError, match="modified while running"):
            eng.logits(IDS)


def test_file_replaced_by_rename_keeps_serving_the_loaded_model(tiny_model, tmp_path):
    # a new file renamed over the path: the open file still holds the loaded model's bytes
    src, _ = tiny_model("qwen3_moe")
    path = tmp_path / "model.gguf"
    shutil.copyfile(src, path)
    budget = minimum_budget(path)
    with Engine(path, **SETTINGS, expert_cache=budget) as eng:
        before = eng.logits(IDS)
        other = tmp_path / "other.gguf"
        other.write_bytes(os.urandom(os.path.getsize(path)))
        os.replace(other, path)
        assert np.array_equal(eng.logits(IDS), before)


def test_a_trace_switched_on_after_decoding_records_the_routing_weights(tiny_model):
    """The layer's op takes the routing weights only while something reads them (on a GPU each
    input of the op is one more copy to the host a layer). A trace switched on after a decode
    reused graphs built without them: llama.cpp builds new ones, and the trace records the same
    weights as a trace recorded from the start."""
    path, _ = tiny_model("qwen3_moe")
    traces = []
    for late in (False, True):
        with Engine(path, **SETTINGS, expert_cache="50%") as eng:
            if late:
                eng.logits(IDS[:4], one_token_per_step=True)  # one-token graphs, without the weights
            eng.record_routing()
            eng.logits(IDS[:8], one_token_per_step=True)
            traces.append(eng.take_routing_trace())
    early, late = traces
    assert len(late["weights"]) == len(early["weights"]) > 0
    assert (early["weights"] > 0).all()
    np.testing.assert_array_equal(late["ids"], early["ids"])
    np.testing.assert_array_equal(late["weights"], early["weights"])
