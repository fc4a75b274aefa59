"""The model's embeddings of a text: its hidden states after the last layer (llama.cpp's
embeddings, read with the context's embeddings switched on for one llama_decode).

How a text's rows become one vector is llama.cpp's pooling type: the model's (a GGUF of an
embedding model names one; a generative model's is none: a vector per token, as llama-cpp-python's
Llama.embed returns them), or the `pooling` option (llama.cpp's --pooling, llama-cpp-python's
pooling_type): mean, cls (the first token's) or last (the last token's, the usual choice for a
decoder-only model) pool the text's rows into one vector. Pooling is done within one pass of the
model (a ubatch), as llama.cpp computes it, so a pooled text is at most n_ubatch tokens.
"""
from __future__ import annotations

import numpy as np

from pyedgemoe.errors import InvalidOptionError

# llama.cpp's enum llama_pooling_type by name (-1, unspecified: the model's)
POOLING_TYPES: dict[str, int] = {"none": 0, "mean": 1, "cls": 2, "last": 3}
POOLING_NONE = POOLING_TYPES["none"]
POOLING_HELP = ("how embeddings pool a text's rows: none (a vector per token), mean, cls or last (llama.cpp's "
                "--pooling; for embed and serve --embeddings)")
# the CLI's options (run, embed, serve) of the settings that bound one embedding pass (max_tokens)
FLAGS = {"n_ubatch": "-ub", "n_batch": "-b", "n_ctx": "-c", "expert_cache": "--expert-cache"}
_RANK = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK: a reranker's score, from a classification head
_NO_RANK = ("rank pooling scores documents with a reranking model's classification head, which a generative MoE "
            "model has not (llama.cpp stops on it): use none, mean, cls or last")
# llama.cpp's embd_normalize (common_embd_normalize): what a pooled vector is divided by
NORMALIZATIONS = {-1: "none", 0: "the largest magnitude / 32760 (int16's range)", 1: "taxicab",
                  2: "euclidean (L2; the default)"}


def checked_pooling(value) -> str:
    """The pooling option's value by name, or InvalidOptionError naming what it takes."""
    if value == "rank":
        raise InvalidOptionError(_NO_RANK)
    if value not in POOLING_TYPES:
        raise InvalidOptionError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {value!r}")
    return value


def pooling_from_llama_cpp_python(pooling_type) -> str | None:
    """llama-cpp-python's pooling_type (llama.cpp's enum; -1: the model's) by name (None: the model's)."""
    names = {number: name for name, number in POOLING_TYPES.items()}
    if pooling_type == _RANK:
        raise InvalidOptionError(_NO_RANK)
    if isinstance(pooling_type, bool) or pooling_type not in (-1, *names):
        raise InvalidOptionError(f"pooling_type must be -1 (the model's) or one of llama.cpp's types {names}, "
                                 f"got {pooling_type!r}")
    return names.get(pooling_type)


def context_keywords(options) -> dict:
    """The native Context's keyword of the pooling option (an ExpertOptions: None where unset)."""
    return {} if options["pooling"] is None else {"pooling_type": POOLING_TYPES[options["pooling"]]}


def normalized(rows: np.ndarray, p: int = 2) -> np.ndarray:
    """Each row divided as llama.cpp's common_embd_normalize(p) divides it: p -1 none, 0 by its largest
    magnitude / 32760, else its p-norm (1 taxicab, 2 euclidean); a zero row stays zero."""
    if isinstance(p, bool) or not isinstance(p, int):
        raise InvalidOptionError(f"embd_normalize must be an integer (-1 none, 0 int16 range, 1 taxicab, 2 "
                                 f"euclidean, p > 2: p-norm), got {p!r}")
    rows = np.atleast_2d(rows)
    if p == -1:
        return rows.copy()
    if p == 0:
        sums = np.abs(rows).max(axis=1).astype(np.float64) / 32760.0
    elif p < 0:
        raise InvalidOptionError(f"embd_normalize must be -1 or more, got {p}")
    else:
        sums = (np.abs(rows.astype(np.float64)) ** p).sum(axis=1) ** (1.0 / p)
    with np.errstate(divide="ignore"):
        norms = np.where(sums > 0, 1.0 / sums, 0.0).astype(np.float32)
    return rows * norms[:, None]


def pooling_type(engine) -> int:
    """The pooling type of the Engine's embeddings (llama.cpp's enum; POOLING_NONE: a row per token)."""
    return engine._live().pooling_type


def max_tokens(engine) -> tuple[int, str]:
    """The most tokens one embed() evaluates, and the setting that bounds it: a pooled text is pooled
    within one pass of the model (n_ubatch; or expert_cache, which caps it for a model with expert
    biases: docs/expert-residency.md), a text's rows come from one llama_decode (n_batch), all within
    the context (n_ctx, named first where it is as small: it bounds the others)."""
    pass_bound = "expert_cache" if engine.n_ubatch < engine.plan.n_ubatch else "n_ubatch"
    pooled = [(engine.n_ubatch, pass_bound)] if pooling_type(engine) != POOLING_NONE else []
    n_ctx = min(engine.n_ctx, engine.plan.n_ctx or engine.n_ctx)  # a sequence's, at most the context asked for
    return min([(n_ctx, "n_ctx"), *pooled, (engine.plan.n_batch, "n_batch")], key=lambda bound: bound[0])


def check_one_pass(engine, n_tokens: int, flags: dict[str, str] | None = None) -> None:
    """InvalidOptionError where n_tokens are more than one embed() evaluates (max_tokens): the bound
    and the setting that raises it, by the Engine's names, or by flags (the CLI's FLAGS, which has no
    truncate=True to advise)."""
    limit, what = max_tokens(engine)
    if n_tokens <= limit:
        return
    name = flags or {setting: setting for setting in FLAGS}
    # n_ctx bounding less than the context: the batch, which llama.cpp caps at the n_ctx asked (a context is rounded up)
    if what == "n_ctx" and limit < engine.n_ctx:
        bound = f"the batch of {limit} tokens ({name['n_batch']}, at most the {name['n_ctx']} asked)"
    elif what == "expert_cache":
        bound = f"the {limit} tokens whose experts the expert cache holds at once ({name[what]}; this model's " \
                f"expert biases)"
    else:
        bound = f"{name[what]} {limit}"
    fix = f"raise {name[what]}" if flags else f"truncate=True drops the rest, or raise {what}"
    raise InvalidOptionError(f"{n_tokens} tokens exceed {bound}: embed evaluates a text in one pass ({fix})")


def embed(engine, text: str | list[int], normalize: bool = False, truncate: bool = True) -> np.ndarray:
    """float32 embeddings of text (tokenized with BOS) or token ids, on a sequence that holds nothing
    before or after (n_parallel > 1: a free one, queued for as a generation): [n_tokens, n_embd],
    or [n_embd] where the context pools. One llama_decode of at most n_batch tokens (n_ubatch where
    it pools): those past it are dropped (truncate, llama-cpp-python's default) or refused.
    normalize: every vector scaled to unit length (L2)."""
    ids = engine.prompt_tokens(text)
    if not ids:
        raise InvalidOptionError("embed needs at least one token")
    if not truncate:
        check_one_pass(engine, len(ids))
    ids = ids[:max_tokens(engine)[0]]
    engine._check_fits(len(ids), 0)
    if engine._batcher is not None:
        rows = engine._batcher.embed(ids)
    else:
        with engine._sequence_turn():
            rows = engine._decoder.embed(ids, engine._decoder.sequences[0])
    if normalize:
        rows = normalized(rows, 2)
    return rows[0] if pooling_type(engine) != POOLING_NONE else rows
