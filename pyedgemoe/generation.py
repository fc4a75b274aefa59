"""One generation path, for the Engine's one sequence and the batcher's several alike.

- SamplingParams: llama.cpp's sampler chain settings, declared once; the CLI's flags
  (cli_options.sampling_options), the Engine's keywords and the OpenAI request fields the server
  takes (server/request_params.py) are made from its fields.
- Generation: one generation on one sequence of the KV cache, from its prompt to its finish:
  prefill (reusing the prefix the sequence holds, unless fresh), the next token's input, the stop
  rules (end-of-generation tokens, the budget), the finish reason and the timings. The Engine steps
  one on the caller's thread (Engine._one_sequence), the Batcher several in one llama_decode
  (batch.py); both decode through the Decoder (decoder.py).
"""
from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field

import numpy as np

from pyedgemoe import _native
from pyedgemoe.errors import InvalidOptionError

CHAT_TEMPERATURE = 0.2  # llama-cpp-python's create_chat_completion default (a completion's: 0.8)


def _flag(flag: str | None, help: str = "") -> dict:
    """A field's metadata: its CLI flag (None: not on the CLI nor in OpenAI requests) and help."""
    return {"flag": flag, "help": help}


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's sampler chain settings; temperature <= 0 means greedy. Every field with a flag
    is a CLI flag, a keyword of Engine.generate / create_completion / create_chat_completion and
    an OpenAI request field of the same name."""
    temperature: float = field(default=0.8, metadata=_flag("--temp", "temperature (0 = greedy)"))
    top_k: int = field(default=40, metadata=_flag("--top-k", "keep the k most likely tokens (0: all)"))
    top_p: float = field(default=0.95, metadata=_flag("--top-p", "keep the most likely tokens up to this "
                                                                 "probability mass"))
    min_p: float = field(default=0.05, metadata=_flag("--min-p", "drop tokens less likely than this share of "
                                                                 "the most likely one's probability"))
    repeat_penalty: float = field(default=1.0, metadata=_flag("--repeat-penalty", "divide the logits of recent "
                                                                                  "tokens by this (1: off)"))
    penalty_last_n: int = field(default=64, metadata=_flag(None))
    seed: int | None = field(default=None, metadata=_flag("--seed", "sampling seed (default: random)"))

    @classmethod
    def of(cls, keywords: dict, **defaults) -> "SamplingParams":
        """The settings from keyword arguments (None: the default), over `defaults`; checked."""
        given = {name: value for name, value in {**defaults, **keywords}.items() if value is not None}
        unknown = sorted(set(given) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r} (sampling takes "
                            f"{', '.join(f.name for f in dataclasses.fields(cls))})")
        params = cls(**given)
        params.validate()
        return params

    def validate(self) -> None:
        if not np.isfinite(self.temperature):
            raise InvalidOptionError(f"temperature must be a finite number, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidOptionError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidOptionError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidOptionError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (np.isfinite(self.repeat_penalty) and self.repeat_penalty > 0.0):
            raise InvalidOptionError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise InvalidOptionError(f"seed must be in [0, 2^32), got {self.seed}")

    def sampler(self, model, default_seed: int | None, prompt: list[int]):
        """A native sampler chain of these settings (the seed: its own, else default_seed, else a
        random one) that has seen the prompt's last penalty_last_n tokens."""
        seed = next((s for s in (self.seed, default_seed) if s is not None), None)
        sampler = _native.Sampler(model, self.temperature, self.top_k, self.top_p, self.min_p, self.repeat_penalty,
                                  self.penalty_last_n, random.getrandbits(32) if seed is None else seed)
        for t in prompt[-self.penalty_last_n:] if self.penalty_last_n > 0 else []:
            sampler.accept_prompt(t)
        return sampler


def exposed_fields() -> list[dataclasses.Field]:
    """The settings a CLI flag and an OpenAI request field give (those with a flag)."""
    return [f for f in dataclasses.fields(SamplingParams) if f.metadata["flag"]]


@dataclass
class GenerationStats:
    """Of one generation: prefill = evaluating the prompt, decode = the generated tokens."""
    n_prompt_tokens: int = 0
    n_cached_prompt_tokens: int = 0  # prompt prefix reused from what the sequence's KV cache held
    prefill_seconds: float = 0.0
    n_decoded: int = 0
    decode_seconds: float = 0.0
    finish_reason: str = "length"  # "stop": an end-of-generation token; "length": max_tokens or n_ctx

    @property
    def prefill_tokens_per_second(self) -> float:
        n = self.n_prompt_tokens - self.n_cached_prompt_tokens
        return n / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.n_decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def add(self, other: "GenerationStats") -> None:
        """Counts other's tokens and time in these (totals)."""
        self.n_prompt_tokens += other.n_prompt_tokens
        self.n_cached_prompt_tokens += other.n_cached_prompt_tokens
        self.prefill_seconds += other.prefill_seconds
        self.n_decoded += other.n_decoded
        self.decode_seconds += other.decode_seconds

    def to_dict(self) -> dict:
        return {
            "n_prompt_tokens": self.n_prompt_tokens,
            "n_cached_prompt_tokens": self.n_cached_prompt_tokens,
            "prefill_seconds": self.prefill_seconds,
            "prefill_tokens_per_second": self.prefill_tokens_per_second,
            "n_decoded": self.n_decoded,
            "decode_seconds": self.decode_seconds,
            "decode_tokens_per_second": self.decode_tokens_per_second,
        }


def shared_prefix(held: list[int], prompt: list[int]) -> int:
    """How many of prompt's tokens a KV cache holding held can keep: their common prefix, short of
    prompt's last token (evaluated again, for its logits)."""
    n, limit = 0, min(len(held), len(prompt) - 1)
    while n < limit and held[n] == prompt[n]:
        n += 1
    return n


@dataclass
class KVSequence:
    """One sequence of a context's KV cache: its id and the tokens it holds, position by position."""
    seq: int
    tokens: list[int] = field(default_factory=list)
    busy: bool = False  # a generation runs on it (the batcher's)


class Generation:
    """One generation on one KVSequence: prefill() evaluates the prompt and picks the first token;
    then, while more() is true, the model evaluates next_input() and picked() takes the next pick.
    A pick is None when the generation ends there (timings.finish_reason says why).

    budget: tokens to generate at most. fresh: reuse no prefix of what the sequence holds.
    feed_tokens (benchmarks): after the i-th pick, feed feed_tokens[i] to the model instead."""

    def __init__(self, decoder, prompt: list[int], budget: int, sampler, ignore_eos: bool,
                 timings: GenerationStats, fresh: bool, feed_tokens: list[int] | None = None):
        self.decoder = decoder
        self.prompt = prompt
        self.budget = budget
        self.sampler = sampler
        self.ignore_eos = ignore_eos
        self.timings = timings
        self.fresh = fresh
        self.feed_tokens = feed_tokens
        self.sequence: KVSequence | None = None
        self._last = -1  # the token picked last
        self._fed = -1  # the token evaluated at the step in flight
        self._decode_start = 0.0

    def prefill(self, sequence: KVSequence) -> int | None:
        """Evaluates the prompt on sequence, keeping the prefix it shares with what the sequence holds
        (none when fresh; at least the prompt's last token is evaluated again, for its logits), and
        picks the first token."""
        start = time.perf_counter()
        self.sequence = sequence
        reuse = self.decoder.keep(sequence, 0 if self.fresh else shared_prefix(sequence.tokens, self.prompt))
        self.decoder.decode(self.prompt[reuse:], reuse, sequence)
        sequence.tokens[:] = self.prompt
        self.timings.n_cached_prompt_tokens = reuse
        self.timings.prefill_seconds = time.perf_counter() - start
        self._decode_start = time.perf_counter()
        return self._take(self.decoder.sample(self.sampler))

    def more(self) -> bool:
        """Whether the budget allows another token after the last pick."""
        return self.timings.n_decoded < self.budget

    def next_input(self) -> tuple[int, int]:
        """(token, position) the model evaluates next: the last pick, or the token fed instead."""
        self._fed = self._last if self.feed_tokens is None else self.feed_tokens[self.timings.n_decoded - 1]
        return self._fed, len(self.sequence.tokens)

    def picked(self, token: int) -> int | None:
        """After the model evaluated next_input() (now in the sequence), the token it picked next."""
        self.sequence.tokens.append(self._fed)
        return self._take(token)

    def step(self) -> int | None:
        """One sequence alone: the next pick, or None at the end. Time spent by the consumer between
        two steps does not count as decode time."""
        self._decode_start = time.perf_counter() - self.timings.decode_seconds
        if not self.more():
            return self._finish("length")
        token, pos = self.next_input()
        self.decoder.decode([token], pos, self.sequence)
        return self.picked(self.decoder.sample(self.sampler))

    def _take(self, token: int) -> int | None:
        """The stop rules: the budget spent (before the pick: max_tokens 0), an end-of-generation token."""
        if not self.more():
            return self._finish("length")
        if not self.ignore_eos and self.decoder.is_eog(token):
            return self._finish("stop")
        self.timings.n_decoded += 1
        self.timings.decode_seconds = time.perf_counter() - self._decode_start
        self._last = token
        return token

    def _finish(self, reason: str) -> None:
        self.timings.finish_reason = reason
        self.timings.decode_seconds = time.perf_counter() - self._decode_start
        return None
