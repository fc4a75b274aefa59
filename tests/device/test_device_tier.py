"""The device tier (docs/gpu.md) on a real ggml GPU backend: in CI the Vulkan variant on Mesa's
lavapipe, a Vulkan device with its own memory and kernels on the CPU.

Lossless with low precision off: gpu (misses uploaded) and coop (misses computed on the CPU from
the host tier) at device budgets of 50 %, 25 % and the minimum give the greedy tokens of the run
with every expert resident on the device (gpu: bit-identical logits; coop: the CPU computes the
misses, so its logits lie within the two backends' own difference). The counters show
what really happened (bytes uploaded, experts computed on the CPU), and the memory llama.cpp and
the pools allocate stays within the budgets."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiny_moe  # scripts/, on the path by tests/conftest.py
from conftest import REPO, latin_square

from pyedgemoe import Engine, load_plan
from pyedgemoe.devices import gpu_devices
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.model_info import read_model_info

MOE_ARCHITECTURES = tiny_moe.MOE_ARCHITECTURES + tiny_moe.LLAMA_CPP_ONLY
# make test runs these with the Vulkan variant on lavapipe and PYEDGEMOE_REQUIRE_GPU=1 (a build
# without a GPU is then a failure); elsewhere a build without a GPU skips them
if not gpu_devices() and os.environ.get("PYEDGEMOE_REQUIRE_GPU") != "1":
    pytest.skip("no GPU device in this build (make test runs these with the Vulkan variant)", allow_module_level=True)

SETTINGS = dict(n_ctx=256, n_threads=2, flash_attn=False, kv_type="f32")
# stock llama.cpp's Vulkan backend on lavapipe against its CPU backend, all resident: within 2e-2 on
# most tiny models (docs/gpu.md); the gated delta net layers of Qwen3-Next and Qwen3.5 3-4.5e-2,
# Jamba's Mamba layers 3.1e-2
BACKEND_GAP = {"qwen3_next": 6e-2, "qwen3_5_moe": 6e-2, "jamba": 6e-2}
IDS = [1, 17, 42, 99, 5, 230, 64, 7, 150, 33, 12, 201, 88, 3, 120, 45]
N_GREEDY = 32


def minimum_budget(path) -> int:
    info = read_model_info(path)
    return info.n_experts_used * max(info.expert_bytes_per_layer.values()) // info.n_experts


def run(path, **options) -> tuple:
    """(logits of IDS, greedy tokens after IDS[:8], stats with the ubatch size run)"""
    with Engine(path, **SETTINGS, **options) as eng:
        logits = eng.logits(IDS)
        tokens = eng.time_generation(IDS[:8], N_GREEDY)["tokens"]
        return logits, tokens, {**eng.stats(), "n_ubatch": eng.n_ubatch}


@pytest.fixture(scope="module")
def references(tiny_model):
    """Per architecture and ubatch size: (the run with every expert resident on the device, the
    CPU's logits). The ubatch size of the run compared with them: a budget below a ubatch's experts
    in one wave caps it for a model with expert biases (GPT-OSS), and other kernels' sums round
    differently (docs/expert-residency.md)."""
    cache = {}

    def get(arch: str, n_ubatch: int | None = None):
        if (arch, n_ubatch) not in cache:
            path = tiny_model(arch)[0]
            ubatch = {"n_ubatch": n_ubatch} if n_ubatch else {}
            resident = run(path, mode="gpu", **ubatch)
            assert "experts" not in resident[2]  # all resident: no expert cache
            # under the size asked for and the size it ran with (None: the default)
            cache[arch, n_ubatch] = cache[arch, resident[2]["n_ubatch"]] = \
                (resident, run(path, mode="cpu", **ubatch)[0])
        return cache[arch, n_ubatch]
    return get


# every mode with every architecture and at every budget, every architecture at every budget (all
# pairs of the three)
LOSSLESS_RUNS = latin_square(MOE_ARCHITECTURES, ["gpu", "coop", "split"], ["50%", "25%", "minimum"])


@pytest.mark.parametrize("arch,mode,budget", LOSSLESS_RUNS, ids=["-".join(run) for run in LOSSLESS_RUNS])
def test_device_tier_is_lossless(tiny_model, references, arch, mode, budget):
    path = tiny_model(arch)[0]
    # split: half the misses each way (the rates measured at load send a tiny model's all to the link)
    share = dict(link_share=0.5) if mode == "split" else {}
    logits, tokens, stats = run(path, mode=mode, expert_cache=minimum_budget(path) if budget == "minimum" else budget, **share)
    (resident_logits, resident_tokens, _), cpu_logits = references(arch, stats["n_ubatch"])
    assert tokens == resident_tokens
    # how far the device backend's own arithmetic is from the CPU's in the resident run (stock
    # llama.cpp on lavapipe: up to 1.4e-2 on these models, docs/gpu.md)
    backend = np.abs(resident_logits - cpu_logits).max()
    assert backend < BACKEND_GAP.get(arch, 2e-2)
    if mode == "gpu":  # the same kernels over the same bytes, masked rows removed exactly
        assert np.array_equal(logits, resident_logits)
    else:  # the misses' rows by the CPU's kernels, the rest by the device's: a mix of the two
        assert max(np.abs(logits - resident_logits).max(), np.abs(logits - cpu_logits).max()) <= 2 * backend

    experts = stats["experts"]
    assert experts["device"] == stats["device"] == gpu_devices()[0]["name"]
    assert experts["mode"] == mode
    t = experts["total"]
    assert t["misses"] > 0
    if mode == "gpu":
        # every miss is uploaded, its bytes counted; nothing runs on the CPU
        assert t["uploads"] == t["misses"] and t["cpu_experts"] == 0
        info = read_model_info(path)
        per_expert = {il: b // info.n_experts for il, b in info.high_expert_bytes_per_layer.items()}
        # and a prefetch not begun when its layer came (late) is read and uploaded by that layer
        late = {il: p["late"] for il, p in experts["prefetches"]["layers"].items()}
        assert t["bytes_uploaded"] == sum((c["uploads"] + late.get(il, 0)) * per_expert[int(il)]
                                          for il, c in experts["layers"].items())
    elif mode == "coop":
        # every miss is computed on the CPU from the host tier; none is uploaded
        assert t["cpu_experts"] == t["misses"] and t["uploads"] == 0 and t["bytes_uploaded"] == 0
    else:
        # each miss either uploaded (while the CPU computes the others) or computed on the CPU
        assert t["uploads"] + t["cpu_experts"] == t["misses"] and t["uploads"] > 0 and t["cpu_experts"] > 0
    # only split's device passes wait for uploads queued while the CPU computes (timed, so above 0)
    assert (t["upload_wait_ms"] > 0) == (mode == "split")
    assert (t["cpu_pass_ms"] > 0) == (mode != "gpu")  # the CPU's passes: coop's and split's
    assert (t["queue_ms"] > 0) == (mode == "split")  # the op's calls that queue them
    assert t["host_hits"] + t["host_loads"] == t["misses"]


def test_memory_stays_within_the_budgets(tiny_model):
    path = tiny_model("qwen3_moe")[0]
    info = read_model_info(path)
    budget, host = minimum_budget(path) * 3, minimum_budget(path) * 5
    with Engine(path, **SETTINGS, mode="gpu", expert_cache=budget, host_cache=host) as eng:
        eng.logits(IDS)
        stats = eng.stats()
    experts = stats["experts"]
    assert experts["pool_bytes"] <= budget and experts["host_pool_bytes"] <= host
    device = {m["buffer_type"]: m for m in stats["memory"]}[stats["device"]]
    # the model's device weights are the non-expert ones (the experts stay in the file)
    assert 0 < device["model"] <= info.non_expert_bytes


def test_a_gpu_run_without_a_host_tier_uploads_through_staging(tiny_model, references):
    path = tiny_model("olmoe")[0]
    _, tokens, stats = run(path, mode="gpu", expert_cache="25%", host_cache=0)
    assert tokens == references("olmoe")[0][1]
    t = stats["experts"]["total"]
    assert stats["experts"]["host_pool_bytes"] == 0 and t["host_hits"] + t["host_loads"] == 0
    assert t["bytes_uploaded"] > 0


@pytest.mark.parametrize("mode", ["coop", "split"])
def test_coop_and_split_need_a_host_tier(tiny_model, mode):
    with pytest.raises(InvalidOptionError, match="host-cache"):
        Engine(tiny_model("olmoe")[0], **SETTINGS, mode=mode, expert_cache="25%", host_cache=0)


def balanced_uploads(tokens: list[int], share: float) -> float:
    """How many of a wave's misses split uploads: an upload is worth (1 - s) / s of one token of an
    expert on the CPU, and the misses of the most tokens go first, until the uploads' worth x
    equals the tokens left to the CPU (a part of an expert counts that part of its tokens)."""
    tokens = sorted(tokens, reverse=True)
    r = (1 - share) / share

    def left(x: float) -> float:  # the CPU's tokens with x uploaded
        whole = int(x)
        return sum(tokens[whole:]) - (x - whole) * (tokens[whole] if whole < len(tokens) else 0)
    lo, hi = 0.0, float(len(tokens))
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid * r < left(mid) else (lo, mid)
    return lo


def test_split_uploads_a_decode_tokens_share(tiny_model):
    with Engine(tiny_model("olmoe")[0], **SETTINGS, mode="split", expert_cache="25%", link_share=0.5,
                fill_cache=False) as eng:
        eng.logits(IDS[:1])
        layers = eng.stats()["experts"]["layers"]
    for c in layers.values():
        assert c["uploads"] + c["cpu_experts"] == c["misses"] > 0
        assert abs(c["uploads"] - 0.5 * c["misses"]) <= 1


@pytest.mark.parametrize("prompt", [IDS, IDS[:4] * 4, [IDS[0]] * 16], ids=["varied", "repeated", "one token"])
def test_split_uploads_the_experts_of_most_tokens(tiny_model, prompt):
    # --link-share is a decode token's; an expert's tokens multiply the CPU's work, not an upload's
    # bytes: a 16-token prefill uploads more than that share, the more the more tokens an expert has
    with Engine(tiny_model("olmoe")[0], **SETTINGS, mode="split", expert_cache="75%", link_share=0.5,
                fill_cache=False) as eng:
        eng.record_routing()
        eng.logits(prompt, one_token_per_step=False)
        first = eng.stats()["experts"]["layers"]["0"]  # the first MoE layer: every expert a miss (the
        trace = eng.take_routing_trace()               # next ones' are read ahead while it computes)
    ids = np.asarray(trace["ids"])[np.asarray(trace["layer"]) == 0].ravel()
    tokens = np.unique(ids, return_counts=True)[1].tolist()  # per expert
    assert first["uploads"] + first["cpu_experts"] == first["misses"] == len(tokens)  # one wave
    expected = balanced_uploads(tokens, 0.5)
    assert expected > 0.5 * len(tokens)
    assert abs(first["uploads"] - expected) <= 0.5


def test_split_keeps_its_share_over_waves_of_one_or_two_misses(tiny_model):
    # decode steps miss one or two experts a layer: rounded alone, half of one is one (every miss
    # uploaded); the fraction each wave leaves is carried to the next
    with Engine(tiny_model("olmoe")[0], **SETTINGS, mode="split", expert_cache="25%", link_share=0.5,
                fill_cache=False) as eng:
        eng.logits(IDS, one_token_per_step=True)
        t = eng.stats()["experts"]["total"]
    assert t["uploads"] + t["cpu_experts"] == t["misses"] > 20
    assert abs(t["uploads"] - t["misses"] / 2) <= 0.5


def test_split_says_its_share(tiny_model, capfd):
    with Engine(tiny_model("olmoe")[0], **SETTINGS, mode="split", expert_cache="25%") as eng:
        assert eng.mode == eng.stats()["experts"]["mode"] == "split"
    assert re.search(r"--mode split uploads \d+ % of the misses at first, then as each decode layer's times say: uploads [\d.]+ GB/s", capfd.readouterr().err)


def test_split_refines_the_share_its_rates_give_and_keeps_one_given(tiny_model, references):
    # the share is what each decode layer took since (link-balance.h: tests/test_link_balance.py);
    # within the bounds that keep both sides measured, and lossless whatever it is
    path = tiny_model("olmoe")[0]
    _, tokens, stats = run(path, mode="split", expert_cache="25%")
    assert tokens == references("olmoe")[0][1]
    t = stats["experts"]["total"]
    assert t["uploads"] > 0 and t["cpu_experts"] > 0
    assert 0.05 <= stats["experts"]["link_share"] <= 0.95
    assert run(path, mode="split", expert_cache="25%", link_share=0.3)[2]["experts"]["link_share"] == 0.3


@pytest.fixture(scope="module")
def repacking_model(tmp_path_factory):
    """A tiny Qwen3-MoE whose HIGH experts are Q4_K, which the CPU backend repacks."""
    path = tiny_moe.repacking_gguf(tmp_path_factory.mktemp("repacking"))
    assert read_model_info(path).repacked_expert_bytes > 0
    return path


def test_split_computes_from_repacked_copies_where_the_host_tier_holds_both(repacking_model, capfd):
    # the host tier keeps each copy twice, pinned for the uploads and repacked for the CPU's kernels,
    # where auto's budget holds them all so (a smaller one keeps the pinned copies alone): with
    # nothing uploaded, split then computes what coop computes from its repacked host tier, bit for
    # bit (decode steps: one wave each, as in coop)
    def decode(**options):
        with Engine(repacking_model, **SETTINGS, expert_cache="25%", **options) as eng:
            return eng.logits(IDS, one_token_per_step=True), eng.stats()["experts"]
    coop, _ = decode(mode="coop")
    both, both_stats = decode(mode="split", link_share=0.0)
    pinned, pinned_stats = decode(mode="split", link_share=0.0, host_cache="100%")
    assert np.array_equal(both, coop)
    assert not np.array_equal(pinned, coop)  # the plain kernels' sums differ a little
    assert both_stats["host_pool_bytes"] >= 1.9 * pinned_stats["host_pool_bytes"]
    # half uploaded: the pinned copies go to the device, the CPU computes the rest from the repacked
    _, tokens, halves = run(repacking_model, mode="split", expert_cache="25%", link_share=0.5)
    assert tokens == run(repacking_model, mode="split", expert_cache="25%", link_share=0.5, host_cache="100%")[1]
    assert halves["experts"]["total"]["cpu_experts"] > 0 and halves["experts"]["total"]["uploads"] > 0
    with Engine(repacking_model, **SETTINGS, mode="split", expert_cache="25%"):
        pass
    assert re.search(r"--mode split uploads \d+ % of the misses at first, .* \(repacked\)", capfd.readouterr().err)


@pytest.mark.parametrize("arch", ["olmoe", "mixtral"])
def test_auto_mode_measures_and_says_which(tiny_model, capfd, arch):
    # the fastest by the rates it prints: split where the link and the CPU (over the pinned layout
    # split computes from) together beat the faster alone by a fifth, uploading the link's share
    with Engine(tiny_model(arch)[0], **SETTINGS, mode="auto", expert_cache="25%") as eng:
        mode = eng.stats()["experts"]["mode"]
        assert eng.mode == eng.stats()["mode"] == mode
        tokens = eng.time_generation(IDS[:8], N_GREEDY)["tokens"]
    if mode == "split":  # lossless like the others
        assert tokens == run(tiny_model(arch)[0], mode="gpu", expert_cache="25%")[1]
    said = re.search(r"--mode auto chose (\w+): uploads ([\d.]+) GB/s, the CPU's expert math ([\d.]+) GB/s "
                     r"\(([\d.]+) over split's layout, \w+\)(, uploading (\d+) % of the misses)?", capfd.readouterr().err)
    assert said and said[1] == mode
    upload, cpu, pinned = (float(x) for x in said.group(2, 3, 4))
    if abs(upload + pinned - 1.2 * max(upload, cpu)) > 0.05:  # not a tie within the printed digits
        assert mode == ("split" if upload + pinned > 1.2 * max(upload, cpu) else "coop" if cpu > upload else "gpu")
    assert (mode == "split") == (said[6] is not None)
    if said[6]:
        assert abs(int(said[6]) - 100 * upload / (upload + pinned)) <= 1


def test_a_pool_larger_than_the_device_addresses_is_a_clear_error(tiny_model):
    # a Vulkan device addresses at most maxStorageBufferRange bytes in one tensor (lavapipe: 128
    # MiB), and ggml's scheduler stops the process on a larger pool; here the limit is forced down
    # to 100000 bytes (ggml-vulkan's GGML_VK_FORCE_MAX_BUFFER_SIZE), in a process of its own
    code = ("from pyedgemoe import Engine\n"
            "from pyedgemoe.errors import InvalidOptionError\n"
            "try:\n"
            f"    Engine({str(tiny_model('olmoe')[0])!r}, n_ctx=256, n_batch=16, n_ubatch=16, mode='gpu', expert_cache='87.5%')\n"
            "except InvalidOptionError as e:\n"
            "    print('error:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "GGML_VK_FORCE_MAX_BUFFER_SIZE": "100000"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"error: the expert cache's up pool \(14 slots, 0.1 MiB\) is more than Vulkan0 can address in one "
                     r"tensor \(12 slots\): give a smaller --expert-cache, at most 85% of this one", out.stdout)


def test_a_budget_beyond_the_devices_free_memory_is_a_clear_error(tiny_model, monkeypatch):
    # a tiny model's experts fit any device, and a budget beyond them is capped at them: the device
    # is made to report less free memory than half the experts take
    path = tiny_model("olmoe")[0]
    device = gpu_devices()[0]
    free = read_model_info(path).expert_bytes // 4
    monkeypatch.setattr(load_plan, "gpu_devices", lambda: [{**device, "free_bytes": free}])
    with pytest.raises(InvalidOptionError, match=rf"does not fit in {device['name']}'s free memory: {free} bytes"):
        Engine(path, **SETTINGS, mode="gpu", expert_cache="50%")


@pytest.mark.parametrize("mode", ["gpu", "coop", "split"])
def test_mixed_precision_and_prefetch_run_on_the_device(tiny_model, tmp_path, mode):
    from pyedgemoe.convert import convert

    path = convert(tiny_model("qwen3_moe", "q8_0")[0], tmp_path / "mp.gguf", high="q8_0", low="q4_0", progress=False)
    options = dict(mode=mode, expert_cache="40%", prefetch="hobbit", skip=False, t1=0.0, t2=1.0,
                   **(dict(link_share=0.5) if mode == "split" else {}))
    logits, tokens, stats = run(path, **options)
    assert np.isfinite(logits).all()
    t, p = stats["experts"]["total"], stats["experts"]["prefetches"]
    assert t["selections_low"] > 0 and p["issued"] > 0
    # lossy, and still the same answer each time: which copy a selection gets never depends on timing
    again_logits, again_tokens, _ = run(path, **options)
    assert again_tokens == tokens and np.array_equal(again_logits, logits)


@pytest.mark.parametrize("policy", ["lfu", "hobbit", "decay", "adaptive"])
def test_cache_policies_are_lossless_on_the_device(tiny_model, references, policy):
    path = tiny_model("qwen2_moe")[0]
    _, tokens, stats = run(path, mode="gpu", expert_cache="25%", cache_policy=policy)
    assert tokens == references("qwen2_moe")[0][1]
    assert stats["experts"]["cache_policy"] == policy and stats["experts"]["total"]["uploads"] > 0


def test_calibration_runs_on_the_device(tiny_model, tmp_path):
    import json
    import shutil
    import subprocess
    import sys

    model = tmp_path / "model.gguf"
    shutil.copyfile(tiny_model("olmoe")[0], model)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "calibrate", str(model), "-f", str(text),
                        "--budget", "50%", "--ctx", "64", "--max-tokens", "64", "-t", "1", "--mode", "gpu"],
                       capture_output=True, text=True, timeout=600)  # the environment picks this native build
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "model.gguf.calibration.json").read_text())["n_tokens"] == 64


@pytest.mark.parametrize("mode", ["gpu", "coop", "split"])
def test_prefetch_is_lossless_on_the_device(tiny_model, references, mode):
    path = tiny_model("mixtral")[0]
    _, tokens, stats = run(path, mode=mode, expert_cache="40%", prefetch="hobbit", **(dict(link_share=0.5) if mode == "split" else {}))
    assert tokens == references("mixtral")[0][1]
    p = stats["experts"]["prefetches"]
    # prefetches read from storage and upload on the prefetch threads
    assert p["issued"] > 0 and p["bytes_uploaded"] > 0


# a run in a process of its own (under the fault shim): its greedy tokens and prefetch counters
PREFETCH_RUN = """
import json, sys
from pyedgemoe import Engine
with Engine(sys.argv[1], **json.loads(sys.argv[2])) as eng:
    tokens = eng.time_generation(json.loads(sys.argv[3]), int(sys.argv[4]))["tokens"]
    print(json.dumps(dict(tokens=tokens, prefetches=eng.stats()["experts"]["prefetches"])))
"""


@pytest.mark.parametrize("mode", ["coop", "split"])
def test_a_prefetch_not_begun_by_its_layer_is_a_miss_there(tiny_model, references, shim, mode):
    # where the CPU computes misses, a prefetch still queued when its layer comes is given back
    # (cancelled, its slot freed) for the layer to divide, rather than read by the layer while the
    # device waits. Slow storage (every read of the file 80 ms, the fault shim: slower than a layer on
    # a busy machine too, where 30 ms was not) and one read at a time queue them up; a host tier too
    # small to hold every expert sends prefetches to the file.
    path = tiny_model("mixtral")[0]
    options = dict(SETTINGS, mode=mode, expert_cache="40%", host_cache="60%", prefetch="hobbit", io_threads=1,
                   fill_cache=False, **(dict(link_share=0.5) if mode == "split" else {}))
    env = dict(os.environ, LD_PRELOAD=str(shim), PYEDGEMOE_FAULT_PATH=str(path), PYEDGEMOE_FAULT_BEGIN="0",
               PYEDGEMOE_FAULT_END=str(path.stat().st_size), PYEDGEMOE_FAULT_DELAY_MS="80")
    r = subprocess.run([sys.executable, "-c", PREFETCH_RUN, str(path), json.dumps(options), json.dumps(IDS[:8]),
                        str(N_GREEDY)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["tokens"] == references("mixtral")[0][1]
    p = out["prefetches"]
    assert p["given_back"] > 0 and p["used"] + p["wasted"] + p["given_back"] <= p["issued"]


@pytest.mark.parametrize("mode", ["gpu", "split"])
def test_prefetches_upload_from_a_host_tier_that_holds_every_expert(tiny_model, references, mode):
    # such a tier never evicts, so a prefetch may upload from its pinned copy while the layers go
    # on; the file is read once per expert, however often the experts come back
    path = tiny_model("mixtral")[0]
    share = dict(link_share=0.5) if mode == "split" else {}
    with Engine(path, **SETTINGS, mode=mode, expert_cache="40%", prefetch="hobbit", fill_cache=False, **share) as eng:
        first = eng.time_generation(IDS[:8], N_GREEDY)["tokens"]
        before = eng.stats()["experts"]
        again = eng.time_generation(IDS[:8], N_GREEDY)["tokens"]
        after = eng.stats()["experts"]
    assert first == again == references("mixtral")[0][1]
    p0, p1 = before["prefetches"], after["prefetches"]
    assert p1["issued"] > p0["issued"] and p1["bytes_uploaded"] > p0["bytes_uploaded"]
    assert p1["bytes_read"] == p0["bytes_read"]  # the second run's prefetches: from the host tier
    assert after["total"]["bytes_read"] == before["total"]["bytes_read"]
    # a host tier that cannot hold them all is left alone: prefetches read the file
    with Engine(path, **SETTINGS, mode=mode, expert_cache="40%", prefetch="hobbit", fill_cache=False,
                host_cache="60%", **share) as eng:
        eng.time_generation(IDS[:8], N_GREEDY)
        p = eng.stats()["experts"]["prefetches"]
    assert p["issued"] > 0 and p["bytes_read"] > 0


@pytest.mark.parametrize("mode", ["gpu", "split", "coop"])
def test_prefetches_read_nothing_after_the_host_tier_is_filled(tiny_model, references, mode):
    # filled at load (the default where it holds every copy), the host tier has each expert in the
    # file's layout (pinned; coop's where nothing repacks, as here): prefetches upload from it
    path = tiny_model("mixtral")[0]
    share = dict(link_share=0.5) if mode == "split" else {}
    with Engine(path, **SETTINGS, mode=mode, expert_cache="40%", prefetch="hobbit", **share) as eng:
        tokens = eng.time_generation(IDS[:8], N_GREEDY)["tokens"]
        experts = eng.stats()["experts"]
    assert tokens == references("mixtral")[0][1]
    p = experts["prefetches"]
    assert p["issued"] > 0 and p["bytes_uploaded"] > 0 and p["bytes_read"] == 0
    assert experts["total"]["bytes_read"] == 0


def test_prefetches_read_the_file_where_coops_host_tier_is_repacked(repacking_model):
    # a repacked copy is not the layout an upload takes: the prefetches read the file
    with Engine(repacking_model, **SETTINGS, mode="coop", expert_cache="25%", prefetch="hobbit", fill_cache=False) as eng:
        eng.time_generation(IDS[:8], N_GREEDY)
        p = eng.stats()["experts"]["prefetches"]
    assert p["issued"] > 0 and p["bytes_read"] > 0


@pytest.mark.parametrize("mode", ["gpu", "coop", "split"])
def test_a_host_tier_that_holds_every_expert_is_filled_at_load(tiny_model, references, mode):
    # with the fill on (the default), before the first token: no request reads the file after it
    path = tiny_model("qwen2_moe")[0]
    info = read_model_info(path)
    with Engine(path, **SETTINGS, mode=mode, expert_cache="25%", **(dict(link_share=0.5) if mode == "split" else {})) as eng:
        host_fill = eng.expert_residency["host_fill"]
        tokens = eng.time_generation(IDS[:8], N_GREEDY)["tokens"]
        total = eng.stats()["experts"]["total"]
    assert tokens == references("qwen2_moe")[0][1]
    assert host_fill["experts"] == info.n_experts * len(info.expert_bytes_per_layer)
    assert host_fill["bytes_read"] >= info.expert_bytes
    assert total["host_loads"] == 0 and total["bytes_read"] == 0
    # a host tier that holds fewer is filled as requests come
    with Engine(path, **SETTINGS, mode=mode, expert_cache="25%", host_cache="60%",
                **(dict(link_share=0.5) if mode == "split" else {})) as eng:
        assert eng.expert_residency["host_fill"]["experts"] == 0


def test_a_filled_host_tier_serves_low_copies_too(tiny_model, tmp_path):
    # both precisions are read at load (LOW first: a HIGH copy would count as serving a LOW
    # demand), and a LOW load is uploaded from the LOW copy, not read again
    from pyedgemoe.convert import convert

    path = convert(tiny_model("qwen3_moe", "q8_0")[0], tmp_path / "mp.gguf", high="q8_0", low="q4_0", progress=False)
    info = read_model_info(path)
    with Engine(path, **SETTINGS, mode="gpu", expert_cache="25%", skip=False, t1=0.0, t2=1.0) as eng:
        host_fill = eng.expert_residency["host_fill"]
        eng.time_generation(IDS[:8], N_GREEDY)
        total = eng.stats()["experts"]["total"]
    assert host_fill["experts"] == 2 * info.n_experts * len(info.expert_bytes_per_layer)
    assert total["loads_low"] > 0 and total["bytes_read"] == 0


@pytest.mark.parametrize("expert_cache, host_cache, match", [
    ("25%", "lots", "invalid host_cache 'lots'"),
    (None, "lots", "invalid host_cache 'lots'"),  # checked even with every expert resident
    ("25%", "1KiB", r"host cache budget 1024 bytes .* below the minimum"),
])
def test_a_bad_host_cache_is_a_clear_error(tiny_model, expert_cache, host_cache, match):
    with pytest.raises(InvalidOptionError, match=match):
        Engine(tiny_model("olmoe")[0], **SETTINGS, mode="gpu", expert_cache=expert_cache, host_cache=host_cache)


@pytest.mark.parametrize("mode", ["gpu", "coop"])
def test_the_seed_systems_run_on_the_device(tiny_model, references, mode):
    # MoBiLE redoing every token big is the resident run; its little pass scales the device's (and
    # coop's host) passes through the masks; the papers' policies are lossless in HIGH
    path = tiny_model("mixtral")[0]
    _, tokens, stats = run(path, mode=mode, expert_cache="40%", big_little=0.999999, cache_policy="fate")
    assert tokens == references("mixtral")[0][1]
    assert stats["big_little"]["fallbacks"] == stats["big_little"]["little_tokens"] > 0
    big = stats["experts"]["total"]
    _, _, stats = run(path, mode=mode, expert_cache="40%", big_little=1e-9, cache_policy="edgemoe")
    # every decode step (not the batched logits or prompt) went through the little pass alone,
    # which asks for half the experts: fewer than the run that redid every step big
    assert stats["big_little"]["fallbacks"] == 0 and stats["big_little"]["little_tokens"] == N_GREEDY - 1
    assert stats["experts"]["total"]["requests"] < big["requests"]


def test_cache_routing_and_the_traced_inputs_reach_the_op_on_the_device(tiny_model):
    # the op takes the router's probabilities and the layer's input only where they are read (on a
    # device each is one more copy to the host a layer): cache routing and tracing get them there too
    from pyedgemoe.calibration.trace import record_trace

    path = tiny_model("qwen2_moe")[0]
    misses = {}
    for routing in (0.0, 1.0):
        _, tokens, stats = run(path, mode="gpu", expert_cache="25%", cache_routing=routing)
        misses[routing] = stats["experts"]["total"]["misses"]
    assert misses[1.0] < 0.5 * misses[0.0]
    traces, inputs = {}, {"gpu": [], "cpu": []}
    for mode in ("gpu", "cpu"):
        with Engine(path, **SETTINGS, mode=mode, expert_cache="25%", trace_routing=True) as eng:
            traces[mode] = record_trace(eng, IDS, 64, on_inputs=lambda part: inputs[mode].append(part["inputs"]))
    assert np.array_equal(traces["gpu"]["ids"], traces["cpu"]["ids"])
    np.testing.assert_allclose(np.concatenate(inputs["gpu"]), np.concatenate(inputs["cpu"]), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("mode", ["gpu", "coop", "split"])
def test_stand_ins_swap_and_drop_on_the_device(tiny_model, tmp_path, mode):
    # a dropped selection is one that no pass adds (masked on the device, skipped on the host); a
    # swapped one another expert's row, served like any other
    import json
    import shutil

    from pyedgemoe.calibration.run import calibrate

    model = tmp_path / "model.gguf"
    shutil.copyfile(tiny_model("qwen3_moe")[0], model)
    text = "The quick brown fox jumps over the lazy dog. " * 40
    calibrate(model, text, budget="25%", max_tokens=128, n_ctx=64, n_threads=2, stand_ins=True, mode="cpu")
    extra = dict(mode=mode, expert_cache="25%", system="lossless", **(dict(link_share=0.5) if mode == "split" else {}))
    off = run(model, stand_in=0.0, **extra)
    assert off[1] == run(model, mode=mode)[1]
    on = run(model, stand_in=1.0, **extra)
    assert np.isfinite(on[0]).all()
    assert on[2]["experts"]["total"]["misses"] < 0.5 * off[2]["experts"]["total"]["misses"]
    assert on[2]["experts"]["total"]["stand_in_drops"] > 0
    again = run(model, stand_in=1.0, **extra)
    assert again[1] == on[1] and np.array_equal(again[0], on[0])
    sidecar = Path(f"{model}.calibration.json")  # without drop costs every change is a swap
    data = json.loads(sidecar.read_text())
    for layer in data["stand_ins"]["layers"].values():
        del layer["drop_cost"]
    sidecar.write_text(json.dumps(data))
    swapped = run(model, stand_in=1.0, **extra)[2]["experts"]["total"]
    assert swapped["stand_in_swaps"] > 0 and swapped["stand_in_drops"] == 0
    assert swapped["misses"] < off[2]["experts"]["total"]["misses"]


SPLIT_LINE = re.compile(r"## SPLIT #\d+: (\S+) # \d+ inputs:(.*)")


@pytest.mark.parametrize("mode", ["gpu", "coop", "split"])
def test_a_layer_copies_to_and_from_the_device_what_the_passes_read(tiny_model, mode):
    # Each input of a split is one synchronous copy between the host and the device. A decode's
    # MoE layer is one CPU split (the op; coop and split: the CPU's pass) whose inputs are the
    # router's choices and, where the CPU computes, the layer's input (not the routing weights:
    # nothing reads them here); then one device split whose only tensor of ours is the wave's plan
    # (slot ids, masks and, where the CPU computes, its output in one): stock's -ot exps=CPU copies
    # as many each way.
    share = ["--link-share", "0.5"] if mode == "split" else []
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", str(tiny_model("qwen3_moe")[0]), "--mode", mode,
                        "--expert-cache", "25%", "--host-cache", "auto", "-p", "Hello", "-n", "2", "--verbose", *share],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "GGML_SCHED_DEBUG": "2"})
    assert r.returncode == 0, r.stderr[-2000:]
    splits = [(m[1], re.findall(r"\[(\S+)", m[2])) for m in SPLIT_LINE.finditer(r.stdout + r.stderr)]
    ours = [(i, inputs) for i, (backend, inputs) in enumerate(splits) if backend == "CPU" and
            any(n.startswith("ffn_moe_topk") for n in inputs)]
    assert ours
    on_cpu = mode != "gpu"
    for i, inputs in ours:
        assert sorted(n.split("-")[0] for n in inputs) == (["ffn_moe_topk", "ffn_norm"] if on_cpu else ["ffn_moe_topk"])
        backend, device_inputs = splits[i + 1]
        assert backend == "Vulkan0"
        assert [n.split("-")[0] for n in device_inputs if n.startswith(("edgemoe", "ffn_"))] == ["edgemoe_device_plan"]


def test_list_devices_shows_the_gpu_as_llama_cpp_does():
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", "--list-devices"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "Available devices:" and re.fullmatch(r"  Vulkan0: .+ \(\d+ MiB, \d+ MiB free\)", lines[1])


@pytest.mark.parametrize("mode", ["gpu", "coop", "split"])
def test_a_split_gguf_s_experts_go_to_the_device_from_every_shard(tiny_model, references, mode, tmp_path):
    """A GGUF in shards (llama.cpp's gguf-split): its experts, read from their own shards, give the
    whole file's resident tokens in each mode."""
    from gguf_splits import write_split

    shards = write_split(tiny_model("qwen3_moe")[0], tmp_path / "model.gguf", 3)
    share = dict(link_share=0.5) if mode == "split" else {}
    _, tokens, stats = run(shards[0], mode=mode, expert_cache="25%", **share)
    (_, resident_tokens, _), _ = references("qwen3_moe", stats["n_ubatch"])
    assert tokens == resident_tokens
    experts = stats["experts"]  # read on demand, or at load into the device's cache and the host tier
    assert experts["total"]["bytes_read"] + experts["fill"]["bytes_read"] + experts["host_fill"]["bytes_read"] > 0


@pytest.mark.parametrize("mode", ["gpu", "coop", "split"])
def test_speculative_guesses_checked_on_the_device_give_the_model_s_tokens(tiny_model, mode):
    """A guess checked in one batch (pyedgemoe.speculative) through the device tier: the greedy
    tokens without a drafter, but where two tokens' logits tie within a batch's rounding."""
    from pyedgemoe import LlamaPromptLookupDecoding
    from pyedgemoe.generation import SamplingParams
    path = tiny_model("qwen3_moe")[0]
    share = dict(link_share=0.5) if mode == "split" else {}
    prompt = IDS[:6] * 5  # a random model goes on repeating it: guesses are taken
    with Engine(path, **SETTINGS, mode=mode, expert_cache="25%", **share) as eng:
        def greedy(draft=None):
            return list(eng.generate_tokens(prompt, 48, SamplingParams(temperature=0, seed=1, draft_model=draft)))
        plain, drafted = greedy(), greedy(LlamaPromptLookupDecoding(num_pred_tokens=6))
        assert eng.last_timings.n_draft_accepted > 0
        i = next((i for i, (a, b) in enumerate(zip(plain, drafted)) if a != b), None)
        if i is not None:
            logits = eng.logits(prompt + plain[:i])[-1]
            assert logits.max() - logits[drafted[i]] < 2e-2 and logits.max() - logits[plain[i]] < 2e-2
        assert len(drafted) == 48


@pytest.mark.parametrize("mode", ["gpu", "coop"])
def test_context_checkpoints_restore_the_devices_recurrent_states(tiny_model, mode):
    """A prompt departing from what a Qwen3-Next sequence holds restores the checkpoint taken of its
    recurrent states in device memory (pyedgemoe.context_checkpoints): the tokens of a run that
    evaluates it afresh."""
    from pyedgemoe.generation import SamplingParams
    path, greedy = tiny_model("qwen3_next")[0], SamplingParams(temperature=0)
    prompt = (IDS * 10)[:120]
    departed = prompt + [9, 8, 7]  # the 16 tokens generated after the prompt written otherwise
    replies, reused = {}, {}
    for n in (4, 0):
        with Engine(path, **SETTINGS, mode=mode, expert_cache="50%", n_batch=32, n_ubatch=32, ctx_checkpoints=n) as eng:
            list(eng.generate_tokens(prompt, 16, greedy, ignore_eos=True))
            replies[n] = list(eng.generate_tokens(departed, 16, greedy))
            reused[n] = eng.last_timings.n_cached_prompt_tokens
    assert replies[4] == replies[0] and reused == {4: 116, 0: 0}


@pytest.mark.skipif(not any("llvmpipe" in d["description"] for d in gpu_devices()), reason="lavapipe's own fault")
def test_flash_attention_is_off_on_lavapipe_unless_asked_and_refused_when_asked(tiny_model):
    # the default (-fa auto) ended every run whose decodes followed a prompt in a segfault
    prompt = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
    args = [sys.executable, "-m", "pyedgemoe.cli", "run", str(tiny_model("qwen3_moe")[0]), "-p", prompt, "-n", "8",
            "-t", "2", "--temp", "0", "-c", "256"]
    auto, off = (subprocess.run(args + fa, capture_output=True, text=True, timeout=300) for fa in ([], ["-fa", "off"]))
    assert auto.returncode == 0 and "note: flash attention off: ggml-vulkan's flash attention" in auto.stderr, auto.stderr
    assert auto.stdout == off.stdout and off.returncode == 0
    on = subprocess.run(args + ["-fa", "on"], capture_output=True, text=True, timeout=300)
    assert on.returncode == 1 and on.stderr.splitlines()[-1].startswith("error: -fa on: ggml-vulkan's flash attention")
    with pytest.raises(InvalidOptionError, match="-fa on: ggml-vulkan's flash attention"):
        Engine(tiny_model("qwen3_moe")[0], n_ctx=256, n_threads=2, flash_attn=True)


def test_the_gpu_checks_cell_runs_here_with_the_rehearsals_settings(monkeypatch):
    # a cell of ours in `make gpu-rehearse` (scripts/gpu_check.py's measure; the demo's vocabulary, smaller than
    # those of its benchmark files, bounds the decode's walk): lavapipe's settings (flash attention off) let it run
    import gpu_check  # scripts/
    from pyedgemoe.bench import worker
    monkeypatch.setattr(gpu_check, "fixed_decode_token_ids", lambda n: worker.fixed_decode_token_ids(n, 8192))
    sizes = {**gpu_check.SIZES[True], "repeats": 1}
    cell = gpu_check.measure(REPO / "models" / "demo.gguf", "gpu", "25%", sizes, threads=2)
    assert cell["chosen_mode"] == "gpu" and cell["decode_tps"] > 0 and cell["uploads"] > 0
