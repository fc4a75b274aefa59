"""llama-server's slot files (`--slot-save-path PATH`; POST /slots/N?action=save|restore|erase): a
sequence of the KV cache (a slot) kept in a file and read back, so that a long prompt evaluated
once (a system prompt, a document) is not evaluated again after a restart, or is shared between
servers of the same model and context settings. The file is llama.cpp's sequence state file
(llama_state_seq_save_file: the tokens, then the sequence's KV cache), the one llama-server writes:
either reads the other's. A slot restored holds those tokens; the next request whose prompt begins
with them evaluates only the rest (on that sequence, which the server picks for the longest shared
prefix). Erasing empties it. The expert cache is the run's own: lossless."""
from __future__ import annotations

import os
import time
import unicodedata

from pyedgemoe.errors import InvalidOptionError

MAX_FILENAME_BYTES = 255  # a file name's limit on common file systems (llama.cpp's fs_validate_filename)


def checked_filename(name) -> str:
    """name, a plain file's name in the slot directory (no path, no '..', no control characters),
    as llama.cpp's fs_validate_filename takes it; InvalidOptionError naming what is wrong."""
    if not isinstance(name, str) or not name or len(name.encode("utf-8", "surrogatepass")) > MAX_FILENAME_BYTES:
        raise InvalidOptionError(f"filename must be a file's name of 1 to {MAX_FILENAME_BYTES} bytes, got {name!r}"[:200])
    if any(c in name for c in '/\\:') or name in (".", "..") or name.startswith(".") or name != name.strip() or \
            any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn") for c in name):
        raise InvalidOptionError(f"filename must be a plain file's name (no path, no leading dot, no control "
                                 f"characters), got {name!r}"[:200])
    return name


def save(engine, seq: int, directory: str, filename: str) -> dict:
    """Sequence seq's tokens and KV cache into directory/filename; llama-server's answer."""
    path = os.path.join(directory, checked_filename(filename))

    def write(sequence) -> tuple[int, int, float]:
        start = time.perf_counter()  # the write's time, as llama-server's: not the wait for a busy slot
        try:
            return len(sequence.tokens), engine._decoder.save_sequence_file(path, sequence), time.perf_counter() - start
        except RuntimeError as e:  # a directory of that name, the slot directory gone
            raise _file_error(e, path, filename) from None
    n_tokens, written, seconds = engine.on_sequence(seq, write)
    return {"id_slot": seq, "filename": filename, "n_saved": n_tokens, "n_written": written,
            "timings": {"save_ms": seconds * 1000}}


def restore(engine, seq: int, directory: str, filename: str) -> dict:
    """Sequence seq holds what directory/filename holds; llama-server's answer."""
    path = os.path.join(directory, checked_filename(filename))
    if not os.path.isfile(path):
        raise InvalidOptionError(f"no slot file {filename!r} in the slot directory")

    def load(sequence) -> tuple[int, int, float]:
        start = time.perf_counter()
        try:
            read = engine._decoder.load_sequence_file(path, sequence)
        except RuntimeError as e:
            raise _file_error(e, path, filename) from None
        return len(sequence.tokens), read, time.perf_counter() - start
    n_tokens, read, seconds = engine.on_sequence(seq, load)
    return {"id_slot": seq, "filename": filename, "n_restored": n_tokens, "n_read": read,
            "timings": {"restore_ms": seconds * 1000}}


def _file_error(e: RuntimeError, path: str, filename: str) -> InvalidOptionError:
    """llama.cpp's words why a slot file cannot be written or read, the file named as the request names it."""
    return InvalidOptionError(f"slot file {filename!r}: {str(e).splitlines()[0].replace(path, filename)}")


def erase(engine, seq: int) -> dict:
    """Sequence seq holds nothing; llama-server's answer."""
    def clear(sequence) -> int:
        n = len(sequence.tokens)
        engine._decoder.keep(sequence, 0)
        return n
    return {"id_slot": seq, "n_erased": engine.on_sequence(seq, clear)}
