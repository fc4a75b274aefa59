"""Llama(chat_format="chatml-function-calling"): llama-cpp-python's tool calls by any model (its
README's "Function Calling" example), against stock llama-cpp-python on the same tiny model. The
handler is a sequence of text completions: the test records the completions each makes and finds
them the same (prompts, stops, temperatures, grammars), so the answers are the same wherever the
grammars are. A function's JSON-schema grammar is llama.cpp's converter's here and
llama-cpp-python's older Python port there, which allows other whitespace: those answers are
compared by their calls and their schema, not their text."""
from __future__ import annotations

import json

import pytest

from conftest import recording_completions
from pyedgemoe import InvalidOptionError, Llama
from pyedgemoe.chatml_function_calling import TEMPLATE

FORMAT = "chatml-function-calling"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather <of a city>",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "rain": {"type": "boolean"}},
                   "required": ["unit", "rain"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "system", "content": "You are <b>helpful</b>."},
            {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def pair(tiny_model):
    """Stock llama-cpp-python's Llama and ours with the format, on the tiny Mixtral (a text prompt
    tokenizes alike there) and the tiny Qwen3-MoE; each completion they make recorded."""
    llama_cpp = pytest.importorskip("llama_cpp")
    made = {}

    def make(arch: str):
        if arch not in made:
            path = str(tiny_model(arch)[0])
            kwargs = dict(n_ctx=2048, n_threads=2, verbose=False, chat_format=FORMAT)
            made[arch] = tuple(recording_completions(llm) for llm in (llama_cpp.Llama(model_path=path, **kwargs),
                                                           Llama(model_path=path, **kwargs)))
        for llm in made[arch]:
            llm.calls.clear()
        return made[arch]
    yield make
    for theirs, ours in made.values():
        theirs.close()
        ours.close()


def _same_calls(theirs, ours, *, schema_step: int | None = None) -> None:
    """The two handlers made the same completions. Step `schema_step` had a function's grammar
    (different converters: present in both), so its text and the prompts after it, which hold
    that text, may differ beyond its own prompt."""
    drop = ("seed", "logit_bias")  # passed here, not there
    assert len(ours.calls) == len(theirs.calls)
    for i, (mine, expected) in enumerate(zip(ours.calls, theirs.calls)):
        mine, expected = ({k: v for k, v in call.items() if k not in drop} for call in (mine, expected))
        if i == schema_step:
            assert mine.pop("grammar") and expected.pop("grammar")
        if schema_step is not None and i > schema_step:
            start = ours.calls[schema_step]["prompt"]
            assert mine.pop("prompt").startswith(start) and expected.pop("prompt").startswith(start)
        assert mine == expected


def _without_ids(value: dict) -> dict:
    """A result with its completion id and time (random, the clock) taken out."""
    return {k: v for k, v in json.loads(json.dumps(value).replace(value["id"].removeprefix("chat"), "ID")).items()
            if k != "created"}


def keys(value):
    """value's shape: its dicts' keys, all the way down."""
    if isinstance(value, dict):
        return {k: keys(v) for k, v in value.items() if k not in ("logprobs", "usage")}
    return [keys(v) for v in value] if isinstance(value, list) else None


def _check_arguments(arguments: str) -> None:
    value = json.loads(arguments)
    assert value["unit"] in ("c", "f") and isinstance(value["rain"], bool)


def test_a_chat_without_tools_is_stock_llama_cpp_pythons(pair):
    theirs, ours = pair("mixtral")
    for kwargs in (dict(max_tokens=12), dict(tools=[WEATHER], tool_choice="none", max_tokens=12, temperature=0.9)):
        out = ours.create_chat_completion(MESSAGES, **kwargs)
        assert _without_ids(out) == _without_ids(theirs.create_chat_completion(MESSAGES, **kwargs))
        _same_calls(theirs, ours)
    # streamed: the same text (stock's stream also sends empty pieces), the same first and last chunks
    chunks, expected = (list(llm.create_chat_completion(MESSAGES, max_tokens=12, stream=True)) for llm in (ours, theirs))
    assert [_without_ids(c) for c in (chunks[0], chunks[-1])] == [_without_ids(c) for c in (expected[0], expected[-1])]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        "".join(c["choices"][0]["delta"].get("content", "") for c in expected)


def test_json_mode_without_tools_is_stock_llama_cpp_pythons(pair):
    theirs, ours = pair("mixtral")
    kwargs = dict(response_format={"type": "json_object"}, max_tokens=24)
    out = ours.create_chat_completion(MESSAGES, **kwargs)
    assert _without_ids(out) == _without_ids(theirs.create_chat_completion(MESSAGES, **kwargs))
    assert out["choices"][0]["message"]["content"].startswith("{")
    _same_calls(theirs, ours)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_a_named_function_is_called_as_in_llama_cpp_python(pair, arch):
    theirs, ours = pair(arch)
    out = ours.create_chat_completion(MESSAGES, tools=[WEATHER], tool_choice=NAMED)
    expected = theirs.create_chat_completion(MESSAGES, tools=[WEATHER], tool_choice=NAMED)
    _same_calls(theirs, ours, schema_step=0)
    prompt = ours.calls[0]["prompt"]  # the system message escaped as HTML, as there
    assert "You are &lt;b&gt;helpful&lt;/b&gt;." in prompt and prompt.endswith("functions.get_weather:\n")
    assert keys(out) == keys(expected) and out["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    choice = out["choices"][0]
    call, = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert call["id"] == f"call__0_get_weather_{out['id'].removeprefix('chat')}"
    assert call["function"]["name"] == expected["choices"][0]["message"]["tool_calls"][0]["function"]["name"]
    assert choice["message"]["function_call"] == call["function"]
    _check_arguments(call["function"]["arguments"])


def test_a_named_call_streams_as_in_llama_cpp_python(pair):
    theirs, ours = pair("mixtral")
    chunks = list(ours.create_chat_completion(MESSAGES, tools=[WEATHER], tool_choice=NAMED, stream=True))
    expected = list(theirs.create_chat_completion(MESSAGES, tools=[WEATHER], tool_choice=NAMED, stream=True))
    assert [keys(c) for c in (chunks[0], chunks[1], chunks[-1])] == \
        [keys(c) for c in (expected[0], expected[1], expected[-1])]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == expected[-1]["choices"][0]["finish_reason"] == "tool_calls"
    pieces = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks[1:-1]]
    _check_arguments("".join(p["function"]["arguments"] for p in pieces))
    assert {p["id"] for p in pieces} == {f"call__0_get_weather_{chunks[0]['id'].removeprefix('chat')}"}


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_auto_takes_the_branch_llama_cpp_python_takes(pair, arch):
    theirs, ours = pair(arch)
    out = ours.create_chat_completion(MESSAGES, tools=[WEATHER], tool_choice="auto")
    expected = theirs.create_chat_completion(MESSAGES, tools=[WEATHER], tool_choice="auto")
    called = bool(expected["choices"][0]["message"].get("tool_calls"))
    _same_calls(theirs, ours, schema_step=1 if called else None)
    assert ours.calls[0]["temperature"] == 0 and ours.calls[0]["stop"] == [":"]
    message = out["choices"][0]["message"]
    if not called:  # "message:", then its text
        assert _without_ids(out) == _without_ids(expected)
        return
    assert [c["function"]["name"] for c in message["tool_calls"]] == \
        [c["function"]["name"] for c in expected["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    _check_arguments(message["tool_calls"][0]["function"]["arguments"])
    # there the legacy field names what the step after the call wrote ("get_weather:"): here the call
    assert message["function_call"] == message["tool_calls"][0]["function"]


def test_a_logits_processor_reaches_every_step_as_there(pair):
    """The tiny Qwen3-MoE's first pick in "auto" is the function (above); a processor that lifts
    "message" sends both handlers to the message."""
    theirs, ours = pair("qwen3_moe")
    message_token = ours.tokenize(b"message", add_bos=False)[0]

    def prefer_message(input_ids, scores):
        scores[message_token] += 100.0
        return scores
    kwargs = dict(tools=[WEATHER], tool_choice="auto", logits_processor=[prefer_message])
    out = ours.create_chat_completion(MESSAGES, **kwargs)
    assert _without_ids(out) == _without_ids(theirs.create_chat_completion(MESSAGES, **kwargs))
    assert ours.calls[1]["prompt"].endswith("message:\n") and len(ours.calls) == 2
    assert "tool_calls" not in out["choices"][0]["message"]


def test_legacy_functions_are_tools(pair):
    theirs, ours = pair("qwen3_moe")
    out = ours.create_chat_completion(MESSAGES, functions=[WEATHER["function"]],
                                      function_call={"name": "get_weather"})
    theirs.create_chat_completion(MESSAGES, functions=[WEATHER["function"]], function_call={"name": "get_weather"})
    _same_calls(theirs, ours, schema_step=0)
    assert out["choices"][0]["message"]["function_call"]["name"] == "get_weather"


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(tools=[WEATHER], tool_choice="auto", stream=True), "not streamed"),
    (dict(tools=[WEATHER], tool_choice="required"), '"required"'),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nowhere"}}),
     "Tool with name 'nowhere' not found"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="auto"),
     "cannot render the messages and tools"),
    (dict(tools={"get_weather": WEATHER}, tool_choice="auto"), "tools must be a list"),
])
def test_what_the_format_cannot_do_is_an_invalid_option(pair, kwargs, fragment):
    _, ours = pair("qwen3_moe")  # whose first pick in "auto" is the function
    with pytest.raises(InvalidOptionError, match=fragment):
        out = ours.create_chat_completion(MESSAGES, **kwargs)
        list(out) if kwargs.get("stream") else out


def test_the_template_is_llama_cpp_pythons():
    import inspect
    llama_chat_format = pytest.importorskip("llama_cpp.llama_chat_format")
    source = inspect.getsource(llama_chat_format.chatml_function_calling)
    code = source[source.index("function_calling_template = ("):source.index("template_renderer")]
    namespace = {}
    exec(code.strip().replace("function_calling_template", "t", 1), namespace)
    assert namespace["t"] == TEMPLATE
