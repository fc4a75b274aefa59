"""The routing trace of a text: recorded with an Engine, saved as `<model>.routing-trace.npz`, and
what it says on its own (per-layer expert usage, the predictor's accuracy).

record_trace runs the text as decode does, one token per ubatch: a prefill ubatch of hundreds of
tokens touches most experts of every layer, so its evictions barely depend on the policy. Where the
runtime records its predictor's guesses (a "predicted" array in Engine.take_routing_trace), they
are kept in the trace; a runtime without a predictor records none.
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np

from pyedgemoe.output_files import write_whole

TRACE_SUFFIX = ".routing-trace.npz"


def trace_path(model_path: str | os.PathLike) -> str:
    return os.fspath(model_path) + TRACE_SUFFIX


def record_trace(engine, tokens: list[int], n_ctx: int, on_inputs: Callable[[dict], None] | None = None) -> dict:
    """The routing of `tokens` under engine (made with an expert cache and trace_routing=True) as
    decode sees it: consecutive sequences of n_ctx tokens, each on a fresh context, one token per
    llama_decode with its logits (llama.cpp computes the last layer only for tokens whose logits
    are wanted, so a prefill would skip the last MoE layer for all but its last token; none is kept,
    so the engine needs room for one token's). Returns the arrays of Engine.take_routing_trace plus
    "sequence" [n]. on_inputs: called with each sequence's arrays and its records' layer inputs
    ("inputs" [n, n_embd]), which the trace returned leaves out (a text's inputs are n_layers x
    n_embd floats a token)."""
    parts = []
    engine.record_routing(True, inputs=on_inputs is not None)
    try:
        engine.take_routing_trace()  # whatever was recorded before
        for i, start in enumerate(range(0, len(tokens), n_ctx)):
            # a fresh sequence, as a new prompt starts one: the cache's records restart
            engine.reset()
            for token in tokens[start:start + n_ctx]:
                engine.eval([token])  # one llama_decode, its token's logits computed and not kept
            part = engine.take_routing_trace()
            part["sequence"] = np.full(len(part["layer"]), i, dtype=np.int32)
            if on_inputs is not None:
                on_inputs(part)
            parts.append({key: value for key, value in part.items() if key != "inputs"})
    finally:
        engine.record_routing(False)
    keys = parts[0].keys()
    return {key: np.concatenate([p[key] for p in parts]) for key in keys}


def save_trace(trace: dict, path: str | os.PathLike) -> str:
    """Writes the trace's arrays to `path` (npz; exactly that name)."""
    return write_whole(path, lambda f: np.savez_compressed(f, **{k: np.asarray(v) for k, v in trace.items()}))


def load_trace(path: str | os.PathLike) -> dict:
    with np.load(os.fspath(path)) as data:
        return {k: data[k] for k in data.files}


def expert_usage(trace: dict, n_expert: int) -> dict[str, list[int]]:
    """Per MoE layer, how many selections each expert got."""
    layer, ids = np.asarray(trace["layer"]), np.asarray(trace["ids"])
    return {str(int(l)): np.bincount(ids[layer == l].ravel(), minlength=n_expert).tolist()
            for l in np.unique(layer)}


def prediction_accuracy(trace: dict) -> dict | None:
    """Of the predictor's guesses in the trace ("predicted" [n, k]: the experts predicted one MoE
    layer earlier for each record's token and layer, best first; -1 where none was made, as for the
    first MoE layer): how often the predicted top-1 is the router's top-1 (HOBBIT Fig. 7b), and the
    share of the router's selections that were predicted (recall), counted as the runtime's
    prediction statistics count them. None when the trace has no predictions."""
    if "predicted" not in trace:
        return None
    predicted, ids = np.asarray(trace["predicted"]), np.asarray(trace["ids"])
    if predicted.shape != ids.shape:
        return None
    made = predicted[:, 0] >= 0
    n_made = int(made.sum())
    if n_made == 0:
        return {"n_predicted": 0, "top1_accuracy": None, "recall": None}
    guessed, actual = predicted[made], ids[made]
    overlap = sum(int(np.isin(g, a).sum()) for g, a in zip(guessed, actual))
    return {"n_predicted": n_made, "top1_accuracy": float(np.mean(guessed[:, 0] == actual[:, 0])),
            "recall": overlap / actual.size}
