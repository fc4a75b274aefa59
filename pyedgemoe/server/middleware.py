"""Two ASGI middlewares (plain ASGI: Starlette's BaseHTTPMiddleware would stand between a streamed
response and the client's disconnect): the API key check and the request counter of /metrics."""
from __future__ import annotations

import hmac
from typing import Callable

from pyedgemoe.server.metrics import RequestCounts
from pyedgemoe.server.openai_errors import APIError


HEALTH_PATHS = ("/health", "/v1/health")  # open to probes, as llama-server's


def api_keys(given: str | None, path=None) -> tuple[str, ...]:
    """The keys of llama-server's --api-key (a comma-separated list) and --api-key-file (one a line,
    lines starting with # comments); OSError where the file cannot be read."""
    keys = [k.strip() for k in (given or "").split(",")]
    if path is not None:
        with open(path, encoding="utf-8") as f:
            keys += [line.strip() for line in f if not line.startswith("#")]
    return tuple(k for k in keys if k)


class BearerAuth:
    """With API keys, every path but the open ones (HEALTH_PATHS, for probes; is_open's, e.g. the web
    pages) needs the header `Authorization: Bearer KEY` (or, as llama-server takes it, Anthropic's
    `X-Api-Key: KEY`), KEY one of them; else 401 as OpenAI answers it."""

    def __init__(self, app, api_keys: tuple[str, ...], is_open: Callable[[str], bool] = lambda path: False) -> None:
        self.app = app
        self.api_keys = [key.encode("utf-8") for key in api_keys]
        self.is_open = is_open

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] == "http" and self.api_keys and scope["path"] not in HEALTH_PATHS
                and not self.is_open(scope["path"])):
            headers = dict(scope["headers"])
            header = headers.get(b"authorization")
            if header is not None:
                scheme, _, token = header.partition(b" ")
                token = token if scheme.lower() == b"bearer" else None
            else:
                token = headers.get(b"x-api-key")
            error = None
            # a header given twice: a proxy in front may read the first where this read the last
            names = [name for name, _ in scope["headers"]]
            if names.count(b"authorization") > 1 or names.count(b"x-api-key") > 1:
                error = APIError(401, "an API key header given twice: send one 'Authorization: Bearer KEY'",
                                 "invalid_api_key")
            elif header is None and token is None:
                error = APIError(401, "no API key: send the header 'Authorization: Bearer KEY'", "invalid_api_key")
            elif token is None or not any([hmac.compare_digest(token.strip(), key) for key in self.api_keys]):
                error = APIError(401, "incorrect API key", "invalid_api_key")
            if error is not None:
                response = error.response()
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestCounting:
    """Counts each HTTP request by path and the status it was answered with: 499 where its client
    left before the answer's end (mid-body, mid-stream), as the server's own 499s."""

    def __init__(self, app, counts: RequestCounts) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, answered, left = 500, False, False  # 500 unless a response starts

        async def receive_and_note_leaving():
            nonlocal left
            message = await receive()
            left = left or message["type"] == "http.disconnect"
            return message

        async def send_and_note_status(message) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True
            await send(message)

        try:
            await self.app(scope, receive_and_note_leaving, send_and_note_status)
        finally:
            self.counts.add(scope["path"], 499 if left and not answered else status)
