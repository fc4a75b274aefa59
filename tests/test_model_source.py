"""The model as llama.cpp's tools take it: MODEL, -m MODEL, or -hf USER/MODEL[:QUANT] (-hff FILE), a
GGUF of a Hugging Face repo picked by llama.cpp's rules and downloaded with its shards. The Hub is
out of reach here: the repo is laid out in huggingface_hub's cache and read offline, the way a
machine without network takes what it downloaded before."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gguf_splits import write_split
from pyedgemoe.convert.export import export
from pyedgemoe.model_source import _best_model, shard_names

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "demo.gguf"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPT = ["-p", "def main(", "-n", "12", "--temp", "0"]

# a listing like those of the GGUF repos on the Hub
LISTING = ["README.md", "mmproj-model-f16.gguf", "model-Q2_K.gguf", "model-q8_0.gguf",
           "Q4_K_M/model-Q4_K_M-00002-of-00002.gguf", "Q4_K_M/model-Q4_K_M-00001-of-00002.gguf", "imatrix.gguf"]


def test_the_file_is_picked_as_llama_cpp_picks_it():
    assert _best_model(LISTING, "") == "Q4_K_M/model-Q4_K_M-00001-of-00002.gguf"  # Q4_K_M first, its first shard
    assert _best_model(LISTING, "Q8_0") == _best_model(LISTING, "q8_0") == "model-q8_0.gguf"  # any case
    assert _best_model(LISTING, "Q5_K_M") is None
    without_defaults = ["mmproj-model-f16.gguf", "model-Q2_K.gguf", "model-IQ4_XS.gguf"]
    assert _best_model(without_defaults, "") == "model-Q2_K.gguf"  # the first model file, not the projector
    assert _best_model(["mmproj-model-f16.gguf"], "") is None
    assert _best_model(["model-Q8_0.gguf"], "Q8") is None  # the quant is followed by "." or "-"
    assert shard_names("Q4_K_M/model-Q4_K_M-00001-of-00002.gguf") == [
        "Q4_K_M/model-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/model-Q4_K_M-00002-of-00002.gguf"]
    assert shard_names("model-q8_0.gguf") == ["model-q8_0.gguf"]


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """A Hub cache holding repo pyedgemoe-tests/demo: the demo model as a Q8_0 file and, in two
    shards, as the Q4_K_M one (both the demo's q8_0 experts: what matters is which is read), its
    LOW copies as a Q4_K file, and a projector."""
    d = tmp_path_factory.mktemp("hub")
    std = export(DEMO, d / "demo-std.gguf", precision="high", progress=False)
    low = export(DEMO, d / "demo-low.gguf", precision="low", progress=False)
    shards = write_split(std, d / "shards" / "x.gguf", 2)
    snapshot = d / "home" / "hub" / "models--pyedgemoe-tests--demo" / "snapshots" / COMMIT
    (snapshot / "Q4_K_M").mkdir(parents=True)
    (d / "home" / "hub" / "models--pyedgemoe-tests--demo" / "refs").mkdir()
    (d / "home" / "hub" / "models--pyedgemoe-tests--demo" / "refs" / "main").write_text(COMMIT)
    (snapshot / "demo-Q8_0.gguf").symlink_to(std)
    (snapshot / "demo-Q4_K.gguf").symlink_to(low)
    (snapshot / "mmproj-demo-f16.gguf").symlink_to(std)
    for i, shard in enumerate(shards, 1):
        (snapshot / "Q4_K_M" / f"demo-Q4_K_M-0000{i}-of-00002.gguf").symlink_to(shard)
    return d / "home"


def cli(*args, hf_home: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    if hf_home is not None:
        env.update(HF_HUB_OFFLINE="1", HF_HOME=str(hf_home))
        env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "pyedgemoe", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def inspected_file(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()[0].split()[1]


def test_hf_takes_the_quant_asked_for_else_llama_cpps_default(hf_home):
    snapshot = hf_home / "hub" / "models--pyedgemoe-tests--demo" / "snapshots" / COMMIT
    assert inspected_file(cli("inspect", "-hf", "pyedgemoe-tests/demo:q8_0", hf_home=hf_home)) == \
        str(snapshot / "demo-Q8_0.gguf")
    r = cli("inspect", "-hf", "pyedgemoe-tests/demo", hf_home=hf_home)
    assert inspected_file(r) == str(snapshot / "Q4_K_M" / "demo-Q4_K_M-00001-of-00002.gguf")
    assert "in 2 shards)" in r.stdout.splitlines()[0]
    assert inspected_file(cli("inspect", "-hf", "pyedgemoe-tests/demo", "-hff", "demo-Q8_0.gguf",
                              hf_home=hf_home)) == str(snapshot / "demo-Q8_0.gguf")


def test_hf_generates_what_the_file_generates(hf_home):
    ours = cli("run", "-hf", "pyedgemoe-tests/demo", "--expert-cache", "25%", *PROMPT, hf_home=hf_home)
    assert ours.returncode == 0, ours.stderr
    local = cli("run", "-m", DEMO, "--no-low-precision", "--expert-cache", "25%", *PROMPT)
    assert local.returncode == 0, local.stderr
    assert ours.stdout == local.stdout and len(ours.stdout) > len("def main(")


def test_low_copies_from_the_repo_as_from_a_file(hf_home):
    """-hfl USER/MODEL[:QUANT]: --low-from's file got as -hf gets the model's."""
    snapshot = hf_home / "hub" / "models--pyedgemoe-tests--demo" / "snapshots" / COMMIT
    options = ["--expert-cache", "25%", "--t1", "0.3", "--json", *PROMPT]
    ours = cli("run", "-hf", "pyedgemoe-tests/demo:Q8_0", "-hfl", "pyedgemoe-tests/demo:q4_k", *options,
               hf_home=hf_home)
    assert ours.returncode == 0, ours.stderr
    local = cli("run", snapshot / "demo-Q8_0.gguf", "--low-from", snapshot / "demo-Q4_K.gguf", *options)
    a, b = json.loads(ours.stdout), json.loads(local.stdout)
    assert a["tokens"] == b["tokens"]
    assert a["stats"]["experts"]["low_source"] == str(snapshot / "demo-Q4_K.gguf")
    assert a["stats"]["experts"]["total"]["loads_low"] > 0
    both = cli("run", "-hf", "pyedgemoe-tests/demo:Q8_0", "-hfl", "pyedgemoe-tests/demo:Q4_K", "--low-from", "x.gguf",
               "-p", "x", hf_home=hf_home)
    assert both.returncode == 1 and both.stderr == "error: give --low-from FILE or -hfl USER/MODEL[:QUANT], not both\n"


@pytest.mark.parametrize("args, error", [
    (("-hf", "pyedgemoe-tests/demo:Q5_K_M"), "error: no GGUF model file of quant Q5_K_M in Hugging Face repo "
     "'pyedgemoe-tests/demo'; its GGUF files: Q4_K_M/demo-Q4_K_M-00001-of-00002.gguf, "
     "Q4_K_M/demo-Q4_K_M-00002-of-00002.gguf, demo-Q4_K.gguf, demo-Q8_0.gguf, mmproj-demo-f16.gguf"),
    (("-hf", "pyedgemoe-tests/demo", "-hff", "nope.gguf"), "error: no file nope.gguf in Hugging Face repo"),
    (("-hf", "pyedgemoe-tests/not-cached"), "error: cannot get a GGUF model from Hugging Face repo "
     "'pyedgemoe-tests/not-cached' (offline, HF_HUB_OFFLINE=1 or --offline: only files already in the cache load)"),
    (("-hf", "demo"), "error: 'demo' is not a Hugging Face repo: USER/MODEL[:QUANT]"),
    (("-hf", "pyedgemoe-tests/demo", "-hfl", "a/b/c"), "error: 'a/b/c' is not a Hugging Face repo: USER/MODEL[:QUANT]"),
    (("-hff", "demo-Q8_0.gguf", "x.gguf"), "error: -hff goes with -hf USER/MODEL"),
    (("-m", "a.gguf", "b.gguf"), "error: give the model once: MODEL, -m MODEL, -hf USER/MODEL[:QUANT] or -mu URL "
     "(given: MODEL, -m)"),
    ((), "error: give the model once: MODEL, -m MODEL, -hf USER/MODEL[:QUANT] or -mu URL"),
])
def test_a_model_not_to_be_had_is_one_error_line(hf_home, args, error):
    r = cli("run", *args, "-p", "x", hf_home=hf_home)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(error), r.stderr


def test_from_pretrained_brings_a_split_ggufs_shards(hf_home):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HF_HUB_OFFLINE": "1", "HF_HOME": str(hf_home)}
    env.pop("HF_HUB_CACHE", None)
    code = ("from pyedgemoe import Llama\n"
            "for name in ('*Q4_K_M-00001-of-00002.gguf', 'demo-Q8_0.gguf'):\n"
            "    llm = Llama.from_pretrained('pyedgemoe-tests/demo', name, n_ctx=64, verbose=False)\n"
            "    print(llm('def main(', max_tokens=12, temperature=0)['choices'][0]['text'].encode())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    split, whole = r.stdout.splitlines()
    assert split == whole and len(split) > len("b''")


def test_serve_names_the_model_by_its_repo_as_llama_server_does(hf_home, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HF_HUB_OFFLINE": "1", "HF_HOME": str(hf_home)}
    env.pop("HF_HUB_CACHE", None)
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pyedgemoe", "serve", "-hf", "pyedgemoe-tests/demo:Q8_0",
                                 "--port", "0", "-t", "1"], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"serving (\S+) on (http://\S+) ", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert found[1] == "pyedgemoe-tests/demo:Q8_0"
        models = json.loads(urllib.request.urlopen(found[2] + "/v1/models", timeout=30).read())
        assert [m["id"] for m in models["data"]] == ["pyedgemoe-tests/demo:Q8_0"]
        body = json.dumps({"model": "pyedgemoe-tests/demo:Q8_0", "prompt": "def main(", "max_tokens": 4}).encode()
        answer = urllib.request.urlopen(urllib.request.Request(found[2] + "/v1/completions", body,
                                                               {"Content-Type": "application/json"}), timeout=60)
        assert json.loads(answer.read())["model"] == "pyedgemoe-tests/demo:Q8_0"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def test_offline_takes_the_cache_without_trying_the_hub(hf_home):
    """--offline (llama.cpp's) as HF_HUB_OFFLINE=1: the cached file, no attempt to reach the Hub
    (whose error would say it could not be reached)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HF_HOME": str(hf_home),
           "HF_ENDPOINT": "http://127.0.0.1:9"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_HUB_CACHE", None)

    def run(*args):
        return subprocess.run([sys.executable, "-m", "pyedgemoe", "inspect", *args], capture_output=True, text=True,
                              env=env, timeout=300)
    r = run("-hf", "pyedgemoe-tests/demo:Q8_0", "--offline")
    assert inspected_file(r).endswith("demo-Q8_0.gguf")
    r = run("-hf", "pyedgemoe-tests/not-cached", "--offline")
    assert "(offline, HF_HUB_OFFLINE=1 or --offline: only files already in the cache load)" in r.stderr
    assert "(offline, HF_HUB_OFFLINE=1 or --offline" not in run("-hf", "pyedgemoe-tests/not-cached").stderr
