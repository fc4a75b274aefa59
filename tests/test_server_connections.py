"""`pyedgemoe serve` and its connections: sockets held open by a trickle (slowloris) are closed,
connections past `--max-connections` are refused, a web page of another site cannot use the server
(Host and Origin checked), a queued client that leaves leaves the queue, a generation whose client
leaves ends, and the access log does
not take a client's word for its address (X-Forwarded-For).

The real server in a subprocess (tests/test_server.py's) with a 2 s --timeout, over raw sockets."""
from __future__ import annotations

import http.client
import json
import signal
import socket
import time
from urllib.parse import urlparse

import pytest

from test_server import SERVER_ARGS, metric_values, open_stream, start_server, stop_server
from test_server_llama_api import FIM_OVERRIDES

TIMEOUT = 2.0
MAX_CONNECTIONS = 40


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log = tmp_path_factory.mktemp("connections") / "server.log"
    proc, url = start_server(log, *SERVER_ARGS, "--timeout", str(TIMEOUT), "--max-connections",
                             str(MAX_CONNECTIONS), "--allowed-hosts", "my.box", "--override-kv", FIM_OVERRIDES)  # /infill
    yield url, log
    stop_server(proc)


@pytest.fixture()
def server(served):
    return served[0]


def connect(url: str) -> socket.socket:
    u = urlparse(url)
    return socket.create_connection((u.hostname, u.port), timeout=10)


def get(url: str, path: str, headers: dict[str, str] | None = None, body: dict | None = None) -> tuple[int, dict]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("POST" if body is not None else "GET", path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def is_closed(sock: socket.socket, answers: dict | None = None) -> bool:
    """Whether the server has closed sock; what it sent before goes to answers[sock]."""
    try:
        while data := sock.recv(65536, socket.MSG_DONTWAIT):
            if answers is not None:
                answers[sock] = answers.get(sock, b"") + data
        return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_idle_trickling_and_slow_body_sockets_are_closed(server):
    idle = [connect(server) for _ in range(10)]
    trickling = [connect(server) for _ in range(10)]
    slow_body = [connect(server) for _ in range(10)]
    for s in trickling:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    for s in slow_body:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{")
    opened = time.monotonic()
    open_ones, answers = idle + trickling + slow_body, {}
    while open_ones and time.monotonic() - opened < TIMEOUT + 4:
        assert get(server, "/health")[0] == 200  # the server answers meanwhile
        for s in trickling + slow_body:
            try:
                s.send(b"a")  # a byte now and then: each keeps the socket "active"
            except OSError:
                pass
        open_ones = [s for s in open_ones if not is_closed(s, answers)]
        time.sleep(0.3)
    assert not open_ones, f"{len(open_ones)} of 30 sockets still open {TIMEOUT + 4} s later"
    assert time.monotonic() - opened > TIMEOUT - 0.5  # not closed before their time
    for s in slow_body:
        assert answers[s].startswith(b"HTTP/1.1 408 ")  # told why
    for s in idle + trickling + slow_body:
        s.close()


def test_connections_past_the_limit_are_answered_503(server):
    held = [connect(server) for _ in range(MAX_CONNECTIONS)]
    time.sleep(0.3)
    u = urlparse(server)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    conn.request("GET", "/health")
    status = conn.getresponse().status
    conn.close()
    for s in held:
        s.close()
    assert status == 503
    time.sleep(0.3)
    assert get(server, "/health")[0] == 200


def test_a_client_that_stops_reading_is_closed_after_the_timeout(server):
    # answers it never reads fill the sockets' buffers: the server's write waited for ever, and a few
    # dozen such clients held every connection
    u = urlparse(server)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((u.hostname, u.port))
    sock.setblocking(False)
    for _ in range(500):  # pipelined requests of an 8 KB page (no key needed)
        try:
            sock.send(b"GET /experts HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        except BlockingIOError:  # the server no longer reads: its answers wait
            break
        time.sleep(0.005)
    time.sleep(TIMEOUT + 3)
    assert is_closed(sock)  # reset: what waited in the buffers dropped
    sock.close()
    assert get(server, "/health")[0] == 200


def test_a_connection_past_the_limit_is_held_for_a_short_while_only(tmp_path):
    # idle, it was held for --timeout like the others: a thousand of them took the file descriptors
    proc, url = start_server(tmp_path / "server.log", *SERVER_ARGS, "--timeout", "20", "--max-connections", "4")
    try:
        within, past = [connect(url) for _ in range(4)], [connect(url) for _ in range(4)]
        for s in within + past:
            s.setblocking(False)  # is_closed's "nothing yet" (a socket with a timeout raises TimeoutError)
        time.sleep(4)
        assert all(is_closed(s) for s in past) and not any(is_closed(s) for s in within)
        for s in within + past:
            s.close()
    finally:
        stop_server(proc)


def queue_depth(url: str) -> int:
    return get(url, "/health")[1]["queue_depth"]


def test_a_queued_client_that_leaves_leaves_the_queue(server):
    stream, _ = open_stream(server, 1500, key=None)  # holds the one sequence
    waiting = connect(server)
    body = json.dumps({"prompt": "import os\n", "max_tokens": 4}).encode()
    waiting.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 10
    while queue_depth(server) != 1:
        assert time.monotonic() < deadline, "the request never queued"
        time.sleep(0.05)
    waiting.close()
    left = time.monotonic()
    while queue_depth(server) != 0:
        assert time.monotonic() - left < 2, "a client that left still counts in the queue"
        time.sleep(0.05)
    stream.sock.shutdown(socket.SHUT_RDWR)
    stream.close()


def running(url: str) -> float:
    return metric_values(url)[("pyedgemoe_requests_running", ())]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "a", "max_tokens": 1500}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1500}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1500}),
    ("/v1/responses", {"input": "a", "max_output_tokens": 1500}),
    ("/completion", {"prompt": "a", "n_predict": 1500}),
    ("/infill", {"input_prefix": "def f(", "input_suffix": "\n", "n_predict": 1500}),
])
def test_a_client_that_leaves_a_non_streamed_generation_ends_it(served, path, body):
    """Answered 499 (counted so, no traceback), and the next request runs at once."""
    url, log = served
    leaving = connect(url)
    data = json.dumps({**body, "temperature": 0, "ignore_eos": True} if path in ("/completion", "/infill")
                      else body).encode()
    leaving.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
    deadline = time.monotonic() + 10
    while running(url) != 1:
        assert time.monotonic() < deadline, "the generation never started"
        time.sleep(0.05)
    time.sleep(0.3)  # tokens generated
    before = metric_values(url).get(("pyedgemoe_requests_total", (("code", "499"), ("path", path))), 0)
    leaving.close()
    left = time.monotonic()
    assert get(url, "/v1/completions", body={"prompt": "x", "max_tokens": 2})[0] == 200
    assert time.monotonic() - left < 3, "the generation went on after its client left"
    assert metric_values(url)[("pyedgemoe_requests_total", (("code", "499"), ("path", path)))] == before + 1
    assert "Traceback" not in log.read_text()


def count(url: str, path: str, code: str) -> float:
    return metric_values(url).get(("pyedgemoe_requests_total", (("code", code), ("path", path))), 0)


@pytest.mark.parametrize("how", ["mid-body", "mid-stream"])
def test_a_client_that_leaves_is_counted_499_not_500_or_200(served, how):
    url, log = served
    before = {code: count(url, "/v1/completions", code) for code in ("200", "499", "500")}
    if how == "mid-body":  # the body never finishes: no answer at all (it was counted a 500)
        sock = connect(url)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        time.sleep(0.3)
        sock.close()
    else:  # the 200 went out, its end did not (it was counted a 200)
        conn, _ = open_stream(url, 1500, key=None)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    deadline = time.monotonic() + 5
    while count(url, "/v1/completions", "499") != before["499"] + 1:
        assert time.monotonic() < deadline, metric_values(url)
        time.sleep(0.1)
    assert {code: count(url, "/v1/completions", code) for code in ("200", "500")} == \
        {code: before[code] for code in ("200", "500")}
    assert "Traceback" not in log.read_text()


def test_stopping_the_server_answers_a_body_still_arriving_503_at_once(tmp_path):
    # uvicorn waited its graceful 5 s for the body, then cancelled its read: a traceback and a 500
    proc, url = start_server(tmp_path / "server.log", *SERVER_ARGS)
    sock = connect(url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\":")
    time.sleep(0.3)
    stopped = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0 and time.monotonic() - stopped < 3
    answer = b"".join(iter(lambda: sock.recv(65536), b""))  # to the close: the body may come in a packet of its own
    assert answer.startswith(b"HTTP/1.1 503") and b'"server_shutting_down"' in answer
    assert "Traceback" not in (tmp_path / "server.log").read_text()


@pytest.mark.parametrize("host, status", [
    ("evil.example", 403),  # DNS rebinding: a name of the attacker's, resolved to 127.0.0.1
    ("evil.example:{port}", 403),
    ("localhost:{port}", 200),
    ("127.0.0.1:{port}", 200),
    ("[::1]:{port}", 200),
    ("my.box:{port}", 200),  # --allowed-hosts
])
def test_only_addresses_localhost_and_allowed_names_are_answered(server, host, status):
    got, out = get(server, "/v1/models", {"Host": host.format(port=urlparse(server).port)})
    assert got == status, out
    if status == 403:
        assert out["error"]["code"] == "forbidden_host"


def test_a_request_from_a_page_of_another_site_is_403(server):
    """A page of another site can make the visitor's browser POST to 127.0.0.1 (a form, or fetch()
    without reading the answer): the browser names the page in Origin."""
    port = urlparse(server).port
    body = {"prompt": "x", "max_tokens": 1}
    status, out = get(server, "/v1/completions", {"Origin": "http://evil.example"}, body)
    assert status == 403 and out["error"]["code"] == "forbidden_origin"
    assert get(server, "/v1/completions", {"Origin": "null"}, body)[0] == 403  # a sandboxed page
    assert get(server, "/v1/completions", {"Origin": f"http://127.0.0.1:{port}"}, body)[0] == 200  # its own page


def test_the_access_log_does_not_trust_x_forwarded_for(served):
    url, log = served
    assert get(url, "/health", {"X-Forwarded-For": "203.0.113.7"})[0] == 200
    time.sleep(0.2)
    lines = [line for line in log.read_text().splitlines() if "GET /health" in line]
    assert lines and "203.0.113.7" not in log.read_text()
    assert lines[-1].split()[1].startswith("127.0.0.1:")


def test_a_request_whose_body_trickles_is_408_and_closed(server):
    s = connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{")
    response = http.client.HTTPResponse(s)
    started = time.monotonic()
    response.begin()
    assert response.status == 408 and TIMEOUT - 0.5 < time.monotonic() - started < TIMEOUT + 2
    assert json.loads(response.read())["error"]["code"] == "request_timeout"
    assert is_closed(s)
    s.close()
    assert get(server, "/v1/completions", body={"prompt": "x", "max_tokens": 1})[0] == 200
