"""Speculative decoding without a draft model: a drafter guesses the tokens that follow from the
tokens so far, and the model checks its guesses in one batch (generation.Generation).

A drafter is llama-cpp-python's LlamaDraftModel: called with every token so far (the prompt's and
the generated ones, the latest last; int32), it returns the token ids it guesses follow (an array;
empty: no guess). Two come with pyedgemoe, each as its original has it:
- LlamaPromptLookupDecoding: llama-cpp-python's (`Llama(draft_model=LlamaPromptLookupDecoding())`):
  the first earlier occurrence of the last max_ngram_size (then fewer) tokens, and up to
  num_pred_tokens of what followed it.
- NgramSimple: llama.cpp's `--spec-type ngram-simple` (common/ngram-map.cpp,
  common_ngram_simple_draft): the latest earlier occurrence of the last size_n tokens, and up to
  size_m of what followed it (none if fewer than size_n).
Any other callable of that shape works too (llama_cpp.llama_speculative's own classes).

Whether it pays: the experts a batch's tokens route to are read and computed once for all of
them, but tokens seldom share all of theirs, so on a CPU a batch of n tokens of an MoE costs close
to n steps of one (docs/speculative.md); a guess pays only when most of it is taken. So each
generation measures what its checks earn (DraftControl, after the utility of Cascade, Saxena et
al. 2025, "Utility-Driven Speculative Decoding for Mixture-of-Experts"): the tokens a check gave
per second against a step without a guess, averaged over the last checks. While that is below 1,
drafting pauses (4 steps, doubling while checks keep losing, up to 256); the tokens of a guess
checked next start at 2, double after a guess taken whole and are one more than those taken after
one cut short.
Whatever is checked, the tokens are the ones each position's pick gives.
"""
from __future__ import annotations

import abc

import numpy as np

from pyedgemoe.errors import InvalidOptionError

SPEC_TYPES = ("none", "ngram-simple")  # llama.cpp's --spec-type names this build runs
NGRAM_SIMPLE_SIZE_N = 12  # llama.cpp's defaults (common_params_speculative_ngram_map)
NGRAM_SIMPLE_SIZE_M = 48


class LlamaDraftModel(abc.ABC):
    """llama-cpp-python's drafter interface: the token ids guessed to follow input_ids."""

    @abc.abstractmethod
    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        """The guess after input_ids (every token so far, int32); empty: none."""


class LlamaPromptLookupDecoding(LlamaDraftModel):
    """llama-cpp-python's prompt lookup decoding (after apoorvumang/prompt-lookup-decoding)."""

    def __init__(self, max_ngram_size: int = 2, num_pred_tokens: int = 10):
        _check_sizes("LlamaPromptLookupDecoding", max_ngram_size=max_ngram_size, num_pred_tokens=num_pred_tokens)
        self.max_ngram_size = max_ngram_size
        self.num_pred_tokens = num_pred_tokens

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        ids = np.asarray(input_ids)
        n = ids.shape[0]
        for size in range(min(self.max_ngram_size, n - 1), 0, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ids, (size,))
            for start in np.nonzero(np.all(windows == ids[-size:], axis=1))[0] + size:
                if start < n:  # an earlier occurrence, with tokens after it
                    return ids[start:min(start + self.num_pred_tokens, n)]
        return np.array([], dtype=np.intc)


class NgramSimple(LlamaDraftModel):
    """llama.cpp's ngram-simple self-speculation."""

    def __init__(self, size_n: int = NGRAM_SIMPLE_SIZE_N, size_m: int = NGRAM_SIMPLE_SIZE_M):
        _check_sizes("ngram-simple", size_n=size_n, size_m=size_m)
        self.size_n, self.size_m = size_n, size_m

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        ids = np.asarray(input_ids)
        n, size = ids.shape[0] - 1, self.size_n  # n: llama.cpp's tokens before the one just sampled
        if n <= size + self.size_m + 1:
            return np.array([], dtype=np.intc)
        # occurrences start at 1 .. n - size - 1; those ending in the last token, the latest first
        for end in np.flatnonzero(ids[size:n - 1] == ids[-1])[::-1] + size:
            if np.array_equal(ids[end - size + 1:end + 1], ids[-size:]):
                length = min(self.size_m, n - end - 1)
                return ids[end + 1:end + 1 + length] if length >= size else np.array([], dtype=np.intc)
        return np.array([], dtype=np.intc)


def drafter(spec_type: str, size_n: int = NGRAM_SIMPLE_SIZE_N, size_m: int = NGRAM_SIMPLE_SIZE_M):
    """The drafter of llama.cpp's --spec-type (None for "none")."""
    if spec_type not in SPEC_TYPES:
        raise InvalidOptionError(f"--spec-type must be one of {', '.join(SPEC_TYPES)} (llama.cpp's others, draft "
                                 f"models and the other n-gram kinds, are not in pyedgemoe), got {spec_type!r}")
    return NgramSimple(size_n, size_m) if spec_type == "ngram-simple" else None


class DraftControl:
    """One generation's drafting: how many tokens of a guess the next step checks (size), from what
    the steps so far measured (record)."""

    FIRST_SIZE = 2  # tokens of a guess the first check takes
    MAX_SIZE = 64
    PAUSE_STEPS = 4  # steps without a guess after a check that earned less than a plain step, doubling
    MAX_PAUSE_STEPS = 256

    def __init__(self) -> None:
        self.step_seconds: float | None = None  # a step without a guess (a moving average)
        self.window = self.FIRST_SIZE
        self.paused = 0  # steps left without a guess
        self.earned = 1.0  # what checks earned lately: their tokens a second over a plain step's
        self.pause = self.PAUSE_STEPS

    def size(self) -> int:
        """Tokens of a guess the next step checks, at most; 0: ask for none (the first step measures
        a step without one)."""
        if self.step_seconds is None:
            return 0
        if self.paused > 0:
            self.paused -= 1
            return 0
        return self.window

    def record(self, checked: int, taken: int, seconds: float) -> None:
        """A step's decode took seconds, with `checked` tokens of a guess of which it took `taken`."""
        if checked == 0:
            self.step_seconds = seconds if self.step_seconds is None else 0.75 * self.step_seconds + 0.25 * seconds
            return
        self.window = min(2 * checked, self.MAX_SIZE) if taken == checked else taken + 1
        # tokens a second against a plain step's, of this check and (decaying) of those before
        self.earned = 0.5 * self.earned + 0.5 * (taken + 1) * self.step_seconds / seconds
        if self.earned < 1.0:
            self.paused, self.pause = self.pause, min(2 * self.pause, self.MAX_PAUSE_STEPS)
        else:
            self.pause = self.PAUSE_STEPS


def _check_sizes(where: str, **sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidOptionError(f"{where}: {name} must be an integer >= 1, got {value!r}")
