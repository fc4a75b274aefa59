"""The model's embeddings of a text: its hidden states after the last layer (llama.cpp's
embeddings, read with the context's embeddings switched on for one llama_decode).

A model whose GGUF names a pooling type (mean, cls, last, ...; embedding models) gives one vector
per text; any other model (a generative one: pooling none) one per token, as llama-cpp-python's
Llama.embed returns them.
"""
from __future__ import annotations

import numpy as np

from pyedgemoe.errors import InvalidOptionError

POOLING_NONE = 0  # llama.cpp's LLAMA_POOLING_TYPE_NONE: a vector per token


def embed(engine, text: str | list[int], normalize: bool = False, truncate: bool = True) -> np.ndarray:
    """float32 embeddings of text (tokenized with BOS) or token ids, on the Engine's one sequence,
    which holds nothing afterwards: [n_tokens, n_embd], or [n_embd] where the model pools. One
    llama_decode: the tokens past n_batch are dropped (truncate, llama-cpp-python's default) or
    refused. normalize: every vector scaled to unit length (L2)."""
    engine._single_sequence("embed")
    ids = engine._prompt_tokens(text)
    if not ids:
        raise InvalidOptionError("embed needs at least one token")
    n_batch = engine.plan.n_batch
    if len(ids) > n_batch:
        if not truncate:
            raise InvalidOptionError(f"{len(ids)} tokens exceed n_batch {n_batch}: embed evaluates one batch "
                                     "(truncate=True drops the rest, or raise n_batch)")
        ids = ids[:n_batch]
    engine._check_fits(len(ids), 0)
    with engine._sequence_turn():
        rows = engine._decoder.embed(ids)
    if normalize:
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        rows = np.divide(rows, norms, out=rows.copy(), where=norms > 0)
    return rows[0] if engine._live().pooling_type != POOLING_NONE else rows
