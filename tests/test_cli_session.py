"""`pyedgemoe run` tells the truth about a session, as a user of llama.cpp's llama-cli expects:
-h and --version, the context's size (rounded up, past the training context, full), --chat's
-p / -sys, a model without a chat template, --json and --stats with --chat, and Ctrl-C (a reply
stops, the session goes on; a plain run prints its timings)."""
from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pyedgemoe import Engine
from test_cli import assert_one_line_error, cli
from test_io_faults import DEMO
from test_signals import CLI, start  # SIGINT at its default, as in a terminal

PROMPT = "def add(a, b):"


def notes(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("note: ")]


def test_version_and_short_help():
    r = cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"pyedgemoe {importlib.metadata.version('pyedgemoe')}"
    assert r.stdout.splitlines()[1].startswith("llama.cpp ")
    for args in (("-h",), ("run", "-h"), ("calibrate", "-h")):
        r = cli(*args)
        assert r.returncode == 0 and r.stdout.startswith("Usage: pyedgemoe"), (args, r.stderr)
    assert "--expert-cache" in cli("run", "-h").stdout


def test_a_context_rounded_up_or_past_the_training_context_says_so():
    # the demo model was trained on 256 positions; llama.cpp allocates a context in multiples of 256
    r = cli("run", DEMO, "-p", PROMPT, "-n", "1", "-c", "300")
    assert r.returncode == 0, r.stderr
    said = "\n".join(notes(r.stderr))
    assert "300 positions rounded up to 512" in said
    assert "longer than the model was trained for (256)" in said
    plan = cli("run", DEMO, "-c", "300", "--dry-run")
    assert "rounded up to 512" in plan.stdout and "trained for (256)" in plan.stdout
    # left unset, --ctx is the training context (at most 4096): nothing to say
    quiet = cli("run", DEMO, "-p", PROMPT, "-n", "1")
    assert not [n for n in notes(quiet.stderr) if "context" in n], quiet.stderr


def test_a_generation_stopped_by_a_full_context_says_so():
    with Engine(DEMO, n_ctx=256) as eng:
        n_prompt = len(eng.tokenize(PROMPT))
    r = cli("run", DEMO, "-p", PROMPT, "-n", "400", "--ignore-eos", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert (f"note: stopped after {256 - n_prompt} generated tokens: the context of 256 positions is full "
            "(-n 400 asked for more: raise --ctx)") in r.stderr
    full = json.loads(cli("run", DEMO, "-p", PROMPT, "-n", "400", "--ignore-eos", "--temp", "0", "--json").stdout)
    assert (len(full["tokens"]), full["finish_reason"], full["context_full"]) == (256 - n_prompt, "length", True)
    for n in ("-1", "-2"):  # llama.cpp's: until the context is full (-1 with a context shift there)
        to_the_end = json.loads(cli("run", DEMO, "-p", PROMPT, "-n", n, "--ignore-eos", "--temp", "0", "--json").stdout)
        assert to_the_end["tokens"] == full["tokens"]
    short = cli("run", DEMO, "-p", PROMPT, "-n", "4", "--ignore-eos", "--temp", "0")
    assert "context" not in short.stderr and "stopped" not in short.stderr
    assert json.loads(cli("run", DEMO, "-p", PROMPT, "-n", "4", "--ignore-eos", "--json").stdout)["context_full"] is False


def test_chat_p_is_the_first_user_message_and_sys_the_system_message():
    # llama.cpp's llama-cli: -p is sent as the first user message (echoed), -sys is the system message
    r = cli("run", DEMO, "--chat", "-sys", "You write Python.", "-p", PROMPT, "-n", "6", "--temp", "0",
            input_text="and then?\n")
    assert r.returncode == 0, r.stderr
    messages, expected = [{"role": "system", "content": "You write Python."}], ""
    with Engine(DEMO, n_ctx=256) as eng:
        for line in (PROMPT, "and then?"):
            messages.append({"role": "user", "content": line})
            reply = eng.create_chat_completion(messages, max_tokens=6, temperature=0)["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": reply})
            expected += f"> {line}\n{reply}\n" if line == PROMPT else f"> {reply}\n"
    assert r.stdout == expected + "> \n"


def test_a_chat_message_beyond_the_context_is_an_error_line_and_the_session_goes_on():
    # as llama-cli: the error shown, the next message answered (without the one that did not fit); the
    # exit status 1 tells a script piping messages that one failed
    r = cli("run", DEMO, "--chat", "-c", "256", "-n", "4", "--temp", "0", input_text="x " * 3000 + "\nhi\n")
    assert r.returncode == 1, r.stderr
    assert [l for l in r.stderr.splitlines() if l.startswith("error:")] == [
        "error: prompt of 3025 tokens does not fit the context of 256 tokens with room for 1 generated (raise n_ctx "
        "/ --ctx)"]
    with Engine(DEMO, n_ctx=256) as eng:
        reply = eng.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=4,
                                           temperature=0)["choices"][0]["message"]["content"]
    assert r.stdout == f"> > {reply}\n> \n"
    single = cli("run", DEMO, "-st", "-c", "256", "-n", "4", "-p", "x " * 3000)
    assert_one_line_error(single, "does not fit the context of 256 tokens")


def test_chat_with_a_model_without_a_template_says_chatml_is_used():
    r = cli("run", DEMO, "--chat", "-n", "2", input_text="hi\n")
    assert r.returncode == 0, r.stderr
    assert "note: the model has no chat template (tokenizer.chat_template): ChatML is used" in r.stderr


def test_chat_refuses_json_and_a_system_prompt_needs_chat():
    assert_one_line_error(cli("run", DEMO, "--chat", "--json", input_text="hi\n"), "--json", "--chat")
    assert_one_line_error(cli("run", DEMO, "-no-cnv", "-sys", "be brief", "-p", "hi"), "--system-prompt", "--no-chat")


def test_a_chats_own_flag_makes_a_chat_as_in_llama_cli():
    # llama-cli's -p with -sys or -st: the first user message of a chat (one turn with -st)
    greedy = ["-n", "4", "--temp", "0"]
    for flags in (["-st"], ["-sys", "be brief"], ["-st", "-sys", "be brief"]):
        implied = cli("run", DEMO, "-p", "hi", *flags, *greedy, input_text="")
        given = cli("run", DEMO, "-cnv", "-p", "hi", *flags, *greedy, input_text="")
        assert implied.returncode == 0 and implied.stdout.startswith("> hi\n"), implied.stderr
        assert implied.stdout == given.stdout


def test_chat_stats_come_at_the_end_of_the_session():
    r = cli("run", DEMO, "--chat", "-n", "4", "--expert-cache", "25%", "--stats", input_text="hi\nagain\n")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("   total: ") == 1 and "requests =" in r.stderr


def wait_for(ready, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"it ended too early: {proc.communicate()}"
        assert time.monotonic() < deadline, "never got ready"
        time.sleep(0.01)


def test_ctrl_c_during_a_chat_reply_stops_the_reply_not_the_session(tmp_path):
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = start([*CLI, "run", str(DEMO), "--chat", "-c", "4096", "-n", "3000", "-t", "1", "--expert-cache", "25%"],
                     stdin=subprocess.PIPE, stdout=stdout, stderr=stderr, text=True)
        proc.stdin.write(PROMPT + "\n")
        proc.stdin.flush()
        wait_for(lambda: len(out.read_text()) > 40, proc)
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: "reply interrupted" in err.read_text(), proc)
        proc.stdin.write("/exit\n")  # the session still reads the next line
        proc.stdin.close()
        proc.wait(timeout=60)
    assert proc.returncode == 0, err.read_text()
    assert "note: reply interrupted" in err.read_text() and "Traceback" not in err.read_text()
    text = out.read_text()
    assert text.startswith("> ") and text.endswith("\n> ")  # the reply, cut short, then the next prompt


def test_ctrl_c_at_the_chat_prompt_ends_the_session_with_its_stats(tmp_path):
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        proc = start([*CLI, "run", str(DEMO), "--chat", "-n", "2", "--expert-cache", "25%", "--stats"],
                     stdin=subprocess.PIPE, stdout=stdout, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: out.read_text().startswith("> "), proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "   total: " in err and "Traceback" not in err and "KeyboardInterrupt" not in err


def test_ctrl_c_during_a_run_prints_its_timings(tmp_path):
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        proc = start([*CLI, "run", str(DEMO), "-p", PROMPT, "-c", "4096", "-n", "4000", "--ignore-eos", "-t", "1",
                      "--expert-cache", "25%"], stdout=stdout, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: out.stat().st_size > len(PROMPT) + 20, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "prompt eval:" in err and "       eval: " in err and "note: interrupted (Ctrl-C)" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def test_ctrl_c_while_the_prompt_is_evaluated_gives_no_timings_it_does_not_have(tmp_path):
    out, text = tmp_path / "out.txt", tmp_path / "long.txt"
    text.write_text("def f(x):\n    return x\n" * 600)  # 6000 tokens in ubatches of 32: seconds of prefill
    with open(out, "w") as stdout:
        proc = start([*CLI, "run", str(DEMO), "-f", str(text), "-c", "8192", "-b", "32", "-ub", "32", "-n", "5", "-t",
                      "1"], stdout=stdout, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: out.stat().st_size > 100, proc)  # the prompt, shown before its evaluation
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=60)
    # between two decode calls of 32 tokens: the whole prompt takes 15 s here (it waited for its end)
    assert time.monotonic() - sent < 5
    assert proc.returncode == 130, err
    assert "note: interrupted (Ctrl-C) while the prompt was evaluated" in err and "prompt eval:" not in err
    assert "Traceback" not in err


@pytest.mark.parametrize("delay", [0.1, 0.25, 0.4])
def test_ctrl_c_while_the_command_starts_is_status_130_without_a_traceback(delay):
    # the first second or so is Python importing the CLI (pyedgemoe.__main__)
    proc = start([sys.executable, "-m", "pyedgemoe", "run", str(DEMO), "-p", PROMPT, "-n", "4000", "-t", "1"],
                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (130, -signal.SIGINT), err  # -SIGINT: before Python took the signal over
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


# Ctrl-C at the one moment it aborted the process: while nanobind creates the native module's enums
CTRL_C_IN_THE_NATIVE_IMPORT = """
import enum, os, runpy, signal, sys
create = enum.EnumType.__call__
def ctrl_c_while_native_enums_are_made(cls, *args, **kwargs):
    if kwargs.get("module") == "pyedgemoe._native":
        os.kill(os.getpid(), signal.SIGINT)
    return create(cls, *args, **kwargs)
enum.EnumType.__call__ = ctrl_c_while_native_enums_are_made
sys.argv = ["pyedgemoe", "--version"]
runpy.run_module("pyedgemoe", run_name="__main__")
"""


def test_ctrl_c_while_the_native_module_is_imported_is_status_130_not_an_abort():
    proc = start([sys.executable, "-c", CTRL_C_IN_THE_NATIVE_IMPORT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and out == "", (proc.returncode, err)
    assert "Traceback" not in err and "nanobind" not in err, err


def test_output_that_cannot_be_written_is_one_error_line():
    run = [sys.executable, "-m", "pyedgemoe", "run", str(DEMO), "-p", PROMPT, "-n", "4", "-t", "1"]
    with open("/dev/full", "w") as full:
        r = subprocess.run(run, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.splitlines()[-1] == "error: No space left on device", r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr
    closed = subprocess.run(run, preexec_fn=lambda: os.close(1), stderr=subprocess.PIPE, text=True, timeout=120)
    assert closed.returncode == 1 and closed.stderr == "error: the standard output is closed\n", closed.stderr
    # a closed stdin reads as empty: the tokens of no text
    empty = subprocess.run([*CLI, "tokenize", str(DEMO), "--stdin", "--ids"], preexec_fn=lambda: os.close(0),
                           capture_output=True, text=True, timeout=120)
    expected = cli("tokenize", DEMO, "--stdin", "--ids", input_text="")
    assert empty.returncode == 0 and empty.stdout == expected.stdout, empty.stderr


def test_make_demo_prints_the_prompt_once():
    import demo  # scripts/demo.py, what `make demo` runs

    r = subprocess.run([sys.executable, demo.__file__], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    shown = r.stdout.split("--stats\n", 1)[1]  # after the command line it shows
    assert shown.count(demo.PROMPT) == 1 and shown.lstrip("\n").startswith(demo.PROMPT)


def test_ctrl_c_while_a_chat_message_is_rendered_stops_the_reply_not_the_session(capsys):
    """Ctrl-C just after a long message was sent (while the chat was rendered and tokenized) ended the
    session with status 130."""
    from pyedgemoe.cli_chat import _reply
    from pyedgemoe.generation import SamplingParams

    class Rendering:
        def create_chat_completion(self, *args, **kwargs):
            raise KeyboardInterrupt

    message = _reply(Rendering(), [{"role": "user", "content": "hi"}], 4, SamplingParams(), [], None, None)
    assert message == {"role": "assistant", "content": ""}
    assert "note: reply interrupted" in capsys.readouterr().err
