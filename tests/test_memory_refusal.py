"""No OOM kill (issue 19): under a cgroup memory limit, an explicit `--expert-cache` that cannot fit
beside the non-expert weights and the context is refused with one `error:` line, and
the same value with a trailing `~` ("up to") runs with what fits and says so; a size that fits
only by eating into the slack runs, with a warning.

The model: tests/test_memory_honesty.py's reduced OLMoE geometry, but f16 with experts of n_ff
1536, so that its experts (1152 MiB) are far more than the 384 MiB slack: a cache of all of them
under a cap that leaves room for a quarter really exceeds the limit, and before the refusal the
kernel killed the run (SIGKILL, no message). Written in ~10 s; the runs take a few seconds.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from pyedgemoe import memory_budget
from pyedgemoe.model_info import read_model_info
from pyedgemoe.sysmem import evict_from_page_cache
from test_memory_honesty import cgroup_skip_reason, dense, run_cli  # noqa: F401 (dense: a fixture)

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.skipif(cgroup_skip_reason() is not None, reason=str(cgroup_skip_reason())),
              pytest.mark.slow]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_model) -> Path:
    vocab, _ = tiny_model("olmoe")
    spec = importlib.util.spec_from_file_location("make_synthetic_gguf", ROOT / "scripts" / "make_synthetic_gguf.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen
    spec.loader.exec_module(gen)
    gen.GEOMETRIES["olmoe-refusal"] = dataclasses.replace(
        gen.GEOMETRIES["olmoe-1b-7b"], n_layer=2, n_embd=1024, n_head=8, n_head_kv=8, n_ff_exp=1536, n_ff=1536,
        tokenizer_pre=None)
    path = tmp_path_factory.mktemp("refusal") / "olmoe-refusal-f16.gguf"
    gen.write_synthetic_gguf(path, "olmoe-refusal", 2, "f16", seed=0, vocab_path=vocab, log=lambda s: None)
    return path


@pytest.fixture(scope="module")
def cap(model, dense) -> tuple[int, int]:
    """(a cgroup limit with room for a quarter of the experts beside the interpreter, the non-expert
    weights, the context of run's defaults and the slack; the model's expert bytes)."""
    base = run_cli(dense, "auto", limit_bytes=4 * 2**30)  # the interpreter as the cgroup counts it
    assert base["returncode"] == 0, base["stderr"][-2000:]
    info = read_model_info(model)
    context = memory_budget.context_bytes(info.metadata, 4096, 512, 2, flash_attn=None)  # --ctx 4096, f16
    limit = (base["cgroup_max_usage"] + info.non_expert_bytes + context + memory_budget.RESERVE_SLACK_BYTES
             + info.expert_bytes // 4)
    return limit, info.expert_bytes


def test_a_cache_that_cannot_fit_is_refused_with_one_error_line_not_killed(model, cap):
    limit, _ = cap
    evict_from_page_cache(model)
    r = run_cli(model, "100%", limit_bytes=limit)
    assert r["returncode"] != -9, "killed by the kernel: the refusal did not happen"
    assert r["returncode"] == 1, r["stderr"][-2000:]
    lines = [line for line in r["stderr"].splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: expert cache 100% ("), r["stderr"]
    assert "does not fit" in lines[0] and "cgroup v1 memory limit" in lines[0]
    assert "the largest expert cache that fits with" in lines[0]


def test_a_trailing_tilde_runs_with_what_fits_and_says_so(model, cap):
    limit, expert_bytes = cap
    evict_from_page_cache(model)
    r = run_cli(model, "100%~", limit_bytes=limit)
    assert r["returncode"] == 0, f"100%~ under a {limit}-byte cap failed ({r['returncode']}):\n{r['stderr'][-2000:]}"
    notes = [line for line in r["stderr"].splitlines() if line.startswith("note: expert cache")]
    assert len(notes) == 1 and "reduced to what fits" in notes[0], r["stderr"]
    pool = r["stats"]["experts"]["pool_bytes"]
    assert expert_bytes // 8 < pool < expert_bytes // 2, "about the quarter the cap leaves room for"
    assert r["cgroup_failcnt"] == 0 or r["cgroup_max_usage"] <= limit


def test_a_cache_that_fits_only_in_the_slack_runs_with_a_warning(model, cap):
    """Half the experts: 576 MiB beside the weights and context fit under the cap, with ~100 MiB of
    the 384 MiB slack left, which this small model's other buffers do not need."""
    limit, _ = cap
    evict_from_page_cache(model)
    r = run_cli(model, "50%", limit_bytes=limit)
    assert r["returncode"] == 0, r["stderr"][-2000:]
    notes = [line for line in r["stderr"].splitlines() if line.startswith("note: expert cache")]
    assert len(notes) == 1 and "fits, but leaves only" in notes[0] and "of slack" in notes[0], r["stderr"]
