"""--mlock / --no-mmap (llama.cpp's flags; Llama(use_mlock=..., use_mmap=...)): the weights and the
expert cache locked in memory, the weights read instead of mapped. Checked by the kernel's own
count of this process's locked memory (VmLck) and, with the locking refused (no CAP_IPC_LOCK, a
small RLIMIT_MEMLOCK), by the one error the load ends in."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyedgemoe import Engine, InvalidOptionError, Llama

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"
SMALL = dict(n_ctx=128, n_threads=2, verbose=False)


def locked_bytes() -> int:
    """This process's locked memory, as the kernel counts it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmLck in /proc/self/status")


def tokens_of(engine: Engine) -> list[int]:
    return engine.tokenize(engine.generate("def add(a, b):", max_tokens=8, temperature=0), add_bos=False)


@pytest.fixture(scope="module")
def expected() -> list[int]:
    with Engine(DEMO, **SMALL) as plain:
        assert locked_bytes() == 0
        return tokens_of(plain)


def test_mlock_locks_the_mapped_weights_of_a_resident_model(expected):
    with Engine(DEMO, mlock=True, **SMALL) as eng:
        assert eng.plan.use_mmap and locked_bytes() >= 0.9 * eng.info.non_expert_bytes + eng.info.high_expert_bytes
        assert tokens_of(eng) == expected
    assert locked_bytes() == 0


def test_no_mmap_reads_the_weights_into_memory(expected):
    with Engine(DEMO, mmap=False, mlock=True, **SMALL) as eng:
        assert not eng.plan.use_mmap and "weights       read into memory, locked  (--no-mmap)" in eng.plan.describe()
        assert tokens_of(eng) == expected
        assert locked_bytes() >= eng.info.non_expert_bytes + eng.info.high_expert_bytes


def test_mlock_locks_the_expert_cache_not_the_file(expected):
    with Engine(DEMO, mlock=True, expert_cache="25%", low_precision=False, **SMALL) as eng:  # lossless
        # the weights read into memory and the pools; not the experts' file, nor the input
        # embedding's rows, which stay mapped beside a cache
        assert eng.plan.embedding_mapped
        read = eng.info.non_expert_bytes - eng.info.cold_embedding_bytes + eng.expert_residency["pool_bytes"]
        assert read <= locked_bytes() < read + (1 << 20)
        assert tokens_of(eng) == expected


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
