"""OpenAI's Responses API on `pyedgemoe serve` (/v1/responses), through OpenAI's own client
(`client.responses.create`, `client.responses.stream`), the real server in a subprocess over the
tiny Qwen3-MoE (its chat template takes tools), its experts in a 50 % cache. The answers are checked
against an in-process Engine's chat completion of the same conversation, greedy."""
from __future__ import annotations

import json

import openai
import pytest

from test_server import request, start_server, stop_server
from test_server_anthropic import ARGS, engine, greedy_chat, model  # noqa: F401 - fixtures shared
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                 "parameters": WEATHER["parameters"]}}


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    proc, url = start_server(tmp_path_factory.mktemp("responses") / "server.log", *ARGS, model=model)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def test_a_response_is_the_chat_completions_text(client, engine):
    kwargs = dict(model="gpt-5", instructions="Be brief.", input="Name a color.", max_output_tokens=16, temperature=0)
    out = client.responses.create(**kwargs)
    expected = greedy_chat(engine, [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Name a color."}], 16)
    assert out.object == "response" and out.model == "qwen3_moe-f32.gguf" and out.id.startswith("resp_")
    assert out.output_text == expected["choices"][0]["message"]["content"]
    assert [item.type for item in out.output] == ["message"]
    cut = expected["choices"][0]["finish_reason"] == "length"
    assert out.status == ("incomplete" if cut else "completed")
    assert (out.incomplete_details.reason if cut else out.incomplete_details) == ("max_output_tokens" if cut else None)
    assert out.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert out.usage.output_tokens == expected["usage"]["completion_tokens"]
    assert out.instructions == "Be brief." and out.max_output_tokens == 16
    again = client.responses.create(**kwargs)  # the same request: its prompt held but the last token
    assert again.usage.input_tokens_details.cached_tokens == out.usage.input_tokens - 1


def test_a_streamed_response_is_the_same_as_a_whole_one(client):
    kwargs = dict(model="m", input=[{"role": "developer", "content": "You are terse."},
                                    {"role": "user", "content": [{"type": "input_text", "text": "Count to five."}]}],
                  max_output_tokens=20, temperature=0)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text == "".join(e.delta for e in events
                                                             if e.type == "response.output_text.delta")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == whole.status
    # a message announced empty, its part then added: a client building it from the events had two parts
    added = next(e for e in events if e.type == "response.output_item.added" and e.item.type == "message")
    assert added.item.content == [] and len(final.output[-1].content) == 1
    cut = client.responses.create(**{**kwargs, "max_output_tokens": 2})  # cut: the message too, as OpenAI's
    assert cut.status == "incomplete" and cut.output[-1].status == "incomplete"
    seeded = {**kwargs, "temperature": 1.0, "extra_body": {"seed": 11}}  # llama-server passes a seed on
    assert client.responses.create(**seeded).output_text == client.responses.create(**seeded).output_text


def test_a_function_chosen_is_a_function_call_item_whole_and_streamed(client):
    kwargs = dict(model="m", input="What is the weather in Paris?", tools=[WEATHER, {"type": "web_search"}],
                  tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64, temperature=0)
    out = client.responses.create(**kwargs)
    calls = [item for item in out.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    with client.responses.stream(**kwargs) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    streamed = [item for item in final.output if item.type == "function_call"]
    assert streamed[0].arguments == calls[0].arguments and streamed[0].name == "get_weather"
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types


def test_a_conversation_with_a_call_and_its_output_continues_as_the_chat_would(client, engine):
    arguments = json.dumps({"city": "Paris"})
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}]
    chat = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    out = client.responses.create(model="m", input=items, tools=[WEATHER], max_output_tokens=12, temperature=0)
    expected = greedy_chat(engine, chat, 12, tools=[CHAT_WEATHER])
    assert out.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert client.responses.input_tokens.count(model="m", input=items, tools=[WEATHER]).input_tokens == \
        expected["usage"]["prompt_tokens"]
    counted = client.post("/chat/completions/input_tokens", cast_to=object,
                          body={"messages": chat, "tools": [CHAT_WEATHER]})  # llama-server's
    assert counted == {"object": "response.input_tokens", "input_tokens": expected["usage"]["prompt_tokens"]}
    assert out.output_text == (expected["choices"][0]["message"]["content"] or "")


def test_a_json_schema_format_constrains_the_text(client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    out = client.responses.create(model="m", input="2 + 2?", max_output_tokens=48,
                                  text={"format": {"type": "json_schema", "name": "sum", "schema": schema}})
    if out.status == "completed":
        assert isinstance(json.loads(out.output_text)["answer"], int)
    else:
        assert out.output_text.startswith("{")


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "bogus"}]}, "input[0]"),
    ({"input": [{"role": {"a": 1}, "content": "hi"}]}, "input[0]"),  # a 500 (found by fuzzing the bodies)
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "objekt"}}}}, "text.format.schema"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "seed": "3"}, "seed"),
    ({"input": "x", "instructions": 5}, "instructions"),
    ({"input": "x", "max_output_tokens": -3}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": "3"}, "max_output_tokens"),
    ({"input": "x", "model": [None]}, "model"),
    ({"input": "x", "tools": [{"type": False}, {"type": "function", "name": "f", "parameters": {}}]}, "tools[0]"),
])
def test_bad_requests_are_400s_naming_what(server, body, param):
    status, answer = request("POST", server + "/v1/responses", json.dumps({"model": "m", **body}).encode(), key=None)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert param in answer["error"]["message"], answer  # the name the client sent


def test_openais_client_raises_its_own_error(client):
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input="x", previous_response_id="resp_1")
    out = client.responses.create(model="m", input="hi", max_output_tokens=4, store=False, metadata={"k": "v"},
                                  reasoning={"effort": "low"}, include=["reasoning.encrypted_content"])
    assert out.metadata == {"k": "v"} and out.status in ("completed", "incomplete")
