"""`pyedgemoe tokenize`, llama.cpp's llama-tokenize: the vocabulary alone is loaded (no weights),
the tokens are stock llama.cpp's (through llama-cpp-python's vocab_only Llama, the same code), and
printed as llama-tokenize prints them: `%6d -> 'piece'` a line, or `--ids` a list."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "demo.gguf"
TEXT = "def fib(n):\n    return <|endoftext|> héllo ✓"


def tokenize(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyedgemoe", "tokenize", *args], capture_output=True, input=stdin,
                          timeout=120)


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    llama_cpp = pytest.importorskip("llama_cpp")
    from pyedgemoe.convert.export import export
    high = export(DEMO, tmp_path_factory.mktemp("stock") / "demo-high.gguf", precision="high", progress=False)
    llm = llama_cpp.Llama(model_path=str(high), vocab_only=True, verbose=False)
    yield llm
    llm.close()


@pytest.mark.parametrize("flags, add_bos, special", [([], True, True), (["--no-bos"], False, True),
                                                     (["--no-parse-special"], True, False)])
def test_the_ids_are_llama_cpps(stock, flags, add_bos, special):
    r = tokenize(str(DEMO), "-p", TEXT, "--ids", "--no-escape", *flags)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{stock.tokenize(TEXT.encode(), add_bos, special)}\n".encode()


def test_each_token_is_a_line_of_its_id_and_text_as_llama_tokenize_prints_it(stock):
    r = tokenize(str(DEMO), "-p", TEXT, "--no-escape", "--show-count")
    ids = stock.tokenize(TEXT.encode(), True, True)
    expected = b"".join(f"{t:6d} -> '".encode() + stock.detokenize([t], special=True) + b"'\n" for t in ids)
    assert r.returncode == 0 and r.stdout == expected + f"Total number of tokens: {len(ids)}\n".encode()


def test_the_text_from_a_file_or_stdin_whole_with_its_escapes(tmp_path):
    file = tmp_path / "text.txt"
    file.write_bytes(b"a\\tb\n")  # all of it, its last line break too, as llama-tokenize reads -f
    from_file = tokenize(str(DEMO), "-f", str(file), "--ids").stdout
    assert from_file == tokenize(str(DEMO), "-p", "a\tb\n", "--ids", "--no-escape").stdout
    assert tokenize(str(DEMO), "--stdin", "-p", "ignored", "--ids", stdin=b"a\\tb\n").stdout == from_file


@pytest.mark.parametrize("args, message", [([str(DEMO)], "give the text with -p TEXT, -f FILE or --stdin"),
                                           (["/nonexistent.gguf", "-p", "x"], "model file not found"),
                                           ([str(DEMO), "-f", "/nonexistent.txt"], "cannot read /nonexistent.txt: No such file")])
def test_bad_input_is_one_error_line(args, message):
    r = tokenize(*args)
    assert r.returncode == 1 and r.stderr.decode().startswith("error: ") and message in r.stderr.decode()
    assert len(r.stderr.decode().strip().splitlines()) == 1


def test_the_log_flags_are_taken_as_in_llama_tokenize():
    quiet = tokenize(str(DEMO), "-p", "hello", "--ids", "--log-disable")
    loud = tokenize(str(DEMO), "-p", "hello", "--ids", "-v")
    assert quiet.returncode == loud.returncode == 0 and quiet.stdout == loud.stdout == tokenize(str(DEMO), "-p", "hello",
                                                                                                "--ids").stdout
    assert quiet.stderr == b"" and b"llama_model_load: vocab only" in loud.stderr  # -v: llama.cpp's log


@pytest.mark.parametrize("command", [["tokenize"], ["run", "-n", "2", "-t", "1", "--temp", "0"], ["embed", "-t", "1"]])
def test_an_argument_of_bytes_that_are_not_utf8_is_read_as_a_file_of_them_is(tmp_path, command):
    # Python reads them as lone surrogates (U+DCFF), whose encoding was a traceback
    file = tmp_path / "text.txt"
    file.write_bytes(b"a\xffb")
    by_argument = subprocess.run([sys.executable, "-m", "pyedgemoe", command[0], str(DEMO), "-p", os.fsdecode(b"a\xffb"),
                                  *command[1:]], capture_output=True, timeout=300)
    by_file = subprocess.run([sys.executable, "-m", "pyedgemoe", command[0], str(DEMO), "-f", str(file), *command[1:]],
                             capture_output=True, timeout=300)
    assert by_argument.returncode == 0 and b"Traceback" not in by_argument.stderr, by_argument.stderr
    assert by_argument.stdout == by_file.stdout


def test_a_file_that_is_not_utf8_gives_llama_cpps_ids(stock, tmp_path):
    """Each byte that begins no whole character is one U+FFFD, as llama.cpp's BPE reads it (a character
    cut short was one U+FFFD for all its bytes, and its ids stock's otherwise)."""
    raw = b"caf\xe9 \xe2\x82 ok \xff end"
    file = tmp_path / "latin.txt"
    file.write_bytes(raw)
    r = tokenize(str(DEMO), "-f", str(file), "--ids")
    assert r.returncode == 0 and r.stdout == f"{stock.tokenize(raw, True, True)}\n".encode()
