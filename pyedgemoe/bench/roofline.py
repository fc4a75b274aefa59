"""The roofline of a decode step (DESIGN §8): the weights a token must touch, at RAM bandwidth,
plus the expert bytes it must read from storage, at the disk's bandwidth.

    time/token >= active bytes / RAM bandwidth + read bytes / disk bandwidth

Both bandwidths are measured here, on this machine, the way the runtime uses them: RAM by copying
a large buffer, the disk by O_DIRECT reads of one expert projection at a time at random offsets of
the model file (the loader's default of one read in flight), after evicting it from the page cache.
"""
from __future__ import annotations

import mmap
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ALIGN = 4096


@dataclass
class Bandwidths:
    ram_bytes_per_second: float
    disk_bytes_per_second: float
    disk_read_bytes: int  # the size of one read in the disk measurement


def ram_bandwidth(n_bytes: int = 512 << 20, repeats: int = 3) -> float:
    """Bytes read per second when copying a buffer much larger than the caches (best of repeats)."""
    src = np.ones(n_bytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return n_bytes / best


def disk_bandwidth(path: str | os.PathLike, read_bytes: int, n_reads: int = 48, seed: int = 0) -> float:
    """Bytes per second of O_DIRECT reads of read_bytes (rounded up to 4 KiB) at random aligned
    offsets of path, one at a time. Evict path from the page cache first (runner.evict_from_page_cache)."""
    size = os.path.getsize(path)
    length = -(-read_bytes // ALIGN) * ALIGN
    if size < length:
        raise ValueError(f"{path} is smaller than one read of {length} bytes")
    buf = mmap.mmap(-1, length)  # page-aligned, as O_DIRECT wants
    rng = random.Random(seed)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        t0 = time.perf_counter()
        for _ in range(n_reads):
            offset = rng.randrange(0, (size - length) // ALIGN + 1) * ALIGN
            os.preadv(fd, [buf], offset)
        elapsed = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
    return n_reads * length / elapsed


def measure(path: str | os.PathLike, read_bytes: int) -> Bandwidths:
    return Bandwidths(ram_bandwidth(), disk_bandwidth(path, read_bytes), read_bytes)


def active_bytes_per_token(info) -> int:
    """Weight bytes one decode step touches: every non-expert weight and, in each MoE layer, the
    HIGH copies of the k routed experts (a ModelInfo)."""
    per_expert = sum(info.high_expert_bytes_per_layer.values()) / max(1, info.n_experts)
    return int(info.non_expert_bytes + info.n_experts_used * per_expert)


def roofline_tokens_per_second(active_bytes: float, read_bytes: float, bw: Bandwidths) -> float:
    return 1.0 / (active_bytes / bw.ram_bytes_per_second + read_bytes / bw.disk_bytes_per_second)


def projection_bytes(path: str | os.PathLike) -> int:
    """One expert projection's bytes in the model (the size of the loader's reads)."""
    from pyedgemoe.model_info import read_model_info
    info = read_model_info(Path(path))
    per_layer = max(info.high_expert_bytes_per_layer.values())
    return per_layer // info.n_experts // 3
