"""llama.cpp's escape sequences in text given on the command line (its `-e`, on by default): in a
prompt (`-p`, `-f`) and a reverse prompt (`-r`), `\\n` is a line break, as llama-cli reads it."""
from __future__ import annotations

import re

# llama.cpp's string_process_escapes: \n \r \t \' \" \\ and \xHH (a byte); any other \ is kept as is
_ESCAPE = re.compile(rb"\\(?:([nrt'\"\\])|x([0-9A-Fa-f]{2}))")
_SIMPLE = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"'": b"'", b'"': b'"', b"\\": b"\\"}


def process_escapes(text: str) -> str:
    """text with llama.cpp's escape sequences replaced; bytes given by \\xHH that are not UTF-8 become
    U+FFFD."""
    raw = _ESCAPE.sub(lambda m: _SIMPLE[m[1]] if m[1] else bytes([int(m[2], 16)]), text.encode("utf-8"))
    return raw.decode("utf-8", errors="replace")
