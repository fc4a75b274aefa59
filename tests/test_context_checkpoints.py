"""Context checkpoints (llama-server's --ctx-checkpoints): a model whose memory cannot drop its last
tokens (Qwen3-Next's gated delta nets, LFM2's short convolutions, a window-sized cache of GPT-OSS's
sliding-window layers) evaluated a chat's whole conversation again at every turn, the template
writing the last reply other than it was generated; with checkpoints taken 4 + n_ubatch and 4 tokens
before a prompt's end, the next turn restores one and evaluates the rest. The same tokens as a fresh
evaluation of the whole prompt; the memory a checkpoint takes counted in the plan."""
from __future__ import annotations

import numpy as np
import pytest

from pyedgemoe import Engine, InvalidOptionError
from pyedgemoe.context_checkpoints import DEFAULT_LIMIT, cuts
from pyedgemoe.generation import SamplingParams

GREEDY = SamplingParams(temperature=0)
FIRST = [{"role": "user", "content": "Tell me about the planets of the solar system, one by one. " * 6}]
SETTINGS = dict(n_ctx=1024, n_batch=64, n_ubatch=32, n_threads=2, verbose=False)


def test_a_prompt_pauses_where_llama_server_takes_its_checkpoints():
    assert cuts(0, 1000, 1024, 512) == [484, 996]  # 4 + n_ubatch and 4 tokens before the end
    assert cuts(0, 1000, 512, 512) == [488, 996]  # at most a batch before it
    assert cuts(990, 1000, 512, 512) == [996]  # after what the sequence held
    assert cuts(0, 4, 512, 512) == [] and cuts(996, 1000, 512, 512) == []


def conversation(engine: Engine, turns: int = 3) -> list[tuple[int, int, str]]:
    """A chat of `turns` turns: each turn's prompt tokens, the tokens its prefill reused and its reply."""
    messages, out = list(FIRST), []
    for turn in range(turns):
        reply = engine.create_chat_completion(messages, max_tokens=12, temperature=0)["choices"][0]["message"]
        timings = engine.last_timings
        out.append((timings.n_prompt_tokens, timings.n_cached_prompt_tokens, reply["content"]))
        messages += [reply, {"role": "user", "content": f"And what of planet number {turn + 3}? " * 4}]
    return out


@pytest.mark.parametrize("arch, n_parallel", [("qwen3_next", 1), ("lfm2_moe", 1), ("qwen3_next", 2),
                                              ("granitemoehybrid", 1), ("qwen3_5_moe", 1), ("nemotron_h", 1),
                                              ("jamba", 1)])
def test_a_chats_next_turn_restores_a_checkpoint_and_answers_as_without_them(tiny_model, arch, n_parallel):
    path = str(tiny_model(arch)[0])
    with Engine(path, **SETTINGS, n_parallel=n_parallel) as engine:
        assert engine.plan.ctx_checkpoints == DEFAULT_LIMIT
        turns = conversation(engine)
        held = [s.checkpoints.nbytes for s in engine._decoder.sequences]
        assert 0 < sum(held) and max(held) <= DEFAULT_LIMIT * engine.plan.checkpoint_bytes
    with Engine(path, **SETTINGS, n_parallel=n_parallel, ctx_checkpoints=0) as engine:
        assert engine.plan.ctx_checkpoints == 0
        afresh = conversation(engine)
    assert [reply for _, _, reply in turns] == [reply for _, _, reply in afresh]
    for (n_prompt, reused, _), (previous, _, _) in zip(turns[1:], turns):
        assert previous - 4 - SETTINGS["n_ubatch"] <= reused < n_prompt  # up to a checkpoint of the turn before
    assert [reused for _, reused, _ in afresh[1:]] == [0, 0]  # everything evaluated again without them


def test_a_window_cache_restores_a_checkpoint_behind_its_window(tiny_model):
    # GPT-OSS with --no-swa-full: a 300-token reply written otherwise departs from the sequence further
    # back than the window cache's 256 cells hold (tests/test_swa_cache.py)
    path, prompt = str(tiny_model("gpt_oss")[0]), [5 + i % 300 for i in range(600)]
    departed = prompt + [7, 8, 9]
    settings = dict(n_ctx=1024, n_batch=32, n_ubatch=32, n_threads=2, verbose=False)
    reused, replies = {}, {}
    for n in (DEFAULT_LIMIT, 0):
        with Engine(path, **settings, swa_full=False, ctx_checkpoints=n) as window:
            assert len(list(window.generate_tokens(prompt, 300, GREEDY, ignore_eos=True))) == 300
            replies[n] = list(window.generate_tokens(departed, 10, GREEDY))
            reused[n] = window.last_timings.n_cached_prompt_tokens
    with Engine(path, **settings) as full:
        assert replies[DEFAULT_LIMIT] == replies[0] == list(full.generate_tokens(departed, 10, GREEDY))
    assert reused == {DEFAULT_LIMIT: 596, 0: 0}  # the checkpoint 4 tokens before the first prompt's end


def test_the_restored_state_gives_the_logits_of_a_fresh_evaluation(tiny_model):
    path = str(tiny_model("qwen3_next")[0])
    prompt = [5 + i % 200 for i in range(300)]
    departed = prompt[:290] + [7, 8, 9, 10, 11, 12]
    with Engine(path, **SETTINGS) as engine:
        list(engine.generate_tokens(prompt, 4, GREEDY))
        ours = engine.create_completion(departed, max_tokens=6, temperature=0, logprobs=3)["choices"][0]
        assert engine.last_timings.n_cached_prompt_tokens == 300 - 4 - SETTINGS["n_ubatch"]
    with Engine(path, **SETTINGS) as engine:
        fresh = engine.create_completion(departed, max_tokens=6, temperature=0, logprobs=3)["choices"][0]
        assert engine.last_timings.n_cached_prompt_tokens == 0
    assert ours["text"] == fresh["text"]
    np.testing.assert_allclose(ours["logprobs"]["token_logprobs"], fresh["logprobs"]["token_logprobs"], atol=1e-4)


def test_the_plan_counts_the_checkpoints_memory_where_the_model_needs_them(tiny_model):
    with Engine(str(tiny_model("qwen3_moe")[0]), **SETTINGS) as attention:  # drops any tokens: none needed
        assert attention.plan.ctx_checkpoints == 0 and attention.plan.checkpoint_bytes == 0
        assert "none needed" in attention.plan.reasons["ctx_checkpoints"]
    plans = {}
    for n in (0, 2, 6):
        with Engine(str(tiny_model("qwen3_next")[0]), **SETTINGS, ctx_checkpoints=n) as engine:
            plans[n] = engine.plan
    each = plans[2].checkpoint_bytes
    assert each > 0 and plans[6].ctx_checkpoints == 6
    assert plans[2].context_bytes - plans[0].context_bytes == 2 * each
    assert plans[6].context_bytes - plans[0].context_bytes == 6 * each
    with pytest.raises(InvalidOptionError, match="ctx_checkpoints must be a count >= 0"):
        Engine(str(tiny_model("qwen3_next")[0]), **SETTINGS, ctx_checkpoints=-1)
