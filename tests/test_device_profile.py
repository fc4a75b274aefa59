"""The GPU check's profile of a decode (pyedgemoe.bench.device_profile): what it reads from a CUPTI
trace, as PyTorch's profiler (Kineto) writes one, and that it profiles a real decode of ours. No GPU
here: the device's side is read from a trace written by hand in Kineto's format, the numbers worked
out by hand."""
from __future__ import annotations

import gzip
import json

import pytest

from pyedgemoe import Engine
from pyedgemoe.bench.device_profile import WINDOW, describe, profile_decode, summarize, union_ms


def x(cat: str, name: str, ts: float, dur: float, **args) -> dict:
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, pid=0, tid=7, args=args)


# Two decode tokens in a window of 1000 us to 3000 us (1 ms a token, in microseconds below).
TRACE = [
    x("user_annotation", WINDOW, 1000, 2000),
    x("kernel", "mul_mat_vec_q", 1100, 200),         # 1100-1300
    x("kernel", "mul_mat_vec_q", 1250, 150),         # 1250-1400, on another stream: overlaps the first
    x("kernel", "rms_norm_f32", 2000, 100),          # 2000-2100
    x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1350, 250, bytes=3 << 20),  # 1350-1600: 200 us beside no kernel
    x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 2900, 300, bytes=1 << 20),  # clipped at 3000: 100 us
    x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 2500, 10, bytes=4096),
    x("kernel", "before_the_window", 500, 100),      # outside: not counted
    x("cuda_runtime", "cudaMemcpyAsync", 1010, 8),
    x("cuda_runtime", "cudaMemcpyAsync", 1020, 12),
    x("cuda_runtime", "cudaStreamSynchronize", 1400, 300),
    x("cuda_driver", "cuLaunchKernel", 1050, 4),
]


def test_union_counts_overlapping_time_once():
    assert union_ms([(0, 1000), (500, 1500), (3000, 3100)]) == pytest.approx(1.6)


def test_summary_places_a_tokens_time_on_the_device():
    s = summarize(TRACE, n_tokens=2)
    assert s["wall_ms"] == pytest.approx(1.0)
    # kernels 1100-1400 and 2000-2100: 0.4 ms; with the copies 1100-1600, 2000-2100, 2500-2510, 2900-3000
    assert s["kernel_ms"] == pytest.approx(0.4 / 2)
    assert s["kernels"] == 3 / 2
    assert s["device_busy_ms"] == pytest.approx((500 + 100 + 10 + 100) / 1e3 / 2)
    assert s["device_idle_ms"] == pytest.approx((2000 - 710) / 1e3 / 2)
    up = s["copies"]["HtoD"]
    assert (up["count"], up["bytes"]) == (1, (4 << 20) / 2)
    assert up["ms"] == pytest.approx(0.35 / 2)
    assert up["beside_no_kernel_ms"] == pytest.approx(0.3 / 2)  # 1400-1600 and 2900-3000
    assert s["copies"]["DtoH"]["count"] == 0.5
    assert s["sync_ms"] == pytest.approx(0.3 / 2) and s["syncs"] == 0.5
    # one spell without a kernel, 1400-2000: the device waiting for the CPU
    assert (s["kernel_gaps"], s["kernel_gap_median_us"]) == (0.5, 600)
    assert s["kernel_gaps_over_20us_ms"] == pytest.approx(0.6 / 2)
    calls = {c["name"]: c for c in s["calls"]}
    assert calls["cudaMemcpyAsync"]["count"] == 1 and calls["cudaMemcpyAsync"]["ms"] == pytest.approx(0.01)
    assert s["calls"][0]["name"] == "cudaStreamSynchronize"  # the costliest first
    assert s["top_kernels"][0]["name"] == "mul_mat_vec_q" and s["top_kernels"][0]["count"] == 1
    assert "device busy 0.4 ms" in describe(dict(s, activities=["CPU", "CUDA"]))


def test_a_trace_without_the_window_is_an_error():
    with pytest.raises(ValueError, match=WINDOW):
        summarize(TRACE[1:], n_tokens=2)


def test_profiles_a_real_decode(tiny_model, tmp_path):
    """On this machine's PyTorch (CPU): the decode runs under the profiler, its tokens and wall time
    counted, and the summary says that no device was recorded; the trace keeps the window."""
    gguf, _ = tiny_model("qwen3_moe")
    trace = tmp_path / "profile.json.gz"
    with Engine(gguf, n_ctx=64, expert_cache="50%") as eng:
        s = profile_decode(eng, [1, 17, 42, 99], [5, 230, 64, 7, 9, 11], trace)
    assert s["tokens"] == 6 and s["wall_ms"] > 0
    assert not s["device_recorded"] and s["activities"] == ["CPU"]
    assert "no device activity recorded" in describe(s)
    events = json.loads(gzip.open(trace, "rt").read())["traceEvents"]
    assert [e["name"] for e in events] == [WINDOW]
