"""Other machines' devices over ggml's RPC backend (docs/distributed.md), as llama.cpp's `--rpc`.

    pyedgemoe rpc-server --host 0.0.0.0 --port 50052      # on each worker machine
    pyedgemoe run model.gguf --rpc 192.168.1.7:50052 --device RPC0 --mode gpu

A worker is llama.cpp's rpc-server: it serves its CPU (or GPU) to whoever connects, unauthenticated,
so it binds to 127.0.0.1 unless told otherwise. Its devices join this process's device list under
llama.cpp's names (RPC0, RPC1, ... in the order the servers were given), and from there they are
devices like any GPU: `--device`, the device tier, the load plan.
"""
from __future__ import annotations

import os
import socket

from pyedgemoe import _native
from pyedgemoe.errors import InvalidOptionError, RemoteDeviceError
from pyedgemoe.listen import bind_socket

DEFAULT_PORT = 50052  # llama.cpp's rpc-server's
DEFAULT_HOST = "127.0.0.1"
CONNECT_TIMEOUT_S = 5.0
# a worker silent this long fails the call (RemoteDeviceError): longer than any one graph a worker
# computes for a decode or a prefill ubatch
DEFAULT_TIMEOUT_S = 120


def parse_servers(text: str) -> list[tuple[str, int]]:
    """"host:port[,host:port...]" (llama.cpp's --rpc) -> [(host, port)]."""
    servers = []
    for item in (s.strip() for s in text.split(",")):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidOptionError(f"--rpc: {item!r} is not HOST:PORT (e.g. 192.168.1.7:{DEFAULT_PORT})")
        servers.append((host.strip("[]"), int(port)))
    return servers


def connect(text: str, timeout_s: int = DEFAULT_TIMEOUT_S) -> list[str]:
    """Reaches every server of `text` (parse_servers) and registers its devices; their names, in order.
    A server that is not there, or not an rpc-server of this version, is a RemoteDeviceError naming
    it. Later, a worker lost or silent for timeout_s seconds fails the call that waits on it
    with a RemoteDeviceError (native patch 0006)."""
    os.environ["GGML_RPC_TIMEOUT_S"] = str(int(timeout_s))  # read by each new connection
    names = []
    for host, port in parse_servers(text):
        endpoint = f"{host}:{port}"
        try:  # ggml's own connect has no timeout: an address nothing answers would take minutes
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:
            raise RemoteDeviceError(f"RPC server {endpoint}: cannot connect ({e.strerror or e})") from None
        try:
            names += _native.rpc_add_server(endpoint)
        except ValueError as e:
            raise RemoteDeviceError(str(e)) from None
    return names


def serve(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, threads: int = 1, cache_dir: str = "") -> None:
    """Serve this machine's CPU at host:port until stopped (llama.cpp's rpc-server)."""
    if not 0 < port < 65536:
        raise InvalidOptionError(f"--port {port}: not a TCP port")
    try:  # its reason, before llama.cpp's server starts (which says only that it stopped)
        bind_socket(host, port).close()
    except OSError as e:
        raise InvalidOptionError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    _native.rpc_serve(f"{host}:{port}", cache_dir, threads)
