"""EdgeMoE's expert predictor from activation paths (EdgeMoE sec. 3.3.2), learned from a routing trace.

The paper observes that a token's path (the experts it activates at each MoE layer in turn) is
skewed, and estimates P(expert e at layer L_j | the experts activated at L_{j-2} and L_{j-1}) by
counting paths offline; online it looks up the activations of the two previous layers and preloads
the most probable experts. We count the same thing per token of a trace, keyed by the activated
experts as sets (sorted tuples), at three levels of context so that a pair never seen in the trace
still gets a prediction: (set at L_{j-2}, set at L_{j-1}) (the first set empty for j = 1), ((),
set at L_{j-1}) and ((), ()) (the layer's marginal). A lookup uses the most specific key seen.

The statistics, as JSON (path_statistics):

    {"version": 1, "n_expert": E, "layers": [the trace's MoE layer ids, ascending],
     "tables": {"<layer>": [[prev2, prev1, n, [[expert, count], ...]], ...]}}

with a table for every MoE layer but the first; prev2 and prev1 are sorted expert lists ([] for
the empty set), n the tokens seen with that key, and [expert, count] the activations among them of
the experts that occurred, by expert id. Rows are sorted by (prev2, prev1), so the marginal
([], [], ...) comes first.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

PATHS_VERSION = 1
Key = tuple[tuple[int, ...], tuple[int, ...]]  # (set at L_{j-2}, set at L_{j-1}) as sorted tuples


def token_paths(trace: dict) -> tuple[list[int], list[list[tuple[int, ...]]]]:
    """The trace's MoE layers (ascending) and every token's path: per layer, its sorted experts.

    A token is a row of a (sequence, ubatch): the records of one (sequence, ubatch, layer) are
    consecutive, one row per token in the same order at every layer (Engine.take_routing_trace)."""
    layer = np.asarray(trace["layer"])
    ubatch = np.asarray(trace["ubatch"])
    sequence = np.asarray(trace.get("sequence", np.zeros(len(layer), dtype=np.int64)))
    ids = np.asarray(trace["ids"])
    if len(layer) == 0:
        return [], []
    layers = sorted(int(l) for l in np.unique(layer))
    key = np.stack([sequence, ubatch, layer], axis=1)
    starts = np.flatnonzero(np.r_[True, np.any(key[1:] != key[:-1], axis=1)])
    ends = np.r_[starts[1:], len(layer)]
    rows: dict[tuple[int, int], dict[int, list[tuple[int, ...]]]] = {}
    for s, e in zip(starts, ends):
        sets = [tuple(sorted(int(i) for i in row)) for row in ids[s:e]]
        rows.setdefault((int(sequence[s]), int(ubatch[s])), {})[int(layer[s])] = sets
    paths = []
    for (seq, ub), by_layer in rows.items():
        counts = {len(by_layer.get(l, ())) for l in layers}
        if len(counts) != 1:
            # e.g. a prefill that computes the last layer only for tokens with logits
            raise ValueError(f"sequence {seq} ubatch {ub} does not have the same tokens at every MoE layer: "
                             f"path statistics need each token's whole path (record one token per ubatch)")
        paths.extend(list(p) for p in zip(*(by_layer[l] for l in layers)))
    return layers, paths


def previous_sets(path: list[tuple[int, ...]], j: int) -> Key:
    """The sets at the two MoE layers before layer index j >= 1 of a path (the first empty for j = 1)."""
    return (path[j - 2] if j >= 2 else ()), path[j - 1]


def path_statistics(trace: dict, n_expert: int) -> dict:
    """Counts of the trace's paths at three levels of context per MoE layer (format: module doc)."""
    layers, paths = token_paths(trace)
    tables = {}
    for j in range(1, len(layers)):
        seen: Counter = Counter()
        activated: dict[Key, Counter] = {}
        for path in paths:
            prev2, prev1 = previous_sets(path, j)
            for key in {(prev2, prev1), ((), prev1), ((), ())}:  # at j = 1 the first two coincide
                seen[key] += 1
                activated.setdefault(key, Counter()).update(path[j])
        tables[str(layers[j])] = [[list(prev2), list(prev1), seen[prev2, prev1],
                                   [[e, c] for e, c in sorted(activated[prev2, prev1].items())]]
                                  for prev2, prev1 in sorted(seen)]
    return {"version": PATHS_VERSION, "n_expert": n_expert, "layers": layers, "tables": tables}


def probability_index(stats: dict) -> dict[int, dict[Key, list[float]]]:
    """Per MoE layer with a table, each stored key's dense probabilities count / n."""
    index = {}
    for layer, rows in stats["tables"].items():
        index[int(layer)] = {}
        for prev2, prev1, n, counts in rows:
            probs = [0.0] * stats["n_expert"]
            for expert, count in counts:
                probs[expert] = count / n
            index[int(layer)][tuple(prev2), tuple(prev1)] = probs
    return index


def lookup(index: dict, n_expert: int, layer: int, prev2, prev1) -> list[float]:
    """The probabilities of the most specific key seen: (prev2, prev1), ((), prev1), ((), ())."""
    table = index.get(layer)
    if table is None:
        return [0.0] * n_expert
    prev2, prev1 = tuple(sorted(prev2)), tuple(sorted(prev1))
    for key in ((prev2, prev1), ((), prev1)):
        if key in table:
            return table[key]
    return table[(), ()]  # every token that reached the layer counts here


def predict(stats: dict, layer: int, prev2: list[int], prev1: list[int]) -> list[float]:
    """P(each expert activated at `layer` | the experts activated at the two MoE layers before it);
    all zeros for a layer without a table (the first MoE layer). The ids' order does not matter."""
    return lookup(probability_index(stats), stats["n_expert"], layer, prev2, prev1)


def native_entries(stats: dict) -> list[tuple[int, list[int], list[int], list[float]]]:
    """Every stored key as (layer, prev2, prev1, dense probabilities), for the runtime's table (which
    falls back as predict does)."""
    index = probability_index(stats)
    return [(layer, list(prev2), list(prev1), probs)
            for layer, table in index.items() for (prev2, prev1), probs in table.items()]


def path_accuracy(stats: dict, trace: dict, k: int | None = None) -> float:
    """Over every token and MoE layer but the first of `trace`: the share of the activated experts
    that are among predict()'s top-k (k: the trace's top-k; ties: lower expert id). 0.0 when the
    trace has no such record."""
    k = np.asarray(trace["ids"]).shape[1] if k is None else k
    index, n_expert = probability_index(stats), stats["n_expert"]
    layers, paths = token_paths(trace)
    hits = total = 0
    for path in paths:
        for j in range(1, len(layers)):
            probs = lookup(index, n_expert, layers[j], *previous_sets(path, j))
            top = sorted(range(n_expert), key=lambda e: (-probs[e], e))[:k]
            hits += len(set(top) & set(path[j]))
            total += len(path[j])
    return hits / total if total else 0.0
