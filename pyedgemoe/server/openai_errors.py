"""Errors as OpenAI's API shapes them: an HTTP status and {"error": {"message", "type", "param",
"code"}}, so that OpenAI's clients raise their usual exceptions (BadRequestError, NotFoundError,
AuthenticationError, ...)."""
from __future__ import annotations

import logging
import re

from starlette.responses import JSONResponse

from pyedgemoe.errors import ContextOverflowError, InvalidOptionError, PyEdgeMoEError, RemoteDeviceError

# OpenAI's error types, by HTTP status (any other 4xx: invalid_request_error)
_TYPES = {500: "server_error", 503: "server_error"}
INTERNAL_ERROR = "internal server error (the server's log has the details)"
# the setting an Engine's message is about: "top_p must be ...", "grammar: ...", "tools[0].function: ..."
_NAMED = re.compile(r"([a-z_]+(?:\[\d+\])?(?:\.[a-z_]+)*)(?::| must | names )")


class APIError(Exception):
    """A request the server answers with an error; code is OpenAI's machine-readable reason
    (e.g. "model_not_found"), param the request parameter at fault, extra more fields of the error
    (llama-server's)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 extra: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.extra = extra or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code, **self.extra}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_engine_error(e: Exception) -> APIError:
    """The API error of an exception the Engine raised: what the request asked for is the client's
    fault (400), a remote device lost unavailable (503), anything else (an expert that cannot be read, a
    bug) the server's (500)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextOverflowError):  # with llama-server's counts, which its web UI's context dialog shows
        return APIError(400, str(e), "context_length_exceeded",
                        extra={"n_prompt_tokens": e.n_prompt_tokens, "n_ctx": e.n_ctx})
    if isinstance(e, InvalidOptionError):
        named = _NAMED.match(str(e))
        return APIError(400, str(e), "invalid_value", named.group(1) if named else None)
    if isinstance(e, RemoteDeviceError):  # a worker lost: the server cannot answer (nor can it later)
        return APIError(503, str(e), type(e).__name__)
    if isinstance(e, PyEdgeMoEError):
        return APIError(500, str(e), type(e).__name__)
    # a bug: its text (a binding's signature, a path) is for the log, not for the client
    logging.getLogger("uvicorn.error").error("the request failed", exc_info=e)
    return APIError(500, INTERNAL_ERROR)
