"""A chat template that refuses the messages (its own raise_exception) or fails on them (an error of its
code): refused with the template's words or the error named, as stock llama-cpp-python and Transformers
raise them (a ValueError from the Engine and the drop-in, a 400 from the server, one error line on the
CLI; a chat that llama.cpp's rendering takes, Gemma 2's system message merged, is rendered so there,
as llama-server renders it); a template that fails on a user's message alone refused at start, as
llama-server refuses it.
The server joins a message's text parts one a line, as llama-server does."""
from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime

import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from pyedgemoe import Engine, InvalidOptionError, Llama
from pyedgemoe.completions import chat_text
from test_server import request, start_server, stop_server

# Gemma 2's own (google-gemma-2-2b-it.jinja): a style llama.cpp's built-in templates know
GEMMA_2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
SYSTEM = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
USER = [{"role": "user", "content": "Hi"}]
# one no built-in template matches: what it writes for the system message fails, the rest renders
TURNS = "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"


# refuses the system message SYSTEM has, not every one: llama.cpp's rendering refuses it too
REFUSING = ("{% for m in messages %}{% if m['content'] == 'Be brief.' %}{{ raise_exception('No brevity here') }}"
            "{% endif %}" + TURNS)


def failing_on_system(expression: str) -> str:
    return "{% for m in messages %}{% if m['role'] == 'system' %}" + expression + "{% endif %}" + TURNS


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return str(tiny_model("qwen3_moe")[0])


def test_a_templates_own_refusal_stands_unless_llama_cpp_renders_what_it_refuses(qwen3):
    # llama.cpp's built-in Gemma template rendered it instead (the system merged, no BOS); llama.cpp's
    # chat rendering (llama-server's, llama-cli's) merges the system message into the user's, BOS kept
    with pytest.raises(ValueError, match="System role not supported"):  # stock's exception
        Jinja2ChatFormatter(template=GEMMA_2, eos_token="<eos>", bos_token="<bos>")(messages=SYSTEM)
    with Engine(qwen3, n_ctx=256, n_threads=2, chat_template=GEMMA_2) as eng:
        with pytest.raises(InvalidOptionError, match="^the chat template refuses these messages: System role not "
                                                     "supported$"):
            eng.format_chat(SYSTEM)
        assert eng.format_chat(USER).endswith("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
        merged = chat_text(eng, SYSTEM)[0]
        assert merged == chat_text(eng, SYSTEM, reasoning_format="auto")[0]
        assert merged.endswith("<start_of_turn>user\nBe brief.\nHi<end_of_turn>\n<start_of_turn>model\n")
        with Engine(qwen3, n_ctx=256, n_threads=2, chat_template=REFUSING) as refusing:
            with pytest.raises(InvalidOptionError, match="^the chat template refuses these messages: No brevity here$"):
                refusing.create_chat_completion(SYSTEM, max_tokens=1)  # llama.cpp refuses it too
    with Llama(model_path=qwen3, n_ctx=256, chat_template=GEMMA_2, verbose=False) as llm:
        with pytest.raises(ValueError, match="System role not supported"):
            llm.create_chat_completion(SYSTEM, max_tokens=1)


@pytest.mark.parametrize("expression, error", [
    ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
    ("{{ range(200000)|length }}", "OverflowError: Range too big"),  # the sandbox's bound
])
def test_a_template_failing_on_the_messages_is_refused_naming_the_error(qwen3, expression, error):
    with Engine(qwen3, n_ctx=256, n_threads=2, chat_template=failing_on_system(expression)) as eng:
        with pytest.raises(InvalidOptionError, match=f"^the chat template fails on these messages: {error}"):
            eng.create_chat_completion(SYSTEM, max_tokens=1)
        assert eng.format_chat(USER) == "[user] Hi\n[assistant] "


def test_the_template_is_given_todays_date_as_llama_cpp_gives_it_and_the_drop_in_none(qwen3):
    # Llama 3.1's template shows the date its tools give, else its own (llama.cpp's common_chat_extra_context
    # gives date_string and datetime to every template; llama-cpp-python gives none)
    dated = ('{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}'
             "Today Date: {{ date_string }} ({{ datetime | default('none') }})\n{% for m in messages %}" + TURNS)
    now = datetime.now()
    with Engine(qwen3, n_ctx=256, n_threads=2, chat_template=dated) as eng:
        plain = chat_text(eng, USER)[0]
        assert plain.startswith(f"Today Date: {now:%d %b %Y} ({now:%b %d %Y})\n")
        assert plain == chat_text(eng, USER, reasoning_format="auto")[0]  # llama.cpp's rendering
    stock = Jinja2ChatFormatter(template=dated, eos_token="", bos_token="")(messages=USER).prompt
    assert stock.startswith("Today Date: 26 Jul 2024 (none)\n")
    with Llama(model_path=qwen3, n_ctx=256, chat_template=dated, verbose=False) as llm:
        assert chat_text(llm.engine, USER, jinja2_formatter=True)[0] == stock


def cli_error(command: str, *arguments: str) -> str:
    """The one line the command fails with (after its notes)."""
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", command, *arguments], capture_output=True, text=True,
                       timeout=120)
    lines = [line for line in r.stderr.splitlines() if not line.startswith("note: ")]
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    return lines[0]


def test_the_cli_says_a_refusal_in_one_line(qwen3, tmp_path):
    path = tmp_path / "refusing.jinja"
    path.write_text(REFUSING)
    error = cli_error("run", qwen3, "-p", "Hi", "-sys", "Be brief.", "-st", "-n", "2",
                      "--chat-template-file", str(path))
    assert error == "error: the chat template refuses these messages: No brevity here"


@pytest.mark.parametrize("command, arguments", [("run", ["-p", "Hi", "-st"]), ("serve", ["--port", "0", "-t", "1"])])
def test_a_template_failing_on_a_user_message_alone_is_refused_at_start(qwen3, tmp_path, command, arguments):
    path = tmp_path / "div0.jinja"
    path.write_text("{% for m in messages %}{{ 1/0 }}{% endfor %}")
    assert cli_error(command, qwen3, *arguments, "--chat-template-file", str(path)).startswith(
        "error: the chat template fails on these messages: ZeroDivisionError: division by zero")


@pytest.mark.parametrize("name", ["llama3", "gemma", "bogusname", "{{ 'no messages read' }}"])
def test_a_template_that_reads_no_message_is_refused(qwen3, name):
    """llama.cpp's built-in names (but chatml) are Jinja text here that reads no message: every chat
    became the name itself, answered without a word."""
    assert cli_error("run", qwen3, "-p", "Hi", "-st", "--chat-template", name) == (
        f"error: the chat template {name!r} never reads the messages: give a Jinja chat template (or chatml); "
        "llama.cpp's other built-in names are not taken")


def test_the_server_answers_a_refusal_or_a_failure_with_a_400_and_joins_text_parts_one_a_line(qwen3, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{% if m['content'] == 'Be brief.' %}{{ raise_exception('No system here') }}"
                    "{% elif m['role'] == 'tool' %}{{ 1/0 }}{% endif %}" + TURNS)
    proc, url = start_server(tmp_path / "server.log", "-t", "1", "-c", "256", "--chat-template-file", str(path),
                             model=qwen3)
    try:
        for endpoint in ("/apply-template", "/v1/chat/completions"):
            for messages, message in ((SYSTEM, "the chat template refuses these messages: No system here"), (
                    [*USER, {"role": "assistant", "content": "Hello"}, {"role": "tool", "content": "18 C"}],
                    "the chat template fails on these messages: ZeroDivisionError: division by zero")):
                body = json.dumps({"messages": messages, "max_tokens": 1}).encode()
                status, body = request("POST", url + endpoint, body, key=None)
                assert status == 400 and body["error"]["message"] == message, (endpoint, body)
        parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
        status, body = request("POST", url + "/apply-template", json.dumps({"messages": parts}).encode(), key=None)
        assert status == 200 and body["prompt"] == "[user] a\nb\n[assistant] "  # llama-server's concat_content_parts
    finally:
        stop_server(proc)
