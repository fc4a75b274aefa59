"""A model from a URL, as llama.cpp's `-mu/--model-url` gets it:

    url_model("https://example.org/models/moe-Q8_0.gguf")   # -> ~/.cache/llama.cpp/moe-Q8_0.gguf

The file goes where llama.cpp puts it (common/arg.cpp's get_default_local_path): named by the
URL's last path segment (query and fragment left out) in llama.cpp's cache directory ($LLAMA_CACHE,
else $XDG_CACHE_HOME/llama.cpp, else ~/.cache/llama.cpp), or at `path` where given (llama.cpp's -m
beside -mu; for a split GGUF named as its first shard, NAME-00001-of-00003.gguf). A split GGUF's
shard brings every shard (common_download_get_all_parts): the URL as given, and for the others the
same URL with only the shard's index changed. A file already there is used again unless the server
says it changed, as llama.cpp's download does: the ETag of its download is kept in NAME.etag, and a
HEAD request's ETag that differs (or one the file has none to compare with) downloads it again; no
answer within CHECK_SECONDS, or no ETag, keeps the file, so a run needs no network.

A download goes to NAME.downloadInProgress (llama.cpp's name) and takes the file's name only when
whole and a GGUF; one process at a time downloads a file (NAME.lock). As llama.cpp's, it makes
ATTEMPTS attempts, and where the server takes byte ranges, a download that ended early (the
connection, Ctrl-C) stays, its ETag in NAME.downloadInProgress.etag, and goes on from where it
ended while the server's ETag is the same. Every failure is one ModelLoadError. user:password@ in
the URL is sent as basic authentication and shown as ****:****@.
"""
from __future__ import annotations

import base64
import http.client
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from pyedgemoe.errors import ModelLoadError
from pyedgemoe.file_lock import exclusive_lock
from pyedgemoe.model_source import shard_names

CONNECT_SECONDS = 30.0  # to connect, and between two reads of a download
CHECK_SECONDS = 3.0  # for the server's answer whether a file already there changed
ATTEMPTS = 3  # llama.cpp's max_attempts
RETRY_SECONDS = 2.0  # before the second attempt, doubled before each next one (llama.cpp's backoff)


def url_model(url: str, path: str | os.PathLike | None = None, offline: bool = False) -> str:
    """The local path of the model at url (its first shard), downloaded unless already there
    (offline: never; a file not there is an error)."""
    parts = _parts(url)
    places = _places(parts, path)
    for part, place in zip(parts, places):
        if offline:
            if not place.exists():
                raise ModelLoadError(f"-mu: {_shown(part)} is not at {place}, and offline (--offline, HF_HUB_OFFLINE=1) "
                                     "it is not downloaded")
            continue
        if place.exists() and not os.access(place.parent, os.W_OK | os.X_OK):
            continue  # a cache no one can write (shared, read-only): used as it is, nothing there can change
        place.parent.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(place.with_name(place.name + ".lock")):
            # looked at under the lock: another process may have just downloaded it
            if place.exists() and _changed(part, place):
                print(f"note: -mu: {_shown(part)} changed on the server (its ETag): downloading it again",
                      file=sys.stderr)
                place.unlink()
            if not place.exists():
                _download(part, place)
    return str(places[0])


def cache_directory() -> Path:
    """llama.cpp's cache directory (fs_get_cache_directory, on Linux)."""
    if os.environ.get("LLAMA_CACHE"):
        return Path(os.environ["LLAMA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama.cpp"


def _split(url: str) -> urllib.parse.SplitResult:
    try:
        return urllib.parse.urlsplit(url)
    except ValueError as e:  # a bracketed host left open, a port that is not a number
        raise ModelLoadError(f"-mu: {url!r} is not a URL: {e}") from None


def _shown(url: str) -> str:
    """url to print: a password in it masked as llama.cpp masks it."""
    split = _split(url)
    if "@" not in split.netloc:
        return url
    return urllib.parse.urlunsplit(split._replace(netloc="****:****@" + split.netloc.rpartition("@")[2]))


def _name(url: str) -> str:
    name = _split(url).path.split("/")[-1]  # as written: %2F stays in the name, not a folder
    if not name or name in (".", ".."):
        raise ModelLoadError(f"-mu: the URL {_shown(url)!r} names no file")
    return name


def _with_shard_index(name: str, index: int) -> str:
    """name (a shard's, or a path or URL path ending in one) with another shard's index: only the
    digits of -00001-of-00003.gguf change, the rest (its case too) stays."""
    return f"{name[:-19]}{index:05d}{name[-14:]}"


def _parts(url: str) -> list[str]:
    """url, or where it names a shard of a split GGUF, every shard's URL in order (the first first)."""
    split = _split(url)
    if split.scheme not in ("http", "https"):
        raise ModelLoadError(f"-mu takes an http:// or https:// URL, got {_shown(url)!r}")
    count = len(shard_names(_name(url)))
    given = int(split.path[-19:-14]) if count > 1 else 1
    return [url if i == given else urllib.parse.urlunsplit(split._replace(path=_with_shard_index(split.path, i)))
            for i in range(1, count + 1)]


def _places(parts: list[str], path: str | os.PathLike | None) -> list[Path]:
    if path is None:
        return [cache_directory() / _name(p) for p in parts]
    path = Path(path)
    if len(parts) > 1 and (len(shard_names(path.name)) != len(parts) or path.name[-19:-14] != "00001"):
        raise ModelLoadError(f"-mu: a split GGUF's shards go beside -m's path, which must be named as its first shard, "
                             f"NAME-00001-of-{len(parts):05d}.gguf (got {path.name!r})")
    return [path.with_name(_with_shard_index(path.name, i)) if len(parts) > 1 else path
            for i in range(1, len(parts) + 1)]


def _etag_file(place: Path) -> Path:
    return place.with_name(place.name + ".etag")  # llama.cpp's (common/download.cpp's write_etag)


class _KeepMethodOnRedirect(urllib.request.HTTPRedirectHandler):
    """A HEAD stays a HEAD through redirects (urllib's handler makes every redirect a GET)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        request = super().redirect_request(req, fp, code, msg, headers, newurl)
        if request is not None:
            request.method = req.get_method()
        return request


_OPENER = urllib.request.build_opener(_KeepMethodOnRedirect())


def _open(url: str, seconds: float, method: str = "GET", headers: dict[str, str] | None = None):
    split = _split(url)
    # a path typed with spaces or non-ASCII letters goes percent-encoded; a %XX already there stays
    reserved = "/%:@!$&'()*+,;=?~"
    target = split._replace(netloc=split.netloc.rpartition("@")[2], path=urllib.parse.quote(split.path, safe=reserved),
                            query=urllib.parse.quote(split.query, safe=reserved), fragment="")
    request = urllib.request.Request(urllib.parse.urlunsplit(target), headers=headers or {}, method=method)
    if split.username is not None:
        secret = f"{urllib.parse.unquote(split.username)}:{urllib.parse.unquote(split.password or '')}"
        # unredirected: a redirect to another host does not get the password
        request.add_unredirected_header("Authorization", "Basic " + base64.b64encode(secret.encode()).decode())
    return _OPENER.open(request, timeout=seconds)


def _changed(url: str, place: Path) -> bool:
    """Whether the server's ETag of url differs from the one place was downloaded with (llama.cpp's
    rule: no answer, or no ETag, keeps the file; a file without one of its own is downloaded again)."""
    try:
        with _open(url, CHECK_SECONDS, "HEAD") as response:
            etag = response.headers.get("ETag")
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
        return False
    if not etag:
        return False
    try:
        return _etag_file(place).read_text().strip() != etag
    except OSError:
        return True


def _one_line(text: object) -> str:
    return " ".join(str(text).split())  # urllib's redirect-loop message has three lines


class _Retryable(Exception):
    """A failure another attempt may not meet: the connection, a timeout, an HTTP 5xx."""


class _Unfinished(ModelLoadError):
    """A download every attempt ended early: kept where the server can resume it."""


def _download(url: str, place: Path) -> None:
    partial = place.with_name(place.name + ".downloadInProgress")
    partial_etag = _etag_file(partial)
    try:
        etag = _attempts(url, place, partial)
        _check_whole_gguf(url, partial)
    except BaseException as e:
        # what ended early (the connection at every attempt, Ctrl-C) stays where the server can resume it
        if not (isinstance(e, (_Unfinished, KeyboardInterrupt, SystemExit)) and partial_etag.exists()):
            partial.unlink(missing_ok=True)
            partial_etag.unlink(missing_ok=True)
        raise
    os.replace(partial, place)
    partial_etag.unlink(missing_ok=True)
    if etag:
        _etag_file(place).write_text(etag)
    else:
        _etag_file(place).unlink(missing_ok=True)


def _check_whole_gguf(url: str, partial: Path) -> None:
    """A ModelLoadError unless partial is a GGUF file with all its tensors (a body without a
    Content-Length that ended early, an HTML page, an empty one are not)."""
    import gguf  # here: only a download needs it

    try:
        gguf.GGUFReader(partial, "r")
    except Exception as e:  # gguf-py raises ValueError/struct.error/IndexError on damage
        raise ModelLoadError(f"cannot download {_shown(url)}: what the server sent is not a whole GGUF file "
                             f"({_one_line(e)})") from None


def _attempts(url: str, place: Path, partial: Path) -> str | None:
    """partial made whole from url in up to ATTEMPTS attempts; the file's ETag."""
    print(f"note: -mu: downloading {_shown(url)} to {place}", file=sys.stderr)
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return _fetch(url, partial)
        except urllib.error.HTTPError as e:
            reason = f"HTTP {e.code} {_one_line(e.reason)}"
            if e.code < 500:
                raise ModelLoadError(f"cannot download {_shown(url)}: {reason}") from None
        except (_Retryable, urllib.error.URLError, http.client.HTTPException, OSError) as e:
            reason = _one_line(getattr(e, "reason", None) or getattr(e, "strerror", None) or e)
        except ValueError as e:  # a URL or a header urllib cannot take
            raise ModelLoadError(f"cannot download {_shown(url)}: {_one_line(e)}") from None
        if attempt == ATTEMPTS:
            raise _Unfinished(f"cannot download {_shown(url)} to {place}: {reason} ({ATTEMPTS} attempts)")
        seconds = RETRY_SECONDS * 2 ** (attempt - 1)
        print(f"note: -mu: {reason}: trying again in {seconds:g} s", file=sys.stderr)
        time.sleep(seconds)


def _fetch(url: str, partial: Path) -> str | None:
    """One attempt at partial, going on from its end where it holds the start of the file with
    the ETag kept beside it (a Range request); the file's ETag."""
    partial_etag = _etag_file(partial)
    had = partial.stat().st_size if partial.exists() and partial_etag.exists() else 0
    headers = {"Range": f"bytes={had}-", "If-Range": partial_etag.read_text()} if had else {}
    with _open(url, CONNECT_SECONDS, headers=headers) as response:
        etag = response.headers.get("ETag")
        if response.status == 206:
            given = re.fullmatch(r"bytes (\d+)-\d+/(\d+)", response.headers.get("Content-Range", ""))
            if not (had and given and int(given[1]) == had and etag == headers["If-Range"]):
                partial_etag.unlink(missing_ok=True)  # the next attempt starts over
                raise _Retryable("the server sent another part of the file than asked")
            total, mode = int(given[2]), "ab"
        else:  # the whole file: from its start
            length = response.headers.get("Content-Length")
            total, mode = (int(length) if length is not None else None), "wb"
        resumable = bool(etag) and (mode == "ab" or response.headers.get("Accept-Ranges") == "bytes")
        with open(partial, mode) as out:
            if resumable:
                partial_etag.write_text(etag)
            else:
                partial_etag.unlink(missing_ok=True)
            progress = _Progress(total)
            while chunk := response.read(1 << 20):
                out.write(chunk)
                progress.show(out.tell())
            progress.end(out.tell())
            if total is not None and out.tell() != total:
                raise _Retryable(f"the connection ended after {out.tell()} of {total} bytes")
    return etag


class _Progress:
    """Bytes downloaded on stderr: a line kept up to date on a terminal, else nothing until the end."""

    def __init__(self, total_bytes: int | None):
        self.total_bytes, self.terminal = total_bytes, sys.stderr.isatty()

    def show(self, done_bytes: int) -> None:
        if self.terminal:
            of = f" of {self.total_bytes / 2**20:.1f} MiB ({100 * done_bytes / self.total_bytes:.0f}%)" \
                if self.total_bytes else " MiB"
            print(f"\r-mu: {done_bytes / 2**20:.1f}{of}", end="", file=sys.stderr, flush=True)

    def end(self, done_bytes: int) -> None:
        print(("\n" if self.terminal else "") + f"note: -mu: {done_bytes} bytes downloaded", file=sys.stderr)
