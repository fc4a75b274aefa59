"""Anthropic's Messages API over the chat completions, as llama-server serves it (for clients made for
Anthropic's API: its SDKs, Claude Code with ANTHROPIC_BASE_URL):

    POST /v1/messages               {"model", "max_tokens", "messages", "system", "tools", ...}
                                 -> {"type": "message", "content": [blocks], "stop_reason", "usage"}
    POST /v1/messages/count_tokens  {"messages", "system", "tools"} -> {"input_tokens": n}

A request is checked and turned into a chat completion's (chat_request, after llama-server's
server_chat_convert_anthropic_to_oai): `system` a first system message, text blocks the content,
an assistant's `tool_use` blocks its tool calls, a user's `tool_result` blocks tool messages,
`stop_sequences` the stop strings, `tools`' input_schema their parameters, `tool_choice` auto,
any (a call required), tool (that tool's call) or none, `output_config.format`'s JSON schema the
text's (structured output). The answer is the chat completion's as
Anthropic's message (message()): its thoughts a `thinking` block, its text a `text` block, its calls
`tool_use` blocks; streamed, Anthropic's events (EventStream): message_start, a block's
content_block_start, its deltas and content_block_stop (one block after the other), message_delta
with the stop reason and message_stop. Images and documents are refused (a text model); thinking
blocks of earlier turns are dropped; `thinking` {"type": "enabled", "budget_tokens": N} is the
reasoning budget (llama.cpp's, on a template with thinking tags; DEFAULT_THINKING_BUDGET where N
is missing, as llama-server's), its other types have no effect, as `metadata`, `output_config.effort` and the
service's settings (`service_tier`, `speed`, `container`, ...) have no effect. Any `model` is
answered by the model served, as llama-server answers it (Anthropic's clients send names of
Anthropic's models).
"""
from __future__ import annotations

import json

from pyedgemoe.server.openai_errors import APIError
from pyedgemoe.server.request_params import check_stop, invalid, model_name, refuse_unknown, schema_checked

# the request's fields (others are refused by name): those of Anthropic's API (its Python client's
# Messages.create, 2.14; temperature, top_p and top_k of earlier versions, as llama-server takes them)
# and llama-server's chat_template_kwargs; those of Anthropic's service have no effect here
_FIELDS = {"model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k",
           "tools", "tool_choice", "output_config", "chat_template_kwargs", "thinking", "metadata", "service_tier",
           "cache_control", "container", "diagnostics", "inference_geo", "speed", "user_profile_id", "workspace_id"}
_PASSED = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")
DEFAULT_MAX_TOKENS = 4096  # Anthropic requires max_tokens; llama-server takes this when it is missing
DEFAULT_THINKING_BUDGET = 10000  # llama-server's budget_tokens where thinking is enabled without one
_STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}


def _text_of(param: str, blocks) -> str:
    """A string, or a list of text blocks joined (a system prompt, a tool's result)."""
    if isinstance(blocks, str):
        return blocks
    if isinstance(blocks, list) and all(isinstance(b, dict) and b.get("type") == "text" and
                                        isinstance(b.get("text"), str) for b in blocks):
        return "".join(b["text"] for b in blocks)
    raise invalid(param, 'a string or a list of {"type": "text", "text": ...} blocks', blocks)


def _message(i: int, m) -> list[dict]:
    """One of Anthropic's messages as chat messages: the message (its text, its tool calls) and a
    tool message for each tool_result block."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or "content" not in m:
        raise invalid(where, 'an object with "role" ("user" or "assistant") and "content"', m)
    content = m["content"]
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "a string or a list of content blocks", content)
    text, calls, results = [], [], []
    for j, block in enumerate(content):
        param, kind = f"{where}.content[{j}]", block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append({"type": "text", "text": block["text"]})
        elif kind == "tool_use" and isinstance(block.get("name"), str) and isinstance(block.get("input", {}), dict):
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _text_of(f"{param}.content", block.get("content", ""))})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # an earlier turn's thoughts: not shown to the model again
        elif kind in ("image", "document"):
            raise APIError(400, f"{param}: this server's model reads text only, not {kind}s", "not_supported", param)
        else:
            raise invalid(param, 'a text, tool_use, tool_result or thinking block', block)
    message = {"role": m["role"], "content": text if text else "" if calls else None}
    if calls:
        message["tool_calls"] = calls
    return ([message] if text or calls else []) + results


def _tool(i: int, tool) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or \
            not isinstance(tool.get("input_schema", {}), dict):
        raise invalid(f"tools[{i}]", 'an object with "name" and "input_schema"', tool)
    return {"type": "function", "function": {"name": tool["name"], "description": str(tool.get("description", "")),
                                             "parameters": tool.get("input_schema", {})}}


def _tool_choice(value) -> str | dict:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "tool" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind]
    raise invalid("tool_choice", '{"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}', value)


def chat_request(body) -> dict:
    """The chat completion request of an Anthropic Messages request (APIError naming what is wrong)."""
    refuse_unknown(body, _FIELDS)  # body: a JSON object (parse_body)
    model_name(body)  # any name is answered, but a name it must be
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise APIError(400, "'messages' is required: a non-empty list", "missing_required_parameter", "messages")
    messages = [{"role": "system", "content": _text_of("system", body["system"])}] if "system" in body else []
    messages += [chat for i, m in enumerate(body["messages"]) for chat in _message(i, m)]
    if not messages:
        raise APIError(400, "'messages' hold nothing to answer", "invalid_value", "messages")
    request = {key: body[key] for key in _PASSED if key in body}
    request.update(messages=messages, max_tokens=body.get("max_tokens", DEFAULT_MAX_TOKENS))
    if "stop_sequences" in body:
        stops = body["stop_sequences"]
        if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
            raise invalid("stop_sequences", "a list of non-empty strings", stops)
        request["stop"] = check_stop("stop_sequences", stops)  # bounded as a chat's stop strings
    if "tools" in body:
        if not isinstance(body["tools"], list):
            raise invalid("tools", "a list of tools", body["tools"])
        request["tools"] = [_tool(i, t) for i, t in enumerate(body["tools"])]
    if "tool_choice" in body:
        request["tool_choice"] = _tool_choice(body["tool_choice"])
    thinking = body.get("thinking") or {}
    if not isinstance(thinking, dict):
        raise invalid("thinking", 'an object ({"type": "enabled", "budget_tokens": N})', thinking)
    if thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens", DEFAULT_THINKING_BUDGET)
        if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget < 2**31:
            raise invalid("thinking.budget_tokens", "an integer >= 0", budget)
        request["thinking_budget_tokens"] = budget
    output = body.get("output_config") or {}
    if not isinstance(output, dict):
        raise invalid("output_config", 'an object ({"format": {"type": "json_schema", "schema": ...}})', output)
    if output.get("format") is not None:  # structured output: the schema constrains the text
        form = output["format"]
        if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
            raise invalid("output_config.format", '{"type": "json_schema", "schema": {...}}', form)
        request["json_schema"] = schema_checked("output_config.format.schema", form["schema"])
    return request


def _blocks(message: dict) -> list[dict]:
    """Anthropic's content blocks of a chat completion's message."""
    blocks = [{"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}] \
        if message.get("reasoning_content") else []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        try:
            arguments = json.loads(call["function"]["arguments"])
        except json.JSONDecodeError:
            arguments = {}
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": arguments if isinstance(arguments, dict) else {}})
    return blocks


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """Anthropic's usage, as llama-server gives it: the prompt's tokens the cache held apart from those evaluated."""
    return {"cache_read_input_tokens": cached_tokens, "input_tokens": prompt_tokens - cached_tokens,
            "output_tokens": output_tokens}


def message(completion: dict) -> dict:
    """Anthropic's message of a (joined) chat completion."""
    choice, usage = completion["choices"][0], completion["usage"]
    return {"id": completion["id"], "type": "message", "role": "assistant", "content": _blocks(choice["message"]),
            "model": completion["model"], "stop_reason": _STOP_REASONS[choice["finish_reason"]], "stop_sequence": None,
            "usage": _usage(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                            usage["completion_tokens"])}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class EventStream:
    """Anthropic's stream of a chat completion's chunks (those after the prompt's evaluation with
    llama-server's timings: Engine's timings_per_token): events() of each chunk, in order. The message
    starts at the first chunk with timings, its usage theirs, as llama-server's starts with the
    first token. A block starts where the deltas change kind (thoughts, text, a tool call) and stops
    before the next."""

    def __init__(self) -> None:
        self._started = False
        self._block: tuple[str, object] | None = None  # the open block's kind (and a call's index)
        self._index = -1  # the open block's

    def _start(self, key: tuple[str, object], block: dict) -> str:
        out = self._stop()
        self._block, self._index = key, self._index + 1
        return out + _event("content_block_start", {"index": self._index, "content_block": block})

    def _stop(self) -> str:
        if self._block is None:
            return ""
        out = _event("content_block_delta", {"index": self._index, "delta": {"type": "signature_delta",
                                                                             "signature": ""}}) \
            if self._block[0] == "thinking" else ""  # Anthropic's clients expect a thinking block signed
        self._block = None
        return out + _event("content_block_stop", {"index": self._index})

    def _delta(self, delta: dict) -> str:
        return _event("content_block_delta", {"index": self._index, "delta": delta})

    def events(self, chunk: dict) -> str:
        """The events of one chunk (a chat completion's, as Engine.create_chat_completion streams them)."""
        choice, out = chunk["choices"][0], ""
        delta = choice["delta"]
        if not self._started and "timings" in chunk:
            self._started, timings = True, chunk["timings"]
            out += _event("message_start", {"message": {
                "id": chunk["id"], "type": "message", "role": "assistant", "content": [], "model": chunk["model"],
                "stop_reason": None, "stop_sequence": None,
                "usage": _usage(timings["prompt_n"] + timings["cache_n"], timings["cache_n"], 0)}})
        if delta.get("reasoning_content"):
            if self._block != ("thinking", None):
                out += self._start(("thinking", None), {"type": "thinking", "thinking": ""})
            out += self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            if self._block != ("text", None):
                out += self._start(("text", None), {"type": "text", "text": ""})
            out += self._delta({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if self._block != ("tool_use", call["index"]):
                out += self._start(("tool_use", call["index"]), {"type": "tool_use", "id": call.get("id") or "",
                                                                 "name": function.get("name") or "", "input": {}})
            if function.get("arguments"):
                out += self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})
        if choice["finish_reason"] is not None:
            out += self._stop()
            out += _event("message_delta", {"delta": {"stop_reason": _STOP_REASONS[choice["finish_reason"]],
                                                      "stop_sequence": None},
                                            "usage": {"output_tokens": chunk["usage"]["completion_tokens"]}})
            out += _event("message_stop", {})
        return out

    @staticmethod
    def error(body: dict) -> str:
        """An error once the stream has begun, as Anthropic's event."""
        return _event("error", {"error": {"type": body["error"]["type"], "message": body["error"]["message"]}})
