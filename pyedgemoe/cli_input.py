"""A turn's input at the terminal, as llama.cpp's console reads it (common/console.cpp's readline),
for `run --chat` and `run -i`."""
from __future__ import annotations

import sys


def read_input(multiline: bool) -> str | None:
    """One line; with multiline (-mli), lines until one ends in '\\'. Otherwise a line ending in
    '\\' goes on to the next; one ending in '/' ends the input there (its newline left out). The
    text without its last newline; None at EOF with nothing read."""
    text = ""
    while True:
        line = sys.stdin.readline()
        if not line:
            return text.removesuffix("\n") or None
        line = line.removesuffix("\n")
        if line.endswith("/"):
            return text + line[:-1]
        more = multiline != line.endswith("\\")
        text += line.removesuffix("\\") + "\n"
        if not more:
            return text.removesuffix("\n")
