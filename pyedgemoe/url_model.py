"""A model from a URL, as llama.cpp's `-mu/--model-url` gets it:

    url_model("https://example.org/models/moe-Q8_0.gguf")   # -> ~/.cache/llama.cpp/moe-Q8_0.gguf

The file goes where llama.cpp puts it (common/arg.cpp's get_default_local_path): named by the
URL's last path segment (query and fragment left out) in llama.cpp's cache directory ($LLAMA_CACHE,
else $XDG_CACHE_HOME/llama.cpp, else ~/.cache/llama.cpp), or at `path` where given (llama.cpp's -m
beside -mu); a split GGUF's shard brings every shard (common_download_get_all_parts). A file
already there is used again unless the server says it changed, as llama.cpp's download does: the
ETag of its download is kept in NAME.etag, and a HEAD request's ETag that differs (or one the
file has none to compare with) downloads it again; no answer within CHECK_SECONDS, or no ETag,
keeps the file, so a run needs no network. A download goes to NAME.downloadInProgress (llama.cpp's
name) and takes the file's name only when whole; every failure is one ModelLoadError, and leaves
no file.
"""
from __future__ import annotations

import http.client
import os
import shutil
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from pyedgemoe.errors import ModelLoadError
from pyedgemoe.model_source import shard_names

CONNECT_SECONDS = 30.0  # to connect, and between two reads of a download
CHECK_SECONDS = 3.0  # for the server's answer whether a file already there changed


def url_model(url: str, path: str | os.PathLike | None = None, offline: bool = False) -> str:
    """The local path of the model at url (its first shard), downloaded unless already there
    (offline: never; a file not there is an error)."""
    parts = _parts(url)
    if path is not None:
        places = [Path(path)] + [Path(path).parent / _name(p) for p in parts[1:]]
    else:
        places = [cache_directory() / _name(p) for p in parts]
    for part, place in zip(parts, places):
        if place.exists() and not offline and _changed(part, place):
            print(f"note: -mu: {part} changed on the server (its ETag): downloading it again", file=sys.stderr)
            place.unlink()
        if not place.exists() and offline:
            raise ModelLoadError(f"-mu: {part} is not at {place}, and offline (--offline, HF_HUB_OFFLINE=1) it is not "
                                 "downloaded")
        if not place.exists():
            _download(part, place)
    return str(places[0])


def _etag_file(place: Path) -> Path:
    return place.with_name(place.name + ".etag")  # llama.cpp's (common/download.cpp's write_etag)


def _changed(url: str, place: Path) -> bool:
    """Whether the server's ETag of url differs from the one place was downloaded with (llama.cpp's
    rule: no answer, or no ETag, keeps the file; a file without one of its own is downloaded again)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=CHECK_SECONDS) as response:
            etag = response.headers.get("ETag")
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
        return False
    if not etag:
        return False
    try:
        return _etag_file(place).read_text().strip() != etag
    except OSError:
        return True


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


def _name(url: str) -> str:
    name = _split(url).path.split("/")[-1]  # as written: %2F stays in the name, not a folder
    if not name or name in (".", ".."):
        raise ModelLoadError(f"-mu: the URL {url!r} names no file")
    return name


def _parts(url: str) -> list[str]:
    """url, or where it names a shard of a split GGUF, every shard's URL in order (the first first)."""
    scheme = _split(url).scheme
    if scheme not in ("http", "https"):
        raise ModelLoadError(f"-mu takes an http:// or https:// URL, got {url!r}")
    shards = shard_names(url.split("#")[0].split("?")[0])
    return shards if len(shards) > 1 else [url]


def _download(url: str, place: Path) -> None:
    partial = place.with_name(place.name + ".downloadInProgress")
    try:
        place.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=CONNECT_SECONDS) as response, open(partial, "wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
            expected = response.headers.get("Content-Length")
            if expected is not None and out.tell() != int(expected):
                raise ModelLoadError(f"cannot download {url}: the connection ended after {out.tell()} of "
                                     f"{expected} bytes")
            etag = response.headers.get("ETag")
        os.replace(partial, place)
        if etag:
            _etag_file(place).write_text(etag)
        else:
            _etag_file(place).unlink(missing_ok=True)
    except ModelLoadError:
        partial.unlink(missing_ok=True)
        raise
    except urllib.error.HTTPError as e:
        partial.unlink(missing_ok=True)
        raise ModelLoadError(f"cannot download {url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        partial.unlink(missing_ok=True)
        reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or e
        raise ModelLoadError(f"cannot download {url} to {place}: {reason}") from None
