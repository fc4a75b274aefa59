"""Read faults under the expert cache, injected by an LD_PRELOAD shim (tests/faults/eio_shim.c):
pread()s of the demo model's layer-1 experts fail with EIO, or come back short, from the Nth on.

A failed read is an ExpertLoadError naming the expert, its layer and the file offset (a
ModelLoadError while filling the cache at load); the KV cache is dropped (it would hold values
computed without that expert) and the Engine stays usable: the next call works once the storage
does. A short read that more reads complete is no fault (pread may return less)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from pyedgemoe import Engine

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "demo.gguf"
PROMPT = "def add(a, b):"
OPTIONS = dict(expert_cache="25%", system="lossless", fill_cache=False, n_threads=1)
# loading, one generation streamed, then another: what each gave (text, or the error's type and message)
SCRIPT = f"""
import json, sys
from pyedgemoe import Engine
from pyedgemoe.errors import PyEdgeMoEError
out = {{"pieces": 0}}
try:
    eng = Engine(sys.argv[1], **json.loads(sys.argv[2]))
except PyEdgeMoEError as e:
    print(json.dumps({{"load": [type(e).__name__, str(e)]}}))
    sys.exit(0)
try:
    for piece in eng.generate({PROMPT!r}, 32, temperature=0, ignore_eos=True, stream=True):
        out["pieces"] += 1
    out["first"] = "ok"
    eng.generate({PROMPT!r}, 32, temperature=0, ignore_eos=True)
except PyEdgeMoEError as e:
    out["first"] = [type(e).__name__, str(e)]
    try:
        out["second"] = eng.generate({PROMPT!r}, 32, temperature=0, ignore_eos=True)
    except PyEdgeMoEError as e:
        out["second"] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def layer1() -> tuple[int, int]:
    """The byte range of layer 1's expert tensors (both precisions)."""
    tensors = [t for t in gguf.GGUFReader(DEMO).tensors if t.name.startswith("blk.1.ffn_") and "_exps" in t.name]
    return min(t.data_offset for t in tensors), max(t.data_offset + t.n_bytes for t in tensors)


@pytest.fixture(scope="module")
def reference() -> str:
    with Engine(DEMO, **OPTIONS) as eng:
        return eng.generate(PROMPT, 32, temperature=0, ignore_eos=True)


def faulty_env(shim: Path, layer1: tuple[int, int], **fault) -> dict:
    env = dict(os.environ, LD_PRELOAD=str(shim), PYEDGEMOE_FAULT_PATH=str(DEMO),
               PYEDGEMOE_FAULT_BEGIN=str(layer1[0]), PYEDGEMOE_FAULT_END=str(layer1[1]))
    env.update({f"PYEDGEMOE_FAULT_{k.upper()}": str(v) for k, v in fault.items()})
    return env


def generate_under(env: dict, **options) -> dict:
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(DEMO), json.dumps({**OPTIONS, **options})],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def assert_names_the_read(message: str, what: str) -> None:
    assert "of layer 1" in message and "expert " in message and "file offset " in message and what in message, message


@pytest.mark.parametrize("n_parallel", [1, 2])
def test_eio_mid_generation_is_an_expert_load_error_and_the_next_call_works(shim, layer1, reference, n_parallel):
    out = generate_under(faulty_env(shim, layer1, after=60, times=1), n_parallel=n_parallel)
    assert out["pieces"] > 0  # it failed mid-generation, not at the prompt
    assert out["first"][0] == "ExpertLoadError"
    assert_names_the_read(out["first"][1], "Input/output error")
    assert out["second"] == reference


def test_storage_that_keeps_failing_keeps_saying_so(shim, layer1):
    out = generate_under(faulty_env(shim, layer1, after=60))
    assert out["first"][0] == out["second"][0] == "ExpertLoadError"
    assert_names_the_read(out["second"][1], "Input/output error")


def test_a_read_that_stays_short_is_an_error_and_one_completed_by_more_reads_is_not(shim, layer1, reference):
    out = generate_under(faulty_env(shim, layer1, after=60, short=1))
    assert out["first"][0] == "ExpertLoadError"
    assert_names_the_read(out["first"][1], "short read")
    assert generate_under(faulty_env(shim, layer1, after=60, short=1, times=1))["first"] == "ok"


def test_eio_while_filling_the_cache_is_a_model_load_error(shim, layer1):
    out = generate_under(faulty_env(shim, layer1), fill_cache=True, fill_background=False)
    assert out["load"][0] == "ModelLoadError"
    assert_names_the_read(out["load"][1], "Input/output error")


def test_eio_while_filling_the_cache_in_the_background_is_an_expert_load_error(shim, layer1, reference):
    # the fill's first reads (one expert of each layer) go out at load; the error comes with the
    # first generation, and the next one works
    out = generate_under(faulty_env(shim, layer1, times=1), fill_cache=True, fill_background=True)
    assert out["first"][0] == "ExpertLoadError"
    assert_names_the_read(out["first"][1], "Input/output error")
    assert out["second"] == reference


def test_eio_in_a_prefetch_or_a_low_copy_is_an_expert_load_error(shim, layer1):
    out = generate_under(faulty_env(shim, layer1, after=20), system="hobbit", prefetch="hobbit")
    assert out["first"][0] == "ExpertLoadError"
    assert_names_the_read(out["first"][1], "Input/output error")


def test_the_cli_prints_one_error_line(shim, layer1):
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", str(DEMO), "-p", PROMPT, "-n", "32", "--temp", "0",
                        "--expert-cache", "25%", "--no-fill-cache", "-t", "1"], capture_output=True, text=True,
                       timeout=120, env=faulty_env(shim, layer1, after=60))
    assert r.returncode == 1
    lines = [l for l in r.stderr.splitlines() if l.strip() and not l.startswith("note: ")]
    assert len(lines) == 1 and re.match(r"error: cannot read (the LOW copy of )?expert", lines[0]), r.stderr
