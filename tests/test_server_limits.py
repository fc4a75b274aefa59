"""`pyedgemoe serve` bounds what a request may ask: a body too large (413, refused before it is read),
a prompt too long (400, before it is tokenized), parameters out of range or of the wrong kind (400
naming the parameter), JSON nested too deep or with numbers too long (400). Never a 500, never an
internal message (a binding's signature, a traceback), and the server keeps answering meanwhile.

The real server in a subprocess (tests/test_server.py's), talked to over sockets."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from urllib.parse import urlparse

import pytest

from pyedgemoe import Engine
from server_load import rss_bytes
from test_server import DEMO, SERVER_ARGS, request, start_server, stop_server

MAX_BODY = 8 * 2**20  # the default of `serve --max-body`
# what reading a body holds besides the body itself: asyncio's, h11's and uvicorn's buffers, each
# up to a few hundred KiB (measured: 1.1 MiB over a body refused at 8 MiB)
READ_BUFFERS = 2 * 2**20
HEALTH_WITHIN = 0.1  # seconds: /health answers while a large request is refused


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, process, log path) of a server with the default limits."""
    log = tmp_path_factory.mktemp("limits") / "server.log"
    proc, url = start_server(log, *SERVER_ARGS)
    yield url, proc, log
    stop_server(proc)


@pytest.fixture()
def server(served):
    url, _, log = served
    before = log.read_text()
    yield url
    assert "Traceback" not in log.read_text()[len(before):], "a request left a traceback in the server's log"


def post_raw(url: str, body: bytes, path: str = "/v1/completions") -> tuple[int, dict]:
    status, out = request("POST", url + path, body, key=None)
    assert isinstance(out, dict), f"not JSON: {out!r}"
    return status, out


def assert_error(status: int, out: dict, expected_status: int, param: str | None = None, code: str | None = None):
    assert status == expected_status, out
    error = out["error"]
    extra = {"n_prompt_tokens", "n_ctx"} if error.get("code") == "context_length_exceeded" else set()  # llama-server's
    assert set(error) - extra == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    for internal in ("nanobind", "incompatible function arguments", "Traceback", "_native", "Exception"):
        assert internal not in error["message"], error


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "top_k": 3_000_000_000}, "top_k"),
    ({"prompt": "x", "top_k": -3_000_000_000}, "top_k"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "repeat_penalty": 0}, "repeat_penalty"),
    ({"prompt": "x", "seed": 2**32}, "seed"),
    ({"prompt": "x", "seed": -2}, "seed"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "typical_p": 0}, "typical_p"),
    ({"prompt": "x", "frequency_penalty": "a lot"}, "frequency_penalty"),
    ({"prompt": "x", "max_tokens": 10**4000}, "max_tokens"),
    ({"prompt": "x", "logprobs": 1_000_000}, "logprobs"),
    ({"prompt": [99999]}, "prompt"),
    ({"prompt": [2147483648]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "x", "stop": ["s"] * 100_000}, "stop"),
    ({"prompt": "x", "stop": "s" * 10_000}, "stop"),
    ({"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias[1]"),
    ({"prompt": "x", "logit_bias": {"the": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": [1, 2]}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(2000)}}, "logit_bias"),
    ({"prompt": "x", "mirostat_mode": 3}, "mirostat_mode"),
    ({"prompt": "x", "mirostat_tau": -1}, "mirostat_tau"),
    # taken and not used, but of their senders' types (llama-server's, OpenAI's)
    ({"prompt": "x", "cache_prompt": "x"}, "cache_prompt"),
    ({"prompt": "x", "sse_ping_interval": -2}, "sse_ping_interval"),
    ({"prompt": "x", "user": 5}, "user"),
])
def test_a_parameter_out_of_range_is_400_naming_it(server, body, param):
    assert_error(*post_raw(server, json.dumps(body).encode()), 400, param)


@pytest.mark.parametrize("name, low, high", [("max_tokens", -5, 3_000_000_000), ("top_k", -3_000_000_000,
                                                                                   3_000_000_000)])
def test_an_integer_out_of_range_is_told_the_one_range_whichever_side(server, name, low, high):
    messages = []
    for value in (low, high):
        body = {"messages": [{"role": "user", "content": "hi"}], name: value}
        status, out = post_raw(server, json.dumps(body).encode(), "/v1/chat/completions")
        assert_error(status, out, 400, name)
        messages.append(out["error"]["message"].replace(str(value), "V"))
    assert messages[0] == messages[1], messages
    assert "an integer in [" in messages[0]


def test_a_token_id_outside_the_vocabulary_says_the_vocabulary(server):
    status, out = post_raw(server, json.dumps({"prompt": [1, 99999]}).encode())
    assert_error(status, out, 400, "prompt")
    assert "99999" in out["error"]["message"] and "vocabulary" in out["error"]["message"]
    status, out = post_raw(server, json.dumps({"prompt": "x", "logit_bias": {"99999": 1}}).encode())
    assert_error(status, out, 400)
    assert "logit_bias: token id 99999 out of range" in out["error"]["message"]


@pytest.mark.parametrize("raw, param, path", [
    (b'{"prompt": "\\ud800"}', "prompt", "/v1/completions"),
    (b'{"prompt": "x", "stop": ["ok", "\\udc00"]}', "stop[1]", "/v1/completions"),
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content", "/v1/chat/completions"),
])
def test_a_lone_surrogate_is_400_naming_where(server, raw, param, path):
    assert_error(*post_raw(server, raw, path), 400, param)


def test_a_utf8_encoded_surrogate_is_400(server):
    assert_error(*post_raw(server, b'{"prompt": "\xed\xa0\x80"}'), 400, code="invalid_json")


@pytest.mark.parametrize("raw", [
    b'{"prompt": "x", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"prompt": "x", "stop": ' + b"[" * 100 + b"]" * 100 + b"}",
    b'{"prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}",
])
def test_json_too_deep_or_with_numbers_too_long_is_400(server, raw):
    assert_error(*post_raw(server, raw), 400, code="invalid_json")


@pytest.mark.parametrize("raw", [b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "user": [Infinity]}',
                                 b'{"input": "x", "metadata": {"a": -Infinity}}'])
def test_nan_and_infinity_are_no_json_and_400(server, raw):
    # Python's json takes them; an answer that echoes one (the Responses API's metadata) was a 500
    path = "/v1/responses" if b'"input"' in raw else "/v1/completions"
    assert_error(*post_raw(server, raw, path), 400, code="invalid_json")


@pytest.mark.parametrize("body, path, fragment", [
    ({"prompt": "x", "max_tokens": 2, "grammar": "root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000},
     "/v1/completions", "grammar: 20001 rules and parenthesized groups"),
    ({"prompt": "x", "max_tokens": 2, "grammar": "".join(f"r{i} ::= r{i + 1}\n" for i in range(100_000))},
     "/completion", "grammar: 100000 rules"),
    ({"prompt": "x", "max_tokens": 2, "json_schema": '{"type": "array", "items": ' * 3000 + "{}" + "}" * 3000},
     "/completion", "json_schema: nested 3001 levels deep"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
      "response_format": {"type": "json_object", "schema": '{"properties": {"a": ' * 10_000 + "{}" + "}}" * 10_000}},
     "/v1/chat/completions", "json_schema: nested"),
])
def test_a_grammar_or_schema_llama_cpp_would_recurse_through_too_deep_is_400(server, body, path, fragment):
    # each ended the server (a stack overflow in llama.cpp's grammar parser or JSON-schema converter),
    # or held a sequence for 20 s and 3 GB, from a body of 40-350 KB
    status, out = post_raw(server, json.dumps(body).encode(), path)
    assert_error(status, out, 400)
    assert fragment in out["error"]["message"], out
    assert request("GET", server + "/health", key=None)[0] == 200


@pytest.mark.parametrize("temperature", [0, 0.8])
@pytest.mark.parametrize("body, path, fragment", [
    ({"prompt": "x", "grammar": "root ::= [5-1]"}, "/v1/completions", "no token is allowed here"),  # an empty range
    ({"prompt": "x", "json_schema": {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4}},
     "/v1/completions", "no token is allowed here"),
    ({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
          "type": "integer", "minimum": 5, "maximum": 1}}}}, "/v1/chat/completions",
     "response_format.json_schema.schema: minimum 5 is above maximum 1"),  # before generating, by its name
])
def test_a_grammar_nothing_satisfies_is_400_and_the_server_goes_on(server, body, path, fragment, temperature):
    # greedy, llama.cpp's grammar aborted the server on the end of generation it then took; sampled, a 500
    status, out = post_raw(server, json.dumps({**body, "max_tokens": 4, "temperature": temperature}).encode(), path)
    assert_error(status, out, 400)
    assert fragment in out["error"]["message"], out
    assert request("GET", server + "/health", key=None)[0] == 200


def test_a_slow_grammar_does_not_hold_the_other_requests(server):
    # each pick takes about half a second here (llama.cpp's grammar stacks, ambiguous repetitions):
    # the server's event loop went without the GIL meanwhile (/health took up to 15 s with 4 stars)
    body = {"prompt": "Data: ", "grammar": 'root ::= ([a-z]* [a-z]* [a-z]*)+ "."', "max_tokens": 6, "temperature": 0}
    slow = threading.Thread(target=post_raw, args=(server, json.dumps(body).encode()))
    slow.start()
    time.sleep(0.5)
    waits = []
    while slow.is_alive() and len(waits) < 10:
        t0 = time.monotonic()
        assert request("GET", server + "/health", key=None)[0] == 200
        waits.append(time.monotonic() - t0)
        time.sleep(0.2)
    slow.join()
    assert len(waits) >= 3 and max(waits) < 0.25, waits


def test_values_llama_server_and_openai_take_are_taken(server):
    # a uint32 seed, top_k -1 (off), n/echo/best_of null (left out), and an assistant's message as the
    # openai package's model_dump() writes it (null refusal, audio, function_call, annotations), with
    # llama-server's reasoning_content
    for body in ({"prompt": "x", "max_tokens": 2, "seed": 2**32 - 1, "top_k": -1},
                 {"prompt": "x", "max_tokens": 2, "n": None, "echo": None, "best_of": None}):
        status, out = post_raw(server, json.dumps(body).encode())
        assert status == 200 and out["usage"]["completion_tokens"] == 2, out
    reply = {"role": "assistant", "content": "Hello", "refusal": None, "annotations": None, "audio": None,
             "function_call": None, "tool_calls": None, "reasoning_content": "The user greets."}
    body = {"messages": [{"role": "user", "content": "hi"}, reply, {"role": "user", "content": "and?"}],
            "max_tokens": 2}
    status, out = post_raw(server, json.dumps(body).encode(), "/v1/chat/completions")
    assert status == 200 and out["usage"]["completion_tokens"] == 2, out
    status, out = post_raw(server, json.dumps({**body, "messages": [{**reply, "refusal": "no"}]}).encode(),
                           "/v1/chat/completions")
    assert_error(status, out, 400, "messages[0]")


@pytest.mark.parametrize("echoed", [
    {"function_call": {"name": "g", "arguments": "{}"}},  # not the message's call
    {"function_call": {"name": "f", "arguments": "{\"a\": 1}"}},
    {"function_call": {"name": "f", "arguments": "{}"}, "tool_calls": None},  # a call the message has not
    {"annotations": [{"type": "url_citation"}]},
])
def test_an_assistants_echoed_field_that_says_more_than_its_message_is_400(server, echoed):
    reply = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}], **echoed}
    body = {"messages": [{"role": "user", "content": "hi"}, reply, {"role": "tool", "tool_call_id": "c1",
                                                                    "content": "ok"}], "max_tokens": 2}
    assert_error(*post_raw(server, json.dumps(body).encode(), "/v1/chat/completions"), 400, "messages[1]")


def test_max_tokens_and_max_completion_tokens_that_disagree_are_400(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "max_completion_tokens": 8}
    assert_error(*post_raw(server, json.dumps(body).encode(), "/v1/chat/completions"), 400, "max_completion_tokens")
    body["max_completion_tokens"] = 4  # the same: no doubt which holds
    status, out = post_raw(server, json.dumps(body).encode(), "/v1/chat/completions")
    assert status == 200 and out["usage"]["completion_tokens"] <= 4


class HealthWatch:
    """Polls /health on a thread of its own (its own connection each time) while a test runs:
    the slowest answer, and the server's largest RSS seen."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid
        self.slowest = 0.0
        self.max_rss = self.rss_before = rss_bytes(pid)
        self.answers = 0  # 200s
        self.failures: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            status = request("GET", self.url + "/health", key=None)[0]
            self.slowest = max(self.slowest, time.monotonic() - started)
            if status == 200:
                self.answers += 1
            else:
                self.failures.append(status)
            self.max_rss = max(self.max_rss, rss_bytes(self.pid))
            time.sleep(0.02)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def raw_connection(url: str) -> socket.socket:
    u = urlparse(url)
    return socket.create_connection((u.hostname, u.port), timeout=30)


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the next response on sock."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, json.loads(response.read())


def closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_a_body_framed_both_ways_is_400_and_its_connection_closed(server):
    # h11 read it as chunked and kept the connection: a proxy in front reading Content-Length would
    # have taken the chunks for another request (request smuggling)
    sock = raw_connection(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
                 b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    status, out = read_response(sock)
    assert_error(status, out, 400, code="invalid_http")
    assert closed_within(sock, 5)  # the request after it is not answered on this connection
    sock.close()


def test_a_10gb_content_length_is_refused_at_once_without_100_continue(server):
    sock = raw_connection(server)
    started = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 10000000000\r\nExpect: 100-continue\r\n\r\n")
    status, out = read_response(sock)  # the first answer: no "100 Continue" before it
    assert time.monotonic() - started < 1
    assert_error(status, out, 413, code="request_too_large")
    assert str(MAX_BODY) in out["error"]["message"]
    assert closed_within(sock, 5)  # the server does not wait for 10 GB
    sock.close()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_50mb_body_is_refused_while_health_answers_and_rss_stays_within_the_limit(served, server, framing):
    _, proc, _ = served
    size, piece = 50 * 2**20, b"x" * 2**20
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += b"Transfer-Encoding: chunked\r\n\r\n" if framing == "chunked" else b"Content-Length: %d\r\n\r\n" % size
    sock = raw_connection(server)

    def send_body() -> None:
        try:
            sock.sendall(head)
            for _ in range(size // len(piece)):
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if framing == "chunked" else piece)
        except OSError:  # refused: the server closed the connection
            pass

    with HealthWatch(server, proc.pid) as watch:
        sender = threading.Thread(target=send_body)
        sender.start()
        status, out = read_response(sock)
        sender.join()
        sock.close()
        time.sleep(0.2)
    assert_error(status, out, 413, code="request_too_large")
    assert watch.answers > 0 and not watch.failures and watch.slowest < HEALTH_WITHIN, watch.slowest
    assert watch.max_rss - watch.rss_before <= MAX_BODY + READ_BUFFERS, (watch.rss_before, watch.max_rss)


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(served, server):
    """A 7 MB prompt (within --max-body) would take the tokenizer seconds: its bytes alone show it
    cannot fit the context, so it is refused at once, and /health answers meanwhile."""
    _, proc, _ = served
    body = json.dumps({"prompt": "word " * 1_400_000, "max_tokens": 4}).encode()
    with HealthWatch(server, proc.pid) as watch:
        started = time.monotonic()
        status, out = post_raw(server, body)
        took = time.monotonic() - started
    assert_error(status, out, 400, code="context_length_exceeded")
    assert "bytes" in out["error"]["message"]
    assert took < 2, took
    assert not watch.failures and watch.slowest < HEALTH_WITHIN, watch.slowest


def test_tokenize_answers_are_bounded_as_bodies_are(served, server):
    """/tokenize with_pieces made an 8 MB text's answer of 96 MB, the server 1.4 GiB: a text of more
    than 2 MiB, or of more than 2^19 tokens, is a 400 (the first before it is tokenized)."""
    _, proc, _ = served
    with HealthWatch(server, proc.pid) as watch:
        for path, field, text in (("/tokenize", "content", "a b " * 1_000_000), ("/tokenize", "content", "7" * 600_000),
                                  ("/extras/tokenize/count", "input", "a b " * 1_000_000)):
            status, out = post_raw(server, json.dumps({field: text, "with_pieces": True} if field == "content" else
                                                      {field: text}).encode(), path)
            assert_error(status, out, 400, param=field, code="invalid_value")
    assert watch.max_rss - watch.rss_before <= 200 * 2**20, (watch.rss_before, watch.max_rss)
    status, out = post_raw(server, json.dumps({"content": "a b " * 1000, "with_pieces": True}).encode(), "/tokenize")
    assert status == 200 and len(out["tokens"]) >= 1000


def test_a_body_of_many_small_values_is_refused_before_python_makes_them(served, server):
    """200,000 messages in 7 MB took the parser 125 MiB (a capped server was OOM-killed): a body's
    arrays and objects, and its values, are counted on its text first. A prompt of 500,000 token
    ids is parsed (and refused by the context)."""
    _, proc, _ = served
    many = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 200_000, "max_tokens": 4}).encode()
    with HealthWatch(server, proc.pid) as watch:
        status, out = post_raw(server, many, "/v1/chat/completions")
        time.sleep(0.2)
    assert_error(status, out, 400, code="invalid_json")
    assert out["error"]["message"] == "the request body has more than 32768 arrays and objects"
    # the body read (its pieces, then joined) and little more: the parse took 18 times the body
    assert watch.max_rss - watch.rss_before <= 3 * len(many) + READ_BUFFERS, (watch.rss_before, watch.max_rss)
    assert_error(*post_raw(server, json.dumps({"prompt": [1000] * 600_000}).encode()), 400, code="invalid_json")
    # brackets, commas and escaped quotes inside strings are text
    text = json.dumps({"prompt": '"{[,:\\' * 200_000 + "x", "max_tokens": 1}).encode()
    assert_error(*post_raw(server, text), 400, code="context_length_exceeded")
    assert_error(*post_raw(server, json.dumps({"prompt": [1000] * 500_000}).encode()), 400,
                 code="context_length_exceeded")


def post_typed(server: str, content_type: bytes | None, body: bytes) -> tuple[int, dict]:
    """POST body to /v1/completions with that Content-Type header (None: no such header)."""
    u = urlparse(server)
    typed = b"Content-Type: %s\r\n" % content_type if content_type is not None else b""
    sock = raw_connection(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\n%sContent-Length: %d\r\n\r\n%s"
                 % (u.hostname.encode(), u.port, typed, len(body), body))
    try:
        return read_response(sock)
    finally:
        sock.close()


@pytest.mark.parametrize("content_type", [b"application/json", b"application/json; charset=utf-8", None,
                                          b"application/x-www-form-urlencoded"])
def test_a_json_body_is_read_as_clients_send_it(server, content_type):
    """application/json; none (requests.post(data=...)); curl -d's form type: llama-server reads each."""
    status, out = post_typed(server, content_type, b'{"prompt": "x", "max_tokens": 2}')
    assert status == 200, out
    assert out["object"] == "text_completion"


def test_a_form_s_body_is_not_json(server):
    """What a browser's form posts (url-encoded) is never JSON: a 400, not a guess."""
    assert_error(*post_typed(server, b"application/x-www-form-urlencoded", b"%7B%22prompt%22%3A+%22x%22%7D="),
                 400, code="invalid_json")


@pytest.mark.parametrize("content_type", [b"text/plain", b"multipart/form-data; boundary=x", b"text/html"])
def test_a_body_a_page_may_send_anywhere_is_415(server, content_type):
    """text/plain and multipart/form-data are what a web page's form sends to any site unasked."""
    assert_error(*post_typed(server, content_type, b'{"prompt": "x"}'), 415, code="unsupported_media_type")


def test_headers_beyond_the_limit_are_refused(server):
    # a head that arrives in one read passed h11's limit of an incomplete one
    u = urlparse(server)
    sock = raw_connection(server)
    try:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: %s:%d\r\nX-Pad: %s\r\n\r\n"
                     % (u.hostname.encode(), u.port, b"a" * 100_000))
        status, out = read_response(sock)
    finally:
        sock.close()
    assert_error(status, out, 431, code="request_header_fields_too_large")


@pytest.mark.parametrize("head", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nNo-Colon-Here\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\n\r\n",  # no Host
    b"NOT HTTP\r\n\r\n",
])
def test_a_request_that_is_not_http_is_400_in_openais_shape(server, head):
    sock = raw_connection(server)
    try:
        sock.sendall(head)
        status, out = read_response(sock)
    finally:
        sock.close()
    assert_error(status, out, 400, code="invalid_http")


def test_a_compressed_body_is_415_naming_its_encoding(server):
    # gzip's bytes were read as JSON and refused as "not UTF-8"
    import gzip
    assert_error(*post_typed(server, b"application/json\r\nContent-Encoding: gzip", gzip.compress(b'{"prompt": "x"}')),
                 415, code="unsupported_media_type")


def ticks_while(work) -> tuple[float, float]:
    """The longest a Python thread that ticks every millisecond had to wait while work() ran on
    another thread, and work's time (seconds): the whole of it when work holds the GIL (a busy
    machine's scheduler makes a few waits of a tenth of a second or more)."""
    longest, done = 0.0, threading.Event()

    def tick() -> None:
        nonlocal longest
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.001)
            now = time.monotonic()
            longest, last = max(longest, now - last), now

    ticker = threading.Thread(target=tick)
    ticker.start()
    worker = threading.Thread(target=work)
    started = time.monotonic()
    worker.start()
    worker.join()
    took = time.monotonic() - started
    done.set()
    ticker.join()
    return longest, took


@pytest.fixture(scope="module")
def engine():
    with Engine(DEMO, n_ctx=256, n_threads=1) as eng:
        yield eng


def test_tokenize_and_detokenize_release_the_gil(engine):
    text = "def add(a, b):\n    return a + b\n" * 200_000  # 6 MB: seconds of tokenizing
    tokens: list[int] = []
    longest, took = ticks_while(lambda: tokens.extend(engine.tokenize(text)))
    assert took > 0.5 and longest < took / 2, (longest, took)  # long enough to tell
    longest, took = ticks_while(lambda: engine.detokenize(tokens * 4))
    assert took > 0.5 and longest < took / 2, (longest, took)


def test_a_path_no_file_can_have_is_no_file_of_the_ui(tmp_path):
    # with --api-key, each path is checked for a UI file before the key: a NUL (ValueError) and a name
    # too long (OSError) were 500s with a traceback for any client
    from pyedgemoe.server.web_ui import WebUI

    (tmp_path / "index.html").write_text("<html><body>ui</body></html>")
    (tmp_path / "app.js").write_text("")
    ui = WebUI(tmp_path)
    assert ui.is_public("/app.js") and not ui.is_public("/none.js") and not ui.is_public("/../" + tmp_path.name)
    assert not ui.is_public("/a\x00b") and not ui.is_public("/" + "a/" * 3000) and not ui.is_public("/" + "a" * 300)
