"""llama.cpp's escape sequences in text given on the command line (its `-e`, on by default): in a
prompt (`-p`, `-f`), a reverse prompt (`-r`) and the text llama-perplexity scores (`-f`), `\\n` is a
line break, as llama.cpp's tools read them."""
from __future__ import annotations

import re

import typer

from pyedgemoe.text_stream import utf8

# llama.cpp's string_process_escapes: \n \r \t \' \" \\ and \xHH (a byte); any other \ is kept as is
_ESCAPE = re.compile(rb"\\(?:([nrt'\"\\])|x([0-9A-Fa-f]{2}))")
_SIMPLE = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"'": b"'", b'"': b'"', b"\\": b"\\"}


def process_escapes(text: str) -> str:
    """text with llama.cpp's escape sequences replaced; bytes given by \\xHH that are not UTF-8 become
    U+FFFD."""
    raw = _ESCAPE.sub(lambda m: _SIMPLE[m[1]] if m[1] else bytes([int(m[2], 16)]), utf8(text))
    return raw.decode("utf-8", errors="replace")


def read_text_file(path, escape: bool) -> str:
    """A text file as llama.cpp's -f reads it: one trailing line break dropped, then (escape) its
    escapes processed; bytes that are not UTF-8 become U+FFFD. OSError where it cannot be read."""
    with open(path, "rb") as f:
        raw = f.read()
    text = raw.removesuffix(b"\n").decode("utf-8", errors="replace")
    return process_escapes(text) if escape else text


def escape_option(where: str):
    """The -e/--escape/--no-escape flag of a command, processing the escapes of `where` ("-p, -f and -r")."""
    return typer.Option(True, "--escape/--no-escape", "-e",
                        help=rf"process escapes (\n, \r, \t, \', \", \\, \xHH) in {where}, as llama.cpp does by default")
