"""The load plan: every decision of a load, made once, each with its reason.

    plan = plan_load(info, options, this_machine(), *context_memory(info, options), calibration=calibration)
    print("\\n".join(plan.describe()))          # `pyedgemoe run --dry-run`

plan_load is a pure function of what the model holds (ModelInfo and its calibration), what the
caller asked (LoadOptions: Engine's keyword arguments), the machine (Machine: the memory
available, the GPUs, the cores) and llama.cpp's memory of the context asked for (context_memory,
measured by llama.cpp from the file): it decides the compute mode and device, the expert cache's size
(or every expert resident, or the mapped file), the host tier, repacking, the expert options the
model and its calibration complete, prefetch and the cache's fill, the thread counts, the context
checkpoints a sequence keeps, and refuses what cannot work (InvalidOptionError) before anything
loads. Engine.__init__ executes a plan; what only the native layer knows at load (--mode auto's
measured choice, the ubatch cap its slots set) comes back from it.
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import gguf

from pyedgemoe import _native, kv_overrides, lora, rope_scaling, rpc
from pyedgemoe import memory_budget  # available_memory through the module: tests replace it there
from pyedgemoe.calibration import stand_ins as stand_in_stats
from pyedgemoe.calibration.paths import native_entries
from pyedgemoe.calibration.sidecar import load_calibration
from pyedgemoe.context_checkpoints import DEFAULT_LIMIT as DEFAULT_CHECKPOINTS, checkpoint_bytes as checkpoint_size
from pyedgemoe.devices import BUILD_HINT, check_fits_device, flash_attention_fails, gpu_devices, host_cache_bytes
from pyedgemoe.errors import InvalidOptionError, ModelLoadError
from pyedgemoe.expert_options import ExpertOptions, auto_prefetch, default_mode, fill_ranking, options_dict
from pyedgemoe.generation import SamplingParams
from pyedgemoe.memory_budget import (KV_CELL_MULTIPLE, MAPPED, UP_TO, context_bytes, context_positions, is_share,
                                     parse_expert_cache, repack_staging_bytes, spare_bytes, training_context,
                                     ubatch_tokens)
from pyedgemoe.model_info import ModelInfo, read_model_info
from pyedgemoe.sysmem import format_bytes
from pyedgemoe.systems import system_options
from pyedgemoe.threads import ThreadCount, default_threads


MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ
MAX_THREADS = 512  # ggml's GGML_MAX_N_THREADS (more: libgomp stopped the process)


@dataclass(frozen=True)
class LoadOptions:
    """What a caller asks of a load (Engine's keyword arguments, whose defaults these are), checked
    when made. expert_options: the expert options and where the model runs (mode, device,
    host_cache, repack, n_gpu_layers), as given."""
    n_ctx: int = 4096
    n_threads: int | None = None
    n_threads_batch: int | None = None
    n_batch: int = 512
    n_ubatch: int = 512
    n_parallel: int = 1
    n_logits: int = 0
    seed: int | None = None
    flash_attn: bool | None = None
    kv_type: str = "f16"
    expert_cache: str | int | None = None
    expert_options: ExpertOptions = field(default_factory=ExpertOptions)
    system: str | None = None
    trace_routing: bool = False

    def __post_init__(self) -> None:
        for name in ("n_ctx", "n_threads", "n_threads_batch", "n_batch", "n_ubatch", "n_parallel", "n_logits", "seed"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # numpy's too, as llama-cpp-python
                object.__setattr__(self, name, int(value))
        for name in ("n_ctx", "n_logits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidOptionError(f"{name} must be a non-negative integer, got {value!r}")
        if type(self.n_ubatch) is int and self.n_ubatch == 0:  # llama.cpp's 0: a pass of the whole batch
            object.__setattr__(self, "n_ubatch", self.n_batch)
        for name in ("n_threads", "n_threads_batch", "n_batch", "n_ubatch", "n_parallel"):
            value = getattr(self, name)
            if (value is not None or name not in ("n_threads", "n_threads_batch")) and \
                    (isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31):
                raise InvalidOptionError(f"{name} must be a positive integer, got {value!r}")
            if name in ("n_threads", "n_threads_batch") and value is not None and value > MAX_THREADS:
                raise InvalidOptionError(f"{name} must be at most {MAX_THREADS} (ggml's GGML_MAX_N_THREADS), "
                                         f"got {value}")
        # llama.cpp's limits of a context's sequences (LLAMA_MAX_SEQ; and a batch of one token for
        # each, which it caps at the context: more stopped the process on an internal check)
        batch = min(self.n_batch, self.n_ctx or self.n_batch)
        if self.n_parallel > min(MAX_SEQUENCES, batch):
            raise InvalidOptionError(
                f"n_parallel={self.n_parallel} is more sequences than llama.cpp decodes together: at most "
                f"{MAX_SEQUENCES}, and at most n_batch and n_ctx (here {batch}), a batch holding a token of each")
        if not (self.flash_attn is None or isinstance(self.flash_attn, bool)):  # a string would be true
            raise InvalidOptionError(f"flash_attn must be True, False or None (llama.cpp decides), got {self.flash_attn!r}")
        if not isinstance(self.trace_routing, bool):
            raise InvalidOptionError(f"trace_routing must be True or False, got {self.trace_routing!r}")
        if self.system is not None and not isinstance(self.system, str):
            raise InvalidOptionError(f"system must be a system's name, got {self.system!r}")
        SamplingParams(seed=self.seed).validate()
        kv_type_id(self.kv_type)


def check_drafts(plan: LoadPlan, draft_model) -> None:
    """Refuses speculative decoding (a draft model, or --spec-type's guesses) where the plan cannot
    verify a batch of guesses (LoadPlan.no_drafts)."""
    if draft_model is not None and plan.no_drafts:
        raise InvalidOptionError(f"speculative decoding (draft_model, --spec-type) cannot run: {plan.no_drafts}")


def capped_ubatch(plan: LoadPlan, residency: dict | None) -> int:
    """n_ubatch within the tokens whose experts one wave of the expert cache serves (models with
    expert biases: docs/expert-residency.md). n_parallel sequences decode a token each in one
    ubatch: more of them than that is refused."""
    cap = residency["max_ubatch_tokens"] if residency else 0
    if cap and plan.n_parallel > cap:
        raise InvalidOptionError(f"n_parallel {plan.n_parallel} decodes {plan.n_parallel} tokens a step in one ubatch, "
                                 f"and with this model's expert biases a ubatch's experts must all be in the expert "
                                 f"cache at once: this one holds those of {cap} tokens (give a larger expert cache, "
                                 f"or n_parallel {cap})")
    return min(plan.n_ubatch, cap) if cap > 0 else plan.n_ubatch


def kv_type_id(kv_type: str) -> int:
    """The ggml type id of a KV cache type's name."""
    try:
        return int(gguf.GGMLQuantizationType[kv_type.upper()])
    except (KeyError, AttributeError):
        raise InvalidOptionError(f"unknown kv_type {kv_type!r} (f16, f32, bf16, q8_0, q4_0, ...)") from None


@dataclass(frozen=True)
class Machine:
    """What a plan reads of the machine."""
    memory: tuple[int, str]  # what this process can still use, and where that number comes from
    gpus: tuple[dict, ...]  # this build's GPUs (devices.gpu_devices)
    cores: ThreadCount  # the default thread count, and why (threads.default_threads)


def this_machine() -> Machine:
    return Machine(memory_budget.available_memory(), tuple(gpu_devices()), default_threads())


@dataclass(frozen=True)
class LoadPlan:
    """A load's decisions; reasons[name] says why each was made (the note a load prints on stderr
    is expert_cache_note)."""
    mode: str  # cpu, gpu, coop, split, or auto: the residency layer measures at load which of gpu and coop
    device: dict | None  # the GPU (gpu_devices' entry) of the modes but cpu, the first of layer_devices
    layer_devices: tuple[str, ...]  # the devices the layers are spread over (--device A,B), device first
    tensor_split: tuple[float, ...]  # their shares of the layers (--tensor-split); empty: by free memory
    expert_cache: int | str | None  # bytes of the expert cache; None: every expert resident; MAPPED
    offload: bool  # experts read into an expert cache when routed to
    experts_mapped: bool  # experts computed from the mapped file, the page cache holding them
    embedding_mapped: bool  # the input embedding's rows read from the mapped file (ModelInfo.cold_embedding_bytes)
    host_cache_bytes: int  # the host tier (RAM between the file and the GPU)
    repack: bool  # repacked copies of the weights the CPU computes
    use_mmap: bool  # the weights mapped from the file (else read into memory)
    loras: tuple[tuple[str, float], ...]  # LoRA adapters (path, scale), checked for the model (pyedgemoe.lora)
    expert_options: ExpertOptions  # as given, with the system's preset, the mode and prefetch chosen here
    native_options: _native.ExpertOptions | None  # completed for the model and calibration (None: dense)
    fill: str  # the expert cache's fill: "none", "at load" or "in the background"
    fill_ranking: Mapping  # per MoE layer, its experts most routed first (calibration)
    precision_map: Mapping | None  # EdgeMoE's static map, {layer: [LOW experts]} (static_precision)
    path_statistics: list | None  # EdgeMoE's path statistics as the native table takes them
    stand_ins: Mapping | None  # the calibrated stand-ins for stand_in, {layer: (costs, drop costs, tau)}
    big_little: float  # MoBiLE's gamma; 0: off
    no_drafts: str  # why speculative decoding's batches cannot run here ("": they can)
    n_ctx: int
    n_batch: int  # tokens a llama_decode takes
    n_ubatch: int  # tokens llama.cpp computes at once: it splits a llama_decode's batch into ubatches
    n_parallel: int
    n_logits: int
    kv_type: int  # ggml type id
    flash_attn: int  # -1: llama.cpp decides, 0 off, 1 on
    swa_full: bool  # a full-size KV cache for sliding-window layers (llama.cpp's --swa-full, on unless given off)
    ctx_checkpoints: int  # context checkpoints a sequence keeps (pyedgemoe.context_checkpoints); 0: none
    checkpoint_bytes: int  # what one takes at most: a sequence's memory that does not grow with the context, and records
    trace_routing: bool
    seed: int | None
    cores: int  # the default thread count
    n_threads: int  # the decode's, at most (governed: fewer while the machine is busy)
    n_threads_batch: int
    governed: bool  # the decode's count follows the machine's load (threads.ThreadGovernor)
    batch_governed: bool  # the prompt's batches' count too
    reads_core: bool  # the decode left a core to prefetch's reads
    auto_mode_threads: int  # the threads --mode auto measures the CPU's expert rate with
    context_bytes: int  # memory_budget.context_bytes of this context
    spare_bytes: int  # host memory the run leaves beside the expert cache (memory_budget.spare_bytes)
    ubatch_tokens: int  # llama.cpp's largest ubatch (memory_budget.ubatch_tokens)
    expert_cache_note: str
    reasons: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    notes: tuple[str, ...] = ()  # what the user should know besides: the context's size, options left unused

    def describe(self) -> list[str]:
        """The plan, one decision a line: what and why."""
        cache = ("every expert resident" if self.expert_cache is None else self.expert_cache
                 if self.expert_cache == MAPPED else format_bytes(self.expert_cache))
        rows = [
            ("mode", self.mode, self.reasons["mode"]),
            ("device", ",".join(self.layer_devices) if self.device else "none", self.reasons["device"] + (
                f"; the layers split {':'.join(f'{s:g}' for s in self.tensor_split)}" if self.tensor_split else "")),
            ("expert cache", cache, self.expert_cache_note),
            ("host cache", format_bytes(self.host_cache_bytes), self.reasons["host_cache"]),
            ("repack", "on" if self.repack else "off", self.reasons["repack"]),
            ("weights", ("mapped" if self.use_mmap else "read into memory") + (", locked" if self.expert_options["mlock"]
                                                                              else ""), self.reasons["mmap"]),
        ]
        if self.offload:
            rows.append(("experts", serving_text(self._planned_serving(), self), self.reasons["fill"]))
        if self.expert_options["override_kv"]:
            rows.append(("metadata", self.expert_options["override_kv"], "--override-kv"))
        if self.loras:
            rows.append(("lora", ", ".join(f"{path} (scale {scale:g})" for path, scale in self.loras),
                         "--lora, --lora-scaled"))
        if rope_scaling.described(self.expert_options):
            rows.append(("rope", rope_scaling.described(self.expert_options), "the model's, where not given"))
        rows += [
            ("context", f"{self.n_ctx or 'training'} positions, {self.n_parallel} sequence"
                        f"{'s' if self.n_parallel > 1 else ''}, batches of {self.n_batch} in ubatches of "
                        f"{self.n_ubatch}, kv "
                        f"{gguf.GGMLQuantizationType(self.kv_type).name.lower()}",
             f"{format_bytes(self.context_bytes)} for the KV cache, compute buffers, vocabulary and logits"),
            ("threads", self.reasons["threads"].removeprefix("threads: "), ""),
        ]
        if self.checkpoint_bytes:  # a model whose memory cannot drop tokens
            rows.insert(-1, ("checkpoints", str(self.ctx_checkpoints), self.reasons["ctx_checkpoints"]))
        return [f"{name:<13} {value}" + (f"  ({why})" if why else "") for name, value, why in rows] + \
            [f"note: {note}" for note in self.notes]

    def _planned_serving(self) -> dict:
        return {**options_dict(self.native_options), "mixed_precision": self.native_options.low_precision}


def serving_text(experts: dict, plan: LoadPlan) -> str:
    """How the cache serves the experts, for the note on stderr: io, reads in flight, the fill (as
    planned), prefetch (and why, when chosen automatically), eviction, what is lossy and repacking.
    experts: the options by name (expert_residency_info, or a plan's)."""
    fill = "no fill" if plan.fill == "none" else f"fill {plan.fill}"
    if plan.fill == "none" and plan.reasons["fill"] != "fill_cache off":
        fill += f" ({plan.reasons['fill']})"
    share = experts["prefill_low_share"]
    precision = ("mixed precision" + (" with skips" if experts["skip"] else "")
                 + (f", prefill low share {share:g}" if share else "")) if experts["mixed_precision"] else \
        "skip-only (lossy: the misses of the SKIP band are skipped)" if experts["skip"] else "lossless"
    lossy = []
    if experts["big_little"] > 0:
        lossy.append(f"lossy big-little decoding (a token keeps half its experts when its top probability reaches "
                     f"{experts['big_little']:g})")
    if experts["cache_routing"] > 0:
        lossy.append(f"lossy cache-aware routing (λ {experts['cache_routing']:g})")
    if experts["stand_in"] > 0:
        lossy.append(f"lossy cache-aware routing by calibrated stand-ins, a cached expert or none (q {experts['stand_in']:g})")
    if lossy:
        precision = ", ".join(["every expert in HIGH" if precision == "lossless" else precision, *lossy])
    prefetch_why = plan.reasons["prefetch"]
    cap = experts.get("max_ubatch_tokens", 0)  # the loaded cache's (expert biases: docs/expert-residency.md)
    capped = f", ubatches of {cap} tokens (with expert biases, those whose experts the cache holds at once)" \
        if 0 < cap < plan.n_ubatch else ""
    return (f"io {experts['io']} with {experts['io_threads']} reads in flight, {fill}, prefetch {experts['prefetch']}"
            f"{f' ({prefetch_why})' if prefetch_why else ''}, "
            f"eviction {experts['cache_policy']}, {precision}, repack {'on' if plan.repack else 'off'}{capped}")


def plan_for(model_path: str | os.PathLike, options: LoadOptions) -> tuple[ModelInfo, LoadPlan]:
    """The model's header, and the plan of loading it here (reads the calibration, measures the machine)."""
    info = read_model_info(model_path, options.expert_options["override_kv"])
    # judged against the file as made (one routed otherwise by --override-kv keeps its own); none where
    # the routing is recorded for a calibration (pyedgemoe calibrate: the model's own, the one it replaces aside)
    calibration = load_calibration(os.fspath(model_path), info.metadata_as_made, info.n_experts_used) \
        if info.is_moe and not options.trace_routing else None
    if options.expert_options["rpc"]:  # the workers' devices join this machine's before it is measured
        rpc.connect(options.expert_options["rpc"])
    memory_budget.check_room_to_measure()
    return info, plan_load(info, options, this_machine(), *context_memory(info, options), calibration=calibration)


# The largest context measured as it is: llama.cpp's records of a context's cells take some 48 bytes
# a cell while it is measured (12 MiB here); a larger one is extrapolated from this one and its half,
# past every sliding window's knee, where its memory grows linearly.
MEASURED_CELLS = 1 << 18


def context_memory(info: ModelInfo, options: LoadOptions) -> tuple[int, int]:
    """llama.cpp's KV cache and recurrent states of the context options ask for, every layer as the
    model lays them out (sliding windows, MLA's keys alone, a hybrid model's recurrent layers), as
    llama.cpp measures them without allocating (_native.context_memory_bytes; beyond MEASURED_CELLS
    extrapolated); and of them, every sequence's part that does not grow with the context (recurrent
    states, a window-sized cache of sliding-window layers), which a context checkpoint holds at most:
    the measures at MEASURED_CELLS and its half, linear beyond. The file's errors as its load's."""
    n_ctx = options.n_ctx or training_context(info.metadata)  # 0 both: llama.cpp's default
    sizes = [n_ctx] * (n_ctx <= MEASURED_CELLS) + [MEASURED_CELLS // 2, MEASURED_CELLS]
    try:
        measured = _native.context_memory_bytes(
            info.path, kv_overrides.items(options.expert_options["override_kv"]), sizes, options.n_batch,
            options.n_ubatch, _flash_attn_type(options.flash_attn), kv_type_id(options.kv_type), options.n_parallel,
            _swa_full(options.expert_options))
    except ValueError as e:
        raise InvalidOptionError(str(e)) from None
    except RuntimeError as e:
        raise (context_error(options.n_ctx, e) if str(e).startswith("failed to create a context")
               else ModelLoadError(str(e))) from None
    half, whole = measured[-2:]
    fixed = max(0, 2 * half - whole)
    if n_ctx <= MEASURED_CELLS:
        return measured[0], fixed
    return whole + (whole - half) * (n_ctx - MEASURED_CELLS) // (MEASURED_CELLS // 2), fixed


def context_memory_bytes(info: ModelInfo, options: LoadOptions) -> int:
    """context_memory's first: llama.cpp's memory of the context options ask for."""
    return context_memory(info, options)[0]


def context_error(n_ctx: int, e: RuntimeError) -> ModelLoadError:
    """A context llama.cpp could not create (its reason in e)."""
    return ModelLoadError(f"cannot create a context of {n_ctx} tokens: {e}")


def _flash_attn_type(flash_attn: bool | None) -> int:
    """llama.cpp's flash attention type: -1 it decides, 0 off, 1 on."""
    return -1 if flash_attn is None else int(bool(flash_attn))


def _flash_attn(given: bool | None, devices: tuple[dict, ...]) -> tuple[bool | None, list[str]]:
    """Flash attention as given (None: llama.cpp decides), but off where it ends the process
    (devices.flash_attention_fails: lavapipe), with a note; asked for there, an InvalidOptionError."""
    if not flash_attention_fails(devices):
        return given, []
    why = "ggml-vulkan's flash attention ends the process on lavapipe (Mesa's llvmpipe), stock llama.cpp's too"
    if given:
        raise InvalidOptionError(f"-fa on: {why}: -fa off or auto")
    return False, [f"flash attention off: {why}"] if given is None else []


def _swa_full(expert_options: ExpertOptions) -> bool:
    """--swa-full: on unless given off, as llama-cpp-python's Llama takes it."""
    return expert_options["swa_full"] is not False


def plan_load(info: ModelInfo, options: LoadOptions, machine: Machine, kv_bytes: int, fixed_bytes: int = 0,
              calibration: dict | None = None) -> LoadPlan:
    """Every decision of loading the model described by info with options on machine (module doc);
    kv_bytes: llama.cpp's memory of the context asked for, fixed_bytes the part of it that does not grow
    with the context (context_memory)."""
    reasons: dict[str, str] = {}
    expert_options = options.expert_options
    if options.system is not None:
        expert_options = system_options(options.system, expert_options, info, options.n_parallel, calibration)
    mode, reasons["mode"] = _mode(expert_options, bool(machine.gpus))
    layer_devices, reasons["device"] = _devices(mode, expert_options["device"], machine.gpus)
    device = layer_devices[0] if layer_devices else None
    flash_attn, fa_notes = _flash_attn(options.flash_attn, layer_devices)
    tensor_split = _tensor_split(expert_options["tensor_split"], layer_devices)
    expert_options = expert_options.merged(mode=mode)
    if "link_share" in expert_options.given and mode != "split":
        raise InvalidOptionError(f"--link-share divides --mode split's misses; this run's mode is {mode}")

    predicting = info.is_moe and expert_options["prefetch"] == "hobbit"
    # llama.cpp's: at most the context asked for (0: the training context)
    n_batch = min(options.n_batch, options.n_ctx or training_context(info.metadata) or options.n_batch)
    n_ubatch = min(n_batch, options.n_ubatch)
    checkpoint_bytes = checkpoint_size(-(-fixed_bytes // options.n_parallel))
    checkpoints, reasons["ctx_checkpoints"] = _checkpoints(expert_options["ctx_checkpoints"], checkpoint_bytes)
    # the checkpoints are host memory: with a GPU the context's memory is the device's
    held = 0 if device else checkpoints * checkpoint_bytes * options.n_parallel
    context = context_bytes(info.metadata, kv_bytes + held, options.n_ctx, n_ubatch, flash_attn,
                            options.n_parallel, options.n_logits,
                            expert_options["prefetch_depth"] if predicting else 0, every_output=device is not None)
    devices_free = _spread(layer_devices)  # where the expert pools go: the layers' devices
    # the input embedding's rows, mapped beside a CPU's expert cache or mapped experts
    cold = info.cold_embedding_bytes if info.is_moe and not device else 0
    expert_cache = options.expert_cache
    if not info.is_moe and is_share(expert_cache):  # a share of no experts (a script's --expert-cache 25%):
        expert_cache = "auto"  # a dense model runs as it would without one
    most_held = _most_held(info, expert_options)
    # --repack given on the CPU: an expert cache's reads need staging buffers beside it
    staging = repack_staging_bytes(info.largest_repacked_projection, expert_options["io_threads"]) \
        if expert_options["repack"] and not device and info.is_moe else 0
    try:
        budget, note = parse_expert_cache(
            expert_cache, info.high_expert_bytes, info.non_expert_bytes, context + staging,
            devices_free["free_bytes"] if device else machine.memory, refuse=not device,  # a GPU: check_fits_device
            repacked_expert_bytes=0 if device else info.repacked_expert_bytes, cold_bytes=cold,
            minimum_bytes=0 if device else info.minimum_cache_bytes(), most_bytes=most_held)
    except InvalidOptionError as e:
        if not staging:
            raise
        raise InvalidOptionError(f"{e} (the context's share includes {format_bytes(staging)} of --repack's staging "
                                 "buffers: without --repack they are not needed)") from None
    asked = str(options.expert_cache or "auto").strip().lower()
    if device and isinstance(budget, int) and (asked == "auto" or asked.endswith(UP_TO)):  # what fits
        budget, note = _addressable(budget, note, layer_devices, info)
    experts_mapped = budget == MAPPED and info.is_moe
    if experts_mapped and device:
        raise InvalidOptionError(f"expert_cache {MAPPED!r} leaves the experts in the page cache, in host memory: it "
                                 "runs with mode 'cpu'")
    offload = budget not in (None, MAPPED) and info.is_moe
    embedding_mapped = (offload or experts_mapped) and cold > 0
    if offload:
        budget, note, expert_options = _held_experts(budget, note, options.expert_cache, expert_options, info,
                                                     most_held)
    if offload and device:
        check_fits_device(budget, devices_free)
    loras = _loras(expert_options, info, offload)
    use_mmap, reasons["mmap"] = _mmap(expert_options, offload, experts_mapped)
    repack, reasons["repack"] = _repack(expert_options["repack"], info, experts_mapped, offload, device, context,
                                        machine.memory[0])
    if reasons["repack"].startswith("repack off:"):  # decided here against what llama.cpp would do
        note += f"; {reasons['repack']}"
    if offload and staging:
        reasons["repack"] += (f"; reads into the expert cache are converted from staging buffers, "
                              f"{format_bytes(staging)} beside it")
    # resolved (and checked: LOW copies asked for must exist) even when every expert is resident
    native = expert_options.resolve(info, calibration, options.n_parallel) if info.is_moe else None
    # every expert copy the run loads: LOW ones with low precision on (top-1 routing has none; with
    # --low-from they are in the other file), as the residency layer's layout has them
    copies = info.high_expert_bytes + (_low_copy_bytes(info, expert_options)
                                       if native is not None and native.low_precision and info.n_experts_used > 1 else 0)
    host_bytes, reasons["host_cache"] = _host_cache(expert_options["host_cache"], mode, offload, copies,
                                                    machine.memory[0], repack and info.repacked_expert_bytes > 0)
    reasons["prefetch"] = ""  # why prefetch is what it is, when chosen here
    if offload and not device and options.n_parallel == 1 and "prefetch" not in expert_options.given \
            and not native.big_little:
        expert_bytes = max(info.high_expert_bytes_per_layer.values()) // info.n_experts
        prefetch, reasons["prefetch"] = auto_prefetch(budget / info.high_expert_bytes, expert_bytes, machine.cores.n,
                                                      options.n_threads is not None)
        expert_options = expert_options.merged(prefetch=prefetch)
        native = expert_options.resolve(info, calibration, options.n_parallel)
    if offload and not device:
        _above_minimum(budget, info, native.low_precision and info.n_experts_used > 1)
    if native is not None and not offload and (native.big_little > 0 or native.static_precision
                                               or native.prefetch.name == "edgemoe" or native.stand_in > 0):
        raise InvalidOptionError("big_little, static_precision, stand_in and prefetch edgemoe act on the expert cache: "
                                 "give an expert_cache below the model's experts (e.g. --expert-cache 50%)")
    big_little = native.big_little if offload else 0.0
    if options.n_parallel > 1 and big_little > 0:
        raise InvalidOptionError("big_little redoes low-confidence tokens one sequence at a time: it needs "
                                 "n_parallel=1")
    # a guess is checked in one batch, and what is rejected of it dropped
    no_drafts = ("MoBiLE's big-little decodes one token at a time" if big_little > 0 else
                 f"{info.architecture}'s recurrent layers cannot drop a rejected guess" if info.recurrent else "")
    precision_map, path_statistics, stand_ins = _calibrated_tables(native, calibration) if offload else (None, None, None)
    fill, reasons["fill"] = _fill(native if offload else None, precision_map, info)
    notes = _context_notes(info, options.n_ctx, options.n_parallel, expert_options) + fa_notes + \
        _unused_low_from(expert_options, native, budget, info) + _unused_thresholds(expert_options, native) + \
        _crowded_threads(options.n_threads, options.n_threads_batch, machine.cores)
    reads_core = bool(reasons["prefetch"]) and expert_options["prefetch"] != "none"
    threads = _threads(options.n_threads, options.n_threads_batch, machine.cores, reads_core)
    reasons["threads"] = threads.pop("why")
    return LoadPlan(
        mode=mode, device=device, layer_devices=tuple(d["name"] for d in layer_devices), tensor_split=tensor_split,
        expert_cache=budget, offload=offload, experts_mapped=experts_mapped, embedding_mapped=embedding_mapped,
        host_cache_bytes=host_bytes, repack=repack, use_mmap=use_mmap, loras=loras, expert_options=expert_options,
        native_options=native,
        fill=fill, fill_ranking=MappingProxyType(fill_ranking(calibration, info.n_experts) if offload else {}),
        precision_map=precision_map, path_statistics=path_statistics, stand_ins=stand_ins, big_little=big_little,
        no_drafts=no_drafts,
        n_ctx=options.n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_parallel=options.n_parallel,
        n_logits=options.n_logits,
        kv_type=kv_type_id(options.kv_type), trace_routing=options.trace_routing, seed=options.seed,
        flash_attn=_flash_attn_type(flash_attn), swa_full=_swa_full(expert_options), ctx_checkpoints=checkpoints,
        checkpoint_bytes=checkpoint_bytes,
        reads_core=reads_core, auto_mode_threads=options.n_threads or machine.cores.n, context_bytes=context,
        # host memory left for logits asked for beyond n_logits (a GPU's expert cache is not in it)
        spare_bytes=spare_bytes(budget if offload and not device else 0,
                                info.non_expert_bytes - (cold if embedding_mapped else 0),
                                context + (staging if offload else 0), machine.memory),
        ubatch_tokens=ubatch_tokens(info.metadata, options.n_ctx, n_ubatch), expert_cache_note=note,
        reasons=MappingProxyType(reasons), notes=tuple(notes), **threads)


def _checkpoints(given: int | None, each: int) -> tuple[int, str]:
    """The context checkpoints a sequence keeps, and why: where the model's memory has a part that
    cannot drop its last tokens (each: that part, of a sequence), the count given, else
    DEFAULT_CHECKPOINTS; none elsewhere."""
    if each == 0:
        return 0, "none needed: the model's memory can drop any tokens (no recurrent layers; sliding windows full-size)"
    n = DEFAULT_CHECKPOINTS if given is None else given
    return n, (f"a sequence's, each up to {format_bytes(each)}: a prompt that departs from the "
               "last before its end restores one instead of evaluating everything afresh (recurrent states or a "
               "window-sized cache cannot drop tokens)" + ("" if given is None else "; --ctx-checkpoints"))


def _loras(expert_options: ExpertOptions, info: ModelInfo, offload: bool) -> tuple[tuple[str, float], ...]:
    """The LoRA adapters asked for, each checked for the model; one that changes the routed experts
    needs llama.cpp's own graph for them, every expert resident or mapped (pyedgemoe.lora)."""
    adapters = tuple(lora.adapters(expert_options["lora"], expert_options["lora_scaled"]))
    for path, _ in adapters:
        experts = lora.expert_matrices(lora.check(path, info.architecture))
        if experts and offload:
            raise InvalidOptionError(f"the LoRA adapter {path} changes the routed experts ({experts[0]}, ...), which "
                                     "the expert cache computes itself: run with every expert resident or mapped "
                                     "(--expert-cache auto where the model fits, or mmap)")
    return adapters


def _mmap(expert_options: ExpertOptions, offload: bool, experts_mapped: bool) -> tuple[bool, str]:
    """Whether llama.cpp maps the weights, and why."""
    if expert_options["mmap"] is False and (experts_mapped or offload and expert_options["io"] == "mmap"):
        raise InvalidOptionError("--no-mmap: " + ("--expert-cache mmap computes the experts from the mapped file"
                                                  if experts_mapped else "--io mmap reads the experts through a mapping"))
    if offload or experts_mapped:  # the kernel could drop their pages under a cap to make room for an expert's
        return False, "the other weights read into memory beside " + ("the mapped experts" if experts_mapped else
                                                                     "an expert cache")
    if expert_options["mmap"] is False:
        return False, "--no-mmap"
    return True, "every weight resident, mapped from the file as llama.cpp does"


def _low_asked(expert_options: ExpertOptions) -> bool:
    """Whether the run asks for LOW copies or skips (--low-precision, --skip, --static-precision, or a
    --system that sets them): else a cache with room for every expert in HIGH holds them all in HIGH."""
    return any(expert_options.given.get(name) for name in ("low_precision", "skip", "static_precision"))


def _most_held(info: ModelInfo, expert_options: ExpertOptions) -> int:
    """The most bytes an expert cache takes: every HIGH copy, and where LOW copies are asked for
    (_low_asked) every LOW copy too, the LOW tier taking low_cache of the budget, the HIGH tier the
    rest (expert-budget.cpp)."""
    high = info.high_expert_bytes
    if not _low_asked(expert_options):
        return high
    low, share = _low_copy_bytes(info, expert_options), expert_options["low_cache"]
    return max(high + low, math.ceil(low / share), math.ceil(high / (1 - share)))


def _held_experts(budget: int, note: str, asked, expert_options: ExpertOptions, info: ModelInfo,
                  most: int) -> tuple[int, str, ExpertOptions]:
    """A cache with room for every expert in HIGH holds every expert in HIGH: no LOW copies, no skips,
    unless asked for (_low_asked); and never more bytes than its copies can take (most: _most_held).
    (budget, the note, the options)."""
    if budget < most or (budget == most and _low_asked(expert_options)):
        return budget, note, expert_options
    if not _low_asked(expert_options):
        what = "every expert resident in HIGH (no LOW copy, nothing skipped" + \
            ("; the LOW copies unused: --low-precision uses them)" if info.multi_precision else ")")
        capped = f", capped at what they take ({format_bytes(budget)} asked for)" if budget > most else ""
        return most, f"expert cache {asked}: {format_bytes(most)}, {what}{capped}", \
            expert_options.merged(low_precision=False)
    return most, (f"expert cache {asked}: {format_bytes(most)}, room for every HIGH and LOW copy with LOW's share "
                  f"of {expert_options['low_cache']:.0%} ({format_bytes(budget)} asked for)"), expert_options


def _above_minimum(budget: int, info: ModelInfo, low: bool) -> None:
    """Refuses a CPU's expert cache below the smallest the runtime takes (ModelInfo.minimum_cache_bytes),
    as the load would, so that --dry-run says so too; low: LOW copies in the cache."""
    minimum = info.minimum_cache_bytes(low)
    if budget < minimum:
        raise InvalidOptionError(
            f"expert cache budget {budget} bytes ({format_bytes(budget)}) is below the minimum of {minimum} bytes "
            f"({format_bytes(minimum)}): one layer's top-{info.n_experts_used} experts must fit"
            + (" in HIGH, and all but one of them in LOW" if low else ""))


def _low_copy_bytes(info: ModelInfo, expert_options: ExpertOptions) -> int:
    """The bytes of every LOW expert copy: the multi-precision file's, or those of --low-from's file."""
    low_from = expert_options.given.get("low_from")
    if low_from and not info.multi_precision:
        return read_model_info(low_from).high_expert_bytes
    return info.low_expert_bytes


def _context_notes(info: ModelInfo, n_ctx: int, n_parallel: int, expert_options: ExpertOptions) -> list[str]:
    """What the context's size needs saying: llama.cpp pads a sequence's positions to a multiple of
    KV_CELL_MULTIPLE; past the training context (stretched by RoPE scaling) a model's output may
    degrade (llama.cpp warns too)."""
    notes = []
    positions, trained = context_positions(info.metadata, n_ctx, n_parallel), training_context(info.metadata)
    asked = (n_ctx or trained) // n_parallel
    if positions != asked and n_ctx:
        notes.append(f"context: {asked} positions{' a sequence' if n_parallel > 1 else ''} rounded up to {positions}, "
                     f"as llama.cpp allocates them in multiples of {KV_CELL_MULTIPLE}")
    covered = rope_scaling.positions_trained(trained, expert_options)
    if trained and positions > covered:
        scaled = f", {covered} with its RoPE scaled" if covered != trained else ""
        notes.append(f"the context of {positions} positions{' a sequence' if n_parallel > 1 else ''} is "
                     f"longer than the model was trained for ({trained}{scaled}): past {covered} tokens its output "
                     "may degrade" + ("" if scaled else " (RoPE scaling stretches it: --rope-scaling yarn --rope-scale N)"))
    return notes


def _crowded_threads(n_threads: int | None, n_threads_batch: int | None, cores: ThreadCount) -> list[str]:
    """Threads given beyond the CPUs this process may run on take turns on them, and ggml's threads
    wait for each other at every op: llama.cpp runs them all the same, slowly, and says nothing."""
    given = max(n_threads or 0, n_threads_batch or 0)
    if not cores.cpus or given <= cores.cpus:
        return []
    return [f"{given} threads on the {cores.cpus} CPU{'s' if cores.cpus != 1 else ''} this process may use: "
            f"they take turns there and each step waits for the last of them (the default: {cores.n})"]


def _unused_thresholds(expert_options: ExpertOptions, native: _native.ExpertOptions | None) -> list[str]:
    """--t1 and --t2 split the misses between HIGH, LOW and skipped: with neither, they are unused."""
    given = [f"--{name} {expert_options[name]:g}" for name in ("t1", "t2") if name in expert_options.given]
    if not given or (native is not None and (native.low_precision or native.skip)):
        return []
    return [f"{' and '.join(given)} unused: this run has no LOW copies and skips nothing (the thresholds take effect "
            "with a multi-precision GGUF, --low-from or --skip)"]


def _unused_low_from(expert_options: ExpertOptions, native: _native.ExpertOptions | None, budget,
                     info: ModelInfo) -> list[str]:
    """--low-from is the LOW copies' source of an expert cache with low precision; else it is unused."""
    low_from = expert_options.given.get("low_from")
    if not low_from or (native is not None and native.low_precision and budget not in (None, MAPPED)):
        return []
    why = ("every expert is resident (no expert cache)" if budget is None
           else "the experts stay in the mapped file" if budget == MAPPED
           else "every expert is resident in HIGH" if budget >= info.high_expert_bytes
           else "low precision is off")
    return [f"--low-from {low_from} is unused: {why}"]


NO_DEVICE = "none"  # --device none: the CPU alone, as llama.cpp's -dev none


def _mode(options: ExpertOptions, has_gpu: bool) -> tuple[str, str]:
    """The compute mode and why: --mode as given (its GPU modes need a GPU), else -ngl's (llama.cpp's
    habit: 0 the CPU; -1 or a count the GPU where there is one, else the CPU as llama.cpp runs),
    else the build's default (default_mode)."""
    given, layers = options.given.get("mode"), options.given.get("n_gpu_layers")
    given = given.name if given is not None else None
    if options.given.get("device") == NO_DEVICE:  # llama.cpp's -dev none
        if given not in (None, "cpu") or layers not in (None, 0):
            raise InvalidOptionError(f"--device none means --mode cpu, not {f'--mode {given}' if given else f'-ngl {layers}'}")
        return "cpu", "--device none: no GPU"
    if layers == 0 and given not in (None, "cpu"):
        raise InvalidOptionError(f"-ngl 0 means --mode cpu, not --mode {given}")
    if layers not in (None, 0) and given == "cpu" and has_gpu:  # without a GPU, -ngl N is the CPU too
        raise InvalidOptionError(f"-ngl {layers} asks for the GPU and --mode cpu for none: give one")
    if given is not None and given != "cpu" and not has_gpu:
        raise InvalidOptionError(f"--mode {given} needs a GPU and this build found none: {BUILD_HINT}")
    if given is not None:
        return given, "given"
    if layers == 0:
        return "cpu", "-ngl 0: no layer on the GPU"
    if layers is not None:
        if not has_gpu:
            return "cpu", f"-ngl {layers} asks for the GPU and this build has none: the CPU, as llama.cpp runs"
        return default_mode(True), f"-ngl {layers}: the GPU, the mode measured at load"
    return default_mode(has_gpu), f"the default of a build {'with' if has_gpu else 'without'} a GPU"


def _devices(mode: str, names: str | None, gpus: tuple[dict, ...]) -> tuple[tuple[dict, ...], str]:
    """The GPUs of a gpu/coop/auto mode (--device NAME[,NAME...], llama.cpp's -dev: the layers spread
    over them as llama.cpp spreads them, each layer's experts cached on its layer's device; default the
    first GPU),
    none for cpu."""
    if mode == "cpu":
        if names and names != NO_DEVICE:
            raise InvalidOptionError(f"--device {names} needs --mode gpu, coop or auto" if gpus else
                                     f"--device {names} needs a GPU and this build found none: {BUILD_HINT}")
        return (), "--mode cpu"
    if not names:
        return (gpus[0],), "the first GPU"
    by_name = {d["name"]: d for d in gpus}
    chosen = []
    for name in (n.strip() for n in names.split(",")):
        if name not in by_name:
            raise InvalidOptionError(f"no GPU device named {name!r} (this build has: {', '.join(by_name)})")
        if by_name[name] in chosen:
            raise InvalidOptionError(f"--device {names}: {name} is named twice")
        chosen.append(by_name[name])
    return tuple(chosen), "given" if len(chosen) == 1 else \
        "given: the layers spread over them, each layer's experts cached on its device"


def _addressable(budget: int, note: str, devices: tuple[dict, ...], info: ModelInfo) -> tuple[int, str]:
    """A device expert cache of what fits (auto, or a size with "~") where a device addresses fewer bytes in one tensor than the cache's
    largest pool would take (Vulkan: maxStorageBufferRange; a larger pool would be refused at load):
    at most what keeps that pool within it."""
    limits = [(d["max_tensor_bytes"], d["name"]) for d in devices if d.get("max_tensor_bytes")]
    if not limits or not info.largest_projection_share:
        return budget, note
    limit, name = min(limits)
    most = int(limit / info.largest_projection_share)
    if budget <= most:
        return budget, note
    return most, (f"{note}; at most {format_bytes(most)}: {name} addresses {format_bytes(limit)} in one tensor, and the "
                  f"cache's largest pool (one tensor) takes {info.largest_projection_share:.0%} of it")


def _spread(devices: tuple[dict, ...]) -> dict:
    """The layers' devices as one for the expert cache's size: their names and free memory summed (the
    native residency checks each device's share of the pools)."""
    return {"name": ",".join(d["name"] for d in devices), **{key: sum(d[key] for d in devices)
                                                            for key in ("free_bytes", "total_bytes")}}


def _tensor_split(text: str | None, devices: tuple[dict, ...]) -> tuple[float, ...]:
    """--tensor-split's shares, one per device of --device at most (llama.cpp's rule)."""
    if not text:
        return ()
    shares = tuple(float(x) for x in text.split(","))  # checked when given (expert_options)
    if len(shares) > len(devices):
        names = ",".join(d["name"] for d in devices) or "none: --mode cpu"
        raise InvalidOptionError(f"--tensor-split {text}: {len(shares)} shares for the layers' devices ({names})")
    return shares


def _host_cache(value, mode: str, offload: bool, expert_bytes: int, available: int, repacks: bool) -> tuple[int, str]:
    """The host tier's bytes and why: only a GPU mode has one; coop and split compute misses from it.
    repacks: the CPU's expert weights are repacked, so that split (or auto, which may choose it)
    keeps each copy twice where the budget holds them all so (host-tier.h): auto then asks for that."""
    if mode == "cpu":
        if value not in (None, "auto"):
            raise InvalidOptionError("--host-cache is the host tier of --mode gpu, coop, split or auto")
        return 0, "--mode cpu has no host tier"
    twice = repacks and mode in ("split", "auto")
    host_bytes = host_cache_bytes(value, expert_bytes, available, layouts=2 if twice else 1)  # checked, used or not
    if not offload:
        return 0, "every expert resident: no host tier" + (" (--host-cache unused)" if value not in (None, "auto") else "")
    if mode in ("coop", "split") and host_bytes == 0:
        raise InvalidOptionError(f"--mode {mode} computes the device's misses from the host tier: give it a --host-cache")
    if value not in (None, "auto"):
        held = expert_bytes * (2 if twice else 1)  # what the residency layer's tier takes of it at most
        return (host_bytes, "given") if host_bytes <= held else (held, "given, capped at every expert copy")
    return host_bytes, ("auto: every expert copy" + (" in split's two layouts (pinned, repacked)" if twice else "")
                        + ", or what RAM has free")


def _repack(given: bool | None, info: ModelInfo, experts_mapped: bool, offload: bool, device: dict | None,
            context: int, available: int) -> tuple[bool, str]:
    """Repacked copies (llama.cpp's default) and why: off where the experts stay mapped or stream
    through a cache in host memory (each read would be converted again), or where the copies would
    not fit beside the mapped experts they are read from (memory_budget.repack_fits)."""
    if given and experts_mapped:
        raise InvalidOptionError(f"expert_cache {MAPPED!r} computes from the mapped file: repacked copies would "
                                 "take the experts out of it (repack off)")
    if given is not None:
        return given, "given"
    if experts_mapped:
        return False, "the experts are computed from the mapped file"
    if offload and not device:
        return False, "the experts stream through an expert cache in host memory: each read would be converted again"
    if not device and not memory_budget.repack_fits(info.high_expert_bytes, info.repacked_expert_bytes,
                                                    info.non_expert_bytes, context, available):
        return False, (f"repack off: {format_bytes(info.repacked_expert_bytes)} of repacked copies would not fit "
                       "beside the mapped experts they are read from")
    return True, "llama.cpp's default"


def _calibrated_tables(native: _native.ExpertOptions, calibration: dict | None) -> tuple[dict | None, list | None,
                                                                                         dict | None]:
    """What options read from the calibration sidecar: EdgeMoE's static precision map
    (static_precision) and path statistics (prefetch edgemoe), the stand-ins (stand_in)."""
    calibration = calibration or {}
    precision_map = path_statistics = stand_ins = None
    if native.static_precision:
        if not calibration.get("precision_map"):
            raise InvalidOptionError("static_precision needs the precision map of `pyedgemoe calibrate --system edgemoe` "
                                     "in the calibration sidecar")
        precision_map = {int(layer): experts for layer, experts in calibration["precision_map"]["low"].items()}
    if native.prefetch.name == "edgemoe":
        stats = calibration.get("path_statistics")
        if not stats:
            raise InvalidOptionError("prefetch edgemoe needs the path statistics of `pyedgemoe calibrate` in the "
                                     "calibration sidecar")
        path_statistics = native_entries(stats)
    if native.stand_in > 0:
        if not calibration.get("stand_ins"):
            raise InvalidOptionError("stand_in needs the stand-ins of `pyedgemoe calibrate --stand-ins` in the "
                                     "calibration sidecar")
        stand_ins = MappingProxyType(stand_in_stats.taus(calibration["stand_ins"], native.stand_in))
    return precision_map, path_statistics, stand_ins


def _fill(native: _native.ExpertOptions | None, precision_map: Mapping | None, info: ModelInfo) -> tuple[str, str]:
    """The expert cache's fill, most routed first when calibrated, and why not in the background.
    The fill reads HIGH copies: with EdgeMoE's map, of the experts it keeps in HIGH."""
    if native is None or not native.fill_cache:
        return "none", "" if native is None else "fill_cache off"
    if precision_map is not None and \
            sum(map(len, precision_map.values())) == info.n_experts * len(info.expert_bytes_per_layer):
        return "none", "EdgeMoE's map puts every expert in LOW, and the fill reads HIGH copies"
    if native.fill_background and native.lossy:
        # with LOW copies, skips or cache routing, what a token computes would depend on whether the
        # fill has cached that expert yet, i.e. on timing
        return "at load", "lossy options: a background fill would make the tokens depend on timing"
    return ("in the background", "") if native.fill_background else ("at load", "fill_background off")


def _threads(n_threads: int | None, n_threads_batch: int | None, cores: ThreadCount, reads_core: bool) -> dict:
    """The thread counts: those given stay; the default (cores) goes to the decode less a core left
    to the expert reads, and follows the machine's load (threads.ThreadGovernor)."""
    why = f"threads: {n_threads or 'default'} decode, {n_threads_batch or n_threads or 'default'} batch"
    if not (n_threads and n_threads_batch):
        why += f"; default {cores.n}: {cores.why}"
        if reads_core and not n_threads:
            why += "; the decode leaves one to the expert reads"
    if not n_threads and cores.n > 1:
        why += "; fewer while the machine is busy"
    return dict(n_threads=n_threads or (cores.n - 1 if reads_core else cores.n),
                n_threads_batch=n_threads_batch or n_threads or cores.n, governed=not n_threads,
                batch_governed=not (n_threads_batch or n_threads), cores=cores.n, why=why)

