#!/usr/bin/env python3
"""Bytes on the wire per decoded token and decode speed over ggml's RPC backend, on loopback, for
each placement of docs/distributed.md (the table there is this script's output).

    .venv/bin/python scripts/rpc_wire.py models/demo.gguf [--tokens 64] [--repeats 3]

Two workers (`pyedgemoe rpc-server`) run in processes of their own; the client decodes the same
greedy tokens all local and with each placement (lossless: every expert in HIGH). The bytes are the kernel's count for the
workers' TCP connections (`ss`'s bytes_received and bytes_sent, both directions), read around
a generation of N tokens and one of 1 token: their difference over N - 1 is a decode step's."""
from __future__ import annotations

import argparse
import re
import socket
import statistics
import subprocess
import sys
import time

from pyedgemoe import Engine, rpc

PROMPT = [100 + (i * 37) % 1000 for i in range(16)]
PLACEMENTS = {  # device: the first worker's unless given
    "all local (reference)": dict(mode="cpu"),
    "every layer remote (-ngl all)": dict(n_gpu_layers=-1),
    "the layers over two workers (--device RPC0,RPC1)": dict(n_gpu_layers=-1, device="RPC0,RPC1"),
    "expert pools remote, 50 % (--mode gpu)": dict(mode="gpu", expert_cache="50%", system="lossless"),
    "expert pools remote, 25 % (--mode gpu)": dict(mode="gpu", expert_cache="25%", system="lossless"),
    "expert pools remote, 25 %, misses here (--mode coop)": dict(mode="coop", expert_cache="25%", system="lossless"),
    "expert pools over two workers, 25 % (--mode gpu --device RPC0,RPC1)":
        dict(mode="gpu", expert_cache="25%", system="lossless", device="RPC0,RPC1"),
    "expert pools over two workers, 50 % (--mode gpu --device RPC0,RPC1)":
        dict(mode="gpu", expert_cache="50%", system="lossless", device="RPC0,RPC1"),
}


def wire_bytes(ports: list[int]) -> int:
    """Bytes both ways on the workers' established connections (the kernel's tcp_info)."""
    total = 0
    for port in ports:
        out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                             capture_output=True, text=True, check=True).stdout
        total += sum(int(n) for key in ("bytes_received", "bytes_sent") for n in re.findall(rf"{key}:(\d+)", out))
    return total


def start_worker(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "pyedgemoe", "rpc-server", "--port", str(port)],
                            stdout=subprocess.DEVNULL)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.1)
    raise SystemExit("the worker did not start")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=50052, help="the first worker's; the second's is the next")
    args = p.parse_args()
    ports = [args.port, args.port + 1]
    workers = [start_worker(port) for port in ports]
    try:
        device = rpc.connect(",".join(f"127.0.0.1:{port}" for port in ports))[0]
        print("| placement | bytes on the wire per decoded token | decode tok/s (median) | same tokens |")
        print("|---|---:|---:|---|")
        reference = None
        for name, options in PLACEMENTS.items():
            remote = options.get("mode") != "cpu"
            with Engine(args.model, n_ctx=256, **{**({"device": device} if remote else {}), **options}) as eng:
                speeds, tokens = [], None
                for _ in range(args.repeats):
                    t = eng.time_generation(PROMPT, args.tokens)
                    speeds.append(t["n_decoded"] / t["decode_seconds"])
                    tokens = t["tokens"]
                per_token = "-"
                if remote:
                    before = wire_bytes(ports)
                    eng.time_generation(PROMPT, 1)
                    one = wire_bytes(ports) - before
                    before = wire_bytes(ports)
                    eng.time_generation(PROMPT, args.tokens)
                    many = wire_bytes(ports) - before
                    per_token = f"{(many - one) / (args.tokens - 1) / 1024:.1f} KiB"
            reference = reference or tokens
            print(f"| {name} | {per_token} | {statistics.median(speeds):.1f} | {'yes' if tokens == reference else 'NO'} |")
    finally:
        for worker in workers:
            worker.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
