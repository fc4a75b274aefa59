"""At the context's edge, each face (Engine, drop-in Llama, CLI, server) as stock llama.cpp and
llama-cpp-python have it: a prompt that leaves no room for one generated token is refused whatever
max_tokens says but 0 (llama-cpp-python: len(prompt) >= n_ctx, llama-server: n_tokens >= n_ctx), in
llama-cpp-python's words from the drop-in and with llama-server's counts from the server; the Engine
refuses a negative max_tokens as given; a generation cut by a full context says so (the CLI's note,
/completion's truncated); what a pass of embeddings holds is what is counted and named. A tiny
Qwen3-MoE, trained on 512 positions, in a context of 64 asked: 256 positions."""
from __future__ import annotations

import re

import pytest

from pyedgemoe import ContextOverflowError, Engine, InvalidOptionError, Llama
from pyedgemoe.generation import SamplingParams
from conftest import in_process_server
from test_cli import assert_one_line_error, cli

N_CTX = 256  # -c 64, rounded up as llama.cpp allocates a context
SMALL = dict(n_ctx=64, n_threads=1)
GREEDY = SamplingParams(temperature=0.0)
STOCK_OVERFLOW = re.compile(r"Requested tokens \((\d+)\) exceed context window of (\d+)")  # llama_cpp/server/errors.py


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model("qwen3_moe")[0])


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model, **SMALL) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    with in_process_server(engine, "m") as c:
        yield c


@pytest.fixture(scope="module")
def whole_context(engine) -> str:
    """A text of exactly N_CTX tokens (each "x" one token, no BOS)."""
    text = "x" * N_CTX
    assert len(engine.prompt_tokens(text)) == N_CTX
    return text


def test_a_prompt_of_the_whole_context_is_refused_whatever_max_tokens_asks(engine, whole_context):
    tokens = engine.prompt_tokens(whole_context)
    for max_tokens in (None, 8):
        with pytest.raises(ContextOverflowError, match=f"prompt of {N_CTX} tokens .* room for 1 generated"):
            engine.generate_tokens(tokens, max_tokens, GREEDY)
    assert list(engine.generate_tokens(tokens, 0, GREEDY)) == []  # nothing asked for: it fits
    assert len(list(engine.generate_tokens(tokens[:-1], None, GREEDY, ignore_eos=True))) == 1


def test_the_server_and_the_cli_refuse_it_with_max_tokens_unlimited(client, model, whole_context):
    for path, body in (("/v1/completions", {"prompt": whole_context, "max_tokens": -1}),
                       ("/completion", {"prompt": whole_context})):  # llama-server's default n_predict: -1
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", (path, r.text)
    run = cli("run", model, "-t", "1", "-c", "64", "-n", "-1", "--temp", "0", "-p", whole_context)
    assert_one_line_error(run, f"prompt of {N_CTX} tokens does not fit the context of {N_CTX} tokens")


def test_the_dropin_refuses_it_in_llama_cpp_pythons_words(model, whole_context):
    with Llama(model, verbose=False, **SMALL) as llm:
        for call in (lambda: llm(whole_context, max_tokens=None), lambda: llm(whole_context, max_tokens=4),
                     lambda: llm.create_chat_completion([{"role": "user", "content": "x" * 400}])):
            with pytest.raises(ContextOverflowError) as e:
                call()
            assert isinstance(e.value, ValueError)
            said = STOCK_OVERFLOW.fullmatch(str(e.value))
            assert said and int(said[2]) == N_CTX and int(said[1]) >= N_CTX, str(e.value)


@pytest.mark.parametrize("max_tokens", [-1, -16, -17, -1000])
def test_the_engine_refuses_a_negative_max_tokens_as_given(engine, max_tokens):
    for call in (lambda: engine.create_completion("hi", max_tokens=max_tokens, temperature=0),
                 lambda: engine.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=max_tokens),
                 lambda: engine.generate("hi", max_tokens),
                 lambda: engine.generate_tokens(engine.prompt_tokens("hi"), max_tokens, GREEDY)):
        with pytest.raises(InvalidOptionError, match=f"max_tokens must be an integer >= 0, got {max_tokens}$"):
            call()


def test_max_tokens_minus_one_is_still_until_the_context_is_full_on_the_server_and_the_dropin(client, model, engine):
    prompt = "x" * (N_CTX - 6)
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": -1, "temperature": 0})
    assert r.status_code == 200, r.text
    until_full = engine.create_completion(prompt, max_tokens=None, temperature=0)
    assert r.json()["choices"][0]["text"] == until_full["choices"][0]["text"]
    with Llama(model, verbose=False, **SMALL) as llm:  # llama-cpp-python's None or <= 0
        unlimited = [llm(prompt, max_tokens=max_tokens, temperature=0)["choices"] for max_tokens in (-1, 0, None)]
    assert unlimited[0] == unlimited[1] == unlimited[2] and unlimited[0][0]["text"]


def test_a_chat_cut_by_a_full_context_says_so_in_conversation_mode(model):
    # a long first message: the reply runs into the end of the context before its end-of-generation token
    r = cli("run", model, "-t", "1", "-c", "64", "-cnv", "-st", "-n", "-1", "--temp", "0", "-p", "hello " * 75,
            input_text="")
    assert r.returncode == 0, r.stderr
    assert re.search(rf"^note: stopped after \d+ generated tokens: the context of {N_CTX} positions is full$",
                     r.stderr, re.M), r.stderr


def test_completion_is_truncated_where_the_context_ran_out(client, engine):
    tokens = engine.prompt_tokens("x" * (N_CTX - 4))
    full = client.post("/completion", json={"prompt": tokens, "temperature": 0, "ignore_eos": True}).json()
    assert (full["tokens_predicted"], full["stop_type"], full["truncated"]) == (4, "limit", True)
    asked = client.post("/completion", json={"prompt": tokens, "n_predict": 2, "temperature": 0,
                                             "ignore_eos": True}).json()
    assert (asked["tokens_predicted"], asked["stop_type"], asked["truncated"]) == (2, "limit", False)


def test_the_servers_context_error_has_llama_servers_counts(client, engine):
    text = "x" * 300
    for prompt in (text, engine.prompt_tokens(text)):  # counted by the Engine, or before it (token ids)
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["code"], error["type"], error["n_prompt_tokens"], error["n_ctx"]) == \
            ("context_length_exceeded", "invalid_request_error", 300, N_CTX)


def test_pooled_embeddings_count_the_tokens_embedded(model):
    with Llama(model, embedding=True, n_ctx=256, n_batch=256, n_ubatch=64, pooling_type=1, n_threads=1,
               verbose=False) as llm:
        text = "hello world " * 75
        assert len(llm.tokenize(text.encode())) > 64
        out = llm.create_embedding(text)
        assert out["usage"] == {"prompt_tokens": 64, "total_tokens": 64}  # one pass of n_ubatch tokens
        assert out["data"][0]["embedding"] == llm.engine.embed(llm.tokenize(text.encode())[:64]).tolist()


def test_the_embed_command_names_its_own_options_for_a_text_too_long(model):
    text = "x" * 101
    batch = cli("embed", model, "-t", "1", "-c", "64", "-p", text)
    assert_one_line_error(batch, "error: 101 tokens exceed the batch of 64 tokens (-b, at most the -c asked): embed "
                          "evaluates a text in one pass (raise -c)")
    pooled = cli("embed", model, "-t", "1", "-ub", "16", "--pooling", "mean", "-p", text)
    assert_one_line_error(pooled, "error: 101 tokens exceed -ub 16: embed evaluates a text in one pass (raise -ub)")


def test_a_share_of_the_context_says_so(model):
    with Engine(model, n_ctx=512, n_parallel=2, n_threads=1) as eng:
        with pytest.raises(ContextOverflowError) as e:
            eng.generate("x" * 300, 4)
    assert str(e.value) == ("prompt of 300 tokens does not fit the context of 256 tokens with room for 1 generated, "
                            "each sequence's share of n_ctx 512 across n_parallel 2 (raise n_ctx / --ctx, or lower "
                            "n_parallel / --parallel)")


def test_n_ubatch_0_is_the_batch_as_in_llama_cpp(model):
    with Llama(model, n_batch=32, n_ubatch=0, verbose=False, **SMALL) as llm:
        assert (llm.engine.plan.n_batch, llm.engine.plan.n_ubatch) == (32, 32)
    r = cli("run", model, "-c", "512", "-b", "128", "-ub", "0", "--dry-run")
    assert r.returncode == 0 and "batches of 128 in ubatches of 128" in r.stdout, r.stderr
