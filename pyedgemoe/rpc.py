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
import time

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
        if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            raise InvalidOptionError(f"--rpc: {item!r} is not HOST:PORT (e.g. 192.168.1.7:{DEFAULT_PORT})")
        if ":" in host:  # ggml's client splits an endpoint at its first colon
            raise InvalidOptionError(f"--rpc: {item!r}: llama.cpp's RPC client takes no IPv6 address; give an "
                                     "IPv4 address or a host name")
        servers.append((host, int(port)))
    return servers


def connect(text: str) -> list[str]:
    """Reaches every server of `text` (parse_servers) and registers its devices; their names, in order.
    A server that is not there, or not an rpc-server of this version, is a RemoteDeviceError naming
    it. Later, a worker lost or silent for GGML_RPC_TIMEOUT_S seconds (the environment's, else
    DEFAULT_TIMEOUT_S) fails the call that waits on it with a RemoteDeviceError (native patch 0006)."""
    timeout_s = os.environ.setdefault("GGML_RPC_TIMEOUT_S", str(DEFAULT_TIMEOUT_S))  # read by each new connection
    if not (timeout_s.isascii() and timeout_s.isdigit() and int(timeout_s) > 0):
        raise InvalidOptionError(f"GGML_RPC_TIMEOUT_S must be a number of seconds, got {timeout_s!r}")
    names = []
    for host, port in parse_servers(text):
        endpoint = f"{host}:{port}"
        try:  # ggml's own connect has no timeout: an address nothing answers would take minutes
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:
            raise RemoteDeviceError(f"RPC server {endpoint}: cannot connect ({e.strerror or e})") from None
        start = time.monotonic()
        try:
            names += _native.rpc_add_server(endpoint)
        except (ValueError, RemoteDeviceError) as e:  # no devices; no handshake (native patch 0006)
            # it took the connection, and never answered (the socket's timeout can end a little early)
            if time.monotonic() - start >= 0.9 * int(timeout_s):
                raise RemoteDeviceError(f"RPC server {endpoint}: no answer in {timeout_s} s: a worker serves one "
                                        "client at a time (is another one using it?)") from None
            raise RemoteDeviceError(str(e)) from None
    return names


def serve(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, threads: int = 1, cache_dir: str = "") -> None:
    """Serve this machine's CPU at host:port until stopped (llama.cpp's rpc-server; a host name is
    taken as its IPv4 address, which is all llama.cpp's server reads)."""
    if not 0 < port < 65536:
        raise InvalidOptionError(f"--port {port}: not a TCP port")
    host = ipv4_address(host)
    try:  # its reason, before llama.cpp's server starts (which says only that it stopped)
        bind_socket(host, port).close()
    except OSError as e:
        raise InvalidOptionError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    _native.rpc_serve(f"{host}:{port}", cache_dir, threads)


def ipv4_address(host: str) -> str:
    """host as the dotted IPv4 address llama.cpp's rpc-server listens on (it reads no other form: a
    name or an IPv6 address failed after its banner, as if the port were in use)."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except (OSError, UnicodeError) as e:
        raise InvalidOptionError(f"--host {host}: no IPv4 address ({getattr(e, 'strerror', None) or e}); "
                                 "llama.cpp's rpc-server listens on IPv4 only") from None
