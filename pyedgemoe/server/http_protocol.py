"""uvicorn's HTTP/1.1 protocol (h11) with deadlines on what a client owes the server.

- The head: uvicorn closes a connection left idle after a response (timeout_keep_alive), but not one
  that was never sent a request, nor one whose request's head trickles in a byte at a time: each byte
  starts the wait anew. A few hundred such sockets (slowloris) hold the server. Here the head must
  be whole within timeout_seconds of the connection opening or of the last response ending, else
  the connection is closed. The body's own deadline is JSONBody's (request_guards.py).
- The reading of answers: a client that stops reading fills the socket's buffers, and the answer
  (a stream's next piece too) waited to be written for ever, its connection held (a few dozen such
  clients took every connection). Writing paused for timeout_seconds without the client taking
  any of it closes the connection.
- A connection past the server's limit (uvicorn's limit_concurrency answers its requests 503) has
  LINGER_SECONDS for each request's head, not timeout_seconds: held idle, such sockets took the
  process's file descriptors.

A request refused before its body was read (413: its Content-Length too large) leaves the body
coming: uvicorn discards it, for LINGER_SECONDS at most, then the connection is closed. Closing at
once would reset the connection under the client's feet (unread data), and a client that sends
its body before reading the answer might never see the 413.

A request h11 cannot parse (a negative Content-Length, a header line without a colon, no Host) is
answered 400 in OpenAI's error shape, as every other error, not with uvicorn's plain text.
"""
from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pyedgemoe.server.openai_errors import APIError

LINGER_SECONDS = 2.0


class DeadlineProtocol(H11Protocol):
    def __init__(self, *args, timeout_seconds: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_seconds = timeout_seconds
        self._head_seconds = timeout_seconds  # LINGER_SECONDS past the connection limit
        self._head_deadline: asyncio.TimerHandle | None = None
        self._write_deadline: asyncio.TimerHandle | None = None

    def _await_head(self, seconds: float) -> None:
        self._stop_waiting()
        self._head_deadline = self.loop.call_later(seconds, self._late)

    def _stop_waiting(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _late(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def _write_late(self) -> None:
        self._write_deadline = None
        self.transport.abort()  # what waits in the buffers is never read: dropped

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
            self._head_seconds = min(LINGER_SECONDS, self.timeout_seconds)
        self._await_head(self._head_seconds)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's head arrived
            self._stop_waiting()

    def on_response_complete(self) -> None:
        # before the next request (a pipelined one may start at once)
        unread_body = self.conn.their_state is h11.SEND_BODY
        self._await_head(min(LINGER_SECONDS, self._head_seconds) if unread_body else self._head_seconds)
        super().on_response_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._stop_write_wait()
        self._write_deadline = self.loop.call_later(self.timeout_seconds, self._write_late)

    def resume_writing(self) -> None:
        self._stop_write_wait()
        super().resume_writing()

    def _stop_write_wait(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def send_400_response(self, msg: str) -> None:
        body = APIError(400, "the request is not valid HTTP/1.1 (its request line or headers)",
                        "invalid_http").response().body
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def connection_lost(self, exc) -> None:
        self._stop_waiting()
        self._stop_write_wait()
        super().connection_lost(exc)
