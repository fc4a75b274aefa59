"""llama.cpp's -mu/--model-url (pyedgemoe/url_model.py): a GGUF from an http(s) URL into llama.cpp's
cache directory, served here by a real HTTP server on loopback; a split GGUF's shards with it; the
file used again without the network; failures one error line that leave no file."""
from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gguf_splits import write_split

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
