"""The JSON body of an OpenAI request, checked and turned into Engine keyword arguments.

Every parameter is known by name: one the Engine does not implement is refused (400, naming it)
rather than silently ignored, except at the value that means "off" (clients send some of those by
default, e.g. `n: 1`, `presence_penalty: 0`).
"""
from __future__ import annotations

import itertools
import json
import math
import re
import sys
from dataclasses import dataclass, field
from typing import get_args, get_type_hints

from pyedgemoe.chat_formats import REASONING_FORMATS
from pyedgemoe.errors import ContextOverflowError, InvalidOptionError
from pyedgemoe.generation import RANDOM_SEED, SAMPLER_NAMES, SamplingParams, exposed_fields, sampler_order
from pyedgemoe.server.limits import (INT32_MAX, MAX_EMBEDDING_INPUTS, MAX_JSON_CONTAINERS, MAX_JSON_DEPTH,
                                     MAX_JSON_VALUES, MAX_LOGIT_BIAS, MAX_STOP_CHARS,
                                     MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, UINT32_MAX)
from pyedgemoe.server.openai_errors import APIError, from_engine_error
from pyedgemoe.structured_output import schema_grammar, schema_text
from pyedgemoe.tool_calls import from_functions


def _shown(value) -> str:
    """value as JSON, cut short: an error message quotes what was sent, not megabytes of it."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def invalid(name: str, what: str, value) -> APIError:
    return APIError(400, f"'{name}' must be {what}, got {_shown(value)}", "invalid_value", name)


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(name, "a number", value)
    return float(value)


def _any_integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, "an integer", value)
    return value


def _in_range(kind: type, low: float, high: float, low_open: bool = False):
    """The check of a number (kind float) or an integer (kind int) with low <= value <= high (low < value
    when low_open): its one message states the range."""
    check, what = (_number, "a number") if kind is float else (_any_integer, "an integer")

    def checked(name: str, value):
        value = check(name, value)
        if value > high or value < low or (low_open and value == low):
            raise invalid(name, f"{what} in {'(' if low_open else '['}{_bound(low)}, {_bound(high)}]", value)
        return value
    return checked


# an integer that llama.cpp's int32 holds (a larger one is no setting anyone means)
_integer = _in_range(int, -INT32_MAX, INT32_MAX)


def _bound(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def _one_of(choices: tuple[str, ...]):
    def checked(name: str, value) -> str:
        if value not in choices:
            raise invalid(name, "one of " + ", ".join(f'"{c}"' for c in choices), value)
        return value
    return checked


def _of_type(kind: type, what: str):
    """The check that a value is a kind (what: its name in the error)."""
    def checked(name: str, value):
        if not isinstance(value, kind):
            raise invalid(name, what, value)
        return value
    return checked


_boolean = _of_type(bool, "true or false")
_text = _of_type(str, "a string")
_object = _of_type(dict, "an object")


def _continuation(name: str, value) -> bool | str:
    """llama-server's continue_final_message: true, false, "content" or "reasoning_content"."""
    if not (isinstance(value, bool) or value in ("content", "reasoning_content")):
        raise invalid(name, 'true, false, "content" or "reasoning_content"', value)
    return value


def _effort(name: str, value) -> str:
    """OpenAI's reasoning_effort: a level the template takes ("low", "medium", "high", ...; "none")."""
    if not isinstance(value, str) or not value or len(value) > 32:
        raise invalid(name, 'a level such as "low", "medium", "high" or "none"', value)
    return value
_tools = _of_type(list, "a list of tools")  # each tool checked by the Engine (pyedgemoe.tool_calls)


def _schema(name: str, value) -> str | dict | bool:
    """A JSON schema: an object (or true/false), or its JSON text."""
    if not isinstance(value, (str, dict, bool)):
        raise invalid(name, "a JSON schema (an object)", value)
    return value


def schema_checked(name: str, schema: dict | bool) -> dict | bool:
    """A schema given under `name`, checked where it came in: the grammar built from it later would
    name the chat's json_schema, not the request's field. An empty one is any object (completions.py)."""
    try:
        if schema != {}:
            schema_grammar(schema_text(schema, name), name)
    except InvalidOptionError as e:
        raise APIError(400, str(e), "invalid_value", name) from None
    return schema


def _response_format(name: str, value) -> dict:
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", ...}; the Engine
    checks the rest (structured_output.py)."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid(name, 'an object with a "type"', value)
    spec = value.get("json_schema")
    if value["type"] == "json_schema" and isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
        schema_checked(f"{name}.json_schema.schema", spec["schema"])
    return value


def _logit_bias(name: str, value) -> dict[int, float]:
    """OpenAI's logit_bias: {token id (its text, as JSON's keys are): bias in [-100, 100]}; each id
    in the vocabulary (the Engine checks)."""
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise invalid(name, f"an object of at most {MAX_LOGIT_BIAS} token ids and their biases", value)
    out = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and int(key) <= INT32_MAX):
            raise invalid(name, "an object whose keys are token ids", value)
        out[int(key)] = _in_range(float, -100, 100)(f"{name}[{key}]", bias)
    return out


_logprobs_count = _in_range(int, 0, MAX_TOP_LOGPROBS)
check_max_tokens = _in_range(int, -1, INT32_MAX)  # -1: until the end (llama-server's n_predict), as null


def check_stop(name: str, value) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid(name, "a non-empty string or a list of them", value)
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise invalid(name, f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters", value)
    return stops


def _is_token_ids(value) -> bool:
    """A list of integers that llama.cpp's token ids (int32, not negative) can be."""
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX
                                           for t in value)


def _prompt(name: str, value) -> str | list[int]:
    """A string, a list of token ids, or a list of one of either (OpenAI's batch of prompts,
    of which this server takes one)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str) and value:
        return value
    if value and _is_token_ids(value):
        return value  # each in the vocabulary: PromptBound.check_tokens
    raise invalid(name, f"a non-empty string or list of token ids in [0, {INT32_MAX}] (one prompt)", value)


def _content(i: int, value) -> str:
    """A message's text: a string, or OpenAI's list of parts, all of type text, one a line after the
    first that has text (llama-server's concat_content_parts)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        text = ""
        for p in value:
            text += f"\n{p['text']}" if text else p["text"]
        return text
    raise invalid(f"messages[{i}].content", "a string or a list of text parts", value)


_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
# OpenAI's fields of an assistant's message that its SDK's model_dump() writes, sent back as they are
_ECHOED_MESSAGE_KEYS = {"refusal", "audio", "function_call", "annotations"}


def _is_echo(m: dict, key: str) -> bool:
    """Whether m[key] (an _ECHOED_MESSAGE_KEYS') says nothing the message does not: null, no
    annotations (OpenAI's answer has an empty list), or the legacy function_call of the message's
    first tool call (a forced call's answer has both, tool_calls.call_message)."""
    value = m[key]
    if value is None or key == "annotations" and value == []:
        return True
    calls = m.get("tool_calls")
    return key == "function_call" and isinstance(calls, list) and bool(calls) and _is_tool_call(calls[0]) and \
        value == {"name": calls[0]["function"]["name"], "arguments": calls[0]["function"].get("arguments", "")}


def _messages(name: str, value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise invalid(name, "a non-empty list of messages", value)
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", "an object with 'role' and 'content'", m)
        unknown = sorted(set(m) - _MESSAGE_KEYS - {k for k in _ECHOED_MESSAGE_KEYS if k in m and _is_echo(m, k)})
        if unknown:
            raise APIError(400, f"unsupported field(s) in messages[{i}]: {', '.join(unknown)}",
                           "unknown_parameter", f"messages[{i}]")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise invalid(f"messages[{i}].role", "a string", m.get("role"))
        calls = m.get("tool_calls")
        if calls is not None:  # the assistant's earlier calls: its content may be null
            if not (isinstance(calls, list) and all(_is_tool_call(c) for c in calls)):
                raise invalid(f"messages[{i}].tool_calls", 'a list of {"id": ..., "type": "function", "function": '
                               '{"name": ..., "arguments": "..."}}', calls)
        elif "content" not in m:
            raise APIError(400, f"messages[{i}] has no 'content'", "missing_required_parameter",
                           f"messages[{i}].content")
        if "tool_call_id" in m and not isinstance(m["tool_call_id"], str):
            raise invalid(f"messages[{i}].tool_call_id", "a string", m["tool_call_id"])
        if not isinstance(m.get("reasoning_content", ""), (str, type(None))):  # llama-server's: the thoughts
            raise invalid(f"messages[{i}].reasoning_content", "a string", m["reasoning_content"])
        message = {k: v for k, v in m.items() if k in ("role", "tool_calls", "tool_call_id", "reasoning_content")
                   and v is not None}
        content = m.get("content")
        out.append({**message, "content": None if content is None and calls is not None else _content(i, content)})
    return out


def _is_tool_call(call) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return (isinstance(function, dict) and call.get("type", "function") == "function"
            and isinstance(function.get("name"), str) and isinstance(function.get("arguments", ""), str))


def _tool_choice(name: str, value) -> str | dict:
    if not isinstance(value, (str, dict)):
        raise invalid(name, '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}', value)
    return value


def _function_call(name: str, value) -> str | dict:
    if not (value in ("none", "auto") or isinstance(value, dict) and set(value) == {"name"}
            and isinstance(value["name"], str)):
        raise invalid(name, '"none", "auto" or {"name": ...}', value)
    return value


# name -> check (returns the value the Engine gets), for what both endpoints take: the sampling
# settings (SamplingParams' fields with a flag, by their type, within OpenAI's ranges where it has
# them, else the Engine's; a JSON schema may be an object) and the stop strings
_BY_TYPE = {float: _number, int: _integer, str: _text}
_RANGES = {"temperature": _in_range(float, 0, 2), "top_k": _integer,
           "top_p": _in_range(float, 0, 1),
           "typical_p": _in_range(float, 0, 1, low_open=True), "min_p": _in_range(float, 0, 1),
           "repeat_penalty": _in_range(float, 0, 1e6, low_open=True), "seed": _in_range(int, RANDOM_SEED, UINT32_MAX),
           "frequency_penalty": _in_range(float, -2, 2), "presence_penalty": _in_range(float, -2, 2),
           "mirostat_mode": _in_range(int, 0, 2), "mirostat_tau": _in_range(float, 0, 1e6),
           "mirostat_eta": _in_range(float, 0, 1e6), "reasoning_budget_tokens": _in_range(int, -1, INT32_MAX)}


def _field_check(name: str):
    """The check of a SamplingParams field: its range, else by its type (an optional one's: the
    type it holds)."""
    if name in _RANGES:
        return _RANGES[name]
    hint = get_type_hints(SamplingParams)[name]
    return _BY_TYPE[next(t for t in get_args(hint) if t is not type(None)) if get_args(hint) else hint]


def _breakers(name: str, value) -> list[str]:
    """DRY's sequence breakers: at most MAX_STOP_STRINGS strings of at most MAX_STOP_CHARS characters."""
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value) or \
            len(value) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in value):
        raise invalid(name, f"a list of at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} "
                       "characters", value)
    return value


def _samplers(name: str, value) -> str:
    """llama.cpp's sampler order: a list of names, or their letters ("kpt")."""
    try:
        return sampler_order(value)
    except InvalidOptionError:
        raise invalid(name, "llama.cpp's samplers in an order, a list of their names or a string of their letters "
                       f"({', '.join(SAMPLER_NAMES)}; {''.join(SAMPLER_NAMES.values())})", value) from None


_SAMPLING = {**{f.name: _field_check(f.name) for f in exposed_fields()}, "json_schema": _schema, "stop": check_stop,
             "logit_bias": _logit_bias, "dry_sequence_breakers": _breakers, "samplers": _samplers}
# max_tokens and its other names (chat's newer one; llama-server's)
_LENGTHS = ("max_tokens", "max_completion_tokens", "n_predict")
# the reasoning budget's names (llama-server's: the first before the second; -1 is the server's default)
_BUDGETS = ("reasoning_budget_tokens", "thinking_budget_tokens")
_COMMON = {"model": None, "stream": _boolean, "max_tokens": check_max_tokens, "n_predict": check_max_tokens,
           "timings_per_token": _boolean, "return_progress": _boolean, **_SAMPLING}


def _stream_options(name: str, value) -> dict:
    """OpenAI's stream_options: include_usage (a last chunk of the usage, with no choices)."""
    if not (isinstance(value, dict) and set(value) <= {"include_usage", "include_obfuscation"}
            and all(isinstance(v, bool) for v in value.values())):
        raise invalid(name, '{"include_usage": true or false}', value)
    return value


# accepted and ignored (they change nothing generated), their values checked as their senders'
# servers check them: OpenAI's (stream_options: where the endpoint is not OpenAI's), llama-server's
# that its web UI sends (its streaming options, how it shows a reasoning model's thoughts), and the
# prompt's time limit code editors' plugins send (which llama-server does not implement either)
_IGNORED = {"user": _text, "stream_options": _stream_options, "cache_prompt": _boolean,
            "sse_ping_interval": _in_range(int, -1, INT32_MAX), "backend_sampling": _boolean,
            "t_max_prompt_ms": _integer}


# OpenAI parameters accepted only at the value(s) meaning "off"
_NEUTRAL = {"n": (1,), "echo": (False,), "best_of": (1,)}
# logprobs: a completion's is the count of most likely tokens (OpenAI's completions), a chat's a
# switch with top_logprobs the count (OpenAI's chat)
# (a suffix: the prompt is the text before a gap for the model to fill, fill_in_middle.py)
COMPLETION_PARAMETERS = {**_COMMON, "prompt": _prompt, "suffix": _text, "logprobs": _logprobs_count,
                         "stream_options": _stream_options}
CHAT_PARAMETERS = {**_COMMON, "messages": _messages, "stream_options": _stream_options,
                   "max_completion_tokens": check_max_tokens, "logprobs": _boolean, "top_logprobs": _logprobs_count,
                   "response_format": _response_format, "tools": _tools, "tool_choice": _tool_choice, "functions": _of_type(list, "a list of functions"),
                   "function_call": _function_call, "parallel_tool_calls": _boolean, "chat_template_kwargs": _object,
                   "reasoning_format": _one_of(REASONING_FORMATS), "reasoning_effort": _effort,
                   "thinking_budget_tokens": _RANGES["reasoning_budget_tokens"],
                   "reasoning_control": _boolean,  # (server/reasoning_control.py)
                   "continue_final_message": _continuation, "add_generation_prompt": _boolean}


def _native_prompt(name: str, value) -> str | list[int | str]:
    """llama-server's prompt: a string, token ids, or a list mixing strings and token ids (one
    prompt; a list of one such list is taken as it)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(p, str) or _is_token_ids([p]) for p in value):
        return value
    raise invalid(name, f"a non-empty string, or a list of strings and token ids in [0, {INT32_MAX}] (one "
                   "prompt)", value)


def _native_logit_bias(name: str, value) -> list[tuple[int | str, float]]:
    """llama-server's logit_bias: [[token, bias], ...] or {token: bias}, a token an id or a text (each
    of its tokens biased), a bias a number or false (never)."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    what = f"[[token, bias], ...] or {{token: bias}} of at most {MAX_LOGIT_BIAS} tokens (an id or a text; a bias a " \
           "number or false)"
    if not isinstance(pairs, list) or len(pairs) > MAX_LOGIT_BIAS or \
            not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise invalid(name, what, value)
    out = []
    for key, bias in pairs:
        key = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if not (isinstance(key, str) or _is_token_ids([key])):
            raise invalid(name, what, value)
        out.append((key, -math.inf if bias is False else _number(f"{name}[{key}]", bias)))
    return out


def _extra_context(name: str, value) -> list[dict]:
    """llama-server's input_extra: [{"text": ..., "filename": ...}, ...] (a filename optional)."""
    if not isinstance(value, list) or not all(
            isinstance(c, dict) and isinstance(c.get("text"), str) and isinstance(c.get("filename", ""), str)
            and set(c) <= {"text", "filename"} for c in value):
        raise invalid(name, 'a list of {"text": string, "filename": string}', value)
    return value


def _paths(name: str, value) -> list[str]:
    """llama-server's response_fields: the answer's fields to keep, as paths ("timings/prompt_n")."""
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value) or len(value) > MAX_STOP_STRINGS * 4:
        raise invalid(name, f"a list of at most {MAX_STOP_STRINGS * 4} field paths", value)
    return value


# llama-server's own /completion: its names (mirostat, repeat_last_n, n_probs or logprobs) besides
# the sampling settings, and a prompt that may mix text and token ids; /infill adds the text around
# the gap (input_prefix, input_suffix), other files (input_extra) and the gap's start (prompt)
NATIVE_COMPLETION_PARAMETERS = {
    **_COMMON, "max_completion_tokens": check_max_tokens, "prompt": _native_prompt, "logit_bias": _native_logit_bias,
    "n_probs": _logprobs_count, "logprobs": _logprobs_count, "ignore_eos": _boolean, "return_tokens": _boolean,
    "repeat_last_n": _in_range(int, -1, INT32_MAX), "mirostat": _RANGES["mirostat_mode"],
    "n_indent": _in_range(int, 0, INT32_MAX), "t_max_predict_ms": _in_range(int, 0, INT32_MAX),
    "response_fields": _paths}
INFILL_PARAMETERS = {**NATIVE_COMPLETION_PARAMETERS, "prompt": _text, "input_prefix": _text, "input_suffix": _text,
                     "input_extra": _extra_context}
# llama-server's settings accepted at the values that leave them off (its defaults)
NATIVE_NEUTRAL = {"id_slot": (-1, 0), "n_keep": (0,), "min_keep": (0,), "post_sampling_probs": (False,),
                  "n_cmpl": (1,), "lora": ([],)}


def _token_ids(name: str, value) -> list[int]:
    if not _is_token_ids(value):
        raise invalid(name, f"a list of token ids in [0, {INT32_MAX}]", value)
    return value  # each in the vocabulary: the Engine checks


# llama-server's /tokenize and /detokenize (token_routes.py): field -> (check, default; ... required)
TOKENIZE_PARAMETERS = {"content": (_text, ...), "add_special": (_boolean, False), "parse_special": (_boolean, True),
                       "with_pieces": (_boolean, False)}
DETOKENIZE_PARAMETERS = {"tokens": (_token_ids, ...)}
# llama-server's /slots/N?action=save and restore (slot_files.checked_filename checks the name)
SLOT_FILE_PARAMETERS = {"filename": (_text, ...)}
# llama-cpp-python's server's /extras/tokenize (and /count) and /extras/detokenize
EXTRAS_TOKENIZE_PARAMETERS = {"input": (_text, ...), "model": (_of_type(str, "a model's name"), None)}
EXTRAS_DETOKENIZE_PARAMETERS = {"tokens": (_token_ids, ...), "model": (_of_type(str, "a model's name"), None)}


def _embedding_inputs(name: str, value) -> list[str | list[int | str]]:
    """llama-server's embedding inputs (its tokenize_input_prompts): a string or a list holding token
    ids (one input: its token ids, or text and token ids mixed), else a list of such inputs."""
    if isinstance(value, str) or (isinstance(value, list) and any(_is_token_ids([p]) for p in value)):
        value = [value]
    what = f"a string, a list of token ids in [0, {INT32_MAX}] (and strings), or a list of at most " \
           f"{MAX_EMBEDDING_INPUTS} of those"
    if not isinstance(value, list) or len(value) > MAX_EMBEDDING_INPUTS:
        raise invalid(name, what, value)
    if not value:
        raise APIError(400, f"'{name}' must not be empty", "invalid_value", name)
    for p in value:
        if not (isinstance(p, str) or isinstance(p, list) and all(isinstance(q, str) or _is_token_ids([q]) for q in p)):
            raise invalid(name, what, value)
    return value


# llama-server's embeddings (embeddings_api.py): input (OpenAI's) or content (llama-server's own)
EMBEDDING_PARAMETERS = {"input": (_embedding_inputs, None), "content": (_embedding_inputs, None),
                        "model": (_of_type(str, "a model's name"), None), "user": (_text, None),
                        "encoding_format": (_one_of(("float", "base64")), "float"),
                        "embd_normalize": (_in_range(int, -1, 1000), 2)}


def refuse_unknown(body: dict, known) -> None:
    """A 400 naming the body's fields that are not in known."""
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise APIError(400, f"unknown parameter(s): {', '.join(unknown)}", "unknown_parameter", unknown[0])


def parse_fields(raw: bytes, fields: dict) -> dict:
    """A body's fields checked against fields ({name: (check, default)}), the defaults filled in."""
    body = parse_body(raw)
    refuse_unknown(body, fields)
    out = {}
    for name, (check, default) in fields.items():
        if name not in body and default is ...:
            raise APIError(400, f"'{name}' is required", "missing_required_parameter", name)
        out[name] = check(name, body[name]) if name in body else default
    return out


@dataclass
class GenerationRequest:
    """What a completion or chat request asks for: the prompt (or messages) and the Engine's
    keyword arguments for it; only those given, so the Engine's defaults hold for the rest."""
    model: str | None
    stream: bool
    include_usage: bool = False  # OpenAI's stream_options
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    engine_kwargs: dict = field(default_factory=dict)

    def text_bytes(self) -> int:
        """The bytes of the text the prompt is made of: the prompt's (its texts, beside token ids) and
        a suffix's, or the messages' contents, their tool calls, the tools and the template's variables
        (the template may show them all)."""
        prompt = self.prompt if isinstance(self.prompt, list) else [self.prompt or ""]
        shown = [m["content"] or "" for m in self.messages or ()] + [p for p in prompt if isinstance(p, str)]
        shown += [self.engine_kwargs.get("suffix") or ""]
        shown += [json.dumps(m["tool_calls"]) for m in self.messages or () if m.get("tool_calls")]
        shown += [json.dumps(self.engine_kwargs[k]) for k in ("tools", "chat_template_kwargs") if self.engine_kwargs.get(k)]
        return sum(len(text.encode()) for text in shown)


def parse_body(raw: bytes) -> dict:
    """The body as a JSON object, nested at most MAX_JSON_DEPTH deep, of at most MAX_JSON_CONTAINERS
    arrays and objects and MAX_JSON_VALUES values, every string of it text that UTF-8 can encode
    (JSON's escapes can write a lone surrogate, "\\ud800", which no tokenizer takes)."""
    _check_count(raw)
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_not_json)
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not UTF-8: {e.reason} at byte {e.start}", "invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", "invalid_json") from None
    except ValueError:  # an integer of more digits than Python converts
        raise APIError(400, f"the request body has an integer of more than {sys.get_int_max_str_digits()} digits",
                       "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", "invalid_json")
    _check_tree(body)
    return body


_JSON_STRING = re.compile(rb'"[^"]*"')  # once its escaped quotes and backslashes are taken out


def _check_count(raw: bytes) -> None:
    """A 400 for a body of more arrays and objects, or values, than the limits, counted outside its
    strings (where a bracket or comma is text), before Python's parser makes them; a string at a
    time (a regular expression over a whole string of escapes keeps a frame for each)."""
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in raw else raw  # no copies of most bodies
    containers = values = end = 0
    for string in itertools.chain(_JSON_STRING.finditer(text), [None]):
        start = len(text) if string is None else string.start()
        containers += text.count(b"{", end, start) + text.count(b"[", end, start)
        values += text.count(b",", end, start) + text.count(b":", end, start)
        if containers > MAX_JSON_CONTAINERS:
            raise APIError(400, f"the request body has more than {MAX_JSON_CONTAINERS} arrays and objects",
                           "invalid_json")
        if values >= MAX_JSON_VALUES:
            raise APIError(400, f"the request body has more than {MAX_JSON_VALUES} values", "invalid_json")
        end = string and string.end()


def _not_json(constant: str):
    """Python's json takes NaN and Infinity, which JSON has not (nor an answer that echoes them)."""
    raise APIError(400, f"the request body is not valid JSON: {constant} is no JSON value", "invalid_json")


def _check_tree(body: dict) -> None:
    """Walks body (without recursion): its depth, and each string and key UTF-8-encodable; a bad
    string is a 400 naming where it is (messages[0].content)."""
    todo: list = [(body, 1, None)]  # (value, depth, where: (the parent's where, key or index) or None)
    while todo:
        value, depth, where = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                name = _path(where)
                raise APIError(400, f"'{name}' is not text: it has a lone surrogate (\\u{ord(value[e.start]):04x})",
                               "invalid_value", name) from None
        elif isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", "invalid_json")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    todo.append((key, depth, (where, key)))
                if isinstance(item, (str, dict, list)):
                    todo.append((item, depth + 1, (where, key)))


def _path(where) -> str:
    """A value's place in the body, as messages[0].content."""
    parts = []
    while where is not None:
        where, key = where
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(reversed(parts)).lstrip(".")


def model_name(body: dict) -> str | None:
    """The body's model (null or missing: None), a 400 where it is no name."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "a string", model)
    return model


def parse_generation(body: dict, parameters: dict, required: str, neutral_values: dict | None = None) -> GenerationRequest:
    """Checks body against parameters (COMPLETION_PARAMETERS, CHAT_PARAMETERS, ...); required is the
    one that must be there ("prompt" or "messages"); neutral_values: the parameters taken only at
    these values (OpenAI's by default)."""
    neutral_values = _NEUTRAL if neutral_values is None else neutral_values
    refuse_unknown(body, {*parameters, *_IGNORED, *neutral_values})
    for name, neutral in neutral_values.items():
        if body.get(name) is not None and body[name] not in neutral:  # null: left out
            raise APIError(400, f"'{name}' = {_shown(body[name])} is not supported (only "
                           f"{' or '.join(json.dumps(v) for v in neutral)})", "unsupported_parameter", name)
    if body.get(required) is None:
        raise APIError(400, f"'{required}' is required", "missing_required_parameter", required)
    model = model_name(body)
    lengths = {name: body[name] for name in _LENGTHS if body.get(name) is not None}
    if len(set(map(json.dumps, lengths.values()))) > 1:  # which one holds would be a guess
        raise APIError(400, " and ".join(f"'{k}' ({_shown(v)})" for k, v in lengths.items()) + " disagree: give one",
                       "invalid_value", list(lengths)[-1])
    request = GenerationRequest(model=model, stream=False)
    budgets = {}
    for name, value in body.items():
        check = parameters.get(name)
        if check is None and value is not None and name in _IGNORED:
            _IGNORED[name](name, value)
        if check is None or value is None:  # null: as if not given (OpenAI's defaults are the Engine's)
            continue
        value = check(name, value)
        if name == "stream":
            request.stream = value
        elif name == "stream_options":
            request.include_usage = value.get("include_usage", False)
        elif name == "prompt":
            request.prompt = value
        elif name == "messages":
            request.messages = value
        elif name in _LENGTHS:
            request.engine_kwargs["max_tokens"] = None if value == -1 else value
        elif name in _BUDGETS:
            budgets[name] = value
        else:
            request.engine_kwargs[name] = value
    given = request.engine_kwargs
    if "reasoning_effort" in given:  # llama-server's: the template's reasoning_effort; "none": no thinking
        effort = given.pop("reasoning_effort")
        kwargs = {k: v for k, v in (given.get("chat_template_kwargs") or {}).items() if k != "reasoning_effort"}
        given["chat_template_kwargs"] = {**kwargs, "enable_thinking": False} if effort == "none" else \
            {**kwargs, "reasoning_effort": effort}
    budget = next((budgets[name] for name in _BUDGETS if budgets.get(name, -1) != -1), None)
    if budget is not None:
        given["reasoning_budget_tokens"] = budget
    if "functions" in given or "function_call" in given:  # OpenAI's legacy names of a chat's tools
        try:
            given["tools"], given["tool_choice"] = from_functions(given.pop("functions", None), given.pop(
                "function_call", None), given.get("tools"), given.get("tool_choice"))
        except InvalidOptionError as e:
            raise APIError(400, str(e), "invalid_value", "functions") from None
    return request


class PromptBound:
    """The longest prompt text that can fit the context: a token stands for at most the bytes of
    the longest piece of the vocabulary, so a text of more than n_ctx times those bytes needs more
    than n_ctx tokens. It is refused without being tokenized (a prompt of megabytes would take the
    tokenizer seconds); the Engine checks the exact count of a shorter one."""

    def __init__(self, engine) -> None:
        self.n_ctx = engine.n_ctx
        self.n_parallel, self.n_ctx_total = engine.n_parallel, engine._live().n_ctx  # the sequences sharing the context
        self.n_vocab = engine.n_vocab
        # special=True: a chat's template text is tokenized with its special tokens
        self.max_piece_bytes = max(1, max(len(engine.token_piece(t, special=True)) for t in range(self.n_vocab)))
        self.max_text_bytes = self.n_ctx * self.max_piece_bytes

    def check_text(self, n_bytes: int) -> None:
        if n_bytes > self.max_text_bytes:
            raise APIError(400, f"the prompt of {n_bytes} bytes cannot fit the context of {self.n_ctx} tokens (a "
                           f"token of this model stands for at most {self.max_piece_bytes} bytes)",
                           "context_length_exceeded")

    def check_tokens(self, tokens: list[int], name: str = "prompt") -> None:
        if len(tokens) > self.n_ctx:
            raise from_engine_error(ContextOverflowError.of_prompt(len(tokens), 0, self.n_ctx, self.n_parallel,
                                                                   self.n_ctx_total))
        bad = next((t for t in tokens if t >= self.n_vocab), None)
        if bad is not None:
            raise APIError(400, f"'{name}' has the token id {bad}, out of the vocabulary [0, {self.n_vocab})",
                           "invalid_value", name)
