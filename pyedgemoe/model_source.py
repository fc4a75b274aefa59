"""Models from the Hugging Face Hub, through huggingface_hub into its cache, as llama.cpp's -hf and
llama-cpp-python's Llama.from_pretrained get them:

    hub_model("ggml-org/Qwen3-30B-A3B-GGUF:Q8_0")   # -> the local path of the GGUF (its first shard)
    hub_download(repo_id, ["*q8_0.gguf"])           # from_pretrained's: names or globs, a file each

hub_model picks the file as llama.cpp's -hf does (common/download.cpp): the first GGUF model file
(not a projector, imatrix or draft head) whose name holds the quant followed by "." or "-", any
case; without a quant Q4_K_M, else Q8_0, else the first GGUF model file; of a split GGUF
(NAME-00001-of-0000N.gguf) the first shard, downloaded with all its shards. Offline
(HF_HUB_OFFLINE=1 or the CLI's --offline, or the Hub out of reach within HUB_CONNECT_SECONDS) the files come from the
cache. Every failure is one ModelLoadError.
"""
from __future__ import annotations

import fnmatch
import os
import re
import socket
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from pyedgemoe.errors import ModelLoadError

# how long to wait to reach the Hub before taking the local cache (huggingface_hub itself retries an
# unreachable Hub for ~23 s)
HUB_CONNECT_SECONDS = 3.0
# llama.cpp's choice where -hf names no quant, in this order
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
# files of a GGUF repo that are not a model llama.cpp loads alone (llama.cpp's gguf_filename_is_model)
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_SHARD = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})\.gguf$", re.IGNORECASE)


def hub_model(repo_and_quant: str, hf_file: str | None = None, token: str | None = None) -> str:
    """The local path of a Hub repo's GGUF model (USER/MODEL[:QUANT], or its file hf_file),
    downloaded with its shards where it is split."""
    repo_id, quant = _repo_and_quant(repo_and_quant)
    hub = _Hub(repo_id, token)
    with hub.errors(hf_file or f"a GGUF model{' of quant ' + quant if quant else ''}"):
        files = hub.files()
        name = (hf_file if hf_file in files else None) if hf_file else _best_model(files, quant)
        if name is None:
            wanted = f"file {hf_file}" if hf_file else f"GGUF model file of quant {quant}" if quant else "GGUF model file"
            ggufs = ", ".join(f for f in files if f.endswith(".gguf")) or "none"
            raise ModelLoadError(f"no {wanted} in {hub.where}; its GGUF files: {ggufs}")
        return [hub.download(f) for f in shard_names(name)][0]


def hub_download(repo_id: str, patterns: list[str], local_dir=None, cache_dir=None, token: str | None = None) -> list[str]:
    """The local paths of the repo's files matching each pattern (a name or a glob; one file each),
    the first first; a split GGUF's other shards are downloaded with it."""
    hub = _Hub(repo_id, token, local_dir, cache_dir)
    with hub.errors(", ".join(patterns)):
        names = list(patterns)
        if any(any(c in p for c in "*?[") for p in patterns):
            files, names = hub.files(), []
            for pattern in patterns:
                matches = [f for f in files if fnmatch.fnmatch(f, pattern)]
                if len(matches) != 1:
                    raise ModelLoadError(f"{len(matches) or 'no'} files of {hub.where} match {pattern!r}"
                                         f"{' (' + ', '.join(matches) + ')' if matches else ''}; its files: "
                                         f"{', '.join(files)}")
                names.append(matches[0])
        return [hub.download(n) for n in dict.fromkeys(f for name in names for f in shard_names(name))]


def _repo_and_quant(text: str) -> tuple[str, str]:
    """llama.cpp's common_download_split_repo_tag: USER/MODEL[:QUANT]."""
    parts = text.split(":")
    repo_id, quant = parts[0], parts[-1] if len(parts) > 1 else ""
    if len(repo_id.split("/")) != 2 or not all(repo_id.split("/")):
        raise ModelLoadError(f"{text!r} is not a Hugging Face repo: USER/MODEL[:QUANT], e.g. ggml-org/gpt-oss-20b-GGUF:Q8_0")
    return repo_id, quant


def _is_model(name: str) -> bool:
    return name.endswith(".gguf") and not any(k in name.rsplit("/", 1)[-1] for k in _NOT_MODELS)


def _first_shard_or_whole(name: str) -> bool:
    shard = _SHARD.match(name)
    return shard is None or int(shard[3]) <= 1 or int(shard[2]) == 1


def _best_model(files: list[str], quant: str) -> str | None:
    """llama.cpp's find_best_model."""
    for q in [quant] if quant else DEFAULT_QUANTS:
        pattern = re.compile(re.escape(q) + "[.-]", re.IGNORECASE)
        for f in files:
            if _is_model(f) and pattern.search(f) and _first_shard_or_whole(f):
                return f
    if not quant:
        return next((f for f in files if _is_model(f) and _first_shard_or_whole(f)), None)
    return None


def shard_names(name: str) -> list[str]:
    """name, or where it is a shard of a split GGUF, every shard's name in order (the first first),
    as llama.cpp's llama_split_path names them."""
    shard = _SHARD.match(name)
    if shard is None or int(shard[3]) <= 1:
        return [name]
    return [f"{shard[1]}-{i:05d}-of-{shard[3]}.gguf" for i in range(1, int(shard[3]) + 1)]


class _Hub:
    """A repo on the Hub through huggingface_hub, or in its cache when offline."""

    def __init__(self, repo_id: str, token: str | None, local_dir=None, cache_dir=None):
        try:
            import huggingface_hub
            from huggingface_hub import constants
        except ImportError:
            raise ModelLoadError("models from the Hugging Face Hub need huggingface_hub: pip install huggingface-hub") from None
        self.hf, self.repo_id, self.token, self.local_dir, self.cache_dir = huggingface_hub, repo_id, token, local_dir, cache_dir
        self.where = f"Hugging Face repo {repo_id!r}"
        forced = constants.HF_HUB_OFFLINE or offline_asked()  # the variable, read at huggingface_hub's import or now
        self.unreachable = None if forced else _unreachable(constants.ENDPOINT)
        self.offline = bool(forced) or self.unreachable is not None
        self._why_offline = (" (offline, HF_HUB_OFFLINE=1 or --offline: only files already in the cache load)" if forced
                             else f" (offline: {self.unreachable}; only files already in the cache load)" if self.unreachable else "")

    def files(self) -> list[str]:
        """The repo's file names: from the Hub, or offline from the cached snapshot of its main branch."""
        if not self.offline:
            return self.hf.list_repo_files(self.repo_id, token=self.token)
        snapshot = Path(self.hf.snapshot_download(self.repo_id, cache_dir=self.cache_dir, local_files_only=True))
        return sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())

    def download(self, name: str) -> str:
        return self.hf.hf_hub_download(self.repo_id, name, local_dir=self.local_dir, cache_dir=self.cache_dir,
                                       local_files_only=self.offline, token=self.token)

    @contextmanager
    def errors(self, what: str):
        """A context in which huggingface_hub's errors (offline, not found, gated, network, a bad repo
        id, ...) become one ModelLoadError."""
        try:
            yield
        except ModelLoadError:
            raise
        except Exception as e:
            text = str(e).strip()
            raise ModelLoadError(f"cannot get {what} from {self.where}{self._why_offline}: "
                                 f"{type(e).__name__}: {text.splitlines()[0] if text else ''}") from None


def offline_asked() -> bool:
    """Whether HF_HUB_OFFLINE says offline (huggingface_hub's true values), as `--offline` sets it."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _unreachable(endpoint: str) -> str | None:
    """Why the Hub at endpoint cannot be reached (one connection attempt of at most
    HUB_CONNECT_SECONDS), or None; None too behind a proxy, which huggingface_hub goes through."""
    url = urllib.parse.urlsplit(endpoint)
    if url.hostname is None or urllib.request.getproxies().get(url.scheme):
        return None
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=HUB_CONNECT_SECONDS).close()
        return None
    except OSError as e:
        return f"cannot reach {endpoint}: {e.strerror or e}"
