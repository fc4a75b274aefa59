"""What llama-cli and llama-bench users type, as those read it: escapes in -p, -f and -r (llama.cpp's
-e, on by default), -r/--reverse-prompt ending the text, -st/--single-turn, -sysf, -j/-jf, -l,
--repeat-last-n, --no-warmup, the chat template's variables (--chat-template-kwargs, -rea, --reasoning-effort),
-sp/--special, --verbose-prompt, --keep, --simple-io, -kvu; bench's -p, -n, -r and --no-warmup."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pyedgemoe import Engine
from pyedgemoe.cli_escapes import process_escapes

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"
GREEDY = ["--temp", "0", "-t", "1", "--no-display-prompt"]


def run(*arguments: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", str(DEMO), *arguments], capture_output=True,
                          text=True, timeout=180, input=stdin)


@pytest.fixture(scope="module")
def engine():
    with Engine(DEMO, n_ctx=256, n_threads=1) as eng:
        yield eng


def greedy(engine, prompt: str, n: int, stop: list[str] | None = None) -> str:
    return engine.generate(prompt, n, stop=stop, temperature=0.0)


@pytest.mark.parametrize("text, expected", [
    (r"a\nb", "a\nb"), (r"tab\there", "tab\there"), (r"quote\"s\'", "quote\"s'"), (r"back\\n", "back\\n"),
    (r"\x41\xe2\x82\xac", "A€"), (r"C:\dir\q", r"C:\dir\q"), ("end\\", "end\\"), (r"\x4", r"\x4"),
])
def test_escapes_are_llama_cpps(text, expected):
    assert process_escapes(text) == expected


def test_a_prompts_escapes_are_processed_unless_told_not(engine, tmp_path):
    prompt = r"def add(a, b):\n   "
    escaped, verbatim = run("-p", prompt, "-n", "12", *GREEDY), run("-p", prompt, "-n", "12", "--no-escape", *GREEDY)
    assert escaped.returncode == verbatim.returncode == 0, escaped.stderr
    assert escaped.stdout == greedy(engine, "def add(a, b):\n   ", 12) + "\n"
    assert verbatim.stdout == greedy(engine, prompt, 12) + "\n" != escaped.stdout
    file = tmp_path / "prompt.txt"
    file.write_text(prompt)  # as llama.cpp: a file's text too
    assert run("-f", str(file), "-n", "12", *GREEDY).stdout == escaped.stdout


def test_a_reverse_prompt_ends_the_text_before_it(engine):
    text = greedy(engine, "def add(a, b):\n   ", 32)
    word = text.split()[3]
    r = run("-p", r"def add(a, b):\n   ", "-n", "32", "-r", "zzz", "-r", word, *GREEDY)
    assert r.returncode == 0 and r.stdout == text[:text.index(word)] + "\n"
    assert "context" not in r.stderr  # a stop, not a full context


def test_a_reverse_prompts_escapes_are_processed(engine):
    text = greedy(engine, "def add(a, b):\n   ", 32)
    line = text.split("\n")[1][:4]  # the start of the second line, after a line break
    r = run("-p", r"def add(a, b):\n   ", "-n", "32", "-r", r"\n" + line, *GREEDY)
    assert r.stdout == text[:text.index("\n" + line)] + "\n"


def test_single_turn_answers_once_and_ends(engine):
    r = run("-cnv", "-p", "hello", "-st", "-n", "8", "--temp", "0", "-t", "1", stdin="never read\n")
    reply = engine.create_chat_completion([{"role": "user", "content": "hello"}], max_tokens=8, temperature=0.0)
    assert r.returncode == 0 and r.stdout == f"> hello\n{reply['choices'][0]['message']['content']}\n"
    read = run("-cnv", "-st", "-n", "8", "--temp", "0", "-t", "1", stdin="hello\nsecond\n")
    assert read.returncode == 0 and read.stdout == "> " + r.stdout.removeprefix("> hello\n")  # one line read


def chat_reply(engine, messages: list[dict]) -> str:
    return engine.create_chat_completion(messages, max_tokens=8, temperature=0.0)["choices"][0]["message"]["content"]


def test_a_chats_commands_are_llama_clis(engine, tmp_path):
    """/read FILE and /glob PATTERN put text files ahead of the next message, /regen answers the last
    message again, /clear empties the history; what they cannot do is a note, the session goes on."""
    chat = ("-cnv", "-n", "8", "--temp", "0", "-t", "1")
    (tmp_path / "a.txt").write_text("alpha\n")
    (tmp_path / "b.txt").write_text("beta\n")
    read = run(*chat, stdin=f"/read {tmp_path / 'a.txt'}\nsum it up\n")
    content = f"--- File: {tmp_path / 'a.txt'} ---\nalpha\nsum it up"
    assert read.returncode == 0 and chat_reply(engine, [{"role": "user", "content": content}]) in read.stdout
    globbed = run(*chat, stdin=f"/glob {tmp_path}/*.txt\nboth\n")
    content = f"--- File: {tmp_path / 'a.txt'} ---\nalpha\n--- File: {tmp_path / 'b.txt'} ---\nbeta\nboth"
    assert chat_reply(engine, [{"role": "user", "content": content}]) in globbed.stdout
    counted = "{% for m in messages %}{{ m.content }} {% endfor %}turn {{ messages|length }} of the talk:"
    # the history's length in the prompt: "turn 1" after /clear, "turn 3" without it
    first = greedy(engine, "hello turn 1 of the talk:", 6)
    third = greedy(engine, f"hello {first} hello turn 3 of the talk:", 6)
    assert first != third
    talk = (*chat, "-n", "6", "--chat-template", counted)
    regen = run(*talk, stdin="/regen\nhello\n/regen\n")
    assert regen.stdout.count(first) == 2 and "note: no reply to regenerate" in regen.stderr
    kept = run(*talk, stdin="hello\nhello\n")
    assert kept.stdout.count(first) == 1 and third in kept.stdout
    cleared = run(*talk, stdin="hello\n/clear\nhello\n")
    assert cleared.stdout.count(first) == 2 and "note: chat history cleared" in cleared.stderr
    missing = run(*talk, stdin=f"/read {tmp_path / 'none.txt'}\n/glob {tmp_path}/*.md\nhello\n")
    assert missing.returncode == 0 and first in missing.stdout
    assert "cannot be opened" in missing.stderr and "no file matches" in missing.stderr


def test_a_chats_template_variables_reach_the_template(engine, tmp_path):
    template = "{% for m in messages %}{{ m.content }}{% endfor %} thinking={{ enable_thinking }} effort=" \
        "{{ reasoning_effort | default('unset') }}:"
    for flags, shown in ((["-rea", "off"], "thinking=False effort=unset"),
                         (["--chat-template-kwargs", '{"enable_thinking": true}', "--reasoning-effort", "low"],
                          "thinking=True effort=low")):
        r = run("-cnv", "-st", "-p", "hello", "-n", "6", "--chat-template", template, *flags, *GREEDY)
        expected = greedy(engine, f"hello {shown}:", 6)
        assert r.returncode == 0 and r.stdout == f"> hello\n{expected}\n", r.stderr  # the template's text, greedy


@pytest.mark.parametrize("arguments, message", [
    (["-no-cnv", "-p", "x", "-st"], "--single-turn is one turn of a chat session"),
    (["-no-cnv", "-p", "x", "-rea", "off"], "the chat template's, which --no-chat leaves out"),
    (["-p", "x", "-r", "y", "--json"], "--reverse-prompt ends streamed text"),
    (["-cnv", "-sp"], "--special and --verbose-prompt are a completion's"),
])
def test_a_flag_without_its_mode_is_one_error_line(arguments, message):
    r = run(*arguments)
    assert r.returncode != 0 and r.stderr.startswith("error: ") and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_system_prompt_file_is_read_as_llama_cpp_reads_it(engine, tmp_path):
    """-sysf FNAME: the system message, one trailing line break dropped; with -sys too, one error line."""
    file = tmp_path / "system.txt"
    file.write_text("Answer in Python.\n")
    messages = [{"role": "system", "content": "Answer in Python."}, {"role": "user", "content": "hello"}]
    reply = engine.create_chat_completion(messages, max_tokens=8, temperature=0.0)["choices"][0]["message"]["content"]
    r = run("-cnv", "-st", "-sysf", str(file), "-p", "hello", "-n", "8", "--temp", "0", "-t", "1")
    assert r.returncode == 0 and r.stdout == f"> hello\n{reply}\n"
    both = run("-cnv", "-st", "-sysf", str(file), "-sys", "x", "-p", "hello")
    assert both.returncode == 1 and both.stderr == "error: give the system message with -sys or -sysf, not both\n"
    missing = run("-cnv", "-st", "-sysf", str(tmp_path / "nope.txt"), "-p", "hello")
    assert missing.returncode == 1 and missing.stderr.startswith("error: cannot read the system prompt's file: ")


def test_json_schemas_short_flags_are_llama_cpps(engine, tmp_path):
    """-j SCHEMA and -jf FILE, as --json-schema and --json-schema-file."""
    schema = '{"type": "boolean"}'
    (tmp_path / "schema.json").write_text(schema)
    expected = engine.generate("x = ", 8, temperature=0.0, json_schema=schema) + "\n"
    assert run("-p", "x = ", "-n", "8", "-j", schema, *GREEDY).stdout == expected
    assert run("-p", "x = ", "-n", "8", "-jf", str(tmp_path / "schema.json"), *GREEDY).stdout == expected
    assert expected.strip() in ("true", "false")


def test_logit_bias_and_the_penalties_window_are_llama_cpps(engine):
    """-l TOKEN_ID(+/-)BIAS (several), --repeat-last-n N: as the same settings of a generation."""
    first = engine.tokenize(greedy(engine, "def main(", 1), add_bos=False)[0]
    expected = engine.generate("def main(", 8, temperature=0.0, logit_bias={first: float("-inf"), 1: 2.5})
    r = run("-p", "def main(", "-n", "8", "-l", f"{first}-inf", "-l", "1+2.5", *GREEDY)
    assert r.returncode == 0 and r.stdout == expected + "\n" and not expected.startswith(greedy(engine, "def main(", 1))
    expected = engine.generate("def main(", 32, temperature=0.0, repeat_penalty=2.0, penalty_last_n=0)
    r = run("-p", "def main(", "-n", "32", "--repeat-penalty", "2", "--repeat-last-n", "0", *GREEDY)
    assert r.returncode == 0 and r.stdout == expected + "\n"
    assert expected != engine.generate("def main(", 32, temperature=0.0, repeat_penalty=2.0)  # the window matters
    expected = engine.generate("def main(", 32, temperature=0.0, repeat_penalty=2.0, penalty_last_n=-1)
    r = run("-p", "def main(", "-n", "32", "--repeat-penalty", "2", "--repeat-last-n", "-1", *GREEDY)
    assert r.returncode == 0 and r.stdout == expected + "\n"  # -1: the context, as llama-cli's


@pytest.mark.parametrize("arguments, message", [
    (["-l", "1+x"], "error: --logit-bias takes TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-inf, got '1+x'"),
    (["-l", "99999+1"], "error: logit_bias: token id 99999 out of range"),
    (["--repeat-last-n", "-2"], "error: --repeat-last-n must be >= -1 (0: off, -1: the context), got -2"),
    (["-t", "100000"], "error: n_threads must be at most 512"),  # libgomp ended the process
    (["-tb", "513"], "error: n_threads_batch must be at most 512"),
])
def test_a_bad_bias_window_or_thread_count_is_one_error_line(arguments, message):
    r = run("-p", "x", "-n", "2", *arguments)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(message), r.stderr


def test_no_warmup_is_taken(engine):
    r = run("-p", "x", "-n", "4", "--no-warmup", *GREEDY)
    assert r.returncode == 0 and r.stdout == greedy(engine, "x", 4) + "\n"


def test_special_tokens_are_shown_with_sp(engine):
    """-sp: special tokens' text in the output (a bias makes the model write the demo's one special
    token, its end of text, and --ignore-eos goes on past it), in the stream and in --json's text; the
    end-of-generation token that ends the text is shown too, as llama-completion shows it."""
    special = engine.token_piece(engine.token_eos(), special=True).decode()
    forced = ["-l", f"{engine.token_eos()}+100", *GREEDY]
    plain, shown = run("-p", "x", "-n", "3", "--ignore-eos", *forced), run("-sp", "-p", "x", "-n", "3", "--ignore-eos",
                                                                             *forced)
    assert plain.returncode == shown.returncode == 0
    assert plain.stdout == "\n" and shown.stdout == special * 3 + "\n"
    assert f'"text": "{special * 2}"' in run("-sp", "--json", "-p", "x", "-n", "2", "--ignore-eos", *forced).stdout
    ended = run("-sp", "-p", "x", "-n", "3", *forced)
    assert ended.returncode == 0 and ended.stdout == special + "\n" and run("-p", "x", "-n", "3", *forced).stdout == "\n"


def test_verbose_prompt_prints_the_prompts_tokens(engine):
    r = run("--verbose-prompt", "-p", "hello world", "-n", "1", *GREEDY)
    tokens = engine.tokenize("hello world")
    assert r.returncode == 0
    assert f"prompt: 'hello world'\nnumber of tokens in prompt = {len(tokens)}\n" in r.stderr
    for token in tokens:
        assert f"{token:6d} -> '{engine.token_piece(token, special=True).decode()}'" in r.stderr


def test_json_and_verbose_prompt_take_the_prompts_special_tokens_as_the_run_does(engine):
    # llama-completion parses special-token text in a prompt; so do the streamed run, --json and
    # --verbose-prompt alike
    prompt = f"x{engine.token_piece(engine.token_eos(), special=True).decode()}y"
    tokens = engine.prompt_tokens(prompt)
    assert len(tokens) < len(engine.tokenize(prompt))  # the special token's text is one token
    shown = run("--verbose-prompt", "-p", prompt, "-n", "3", *GREEDY)
    assert shown.returncode == 0 and f"number of tokens in prompt = {len(tokens)}\n" in shown.stderr
    as_json = json.loads(run("--json", "-p", prompt, "-n", "3", *GREEDY).stdout)
    assert as_json["n_prompt_tokens"] == len(tokens) and as_json["text"] + "\n" == shown.stdout


def test_keep_simple_io_and_kv_unified_are_llama_cpps(engine):
    expected = greedy(engine, "x", 2) + "\n"
    kept = run("-p", "x", "-n", "2", "--keep", "5", "--simple-io", "-no-kvu", *GREEDY)
    assert kept.returncode == 0 and kept.stdout == expected and "note: --keep 5:" in kept.stderr
    unified = run("-p", "x", "-n", "2", "-kvu")
    assert unified.returncode != 0 and unified.stderr.startswith("error: --kv-unified is not supported")


def test_a_prompt_file_is_read_as_llama_cpp_reads_it(engine, tmp_path):
    """One trailing line break dropped; bytes that are not UTF-8 do not stop it."""
    file = tmp_path / "prompt.txt"
    file.write_text("def add(a, b):\n")
    assert run("-f", str(file), "-n", "8", *GREEDY).stdout == greedy(engine, "def add(a, b):", 8) + "\n"
    file.write_bytes(b"abc\xff def")
    r = run("-f", str(file), "-n", "4", *GREEDY)
    assert r.returncode == 0 and r.stdout == greedy(engine, "abc\ufffd def", 4) + "\n"


def test_bench_takes_llama_benchs_flags(monkeypatch):
    """-p, -n, -r and --no-warmup mean what they mean to llama-bench."""
    from typer.testing import CliRunner

    import pyedgemoe.bench.runner
    from pyedgemoe.cli import app
    given = {}
    monkeypatch.setattr(pyedgemoe.bench.runner, "cli_main", lambda model, **kwargs: given.update(kwargs))
    r = CliRunner().invoke(app, ["bench", str(DEMO), "-p", "512", "-p", "16", "-n", "128", "-r", "5", "--no-warmup"])
    assert r.exit_code == 0, r.output
    assert (given["prompt_tokens"], given["output_tokens"], given["repeats"], given["warmup"]) == ([512, 16], [128], 5, 0)
    CliRunner().invoke(app, ["bench", str(DEMO)])
    assert (given["prompt_tokens"], given["output_tokens"], given["repeats"], given["warmup"]) == ([16], [32], 3, 1)


def test_perplexity_takes_llama_cpps_defaults_c_0_and_chunks_minus_1(engine, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text((Path(__file__).parent / "test_cli.py").read_text())
    trained = int(engine.metadata[f"{engine.metadata['general.architecture']}.context_length"])

    def ppl(*args):
        r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "perplexity", str(DEMO), "-f", str(text), "-t", "1",
                            "--json", *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return {k: v for k, v in json.loads(r.stdout).items() if k in ("ppl", "n_ctx", "n_chunks")}
    assert ppl("-c", "0", "--chunks", "-1") == ppl("-c", str(trained)) == {**ppl("-c", str(trained)), "n_ctx": trained}


@pytest.mark.parametrize("command", ["run", "serve", "perplexity"])
def test_list_devices_needs_no_model(command):
    """As llama.cpp's --list-devices: the devices (none but the CPU in a CPU build), then exit."""
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", command, "--list-devices"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("Available devices:\n"), r.stderr


@pytest.mark.parametrize("threads", [("-t", "-1"), ("-t", "0", "-tb", "-1")])
def test_threads_of_minus_one_or_zero_are_the_default_as_in_llama_cpp(threads):
    plan = run("-p", "x", "--dry-run", *threads)
    assert plan.returncode == 0, plan.stderr
    assert "threads       default decode, default batch" in plan.stdout
    assert run("-p", "x", "-n", "2", *threads).returncode == 0
