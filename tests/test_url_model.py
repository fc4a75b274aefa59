"""llama.cpp's -mu/--model-url (pyedgemoe/url_model.py): a GGUF from an http(s) URL into llama.cpp's
cache directory, served here by a real HTTP server on loopback; a split GGUF's shards with it; the
file used again without the network; failures one error line that leave no file."""
from __future__ import annotations

import base64
import functools
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import gguf
import numpy as np
import pytest

from gguf_splits import write_split
from pyedgemoe import url_model as url_model_module
from pyedgemoe.errors import ModelLoadError
from pyedgemoe.url_model import url_model

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "demo.gguf"


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def end_headers(self):
        # an ETag of the file's bytes, as a server of models sends one (the test's own: for its own files)
        file = Path(self.translate_path(self.path))
        if file.is_file():
            self.send_header("ETag", f'"{hash(file.read_bytes())}"')
        super().end_headers()

    def do_GET(self):
        if self.path == "/short.gguf":  # a Content-Length the body does not reach: a connection that ends early
            self.send_response(200)
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            self.wfile.write(b"GGUF" + b"\0" * 1000)
            self.wfile.flush()
            self.connection.shutdown(2)
            return
        super().do_GET()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, the served folder): the demo model, and a tiny Qwen3-MoE split into 3 shards."""
    root = tmp_path_factory.mktemp("served")
    shutil.copy(DEMO, root / "demo.gguf")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", root
    server.shutdown()


def cli(*args: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}
    return subprocess.run([sys.executable, "-m", "pyedgemoe", *args], capture_output=True, text=True, timeout=300,
                          env={**clean, "LLAMA_CACHE": str(cache), **env})


def tokens(r: subprocess.CompletedProcess) -> list[int]:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["tokens"]


GENERATE = ("-p", "def add(a, b):", "-n", "8", "--temp", "0", "--json", "-c", "256")


def test_mu_downloads_into_llama_cpp_s_cache_and_runs_the_model(served, tmp_path):
    url, _ = served
    cache = tmp_path / "cache"
    assert tokens(cli("run", "-mu", f"{url}/demo.gguf?download=1", *GENERATE, cache=cache)) == \
        tokens(cli("run", str(DEMO), *GENERATE, cache=cache))
    assert (cache / "demo.gguf").read_bytes() == DEMO.read_bytes()
    assert not list(cache.glob("*.downloadInProgress"))
    # there already: used without the network (nothing listens at this port now)
    assert tokens(cli("run", "-mu", "http://127.0.0.1:9/demo.gguf", *GENERATE, cache=cache)) == \
        tokens(cli("run", str(DEMO), *GENERATE, cache=cache))


def test_mu_with_m_downloads_to_m_s_path(served, tmp_path):
    url, _ = served
    target = tmp_path / "models" / "mine.gguf"
    r = cli("inspect", "-mu", f"{url}/demo.gguf", "-m", str(target), cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    assert target.read_bytes() == DEMO.read_bytes() and not (tmp_path / "cache" / "demo.gguf").exists()


def test_mu_brings_a_split_gguf_s_shards(served, tiny_model, tmp_path):
    url, root = served
    whole = tiny_model("qwen3_moe")[0]
    names = [Path(s).name for s in write_split(whole, root / "tiny.gguf", 3)]
    cache = tmp_path / "cache"
    r = cli("run", "-mu", f"{url}/{names[0]}", *GENERATE, cache=cache)
    assert tokens(r) == tokens(cli("run", str(whole), *GENERATE, cache=cache))
    assert sorted(p.name for p in cache.iterdir() if p.suffix != ".etag") == sorted(names)


@pytest.mark.parametrize("path, error", [
    ("/missing.gguf", "cannot download {url}/missing.gguf: HTTP 404"),
    ("/short.gguf", "cannot download {url}/short.gguf"),
])
def test_a_download_that_fails_is_one_error_line_and_leaves_no_file(served, tmp_path, path, error):
    url, _ = served
    cache = tmp_path / "cache"
    r = cli("run", "-mu", url + path, "-p", "x", cache=cache)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 1 and error.format(url=url) in errors[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not cache.exists() or not list(cache.iterdir())


@pytest.mark.parametrize("args, error", [
    (("-mu", "ftp://host/m.gguf"), "-mu takes an http:// or https:// URL, got 'ftp://host/m.gguf'"),
    (("-mu", "http://127.0.0.1:9/"), "the URL 'http://127.0.0.1:9/' names no file"),
    (("-mu", "http://[::1/m.gguf"), "-mu: 'http://[::1/m.gguf' is not a URL: Invalid IPv6 URL"),
    (("-mu", "http://127.0.0.1:9/m.gguf", str(DEMO)), "give the model once: MODEL, -m MODEL, -hf USER/MODEL[:QUANT] "
                                                       "or -mu URL (given: MODEL, -mu)"),
    (("-mu", "http://127.0.0.1:9/m.gguf"), "cannot download http://127.0.0.1:9/m.gguf"),
])
def test_bad_mu_arguments_are_one_error_line(tmp_path, args, error):
    r = cli("run", *args, "-p", "x", cache=tmp_path / "cache")
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 1 and error in errors[0], r.stderr


def test_llama_arg_model_url_gives_way_to_a_model_on_the_command_line(served, tmp_path):
    url, _ = served
    cache = tmp_path / "cache"
    assert tokens(cli("run", *GENERATE, cache=cache, LLAMA_ARG_MODEL_URL=f"{url}/demo.gguf")) == \
        tokens(cli("run", str(DEMO), *GENERATE, cache=cache, LLAMA_ARG_MODEL_URL="http://127.0.0.1:9/x.gguf"))


def test_offline_mu_takes_only_a_file_already_there(served, tmp_path):
    url, _ = served
    cache = tmp_path / "cache"
    r = cli("run", "-mu", f"{url}/demo.gguf", "--offline", "-p", "x", cache=cache)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 1 and "is not at" in errors[0] and "not downloaded" in errors[0]
    assert not cache.exists() or not list(cache.iterdir())
    assert tokens(cli("run", "-mu", f"{url}/demo.gguf", *GENERATE, cache=cache))  # downloaded
    assert tokens(cli("run", "-mu", f"{url}/demo.gguf", "--offline", *GENERATE, cache=cache, LLAMA_ARG_OFFLINE="1"))


def test_mu_downloads_again_what_changed_on_the_server_as_llama_cpp(served, tmp_path):
    url, root = served
    cache = tmp_path / "cache"
    shutil.copy(DEMO, root / "moving.gguf")
    first = cli("inspect", "-mu", f"{url}/moving.gguf", cache=cache)
    assert first.returncode == 0, first.stderr
    assert (cache / "moving.gguf.etag").read_text().startswith('"')  # llama.cpp's file beside it
    again = cli("inspect", "-mu", f"{url}/moving.gguf", cache=cache)  # the same: not downloaded again
    assert again.returncode == 0 and "changed on the server" not in again.stderr
    fine = REPO / "models" / "fine.gguf"
    shutil.copy(fine, root / "moving.gguf")  # another model at the same URL
    changed = cli("inspect", "-mu", f"{url}/moving.gguf", cache=cache)
    assert changed.returncode == 0 and "note: -mu: " in changed.stderr and "changed on the server" in changed.stderr
    assert (cache / "moving.gguf").read_bytes() == fine.read_bytes()


def _tiny_gguf() -> bytes:
    """A GGUF of one tensor, 256 KiB."""
    with tempfile.TemporaryDirectory() as folder:
        writer = gguf.GGUFWriter(f"{folder}/t.gguf", "llama")
        writer.add_tensor("t", np.arange(1 << 16, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return Path(f"{folder}/t.gguf").read_bytes()


# A server that misbehaves as servers of models do, for url_model itself (in this process): its
# first path segment says how, the last names the file. Its files hold GGUF_BODY.
GGUF_BODY = _tiny_gguf()
ETAG = '"v1"'


class _Misbehaving(http.server.BaseHTTPRequestHandler):
    requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.answer(head=True)

    def do_GET(self):
        self.answer(head=False)

    def send(self, code, headers, body=b"", head=False):
        self.send_response(code)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def answer(self, head):
        split = urllib.parse.urlsplit(self.path)
        how = split.path.split("/")[1]
        self.requests.append((self.command, self.path, self.headers.get("Range")))
        if how == "redirect":
            return self.send(302, {"Location": "/ok/" + split.path.split("/")[-1], "Content-Length": "0"})
        if how == "loop":
            return self.send(302, {"Location": self.path, "Content-Length": "0"})
        if how == "signed" and split.query != "sig=ok&x=%2F":
            return self.send(403, {"Content-Length": "0"})
        if how == "auth" and self.headers.get("Authorization") != "Basic " + base64.b64encode(b"user:p@ss").decode():
            return self.send(401, {"Content-Length": "0"})
        if how == "html":
            return self.send(200, {"Content-Length": "30"}, b"<html>Please log in</html>    ", head)
        if how == "empty":
            return self.send(200, {"Content-Length": "0"})
        if how == "cut":  # no Content-Length, and the connection ends halfway
            return self.send(200, {}, GGUF_BODY[:len(GGUF_BODY) // 2], head)
        if how == "fail-once" and len(self.requests) == 1:
            return self.send(503, {"Content-Length": "0"})
        start = 0
        if self.headers.get("Range") and self.headers.get("If-Range") == ETAG:
            start = int(self.headers["Range"][len("bytes="):-1])
        body = GGUF_BODY[start:]
        headers = {"ETag": ETAG, "Accept-Ranges": "bytes", "Content-Length": str(len(body))}
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(GGUF_BODY) - 1}/{len(GGUF_BODY)}"
        self.send(206 if start else 200, headers, head=True)
        if head:
            return
        if how == "short":  # the end of the body never comes
            self.wfile.write(body[:1000])
            return self.connection.shutdown(socket.SHUT_RDWR)
        if how == "drop-first" and len(self.requests) == 1:  # the connection drops halfway, once
            self.wfile.write(body[:len(body) // 2])
            return self.connection.shutdown(socket.SHUT_RDWR)
        for i in range(0, len(body), 64 << 10):
            if how == "slow":
                time.sleep(0.1)
            self.wfile.write(body[i:i + (64 << 10)])


@pytest.fixture
def misbehaving(monkeypatch, tmp_path):
    """(base URL, the requests it got): a fresh server, llama.cpp's cache in tmp_path/cache."""
    _Misbehaving.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Misbehaving)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(url_model_module, "RETRY_SECONDS", 0.0, raising=False)
    yield f"http://127.0.0.1:{server.server_address[1]}", _Misbehaving.requests
    server.shutdown()


def gets(requests):
    return [r for r in requests if r[0] == "GET"]


def test_two_downloads_of_one_file_at_once_make_one_download(misbehaving, tmp_path):
    url, requests = misbehaving
    results = []
    threads = [threading.Thread(target=lambda: results.append(url_model(f"{url}/slow/m.gguf"))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [str(tmp_path / "cache" / "m.gguf")] * 2
    assert Path(results[0]).read_bytes() == GGUF_BODY and len(gets(requests)) == 1
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m.gguf", "m.gguf.etag"]


def test_a_file_in_a_cache_no_one_can_write_is_used_as_it_is(misbehaving, tmp_path):
    # the lock file of a download cannot be made there (a shared, read-only cache); it was an error
    url, requests = misbehaving
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "m.gguf").write_bytes(GGUF_BODY)
    if subprocess.run(["chattr", "+i", str(cache)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i does not work on this file system")
    try:
        assert url_model(f"{url}/ok/m.gguf") == str(cache / "m.gguf") and requests == []
    finally:
        subprocess.run(["chattr", "-i", str(cache)])


def test_a_split_url_s_shards_keep_its_query_and_its_case(misbehaving, tmp_path):
    url, requests = misbehaving
    first = url_model(f"{url}/signed/QM-00001-OF-00003.GGUF?sig=ok&x=%2F#part")
    assert first == str(tmp_path / "cache" / "QM-00001-OF-00003.GGUF")
    assert [r[1] for r in gets(requests)] == [f"/signed/QM-0000{i}-OF-00003.GGUF?sig=ok&x=%2F" for i in (1, 2, 3)]


def test_a_split_url_with_m_not_named_as_a_first_shard_is_refused_before_downloading(misbehaving, tmp_path):
    url, requests = misbehaving
    with pytest.raises(ModelLoadError, match="must be named as its first shard, NAME-00001-of-00003.gguf"):
        url_model(f"{url}/ok/m-00001-of-00003.gguf", tmp_path / "mine.gguf")
    assert requests == []


def test_a_dropped_connection_is_tried_again_from_where_it_ended(misbehaving, tmp_path):
    url, requests = misbehaving
    assert Path(url_model(f"{url}/drop-first/m.gguf")).read_bytes() == GGUF_BODY
    assert [r[2] for r in gets(requests)] == [None, f"bytes={len(GGUF_BODY) // 2}-"]


def test_a_server_error_is_tried_again_a_missing_file_not(misbehaving, tmp_path):
    url, requests = misbehaving
    assert Path(url_model(f"{url}/fail-once/m.gguf")).read_bytes() == GGUF_BODY
    requests.clear()
    with pytest.raises(ModelLoadError, match="HTTP 401"):
        url_model(f"{url}/auth/other.gguf")
    assert len(requests) == 1


def test_a_download_every_attempt_ended_early_is_resumed_by_the_next_run_while_its_etag_holds(misbehaving, tmp_path):
    url, requests = misbehaving
    with pytest.raises(ModelLoadError, match="the connection ended after 3000 of .* bytes [(]3 attempts[)]"):
        url_model(f"{url}/short/m.gguf")  # 1000 bytes each attempt
    partial = tmp_path / "cache" / "m.gguf.downloadInProgress"
    assert partial.read_bytes() == GGUF_BODY[:3000] and Path(f"{partial}.etag").read_text() == ETAG
    requests.clear()
    assert Path(url_model(f"{url}/ok/m.gguf")).read_bytes() == GGUF_BODY
    assert [r[2] for r in gets(requests)] == ["bytes=3000-"]
    # a partial of a file since changed on the server (another ETag) starts over
    partial.write_bytes(b"GGUF-old")
    Path(f"{partial}.etag").write_text('"v0"')
    (tmp_path / "cache" / "m.gguf").unlink()
    assert Path(url_model(f"{url}/ok/m.gguf")).read_bytes() == GGUF_BODY


def test_user_and_password_in_the_url_are_basic_auth_and_never_shown(misbehaving, tmp_path):
    url, _ = misbehaving
    host = url.removeprefix("http://")
    assert Path(url_model(f"http://user:p%40ss@{host}/auth/m.gguf")).read_bytes() == GGUF_BODY
    with pytest.raises(ModelLoadError) as refused:
        url_model(f"http://user:wrong@{host}/auth/other.gguf")
    assert "wrong" not in str(refused.value) and f"http://****:****@{host}/auth/other.gguf: HTTP 401" in str(refused.value)


def test_a_url_with_letters_beyond_ascii_is_percent_encoded(misbehaving, tmp_path):
    url, requests = misbehaving
    assert url_model(f"{url}/ok/modèle 1.gguf") == str(tmp_path / "cache" / "modèle 1.gguf")
    assert gets(requests)[0][1] == "/ok/mod%C3%A8le%201.gguf"


def test_a_redirect_loop_is_one_line(misbehaving):
    url, _ = misbehaving
    with pytest.raises(ModelLoadError) as refused:
        url_model(f"{url}/loop/m.gguf")
    assert "HTTP 302" in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("how", ["html", "empty", "cut"])
def test_a_body_not_a_whole_gguf_is_refused_and_leaves_no_file(misbehaving, tmp_path, how):
    url, _ = misbehaving
    with pytest.raises(ModelLoadError, match="what the server sent is not a whole GGUF file"):
        url_model(f"{url}/{how}/m.gguf")
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_check_whether_a_file_changed_stays_a_head_through_redirects(misbehaving):
    url, requests = misbehaving
    url_model(f"{url}/redirect/m.gguf")
    requests.clear()
    url_model(f"{url}/redirect/m.gguf")
    assert [r[0] for r in requests] == ["HEAD", "HEAD"]


def test_a_download_says_what_it_downloads_on_stderr(misbehaving, tmp_path, capsys):
    url, _ = misbehaving
    url_model(f"{url}/ok/m.gguf")
    assert capsys.readouterr().err.splitlines() == [
        f"note: -mu: downloading {url}/ok/m.gguf to {tmp_path / 'cache' / 'm.gguf'}",
        f"note: -mu: {len(GGUF_BODY)} bytes downloaded"]
