"""llama.cpp's escape sequences in text given on the command line (its `-e`, on by default but in
llama-perplexity): in a prompt (`-p`, `-f`), a reverse prompt (`-r`) and the text llama-perplexity
scores (`-f`, with `-e`), `\\n` is a line break, as llama.cpp's tools read them."""
from __future__ import annotations

import re

import typer

from pyedgemoe.text_stream import LLAMA_BYTES, utf8

# llama.cpp's string_process_escapes: \n \r \t \' \" \\ and \xHH (a byte); any other \ is kept as is
_ESCAPE = re.compile(rb"\\(?:([nrt'\"\\])|x([0-9A-Fa-f]{2}))")
_SIMPLE = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"'": b"'", b'"': b'"', b"\\": b"\\"}


def process_escapes(text: str) -> str:
    """text with llama.cpp's escape sequences replaced; bytes given by \\xHH that are not UTF-8 become
    U+FFFD as llama.cpp reads them (LLAMA_BYTES)."""
    return text_of(utf8(text), escape=True)


def read_text_file(path, escape: bool) -> str:
    """A text file as llama.cpp's -f reads it: one trailing line break dropped, then (escape) its
    escapes processed; bytes that are not UTF-8 become U+FFFD as llama.cpp reads them (LLAMA_BYTES).
    OSError where it cannot be read."""
    with open(path, "rb") as f:
        return text_of(f.read().removesuffix(b"\n"), escape)


def text_of(raw: bytes, escape: bool) -> str:
    """Bytes read as text, (escape) their escapes processed; bytes that are not UTF-8 a U+FFFD as
    llama.cpp reads them (LLAMA_BYTES)."""
    if escape:
        raw = _ESCAPE.sub(lambda m: _SIMPLE[m[1]] if m[1] else bytes([int(m[2], 16)]), raw)
    return raw.decode("utf-8", errors=LLAMA_BYTES)


def escape_option(where: str, default: bool = True):
    """The -e/--escape/--no-escape flag of a command, processing the escapes of `where` ("-p, -f and -r");
    default: the llama.cpp tool's (llama-perplexity's is off)."""
    return typer.Option(default, "--escape/--no-escape", "-e",
                        help=rf"process escapes (\n, \r, \t, \', \", \\, \xHH) in {where}, as llama.cpp's "
                        f"tool does {'by default' if default else 'with -e'}")
