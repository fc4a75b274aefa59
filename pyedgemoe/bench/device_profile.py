"""Where a decode token's time goes on a CUDA device, from CUPTI's trace (docs/gpu.md, "The GPU check").

Our counters (op_ms, cpu_pass_ms, upload_wait_ms, ...) time what our code does; they cannot see
the device: how long its kernels and copies run, how long it sits idle while the CPU works, how
long the CPU waits for it, what the driver's calls cost. CUPTI records all of that for every CUDA
call in the process, ggml's included, and PyTorch's profiler (Kineto) reads it out; PyTorch is
installed where the GPU check runs. Nsight Systems is not usable there (docs/gpu.md).

    summary = profile_decode(engine, prompt_ids, feed_ids, trace_path)

decodes len(feed_ids) tokens after prompt_ids under the profiler and returns, per decode token:
the wall time; the device's busy time (kernels, copies by direction: count, bytes, time); the
time the CPU spent in calls that wait for the device (synchronizations); the costliest driver
calls and kernels. A gzipped trace of the device's and the driver's events goes to trace_path
(chrome://tracing or Perfetto read it). Without CUDA (a CPU build of PyTorch) the summary has the
wall time alone and says so.
"""
from __future__ import annotations

import gzip
import json
import tempfile
from collections import defaultdict
from pathlib import Path

WINDOW = "pyedgemoe_decode"  # the annotation around the profiled decode
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
CALL_CATEGORIES = {"cuda_runtime", "cuda_driver"}
TOP = 8  # the costliest driver calls and kernels kept


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals (start, end) merged where they overlap or touch, in order."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """The time (ms) covered by at least one of the intervals (start, end in microseconds)."""
    return sum(e - s for s, e in merged(intervals)) / 1e3


def copy_direction(name: str) -> str:
    """'HtoD', 'DtoH', 'DtoD', ... from Kineto's 'Memcpy HtoD (Pinned -> Device)'."""
    parts = name.split()
    return parts[1] if len(parts) > 1 and parts[0] == "Memcpy" else name


def summarize(events: list[dict], n_tokens: int) -> dict:
    """Per decode token, from a Chrome trace's events: only what lies in the WINDOW annotation (the
    device's events clipped to it). Times in ms, sizes in bytes."""
    window = next((e for e in events if e.get("name") == WINDOW and e.get("ph") == "X"
                   and e.get("cat") == "user_annotation"), None)
    if window is None:
        raise ValueError(f"the trace has no '{WINDOW}' annotation")
    w0, w1 = float(window["ts"]), float(window["ts"]) + float(window["dur"])

    def inside(e: dict) -> tuple[float, float] | None:
        s, d = float(e["ts"]), float(e.get("dur", 0))
        s, t = max(s, w0), min(s + d, w1)
        return (s, t) if t > s else None

    per = 1 / n_tokens
    device, kernels, copies = [], [], defaultdict(lambda: dict(count=0, bytes=0, spans=[]))
    kernel_time, calls = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    sync_ms, syncs = 0.0, 0
    for e in events:
        if e.get("ph") != "X" or (span := inside(e)) is None:
            continue
        cat = e.get("cat")
        if cat in DEVICE_CATEGORIES:
            device.append(span)
            if cat == "kernel":
                kernels.append(span)
                k = kernel_time[e["name"][:100]]
                k[0] += 1
                k[1] += (span[1] - span[0]) / 1e3
            elif cat == "gpu_memcpy":
                c = copies[copy_direction(e["name"])]
                c["count"] += 1
                c["bytes"] += int((e.get("args") or {}).get("bytes", 0))
                c["spans"].append(span)
        elif cat in CALL_CATEGORIES:
            c = calls[e["name"]]
            c[0] += 1
            c[1] += (span[1] - span[0]) / 1e3
            if "Synchronize" in e["name"]:  # the CPU waits there for the device
                sync_ms += (span[1] - span[0]) / 1e3
                syncs += 1

    def top(table: dict) -> list[dict]:
        rows = sorted(table.items(), key=lambda kv: -kv[1][1])[:TOP]
        return [dict(name=name, count=n * per, ms=ms * per) for name, (n, ms) in rows]
    wall_ms = (w1 - w0) / 1e3
    computing, device_busy = merged(kernels), union_ms(device)
    kernel_busy = sum(e - s for s, e in computing) / 1e3
    # the spells between kernels: the longer ones are the device waiting for the CPU (our op, the
    # CPU's pass, the graph's switch between backends), the shorter ones launch gaps
    gaps = sorted(b[0] - a[1] for a, b in zip(computing, computing[1:]))
    return dict(
        tokens=n_tokens, wall_ms=wall_ms * per, device_recorded=bool(device or calls),
        device_busy_ms=device_busy * per, device_idle_ms=(wall_ms - device_busy) * per,
        kernel_gaps=len(gaps) * per, kernel_gap_median_us=gaps[len(gaps) // 2] if gaps else 0.0,
        kernel_gaps_over_20us_ms=sum(g for g in gaps if g > 20) / 1e3 * per,
        kernel_ms=kernel_busy * per, kernels=len(kernels) * per,
        copies={d: dict(count=c["count"] * per, bytes=c["bytes"] * per, ms=union_ms(c["spans"]) * per,
                        beside_no_kernel_ms=(union_ms(c["spans"] + kernels) - kernel_busy) * per)
                for d, c in sorted(copies.items())},
        sync_ms=sync_ms * per, syncs=syncs * per, calls=top(calls), top_kernels=top(kernel_time))


def profile_decode(engine, prompt_ids: list[int], feed_ids: list[int], trace_path: Path | None = None) -> dict:
    """Greedy decode of len(feed_ids) tokens after prompt_ids (the picks replaced by feed_ids, as
    the check's decode feeds them) under PyTorch's profiler, CUDA's activities where it has them;
    the prefill runs before the profiler starts. summarize's dict, and what the profiler could see."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from pyedgemoe.generation import SamplingParams

    activities = [a for a in (ProfilerActivity.CPU, ProfilerActivity.CUDA) if a in torch.profiler.supported_activities()]
    tokens = engine.generate_tokens(prompt_ids, len(feed_ids) + 1, SamplingParams(temperature=0.0), ignore_eos=True,
                                    feed_tokens=feed_ids)
    next(tokens)  # the prefill, and the first pick
    with profile(activities=activities) as prof, record_function(WINDOW):
        n = sum(1 for _ in tokens)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        events = json.loads(raw.read_text())["traceEvents"]
    summary = summarize(events, n)
    summary["activities"] = [a.name for a in activities]
    if trace_path is not None:  # the device's and the driver's events, and the window
        kept = [e for e in events if e.get("cat") in DEVICE_CATEGORIES | CALL_CATEGORIES or e.get("name") == WINDOW]
        with gzip.open(trace_path, "wt") as f:
            json.dump({"traceEvents": kept}, f)
    return summary


def describe(s: dict) -> str:
    """One line for a report."""
    line = f"a token {s['wall_ms']:.1f} ms"
    if not s["device_recorded"]:
        return line + f" (no device activity recorded: the profiler had {', '.join(s['activities'])})"
    up = s["copies"].get("HtoD", dict(count=0, bytes=0, ms=0, beside_no_kernel_ms=0))
    down = s["copies"].get("DtoH", dict(count=0, bytes=0, ms=0))
    line += (f": device busy {s['device_busy_ms']:.1f} ms, idle {s['device_idle_ms']:.1f}; kernels {s['kernel_ms']:.1f} ms "
             f"({s['kernels']:.0f}), none for {s['kernel_gaps_over_20us_ms']:.1f} ms in spells over 20 us "
             f"({s['kernel_gaps']:.0f} spells in all, median {s['kernel_gap_median_us']:.0f} us); "
             f"to the device {up['bytes'] / 2**20:.0f} MiB in {up['count']:.0f} copies, "
             f"{up['ms']:.1f} ms ({up['beside_no_kernel_ms']:.1f} of them while no kernel ran); to the host "
             f"{down['count']:.0f} copies, {down['ms']:.1f} ms; the CPU waiting for the device {s['sync_ms']:.1f} ms "
             f"in {s['syncs']:.0f} synchronizations; "
             "calls: " + ", ".join(f"{c['name']} {c['count']:.0f}x {c['ms']:.1f} ms" for c in s["calls"][:4]))
    return line
