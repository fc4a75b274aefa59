"""EdgeMoE's offline step (EdgeMoE sec. 3.2) on a model with HIGH and LOW expert copies: the static
precision map that `static_precision` (and `--system edgemoe`) load.

1. Importance: for each expert, the perplexity of the calibration tokens (decode mode: one token
   per llama_decode, as generation routes) with that expert alone LOW and every other expert HIGH,
   minus the all-HIGH perplexity.
2. The K least important experts go LOW (bitwidths.py): K the largest whose perplexity stays within
   loss_budget of all HIGH, or, with a size_budget, the smallest that brings the experts to that
   share of their all-HIGH bytes.

The Engine runs with an expert cache the size of the HIGH experts, so that each map's experts are
read in the precision it gives them (a new map empties the cache).
"""
from __future__ import annotations

import math
import os

import numpy as np

from pyedgemoe.calibration.bitwidths import (choose_low_count, importance_order, low_count_for_size,
                                             low_map)
from pyedgemoe.engine import Engine
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.model_info import read_model_info
from pyedgemoe.perplexity import token_nll

DEFAULT_LOSS_BUDGET = 0.01  # +1 % perplexity over HIGH only
PROFILE_TOKENS = 128        # calibration tokens each map is measured on


def _decode_mode_ppl(engine: Engine, tokens: list[int], low: dict[int, list[int]]) -> float:
    engine.set_precision_map(low)
    logits = engine.logits(tokens, one_token_per_step=True)
    return math.exp(float(token_nll(logits[:-1], np.asarray(tokens[1:])).mean()))


def precision_map(model_path: str | os.PathLike, tokens: list[int], *, loss_budget: float = DEFAULT_LOSS_BUDGET,
                  size_budget: float | None = None, **engine_options) -> dict:
    """The static precision map for the model from tokens (at most PROFILE_TOKENS are used), as the
    sidecar's "precision_map": {"low": {layer: [experts]}, the budget, the perplexities measured and
    each expert's importance}. InvalidOptionError without LOW copies (the Engine's) or with fewer
    than 2 tokens."""
    info = read_model_info(model_path)
    tokens = tokens[:PROFILE_TOKENS]
    if len(tokens) < 2:
        raise InvalidOptionError("EdgeMoE's precision map needs at least 2 tokens of text")
    options = dict(engine_options, low_precision=True, skip=False, prefetch="none", static_precision=False,
                   big_little=0.0)
    with Engine(model_path, n_ctx=max(len(tokens), 16), n_logits=len(tokens), expert_cache="100%", **options) as eng:
        layers = sorted(info.expert_bytes_per_layer)
        experts = [(layer, e) for layer in layers for e in range(info.n_experts)]
        baseline = _decode_mode_ppl(eng, tokens, {})
        deltas = {(layer, e): _decode_mode_ppl(eng, tokens, {layer: [e]}) - baseline for layer, e in experts}
        order = importance_order(deltas)

        def evaluate(k: int) -> float:
            return _decode_mode_ppl(eng, tokens, low_map(order, k))

        if size_budget is None:
            k, evaluations = choose_low_count(len(order), evaluate, baseline, loss_budget)
        else:
            k = low_count_for_size(len(order), info.high_expert_bytes, info.low_expert_bytes, size_budget)
            evaluations = {k: evaluate(k)} if k else {}
    chosen = low_map(order, k)
    return {
        "low": {str(layer): es for layer, es in chosen.items()},
        "n_low": k,
        "n_experts": len(order),
        "loss_budget": None if size_budget is not None else loss_budget,
        "size_budget": size_budget,
        "baseline_ppl": baseline,
        "ppl": evaluations.get(k, baseline),
        "evaluations": {str(n): p for n, p in sorted(evaluations.items())},
        "importance": [[layer, e, deltas[layer, e]] for layer, e in order],
        "n_tokens": len(tokens),
    }
