"""Running the server: the listening socket, then uvicorn over it until SIGINT/SIGTERM.

The socket is bound before the model loads (a port in use fails at once, not after a long load)
and listens only once the model is loaded (until then connections are refused, not queued)."""
from __future__ import annotations

import contextlib
import functools
import socket
import sys
from collections.abc import Mapping
from types import MappingProxyType

import uvicorn

from pyedgemoe.completions import chat_text
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.server.app import create_app
from pyedgemoe.server.http_protocol import DeadlineProtocol
from pyedgemoe.server.limits import MAX_HEAD_BYTES, Limits


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _check_chat_template(engine, chat_defaults: Mapping) -> None:
    """InvalidOptionError where the chat template cannot render a user's message alone, with the
    server's chat defaults: refused at start, as llama-server refuses a template its example fails
    on (common_chat_format_example), rather than with every chat."""
    try:
        chat_text(engine, [{"role": "user", "content": "test"}],
                  template_kwargs=chat_defaults.get("chat_template_kwargs"),
                  reasoning_format=chat_defaults.get("reasoning_format"))
    except InvalidOptionError as e:
        raise InvalidOptionError(f"{e} (a user's message alone, tried at start)") from None


class _Server(uvicorn.Server):
    """uvicorn's server, which on SIGINT/SIGTERM first ends the generations in flight (their
    clients get an error) rather than wait for them and cancel them after the graceful timeout."""

    def __init__(self, config: uvicorn.Config, engine_queue) -> None:
        super().__init__(config)
        self.engine_queue = engine_queue

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            # stopped as asked, the process exits 0, as llama-server's does; uvicorn would raise the signal again
            self._captured_signals.clear()

    async def shutdown(self, sockets=None) -> None:
        self.engine_queue.stop()
        await super().shutdown(sockets=sockets)


def serve(engine, sock: socket.socket, *, model_id: str, model_aliases: tuple[str, ...] = (),
          api_keys: tuple[str, ...] = (), limits: Limits = Limits(), allowed_hosts: tuple[str, ...] = (),
          chat_defaults: Mapping = MappingProxyType({}), request_defaults: Mapping = MappingProxyType({}),
          embeddings: bool = False, spm_infill: bool = False, web_pages: bool = True, log_level: str = "info",
          slot_directory: str | None = None) -> None:
    """Serves engine on sock until the process is told to stop."""
    _check_chat_template(engine, chat_defaults)
    app = create_app(engine, model_id=model_id, model_aliases=model_aliases, api_keys=api_keys, limits=limits,
                     allowed_hosts=allowed_hosts, chat_defaults=chat_defaults, request_defaults=request_defaults,
                     embeddings=embeddings, spm_infill=spm_infill, web_pages=web_pages, slot_directory=slot_directory)
    config = uvicorn.Config(
        app, log_level=log_level, timeout_graceful_shutdown=5, lifespan="off", ws="none",
        # HTTP/1.1 by h11 (not httptools, were it installed): the protocol whose limits are set here
        http=functools.partial(DeadlineProtocol, timeout_seconds=limits.timeout_seconds),
        h11_max_incomplete_event_size=MAX_HEAD_BYTES, limit_concurrency=limits.max_connections,
        timeout_keep_alive=min(5, limits.timeout_seconds),
        # the access log names the peer: X-Forwarded-For is anyone's to write, a local client's too
        proxy_headers=False, server_header=False)
    sock.listen(config.backlog)
    print(f"pyedgemoe: serving {model_id} on {url_of(sock)} (OpenAI API under /v1)", file=sys.stderr, flush=True)
    try:
        _Server(config, app.state.engine_queue).run(sockets=[sock])
    finally:
        app.state.engine_queue.close()
