"""The layer planner (native/src/layer-planner.h) is a pure function of a layer's routing: each
selection's demand by HOBBIT's score rule, and the distinct experts the layer needs, each with the
highest demand of its tokens, in order of first use. No model is loaded here."""
from __future__ import annotations

import numpy as np
import pytest

from pyedgemoe import _native

HIGH, LOW, SKIP = 2, 1, 0


def test_scores_are_the_normalized_weight_ranked_above():
    w = np.array([[0.1, 0.6, 0.3], [2.0, 2.0, 4.0]], dtype=np.float32)
    scores = _native.selection_scores(w)
    # row 0: ranks 1 (0.6), 2 (0.3), 0 (0.1): s = 0, 0.6, 0.9; row 1: ranks 2, then 0 before 1 (tie)
    assert scores[0] == pytest.approx([0.9, 0.0, 0.6])
    assert scores[1] == pytest.approx([0.5, 0.75, 0.0])


def test_each_selection_gets_the_demand_of_the_score_rule():
    ids = np.array([[3, 1, 2, 0]], dtype=np.int32)
    w = np.array([[0.5, 0.3, 0.15, 0.05]], dtype=np.float32)  # s = 0, 0.5, 0.8, 0.95
    demands, wanted = _native.plan_layer(ids, w, n_expert=4, t1=0.6, t2=0.9)
    assert demands.tolist() == [[HIGH, HIGH, LOW, SKIP]]
    assert wanted == [(3, "high"), (1, "high"), (2, "low"), (0, "skip")]


def test_an_expert_two_tokens_share_is_planned_once_at_the_higher_demand():
    ids = np.array([[0, 1], [2, 0], [1, 3]], dtype=np.int32)
    w = np.array([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3]], dtype=np.float32)  # s of the 2nd: 0.9, 0.8, 0.7
    demands, wanted = _native.plan_layer(ids, w, n_expert=4, t1=0.75, t2=0.85)
    assert demands.tolist() == [[HIGH, SKIP], [HIGH, LOW], [HIGH, HIGH]]
    # expert 1: SKIP for token 0, HIGH for token 2 -> HIGH; expert 0: HIGH then LOW -> HIGH
    assert wanted == [(0, "high"), (1, "high"), (2, "high"), (3, "high")]


def test_without_low_precision_and_skip_every_selection_is_high():
    ids = np.array([[0, 1, 2]], dtype=np.int32)
    w = np.array([[0.4, 0.35, 0.25]], dtype=np.float32)
    demands, wanted = _native.plan_layer(ids, w, n_expert=3, t1=0.0, t2=0.0, use_low=False, use_skip=False)
    assert demands.tolist() == [[HIGH, HIGH, HIGH]]
    assert wanted == [(0, "high"), (1, "high"), (2, "high")]


def test_an_expert_id_out_of_range_is_an_error():
    ids = np.array([[0, 7]], dtype=np.int32)
    w = np.array([[0.5, 0.5]], dtype=np.float32)
    with pytest.raises(ValueError, match="expert 7 out of 4"):
        _native.plan_layer(ids, w, n_expert=4)


def test_the_options_defaults_come_from_one_native_schema():
    from pyedgemoe.expert_options import OPTION_NAMES, default

    defaults = _native.ExpertOptions()
    assert OPTION_NAMES[:3] == ("io", "io_threads", "fill_cache")
    assert (default("io"), default("io_threads"), default("prefetch"), default("t1")) == ("direct", 4, "none", 0.6)
    assert defaults.t1 == 0.6 and defaults.t2 == 0.9
