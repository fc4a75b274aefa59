"""EdgeMoE's offline step (EdgeMoE sec. 3.2) on a model with HIGH and LOW expert copies: the static
precision map that `static_precision` (and `--system edgemoe`) load.

1. Importance: for each expert, the perplexity of the calibration tokens (decode mode: one token
   per llama_decode, as generation routes) with that expert alone LOW and every other expert HIGH,
   minus the all-HIGH perplexity.
2. The K least important experts go LOW (bitwidths.py): K the largest whose perplexity stays within
   loss_budget of all HIGH and whose top-1 token agrees with all HIGH's on at least min_agreement
   of the calibration tokens (a perplexity budget alone let 6 % of the tokens change), or, with a
   size_budget, the smallest that brings the experts to that share of their all-HIGH bytes. The
   maps are measured on more tokens than the importances: on 128 a token is 0.8 % of agreement,
   and the demo's first 128 made one expert LOW cost 3.9 % where 1024 say 0.8 %.

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
from pyedgemoe.perplexity import decode_mode_logits, next_token_nll

DEFAULT_LOSS_BUDGET = 0.01    # +1 % perplexity over HIGH only
DEFAULT_MIN_AGREEMENT = 0.97  # of the tokens whose top-1 is all HIGH's
PROFILE_TOKENS = 128          # calibration tokens each expert's importance is measured on
MAP_TOKENS = 1024             # calibration tokens each candidate map is measured on


def check_bounds(loss_budget, min_agreement, size_budget=None) -> None:
    """The bounds a map or gamma is chosen for are numbers, the agreement a share of the tokens (their
    other ranges are checked where they are used); else InvalidOptionError."""
    for name, value in (("loss_budget", loss_budget), ("min_agreement", min_agreement), ("size_budget", size_budget)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise InvalidOptionError(f"{name} must be a number, got {value!r}")
    if not 0 <= min_agreement <= 1:
        raise InvalidOptionError(f"the agreement bound must be in [0, 1], got {min_agreement!r}")


def _decode_mode(engine: Engine, tokens: list[int], low: dict[int, list[int]], n_ctx: int) -> tuple[float, np.ndarray]:
    """The map's decode-mode perplexity of tokens (in sequences of n_ctx), and its top-1 token at
    each position."""
    engine.set_precision_map(low)
    logits = decode_mode_logits(engine, tokens, n_ctx)
    return math.exp(float(np.nanmean(next_token_nll(logits, tokens, n_ctx)))), logits.argmax(axis=-1)


def precision_map(model_path: str | os.PathLike, tokens: list[int], *, loss_budget: float = DEFAULT_LOSS_BUDGET,
                  min_agreement: float = DEFAULT_MIN_AGREEMENT, size_budget: float | None = None,
                  n_ctx: int = 256, **engine_options) -> dict:
    """The static precision map for the model from tokens (importances on the first PROFILE_TOKENS,
    maps on the first MAP_TOKENS, in sequences of n_ctx), as the sidecar's "precision_map": {"low":
    {layer: [experts]}, the budget, the perplexities and agreements measured and each expert's
    importance}. InvalidOptionError without LOW copies (the Engine's), with fewer than 2 tokens, or
    for a bound out of range."""
    info = read_model_info(model_path)
    tokens = tokens[:MAP_TOKENS]
    if len(tokens) < 2:
        raise InvalidOptionError("EdgeMoE's precision map needs at least 2 tokens of text")
    if loss_budget < 0:
        raise InvalidOptionError(f"the loss budget must be >= 0, got {loss_budget!r}")
    check_bounds(loss_budget, min_agreement, size_budget)
    n_ctx = max(min(n_ctx, len(tokens)), 16)
    profiled = tokens[:min(PROFILE_TOKENS, n_ctx)]
    options = dict(engine_options, low_precision=True, skip=False, prefetch="none", static_precision=False,
                   big_little=0.0)
    with Engine(model_path, n_ctx=n_ctx, n_logits=n_ctx, expert_cache="100%", **options) as eng:
        layers = sorted(info.expert_bytes_per_layer)
        experts = [(layer, e) for layer in layers for e in range(info.n_experts)]
        profile_baseline = _decode_mode(eng, profiled, {}, n_ctx)[0]
        deltas = {(layer, e): _decode_mode(eng, profiled, {layer: [e]}, n_ctx)[0] - profile_baseline
                  for layer, e in experts}
        order = importance_order(deltas)
        baseline, top1 = _decode_mode(eng, tokens, {}, n_ctx)
        evaluations: dict[int, tuple[float, float]] = {}  # K: (perplexity, agreement)

        def evaluate(k: int) -> tuple[float, float]:
            ppl, top1_k = _decode_mode(eng, tokens, low_map(order, k), n_ctx)
            evaluations[k] = ppl, float((top1_k == top1).mean())
            return evaluations[k]

        def fits(k: int) -> bool:
            ppl, agreement = evaluate(k)
            return ppl <= baseline * (1 + loss_budget) and agreement >= min_agreement

        if size_budget is None:
            k = choose_low_count(len(order), fits)
        else:
            k = low_count_for_size(len(order), info.high_expert_bytes, info.low_expert_bytes, size_budget)
            if k:
                evaluate(k)
    chosen = low_map(order, k)
    return {
        "low": {str(layer): es for layer, es in chosen.items()},
        "n_low": k,
        "n_experts": len(order),
        "loss_budget": None if size_budget is not None else loss_budget,
        "min_agreement": None if size_budget is not None else min_agreement,
        "size_budget": size_budget,
        "baseline_ppl": baseline,
        "ppl": evaluations.get(k, (baseline, 1.0))[0],
        "agreement": evaluations.get(k, (baseline, 1.0))[1],
        "evaluations": {str(n): p for n, (p, _) in sorted(evaluations.items())},
        "agreements": {str(n): a for n, (_, a) in sorted(evaluations.items())},
        "importance": [[layer, e, deltas[layer, e]] for layer, e in order],
        "n_tokens": len(tokens),
    }
