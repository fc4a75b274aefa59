"""Llama: llama-cpp-python's high-level class, in front of pyedgemoe's Engine.

Code written for `llama_cpp.Llama` runs with one import changed:

    from pyedgemoe import Llama
    llm = Llama(model_path="model.gguf", n_ctx=2048)
    llm("Q: Name the planets in the solar system? A: ", max_tokens=32, stop=["Q:", "\\n"])
    llm.create_chat_completion(messages=[{"role": "user", "content": "Hi"}])
    llm = Llama("model.gguf", expert_cache="25%", system="hobbit")   # pyedgemoe's own keywords

The arguments and defaults are llama-cpp-python 0.3's. An argument pyedgemoe has no counterpart
for is refused with InvalidOptionError when given a value other than its default, never ignored
(the UNSUPPORTED_* tables below).
"""
from __future__ import annotations

import fnmatch
import inspect
import os
from pathlib import Path
from typing import Iterator

import gguf
import jinja2

from pyedgemoe.chat_template import render_chat
from pyedgemoe.engine import Engine
from pyedgemoe.errors import InvalidOptionError, ModelLoadError
from pyedgemoe.expert_options import OPTION_NAMES
from pyedgemoe.generation import exposed_fields

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's "pick a random seed"

# llama_cpp.Llama.__init__'s arguments with no counterpart here, and their defaults there
UNSUPPORTED_INIT_ARGS: dict[str, object] = {
    "split_mode": 1, "main_gpu": 0, "tensor_split": None, "vocab_only": False, "use_mmap": True,
    "use_mlock": False, "kv_overrides": None, "rope_scaling_type": -1, "pooling_type": -1,
    "attention_type": -1, "rope_freq_base": 0.0, "rope_freq_scale": 0.0, "yarn_ext_factor": -1.0,
    "yarn_attn_factor": 1.0, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_orig_ctx": 0,
    "logits_all": False, "embedding": False, "offload_kqv": True, "op_offload": None, "swa_full": None,
    "no_perf": False, "last_n_tokens_size": 64, "lora_base": None, "lora_scale": 1.0, "lora_path": None,
    "numa": False, "chat_handler": None, "draft_model": None, "tokenizer": None, "spm_infill": False,
}
# the sampling and output arguments of create_completion / create_chat_completion the Engine lacks
UNSUPPORTED_COMPLETION_ARGS: dict[str, object] = {
    "suffix": None, "typical_p": 1.0, "logprobs": None, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "tfs_z": 1.0, "mirostat_mode": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "stopping_criteria": None,
    "logits_processor": None, "grammar": None, "logit_bias": None,
}
UNSUPPORTED_CHAT_ARGS: dict[str, object] = {
    "functions": None, "function_call": None, "tools": None, "tool_choice": None, "typical_p": 1.0,
    "response_format": None, "presence_penalty": 0.0, "frequency_penalty": 0.0, "tfs_z": 1.0,
    "mirostat_mode": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "logits_processor": None, "grammar": None,
    "logit_bias": None, "logprobs": None, "top_logprobs": None,
}

# what Llama passes on to the Engine: its keywords and the expert options
_ENGINE_KEYWORDS = (set(inspect.signature(Engine.__init__).parameters) - {"self", "model_path", "options"}) \
    | set(OPTION_NAMES)

# a conversation with every role, to tell whether the model's template renders as ChatML does
_PROBE_CHAT = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
               {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]


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


class Llama:
    """A GGUF model, used the way llama_cpp.Llama is; `engine` is the pyedgemoe Engine behind it.

    Supported from llama-cpp-python: model_path, n_ctx (0: the model's training context), n_batch,
    n_ubatch (>= n_batch: the Engine's micro-batch is n_batch), n_threads, n_threads_batch, seed,
    flash_attn, type_k == type_v, verbose, n_gpu_layers (the Engine's and the CLI's -ngl: 0 the CPU,
    unless pyedgemoe's mode is given; -1 or > 0 the GPU where the build has one, mode auto, else the
    CPU, as llama-cpp-python runs) and chat_format (None, "chat_template.default" where the model has
    a template, "chatml" where its template renders as ChatML). Any other keyword is pyedgemoe's own and goes to
    Engine: expert_cache, expert_options, system, mode, device, host_cache, kv_type, the expert
    options (io, prefetch, ...).
    """

    def __init__(self, model_path: str | os.PathLike, *, n_gpu_layers: int = 0, seed: int = LLAMA_DEFAULT_SEED,
                 n_ctx: int = 512, n_batch: int = 512, n_ubatch: int = 512, n_threads: int | None = None,
                 n_threads_batch: int | None = None, flash_attn: bool = False, chat_format: str | None = None,
                 type_k: int | None = None, type_v: int | None = None, verbose: bool = True, **kwargs):
        unsupported = {name: kwargs.pop(name) for name in list(kwargs) if name in UNSUPPORTED_INIT_ARGS}
        refuse_unsupported("Llama", UNSUPPORTED_INIT_ARGS, unsupported)
        unknown = sorted(set(kwargs) - _ENGINE_KEYWORDS)
        if unknown:
            raise InvalidOptionError(f"Llama: unknown argument {unknown[0]!r} (neither llama-cpp-python's nor "
                                     "pyedgemoe.Engine's)")
        engine_kwargs = dict(kwargs)
        options = kwargs.get("expert_options")
        mode_given = kwargs.get("mode") is not None or (options is not None and "mode" in options.given)
        if not (n_gpu_layers == 0 and mode_given):  # llama-cpp-python's default of 0 gives way to a mode given
            engine_kwargs["n_gpu_layers"] = n_gpu_layers
        kv_type = _kv_type(type_k, type_v)
        if kv_type is not None:
            if "kv_type" in kwargs:
                raise InvalidOptionError("give either type_k/type_v or kv_type, not both")
            engine_kwargs["kv_type"] = kv_type
        if isinstance(n_ctx, int) and n_ctx > 0 and isinstance(n_batch, int):
            n_batch = min(n_ctx, n_batch)  # as llama-cpp-python does
        if isinstance(n_ubatch, int) and isinstance(n_batch, int) and n_ubatch < n_batch:
            raise InvalidOptionError(f"n_ubatch={n_ubatch} below n_batch={n_batch} is not supported: pyedgemoe's "
                                     "micro-batch is n_batch (smaller where the expert cache needs it)")
        if seed in (LLAMA_DEFAULT_SEED, -1):
            seed = None
        self._engine: Engine | None = Engine(
            model_path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads_batch, n_batch=n_batch, seed=seed,
            flash_attn=flash_attn, verbose=verbose, **engine_kwargs)
        self.model_path = self.engine.model_path
        self.verbose = verbose
        try:
            self.chat_format = self._check_chat_format(chat_format)
        except InvalidOptionError:
            self.close()
            raise

    def _check_chat_format(self, chat_format: str | None) -> str:
        """The chat format the Engine's formatting amounts to; a different one asked for is refused."""
        has_template = "tokenizer.chat_template" in self.engine.metadata
        try:
            renders_chatml = self.engine.format_chat(_PROBE_CHAT) == render_chat(
                None, _PROBE_CHAT, bos_token="", eos_token="")
        except jinja2.TemplateError:  # a template that refuses the probe (no system role, ...) is not ChatML
            renders_chatml = False
        accepted = (["chat_template.default"] if has_template else []) + (["chatml"] if renders_chatml else [])
        if chat_format is None:
            return accepted[0]
        if chat_format not in accepted:
            raise InvalidOptionError(
                f"chat_format {chat_format!r} is not supported: pyedgemoe formats chats with the model's own "
                f"template (its tokenizer.chat_template, else ChatML); give chat_format=None"
                + (f" or {' or '.join(repr(a) for a in accepted)}" if accepted else ""))
        return chat_format

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str, additional_files: list[str] | None = None,
                        local_dir: str | os.PathLike | None = None, local_dir_use_symlinks: bool | str = "auto",
                        cache_dir: str | os.PathLike | None = None, **kwargs) -> "Llama":
        """Downloads filename (a name or a glob such as "*q8_0.gguf") of a Hugging Face Hub repo, and
        additional_files (the other shards of a split GGUF), through huggingface_hub, then loads it;
        kwargs go to Llama(). Offline (HF_HUB_OFFLINE=1) it uses the local cache."""
        if local_dir_use_symlinks != "auto":
            raise InvalidOptionError("local_dir_use_symlinks: huggingface_hub no longer supports it (leave it 'auto')")
        model_path = _download(repo_id, [filename, *(additional_files or [])], local_dir, cache_dir)[0]
        return cls(model_path=model_path, **kwargs)

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        """The pyedgemoe Engine behind this Llama (its stats(), logits(), ...)."""
        if self._engine is None:
            raise RuntimeError("this Llama is closed")
        return self._engine

    def close(self) -> None:
        """Frees the model and its context; the Llama is unusable afterwards."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the model ----------------------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, str]:
        return self.engine.metadata

    def n_ctx(self) -> int:
        return self.engine.n_ctx

    def n_vocab(self) -> int:
        return self.engine.n_vocab

    def token_bos(self) -> int:
        bos = self.engine.token_bos()
        return -1 if bos is None else bos

    def token_eos(self) -> int:
        eos = self.engine.token_eos()
        return -1 if eos is None else eos

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of UTF-8 text; add_bos adds the model's BOS where it uses one, special parses
        special-token text such as <|im_start|>."""
        if isinstance(text, str):
            text = text.encode("utf-8")
        try:
            text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidOptionError(f"tokenize takes UTF-8 text: {e}") from None
        return self.engine.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes:
        """The bytes of tokens (special: with special tokens' text); after prev_tokens, only what
        tokens add to them. As llama-cpp-python: the token pieces joined, the space a leading BOS
        gives the first word dropped."""
        if prev_tokens is not None:
            before = self.detokenize(prev_tokens, special=special)
            return self.detokenize([*prev_tokens, *tokens], special=special)[len(before):]
        tokens = [int(t) for t in tokens]
        text = b"".join(self.engine.token_piece(t, special) for t in tokens)
        if tokens and tokens[0] == self.token_bos() and text.startswith(b" "):
            return text[1:]
        return text

    # -- generation ---------------------------------------------------------------------------
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
        As llama-cpp-python: a text prompt's special-token text is parsed, max_tokens None or <= 0
        generates until the context is full, echo puts the prompt before the text."""
        refuse_unsupported("create_completion", UNSUPPORTED_COMPLETION_ARGS, dict(
            suffix=suffix, typical_p=typical_p, logprobs=logprobs, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta, stopping_criteria=stopping_criteria, logits_processor=logits_processor,
            grammar=grammar, logit_bias=logit_bias))
        if isinstance(prompt, str):
            prompt_text = prompt
            prompt = self.engine.tokenize(prompt, add_bos=True, special=True)
        else:
            prompt_text = self.detokenize(prompt).decode("utf-8", errors="ignore") if echo else ""
        out = self.engine.create_completion(prompt, _max_tokens(max_tokens), stop=stop, stream=stream,
                                            **_sampling(locals()))
        if not stream:
            if echo:
                out["choices"][0]["text"] = prompt_text + out["choices"][0]["text"]
            return _named(out, model)
        return _stream_named(out, model, prompt_text if echo else "", "text")

    __call__ = create_completion

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
        dict (or, stream=True, its chunks: the role, the content pieces, the finish reason)."""
        refuse_unsupported("create_chat_completion", UNSUPPORTED_CHAT_ARGS, dict(
            functions=functions, function_call=function_call, tools=tools, tool_choice=tool_choice,
            typical_p=typical_p, response_format=response_format, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
            mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, logits_processor=logits_processor,
            grammar=grammar, logit_bias=logit_bias, logprobs=logprobs, top_logprobs=top_logprobs))
        out = self.engine.create_chat_completion(messages, _max_tokens(max_tokens), stop=stop, stream=stream,
                                                 **_sampling(locals()))
        return _stream_named(out, model, "", None) if stream else _named(out, model)


def _sampling(arguments: dict) -> dict:
    """The sampling settings among a method's arguments (SamplingParams' fields, by the same names)."""
    return {f.name: arguments[f.name] for f in exposed_fields()}


def _max_tokens(max_tokens: int | None) -> int | None:
    """llama-cpp-python's max_tokens None or <= 0: until the context is full (the Engine's None)."""
    return None if max_tokens is None or max_tokens <= 0 else max_tokens


def _named(result: dict, model: str | None) -> dict:
    """llama-cpp-python's `model` argument: the name results carry instead of the model's path."""
    return result if model is None else {**result, "model": model}


def _stream_named(chunks: Iterator[dict], model: str | None, echo: str, text_key: str | None) -> Iterator[dict]:
    for i, chunk in enumerate(chunks):
        if i == 0 and echo:
            choice = chunk["choices"][0]
            chunk = {**chunk, "choices": [{**choice, text_key: echo + choice[text_key]}]}
        yield _named(chunk, model)


def _download(repo_id: str, patterns: list[str], local_dir, cache_dir) -> list[str]:
    """The local paths of the repo's files matching each pattern (one file each), downloaded or,
    offline, from the cache; every failure is one ModelLoadError."""
    try:
        import huggingface_hub
        from huggingface_hub import constants as hub_constants
    except ImportError:
        raise ModelLoadError("Llama.from_pretrained needs huggingface_hub: pip install huggingface-hub") from None
    where = f"Hugging Face repo {repo_id!r}"
    try:
        if any(any(c in p for c in "*?[") for p in patterns):
            files = _repo_files(huggingface_hub, hub_constants.HF_HUB_OFFLINE, repo_id, cache_dir)
            names = []
            for pattern in patterns:
                matches = [f for f in files if fnmatch.fnmatch(f, pattern)]
                if len(matches) != 1:
                    raise ModelLoadError(f"{len(matches) or 'no'} files of {where} match {pattern!r}"
                                         f"{' (' + ', '.join(matches) + ')' if matches else ''}; its files: "
                                         f"{', '.join(files)}")
                names.append(matches[0])
        else:
            names = list(patterns)
        return [huggingface_hub.hf_hub_download(repo_id, name, local_dir=local_dir, cache_dir=cache_dir)
                for name in names]
    except ModelLoadError:
        raise
    except Exception as e:  # huggingface_hub's errors: offline, not found, gated, network, bad repo id, ...
        offline = " (offline, HF_HUB_OFFLINE=1: only files already in the cache load)" \
            if hub_constants.HF_HUB_OFFLINE else ""
        raise ModelLoadError(f"cannot get {', '.join(patterns)} from {where}{offline}: "
                             f"{type(e).__name__}: {_first_line(e)}") from None


def _repo_files(huggingface_hub, offline: bool, repo_id: str, cache_dir) -> list[str]:
    """The repo's file names: from the Hub, or offline from the cached snapshot of its main branch."""
    if not offline:
        return huggingface_hub.list_repo_files(repo_id)
    snapshot = Path(huggingface_hub.snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True))
    return sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
