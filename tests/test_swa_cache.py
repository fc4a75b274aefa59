"""The sliding-window layers' KV cache (GPT-OSS's, Gemma's): full-size by default (llama-cpp-python's
default, llama.cpp's --swa-full), or with --no-swa-full / swa_full=False the window's positions alone
(llama-server's default): less memory for a long context, the same tokens. A prompt that departs
from what the sequence holds further back than the window is then evaluated afresh (llama-server's
check of the cache's first position), where a full-size cache reuses the prefix.

A tiny GPT-OSS (its sliding window 8 positions; llama.cpp's window cache 256 cells here, so a
600-token sequence has overwritten the start of it)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pyedgemoe import Engine, Llama
from pyedgemoe.generation import SamplingParams

GREEDY = SamplingParams(temperature=0)
PROMPT = [5 + i % 300 for i in range(600)]


@pytest.fixture(scope="module")
def gpt_oss(tiny_model):
    return tiny_model("gpt_oss")[0]


@pytest.fixture(scope="module")
def full(gpt_oss):
    with Engine(str(gpt_oss), n_ctx=1024, n_batch=32, n_ubatch=32, verbose=False) as e:
        yield e


@pytest.fixture(scope="module")
def window(gpt_oss):
    with Engine(str(gpt_oss), n_ctx=1024, n_batch=32, n_ubatch=32, verbose=False, swa_full=False) as e:
        yield e


def kv_bytes(engine) -> int:
    return sum(row["context"] for row in engine.stats()["memory"])


def top_logprobs(engine, prompt: list[int]) -> list[dict]:
    done = engine.create_completion(prompt, max_tokens=12, temperature=0, logprobs=3)
    return done["choices"][0]["logprobs"]["top_logprobs"]


def test_the_window_takes_less_memory_and_gives_the_same_tokens(full, window):
    assert kv_bytes(window) < 0.7 * kv_bytes(full)
    ours, theirs = top_logprobs(window, PROMPT), top_logprobs(full, PROMPT)
    assert [list(t) for t in ours] == [list(t) for t in theirs]
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(list(a.values()), list(b.values()), atol=2e-3)  # fewer cells summed (f16 KV)


@pytest.mark.parametrize("departs_at, reused_by_window", [(200, False), (590, True)])
def test_a_prompt_departing_behind_the_window_is_evaluated_afresh(full, window, departs_at, reused_by_window):
    for e in (full, window):
        list(e.generate_tokens(PROMPT, 8, GREEDY))  # the sequence holds 608 positions
    departed = PROMPT[:departs_at] + [7, 8, 9]
    ours, theirs = (list(e.generate_tokens(departed, 10, GREEDY)) for e in (window, full))
    assert ours == theirs
    assert full.last_timings.n_cached_prompt_tokens == departs_at
    assert window.last_timings.n_cached_prompt_tokens == (departs_at if reused_by_window else 0)


def test_rejected_guesses_are_dropped_within_the_window(full, window):
    """Speculative decoding drops the positions of a guess cut short: they are within the window."""
    wrong = SamplingParams(temperature=0, draft_model=lambda ids: np.array([1, 2, 3], dtype=np.intc))
    expected = list(full.generate_tokens(PROMPT, 16, GREEDY))
    assert list(window.generate_tokens(PROMPT, 16, wrong)) == expected
    assert window.last_timings.n_draft_tokens > 0


def test_llama_and_the_cli_take_swa_full(gpt_oss):
    for value in (None, True, False):
        with Llama(str(gpt_oss), n_ctx=1024, swa_full=value, verbose=False) as llm:
            assert llm.create_completion(PROMPT[:40], max_tokens=4, temperature=0)["choices"][0]["finish_reason"]
    texts = [subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", str(gpt_oss), "-p", "hello", "-n", "6",
                             "--temp", "0", "-t", "1", *flags], capture_output=True, text=True, timeout=300)
             for flags in ([], ["--no-swa-full"], ["--swa-full"])]
    assert all(r.returncode == 0 for r in texts) and len({r.stdout for r in texts}) == 1, texts[1].stderr
