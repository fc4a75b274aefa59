"""One client process of tests/test_rpc.py: registers RPC servers (they stay registered for the
process's life, so each scenario is a process of its own) and prints one JSON line.

    python scenario.py tokens MODEL ENDPOINTS      # every mode, all local and over the servers
    python scenario.py fault MODEL ENDPOINT SIGNAL SERVER_PID TIMEOUT_S CALL
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

from pyedgemoe import Engine, rpc
from pyedgemoe.model_info import read_model_info

SETTINGS = dict(n_ctx=256, n_threads=2, flash_attn=False, kv_type="f32")
IDS = [1, 17, 42, 99, 5, 230, 64, 7, 150, 33, 12, 201, 88, 3, 120, 45]
N_GREEDY = 24


def run(path, **options) -> tuple:
    with Engine(path, **SETTINGS, **options) as eng:
        return eng.logits(IDS), eng.time_generation(IDS[:8], N_GREEDY)["tokens"], eng.stats()


def minimum_budget(path) -> int:
    info = read_model_info(path)
    return info.n_experts_used * max(info.expert_bytes_per_layer.values()) // info.n_experts


def split_moe_layers(path) -> list[int]:
    """--tensor-split shares that put the first MoE layer on the first device, the others (and the
    output) on the second."""
    info = read_model_info(path)
    first = min(info.expert_bytes_per_layer) + 1
    return [first, info.n_layers + 1 - first]


def tokens(path: str, endpoints: str) -> dict:
    local_logits, local_tokens, _ = run(path, mode="cpu")
    devices = rpc.connect(endpoints)
    out = {"devices": devices, "local": local_tokens, "runs": {}}
    minimum = minimum_budget(path)
    spread = [",".join(devices)] if len(devices) > 1 else []  # the layers over every worker
    expert_bytes = read_model_info(path).high_expert_bytes
    for device in devices + spread:
        # each device caches its layers' experts: a token's top-k on each, at least
        least = minimum * (device.count(",") + 1)
        cases = {"resident": dict(n_gpu_layers=-1), "gpu 50%": dict(mode="gpu", expert_cache=max(least, expert_bytes // 2)),
                 "gpu 25%": dict(mode="gpu", expert_cache=max(least, expert_bytes // 4)),
                 "gpu minimum": dict(mode="gpu", expert_cache=least),
                 "coop 25%": dict(mode="coop", expert_cache=max(least, expert_bytes // 4)),
                 "split 25%": dict(mode="split", link_share=0.5, expert_cache=max(least, expert_bytes // 4))}
        for name, options in cases.items():
            if "," in device:  # llama.cpp's --tensor-split, not free memory: MoE layers on each
                options = dict(options, tensor_split=split_moe_layers(path))
            logits, toks, stats = run(path, device=device, **options)
            experts = stats.get("experts") or {}
            out["runs"][f"{device} {name}"] = {
                "tokens": toks, "device": stats.get("device"), "mode": stats.get("mode"),
                "pools": experts.get("device_pool_bytes", {}), "budget": options.get("expert_cache"),
                "max_logit_diff": float(np.abs(logits - local_logits).max()),
                "uploads": (experts.get("total") or {}).get("uploads", 0),
                "cpu_experts": (experts.get("total") or {}).get("cpu_experts", 0)}
    return out


def fault(path: str, endpoint: str, how: str, server_pid: int, timeout_s: int, call: str) -> dict:
    """call: the first call after the worker is lost, "generate" or "save_state"."""
    os.environ["GGML_RPC_TIMEOUT_S"] = str(timeout_s)
    device = rpc.connect(endpoint)[0]
    eng = Engine(path, **SETTINGS, n_gpu_layers=-1, device=device)
    first = eng.time_generation(IDS[:8], 4)["tokens"]
    calls = {"generate": lambda: eng.time_generation(IDS[:8], 8), "save_state": eng.save_state}
    os.kill(server_pid, getattr(signal, how))
    t0 = time.monotonic()
    try:
        calls[call]()
        error = None
    except Exception as e:  # what the caller sees is the point
        error = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - t0
    again = []
    for later in (calls["generate"], calls["save_state"]):  # the same loss, not text from a model half gone
        try:
            later()
            again.append(None)
        except Exception as e:
            again.append(f"{type(e).__name__}: {e}")
    eng.close()
    return {"first": first, "error": error, "again": again, "seconds": seconds, "closed": True}


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    result = tokens(*args) if what == "tokens" else fault(args[0], args[1], args[2], int(args[3]), int(args[4]),
                                                                        args[5])
    print(json.dumps(result))
