"""The roofline of a decode step (docs/benchmarks.md): the weights a token must touch, at RAM
bandwidth, plus the expert bytes it must read from storage, at the disk's bandwidth.

    time/token >= active bytes / RAM bandwidth + read bytes / disk bandwidth

RAM bandwidth is measured here by copying a large buffer. The disk's is the bandwidth the run's
own expert reads got (bytes read / time spent in reads, from the engine's counters): on a virtual
disk the host caches what earlier reads fetched and serves re-reads faster, so a separate
measurement gives another number for every access pattern. Two tried here: random offsets
(0.68 GB/s) and random whole experts (0.22-0.58 GB/s, depending on what the host had cached),
against 1.0-1.1 GB/s inside the runs; both put the roofline below the measured speed. With the
run's own bandwidth, measured / roofline says how much the runtime adds to reading and computing.
"""
from __future__ import annotations

import time

import numpy as np


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


def run_disk_bandwidth(expert_stats: dict) -> float | None:
    """Bytes per second of a run's expert reads, on demand and prefetched (Engine.stats()["experts"]),
    over the wall time reads were in flight; None when it read nothing. (Results written before the
    prefetcher reported busy_ms ran one prefetch read at a time: its summed load_ms is that time.)"""
    prefetched = expert_stats.get("prefetches") or {}
    n_bytes = expert_stats["total"]["bytes_read"] + prefetched.get("bytes_read", 0)
    prefetch_ms = prefetched.get("busy_ms", prefetched.get("load_ms", 0.0))
    seconds = (expert_stats["total"]["load_ms"] + prefetch_ms) / 1000
    return n_bytes / seconds if n_bytes and seconds > 0 else None


def active_bytes_per_token(info) -> int:
    """Weight bytes one decode step touches: every non-expert weight and, in each MoE layer, the
    HIGH copies of the k routed experts (a ModelInfo)."""
    per_expert = sum(info.high_expert_bytes_per_layer.values()) / max(1, info.n_experts)
    return int(info.non_expert_bytes + info.n_experts_used * per_expert)


def roofline_tokens_per_second(active_bytes: float, read_bytes: float, ram_bytes_per_second: float,
                               disk_bytes_per_second: float) -> float:
    return 1.0 / (active_bytes / ram_bytes_per_second + read_bytes / disk_bytes_per_second)
