"""Engine(n_parallel=N): several generations decoding together (pyedgemoe/batch.py), and an Engine
with one sequence used from several threads.

The demo model with a quarter of its experts cached, lossless: every expert computed in HIGH, so
a greedy answer is the model's whatever the cache holds and whatever runs beside it."""
from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import pytest

from pyedgemoe import ContextOverflowError, Engine, EngineBusyError, InvalidOptionError

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"
PROMPTS = ["def add(a, b):", "class Node(object):", "import os\n", "# Copyright", "for i in range(10):"]
N_CTX = 1024
OPTIONS = dict(expert_cache="25%", system="lossless", n_threads=1)


@pytest.fixture(scope="module")
def alone() -> dict[str, str]:
    """Each prompt's greedy answer from an Engine with one sequence, one prompt after another."""
    with Engine(DEMO, n_ctx=N_CTX // 4, **OPTIONS) as eng:
        return {p: eng.generate(p, 32, temperature=0, ignore_eos=True) for p in PROMPTS}


@pytest.fixture(scope="module")
def batched():
    with Engine(DEMO, n_ctx=N_CTX, n_parallel=4, **OPTIONS) as eng:
        yield eng


def run_together(eng: Engine, prompts: list[str], **kwargs) -> list[str]:
    answers: list[str | None] = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        start.wait()
        answers[i] = eng.generate(prompts[i], 32, temperature=0, ignore_eos=True, **kwargs)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return answers


def test_generations_decoding_together_each_get_their_answer_alone(batched, alone):
    # five prompts for four sequences: the fifth waits for a free one
    before = batched.stats()
    assert run_together(batched, PROMPTS) == [alone[p] for p in PROMPTS]
    after = batched.stats()
    assert after["totals"]["n_decoded"] - before["totals"]["n_decoded"] == 32 * len(PROMPTS)
    # a step's experts over all layers outnumber the slots: LRU would evict each layer's just before
    # the next step needs them (1-2 % hits); the automatic policy with several sequences keeps them
    assert batched.expert_residency["cache_policy"] == "hobbit"
    hits, requests = (after["experts"]["total"][k] - before["experts"]["total"][k] for k in ("hits", "requests"))
    assert hits > 0.15 * requests


def test_streamed_generations_interleave_and_closing_one_frees_its_sequence(batched, alone):
    streams = [batched.generate(p, 32, temperature=0, ignore_eos=True, stream=True) for p in PROMPTS[:4]]
    firsts = [next(s) for s in streams]  # four sequences busy at once, each answered in turn
    streams[0].close()  # its sequence goes to the fifth
    fifth = batched.generate(PROMPTS[4], 32, temperature=0, ignore_eos=True)
    assert fifth == alone[PROMPTS[4]]
    for p, first, s in zip(PROMPTS[1:4], firsts[1:], streams[1:]):
        assert first + "".join(s) == alone[p]


def test_a_logits_processor_that_fails_ends_its_generation_alone(batched, alone):
    # a sampler's Python hook runs on the batcher's thread: its error reaches its caller, not the others
    errors: list[Exception] = []

    def failing(ids, logits):
        raise ZeroDivisionError("the caller's own bug")

    def run_failing() -> None:
        try:
            batched.generate(PROMPTS[0], 32, temperature=0, logits_processor=failing)
        except ZeroDivisionError as e:
            errors.append(e)
    failing_thread = threading.Thread(target=run_failing)
    failing_thread.start()
    assert run_together(batched, PROMPTS[1:3]) == [alone[p] for p in PROMPTS[1:3]]
    failing_thread.join(timeout=120)
    assert len(errors) == 1
    banned = batched.generate(PROMPTS[0], 8, temperature=0, ignore_eos=True,
                              logits_processor=lambda ids, logits: logits - 1.0)  # the same order: the same text
    assert banned == batched.generate(PROMPTS[0], 8, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("leaving", [KeyboardInterrupt, SystemExit])
def test_a_hook_that_interrupts_or_exits_reaches_its_caller_and_the_engine_goes_on(batched, alone, leaving):
    # as with one sequence: the exception in the caller, the batcher's thread alive for the next call
    def interrupting(ids, logits):
        raise leaving()
    with pytest.raises(leaving):
        batched.generate(PROMPTS[0], 8, temperature=0, logits_processor=interrupting)
    assert batched.generate(PROMPTS[1], 32, temperature=0, ignore_eos=True) == alone[PROMPTS[1]]


def test_a_hook_that_calls_its_own_engine_is_refused_not_a_deadlock(batched, alone):
    def reentrant(ids, logits):
        batched.generate("x", 1)
        return logits
    with pytest.raises(EngineBusyError, match="called its own Engine"):
        batched.generate(PROMPTS[0], 4, temperature=0, logits_processor=reentrant)
    assert batched.generate(PROMPTS[1], 32, temperature=0, ignore_eos=True) == alone[PROMPTS[1]]


@pytest.mark.parametrize("n_parallel", [1, 2])
def test_an_engine_closed_by_its_generations_hook_says_it_is_closed(n_parallel):
    with Engine(DEMO, n_ctx=N_CTX, n_parallel=n_parallel, **OPTIONS) as eng:
        def closing(ids, logits):
            eng.close()
            return logits
        with pytest.raises(RuntimeError, match="this Engine is closed"):
            eng.generate(PROMPTS[0], 4, temperature=0, logits_processor=closing)
        for after in (lambda: eng.chat_format, lambda: eng.tokens if n_parallel == 1 else eng.n_ctx,
                      lambda: eng.on_sequence(0, lambda sequence: "ran")):
            with pytest.raises(RuntimeError, match="this Engine is closed"):
                after()


def test_a_seeded_generation_reuses_no_prefix_and_repeats_itself(batched):
    kwargs = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.1, seed=7)
    first = batched.generate(PROMPTS[1], 16, **kwargs)
    assert batched.generate(PROMPTS[1], 16, **kwargs) == first
    assert batched.last_timings.n_cached_prompt_tokens == 0


def test_a_request_sharing_a_prefix_reuses_it_and_answers_as_without_reuse():
    # greedy: the tokens are the model's, whatever prefix of the prompt was evaluated before
    first, second = "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a + b\n\ndef mul(a, b):"
    with Engine(DEMO, n_ctx=N_CTX // 2, n_parallel=2, **OPTIONS) as eng:
        without = eng.generate(second, 16, temperature=0, ignore_eos=True)
        assert eng.last_timings.n_cached_prompt_tokens == 0
    with Engine(DEMO, n_ctx=N_CTX // 2, n_parallel=2, **OPTIONS) as eng:
        eng.generate(first, 16, temperature=0, ignore_eos=True)
        reused = eng.generate(second, 16, temperature=0, ignore_eos=True)
        n_first = len(eng.tokenize(first))
        assert 0 < eng.last_timings.n_cached_prompt_tokens <= n_first
    assert reused == without


def test_each_sequence_has_the_contexts_share(batched):
    assert batched.n_ctx == N_CTX // 4
    with pytest.raises(ContextOverflowError):
        batched.generate([1] * (N_CTX // 4), 4)


def test_a_batched_engine_refuses_what_needs_a_sequence_of_its_own(batched):
    with pytest.raises(InvalidOptionError, match="n_parallel=1"):
        batched.logits([1, 2, 3])
    with pytest.raises(InvalidOptionError, match="n_parallel=1"):
        Engine(DEMO, n_ctx=N_CTX, n_parallel=2, expert_cache="50%", big_little=0.7)
    with pytest.raises(InvalidOptionError, match="n_parallel"):
        Engine(DEMO, n_parallel=0)


def test_one_sequence_engine_serves_threads_in_turn(alone):
    with Engine(DEMO, n_ctx=N_CTX // 4, **OPTIONS) as eng:
        assert run_together(eng, PROMPTS[:3]) == [alone[p] for p in PROMPTS[:3]]


def test_one_sequence_engine_refuses_a_second_open_generation_on_the_same_thread(alone):
    with Engine(DEMO, n_ctx=N_CTX // 4, **OPTIONS) as eng:
        first = eng.generate(PROMPTS[0], 32, temperature=0, ignore_eos=True, stream=True)
        head = next(first)
        with pytest.raises(EngineBusyError, match="close"):
            eng.generate(PROMPTS[1], 4, temperature=0)
        assert head + "".join(first) == alone[PROMPTS[0]]  # the open one is unharmed
        assert eng.generate(PROMPTS[1], 32, temperature=0, ignore_eos=True) == alone[PROMPTS[1]]


def test_a_stream_read_on_by_another_thread_is_waited_for_not_refused(alone):
    """A web framework (Starlette's iterate_in_threadpool) or asyncio.to_thread takes each of a stream's
    tokens on whichever thread of its pool is free: a thread that took one of a stream may start the next
    request while another thread reads the rest. That start was refused (EngineBusyError), the turn tied to
    the thread that took the stream's first token; it waits for the stream now."""
    with Engine(DEMO, n_ctx=N_CTX // 4, **OPTIONS) as eng:
        first = eng.generate(PROMPTS[0], 32, temperature=0, ignore_eos=True, stream=True)
        head = next(first)  # taken here
        rest: list[str] = []
        reader = threading.Thread(target=lambda: (time.sleep(0.5), rest.extend(first)))  # the rest, on another thread
        reader.start()
        assert eng.generate(PROMPTS[1], 32, temperature=0, ignore_eos=True) == alone[PROMPTS[1]]
        reader.join()
        assert head + "".join(rest) == alone[PROMPTS[0]]


def test_streams_read_on_by_another_thread_holding_every_sequence_are_waited_for_not_refused(alone):
    with Engine(DEMO, n_ctx=N_CTX // 2, n_parallel=2, **OPTIONS) as eng:
        streams = [eng.generate(p, 32, temperature=0, ignore_eos=True, stream=True) for p in PROMPTS[:2]]
        heads = [next(s) for s in streams]  # both sequences held, by streams this thread took tokens of
        rests: list[str] = []
        reader = threading.Thread(target=lambda: (time.sleep(0.5), rests.extend("".join(s) for s in streams)))
        reader.start()
        assert eng.generate(PROMPTS[2], 32, temperature=0, ignore_eos=True) == alone[PROMPTS[2]]
        reader.join()
        assert [h + r for h, r in zip(heads, rests)] == [alone[p] for p in PROMPTS[:2]]


@pytest.mark.parametrize("n_parallel", [1, 2])
def test_streams_dropped_unclosed_in_reference_cycles_free_their_sequences_for_those_waiting(alone, n_parallel):
    """A web framework whose client left drops the stream without closing it (Starlette: the iterator in a
    reference cycle of the cancelled task, for the collector): it held its sequence, and every request after it
    waited for ever, until Python's collector happened to run (an outside probe's FastAPI app, 14 of 16 clients)."""
    with Engine(DEMO, n_ctx=N_CTX // 4 * n_parallel, n_parallel=n_parallel, **OPTIONS) as eng:
        gc.disable()  # the collector runs when the wait asks for it, not by chance
        try:
            for p in PROMPTS[:n_parallel]:
                dropped = eng.generate(p, 32, temperature=0, ignore_eos=True, stream=True)
                next(dropped)
                cycle = [dropped]
                cycle.append(cycle)
                del dropped, cycle
            answer: list[str] = []
            waiting = threading.Thread(target=lambda: answer.append(
                eng.generate(PROMPTS[2], 32, temperature=0, ignore_eos=True)), daemon=True)
            waiting.start()
            waiting.join(60)
        finally:
            gc.enable()
        assert answer == [alone[PROMPTS[2]]], "left waiting"


def test_a_thread_whose_open_generations_hold_every_sequence_is_refused_another_not_left_waiting(batched, alone):
    # it waited forever for a sequence only it could free (a one-sequence Engine refuses at once)
    streams = [batched.generate(p, 32, temperature=0, ignore_eos=True, stream=True) for p in PROMPTS[:4]]
    heads = [next(s) for s in streams]
    with pytest.raises(EngineBusyError, match=r"every sequence \(4\) holds a generation this thread started"):
        batched.generate(PROMPTS[0], 4, temperature=0)
    assert heads[0] + "".join(streams[0]) == alone[PROMPTS[0]]  # one taken to its end frees its sequence
    assert batched.generate(PROMPTS[1], 32, temperature=0, ignore_eos=True) == alone[PROMPTS[1]]
    for s in streams[1:]:
        s.close()


def test_threads_whose_open_generations_hold_every_sequence_and_wait_for_another_are_not_left_waiting(batched):
    """Each of four threads holds a sequence with a stream it left open, then asks for another: each
    waited for a sequence only a waiting thread could free, for ever. The last to ask is refused; once
    its thread lets its stream go, the others get theirs."""
    barrier, answers = threading.Barrier(4), {}

    def ask(i: int) -> None:
        held = batched.generate(PROMPTS[i], 32, temperature=0, ignore_eos=True, stream=True)
        next(held)
        barrier.wait()
        try:
            answers[i] = batched.generate(PROMPTS[i], 2, temperature=0, ignore_eos=True)
        except EngineBusyError as e:
            answers[i] = e
        finally:
            held.close()
    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "left waiting"
    refused = [a for a in answers.values() if isinstance(a, EngineBusyError)]
    assert len(refused) == 1 and "threads that wait for a sequence too" in str(refused[0])


def test_more_sequences_than_an_expert_bias_models_cache_serves_in_a_step_are_refused_at_load(tiny_model):
    """GPT-OSS's experts have biases: a ubatch's experts must all be in the cache at once, and a
    step of N sequences is one ubatch of N tokens. Every generation failed ("no slot left for this
    ubatch") where the cache held fewer tokens' experts than n_parallel."""
    path = tiny_model("gpt_oss")[0]
    with Engine(path, n_ctx=256, n_parallel=2, expert_cache="25%") as eng:
        cap = eng.stats()["experts"]["max_ubatch_tokens"]
        prompts = ["def foo(x):", "class Bar:", "Once upon"]
        results = {}
        threads = [threading.Thread(target=lambda p=p: results.update({p: eng.generate(p, 6, temperature=0)}))
                   for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert 2 <= cap < 4 and sorted(results) == sorted(prompts)
    with pytest.raises(InvalidOptionError,
                       match=f"n_parallel 4 decodes 4 tokens a step .* holds those of {cap} tokens"):
        Engine(path, n_ctx=256, n_parallel=4, expert_cache="25%")
