"""llama-cpp-python's chat handlers' common steps (llama_cpp.llama_chat_format, MIT), for the
handlers ported onto Llama.create_completion (chatml_function_calling, named_chat_formats): the
grammar of a response format or of a function's arguments, and
a text completion (or its chunks) as a chat completion, or as a call of a named function, in its
shapes."""
from __future__ import annotations

import json
from typing import Iterator

from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.structured_output import JSON_GRAMMAR, schema_grammar
from pyedgemoe.tool_calls import EMPTY_DELTA, call_delta, call_message


def response_grammar(response_format, grammar):
    """response_format's grammar where it is {"type": "json_object"} (with a "schema": its), else grammar."""
    if response_format is not None and response_format.get("type") == "json_object":
        return json_grammar(response_format["schema"]) if "schema" in response_format else JSON_GRAMMAR
    return grammar


def json_grammar(schema) -> str:
    """The grammar of a schema, any JSON where llama.cpp's converter cannot convert it (as there)."""
    try:
        return schema_grammar(json.dumps(schema))
    except (InvalidOptionError, TypeError):
        return JSON_GRAMMAR


def arguments_grammar(tool: dict) -> str:
    """The grammar of a function's arguments: its parameters' schema."""
    return json_grammar(tool["function"].get("parameters"))


def _chat_logprobs(logprobs: dict | None) -> dict | None:
    """A completion's logprobs in the chat's shape, as there (the tokens' bytes not given)."""
    if logprobs is None:
        return None
    return {"content": [{"token": token, "bytes": None, "logprob": logprob,
                         "top_logprobs": [{"token": t, "logprob": p, "bytes": None} for t, p in top.items()]}
                        for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                                       logprobs["top_logprobs"])],
            "refusal": None}


def as_chat(completion, stream: bool):
    """A text completion (or its chunks) as the assistant's message."""
    if stream:
        return _chat_chunks(completion)
    choice = completion["choices"][0]
    return {"id": "chat" + completion["id"], "object": "chat.completion", "created": completion["created"],
            "model": completion["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": choice["text"]},
                         "logprobs": _chat_logprobs(choice["logprobs"]), "finish_reason": choice["finish_reason"]}],
            "usage": completion["usage"]}


def _chunk(chunk: dict, delta: dict, finish_reason, logprobs) -> dict:
    return {"id": "chat" + chunk["id"], "model": chunk["model"], "created": chunk["created"],
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def _chat_chunks(chunks: Iterator[dict]) -> Iterator[dict]:
    for i, chunk in enumerate(chunks):
        choice = chunk["choices"][0]
        if i == 0:
            yield _chunk(chunk, {"role": "assistant"}, None, None)
        yield _chunk(chunk, {"content": choice["text"]} if choice["finish_reason"] is None else {},
                     choice["finish_reason"], _chat_logprobs(choice["logprobs"]))


def as_call(name: str, completion, stream: bool):
    """A completion (or its chunks) as a call of function name."""
    return _call_stream(name, completion) if stream else _call(name, completion)


def _call(name: str, completion: dict) -> dict:
    choice = completion["choices"][0]
    return {"id": "chat" + completion["id"], "object": "chat.completion", "created": completion["created"],
            "model": completion["model"],
            "choices": [{"index": 0,
                         "message": call_message(name, choice["text"], f"call__0_{name}_{completion['id']}"),
                         "logprobs": _chat_logprobs(choice["logprobs"]), "finish_reason": "tool_calls"}],
            "usage": completion["usage"]}


def _call_stream(name: str, chunks: Iterator[dict]) -> Iterator[dict]:
    """Every chunk's text as a piece of the call's arguments (the last, empty one too), after an
    empty delta, then the finish reason: llama-cpp-python's stream of a named function's call."""
    last = None
    for chunk in chunks:
        if last is None:
            yield _chunk(chunk, {**EMPTY_DELTA, "role": "assistant"}, None, None)
        last = chunk
        call_id = f"call__0_{name}_{chunk['id']}"
        yield _chunk(chunk, call_delta(name, chunk["choices"][0]["text"], call_id), None,
                     _chat_logprobs(chunk["choices"][0]["logprobs"]))
    if last is not None:
        yield _chunk(last, EMPTY_DELTA, "tool_calls", None)
