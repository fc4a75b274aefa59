"""llama-server's reasoning control, which llama.cpp's web UI uses for its "stop thinking" button:

    POST /v1/chat/completions   {..., "reasoning_control": true, "stream": true}
    POST /v1/chat/completions/control  {"id": "chatcmpl-...", "action": "reasoning_end"}
                                    -> {"success": true}, or false with a "message"

A chat with reasoning_control gets a reasoning budget without a limit (its template's thinking tags,
as with --reasoning-budget); while it runs, its completion id (every chunk's `id`) names it, and
`reasoning_end` ends the thought it is writing: the end tag is forced from its next token on (the
budget's message before it), as a budget that ran out. A chat without it, or one no longer running:
success false, as llama-server answers. A body without an id or with another action: a 400."""
from __future__ import annotations

import threading

from fastapi import FastAPI, Request

from pyedgemoe.server.openai_errors import APIError
from pyedgemoe.server.request_params import _of_type, _text, parse_fields

ACTIONS = ("reasoning_end",)
CONTROL_PARAMETERS = {"id": (_text, ...), "action": (_text, ...), "model": (_of_type(str, "a model's name"), None)}


class ReasoningControls:
    """The running chats that took reasoning_control, by completion id."""

    def __init__(self) -> None:
        self._running: dict[str, threading.Event] = {}

    def arm(self, start, kwargs: dict):
        """start (an Engine call streaming a chat's chunks, taking kwargs), with the chat's
        reasoning_control (a request's true) made an Event its id names while it runs."""
        if not kwargs.pop("reasoning_control", False):
            return start
        control = kwargs["reasoning_control"] = threading.Event()

        def controlled():
            chunks, key = start(), None
            try:
                for chunk in chunks:
                    if key is None:
                        key = chunk["id"]
                        self._running[key] = control
                    yield chunk
            finally:
                self._running.pop(key, None)
                chunks.close()
        return controlled

    def end(self, completion_id: str) -> dict:
        control = self._running.get(completion_id)
        if control is None:
            return {"success": False, "message": "no active completion for this id"}
        control.set()
        return {"success": True}

    def add_routes(self, app: FastAPI, check_model) -> None:
        @app.post("/v1/chat/completions/control")
        async def control(request: Request) -> dict:
            q = parse_fields(await request.body(), CONTROL_PARAMETERS)
            check_model(q["model"])
            if q["action"] not in ACTIONS:
                raise APIError(400, f"unknown control action {q['action'][:40]!r}: {', '.join(ACTIONS)}",
                               "invalid_value", "action")
            return self.end(q["id"])
