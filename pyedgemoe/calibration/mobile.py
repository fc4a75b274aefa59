"""MoBiLE's gamma for a model (`pyedgemoe calibrate --system mobile`): the paper's 0.7 let the
little pass keep 1 token in 7 on the demo model and none on others, so the threshold is chosen
from what the model does instead.

On the calibration tokens, in decode mode (one token per llama_decode, as generation runs), the
little pass (each token through its top-k/2 experts) gives each position its top probability p
and its top-1 token; the big pass (the whole top-k) its own top-1. A token whose p is below gamma
is redone big, so with gamma its top-1 differs from the big pass's only where p >= gamma and the
two passes disagree. gamma is the smallest threshold (the fewest tokens redone) that keeps the
top-1 of at least min_agreement of the tokens and the decode-mode perplexity (each token scored by
the pass that gives it) within loss_budget of the big pass's, as EdgeMoE's map is bounded: an
agreement bound alone cost the demo +1.8 % perplexity on held-out text.
"""
from __future__ import annotations

import math
import os

import numpy as np

from pyedgemoe.calibration.edgemoe import DEFAULT_LOSS_BUDGET, DEFAULT_MIN_AGREEMENT, check_bounds
from pyedgemoe.decoder import top_probability
from pyedgemoe.engine import Engine
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.perplexity import decode_mode_logits, next_token_nll

# the little pass alone: no little token's top probability is below it, so none is redone
LITTLE_ONLY = 1e-30
PROFILE_TOKENS = 1024  # calibration tokens the two passes are measured on (a token: 0.1 % of agreement)


def choose_gamma(confidence: np.ndarray, agrees: np.ndarray, min_agreement: float = DEFAULT_MIN_AGREEMENT,
                 nll: tuple[np.ndarray, np.ndarray] | None = None, loss_budget: float = DEFAULT_LOSS_BUDGET) -> dict:
    """The smallest gamma whose tokens kept little (confidence >= gamma) disagree with the whole
    model on at most 1 - min_agreement of all tokens and, given nll (each token's negative
    log-likelihood of the next under the little and the big pass; NaN where there is no next),
    keep the perplexity within loss_budget of the big pass's: {"gamma", "agreement",
    "fallback_rate"}. Tokens are kept little most confident first, until the first that breaks a
    bound. A gamma above every confidence (1.0: every token redone big) when even the most
    confident does."""
    check_bounds(loss_budget, min_agreement)
    confidence, agrees = np.asarray(confidence, dtype=np.float64), np.asarray(agrees, dtype=bool)
    n = len(confidence)
    if n == 0:
        raise InvalidOptionError("MoBiLE's gamma needs at least one token")
    allowed = (1 - min_agreement) * n + 1e-9  # disagreements the bound allows
    if nll is not None:
        little, big = (np.asarray(a, dtype=np.float64) for a in nll)
        scored = ~np.isnan(big)
        allowed_nll = float(big[scored].mean()) + math.log1p(loss_budget)  # log of the perplexity bound
    best = {"gamma": 1.0, "agreement": 1.0, "fallback_rate": 1.0}
    for gamma in np.unique(confidence)[::-1]:  # most confident first: the tokens kept little grow
        kept = confidence >= gamma
        disagreements = int((kept & ~agrees).sum())
        if disagreements > allowed:
            break
        if nll is not None and float(np.where(kept, little, big)[scored].mean()) > allowed_nll:
            break
        best = {"gamma": float(gamma), "agreement": 1 - disagreements / n, "fallback_rate": float(1 - kept.mean())}
    return best


def calibrate_gamma(model_path: str | os.PathLike, tokens: list[int], budget, *,
                    min_agreement: float = DEFAULT_MIN_AGREEMENT, loss_budget: float = DEFAULT_LOSS_BUDGET,
                    n_ctx: int = 256, **engine_options) -> dict:
    """gamma for the model from tokens (choose_gamma of the little and big passes' decode-mode
    logits, at most PROFILE_TOKENS of them, in sequences of n_ctx) as the sidecar's "big_little",
    with what it measured."""
    tokens = tokens[:PROFILE_TOKENS]
    n_ctx = max(min(n_ctx, len(tokens)), 16)
    options = dict(engine_options, low_precision=False, skip=False, prefetch="none", n_ctx=n_ctx, n_logits=n_ctx,
                   expert_cache=budget)
    with Engine(model_path, **options, big_little=LITTLE_ONLY) as eng:
        little = decode_mode_logits(eng, tokens, n_ctx)
    with Engine(model_path, **options) as eng:
        big = decode_mode_logits(eng, tokens, n_ctx)
    confidence = np.array([top_probability(row) for row in little])
    agrees = little.argmax(axis=-1) == big.argmax(axis=-1)
    nll = next_token_nll(little, tokens, n_ctx), next_token_nll(big, tokens, n_ctx)
    return {**choose_gamma(confidence, agrees, min_agreement, nll, loss_budget), "min_agreement": min_agreement,
            "loss_budget": loss_budget, "little_agreement": float(agrees.mean()), "n_tokens": len(tokens)}
