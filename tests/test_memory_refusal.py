"""No OOM kill (issue 19): under a cgroup memory limit, an explicit `--expert-cache` that does not fit
beside the non-expert weights, the context (KV cache, compute and work buffers, vocabulary:
memory_budget.context_bytes) and the allowance is refused with one `error:` line, and the same
value with a trailing `~` ("up to") runs with what fits and says so. Every size either runs to the
end or is refused: none is killed.

The model: tests/test_memory_honesty.py's reduced OLMoE geometry, but f16 with experts of n_ff
1536, so that its experts (1152 MiB) dwarf everything else (18 MiB of weights, 153 MiB for the
context at run's defaults): a cache of all of them under a cap that leaves room for half really
exceeds the limit, and before the refusal the kernel killed the run (SIGKILL, no message); so
did `58%` when it was kept with a warning for fitting only in the former 384 MiB slack. The runs
use a prompt longer than a ubatch, so that llama.cpp's compute buffer is used whole. Written in
~10 s; a run takes a few seconds.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pyedgemoe import memory_budget
from pyedgemoe.load_plan import LoadOptions, context_memory_bytes
from pyedgemoe.model_info import read_model_info
from pyedgemoe.sysmem import evict_from_page_cache
from test_memory_honesty import cgroup_skip_reason, dense, run_capped_child, run_cli, two_layer_olmoe  # noqa: F401 (dense: a fixture)

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 20  # 640 tokens: a full ubatch of 512 and more
SWEEP = ["1%", "10%", "25%", "40%", "45%", "50%", "55%", "58%", "75%", "100%"]

pytestmark = [pytest.mark.skipif(cgroup_skip_reason() is not None, reason=str(cgroup_skip_reason())),
              pytest.mark.slow]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_model) -> Path:
    return two_layer_olmoe(tmp_path_factory.mktemp("refusal"), tiny_model("olmoe")[0], "olmoe-refusal", 1536, "f16")


@pytest.fixture(scope="module")
def cap(model, dense) -> tuple[int, int]:
    """(a cgroup limit with room for half of the experts beside the interpreter, the non-expert
    weights, the context of run's defaults and the allowance; the model's expert bytes)."""
    base = run_cli(dense, "auto", limit_bytes=4 * 2**30)  # the interpreter as the cgroup counts it
    assert base["returncode"] == 0, base["stderr"][-2000:]
    info = read_model_info(model)
    context = memory_budget.context_bytes(info.metadata, context_memory_bytes(info, LoadOptions()), 4096, 512,
                                          flash_attn=None)  # --ctx 4096, f16
    limit = (base["cgroup_max_usage"] + info.non_expert_bytes + context + memory_budget.RUN_ALLOWANCE_BYTES
             + info.expert_bytes // 2)
    return limit, info.expert_bytes


def run_capped(model: Path, expert_cache: str, limit: int) -> dict:
    evict_from_page_cache(model)
    return run_cli(model, expert_cache, limit_bytes=limit, prompt=LONG_PROMPT, n_predict=64)


def refusal_line(result: dict) -> str:
    """The one line on stderr of a refused run (exit status 1), else an assertion error saying what happened."""
    assert result["returncode"] != -9, "killed by the kernel: the refusal did not happen"
    assert result["returncode"] == 1, result["stderr"][-2000:]
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: expert cache "), result["stderr"]
    return lines[0]


def test_a_cache_that_cannot_fit_is_refused_with_one_error_line_not_killed(model, cap):
    limit, _ = cap
    line = refusal_line(run_capped(model, "100%", limit))
    assert line.startswith("error: expert cache 100% (")
    assert "does not fit" in line and "cgroup v1 memory limit" in line
    assert "for the context (KV cache, compute buffers, vocabulary, logits)" in line and "of allowance" in line
    assert "the largest expert cache that fits is" in line


def test_the_size_once_kept_with_a_warning_then_killed_is_refused_with_the_numbers(model, cap):
    """58 %: under the former 384 MiB slack it was kept, with 9 MiB of that slack left, and the kernel
    killed the run as the cache filled (docs/expert-residency.md). The compute buffer alone is
    84 MiB here (llama.cpp's own account), which the slack was not computed from."""
    limit, _ = cap
    line = refusal_line(run_capped(model, "58%", limit))
    assert line.startswith("error: expert cache 58% (668.16 MiB) does not fit: it needs 668.16 MiB + ")


def test_a_trailing_tilde_runs_with_what_fits_and_says_so(model, cap):
    limit, expert_bytes = cap
    r = run_capped(model, "100%~", limit)
    assert r["returncode"] == 0, f"100%~ under a {limit}-byte cap failed ({r['returncode']}):\n{r['stderr'][-2000:]}"
    notes = [line for line in r["stderr"].splitlines() if line.startswith("note: expert cache")]
    assert len(notes) == 1 and "reduced to what fits" in notes[0], r["stderr"]
    pool = r["stats"]["experts"]["pool_bytes"]
    assert expert_bytes // 3 < pool < 2 * expert_bytes // 3, "about the half the cap leaves room for"


def test_every_size_from_small_to_all_experts_runs_to_the_end_or_is_refused(model, cap):
    """The sweep (docs/expert-residency.md has its table): each size runs to the end or is refused
    with one line, never killed; below the minimum (one layer's top-8: 72 MiB, 6.25 %) for being
    too small, above the room the cap leaves (about half) for not fitting, and in between it runs."""
    limit, _ = cap
    outcomes = {}
    for value in SWEEP:
        r = run_capped(model, value, limit)
        outcomes[value] = (f"ran: pool {r['stats']['experts']['pool_bytes'] / 2**20:.1f} MiB, peak cgroup usage "
                           f"{r['cgroup_max_usage'] / 2**20:.1f} MiB" if r["returncode"] == 0 else refusal_line(r))
    print(f"limit {limit / 2**20:.1f} MiB:", *(f"{v}: {o}" for v, o in outcomes.items()), sep="\n")
    kinds = ["ran" if o.startswith("ran") else "too small" if "below the minimum" in o else
             "does not fit" if "does not fit" in o else o for o in outcomes.values()]
    assert kinds == sorted(kinds, key=["too small", "ran", "does not fit"].index), outcomes
    kind = dict(zip(SWEEP, kinds))
    assert (kind["1%"], kind["40%"], kind["75%"]) == ("too small", "ran", "does not fit"), outcomes


def test_perplexity_under_a_cap_keeps_room_for_its_chunks_logits(model, cap, tmp_path):
    """`pyedgemoe perplexity --ctx 512` asks for 512 tokens' logits per chunk: it loads with them
    reserved (n_logits = --ctx; 1.5 MiB with this model's 384-token vocabulary, so what this shows
    is that the reservation's path runs under a cap, not that it was needed) and runs to the end."""
    limit, _ = cap
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 150)  # > 2 x 512 tokens
    evict_from_page_cache(model)
    r = run_capped_child([sys.executable, "-m", "pyedgemoe", "perplexity", str(model), "-f", str(text), "--ctx", "512",
                          "--chunks", "1", "--json"], limit)
    assert r["returncode"] == 0, r["stderr"][-2000:]
    assert json.loads(r["stdout"])["n_chunks"] == 1


@pytest.mark.parametrize("command", [["run", "-p", "x", "-n", "2"], ["run", "--dry-run"], ["serve", "--port", "0"]])
def test_a_cap_below_what_measuring_the_context_takes_is_refused_not_killed(command):
    # the interpreter's own memory and a few MiB: measuring the context (llama.cpp's graph) took the
    # rest and the OOM killer ended the process before a load's check could refuse
    demo = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"

    def cli(model: Path, limit: int) -> dict:
        return run_capped_child([sys.executable, "-m", "pyedgemoe", command[0], str(model), *command[1:], "-t", "1"],
                                limit)
    base = cli(demo.parent / "missing.gguf", 4 * 2**30)["cgroup_max_usage"]  # what comes before the model's plan
    r = cli(demo, base + 8 * 2**20)
    assert r["returncode"] == 1, r
    assert r["stderr"].strip().splitlines()[-1].startswith("error: not enough memory: measuring the model's context")
