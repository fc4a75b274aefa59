"""The load plan (pyedgemoe/load_plan.py) is a pure function of the model's header, the options a
caller gave and the machine: each decision with its reason, and every refusal before anything
loads. No model file is read here: the model is a ModelInfo of a small MoE's shape, the machine a
Machine with the memory, GPUs and cores each test says."""
from __future__ import annotations

import dataclasses

import pytest

from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.expert_options import ExpertOptions
from pyedgemoe.load_plan import LoadOptions, Machine, plan_load
from pyedgemoe.memory_budget import MAPPED, RESERVE_SLACK_BYTES
from pyedgemoe.model_info import ModelInfo
from pyedgemoe.threads import ThreadCount

MiB, GiB = 2**20, 2**30
EXPERT_BYTES = 64 * MiB  # 4 layers of 16 MiB: 8 experts of 2 MiB each
METADATA = {"general.architecture": "qwen3moe", **{f"qwen3moe.{k}": v for k, v in {
    "block_count": 4, "embedding_length": 256, "attention.head_count": 4, "attention.head_count_kv": 2,
    "feed_forward_length": 512, "expert_feed_forward_length": 128, "expert_count": 8, "expert_used_count": 2,
    "context_length": 2048, "vocab_size": 1000}.items()}}
GPU = {"name": "GPU0", "description": "a test GPU", "type": "gpu", "free_bytes": 1 * GiB, "total_bytes": 2 * GiB}
SMALL = dict(n_ctx=256)


def moe(multi_precision: bool = False) -> ModelInfo:
    per_layer = {layer: EXPERT_BYTES // 4 for layer in range(4)}
    return ModelInfo(path="model.gguf", files=("model.gguf",), file_bytes=80 * MiB, architecture="qwen3moe", name="test", n_layers=4,
                     n_experts=8, n_experts_used=2, n_experts_shared=0, expert_bytes_per_layer=per_layer,
                     non_expert_bytes=16 * MiB, tensor_types={"q8_0": 80 * MiB}, multi_precision=multi_precision,
                     metadata=METADATA, high_expert_bytes_per_layer=dict(per_layer))


def machine(memory: int = 8 * GiB, gpus: tuple = (), cores: int = 2, cpus: int = 4) -> Machine:
    return Machine((memory, "in this test"), gpus, ThreadCount(cores, f"{cores} cores in this test", cpus))


def plan(memory: int = 8 * GiB, gpus: tuple = (), cores: int = 2, calibration: dict | None = None,
         info: ModelInfo | None = None, fixed_bytes: int = 0, **options):
    """The plan of the test model (or info) on machine(memory, gpus, cores); options: LoadOptions'
    fields and the expert options; fixed_bytes: the memory's part that does not grow with the context."""
    load = LoadOptions(**{**SMALL, **{k: options.pop(k) for k in list(options)
                                      if k in {f.name for f in dataclasses.fields(LoadOptions)}}},
                       expert_options=ExpertOptions(**options))
    kv_bytes = load.n_ctx * 4 * 256 * 2  # llama.cpp's f16 KV cache of 4 layers, 2 KV heads of 64
    return plan_load(info or moe(), load, machine(memory, gpus, cores), kv_bytes, fixed_bytes, calibration)


# -- the mode and the device -------------------------------------------------------------------------
def test_the_default_mode_is_cpu_without_a_gpu_and_auto_with_one():
    cpu, gpu = plan(), plan(gpus=(GPU,))
    assert (cpu.mode, cpu.device, cpu.reasons["mode"]) == ("cpu", None, "the default of a build without a GPU")
    assert (gpu.mode, gpu.device, gpu.reasons["mode"]) == ("auto", GPU, "the default of a build with a GPU")


@pytest.mark.parametrize("ngl", [-1, 20])
def test_ngl_asks_for_the_gpu_where_there_is_one_and_runs_on_the_cpu_where_there_is_none(ngl):
    assert plan(gpus=(GPU,), n_gpu_layers=ngl).mode == "auto"
    p = plan(n_gpu_layers=ngl)
    assert p.mode == "cpu" and "this build has none: the CPU, as llama.cpp runs" in p.reasons["mode"]


def test_ngl_0_is_the_cpu_even_with_a_gpu():
    assert plan(gpus=(GPU,), n_gpu_layers=0).mode == "cpu"


def test_ngl_and_mode_cpu_agree_on_a_build_without_a_gpu():
    assert plan(n_gpu_layers=99, mode="cpu").mode == "cpu"


@pytest.mark.parametrize("options, message", [
    (dict(n_gpu_layers=0, mode="gpu"), "-ngl 0 means --mode cpu, not --mode gpu"),
    (dict(n_gpu_layers=20, mode="cpu"), "-ngl 20 asks for the GPU and --mode cpu for none"),
])
def test_ngl_and_a_mode_that_disagree_are_refused(options, message):
    with pytest.raises(InvalidOptionError, match=message):
        plan(gpus=(GPU,), **options)


def test_device_none_is_the_cpu_as_llama_cpps_dev_none():
    for gpus in ((), (GPU,)):
        p = plan(gpus=gpus, device="none")
        assert (p.mode, p.device, p.reasons["mode"]) == ("cpu", None, "--device none: no GPU")
    assert plan(gpus=(GPU,), device="none", mode="cpu", n_gpu_layers=0).mode == "cpu"
    for options, given in ((dict(mode="gpu"), "--mode gpu"), (dict(n_gpu_layers=99), "-ngl 99")):
        with pytest.raises(InvalidOptionError, match=f"--device none means --mode cpu, not {given}"):
            plan(gpus=(GPU,), device="none", **options)


def test_ngl_and_a_gpu_mode_that_agree_give_that_mode():
    assert plan(gpus=(GPU,), n_gpu_layers=-1, mode="coop", expert_cache="50%").mode == "coop"


@pytest.mark.parametrize("mode", ["gpu", "coop", "auto"])
def test_a_gpu_mode_without_a_gpu_names_the_build_flag(mode):
    with pytest.raises(InvalidOptionError, match=f"--mode {mode} needs a GPU.*GGML_VULKAN=1"):
        plan(mode=mode)


def test_a_device_is_chosen_by_name_and_only_with_a_gpu_mode():
    other = {**GPU, "name": "GPU1"}
    assert plan(gpus=(GPU, other), device="GPU1").device == other
    with pytest.raises(InvalidOptionError, match="no GPU device named 'GPU7'"):
        plan(gpus=(GPU,), device="GPU7")
    with pytest.raises(InvalidOptionError, match="--device GPU0 needs --mode gpu, coop or auto"):
        plan(gpus=(GPU,), device="GPU0", mode="cpu")
    with pytest.raises(InvalidOptionError, match="--device GPU0 needs a GPU.*GGML_VULKAN=1"):
        plan(device="GPU0")


def test_several_devices_hold_the_layers_the_first_the_expert_pools_split_as_given():
    other = {**GPU, "name": "GPU1"}
    p = plan(gpus=(GPU, other), device="GPU1,GPU0", tensor_split=[1, 3])
    assert p.device == other and p.layer_devices == ("GPU1", "GPU0") and p.tensor_split == (1.0, 3.0)
    assert "the layers split 1:3" in "\n".join(p.describe())
    assert plan(gpus=(GPU, other), device="GPU0,GPU1").tensor_split == ()  # by free memory
    with pytest.raises(InvalidOptionError, match="GPU0 is named twice"):
        plan(gpus=(GPU, other), device="GPU0,GPU0")
    with pytest.raises(InvalidOptionError, match=r"--tensor-split 1,1,1: 3 shares for the layers' devices \(GPU0,GPU1\)"):
        plan(gpus=(GPU, other), device="GPU0,GPU1", tensor_split="1,1,1")
    for bad in ("1,x", "inf", [float("inf")], "3.5e38", "1e400", "2e38,2e38"):  # an infinite sum: an internal check
        with pytest.raises(InvalidOptionError, match="tensor_split must be shares per device like 3,1"):
            plan(gpus=(GPU, other), tensor_split=bad)
    with pytest.raises(InvalidOptionError, match="device must be a device's name, got ''"):  # llama.cpp's -dev ''
        plan(gpus=(GPU,), device="")


# -- the host tier -------------------------------------------------------------------------------------
def test_the_host_tier_auto_holds_every_expert_copy_or_what_ram_has_free():
    assert plan(gpus=(GPU,), mode="gpu", expert_cache="25%").host_cache_bytes == EXPERT_BYTES
    tight = plan(gpus=(GPU,), mode="gpu", expert_cache="25%", memory=RESERVE_SLACK_BYTES + 10 * MiB)
    assert tight.host_cache_bytes == 10 * MiB  # the runtime's own slack stays free


def test_the_host_tier_holds_the_low_copies_only_where_low_precision_uses_them():
    info = dataclasses.replace(moe(multi_precision=True), low_expert_bytes_per_layer={layer: MiB for layer in range(4)})
    assert plan(gpus=(GPU,), mode="gpu", expert_cache="25%", info=info).host_cache_bytes == EXPERT_BYTES + 4 * MiB
    off = plan(gpus=(GPU,), mode="gpu", expert_cache="25%", info=info, low_precision=False)
    assert off.host_cache_bytes == EXPERT_BYTES  # the residency layer loads no LOW copy


def test_every_expert_resident_on_the_gpu_has_no_host_tier():
    p = plan(gpus=(GPU,), mode="gpu", host_cache="1GiB")
    assert not p.offload and p.host_cache_bytes == 0
    assert p.reasons["host_cache"] == "every expert resident: no host tier (--host-cache unused)"


def test_the_host_tier_auto_holds_the_low_copies_of_a_low_from_file_too(monkeypatch, tmp_path):
    # the LOW copies of --low-from are in the other file, not in this one's expert bytes
    per_layer = {layer: EXPERT_BYTES // 8 for layer in range(4)}
    low = dataclasses.replace(moe(), path="low.gguf", expert_bytes_per_layer=per_layer,
                              high_expert_bytes_per_layer=dict(per_layer))
    for module in ("load_plan", "expert_options"):
        monkeypatch.setattr(f"pyedgemoe.{module}.read_model_info", lambda path: low)
    (tmp_path / "low.gguf").touch()  # its header: low, above
    assert plan(gpus=(GPU,), mode="gpu", expert_cache="25%", low_from=str(tmp_path / "low.gguf")).host_cache_bytes == \
        EXPERT_BYTES + EXPERT_BYTES // 2


def test_a_host_tier_given_is_its_size_capped_at_every_expert_copy_and_cpu_mode_has_none():
    assert plan(gpus=(GPU,), mode="gpu", expert_cache="25%", host_cache="50%").host_cache_bytes == EXPERT_BYTES // 2
    assert plan(gpus=(GPU,), mode="gpu", expert_cache="25%", host_cache=0).host_cache_bytes == 0
    for size in ("1000TiB", 10**30):  # beyond a C integer: the native call refused it (a TypeError)
        p = plan(gpus=(GPU,), mode="gpu", expert_cache="25%", host_cache=size)
        assert (p.host_cache_bytes, p.reasons["host_cache"]) == (EXPERT_BYTES, "given, capped at every expert copy")
    with pytest.raises(InvalidOptionError, match="host tier of --mode gpu, coop, split or auto"):
        plan(host_cache="1GiB")


@pytest.mark.parametrize("mode", ["coop", "split"])
def test_coop_and_split_without_a_host_tier_are_refused_before_loading(mode):
    with pytest.raises(InvalidOptionError, match=f"--mode {mode} computes the device's misses from the host tier: give it a --host-cache"):
        plan(gpus=(GPU,), mode=mode, expert_cache="25%", host_cache=0)


# -- the expert cache ----------------------------------------------------------------------------------
def test_every_expert_resident_where_the_model_fits():
    p = plan()
    assert p.expert_cache is None and not p.offload and not p.experts_mapped
    assert p.repack and p.reasons["repack"] == "llama.cpp's default"
    assert p.expert_cache_note.startswith("expert cache auto: all experts resident")
    assert p.native_options is not None  # resolved (and checked) even with every expert resident


def test_a_size_is_the_cache_and_turns_repacking_off():
    p = plan(expert_cache="25%")
    assert p.expert_cache == EXPERT_BYTES // 4 and p.offload
    assert not p.repack and "stream through an expert cache" in p.reasons["repack"]


def test_repack_given_with_an_expert_cache_counts_the_staging_buffers_of_its_reads():
    # ggml converts a repacked slot's bytes whole: each thread that reads (4 loaders, 4 prefetch
    # threads) keeps a buffer of the largest projection (2 MiB here) beside the cache
    info = dataclasses.replace(moe(), repacked_expert_bytes=EXPERT_BYTES // 4, largest_repacked_projection=2 * MiB)
    plain, repacked = plan(memory=96 * MiB, info=info), plan(memory=96 * MiB, info=info, repack=True)
    assert plain.offload and not plain.repack and repacked.repack
    assert repacked.expert_cache == plain.expert_cache - 16 * MiB
    assert "staging buffers, 16.00 MiB beside it" in repacked.reasons["repack"]
    sized = {"memory": 96 * MiB, "info": info, "expert_cache": 32 * MiB}
    assert plan(**sized, repack=True).spare_bytes == plan(**sized).spare_bytes - 16 * MiB
    assert plan(**sized, repack=True, io_threads=1).spare_bytes == plan(**sized).spare_bytes - 4 * MiB
    room = 32 * MiB + plan(**sized).spare_bytes  # the largest cache that fits without them
    assert plan(**{**sized, "expert_cache": room}).expert_cache == room
    with pytest.raises(InvalidOptionError, match="does not fit.*includes 16.00 MiB of --repack's staging buffers"):
        plan(**{**sized, "expert_cache": room}, repack=True)


def test_a_size_that_does_not_fit_is_refused_with_the_largest_that_does():
    with pytest.raises(InvalidOptionError, match="does not fit.*the largest expert cache that fits"):
        plan(expert_cache="100%", memory=48 * MiB)


@pytest.mark.parametrize("asked", ["100%", "100%~", "5MiB~"])
def test_where_no_cache_that_runs_fits_the_refusal_offers_the_mapped_experts(asked):
    # it offered the room left (3.26 MiB here), which the next load refused as below the minimum (4 MiB)
    with pytest.raises(InvalidOptionError, match=r"leaves 3.26 MiB, below the smallest cache that runs \(4.00 MiB\); "
                                                 r"--expert-cache mmap"):
        plan(expert_cache=asked, memory=40 * MiB)


def test_a_dense_model_takes_a_share_of_its_no_experts_as_a_moe_model_would():
    # a script's --expert-cache 25% over several models: "out of range" on a dense one
    dense = dataclasses.replace(moe(), n_experts=0, expert_bytes_per_layer={}, high_expert_bytes_per_layer={})
    for asked in ("25%", "60%~"):
        p = plan(info=dense, expert_cache=asked)
        assert not p.offload and p.expert_cache is None
    with pytest.raises(InvalidOptionError, match="out of range"):
        plan(info=dense, expert_cache="-5%")


def test_a_device_budget_beyond_its_free_memory_is_refused():
    small = {**GPU, "free_bytes": 8 * MiB}
    with pytest.raises(InvalidOptionError, match=r"does not fit in GPU0's free memory: 8388608 bytes"):
        plan(gpus=(small,), mode="gpu", expert_cache=16 * MiB)


def test_mapped_experts_stay_in_host_memory_and_without_repacked_copies():
    p = plan(expert_cache=MAPPED)
    assert p.experts_mapped and not p.offload and not p.repack
    with pytest.raises(InvalidOptionError, match="runs with mode 'cpu'"):
        plan(gpus=(GPU,), mode="gpu", expert_cache=MAPPED)
    with pytest.raises(InvalidOptionError, match="repacked copies would take the experts out"):
        plan(expert_cache=MAPPED, repack=True)


# -- prefetch, threads, fill ---------------------------------------------------------------------------
def test_a_small_cache_prefetches_on_a_core_of_its_own():
    p = plan(expert_cache="25%")
    assert p.expert_options["prefetch"] == "fate" and p.reads_core
    assert p.reasons["prefetch"] == "its reads on 1 of 2 cores, the cache holds 25% of the experts"
    assert (p.n_threads, p.n_threads_batch, p.governed) == (1, 2, True)  # the decode leaves one core


def test_experts_too_small_for_their_reads_to_hide_are_not_prefetched():
    small = dataclasses.replace(moe(), high_expert_bytes_per_layer={layer: 8 * (MiB - 4096) for layer in range(4)})
    p = plan(expert_cache="25%", info=small)
    assert p.expert_options["prefetch"] == "none" and not p.reads_core and p.n_threads == 2
    assert p.reasons["prefetch"] == "experts of 1020.00 KiB: too small for the compute to hide their reads"


def test_threads_given_keep_their_core_and_prefetch_stays_off():
    p = plan(expert_cache="25%", n_threads=2)
    assert p.expert_options["prefetch"] == "none" and not p.reads_core
    assert p.reasons["prefetch"] == "the decode's threads are given: no core of theirs goes to reads"
    assert (p.n_threads, p.n_threads_batch, p.governed, p.batch_governed) == (2, 2, False, False)


def test_threads_given_beyond_the_cpus_are_run_and_noted():
    # llama.cpp runs them too; at every op each thread waits for the last, which then waits its turn
    crowded = [n for n in plan(n_threads=5).notes if "threads on the 4 CPUs" in n]
    assert crowded == ["5 threads on the 4 CPUs this process may use: they take turns there and each step waits "
                       "for the last of them (the default: 2)"]
    assert plan(n_threads=5).n_threads == 5
    assert any("6 threads on" in n for n in plan(n_threads=2, n_threads_batch=6).notes)
    assert not [n for n in plan(n_threads=4).notes + plan().notes if "threads on" in n]


def test_a_cache_of_half_the_experts_does_not_prefetch():
    p = plan(expert_cache="50%")
    assert p.expert_options["prefetch"] == "none" and (p.n_threads, p.governed) == (2, True)


@pytest.mark.parametrize("n_ctx,batch", [(0, 2048), (256, 256), (8192, 4096)])
def test_a_batch_is_at_most_the_context_the_training_context_for_0_as_llama_cpp_caps_it(n_ctx, batch):
    p = plan(n_ctx=n_ctx, n_batch=4096, n_ubatch=4096)
    assert (p.n_batch, p.n_ubatch) == (batch, batch)


def test_the_fill_runs_in_the_background_when_lossless():
    assert plan(expert_cache="50%").fill == "in the background"
    assert plan(expert_cache="50%", fill_cache=False).fill == "none"
    assert plan().fill == "none"  # nothing to fill: every expert resident


# -- refusals of options that cannot work together ------------------------------------------------------
def test_big_little_needs_one_sequence_and_an_expert_cache():
    with pytest.raises(InvalidOptionError, match="needs n_parallel=1"):
        plan(expert_cache="50%", big_little=0.7, n_parallel=2)
    with pytest.raises(InvalidOptionError, match="act on the expert cache"):
        plan(big_little=0.7)


def test_static_precision_needs_the_calibrated_map():
    with pytest.raises(InvalidOptionError, match="static_precision needs the precision map"):
        plan(expert_cache="50%", static_precision=True, info=moe(multi_precision=True))
    with pytest.raises(InvalidOptionError, match="low precision needs LOW expert copies"):
        plan(expert_cache="50%", low_precision=True)


@pytest.mark.parametrize("options, fragment", [
    (dict(n_ctx=-1), "n_ctx must be a non-negative integer"),
    (dict(n_batch=0), "n_batch must be a positive integer"),
    (dict(kv_type="f12"), "unknown kv_type"),
    (dict(seed=2**32), "seed must be in"),
    (dict(n_parallel=257, n_ctx=8192), "n_parallel=257 is more sequences than llama.cpp decodes together: at most 256"),
    (dict(n_parallel=200, n_ctx=100), r"at most n_batch and n_ctx \(here 100\)"),
    (dict(n_parallel=65, n_batch=64), r"\(here 64\)"),
])
def test_load_options_are_checked_when_made(options, fragment):
    with pytest.raises(InvalidOptionError, match=fragment):
        LoadOptions(**options)


# -- the plan itself -------------------------------------------------------------------------------------
def test_the_plan_is_frozen_and_explains_each_decision():
    p = plan(expert_cache="25%")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.mode = "gpu"
    lines = p.describe()
    names = [line.split("  ")[0].strip() for line in lines]
    assert names == ["mode", "device", "expert cache", "host cache", "repack", "weights", "experts", "context",
                     "threads"]
    assert "prefetch fate (its reads on 1 of 2 cores" in lines[names.index("experts")]
    assert "(the default of a build without a GPU)" in lines[0]


def test_the_same_inputs_give_the_same_plan():
    assert plan(expert_cache="25%").describe() == plan(expert_cache="25%").describe()


# -- a device's limit on one tensor ----------------------------------------------------------------------
def test_auto_keeps_the_largest_pool_within_what_the_device_addresses_in_one_tensor():
    # Vulkan addresses at most maxStorageBufferRange bytes in one tensor (lavapipe: 128 MiB); a pool
    # per projection, here the largest a third of the experts: auto takes at most 3 x the limit
    info = dataclasses.replace(moe(), largest_projection_share=1 / 3)
    small = {**GPU, "free_bytes": 56 * MiB, "max_tensor_bytes": 4 * MiB}
    p = plan(gpus=(small,), mode="gpu", info=info)
    assert p.expert_cache == 12 * MiB
    assert ("at most 12.00 MiB: GPU0 addresses 4.00 MiB in one tensor, and the cache's largest pool (one tensor) "
            "takes 33% of it") in p.expert_cache_note
    # a size given is the user's: the load says if the device cannot take it (slot-pool.cpp)
    assert plan(gpus=(small,), mode="gpu", info=info, expert_cache=16 * MiB).expert_cache == 16 * MiB
    # no limit (CUDA: 0), or one the cache stays within
    assert plan(gpus=({**small, "max_tensor_bytes": 0},), mode="gpu", info=info).expert_cache > 12 * MiB
    assert plan(gpus=({**small, "max_tensor_bytes": 64 * MiB},), mode="gpu", info=info).expert_cache > 12 * MiB
