"""Files a command writes beside what it reads (a calibration's sidecar and trace, a KL-divergence
base, a benchmark's report): checked before the run, so that a wrong path fails at once and never
overwrites an input, and written whole, so that no reader (nor the next run) finds half a file, also
when SIGTERM or SIGHUP ends the command (terminate_cleanly).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import IO, Callable, Iterator

from pyedgemoe.errors import InvalidOptionError

TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # ended by them, a command cleans up as on Ctrl-C


def check_output(path: str | os.PathLike, what: str, inputs: list[str | os.PathLike]) -> None:
    """InvalidOptionError where the `what` file at path would overwrite one of inputs (through a
    link too), or cannot be written there (a directory is there or named, with a trailing /; its folder
    is none or not writable)."""
    path = os.fspath(path)
    if os.path.realpath(path) in {os.path.realpath(p) for p in inputs}:
        raise InvalidOptionError(f"the {what} {path} is one of the command's inputs: give another file")
    folder = os.path.dirname(os.path.abspath(path))
    why = ("a directory is there" if os.path.isdir(path)
           else "that names a directory, not a file" if path.endswith(os.sep)
           else f"{folder} is not a directory" if not os.path.isdir(folder)
           else f"{folder} is not writable" if not os.access(folder, os.W_OK | os.X_OK) else None)
    if why:
        raise InvalidOptionError(f"cannot write the {what} {path}: {why}")


@contextlib.contextmanager
def whole_file(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """A binary file that becomes path when the block ends without an error: a temporary file of its
    own beside it until then (two writers do not write into one), removed on any error or Ctrl-C."""
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with terminate_cleanly(), open(tmp, "wb") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_whole(path: str | os.PathLike, write: Callable[[IO[bytes]], object]) -> str:
    """path, written by write(its file, binary) through whole_file."""
    with whole_file(path) as f:
        write(f)
    return os.fspath(path)


@contextlib.contextmanager
def terminate_cleanly() -> Iterator[None]:
    """SIGTERM (timeout, docker stop) or SIGHUP (the terminal closed, an ssh session dropped) in the
    block raises SystemExit(128 + the signal), the status a shell gives a process the signal ends, so
    that the writers' cleanup removes their temp file as on Ctrl-C. Only where the signal would end
    the process (the default action, in the main thread): a handler of the embedding program's own,
    or an ignored signal (nohup's SIGHUP), is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    taken = [s for s in TERMINATING_SIGNALS if signal.getsignal(s) is signal.SIG_DFL]

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    for s in taken:
        signal.signal(s, terminate)
    try:
        yield
    finally:
        for s in taken:
            signal.signal(s, signal.SIG_DFL)
