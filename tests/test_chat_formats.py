"""Tool calls and thoughts in the model's own format, found as llama-server finds them
(pyedgemoe.chat_formats): a tiny Qwen3-MoE carrying Qwen3's released chat template (from llama.cpp's tree), so that
llama.cpp's chat formats know its calls: `<tool_call>` tags around a JSON object.

A random model does not write calls by itself: a logits processor (llama-cpp-python's hook) lifts
the tokens of a scripted answer, and the grammar, the parser and the stream do the rest, as they
would for a trained model's own answer."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from conftest import REPO, rewrite_gguf
from pyedgemoe import Engine
from pyedgemoe.chat_formats import ChatTurn, joined_message
from pyedgemoe.completions import chat_text_tokens
from pyedgemoe.errors import InvalidOptionError
from test_server import start_server, stop_server

QWEN3_TEMPLATE = REPO / "native" / "vendor" / "llama.cpp" / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "the time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASKED = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
SECOND = '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory) -> Path:
    return rewrite_gguf(tiny_model("qwen3_moe")[0], tmp_path_factory.mktemp("tools") / "qwen3-tools.gguf",
                        chat_template=QWEN3_TEMPLATE.read_text())


@pytest.fixture(scope="module")
def engine(model):
    with Engine(str(model), n_ctx=1024, verbose=False) as e:
        yield e


def writes(engine, text: str):
    """A logits processor that makes the model write text (its tokens lifted one after another),
    then leaves the model to itself."""
    script = engine.tokenize(text, add_bos=False, special=True)
    start = []

    def lift(input_ids, logits):
        start.append(len(input_ids)) if not start else None
        i = len(input_ids) - start[0]
        if i < len(script):
            logits = logits.copy()
            logits[script[i]] += 1000.0
        return logits
    return lift


def chat(engine, answer: str | None = None, **kwargs):
    kwargs = {"tools": TOOLS, "max_tokens": 96, "temperature": 0, **kwargs}
    if answer is not None:
        kwargs["logits_processor"] = writes(engine, answer)
    return engine.create_chat_completion(ASKED, **kwargs)


def test_the_prompt_is_the_template_with_the_tools_as_our_renderer_gives_it(engine):
    assert ChatTurn(engine, ASKED, TOOLS, None, None).prompt == engine.format_chat(ASKED, TOOLS)


def test_chat_template_kwargs_are_the_templates_variables_in_both_renderers(engine):
    no_thinking = {"enable_thinking": False}  # Qwen3's switch: an empty thought opens the answer
    ours = engine.format_chat(ASKED, TOOLS, None, no_thinking)
    assert ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ChatTurn(engine, ASKED, TOOLS, None, None, no_thinking).prompt == ours
    plain = chat(engine, tools=None, max_tokens=1)["usage"]["prompt_tokens"]
    assert chat(engine, tools=None, max_tokens=1, chat_template_kwargs=no_thinking)["usage"]["prompt_tokens"] > plain
    with pytest.raises(InvalidOptionError, match="chat_template_kwargs"):
        chat(engine, chat_template_kwargs="enable_thinking")


def test_a_call_the_model_writes_comes_back_as_tool_calls(engine):
    choice, = chat(engine, "Let me look. " + CALL)["choices"]
    message = choice["message"]
    assert message["content"] == "Let me look. "
    call, = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert re.fullmatch(r"[A-Za-z0-9]{32}", call["id"])  # llama-server's ids


def test_a_streamed_call_gives_its_id_and_name_once_then_its_arguments_in_pieces(engine):
    whole = chat(engine, "Let me look. " + CALL)["choices"][0]["message"]
    chunks = list(chat(engine, "Let me look. " + CALL, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert len(calls) > 3 and all(c["index"] == 0 for c in calls)
    assert set(calls[0]) == {"index", "id", "type", "function"} and calls[0]["function"]["name"] == "get_weather"
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    joined = joined_message(deltas)  # as the server joins a stream for a request without one
    assert joined["content"] == whole["content"]
    assert [c["function"] for c in joined["tool_calls"]] == [c["function"] for c in whole["tool_calls"]]


def test_required_makes_the_answer_end_with_its_calls(engine):
    choice, = chat(engine, CALL, tool_choice="required")["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    choice, = chat(engine, CALL + SECOND, tool_choice="required", max_tokens=160)["choices"]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "get_time"]


def test_the_grammar_keeps_a_call_to_the_tools_and_their_parameters(engine):
    # the model starts a call of a misspelled function with a wrong parameter: from the trigger
    # on, the grammar lets through only the tools' names and a parameters object of their schema
    bad = '<tool_call>\n{"name": "get_wether", "arguments": {"town": "Paris"}}\n</tool_call>'
    message = chat(engine, bad, max_tokens=160)["choices"][0]["message"]
    names = [c["function"]["name"] for c in message["tool_calls"]]
    assert names and set(names) <= {"get_weather", "get_time"}
    assert all(not c["function"]["arguments"].startswith('{"town"') for c in message["tool_calls"])


def test_an_answer_without_a_call_is_the_models_text(engine):
    parsed = chat(engine, max_tokens=12)["choices"][0]
    text = chat(engine, max_tokens=12, parse_tool_calls=False)["choices"][0]  # llama-cpp-python's way: text
    assert "tool_calls" not in parsed["message"]
    # the same tokens; llama.cpp's parser leaves out the whitespace that opens the answer
    assert parsed["message"]["content"] == text["message"]["content"].lstrip()
    assert parsed["finish_reason"] == text["finish_reason"]


def test_a_conversation_with_a_call_is_answered_with_or_without_the_tools(engine):
    called = [*ASKED, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    # with the tools, llama.cpp renders it (the call, the answer in <tool_response>)
    turn = ChatTurn(engine, called, TOOLS, None, None)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in turn.prompt
    assert "<tool_response>\nsunny\n</tool_response>" in turn.prompt
    # without, Qwen3's template fails on the null content (a TypeError in its own code) and
    # llama.cpp's built-in template takes the messages, as for any template that refuses them
    assert chat(engine, tools=None, max_tokens=2)["choices"][0]["finish_reason"] == "length"
    assert engine.create_chat_completion(called, max_tokens=2)["choices"][0]["finish_reason"] == "length"


def test_reasoning_format_gives_the_thoughts_apart_as_llama_server_does(engine):
    answer = "<think>\nI should look it up.\n</think>\n\nIt is sunny."
    inline = chat(engine, answer, tools=None, max_tokens=40)["choices"][0]["message"]
    assert inline["content"].startswith(answer) and "reasoning_content" not in inline  # the default: none
    apart = chat(engine, answer, tools=None, max_tokens=40, reasoning_format="auto")["choices"][0]["message"]
    assert apart["reasoning_content"] == "I should look it up.\n"
    assert apart["content"] == inline["content"][len(answer) - len("It is sunny."):]
    chunks = list(chat(engine, answer, tools=None, max_tokens=40, reasoning_format="auto", stream=True))
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert "reasoning_content" in deltas[0] and joined_message(deltas) == apart
    # before a call too
    message = chat(engine, "<think>\nCall it.\n</think>\n\n" + CALL, max_tokens=160, tool_choice="required",
                   reasoning_format="deepseek")["choices"][0]["message"]
    assert message["reasoning_content"] == "Call it.\n" and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    with pytest.raises(InvalidOptionError, match="reasoning_format"):
        chat(engine, tools=None, reasoning_format="thoughts")


def test_tools_refuse_a_grammar_beside_them_and_messages_the_template_cannot_take(engine):
    with pytest.raises(InvalidOptionError, match="grammar of their own"):
        chat(engine, grammar='root ::= "yes"')
    with pytest.raises(InvalidOptionError, match="tool_choice must be one of none, auto, required"):
        chat(engine, tool_choice="sometimes")
    with pytest.raises(InvalidOptionError, match="logprobs"):
        chat(engine, stream=True, logprobs=True)
    with pytest.raises(InvalidOptionError, match="chat format of the template"):
        engine.create_chat_completion([{"role": "user", "content": {"text": "hi"}}], tools=TOOLS)


def test_required_is_refused_where_the_template_has_no_format_of_calls(tiny_model):
    # the tiny Qwen3-MoE's own template is bare ChatML: "required" would be ignored, the answer free text
    with Engine(str(tiny_model("qwen3_moe")[0]), n_ctx=256, verbose=False) as plain:
        with pytest.raises(InvalidOptionError, match='tool_choice "required": llama.cpp finds no format'):
            plain.create_chat_completion([{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice="required")
        named = {"type": "function", "function": {"name": WEATHER["function"]["name"]}}
        out = plain.create_chat_completion([{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice=named,
                                           max_tokens=4)
        assert out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == WEATHER["function"]["name"]


def test_llama_cpps_rendering_leaves_the_gil_to_other_threads(engine):
    # a server renders a long conversation or many tools on the Engine's thread: meanwhile /health
    # and the others' requests run (a 10 ms tick on this thread goes on)
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": "d" * 200, "parameters": {
        "type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(20)}}}} for i in range(1000)]
    engine.chat_format  # made before the clock starts
    done, ticks = threading.Event(), []
    render = threading.Thread(target=lambda: (ChatTurn(engine, ASKED, tools, None, None), done.set()))
    start = time.perf_counter()
    render.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
        time.sleep(0.01)
    render.join()
    took = time.perf_counter() - start
    gaps = [b - a for a, b in zip([start, *ticks], [*ticks, time.perf_counter()])]
    assert took > 0.2 and max(gaps) < took / 2, (took, max(gaps))


def test_the_server_answers_with_the_calls_and_the_prompt_llama_cpp_renders(model, engine, tmp_path):
    proc, url = start_server(tmp_path / "server.log", "-t", "1", "-c", "1024", model=model)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        kwargs = dict(model="qwen3-tools.gguf", messages=ASKED, tools=TOOLS, max_tokens=16, temperature=0)
        whole = client.chat.completions.create(**kwargs, tool_choice="required", parallel_tool_calls=False)
        streamed = list(client.chat.completions.create(**kwargs, tool_choice="required", stream=True))
        own = chat(engine, tool_choice="required", max_tokens=16)
        assert whole.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in streamed) \
            == own["choices"][0]["message"]["content"]
        prompt = chat_text_tokens(engine, ChatTurn(engine, ASKED, TOOLS, "required", False).prompt)
        assert whole.usage.prompt_tokens == len(prompt)
        for body, expected in (({"tools": TOOLS}, ChatTurn(engine, ASKED, TOOLS, None, None).prompt),
                               ({"chat_template_kwargs": {"enable_thinking": False}},
                                engine.format_chat(ASKED, None, None, {"enable_thinking": False}))):
            applied = json.loads(urllib.request.urlopen(urllib.request.Request(
                url + "/apply-template", json.dumps({"messages": ASKED, **body}).encode(),
                {"Content-Type": "application/json"})).read())
            assert applied == {"prompt": expected}
        thinking = client.chat.completions.create(**kwargs, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert thinking.usage.prompt_tokens > whole.usage.prompt_tokens
        for bad, field in ((dict(parallel_tool_calls="yes"), "parallel_tool_calls"),
                           (dict(extra_body={"chat_template_kwargs": ["enable_thinking"]}), "chat_template_kwargs"),
                           (dict(extra_body={"reasoning_format": "thoughts"}), "reasoning_format"),
                           (dict(extra_body={"grammar": 'root ::= "x"'}), "grammar")):
            with pytest.raises(openai.BadRequestError, match=field):
                client.chat.completions.create(**kwargs, **bad)
    finally:
        stop_server(proc)


def test_the_servers_own_defaults_are_llama_servers_flags(model, engine, tmp_path):
    """serve -a NAME --reasoning-format F --chat-template-kwargs JSON: what a request gives wins,
    the template's variables merged by name."""
    proc, url = start_server(tmp_path / "server.log", "-t", "1", "-c", "1024", "-a", "qwen3", "--reasoning-format",
                             "auto", "--chat-template-kwargs", '{"enable_thinking": false}', model=model)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        assert [m.id for m in client.models.list()] == ["qwen3"]
        for name in ("qwen3", "qwen3-tools.gguf"):  # the alias, and the file's name still
            assert client.chat.completions.create(model=name, messages=ASKED, max_tokens=2).choices[0].message

        def applied(body: dict) -> str:
            return json.loads(urllib.request.urlopen(urllib.request.Request(
                url + "/apply-template", json.dumps({"messages": ASKED, **body}).encode(),
                {"Content-Type": "application/json"})).read())["prompt"]
        assert applied({}) == engine.format_chat(ASKED, None, None, {"enable_thinking": False})
        assert applied({"chat_template_kwargs": {"enable_thinking": True}}) == engine.format_chat(ASKED)
    finally:
        stop_server(proc)


@pytest.mark.parametrize("flag, fragment", [
    (["--reasoning-format", "thoughts"], "--reasoning-format takes none, auto, deepseek, deepseek-legacy"),
    (["--chat-template-kwargs", "[1]"], "--chat-template-kwargs must be a JSON object"),
    (["--chat-template-kwargs", "{"], "--chat-template-kwargs is not JSON"),
])
def test_bad_server_defaults_are_one_error_line(model, flag, fragment):
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "serve", str(model), "--port", "0", *flag],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip() == r.stderr.strip().splitlines()[0]
    assert r.stderr.startswith(f"error: {fragment}")
