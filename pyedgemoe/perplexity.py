"""Perplexity the way llama.cpp's `llama-perplexity` computes it (tools/perplexity/perplexity.cpp,
perplexity()), so numbers are comparable with the ones published for llama.cpp quantizations.

    from pyedgemoe import Engine
    from pyedgemoe.perplexity import perplexity
    with Engine("model.gguf", n_ctx=512, expert_cache="50%") as eng:
        result = perplexity(eng, open("wiki.test.raw").read())
    print(f"ppl = {result.ppl:.4f} +/- {result.stderr:.5f}")

The method: the whole text is tokenized once (with BOS if the model adds one) and cut into
consecutive chunks of n_ctx tokens (a remainder shorter than a chunk is dropped). Each chunk is
evaluated on a fresh sequence, its first token replaced by BOS when the model adds BOS. Only
the second half of a chunk is scored, so every prediction has at least n_ctx/2 tokens of
context: the logits at positions first = n_ctx/2 .. n_ctx-2 predict the tokens at
first+1 .. n_ctx-1, n_ctx - 1 - n_ctx/2 tokens per chunk. ppl = exp(mean negative
log-likelihood); its uncertainty is llama.cpp's: ppl * sqrt(var(nll) / (count - 1)).

Like llama.cpp, the text must tokenize to at least 2 * n_ctx tokens, even with n_chunks = 1.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pyedgemoe.errors import ContextOverflowError, InvalidOptionError, TextTooShortError

DEFAULT_N_CTX = 512  # llama-perplexity's default --ctx-size
MIN_N_CTX = 3  # the smallest chunk whose second half scores a token (first = 1 predicts token 2)
# log-softmax in float64 a block of rows at a time, the block this many bytes at most: its three
# temporaries stay within the run's allowance (memory_budget.RUN_ALLOWANCE_BYTES) whatever the vocabulary
BLOCK_BYTES = 4 * 2**20


@dataclass
class PerplexityResult:
    """One perplexity run. nll holds the negative log-likelihood (natural log) of every scored
    token in text order, n_chunks * (n_ctx - 1 - n_ctx//2) of them."""
    ppl: float
    stderr: float  # llama.cpp's "+/-"; NaN when undefined (fewer than two scored tokens)
    n_ctx: int
    n_chunks: int
    n_tokens: int  # tokens in the whole text (with BOS if the model adds one)
    n_tokens_scored: int
    running_ppl: list[float]  # after chunk i: exp(mean nll over chunks 0..i), llama.cpp's [i+1]
    chunk_nll: list[float]  # mean nll of each chunk alone
    nll: np.ndarray = field(repr=False)  # float64 [n_tokens_scored]
    seconds: float = 0.0

    def to_dict(self) -> dict:
        """JSON-ready (no arrays; NaN as None)."""
        finite = lambda x: x if math.isfinite(x) else None  # noqa: E731
        return {"ppl": finite(self.ppl), "stderr": finite(self.stderr), "n_ctx": self.n_ctx,
                "n_chunks": self.n_chunks, "n_tokens": self.n_tokens, "n_tokens_scored": self.n_tokens_scored,
                "running_ppl": [finite(x) for x in self.running_ppl],
                "chunk_nll": [finite(x) for x in self.chunk_nll], "seconds": self.seconds}


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits[i])[targets[i]] for each row, in float64 (float32 [n, n_vocab] in)."""
    out = np.empty(len(targets), dtype=np.float64)
    block = max(1, BLOCK_BYTES // (8 * logits.shape[1]))
    for start in range(0, len(targets), block):
        rows = logits[start:start + block].astype(np.float64)
        top = rows.max(axis=1)
        log_sum_exp = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
        picked = rows[np.arange(len(rows)), targets[start:start + block]]
        out[start:start + len(rows)] = log_sum_exp - picked
    return out


def decode_mode_logits(engine, tokens: list[int], n_ctx: int) -> np.ndarray:
    """Every token's logits in decode mode (one llama_decode per token), the tokens run as
    consecutive sequences of n_ctx (a model's trained context bounds what its positions mean)."""
    return np.concatenate([engine.logits(tokens[start:start + n_ctx], one_token_per_step=True)
                           for start in range(0, len(tokens), n_ctx)])


def next_token_nll(logits: np.ndarray, tokens: list[int], n_ctx: int) -> np.ndarray:
    """Each position's negative log-likelihood of the next token in its sequence of n_ctx (NaN for a
    sequence's last position)."""
    out = np.full(len(tokens), np.nan)
    for start in range(0, len(tokens), n_ctx):
        end = min(start + n_ctx, len(tokens))
        out[start:end - 1] = token_nll(logits[start:end - 1], np.asarray(tokens[start + 1:end]))
    return out


def _bos_to_insert(engine) -> int | None:
    """The BOS id when the model adds BOS to tokenized text (llama_vocab_get_add_bos), else None."""
    bos = engine.token_bos()
    return bos if engine.add_bos and bos is not None else None


def _stderr_of_ppl(nll: np.ndarray, ppl: float) -> float:
    # llama.cpp's formula, from the running sums of nll and nll^2
    count = len(nll)
    if count < 2:
        return math.nan
    mean = float(nll.sum()) / count
    variance = float((nll * nll).sum()) / count - mean * mean
    return math.sqrt(variance / (count - 1)) * ppl if variance > 0 else math.nan


def text_tokens(engine, text_or_tokens: str | list[int], n_ctx: int | None = None,
                n_chunks: int | None = None) -> list[int]:
    """The tokens perplexity scores: text tokenized as llama-perplexity does (BOS first where the
    model adds it), or token ids as given. With n_chunks chunks of n_ctx asked for, only the text
    they need is tokenized (at least two chunks': llama.cpp's rule)."""
    if engine.add_eos:
        # llama-perplexity asserts the same: an EOS appended to the text would be scored
        raise InvalidOptionError("this model appends EOS to tokenized text; llama.cpp's perplexity does not "
                                 "support such models")
    if isinstance(text_or_tokens, str):
        return engine.first_tokens(text_or_tokens, None if n_chunks is None else max(n_chunks, 2) * n_ctx)
    return [int(t) for t in text_or_tokens]


def check_chunks(engine, n_ctx: int, n_chunks: int | None) -> None:
    """InvalidOptionError for a bad n_ctx / n_chunks, ContextOverflowError for an n_ctx beyond the engine's."""
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < MIN_N_CTX:
        raise InvalidOptionError(f"perplexity n_ctx must be an integer >= {MIN_N_CTX}, got {n_ctx!r}")
    if n_chunks is not None and (isinstance(n_chunks, bool) or not isinstance(n_chunks, int) or n_chunks <= 0):
        raise InvalidOptionError(f"n_chunks must be a positive integer (or None for all), got {n_chunks!r}")
    if n_ctx > engine.n_ctx:
        raise ContextOverflowError(f"perplexity context of {n_ctx} tokens is larger than the engine's context "
                                   f"of {engine.n_ctx} tokens (create the Engine with n_ctx >= {n_ctx})")


def scored_logits(engine, tokens: list[int], n_ctx: int, n_chunks: int, one_token_per_step: bool = False):
    """For each of the first n_chunks chunks of n_ctx tokens: (the tokens its second half predicts,
    the logits that predict them: positions n_ctx/2 .. n_ctx-2), the chunk evaluated on a fresh
    sequence with its first token BOS where the model adds BOS, as llama-perplexity evaluates it."""
    bos = _bos_to_insert(engine)
    first = n_ctx // 2
    for i in range(n_chunks):
        chunk = tokens[i * n_ctx:(i + 1) * n_ctx]
        targets = np.asarray(chunk[first + 1:], dtype=np.int64)
        if bos is not None:
            chunk = [bos] + chunk[1:]
        yield targets, engine.logits(chunk, one_token_per_step=one_token_per_step)[first:n_ctx - 1]


def perplexity(engine, text_or_tokens: str | list[int], n_ctx: int = DEFAULT_N_CTX, n_chunks: int | None = None,
               *, on_chunk: Callable[[int, float], None] | None = None,
               on_logits: Callable[[np.ndarray, np.ndarray], None] | None = None,
               one_token_per_step: bool = False) -> PerplexityResult:
    """llama.cpp's perplexity of text (or of token ids, already tokenized as llama.cpp does: with
    BOS first if the model adds one) under engine, whatever its runtime configuration.

    n_ctx: tokens per chunk (llama-perplexity's --ctx-size); at most engine.n_ctx.
    n_chunks: evaluate at most this many chunks (None: all that fit in the text).
    on_chunk(i, running_ppl): called after each chunk i (0-based), e.g. to print progress.
    on_logits(targets, logits): each chunk's scored tokens and the logits that predict them
    (pyedgemoe.kl_divergence writes a base of them).
    one_token_per_step: decode mode, each chunk evaluated one llama_decode per token (Engine.logits):
    every token is routed, and with an expert cache served, as a decode step is (docs/systems.md).
    Raises TextTooShortError when the text has fewer than 2 * n_ctx tokens, InvalidOptionError
    for a bad n_ctx / n_chunks, ContextOverflowError when n_ctx exceeds the engine's context.
    """
    check_chunks(engine, n_ctx, n_chunks)
    tokens = text_tokens(engine, text_or_tokens)
    if len(tokens) < 2 * n_ctx:
        raise TextTooShortError(f"perplexity with a context of {n_ctx} needs at least {2 * n_ctx} tokens "
                                f"(llama.cpp's rule), the text has only {len(tokens)}")

    chunks_in_text = len(tokens) // n_ctx
    n_chunks = chunks_in_text if n_chunks is None else min(n_chunks, chunks_in_text)
    per_chunk = n_ctx - 1 - n_ctx // 2
    nll = np.empty(n_chunks * per_chunk, dtype=np.float64)
    running_ppl: list[float] = []
    chunk_nll: list[float] = []
    start_time = time.perf_counter()
    for i, (targets, logits) in enumerate(scored_logits(engine, tokens, n_ctx, n_chunks, one_token_per_step)):
        if on_logits is not None:
            on_logits(targets, logits)
        scored = token_nll(logits, targets)
        nll[i * per_chunk:(i + 1) * per_chunk] = scored
        chunk_nll.append(float(scored.mean()))
        running_ppl.append(math.exp(float(nll[:(i + 1) * per_chunk].sum()) / ((i + 1) * per_chunk)))
        if on_chunk is not None:
            on_chunk(i, running_ppl[-1])
    seconds = time.perf_counter() - start_time
    ppl = running_ppl[-1]
    return PerplexityResult(ppl=ppl, stderr=_stderr_of_ppl(nll, ppl), n_ctx=n_ctx, n_chunks=n_chunks,
                            n_tokens=len(tokens), n_tokens_scored=len(nll), running_ppl=running_ppl,
                            chunk_nll=chunk_nll, nll=nll, seconds=seconds)
