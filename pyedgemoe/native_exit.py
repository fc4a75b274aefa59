"""Native calls in flight while the interpreter exits.

A decode releases the GIL while llama.cpp computes. Where the program ends while another (a daemon)
thread decodes, Python's finalization makes that thread exit as it takes the GIL back; it leaves
through the native module's C++ frames, where the unwinding ends in std::terminate (the process
exited 1 with "llama.cpp stopped on an internal check ..."). So at exit (atexit, which runs before
finalization) the calls in flight finish first, and one begun after that raises instead; then the
Engines still open are closed (their batchers' threads ended); then every other native call (a
sampler's pick, a tokenization: any that releases the GIL) in flight finishes, and a thread that comes
back from one, or begins one, waits there for the process's end (native gil_released), one waiting
for the GIL just then first taking it.

What the exit raises in the daemon threads still using an Engine (ProgramExiting) ends them silently, as
the process's end ends daemon threads (stock llama-cpp-python's among them), not with a traceback."""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Callable

from pyedgemoe import _native

EXIT_WAIT_S = 60.0  # the longest the exit waits for the decodes, then the other native calls, in flight
GIL_HANDOVER_S = 0.05  # the GIL left to threads waiting for it, before finalization

_state = threading.Condition()
_in_flight = 0
_exiting = False
_open: set[weakref.finalize] = set()  # the closers of the Engines open (close_at_exit)


class ProgramExiting(RuntimeError):
    """A thread's use of an Engine after the program's exit began (only daemon threads run then)."""


def closed_error(what: str) -> RuntimeError:
    """The error for a use of something closed ("this Engine is closed"); ProgramExiting once the
    exit began (the exit closes the Engines left open)."""
    return ProgramExiting(f"the program is exiting: {what}") if _exiting else RuntimeError(what)


def close_at_exit(obj, close: Callable, *args) -> weakref.finalize:
    """weakref.finalize(obj, close, *args), called at exit by _finish_in_flight, once the decodes in
    flight finished (weakref's own exit hook may run before it)."""
    def closing():
        _open.discard(closer)
        close(*args)
    closer = weakref.finalize(obj, closing)
    closer.atexit = False
    _open.add(closer)
    return closer


def in_flight(call: Callable) -> Callable:
    """call, counted while it runs; begun once the exit began, a ProgramExiting."""
    def counted(*args, **kwargs):
        global _in_flight
        with _state:
            if _exiting:
                raise ProgramExiting("the program is exiting: no more decodes")
            _in_flight += 1
        try:
            return call(*args, **kwargs)
        finally:
            with _state:
                _in_flight -= 1
                _state.notify_all()
    return counted


@atexit.register
def _finish_in_flight() -> None:
    global _exiting
    _quiet_when_exiting()
    with _state:
        _exiting = True
        _state.wait_for(lambda: _in_flight == 0, timeout=EXIT_WAIT_S)
    for closer in list(_open):
        closer()
    # from now on a thread coming back from llama.cpp, or going there, waits for the end (native
    # gil_released) once the calls in flight ended; one already waiting for the GIL takes it now,
    # before finalization would end it in native frames
    _native.exiting_threads_wait(EXIT_WAIT_S)
    time.sleep(GIL_HANDOVER_S)


def _quiet_when_exiting() -> None:
    """threading.excepthook, silent for a thread ended by ProgramExiting."""
    previous = threading.excepthook

    def hook(args) -> None:
        if not isinstance(args.exc_value, ProgramExiting):
            previous(args)
    threading.excepthook = hook
