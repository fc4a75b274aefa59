"""Turning a stream of token bytes into text pieces, honouring stop strings.

A token can end in the middle of a UTF-8 character, and a stop string can span tokens:
text is held back until it can no longer turn into a stop string.
"""
from __future__ import annotations

import codecs

from pyedgemoe.errors import InvalidOptionError


def utf8(text: str | bytes) -> bytes:
    """text as UTF-8 (bytes: as they are; the bytes Python read from the command line or a file
    name, U+DC80-U+DCFF, as they were); InvalidOptionError where it cannot be (another lone
    surrogate, which JSON's and Python's escapes can write, or no text at all)."""
    if isinstance(text, bytes):
        return text
    if not isinstance(text, str):
        raise InvalidOptionError(f"text must be a string (or UTF-8 bytes), got {text!r}"[:200])
    try:
        return text.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError as e:
        raise InvalidOptionError(f"the text cannot be UTF-8: {e.reason} at character {e.start}") from None


class TextStream:
    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        # bytes that are not UTF-8 (a character cut by the end) are dropped, as llama-cpp-python does
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self._pending = ""
        self.stopped = False  # a stop string was met; nothing after it is emitted

    def push(self, piece: bytes) -> str:
        """Adds a token's bytes; returns the text that is now safe to emit."""
        self._pending += self._decoder.decode(piece)
        for s in self.stop:
            at = self._pending.find(s)
            if at >= 0:
                out, self._pending, self.stopped = self._pending[:at], "", True
                return out
        keep = self._longest_stop_prefix_suffix()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """The held-back text, at the end of generation."""
        if self.stopped:
            return ""
        out = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        return out

    def _longest_stop_prefix_suffix(self) -> int:
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self._pending)), 0, -1):
                if self._pending.endswith(s[:n]):
                    best = max(best, n)
                    break
        return best
