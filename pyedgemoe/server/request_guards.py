"""What a request must be before a route sees it (plain ASGI middlewares, as middleware.py's).

- SameSite: only this machine's pages and clients that are no web page. A server without an API
  key on localhost is reachable from any web page its user visits: by DNS rebinding (a name of the
  page's site that resolves to 127.0.0.1 carries that name in the Host header) and by cross-site
  requests (fetch() or a form posting to 127.0.0.1; the browser names the page's site in Origin).
  llama-server answers both; this server answers a Host that is an IP address, localhost or a name
  given with `serve --allowed-hosts`, and an Origin (when there is one: a browser's) only when it is
  the server's own. Anything else is 403.
- JSONBody: a POST's body is read as JSON when its Content-Type is application/json (which a web
  page cannot send to another site without asking it first), none (`requests.post(data=...)`; a
  browser that sends none sends an Origin, which SameSite checks) or application/x-www-form-urlencoded
  (`curl -d`'s; a browser's form encodes `{` as `%7B`, so its bodies are never JSON): llama-server
  reads any body as JSON. Other types (text/plain, multipart/form-data: what a page's form can send
  to any site) are 415, and so is a compressed body (Content-Encoding). The body is at most max_bytes (413, refused from
  its Content-Length before it is read, so no `100 Continue` invites it), and it arrives within
  timeout_seconds (408, and the connection closed). The body is read here, whole, and handed on. A
  body still arriving when the server stops is answered 503 then (uvicorn waited for it, then
  cancelled its read: a traceback and a 500).
- HeadChecks: a request line and headers of more than max_bytes are 431. h11 refuses a head still
  incomplete beyond its limit, but one that arrives in one read passes it (a 100 KB head did). A
  head with both Content-Length and Transfer-Encoding is 400 and its connection closed (RFC 9112
  allows the refusal and asks for the close): h11 read such a body as chunked and kept the
  connection, where a proxy in front that read the Content-Length would see another request in it
  (request smuggling).
A request refused before its body was read leaves its client a moment to send the rest, which is
discarded, before the connection closes (http_protocol.py).
"""
from __future__ import annotations

import asyncio
import ipaddress
from urllib.parse import urlsplit

from pyedgemoe.server.openai_errors import APIError

STOPPING_CHECK_SECONDS = 0.25  # how often a body's read looks whether the server is stopping

def _host_name(host: str) -> str:
    """The name or address of a Host header (or an Origin's netloc), without its port."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8080
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_local_or_address(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: always this machine
        return True
    try:
        ipaddress.ip_address(name)  # a rebinding attack needs a name: an address cannot be rebound
    except ValueError:
        return False
    return True


class HeadChecks:
    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            size = len(scope["method"]) + len(scope["raw_path"]) + len(scope["query_string"]) + \
                sum(len(name) + len(value) + 4 for name, value in scope["headers"])  # ": ", CRLF
            names = {name for name, _ in scope["headers"]}
            response = None
            if size > self.max_bytes:
                response = APIError(431, f"the request line and headers are larger than {self.max_bytes} bytes",
                                    "request_header_fields_too_large").response()
            elif b"content-length" in names and b"transfer-encoding" in names:
                response = APIError(400, "the request has both Content-Length and Transfer-Encoding",
                                    "invalid_http").response()
                response.headers["Connection"] = "close"
            if response is not None:
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class SameSite:
    def __init__(self, app, allowed_hosts: tuple[str, ...] = ()) -> None:
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.allowed_hosts = {h.strip().lower() for h in allowed_hosts}

    def _refusal(self, headers: dict) -> APIError | None:
        host = headers.get(b"host", b"").decode("latin-1")
        name = _host_name(host)
        if host and not (self.any_host or _is_local_or_address(name) or name in self.allowed_hosts):
            return APIError(403, f"this server does not answer to the name {name!r} (a name another site may "
                            "point at it; `serve --allowed-hosts` lists the names it answers to)", "forbidden_host")
        origin = headers.get(b"origin")
        if origin is not None and urlsplit(origin.decode("latin-1")).netloc.lower() != host.lower():
            return APIError(403, "cross-origin requests are refused: a web page of another site may not use this "
                            "server", "forbidden_origin")
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = self._refusal(dict(scope["headers"]))
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


# The body types read as JSON (the module's docstring says why these and no others).
_READ_AS_JSON = (b"application/json", b"", b"application/x-www-form-urlencoded")


class JSONBody:
    def __init__(self, app, max_bytes: int, timeout_seconds: float, stopping) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_seconds = timeout_seconds
        self.stopping = stopping  # () -> whether the server is stopping

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._body(scope, receive)
        except APIError as e:
            # a body too slow is a connection to close (slowloris); one refused unread is discarded
            await e.response({"Connection": "close"} if e.status in (408, 503) else None)(scope, receive, send)
            return
        if body is None:  # the client left
            return
        given = False

        async def replay():
            nonlocal given
            if given:
                return await receive()  # after the body: the client's disconnect
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _body(self, scope, receive) -> bytes | None:
        """The checked body (None when the client left); APIError when refused."""
        headers = dict(scope["headers"])
        media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if media_type not in _READ_AS_JSON:
            raise APIError(415, f"the body must be JSON sent as 'Content-Type: application/json', not "
                           f"{media_type.decode('latin-1')!r}", "unsupported_media_type")
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding != b"identity":  # a compressed body would be read as bytes that are no JSON
            raise APIError(415, f"the body must be sent uncompressed, not as 'Content-Encoding: "
                           f"{encoding.decode('latin-1')}'", "unsupported_media_type")
        length = headers.get(b"content-length")  # h11 checked it is digits
        if length is not None and int(length) > self.max_bytes:
            raise self._too_large()
        loop = asyncio.get_running_loop()
        deadline, read = loop.time() + self.timeout_seconds, asyncio.ensure_future(self._read(receive))
        try:
            while not read.done():
                if self.stopping():
                    raise APIError(503, "the server is shutting down", "server_shutting_down")
                if loop.time() >= deadline:
                    raise APIError(408, f"the request body did not arrive within {self.timeout_seconds:g} s",
                                   "request_timeout")
                await asyncio.wait({read}, timeout=min(STOPPING_CHECK_SECONDS, deadline - loop.time()))
            return read.result()
        finally:
            read.cancel()

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than the server's limit of {self.max_bytes} bytes "
                        "(`serve --max-body`)", "request_too_large")

    async def _read(self, receive) -> bytes | None:
        """The whole body (None when the client left); refused before it holds more than max_bytes."""
        chunks, n_bytes = [], 0  # joined at the end: a growing buffer would hold more than it has
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            n_bytes += len(chunk)
            if n_bytes > self.max_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
