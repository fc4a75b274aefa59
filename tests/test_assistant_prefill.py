"""llama-server's continuation of an assistant's message (continue_final_message, its default
prefill_assistant; `serve --no-prefill-assistant`) and add_generation_prompt: the prompt ends with the
last message, the assistant's, and the answer is what the model writes after it (Anthropic's
prefill; llama.cpp's web UI's "continue"). The prompt is llama.cpp's rendering (its chat formats),
the answer the greedy continuation of that prompt."""
from __future__ import annotations

import json

import openai
import pytest

from pyedgemoe.chat_formats import joined_message
from pyedgemoe.completions import chat_text, chat_text_tokens
from pyedgemoe.errors import InvalidOptionError
from test_chat_formats import ASKED, engine, model  # noqa: F401 (fixtures)
from test_server import request, start_server, stop_server

PREFILL = "The weather in Paris is"
STARTED = [*ASKED, {"role": "assistant", "content": PREFILL}]


def greedy_after(engine, prompt: str, n: int) -> str:
    return engine.generate(chat_text_tokens(engine, prompt), n, temperature=0)


def test_the_last_message_is_continued(engine):
    prompt = chat_text(engine, STARTED, continue_final_message=True)[0]
    assert prompt.endswith(PREFILL) and not prompt.endswith("<|im_start|>assistant\n")
    expected = greedy_after(engine, prompt, 8)
    for value in (True, "content"):
        message = engine.create_chat_completion(STARTED, max_tokens=8, temperature=0,
                                                continue_final_message=value)["choices"][0]["message"]
        assert message == {"role": "assistant", "content": expected}
    chunks = list(engine.create_chat_completion(STARTED, max_tokens=8, temperature=0, continue_final_message=True,
                                                stream=True))
    assert joined_message([c["choices"][0]["delta"] for c in chunks[1:-1]])["content"] == expected
    # without it, a new message follows (llama-cpp-python's way, the Engine's default)
    assert engine.format_chat(STARTED).endswith("<|im_start|>assistant\n")


def test_no_generation_prompt(engine):
    prompt = chat_text(engine, ASKED, add_generation_prompt=False)[0]
    assert prompt.endswith("What is the weather in Paris?<|im_end|>\n")
    assert engine.create_chat_completion(ASKED, max_tokens=6, temperature=0, add_generation_prompt=False)[
        "choices"][0]["message"]["content"] == greedy_after(engine, prompt, 6).lstrip()  # as llama.cpp's parser


@pytest.mark.parametrize("messages, kwargs, fragment", [
    (STARTED, {"continue_final_message": "all"}, "continue_final_message must be true"),
    (STARTED, {"continue_final_message": True, "add_generation_prompt": True}, "not both"),
    (ASKED, {"continue_final_message": True}, "must be the assistant's"),
    ([*STARTED[:1], {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}], {"continue_final_message": True}, "with tool calls"),
    ([*STARTED, {"role": "assistant", "content": "x"}], {"continue_final_message": True}, "two assistant's"),
])
def test_what_cannot_be_continued_is_refused(engine, messages, kwargs, fragment):
    with pytest.raises(InvalidOptionError, match=fragment):
        engine.create_chat_completion(messages, max_tokens=2, **kwargs)


def test_the_server_prefills_as_llama_server(model, engine, tmp_path):
    continued = engine.create_chat_completion(STARTED, max_tokens=8, temperature=0,
                                              continue_final_message=True)["choices"][0]["message"]["content"]
    anew = engine.create_chat_completion(STARTED, max_tokens=8, temperature=0)["choices"][0]["message"]["content"]
    assert continued != anew
    proc, url = start_server(tmp_path / "server.log", "-t", "1", "-c", "1024", model=model)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        kwargs = dict(model="qwen3-tools.gguf", messages=STARTED, max_tokens=8, temperature=0)
        assert client.chat.completions.create(**kwargs).choices[0].message.content == continued  # the default
        streamed = client.chat.completions.create(**kwargs, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == continued
        assert client.chat.completions.create(**kwargs, extra_body={"continue_final_message": False}) \
            .choices[0].message.content == anew
        ui = {"continue_final_message": True, "add_generation_prompt": False}  # llama.cpp's web UI's "continue"
        assert client.chat.completions.create(**kwargs, extra_body=ui).choices[0].message.content == continued
        status, applied = request("POST", url + "/apply-template", json.dumps({"messages": STARTED}).encode())
        assert status == 200 and applied["prompt"].endswith(PREFILL)
        anthropic = {"model": "x", "max_tokens": 8, "temperature": 0, "messages": STARTED}  # Anthropic's prefill
        status, body = request("POST", url + "/v1/messages", json.dumps(anthropic).encode())
        assert status == 200 and body["content"][0]["text"] == continued
        for bad, field in (({"continue_final_message": "all"}, "continue_final_message"),
                           ({"continue_final_message": True, "add_generation_prompt": True}, "not both")):
            with pytest.raises(openai.BadRequestError, match=field):
                client.chat.completions.create(**kwargs, extra_body=bad)
    finally:
        stop_server(proc)
    proc, url = start_server(tmp_path / "server2.log", "-t", "1", "-c", "1024", "--no-prefill-assistant", model=model)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        assert client.chat.completions.create(model="qwen3-tools.gguf", messages=STARTED, max_tokens=8,
                                              temperature=0).choices[0].message.content == anew
    finally:
        stop_server(proc)
