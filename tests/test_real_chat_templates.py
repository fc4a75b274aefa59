"""The released chat templates of llama.cpp's tree (models/templates: Gemma 4, GLM-4.7-Flash,
Nemotron 3 Nano, MiniMax-M2, GPT-OSS, Granite 4, Qwen3, DeepSeek V3.1, ...) render a chat as
llama-cpp-python's own formatter (Jinja2ChatFormatter) renders it: a plain chat with a system
prompt, one without, and a tool call with its result. A template that refuses a chat (Gemma 2 a
system prompt, the tool-use templates a chat without tools) is refused by both, ours with a typed
error saying why where stock raises the template's exception."""
from __future__ import annotations

from pathlib import Path

import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from conftest import REPO
from pyedgemoe.chat_template import render_chat
from pyedgemoe.errors import InvalidOptionError

TEMPLATES = sorted((REPO / "native" / "vendor" / "llama.cpp" / "models" / "templates").glob("*.jinja"))
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHATS = {
    "with a system prompt": ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
                              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is MoE?"}],
                             None),
    "without one": ([{"role": "user", "content": "What is MoE?"}], None),
    "a tool call and its result": ([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}], [WEATHER]),
}


def test_the_tree_has_the_templates():
    assert len(TEMPLATES) > 50 and any(t.name.startswith("google-gemma-4") for t in TEMPLATES)


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.stem)
def test_a_released_template_renders_as_llama_cpp_python_renders_it(template: Path, chat: str):
    source, (messages, tools) = template.read_text(), CHATS[chat]
    try:
        expected = Jinja2ChatFormatter(template=source, eos_token="</s>", bos_token="<s>")(
            messages=messages, tools=tools).prompt
    except Exception:  # the template refuses the chat: ours refuses it too, saying why
        with pytest.raises(InvalidOptionError, match="the chat template (refuses|fails on) these messages: ."):
            render_chat(source, messages, bos_token="<s>", eos_token="</s>", tools=tools)
        return
    assert render_chat(source, messages, bos_token="<s>", eos_token="</s>", tools=tools) == expected
