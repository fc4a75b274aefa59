"""The JSON body of an OpenAI request, checked and turned into Engine keyword arguments.

Every parameter is known by name: one the Engine does not implement is refused (400, naming it)
rather than silently ignored, except at the value that means "off" (clients send some of those by
default, e.g. `n: 1`, `presence_penalty: 0`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import get_args, get_type_hints

from pyedgemoe.generation import SamplingParams, exposed_fields
from pyedgemoe.server.openai_errors import APIError


def _invalid(name: str, what: str, value) -> APIError:
    return APIError(400, f"'{name}' must be {what}, got {json.dumps(value)}", "invalid_value", name)


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _invalid(name, "a number", value)
    return float(value)


def _integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(name, "an integer", value)
    return value


def _boolean(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise _invalid(name, "true or false", value)
    return value


def _text(name: str, value) -> str:
    if not isinstance(value, str):
        raise _invalid(name, "a string", value)
    return value


def _schema(name: str, value) -> str | dict | bool:
    """A JSON schema: an object (or true/false), or its JSON text."""
    if not isinstance(value, (str, dict, bool)):
        raise _invalid(name, "a JSON schema (an object)", value)
    return value


def _response_format(name: str, value) -> dict:
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", ...}; the Engine
    checks the rest (structured_output.py)."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _invalid(name, 'an object with a "type"', value)
    return value


def _logprobs_count(name: str, value) -> int:
    value = _integer(name, value)
    if value < 0:
        raise _invalid(name, "an integer >= 0", value)
    return value


def _max_tokens(name: str, value) -> int:
    value = _integer(name, value)
    if value < 0:
        raise _invalid(name, "an integer >= 0", value)
    return value


def _stop(name: str, value) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _invalid(name, "a non-empty string or a list of them", value)
    return stops


def _prompt(name: str, value) -> str | list[int]:
    """A string, a list of token ids, or a list of one of either (OpenAI's batch of prompts,
    of which this server takes one)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str) and value:
        return value
    if (isinstance(value, list) and value
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)):
        return value
    raise _invalid(name, "a non-empty string or list of token ids (one prompt)", value)


def _content(i: int, value) -> str:
    """A message's text: a string, or OpenAI's list of parts, all of type text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise _invalid(f"messages[{i}].content", "a string or a list of text parts", value)


_MESSAGE_KEYS = {"role", "content", "name"}


def _messages(name: str, value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _invalid(name, "a non-empty list of messages", value)
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise _invalid(f"messages[{i}]", "an object with 'role' and 'content'", m)
        unknown = sorted(set(m) - _MESSAGE_KEYS)
        if unknown:
            raise APIError(400, f"unsupported field(s) in messages[{i}]: {', '.join(unknown)}",
                           "unknown_parameter", f"messages[{i}]")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise _invalid(f"messages[{i}].role", "a string", m.get("role"))
        if "content" not in m:
            raise APIError(400, f"messages[{i}] has no 'content'", "missing_required_parameter",
                           f"messages[{i}].content")
        out.append({"role": m["role"], "content": _content(i, m["content"])})
    return out


# name -> check (returns the value the Engine gets), for what both endpoints take: the sampling
# settings (SamplingParams' fields with a flag, by their type; a JSON schema may be an object) and
# the stop strings
_BY_TYPE = {float: _number, int: _integer, str: _text}


def _field_check(name: str):
    """The check of a SamplingParams field, by its type (an optional one's: the type it holds)."""
    hint = get_type_hints(SamplingParams)[name]
    return _BY_TYPE[next(t for t in get_args(hint) if t is not type(None)) if get_args(hint) else hint]


_SAMPLING = {**{f.name: _field_check(f.name) for f in exposed_fields()}, "json_schema": _schema, "stop": _stop}
_COMMON = {"model": None, "stream": _boolean, "max_tokens": _max_tokens, **_SAMPLING}
# accepted and ignored: they change nothing generated
_IGNORED = {"user", "stream_options"}
# OpenAI parameters accepted only at the value(s) meaning "off"
_NEUTRAL = {"n": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": (None, {}),
            "echo": (False,), "best_of": (1,), "suffix": (None,), "tools": (None, [])}
# logprobs: a completion's is the count of most likely tokens (OpenAI's completions), a chat's a
# switch with top_logprobs the count (OpenAI's chat)
COMPLETION_PARAMETERS = {**_COMMON, "prompt": _prompt, "logprobs": _logprobs_count}
CHAT_PARAMETERS = {**_COMMON, "messages": _messages, "max_completion_tokens": _max_tokens, "logprobs": _boolean,
                   "top_logprobs": _logprobs_count, "response_format": _response_format}


@dataclass
class GenerationRequest:
    """What a completion or chat request asks for: the prompt (or messages) and the Engine's
    keyword arguments for it; only those given, so the Engine's defaults hold for the rest."""
    model: str | None
    stream: bool
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    engine_kwargs: dict = field(default_factory=dict)


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", "invalid_json")
    return body


def parse_generation(body: dict, parameters: dict, required: str) -> GenerationRequest:
    """Checks body against parameters (COMPLETION_PARAMETERS or CHAT_PARAMETERS); required is the
    one that must be there ("prompt" or "messages")."""
    unknown = sorted(k for k in body if k not in parameters and k not in _IGNORED and k not in _NEUTRAL)
    if unknown:
        raise APIError(400, f"unknown parameter(s): {', '.join(unknown)}", "unknown_parameter", unknown[0])
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise APIError(400, f"'{name}' = {json.dumps(body[name])} is not supported (only "
                           f"{' or '.join(json.dumps(v) for v in neutral)})", "unsupported_parameter", name)
    if required not in body:
        raise APIError(400, f"'{required}' is required", "missing_required_parameter", required)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _invalid("model", "a string", model)
    request = GenerationRequest(model=model, stream=False)
    for name, value in body.items():
        check = parameters.get(name)
        if check is None or value is None:  # null: as if not given (OpenAI's defaults are the Engine's)
            continue
        value = check(name, value)
        if name == "stream":
            request.stream = value
        elif name == "prompt":
            request.prompt = value
        elif name == "messages":
            request.messages = value
        elif name == "max_completion_tokens":  # chat's newer name for max_tokens
            request.engine_kwargs["max_tokens"] = value
        else:
            request.engine_kwargs[name] = value
    if request.prompt is None and request.messages is None:
        raise APIError(400, f"'{required}' is required", "missing_required_parameter", required)
    return request
