"""The socket a server listens on, bound before the slow part of its start (a model's load): a
port in use or a host that is not this machine's fails at once (pyedgemoe serve, rpc-server)."""
from __future__ import annotations

import socket


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one); raises OSError."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock
