"""The options of the CLI's commands, declared once elsewhere and made into flags here.

@model_options (every command that loads a model): `-t/--threads`, `-tb/--threads-batch`,
`--expert-cache`, `--system`, `-b/--batch-size`, `-ub/--ubatch-size`, `-fa/--flash-attn`, `-v/--verbose`,
llama.cpp's `--log-*` flags (pyedgemoe.llama_log),
`-ctk`/`-ctv`, `--rope-scale`, `--list-devices`, `--chat-template-file`, `-hfl` and one flag per option of the schema
(pyedgemoe.expert_options.OPTION_NAMES with dashes: `--io-threads`, `--prefetch`, `--mode`,
`--device`, `--host-cache`, `--repack/--no-repack`, `-ngl/--n-gpu-layers`, ..., their help and
defaults from the schema). The command receives them as `engine_options`, a dict of Engine keyword
arguments. @sampling_options: one flag per setting of pyedgemoe.generation.SamplingParams
(`--temp`, `--top-k`, ..., `--seed`, `--grammar`/`--grammar-file`, `--json-schema`/
`--json-schema-file`); the command receives `sampling`, a SamplingParams. @model_source(): the
model as MODEL, `-m`, `-hf` or `-mu` (`--offline`); the command receives its path as `model`. @speculative_options:
`--spec-type` and its sizes; the command receives `draft_model`. A bad value is one `error:` line."""
from __future__ import annotations

import functools
import inspect
import json
import math
import os
import re
from pathlib import Path
from typing import Optional, get_args, get_type_hints

import typer

from pyedgemoe import llama_log, moe_placement
from pyedgemoe.devices import print_devices
from pyedgemoe.errors import InvalidOptionError, PyEdgeMoEError
from pyedgemoe.expert_options import AUTOMATIC, LOAD_OPTIONS, OPTION_NAMES, ExpertOptions, choices, default, help_text
from pyedgemoe.generation import CHAT_TEMPERATURE, WHOLE_CONTEXT, SamplingParams, exposed_fields
from pyedgemoe.llama_env import from_environment
from pyedgemoe.load_plan import LoadOptions
from pyedgemoe.model_source import DEFAULT_QUANTS, hub_model, offline_asked
from pyedgemoe.speculative import NGRAM_SIMPLE_SIZE_M, NGRAM_SIMPLE_SIZE_N, drafter
from pyedgemoe.threads import set_priority
from pyedgemoe.url_model import url_model
from pyedgemoe.systems import SYSTEMS

# (parameter, annotation, typer option, Engine keyword) of the options besides the expert ones
_ENGINE_OPTIONS = (
    ("threads", Optional[int], typer.Option(None, "-t", "--threads",
                                            help="threads of the decode (default: the physical cores this process "
                                                 "may use, within its cgroup's CPU quota; the decode leaves one to "
                                                 "the expert reads when prefetch is chosen automatically; 0 or -1, "
                                                 "llama.cpp's default: this default)"), "n_threads"),
    ("threads_batch", Optional[int], typer.Option(None, "-tb", "--threads-batch",
                                                  help="threads of the prompt's batches (default: --threads, or its "
                                                       "default; 0 or -1 too)"), "n_threads_batch"),
    ("expert_cache", str, typer.Option("auto", "--expert-cache",
                                       help="memory for experts: 300MiB, 4GiB, 50% (of expert bytes, above 0 "
                                            "and at most 100%), auto, or mmap (no cache: the page cache holds the "
                                            "mapped experts, as in llama.cpp --no-repack, the other weights in "
                                            "memory); a size that does not fit "
                                            "is refused, a trailing ~ (60%~, 4GiB~) takes what fits if less; room "
                                            "for every expert (100%) holds every expert in HIGH, lossless, unless "
                                            "LOW copies are asked for, and a larger size is capped"),
     "expert_cache"),
    ("system", Optional[str], typer.Option(None, "--system",
                                           help=f"a seed system's preset of the expert options: {', '.join(list(SYSTEMS)[:-1])} "
                                                f"or {list(SYSTEMS)[-1]} (docs/systems.md); options given win"),
     "system"),
    ("batch_size", int, typer.Option(LoadOptions.n_batch, "-b", "--batch-size",
                                     help="tokens of the prompt per llama_decode, as llama.cpp's -b"), "n_batch"),
    ("ubatch_size", int, typer.Option(LoadOptions.n_ubatch, "-ub", "--ubatch-size",
                                      help="tokens per pass of the model, at most --batch-size (0: --batch-size), "
                                           "as llama.cpp's -ub"),
     "n_ubatch"),
    ("flash_attn", Optional[str], typer.Option(None, "-fa", "--flash-attn",
                                               help="flash attention: on, off or auto (llama.cpp decides; the "
                                                    "default), as llama.cpp's -fa"), "flash_attn"),
    ("verbose", bool, typer.Option(False, "-v", "--verbose", "--log-verbose",
                                   help="show llama.cpp's log, every message, and the thread counts and why"),
     "verbose"),
)
# llama.cpp's -ctk and -ctv: the Engine's kv_type, one type for both
_KV_TYPES = (
    ("cache_type_k", Optional[str], typer.Option(None, "-ctk", "--cache-type-k",
                                                 help="KV cache type for K: f16 (the default), q8_0, q4_0, bf16, "
                                                      "f32, ... as llama.cpp's -ctk; give -ctv the same")),
    ("cache_type_v", Optional[str], typer.Option(None, "-ctv", "--cache-type-v",
                                                 help="KV cache type for V, as llama.cpp's -ctv (a quantized one "
                                                      "needs flash attention); give -ctk the same")),
)


def _list_devices(value: bool) -> None:
    if value:
        print_devices()
        raise typer.Exit()


# llama.cpp's --list-devices: the devices, then exit (before anything else is read, as --help)
_LIST_DEVICES = ("list_devices", bool, typer.Option(False, "--list-devices", is_eager=True, callback=_list_devices,
                                                    help="print the devices (GPUs, RPC workers) and exit, as "
                                                         "llama.cpp's --list-devices"))
# llama.cpp's --rope-scale N: --rope-freq-scale 1/N
_ROPE_SCALE = ("rope_scale", Optional[float], typer.Option(None, "--rope-scale", help="RoPE context scaling: N times "
                                                           "the positions the model was trained with, as llama.cpp's "
                                                           "--rope-scale (--rope-freq-scale 1/N)"))
# llama.cpp's --chat-template-file: --chat-template read from a file
_CHAT_TEMPLATE_FILE = ("chat_template_file", Optional[Path], typer.Option(
    None, "--chat-template-file", help="read --chat-template from this file (a Jinja template), as llama.cpp's"))
# --low-from's file from a Hugging Face repo, as -hf gets the model's (named after llama.cpp's -hfd,
# the draft model's repo)
_HF_REPO_LOW = ("hf_repo_low", Optional[str], typer.Option(
    None, "-hfl", "--hf-repo-low", help="--low-from's GGUF from a Hugging Face repo, USER/MODEL[:QUANT] (e.g. the "
    "model's repo with a lower quant), got as -hf gets the model's (its token: HF_TOKEN or huggingface_hub's login)"))
def _no_context_shift(value: bool) -> None:
    raise InvalidOptionError("--context-shift is not supported: a generation ends when the context is full (finish "
                             "reason length); give a larger -c")


def _keep(value: int) -> str:
    return f"--keep {value}: the tokens a context shift keeps; a generation here ends when the context is full " \
           "(no context shift): not used"


def _no_kv_unified(value: bool) -> None:
    raise InvalidOptionError("--kv-unified is not supported: each of -np sequences has its own share of the context "
                             "(llama.cpp's --no-kv-unified)")


# llama.cpp's flags whose work pyedgemoe does otherwise, or does as well: None where taken as given,
# else what takes them (returning a note to print, or None; InvalidOptionError where the way here differs)
_LLAMA_CPP_FLAGS = (
    ("jinja", bool, typer.Option(False, "--jinja", help="llama.cpp's: chats with the model's Jinja template, which "
                                 "pyedgemoe always does"), None),
    ("no_warmup", bool, typer.Option(False, "--no-warmup", help="llama.cpp's: no warm-up run at load, which "
                                     "pyedgemoe never makes"), None),
    ("override_tensor", Optional[str], typer.Option(
        None, "-ot", "--override-tensor", help="llama.cpp's PATTERN=CPU over experts' tensors (e.g. "
        "'.ffn_.*_exps.=CPU'): experts in host memory, where pyedgemoe keeps those its expert cache does not hold; "
        "taken with a note (others are refused)"), moe_placement.override_tensor),
    ("cpu_moe", bool, typer.Option(False, "-cmoe", "--cpu-moe", help="llama.cpp's: taken as -ot does"),
     moe_placement.cpu_moe),
    ("n_cpu_moe", Optional[int], typer.Option(None, "-ncmoe", "--n-cpu-moe", help="llama.cpp's: taken as -ot does"),
     moe_placement.n_cpu_moe),
    ("context_shift", Optional[bool], typer.Option(
        None, "--context-shift/--no-context-shift", help="llama.cpp's: only off, its default: a generation ends "
        "when the context is full (finish reason length)"), _no_context_shift),
    ("keep", Optional[int], typer.Option(None, "--keep", help="llama.cpp's: the prompt's tokens a context shift "
                                         "keeps; taken with a note (no context shift here)"), _keep),
    ("simple_io", bool, typer.Option(False, "--simple-io", help="llama.cpp's: plain input and output, which pyedgemoe "
                                     "always has"), None),
    ("kv_unified", Optional[bool], typer.Option(
        None, "-kvu/-no-kvu", "--kv-unified/--no-kv-unified", help="llama.cpp's: only off: each of -np sequences has "
        "its own share of the context"), _no_kv_unified),
    ("prio", Optional[int], typer.Option(None, "--prio", help="the process's priority, as llama.cpp's: low (-1), "
                                         "normal (0), medium (1), high (2), realtime (3; above normal needs "
                                         "privileges)"), set_priority),
)
# llama.cpp's words for -fa (common/arg.cpp): the Engine's flash_attn
FLASH_ATTN = {"on": True, "enabled": True, "true": True, "1": True, "off": False, "disabled": False, "false": False,
              "0": False, "auto": None}


def _expert_option(name: str) -> tuple[object, object]:
    """(annotation, typer option) of one expert option: unset (None) unless given."""
    value = default(name)
    shown = AUTOMATIC.get(name) or (",".join(f"{w:g}" for w in value) if name == "policy_weights" else value)
    help = f"{help_text(name)} (default: {shown})"
    flag = "--" + name.replace("_", "-")
    load = LOAD_OPTIONS.get(name)
    if isinstance(value, bool) or (load and load.kind is bool):
        return Optional[bool], typer.Option(None, f"{flag}/--no-{flag[2:]}", help=help)
    kind = load.kind if load else str if choices(name) or isinstance(value, (str, list, tuple)) else type(value)
    return Optional[kind], typer.Option(None, *([load.short_flag] if load and load.short_flag else []), flag, help=help)


def model_options(command=None, *, without: tuple[str, ...] = ()):
    """Adds the model-loading options to a typer command, which gets them as `engine_options`, but
    those named in `without` (a command that sizes the cache itself has no --expert-cache, one with
    a flag of its own for flash attention no -fa, bench's warm-up runs no --no-warmup)."""
    if command is None:
        return functools.partial(model_options, without=without)
    engine = [o for o in _ENGINE_OPTIONS if o[0] not in without]
    added = [(name, annotation, option) for name, annotation, option, _ in engine]
    added += [o for o in _KV_TYPES if o[0] not in without] + [_ROPE_SCALE, _LIST_DEVICES, _CHAT_TEMPLATE_FILE,
                                                                 _HF_REPO_LOW]
    llama_cpp_flags = [o for o in _LLAMA_CPP_FLAGS if o[0] not in without]
    added += [(name, annotation, option) for name, annotation, option, _ in llama_cpp_flags]
    added += list(llama_log.OPTIONS)
    added += [(name, *_expert_option(name)) for name in OPTION_NAMES]

    def collect(params: dict) -> dict:
        for name, _, _, take in llama_cpp_flags:
            value = params.pop(name)
            note = take(value) if value not in (None, False) and take is not None else None
            if note:
                typer.echo(f"note: {note}", err=True)
        engine_options = {keyword: params.pop(name) for name, _, _, keyword in engine}
        verbose = llama_log.apply(engine_options.get("verbose", False), *(params.pop(o[0]) for o in llama_log.OPTIONS))
        if "verbose" in engine_options:
            engine_options["verbose"] = verbose
        for keyword in ("n_threads", "n_threads_batch"):  # llama.cpp's -t/-tb 0 or -1 (its default): the default
            if keyword in engine_options and engine_options[keyword] is not None and engine_options[keyword] <= 0:
                engine_options[keyword] = None
        k, v = (params.pop(name, None) for name, _, _ in _KV_TYPES)
        if k is not None or v is not None:
            if k != v:
                raise InvalidOptionError(f"-ctk {k or 'f16'} -ctv {v or 'f16'}: pyedgemoe's KV cache takes one type for "
                                         "K and V (f16 where not given, as in llama.cpp): give both the same")
            engine_options["kv_type"] = k
        if engine_options.get("flash_attn") is not None:
            fa = engine_options["flash_attn"]
            if fa.lower() not in FLASH_ATTN:
                raise InvalidOptionError(f"--flash-attn takes on, off or auto, got {fa!r}")
            engine_options["flash_attn"] = FLASH_ATTN[fa.lower()]
        params.pop(_LIST_DEVICES[0])
        scale = params.pop(_ROPE_SCALE[0])
        if scale is not None:
            if not 0 < scale < math.inf:
                raise InvalidOptionError(f"--rope-scale must be a positive number, got {scale:g}")
            if params["rope_freq_scale"] not in (None, 1 / scale):
                raise InvalidOptionError(f"--rope-scale {scale:g} is --rope-freq-scale {1 / scale:g}, not "
                                         f"{params['rope_freq_scale']:g}: give one of them")
            params["rope_freq_scale"] = 1 / scale
        template_file = params.pop(_CHAT_TEMPLATE_FILE[0])
        if template_file is not None:
            if params["chat_template"] is not None:
                raise InvalidOptionError("give --chat-template or --chat-template-file, not both")
            try:
                params["chat_template"] = template_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise InvalidOptionError(f"--chat-template-file: cannot read {template_file}: {e}") from None
        low_repo = params.pop(_HF_REPO_LOW[0])
        if low_repo is not None:
            if params["low_from"] is not None:
                raise InvalidOptionError("give --low-from FILE or -hfl USER/MODEL[:QUANT], not both")
            params["low_from"] = hub_model(low_repo)
        engine_options["expert_options"] = ExpertOptions(**{name: params.pop(name) for name in OPTION_NAMES})
        return engine_options
    return _with_options(command, "engine_options", added, collect)


# llama.cpp's flags of two settings that are not request fields here (OpenAI's logit_bias is a JSON
# object; llama-cpp-python's server has no penalty window)
_LLAMA_CPP_SAMPLING = (
    ("penalty_last_n", Optional[int], typer.Option(
        None, "--repeat-last-n", help="the recent tokens the penalties count (0: off, -1: the context), as "
        f"llama.cpp's (default: {SamplingParams.penalty_last_n})")),
    ("logit_bias", Optional[list[str]], typer.Option(
        None, "-l", "--logit-bias", help="TOKEN_ID(+/-)BIAS: add BIAS to the token's logit (15043-inf: never that "
        "token), as llama.cpp's -l; can be given several times")),
)
_LOGIT_BIAS = re.compile(r"\s*(\d+)\s*([+-])(.+)")


def log_options(command):
    """Adds -v and llama.cpp's --log-* flags to a typer command that loads no Engine (tokenize's
    vocabulary), which gets whether to be verbose as `verbose`."""
    verbose = next(o[:3] for o in _ENGINE_OPTIONS if o[0] == "verbose")

    def collect(params: dict) -> bool:
        return llama_log.apply(*(params.pop(o[0]) for o in (verbose, *llama_log.OPTIONS)))
    return _with_options(command, "verbose", [verbose, *llama_log.OPTIONS], collect)


def sampling_options(command=None, *, request_defaults: bool = False):
    """Adds SamplingParams's flags to a typer command, which gets them as `sampling`; a setting with
    a file flag (--grammar-file, --json-schema-file) can be read from a file instead. With
    request_defaults (serve), every flag is unset unless given and `sampling` is the dict of those
    given (SamplingParams's names, checked): a request's settings where it gives none, as
    llama-server's flags are."""
    if command is None:
        return functools.partial(sampling_options, request_defaults=request_defaults)
    hints = get_type_hints(SamplingParams)
    fields = exposed_fields()

    def option(f):
        kind = Optional[_held_type(hints[f.name])] if f.default is None else \
            Optional[type(f.default)] if request_defaults else type(f.default)
        fallback = "unset" if f.default is None else f"{f.default}, a chat's {CHAT_TEMPERATURE}" \
            if f.name == "temperature" else f.default
        shown = f" (a request's where it gives none; else {fallback})" if request_defaults else ""
        return (f.name, kind, typer.Option(None if request_defaults else f.default,
                                           *filter(None, (f.metadata["short_flag"], f.metadata["flag"])),
                                           help=f"{f.metadata['help']}{shown}" if f.metadata["help"] else None))
    added = [option(f) for f in fields]
    added += [(f"{f.name}_file", Optional[Path],
               typer.Option(None, *filter(None, (f.metadata["file_short_flag"], f.metadata["file_flag"])),
                            help=f"file to read {f.metadata['flag']} from"))
              for f in fields if f.metadata["file_flag"]]
    added += list(_LLAMA_CPP_SAMPLING)

    def collect(params: dict) -> SamplingParams:
        given = {f.name: params.pop(f.name) for f in fields}
        window, biases = (params.pop(name) for name, _, _ in _LLAMA_CPP_SAMPLING)
        if window is not None:
            if window < WHOLE_CONTEXT:
                raise InvalidOptionError(f"--repeat-last-n must be >= -1 (0: off, -1: the context), got {window}")
            given["penalty_last_n"] = window
        if biases:
            given["logit_bias"] = [_logit_bias(b) for b in biases]
        for f in (f for f in fields if f.metadata["file_flag"]):
            path = params.pop(f"{f.name}_file")
            if path is not None:
                if given[f.name] is not None:
                    raise InvalidOptionError(f"give {f.metadata['flag']} or {f.metadata['file_flag']}, not both")
                try:
                    given[f.name] = path.read_text()
                except (OSError, UnicodeDecodeError) as e:
                    raise InvalidOptionError(f"{f.metadata['file_flag']}: cannot read {path}: {e}") from None
        if request_defaults:
            given = {name: value for name, value in given.items() if value is not None}
            SamplingParams.of(given)  # checked
            return given
        return SamplingParams.of(given)
    return _with_options(command, "sampling", added, collect)


# llama.cpp's words for --reasoning (its is_truthy, is_falsey, is_autoy): the template's enable_thinking
REASONING_WORDS = {**dict.fromkeys(("on", "enabled", "true", "1"), True),
                   **dict.fromkeys(("off", "disabled", "false", "0"), False), "auto": None, "-1": None}


def chat_template_options(command=None, *, request_defaults: bool = False):
    """Adds the chat template's variables to a typer command, which gets them as `template_kwargs` (a
    dict): --chat-template-kwargs (a JSON object), with llama.cpp's -rea/--reasoning on|off
    (enable_thinking) and --reasoning-effort LEVEL (reasoning_effort). request_defaults (serve): the
    variables where a request gives none of that name."""
    if command is None:
        return functools.partial(chat_template_options, request_defaults=request_defaults)
    where = " where a request's do not say" if request_defaults else ""
    added = [
        ("chat_template_kwargs", Optional[str], typer.Option(
            None, "--chat-template-kwargs", help=f"the chat template's variables{where}, a JSON object, e.g. "
            "'{\"enable_thinking\": false}' (llama.cpp's)")),
        ("reasoning", str, typer.Option("auto", "-rea", "--reasoning", help=f"a reasoning model's thinking{where}: on, "
                                        "off (the template's enable_thinking, as Qwen3's) or auto (on, where the "
                                        "template has the switch), as llama.cpp's")),
        ("reasoning_effort", str, typer.Option("default", "--reasoning-effort", help=f"the template's "
                                               f"reasoning_effort{where} (low, medium, high: GPT-OSS's), as "
                                               "llama.cpp's; default: the template's")),
    ]

    def collect(params: dict) -> dict:
        given, reasoning, effort = (params.pop(name) for name, _, _ in added)
        out = {}
        if given is not None:
            try:
                out = json.loads(given)
            except json.JSONDecodeError as e:
                raise InvalidOptionError(f"--chat-template-kwargs is not JSON: {e}") from None
            if not isinstance(out, dict):
                raise InvalidOptionError("--chat-template-kwargs must be a JSON object")
        if reasoning not in REASONING_WORDS:
            raise InvalidOptionError(f"--reasoning takes on, off or auto, got {reasoning!r}")
        flags = {"enable_thinking": REASONING_WORDS[reasoning],
                 "reasoning_effort": None if effort == "default" else effort}
        for name, value in flags.items():
            if value is not None:
                if out.get(name, value) != value:
                    raise InvalidOptionError(f"--chat-template-kwargs gives {name} {out[name]!r}, --reasoning or "
                                             f"--reasoning-effort {value!r}: give one")
                out[name] = value
        return out
    return _with_options(command, "template_kwargs", added, collect)


def speculative_options(command):
    """Adds llama.cpp's flags of self-speculative decoding (--spec-type ngram-simple and its sizes) to
    a typer command, which gets the drafter (pyedgemoe.speculative) as `draft_model` (None: none)."""
    added = [
        ("spec_type", str, typer.Option("none", "--spec-type", help="speculative decoding without a draft model, as "
                                        "llama.cpp's: ngram-simple guesses that the text goes on as after the last "
                                        "earlier occurrence of its last N tokens, and the model checks M of them in "
                                        "one batch while that pays (docs/speculative.md); none: off")),
        ("size_n", Optional[int], typer.Option(None, "--spec-ngram-simple-size-n", help="ngram-simple: the tokens "
                                               f"looked up, N (default: {NGRAM_SIMPLE_SIZE_N})")),
        ("size_m", Optional[int], typer.Option(None, "--spec-ngram-simple-size-m", help="ngram-simple: the tokens "
                                               f"guessed at most, M (default: {NGRAM_SIMPLE_SIZE_M})")),
    ]

    def collect(params: dict):
        spec_type, size_n, size_m = (params.pop(name) for name, _, _ in added)
        if spec_type != "ngram-simple" and (size_n is not None or size_m is not None):
            raise InvalidOptionError("--spec-ngram-simple-size-n/-m are sizes of --spec-type ngram-simple: give it too")
        return drafter(spec_type, NGRAM_SIMPLE_SIZE_N if size_n is None else size_n,
                       NGRAM_SIMPLE_SIZE_M if size_m is None else size_m)
    return _with_options(command, "draft_model", added, collect)


def _logit_bias(text: str) -> tuple[int, float]:
    """llama.cpp's -l TOKEN_ID(+/-)BIAS."""
    match = _LOGIT_BIAS.fullmatch(text)
    try:
        return int(match[1]), float(match[2] + match[3].strip())
    except (TypeError, ValueError):
        raise InvalidOptionError(f"--logit-bias takes TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-inf, got {text!r}") from None


def _held_type(hint) -> type:
    """The type an optional annotation (`int | None`) holds."""
    return next(t for t in get_args(hint) if t is not type(None))


def model_source(help: str = "GGUF model file (a split GGUF: its first shard)"):
    """Adds the model's flags to a typer command, which gets the model's path as `model`: the
    argument MODEL (help), llama.cpp's -m/--model, a Hugging Face repo's GGUF (llama.cpp's
    -hf/-hff/-hft: pyedgemoe.model_source) or a URL's (-mu: pyedgemoe.url_model; -m then the place
    it goes). Exactly one of them; --offline keeps -hf and -mu to their caches."""
    added = [
        ("model_file", Optional[Path], typer.Argument(None, metavar="MODEL", show_default=False, help=help)),
        ("model_flag", Optional[Path], typer.Option(None, "-m", "--model", help="the model file, as llama.cpp's -m "
                                                    "(or give it as MODEL)")),
        ("hf_repo", Optional[str], typer.Option(
            None, "-hf", "-hfr", "--hf-repo", help="a GGUF of a Hugging Face repo, USER/MODEL[:QUANT], as llama.cpp's "
            f"-hf: the quant's file (any case; default {', else '.join(DEFAULT_QUANTS)}, else the repo's first GGUF), "
            "with its shards, downloaded into huggingface_hub's cache (offline: taken from it)")),
        ("model_url", Optional[str], typer.Option(
            None, "-mu", "--model-url", help="a GGUF at this http(s) URL, as llama.cpp's -mu: downloaded (a split "
            "one's first shard with its shards) into llama.cpp's cache ($LLAMA_CACHE, else ~/.cache/llama.cpp), or "
            "to -m's path, unless already there and unchanged on the server (its ETag)")),
        ("offline", bool, typer.Option(False, "--offline", help="no network: -hf, -hfl and -mu take only files already "
                                       "in their caches, as llama.cpp's --offline (HF_HUB_OFFLINE=1 too)")),
        ("hf_file", Optional[str], typer.Option(None, "-hff", "--hf-file", help="with -hf: this file of the repo in "
                                                "place of the quant, as llama.cpp's -hff")),
        ("hf_token", Optional[str], typer.Option(None, "-hft", "--hf-token", help="the Hugging Face access token for "
                                                 "-hf (default: HF_TOKEN, or huggingface_hub's login)")),
    ]

    def collect(params: dict) -> Path:
        path, flag, repo, url, offline, hf_file, token = (params.pop(name) for name, _, _ in added)
        if offline:  # for this process: -hf's and -hfl's huggingface_hub, and -mu
            os.environ["HF_HUB_OFFLINE"] = "1"
        # llama.cpp's variables (llama_env) give way to a model given on the command line; -hff and -hft
        # from them go with -hf only
        sources = {"model_file": path, "model_flag": flag, "hf_repo": repo, "model_url": url}
        if any(value is not None and not from_environment(name) for name, value in sources.items()):
            flag, repo, url = (None if from_environment(name) else sources[name] for name in ("model_flag", "hf_repo",
                                                                                               "model_url"))
        hf_file, token = (None if value is not None and from_environment(name) and repo is None else value
                          for name, value in (("hf_file", hf_file), ("hf_token", token)))
        # with -mu, -m is where the download goes, as in llama.cpp
        given = [what for what, value in (("MODEL", path), ("-m", None if url else flag), ("-hf", repo), ("-mu", url))
                 if value is not None]
        if len(given) != 1:
            raise InvalidOptionError("give the model once: MODEL, -m MODEL, -hf USER/MODEL[:QUANT] or -mu URL"
                                     + (f" (given: {', '.join(given)})" if given else ""))
        if repo is None and (hf_file is not None or token is not None):
            raise InvalidOptionError(f"{'-hff' if hf_file is not None else '-hft'} goes with -hf USER/MODEL")
        if url is not None:
            return Path(url_model(url, flag, offline_asked()))
        return Path(hub_model(repo, hf_file, token)) if repo is not None else path or flag
    return lambda command: _with_options(command, "model", added, collect, first=True)


def model_name(ctx: typer.Context, model: Path) -> str:
    """The model's name as llama-server gives it: -hf's USER/MODEL[:QUANT] as given, else the file's
    name (a command of @model_source, its context)."""
    return ctx.params.get("hf_repo") or model.name


def _with_options(command, receives: str, added: list[tuple], collect, first: bool = False):
    """command with the parameters `added` ((name, annotation, typer option) each) in place of its
    parameter `receives`, which gets collect(params) (collect pops the added ones from params); a
    PyEdgeMoEError of collect is one error line. first: the added ones before the others (the
    command's arguments)."""
    signature = inspect.signature(command)

    @functools.wraps(command)
    def with_options(**params):
        try:
            value = collect(params)
        except PyEdgeMoEError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1)
        return command(**params, **{receives: value})

    hints = get_type_hints(command)  # the command's own annotations, resolved where it was written
    kept = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in signature.parameters.values()
            if p.name != receives]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if first else inspect.Parameter.KEYWORD_ONLY
    new = [inspect.Parameter(name, kind, default=option, annotation=annotation) for name, annotation, option in added]
    given = [p for p in kept if p.default is inspect.Parameter.empty]  # a typer.Context: before the defaults
    parameters = given + new + [p for p in kept if p not in given] if first else kept + new
    with_options.__signature__ = signature.replace(parameters=parameters)
    with_options.__annotations__ = {p.name: p.annotation for p in parameters}
    return with_options
