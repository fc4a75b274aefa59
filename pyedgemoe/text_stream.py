"""Turning a stream of token bytes into text pieces, one a token, honouring stop strings.

A token can end in the middle of a UTF-8 character, and a stop string can span tokens:
tokens are held back until their text can no longer turn into a stop string.
"""
from __future__ import annotations

import codecs

from pyedgemoe.errors import InvalidOptionError

# bytes that are not UTF-8 in text of the command line, as llama.cpp's BPE pre-tokenizer reads them
# (unicode_cpts_from_utf8): each byte that begins no whole character a U+FFFD. (Tokenizing takes bytes as
# they are, Vocabulary.tokenize: llama.cpp decodes overlong forms and surrogates itself.)
LLAMA_BYTES = "pyedgemoe-llama-bytes"
codecs.register_error(LLAMA_BYTES, lambda e: ("\ufffd", e.start + 1))


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
    """A generation's text, token by token: each token's text is the characters it completes ("" for
    one that ends inside a character, whose next token carries it whole); a token is held back, whole,
    while the text from it on can still begin a stop string, so that each piece given out is one
    token's text (llama-cpp-python streams a chunk per token the same way)."""

    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        # bytes that are not UTF-8 (a character cut by the end) are dropped, as llama-cpp-python does
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self._held: list[str] = []  # the texts of the tokens held back
        self.stopped = False  # a stop string was met; nothing from it on is given out

    def push(self, piece: bytes) -> list[str]:
        """Adds a token's bytes; returns the texts of the tokens now safe to give out, one each."""
        self._held.append(self._decoder.decode(piece))
        held = "".join(self._held)
        starts = [at for s in self.stop if (at := held.find(s)) >= 0]
        if starts:
            self.stopped = True
            return self._release(min(starts), cut=True)
        return self._release(len(held) - self._longest_stop_prefix_suffix(held), cut=False)

    def flush(self) -> list[str]:
        """The texts of the tokens held back, at the end of generation."""
        out, self._held = ([] if self.stopped else self._held), []
        return out

    def _release(self, end: int, cut: bool) -> list[str]:
        """The held tokens whose text ends by end (cut: also the one end falls in, cut there, unless
        that leaves nothing of it; the rest dropped)."""
        out, at = [], 0
        while self._held and at + len(self._held[0]) <= end:
            at += len(self._held[0])
            out.append(self._held.pop(0))
        if cut:
            if self._held and end > at:
                out.append(self._held[0][:end - at])
            self._held = []
        return out

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    best = max(best, n)
                    break
        return best
