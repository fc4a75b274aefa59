"""How offloaded experts are served: one option schema from the CLI to the C++ layer.

Every option is declared once: the expert cache's in native/src/expert-options.h (type, name,
default, help), bound as `_native.ExpertOptions`, whose names, defaults, choices and help come from
there; those of where and how the model is loaded that the native layer does not take (device,
host_cache, repack, n_gpu_layers, tensor_split, rpc, mmap, override_kv, chat_template, RoPE scaling's,
pyedgemoe.rope_scaling, the embeddings' pooling, pyedgemoe.embeddings, and LoRA adapters,
pyedgemoe.lora) in LOAD_OPTIONS here. The defaults default() gives are the ones that apply
(mode's depends on the build: default_mode). The CLI's flags, Engine's keywords and Llama's are
made from them. This module adds what only the model and its calibration know, for options a
caller leaves unset:

- with LOW copies available (a multi-precision GGUF, or low_from=OTHER.gguf), HOBBIT's dynamic
  loading is on (docs/mixed-precision.md): a missed selection is loaded in HIGH precision if its
  score s_i <= t1, in LOW if s_i <= t2, and skipped above (the top-1 always HIGH). Without LOW
  copies everything is HIGH and nothing is skipped: offloading is lossless.
- a calibration sidecar next to the model (pyedgemoe calibrate) supplies t1, t2 and the cache
  policy with its weights.
"""
from __future__ import annotations

import difflib
import enum
import inspect
import os
from dataclasses import dataclass

from pyedgemoe import _native, embeddings, kv_overrides, lora, rope_scaling, rpc
from pyedgemoe.chat_template import template_source
from pyedgemoe.context_checkpoints import DEFAULT_LIMIT as DEFAULT_CHECKPOINTS
from pyedgemoe.devices import gpu_devices
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.model_info import ModelInfo, read_model_info
from pyedgemoe.sysmem import format_bytes


@dataclass(frozen=True)
class LoadOption:
    """An option of where the model runs that the native layer does not take (its type, its help, and
    what it becomes left unset); it is given and checked as the native ones are."""
    kind: type
    help: str
    automatic: str
    short_flag: str | None = None  # a CLI flag besides --name


# The native options (native/src/expert-options.h) first, then these.
LOAD_OPTIONS: dict[str, LoadOption] = {
    "device": LoadOption(str, "the GPU by ggml's name, e.g. Vulkan0, CUDA0; several (RPC0,RPC1): the layers spread "
                         "over them, each layer's experts cached on its device; none: the CPU alone (--mode cpu), "
                         "as llama.cpp's -dev none", "the first", short_flag="-dev"),
    "host_cache": LoadOption(str, "with a GPU: RAM for experts between the file and the GPU: 8GiB, 50% "
                             "(of expert bytes), 0 or auto", "auto: every expert copy, or what RAM has free"),
    "repack": LoadOption(bool, "repacked copies of the weights, as llama.cpp makes them",
                         "off where experts stream through an expert cache or stay mapped, or where the copies "
                         "would not fit beside the mapped experts; else on"),
    "n_gpu_layers": LoadOption(str, "llama.cpp's habit: 0 is --mode cpu; -1, all or a layer count, the GPU where "
                               "this build has one (--mode auto; every layer goes to the GPU), else the CPU; auto: "
                               "--mode decides", "--mode decides", short_flag="-ngl"),
    "tensor_split": LoadOption(str, "with several --device: the layers' shares per device, e.g. 3,1 (llama.cpp's "
                               "--tensor-split)", "by the devices' free memory"),
    "rpc": LoadOption(str, "other machines' devices: HOST:PORT[,HOST:PORT...] of `pyedgemoe rpc-server`s "
                      "(llama.cpp's --rpc); they are RPC0, RPC1, ... for --device", "none"),
    "mmap": LoadOption(bool, "map the model file, as llama.cpp does (--no-mmap: read the weights into memory)",
                       "on where every weight is resident; off beside an expert cache or mapped experts (the other "
                       "weights read into memory)"),
    "swa_full": LoadOption(bool, "a full-size KV cache for the sliding-window layers (GPT-OSS's, Gemma's; llama.cpp's "
                           "--swa-full); --no-swa-full: their window's positions alone, less memory for a long "
                           "context, but a prompt that departs from the one before further back than the window "
                           "restores a context checkpoint or is evaluated afresh (--ctx-checkpoints)",
                           "on (llama-cpp-python's default)"),
    "ctx_checkpoints": LoadOption(int, "context checkpoints a sequence keeps where the model's memory cannot drop its "
                                  "last tokens (recurrent layers: Qwen3-Next's, LFM2's; --no-swa-full): a prompt that "
                                  "departs from the one before (a chat's next turn) restores the latest one before the "
                                  "departure instead of evaluating everything afresh; each held in memory, up to the "
                                  "model's recurrent states (llama.cpp's --ctx-checkpoints; 0: none)",
                                  f"{DEFAULT_CHECKPOINTS} where the model's memory needs them, else none",
                                  short_flag="-ctxcp"),
    "override_kv": LoadOption(str, "model metadata replaced at load, KEY=TYPE:VALUE[,...] with TYPE int, float, bool "
                              "or str (llama.cpp's --override-kv), e.g. qwen3moe.expert_used_count=int:4: 4 experts a "
                              "token (lossy)", "none"),
    **{name: LoadOption(kind, help, rope_scaling.AUTOMATIC) for name, (kind, help) in rope_scaling.OPTIONS.items()},
    "chat_template": LoadOption(str, "a chat template (Jinja) in place of the model's, as llama.cpp's --chat-template "
                                "(chatml: ChatML; --chat-template-file reads one)", "the model's"),
    "pooling": LoadOption(str, embeddings.POOLING_HELP, "the model's (none for a generative model)"),
    "lora": LoadOption(str, "LoRA adapters, FNAME[,FNAME...] (GGUF; llama.cpp's --lora): with an adapter that "
                       "changes the experts, every expert resident", "none"),
    "lora_scaled": LoadOption(str, "LoRA adapters with their scales, FNAME:SCALE[,FNAME:SCALE...] (llama.cpp's "
                              "--lora-scaled)", "none"),
}
NATIVE_NAMES: tuple[str, ...] = tuple(_native.ExpertOptions.names)
OPTION_NAMES: tuple[str, ...] = NATIVE_NAMES + tuple(LOAD_OPTIONS)
_DEFAULTS = _native.ExpertOptions()
FLOAT_MAX = 3.4028234663852886e38  # a C float's largest


def default_mode(has_gpu: bool) -> str:
    """mode's default: auto where the build has a GPU (the residency layer measures at load which of
    gpu, coop and split serves misses fastest), else cpu, the one mode of a CPU-only build."""
    return "auto" if has_gpu else "cpu"


def default(name: str):
    """The default that applies to an option left unset (an enum option by its name): the native
    schema's, mode's for this build (default_mode), None for a load option (AUTOMATIC says what it
    becomes)."""
    if name in LOAD_OPTIONS:
        return None
    if name == "mode":
        return default_mode(bool(gpu_devices()))
    value = getattr(_DEFAULTS, name)
    return value.name if isinstance(value, enum.Enum) else value


def choices(name: str) -> tuple[str, ...] | None:
    """The names an enum option takes; None for other options."""
    value = getattr(_DEFAULTS, name, None)
    return tuple(type(value).__members__) if isinstance(value, enum.Enum) else None


def help_text(name: str) -> str:
    if name in LOAD_OPTIONS:
        return LOAD_OPTIONS[name].help
    return getattr(_native.ExpertOptions, name).__doc__ or ""


def options_dict(native: _native.ExpertOptions) -> dict:
    """The native options by name (an enum by its name), as expert_residency_info gives them."""
    values = {name: getattr(native, name) for name in NATIVE_NAMES}
    return {name: v.name if isinstance(v, enum.Enum) else v for name, v in values.items()}


# With LOW copies, a prefill ubatch's least popular experts covering this share of its selections
# are LOW (Fate's prefill): on the benchmarks' OLMoE geometry under 25/50 % caps, prefill 1.6-1.7x
# stock llama.cpp's speed (single runs at 0.5: 1.2-1.8x); on the demo model +0.16 % batch
# perplexity with Q4_K LOW copies, +0.64 % with Q2_K (docs/benchmarks.md, docs/fidelity.md).
PREFILL_LOW_SHARE = 0.75

# prefetch left unset, with an expert cache in host memory holding at most this share of the
# experts' bytes: Fate's prefetch (one layer ahead) with a core of its own for the reads, the
# decode computing on the other cores. Measured on 2 cores (docs/benchmarks.md, "Prefetch on a core
# of its own"): decode 1.08-1.29x with 13-18 % of the experts cached; with 41-45 % from 0.92x
# (Qwen3) to 1.23x (OLMoE); with 69-88 %, where few experts are missed, the core the decode gives
# up costs more than the reads hidden (0.77-0.94x on Qwen3). With LOW copies (prefetching made
# independent of timing there, "Prefetching with LOW copies"): 1.02-1.19x at the 25 % caps. The
# disk's rate is not an input: from page-cache speed down to 300 MiB/s it changed no choice ("The
# disk's rate and the prefetch choice").
PREFETCH_CACHE_SHARE = 0.3
# Reads of experts smaller than this are latency (a request's round trip), not bandwidth, and the
# compute between two layers of such a model hides none of them: on the trained demo and fine
# models (experts of 204 and 26 KiB) Fate's prefetch read 25-43 % more bytes and decoded slower
# (docs/benchmarks.md, "Prefetch that never costs"); real MoEs' experts are MiBs (OLMoE-1B-7B 6.4
# in Q8_0, Qwen3-30B-A3B 2.5 in Q4_K, Mixtral 8x7B 95 in Q4_K).
PREFETCH_MIN_EXPERT_BYTES = 1 << 20

# What an option left unset becomes, besides its native default (for --help).
AUTOMATIC = {
    "prefetch": f"fate on a core of its own when the cache holds at most {PREFETCH_CACHE_SHARE:.0%} of the "
                f"experts, an expert is at least {PREFETCH_MIN_EXPERT_BYTES >> 20} MiB and --threads is not given, "
                "else none",
    "cache_policy": "calibrated: the best on the calibration's replay for the mode that runs (lossless, or with "
                    "LOW copies); hobbit when n_parallel > 1; else adaptive (lru or decay, whichever shadow "
                    "caches of each say hits more lately)",
    "policy_weights": "calibrated, else equal",
    "low_precision": "on when LOW copies exist, unless the experts have biases (GPT-OSS)",
    "skip": "with low precision",
    "prefill_low_share": f"{PREFILL_LOW_SHARE} with low precision, else 0",
    "t1": f"calibrated, else {default('t1')}",
    "t2": f"calibrated, else {default('t2')}",
    "mode": f"{default_mode(True)} with a GPU, else {default_mode(False)}",
    "low_cache": f"{default('low_cache')}; with static_precision, the LOW share of the map's bytes",
    **{name: option.automatic for name, option in LOAD_OPTIONS.items()},
}


def auto_prefetch(cache_share: float, expert_bytes: int, cores: int, threads_given: bool) -> tuple[str, str]:
    """What prefetch left unset becomes, with an expert cache in host memory holding cache_share of
    the experts' bytes (each of expert_bytes, HIGH), on `cores` cores: the mode, and why, for the
    note on stderr. Prefetching takes a core from the decode (Engine's n_threads), so only when the
    decode's threads are not given."""
    if cache_share >= 1:
        return "none", "the cache is the size of all the experts"
    if cache_share > PREFETCH_CACHE_SHARE:
        return "none", f"the cache holds {cache_share:.0%} of the experts"
    if threads_given:
        return "none", "the decode's threads are given: no core of theirs goes to reads"
    if cores < 2:
        return "none", "one core: none to leave to reads"
    if expert_bytes < PREFETCH_MIN_EXPERT_BYTES:
        return "none", f"experts of {format_bytes(expert_bytes)}: too small for the compute to hide their reads"
    return "fate", f"its reads on 1 of {cores} cores, the cache holds {cache_share:.0%} of the experts"


def parse_policy_weights(value) -> tuple[float, float, float, float]:
    """"a,b,c,d" or four numbers (lru, lfu, lhu, fld), non-negative, normalized to sum 1."""
    try:
        weights = [float(p) for p in (value.split(",") if isinstance(value, str) else value)]
    except (TypeError, ValueError):
        raise InvalidOptionError(f"policy weights must be four numbers a,b,c,d, got {value!r}") from None
    if len(weights) != 4 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise InvalidOptionError(f"policy weights must be four non-negative numbers (lru,lfu,lhu,fld) "
                                 f"with a positive sum, got {value!r}")
    total = sum(weights)
    return tuple(w / total for w in weights)


def _converted(name: str, value):
    """value as the native field's type (a load option's: as given, checked), or InvalidOptionError."""
    if name in LOAD_OPTIONS:
        return _load_option(name, value)
    kind = default(name)
    names = choices(name)
    if names is not None:
        if isinstance(value, enum.Enum):
            value = value.name
        if value not in names:
            raise InvalidOptionError(f"unknown {name} {value!r} ({', '.join(names)})")
        return getattr(type(getattr(_DEFAULTS, name)), value)
    if name == "policy_weights":
        return parse_policy_weights(value)
    if name == "low_from":
        if not isinstance(value, (str, os.PathLike)):
            raise InvalidOptionError(f"low_from must be a file's path, got {value!r}")
        if not os.path.isfile(value):
            raise InvalidOptionError(f"--low-from file not found: {os.fspath(value)}")
        return os.fspath(value)
    if isinstance(kind, bool):
        if not isinstance(value, bool):
            raise InvalidOptionError(f"{name} must be True or False, got {value!r}")
        return value
    if isinstance(kind, int):
        if isinstance(value, bool) or not isinstance(value, int) or not -2**31 <= value < 2**31:
            raise InvalidOptionError(f"{name} must be an integer within 32 bits, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidOptionError(f"{name} must be a number, got {value!r}")
    return float(value)


def _load_option(name: str, value):
    if name in ("repack", "mmap", "swa_full"):
        if not isinstance(value, bool):
            raise InvalidOptionError(f"{name} must be True or False, got {value!r}")
    elif name == "device":
        if not isinstance(value, str) or not value.strip():  # llama.cpp's -dev '': "invalid device"
            raise InvalidOptionError(f"device must be a device's name, got {value!r}")
    elif name == "tensor_split":  # "3,1" or a list of numbers, as Llama(tensor_split=[...]) takes it
        text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
        try:
            shares = [float(x) for x in str(text).split(",")]
        except ValueError:
            shares = []
        # llama.cpp divides by their sum as a float: an infinite one made its load fail on an internal check
        if not shares or any(not s >= 0 for s in shares) or not 0 < sum(shares) < FLOAT_MAX:
            raise InvalidOptionError(f"tensor_split must be shares per device like 3,1, got {value!r}")
        value = ",".join(f"{s:g}" for s in shares)
    elif name == "rpc":  # a list of servers as Engine(rpc=[...]) takes it, or llama.cpp's comma list
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            value = ",".join(value)
        if not isinstance(value, str):
            raise InvalidOptionError(f"rpc must be HOST:PORT[,HOST:PORT...] or a list of them, got {value!r}")
        rpc.parse_servers(value)
    elif name == "override_kv":  # llama.cpp's text, or a dict as Llama(kv_overrides={...}) takes it
        value = kv_overrides.canonical(value)
    elif name in rope_scaling.OPTIONS:
        value = rope_scaling.checked(name, value)
    elif name == "chat_template":
        value = template_source(value)
    elif name == "pooling":
        value = embeddings.checked_pooling(value)
    elif name in ("lora", "lora_scaled"):
        lora.adapters(*(value, None) if name == "lora" else (None, value))
        value = tuple(map(tuple, value)) if isinstance(value, (list, tuple)) else value  # pairs from Python
    elif name == "ctx_checkpoints":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
            raise InvalidOptionError(f"ctx_checkpoints must be a count >= 0, got {value!r}")
    elif name == "host_cache":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise InvalidOptionError(f"host_cache must be bytes, a size like '8GiB' or 'auto', got {value!r}")
        if isinstance(value, int) and value < 0:
            raise InvalidOptionError(f"host_cache must be >= 0, got {value}")
    else:  # n_gpu_layers: a count, or llama.cpp's words for -1 and for none given
        value = {"all": -1, "auto": None}.get(value, value) if isinstance(value, str) else value
        value = int(value) if isinstance(value, str) and value.removeprefix("-").isdigit() else value
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < -1):
            raise InvalidOptionError(f"n_gpu_layers must be -1 or all, 0 (none), a layer count or auto, got {value!r}")
    return value


class ExpertOptions:
    """The options a caller gave of how the experts are served and where the model runs, by the
    names of `_native.ExpertOptions` and LOAD_OPTIONS (OPTION_NAMES); None or absent: the automatic
    value (AUTOMATIC) or the default (default()). Checked when made: a wrong name, type or range is
    an InvalidOptionError."""

    def __init__(self, **given):
        unknown = sorted(set(given) - set(OPTION_NAMES))
        if unknown:
            raise unknown_option(unknown[0], OPTION_NAMES, "expert option")
        converted = {name: _converted(name, value) for name, value in given.items() if value is not None}
        self.given = {name: value for name, value in converted.items() if value is not None}  # -ngl auto: none
        t1 = self.given.get("t1", default("t1"))
        self._checked({"t2": max(default("t2"), t1), **self.given})

    def __getitem__(self, name: str):
        """The option as given, else its default (default())."""
        value = self.given[name] if name in self.given else default(name)
        return value.name if isinstance(value, enum.Enum) else value

    def merged(self, **more) -> "ExpertOptions":
        """These options with `more` given on top."""
        return ExpertOptions(**{**self.given, **more})

    def with_keywords(self, keywords: dict, function) -> "ExpertOptions":
        """These options and those given as keyword arguments of function (Engine's **options): a name
        neither an option nor one of function's own parameters, or an option given both ways with two
        values, is an InvalidOptionError."""
        own = [name for name, p in inspect.signature(function).parameters.items()
               if p.kind is inspect.Parameter.KEYWORD_ONLY]
        unknown = sorted(set(keywords) - set(OPTION_NAMES))
        if unknown:
            raise unknown_option(unknown[0], own + list(OPTION_NAMES), "keyword argument")
        more = ExpertOptions(**keywords).given
        for name in sorted(set(more) & set(self.given)):
            if more[name] != self.given[name]:
                raise InvalidOptionError(f"{name} is given twice: {keywords[name]!r} as a keyword argument and "
                                         f"{self[name]!r} in expert_options; give it once")
        return self.merged(**more)

    @staticmethod
    def _checked(values: dict) -> _native.ExpertOptions:
        native = _native.ExpertOptions()
        for name, value in values.items():
            if name not in LOAD_OPTIONS:
                setattr(native, name, value)
        try:
            native.check()
        except ValueError as e:
            raise InvalidOptionError(str(e)) from None
        return native

    def resolve(self, info: ModelInfo, calibration: dict | None, n_parallel: int = 1) -> _native.ExpertOptions:
        """The native options for a model: what was given, else what the model and its calibration
        decide (AUTOMATIC), else the native default. n_parallel: sequences decoding together."""
        calibration = calibration or {}
        given = self.given
        has_low_source = info.multi_precision or "low_from" in given
        if given.get("low_precision") and not has_low_source:
            raise InvalidOptionError("low precision needs LOW expert copies: a multi-precision GGUF "
                                     "(pyedgemoe convert) or --low-from OTHER.gguf")
        if "low_from" in given:
            _check_low_from(info, given["low_from"])
        # expert biases are added by expert id, once per pass: a pass per precision would add them twice
        low_precision = given.get("low_precision", has_low_source and not info.expert_biases)
        if low_precision and info.expert_biases:
            raise InvalidOptionError("low precision (mixed-precision experts) does not support models with expert "
                                     "biases (GPT-OSS): run with low precision off (--no-low-precision)")
        if given.get("static_precision") and given.get("low_precision") is False:
            raise InvalidOptionError("static_precision (EdgeMoE's map) serves its LOW experts in low precision: it "
                                     "needs low precision on, not --no-low-precision")
        rerouting = next((name for name in ("cache_routing", "stand_in") if given.get(name, 0) > 0), None)
        if rerouting and info.fixed_routing:
            raise InvalidOptionError(f"{rerouting} changes which experts a token uses, and this model's experts need "
                                     f"the router's own choice: {info.fixed_routing}")
        # A step of several sequences needs more experts than one token: when a step's experts over
        # every layer outnumber the cache's slots, LRU evicts each layer's experts just before the
        # next step needs them (0-2 % hits on the demo at 25 %); HOBBIT's priority, with its
        # layer-distance term, keeps them (as many bytes per token as one sequence). The
        # calibration's replay is of one sequence, so its choice holds for n_parallel 1 only. It chose
        # for the mode that runs: with LOW copies by the miss penalty, lossless by the loads.
        best = calibration.get("best_policy" if low_precision else "best_lossless_policy") or calibration.get("best_policy")
        single = best or ("hobbit" if "policy_weights" in calibration else "adaptive")
        policy = given["cache_policy"] if "cache_policy" in given else _converted(
            "cache_policy", single if n_parallel == 1 else "hobbit")
        t1 = given.get("t1", calibration.get("t1", default("t1")))
        automatic = {
            "low_precision": low_precision,
            "skip": given.get("skip", low_precision),
            "prefill_low_share": given.get("prefill_low_share", PREFILL_LOW_SHARE if low_precision else 0.0),
            "cache_policy": policy,
            "policy_weights": given.get("policy_weights", tuple(calibration.get("policy_weights", default("policy_weights")))),
            "t1": t1,
            "t2": given.get("t2", calibration.get("t2", max(default("t2"), t1))),
        }
        precision_map = calibration.get("precision_map")
        if given.get("static_precision") and "low_cache" not in given and precision_map:
            automatic["low_cache"] = _static_low_share(info, precision_map)
        return self._checked({**given, **automatic})


def unknown_option(name: str, valid, what: str) -> InvalidOptionError:
    """An unknown name: the valid ones listed, the closest first if one is close."""
    close = difflib.get_close_matches(name, valid, n=1)
    return InvalidOptionError(f"unknown {what} {name!r}" + (f": did you mean {close[0]!r}?" if close else "")
                              + f" (valid: {', '.join(valid)})")


def _static_low_share(info: ModelInfo, precision_map: dict) -> float:
    """EdgeMoE's map decides each expert's one precision: the LOW tier gets the LOW experts' share
    of the bytes (within [0.05, 0.95]: each tier keeps room for a token's experts)."""
    ratio = info.low_expert_bytes / info.high_expert_bytes
    n_low, n = precision_map["n_low"], precision_map["n_experts"]
    low = n_low * ratio
    return min(0.95, max(0.05, low / (low + n - n_low))) if n else default("low_cache")


def fill_ranking(calibration: dict | None, n_experts: int) -> dict[int, list[int]]:
    """Per MoE layer, its experts most routed first, from the calibration's expert usage (the
    counts of calibration's expert_usage); layers it does not cover fill by expert id."""
    usage = (calibration or {}).get("expert_usage") or {}
    return {int(layer): sorted(range(n_experts), key=lambda e: -counts[e])
            for layer, counts in usage.items() if len(counts) == n_experts}


def _check_low_from(info: ModelInfo, path: str) -> None:
    """A --low-from file must be a standard GGUF of the same model (same architecture and experts)."""
    low = read_model_info(path)
    if low.multi_precision:
        raise InvalidOptionError(f"--low-from {path} is a multi-precision GGUF: give a standard one")
    if (low.architecture, low.n_experts, sorted(low.expert_bytes_per_layer)) != \
            (info.architecture, info.n_experts, sorted(info.expert_bytes_per_layer)):
        raise InvalidOptionError(f"--low-from {path} is not a GGUF of the same model "
                                 f"({low.architecture}, {low.n_experts} experts vs {info.architecture}, "
                                 f"{info.n_experts} experts)")
