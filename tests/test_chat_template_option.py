"""A chat template in place of the model's (llama.cpp's --chat-template, --chat-template-file;
Engine(chat_template=...)): every reader of the model's template takes it, the Python rendering and
llama.cpp's own (tool calls, the server's /apply-template) alike."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pyedgemoe import Engine, InvalidOptionError, Llama
from pyedgemoe.chat_template import CHATML, TEMPLATE_KEY
from pyedgemoe.completions import chat_text
from test_server import request, start_server, stop_server

REPO = Path(__file__).resolve().parents[1]

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
RENDERED = "[system] Be brief.\n[user] Hi\n[assistant] "


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return str(tiny_model("qwen3_moe")[0])


def test_every_reader_of_the_template_takes_the_one_given(qwen3):
    with Engine(qwen3, n_ctx=256, n_threads=2, chat_template=TEMPLATE) as eng, Engine(qwen3, n_ctx=256) as plain:
        assert plain.format_chat(MESSAGES) != RENDERED  # the model's own template differs
        assert eng.format_chat(MESSAGES) == RENDERED
        assert chat_text(eng, MESSAGES, tools=TOOLS)[0] == RENDERED  # llama.cpp's rendering (common_chat)
        assert eng.metadata[TEMPLATE_KEY] == TEMPLATE
        with Llama(model_path=qwen3, n_ctx=256, chat_template=TEMPLATE, verbose=False) as llm:
            assert llm.chat_format == "chat_template.default"
            reply = llm.create_chat_completion(MESSAGES, max_tokens=4, temperature=0)
            expected = eng.create_completion(eng.tokenize(RENDERED, special=True), max_tokens=4, temperature=0)
            assert reply["choices"][0]["message"]["content"] == expected["choices"][0]["text"]


def test_a_thinking_template_is_given_what_llama_cpp_gives_it_and_the_drop_in_what_llama_cpp_python_does(qwen3):
    # QwQ's template closes the thought where `enable_thinking` is not true: undefined in the Python
    # rendering, it closed it there, while llama.cpp's (tools, reasoning_format) left it open, as llama-server
    llama_cpp = pytest.importorskip("llama_cpp")
    source = (REPO / "native/vendor/llama.cpp/models/templates/Qwen-QwQ-32B.jinja").read_text()
    with Engine(qwen3, n_ctx=256, n_threads=2, chat_template=source) as eng:
        plain = chat_text(eng, MESSAGES)[0]
        assert plain.endswith("<think>\n") and plain == chat_text(eng, MESSAGES, reasoning_format="auto")[0]
        assert chat_text(eng, MESSAGES, template_kwargs={"enable_thinking": False})[0].endswith("</think>")
    stock = llama_cpp.llama_chat_format.Jinja2ChatFormatter(template=source, eos_token="<|im_end|>", bos_token="")
    with Llama(model_path=qwen3, n_ctx=256, chat_template=source, verbose=False) as llm:
        assert chat_text(llm.engine, MESSAGES, jinja2_formatter=True)[0] == stock(messages=MESSAGES).prompt


def test_chatml_by_name_as_llama_cpp(qwen3):
    with Engine(qwen3, n_ctx=256, chat_template="chatml") as eng:
        assert eng.metadata[TEMPLATE_KEY] == CHATML
        assert eng.format_chat(MESSAGES) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                             "<|im_start|>assistant\n")


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}", "the chat template does not parse"),
    ("", "chat_template must be a Jinja template"),
])
def test_a_bad_template_is_refused_at_load(qwen3, template, message):
    with pytest.raises(InvalidOptionError, match=message):
        Engine(qwen3, n_ctx=256, chat_template=template)


def cli(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", *arguments], capture_output=True, text=True,
                          timeout=120)


def test_the_cli_reads_a_template_file(qwen3, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    r = cli(qwen3, "-cnv", "-p", "Hi", "-st", "-n", "4", "--temp", "0", "--chat-template-file", str(path))
    assert r.returncode == 0 and "no chat template" not in r.stderr, r.stderr
    for arguments, message in ((["--chat-template-file", str(tmp_path / "missing.jinja")], "cannot read"),
                               (["--chat-template-file", str(path), "--chat-template", "chatml"], "not both"),
                               (["--chat-template", "{% if %}"], "does not parse")):
        r = cli(qwen3, "-p", "Hi", "-n", "2", *arguments)
        assert r.returncode != 0 and r.stderr.startswith("error: ") and message in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_the_server_applies_it(qwen3, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    proc, url = start_server(tmp_path / "server.log", "-t", "1", "-c", "256", "--chat-template-file", str(path),
                             model=qwen3)
    try:
        status, body = request("POST", url + "/apply-template", json.dumps({"messages": MESSAGES}).encode(), key=None)
        assert status == 200 and body["prompt"] == RENDERED
    finally:
        stop_server(proc)
