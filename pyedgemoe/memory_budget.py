"""Sizes of the expert cache: parsing `--expert-cache`, choosing one for "auto", and refusing
one that cannot fit.

What a run needs beside the memory it already uses: the expert cache (its budget; nothing when
every expert is resident, as the file is mapped and the page cache can drop experts), the
non-expert weights and the context's buffers (KV cache and attention scores, computed from the
model's shape); "auto" also keeps a fixed slack free. The memory available: MemAvailable, or what
is left under a cgroup memory limit if one is set. "auto" keeps every expert resident when they
fit with the rest, and otherwise gives the experts what is left. An explicit size that cannot fit
is refused with the numbers, or with a trailing `~` ("up to": `60%~`, `4GiB~`) reduced to what
"auto" would leave; one that fits only by eating into the slack is kept, with a warning.
"""
from __future__ import annotations

from pathlib import Path

from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.sysmem import format_bytes, own_memory_cgroup_v1, parse_size

# Kept free beside the context's KV cache and attention scores: llama.cpp's other compute
# buffers, Python and the OS (a 7 GB model's run used 0.12 GiB beyond weights and cache).
RESERVE_SLACK_BYTES = 384 * 1024**2
CGROUP_V2 = Path("/sys/fs/cgroup")
UP_TO = "~"  # a trailing "~" on a size: that much, or what fits if less


def available_memory() -> tuple[int, str]:
    """(what this process can still use, where that number comes from): MemAvailable, capped by
    the room under its cgroup's memory limit (limit minus usage, page cache included)."""
    available = None
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        raise OSError("no MemAvailable in /proc/meminfo")
    where = "according to MemAvailable"
    limits = [("cgroup v2", CGROUP_V2 / "memory.max", CGROUP_V2 / "memory.current")]
    v1 = own_memory_cgroup_v1()
    if v1 is not None:
        limits.append(("cgroup v1", v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes"))
    for name, limit_file, usage_file in limits:
        try:
            limit_text = limit_file.read_text().strip()
            if limit_text == "max":
                continue
            limit, usage = int(limit_text), int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if 0 < limit - usage < available:
            available = limit - usage
            where = f"under the {name} memory limit of {format_bytes(limit)} with {format_bytes(usage)} in use"
    return available, where


def available_memory_bytes() -> int:
    """What this process can still use (available_memory's bytes)."""
    return available_memory()[0]


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


def room_for_experts_bytes(non_expert_bytes: int, context: int, available: int) -> int:
    """What an expert cache may take and still leave the slack free: the available memory less the
    non-expert weights, the context (context_bytes()) and the slack. Not positive: those alone do
    not fit. Beyond this plus the slack a cache cannot fit at all."""
    return available - non_expert_bytes - context - RESERVE_SLACK_BYTES


def _measured(available: int | None) -> tuple[int, str]:
    """(available as given, e.g. a GPU's free memory, with nothing to say where from) or, for
    None, this machine's available_memory()."""
    return available_memory() if available is None else (available, "")


def _available_text(available: int, where: str) -> str:
    return f"{format_bytes(available)} available" + (f" {where}" if where else "")


def _no_room_error(non_expert_bytes: int, context: int, available: int, where: str) -> InvalidOptionError:
    """The refusal when the non-expert weights, the context and the slack alone do not fit."""
    need = non_expert_bytes + context + RESERVE_SLACK_BYTES
    context_room = available - non_expert_bytes - RESERVE_SLACK_BYTES
    hint = (f"the context must take less than {format_bytes(context_room)} (a shorter --ctx)" if context_room > 0
            else "the non-expert weights and the slack alone do not fit")
    return InvalidOptionError(
        f"not enough memory: the non-expert weights ({format_bytes(non_expert_bytes)}), the context's KV cache and "
        f"attention scores ({format_bytes(context)}) and {format_bytes(RESERVE_SLACK_BYTES)} of slack need "
        f"{format_bytes(need)}, and {_available_text(available, where)}: {hint}")


def auto_expert_cache(expert_bytes: int, non_expert_bytes: int, context: int,
                      available: int | None = None) -> tuple[int | None, str]:
    """(budget bytes, or None for every expert resident; a sentence saying which and why).
    context: context_bytes() of the context the model will run in. available: the memory the
    model runs in (a GPU's free memory), else available_memory()."""
    available, where = _measured(available)
    room = room_for_experts_bytes(non_expert_bytes, context, available)
    reserve = context + RESERVE_SLACK_BYTES
    gib = 1024**3
    if expert_bytes <= room:
        return None, (f"expert cache auto: all experts resident ({expert_bytes / gib:.2f} GiB of experts fit "
                      f"in {available / gib:.2f} GiB available)")
    if room <= 0:
        raise _no_room_error(non_expert_bytes, context, available, where)
    return room, (f"expert cache auto: {room / gib:.2f} GiB for {expert_bytes / gib:.2f} GiB of experts "
                  f"({available / gib:.2f} GiB available, {reserve / gib:.2f} GiB reserved for the context "
                  f"and slack)")


def fit_expert_cache(budget: int, shown: str, up_to: bool, expert_bytes: int, non_expert_bytes: int, context: int,
                     available: int | None = None, refuse: bool = True) -> tuple[int, str | None]:
    """(the budget, or with up_to what fits if less; None, or a sentence saying it was reduced or
    that it eats into the slack). An explicit budget that cannot fit at all beside the non-expert
    weights and the context is refused with the numbers (InvalidOptionError); refuse=False leaves
    that to the caller (a GPU's budget: devices.check_fits_device). One that fits is kept even if
    it leaves less than the slack (a small model's other buffers need far less: see
    tests/test_memory_honesty.py), with a warning; what it is reduced to, and the largest budget
    a refusal names, keep the slack free as "auto" does. shown: the value as the user gave it,
    without the "~". A model without experts caches none: only its context is checked."""
    available, where = _measured(available)
    room = room_for_experts_bytes(non_expert_bytes, context, available)
    cache = budget if expert_bytes else 0
    if cache <= room:
        return budget, None
    if cache <= room + RESERVE_SLACK_BYTES or not (refuse or up_to):
        left = room + RESERVE_SLACK_BYTES - cache
        return budget, None if not expert_bytes or left < 0 else (
            f"expert cache {shown} ({format_bytes(budget)}) fits, but leaves only {format_bytes(left)} of the "
            f"{format_bytes(RESERVE_SLACK_BYTES)} of slack auto keeps for llama.cpp's other buffers and the OS "
            f"({_available_text(available, where)}, less {format_bytes(non_expert_bytes)} of non-expert weights "
            f"and {format_bytes(context)} for the context): the run is killed if they need more")
    if room <= 0:
        raise _no_room_error(non_expert_bytes, context, available, where)
    if up_to:
        return room, (f"expert cache {shown}{UP_TO} reduced to what fits: {format_bytes(room)} instead of "
                      f"{format_bytes(budget)}, for {format_bytes(expert_bytes)} of experts "
                      f"({_available_text(available, where)}, less {format_bytes(non_expert_bytes)} of non-expert "
                      f"weights, {format_bytes(context)} for the context and {format_bytes(RESERVE_SLACK_BYTES)} "
                      f"of slack)")
    mib = 1024**2
    largest = f"{room // mib}MiB" if room >= mib else str(room)
    raise InvalidOptionError(
        f"expert cache {shown} ({format_bytes(budget)}) does not fit: it needs {format_bytes(budget)} + "
        f"{format_bytes(non_expert_bytes)} of non-expert weights + {format_bytes(context)} for the context = "
        f"{format_bytes(budget + non_expert_bytes + context)}, and {_available_text(available, where)}; the largest "
        f"expert cache that fits with {format_bytes(RESERVE_SLACK_BYTES)} of slack for llama.cpp's other buffers "
        f"and the OS is {format_bytes(room)} (--expert-cache {largest}, or {shown}{UP_TO} for what fits)")


def parse_expert_cache(value: str | int | None, expert_bytes: int, non_expert_bytes: int,
                       context: int, available: int | None = None, refuse: bool = True) -> tuple[int | None, str]:
    """(bytes of the expert cache or None = every expert resident, a sentence for the user).
    value: None / "auto", bytes (int), "300MiB", "4GiB", "1.5GB", or "50%" of the expert bytes;
    a size with a trailing "~" is that much or what fits, if less. context: context_bytes().
    available: as for auto_expert_cache. A size that does not fit is refused (fit_expert_cache;
    refuse=False: the caller checks it)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return auto_expert_cache(expert_bytes, non_expert_bytes, context, available)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidOptionError(f"expert_cache must be bytes, a size like '4GiB', a percentage or 'auto', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise InvalidOptionError(f"expert_cache must be positive, got {value}")
        budget, note = fit_expert_cache(value, str(value), False, expert_bytes, non_expert_bytes, context,
                                        available, refuse)
        return budget, note or f"expert cache: {value} bytes"
    shown = value.strip()
    up_to = shown.endswith(UP_TO)
    shown = shown.removesuffix(UP_TO).strip()
    try:
        budget = parse_size(shown, percent_of=expert_bytes)
        if shown.endswith("%") and budget > expert_bytes:
            raise ValueError("more than every expert")
    except ValueError:
        raise InvalidOptionError(
            f"invalid expert_cache {value!r}: use bytes, a size like '300MiB' or '4GiB', a percentage like '50%', "
            f"'auto', or a size with a trailing '{UP_TO}' for up to that much ('60%{UP_TO}': what fits if less)"
        ) from None
    budget, note = fit_expert_cache(budget, shown, up_to, expert_bytes, non_expert_bytes, context, available, refuse)
    return budget, note or f"expert cache: {budget / 1024**2:.1f} MiB for {expert_bytes / 1024**2:.1f} MiB of experts"
