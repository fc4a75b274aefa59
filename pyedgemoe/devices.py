"""Where the math runs: the GPUs a build of ours has (ggml's Vulkan, CUDA or Metal backend), whether
a device budget fits one, and the host tier's size (--host-cache). Which mode and device a load
uses, and why, is the load plan's decision (load_plan).

gpu: non-expert weights, the KV cache and a cache of experts in the GPU's memory; a missed
expert is uploaded. coop: the same, but a missed expert is computed on the CPU from the host tier.
split: the misses divided between the two at once, in the ratio of their rates measured at load and
then as the decode runs.
auto (the default where a GPU exists): the residency layer measures the upload bandwidth and the
CPU's expert throughput at load and picks one. cpu: everything on the CPU (the only mode of a
CPU-only build).
"""
from __future__ import annotations

from pyedgemoe import _native
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.memory_budget import RESERVE_SLACK_BYTES
from pyedgemoe.sysmem import parse_size

GPU_TYPES = ("gpu", "igpu")
BUILD_HINT = ("build with `make setup GGML_VULKAN=1` (or GGML_CUDA=1) and run where ggml sees a GPU "
              "(docs/gpu.md), or lend another machine's devices with --rpc HOST:PORT (docs/distributed.md)")


# Mesa 22.3.6's lavapipe (Debian 12's Vulkan on the CPU) ends the process in ggml-vulkan's flash
# attention once decodes follow a prompt: stock llama.cpp's too (llama-bench -fa 1 -pg 48,16: SIGSEGV)
FLASH_ATTENTION_FAILS = "llvmpipe"  # in such a device's description


def flash_attention_fails(devices) -> bool:
    """Whether ggml-vulkan's flash attention ends the process on one of devices (FLASH_ATTENTION_FAILS)."""
    return any(FLASH_ATTENTION_FAILS in d["description"] for d in devices)


def gpu_devices() -> list[dict]:
    """This build's GPUs (name, description, type, free_bytes, total_bytes), in ggml's order."""
    return [d for d in _native.devices() if d["type"] in GPU_TYPES]


def print_devices() -> None:
    """llama.cpp's --list-devices: every device but the CPU, its memory in MiB."""
    print("Available devices:")
    devices = [d for d in _native.devices() if d["type"] != "cpu"]
    for d in devices:
        print(f"  {d['name']}: {d['description']} ({d['total_bytes'] >> 20} MiB, {d['free_bytes'] >> 20} MiB free)")
    if not devices:
        print("  (none)")


def check_fits_device(budget: int, device: dict) -> None:
    """A device expert cache larger than the device's free memory is refused before anything loads."""
    if budget > device["free_bytes"]:
        gib = 1024**3
        raise InvalidOptionError(
            f"expert cache of {budget} bytes ({budget / gib:.2f} GiB) does not fit in {device['name']}'s free "
            f"memory: {device['free_bytes']} bytes ({device['free_bytes'] / gib:.2f} GiB) free of "
            f"{device['total_bytes']} ({device['total_bytes'] / gib:.2f} GiB)")


def host_cache_bytes(value: str | int | None, expert_bytes: int, available_bytes: int, layouts: int = 1) -> int:
    """The host tier's bytes: None / "auto" = every expert copy (both precisions: expert_bytes) in
    each of its layouts, or what RAM has free (available_bytes less RESERVE_SLACK_BYTES), whichever
    is less; a size (a share: of expert_bytes); 0 = none. Whether a mode has one is the load plan's
    rule (load_plan)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return max(0, min(expert_bytes * layouts, available_bytes - RESERVE_SLACK_BYTES))
    if isinstance(value, int):
        return value
    if value.strip() == "0":
        return 0
    try:
        return parse_size(value, percent_of=expert_bytes)
    except ValueError as e:
        raise InvalidOptionError(f"invalid host_cache {value!r}: {e}") from None
