"""Mixed-precision experts, prefetching and cache policies (HOBBIT sec. 3.2-3.4): the precision
rule and the cache policies against hand-computed expectations, and the runtime on tiny
multi-precision models — lossless whenever low precision and skipping are off (with every cache
policy and prefetch mode), and exactly the two-pass sum it claims to be.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import tiny_moe
from pyedgemoe import Engine, _native, expert_options
from pyedgemoe.convert import convert
from pyedgemoe.generation import SamplingParams
from pyedgemoe.convert.export import export
from pyedgemoe.convert.from_gguf import convert_gguf, copy_chunks, copy_kv, kv_value, open_gguf, tensor_ne, tensor_type_name
from pyedgemoe.convert.gguf_out import GGUFOutput
from pyedgemoe.errors import InvalidOptionError

SETTINGS = dict(n_ctx=256, n_threads=2, flash_attn=False, kv_type="f32")
IDS = [1, 17, 42, 99, 5, 230, 64, 7, 150, 33, 12, 201, 88, 3, 120, 45]
POLICIES = ["lru", "lfu", "lhu", "fld", "hobbit", "edgemoe", "fate"]
PREFETCH = ["none", "hobbit", "fate"]


# -- the precision rule: s_0 = 0, s_i = sum of the normalized weights ranked above ----------------

@pytest.mark.parametrize("weights, expected", [
    ([0.7, 0.3], ["high", "low"]),                          # s = 0, 0.7
    ([0.55, 0.45], ["high", "high"]),                       # s = 0, 0.55 <= 0.6
    ([0.5, 0.3, 0.15, 0.05], ["high", "high", "low", "skip"]),  # s = 0, 0.5, 0.8, 0.95
    ([0.05, 0.15, 0.3, 0.5], ["skip", "low", "high", "high"]),  # the same, in another order
    ([5.0, 3.0, 1.5, 0.5], ["high", "high", "low", "skip"]),    # weights are normalized first
    ([0.95, 0.05], ["high", "skip"]),                       # s = 0.95 > 0.9
])
def test_precision_rule_matches_hand_computed_scores(weights, expected):
    assert _native.choose_precisions(weights, 0.6, 0.9) == expected


def test_precision_rule_ties_rank_the_earlier_selection_first():
    # equal weights: s = 0, 0.25, 0.5, 0.75 in position order
    assert _native.choose_precisions([0.25] * 4, 0.3, 0.6) == ["high", "high", "low", "skip"]


def test_top1_is_high_even_with_zero_thresholds():
    assert _native.choose_precisions([0.6, 0.4], 0.0, 0.0) == ["high", "skip"]


def test_without_low_the_low_band_is_high_and_without_skip_the_skip_band_is_low():
    w = [0.5, 0.3, 0.15, 0.05]
    assert _native.choose_precisions(w, 0.6, 0.9, use_low=False) == ["high", "high", "high", "skip"]
    assert _native.choose_precisions(w, 0.6, 0.9, use_skip=False) == ["high", "high", "low", "low"]
    assert _native.choose_precisions(w, 0.6, 0.9, use_low=False, use_skip=False) == ["high"] * 4


# -- the cache's placement and eviction (the runtime's own code, without memory or I/O) -----------

def served(placements):
    return [(e, p, load) for e, p, _slot, load in placements]


def test_cached_high_serves_any_demand_and_low_serves_low_and_skip():
    c = _native.ExpertCache(high_slots=2, low_slots=2)
    c.place(0, [(1, "high"), (2, "low")])
    assert served(c.place(0, [(1, "skip"), (2, "skip"), (3, "skip")])) == [
        (1, "high", False), (2, "low", False), (3, "skip", False)]


def test_low_hit_for_a_high_demand_is_accepted_or_reloaded():
    accept = _native.ExpertCache(high_slots=2, low_slots=2, low_serves_high=True)
    reload = _native.ExpertCache(high_slots=2, low_slots=2, low_serves_high=False)
    for c in (accept, reload):
        c.place(0, [(5, "low")])
    assert served(accept.place(0, [(5, "high")])) == [(5, "low", False)]
    assert served(reload.place(0, [(5, "high")])) == [(5, "high", True)]


def test_lru_evicts_the_least_recently_used_and_never_one_needed_now():
    c = _native.ExpertCache(high_slots=3, policy="lru")
    for e in (1, 2, 3):
        c.place(0, [(e, "high")])
    c.place(0, [(1, "high")])                      # order of use: 2, 3, 1
    c.place(0, [(4, "high"), (2, "high")])        # 2 is needed now: 3 goes
    assert not c.cached(0, 3, "high")
    assert all(c.cached(0, e, "high") for e in (1, 2, 4))


def test_a_prefill_sweep_evicts_the_layers_it_has_passed_before_those_ahead():
    # 4 experts a layer, 2 a token, 8 slots: two layers. The cache holds layers 1 and 2 (1 the
    # older, as a fill leaves it) when a ubatch sweeps layers 0, 1 and 2 needing every expert.
    def loads(n_tokens):
        c = _native.ExpertCache(high_slots=8, policy="lru", n_layers=3, n_expert=4, n_expert_used=2)
        for il in (1, 2):
            c.place(il, [(e, "high") for e in range(4)])
        c.advance_tokens(n_tokens)
        return sum(load for il in (0, 1, 2) for _, _, _, load in c.place(il, [(e, "high") for e in range(4)]))

    # 4 tokens need most experts (a sweep): layer 0 takes layer 1's slots (none passed yet), layer 1
    # then takes layer 0's, which the sweep has passed, and layer 2 finds its own cached
    assert loads(4) == 8
    # one token is no sweep: plain LRU, where layer 1 takes layer 2's slots (older than layer 0's)
    assert loads(1) == 12


def test_lfu_evicts_the_least_used():
    c = _native.ExpertCache(high_slots=2, policy="lfu")
    c.place(0, [(1, "high")])
    c.place(0, [(2, "high")])
    c.place(0, [(1, "high")])  # 1 used twice (load + hit: uses since insertion 2 vs 1)
    c.place(0, [(3, "high")])
    assert c.cached(0, 1, "high") and not c.cached(0, 2, "high")


def test_hobbit_priority_is_the_weighted_sum_of_recency_frequency_high_use_and_layer_distance():
    # Two cached experts of layer 0, decided at token T = 4 while layer 1 runs (L = 4):
    #   A: last used at token 1, 3 uses, 3 HIGH -> recency 1/4, frequency 3/4, high 3/4
    #   B: last used at token 4, 1 use,  1 HIGH -> recency 4/4, frequency 1/4, high 1/4
    # fld is equal for both (same layer). With weights lru only, A goes; with lfu only, B goes.
    def scenario(weights):
        c = _native.ExpertCache(high_slots=2, policy="hobbit", weights=weights, n_layers=4)
        c.advance_tokens(1)
        c.place(0, [(0, "high")])  # A, use 1 at token 1
        c.place(0, [(0, "high")])  # use 2
        c.place(0, [(0, "high")])  # use 3
        c.advance_tokens(3)        # T = 4
        c.place(0, [(1, "high")])  # B at token 4
        c.place(1, [(9, "high")])  # layer 1 needs a slot: one of layer 0's experts is evicted
        return "A" if not c.cached(0, 0, "high") else "B"

    assert scenario([1, 0, 0, 0]) == "A"
    assert scenario([0, 1, 0, 0]) == "B"
    assert scenario([0, 0, 1, 0]) == "B"


def test_fld_evicts_the_expert_whose_layer_comes_last():
    # running layer 2 of 4: layer 1 is 3 layers away (p = 1/4), layer 3 one away (p = 3/4)
    c = _native.ExpertCache(high_slots=2, policy="fld", n_layers=4)
    c.place(3, [(0, "high")])
    c.place(1, [(0, "high")])
    c.place(2, [(5, "high")])
    assert c.cached(3, 0, "high") and not c.cached(1, 0, "high")


def _decode_loads(policy, experts, slots=2):
    """Loads of one layer decoding a token at a time, each routed to one of `experts`."""
    c = _native.ExpertCache(high_slots=slots, policy=policy, n_layers=1, n_expert=8, n_expert_used=1)
    loads = 0
    for e in experts:
        c.advance_tokens(1)
        loads += sum(load for _, _, _, load in c.place(0, [(e, "high")]))
    return loads


def test_decay_keeps_an_expert_used_often_lately_through_a_burst_of_others():
    # A four times, then B, C, A, D, E, A, ...: lru drops A whenever two others pass; decay keeps it
    burst = [0] * 4 + [1, 2, 0, 3, 4, 0, 5, 6, 0, 1, 2, 0]
    assert _decode_loads("lru", burst) == 13
    assert _decode_loads("decay", burst) == 9   # A loaded once; each of the 8 others once


def test_decay_lets_an_expert_hot_long_ago_go_where_lfu_keeps_it():
    # A 20 times, then B and C alternating for 200 tokens: lfu keeps A (20 uses against 1, counted
    # since insertion) and B and C evict each other every token. With decay A's score halves every
    # 16 tokens while B's and C's climb (their records outlive evictions), so A goes within a few
    # dozen tokens and B and C stay
    hot_then_cold = [0] * 20 + [1, 2] * 100
    assert _decode_loads("lfu", hot_then_cold) == 201
    assert _decode_loads("decay", hot_then_cold) <= 40
    assert _decode_loads("lru", hot_then_cold) == 3


def test_lhu_does_not_count_low_uses():
    c = _native.ExpertCache(high_slots=1, low_slots=2, policy="lhu")
    c.advance_tokens(1)
    c.place(0, [(1, "low")])
    c.place(0, [(1, "low")])
    c.place(0, [(2, "low")])   # 1: two LOW uses, 2: one LOW use, both H = 0: the older (1) goes
    c.place(0, [(3, "low")])
    assert not c.cached(0, 1, "low") and c.cached(0, 2, "low")


def test_records_reset_with_a_new_sequence():
    c = _native.ExpertCache(high_slots=2, policy="lhu")
    c.advance_tokens(1)
    for _ in range(3):
        c.place(0, [(1, "high")])  # 1: three HIGH uses
    c.place(0, [(2, "high")])
    c.start_sequence()             # both records forgotten: ties go to the least recently used (1)
    c.place(0, [(3, "high")])
    assert not c.cached(0, 1, "high") and c.cached(0, 2, "high")


# -- the predictor and HOBBIT's prefetch walk ----------------------------------------------------

def test_predicted_experts_are_the_top_k_in_the_precision_of_their_softmax_weight():
    # logits ln(0.7), ln(0.2), ln(0.1), ~-inf: softmax 0.7, 0.2, 0.1, 0 -> top-2 (0, 1); normalized
    # over the top-2 as the rule does: 0.7/0.9 = 0.778 -> s_1 = 0.778
    logits = [np.log(0.7), np.log(0.2), np.log(0.1), -30.0]
    assert _native.predict_layer(logits, 2) == [(0, "high"), (1, "low")]
    assert _native.predict_layer(logits, 2, t1=0.8) == [(0, "high"), (1, "high")]
    assert _native.predict_layer(logits, 2, t2=0.75) == [(0, "high")]  # s_1 > t2: skipped, not prefetched


def test_fate_adds_likely_experts_beyond_the_top_k():
    # 10 experts, probabilities 0.4 0.3 0.2 0.05 0.0083...: above the 75th percentile are the top
    # ceil(2.5) = 3 (Fate's rule), above the 90th the top 1
    probs = [0.4, 0.3, 0.2, 0.05] + [0.05 / 6] * 6
    logits = list(np.log(probs))
    assert [e for e, _ in _native.predict_layer(logits, 1, t1=1.0, fate_extra=3)] == [0, 1, 2]
    assert [e for e, _ in _native.predict_layer(logits, 1, t1=1.0, fate_extra=1)] == [0, 1]  # the I/O cap
    assert [e for e, _ in _native.predict_layer(logits, 1, t1=1.0, fate_extra=3, fate_percentile=0.9)] == [0]


def test_walk_goes_one_layer_further_only_while_every_prediction_is_cached():
    layers = [[(1, "high"), (2, "low")], [(3, "high"), (4, "high")], [(5, "high"), (6, "low")]]
    # nothing cached: the next layer only
    assert _native.walk_predictions(layers, []) == [(0, 1), (0, 2)]
    # the next layer cached: the one after it too, which has a miss: stop there
    assert _native.walk_predictions(layers, [(0, 1), (0, 2)]) == [(0, 1), (0, 2), (1, 3), (1, 4)]
    # two layers cached: all three
    walked = _native.walk_predictions(layers, [(0, 1), (0, 2), (1, 3), (1, 4)])
    assert walked == [(0, 1), (0, 2), (1, 3), (1, 4), (2, 5), (2, 6)]
    # Fate: the next layer only, cached or not
    assert _native.walk_predictions(layers, [(0, 1), (0, 2)], walk_further=False) == [(0, 1), (0, 2)]


# -- the runtime on multi-precision files -------------------------------------------------------

@pytest.fixture(scope="module")
def mp_models(tiny_model, tmp_path_factory):
    """(HIGH q8_0 + LOW q4_0, HIGH q8_0 + LOW q8_0) multi-precision files of tiny Qwen3-MoE."""
    src, _ = tiny_model("qwen3_moe")
    d = tmp_path_factory.mktemp("mp")
    return (convert_gguf(src, d / "q8-q4.gguf", high="q8_0", low="q4_0", progress=False),
            convert_gguf(src, d / "q8-q8.gguf", high="q8_0", low="q8_0", progress=False))


N_GENERATED = 24


def evaluate(path, **options):
    with Engine(path, **SETTINGS, **options) as eng:
        return eng.logits(IDS), eng.time_generation(IDS[:6], N_GENERATED)["tokens"], eng.stats(), eng.n_ubatch


def resident(path, n_ubatch):
    return evaluate(path, n_batch=n_ubatch)


@pytest.mark.parametrize("prefetch", PREFETCH)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("budget", ["50%", "minimum"])
def test_without_low_precision_and_skipping_every_policy_and_prefetch_is_lossless(mp_models, policy, prefetch,
                                                                                  budget):
    path = mp_models[0]
    if budget == "minimum":
        with Engine(path, **SETTINGS, expert_cache="50%", low_precision=False) as eng:
            budget = eng.expert_residency["minimum_bytes"]
    logits, tokens, stats, n_ubatch = evaluate(path, expert_cache=budget, low_precision=False, skip=False,
                                               cache_policy=policy, prefetch=prefetch)
    ref_logits, ref_tokens, _, _ = resident(path, n_ubatch)
    assert stats["experts"]["total"]["misses"] > 0
    assert np.array_equal(logits, ref_logits)
    assert tokens == ref_tokens


def test_mixed_precision_is_on_by_default_for_a_multi_precision_file(mp_models):
    _, _, stats, _ = evaluate(mp_models[0], expert_cache="50%")
    experts = stats["experts"]
    assert experts["mixed_precision"] and experts["skip"]
    total = experts["total"]
    assert total["loads_low"] > 0
    # the bytes read are split by precision, per layer as in total
    assert 0 < total["bytes_read_low"] < total["bytes_read"]
    for c in experts["layers"].values():
        assert (c["bytes_read_low"] > 0) == (c["loads_low"] > 0)
    # every token's k selections in a layer are served exactly once: in HIGH, in LOW or skipped.
    # evaluate() runs IDS, then the prompt IDS[:6] again (time_generation starts a new sequence) and
    # each generated token but the last; llama.cpp runs the last layer only on the tokens whose
    # logits are read: all of IDS, the prompt's last token and the generated ones
    tokens = {"0": len(IDS) + 6 + N_GENERATED - 1, "1": len(IDS) + 1 + N_GENERATED - 1}
    served = {layer: c["selections_high"] + c["selections_low"] + c["selections_skip"]
              for layer, c in experts["layers"].items()}
    assert served == {layer: experts["n_expert_used"] * n for layer, n in tokens.items()}


# llama.cpp's files of families pyedgemoe's HF converter does not take: DeepSeek-V3's and dots.llm1's
# sigmoid routing with a correction bias (HOBBIT's rule takes the routing weights as they come),
# Granite's scaled residuals, the recurrent layers of Granite-4.0-H, Qwen3.5, Nemotron-H and Jamba
# beside them, the selection biases of Nemotron-H, AFMoE and ERNIE-4.5, Gemma 4's fused gate/up experts
# with a scale each.
# (The tiny MiniMax-M2's top-2 weights are near even, so nothing goes LOW at HOBBIT's thresholds.)
@pytest.mark.parametrize("arch", ["deepseek_v3", "dots1", "granitemoe", "granitemoehybrid", "qwen3_5_moe", "nemotron_h",
                                  "afmoe", "ernie4_5_moe", "jamba", "gemma4", "glm4_moe_lite"])
def test_a_llama_cpp_file_made_multi_precision_runs_mixed(tiny_model, tmp_path, arch):
    path = convert_gguf(tiny_model(arch)[0], tmp_path / "mp.gguf", high="q8_0", low="q4_0", progress=False)
    logits, _, stats, n_ubatch = evaluate(path, expert_cache="50%")
    assert stats["experts"]["mixed_precision"] and stats["experts"]["total"]["loads_low"] > 0
    lossless = evaluate(path, expert_cache="50%", low_precision=False, skip=False)
    assert lossless[1] == resident(path, lossless[3])[1]
    assert np.isfinite(logits).all() and not np.array_equal(logits, lossless[0])  # lossy: LOW copies, skips


def test_gpt_oss_runs_lossless_by_default_and_refuses_low_precision(tiny_model, tmp_path):
    # its expert biases are added by expert id, once a pass: a pass per precision would add them twice
    path = convert_gguf(tiny_model("gpt_oss")[0], tmp_path / "oss.gguf", high="q8_0", low="q4_0", progress=False)
    logits, tokens, stats, n_ubatch = evaluate(path, expert_cache="50%")
    assert not stats["experts"]["mixed_precision"] and stats["experts"]["total"]["misses"] > 0
    ref_logits, ref_tokens, _, _ = resident(path, n_ubatch)
    assert np.array_equal(logits, ref_logits) and tokens == ref_tokens
    for options in (dict(low_precision=True), dict(system="hobbit")):
        with pytest.raises(InvalidOptionError, match="does not support models with expert biases"):
            Engine(path, **SETTINGS, expert_cache="50%", **options)


def test_low_copies_identical_to_high_give_the_resident_logits_exactly(mp_models):
    # LOW = HIGH bytes and nothing skipped: the two passes (HIGH pool, LOW pool) must sum to the
    # one-pass result bit for bit, whatever each selection's precision
    path = mp_models[1]
    logits, tokens, stats, n_ubatch = evaluate(path, expert_cache="50%", t1=0.0, t2=1.0)
    # a prefill ubatch serves an expert in the highest precision any of its tokens asks for: most
    # LOW selections come from the decode steps
    assert stats["experts"]["summary"]["low_fraction"] > 0.1
    ref_logits, ref_tokens, _, _ = resident(path, n_ubatch)
    assert np.array_equal(logits, ref_logits)
    assert tokens == ref_tokens


def test_t1_of_one_without_a_prefill_low_share_serves_everything_in_high(mp_models):
    path = mp_models[0]
    logits, _, stats, n_ubatch = evaluate(path, expert_cache="50%", t1=1.0, prefill_low_share=0.0)
    assert stats["experts"]["summary"]["high_fraction"] == 1.0
    assert np.array_equal(logits, resident(path, n_ubatch)[0])


def test_low_precision_changes_logits_a_little_and_skipping_more(mp_models):
    path = mp_models[0]
    # an empty cache at the start: LOW precision and skipping apply to misses
    low, _, _, n_ubatch = evaluate(path, expert_cache="50%", t1=0.0, t2=1.0, fill_cache=False)
    ref = resident(path, n_ubatch)[0]
    skipped, _, stats, n_ubatch_skip = evaluate(path, expert_cache="50%", t1=0.0, t2=0.0, fill_cache=False)
    assert stats["experts"]["summary"]["skip_fraction"] > 0.1
    low_err = np.abs(low - ref).max()
    skip_err = np.abs(skipped - resident(path, n_ubatch_skip)[0]).max()
    assert 0 < low_err < skip_err


def test_low_from_a_standard_lower_quant_equals_the_multi_precision_file(mp_models, tmp_path):
    high = export(mp_models[0], tmp_path / "high.gguf", precision="high", progress=False)
    low = export(mp_models[0], tmp_path / "low.gguf", precision="low", progress=False)
    options = dict(expert_cache="50%", t1=0.3, t2=0.95)
    a_logits, a_tokens, a_stats, _ = evaluate(mp_models[0], **options)
    b_logits, b_tokens, b_stats, _ = evaluate(high, low_from=low, **options)
    assert b_stats["experts"]["low_source"] == str(low)
    assert b_stats["experts"]["total"]["loads_low"] > 0
    assert np.array_equal(a_logits, b_logits)
    assert a_tokens == b_tokens


def test_a_standard_file_is_lossless_by_default_and_refuses_low_precision(mp_models, tmp_path):
    high = export(mp_models[0], tmp_path / "high.gguf", precision="high", progress=False)
    _, _, stats, _ = evaluate(high, expert_cache="50%")
    assert not stats["experts"]["mixed_precision"] and not stats["experts"]["skip"]
    with pytest.raises(InvalidOptionError, match="LOW expert copies"):
        Engine(high, **SETTINGS, expert_cache="50%", low_precision=True)


def test_low_from_of_another_model_is_refused(mp_models, tiny_model, tmp_path):
    high = export(mp_models[0], tmp_path / "high.gguf", precision="high", progress=False)
    other, _ = tiny_model("mixtral")
    with pytest.raises(InvalidOptionError, match="not a GGUF of the same model"):
        Engine(high, **SETTINGS, expert_cache="50%", low_from=other)


@pytest.mark.parametrize("options, message", [
    (dict(t1=0.8, t2=0.5), "must not exceed"),
    (dict(t1=1.5), "between 0 and 1"),
    (dict(low_cache=0), r"low_cache must be a fraction in \(0, 1\), got 0"),
    (dict(low_cache=1), r"in \(0, 1\), got 1"),
    (dict(low_hit="maybe"), "unknown low_hit"),
    (dict(cache_policy="random"), "unknown cache_policy"),
    (dict(policy_weights="1,2,3"), "four"),
    (dict(policy_weights="1,-1,0,0"), "non-negative"),
])
def test_bad_precision_options_are_clear_errors(mp_models, options, message):
    with pytest.raises(InvalidOptionError, match=message):
        Engine(mp_models[0], **SETTINGS, expert_cache="50%", **options)


def test_budget_below_the_mixed_minimum_names_it(mp_models):
    with Engine(mp_models[0], **SETTINGS, expert_cache="50%") as eng:
        minimum = eng.expert_residency["minimum_bytes"]
    with pytest.raises(InvalidOptionError, match=f"minimum of {minimum} bytes"):
        Engine(mp_models[0], **SETTINGS, expert_cache=minimum - 1)


@pytest.mark.parametrize("prefetch", ["hobbit", "fate"])
def test_prefetching_reads_predicted_experts_and_reports_what_became_of_them(mp_models, prefetch):
    with Engine(mp_models[0], **SETTINGS, expert_cache="50%", low_precision=False, skip=False,
                prefetch=prefetch) as eng:
        eng.record_routing()
        eng.logits(IDS)
        eng.time_generation(IDS[:6], N_GENERATED)
        trace = eng.take_routing_trace()
        experts = eng.stats()["experts"]
    assert experts["prefetch"] == prefetch
    counters = experts["prefetches"]
    assert counters["issued"] > 0 and counters["bytes_read"] > 0
    assert counters["used"] + counters["wasted"] <= counters["issued"]
    # the next-layer prediction's scores, recounted from the routing trace: per token and layer,
    # the guessed top-k next to the real one (-1 where nothing was guessed: the first layer)
    guessed = trace["predicted"][:, 0] >= 0
    predicted, actual = trace["predicted"][guessed], trace["ids"][guessed]
    k = actual.shape[1]
    overlap = sum(len(set(p) & set(a)) for p, a in zip(predicted.tolist(), actual.tolist()))
    assert experts["prediction"][0] == {
        "depth": 1, "tokens": len(actual), "top1_accuracy": pytest.approx(np.mean(predicted[:, 0] == actual[:, 0])),
        "precision": pytest.approx(overlap / (k * len(actual))), "recall": pytest.approx(overlap / (k * len(actual)))}


@pytest.mark.parametrize("prefetch", ["hobbit", "fate"])
def test_a_model_of_one_moe_layer_has_nothing_to_prefetch_and_decodes_as_without(tmp_path, prefetch):
    # the predictor stacks the routers of the MoE layers ahead (hobbit: two): with one there are
    # none, and the load stopped on "cannot allocate the stacked routers"
    hf = tiny_moe.build_hf_checkpoint("qwen3_moe", tmp_path / "hf", overrides={"num_hidden_layers": 1})
    path = convert(hf, tmp_path / "one-layer.gguf", high="f32", low="q4_0", base="f32", progress=False)
    with Engine(path, **SETTINGS, expert_cache="50%", low_precision=False) as eng:
        expected = eng.time_generation(IDS[:6], N_GENERATED)["tokens"]
    with Engine(path, **SETTINGS, expert_cache="50%", low_precision=False, prefetch=prefetch) as eng:
        assert eng.time_generation(IDS[:6], N_GENERATED)["tokens"] == expected
        assert eng.stats()["experts"]["prefetches"]["issued"] == 0


def test_the_routing_trace_has_every_layer_of_every_token_and_the_predictors_guess(mp_models):
    with Engine(mp_models[0], **SETTINGS, expert_cache="50%", trace_routing=True) as eng:
        eng.record_routing()
        eng.logits(IDS[:5])
        trace = eng.take_routing_trace()
        k, layers = eng.info.n_experts_used, eng.expert_residency["n_layers"]
    assert trace["ids"].shape == (5 * layers, k) and trace["weights"].shape == (5 * layers, k)
    assert sorted(trace["layer"].tolist()) == sorted(list(range(layers)) * 5)
    first = trace["layer"] == trace["layer"].min()
    assert (trace["predicted"][first] == -1).all()           # nothing predicts the first layer
    assert (trace["predicted"][~first] >= 0).all()


def test_without_prefetch_tracing_or_low_copies_no_predictor_runs(mp_models):
    with Engine(mp_models[0], **SETTINGS, expert_cache="50%", low_precision=False, skip=False) as eng:
        eng.record_routing()
        eng.logits(IDS[:5])
        trace = eng.take_routing_trace()
        experts = eng.stats()["experts"]
    assert experts["predictor_depth"] == 0 and experts["prediction"] == []
    assert (trace["predicted"] == -1).all() and len(trace["layer"]) > 0


def with_loud_attention(src: Path, out: Path, factor: float = 50.0) -> Path:
    """src (f32) with every attention output projection scaled by `factor`: each layer's input is
    then mostly that layer's own attention output, so the next layer's router applied to this
    layer's input (the predictor) guesses little better than chance."""
    reader = open_gguf(src, "model")
    output = GGUFOutput(out, arch=kv_value(reader, gguf.Keys.General.ARCHITECTURE), force=True)
    copy_kv(reader, output.writer, skip=lambda key: False)
    for t in reader.tensors:
        if t.name.endswith("attn_output.weight"):
            produce = (lambda s=t: np.asarray(s.data, dtype=np.float32) * np.float32(factor))
        else:
            produce = (lambda s=t: copy_chunks(src, s))
        output.add_tensor(t.name, tensor_ne(t), tensor_type_name(t), produce)
    return output.finish(progress=False)


def test_prefetching_stops_itself_when_its_guesses_cost_more_reads_than_they_save(tiny_model, tmp_path):
    path = with_loud_attention(tiny_model("qwen3_moe")[0], tmp_path / "loud.gguf")
    with Engine(path, **{**SETTINGS, "n_ctx": 512}, expert_cache="25%", prefetch="hobbit") as eng:
        tokens = eng.time_generation(IDS[:6], 400)["tokens"]
        p = eng.stats()["experts"]["prefetches"]
        # judged by the meter (32 guesses of a rank settled) or the trial (not faster), whichever first
        assert 0 < p["used"] < p["wasted"], p
        assert p["stopped"]
        issued = p["issued"]
        # none since it stopped (a one-token prompt: a longer one's planned waves are read ahead)
        eng.time_generation(IDS[:1], 32)
        assert eng.stats()["experts"]["prefetches"]["issued"] == issued
    with Engine(path, **{**SETTINGS, "n_ctx": 512}) as eng:
        resident = eng.time_generation(IDS[:6], 400)["tokens"]
    assert tokens == resident  # lossless all along


def test_prefetching_is_judged_on_decode_guesses_only(tiny_model, tmp_path):
    # with LOW copies a prefill reads the next waves and layers ahead, and those reads are mostly
    # used; decode's guesses (loud attention) mostly miss, and the prompts must not outvote them
    loud = with_loud_attention(tiny_model("qwen3_moe")[0], tmp_path / "loud.gguf")
    path = convert_gguf(loud, tmp_path / "loud-mp.gguf", high="q8_0", low="q8_0", progress=False)
    prompt = (IDS * 32)[:480]
    with Engine(path, **{**SETTINGS, "n_ctx": 1024, "n_batch": 8}, expert_cache="25%", prefetch="hobbit") as eng:
        for _ in range(5):
            eng.logits(prompt)
        p = eng.stats()["experts"]["prefetches"]
        assert p["used"] >= 256 and p["used"] > 0.6 * (p["used"] + p["wasted"]) and not p["stopped"], p
        eng.time_generation(prompt[-8:], 400)
        p = eng.stats()["experts"]["prefetches"]
        assert p["stopped"], p
        # counted with the prompts' read-ahead, the used share would still be at least half
        assert p["used"] >= 0.5 * (p["used"] + p["wasted"]), p

@contextmanager
def on_two_cores():
    """This process on two of its cores while the block runs (an Engine reads them at load)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    os.sched_setaffinity(0, cores[:2])
    try:
        yield
    finally:
        os.sched_setaffinity(0, cores)


def test_prefetch_left_unset_reads_on_a_core_of_its_own_when_the_cache_holds_30_percent_or_less(tiny_model, mp_models,
                                                                                                 monkeypatch):
    path = tiny_model("qwen3_moe")[0]
    unset = {k: v for k, v in SETTINGS.items() if k != "n_threads"}
    with on_two_cores():
        with Engine(path, **unset, expert_cache="25%") as eng:  # a tiny model's experts: reads the compute cannot hide
            assert eng.stats()["experts"]["prefetch"] == "none" and eng.n_threads == 2
            assert "prefetch none (experts of 24.00 KiB: too small for the compute to hide their reads)" \
                in eng.expert_cache_note
        monkeypatch.setattr(expert_options, "PREFETCH_MIN_EXPERT_BYTES", 0)  # as if they were a real model's
        with Engine(path, **unset, expert_cache="25%") as eng:
            tokens = eng.time_generation(IDS[:6], N_GENERATED)["tokens"]
            experts = eng.stats()["experts"]
            assert experts["prefetch"] == "fate" and experts["prefetches"]["issued"] > 0
            assert eng.n_threads == 1
            assert "prefetch fate (its reads on 1 of 2 cores, the cache holds 25% of the experts)" in eng.expert_cache_note
        with Engine(path, **unset, expert_cache="50%") as eng:
            assert eng.stats()["experts"]["prefetch"] == "none" and eng.n_threads == 2
            assert "prefetch none (the cache holds 50% of the experts)" in eng.expert_cache_note
        with Engine(path, **SETTINGS, expert_cache="25%") as eng:  # n_threads given
            assert eng.stats()["experts"]["prefetch"] == "none" and eng.n_threads == 2
            assert "prefetch none (the decode's threads are given" in eng.expert_cache_note
        with Engine(mp_models[0], **unset, expert_cache="25%") as eng:  # with LOW copies too
            assert eng.stats()["experts"]["prefetch"] == "fate" and eng.n_threads == 1
        with Engine(path, **unset, expert_cache="25%", prefetch="hobbit") as eng:  # given: no reason shown
            assert eng.n_threads == 2 and "prefetch hobbit," in eng.expert_cache_note
    with Engine(path, **SETTINGS) as eng:
        assert tokens == eng.time_generation(IDS[:6], N_GENERATED)["tokens"]  # lossless


def test_the_decode_gets_the_reads_core_back_when_prefetching_stops_itself(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(expert_options, "PREFETCH_MIN_EXPERT_BYTES", 0)  # a tiny model prefetching as a real one
    path = with_loud_attention(tiny_model("qwen3_moe")[0], tmp_path / "loud.gguf")
    unset = {k: v for k, v in SETTINGS.items() if k != "n_threads"}
    with on_two_cores(), Engine(path, **{**unset, "n_ctx": 512}, expert_cache="25%") as eng:
        assert eng.n_threads == 1
        eng.time_generation(IDS[:6], 400)
        assert eng.stats()["experts"]["prefetches"]["stopped"]
        # both cores are the decode's again; how many it uses now is the thread governor's call,
        # fewer while other work runs beside the test (pyedgemoe/threads.py)
        assert eng._governor.n_max == 2 and not eng._reads_core


def test_the_trial_lends_the_reads_core_to_the_decode_in_its_windows_without_prefetch(tiny_model, monkeypatch):
    # lossless, prefetch left unset on two cores: Fate's reads on one, the decode on the other, and
    # in the trial's windows without prefetch (prefetch-trial.cpp) the decode has both, so the trial
    # weighs prefetching against what stopping it would give
    monkeypatch.setattr(expert_options, "PREFETCH_MIN_EXPERT_BYTES", 0)
    path = tiny_model("qwen3_moe")[0]
    unset = {k: v for k, v in SETTINGS.items() if k != "n_threads"}
    with on_two_cores(), Engine(path, **{**unset, "n_ctx": 512}, expert_cache="25%") as eng:
        seen = set()
        for _ in eng.generate_tokens(IDS[:6], 48, SamplingParams(temperature=0.0), ignore_eos=True):
            phase = eng._model.expert_prefetch_phase()
            seen.add(phase)
            assert eng._governor.n_max == (1 if phase == "reading" else 2), phase
        assert "held" in seen or "stopped" in seen, seen  # the trial ran its windows without prefetch


@pytest.mark.parametrize("prefetch", ["hobbit", "fate"])
def test_with_low_copies_prefetching_gives_the_same_tokens_however_fast_its_reads_go(mp_models, prefetch):
    # With LOW copies what a miss computes depends on what the cache holds. So what is prefetched,
    # cached and evicted must not depend on the reads' speed (threads, page cache or O_DIRECT):
    # each layer waits for the prefetch reads in flight, and Fate prefetches a fixed number of
    # experts beyond the top-k instead of as many as the measured compute would hide.
    runs = set()
    for io, io_threads in [("direct", 1), ("direct", 4), ("mmap", 1), ("mmap", 8), ("buffered", 2)]:
        with Engine(mp_models[0], **SETTINGS, expert_cache="25%", prefetch=prefetch, io=io,
                    io_threads=io_threads) as eng:
            tokens = tuple(eng.time_generation(IDS[:6], 96)["tokens"])
            experts = eng.stats()["experts"]
        assert experts["mixed_precision"] and experts["prefetches"]["issued"] > 0
        assert experts["total"]["loads_low"] > 0
        counts = experts["prefetches"]
        runs.add((tokens, *(counts[k] for k in ("issued", "used", "wasted")),
                  *(experts["total"][k] for k in ("hits_high", "hits_low", "loads_high", "loads_low"))))
    assert len(runs) == 1
