"""OpenAI's Responses API over the chat completions, as llama-server serves it (for clients made for
it: OpenAI's SDKs' `client.responses`, agents built on them):

    POST /v1/responses (and /responses)  {"model", "input", "instructions", "tools", "text", ...}
                                      -> {"object": "response", "status", "output": [items], "usage"}

A request is checked and turned into a chat completion's (chat_request, after llama-server's
server_chat_convert_responses_to_chatcmpl): `instructions` a first system message, `input` a user
message (a string) or its items (messages of any role, `developer` as `system`, their input_text or
output_text parts; an assistant's `function_call` items its tool calls; `function_call_output`
items tool messages), `tools` the function tools, `tool_choice`, `text.format` the response format
(text, json_object, json_schema), `max_output_tokens`. The answer is the chat completion's as a
response (ResponseShape): its thoughts a `reasoning` item, its text a `message` item with one
`output_text` part, its calls `function_call` items; `status` completed, or incomplete (with
`incomplete_details.reason` max_output_tokens) where the text was cut; streamed, the Responses
API's events, each with its sequence number: response.created, response.in_progress, each item's
output_item.added, its deltas and their .done events, output_item.done (one item after the other),
and response.completed (its response's status incomplete where the text was cut: OpenAI's clients'
stream helpers wait for response.completed).

Nothing is stored: `previous_response_id`, `conversation` and stored `prompt`s are refused (the
conversation goes in `input`, as llama-server asks), `background` is refused; `store`, `include`,
`metadata` (echoed), `truncation`, `reasoning`'s summary and the service's settings have no effect
(`reasoning.effort` is the chat's `reasoning_effort`). Tools of
OpenAI's own service (web search, file search, ...) are left out, as llama-server leaves them:
the model is given the function tools. Images and files are refused (a text model).
"""
from __future__ import annotations

import json
import time
import uuid

from pyedgemoe.server.openai_errors import APIError
from pyedgemoe.server.request_params import check_max_tokens, invalid, model_name, refuse_unknown, schema_checked

# the request's fields (others are refused by name): OpenAI's Python client's responses.create (3.51)
_FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
           "parallel_tool_calls", "stream", "text", "reasoning", "metadata", "user", "store", "include",
           "truncation", "service_tier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
           "safety_identifier", "stream_options", "top_logprobs", "max_tool_calls", "background",
           "previous_response_id", "conversation", "prompt", "context_management", "moderation", "access_programs",
           "image", "seed"}  # seed: llama-server's, passed on to the chat
_STORED = ("previous_response_id", "conversation", "prompt")  # what would need responses kept
_PASSED = {"temperature": "temperature", "top_p": "top_p", "parallel_tool_calls": "parallel_tool_calls",
           "stream": "stream", "seed": "seed"}
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def _parts(param: str, content, kinds: tuple[str, ...]) -> list[dict]:
    """A message's content (a string, or parts of these kinds) as a chat message's text parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(param, "a string or a list of content parts", content)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in kinds and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind in ("input_image", "input_file", "input_audio"):
            raise APIError(400, f"{param}[{j}]: this server's model reads text only, not {kind}",
                           "not_supported", f"{param}[{j}]")
        else:
            raise invalid(f"{param}[{j}]", f"a part of type {' or '.join(kinds)} with its text", part)
    return out


def _messages(items: list) -> list[dict]:
    """The chat messages of the input's items, an assistant's text and calls in one message."""
    messages: list[dict] = []

    def assistant() -> dict:
        """The message an assistant's item joins: the last one where it is the assistant's."""
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": None})
        return messages[-1]
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(param, "an input item (an object)", item)
        kind = item.get("type", "message")
        if kind == "message" and isinstance(item.get("role"), str) and item["role"] in _ROLES:
            role = _ROLES[item["role"]]
            parts = _parts(f"{param}.content", item.get("content"),
                           ("output_text", "input_text") if role == "assistant" else ("input_text",))
            if role == "assistant":
                message = assistant()
                message["content"] = (message["content"] or []) + parts
            else:
                messages.append({"role": role, "content": parts})
        elif kind == "function_call" and all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            message = assistant()
            message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
            message["content"] = message["content"] or ""
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            output = item.get("output")
            text = output if isinstance(output, str) else \
                "".join(p["text"] for p in _parts(f"{param}.output", output, ("input_text",)))
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            continue  # an earlier turn's thoughts: not shown to the model again
        else:
            raise invalid(param, "a message, function_call, function_call_output or reasoning item", item)
    return messages


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise invalid("tools", "a list of tools", tools)
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool.get("type"), str):
            raise invalid(f"tools[{i}]", 'a tool with its "type"', tool)
        if tool["type"] != "function":
            continue  # a tool of OpenAI's service: not this server's, as llama-server leaves it out
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("parameters", {}), (dict, type(None))):
            raise invalid(f"tools[{i}]", 'a function tool with "name" and "parameters"', tool)
        out.append({"type": "function", "function": {"name": tool["name"], "description": tool.get("description") or "",
                                                     "parameters": tool.get("parameters") or {}}})
    return out


def _tool_choice(value) -> str | dict:
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise invalid("tool_choice", '"auto", "none", "required" or {"type": "function", "name": ...}', value)


def _response_format(text) -> dict | None:
    form = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or not (form is None or isinstance(form, dict)):
        raise invalid("text", 'an object like {"format": {"type": "json_schema", "schema": {...}}}', text)
    kind = (form or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(form.get("schema"), dict):
        schema = schema_checked("text.format.schema", form["schema"])
        return {"type": "json_schema", "json_schema": {"name": form.get("name", "response"), "schema": schema,
                                                       "strict": form.get("strict", False)}}
    raise invalid("text.format", 'of type "text", "json_object" or "json_schema" (with its "schema")', form)


def chat_request(body) -> dict:
    """The chat completion request of a Responses request (APIError naming what is wrong)."""
    refuse_unknown(body, _FIELDS)  # body: a JSON object (parse_body)
    model_name(body)  # any name is answered, but a name it must be
    for name in _STORED:
        if body.get(name) is not None:
            raise APIError(400, f"'{name}' needs stored responses, which this server does not keep: send the "
                           "conversation in 'input'", "not_supported", name)
    if body.get("background"):
        raise APIError(400, "background responses are not supported", "not_supported", "background")
    if body.get("top_logprobs"):
        raise APIError(400, "top_logprobs is not supported in responses (the chat completions give logprobs)",
                       "not_supported", "top_logprobs")
    given = body.get("input")
    if isinstance(given, str):
        messages = [{"role": "user", "content": given}]
    elif isinstance(given, list) and given:
        messages = _messages(given)
    else:
        raise APIError(400, "'input' is required: a string or a non-empty list of items", "missing_required_parameter",
                       "input")
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise invalid("instructions", "a string", body["instructions"])
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    request = {chat: body[name] for name, chat in _PASSED.items() if body.get(name) is not None}
    request["messages"] = messages
    if body.get("max_output_tokens") is not None:
        request["max_tokens"] = check_max_tokens("max_output_tokens", body["max_output_tokens"])
    tools = _tools(body["tools"]) if body.get("tools") is not None else []
    if tools:
        request["tools"] = tools
    if body.get("tool_choice") is not None:
        request["tool_choice"] = _tool_choice(body["tool_choice"])
    reasoning = body.get("reasoning") or {}
    if not isinstance(reasoning, dict):
        raise invalid("reasoning", 'an object ({"effort": ...})', reasoning)
    if reasoning.get("effort") is not None:  # the chat's reasoning_effort, as llama-server converts it
        request["reasoning_effort"] = reasoning["effort"]
    if body.get("text") is not None and _response_format(body["text"]) is not None:
        request["response_format"] = _response_format(body["text"])
    return request


def _usage(completion_usage: dict) -> dict:
    return {"input_tokens": completion_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": completion_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": completion_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": completion_usage["total_tokens"]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseShape:
    """The response of one request (its body as sent): whole (response()) or as events (events())."""

    def __init__(self, body: dict, model: str) -> None:
        self.body, self.model = body, model
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self._sequence = 0
        self._item: dict | None = None  # the item being streamed
        self._output: list[dict] = []  # the items streamed and done
        self._call = -1  # the index of the call streamed last

    def _head(self, status: str, output: list[dict], usage: dict | None, finish: str | None) -> dict:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "metadata": b.get("metadata") or {}, "model": self.model, "output": output,
                "parallel_tool_calls": b.get("parallel_tool_calls", True), "temperature": b.get("temperature"),
                "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [], "top_p": b.get("top_p"),
                "text": b.get("text") or {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
                "reasoning": {"effort": None, "summary": None}, "usage": usage, "user": b.get("user")}

    def response(self, completion: dict) -> dict:
        """The whole response of a (joined) chat completion."""
        choice = completion["choices"][0]
        message, output = choice["message"], []
        if message.get("reasoning_content"):
            output.append({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "status": "completed",
                           "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
        finish = choice["finish_reason"]
        if message.get("content"):
            output.append({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                           "status": "incomplete" if finish == "length" else "completed",
                           "content": [_text_part(message["content"])]})
        for call in message.get("tool_calls") or ():
            output.append({"id": f"fc_{call['id']}", "type": "function_call", "status": "completed",
                           "call_id": call["id"], "name": call["function"]["name"],
                           "arguments": call["function"]["arguments"]})
        return self._head("incomplete" if finish == "length" else "completed", output, _usage(completion["usage"]),
                          finish)

    # -- streamed --------------------------------------------------------------------------------
    def _event(self, kind: str, data: dict) -> str:
        self._sequence += 1
        payload = {"type": kind, "sequence_number": self._sequence - 1, **data}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _open(self, item: dict) -> str:
        out = self._close()
        self._item = item
        # a message is announced empty, its part then added (OpenAI's clients build it from the events)
        announced = {**item, "content": []} if item["type"] == "message" else item
        out += self._event("response.output_item.added", {"output_index": len(self._output), "item": announced})
        if item["type"] == "message":
            out += self._event("response.content_part.added", {"item_id": item["id"], "output_index": len(self._output),
                                                               "content_index": 0, "part": _text_part("")})
        return out

    def _close(self, status: str = "completed") -> str:
        item, self._item = self._item, None
        if item is None:
            return ""
        at, out = {"item_id": item["id"], "output_index": len(self._output)}, ""
        item["status"] = status
        if item["type"] == "reasoning":
            out += self._event("response.reasoning_text.done", {**at, "content_index": 0,
                                                                "text": item["content"][0]["text"]})
        elif item["type"] == "message":
            part = item["content"][0]
            out += self._event("response.output_text.done", {**at, "content_index": 0, "text": part["text"],
                                                             "logprobs": []})
            out += self._event("response.content_part.done", {**at, "content_index": 0, "part": part})
        else:
            out += self._event("response.function_call_arguments.done", {**at, "name": item["name"],
                                                                         "arguments": item["arguments"]})
        self._output.append(item)
        return out + self._event("response.output_item.done", {"output_index": len(self._output) - 1, "item": item})

    def events(self, chunk: dict) -> str:
        """The events of one chunk (a chat completion's, as Engine.create_chat_completion streams them)."""
        choice, out = chunk["choices"][0], ""
        delta, item = choice["delta"], self._item
        if delta.get("role"):
            snapshot = self._head("in_progress", [], None, None)
            out += self._event("response.created", {"response": snapshot})
            out += self._event("response.in_progress", {"response": snapshot})
        if delta.get("reasoning_content"):
            if item is None or item["type"] != "reasoning":
                out += self._open({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [],
                                   "status": "in_progress", "content": [{"type": "reasoning_text", "text": ""}]})
            self._item["content"][0]["text"] += delta["reasoning_content"]
            out += self._event("response.reasoning_text.delta", {"item_id": self._item["id"], "content_index": 0,
                                                                 "output_index": len(self._output),
                                                                 "delta": delta["reasoning_content"]})
        if delta.get("content"):
            if self._item is None or self._item["type"] != "message":
                out += self._open({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                                   "status": "in_progress", "content": [_text_part("")]})
            self._item["content"][0]["text"] += delta["content"]
            out += self._event("response.output_text.delta", {"item_id": self._item["id"], "content_index": 0,
                                                              "output_index": len(self._output),
                                                              "delta": delta["content"], "logprobs": []})
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if self._item is None or self._item["type"] != "function_call" or self._call != call["index"]:
                self._call = call["index"]  # a call's first delta (each may repeat its id)
                call_id = call.get("id") or f"call_{uuid.uuid4().hex}"
                out += self._open({"id": f"fc_{call_id}", "type": "function_call", "status": "in_progress",
                                   "call_id": call_id, "name": function.get("name") or "", "arguments": ""})
            if function.get("arguments") and self._item is not None:
                self._item["arguments"] += function["arguments"]
                out += self._event("response.function_call_arguments.delta", {
                    "item_id": self._item["id"], "output_index": len(self._output), "delta": function["arguments"]})
        finish = choice["finish_reason"]
        if finish is not None:
            status = "incomplete" if finish == "length" else "completed"  # the last item's too, as OpenAI's
            out += self._close(status)
            # response.completed even where the text was cut (its status says so), as llama-server: OpenAI's
            # clients' stream helpers wait for that event and know no response.incomplete
            out += self._event("response.completed", {"response": self._head(status, self._output,
                                                                             _usage(chunk["usage"]), finish)})
        return out

    def error(self, body: dict) -> str:
        """An error once the stream has begun, as the Responses API's error event."""
        e = body["error"]
        return self._event("error", {"code": e.get("code"), "message": e["message"], "param": e.get("param")})
