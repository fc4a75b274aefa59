"""Thresholds T1/T2 from a routing trace (HOBBIT sec. 3.2): each selection's score s_i (HOBBIT
eq. 2), T1/T2 at the quantiles of the scores that give a target split of the selections into
HIGH / LOW / SKIP, and the split the runtime's rule then achieves.

The default split for top-k (default_split) keeps HOBBIT's treatment of the non-top-1 selections:
at top-2 its 67/30/3 (Mixtral's) means that the second selection is HIGH 34%, LOW 60% and SKIP 6%
of the time, and so is every non-top-1 selection at any k (top-8: 42% / 52.5% / 5.25% of all
selections). Keeping 67% HIGH of all selections instead would make 62% of the non-top-1 selections
of a top-8 model HIGH, far more conservative than HOBBIT at top-2. The achieved split is counted
with the runtime's own rule (_native.choose_precisions): ties between scores make it differ a
little from the target.
"""
from __future__ import annotations

import numpy as np

from pyedgemoe import _native
from pyedgemoe.errors import InvalidOptionError

TOP2_SPLIT = (0.67, 0.30, 0.03)  # HOBBIT sec. 3.2: Mixtral-8x7B with T1 = 0.6, T2 = 0.9
# A selection's demand as a number, ordered like the runtime's expert_precision (precision_demands)
DEMAND_CODE = {"skip": 0, "low": 1, "high": 2}


def parse_split(value) -> tuple[float, float, float]:
    """"0.67,0.30,0.03" or three numbers: the shares of selections HIGH, LOW, SKIP (sum 1)."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    try:
        split = tuple(float(p) for p in parts)
    except (TypeError, ValueError):
        raise InvalidOptionError(f"the target split must be three numbers high,low,skip, got {value!r}") from None
    if len(split) != 3 or any(not 0 <= s <= 1 for s in split) or abs(sum(split) - 1) > 1e-6:
        raise InvalidOptionError(f"the target split must be three shares high,low,skip in [0, 1] that sum "
                                 f"to 1, got {value!r}")
    return split


def default_split(k: int) -> tuple[float, float, float]:
    """The default target split for top-k routing: the top-1 (1/k of the selections) HIGH, and
    every other selection split like the second one of HOBBIT's top-2 split (module doc)."""
    if k < 2:
        return (1.0, 0.0, 0.0)
    high, low, skip = TOP2_SPLIT
    second = (2 * high - 1, 2 * low, 2 * skip)  # at top-2 half the selections are top-1: (0.34, 0.60, 0.06)
    rest = 1 - 1 / k
    return (1 / k + rest * second[0], rest * second[1], rest * second[2])


def selection_scores(weights: np.ndarray) -> np.ndarray:
    """float64 [n, k]: each selection's score s_i (HOBBIT eq. 2) in the order of `weights`, as the
    runtime computes it (native/src/precision-policy.cpp): ranked by weight (ties: earlier position
    first), s = the sum of the normalized weights ranked above; the top-1 scores 0."""
    return _native.selection_scores(np.ascontiguousarray(weights, dtype=np.float32))


def choose_thresholds(weights: np.ndarray, split=None) -> tuple[float, float]:
    """T1, T2 that split the selections of `weights` [n, k] into the target shares (high, low, skip;
    None: default_split(k)).

    Of n*k selections, the n top-1 ones are always HIGH. Of the other N = n*(k-1), the
    m_high = round(high * n*k) - n with the smallest scores are HIGH too: T1 is the m_high-th smallest
    score (0 when m_high <= 0, i.e. high <= 1/k); the m_skip = round(skip * n*k) with the largest
    scores are skipped: T2 is the (m_skip+1)-th largest (1 when m_skip = 0: nothing is skipped).
    The rule is s <= T1 HIGH, T1 < s <= T2 LOW, s > T2 SKIP; equal scores at a boundary all fall on
    the same side, so count the achieved split with split_of(precision_demands(...)).
    """
    w = np.asarray(weights, dtype=np.float32)
    if w.ndim != 2 or w.shape[0] == 0:
        raise InvalidOptionError("choosing thresholds needs at least one token's routing weights")
    n, k = w.shape
    high, _low, skip = default_split(k) if split is None else parse_split(split)
    scores = selection_scores(w)
    order = np.argsort(-w, axis=1, kind="stable")
    others = np.sort(np.take_along_axis(scores, order[:, 1:], axis=1).ravel())  # N non-top-1 scores
    n_others = len(others)
    m_high = min(max(int(round(high * n * k)) - n, 0), n_others)
    m_skip = min(max(int(round(skip * n * k)), 0), n_others - m_high)
    t1 = float(others[m_high - 1]) if m_high > 0 else 0.0
    if m_skip == 0:
        t2 = 1.0
    else:
        t2 = float(others[n_others - m_skip - 1]) if n_others - m_skip - 1 >= 0 else 0.0
    return t1, max(t1, t2)


def precision_demands(weights: np.ndarray, t1: float, t2: float, use_low: bool = True,
                      use_skip: bool = True) -> np.ndarray:
    """int8 [n, k]: each selection's demand by the runtime's rule: 2 HIGH, 1 LOW, 0 SKIP (DEMAND_CODE)."""
    return _native.precision_demands(np.ascontiguousarray(weights, dtype=np.float32), t1, t2, use_low, use_skip)


def split_of(demands: np.ndarray) -> dict:
    """Shares of selections per demand: {"high", "low", "skip"}."""
    total = demands.size
    return {name: float(np.count_nonzero(demands == DEMAND_CODE[name])) / total if total else 0.0
            for name in ("high", "low", "skip")}
