"""Speculative decoding without a draft model (pyedgemoe/speculative.py): llama-cpp-python's
draft_model / LlamaPromptLookupDecoding and llama.cpp's --spec-type ngram-simple. A guess is checked
in one batch and the picks that agree with it are taken, so the tokens are those of the model's
picks: the same as without a drafter, but where two tokens' logits tie within the rounding that a
batch's sums differ by (llama.cpp's speculative decoding has the same property)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from pyedgemoe import Engine, InvalidOptionError, Llama, LlamaPromptLookupDecoding
from pyedgemoe.generation import SamplingParams
from pyedgemoe.speculative import DraftControl, NgramSimple

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "demo.gguf"
CODE = (Path(__file__).parent / "speculative" / "prompt.txt").read_text()  # batch.py's first 1200 characters once
COPY_PROMPT = CODE + "\n\n" + CODE[:160]  # the text goes on as it did: guesses are taken
LOSSLESS = dict(expert_cache="25%", system="lossless", n_threads=1)
TIE = 0.02  # logits this close are a tie a batch's rounding may break either way


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def assert_same_up_to_ties(eng: Engine, prompt: list[int], plain: list[int], drafted: list[int]) -> None:
    """drafted is plain, or leaves it only where plain's pick tied with drafted's."""
    i = first_difference(plain, drafted)
    if i is None:
        assert len(plain) == len(drafted)
        return
    logits = eng.logits(prompt + plain[:i])[-1]
    assert abs(logits[plain[i]] - logits[drafted[i]]) < TIE, f"token {i}: not a tie"
    assert logits.max() - logits[drafted[i]] < TIE


def greedy(eng: Engine, prompt: list[int], n: int, draft=None) -> list[int]:
    # a seed makes each generation fresh: the prompt evaluated in the same batches every time
    return list(eng.generate_tokens(prompt, n, SamplingParams(temperature=0, seed=1, draft_model=draft)))


# -- the drafters ---------------------------------------------------------------------------------

def test_prompt_lookup_guesses_as_llama_cpp_python_s():
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding as Theirs
    rng = np.random.default_rng(0)
    for n, vocab, sizes in [(40, 5, (2, 10)), (200, 30, (3, 4)), (2, 3, (2, 10)), (60, 50, (1, 7))]:
        for _ in range(50):
            ids = rng.integers(0, vocab, n).astype(np.intc)
            assert LlamaPromptLookupDecoding(*sizes)(ids).tolist() == Theirs(*sizes)(ids).tolist()


def test_ngram_simple_takes_what_followed_the_latest_earlier_occurrence_of_the_last_n_tokens():
    d = NgramSimple(size_n=2, size_m=3)
    # the last two tokens (7, 8) occurred at 1 and at 6: the latest, 6, was followed by 9 9 4 ...
    ids = [1, 7, 8, 5, 5, 5, 7, 8, 9, 9, 4, 2, 2, 7, 8]
    assert d(np.array(ids)).tolist() == [9, 9, 4]
    # the latest occurrence (7, 7 at 8) has fewer than size_n tokens after it: no guess (llama.cpp's
    # copy_max < n_draft_min), though an earlier one (at 9? no: the search starts below the last) would
    assert d(np.array([1, 3, 3, 3, 3, 3, 3, 3, 7, 7, 7, 7])).tolist() == []
    assert d(np.array([1, 3, 3, 3, 3, 3, 3, 7, 8, 6, 7, 8])).tolist() == [6, 7]
    # a history of at most size_n + size_m + 1 tokens before the last one: none
    assert d(np.array([7, 8, 9, 7, 8, 9])).tolist() == []
    assert d(np.array([4, 4, 4, 4, 4, 4, 1, 2])).tolist() == []  # (1, 2) never occurred before


def ngram_simple_draft(ids: list[int], size_n: int, size_m: int) -> list[int]:
    """llama.cpp's common_ngram_simple_draft (common/ngram-map.cpp), line for line: tokens are ids
    but the last, sampled the last."""
    tokens, sampled = ids[:-1], ids[-1]
    cur_len = len(tokens)
    if cur_len <= size_n + size_m + 1:
        return []
    pattern = tokens[cur_len - size_n + 1:] + [sampled]
    match_pos = 0
    for j in range(cur_len - size_n - 1, 0, -1):
        if tokens[j:j + size_n] == pattern:
            match_pos = j
            break
    if match_pos == 0:
        return []
    copy_max = min(size_m, cur_len - (match_pos + size_n))
    return [] if copy_max < size_n else tokens[match_pos + size_n:match_pos + size_n + copy_max]


def test_ngram_simple_guesses_as_llama_cpp_s():
    rng = np.random.default_rng(1)
    for _ in range(3000):
        size_n, size_m = int(rng.integers(1, 4)), int(rng.integers(1, 6))
        ids = rng.integers(0, 3, int(rng.integers(1, 40))).tolist()
        assert NgramSimple(size_n, size_m)(np.array(ids, dtype=np.intc)).tolist() == ngram_simple_draft(ids, size_n, size_m)


def test_a_drafter_s_sizes_are_checked():
    for make in (lambda: NgramSimple(0, 4), lambda: NgramSimple(4, -1), lambda: LlamaPromptLookupDecoding(2, 0)):
        with pytest.raises(InvalidOptionError, match=">= 1"):
            make()


def test_drafting_pauses_while_checks_earn_less_than_plain_steps():
    c = DraftControl()
    assert c.size() == 0  # the first step measures a step without a guess
    c.record(0, 0, 1.0)
    assert c.size() == DraftControl.FIRST_SIZE
    c.record(2, 2, 1.5)  # 3 tokens in 1.5 s: earned; the whole guess was taken: twice as many next
    assert c.size() == 4
    c.record(4, 0, 4.0)  # 1 token in 4 s: lost, more than the last earned; 4 steps without a guess, then
    # one more than taken
    assert [c.size() for _ in range(5)] == [0, 0, 0, 0, 1]
    c.record(1, 0, 1.2)  # lost again: the pause doubles
    assert [c.size() for _ in range(9)] == [0] * 8 + [1]


# -- generation -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cached():
    with Engine(DEMO, n_ctx=1024, **LOSSLESS) as eng:
        yield eng


@pytest.mark.parametrize("drafter", [LlamaPromptLookupDecoding(), NgramSimple(3, 12)], ids=["prompt-lookup", "ngram"])
def test_greedy_tokens_with_a_drafter_are_the_model_s(cached, drafter):
    prompt = cached.tokenize(COPY_PROMPT)
    plain = greedy(cached, prompt, 96)
    drafted = greedy(cached, prompt, 96, drafter)
    t = cached.last_timings
    assert t.n_draft_tokens > 0 and t.n_draft_accepted > 0  # guesses were checked, and taken
    assert t.n_decoded == 96
    assert_same_up_to_ties(cached, prompt, plain, drafted)


def test_the_kv_cache_holds_no_rejected_guess_after_a_drafted_generation(cached):
    prompt = cached.tokenize(COPY_PROMPT)
    drafted = greedy(cached, prompt, 64, LlamaPromptLookupDecoding(num_pred_tokens=6))
    t = cached.last_timings
    assert t.n_draft_tokens > t.n_draft_accepted > 0  # some guesses were cut short
    held = cached.tokens
    assert held == prompt + drafted[:-1]  # the last pick is not evaluated yet
    after = cached.eval([drafted[-1]], all_logits=True)[-1]  # evaluated on what the KV cache holds
    fresh = cached.logits(prompt + drafted)[-1]
    assert np.abs(after - fresh).max() < 0.05


def test_a_drafter_s_bad_guess_is_an_error_naming_it(cached):
    prompt = cached.tokenize(COPY_PROMPT)
    with pytest.raises(InvalidOptionError, match="outside the vocabulary"):
        greedy(cached, prompt, 8, lambda ids: np.array([cached.n_vocab + 5]))
    with pytest.raises(InvalidOptionError, match="draft_model must be callable"):
        greedy(cached, prompt, 8, "ngram-simple")
    with pytest.raises(InvalidOptionError, match="draft_model is a drafter.* not a model"):  # llama.cpp's -md habit
        greedy(cached, prompt, 8, cached)
    assert greedy(cached, prompt, 4) == greedy(cached, prompt, 4)  # the Engine goes on


def test_the_budget_and_end_of_generation_hold_within_a_guess(cached):
    prompt = cached.tokenize(COPY_PROMPT)
    for n in (1, 2, 5, 17):
        assert len(greedy(cached, prompt, n, LlamaPromptLookupDecoding())) == n
    # the guess always goes on with an end-of-generation token: the generation stops there
    eos = cached.token_eos()
    drafted = greedy(cached, prompt, 40, lambda ids: np.array([eos] * 3))
    assert cached.last_timings.finish_reason in ("stop", "length") and eos not in drafted


def test_an_engine_wide_drafter_serves_every_generation(tmp_path):
    with Engine(DEMO, n_ctx=1024, draft_model=NgramSimple(3, 12), **LOSSLESS) as eng:
        eng.generate(COPY_PROMPT, 64, temperature=0)
        assert eng.last_timings.n_draft_tokens > 0
        eng.generate(COPY_PROMPT, 64, temperature=0, seed=2, draft_model=None)  # None: the Engine's
        assert eng.last_timings.n_draft_tokens > 0
        assert eng.stats()["totals"]["n_draft_tokens"] > 0


def test_a_drafter_with_big_little_is_refused_at_load():
    with pytest.raises(InvalidOptionError, match="big-little"):
        Engine(DEMO, n_ctx=256, expert_cache="25%", system="mobile", draft_model=NgramSimple())


def test_a_drafter_for_a_model_with_recurrent_layers_is_refused(tiny_model):
    """Qwen3-Next's gated delta net layers keep a state that cannot drop a rejected guess."""
    path = tiny_model("qwen3_next")[0]
    with pytest.raises(InvalidOptionError, match="qwen3next's recurrent layers cannot drop a rejected guess"):
        Engine(path, n_ctx=256, draft_model=LlamaPromptLookupDecoding())
    with Engine(path, n_ctx=256) as eng:
        with pytest.raises(InvalidOptionError, match="recurrent layers"):
            greedy(eng, [1, 17, 42, 99] * 5, 8, LlamaPromptLookupDecoding())
        assert len(greedy(eng, [1, 17, 42, 99] * 5, 8)) == 8


@pytest.mark.parametrize("dry", [["--dry-run"], ["-p", "hi", "-n", "4"]])
def test_the_cli_refuses_a_drafter_that_cannot_run_in_its_dry_run_too(tiny_model, dry):
    for model, more in ((tiny_model("qwen3_next")[0], []), (DEMO, ["--expert-cache", "25%", "--big-little", "0.5"])):
        r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", str(model), *dry, "--spec-type",
                            "ngram-simple", *more], capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and r.stderr.count("error:") == 1, r.stderr
        assert "speculative decoding (draft_model, --spec-type) cannot run" in r.stderr, r.stderr


def test_several_sequences_check_their_guesses_in_one_step(cached):
    prompts = [COPY_PROMPT, CODE[200:900] + "\n" + CODE[200:260]]
    alone = {p: greedy(cached, cached.tokenize(p), 48) for p in prompts}
    with Engine(DEMO, n_ctx=2048, n_parallel=2, **LOSSLESS) as eng:
        out, timings = {}, {}

        def one(p):
            out[p] = greedy(eng, eng.tokenize(p), 48, LlamaPromptLookupDecoding())
            timings[p] = eng.last_timings
        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sum(eng_t.n_draft_accepted for eng_t in timings.values()) > 0
    for p in prompts:
        assert_same_up_to_ties(cached, cached.tokenize(p), alone[p], out[p])


def test_a_decode_step_of_several_tokens_keeps_the_decode_s_precision_rule(tiny_model, tmp_path):
    """Fate's prefill_low_share puts a prompt batch's cold experts in LOW; decode steps, one token or
    several (sequences, or a guess checked), follow the decode's rule (here: all in HIGH)."""
    from pyedgemoe.convert.from_gguf import convert_gguf
    src, _ = tiny_model("qwen3_moe")
    path = convert_gguf(src, tmp_path / "q8-q4.gguf", high="q8_0", low="q4_0", progress=False)
    tokens = [5, 9, 13, 17, 21, 25]

    def low_selections(run) -> int:
        with Engine(path, n_ctx=256, expert_cache="50%", t1=1.0, t2=1.0, prefill_low_share=0.9, fill_cache=False) as eng:
            run(eng._decoder.live())
            return eng.stats()["experts"]["total"]["selections_low"]
    assert low_selections(lambda ctx: ctx.decode(tokens, 0, False, 0)) > 0  # a prompt's batch
    assert low_selections(lambda ctx: ctx.decode_step(tokens, list(range(6)), [0] * 6)) == 0


# -- llama-cpp-python's Llama, the CLI, the server ----------------------------------------------------

def test_llama_cpp_python_s_draft_model_code_runs_as_written():
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding as Theirs
    plain = Llama(str(DEMO), n_ctx=1024, verbose=False, **LOSSLESS)
    want = plain(COPY_PROMPT, max_tokens=48, temperature=0)["choices"][0]["text"]
    plain.close()
    for drafter in (LlamaPromptLookupDecoding(num_pred_tokens=10), Theirs(num_pred_tokens=10)):
        llm = Llama(str(DEMO), n_ctx=1024, draft_model=drafter, verbose=False, **LOSSLESS)
        assert llm.draft_model is drafter
        got = llm(COPY_PROMPT, max_tokens=48, temperature=0)["choices"][0]["text"]
        assert llm.engine.last_timings.n_draft_accepted > 0
        llm.close()
        assert got == want


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyedgemoe", *args], capture_output=True, text=True, timeout=300)


def test_cli_spec_type_ngram_simple_gives_the_model_s_tokens_and_reports_its_guesses(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(COPY_PROMPT)
    common = ["run", str(DEMO), "-f", str(prompt), "-n", "64", "--temp", "0", "-c", "1024", "--expert-cache", "25%",
              "--system", "lossless", "-t", "1", "--ignore-eos"]
    plain = json.loads(cli(*common, "--json").stdout)
    spec = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "12"]
    drafted = json.loads(cli(*common, *spec, "--json").stdout)
    if drafted["tokens"] != plain["tokens"]:
        with Engine(DEMO, n_ctx=1024, **LOSSLESS) as eng:
            assert_same_up_to_ties(eng, eng.tokenize(COPY_PROMPT), plain["tokens"], drafted["tokens"])
    streamed = cli(*common, *spec)
    assert streamed.returncode == 0
    assert "draft:" in streamed.stderr and "accepted" in streamed.stderr


@pytest.mark.parametrize("args, message", [
    (["--spec-type", "draft"], "--spec-type must be one of none, ngram-simple"),
    (["--spec-ngram-simple-size-n", "3"], "sizes of --spec-type ngram-simple"),
    (["--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", "0"], "size_m must be an integer >= 1"),
    (["--spec-type", "ngram-simple", "--system", "mobile", "--expert-cache", "25%"], "big-little"),
])
def test_cli_bad_speculative_options_are_one_error_line(args, message):
    r = cli("run", str(DEMO), "-p", "x", "-n", "2", *args)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in r.stderr


def test_serve_spec_type_checks_guesses_and_reports_them_as_llama_server(tmp_path):
    from test_server import request, start_server, stop_server
    proc, url = start_server(tmp_path / "server.log", "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                             "-c", "2048", "--expert-cache", "25%", "--system", "lossless")
    try:
        body = {"prompt": COPY_PROMPT, "n_predict": 48, "temperature": 0}
        status, answer = request("POST", url + "/completion", json.dumps(body).encode())
        assert status == 200
        assert answer["timings"]["draft_n"] >= answer["timings"]["draft_n_accepted"] > 0
        status, chat = request("POST", url + "/v1/completions", json.dumps({**body, "max_tokens": 48}).encode())
        assert status == 200 and chat["choices"][0]["text"] == answer["content"]
        status, metrics = request("GET", url + "/metrics")
        assert "pyedgemoe_draft_tokens_accepted_total" in metrics
        assert request("GET", url + "/props")[1]["default_generation_settings"]["speculative"] is True
    finally:
        stop_server(proc)


def test_a_drafter_s_error_ends_its_own_generation_alone():
    def broken(ids):
        raise RuntimeError("the drafter broke")
    with Engine(DEMO, n_ctx=2048, n_parallel=2, **LOSSLESS) as eng:
        prompt = eng.tokenize(COPY_PROMPT)
        errors, out = [], {}

        def one(name, drafter):
            try:
                out[name] = greedy(eng, prompt, 32, drafter)
            except RuntimeError as e:
                errors.append(str(e))
        threads = [threading.Thread(target=one, args=("broken", broken)),
                   threading.Thread(target=one, args=("fine", LlamaPromptLookupDecoding()))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == ["the drafter broke"] and len(out["fine"]) == 32
