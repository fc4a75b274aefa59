"""--mlock / --no-mmap (llama.cpp's flags; Llama(use_mlock=..., use_mmap=...)): the weights and the
expert cache locked in memory, the weights read instead of mapped. Checked by the kernel's own
count of this process's locked memory (VmLck) and, with the locking refused (no CAP_IPC_LOCK, a
small RLIMIT_MEMLOCK), by the one error the load ends in."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyedgemoe import Engine, InvalidOptionError, Llama

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"
SMALL = dict(n_ctx=128, n_threads=2, verbose=False)


# Run in a process of its own: llama.cpp never unlocks what it locked (its llama_mlock has no
# unlock on destruction), so once a model is freed, heap pages the allocator keeps stay counted.
_LOCKED = """
import json, sys
from pathlib import Path
from pyedgemoe import Engine
with Engine(sys.argv[1], n_ctx=128, n_threads=2, **json.loads(sys.argv[2])) as eng:
    status = Path("/proc/self/status").read_text().splitlines()
    print(json.dumps({"locked": int(next(l for l in status if l.startswith("VmLck:")).split()[1]) * 1024,
                      "tokens": eng.tokenize(eng.generate("def add(a, b):", 8, temperature=0), add_bos=False),
                      "non_expert": eng.info.non_expert_bytes, "experts": eng.info.high_expert_bytes,
                      "cold": eng.info.cold_embedding_bytes, "embedding_mapped": eng.plan.embedding_mapped,
                      "pools": (eng.expert_residency or {}).get("pool_bytes", 0), "plan": eng.plan.describe()}))
"""


def loaded(**kwargs) -> dict:
    """What a fresh process that loads the demo model with kwargs has locked, and what it generates."""
    r = subprocess.run([sys.executable, "-c", _LOCKED, str(DEMO), json.dumps(kwargs)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def expected() -> list[int]:
    plain = loaded()
    assert plain["locked"] == 0
    return plain["tokens"]


def test_mlock_locks_the_mapped_weights_of_a_resident_model(expected):
    run = loaded(mlock=True)
    assert "weights       mapped, locked  (every weight resident, mapped from the file as llama.cpp does)" in run["plan"]
    assert run["locked"] >= 0.9 * (run["non_expert"] + run["experts"]) and run["tokens"] == expected


def test_no_mmap_reads_the_weights_into_memory(expected):
    run = loaded(mmap=False, mlock=True)
    assert "weights       read into memory, locked  (--no-mmap)" in run["plan"]
    assert run["locked"] >= run["non_expert"] + run["experts"] and run["tokens"] == expected


def test_mlock_locks_the_expert_cache_not_the_file(expected):
    run = loaded(mlock=True, expert_cache="25%", low_precision=False)  # lossless
    # the weights read into memory and the pools; not the experts' file, nor the input embedding's
    # rows, which stay mapped beside a cache
    assert run["embedding_mapped"]
    read = run["non_expert"] - run["cold"] + run["pools"]
    assert read <= run["locked"] < read + (1 << 20) and run["tokens"] == expected


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(expert_cache="mmap"), "--expert-cache mmap computes the experts from the mapped file"),
    (dict(expert_cache="25%", io="mmap"), "--io mmap reads the experts through a mapping"),
])
def test_no_mmap_refuses_what_maps_the_experts(kwargs, fragment):
    with pytest.raises(InvalidOptionError, match=fragment):
        Engine(DEMO, mmap=False, **kwargs, **SMALL)


def test_llama_cpp_pythons_arguments_reach_the_engine(expected):
    with Llama(model_path=str(DEMO), use_mmap=False, use_mlock=True, **SMALL) as llm:
        assert not llm.engine.plan.use_mmap and llm.engine.plan.expert_options["mlock"]
    with Llama(model_path=str(DEMO), use_mmap=True, expert_cache="25%", **SMALL) as llm:  # True: the plan's choice
        assert not llm.engine.plan.use_mmap


@pytest.mark.skipif(not (shutil.which("capsh") and shutil.which("prlimit")), reason="needs capsh and prlimit")
@pytest.mark.parametrize("limit_mib, cache, fragment", [
    (1, "auto", "--mlock: failed to mlock"),  # llama.cpp's weights: it warns and goes on; asked for, an error
    (8, "25%", "--mlock: cannot lock 3 MiB of the expert cache in memory"),  # the weights fit, the cache not
])
def test_a_lock_the_kernel_refuses_is_one_error_line(limit_mib, cache, fragment):
    limit = limit_mib << 20
    command = (f"prlimit --memlock={limit}:{limit} {sys.executable} -m pyedgemoe.cli run {DEMO} --mlock "
               f"--expert-cache {cache} -p hi -n 2")
    r = subprocess.run(["capsh", "--drop=cap_ipc_lock", "--", "-c", command], capture_output=True, text=True,
                       timeout=120)
    if "Operation not permitted" in r.stderr and "capsh" in r.stderr:
        pytest.skip("capsh cannot drop capabilities here")
    assert r.returncode == 1 and r.stderr.startswith(f"error: {fragment}") and len(r.stderr.splitlines()) == 1, \
        r.stderr[-2000:]
