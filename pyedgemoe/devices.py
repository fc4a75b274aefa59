"""Where the math runs: the GPU a build of ours has (ggml's Vulkan, CUDA or Metal backend), the
compute mode (--mode cpu|gpu|coop|auto, HOBBIT sec. 4) and the host tier's size (--host-cache).

gpu: non-expert weights, the KV cache and a cache of experts in the GPU's memory; a missed
expert is uploaded. coop: the same, but a missed expert is computed on the CPU from the host tier.
auto (the default where a GPU exists): the residency layer measures the upload bandwidth and the
CPU's expert throughput at load and picks one. cpu: everything on the CPU (the only mode of a
CPU-only build).
"""
from __future__ import annotations

from pyedgemoe import _native
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.memory_budget import RESERVE_SLACK_BYTES, available_memory_bytes
from pyedgemoe.sysmem import parse_size

GPU_TYPES = ("gpu", "igpu")
BUILD_HINT = ("build with `make setup GGML_VULKAN=1` (or GGML_CUDA=1) and run where ggml sees a GPU "
              "(docs/gpu.md)")


def gpu_devices() -> list[dict]:
    """This build's GPUs (name, description, type, free_bytes, total_bytes), in ggml's order."""
    return [d for d in _native.devices() if d["type"] in GPU_TYPES]


def resolve_mode(given: str | None) -> str:
    """The mode for a caller's --mode (None: unset): auto where a GPU exists, else cpu."""
    if given is None:
        return "auto" if gpu_devices() else "cpu"
    if given != "cpu" and not gpu_devices():
        raise InvalidOptionError(f"--mode {given} needs a GPU and this build found none: {BUILD_HINT}")
    return given


def choose_device(mode: str, name: str | None) -> dict | None:
    """The GPU of a gpu/coop/auto mode (--device NAME, default the first), None for cpu."""
    if mode == "cpu":
        if name:
            raise InvalidOptionError(f"--device {name} needs --mode gpu, coop or auto" if gpu_devices() else
                                     f"--device {name} needs a GPU and this build found none: {BUILD_HINT}")
        return None
    gpus = gpu_devices()
    if not name:
        return gpus[0]
    for d in gpus:
        if d["name"] == name:
            return d
    raise InvalidOptionError(f"no GPU device named {name!r} (this build has: "
                             f"{', '.join(d['name'] for d in gpus)})")


def check_fits_device(budget: int, device: dict) -> None:
    """A device expert cache larger than the device's free memory is refused before anything loads."""
    if budget > device["free_bytes"]:
        gib = 1024**3
        raise InvalidOptionError(
            f"expert cache of {budget} bytes ({budget / gib:.2f} GiB) does not fit in {device['name']}'s free "
            f"memory: {device['free_bytes']} bytes ({device['free_bytes'] / gib:.2f} GiB) free of "
            f"{device['total_bytes']} ({device['total_bytes'] / gib:.2f} GiB)")


def host_cache_bytes(value: str | int | None, mode: str, expert_bytes: int) -> int:
    """The host tier's bytes: None / "auto" = every expert copy (both precisions: expert_bytes) or
    what RAM has free, whichever is less; a size; 0 = none. Only device modes have one."""
    if mode == "cpu":
        if value not in (None, "auto"):
            raise InvalidOptionError("--host-cache is the host tier of --mode gpu, coop or auto")
        return 0
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return max(0, min(expert_bytes, available_memory_bytes() - RESERVE_SLACK_BYTES))
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidOptionError(f"host_cache must be bytes, a size like '8GiB' or 'auto', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidOptionError(f"host_cache must be >= 0, got {value}")
        return value
    if value.strip() == "0":
        return 0
    try:
        return parse_size(value, percent_of=expert_bytes)
    except ValueError as e:
        raise InvalidOptionError(f"invalid host_cache {value!r}: {e}") from None
