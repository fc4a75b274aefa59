"""One generation path, for the Engine's one sequence and the batcher's several alike.

- SamplingParams: llama.cpp's sampler chain settings, declared once; the CLI's flags
  (cli_options.sampling_options), the Engine's keywords and the OpenAI request fields the server
  takes (server/request_params.py) are made from its fields. A grammar or a JSON schema constrains
  the text (structured_output.py).
- Generation: one generation on one sequence of the KV cache, from its prompt to its finish:
  prefill (reusing the prefix the sequence holds, unless fresh), the next token's input, the stop
  rules (end-of-generation tokens, the budget, stopping criteria), the finish reason, the timings and, when asked, each
  generated token's log-probability and the most likely alternatives (TokenLogprob). With a drafter
  (SamplingParams.draft_model, speculative.py) a step evaluates the last pick and the drafter's guess
  in one batch and takes the picks that agree with the guess, and the first that does not. The Engine
  steps one on the caller's thread (Engine._one_sequence), the Batcher several in one llama_decode
  (batch.py); both decode through the Decoder (decoder.py).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import random
import time
from collections import deque
from typing import Generator
from dataclasses import dataclass, field

import numpy as np

from pyedgemoe import _native
from pyedgemoe.errors import InvalidOptionError, ModelLoadError
from pyedgemoe.speculative import DraftControl
from pyedgemoe.grammar_limits import check_grammar, check_schema
from pyedgemoe.structured_output import response_format_keywords, schema_grammar, schema_text
from pyedgemoe.text_stream import utf8
from pyedgemoe.token_sampler import TokenSampler

RANDOM_SEED = -1  # llama.cpp's seed for a random one (its CLI's and server's default)
WHOLE_CONTEXT = -1  # llama.cpp's window of recent tokens (penalties, DRY) that is the whole context
# llama.cpp's sampler names (common_sampler_types_from_names) and letters (llama-server's "edskypmxt"),
# in its default order, then the infill sampler; their other names
SAMPLER_NAMES = {"penalties": "e", "dry": "d", "top_n_sigma": "s", "top_k": "k", "typ_p": "y", "top_p": "p",
                 "min_p": "m", "xtc": "x", "temperature": "t", "infill": "i"}
# llama.cpp's other names of them (common_sampler_types_from_names, which lower-cases a name first):
# "top-k" and "topk" for top_k, ...; and older ones
_SAMPLER_ALIASES = {**{alias: name for name in SAMPLER_NAMES if "_" in name
                       for alias in (name.replace("_", "-"), name.replace("_", ""))},
                    "nucleus": "top_p", "typical-p": "typ_p", "typical": "typ_p", "typ": "typ_p", "temp": "temperature"}
CHAT_TEMPERATURE = 0.2  # llama-cpp-python's create_chat_completion default (a completion's: 0.8)


def _flag(flag: str | None, help: str = "", file_flag: str | None = None, short_flag: str | None = None,
          file_short_flag: str | None = None) -> dict:
    """A field's metadata: its CLI flag (None: not on the CLI nor in OpenAI requests) and short one,
    help, and the CLI flag that reads the value from a file (file_flag) and its short one."""
    return {"flag": flag, "short_flag": short_flag, "help": help, "file_flag": file_flag,
            "file_short_flag": file_short_flag}


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's sampler chain settings; temperature <= 0 means greedy. Every field with a flag
    is a CLI flag, a keyword of Engine.generate / create_completion / create_chat_completion and
    an OpenAI request field of the same name."""
    temperature: float = field(default=0.8, metadata=_flag("--temp", "temperature (0 = greedy)"))
    top_k: int = field(default=40, metadata=_flag("--top-k", "keep the k most likely tokens (<= 0: all)"))
    top_p: float = field(default=0.95, metadata=_flag("--top-p", "keep the most likely tokens up to this "
                                                                 "probability mass"))
    min_p: float = field(default=0.05, metadata=_flag("--min-p", "drop tokens less likely than this share of "
                                                                 "the most likely one's probability"))
    typical_p: float = field(default=1.0, metadata=_flag("--typical", "locally typical sampling: keep the tokens "
                                                                      "closest to the expected surprise up to this "
                                                                      "probability mass (1: off)"))
    repeat_penalty: float = field(default=1.0, metadata=_flag("--repeat-penalty", "divide the logits of recent "
                                                                                  "tokens by this (1: off)"))
    frequency_penalty: float = field(default=0.0, metadata=_flag(
        "--frequency-penalty", "subtract this times its count in the recent tokens from a token's logit (0: off)"))
    presence_penalty: float = field(default=0.0, metadata=_flag(
        "--presence-penalty", "subtract this from the logit of a token among the recent ones (0: off)"))
    mirostat_mode: int = field(default=0, metadata=_flag(
        "--mirostat", "Mirostat sampling, 1: Mirostat, 2: Mirostat 2.0 (0: off); after the temperature, in place "
                      "of top-k, typical, top-p and min-p, as llama.cpp's"))
    mirostat_tau: float = field(default=5.0, metadata=_flag("--mirostat-ent", "Mirostat's target entropy (tau)"))
    mirostat_eta: float = field(default=0.1, metadata=_flag("--mirostat-lr", "Mirostat's learning rate (eta)"))
    # llama.cpp's samplers beyond llama-cpp-python's (llama-server's names)
    dry_multiplier: float = field(default=0.0, metadata=_flag(
        "--dry-multiplier", "DRY (don't repeat yourself): a token that extends a repetition of the recent text "
                            "longer than --dry-allowed-length loses this times --dry-base ^ (its length - the "
                            "allowed length) of its logit (0: off)"))
    dry_base: float = field(default=1.75, metadata=_flag("--dry-base", "DRY's base"))
    dry_allowed_length: int = field(default=2, metadata=_flag("--dry-allowed-length", "DRY: the repetitions "
                                                                                      "longer than this are penalized"))
    dry_penalty_last_n: int = field(default=64, metadata=_flag("--dry-penalty-last-n", "DRY: the recent tokens "
                                                                                       "searched (0: off, -1: the "
                                                                                       "context)"))
    # the text that ends a repetition for DRY
    dry_sequence_breakers: tuple[str, ...] = field(default=("\n", ":", '"', "*"), metadata=_flag(None))
    xtc_probability: float = field(default=0.0, metadata=_flag(
        "--xtc-probability", "XTC (exclude top choices): the chance of removing every token but the least likely "
                             "of those above --xtc-threshold (0: off)"))
    xtc_threshold: float = field(default=0.1, metadata=_flag("--xtc-threshold", "XTC's probability threshold "
                                                                                "(above 0.5: off)"))
    top_n_sigma: float = field(default=-1.0, metadata=_flag(
        "--top-nsigma", "keep the tokens within this many standard deviations of the largest logit (<= 0: off)"))
    dynatemp_range: float = field(default=0.0, metadata=_flag(
        "--dynatemp-range", "dynamic temperature: the temperature moves within --temp +/- this, by the "
                            "distribution's entropy (0: off)"))
    dynatemp_exponent: float = field(default=1.0, metadata=_flag("--dynatemp-exp", "dynamic temperature's "
                                                                                  "exponent"))
    samplers: str | None = field(default=None, metadata=_flag(
        "--samplers", "the samplers in this order, separated by ';' (llama.cpp's --samplers; without Mirostat): "
                      + ", ".join(SAMPLER_NAMES) + " (default: llama.cpp's order, all but infill)"))
    # {token id: bias added to its logit} (-inf: never that token); given as a dict, kept as pairs
    logit_bias: tuple[tuple[int, float], ...] = field(default=(), metadata=_flag(None))
    # llama-cpp-python's Python hooks (token_sampler.TokenSampler): f(input_ids, logits) -> logits
    # (or a list of such), ahead of the chain; f(input_ids, logits) -> bool, true to end the
    # generation before a pick
    logits_processor: object = field(default=None, metadata=_flag(None))
    stopping_criteria: object = field(default=None, metadata=_flag(None))
    # speculative decoding's drafter (speculative.py; llama-cpp-python's draft_model): f(input_ids) -> ids
    draft_model: object = field(default=None, metadata=_flag(None))
    # f(input_ids, logits): the prompt evaluated in one go with every row's logits (its last row the
    # first pick's), handed over, logits those of input_ids' last len(logits) tokens (Llama's logits_all)
    prompt_logits: object = field(default=None, metadata=_flag(None))
    penalty_last_n: int = field(default=64, metadata=_flag(None))
    # the penalties count the prompt's tokens too, as llama.cpp's CLI and server do (llama-cpp-python's
    # Llama counts the generated ones only)
    penalize_prompt: bool = field(default=True, metadata=_flag(None))
    seed: int | None = field(default=None, metadata=_flag("--seed", "sampling seed (default, or -1 as in llama.cpp: "
                                                                    "random)", short_flag="-s"))
    grammar: str | None = field(default=None, metadata=_flag(
        "--grammar", "BNF-like grammar (llama.cpp's GBNF) to constrain generations", file_flag="--grammar-file"))
    json_schema: str | None = field(default=None, metadata=_flag(
        "--json-schema", "JSON schema to constrain generations (https://json-schema.org/), e.g. `{}` for any JSON "
        "value", file_flag="--json-schema-file", short_flag="-j", file_short_flag="-jf"))
    # llama.cpp's reasoning budget, in a chat whose template has thinking tags (chat_formats.ChatTurn)
    reasoning_budget_tokens: int = field(default=-1, metadata=_flag(
        "--reasoning-budget", "token budget for thinking: -1 unrestricted, 0 an immediate end, N > 0 at most N "
                              "tokens, then the end of the thought is forced (a chat whose template has thinking "
                              "tags, as llama.cpp's)"))
    reasoning_budget_message: str | None = field(default=None, metadata=_flag(
        "--reasoning-budget-message", "text written before the end of a thought the budget cuts"))
    # llama-server's reasoning control: a threading.Event; once set, the thought being written ends
    # (as the budget ends one) at the next pick
    reasoning_control: object = field(default=None, metadata=_flag(None))
    # a chat format's (chat_formats.ChatTurn): its tool-call grammar's start, lazy from the first of
    # these (patterns the text matches, token ids) on; its thinking tags (start, ends), for the budget;
    # and the text the template put after the last message, which the grammar and the budget have seen
    grammar_triggers: tuple[tuple[str, ...], tuple[int, ...]] | None = field(default=None, metadata=_flag(None))
    thinking_tags: tuple[str, tuple[str, ...]] | None = field(default=None, metadata=_flag(None))
    generation_prompt: str = field(default="", metadata=_flag(None))

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))  # a mapping given: its pairs
        if isinstance(self.dry_sequence_breakers, list):  # as a JSON request gives them
            object.__setattr__(self, "dry_sequence_breakers", tuple(self.dry_sequence_breakers))
        if self.samplers is not None:
            object.__setattr__(self, "samplers", sampler_order(self.samplers))

    @classmethod
    def of(cls, keywords: dict, **defaults) -> "SamplingParams":
        """The settings from keyword arguments (None: the default), over `defaults`; checked. A
        json_schema may be a dict; OpenAI's response_format gives a grammar or a json_schema."""
        keywords = dict(keywords)
        keywords.update(response_format_keywords(keywords.pop("response_format", None)))
        if keywords.get("json_schema") is not None:
            keywords["json_schema"] = schema_text(keywords["json_schema"])
        given = {name: value for name, value in {**defaults, **keywords}.items() if value is not None}
        unknown = sorted(set(given) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r} (sampling takes "
                            f"{', '.join(f.name for f in dataclasses.fields(cls))})")
        params = cls(**given)
        params.validate()
        return params

    def validate(self) -> None:
        for f in dataclasses.fields(self):  # the annotations are text (postponed); the seed's range: below
            kind, bound = {"float": (numbers.Real, None), "int": (numbers.Integral, 2**31),
                           "int | None": (numbers.Integral, None)}.get(f.type, (None, None))
            value = getattr(self, f.name)
            if kind is not None and value is not None and (isinstance(value, bool) or not isinstance(value, kind)
                                                           or bound is not None and abs(value) >= bound):
                raise InvalidOptionError(f"{f.name} must be {'a number' if kind is numbers.Real else 'an integer'}"
                                         f"{f' within 32 bits' if bound else ''}, got {value!r}"[:200])
        if not _finite(self.temperature):
            raise InvalidOptionError(f"temperature must be a finite number, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:  # 0: the most likely token alone (llama.cpp keeps one), as OpenAI's range
            raise InvalidOptionError(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0.0 < self.typical_p <= 1.0:
            raise InvalidOptionError(f"typical_p must be in (0, 1], got {self.typical_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidOptionError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (_finite(self.repeat_penalty) and self.repeat_penalty > 0.0):
            raise InvalidOptionError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not _finite(getattr(self, name)):
                raise InvalidOptionError(f"{name} must be a finite number, got {getattr(self, name)}")
        for name in ("penalty_last_n", "dry_penalty_last_n"):
            if getattr(self, name) < WHOLE_CONTEXT:
                raise InvalidOptionError(f"{name} (the window of recent tokens) must be >= -1 (0: off, -1: the "
                                         f"context), got {getattr(self, name)}")
        if self.mirostat_mode not in (0, 1, 2):
            raise InvalidOptionError(f"mirostat_mode must be 0 (off), 1 or 2, got {self.mirostat_mode}")
        for name in ("mirostat_tau", "mirostat_eta", "dry_multiplier", "dry_base", "xtc_probability", "xtc_threshold",
                     "dynatemp_range", "dynatemp_exponent", "dry_allowed_length"):
            if not (_finite(getattr(self, name)) and getattr(self, name) >= 0.0):
                raise InvalidOptionError(f"{name} must be a number >= 0, got {getattr(self, name)}")
        if not _finite(self.top_n_sigma):
            raise InvalidOptionError(f"top_n_sigma must be a finite number, got {self.top_n_sigma}")
        if not (isinstance(self.dry_sequence_breakers, (list, tuple))
                and all(isinstance(b, str) and b for b in self.dry_sequence_breakers)):
            raise InvalidOptionError(f"dry_sequence_breakers must be a list of non-empty strings, got "
                                     f"{self.dry_sequence_breakers!r}"[:200])
        if hasattr(self.draft_model, "create_completion"):  # a Llama or an Engine: called, it ran a whole completion
            raise InvalidOptionError("draft_model is a drafter, f(input_ids) -> token ids (LlamaPromptLookupDecoding, "
                                     "...), not a model: pyedgemoe runs no draft model (llama.cpp's -md)")
        processors = self.logits_processor if isinstance(self.logits_processor, (list, tuple)) else [self.logits_processor]
        for name, hooks in (("logits_processor", processors), ("stopping_criteria", [self.stopping_criteria]),
                            ("draft_model", [self.draft_model]), ("prompt_logits", [self.prompt_logits])):
            if getattr(self, name) is not None and not all(callable(hook) for hook in hooks):
                raise InvalidOptionError(f"{name} must be callable (f(input_ids{'' if name == 'draft_model' else ', logits'}"
                                         f")), got {getattr(self, name)!r}"[:200])
        if self.reasoning_control is not None and not callable(getattr(self.reasoning_control, "is_set", None)):
            raise InvalidOptionError(f"reasoning_control must be a threading.Event, got {self.reasoning_control!r}"[:200])
        if self.reasoning_budget_tokens < -1:
            raise InvalidOptionError(f"reasoning_budget_tokens must be >= -1 (-1: unrestricted), got "
                                     f"{self.reasoning_budget_tokens}")
        if self.seed is not None and not RANDOM_SEED <= self.seed < 2**32:
            raise InvalidOptionError(f"seed must be in [0, 2^32), or -1 for a random one, got {self.seed}")
        for name in ("grammar", "json_schema", "reasoning_budget_message", "generation_prompt"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidOptionError(f"{name} must be text, got {getattr(self, name)!r}")
            try:
                utf8(getattr(self, name) or "")
            except InvalidOptionError as e:
                raise InvalidOptionError(f"{name}: {e}") from None
        if self.grammar is not None and self.json_schema is not None:
            raise InvalidOptionError("give either a grammar or a json_schema (response_format), not both")
        if self.grammar is not None:
            check_grammar(self.grammar)
        if self.json_schema is not None:
            check_schema(self.json_schema)

    def grammar_text(self) -> str:
        """The GBNF that constrains the text: the grammar, or the JSON schema's; "" for none."""
        return schema_grammar(self.json_schema) if self.json_schema is not None else self.grammar or ""

    def within(self, n_ctx: int) -> "SamplingParams":
        """These settings with the windows of WHOLE_CONTEXT given as n_ctx tokens, as llama.cpp's
        common arguments and llama-server resolve them."""
        return dataclasses.replace(self, **{name: n_ctx for name in ("penalty_last_n", "dry_penalty_last_n")
                                            if getattr(self, name) == WHOLE_CONTEXT})

    def sampler(self, model, n_ctx: int, default_seed: int | None, prompt: list[int]) -> TokenSampler:
        """A sampler of these settings within a context of n_ctx tokens (the seed: its own, else
        default_seed, else a random one) whose native chain has seen the prompt's last
        penalty_last_n tokens (with penalize_prompt)."""
        return self.within(n_ctx)._sampler(model, default_seed, prompt)

    def _sampler(self, model, default_seed: int | None, prompt: list[int]) -> TokenSampler:
        seed = next((s for s in (self.seed, default_seed) if s is not None), RANDOM_SEED)
        grammar = self.grammar_text()
        try:
            chain = _native.Sampler(model, self.temperature, self.top_k, self.top_p, self.min_p, self.typical_p,
                                    self.repeat_penalty, self.frequency_penalty, self.presence_penalty,
                                    self.penalty_last_n, random.getrandbits(32) if seed == RANDOM_SEED else seed, grammar,
                                    self.logit_bias, self.mirostat_mode, self.mirostat_tau, self.mirostat_eta,
                                    self.grammar_triggers is not None, *(self.grammar_triggers or ((), ())),
                                    self.generation_prompt, self.dry_multiplier, self.dry_base, self.dry_allowed_length,
                                    self.dry_penalty_last_n, list(self.dry_sequence_breakers), self.xtc_probability,
                                    self.xtc_threshold, self.top_n_sigma, self.dynatemp_range, self.dynatemp_exponent,
                                    self.samplers.split(";") if self.samplers else [], self.reasoning_budget_tokens,
                                    *(self.thinking_tags or ("", ())), self.reasoning_budget_message or "",
                                    self.reasoning_control is not None)
        except InvalidOptionError as e:
            raise InvalidOptionError(f"logit_bias: {e}") from None
        except ValueError as e:
            raise InvalidOptionError(f"{'json_schema' if self.json_schema is not None else 'grammar'}: {e}") from None
        seen = max(self.penalty_last_n, self.dry_penalty_last_n)  # what the penalties and DRY keep of the prompt
        for t in prompt[-seen:] if seen > 0 and self.penalize_prompt else []:
            chain.accept_prompt(t)
        return TokenSampler(chain, self.logits_processor, self.stopping_criteria, self.reasoning_control)


def sampler_order(value) -> str:
    """An order of samplers as llama.cpp takes it (names separated by ';', a list of names, or
    llama-server's letters, "kpt"), as its names separated by ';'; each once."""
    if isinstance(value, str):
        letters = {letter: name for name, letter in SAMPLER_NAMES.items()}
        parts = [letters.get(c) for c in value] if ";" not in value and value and all(c in letters for c in value) \
            else value.split(";")
    else:
        parts = list(value) if isinstance(value, (list, tuple)) else [None]
    # None: not a name
    names = [_SAMPLER_ALIASES.get(p.lower(), p.lower()) if isinstance(p, str) else None for p in parts]
    unknown = [n for n in names if n not in SAMPLER_NAMES]
    if unknown or not names or len(set(names)) != len(names):
        raise InvalidOptionError(f"samplers must be llama.cpp's samplers, each once, in an order: "
                                 f"{', '.join(SAMPLER_NAMES)} (or their letters, {''.join(SAMPLER_NAMES.values())}); "
                                 f"got {value!r}"[:300])
    return ";".join(names)


def _bias_pairs(logit_bias) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs of a logit_bias mapping (or pairs), by token id; keys may be the ids'
    text, as OpenAI's JSON and llama-cpp-python take them."""
    try:
        items = logit_bias.items() if isinstance(logit_bias, dict) else iter(logit_bias)
        pairs = sorted((_bias_token(token), float(bias)) for token, bias in items)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidOptionError(f"logit_bias must map token ids to numbers: {e}") from None
    nan = next((token for token, bias in pairs if np.isnan(bias)), None)
    if nan is not None:
        raise InvalidOptionError(f"logit_bias: the bias of token {nan} is not a number")
    return tuple(pairs)


def _bias_token(token) -> int:
    if isinstance(token, bool) or not isinstance(token, (int, np.integer, str)) or not -2**31 <= int(token) < 2**31:
        raise TypeError(f"{token!r} is not a token id")
    return int(token)


def _finite(value: float) -> bool:
    """Whether value is a finite number (an integer past a float's range is not; numpy's isfinite raised)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


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
    n_draft_tokens: int = 0  # guessed tokens the model checked (speculative decoding)
    n_draft_accepted: int = 0  # of them, those its picks agreed with

    @property
    def prefill_tokens_per_second(self) -> float:
        n = self.n_prompt_tokens - self.n_cached_prompt_tokens
        return n / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.n_decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def llama_server_timings(self, predicted: int) -> dict:
        """llama-server's `timings` of this generation, which picked `predicted` tokens; with speculative
        decoding, the guessed tokens checked and taken."""
        prompt_n, prompt_ms, predicted_ms = self.n_prompt_tokens - self.n_cached_prompt_tokens, \
            self.prefill_seconds * 1e3, self.decode_seconds * 1e3
        drafts = {"draft_n": self.n_draft_tokens, "draft_n_accepted": self.n_draft_accepted} if self.n_draft_tokens \
            else {}
        return {"cache_n": self.n_cached_prompt_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                "prompt_per_second": self.prefill_tokens_per_second, "predicted_n": predicted,
                "predicted_ms": predicted_ms, "predicted_per_token_ms": predicted_ms / predicted if predicted else 0.0,
                "predicted_per_second": predicted / self.decode_seconds if self.decode_seconds > 0 else 0.0, **drafts}

    def add(self, other: "GenerationStats") -> None:
        """Counts other's tokens and time in these (totals)."""
        self.n_prompt_tokens += other.n_prompt_tokens
        self.n_cached_prompt_tokens += other.n_cached_prompt_tokens
        self.prefill_seconds += other.prefill_seconds
        self.n_decoded += other.n_decoded
        self.decode_seconds += other.decode_seconds
        self.n_draft_tokens += other.n_draft_tokens
        self.n_draft_accepted += other.n_draft_accepted

    def to_dict(self) -> dict:
        return {
            "n_prompt_tokens": self.n_prompt_tokens,
            "n_cached_prompt_tokens": self.n_cached_prompt_tokens,
            "prefill_seconds": self.prefill_seconds,
            "prefill_tokens_per_second": self.prefill_tokens_per_second,
            "n_decoded": self.n_decoded,
            "decode_seconds": self.decode_seconds,
            "decode_tokens_per_second": self.decode_tokens_per_second,
            "n_draft_tokens": self.n_draft_tokens,
            "n_draft_accepted": self.n_draft_accepted,
        }


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's output (before sampling changed it:
    llama-cpp-python's and OpenAI's logprobs), and the n most likely tokens', most likely first."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def logits_to_logprobs(logits, axis: int = -1) -> np.ndarray:
    """Log-softmax along axis in float32, as llama-cpp-python's Llama.logits_to_logprobs (where the
    largest value is not finite, the values are not shifted)."""
    maxs = np.amax(logits, axis=axis, keepdims=True)
    shifted = np.subtract(logits, np.where(np.isfinite(maxs), maxs, 0), dtype=np.single)
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def token_logprob(logits: np.ndarray, token: int, n: int) -> TokenLogprob:
    """TokenLogprob of token from one row of logits (logits_to_logprobs); ties in the top n go to the
    larger token id, as llama-cpp-python's sort does."""
    logprobs = logits_to_logprobs(np.asarray(logits, dtype=np.float32))
    ids = np.argpartition(-logprobs, n)[:n + 1] if 0 < n < len(logprobs) else np.arange(len(logprobs) if n else 0)
    top = sorted(((float(logprobs[i]), int(i)) for i in ids), reverse=True)[:n]
    return TokenLogprob(int(token), float(logprobs[token]), tuple((i, lp) for lp, i in top))


def as_token_ids(value, name: str = "tokens") -> list[int]:
    """value, a sequence of token ids, as a list of ints; InvalidOptionError for anything else (an id
    outside the vocabulary is the native side's to refuse, naming the vocabulary's size)."""
    ids = list(value) if isinstance(value, (list, tuple, np.ndarray)) else None
    if ids is None or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
        raise InvalidOptionError(f"{name} must be {'text or ' if name == 'prompt' else ''}token ids (integers), got "
                                 f"{value!r}"[:200])
    if any(not -2**31 <= t < 2**31 for t in ids):
        raise InvalidOptionError(f"{name}: a token id is beyond 32 bits: {max(ids, key=abs)}")
    return [int(t) for t in ids]


def longest_token_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens a and b share from the start (llama-cpp-python's Llama.longest_token_prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def shared_prefix(held: list[int], prompt: list[int]) -> int:
    """How many of prompt's tokens a KV cache holding held can keep: their common prefix, short of
    prompt's last token (evaluated again, for its logits)."""
    return longest_token_prefix(held, prompt[:-1])


@dataclass
class KVSequence:
    """One sequence of a context's KV cache: its id and the tokens it holds, position by position."""
    seq: int
    tokens: list[int] = field(default_factory=list)
    busy: bool = False  # a generation runs on it (the batcher's)
    checkpoints: object = None  # its context checkpoints (context_checkpoints.Checkpoints), where kept


@dataclass(frozen=True)
class SequenceState:
    """What a KVSequence held, to restore (Engine.save_state, load_state): its tokens and its KV
    cache as llama.cpp saves a sequence (llama_state_seq_get_data), and the model's identity (the
    KV cache of another model of the same shapes loads, and gives garbage). "": a state pickled
    before it was recorded."""
    tokens: tuple[int, ...]
    kv: bytes
    model: str = ""


@dataclass(frozen=True)
class PromptProgress:
    """How far a prompt's evaluation is, as llama-server's prompt_progress: its tokens (total), those
    the sequence held already (cache), those held and evaluated so far (processed), and the time since
    it began."""
    total: int
    cache: int
    processed: int
    ms: float

    def llama_server(self) -> dict:
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": int(self.ms)}

    def stats(self) -> "GenerationStats":
        """The evaluation so far as a generation's stats (nothing generated yet)."""
        return GenerationStats(n_prompt_tokens=self.processed, n_cached_prompt_tokens=self.cache,
                               prefill_seconds=self.ms / 1e3)


class Generation:
    """One generation on one KVSequence: prefill() evaluates the prompt and picks the first token;
    then, while more() is true, the model evaluates next_inputs() and verified() gives the picks
    from its outputs. A pick is None when the generation ends there (timings.finish_reason says why).

    budget: tokens to generate at most. fresh: reuse no prefix of what the sequence holds.
    feed_tokens (benchmarks): after the i-th pick, feed feed_tokens[i] to the model instead.
    n_probs: record each generated token's TokenLogprob with the n_probs most likely (logprobs);
    None: none. draft: a drafter (speculative.py) whose guesses are checked with each input.
    prompt_logits: SamplingParams.prompt_logits. progress: prefill() yields how far it is."""

    def __init__(self, decoder, prompt: list[int], budget: int, sampler, ignore_eos: bool,
                 timings: GenerationStats, fresh: bool, feed_tokens: list[int] | None = None,
                 n_probs: int | None = None, draft=None, prompt_logits=None, progress: bool = False):
        if draft is not None and (feed_tokens is not None or decoder.no_drafts):
            raise InvalidOptionError(f"speculative decoding (draft_model) cannot run here: "
                                     f"{decoder.no_drafts or 'feed_tokens feeds tokens of its own'}")
        self.decoder = decoder
        self.prompt = prompt
        self.budget = budget
        self.sampler = sampler
        self.ignore_eos = ignore_eos
        self.timings = timings
        self.fresh = fresh
        self.feed_tokens = feed_tokens
        self.n_probs = n_probs
        self.draft = draft
        self.prompt_logits = prompt_logits
        self.progress = progress
        self.control = DraftControl()  # what drafting earns, and how much of a guess to check
        self.logprobs: list[TokenLogprob] = []  # of each generated token, with n_probs
        self.end: tuple[int, TokenLogprob | None] | None = None  # the end-of-generation token picked, not yielded
        self._pick_logprob: TokenLogprob | None = None  # the last pick's, until it is taken
        self.sequence: KVSequence | None = None
        self._last = -1  # the token picked last
        self._fed = -1  # the token evaluated at the step in flight
        self._guess: list[int] = []  # the drafted tokens evaluated after it
        self._history = np.zeros(1, dtype=np.intc)  # the drafter's input: the sequence's tokens, then _fed
        self._ready: deque[int | None] = deque()  # verified picks step() has not handed out yet
        self._decode_start = 0.0

    def prefill(self, sequence: KVSequence) -> Generator[PromptProgress, None, int | None]:
        """Evaluates the prompt on sequence, keeping the prefix it shares with what the sequence holds
        (none when fresh; at least the prompt's last token is evaluated again, for its logits), and
        picks the first token: a generator that returns the pick and, with progress, yields a
        PromptProgress as the evaluation begins and after each llama_decode."""
        start = time.perf_counter()
        self.sequence = sequence
        reuse = self.decoder.keep(sequence, 0 if self.fresh else shared_prefix(sequence.tokens, self.prompt))
        evaluation = self.decoder.prefill(self.prompt[reuse:], sequence, self.prompt_logits is not None)
        evaluated = 0
        while True:
            if self.progress:
                yield PromptProgress(len(self.prompt), reuse, reuse + evaluated, (time.perf_counter() - start) * 1e3)
            try:
                evaluated = next(evaluation)
            except StopIteration as done:
                logits = done.value
                break
        sequence.tokens[:] = self.prompt
        if self.prompt_logits is not None:
            self.prompt_logits(self.prompt, logits)
        self.timings.n_cached_prompt_tokens = reuse
        self.timings.prefill_seconds = time.perf_counter() - start
        self._decode_start = time.perf_counter()
        return self._take(self._sample())

    def more(self) -> bool:
        """Whether the budget allows another token after the last pick."""
        return self.timings.n_decoded < self.budget

    def next_inputs(self, max_guess: int | None = None) -> list[tuple[int, int]]:
        """(token, position)s the model evaluates next: the last pick (or the token fed instead),
        then the drafter's guess of what follows, within the budget and max_guess tokens."""
        self._fed = self._last if self.feed_tokens is None else self.feed_tokens[self.timings.n_decoded - 1]
        pos = len(self.sequence.tokens)
        room = self.budget - self.timings.n_decoded - 1  # a fully verified guess adds one pick after it
        size = self.control.size() if self.draft is not None and room > 0 else 0
        size = min(size, room, max_guess if max_guess is not None else room)
        self._guess = self._drafted(size) if size > 0 else []
        return [(t, pos + i) for i, t in enumerate([self._fed] + self._guess)]

    def _drafted(self, size: int) -> list[int]:
        tokens, known = self.sequence.tokens, len(self._history) - 1  # the sequence only grows meanwhile
        self._history = np.concatenate((self._history[:known], np.array(tokens[known:] + [self._fed], dtype=np.intc)))
        guess = as_token_ids(self.draft(self._history), "draft_model's guess")
        if any(not 0 <= t < self.decoder.model.n_vocab for t in guess):
            raise InvalidOptionError(f"draft_model guessed a token id outside the vocabulary of "
                                     f"{self.decoder.model.n_vocab}: {guess[:16]}")
        return guess[:size]

    def _sample(self, i: int = -1) -> int:
        """The sampler's pick after the tokens the sequence holds, from output i of the last decode
        (-1: its last), its TokenLogprob noted with n_probs."""
        token = self.decoder.sample(self.sampler, self.sequence.tokens, i)
        if self.n_probs is not None:
            self._pick_logprob = token_logprob(self.decoder.output_logits(i), token, self.n_probs)
        return token

    def verified(self, first: int, seconds: float) -> list[int | None]:
        """After the model evaluated next_inputs() (now in the sequence) in `seconds`, the picks from
        its outputs first, first + 1, ... (-1: the last decode's last, with no guess): the picks that
        agree with the guess, then the first that does not (or the one after the whole guess); None
        last where the generation ends. The guess's rejected tokens leave the KV cache."""
        guess, self._guess = self._guess, []
        self.sequence.tokens.append(self._fed)
        picks = []
        for j in range(len(guess) + 1):
            picks.append(self._take(self._sample(first + j)))
            if picks[-1] is None or j == len(guess) or picks[-1] != guess[j]:
                break
            self.sequence.tokens.append(guess[j])
        taken = len(picks) - 1  # the picks before the last agreed with the guess
        if self.draft is not None:
            self.control.record(len(guess), taken, seconds)
        if guess:
            self.timings.n_draft_tokens += len(guess)
            self.timings.n_draft_accepted += taken
            n = len(self.sequence.tokens)
            if taken < len(guess) and self.decoder.keep(self.sequence, n) != n:  # the plan refuses such models
                raise ModelLoadError("speculative decoding: the model's memory could not drop the rejected guess")
        return picks

    def step(self) -> int | None:
        """One sequence alone: the next pick, or None at the end. Time spent by the consumer between
        two steps does not count as decode time."""
        self._decode_start = time.perf_counter() - self.timings.decode_seconds
        if not self._ready:
            if not self.more():
                return self._finish("length")
            inputs = self.next_inputs()
            start = time.perf_counter()
            if len(inputs) == 1:
                self.decoder.decode([inputs[0][0]], inputs[0][1], self.sequence)
            else:
                self.decoder.decode_step([t for t, _ in inputs], [p for _, p in inputs], [self.sequence] * len(inputs))
            self._ready.extend(self.verified(-1 if len(inputs) == 1 else 0, time.perf_counter() - start))
        return self._ready.popleft()

    def _take(self, token: int) -> int | None:
        """The stop rules: the budget spent (before the pick: max_tokens 0), an end-of-generation token,
        the sampler's stopping criteria."""
        if not self.more():
            return self._finish("length")
        if not self.ignore_eos and self.decoder.is_eog(token):
            self.end = (token, self._pick_logprob)
            return self._finish("stop")
        if self.sampler.stopped:
            return self._finish("stop")
        self.timings.n_decoded += 1
        self.timings.decode_seconds = time.perf_counter() - self._decode_start
        if self._pick_logprob is not None:
            self.logprobs.append(self._pick_logprob)
        self._last = token
        return token

    def _finish(self, reason: str) -> None:
        self.timings.finish_reason = reason
        self.timings.decode_seconds = time.perf_counter() - self._decode_start
        return None
