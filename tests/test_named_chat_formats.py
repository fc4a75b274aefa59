"""Llama(chat_format="llama-2" | "mistral-instruct" | ...): llama-cpp-python's named chat formats
(its README's chat example). Every formatter's prompt and stop against its own on conversations
with and without a system message, an assistant's turn, empty and missing contents; then whole
chats against stock llama-cpp-python on the same tiny model: the same completions, the same answers."""
from __future__ import annotations

import inspect
import json
import re

import pytest

from conftest import recording_completions
from pyedgemoe import InvalidOptionError, Llama
from pyedgemoe.named_chat_formats import FORMATTERS, Formatted, formatted

CONVERSATIONS = [
    [{"role": "user", "content": "Name a planet."}],
    [{"role": "system", "content": "Be {terse}."}, {"role": "user", "content": "Name a planet."}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a planet."},
     {"role": "assistant", "content": "Mars."}, {"role": "user", "content": "Another?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": ""},
     {"role": "tool", "content": "42"}],
    [{"role": "system", "content": None}, {"role": "user", "content": [{"type": "text", "text": "parts"}]}],
]


def stock_formatter(name: str):
    """llama_cpp.llama_chat_format's function that registers chat format name."""
    llama_chat_format = pytest.importorskip("llama_cpp.llama_chat_format")
    for function in vars(llama_chat_format).values():
        if inspect.isfunction(function) and f'register_chat_format("{name}")' in inspect.getsource(function):
            return function
    raise AssertionError(f"llama-cpp-python registers no chat format {name!r}")


@pytest.mark.parametrize("name", sorted(FORMATTERS))
def test_each_formatter_writes_llama_cpp_pythons_prompt_and_stop(name):
    theirs = stock_formatter(name)
    for messages in CONVERSATIONS:
        expected = theirs(messages=messages)
        assert formatted(name, messages) == Formatted(expected.prompt, expected.stop), messages


def test_every_format_llama_cpp_python_registers_is_here():
    llama_chat_format = pytest.importorskip("llama_cpp.llama_chat_format")
    registered = set(re.findall(r'@register_chat_format\("([^"]+)"\)', inspect.getsource(llama_chat_format)))
    assert registered == set(FORMATTERS)


@pytest.fixture(scope="module")
def pair(tiny_model):
    llama_cpp = pytest.importorskip("llama_cpp")
    made = {}

    def make(chat_format: str, logits_all: bool = False):  # stock's logprobs need logits_all
        if (chat_format, logits_all) not in made:
            path = str(tiny_model("mixtral")[0])
            kwargs = dict(n_ctx=512, n_threads=2, verbose=False, chat_format=chat_format, logits_all=logits_all)
            made[chat_format, logits_all] = (llama_cpp.Llama(model_path=path, **kwargs),
                                             Llama(model_path=path, **kwargs))
        return made[chat_format, logits_all]
    yield make
    for theirs, ours in made.values():
        theirs.close()
        ours.close()


def _without_ids(value: dict) -> dict:
    return {k: v for k, v in json.loads(json.dumps(value).replace(value["id"].removeprefix("chat"), "ID")).items()
            if k != "created"}


def _given(call: dict) -> dict:
    return {k: v for k, v in call.items() if v is not None and v != []}


@pytest.mark.parametrize("chat_format", ["llama-2", "mistral-instruct", "zephyr", "chatml", "gemma", "vicuna"])
def test_a_chat_in_a_named_format_is_stock_llama_cpp_pythons(pair, chat_format):
    for kwargs in (dict(max_tokens=8), dict(max_tokens=8, temperature=0.9, seed=7, stop=["\n"]),
                   dict(max_tokens=8, logprobs=True, top_logprobs=2, temperature=0)):
        theirs, ours = (recording_completions(llm) for llm in pair(chat_format, logits_all="logprobs" in kwargs))
        out = ours.create_chat_completion(CONVERSATIONS[2], **kwargs)
        expected = theirs.create_chat_completion(CONVERSATIONS[2], **kwargs)
        # the same completion: prompt tokens, stops, sampling, seed (there, stop [] and stopping_criteria None)
        assert [_given(c) for c in ours.calls] == [_given(c) for c in theirs.calls]
        if "logprobs" in kwargs:  # the same tokens; their log-probabilities to float precision
            assert [c["token"] for c in out["choices"][0]["logprobs"]["content"]] == \
                [c["token"] for c in expected["choices"][0]["logprobs"]["content"]]
            for key in ("message", "finish_reason"):
                assert out["choices"][0][key] == expected["choices"][0][key]
            continue
        assert _without_ids(out) == _without_ids(expected)
    theirs, ours = pair(chat_format)
    chunks = list(ours.create_chat_completion(CONVERSATIONS[1], max_tokens=8, stream=True))
    expected = list(theirs.create_chat_completion(CONVERSATIONS[1], max_tokens=8, stream=True))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        "".join(c["choices"][0]["delta"].get("content", "") for c in expected)
    assert chunks[-1]["choices"][0]["finish_reason"] == expected[-1]["choices"][0]["finish_reason"]


def test_a_named_function_and_json_mode_in_a_named_format(pair):
    theirs, ours = pair("mistral-instruct")
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}}}
    kwargs = dict(tools=[weather], max_tokens=32, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    out = ours.create_chat_completion(CONVERSATIONS[0], **kwargs)
    expected = theirs.create_chat_completion(CONVERSATIONS[0], **kwargs)  # its grammar: another converter's
    assert out["choices"][0]["message"].keys() == expected["choices"][0]["message"].keys()
    message = out["choices"][0]["message"]
    assert out["choices"][0]["finish_reason"] == "tool_calls" and message["tool_calls"][0]["function"]["name"] == \
        "get_weather" and json.loads(message["tool_calls"][0]["function"]["arguments"])["unit"] in ("c", "f")
    kwargs = dict(response_format={"type": "json_object"}, max_tokens=16)
    assert _without_ids(ours.create_chat_completion(CONVERSATIONS[0], **kwargs)) == \
        _without_ids(theirs.create_chat_completion(CONVERSATIONS[0], **kwargs))  # llama.cpp's json.gbnf in both
    with pytest.raises(InvalidOptionError, match="Tool choice 'nowhere' not found in tools"):
        ours.create_chat_completion(CONVERSATIONS[0], tools=[weather],
                                    tool_choice={"type": "function", "function": {"name": "nowhere"}})


def test_messages_a_format_cannot_read_are_an_invalid_option(pair):
    _, ours = pair("llama-2")
    for messages in ([{"content": "no role"}], [{"role": "user"}], ["text"]):
        with pytest.raises(InvalidOptionError, match="chat_format 'llama-2': each message needs"):
            ours.create_chat_completion(messages, max_tokens=2)
