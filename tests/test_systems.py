"""The seed systems (docs/systems.md): EdgeMoE's and Fate's cache policies, the planner's rules of
EdgeMoE (static precision), Fate (popularity-ordered mixed prefill) and MoBiLE (the little pass),
MoBiLE's fallback, and the --system presets, with hand-computed expectations; the lossless ones stay
lossless. (EdgeMoE's offline pieces: test_systems_calibration.py.)"""
from __future__ import annotations

import math
import subprocess
import sys

import llama_cpp
import numpy as np
import pytest

import tiny_moe
from conftest import MOE_ARCHITECTURES, REPO
from pyedgemoe import Engine, _native
from pyedgemoe.calibration.paths import path_accuracy
from pyedgemoe.calibration.run import calibrate
from pyedgemoe.convert.from_gguf import convert_gguf
from pyedgemoe.engine import top_probability
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.expert_options import PREFILL_LOW_SHARE
from pyedgemoe.model_info import read_model_info

SETTINGS = dict(n_ctx=256, n_threads=2, flash_attn=False, kv_type="f32")
IDS = [1, 17, 42, 99, 5, 230, 64, 7, 150, 33, 12, 201, 88, 3, 120, 45]
TEXT = " ".join(tiny_moe.training_text(seed=11, n_sentences=30))


def cached(c, layer, experts):
    return {e for e in experts if c.cached(layer, e, "high")}


# -- Fate: shallow-favoring split and ARC per layer ---------------------------------------------------

@pytest.mark.parametrize("n_slots, n_shallow, k, expected", [
    (20, 2, 0, [8, 8, 1, 1, 1, 1]),   # shallow layers full (2 x 8), 4 left evenly over 4 deep layers
    (23, 2, 0, [8, 8, 2, 2, 2, 1]),   # 7 over 4 deep: 1 each, the remainder 3 to the first
    (10, 2, 0, [8, 2, 0, 0, 0, 0]),   # fewer than the shallow experts: layer by layer
    (30, -1, 2, [8, 5, 5, 4, 4, 4]),  # default: the first sixth (1 layer) full, 22 over 5 deep layers
])
def test_shallow_favoring_split(n_slots, n_shallow, k, expected):
    assert _native.shallow_favoring_split(n_slots, list(range(6)), 8, n_shallow, k) == expected


def test_the_default_split_leaves_each_deep_layer_a_tokens_top_k():
    # 18 slots, 6 layers of 16 experts, top-2: one shallow layer (16) would leave 2 slots for 5 deep
    # layers; with none shallow the slots go evenly: 3 each
    assert _native.shallow_favoring_split(18, list(range(6)), 16, -1, 2) == [3] * 6


def test_arc_keeps_a_reused_expert_through_a_scan_where_lru_drops_it():
    def run(policy):
        c = _native.ExpertCache(high_slots=3, policy=policy, n_layers=1, layers=[0], n_expert=8, fate_shallow=0)
        for e in (1, 1, 2, 3, 4):  # 1 used twice (T2), then a scan of new experts
            c.place(0, [(e, "high")])
        return cached(c, 0, range(8))
    assert run("fate") == {1, 3, 4}  # ARC evicts T1's least recent (2): |T1| = 2 > p = 0
    assert run("lru") == {2, 3, 4}   # LRU evicts the least recent: 1


def test_arc_ghost_hits_move_the_target_and_decide_the_list():
    c = _native.ExpertCache(high_slots=3, policy="fate", n_layers=1, layers=[0], n_expert=8, fate_shallow=0)
    steps = [
        (1, {1}), (2, {1, 2}), (3, {1, 2, 3}),  # T1 = [3, 2, 1]
        (1, {1, 2, 3}),                         # a hit: 1 to T2
        (4, {1, 3, 4}),                         # |T1| = 2 > p = 0: T1's LRU (2) to B1
        (2, {1, 2, 4}),                         # T1's LRU (3) goes; 2 was in B1: p = 1, 2 to T2
        (5, {2, 4, 5}),                         # |T1| = 1 = p, 5 not in B2: T2's LRU (1) to B2
        (1, {1, 2, 5}),                         # 1 in B2: |T1| = 2 > p: T1's LRU (4) goes; p = 0
    ]
    for e, expected in steps:
        c.place(0, [(e, "high")])
        assert cached(c, 0, range(8)) == expected, e


def test_fate_evicts_from_the_layer_most_above_its_share():
    # 6 slots over layers 0 (shallow), 1, 2 of 4 experts: shares 4, 1, 1
    c = _native.ExpertCache(high_slots=6, policy="fate", n_layers=3, layers=[0, 1, 2], n_expert=4, fate_shallow=1)
    for layer, e in ((1, 0), (1, 1), (2, 0), (2, 1), (0, 0), (0, 1)):
        c.place(layer, [(e, "high")])
    c.place(0, [(2, "high")])  # layer 0 below its share; layers 1 and 2 one above: layer 1 (first) gives e0
    assert cached(c, 1, range(4)) == {1}
    c.place(0, [(3, "high")])  # layer 2 is now the one above its share
    assert cached(c, 2, range(4)) == {1}
    c.place(2, [(2, "high")])  # layer 2 at its share: from its own ARC
    assert cached(c, 2, range(4)) == {2}
    assert cached(c, 0, range(4)) == {0, 1, 2, 3}


# -- EdgeMoE: frequency x layer distance -----------------------------------------------------------

def test_edgemoe_keeps_by_uses_times_how_soon_the_layer_runs():
    # S = 4 layers, running layer I = 2. Keep score f * ((S - i + I) mod S): layer 1 -> f * 1,
    # layer 3 -> f * 3 (it runs next), layer 2 (running) -> 0.
    def scenario(policy, uses_of_layer1):
        c = _native.ExpertCache(high_slots=2, policy=policy, n_layers=4)
        for _ in range(uses_of_layer1):
            c.place(1, [(0, "high")])
        c.place(3, [(0, "high")])
        c.place(2, [(5, "high")])
        return "layer 1" if not c.cached(1, 0, "high") else "layer 3"
    assert scenario("edgemoe", 2) == "layer 1"  # 2 * 1 < 1 * 3
    assert scenario("edgemoe", 4) == "layer 3"  # 4 * 1 > 1 * 3
    assert scenario("fld", 4) == "layer 1"      # distance alone
    assert scenario("lfu", 2) == "layer 3"      # frequency alone


def test_edgemoe_evicts_the_running_layers_idle_expert_first():
    c = _native.ExpertCache(high_slots=2, policy="edgemoe", n_layers=4)
    c.place(2, [(1, "high")])
    c.place(2, [(1, "high")])
    c.place(3, [(0, "high")])
    c.place(2, [(5, "high")])  # expert 1 of layer 2 scores 2 * 0: its next use is a whole pass away
    assert not c.cached(2, 1, "high") and c.cached(3, 0, "high")


# -- the planner's rules ------------------------------------------------------------------------------

def plan(ids, weights, n_expert=4, **rules):
    demand, wanted = _native.plan_layer(np.asarray(ids, dtype=np.int32), np.asarray(weights, dtype=np.float32),
                                        n_expert, **rules)
    return demand.tolist(), wanted


def test_the_little_pass_keeps_each_tokens_heaviest_half():
    demand, wanted = plan([[3, 5]], [[0.3, 0.7]], n_expert=8, keep=1)
    assert demand == [[0, 2]] and wanted == [(5, "high")]


def test_a_static_map_gives_each_expert_its_precision_whatever_its_score():
    demand, wanted = plan([[0, 1], [1, 2]], [[0.9, 0.1], [0.9, 0.1]], fixed=["high", "low", "high", "low"])
    assert demand == [[2, 1], [1, 2]]
    assert wanted == [(0, "high"), (1, "low"), (2, "high")]


def test_fate_prefill_orders_by_popularity_and_loads_the_cold_share_low():
    # 3 tokens: expert 0 has 3 selections, 1, 2 and 3 one each (6 in all). The coldest, up to 34 %
    # of 6 = 2.04 selections: 3 and 2 (2 selections); 1 would make 3.
    _, wanted = plan([[1, 0], [2, 0], [3, 0]], [[0.5, 0.5]] * 3, t1=1.0, t2=1.0, prefill_low_share=0.34)
    assert wanted == [(0, "high"), (1, "high"), (2, "low"), (3, "low")]
    _, decode = plan([[1, 0]], [[0.5, 0.5]], t1=1.0, t2=1.0, prefill_low_share=0.34)
    assert decode == [(1, "high"), (0, "high")]  # one token: not a prefill, no change


# -- MoBiLE -------------------------------------------------------------------------------------------

def test_the_fallback_decision_is_the_top_output_probability():
    assert top_probability(np.array([0.0, math.log(3.0)])) == pytest.approx(0.75)  # softmax [0.25, 0.75]
    assert top_probability(np.array([2.0, 2.0, 2.0, 2.0])) == pytest.approx(0.25)


@pytest.fixture(scope="module")
def mp_model(tiny_model, tmp_path_factory):
    """A multi-precision (HIGH q8_0 + LOW q4_0) tiny Qwen3-MoE (it normalizes its top-k weights)."""
    src, _ = tiny_model("qwen3_moe")
    return convert_gguf(src, tmp_path_factory.mktemp("systems") / "q8-q4.gguf", high="q8_0", low="q4_0",
                        progress=False)


def decode_mode(path, **options):
    with Engine(path, **SETTINGS, **options) as eng:
        return eng.logits(IDS, one_token_per_step=True), eng.stats()


def test_big_little_redoing_every_token_gives_the_resident_logits(mp_model):
    ref, _ = decode_mode(mp_model, expert_cache=None)
    logits, stats = decode_mode(mp_model, expert_cache="50%", low_precision=False, big_little=0.999999)
    b = stats["big_little"]
    assert b["little_tokens"] == len(IDS) and b["fallbacks"] == len(IDS)
    # each fallback prefetches the little pass's whole top-k in every MoE layer
    n_layers = len(stats["experts"]["layers"])
    assert b["prefetched"] == len(IDS) * n_layers * stats["model"]["n_experts_used"]
    assert stats["experts"]["prefetches"]["used"] > 0
    assert np.array_equal(logits, ref)


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_the_little_pass_is_the_model_routed_to_half_its_experts(tiny_model, arch):
    # stock llama.cpp with expert_used_count overridden to k / 2 (it renormalizes the kept weights
    # where the model normalizes its top-k, as our little pass does through the masks)
    path, _ = tiny_model(arch)
    logits, stats = decode_mode(path, expert_cache="50%", big_little=1e-9)
    assert stats["big_little"]["fallbacks"] == 0
    k = stats["model"]["n_experts_used"]
    t = stats["experts"]["total"]
    assert t["selections_high"] == len(IDS) * len(stats["experts"]["layers"]) * (k // 2)
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, n_threads=2, n_threads_batch=2,
                          flash_attn=False, type_k=f32, type_v=f32, verbose=False,
                          kv_overrides={f"{read_model_info(path).architecture}.expert_used_count": k // 2})
    for token in IDS:
        llm.eval([token])
    little = np.array(llm.scores[:len(IDS)], dtype=np.float32)
    llm.close()
    assert np.max(np.abs(logits - little)) <= 1e-4


# -- EdgeMoE's static map and path prefetch, at run time ---------------------------------------------

def test_a_static_map_loads_each_expert_only_in_its_precision(mp_model):
    with Engine(mp_model, **SETTINGS, expert_cache="50%") as eng:
        n_expert = eng.info.n_experts
        layers = sorted(int(l) for l in eng.stats()["experts"]["layers"])
        eng.set_precision_map({layers[0]: list(range(n_expert))})  # the first MoE layer all LOW
        eng.logits(IDS, one_token_per_step=True)
        per_layer = eng.stats()["experts"]["layers"]
    first, other = per_layer[str(layers[0])], per_layer[str(layers[1])]
    assert first["selections_high"] == first["loads_high"] == first["hits_high"] == 0 and first["selections_low"] > 0
    assert other["selections_low"] == other["loads_low"] == 0 and other["selections_skip"] == 0


def test_a_bad_precision_map_is_a_clear_error(mp_model):
    with Engine(mp_model, **SETTINGS, expert_cache="50%") as eng:
        with pytest.raises(InvalidOptionError, match="no expert 99"):
            eng.set_precision_map({0: [99]})
        for low in (None, [1], {0: [2**40]}, {0: ["a"]}, {0: [1.7]}):  # tracebacks, or 1.7 taken as 1
            with pytest.raises(InvalidOptionError, match="a precision map is"):
                eng.set_precision_map(low)


@pytest.fixture(scope="module")
def calibrated(mp_model, tmp_path_factory):
    """The tiny model calibrated for EdgeMoE: path statistics and a static map in its sidecar."""
    result = calibrate(mp_model, TEXT, budget="50%", max_tokens=256, system="edgemoe", loss_budget=0.05)
    return mp_model, result.data


def test_calibrate_edgemoe_writes_the_map_and_the_path_statistics(calibrated):
    path, data = calibrated
    m = data["precision_map"]
    assert m["n_experts"] == len(m["importance"]) and 0 <= m["n_low"] <= m["n_experts"]
    assert sum(len(es) for es in m["low"].values()) == m["n_low"]
    assert m["ppl"] <= m["baseline_ppl"] * 1.05 + 1e-9
    # and what users see: the map keeps at least 97 % of the calibration tokens' top-1, measured for
    # every count tried, and a count that broke either bound was refused
    assert m["agreement"] >= m["min_agreement"] == 0.97
    for n_low, agreement in m["agreements"].items():
        fits = m["evaluations"][n_low] <= m["baseline_ppl"] * 1.05 + 1e-9 and agreement >= 0.97
        assert fits == (int(n_low) <= m["n_low"]), (n_low, agreement, m)
    # the statistics predict the calibration text's next-layer experts better than a guess (k of n)
    k, n = read_model_info(path).n_experts_used, data["path_statistics"]["n_expert"]
    assert data["path_statistics"]["tables"] and k / n < data["path_accuracy"] <= 1


def test_the_edgemoe_preset_runs_the_calibrated_map(calibrated):
    path, data = calibrated
    low_experts = {int(l): set(es) for l, es in data["precision_map"]["low"].items()}
    with Engine(path, **SETTINGS, expert_cache="50%", system="edgemoe") as eng:
        eng.record_routing()
        eng.logits(IDS, one_token_per_step=True)
        stats = eng.stats()["experts"]
    assert stats["static_precision"] and stats["prefetch"] == "edgemoe" and stats["cache_policy"] == "edgemoe"
    # the LOW tier's share of the cache is the map's LOW share of the bytes
    info = read_model_info(path)
    m = data["precision_map"]
    low = m["n_low"] * info.low_expert_bytes / info.high_expert_bytes
    assert stats["low_cache"] == pytest.approx(min(0.95, max(0.05, low / (low + m["n_experts"] - m["n_low"]))))
    assert stats["prediction"][0]["tokens"] > 0
    n_low = sum(c["selections_low"] for c in stats["layers"].values())
    assert (n_low > 0) == bool(low)
    # a layer the map gives no LOW expert never serves one in LOW
    for il, c in stats["layers"].items():
        if not low_experts.get(int(il)):
            assert c["selections_low"] == 0


def test_the_runtimes_path_predictions_are_the_calibrated_statistics(calibrated):
    # the runtime's lookup (path-predictor.cpp) and paths.predict fall back alike: its share of
    # selections predicted is path_accuracy of the same routing
    path, data = calibrated
    with Engine(path, **SETTINGS, expert_cache="50%", low_precision=False, prefetch="edgemoe") as eng:
        eng.record_routing()
        eng.logits(IDS, one_token_per_step=True)
        trace = eng.take_routing_trace()
        prediction = eng.stats()["experts"]["prediction"][0]
    assert prediction["recall"] == pytest.approx(path_accuracy(data["path_statistics"], trace))


def test_calibrate_edgemoe_from_the_cli(mp_model, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    model = tmp_path / "m.gguf"
    model.write_bytes(mp_model.read_bytes())
    r = subprocess.run([sys.executable, "-m", "pyedgemoe", "calibrate", str(model), "-f", str(text), "--budget", "50%",
                        "--max-tokens", "128", "--system", "edgemoe", "--size-budget", "80%"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "EdgeMoE precision map (size budget 80%)" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "pyedgemoe", "calibrate", str(model), "-f", str(text),
                          "--system", "edgemoe", "--loss-budget", "lots"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("error: --loss-budget must be a share")
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("policy", ["edgemoe", "fate"])
@pytest.mark.parametrize("prefetch", ["none", "edgemoe", "fate"])
@pytest.mark.parametrize("budget", ["50%", "minimum"])
def test_the_papers_policies_and_predictors_are_lossless_in_high(calibrated, policy, prefetch, budget):
    path, _ = calibrated
    if budget == "minimum":
        with Engine(path, **SETTINGS, expert_cache="50%", low_precision=False) as eng:
            budget = eng.expert_residency["minimum_bytes"]
    options = dict(expert_cache=budget, low_precision=False, skip=False, cache_policy=policy, prefetch=prefetch)
    with Engine(path, **SETTINGS, **options) as eng:
        logits = eng.logits(IDS)
        stepped = eng.logits(IDS, one_token_per_step=True)
        misses = eng.stats()["experts"]["total"]["misses"]
        n_ubatch = eng.n_ubatch
    with Engine(path, **SETTINGS, n_batch=n_ubatch, expert_cache=None) as eng:
        ref, ref_stepped = eng.logits(IDS), eng.logits(IDS, one_token_per_step=True)
    assert misses > 0
    assert np.array_equal(logits, ref) and np.array_equal(stepped, ref_stepped)


# -- presets ------------------------------------------------------------------------------------------

def test_the_lossless_preset_gives_the_resident_logits(mp_model):
    ref, _ = decode_mode(mp_model, expert_cache=None)
    logits, stats = decode_mode(mp_model, expert_cache="25%", system="lossless")
    assert stats["system"] == "lossless" and not stats["experts"]["mixed_precision"]
    assert np.array_equal(logits, ref)


def test_a_preset_sets_its_knobs_and_an_explicit_one_wins(mp_model):
    with Engine(mp_model, **SETTINGS, expert_cache="50%", system="fate") as eng:
        r = eng.expert_residency
        assert (r["cache_policy"], r["prefetch"], r["t1"], r["t2"], r["low_hit"]) == ("fate", "fate", 1.0, 1.0, "reload")
        assert r["prefill_low_share"] == pytest.approx(0.15)
    with Engine(mp_model, **SETTINGS, expert_cache="50%", system="fate", cache_policy="lru") as eng:
        assert eng.expert_residency["cache_policy"] == "lru"
    with Engine(mp_model, **SETTINGS, expert_cache="50%", system="mobile") as eng:
        assert eng.big_little == pytest.approx(0.7) and not eng.expert_residency["mixed_precision"]


def test_with_low_copies_a_prefills_cold_experts_are_low_by_default_and_hobbit_keeps_its_rule(mp_model):
    shares = {}
    for options in (dict(), dict(system="hobbit"), dict(low_precision=False, skip=False)):
        with Engine(mp_model, **SETTINGS, expert_cache="50%", fill_cache=False, **options) as eng:
            eng.logits(IDS)  # one prefill ubatch
            shares[tuple(options.values())] = (eng.expert_residency["prefill_low_share"],
                                               eng.stats()["experts"]["total"]["selections_low"])
    assert shares[()][0] == pytest.approx(PREFILL_LOW_SHARE) and shares[()][1] > 0
    assert shares[("hobbit",)][0] == 0 == shares[(False, False)][0] == shares[(False, False)][1]
    assert shares[()][1] > shares[("hobbit",)][1]  # more of the prefill's selections LOW


def test_fate_loads_a_prefills_cold_experts_low_and_decodes_in_high(mp_model):
    with Engine(mp_model, **SETTINGS, expert_cache="50%", system="fate", fill_cache=False) as eng:
        eng.logits(IDS)  # one prefill ubatch
        prefill = dict(eng.stats()["experts"]["total"])
        eng._model.reset_expert_stats()
        eng.logits(IDS, one_token_per_step=True)
        decode = eng.stats()["experts"]["total"]
    assert prefill["loads_low"] > 0 and prefill["selections_high"] > prefill["selections_low"]
    assert decode["selections_low"] == 0 and decode["loads_low"] == 0


def test_a_mixed_prefill_reads_the_next_layers_predicted_experts_ahead_and_stays_reproducible(mp_model):
    """With LOW copies, a prefill ubatch that needs most experts reads the next layer's experts
    while this one computes, in the precisions planned from the predictor's routing; the next layer
    claims them whenever they finish, so the logits do not depend on timing."""
    runs = []
    for _ in range(2):
        # a cache that holds every expert copy (LOW ones asked for: else it holds every expert in
        # HIGH): one wave a layer, so only the next layer is read ahead
        with Engine(mp_model, **SETTINGS, expert_cache="1GiB", low_precision=True, fill_cache=False) as eng:
            runs.append(eng.logits(IDS)[-1])
            experts = eng.stats()["experts"]
        ahead = experts["prefetches"]["layers"]
        first = min(experts["layers"], key=int)
        assert experts["predictor_depth"] == 1 and ahead.get(first, {"issued": 0})["issued"] == 0
        assert sum(a["used"] for a in ahead.values()) > 0
    np.testing.assert_array_equal(runs[0], runs[1])


def test_a_mixed_prefill_whose_layer_fills_both_tiers_reads_its_second_wave_while_the_first_computes(mp_model):
    """Where both tiers hold a layer's experts once but not twice, no slots are left to read the
    next layer ahead: a prefill ubatch that needs most experts then computes each layer in two
    waves and reads the second while the first computes, so the first layer reads ahead too. The
    waves claim the reads whenever they finish: the logits do not depend on timing."""
    info = read_model_info(mp_model)
    n = info.n_experts
    high_expert = max(info.high_expert_bytes_per_layer.values()) // n
    budget = int((n + 0.5) * high_expert / 0.75)  # a quarter LOW: each expert in HIGH, about two thirds in LOW
    runs = []
    for _ in range(2):
        with Engine(mp_model, **SETTINGS, expert_cache=budget, low_cache=0.25, fill_cache=False) as eng:
            runs.append(eng.logits(IDS)[-1])
            experts = eng.stats()["experts"]
        assert experts["high_slots"] == n and n < experts["high_slots"] + experts["low_slots"] < 2 * n
        first = min(experts["layers"], key=int)
        assert experts["prefetches"]["layers"][first]["used"] > 0
    np.testing.assert_array_equal(runs[0], runs[1])


@pytest.mark.parametrize("system, error", [("nope", "unknown system"), ("hobbit", "LOW expert copies")])
def test_a_bad_system_is_a_clear_error(tiny_model, system, error):
    path, _ = tiny_model("qwen3_moe")
    with pytest.raises(InvalidOptionError, match=error):
        Engine(path, **SETTINGS, expert_cache="50%", system=system)


def test_edgemoe_without_low_precision_names_the_switch():
    # the demo is multi-precision: "needs LOW expert copies (a multi-precision GGUF ...)" blamed the file
    with pytest.raises(InvalidOptionError, match="static_precision .* needs low precision on, not --no-low-precision"):
        Engine(REPO / "models" / "demo.gguf", **SETTINGS, expert_cache="50%", system="edgemoe", low_precision=False)


def test_the_cli_says_one_error_line_for_a_bad_system(tiny_model):
    path, _ = tiny_model("qwen3_moe")
    r = subprocess.run([sys.executable, "-m", "pyedgemoe", "run", str(path), "-p", "hi", "-n", "2",
                        "--system", "nope"], capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith("error: unknown system")
