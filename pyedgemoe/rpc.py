"""Other machines' devices over ggml's RPC backend (docs/distributed.md), as llama.cpp's `--rpc`.

    pyedgemoe rpc-server --host 0.0.0.0 --port 50052      # on each worker machine
    pyedgemoe run model.gguf --rpc 192.168.1.7:50052 --device RPC0 --mode gpu

A worker is llama.cpp's rpc-server: it serves its CPU (or GPU) to whoever connects, unauthenticated,
so it binds to 127.0.0.1 unless told otherwise. Its devices join this process's device list under
llama.cpp's names (RPC0, RPC1, ... in the order the servers were given), and from there they are
devices like any GPU: `--device`, the device tier, the load plan.
"""
from __future__ import annotations

import socket

from pyedgemoe import _native
from pyedgemoe.errors import InvalidOptionError, ModelLoadError

DEFAULT_PORT = 50052  # llama.cpp's rpc-server's
DEFAULT_HOST = "127.0.0.1"
CONNECT_TIMEOUT_S = 5.0


def parse_servers(text: str) -> list[tuple[str, int]]:
    """"host:port[,host:port...]" (llama.cpp's --rpc) -> [(host, port)]."""
    servers = []
    for item in (s.strip() for s in text.split(",")):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidOptionError(f"--rpc: {item!r} is not HOST:PORT (e.g. 192.168.1.7:{DEFAULT_PORT})")
        servers.append((host.strip("[]"), int(port)))
    return servers


def connect(text: str) -> list[str]:
    """Reaches every server of `text` (parse_servers) and registers its devices; their names, in order.
    A server that is not there is one ModelLoadError naming it, before ggml tries (ggml's RPC client
    aborts the process when a connection fails)."""
    names = []
    for host, port in parse_servers(text):
        endpoint = f"{host}:{port}"
        try:
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:
            raise ModelLoadError(f"cannot reach the RPC server {endpoint}: {e.strerror or e}") from None
        try:
            names += _native.rpc_add_server(endpoint)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
    return names


def serve(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, threads: int = 1, cache_dir: str = "") -> None:
    """Serve this machine's CPU at host:port until stopped (llama.cpp's rpc-server)."""
    if not 0 < port < 65536:
        raise InvalidOptionError(f"--port {port}: not a TCP port")
    _native.rpc_serve(f"{host}:{port}", cache_dir, threads)
