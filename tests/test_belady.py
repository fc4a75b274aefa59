"""Belady's MIN (pyedgemoe.calibration.belady): the fewest loads any eviction policy could make on
a trace, computed by hand on small ones, and never more than a real policy's on random ones."""
from __future__ import annotations

import random

import pytest

from pyedgemoe.calibration.belady import bypass_loads, lookahead_loads, min_loads
from pyedgemoe.calibration.replay import CacheSetup, ReplayStep, against_min, replay


def steps(*layers_and_experts) -> list[ReplayStep]:
    """One step per (layer, experts needed together)."""
    return [ReplayStep(i == 0, 1 if i == 0 else 0, layer, [(e, "high") for e in experts])
            for i, (layer, experts) in enumerate(layers_and_experts)]


def test_one_at_a_time_the_victim_is_the_one_used_again_last():
    # 2 slots; A B C A B D A. MIN: load A, B; C evicts B (next use 4, A's is 3); A hits; B evicts
    # C (never again); D evicts B (never again, A's is 6); A hits: 5 loads (LRU makes 7)
    A, B, C, D = 0, 1, 2, 3
    trace = steps(*[(0, [e]) for e in (A, B, C, A, B, D, A)])
    r = min_loads(trace, slots=2)
    assert (r.loads, r.requests, r.failures) == (5, 7, 0)
    assert replay(trace, CacheSetup(high_slots=2, low_slots=0, n_layers=1, low_cost=0.5), "lru").loads_high == 7


def test_a_step_keeps_what_it_needs():
    # 3 slots; {A,B} {C,D} {A,C} {B,D}: D must not evict C (needed with it) and evicts B (used
    # later than A); then B comes back: 5 loads
    A, B, C, D = 0, 1, 2, 3
    r = min_loads(steps((0, [A, B]), (0, [C, D]), (0, [A, C]), (0, [B, D])), slots=3)
    assert (r.loads, r.requests) == (5, 8)


def test_layers_are_separate_experts_and_counted_apart():
    # expert 0 of layer 0 and expert 0 of layer 1 are two experts; 1 slot: every step loads
    r = min_loads(steps((0, [0]), (1, [0]), (0, [0]), (1, [0])), slots=1)
    assert r.loads == 4 and r.loads_per_layer == {0: 2, 1: 2}
    r = min_loads(steps((0, [0]), (1, [0]), (0, [0]), (1, [0])), slots=2)
    assert r.loads == 2 and r.hit_rate == 0.5


def test_skips_are_not_loads_and_too_few_slots_is_a_failure():
    r = min_loads([ReplayStep(True, 1, 0, [(0, "high"), (1, "skip")])], slots=1)
    assert (r.loads, r.requests, r.failures) == (1, 1, 0)
    r = min_loads(steps((0, [0, 1, 2])), slots=2)
    assert r.failures == 1
    with pytest.raises(ValueError):
        min_loads(steps((0, [0])), slots=0)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("policy", ["lru", "lfu", "fate", "edgemoe", "decay"])
def test_no_policy_beats_min(seed, policy):
    rng = random.Random(seed)
    n_layers, n_expert, k, slots = 3, 8, 2, 7
    trace = steps(*[(t % n_layers, rng.sample(range(n_expert), k)) for t in range(300)])
    setup = CacheSetup(high_slots=slots, low_slots=0, n_layers=n_layers, low_cost=0.5,
                       layers=tuple(range(n_layers)), n_expert=n_expert, n_expert_used=k)
    assert min_loads(trace, slots).loads <= replay(trace, setup, policy).loads_high


def test_a_look_ahead_of_nothing_is_lru_and_of_the_whole_trace_is_min():
    # the trace of the first test: A B C A B D A with 2 slots. Seeing 1 step ahead: C (step 2)
    # sees A next and evicts B; B (step 4) sees neither A nor C and evicts C, the least recent;
    # D (step 5) sees A next and evicts B: MIN's 5 loads. Seeing nothing, lru's 7.
    A, B, C, D = 0, 1, 2, 3
    trace = steps(*[(0, [e]) for e in (A, B, C, A, B, D, A)])
    assert lookahead_loads(trace, 2, 0) == 7
    assert lookahead_loads(trace, 2, 1) == 5
    assert lookahead_loads(trace, 2, len(trace)) == min_loads(trace, 2).loads == 5


@pytest.mark.parametrize("seed", range(3))
def test_seeing_further_never_loads_more_than_lru_and_never_less_than_min(seed):
    rng = random.Random(seed)
    trace = steps(*[(t % 3, rng.sample(range(8), 2)) for t in range(300)])
    lru = replay(trace, CacheSetup(high_slots=7, low_slots=0, n_layers=3, low_cost=0.5), "lru").loads_high
    best = min_loads(trace, 7).loads
    assert lookahead_loads(trace, 7, 0) == lru
    assert lookahead_loads(trace, 7, len(trace)) == best
    for ahead in (3, 12, 48):
        assert best <= lookahead_loads(trace, 7, ahead) <= lru


def reuse_and_scan(tokens: int) -> list[ReplayStep]:
    """Two layers of 16 experts, top-2, one token per step: layer 0 reuses 4 experts (token t:
    t and t+1 mod 4, each back within 3 tokens), layer 1 scans all 16 (2t and 2t+1 mod 16, each
    back after 8 tokens)."""
    trace = []
    for t in range(tokens):
        trace.append(ReplayStep(t == 0, 1, 0, [(t % 4, "high"), ((t + 1) % 4, "high")]))
        trace.append(ReplayStep(False, 0, 1, [((2 * t) % 16, "high"), ((2 * t + 1) % 16, "high")]))
    return trace


def test_the_slots_go_to_the_layer_that_reuses():
    # 6 slots over 64 tokens. The best partition is layer 0's working set (4 slots, loaded once)
    # and layer 1's top-2 (2 slots, a scan never hits): MIN's 4 + 128 loads. lru keeps the 6 most
    # recent, which a token's 2 scanned experts push layer 0's next one out of: one layer-0 load
    # per token (65). A static even split (fate, 3 slots each) thrashes layer 0 the same way.
    # decay, the calibrated lossless default on both trained models, finds MIN's partition: its
    # one extra load is token 3's. At token 2 layer 0's expert 0 and layer 1's expert 1 tie (used
    # once, at token 0), and layer 0's expert 0 goes: its layer, just run, is a whole token away.
    trace = reuse_and_scan(64)
    setup = CacheSetup(high_slots=6, low_slots=0, n_layers=2, low_cost=0.5, layers=(0, 1), n_expert=16,
                       n_expert_used=2, fate_shallow=0)
    assert min_loads(trace, 6).loads_per_layer == {0: 4, 1: 128}
    assert replay(trace, setup, "decay").loads_per_layer == {0: 5, 1: 128}
    assert replay(trace, setup, "lru").loads_per_layer == {0: 65, 1: 128}
    assert replay(trace, setup, "fate").loads_per_layer == {0: 65, 1: 128}
    report = against_min(trace, setup)
    assert report["min"]["loads_per_layer"] == {"0": 4, "1": 128}
    assert report["policies"]["decay"] == {"loads": 133, "x_min": 133 / 132, "loads_per_layer": {"0": 5, "1": 128}}


def test_decay_counts_how_far_each_layer_is():
    # Four layers of one expert each, every one used every token, and 3 slots: a scan. lru evicts
    # the least recent, the next layer's expert, and loads every request. MIN evicts the expert
    # used again last, the one of the layer just run: past its first 3 loads, one every 3
    # requests. decay weighs how soon each is expected back: its decayed frequency, and its
    # layer's distance (a whole token weighed as 16 tokens of absence). Once the frequencies tie
    # but for the token of the last use, the distance decides and decay evicts as MIN does. Its
    # one load more is at token 1, layer 2: layer 3's expert, used once, looks rarer (about 25
    # tokens away, plus 4 for one layer of four) than layer 1's, used twice (12, plus 12 for three
    # layers), so layer 3's goes and is loaded again right after.
    tokens = 30
    trace = [ReplayStep(t == 0, 1 if layer == 0 else 0, layer, [(0, "high")]) for t in range(tokens) for layer in range(4)]
    setup = CacheSetup(high_slots=3, low_slots=0, n_layers=4, low_cost=0.5, layers=(0, 1, 2, 3), n_expert=1,
                       n_expert_used=1)
    assert replay(trace, setup, "lru").loads_high == 4 * tokens
    assert min_loads(trace, 3).loads == 3 + (4 * tokens - 3) // 3 == 42
    assert replay(trace, setup, "decay").loads_high == 43


def test_bypass_keeps_the_cache_for_an_expert_used_sooner():
    # 1 slot; A B A. MIN must cache B, evicting A, and loads A again: 3. Bypassing B (never used
    # again, A's next use is sooner) keeps A: 2
    A, B = 0, 1
    trace = steps(*[(0, [e]) for e in (A, B, A)])
    assert min_loads(trace, slots=1).loads == 3
    assert bypass_loads(trace, slots=1) == 2


@pytest.mark.parametrize("seed", range(5))
def test_bypass_never_loads_more_than_min(seed):
    rng = random.Random(seed)
    trace = steps(*[(t % 3, rng.sample(range(8), 2)) for t in range(300)])
    for slots in (2, 5, 9):
        assert bypass_loads(trace, slots) <= min_loads(trace, slots).loads
