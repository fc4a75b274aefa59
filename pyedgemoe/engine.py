"""Engine: the friendly, documented face of pyedgemoe (as llama_cpp.Llama is for llama.cpp).

    from pyedgemoe import Engine
    with Engine("model.gguf", n_ctx=4096) as eng:
        for piece in eng.generate("def fib(n):", max_tokens=64, stream=True):
            print(piece, end="")
"""
from __future__ import annotations

import os
import random
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import gguf
import numpy as np

from pyedgemoe import _native
from pyedgemoe.batch import Batcher, shared_prefix
from pyedgemoe.chat_template import render_chat
from pyedgemoe.calibration.paths import native_entries
from pyedgemoe.calibration.sidecar import load_calibration
from pyedgemoe.devices import check_fits_device, choose_device, host_cache_bytes, resolve_mode
from pyedgemoe.errors import ContextOverflowError, EngineBusyError, ExpertLoadError, InvalidOptionError, ModelLoadError
from pyedgemoe.expert_options import ExpertOptions, auto_prefetch, fill_ranking
from pyedgemoe import memory_budget  # available_memory through the module: tests replace it there
from pyedgemoe.memory_budget import (MAPPED, check_logits_fit, context_bytes, parse_expert_cache, spare_bytes,
                                     ubatch_tokens)
from pyedgemoe.model_info import ModelInfo, read_model_info
from pyedgemoe.sysmem import format_bytes
from pyedgemoe.systems import system_options
from pyedgemoe.threads import ThreadGovernor, cpu_load, default_threads
from pyedgemoe.text_stream import TextStream


@dataclass
class SamplingParams:
    """llama.cpp's sampler chain settings; temperature <= 0 means greedy."""
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    penalty_last_n: int = 64
    seed: int | None = None

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


@dataclass
class GenerationStats:
    """Of one generation: prefill = evaluating the prompt, decode = the generated tokens."""
    n_prompt_tokens: int = 0
    n_cached_prompt_tokens: int = 0  # prompt prefix reused from the previous call's KV cache
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




def _stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def _usage(n_prompt: int, n_completion: int) -> dict:
    """The OpenAI "usage" object."""
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def _expert_summary(experts: dict) -> dict:
    """HOBBIT's telemetry from the native counters: the share of token selections served in HIGH,
    in LOW or skipped, and the miss penalty (a HIGH load costs 1, a LOW load LOW bytes / HIGH bytes)."""
    t = experts["total"]
    selections = t["selections_high"] + t["selections_low"] + t["selections_skip"]
    low_cost = experts["low_expert_bytes"] / experts["expert_bytes"] if experts["expert_bytes"] else 0.0
    share = (lambda n: n / selections if selections else 0.0)
    return {
        "high_fraction": share(t["selections_high"]),
        "low_fraction": share(t["selections_low"]),
        "skip_fraction": share(t["selections_skip"]),
        "hit_rate": t["hits"] / t["requests"] if t["requests"] else 0.0,
        "low_load_cost": low_cost,
        "miss_penalty": t["loads_high"] + low_cost * t["loads_low"],
    }


def top_probability(logits: np.ndarray) -> float:
    """The largest softmax probability of one row of logits (MoBiLE's confidence)."""
    row = np.asarray(logits, dtype=np.float64)
    return float(1.0 / np.exp(row - row.max()).sum())


def _calibrated_tables(model, options, calibration: dict | None) -> None:
    """Hands the native layer what EdgeMoE's options read from the calibration sidecar: the static
    precision map (static_precision) and the path statistics (prefetch edgemoe)."""
    calibration = calibration or {}
    if options.static_precision:
        precision_map = calibration.get("precision_map")
        if not precision_map:
            raise InvalidOptionError("static_precision needs the precision map of `pyedgemoe calibrate --system edgemoe` "
                                     "in the calibration sidecar")
        model.set_expert_precision_map({int(l): es for l, es in precision_map["low"].items()})
    if options.prefetch.name == "edgemoe":
        stats = calibration.get("path_statistics")
        if not stats:
            raise InvalidOptionError("prefetch edgemoe needs the path statistics of `pyedgemoe calibrate` in the "
                                     "calibration sidecar")
        model.set_expert_path_statistics(native_entries(stats))


def _serving(experts: dict, repack: bool, prefetch_why: str) -> str:
    """How the cache serves the experts, for the note on stderr: io, reads in flight, the fill,
    prefetch (and why, when chosen automatically), eviction, precision and repacking, as in effect."""
    fill = f"fill {'in the background' if experts['fill_background'] else 'at load'}" if experts["fill_cache"] else "no fill"
    share = experts["prefill_low_share"]
    precision = ("mixed precision" + (" with skips" if experts["skip"] else "")
                 + (f", prefill low share {share:g}" if share else "")) if experts["mixed_precision"] else "lossless"
    return (f"io {experts['io']} with {experts['io_threads']} reads in flight, {fill}, prefetch {experts['prefetch']}"
            f"{f' ({prefetch_why})' if prefetch_why else ''}, "
            f"eviction {experts['cache_policy']}, {precision}, repack {'on' if repack else 'off'}")


def _positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value <= 0):
        raise InvalidOptionError(f"{name} must be a positive integer, got {value!r}")


class Engine:
    """A GGUF model loaded into pyedgemoe's build of llama.cpp, with one context.

    n_ctx: context window in tokens (0 = the model's training context).
    n_threads / n_threads_batch: threads for decode / prefill (default: the physical cores this
        process may run on, within its cgroup's CPU quota, pyedgemoe.threads; the decode leaves one of them to the expert reads when prefetch, left unset, is on:
        expert_options.auto_prefetch; the core goes back to the decode if prefetching stops itself).
    n_batch: tokens per llama_decode call during prefill.
    seed: default sampling seed (None = random).
    flash_attn: True/False, or None to let llama.cpp decide (its default).
    kv_type: KV cache element type, "f16" (llama.cpp's default), "f32", "q8_0", ...
    expert_cache: bytes of memory for routed experts: an int, "300MiB", "4GiB", "50%" (of the expert
        bytes), or None / "auto" (every expert resident when the model fits in the memory available,
        else a cache of what is left after the non-expert weights, the context's buffers and a small
        allowance; near fit, experts the CPU repacks stay in the mapped file instead). A size that
        cannot fit is refused (InvalidOptionError); a trailing "~" ("60%~", "4GiB~") takes what fits
        if less. With a budget the experts stay in the file and are read into a cache when routed to
        (docs/expert-residency.md). "mmap": no expert cache, the experts are computed from the mapped
        file as llama.cpp does, without repacked copies, and the page cache holds what fits.
    expert_options: how the cache serves experts, one ExpertOptions; its options can also be
        keyword arguments of their own (`io="buffered", prefetch="hobbit"`), which go on top. The
        options (pyedgemoe.expert_options.OPTION_NAMES; `pyedgemoe run --help` lists them with
        their defaults): io, io_threads (reads in flight), fill_cache (read experts at load, most
        routed first when calibrated; with fill_background, the default, while the prompt and the
        first tokens run), cache_policy and policy_weights (HOBBIT's priority), mixed
        precision (low_precision, skip, t1, t2, low_cache, low_hit, low_from; docs/mixed-precision.md),
        prefetch ("none", "hobbit": HOBBIT's walk prefetch_depth layers ahead, "fate"),
        fate_percentile, fate_extra. Left unset, the calibration sidecar and the model decide
        (expert_options.AUTOMATIC), else the defaults of native/src/expert-options.h.
    trace_routing: record every MoE layer's routing for calibration (record_routing): the expert
        predictor then runs even without prefetch.
    mode (an expert option): "cpu", "gpu", "coop" or "auto" (the default where the build has a
        GPU; pyedgemoe.devices, docs/gpu.md). With a GPU, expert_cache is the GPU's expert budget
        (auto: from its free memory), non-expert weights and the KV cache live there too.
    repack: repacked copies of the weights where llama.cpp's CPU backend makes them (its default;
        False is llama.cpp's --no-repack). None (auto): off where the experts stream through an
        expert cache in host memory or stay in the mapped file (each read would be converted again:
        measured slower in load, prefill and decode, docs/benchmarks.md), or where the copies would
        not fit beside the mapped experts they are read from (memory_budget.repack_fits), on otherwise.
    device: the GPU by ggml's name ("Vulkan0", "CUDA0"); default the first.
    host_cache: the host tier (pinned RAM between the file and the GPU, both precisions): bytes,
        a size, "auto" (every expert copy, or what RAM has free) or 0 (none; coop needs one).
    n_parallel: sequences that decode together (pyedgemoe.batch; the server's --parallel): up to
        n_parallel generations, from as many threads, run at once, each in n_ctx / n_parallel
        positions, one llama_decode per step for all of them, so experts they share load once.
        With n_parallel=1, threads take turns: a generation holds the sequence from its first token
        to its end, another thread's waits; a generation this thread left open (streamed, neither
        finished nor closed) makes its next one raise EngineBusyError.
    system: a seed system's preset of the expert options ("lossless", "hobbit", "edgemoe", "fate",
        "mobile"; pyedgemoe.systems, docs/systems.md); options given explicitly win over it.
        static_precision and prefetch="edgemoe" read the calibration sidecar (`pyedgemoe calibrate
        --system edgemoe`); big_little (MoBiLE) decodes with top-k/2 and redoes low-confidence tokens.
    n_logits: tokens whose logits one call of logits() (perplexity: a chunk) returns: their memory
        is counted at load beside the expert cache (auto leaves room for them; an explicit size must
        fit beside them). logits() of more tokens is refused (InvalidOptionError) when they exceed
        what the budget left beside the expert cache at load or the memory available then, rather
        than outgrow a memory limit.
    verbose: forward llama.cpp's log to stderr.
    """

    def __init__(self, model_path: str | os.PathLike, *, n_ctx: int = 4096, n_threads: int | None = None,
                 n_threads_batch: int | None = None, n_batch: int = 512, seed: int | None = None,
                 flash_attn: bool | None = None, kv_type: str = "f16", expert_cache: str | int | None = None,
                 expert_options: ExpertOptions | None = None, trace_routing: bool = False,
                 device: str | None = None, host_cache: str | int | None = None, system: str | None = None,
                 n_parallel: int = 1, repack: bool | None = None, n_logits: int = 0, verbose: bool = False,
                 **options):
        for name, value in (("n_ctx", n_ctx), ("n_logits", n_logits)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidOptionError(f"{name} must be a non-negative integer, got {value!r}")
        for name, value in (("n_threads", n_threads), ("n_threads_batch", n_threads_batch), ("n_batch", n_batch),
                            ("n_parallel", n_parallel)):
            _positive(name, value)
        SamplingParams(seed=seed).validate()
        try:
            kv_ggml_type = int(gguf.GGMLQuantizationType[kv_type.upper()])
        except KeyError:
            raise InvalidOptionError(f"unknown kv_type {kv_type!r} (f16, f32, bf16, q8_0, q4_0, ...)") from None
        flash_attn_type = -1 if flash_attn is None else int(bool(flash_attn))
        expert_options = (expert_options or ExpertOptions()).merged(**options)
        self.model_path = os.fspath(model_path)
        self.info: ModelInfo = read_model_info(self.model_path)
        self.system = system
        if system is not None:
            expert_options = system_options(system, expert_options, self.info, n_parallel)
        self.mode = resolve_mode(expert_options["mode"] if "mode" in expert_options.given else None)
        expert_options = expert_options.merged(mode=self.mode)
        self.device = choose_device(self.mode, device)
        _native.set_verbose(verbose)

        block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kv_ggml_type)]
        predicting = self.info.is_moe and expert_options["prefetch"] == "hobbit"
        context = context_bytes(self.info.metadata, n_ctx, n_batch, type_bytes / block, flash_attn, n_parallel,
                                n_logits, expert_options["prefetch_depth"] if predicting else 0,
                                every_output=self.device is not None)
        self.n_logits = n_logits
        self._n_ubatch = ubatch_tokens(self.info.metadata, n_ctx, n_batch)
        host = memory_budget.available_memory()  # measured once: for the budget and for what it leaves
        budget, self.expert_cache_note = parse_expert_cache(
            expert_cache, self.info.high_expert_bytes, self.info.non_expert_bytes, context,
            self.device["free_bytes"] if self.device else host, refuse=not self.device,  # a GPU: check_fits_device
            repacked_expert_bytes=0 if self.device else self.info.repacked_expert_bytes)
        self.experts_mapped = budget == MAPPED and self.info.is_moe  # in the page cache, no expert cache
        if self.experts_mapped and self.device:
            raise InvalidOptionError(f"expert_cache {MAPPED!r} leaves the experts in the page cache, in host memory: it "
                                     "runs with mode 'cpu'")
        offload = budget not in (None, MAPPED) and self.info.is_moe
        # host memory left for logits asked for beyond n_logits (a GPU's expert cache is not in it)
        self._spare_bytes = spare_bytes(budget if offload and not self.device else 0, self.info.non_expert_bytes,
                                        context, host)
        if offload and self.device:
            check_fits_device(budget, self.device)
        if repack and self.experts_mapped:
            raise InvalidOptionError(f"expert_cache {MAPPED!r} computes from the mapped file: repacked copies would "
                                     "take the experts out of it (repack off)")
        self.repack = repack if repack is not None else not (self.experts_mapped or (offload and not self.device))
        if repack is None and self.repack and not self.device and not memory_budget.repack_fits(
                self.info.high_expert_bytes, self.info.repacked_expert_bytes, self.info.non_expert_bytes, context, host[0]):
            self.repack = False
            self.expert_cache_note += (f"; repack off: {format_bytes(self.info.repacked_expert_bytes)} of repacked "
                                       "copies would not fit beside the mapped experts they are read from")
        host_bytes = host_cache_bytes(host_cache, self.mode, self.info.expert_bytes)  # checked even when unused
        # resolved (and checked: LOW copies asked for must exist) even when every expert is resident
        calibration = load_calibration(self.model_path, self.info.metadata) if self.info.is_moe else None
        default = default_threads()
        cores = default.n
        prefetch_why = ""  # why prefetch is what it is, when chosen here
        native_options = expert_options.resolve(self.info, calibration, n_parallel) if self.info.is_moe else None
        if offload and not self.device and n_parallel == 1 and "prefetch" not in expert_options.given \
                and not native_options.big_little:
            prefetch, prefetch_why = auto_prefetch(budget / self.info.high_expert_bytes, cores, n_threads is not None)
            expert_options = expert_options.merged(prefetch=prefetch)
            native_options = expert_options.resolve(self.info, calibration, n_parallel)
        self._reads_core = bool(prefetch_why) and expert_options["prefetch"] != "none"  # a core the decode left
        if native_options is not None and not offload and (native_options.big_little > 0 or native_options.static_precision
                                                           or native_options.prefetch.name == "edgemoe"):
            raise InvalidOptionError("big_little, static_precision and prefetch edgemoe act on the expert cache: "
                                     "give an expert_cache below the model's experts (e.g. --expert-cache 50%)")
        background = False  # the cache filled in the background
        try:
            # offloading: non-expert weights are read into memory (not mapped), so the file backs
            # nothing but the expert reads, which report a changed file as an error
            self._model = _native.Model(self.model_path, use_mmap=not offload, experts_on_demand=offload,
                                        device=self.device["name"] if self.device else "",
                                        repack=self.repack)
            if offload:
                self._model.enable_expert_residency(budget, native_options, trace_routing, host_bytes,
                                                    n_threads or cores)  # --mode auto measures with them
                _calibrated_tables(self._model, native_options, calibration)
                if native_options.fill_cache:
                    ranking = fill_ranking(calibration, self.info.n_experts)
                    # lossless only: with LOW copies or skips, what a miss computes depends on
                    # whether the fill has cached that expert yet, i.e. on timing
                    background = native_options.fill_background and not native_options.lossy
                    if background:
                        self._model.fill_expert_cache_in_background(ranking)
                    else:
                        self._model.fill_expert_cache(ranking)
        except (_native.ExpertBudgetError, ValueError) as e:
            raise InvalidOptionError(str(e)) from None
        except RuntimeError as e:
            raise ModelLoadError(str(e)) from None
        self.expert_residency: dict | None = self._model.expert_residency_info() if offload else None
        if self.expert_residency:
            self.expert_residency["fill_background"] = background  # as done
            self.expert_cache_note += f"; {_serving(self.expert_residency, self.repack, prefetch_why)}"
        if self.expert_residency and self.expert_residency["mode_reason"]:
            print(f"pyedgemoe: {self.expert_residency['mode_reason']}", file=sys.stderr)
        if self.mode == "auto":  # as chosen: every expert resident on the GPU is the GPU-centric mode
            self.mode = self.expert_residency["mode"] if self.expert_residency else "gpu"
        n_ubatch = n_batch
        if offload and self.expert_residency["max_ubatch_tokens"] > 0:
            # a ubatch's experts of one layer must all be in slots at once (docs/expert-residency.md)
            n_ubatch = min(n_batch, self.expert_residency["max_ubatch_tokens"])
        self.n_ubatch = n_ubatch
        self.threads_note = f"threads: {n_threads or 'default'} decode, {n_threads_batch or n_threads or 'default'} batch"
        if not (n_threads and n_threads_batch):
            self.threads_note += f"; default {cores}: {default.why}"
            if self._reads_core and not n_threads:
                self.threads_note += "; the decode leaves one to the expert reads"
        # counts left to us follow the machine's load (threads.ThreadGovernor); given ones stay
        self._batch_governed = not (n_threads_batch or n_threads)
        n_threads_batch = n_threads_batch or n_threads or cores
        self._governor = None if n_threads else ThreadGovernor(cores - 1 if self._reads_core else cores, load=cpu_load())
        if self._governor and cores > 1:
            self.threads_note += "; fewer while the machine is busy"
        n_threads = n_threads or (cores - 1 if self._reads_core else cores)
        self._cores = cores
        if verbose:
            print(f"pyedgemoe: {self.threads_note}", file=sys.stderr)
        try:
            self._ctx = _native.Context(self._model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                                        n_threads=n_threads, n_threads_batch=n_threads_batch,
                                        flash_attn=flash_attn_type, kv_type=kv_ggml_type, n_seq_max=n_parallel)
        except RuntimeError as e:
            raise ModelLoadError(f"cannot create a context of {n_ctx} tokens: {e}") from None
        self.n_threads = n_threads
        self._n_threads_batch = n_threads_batch
        self.seed = seed
        self.big_little = native_options.big_little if offload else 0.0  # MoBiLE's gamma; 0: off
        if n_parallel > 1 and self.big_little > 0:
            raise InvalidOptionError("big_little redoes low-confidence tokens one sequence at a time: it needs "
                                     "n_parallel=1")
        self.n_parallel = n_parallel
        self._lock = threading.RLock()  # held while the native context or the expert cache is in use
        self._turn = threading.Lock()  # n_parallel=1: the one sequence, for one generation at a time
        self._turn_owner: int | None = None  # the thread that took it
        self._batcher = Batcher(self, n_parallel) if n_parallel > 1 else None
        self._big_little_counts = {"little_tokens": 0, "fallbacks": 0, "prefetched": 0}
        self._tokens: list[int] = []  # what the KV cache holds, position by position
        self.last_timings = GenerationStats()
        self._totals = GenerationStats()

    # -- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        """Frees the context and the model; the Engine is unusable afterwards."""
        if getattr(self, "_batcher", None) is not None:
            self._batcher.close()
            self._batcher = None
        self._ctx = None
        self._model = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _live(self):
        if self._ctx is None:
            raise RuntimeError("this Engine is closed")
        return self._ctx

    def _live_model(self):
        self._live()
        return self._model

    @contextmanager
    def _sequence_turn(self):
        """The one sequence (n_parallel=1), for one generation or evaluation at a time: another
        thread's waits for its turn, this thread's own is an error (it would wait on itself)."""
        me = threading.get_ident()
        if self._turn_owner == me:
            raise EngineBusyError("a generation of this Engine started on this thread is still open: take it to its "
                                  "end or close() it before starting another (or use n_parallel > 1)")
        with self._turn:
            self._turn_owner = me
            try:
                yield
            finally:
                self._turn_owner = None

    # -- properties ----------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        """The positions one generation has: the context's, divided among n_parallel sequences."""
        return self._live().n_ctx_seq

    @property
    def n_vocab(self) -> int:
        return self._live_model().n_vocab

    @property
    def metadata(self) -> dict[str, str]:
        return self._live_model().metadata()

    # -- tokens ----------------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of text; add_bos adds the model's BOS (if it uses one), special parses
        special-token text such as <|im_start|>."""
        if isinstance(text, str):
            text = text.encode("utf-8")
        return self._live_model().tokenize(text.decode("utf-8", errors="replace"), add_bos, special)

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        return self._live_model().detokenize(list(tokens), False, special).decode("utf-8", errors="replace")

    def token_piece(self, token: int) -> bytes:
        return self._live_model().token_to_piece(token, False)

    # -- evaluation --------------------------------------------------------------------------
    def logits(self, token_ids: list[int], *, one_token_per_step: bool = False) -> np.ndarray:
        """float32 [len(token_ids), n_vocab]: the logits after each token, on a fresh sequence.
        one_token_per_step: evaluate the tokens one llama_decode at a time, as generation does
        (with an expert cache, each step then routes, loads and prefetches like a decode step)."""
        self._single_sequence("logits")
        ids = [int(t) for t in token_ids]
        if not ids:
            raise InvalidOptionError("logits needs at least one token")
        self._check_fits(len(ids), 0)
        check_logits_fit(self.info.metadata, len(ids), self.n_logits, self._spare_bytes, self._n_ubatch)
        with self._sequence_turn():
            self._clear()
            if one_token_per_step:
                out = np.stack([self._decode([t], pos, True)[0] for pos, t in enumerate(ids)])
            else:
                out = self._decode(ids, 0, True)
            self._tokens = ids
        return out

    def _clear(self) -> None:
        with self._lock:
            self._live().clear()
        self._tokens = []

    def _decode(self, ids: list[int], pos0: int, all_logits: bool) -> np.ndarray:
        try:
            with self._lock:
                if self.big_little > 0 and len(ids) == 1:
                    return self._governed(1, lambda: self._decode_big_little(ids, pos0, all_logits))
                logits = self._governed(1 if len(ids) == 1 else 0, lambda: self._live().decode(ids, pos0, all_logits))
                if self._reads_core and self._model.expert_prefetch_stopped():  # its core back to the decode
                    self._reads_core = False
                    self.n_threads = self._cores
                    if self._governor:
                        self._governor.set_max(self._cores)
                    self._ctx.set_n_threads(self.n_threads, self._n_threads_batch)
                return logits
        except _native.ExpertLoadError as e:
            self._tokens = []  # the native side cleared the KV cache
            raise ExpertLoadError(str(e)) from None

    def _governed(self, n_decoded: int, decode):
        """decode() on the thread counts the governor chose, timed for it: n_decoded tokens, one per
        sequence of a decode step (0 for a prompt's batch, which it does not time)."""
        g = self._governor
        if g is None:
            return decode()
        if g.n != self.n_threads:
            self.n_threads = g.n
            batch = self._n_threads_batch if not self._batch_governed or g.n == g.n_max else min(g.n, self._n_threads_batch)
            self._live().set_n_threads(g.n, batch)
        t0 = time.perf_counter()
        out = decode()
        g.record(n_decoded, time.perf_counter() - t0)
        return out

    def _decode_big_little(self, ids: list[int], pos: int, all_logits: bool) -> np.ndarray:
        """MoBiLE (docs/systems.md): the token through each layer's top-k/2 experts; when its top
        output probability is below big_little, its KV entry is removed and it runs again with the
        whole top-k, the experts the little pass's routers chose prefetched."""
        ctx = self._live()
        counts = self._big_little_counts
        self._model.set_expert_little(True)
        try:
            logits = ctx.decode(ids, pos, all_logits)
        finally:
            self._model.set_expert_little(False)
        counts["little_tokens"] += 1
        if top_probability(np.asarray(logits).reshape(-1, self.n_vocab)[-1]) >= self.big_little:
            return logits
        counts["fallbacks"] += 1
        if not ctx.truncate(pos):
            raise ModelLoadError("big_little: this model's memory cannot drop a token to redo it")
        counts["prefetched"] += self._model.prefetch_expert_big()
        return ctx.decode(ids, pos, all_logits)

    def _single_sequence(self, what: str) -> None:
        if self._batcher is not None:
            raise InvalidOptionError(f"{what} evaluates one sequence of its own: it needs an Engine with n_parallel=1")

    def _check_fits(self, n_prompt: int, n_more: int) -> None:
        if n_prompt + n_more > self.n_ctx:
            raise ContextOverflowError(
                f"prompt of {n_prompt} tokens does not fit the context of {self.n_ctx} tokens"
                + (f" with room for {n_more} generated" if n_more else "")
                + " (raise n_ctx / --ctx)"
            )

    def _prefill(self, prompt: list[int]) -> tuple[np.ndarray, int]:
        """Evaluates prompt, reusing the longest prefix already in the KV cache (at least the
        last token is evaluated again, for its logits). Returns (last logits, reused count)."""
        ctx = self._live()
        reuse = shared_prefix(self._tokens, prompt)
        with self._lock:
            if not ctx.truncate(reuse):
                ctx.clear()
                reuse = 0
        self._tokens = self._tokens[:reuse]
        logits = self._decode(prompt[reuse:], reuse, False)
        self._tokens = list(prompt)
        return logits, reuse

    def generate_tokens(self, prompt_tokens: list[int], max_tokens: int | None,
                        sampling: SamplingParams, *, ignore_eos: bool = False,
                        feed_tokens: list[int] | None = None) -> Iterator[int]:
        """Yields generated token ids. Stops at end-of-generation tokens (unless ignore_eos),
        after max_tokens (None = until the context is full), or when the context is full.
        feed_tokens (benchmarks): after the i-th pick, feed feed_tokens[i] to the model instead of
        the pick (teacher forcing; needs max_tokens - 1 of them). Bad arguments raise here, the
        model runs as the tokens are taken. Timings of the run land in last_timings."""
        return self._generation(prompt_tokens, max_tokens, sampling, ignore_eos, feed_tokens)[1]

    def _generation(self, prompt_tokens: list[int], max_tokens: int | None, sampling: SamplingParams,
                    ignore_eos: bool = False, feed_tokens: list[int] | None = None,
                    fresh: bool = False) -> tuple[GenerationStats, Iterator[int]]:
        """generate_tokens, with the generation's own GenerationStats (last_timings is the latest
        generation's, whichever thread started it). fresh: forget the KV cache first (no prefix
        reused; the expert cache's per-sequence records restart). A generation with a seed of its
        own is fresh: reusing a prefix evaluates the prompt's last tokens in a smaller batch, whose
        sums the CPU kernels may round differently, and the same seeded call must give the same tokens."""
        sampling.validate()
        prompt = [int(t) for t in prompt_tokens]
        if not prompt:
            raise InvalidOptionError("the prompt is empty (no tokens)")
        if max_tokens is not None and max_tokens < 0:
            raise InvalidOptionError(f"max_tokens must be >= 0, got {max_tokens}")
        if feed_tokens is not None:
            if self._batcher is not None:
                raise InvalidOptionError("feed_tokens needs n_parallel=1")
            feed_tokens = [int(t) for t in feed_tokens]
            if max_tokens is None or len(feed_tokens) < max_tokens - 1:
                raise InvalidOptionError(f"feed_tokens needs max_tokens - 1 tokens, got {len(feed_tokens)} "
                                         f"for max_tokens {max_tokens}")
        self._check_fits(len(prompt), 1 if max_tokens else 0)
        fresh = fresh or sampling.seed is not None
        seed = sampling.seed if sampling.seed is not None else self.seed
        if seed is None:
            seed = random.getrandbits(32)
        sampler = _native.Sampler(self._model, sampling.temperature, sampling.top_k, sampling.top_p,
                                  sampling.min_p, sampling.repeat_penalty, sampling.penalty_last_n, seed)
        for t in prompt[-sampling.penalty_last_n:] if sampling.penalty_last_n > 0 else []:
            sampler.accept(t)
        timings = GenerationStats(n_prompt_tokens=len(prompt))
        self.last_timings = timings
        budget = self.n_ctx - len(prompt) if max_tokens is None else min(max_tokens, self.n_ctx - len(prompt))
        if self._batcher is not None:
            tokens = self._batcher.generate(prompt, budget, sampler, ignore_eos, timings, fresh)
        else:
            tokens = self._one_sequence(prompt, budget, sampler, ignore_eos, feed_tokens, timings, fresh)
        return timings, self._counted(tokens, timings)

    def _counted(self, tokens: Iterator[int], timings: GenerationStats) -> Iterator[int]:
        try:
            yield from tokens
        finally:
            with self._lock:
                self._add_to_totals(timings)

    def _one_sequence(self, prompt: list[int], budget: int, sampler, ignore_eos: bool,
                      feed_tokens: list[int] | None, timings: GenerationStats, fresh: bool) -> Iterator[int]:
        """The generation of an Engine with one sequence, on the caller's thread, holding the sequence
        from its first token to its end."""
        with self._sequence_turn():
            if fresh:
                self._clear()
            start = time.perf_counter()
            _, timings.n_cached_prompt_tokens = self._prefill(prompt)
            timings.prefill_seconds = time.perf_counter() - start
            decode_start = time.perf_counter()
            for i in range(budget):
                with self._lock:
                    token = sampler.sample(self._live())
                if not ignore_eos and self._model.is_eog(token):
                    timings.finish_reason = "stop"
                    break
                timings.n_decoded += 1
                timings.decode_seconds = time.perf_counter() - decode_start
                yield token
                decode_start = time.perf_counter() - timings.decode_seconds  # time spent by the consumer does not count
                if i + 1 < budget:
                    fed = token if feed_tokens is None else feed_tokens[i]
                    self._decode([fed], len(self._tokens), False)
                    self._tokens.append(fed)
            timings.decode_seconds = time.perf_counter() - decode_start

    def _add_to_totals(self, t: GenerationStats) -> None:
        self._totals.n_prompt_tokens += t.n_prompt_tokens
        self._totals.n_cached_prompt_tokens += t.n_cached_prompt_tokens
        self._totals.prefill_seconds += t.prefill_seconds
        self._totals.n_decoded += t.n_decoded
        self._totals.decode_seconds += t.decode_seconds

    def time_generation(self, prompt_ids: list[int], n_tokens: int, feed_tokens: list[int] | None = None) -> dict:
        """Benchmark helper: greedy-decodes exactly n_tokens (ignoring EOS) from a fresh sequence;
        with feed_tokens, those are fed back instead of the picks (generate_tokens). With an expert
        cache, decode_expert_bytes_read is what the decode steps read (on demand and prefetched),
        without the prefill's reads."""
        self._single_sequence("time_generation")
        tokens, after_prefill = [], 0
        t, generation = self._generation(prompt_ids, n_tokens, SamplingParams(temperature=0.0), True, feed_tokens,
                                         fresh=True)
        for token in generation:
            if not tokens:
                after_prefill = self._expert_bytes_read()
            tokens.append(token)
        return {"prefill_seconds": t.prefill_seconds, "decode_seconds": t.decode_seconds,
                "n_prompt_tokens": t.n_prompt_tokens, "n_decoded": t.n_decoded, "tokens": tokens,
                "decode_expert_bytes_read": self._expert_bytes_read() - after_prefill}

    def _expert_bytes_read(self) -> int:
        if self.expert_residency is None:
            return 0
        stats = self._model.expert_stats()
        return stats["total"]["bytes_read"] + stats["prefetches"]["bytes_read"]

    # -- text generation ------------------------------------------------------------------------
    def _stream_text(self, prompt_tokens: list[int], max_tokens: int | None, sampling: SamplingParams,
                     stop: list[str], result: dict, ignore_eos: bool = False) -> Iterator[str]:
        """Text pieces of a generation (bad arguments raise here, at the call); fills
        result["finish_reason"], result["completion_tokens"]."""
        timings, tokens = self._generation(prompt_tokens, max_tokens, sampling, ignore_eos)
        result["finish_reason"] = "length"
        result["completion_tokens"] = 0
        return self._text_pieces(tokens, timings, TextStream(stop), result)

    def _text_pieces(self, tokens: Iterator[int], timings: GenerationStats, text: TextStream,
                     result: dict) -> Iterator[str]:
        for token in tokens:
            result["completion_tokens"] += 1
            piece = text.push(self.token_piece(token))
            if piece:
                yield piece
            if text.stopped:
                tokens.close()
                result["finish_reason"] = "stop"
                return
        result["finish_reason"] = timings.finish_reason
        tail = text.flush()
        if tail:
            yield tail

    def _prompt_tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_bos=True, special=False)
        return [int(t) for t in prompt]

    def generate(self, prompt: str | list[int], max_tokens: int | None = 128, *, temperature: float = 0.8,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 seed: int | None = None, stop: str | list[str] | None = None,
                 stream: bool = False, ignore_eos: bool = False) -> str | Iterator[str]:
        """Continues prompt (text, or token ids). Returns the text, or with stream=True an
        iterator of text pieces as they are produced. ignore_eos: go on past end-of-generation
        tokens (to max_tokens)."""
        sampling = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, seed=seed)
        sampling.validate()
        stops = _stop_list(stop)
        pieces = self._stream_text(self._prompt_tokens(prompt), max_tokens, sampling, stops, {}, ignore_eos)
        return pieces if stream else "".join(pieces)

    def create_completion(self, prompt: str | list[int], max_tokens: int | None = 16, *,
                          temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                          repeat_penalty: float = 1.0, seed: int | None = None,
                          stop: str | list[str] | None = None, stream: bool = False):
        """OpenAI-style text completion, shaped like llama_cpp.Llama.create_completion's result."""
        sampling = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, seed=seed)
        sampling.validate()
        stops = _stop_list(stop)
        prompt_tokens = self._prompt_tokens(prompt)
        head = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_path}
        result: dict = {}
        pieces = self._stream_text(prompt_tokens, max_tokens, sampling, stops, result)

        def usage() -> dict:
            return _usage(len(prompt_tokens), result["completion_tokens"])

        def choice(text: str, finish_reason: str | None) -> dict:
            return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}

        if not stream:
            text = "".join(pieces)
            return {**head, "choices": [choice(text, result["finish_reason"])], "usage": usage()}

        def chunks():
            for piece in pieces:
                yield {**head, "choices": [choice(piece, None)]}
            yield {**head, "choices": [choice("", result["finish_reason"])], "usage": usage()}
        return chunks()

    def format_chat(self, messages: list[dict]) -> str:
        """The prompt text for messages, using the model's chat template."""
        bos = self._model.bos
        eos = self._model.eos
        return render_chat(
            self._model.chat_template, messages,
            bos_token=self.token_piece(bos).decode("utf-8", "replace") if bos is not None else "",
            eos_token=self.token_piece(eos).decode("utf-8", "replace") if eos is not None else "",
            native_fallback=lambda msgs: self._model.apply_chat_template(msgs, True),
        )

    def create_chat_completion(self, messages: list[dict], max_tokens: int | None = None, *,
                               temperature: float = 0.2, top_k: int = 40, top_p: float = 0.95,
                               min_p: float = 0.05, repeat_penalty: float = 1.0, seed: int | None = None,
                               stop: str | list[str] | None = None, stream: bool = False):
        """OpenAI-style chat completion, shaped like llama_cpp.Llama.create_chat_completion's result."""
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidOptionError(f"each message needs 'role' and 'content', got {m!r}")
        sampling = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, seed=seed)
        sampling.validate()
        stops = _stop_list(stop)
        text = self.format_chat(messages)
        bos = self._model.bos
        starts_with_bos = bos is not None and text.startswith(self.token_piece(bos).decode("utf-8", "replace"))
        prompt_tokens = self.tokenize(text, add_bos=not starts_with_bos, special=True)
        head = {"id": f"chatcmpl-{uuid.uuid4()}", "created": int(time.time()), "model": self.model_path}
        result: dict = {}
        pieces = self._stream_text(prompt_tokens, max_tokens, sampling, stops, result)

        def usage() -> dict:
            return _usage(len(prompt_tokens), result["completion_tokens"])

        if not stream:
            content = "".join(pieces)
            return {**head, "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                 "logprobs": None, "finish_reason": result["finish_reason"]}],
                    "usage": usage()}

        def chunks():
            chunk = {**head, "object": "chat.completion.chunk"}
            yield {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None,
                                         "finish_reason": None}]}
            for piece in pieces:
                yield {**chunk, "choices": [{"index": 0, "delta": {"content": piece}, "logprobs": None,
                                             "finish_reason": None}]}
            yield {**chunk, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                         "finish_reason": result["finish_reason"]}], "usage": usage()}
        return chunks()

    # -- routing trace (calibration) ---------------------------------------------------------------
    def record_routing(self, on: bool = True) -> None:
        """Start (or stop) recording every MoE layer's routing: needs an expert cache. The trace holds
        the predictor's guesses only for an Engine made with trace_routing=True (else -1)."""
        if self.expert_residency is None:
            raise InvalidOptionError("recording the routing needs an expert cache (expert_cache=...)")
        with self._lock:
            self._model.set_expert_tracing(on)

    def take_routing_trace(self) -> dict:
        """The routing recorded since the last call, as numpy arrays: "ubatch" and "layer" [n] (one
        record per token and MoE layer, in compute order), "ids" and "weights" [n, n_experts_used]."""
        if self.expert_residency is None:
            raise InvalidOptionError("recording the routing needs an expert cache (expert_cache=...)")
        with self._lock:
            return dict(self._model.take_expert_trace())

    # -- telemetry ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters since the Engine was created: tokens and time spent in prefill and decode.
        With an expert cache, "experts" holds its settings and per-layer and total counters;
        "experts_mapped": the experts are in the page cache (expert_cache "mmap"); "repack": the
        weights the CPU computes have repacked copies."""
        out = {
            "mode": self.mode, "device": self.device["name"] if self.device else None,
            "experts_mapped": self.experts_mapped, "repack": self.repack,
            "model": {"architecture": self.info.architecture, "is_moe": self.info.is_moe,
                      "n_experts": self.info.n_experts, "n_experts_used": self.info.n_experts_used,
                      "expert_bytes": self.info.expert_bytes, "non_expert_bytes": self.info.non_expert_bytes},
            "totals": self._totals.to_dict(),
            "last": self.last_timings.to_dict(),
        }
        with self._lock:  # between two decodes
            out["memory"] = self._live().memory_breakdown()
            native_experts = self._model.expert_stats() if self.expert_residency is not None else None
        out["system"] = self.system
        if self.expert_residency is not None:
            experts = {**self.expert_residency, **native_experts}
            out["experts"] = {**experts, "summary": _expert_summary(experts)}
        if self.big_little > 0:
            c = self._big_little_counts
            out["big_little"] = {"gamma": self.big_little, **c,
                                 "fallback_rate": c["fallbacks"] / c["little_tokens"] if c["little_tokens"] else 0.0}
        return out

    def set_precision_map(self, low: dict[int, list[int]]) -> None:
        """EdgeMoE's static precision map (with static_precision): the experts listed ({layer: [expert,
        ...]}) only ever in LOW, every other one only in HIGH. Empties the expert cache."""
        if self.expert_residency is None:
            raise InvalidOptionError("a precision map needs an expert cache (expert_cache=...)")
        try:
            with self._lock:
                self._model.set_expert_precision_map({int(l): [int(e) for e in es] for l, es in low.items()})
        except ValueError as e:
            raise InvalidOptionError(str(e)) from None
