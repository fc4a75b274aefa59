#!/usr/bin/env python3
"""Fetch the pinned llama.cpp source (from the llama-cpp-python sdist) and apply our patches.

The vendored tree is never committed: it is rebuilt from the registry package, checked
against a pinned sha256, and patched with native/patches/*.patch in order. Idempotent: a
stamp file records the sdist hash and the patch hashes; when both match nothing is done.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

NATIVE = Path(__file__).resolve().parent
VENDOR = NATIVE / "vendor"
LLAMA_DIR = VENDOR / "llama.cpp"
DOWNLOAD_DIR = VENDOR / "download"
STAMP = VENDOR / "llama.cpp.stamp"
PATCHES = sorted((NATIVE / "patches").glob("*.patch"))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_sdist() -> Path:
    DOWNLOAD_DIR.mkdir(parents=True, exist_ok=True)
    archive = DOWNLOAD_DIR / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if not archive.exists() or sha256_of(archive) != SDIST_SHA256:
        archive.unlink(missing_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--no-binary", SDIST_NAME, f"{SDIST_NAME}=={SDIST_VERSION}", "-d", str(DOWNLOAD_DIR)],
            check=True,
        )
    actual = sha256_of(archive)
    if actual != SDIST_SHA256:
        sys.exit(f"fetch_llama: sha256 mismatch for {archive.name}: got {actual}, pinned {SDIST_SHA256}")
    return archive


def extract_llama(archive: Path, dest: Path) -> None:
    """Extract <sdist>/vendor/llama.cpp/** into dest."""
    prefix = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and len(m.name) > len(prefix):
                m.name = m.name[len(prefix):]
                members.append(m)
        tar.extractall(dest, members=members, filter="data")


def apply_patches(tree: Path) -> None:
    for patch in PATCHES:
        result = subprocess.run(
            ["patch", "-p1", "--fuzz=0", "--forward", "--batch", "--no-backup-if-mismatch", "-i", str(patch)],
            cwd=tree, capture_output=True, text=True,
        )
        if result.returncode != 0:
            sys.exit(f"fetch_llama: patch {patch.name} does not apply:\n{result.stdout}{result.stderr}")
        print(f"fetch_llama: applied {patch.name}")


def wanted_stamp() -> str:
    lines = [f"sdist {SDIST_SHA256}"] + [f"patch {p.name} {sha256_of(p)}" for p in PATCHES]
    return "\n".join(lines) + "\n"


def main() -> None:
    stamp = wanted_stamp()
    if LLAMA_DIR.is_dir() and STAMP.exists() and STAMP.read_text() == stamp:
        print(f"fetch_llama: {LLAMA_DIR} is up to date")
        return
    archive = download_sdist()
    # Extract and patch in a scratch dir, then swap in: a failed patch never leaves a half tree.
    with tempfile.TemporaryDirectory(dir=VENDOR) as scratch:
        tree = Path(scratch) / "llama.cpp"
        tree.mkdir()
        extract_llama(archive, tree)
        apply_patches(tree)
        STAMP.unlink(missing_ok=True)
        if LLAMA_DIR.exists():
            shutil.rmtree(LLAMA_DIR)
        tree.rename(LLAMA_DIR)
    STAMP.write_text(stamp)
    print(f"fetch_llama: llama.cpp from {SDIST_NAME} {SDIST_VERSION} ready in {LLAMA_DIR}")


if __name__ == "__main__":
    main()
