"""Sizes of the expert cache: parsing `--expert-cache` and choosing one for "auto".

"auto" keeps every expert resident when the whole model fits in the memory available
(MemAvailable, or what is left under a cgroup memory limit if one is set), and otherwise gives
the experts what is available minus the non-expert weights, the context's buffers (KV cache and
attention scores, computed from the model's shape) and a fixed slack.
"""
from __future__ import annotations

from pathlib import Path

from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.sysmem import own_memory_cgroup_v1, parse_size

# Kept free under "auto" beside the context's KV cache and attention scores: llama.cpp's other
# compute buffers, Python and the OS (a 7 GB model's run used 0.12 GiB beyond weights and cache).
RESERVE_SLACK_BYTES = 384 * 1024**2
CGROUP_V2 = Path("/sys/fs/cgroup")


def available_memory_bytes() -> int:
    """What this process can still use: MemAvailable, capped by its cgroup's limit minus usage."""
    available = None
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        raise OSError("no MemAvailable in /proc/meminfo")
    limits = [(CGROUP_V2 / "memory.max", CGROUP_V2 / "memory.current")]
    v1 = own_memory_cgroup_v1()
    if v1 is not None:
        limits.append((v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes"))
    for limit_file, usage_file in limits:
        try:
            limit_text = limit_file.read_text().strip()
            if limit_text == "max":
                continue
            room = int(limit_text) - int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if 0 < room < available:
            available = room
    return available


def context_bytes(metadata: dict, n_ctx: int, n_ubatch: int, kv_element_bytes: float, flash_attn: bool | None) -> int:
    """The bulk of what a llama.cpp context allocates beside the weights: the KV cache (n_ctx x layers
    x (K + V widths)) and, with flash attention off, one layer's attention scores and their softmax
    (2 x n_ctx x n_ubatch x heads f32; None = llama.cpp's auto, which turns it on where the device
    has it, as the CPU does). metadata: the GGUF key-values; n_ctx 0 = the training context."""
    arch = str(metadata.get("general.architecture", ""))

    def value(key: str, default: int = 0) -> int:
        v = metadata.get(f"{arch}.{key}", default)
        if isinstance(v, (list, tuple)):  # per-layer values
            v = max(v, default=default)
        return int(v) if isinstance(v, (int, float)) else default

    n_ctx = n_ctx or value("context_length", 4096)
    n_head = value("attention.head_count", 1) or 1
    n_head_kv = value("attention.head_count_kv", n_head) or n_head
    head_dim = value("embedding_length") // n_head
    k_width = n_head_kv * value("attention.key_length", head_dim)
    v_width = n_head_kv * value("attention.value_length", head_dim)
    kv = n_ctx * value("block_count") * (k_width + v_width) * kv_element_bytes
    scores = 2 * n_ctx * n_ubatch * n_head * 4 if flash_attn is False else 0
    return int(kv + scores)


def auto_expert_cache(expert_bytes: int, non_expert_bytes: int, context: int,
                      available: int | None = None) -> tuple[int | None, str]:
    """(budget bytes, or None for every expert resident; a sentence saying which and why).
    context: context_bytes() of the context the model will run in. available: the memory the
    model runs in (a GPU's free memory), else available_memory_bytes()."""
    available = available_memory_bytes() if available is None else available
    reserve = context + RESERVE_SLACK_BYTES
    gib = 1024**3
    if expert_bytes + non_expert_bytes + reserve <= available:
        return None, (f"expert cache auto: all experts resident ({expert_bytes / gib:.2f} GiB of experts fit "
                      f"in {available / gib:.2f} GiB available)")
    budget = available - non_expert_bytes - reserve
    if budget <= 0:
        raise InvalidOptionError(
            f"not enough memory: {available / gib:.2f} GiB available, the non-expert weights alone need "
            f"{non_expert_bytes / gib:.2f} GiB plus a {reserve / gib:.2f} GiB reserve for the context and slack")
    return budget, (f"expert cache auto: {budget / gib:.2f} GiB for {expert_bytes / gib:.2f} GiB of experts "
                    f"({available / gib:.2f} GiB available, {reserve / gib:.2f} GiB reserved for the context "
                    f"and slack)")


def parse_expert_cache(value: str | int | None, expert_bytes: int, non_expert_bytes: int,
                       context: int, available: int | None = None) -> tuple[int | None, str]:
    """(bytes of the expert cache or None = every expert resident, a sentence for the user).
    value: None / "auto", bytes (int), "300MiB", "4GiB", "1.5GB", or "50%" of the expert bytes.
    context: context_bytes(), kept free under "auto"; available: as for auto_expert_cache."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return auto_expert_cache(expert_bytes, non_expert_bytes, context, available)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidOptionError(f"expert_cache must be bytes, a size like '4GiB', a percentage or 'auto', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise InvalidOptionError(f"expert_cache must be positive, got {value}")
        return value, f"expert cache: {value} bytes"
    try:
        budget = parse_size(value, percent_of=expert_bytes)
        if value.strip().endswith("%") and budget > expert_bytes:
            raise ValueError("more than every expert")
    except ValueError:
        raise InvalidOptionError(
            f"invalid expert_cache {value!r}: use bytes, a size like '300MiB' or '4GiB', a percentage like '50%', or 'auto'"
        ) from None
    return budget, f"expert cache: {budget / 1024**2:.1f} MiB for {expert_bytes / 1024**2:.1f} MiB of experts"
