"""EdgeMoE's offline steps (EdgeMoE sec. 3.2 and 3.3.2) on hand-written traces and numbers: the
path-statistics predictor (three levels of context, fallback, multi-token ubatches, the runtime's
table, accuracy) and the expert-wise bitwidth choice (importance order, the K search, the K for a
size budget, the LOW map). Pure Python: no model, no _native.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from pyedgemoe.calibration.bitwidths import choose_low_count, importance_order, low_count_for_size, low_map
from pyedgemoe.calibration.edgemoe import precision_map
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.calibration.paths import native_entries, path_accuracy, path_statistics, predict
from test_io_faults import DEMO

N_EXPERT = 4
LAYERS = (1, 3, 5)  # MoE layer ids: not 0..2, so the tables must be keyed by the trace's ids
# Four tokens, top-2: the experts each activates at MoE layers 1, 3, 5.
T0 = ({0, 1}, {1, 2}, {0, 3})
T1 = ({0, 1}, {1, 2}, {0, 2})
T2 = ({2, 3}, {1, 2}, {0, 3})
T3 = ({0, 1}, {0, 3}, {1, 3})
TOKENS = [T0, T1, T2, T3]


def trace_of(ubatches):
    """A trace from [(sequence, ubatch, [path per token])] in compute order: per ubatch, per layer,
    one record per token. Ids are written largest first, so the sets must be sorted by the code."""
    records = [(seq, ub, LAYERS[j], sorted(path[j], reverse=True))
               for seq, ub, paths in ubatches for j in range(len(LAYERS)) for path in paths]
    return {"sequence": np.array([r[0] for r in records], dtype=np.int32),
            "ubatch": np.array([r[1] for r in records], dtype=np.int32),
            "layer": np.array([r[2] for r in records], dtype=np.int32),
            "ids": np.array([r[3] for r in records], dtype=np.int32),
            "weights": np.full((len(records), 2), 0.5, dtype=np.float32)}


def one_token_ubatches(tokens):
    return trace_of([(0, i, [t]) for i, t in enumerate(tokens)])


@pytest.fixture
def stats():
    return path_statistics(one_token_ubatches(TOKENS), N_EXPERT)


# ---- path statistics -----------------------------------------------------------------------

def test_layer_tables_count_the_three_levels_sparsely_in_key_order(stats):
    assert stats["version"] == 1 and stats["n_expert"] == 4 and stats["layers"] == [1, 3, 5]
    assert set(stats["tables"]) == {"3", "5"}  # none for the first MoE layer
    # layer 3 (j = 1): prev2 is empty, so the full key is ((), prev1)
    assert stats["tables"]["3"] == [
        [[], [], 4, [[0, 1], [1, 3], [2, 3], [3, 1]]],   # all four: {1,2} x3, {0,3}
        [[], [0, 1], 3, [[0, 1], [1, 2], [2, 2], [3, 1]]],  # T0, T1, T3: {1,2}, {1,2}, {0,3}
        [[], [2, 3], 1, [[1, 1], [2, 1]]],               # T2: {1,2}
    ]
    assert stats["tables"]["5"] == [
        [[], [], 4, [[0, 3], [1, 1], [2, 1], [3, 3]]],   # {0,3}, {0,2}, {0,3}, {1,3}
        [[], [0, 3], 1, [[1, 1], [3, 1]]],               # T3
        [[], [1, 2], 3, [[0, 3], [2, 1], [3, 2]]],       # T0, T1, T2
        [[0, 1], [0, 3], 1, [[1, 1], [3, 1]]],           # T3
        [[0, 1], [1, 2], 2, [[0, 2], [2, 1], [3, 1]]],   # T0, T1: {0,3}, {0,2}
        [[2, 3], [1, 2], 1, [[0, 1], [3, 1]]],           # T2
    ]


def test_statistics_are_json_and_deterministic(stats):
    assert json.loads(json.dumps(stats)) == stats
    assert json.dumps(path_statistics(one_token_ubatches(TOKENS), N_EXPERT)) == json.dumps(stats)


def test_predict_uses_the_two_previous_sets_when_seen(stats):
    # key ({0,1}, {1,2}) at layer 5: T0, T1 -> expert 0: 2/2, 2: 1/2, 3: 1/2; order of ids ignored
    assert predict(stats, 5, [1, 0], [2, 1]) == [1.0, 0.0, 0.5, 0.5]


def test_predict_falls_back_to_the_previous_set(stats):
    # ({2,3}, {0,3}) never seen; ((), {0,3}): T3 -> experts 1 and 3: 1/1
    assert predict(stats, 5, [2, 3], [0, 3]) == [0.0, 1.0, 0.0, 1.0]


def test_predict_falls_back_to_the_marginal(stats):
    # {2,3} never activated at layer 3: layer 5's marginal over 4 tokens, counts 3, 1, 1, 3
    assert predict(stats, 5, [0, 1], [2, 3]) == [0.75, 0.25, 0.25, 0.75]


def test_predict_at_the_second_layer_ignores_prev2(stats):
    # ((), {0,1}) at layer 3: T0, T1, T3 -> counts 1, 2, 2, 1 of 3
    assert predict(stats, 3, [], [0, 1]) == pytest.approx([1 / 3, 2 / 3, 2 / 3, 1 / 3])
    assert predict(stats, 3, [2, 3], [0, 1]) == predict(stats, 3, [], [0, 1])


def test_predict_is_zero_at_the_first_layer(stats):
    assert predict(stats, 1, [], []) == [0.0, 0.0, 0.0, 0.0]


def test_multi_token_ubatches_pair_tokens_by_row(stats):
    # T0 and T2 differ at layer 1, so a mis-paired row would change layer 3's keys
    packed = trace_of([(0, 0, [T0, T2]), (0, 1, [T1, T3])])
    assert path_statistics(packed, N_EXPERT) == stats


def test_sequences_separate_ubatches_with_the_same_number(stats):
    split = trace_of([(0, 0, [T0, T2]), (1, 0, [T1, T3])])
    assert path_statistics(split, N_EXPERT) == stats


def test_a_ubatch_missing_tokens_at_a_layer_is_an_error():
    trace = trace_of([(0, 0, [T0, T1])])
    keep = np.r_[np.ones(4, bool), [True, False]]  # the last layer computed for the first token only
    with pytest.raises(ValueError, match="same tokens at every MoE layer"):
        path_statistics({k: v[keep] for k, v in trace.items()}, N_EXPERT)


def test_native_entries_are_every_key_as_predict_sees_it(stats):
    entries = native_entries(stats)
    assert len(entries) == 3 + 6
    assert [(layer, prev2, prev1) for layer, prev2, prev1, _ in entries if layer == 5] == [
        (5, [], []), (5, [], [0, 3]), (5, [], [1, 2]), (5, [0, 1], [0, 3]), (5, [0, 1], [1, 2]), (5, [2, 3], [1, 2])]
    for layer, prev2, prev1, probs in entries:
        assert probs == predict(stats, layer, prev2, prev1)


def test_path_accuracy_on_the_training_trace(stats):
    # top-2 (ties to the lower id) vs the activated pair:
    # layer 3: T0 {1,2}/{1,2} 2, T1 {1,2}/{1,2} 2, T2 {1,2}/{1,2} 2, T3 {1,2}/{0,3} 0
    # layer 5: T0 [1,0,.5,.5] -> {0,2}/{0,3} 1, T1 {0,2}/{0,2} 2, T2 [.5,0,0,.5] -> {0,3}/{0,3} 2,
    #          T3 [0,.5,0,.5] -> {1,3}/{1,3} 2;  13 of 16
    assert path_accuracy(stats, one_token_ubatches(TOKENS)) == 13 / 16


def test_path_accuracy_with_top1(stats):
    # top-1: layer 3: 1, 1, 1, 1 -> hits 1, 1, 1, 0; layer 5: 0, 0, 0, 1 -> hits 1, 1, 1, 1; 7 of 16
    assert path_accuracy(stats, one_token_ubatches(TOKENS), k=1) == 7 / 16


def test_path_accuracy_on_an_unseen_path_falls_back(stats):
    # layer 3: ((), {2,3}) -> {1,2} vs {0,3}: 0; layer 5: ((), {0,3}) -> {1,3} vs {0,1}: 1; 1 of 4
    unseen = one_token_ubatches([({2, 3}, {0, 3}, {0, 1})])
    assert path_accuracy(stats, unseen) == 1 / 4


# ---- bitwidths -----------------------------------------------------------------------------

def test_importance_order_is_least_important_first_ties_by_layer_and_expert():
    deltas = {(3, 1): 0.2, (1, 2): 0.1, (1, 0): 0.2, (3, 0): 0.05}
    assert importance_order(deltas) == [(3, 0), (1, 2), (1, 0), (3, 1)]


def test_choose_low_count_finds_the_largest_k_within_budget():
    # perplexity 10 + K, limit 10 * 1.35 = 13.5 -> K = 3; bisection over (0, 11): 5, 2, 3, 4
    calls = []
    assert choose_low_count(10, lambda k: calls.append(k) or 10.0 + k <= 13.5) == 3
    assert calls == [5, 2, 3, 4]


def test_choose_low_count_never_asks_zero_nor_twice():
    for n in range(1, 20):
        for threshold in range(n + 1):
            calls = []
            assert choose_low_count(n, lambda k: calls.append(k) or k <= threshold) == threshold
            assert 0 not in calls and len(calls) == len(set(calls))


def test_choose_low_count_all_low_and_none_low():
    assert choose_low_count(10, lambda k: True) == 10
    assert choose_low_count(10, lambda k: False) == 0
    assert choose_low_count(0, lambda k: pytest.fail("asked")) == 0


@pytest.mark.parametrize("bounds, says", [(dict(loss_budget=-0.01), "loss budget"),
                                           (dict(min_agreement=1.5), "agreement bound")])
def test_precision_map_rejects_bounds_out_of_range(bounds, says):
    with pytest.raises(InvalidOptionError, match=says):
        precision_map(DEMO, [1, 2, 3], **bounds)


def test_low_count_for_size():
    # 8 experts, 100 / 50 bytes: (8 - K) * 100 + K * 50 = 800 - 50 K
    assert low_count_for_size(8, 100, 50, 1.0) == 0
    assert low_count_for_size(8, 100, 50, 0.75) == 4  # <= 600: K >= 4
    assert low_count_for_size(8, 100, 50, 0.7) == 5   # <= 560: K >= 4.8
    assert low_count_for_size(8, 100, 50, 0.5) == 8   # <= 400: all LOW
    assert low_count_for_size(10, 4, 1, 0.7) == 4     # 40 - 3 K <= 28: exactly K = 4


def test_low_count_for_size_rejects_a_budget_outside_its_range():
    with pytest.raises(ValueError, match=r"\[0.5, 1\]"):
        low_count_for_size(8, 100, 50, 0.4)
    with pytest.raises(ValueError, match=r"\[0.5, 1\]"):
        low_count_for_size(8, 100, 50, 1.1)


def test_low_map_groups_the_first_k_by_layer():
    order = [(3, 2), (1, 2), (3, 0), (1, 0)]
    assert low_map(order, 3) == {1: [2], 3: [0, 2]}
    assert list(low_map(order, 3)) == [1, 3]
    assert low_map(order, 0) == {}
