"""EdgeMoE's expert-wise bitwidth adaptation (EdgeMoE sec. 3.2) over two precisions of a
multi-precision file, HIGH and LOW.

The paper profiles each expert's importance as the accuracy lost when that expert alone is
quantized to the low bitwidth, sorts the experts by it, and puts the K least important in the low
bitwidth, raising K while the accuracy loss stays under the user's tolerance and lowering it once
it is over. We do the same with perplexity as the accuracy, and the top-1 agreement with HIGH only
as a bound users see: importance_order sorts the measured losses, choose_low_count tunes K against
the tolerance, and low_count_for_size gives the K that a size budget needs instead. Where the paper searches for the bitwidth bounds first, the two
precisions here are those the file holds.
"""
from __future__ import annotations

from collections.abc import Callable

from pyedgemoe.errors import InvalidOptionError

Expert = tuple[int, int]  # (layer, expert)


def importance_order(deltas: dict[Expert, float]) -> list[Expert]:
    """The experts least important first: by the loss increase when that expert alone is LOW (the
    paper's Fig. 7a), ties by (layer, expert)."""
    return sorted(deltas, key=lambda expert: (deltas[expert], expert))


def choose_low_count(n: int, fits: Callable[[int], bool]) -> int:
    """The largest K in [0, n] for which fits(K): whether the K least important experts LOW stay
    within the user's tolerance (the perplexity budget and the top-1 agreement bound: edgemoe.py).

    The paper moves K up while the loss is under the goal and down once it is over; assuming, as it
    does, that the loss grows with K, a binary search finds the same K in about log2(n) calls.
    K = 0 is never asked (it is the baseline) and no K twice."""
    fitting, failing = 0, n + 1  # the largest K known to fit, the smallest known not to
    while failing - fitting > 1:
        k = (fitting + failing) // 2
        if fits(k):
            fitting = k
        else:
            failing = k
    return fitting


def low_count_for_size(n: int, high_bytes: int, low_bytes: int, size_budget: float) -> int:
    """The smallest K with (n - K) * high_bytes + K * low_bytes <= size_budget * n * high_bytes:
    how many of the n experts must be LOW for the experts to take size_budget of their all-HIGH size."""
    smallest = low_bytes / high_bytes
    if not smallest <= size_budget <= 1:
        raise InvalidOptionError(f"the size budget must be in [{smallest:g}, 1] (LOW bytes / HIGH bytes to all "
                                 f"HIGH), got {size_budget!r}")
    budget_bytes = size_budget * n * high_bytes
    # n: a budget of exactly low/high may round a little below n * low_bytes
    return next((k for k in range(n + 1) if (n - k) * high_bytes + k * low_bytes <= budget_bytes), n)


def low_map(order: list[Expert], k: int) -> dict[int, list[int]]:
    """The first k experts of the order as {layer: sorted experts}, by layer; layers with none omitted."""
    if not 0 <= k <= len(order):
        raise InvalidOptionError(f"k must be in [0, {len(order)}], got {k!r}")
    low: dict[int, list[int]] = {}
    for layer, expert in sorted(order[:k]):
        low.setdefault(layer, []).append(expert)
    return low
