"""`pyedgemoe run -i`: llama.cpp's llama-completion in interactive mode. A turn of the model ends
at a reverse prompt (-r, shown), an end-of-generation token (the first reverse prompt then goes
into the text) or -n tokens; the line read goes into the text between --in-prefix and --in-suffix
and the completion goes on from the whole text. The input is read as llama.cpp's console reads it
(cli_input: '\\' and '/' at a line's end, -mli), in -i and --chat alike."""
from __future__ import annotations

import io
import signal
import subprocess

import pytest

from pyedgemoe import Engine
from pyedgemoe.cli_input import read_input
from pyedgemoe.generation import SamplingParams
from test_cli import assert_one_line_error, cli
from test_cli_session import wait_for
from test_io_faults import DEMO
from test_signals import CLI, start

PROMPT = "def add(a, b):"
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def eng():
    with Engine(DEMO, n_ctx=4096) as engine:
        yield engine


def turn(eng, tokens: list[int], n: int) -> list[int]:
    return list(eng.generate_tokens(tokens, n, GREEDY))


def text(eng, s: str, special: bool = True) -> list[int]:
    return eng.tokenize(s, add_bos=False, special=special)


def test_each_line_read_goes_into_the_text_and_the_completion_goes_on(eng):
    r = cli("run", DEMO, "-i", "-p", PROMPT, "-n", "8", "--temp", "0", "--in-prefix", "# ", "--in-suffix", r":\n",
            input_text="x = 1\n")
    assert r.returncode == 0, r.stderr
    tokens = eng.tokenize(PROMPT, special=True)
    first = turn(eng, tokens, 8)
    line = text(eng, "x = 1", special=False)
    tokens += first + text(eng, "# ") + line + text(eng, ":\n")
    second = turn(eng, tokens, 8 - len(line))  # as llama-completion's n_remain: the line's tokens count
    assert len(first) == 8 and len(second) == 8 - len(line) > 0
    # what the model wrote, the prefix and suffix around each line read (the line itself is the
    # terminal's echo), then the next turn's prefix and EOF
    assert r.stdout == PROMPT + eng.detokenize(first) + "# :\n" + eng.detokenize(second) + "# \n"
    assert "note: EOF by user" in r.stderr and "Traceback" not in r.stderr


def test_a_reverse_prompt_ends_the_turn_after_it(eng):
    tokens = eng.tokenize(PROMPT, special=True)
    reverse = eng.detokenize(turn(eng, tokens, 3))  # where the greedy text gets after 3 tokens
    r = cli("run", DEMO, "-i", "-p", PROMPT, "-n", "40", "--temp", "0", "-r", reverse, input_text="total\n")
    assert r.returncode == 0, r.stderr
    line = text(eng, "total", special=False)
    tokens += turn(eng, tokens, 3) + line
    assert r.stdout == PROMPT + reverse + eng.detokenize(turn(eng, tokens, 40 - 3 - len(line))) + "\n"


def test_a_prompt_ending_in_a_reverse_prompt_reads_first_as_does_if(eng):
    # llama.cpp's chat-with-bob habit: the prompt ends in "User:", the user types first
    r = cli("run", DEMO, "-i", "-p", "# User:", "-r", "User:", "-n", "6", "--temp", "0", input_text=" add\n")
    first = cli("run", DEMO, "-if", "-p", "# User:", "-n", "6", "--temp", "0", input_text=" add\n")
    line = text(eng, " add", special=False)
    expected = eng.detokenize(turn(eng, eng.tokenize("# User:", special=True) + line, 6 - len(line)))
    assert r.returncode == first.returncode == 0, r.stderr + first.stderr
    assert r.stdout == first.stdout == "# User:" + expected + "\n"


def test_an_end_of_generation_puts_the_first_reverse_prompt_in_the_text(eng):
    forced = f"{eng.token_eos()}+inf"  # every pick the end of generation
    r = cli("run", DEMO, "-i", "-p", PROMPT, "-r", "User:", "-r", "Bot:", "-l", forced, "--temp", "0",
            input_text="hi\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == PROMPT + "User:" + "User:" + "\n"


def test_ctrl_c_gives_the_turn_back_and_ctrl_c_while_reading_ends_it(tmp_path):
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        proc = start([*CLI, "run", str(DEMO), "-i", "-p", PROMPT, "-c", "4096", "-n", "3000", "--ignore-eos", "-t", "1",
                      "--in-prefix", "<you>"], stdin=subprocess.PIPE, stdout=stdout, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: out.stat().st_size > len(PROMPT) + 40, proc)
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: out.read_text().endswith("<you>"), proc)  # the reader's turn
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


@pytest.mark.parametrize("args, fragments", [
    (["-i", "--chat"], ("-i", "--chat")),
    (["-i", "-p", "x", "--json"], ("-i", "--json")),
    (["-p", "x", "--in-prefix", "# "], ("--in-prefix", "-i")),
])
def test_what_i_does_not_go_with_is_one_error_line(args, fragments):
    assert_one_line_error(cli("run", DEMO, *args, input_text=""), *fragments)


@pytest.mark.parametrize("lines, multiline, expected", [
    ("one\n", False, "one"),
    ("one\\\ntwo\nthree\n", False, "one\ntwo"),  # '\' goes on to the next line
    ("one/\ntwo\n", False, "one"),  # '/' ends the input, its newline left out
    ("one\ntwo\\\nthree\n", True, "one\ntwo"),  # -mli: until a line ends in '\'
    ("\n", False, ""),  # an empty line: the turn given back
    ("one", False, "one"),
    ("", False, None),  # EOF
])
def test_input_is_read_as_llama_cpps_console_reads_it(monkeypatch, lines, multiline, expected):
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    assert read_input(multiline) == expected


def test_a_chat_message_goes_on_past_a_line_ending_in_a_backslash(eng):
    r = cli("run", DEMO, "--chat", "-n", "4", "--temp", "0", input_text="def add(a, b):\\\n    return\n")
    messages = [{"role": "user", "content": "def add(a, b):\n    return"}]
    reply = eng.create_chat_completion(messages, max_tokens=4, temperature=0)["choices"][0]["message"]["content"]
    assert r.returncode == 0 and r.stdout == f"> {reply}\n> \n", r.stderr


def test_a_prompt_the_context_cannot_hold_is_plain_completions_error():
    """-i with a prompt longer than the context printed it, noted the context full and exited 0."""
    r = cli("run", DEMO, "-i", "-p", "word " * 400, "-c", "256", "-n", "4", input_text="more\n")
    assert r.returncode == 1 and r.stdout == ""
    assert_one_line_error(r, "does not fit the context of 256 tokens with room for 1 generated")
