"""Calibration (HOBBIT sec. 3.2 and 3.4): thresholds for a target split computed by hand, the
replay through the runtime's cache code against a hand-walked trace and against the runtime
itself, the weight search, and `pyedgemoe calibrate` end to end: the sidecar it writes is what a
following Engine runs with, and a calibration embedded by `convert --calibration` is used when
there is no sidecar.
"""
from __future__ import annotations

import itertools
import json
import shutil
from collections import Counter

import numpy as np
import pytest

from conftest import REPO, tiny_moe
from pyedgemoe import Engine
from pyedgemoe.calibration.replay import (SINGLE_POLICIES, CacheSetup, replay, replay_steps, search_policy_weights,
                                          weight_grid)
from pyedgemoe.calibration.sidecar import embedded_calibration, load_calibration, sidecar_path, write_sidecar
from pyedgemoe.calibration.thresholds import (choose_thresholds, default_split, parse_split, precision_demands,
                                              selection_scores, split_of)
from pyedgemoe.calibration.trace import expert_usage, load_trace, prediction_accuracy, record_trace, trace_path
from pyedgemoe.convert import convert
from pyedgemoe.convert.export import export
from pyedgemoe.convert.from_gguf import convert_gguf
from pyedgemoe.errors import ConversionError, InvalidOptionError
from pyedgemoe.expert_options import ExpertOptions
from pyedgemoe.model_info import read_model_info
from test_cli import assert_one_line_error, cli

TEXT = " ".join(tiny_moe.training_text(seed=11, n_sentences=30))  # ~900 tokens with the tiny tokenizer
# one thread: the decode loop of a tiny model is all synchronisation otherwise
CALIBRATE_ARGS = ("--budget", "50%", "--ctx", "64", "--max-tokens", "256", "-t", "1")
SETTINGS = dict(n_ctx=64, n_batch=1, n_threads=1, flash_attn=False, kv_type="f32")


def trace_of(weights, ids=None, layers=None):
    """A trace of single-token ubatches of one sequence (one layer unless `layers` says otherwise)."""
    weights = np.asarray(weights, dtype=np.float32)
    n, k = weights.shape
    layers = np.zeros(n, dtype=np.int32) if layers is None else np.asarray(layers, dtype=np.int32)
    return {"ubatch": np.arange(1, n + 1, dtype=np.int32), "layer": layers,
            "ids": np.asarray(ids if ids is not None else [list(range(k))] * n, dtype=np.int32),
            "weights": weights, "sequence": np.zeros(n, dtype=np.int32)}


# -- the scores and the thresholds --------------------------------------------------------------

# Top-4, weights exact in binary: per token the scores in position order (rank by weight, ties to
# the earlier position; s = normalized weight ranked above).
TOP4 = [[0.5, 0.25, 0.125, 0.125],     # s = 0, .5, .75, .875
        [0.125, 0.625, 0.125, 0.125],  # s = .625, 0, .75, .875
        [0.25, 0.25, 0.25, 0.25],      # s = 0, .25, .5, .75
        [0.375, 0.375, 0.125, 0.125]]  # s = 0, .375, .75, .875
TOP4_SCORES = [[0, .5, .75, .875], [.625, 0, .75, .875], [0, .25, .5, .75], [0, .375, .75, .875]]
# the 12 non-top-1 scores, sorted: .25 .375 .5 .5 .625 .75 .75 .75 .75 .875 .875 .875


def test_scores_are_the_rules_cumulative_normalized_weights_ranked_above():
    assert selection_scores(TOP4).tolist() == TOP4_SCORES
    assert selection_scores([[6.0, 2.0]]).tolist() == [[0.0, 0.75]]  # normalized first


def test_top2_thresholds_at_the_quantiles_of_the_second_selections():
    # 8 tokens, second selection's score s = g0 = 8/16 .. 15/16; 16 selections, 8 top-1 (HIGH).
    # Target 75/12.5/12.5: 12 HIGH -> 4 more: T1 = 4th smallest = 11/16; 2 SKIP: T2 = 3rd largest = 13/16
    weights = [[g / 16, 1 - g / 16] for g in range(8, 16)]
    t1, t2 = choose_thresholds(weights, (0.75, 0.125, 0.125))
    assert (t1, t2) == (11 / 16, 13 / 16)
    assert split_of(precision_demands(weights, t1, t2)) == {"high": 0.75, "low": 0.125, "skip": 0.125}


def test_a_high_target_below_one_over_k_gives_t1_zero():
    # top-2: the top-1 alone is 50% HIGH; 40% cannot be reached, the other selections are LOW or SKIP
    weights = [[g / 16, 1 - g / 16] for g in range(8, 16)]
    t1, t2 = choose_thresholds(weights, (0.4, 0.5, 0.1))  # 1.6 -> 2 skipped: T2 = 13/16
    assert (t1, t2) == (0.0, 13 / 16)
    assert split_of(precision_demands(weights, t1, t2)) == {"high": 0.5, "low": 0.375, "skip": 0.125}


def test_top4_thresholds_and_the_achieved_split():
    # 16 selections: 50% HIGH = 8 -> 4 non-top-1: T1 = .5; 18.75% SKIP = 3: T2 = 4th largest = .75
    t1, t2 = choose_thresholds(TOP4, (0.5, 0.3125, 0.1875))
    assert (t1, t2) == (0.5, 0.75)
    assert split_of(precision_demands(TOP4, t1, t2)) == {"high": 0.5, "low": 0.3125, "skip": 0.1875}


def test_tied_scores_fall_on_one_side_and_the_achieved_split_says_so():
    # 12.5% SKIP = 2 of 16, but the three largest scores are all .875: T2 = .875 skips none of them
    t1, t2 = choose_thresholds(TOP4, (0.5, 0.375, 0.125))
    assert (t1, t2) == (0.5, 0.875)
    assert split_of(precision_demands(TOP4, t1, t2))["skip"] == 0.0


def test_the_default_split_is_hobbits_at_top2_and_keeps_its_second_selection_share_at_top_k():
    assert default_split(2) == pytest.approx((0.67, 0.30, 0.03))
    # top-8: 1/8 top-1, and 7/8 of the selections split 34/60/6 like top-2's second one
    assert default_split(8) == pytest.approx((0.125 + 0.875 * 0.34, 0.875 * 0.60, 0.875 * 0.06))
    assert default_split(1) == (1.0, 0.0, 0.0)
    assert choose_thresholds(TOP4) == choose_thresholds(TOP4, default_split(4))


@pytest.mark.parametrize("split, message", [
    ("0.5,0.3,0.3", "sum to 1"),
    ("0.7,0.3", "three"),
    ("a,b,c", "three numbers"),
    ("1.2,-0.1,-0.1", r"in \[0, 1\]"),
])
def test_bad_target_splits_are_clear_errors(split, message):
    with pytest.raises(InvalidOptionError, match=message):
        parse_split(split)


# -- the replay -----------------------------------------------------------------------------------

# One layer, HIGH 2 slots, LOW 2 slots, LRU, t1 = .6, t2 = .9, a LOW load costs .25:
#   token 1: 0 H (s 0) load, 1 L (s .75) load            HIGH {0}     LOW {1}     1 + .25
#   token 2: 0 H hit, 2 H (s .5) load                     HIGH {0, 2}             1
#   token 3: 1 H: the LOW copy serves it, 3 L load                     LOW {1, 3}  .25
#   token 4: 2 H hit, 0 SKIP (s .95): its HIGH copy serves it
#   token 5: 4 H load, evicts 2 (0 was used after it);    HIGH {0, 4}
#            5 L load, evicts 1 (3 was used after it)                  LOW {3, 5}  1 + .25
HAND_IDS = [[0, 1], [0, 2], [1, 3], [2, 0], [4, 5]]
HAND_WEIGHTS = [[0.75, 0.25], [0.5, 0.5], [0.75, 0.25], [0.95, 0.05], [0.75, 0.25]]
HAND_SETUP = CacheSetup(high_slots=2, low_slots=2, n_layers=1, low_cost=0.25)


def hand_steps():
    trace = trace_of(HAND_WEIGHTS, HAND_IDS)
    return replay_steps(trace, 0.6, 0.9)


def test_replay_matches_a_hand_walked_trace():
    r = replay(hand_steps(), HAND_SETUP, "lru")
    assert r.penalty == 3.75
    assert (r.loads_high, r.loads_low, r.hits_high, r.hits_low, r.skipped, r.requests) == (3, 3, 3, 1, 0, 10)
    assert r.failures == 0


def test_replay_is_deterministic():
    trace = synthetic_trace(seed=3)
    steps = replay_steps(trace, 0.6, 0.9)
    setup = CacheSetup(high_slots=8, low_slots=4, n_layers=4, low_cost=0.3)
    for policy, weights in [("lru", None), ("lfu", None), ("hobbit", (0.4, 0.1, 0.3, 0.2))]:
        assert replay(steps, setup, policy, weights) == replay(steps, setup, policy, weights)


def test_a_ubatch_places_its_distinct_experts_once_with_the_highest_demand_in_order_of_first_use():
    trace = trace_of([[0.7, 0.3], [0.96, 0.04]], ids=[[0, 1], [1, 2]])
    trace["ubatch"][:] = 7  # both tokens in one ubatch
    steps = replay_steps(trace, 0.6, 0.9)
    assert [(s.new_sequence, s.advance_tokens, s.layer, s.wanted) for s in steps] == [
        (True, 2, 0, [(0, "high"), (1, "high"), (2, "skip")])]


def test_the_clock_advances_once_per_ubatch_and_sequences_restart():
    trace = trace_of([[0.7, 0.3]] * 4, layers=[0, 1, 0, 1])
    trace["ubatch"] = np.array([1, 1, 2, 2], dtype=np.int32)
    trace["sequence"] = np.array([0, 0, 1, 1], dtype=np.int32)
    steps = replay_steps(trace, 0.6, 0.9)
    assert [(s.new_sequence, s.advance_tokens, s.layer) for s in steps] == [
        (True, 1, 0), (False, 0, 1), (True, 1, 0), (False, 0, 1)]


def synthetic_trace(seed: int, n_tokens: int = 200, n_layers: int = 4, n_expert: int = 16, k: int = 2) -> dict:
    """Single-token ubatches over n_layers layers, experts drawn from a skewed per-layer preference."""
    rng = np.random.default_rng(seed)
    preference = rng.dirichlet(np.full(n_expert, 0.5), size=n_layers)
    ids, weights = [], []
    for _ in range(n_tokens):
        for layer in range(n_layers):
            chosen = rng.choice(n_expert, size=k, replace=False, p=preference[layer])
            w = np.sort(rng.dirichlet(np.ones(k)))[::-1]
            ids.append(chosen)
            weights.append(w)
    n = n_tokens * n_layers
    return {"ubatch": np.repeat(np.arange(1, n_tokens + 1), n_layers).astype(np.int32),
            "layer": np.tile(np.arange(n_layers), n_tokens).astype(np.int32),
            "ids": np.asarray(ids, dtype=np.int32), "weights": np.asarray(weights, dtype=np.float32),
            "sequence": np.zeros(n, dtype=np.int32)}


def test_weight_grid_is_every_point_of_the_simplex_on_the_step_in_lexicographic_order():
    assert weight_grid(0.5) == [(0, 0, 0, 1), (0, 0, .5, .5), (0, 0, 1, 0), (0, .5, 0, .5), (0, .5, .5, 0),
                                (0, 1, 0, 0), (.5, 0, 0, .5), (.5, 0, .5, 0), (.5, .5, 0, 0), (1, 0, 0, 0)]
    # step 0.1: the tenths of four non-negative integers that sum to 10, C(13, 3) = 286 of them
    tenths = sorted(c for c in itertools.product(range(11), repeat=4) if sum(c) == 10)
    assert weight_grid(0.1) == [tuple(x / 10 for x in c) for c in tenths]
    assert len(tenths) == 286
    with pytest.raises(InvalidOptionError, match="divide 1"):
        weight_grid(0.3)


def test_the_searched_weights_beat_or_match_every_single_policy():
    trace = synthetic_trace(seed=5)
    t1, t2 = choose_thresholds(trace["weights"])
    steps = replay_steps(trace, t1, t2)
    setup = CacheSetup(high_slots=10, low_slots=6, n_layers=4, low_cost=0.5)
    best, singles = search_policy_weights(steps, setup, step=0.2)
    # the search's choice is the first grid point with the fewest failures, then the lowest
    # penalty, then the fewest loads
    replays = [replay(steps, setup, "hobbit", w) for w in weight_grid(0.2)]
    first_best = min(replays, key=lambda r: (r.failures, r.penalty, r.loads_high + r.loads_low))
    assert (best.policy, best.weights, best.penalty) == ("hobbit", first_best.weights, first_best.penalty)
    assert set(singles) == {"lru", "lfu", "lhu", "fld", "edgemoe", "fate", "decay", "adaptive"}
    for policy in ("lhu", "fld"):  # vertices of the grid (lru and lfu, edgemoe and fate are other policies)
        assert best.penalty <= singles[policy].penalty
    # lhu and fld are the grid's vertices exactly
    assert singles["lhu"].penalty == replay(steps, setup, "hobbit", (0, 0, 1, 0)).penalty
    assert singles["fld"].penalty == replay(steps, setup, "hobbit", (0, 0, 0, 1)).penalty


# -- what a trace says on its own -------------------------------------------------------------------

def test_expert_usage_counts_each_layers_selections_per_expert():
    trace = trace_of([[0.5, 0.5]] * 4, ids=[[0, 2], [2, 3], [2, 0], [1, 3]], layers=[0, 0, 1, 1])
    assert expert_usage(trace, 4) == {"0": [1, 0, 2, 1], "1": [1, 1, 1, 1]}


def test_prediction_accuracy_counts_top1_hits_and_recall_over_the_tokens_with_a_prediction():
    trace = trace_of([[0.5, 0.5]] * 4, ids=[[0, 1], [1, 0], [2, 3], [2, 3]])
    trace["predicted"] = np.array([[-1, -1],   # none made (the first MoE layer)
                                   [1, 2],     # top-1 right, 1 of 2 selections predicted
                                   [3, 0],     # top-1 wrong, 1 of 2
                                   [2, 5]])    # top-1 right, 1 of 2
    assert prediction_accuracy(trace) == {"n_predicted": 3, "top1_accuracy": 2 / 3, "recall": 3 / 6}
    trace["predicted"][:] = -1
    assert prediction_accuracy(trace) == {"n_predicted": 0, "top1_accuracy": None, "recall": None}
    del trace["predicted"]
    assert prediction_accuracy(trace) is None


# -- on tiny multi-precision models -----------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    """HIGH q8_0 + LOW q4_0 and HIGH q8_0 + LOW q8_0 multi-precision copies of tiny Qwen3-MoE, each in a
    directory of its own (sidecars are written next to them), and a text file."""
    src, _ = tiny_model("qwen3_moe")
    d = tmp_path_factory.mktemp("calibrate")
    (d / "q4").mkdir()
    (d / "q8").mkdir()
    text = d / "text.txt"
    text.write_text(TEXT)
    return {"q4": convert_gguf(src, d / "q4" / "model.gguf", high="q8_0", low="q4_0", progress=False),
            "q8": convert_gguf(src, d / "q8" / "model.gguf", high="q8_0", low="q8_0", progress=False),
            "text": text, "src": src}


def decode_sequences(eng, tokens, n_ctx):
    """Decodes tokens one at a time in sequences of n_ctx, each on a fresh context (as record_trace)."""
    for start in range(0, len(tokens), n_ctx):
        eng.logits(tokens[start:start + n_ctx], one_token_per_step=True)


@pytest.mark.parametrize("policy, weights", [("lru", None), ("lfu", None), ("fld", None), ("decay", None),
                                             ("hobbit", (0.3, 0.1, 0.6, 0.0))])
def test_replay_predicts_the_runtimes_cache_counters_exactly(models, policy, weights):
    # LOW copies equal to HIGH and nothing skipped: the routing under any precision choice is the
    # recorded one, so the runtime's counters must be the replay's, load for load
    path = models["q8"]
    with Engine(path, expert_cache="50%", t1=1.0, t2=1.0, trace_routing=True, **SETTINGS) as eng:
        tokens = eng.tokenize(TEXT)[:192]
        trace = record_trace(eng, tokens, 64)
        residency = eng.expert_residency
    t1, t2 = choose_thresholds(trace["weights"], (0.6, 0.4, 0.0))
    assert t2 == 1.0
    steps = replay_steps(trace, t1, t2)
    setup = CacheSetup(residency["high_slots"], residency["low_slots"], residency["n_layers"], 1.0)
    predicted = replay(steps, setup, policy, weights)
    with Engine(path, expert_cache="50%", t1=t1, t2=t2, cache_policy=policy, policy_weights=weights,
                fill_cache=False, **SETTINGS) as eng:  # the replay starts with an empty cache
        decode_sequences(eng, tokens, 64)
        total = eng.stats()["experts"]["total"]
    assert predicted.loads_low > 0 and predicted.hits_low > 0
    assert (predicted.requests, predicted.hits_high, predicted.hits_low, predicted.loads_high, predicted.loads_low) == (
        total["requests"], total["hits_high"], total["hits_low"], total["loads_high"], total["loads_low"])


def test_the_trace_has_every_moe_layer_of_every_token_in_single_token_ubatches(models):
    with Engine(models["q4"], expert_cache="50%", t1=1.0, t2=1.0, trace_routing=True, **SETTINGS) as eng:
        tokens = eng.tokenize(TEXT)[:100]
        trace = record_trace(eng, tokens, 64)
    n_layers = len(read_model_info(models["q4"]).expert_bytes_per_layer)
    assert len(trace["layer"]) == 100 * n_layers
    assert trace["ids"].shape == trace["weights"].shape == (100 * n_layers, 2)
    assert np.unique(np.unique(trace["ubatch"], return_counts=True)[1]).tolist() == [n_layers]
    assert trace["sequence"].tolist() == [0] * 64 * n_layers + [1] * 36 * n_layers


def test_prediction_accuracy_is_counted_as_the_runtime_counts_it(models):
    with Engine(models["q4"], expert_cache="50%", t1=1.0, t2=1.0, trace_routing=True, **SETTINGS) as eng:
        trace = record_trace(eng, eng.tokenize(TEXT)[:64], 64)
        native = eng.stats()["experts"].get("prediction")
    if "predicted" not in trace or not native:
        pytest.skip("this build of the runtime records no predictions")
    accuracy = prediction_accuracy(trace)
    assert accuracy["top1_accuracy"] == pytest.approx(native[0]["top1_accuracy"])
    assert accuracy["recall"] == pytest.approx(native[0]["recall"])


def test_calibrate_writes_the_sidecar_and_trace_and_run_picks_them_up(models, tmp_path):
    model = tmp_path / "model.gguf"
    shutil.copyfile(models["q4"], model)
    r = cli("calibrate", model, "-f", models["text"], *CALIBRATE_ARGS)
    assert r.returncode == 0, r.stderr
    assert "t1" in r.stdout and "hobbit" in r.stdout and sidecar_path(model) in r.stdout
    assert "loads per MoE layer: MIN " in r.stdout
    assert "Traceback" not in r.stderr
    data = json.loads(open(sidecar_path(model)).read())
    assert data["version"] == 1
    assert (data["n_tokens"], data["text"], data["budget"]) == (256, "text.txt", "50%")
    assert data["low_cost"] == pytest.approx(4.5 / 8.5)  # q4_0 / q8_0 bits per weight
    trace = load_trace(trace_path(model))
    assert {"ubatch", "layer", "ids", "weights", "sequence"} <= set(trace)
    assert len(trace["layer"]) == 256 * 2

    # the sidecar's numbers are those of the trace: the thresholds of the default top-2 split, the
    # split they give counted from the scores by the rule (s <= T1 HIGH, s <= T2 LOW, else SKIP),
    # each layer's expert counts, and each policy's penalty replayed again
    assert (data["t1"], data["t2"]) == choose_thresholds(trace["weights"], default_split(2))
    scores = selection_scores(trace["weights"])
    assert data["achieved_split"] == {"high": float(np.mean(scores <= data["t1"])),
                                      "low": float(np.mean((scores > data["t1"]) & (scores <= data["t2"]))),
                                      "skip": float(np.mean(scores > data["t2"]))}
    assert data["achieved_split"]["high"] == pytest.approx(0.67, abs=0.02)
    n_experts = read_model_info(model).n_experts
    assert data["expert_usage"] == {
        str(layer): [Counter(trace["ids"][trace["layer"] == layer].ravel().tolist())[e] for e in range(n_experts)]
        for layer in (0, 1)}

    with Engine(model, expert_cache="50%", **SETTINGS) as eng:
        residency = eng.expert_residency
    assert (residency["t1"], residency["t2"], residency["cache_policy"]) == (data["t1"], data["t2"], "hobbit")
    assert (data["high_slots"], data["low_slots"]) == (residency["high_slots"], residency["low_slots"])
    steps = replay_steps(trace, data["t1"], data["t2"])
    setup = CacheSetup(data["high_slots"], data["low_slots"], residency["n_layers"], data["low_cost"],
                       layers=(0, 1), n_expert=n_experts, n_expert_used=2)
    assert data["penalties"] == {"hobbit": replay(steps, setup, "hobbit", data["policy_weights"]).to_dict(),
                                 **{p: replay(steps, setup, p).to_dict() for p in SINGLE_POLICIES}}
    assert all(data["penalties"]["hobbit"]["penalty"] <= data["penalties"][p]["penalty"] for p in ("lhu", "fld"))
    native = ExpertOptions().resolve(read_model_info(model), load_calibration(model))
    assert list(native.policy_weights) == pytest.approx(data["policy_weights"])  # the runtime's are float32


def test_calibrate_json_and_a_trace_path_of_ones_own(models, tmp_path):
    model = tmp_path / "model.gguf"
    shutil.copyfile(models["q4"], model)
    r = cli("calibrate", model, "-f", models["text"], *CALIBRATE_ARGS, "--trace", tmp_path / "t.trace",
            "--target-split", "0.75,0.25,0", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["trace_path"] == str(tmp_path / "t.trace") and (tmp_path / "t.trace").is_file()
    assert out["target_split"] == {"high": 0.75, "low": 0.25, "skip": 0.0}
    assert out["t2"] == 1.0 and out["achieved_split"]["skip"] == 0.0
    # MIN and every policy, per MoE layer and in total
    against = out["lossless_against_min"]
    for r in [against["min"], *against["policies"].values()]:
        assert list(r["loads_per_layer"]) == ["0", "1"] and sum(r["loads_per_layer"].values()) == r["loads"]


def test_explicit_options_beat_the_sidecar_which_beats_the_embedded_calibration(models, tmp_path):
    embedded = {"version": 1, "t1": 0.3, "t2": 0.8, "policy_weights": [0.1, 0.2, 0.3, 0.4]}
    sidecar_file = tmp_path / "cal.json"
    sidecar_file.write_text(json.dumps(embedded))
    model = convert(models["src"], tmp_path / "embedded.gguf", high="q8_0", low="q4_0", progress=False,
                    calibration=sidecar_file)
    assert not (tmp_path / "embedded.gguf.calibration.json").exists()

    def residency(**options):
        with Engine(model, expert_cache="50%", **SETTINGS, **options) as eng:
            r = eng.expert_residency
        return r["t1"], r["t2"], r["cache_policy"]

    assert residency() == (0.3, 0.8, "hobbit")
    assert load_calibration(model)["policy_weights"] == [0.1, 0.2, 0.3, 0.4]
    write_sidecar({"version": 1, "t1": 0.5, "t2": 0.7, "policy_weights": [1, 0, 0, 0]},
                      sidecar_path(model))
    assert residency() == (0.5, 0.7, "hobbit")
    assert residency(t1=0.2, t2=0.6, cache_policy="lru") == (0.2, 0.6, "lru")


def test_convert_embeds_the_calibration_as_metadata(models, tmp_path):
    sidecar = {"version": 1, "t1": 0.625, "t2": 0.875, "policy_weights": [0.5, 0.25, 0.25, 0.0], "n_tokens": 7}
    (tmp_path / "cal.json").write_text(json.dumps(sidecar))
    r = cli("convert", models["src"], "-o", tmp_path / "out.gguf", "--high", "q8_0", "--low", "q4_0",
            "--calibration", tmp_path / "cal.json")
    assert r.returncode == 0, r.stderr
    kv = read_model_info(tmp_path / "out.gguf").metadata
    assert (kv["edgemoe.calibration.t1"], kv["edgemoe.calibration.t2"]) == (0.625, 0.875)
    assert json.loads(kv["edgemoe.calibration.json"]) == sidecar
    assert embedded_calibration(tmp_path / "out.gguf") == sidecar


def test_convert_refuses_a_calibration_that_is_not_one(models, tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"version": 1, "t1": 0.9, "t2": 0.5}))
    with pytest.raises(ConversionError, match="t1 <= t2"):
        convert(models["src"], tmp_path / "out.gguf", calibration=tmp_path / "bad.json", progress=False)
    r = cli("convert", models["src"], "-o", tmp_path / "out.gguf", "--calibration", tmp_path / "missing.json")
    assert_one_line_error(r, "cannot read the calibration sidecar")
    assert not (tmp_path / "out.gguf").exists()
    # another model's (the demo's 16 experts a layer): embedded, every run of the file refused it
    r = cli("convert", models["src"], "-o", tmp_path / "out.gguf", "--calibration", REPO / "models" / "demo.gguf.calibration.json")
    assert_one_line_error(r, "--calibration is another model's")
    assert list(tmp_path.glob("*.gguf*")) == []


def test_a_model_whose_experts_have_biases_is_calibrated_with_a_note_saying_so(models, tiny_model, tmp_path):
    # GPT-OSS: its LOW copies there, low precision off (a pass per precision would add the biases twice)
    mp = convert_gguf(tiny_model("gpt_oss")[0], tmp_path / "gpt_oss.gguf", high="q8_0", low="q4_0", progress=False)
    r = cli("calibrate", mp, "-f", models["text"], *CALIBRATE_ARGS)
    assert r.returncode == 0, r.stderr
    assert "gpt-oss's experts have biases" in r.stderr and "no LOW expert copies" not in r.stderr


def test_bounds_of_another_system_are_said_unused(models, tmp_path):
    model = tmp_path / "model.gguf"
    shutil.copyfile(models["q4"], model)
    r = cli("calibrate", model, "-f", models["text"], *CALIBRATE_ARGS, "--loss-budget", "5%", "--size-budget", "50%")
    assert r.returncode == 0, r.stderr
    assert "note: the size budget is --system edgemoe's: unused" in r.stderr
    assert "note: the loss budget and the agreement bound are --system edgemoe's and mobile's: unused" in r.stderr


def test_a_model_without_low_copies_is_calibrated_with_a_note(models, tmp_path):
    high = export(models["q4"], tmp_path / "high.gguf", precision="high", progress=False)
    r = cli("calibrate", high, "-f", models["text"], *CALIBRATE_ARGS)
    assert r.returncode == 0, r.stderr
    assert "no LOW expert copies" in r.stderr
    data = json.loads(open(sidecar_path(high)).read())
    assert data["low_slots"] == 0 and data["penalties"]["lru"]["loads_low"] == 0


@pytest.mark.parametrize("args, message", [
    (("--target-split", "0.5,0.3,0.3"), "sum to 1"),
    (("--budget", "auto"), "needs an expert cache budget"),
    (("--budget", "1KiB"), "below the minimum"),
    (("--max-tokens", "10"), "max_tokens must be"),
    (("--grid-step", "0.3"), "divide 1"),
    (("--grid-step", "0"), "divide 1"),  # a ZeroDivisionError's traceback
    (("--grid-step", "0.01"), "at least 1/20"),  # 176,851 replays
    (("--budget", "mmap"), "needs an expert cache budget"),  # a TypeError's traceback
])
def test_bad_calibrate_options_are_one_line_errors(models, tmp_path, args, message):
    model = tmp_path / "model.gguf"
    shutil.copyfile(models["q4"], model)
    r = cli("calibrate", model, "-f", models["text"], "-t", "1", *args)
    assert_one_line_error(r, message)
    assert not (tmp_path / "model.gguf.calibration.json").exists()


@pytest.mark.parametrize("kwargs, message", [
    (dict(t1=0.5), "calibrate sets t1 itself"),  # a TypeError ("multiple values")
    (dict(expert_options=ExpertOptions(t2=0.95)), "calibrate sets t2 itself"),
    (dict(expert_cache="50%"), "calibrate sets expert_cache itself"),
    (dict(system="edgemoe", size_budget="x"), "size_budget must be a number"),
    (dict(min_agreement="x"), "min_agreement must be a number"),
    (dict(grid_step="a"), "the grid step must divide 1"),
])
def test_calibrate_from_python_refuses_what_it_sets_and_bounds_that_are_no_numbers(models, kwargs, message):
    from pyedgemoe.calibration.run import calibrate
    with pytest.raises(InvalidOptionError, match=message):
        calibrate(models["q4"], open(models["text"]).read(), write=False, n_threads=1, **kwargs)


def test_a_short_text_is_a_one_line_error(models, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("a few words only")
    r = cli("calibrate", models["q4"], "-f", short, "-t", "1")
    assert_one_line_error(r, "at least 64 tokens")


def test_a_dense_model_is_a_one_line_error(tiny_model, models):
    dense, _ = tiny_model("llama")
    r = cli("calibrate", dense, "-f", models["text"], "-t", "1")
    assert_one_line_error(r, "no experts")


@pytest.mark.parametrize("sidecar, message", [
    # another model's (its top-k, its experts per layer): its thresholds and tables were applied here
    ({"version": 1, "t1": 0.5, "t2": 0.9, "n_experts_used": 99}, "is another model's"),
    ({"version": 1, "t1": 0.5, "t2": 0.9, "expert_usage": {"0": [1, 2, 3]}}, "is another model's"),
    ({"version": 2, "t1": 0.5, "t2": 0.9}, "not version 1"),
    ({"version": True, "t1": 0.5, "t2": 0.9}, "not version 1"),  # JSON's true is no version
    ({"version": 1, "t1": True, "t2": True}, "no valid t1 <= t2"),
    ({"version": 1, "t1": 0.5, "t2": 0.9, "policy_weights": None}, "invalid policy_weights"),  # was a TypeError
    # were an OverflowError, a TypeError and numpy's ValueError where they were used
    ({"version": 1, "t1": 10**400, "t2": 10**400}, "no valid t1 <= t2"),
    ({"version": 1, "t1": 0.5, "t2": 0.9, "big_little": [1]}, "invalid big_little"),
    ({"version": 1, "t1": 0.5, "t2": 0.9, "stand_ins": {"layers": {"0": {
        "cost": [[0.0]], "swap_cost_quantiles": [0.0, 1.0]}}}}, "invalid stand_ins"),
    ({"version": 1, "t1": 0.5, "t2": 0.9, "policy_weights": [1e308] * 4}, "invalid policy_weights"),
    ({"version": 1, "t1": 0.5, "t2": 0.9, "n_experts_used": "2"}, "invalid n_experts_used"),
])
def test_a_sidecar_that_is_not_one_is_refused(models, tmp_path, sidecar, message):
    model = tmp_path / "model.gguf"
    shutil.copyfile(models["q4"], model)
    (tmp_path / "model.gguf.calibration.json").write_text(json.dumps(sidecar))
    with pytest.raises(InvalidOptionError, match=message):
        Engine(model, expert_cache="50%", **SETTINGS)


def test_the_calibrated_policy_is_the_one_for_the_mode_that_runs():
    """calibrate chooses twice (docs/mixed-precision.md): with LOW copies by the miss penalty
    (best_policy), lossless by the loads (best_lossless_policy); a run takes the one of its mode."""
    info = read_model_info(REPO / "models" / "demo.gguf")  # multi-precision: LOW copies by default
    calibration = {"best_policy": "hobbit", "best_lossless_policy": "decay", "policy_weights": [0.7, 0.2, 0, 0.1]}
    assert ExpertOptions().resolve(info, calibration).cache_policy.name == "hobbit"
    assert ExpertOptions(low_precision=False).resolve(info, calibration).cache_policy.name == "decay"
    # a sidecar from before best_lossless_policy: its one choice for both
    older = {"best_policy": "fate", "policy_weights": [0.7, 0.2, 0, 0.1]}
    assert ExpertOptions(low_precision=False).resolve(info, older).cache_policy.name == "fate"
    # given wins; several sequences: hobbit
    assert ExpertOptions(low_precision=False, cache_policy="lru").resolve(info, calibration).cache_policy.name == "lru"
    assert ExpertOptions(low_precision=False).resolve(info, calibration, n_parallel=2).cache_policy.name == "hobbit"


def test_only_the_text_the_tokens_need_is_tokenized_and_they_are_the_whole_texts(models):
    text = TEXT * 40  # a corpus of megabytes was tokenized whole for the first max_tokens (2 GB for 50 MB)
    with Engine(models["src"], **SETTINGS) as eng:
        whole = eng.tokenize(text, add_bos=True, special=False)
        assert eng.first_tokens(text, 300) == whole[:300] and eng.first_tokens(text, None) == whole
        assert eng.first_tokens(TEXT, 10**6) == eng.tokenize(TEXT, add_bos=True, special=False)
