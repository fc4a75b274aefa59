"""Native calls in flight while the interpreter exits.

A decode, a tokenization, a sampler's pick release the GIL while llama.cpp works. Where the program
ends while another (a daemon) thread is in such a call, Python's finalization makes that thread exit
as it takes the GIL back; it leaves through the native module's C++ frames, where the unwinding ends
in std::terminate (the process exited 1 with "llama.cpp stopped on an internal check ..."), and a call
that runs on while the process tears down what it reads may segfault. So at exit (atexit, which runs
before finalization) the Engines still open are closed (their batchers' threads ended); then the
native calls in flight finish, and a thread that comes back from one, or would begin one, waits there
for the process's end (native gil_released), one waiting for the GIL just then first taking it.

What a daemon thread still using a closed Engine meets then (ProgramExiting) ends it silently, as the
process's end ends daemon threads (stock llama-cpp-python's among them), not with a traceback.

fork() copies the calling thread only: an Engine's threads (OpenMP's team, which libgomp does not
remake in a child: its next parallel region waits for ever; an expert cache's reads, fill and prefetch;
n_parallel > 1's batcher) and a GPU's driver state stay in the parent. In the child, freeing an Engine
would join threads that are not there, for ever: so the Engines open at the fork are never closed in the
child (their memory goes with its end), and their computations raise ForkedEngineError there
(Decoder.live); their vocabulary (tokenize, detokenize, metadata) works, as it runs no thread."""
from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
import weakref
from typing import Callable

from pyedgemoe import _native
from pyedgemoe.errors import EngineClosedError

EXIT_WAIT_S = 60.0  # the longest the exit waits for the native calls in flight (a long prompt's batch)
GIL_HANDOVER_S = 0.05  # the GIL left to threads waiting for it, before finalization

_exiting = False
_open: dict[weakref.finalize, Callable[[], object]] = {}  # the closers of the Engines open, each with in_forked_child
_left_open: list = []  # a forked child's: the Engines open at the fork, with what their closers would free


class ProgramExiting(EngineClosedError):
    """A thread's use of an Engine after the program's exit began (only daemon threads run then)."""


def closed_error(what: str) -> EngineClosedError:
    """The error for a use of something closed ("this Engine is closed"); ProgramExiting once the
    exit began (the exit closes the Engines left open)."""
    return ProgramExiting(f"the program is exiting: {what}") if _exiting else EngineClosedError(what)


def close_at_exit(obj, close: Callable, *args, in_forked_child: Callable[[], object] = lambda: None) -> weakref.finalize:
    """weakref.finalize(obj, close, *args), called at exit by _finish_in_flight, where the exit has
    begun (closed_error) and before the native calls' wait, which would stop a batcher's thread it
    joins (not by weakref's own exit hook, which may come first); in a forked child, never called, and
    in_forked_child() called there instead."""
    def closing():
        _open.pop(closer, None)
        close(*args)
    closer = weakref.finalize(obj, closing)
    closer.atexit = False
    _open[closer] = in_forked_child
    return closer


@atexit.register
def _finish_in_flight() -> None:
    global _exiting
    _quiet_when_exiting()
    _exiting = True
    for closer in list(_open):
        closer()
    # from now on a thread coming back from llama.cpp, or going there, waits for the end (native
    # gil_released) once the calls in flight ended; one already waiting for the GIL takes it now,
    # before finalization would end it in native frames
    _native.exiting_threads_wait(EXIT_WAIT_S)
    time.sleep(GIL_HANDOVER_S)


def _keep_open_in_child() -> None:
    for closer, in_forked_child in _open.items():
        _left_open.append(closer.detach())
        in_forked_child()
    _open.clear()
    # a reference of its own, never given back: the interpreter's end frees what its modules hold, and freeing
    # these (their native destructors) segfaulted the child
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_left_open))


os.register_at_fork(after_in_child=_keep_open_in_child)


def _quiet_when_exiting() -> None:
    """threading.excepthook, silent for a thread ended by ProgramExiting."""
    previous = threading.excepthook

    def hook(args) -> None:
        if not isinstance(args.exc_value, ProgramExiting):
            previous(args)
    threading.excepthook = hook
