"""One process at a time on a file: `with exclusive_lock(Path("m.gguf.lock")): ...` waits while
another process (or thread) holds the lock, and removes the lock file on leaving."""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


@contextlib.contextmanager
def exclusive_lock(lock_file: Path):
    while True:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        # the holder before us may have removed the file we waited on: lock the one at the path now
        with contextlib.suppress(FileNotFoundError):  # gone: try again with a file of our own
            if os.stat(lock_file).st_ino == os.fstat(fd).st_ino:
                break
        os.close(fd)
    try:
        yield
    finally:
        os.unlink(lock_file)  # while still holding it, so a waiter sees the file is gone
        os.close(fd)
