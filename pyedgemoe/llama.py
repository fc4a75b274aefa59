"""Llama: llama-cpp-python's high-level class, in front of pyedgemoe's Engine.

Code written for `llama_cpp.Llama` runs with one import changed:

    from pyedgemoe import Llama
    llm = Llama(model_path="model.gguf", n_ctx=2048)
    llm("Q: Name the planets in the solar system? A: ", max_tokens=32, stop=["Q:", "\\n"])
    llm.create_chat_completion(messages=[{"role": "user", "content": "Hi"}],
                               response_format={"type": "json_object"})   # or a grammar=, a JSON schema
    llm = Llama("model.gguf", expert_cache="25%", system="hobbit")   # pyedgemoe's own keywords

The arguments and defaults are llama-cpp-python 0.3's. An argument pyedgemoe has no counterpart
for is refused with InvalidOptionError when given a value other than its default, never ignored
(the UNSUPPORTED_* tables below); those of earlier llama-cpp-python versions that 0.3 ignores are
ignored here too (IGNORED_LEGACY_ARGS). As there, a call that uses the context goes ahead of a
stream left open (_Stream).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import random
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generator, Iterator

import gguf
import numpy as np

from pyedgemoe import chatml_function_calling, completions, embeddings, named_chat_formats, rope_scaling
from pyedgemoe.completions import chat_prompt_tokens, completion_logprobs
from pyedgemoe.engine import Engine
from pyedgemoe.errors import ContextOverflowError, EngineBusyError, InvalidOptionError
from pyedgemoe.expert_options import OPTION_NAMES
from pyedgemoe.fill_in_middle import completion_prompt
from pyedgemoe.generation import (SamplingParams, SequenceState, TokenLogprob, as_token_ids, exposed_fields,
                                  logits_to_logprobs, longest_token_prefix, token_logprob)
from pyedgemoe.model_source import hub_download
from pyedgemoe.native_exit import closed_error
from pyedgemoe.structured_output import schema_grammar
from pyedgemoe.tool_calls import from_functions
from pyedgemoe.vocabulary import Vocabulary, VocabularyFile

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama-cpp-python's default seed

# llama_cpp.Llama.__init__'s arguments with no counterpart here, and their defaults there
UNSUPPORTED_INIT_ARGS: dict[str, object] = {
    "split_mode": 1, "main_gpu": 0, "attention_type": -1,
    "offload_kqv": True, "op_offload": None,
    "no_perf": False, "lora_base": None,
    "numa": False, "tokenizer": None,
}
# arguments of earlier llama-cpp-python versions that 0.3 takes and ignores (**kwargs; LangChain's LlamaCpp
# still passes n_parts and f16_kv): ignored here too, but f16_kv=False, which asked for an F32 KV cache
IGNORED_LEGACY_ARGS = ("n_parts", "f16_kv", "n_gqa", "rms_norm_eps", "low_vram", "mul_mat_q")
# the sampling and output arguments of create_completion / create_chat_completion the Engine lacks
# (tail-free sampling, tfs_z, left llama.cpp; llama-cpp-python takes the argument and ignores it)
UNSUPPORTED_COMPLETION_ARGS: dict[str, object] = {"tfs_z": 1.0}
# those of generate and sample (penalize_nl is accepted: llama-cpp-python ignores it too)
UNSUPPORTED_GENERATE_ARGS: dict[str, object] = {"tfs_z": 1.0}
UNSUPPORTED_CHAT_ARGS: dict[str, object] = {"tfs_z": 1.0}
# llama-cpp-python's sampler chain at a temperature below 0 (its _init_sampler): a pick from the whole
# distribution after the penalties, the logit bias and the grammar; the other samplers at "off"
WHOLE_DISTRIBUTION = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0,
                      "mirostat_mode": 0}
# the sampling settings of Llama's methods besides those with a CLI flag (generation.exposed_fields)
_PYTHON_SAMPLING = ("logit_bias", "logits_processor", "stopping_criteria")

# what Llama passes on to the Engine: its keywords and the expert options
_ENGINE_KEYWORDS = (set(inspect.signature(Engine.__init__).parameters) - {"self", "model_path", "options"}) \
    | set(OPTION_NAMES)


def refuse_unsupported(where: str, defaults: dict[str, object], given: dict[str, object]) -> None:
    """InvalidOptionError naming every argument of `given` that differs from its llama-cpp-python default."""
    changed = [f"{name}={value!r}" for name, value in given.items() if not _is_default(value, defaults[name])]
    if changed:
        raise InvalidOptionError(f"{where}: pyedgemoe does not support llama-cpp-python's {', '.join(changed)} "
                                 "(leave them at their defaults)")


def _is_default(value: object, default: object) -> bool:
    try:
        return bool(value == default)
    except (TypeError, ValueError):  # numpy arrays and the like compare elementwise: not a default
        return False


def _kv_type(type_k: int | None, type_v: int | None) -> str | None:
    """The Engine's kv_type for llama-cpp-python's ggml type ids (None: f16); one type for K and V."""
    if type_k is None and type_v is None:
        return None
    f16 = int(gguf.GGMLQuantizationType.F16)
    k, v = (f16 if t is None else t for t in (type_k, type_v))
    if k != v:
        raise InvalidOptionError(f"type_k={type_k!r} and type_v={type_v!r} differ: pyedgemoe's KV cache has one "
                                 "element type for both (kv_type=...)")
    try:
        return gguf.GGMLQuantizationType(k).name.lower()
    except ValueError:
        raise InvalidOptionError(f"type_k/type_v {k!r} is not a ggml type id") from None


class _EmbeddingsOff(InvalidOptionError, RuntimeError):
    """embed() of a Llama made without embedding=True: llama-cpp-python's RuntimeError too."""


def _takes_the_context(method):
    """A Llama method that uses the context: as in llama-cpp-python, it goes ahead of the streams left open."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        while not self._streams.end_for_a_call():
            time.sleep(0.001)  # one being read on another thread: it ends when its step is done
        return method(self, *args, **kwargs)
    return call


def _stock_overflow(method):
    """A Llama method's prompt that does not fit the context, in llama-cpp-python's words: its server
    (llama_cpp/server/errors.py) and programs parse "Requested tokens (N) exceed context window of M"."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except ContextOverflowError as e:
            if not e.n_ctx:  # not a prompt's
                raise
            raise ContextOverflowError(f"Requested tokens ({e.n_prompt_tokens}) exceed context window of {e.n_ctx}",
                                       e.n_prompt_tokens, e.n_ctx) from None
    return call


class _Stream:
    """A stream a Llama returned (completion or chat chunks, generate's tokens). In llama-cpp-python a
    call goes ahead of a stream still open (a loop left by break, a client gone): the Llama's next
    call that uses the context ends it here, on whichever thread (one being read on another thread
    at that instant, when its step is done). Read after that, it raises EngineBusyError."""

    def __init__(self, items: Generator):
        self._items, self._ended_by_a_call = items, False
        self._reader: int | None = None  # the thread reading it this instant
        self._end_asked = False  # a call waits for it to end (end_for_a_call): its reader ends it

    def __iter__(self) -> "_Stream":
        return self

    def __next__(self):
        return self.send(None)

    def send(self, value):
        if self._end_asked and not self._ended_by_a_call:
            with contextlib.suppress(ValueError):  # "already executing": the waiting call closes it this instant
                self._items.close()
            self._ended_by_a_call = True
        if self._ended_by_a_call:
            raise EngineBusyError("this stream was ended by a later call of its Llama, which took the context")
        self._reader = threading.get_ident()
        try:
            return self._items.send(value)
        finally:
            self._reader = None

    def close(self) -> None:
        self._items.close()

    def end_for_a_call(self) -> bool:
        """Whether the stream is over now (False: it is being read this instant, on another thread)."""
        if inspect.getgeneratorstate(self._items) == inspect.GEN_CLOSED or self._reader == threading.get_ident():
            return True  # over, or the call is the stream's own (a prompt cache's save at its end)
        try:
            self._items.close()
        except ValueError:  # "generator already executing": its reader ends it before its next step
            self._end_asked = True
            return False
        self._ended_by_a_call = True
        return True


class _OpenStreams:
    """The streams a Llama returned, held weakly (one dropped closes itself). Every one is ended by a
    call that takes the context, also while that call waits for the Engine's turn (Engine.while_waiting):
    a stream started on another thread after the call's check holds the turn until it is ended."""

    def __init__(self):
        self._streams: weakref.WeakSet[_Stream] = weakref.WeakSet()
        self._lock = threading.Lock()  # streams are added and ended from any thread

    def add(self, stream: _Stream) -> None:
        with self._lock:
            self._streams.add(stream)

    def end_for_a_call(self) -> bool:
        """Ends each stream still open; whether all are over (False: one is being read this instant,
        on another thread: it ends before its next step)."""
        with self._lock:
            streams = list(self._streams)
        return all([stream.end_for_a_call() for stream in streams])  # a list: each one asked


def _keeping_prompt_rows(sampling: dict, rows: list) -> dict:
    """sampling, the prompt's logits (as the generation evaluates it) appended to rows too."""
    given = sampling.get("prompt_logits")

    def keep(input_ids, logits):
        rows.append(np.array(logits))
        if given is not None:
            given(input_ids, logits)
    return {**sampling, "prompt_logits": keep}


def _generator(stream: _Stream) -> Generator:
    """A stream as a Llama returns it: a generator, as llama-cpp-python's are (inspect.isgenerator)."""
    return (yield from stream)


class Llama:
    """A GGUF model, used the way llama_cpp.Llama is; `engine` is the pyedgemoe Engine behind it.

    Supported from llama-cpp-python: model_path, n_ctx (0: the model's training context), n_batch
    (tokens per llama_decode), n_ubatch (tokens llama.cpp computes at once, at most n_batch; 0: n_batch),
    n_threads, n_threads_batch, seed, flash_attn, type_k == type_v, verbose, n_gpu_layers (the
    Engine's and the CLI's -ngl: 0 the CPU, unless pyedgemoe's mode is given; -1 or > 0 the GPU
    where the build has one, mode auto, else the CPU, as llama-cpp-python runs), last_n_tokens_size
    (the penalties' window over the generated tokens), use_mmap (False:
    the weights read into memory), use_mlock (the weights and the expert cache locked in memory),
    kv_overrides (the model's metadata replaced at load: pyedgemoe.kv_overrides), rope_scaling_type,
    rope_freq_base, rope_freq_scale and yarn_* (RoPE scaling: pyedgemoe.rope_scaling), lora_path and
    lora_scale (a LoRA adapter: pyedgemoe.lora), embedding (True
    lets embed / create_embedding run, as there), pooling_type (llama.cpp's LLAMA_POOLING_TYPE_*:
    a vector per text, pyedgemoe.embeddings), logits_all (True keeps the logits of every token
    evaluated, by eval() or a generation, in scores and eval_logits, as there; logprobs need no logits_all here),
    chat_format (None: as llama-cpp-python chooses, llama-2 for a model without a template, its formatter
    of a template it knows, else the model's template; "chat_template.default" where it has one;
    llama-cpp-python's named formats, pyedgemoe.named_chat_formats, and "chatml-function-calling",
    pyedgemoe.chatml_function_calling; as there an attribute read at each chat), chat_handler (a handler
    of llama-cpp-python's, text-only, which answers every chat in place of the format's) and draft_model
    (speculative decoding by a drafter such as LlamaPromptLookupDecoding, pyedgemoe.speculative's or
    llama_cpp.llama_speculative's: its guesses are checked in one batch, the tokens those of the picks),
    spm_infill (create_completion's suffix after the prefix: the suffix first, pyedgemoe.fill_in_middle),
    vocab_only (the vocabulary alone, no weights: tokenize, detokenize, the special tokens, metadata;
    what needs the weights raises InvalidOptionError). Any other keyword is pyedgemoe's own and goes to
    Engine: expert_cache, expert_options, system, mode, device, host_cache, kv_type,
    the expert options (io, prefetch, ...).
    """

    def __init__(self, model_path: str | os.PathLike, *, n_gpu_layers: int = 0, tensor_split: list | None = None,
                 use_mmap: bool = True, use_mlock: bool = False, last_n_tokens_size: int = 64,
                 kv_overrides: dict[str, bool | int | float | str] | None = None,
                 lora_path: str | None = None, lora_scale: float = 1.0,
                 seed: int = LLAMA_DEFAULT_SEED,
                 n_ctx: int = 512, n_batch: int = 512, n_ubatch: int = 512, n_threads: int | None = None,
                 n_threads_batch: int | None = None, logits_all: bool = False, embedding: bool = False,
                 pooling_type: int = -1, flash_attn: bool = False, chat_format: str | None = None,
                 type_k: int | None = None, type_v: int | None = None, draft_model=None, spm_infill: bool = False,
                 chat_handler: Callable | None = None, vocab_only: bool = False, swa_full: bool | None = None,
                 verbose: bool = True, **kwargs):
        self._arguments = {name: value for name, value in locals().items() if name not in ("self", "kwargs")} \
            | kwargs  # __getstate__'s
        self._streams = _OpenStreams()
        if kwargs.get("f16_kv") is False:
            raise InvalidOptionError("f16_kv=False (an F32 KV cache) is type_k=0, type_v=0 since llama-cpp-python 0.2")
        kwargs = {name: value for name, value in kwargs.items() if name not in IGNORED_LEGACY_ARGS}
        SamplingParams(penalty_last_n=last_n_tokens_size).validate()
        # llama-cpp-python's n_threads 0 and llama.cpp's -1: the default
        n_threads, n_threads_batch = (None if isinstance(n, int) and not isinstance(n, bool) and n <= 0 else n
                                      for n in (n_threads, n_threads_batch))
        unsupported = {name: kwargs.pop(name) for name in list(kwargs) if name in UNSUPPORTED_INIT_ARGS}
        refuse_unsupported("Llama", UNSUPPORTED_INIT_ARGS, unsupported)
        rope = rope_scaling.from_llama_cpp_python({name: kwargs.pop(name) for name in list(kwargs)
                                                   if name in rope_scaling.LLAMA_CPP_PYTHON_DEFAULTS})
        unknown = sorted(set(kwargs) - _ENGINE_KEYWORDS)
        if unknown:
            raise InvalidOptionError(f"Llama: unknown argument {unknown[0]!r} (neither llama-cpp-python's nor "
                                     "pyedgemoe.Engine's)")
        # llama-cpp-python's seed: a generation given none takes the next of the sequence it starts
        # (_take_seed), so that a program's sampled outputs are the same on every run, as there
        self._seed = seed or LLAMA_DEFAULT_SEED
        # a path that is none: the Engine's ModelLoadError
        self.model_path = os.fspath(model_path) if isinstance(model_path, (str, os.PathLike)) else model_path
        self.verbose, self.embedding = verbose, embedding
        self.spm_infill = spm_infill  # a suffix's fill in the middle: the suffix first
        # llama-cpp-python's attributes of its arguments (numa: ggml's strategy, 0 off; lora_base: none here)
        self.kv_overrides, self.tensor_split, self.numa = kv_overrides, tensor_split, 0
        self.lora_base, self.lora_path, self.lora_scale = None, lora_path, lora_scale
        self.cache = None  # set_cache's
        self.last_n_tokens_size = last_n_tokens_size  # the penalties' window, as there (-1: the context)
        # logits_all: scores, made at its first use; row i the logits after the first i + 1 tokens of
        # _scored (NaN: not computed)
        self._logits_all = logits_all
        self._scores: np.ndarray | None = None
        self._scored: list[int] = []
        self.chat_handler = _checked_handler(chat_handler)
        if isinstance(n_ctx, int) and n_ctx > 0 and isinstance(n_batch, int):
            n_batch = min(n_ctx, n_batch)  # as llama-cpp-python does
        self.n_batch, self._engine = n_batch, None
        if vocab_only:  # llama-tokenize's load: the vocabulary, no weights, no context
            self._vocab: Vocabulary = VocabularyFile(model_path, kv_overrides)
        else:
            if logits_all and "n_logits" not in kwargs:  # scores' rows: their memory counted at load
                kwargs["n_logits"] = _context_rows(model_path, n_ctx)
            self._engine = self._vocab = self._load_engine(
                model_path, dict(n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads_batch, n_batch=n_batch,
                                 n_ubatch=n_ubatch, flash_attn=flash_attn, draft_model=draft_model, swa_full=swa_full,
                                 verbose=verbose),
                n_gpu_layers, tensor_split, use_mmap, use_mlock, kv_overrides, lora_path, lora_scale, pooling_type,
                type_k, type_v, {**kwargs, **rope})
            self.model_path, self.n_batch = self.engine.model_path, self.engine.plan.n_batch
            self.engine.while_waiting = self._streams.end_for_a_call
            # the thread counts the run starts with (the defaults' fewer while the machine is busy)
            n_threads, n_threads_batch = self.engine.plan.n_threads, self.engine.plan.n_threads_batch
        self.n_threads, self.n_threads_batch = n_threads, n_threads_batch
        # as there, an attribute read at each chat: set later, it answers the chats from then on
        self.chat_format = chat_format if chat_format is not None or self.chat_handler is not None \
            else named_chat_formats.default_format(self._vocab.metadata.get("tokenizer.chat_template"))
        try:
            self._format_handler()
        except InvalidOptionError:
            self.close()
            raise

    @staticmethod
    def _load_engine(model_path, keywords: dict, n_gpu_layers, tensor_split, use_mmap, use_mlock, kv_overrides,
                     lora_path, lora_scale, pooling_type, type_k, type_v, kwargs: dict) -> Engine:
        """The Engine of llama-cpp-python's arguments (keywords: those the Engine takes as they are;
        kwargs: pyedgemoe's own)."""
        engine_kwargs = dict(kwargs)
        options = kwargs.get("expert_options")
        mode_given = kwargs.get("mode") is not None or (options is not None and "mode" in options.given)
        if not (n_gpu_layers == 0 and mode_given):  # llama-cpp-python's default of 0 gives way to a mode given
            engine_kwargs["n_gpu_layers"] = n_gpu_layers
        if tensor_split is not None:
            engine_kwargs["tensor_split"] = tensor_split
        if kv_overrides is not None:
            engine_kwargs["override_kv"] = kv_overrides
        pooling = embeddings.pooling_from_llama_cpp_python(pooling_type)
        if pooling is not None:
            engine_kwargs["pooling"] = pooling
        if lora_path is not None:  # llama.cpp's --lora-scaled FNAME:SCALE
            engine_kwargs["lora_scaled"] = [(lora_path, lora_scale)]
        if not use_mmap:  # True, llama.cpp's default, leaves it to the load plan (beside an expert cache: read)
            engine_kwargs["mmap"] = False
        if use_mlock:
            engine_kwargs["mlock"] = True
        kv_type = _kv_type(type_k, type_v)
        if kv_type is not None:
            if "kv_type" in kwargs:
                raise InvalidOptionError("give either type_k/type_v or kv_type, not both")
            engine_kwargs["kv_type"] = kv_type
        return Engine(model_path, **keywords, **engine_kwargs)

    def _format_handler(self) -> Callable | None:
        """The handler of chat_format (as there, the format set now): one of llama-cpp-python's formats',
        or None for the Engine's formatting (the model's template); a format neither is refused."""
        chat_format, template = self.chat_format, self._vocab.metadata.get("tokenizer.chat_template")
        if chat_format == chatml_function_calling.NAME:
            return chatml_function_calling.create_chat_completion
        if chat_format in named_chat_formats.FORMATTERS:
            return functools.partial(named_chat_formats.create_chat_completion, chat_format=chat_format)
        if chat_format is None or chat_format == "chat_template.default" and template is not None:
            return None
        raise InvalidOptionError(
            f"chat_format {chat_format!r} is not supported: give chat_format=None (as llama-cpp-python: the model's "
            f"own template, else {named_chat_formats.WITHOUT_TEMPLATE}){', chat_template.default' if template else ''}, "
            f"one of llama-cpp-python's {', '.join(named_chat_formats.FORMATTERS)} or {chatml_function_calling.NAME}")

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str, additional_files: list[str] | None = None,
                        local_dir: str | os.PathLike | None = None, local_dir_use_symlinks: bool | str = "auto",
                        cache_dir: str | os.PathLike | None = None, **kwargs) -> "Llama":
        """Downloads filename (a name or a glob such as "*q8_0.gguf") of a Hugging Face Hub repo, and
        additional_files, through huggingface_hub, then loads it; kwargs go to Llama(). The other
        shards of a split GGUF (its first shard named) come with it, additional_files or not.
        Offline (HF_HUB_OFFLINE=1) it uses the local cache."""
        if local_dir_use_symlinks != "auto":
            raise InvalidOptionError("local_dir_use_symlinks: huggingface_hub no longer supports it (leave it 'auto')")
        model_path = hub_download(repo_id, [filename, *(additional_files or [])], local_dir, cache_dir)[0]
        return cls(model_path=model_path, **kwargs)

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        """The pyedgemoe Engine behind this Llama (its stats(), logits(), ...)."""
        if self._engine is None:
            if isinstance(self._vocab, VocabularyFile) and not self._vocab.closed:
                raise InvalidOptionError("this Llama holds a vocabulary alone (vocab_only=True): what it was asked "
                                         "needs the model's weights (load it without vocab_only)")
            raise closed_error("this Llama is closed")
        return self._engine

    @property
    def draft_model(self):
        """Speculative decoding's drafter (None: none), as llama-cpp-python's attribute."""
        return self.engine.draft_model

    def close(self) -> None:
        """Frees the model and its context; the Llama is unusable afterwards."""
        self._vocab.close()
        self._engine = None

    def __enter__(self) -> "Llama":
        return self

    def __getstate__(self) -> dict:
        """Its constructor's arguments: a pickled Llama loads the model again, as llama-cpp-python's."""
        return dict(self._arguments)

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the model ----------------------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, str]:
        return self._vocab.metadata

    def n_ctx(self) -> int:
        return self.engine.n_ctx

    def n_vocab(self) -> int:
        return self._vocab.n_vocab

    def pooling_type(self) -> int:
        """llama.cpp's pooling type of the embeddings (0: none, a vector per token), as llama-cpp-python's."""
        return embeddings.pooling_type(self.engine)

    def token_bos(self) -> int:
        bos = self._vocab.token_bos()
        return -1 if bos is None else bos

    def token_eos(self) -> int:
        eos = self._vocab.token_eos()
        return -1 if eos is None else eos

    def token_nl(self) -> int:
        nl = self._vocab.token_nl()
        return -1 if nl is None else nl

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of UTF-8 text (bytes that are not, a U+FFFD each: Vocabulary.tokenize); add_bos adds
        the model's BOS where it uses one, special parses special-token text such as <|im_start|>."""
        return self._vocab.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes:
        """The bytes of tokens (special: with special tokens' text), as llama-cpp-python's: the token
        pieces joined, the space a leading BOS gives the first word dropped; prev_tokens is read by its
        Hugging Face tokenizers alone, not by the model's own, which this is."""
        tokens = as_token_ids(tokens)
        text = b"".join(self._vocab.token_piece(t, special) for t in tokens)
        if tokens and tokens[0] == self.token_bos() and text.startswith(b" "):
            return text[1:]
        return text

    # -- evaluation and state -----------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        """The tokens the context holds (evaluated by eval or the last generation); set to k <= that,
        as llama-cpp-python's attribute, the context keeps its first k (eval goes on after them)."""
        return len(self.engine.tokens)

    @n_tokens.setter
    @_takes_the_context
    def n_tokens(self, k: int) -> None:
        held = len(self.engine.tokens)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= held:
            raise InvalidOptionError(f"n_tokens can be set to a count of the tokens the context holds, 0 to "
                                     f"{held}, got {k!r}"[:200])
        self.engine.reset(keep=int(k))

    @property
    def input_ids(self) -> np.ndarray:
        """llama-cpp-python's input_ids: n_ctx token ids, the first n_tokens those the context holds."""
        ids = np.zeros(self.n_ctx(), dtype=np.intc)
        held = self.engine.tokens
        ids[:len(held)] = held
        return ids

    @_takes_the_context
    def eval(self, tokens: list[int]) -> None:
        """Evaluates tokens after those the context holds (n_tokens); with logits_all, their logits
        go to scores."""
        if not self._logits_all:
            self.engine.eval(tokens)
            return
        n_past = len(self._held_scores())
        logits = self.engine.eval(tokens, all_logits=True)
        self._scores[n_past:n_past + len(logits)] = logits
        self._scored += [int(t) for t in tokens]

    @property
    def scores(self) -> np.ndarray:
        """With logits_all: float32 [n_ctx, n_vocab], row i the logits after the context's first
        i + 1 tokens, where eval() or a generation computed them (NaN where they were computed for
        tokens since replaced); the rows from n_tokens on hold nothing to read, as in llama-cpp-python."""
        if not self._logits_all:
            raise InvalidOptionError("scores holds the logits of eval()'s tokens with Llama(..., logits_all=True) alone")
        self._held_scores()
        return self._scores

    @property
    def eval_tokens(self) -> "deque[int]":
        """The tokens the context holds."""
        return deque(self.engine.tokens, maxlen=self.n_ctx())

    logits_to_logprobs = staticmethod(logits_to_logprobs)
    longest_token_prefix = staticmethod(longest_token_prefix)

    @property
    def eval_logits(self) -> "deque[list[float]]":
        """With logits_all: the rows of scores of the tokens the context holds, as lists."""
        return deque(self.scores[:self.n_tokens].tolist(), maxlen=self.n_ctx())

    def _held_scores(self) -> list[int]:
        """The tokens the context holds; the rows of scores computed for other tokens become NaN.
        A row stays right while the tokens up to its own are the same: the logits of a position
        depend on those alone."""
        if self._scores is None:  # memory is taken as rows are written: as the context fills
            self._scores = np.empty((self.n_ctx(), self.n_vocab()), np.float32)
        held = self.engine.tokens
        same = longest_token_prefix(self._scored, held)
        self._scores[same:max(len(self._scored), len(held))] = np.nan
        self._scored = held
        return held

    @_takes_the_context
    def reset(self) -> None:
        """Forgets the tokens the context holds."""
        self.engine.reset()

    @_takes_the_context
    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               temp: float = 0.80, repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_eta: float = 0.1,
               mirostat_tau: float = 5.0, penalize_nl: bool = True, logits_processor=None, grammar=None,
               idx: int | None = None) -> int:
        """The token sampled after those the context holds (eval's), with the seed (set_seed); idx,
        where given, is the last token's position: other positions' logits are not kept."""
        settings = self._token_sampling("sample", locals())
        if idx is not None and idx != self.n_tokens - 1:
            raise InvalidOptionError(f"sample: idx={idx} is not the last evaluated token's position "
                                     f"({self.n_tokens - 1}): only its logits are kept")
        return self.engine.sample(**settings)

    @_takes_the_context
    def generate(self, tokens: list[int], top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0, reset: bool = True,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, tfs_z: float = 1.0,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 penalize_nl: bool = True, logits_processor=None, stopping_criteria=None,
                 grammar=None) -> Iterator[int]:
        """llama-cpp-python's token generator: evaluates tokens (reset False: after those the context
        holds; else after the longest prefix of them it holds), then yields a sampled token after
        another, end-of-generation ones too, until the caller stops or the context is full. The
        seed: set_seed's, as there. Bad arguments raise here, not at the first token."""
        prompt = ([] if reset else self.engine.tokens) + as_token_ids(tokens)
        sampling = SamplingParams.of(self._scoring(self._token_sampling("generate", locals())))
        return self._streaming(_refusing_sent(self.engine.generate_tokens(prompt, None, sampling, ignore_eos=True)))

    def _scoring(self, sampling: dict) -> dict:
        """sampling, filling scores as llama-cpp-python's generations do with logits_all: the prompt's
        rows from the batch that evaluates it (its last row the first pick's, as there), each pick's
        row recorded by a logits processor ahead of the caller's (the logits as the model gave them)."""
        if not self._logits_all:
            return sampling
        self._held_scores()

        def prompt_rows(input_ids, logits):
            self._scores[len(input_ids) - len(logits):len(input_ids)] = logits
            self._scored = [int(t) for t in input_ids]

        def record(input_ids, logits):
            self._scores[len(input_ids) - 1] = logits
            self._scored = [int(t) for t in input_ids]
            return logits
        given = sampling.get("logits_processor")
        given = list(given) if isinstance(given, (list, tuple)) else [] if given is None else [given]
        return {**sampling, "prompt_logits": prompt_rows, "logits_processor": [record, *given]}

    def _token_sampling(self, where: str, arguments: dict) -> dict:
        """The sampling settings of generate's or sample's arguments (llama-cpp-python's temp is
        temperature here), those without a counterpart refused; the Engine's seed is the Llama's, as
        llama-cpp-python's sampler takes it there."""
        refuse_unsupported(where, UNSUPPORTED_GENERATE_ARGS,
                           {name: arguments[name] for name in UNSUPPORTED_GENERATE_ARGS if name in arguments})
        self.engine.seed = self._seed & 0xFFFFFFFF
        return _sampling({**arguments, "temperature": arguments["temp"]}, self.last_n_tokens_size)

    @_takes_the_context
    def save_state(self) -> "LlamaState":
        """What the context holds and the seed (with logits_all, its rows of scores too), for load_state."""
        return LlamaState(self.engine.save_state(), self._seed,
                          self.scores[:self.n_tokens].copy() if self._logits_all else None)

    @_takes_the_context
    def load_state(self, state: "LlamaState") -> None:
        """The context holds what save_state gave, and its seed is back."""
        if not isinstance(state, LlamaState):
            raise InvalidOptionError(f"load_state takes what save_state gave, got {type(state).__name__}")
        self.engine.load_state(state.sequence)
        self._seed = state.seed
        if self._logits_all and state.scores is not None:
            self._held_scores()  # the state's tokens: their rows are the state's
            self._scores[:len(state.scores)] = state.scores

    def set_cache(self, cache) -> None:
        """llama-cpp-python's prompt cache: one of its LlamaRAMCache or LlamaDiskCache (a mapping from
        token sequences to save_state()'s states that finds the longest prefix), or None. A completion
        whose prompt shares more with a cached state than with what the context holds starts from
        that state, and each completion's state is saved in it."""
        self.cache = cache

    def _from_cache(self, prompt: list[int]) -> None:
        if self.cache is None or not prompt:
            return
        try:
            state = self.cache[prompt]
        except KeyError:
            return
        if longest_token_prefix(state.sequence.tokens, prompt) > longest_token_prefix(self.engine.tokens, prompt):
            self.load_state(state)

    def _saved(self, result):
        """result (a completion, or its chunks), the state after it saved in the cache."""
        if self.cache is None:
            return result

        def save() -> None:
            self.cache[self.engine.tokens] = self.save_state()
        if isinstance(result, dict):
            save()
            return result

        def chunks():
            yield from result
            save()
        return chunks()

    def _streaming(self, items: Generator) -> Generator:
        stream = _Stream(items)
        self._streams.add(stream)
        return _generator(stream)

    def set_seed(self, seed: int) -> None:
        """The seed the next generation given none derives its own from (llama-cpp-python's)."""
        self._seed = _checked_seed(seed)

    def _take_seed(self, seed: int | None) -> None:
        """A generation's seed, as llama-cpp-python picks it: the one given, else the next of the
        sequence the last one starts; it becomes the Engine's seed of the generation and the last one."""
        self._seed = _checked_seed(seed) if seed is not None else random.Random(self._seed).randint(0, 2**32)
        self.engine.seed = self._seed & 0xFFFFFFFF  # as the uint32 llama.cpp's sampler takes

    def n_embd(self) -> int:
        return self._vocab.n_embd

    def tokenizer(self) -> "LlamaTokenizer":
        return LlamaTokenizer(self)

    tokenizer_ = property(tokenizer, doc="llama-cpp-python's attribute of the tokenizer (made at each use: a "
                                         "Llama held by its own attribute would outlive the last reference to it)")

    # -- embeddings ---------------------------------------------------------------------------
    @_takes_the_context
    def embed(self, input: str | list[str], normalize: bool = False, truncate: bool = True,
              return_count: bool = False):
        """The embeddings of a text or of each of a list of texts (Engine.embed): a vector per token,
        or one per text where the model pools; with return_count, also the tokens embedded.
        Needs Llama(..., embedding=True), as llama-cpp-python."""
        if not self.embedding:
            raise _EmbeddingsOff("embed needs Llama(..., embedding=True), as in llama-cpp-python")
        data, n_tokens = [], 0
        if not (isinstance(input, str) or isinstance(input, (list, tuple)) and all(isinstance(t, str) for t in input)):
            raise InvalidOptionError(f"input must be a text or a list of texts, got {input!r}"[:200])
        for text in [input] if isinstance(input, str) else input:
            tokens = self.tokenize(text)
            tokens = tokens[:embeddings.max_tokens(self.engine)[0]] if truncate else tokens  # usage: those embedded
            data.append(self.engine.embed(tokens, normalize=normalize, truncate=truncate).tolist())
            n_tokens += len(tokens)
        out = data[0] if isinstance(input, str) else data
        return (out, n_tokens) if return_count else out

    def create_embedding(self, input: str | list[str], model: str | None = None) -> dict:
        """OpenAI's embeddings response of embed(input)."""
        texts = input if isinstance(input, list) else [input]
        vectors, n_tokens = self.embed(texts, return_count=True)
        return {"object": "list", "model": self.model_path if model is None else model,
                "data": [{"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}

    # -- generation ---------------------------------------------------------------------------
    @_stock_overflow
    @_takes_the_context
    def create_completion(self, prompt: str | list[int], suffix: str | None = None, max_tokens: int | None = 16,
                          temperature: float = 0.8, top_p: float = 0.95, min_p: float = 0.05,
                          typical_p: float = 1.0, logprobs: int | None = None, echo: bool = False,
                          stop: str | list[str] | None = None, frequency_penalty: float = 0.0,
                          presence_penalty: float = 0.0, repeat_penalty: float = 1.0, top_k: int = 40,
                          stream: bool = False, seed: int | None = None, tfs_z: float = 1.0,
                          mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                          model: str | None = None, stopping_criteria=None, logits_processor=None, grammar=None,
                          logit_bias: dict[int, float] | None = None):
        """Text completion: Engine.create_completion's OpenAI-style dict (or, stream=True, its chunks).
        As llama-cpp-python: a text prompt's special-token text is parsed and the model's separator
        token put after it (_text_prompt_tokens), max_tokens None or <= 0
        generates until the context is full, echo puts the prompt before the text and its tokens'
        logprobs before the completion's (a stream leaves it out, as there), grammar is GBNF text or
        a LlamaGrammar. suffix: fill in the middle, the text between prompt and suffix (the model's
        fill-in-the-middle tokens, pyedgemoe.fill_in_middle; a model without them is refused, where
        llama-cpp-python 0.3 puts token 0 in their place)."""
        refuse_unsupported("create_completion", UNSUPPORTED_COMPLETION_ARGS, dict(tfs_z=tfs_z))
        logprobs = int(logprobs) if isinstance(logprobs, bool) else logprobs  # True: 1, as there
        if suffix is not None:
            tokens = completion_prompt(self.engine, prompt, suffix, self.spm_infill)
        elif isinstance(prompt, str):
            tokens = self._text_prompt_tokens(prompt)
        else:
            tokens = as_token_ids(prompt, "prompt")
        self._from_cache(tokens)
        self._take_seed(seed)
        sampling = self._scoring(_sampling(locals(), self.last_n_tokens_size))
        echo_rows: list[np.ndarray] = []  # the echoed prompt's logprobs: its rows, as the completion evaluates it
        if echo and logprobs is not None and not stream:
            self.engine.reset()  # the whole prompt evaluated (the context ends holding the completion, as there)
            sampling = _keeping_prompt_rows(sampling, echo_rows)
        out = self._saved(completions.create_completion(self.engine, tokens, _max_tokens(max_tokens), stop, stream,
                                                        logprobs, sampling, prompt_length=len(prompt),
                                                        finish_character=True))
        if not stream:
            if echo:  # a stream's chunks leave the prompt out, as there
                choice = out["choices"][0]
                choice["text"] = (prompt if isinstance(prompt, str) else self.detokenize(
                    as_token_ids(prompt, "prompt")).decode("utf-8", errors="ignore")) + choice["text"]
                if echo_rows:
                    choice["logprobs"] = self._echoed_logprobs(tokens, echo_rows[0], logprobs, choice["logprobs"],
                                                               len(prompt))
            return _named(out, model)
        return self._streaming(_stream_named(out, model))

    __call__ = create_completion

    def _text_prompt_tokens(self, prompt: str) -> list[int]:
        """llama-cpp-python's tokens of a text prompt (its _create_completion's bos_tokens +
        prefix_tokens + eos_tokens): the model's BOS where it adds one, the text with special-token
        text parsed, then the model's separator token, or its EOS where it has none but adds one. Its
        rule, not llama.cpp's tools' (the Engine's): a model with a SEP gets it after every text prompt,
        whatever tokenizer.ggml.add_sep_token says; a token prompt is taken as it is."""
        bos, sep, eos = self._vocab.token_bos(), self._vocab.token_sep(), self._vocab.token_eos()
        start = [bos] if self._vocab.add_bos and bos is not None else []
        end = sep if sep is not None else eos if self._vocab.add_eos else None
        text = self.engine.tokenize(prompt, add_bos=False, special=True) if prompt else []
        return start + text + ([end] if end is not None else [])

    def _echoed_logprobs(self, tokens: list[int], rows: np.ndarray, n: int, generated: dict, prompt_length: int) -> dict:
        """llama-cpp-python's logprobs with echo: the prompt's tokens (rows: their logits, row i the prediction of
        token i + 1) but a leading BOS (the first without any), then the generated ones (`generated`, offset from
        prompt_length), the text offsets counted from the prompt's start."""
        skip = int(tokens[0] == self.token_bos())
        echoed = tokens[skip:]
        taken = [token_logprob(rows[k + skip - 1], t, n) if k else TokenLogprob(t, 0.0, ())
                 for k, t in enumerate(echoed)]
        out = completion_logprobs(self.engine, taken, 0, len(taken), 0)
        if taken:
            out["token_logprobs"][0] = out["top_logprobs"][0] = None
        shift = len(b"".join(self.engine.token_piece(t) for t in echoed).decode("utf-8", errors="ignore")) \
            - prompt_length
        out["text_offset"] += [offset + shift for offset in generated["text_offset"]]
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            out[key] += generated[key]
        return out

    @_stock_overflow
    @_takes_the_context
    def create_chat_completion(self, messages: list[dict], functions=None, function_call=None, tools=None,
                               tool_choice=None, temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40,
                               min_p: float = 0.05, typical_p: float = 1.0, stream: bool = False,
                               stop: str | list[str] | None = None, seed: int | None = None, response_format=None,
                               max_tokens: int | None = None, presence_penalty: float = 0.0,
                               frequency_penalty: float = 0.0, repeat_penalty: float = 1.0, tfs_z: float = 1.0,
                               mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                               model: str | None = None, logits_processor=None, grammar=None,
                               logit_bias: dict[int, float] | None = None, logprobs: bool | None = None,
                               top_logprobs: int | None = None):
        """Chat completion with the model's template: Engine.create_chat_completion's OpenAI-style
        dict (or, stream=True, its chunks: the role, the content pieces, the finish reason).
        response_format: {"type": "json_object"} (optionally with "schema", llama-cpp-python's JSON
        schema mode) or OpenAI's {"type": "json_schema", "json_schema": {"schema": ...}}. tools and
        tool_choice (or OpenAI's legacy functions and function_call) as llama-cpp-python takes them with a
        model's template (pyedgemoe.tool_calls); with one of llama-cpp-python's chat formats, its handler's answer."""
        handler = self.chat_handler or self._format_handler()  # llama-cpp-python's precedence
        if handler is not None:  # llama-cpp-python's protocol (LlamaChatCompletionHandler): every argument by name
            arguments = {name: value for name, value in locals().items() if name not in ("self", "messages", "handler")}
            return handler(llama=self, messages=messages, **arguments)
        refuse_unsupported("create_chat_completion", UNSUPPORTED_CHAT_ARGS, dict(tfs_z=tfs_z))
        tools, tool_choice = from_functions(functions, function_call, tools, tool_choice)
        prompt = chat_prompt_tokens(self.engine, messages, tools, tool_choice) if self.cache is not None else []
        self._from_cache(prompt)
        self._take_seed(seed)
        out = self._saved(self.engine.create_chat_completion(
            # top_logprobs without logprobs: ignored, as stock's (llama-server refuses it)
            messages, _max_tokens(max_tokens), stop=stop, stream=stream, logprobs=logprobs,
            top_logprobs=top_logprobs if logprobs else None,
            tools=tools, tool_choice=tool_choice, parse_tool_calls=False, response_format=response_format,
            jinja2_formatter=True, finish_character=True,
            **self._scoring(_sampling(locals(), self.last_n_tokens_size))))
        return self._streaming(_stream_named(out, model)) if stream else _named(out, model)


    def create_chat_completion_openai_v1(self, *args, **kwargs):
        """create_chat_completion's result as the openai package's types (ChatCompletion, or with
        stream=True ChatCompletionChunk objects), as llama-cpp-python's; needs `pip install openai`."""
        try:
            from openai.types.chat import ChatCompletion, ChatCompletionChunk
        except ImportError:
            raise InvalidOptionError("create_chat_completion_openai_v1 needs the openai package: pip install openai") \
                from None
        out = self.create_chat_completion(*args, **kwargs)
        return (ChatCompletionChunk(**chunk) for chunk in out) if kwargs.get("stream") else ChatCompletion(**out)


@dataclass(frozen=True)
class LlamaState:
    """llama-cpp-python's LlamaState: what the context held (the Engine's SequenceState), the seed,
    and with logits_all the rows of scores of the tokens held."""
    sequence: SequenceState
    seed: int | None
    scores: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.sequence.tokens)

    @property
    def input_ids(self) -> np.ndarray:
        return np.array(self.sequence.tokens, dtype=np.intc)

    @property
    def llama_state(self) -> bytes:
        return self.sequence.kv

    @property
    def llama_state_size(self) -> int:
        return len(self.sequence.kv)


class LlamaGrammar:
    """llama-cpp-python's LlamaGrammar: GBNF text for Llama's grammar argument."""

    def __init__(self, *, _grammar: str):
        self._grammar = _grammar

    @classmethod
    def from_string(cls, grammar: str, verbose: bool = True) -> "LlamaGrammar":
        return cls(_grammar=grammar)

    @classmethod
    def from_file(cls, file: str | os.PathLike, verbose: bool = True) -> "LlamaGrammar":
        try:
            return cls(_grammar=Path(file).read_text())
        except OSError as e:
            raise InvalidOptionError(f"cannot read the grammar file: {e}") from None

    @classmethod
    def from_json_schema(cls, json_schema: str, verbose: bool = True) -> "LlamaGrammar":
        """The grammar of a JSON schema (JSON text), by llama.cpp's converter."""
        if not isinstance(json_schema, str):  # as llama-cpp-python's json.loads refuses it
            raise TypeError(f"json_schema must be a JSON text (json.dumps(schema)), not {type(json_schema).__name__}")
        return cls(_grammar=schema_grammar(json_schema))


class LlamaTokenizer:
    """llama-cpp-python's LlamaTokenizer of a Llama (Llama.tokenizer())."""

    def __init__(self, llama: Llama):
        self._llama = llama

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        return self._llama.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes:
        return self._llama.detokenize(tokens, prev_tokens=prev_tokens, special=special)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos=add_bos, special=special)

    def decode(self, tokens: list[int]) -> str:
        return self.detokenize(tokens).decode("utf-8", errors="ignore")


def _sampling(arguments: dict, penalty_last_n: int) -> dict:
    """The sampling settings among a method's arguments (SamplingParams' fields, by the same names,
    but the seed: the Engine's, _take_seed); a LlamaGrammar (pyedgemoe's or llama-cpp-python's) as
    its GBNF text. As llama-cpp-python's, the penalties count the generated tokens only, the last
    penalty_last_n of them (its last_n_tokens_size); a temperature below 0 its WHOLE_DISTRIBUTION (the
    Engine's is greedy)."""
    names = [f.name for f in exposed_fields() if f.name != "seed"] + list(_PYTHON_SAMPLING)
    settings = {name: arguments[name] for name in names if name in arguments}
    settings["penalize_prompt"], settings["penalty_last_n"] = False, penalty_last_n
    # a value llama.cpp's sampler takes as "off" (llama-cpp-python passes it on)
    if _is_number(settings.get("top_p")) and settings["top_p"] > 1:
        settings["top_p"] = 1.0
    if _is_number(settings.get("temperature")) and settings["temperature"] < 0:
        settings.update(WHOLE_DISTRIBUTION)
    if settings.get("grammar") is not None and not isinstance(settings["grammar"], str):
        settings["grammar"] = getattr(settings["grammar"], "_grammar", settings["grammar"])
    return settings


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _context_rows(model_path, n_ctx) -> int:
    """The positions of a context of n_ctx (0: the training context's), as llama.cpp pads it: the rows
    of scores with logits_all. A bad n_ctx as it is (the Engine refuses it)."""
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 0:
        return 0
    from pyedgemoe.memory_budget import context_positions
    from pyedgemoe.model_info import read_model_info
    return context_positions(read_model_info(model_path).metadata, n_ctx)


def _checked_handler(chat_handler: Callable | None) -> Callable | None:
    """A chat handler of llama-cpp-python's kind (Jinja2ChatFormatter(...).to_chat_handler(), a function
    of its LlamaChatCompletionHandler protocol), which this Llama's methods serve as theirs do; its
    multimodal ones (Llava15ChatHandler, MTMDChatHandler: a clip model) refused."""
    if chat_handler is not None and not callable(chat_handler):
        raise InvalidOptionError(f"chat_handler must be callable (llama-cpp-python's LlamaChatCompletionHandler), "
                                 f"got {chat_handler!r}"[:200])
    if hasattr(chat_handler, "clip_model_path"):
        raise InvalidOptionError(f"chat_handler {type(chat_handler).__name__}: a multimodal handler (images, with a "
                                 "clip model) needs llama.cpp's mtmd, which pyedgemoe does not run: text models only")
    return chat_handler


def _refusing_sent(tokens: Iterator[int]) -> Iterator[int]:
    """tokens, as a generator that refuses tokens sent into it (llama-cpp-python evaluates them)."""
    for token in tokens:
        if (yield token) is not None:
            raise InvalidOptionError("generate: tokens sent into the generator are not supported: break, eval() "
                                     "them and generate(..., reset=False) again")


def _checked_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidOptionError(f"seed must be an integer, got {seed!r}")
    return seed


def _max_tokens(max_tokens: int | float | None) -> int | None:
    """llama-cpp-python's max_tokens None or <= 0: until the context is full (the Engine's None); a
    whole float (of JSON, of a config file) as its integer."""
    if isinstance(max_tokens, float) and max_tokens.is_integer():
        max_tokens = int(max_tokens)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
        raise InvalidOptionError(f"max_tokens must be an integer, got {max_tokens!r}")
    return None if max_tokens is None or max_tokens <= 0 else max_tokens


def _named(result: dict, model: str | None) -> dict:
    """llama-cpp-python's `model` argument: the name results carry instead of the model's path; and its
    end, without what the Engine's adds: OpenAI's usage details (the prompt's cached tokens) and
    llama-server's timings."""
    if "usage" in result:
        result = {**{k: v for k, v in result.items() if k != "timings"},
                  "usage": {k: v for k, v in result["usage"].items() if k != "prompt_tokens_details"}}
    return result if model is None else {**result, "model": model}


def _stream_named(chunks: Iterator[dict], model: str | None) -> Iterator[dict]:
    """The chunks as _named gives results, their end without the usage and timings (stock's have none)."""
    for chunk in chunks:
        yield _named({k: v for k, v in chunk.items() if k not in ("usage", "timings")}, model)
