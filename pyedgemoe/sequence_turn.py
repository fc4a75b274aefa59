"""The turn at an Engine's one sequence (n_parallel=1): one generation or evaluation holds it at a time,
from its first token to its end; a call of another waits for it.

A stream is not tied to a thread: a web framework or asyncio.to_thread runs each next() on whichever
thread of its pool is free, and a thread that advanced one stream may start another while the first is
still being read. So a thread that wants the turn while a generation it advanced last holds it waits too,
as long as someone advances that generation: only one left as it is for OWN_STREAM_WAIT_S, which
nothing but this thread could advance (a stream it left open, neither finished nor closed), makes it
raise EngineBusyError, where waiting would be for ever. A stream dropped without being closed (a web
framework's, its client gone: Starlette leaves the iterator in a reference cycle for the collector)
holds the turn until it is collected: a wait that sees the holder unread for COLLECT_AFTER_S runs the
collector once."""
from __future__ import annotations

import gc
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from pyedgemoe.errors import EngineBusyError

COLLECT_AFTER_S = 0.5  # how long the holder may sit unread before the waiting thread runs Python's collector
OWN_STREAM_WAIT_S = 2.0  # how long a stream this thread advanced last may sit unread before its wait is an error
WAIT_STEP_S = 0.01  # while_waiting's period


class SequenceTurn:
    def __init__(self):
        self._lock = threading.Lock()
        self._last_advanced_by: int | None = None  # the thread that last advanced the holder (None: free)
        self._advances = 0  # the holder's steps, counted to see it move

    @contextmanager
    def held(self, while_waiting: Callable[[], object]):
        """The turn, for the with-block; while_waiting() runs every WAIT_STEP_S while another holds it."""
        me = threading.get_ident()
        seen = since = collected = None
        while not self._lock.acquire(timeout=WAIT_STEP_S):
            while_waiting()
            if seen != (self._advances, self._last_advanced_by):  # the holder moved (or another holds it)
                seen, since, collected = (self._advances, self._last_advanced_by), time.monotonic(), False
            elif not collected and time.monotonic() - since > COLLECT_AFTER_S:
                collected = True
                gc.collect()  # a stream dropped unclosed in a reference cycle ends (its turn free) when collected
            elif seen[1] == me and time.monotonic() - since > OWN_STREAM_WAIT_S:
                raise EngineBusyError("a generation of this Engine this thread advanced is still open and no other "
                                      "thread takes it on: take it to its end or close() it before starting another "
                                      "(or use n_parallel > 1)")
        self.advanced()
        try:
            yield
        finally:
            self._last_advanced_by = None
            self._lock.release()

    def holding(self, steps: Iterator, while_waiting: Callable[[], object]) -> Iterator:
        """steps' items (a generation's), the turn held from the first to the end (or close) of steps."""
        with self.held(while_waiting):
            try:
                for item in steps:
                    yield item
                    self.advanced()
            finally:
                steps.close()  # its own end (a KV cache's rewind) before the turn is free

    def advanced(self) -> None:
        """The holder takes a step, on this thread."""
        self._last_advanced_by = threading.get_ident()
        self._advances += 1
