"""Anthropic's Messages API on `pyedgemoe serve` (/v1/messages, /v1/messages/count_tokens), through
Anthropic's own Python client, the real server in a subprocess over the tiny Qwen3-MoE (its chat
template takes tools) with its experts in a 50 % cache. The answers are checked against an
in-process Engine's chat completion of the same conversation, greedy."""
from __future__ import annotations

import json

import anthropic
import pytest

from pyedgemoe import Engine
from pyedgemoe.completions import chat_text, chat_text_tokens
from test_server import request, start_server, stop_server

ARGS = ["-t", "1", "-c", "1024", "--expert-cache", "50%"]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen3_moe")[0])


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    proc, url = start_server(tmp_path_factory.mktemp("anthropic") / "server.log", *ARGS, model=model)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model, n_ctx=1024, n_threads=1) as eng:
        yield eng


def greedy_chat(engine, messages: list[dict], max_tokens: int, **kwargs) -> dict:
    return engine.create_chat_completion(messages, max_tokens=max_tokens, temperature=0, **kwargs)


def test_a_message_is_the_chat_completions_text_with_anthropics_fields(client, engine):
    out = client.messages.create(model="local-model", max_tokens=16, extra_body={"temperature": 0}, system="Be brief.",
                                 messages=[{"role": "user", "content": "Name a color."}])
    expected = greedy_chat(engine, [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Name a color."}], 16)
    assert out.type == "message" and out.role == "assistant" and out.model == "qwen3_moe-f32.gguf"
    assert [b.type for b in out.content] == ["text"]
    assert out.content[0].text == expected["choices"][0]["message"]["content"]
    assert out.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[expected["choices"][0]["finish_reason"]]
    # llama-server's usage: the prompt's tokens the cache held apart (none: a first request)
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == expected["usage"]["prompt_tokens"]
    assert out.usage.output_tokens == expected["usage"]["completion_tokens"]


def test_the_tokens_the_cache_held_are_cache_reads_whole_and_streamed(client, engine):
    """A conversation's next turn reuses the prompt the server's sequence holds: those tokens are
    cache_read_input_tokens, the rest input_tokens, in a whole message and in a stream's message_start
    (sent with the first token, as llama-server's)."""
    first = [{"role": "user", "content": "Name three colors of the sea, please."}]
    kwargs = dict(model="local-model", max_tokens=8, extra_body={"temperature": 0})
    reply = client.messages.create(messages=first, **kwargs)
    turn = first + [{"role": "assistant", "content": reply.content[0].text}, {"role": "user", "content": "And sky?"}]
    prompt_tokens = greedy_chat(engine, turn, 1)["usage"]["prompt_tokens"]
    with client.messages.stream(messages=turn, **kwargs) as stream:
        started = next(e for e in stream if e.type == "message_start").message.usage
        streamed = stream.get_final_message()
    assert 0 < started.cache_read_input_tokens < prompt_tokens
    assert started.input_tokens + started.cache_read_input_tokens == prompt_tokens
    assert (streamed.usage.input_tokens, streamed.usage.cache_read_input_tokens) == \
        (started.input_tokens, started.cache_read_input_tokens)
    whole = client.messages.create(messages=turn, **kwargs).usage  # the same prompt again: all held but its last
    assert whole.input_tokens + whole.cache_read_input_tokens == prompt_tokens
    assert whole.cache_read_input_tokens > started.cache_read_input_tokens


def test_a_streamed_message_is_the_same_as_a_whole_one(client):
    kwargs = dict(model="local-model", max_tokens=20, extra_body={"temperature": 0},
                  system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
                  messages=[{"role": "user", "content": [{"type": "text", "text": "Count to five."}]}])
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    # the same prompt: the stream's found it in the cache, all but its last token
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens == final.usage.cache_read_input_tokens + 1


def test_a_tool_chosen_is_a_tool_use_block_whole_and_streamed(client):
    kwargs = dict(model="local-model", max_tokens=64, extra_body={"temperature": 0}, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    out = client.messages.create(**kwargs)
    assert out.stop_reason == "tool_use" and [b.type for b in out.content] == ["tool_use"]
    call = out.content[0]
    assert call.name == "get_weather" and isinstance(call.input["city"], str) and call.id
    with client.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == call.input
    assert events[0] == "message_start" and events[-1] == "message_stop" and "input_json" in events


def test_a_conversation_with_a_tool_result_continues_as_the_chat_would(client, engine, server):
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, call]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}]
    chat = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}],
             "tool_calls": [{"id": "toolu_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    prompt = chat_text_tokens(engine, chat_text(engine, chat, tools, None)[0])
    counted = client.messages.count_tokens(model="local-model", messages=messages, tools=[WEATHER])
    assert counted.input_tokens == len(prompt)
    out = client.messages.create(model="x", max_tokens=12, extra_body={"temperature": 0}, tools=[WEATHER],
                                 messages=messages)
    expected = greedy_chat(engine, chat, 12, tools=tools)
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == len(prompt) == expected["usage"]["prompt_tokens"]
    assert "".join(b.text for b in out.content if b.type == "text") == (expected["choices"][0]["message"]["content"]
                                                                         or "")


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 8}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "some"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"description": "no name"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "system": 5}, "system"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_sequences": "no"}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_sequences": ["s"] * 17}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "model": {"a": 1}}, "model"),
    ({"messages": [{"role": "user", "content": "x"}], "output_config": {"format": {
        "type": "json_schema", "schema": {"$ref": "#/nowhere"}}}}, "output_config.format.schema"),
])
def test_bad_requests_are_400s_naming_what(server, body, param):
    status, answer = request("POST", server + "/v1/messages", json.dumps({"model": "m", **body}).encode(), key=None)
    assert status == 400 and param in answer["error"]["message"], answer  # the name the client sent
    assert answer["error"]["param"] == param, answer


def test_anthropics_client_raises_its_own_error_and_takes_what_it_sends(client):
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    out = client.messages.create(model="m", max_tokens=4, metadata={"user_id": "u"}, speed="fast",
                                 thinking={"type": "enabled", "budget_tokens": 1024}, stop_sequences=["\n\n"],
                                 service_tier="auto", output_config={"effort": "low"},
                                 messages=[{"role": "user", "content": "hi"}])
    assert out.type == "message" and out.stop_reason in ("end_turn", "max_tokens")


def test_an_output_format_constrains_the_text_to_its_schema(client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    out = client.messages.create(model="m", max_tokens=48, output_config={"format": {"type": "json_schema",
                                                                                      "schema": schema}},
                                 messages=[{"role": "user", "content": "2 + 2?"}])
    if out.stop_reason == "end_turn":
        assert isinstance(json.loads(out.content[0].text)["answer"], int)
    else:  # cut by max_tokens: a prefix of such an object
        assert out.content[0].text.startswith('{')


def test_a_stream_of_thoughts_text_and_calls_is_one_block_after_the_other():
    """EventStream over chunks as Engine.create_chat_completion streams a parsed turn: thoughts, text,
    two calls (the second's arguments in two pieces)."""
    from pyedgemoe.server.anthropic_api import EventStream

    def chunk(delta: dict, finish: str | None = None) -> dict:
        out = {"id": "c1", "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if "role" not in delta:  # evaluated: the timings so far (timings_per_token)
            out["timings"] = {"prompt_n": 5, "cache_n": 2}
        return {**out, "usage": {"prompt_tokens": 7, "completion_tokens": 9}} if finish else out
    stream = EventStream()
    chunks = [chunk({"role": "assistant"}), chunk({"reasoning_content": "Hm"}), chunk({"reasoning_content": "m."}),
              chunk({"content": "Two calls."}),
              chunk({"tool_calls": [{"index": 0, "id": "a", "type": "function",
                                     "function": {"name": "f", "arguments": '{"x": 1}'}}]}),
              chunk({"tool_calls": [{"index": 1, "id": "b", "type": "function", "function": {"name": "g", "arguments": '{"y"'}}]}),
              chunk({"tool_calls": [{"index": 1, "function": {"arguments": ': 2}'}}]}), chunk({}, "tool_calls")]
    text = "".join(stream.events(c) for c in chunks)
    events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
    shape = [(e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type")) for e in events]
    assert shape == [("message_start", None, None),
                     ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
                     ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "signature_delta"),
                     ("content_block_stop", 0, None),
                     ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
                     ("content_block_stop", 1, None),
                     ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
                     ("content_block_stop", 2, None),
                     ("content_block_start", 3, "tool_use"), ("content_block_delta", 3, "input_json_delta"),
                     ("content_block_delta", 3, "input_json_delta"), ("content_block_stop", 3, None),
                     ("message_delta", None, None), ("message_stop", None, None)]
    assert events[0]["message"]["usage"] == {"input_tokens": 5, "cache_read_input_tokens": 2, "output_tokens": 0}
    assert events[12]["content_block"] == {"type": "tool_use", "id": "b", "name": "g", "input": {}}
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-2]["usage"]["output_tokens"] == 9
