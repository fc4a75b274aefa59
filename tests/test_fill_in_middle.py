"""Fill in the middle as llama-cpp-python's users ask for it: create_completion(prompt, suffix=...)
(and Llama(spm_infill=True)), OpenAI's /v1/completions `suffix`, `serve --spm-infill`. A tiny
Qwen3-MoE whose fill-in-the-middle tokens are given by kv overrides (a code model's GGUF has them);
the prompt each makes is written out here from llama-cpp-python's create_completion (with the
model's tokens where 0.3 has its TODO) and llama-server's format_prompt_infill, and the text is the
Engine's greedy continuation of it."""
from __future__ import annotations

import json

import pytest

from pyedgemoe import Engine, InvalidOptionError, completions
from pyedgemoe.llama import Llama
from test_server import request, start_server, stop_server

FIM = {"pre": 3, "suf": 4, "mid": 5}
OVERRIDES = {f"tokenizer.ggml.fim_{role}_token_id": token for role, token in FIM.items()}
SMALL = dict(n_ctx=256, n_threads=1, verbose=False)
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n    return c\n"


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen3_moe")[0])


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model, override_kv=OVERRIDES, **SMALL) as eng:
        yield eng


def fim(engine, prefix: list[int], suffix: list[int], spm: bool = False) -> list[int]:
    """[BOS] [FIM_PRE] prefix [FIM_SUF] suffix [FIM_MID]; spm: the suffix's part first."""
    bos = [engine.token_bos()] if engine.add_bos else []
    before, after = [FIM["pre"], *prefix], [FIM["suf"], *suffix]
    return bos + (after + before if spm else before + after) + [FIM["mid"]]


def greedy_text(engine, tokens: list[int], n: int, finish_character: bool = False) -> str:
    """The Engine's greedy continuation of tokens, n tokens (finish_character: a character the last
    cuts finished first, as Llama gives it, llama-cpp-python's way; the server's is exact)."""
    out = completions.create_completion(engine, tokens, n, None, False, None, {"temperature": 0.0},
                                        finish_character=finish_character)
    return out["choices"][0]["text"]


def words(engine, text: str) -> list[int]:
    return engine.tokenize(text, add_bos=False)


@pytest.mark.parametrize("spm", [False, True])
def test_a_suffix_fills_the_middle_with_the_models_tokens(model, engine, spm):
    expected = fim(engine, words(engine, PREFIX), words(engine, SUFFIX), spm)
    with Llama(model, kv_overrides=OVERRIDES, spm_infill=spm, **SMALL) as llm:
        out = llm.create_completion(PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0.0)
        assert llm.engine.tokens[:len(expected)] == expected
        assert out["choices"][0]["text"] == greedy_text(engine, expected, 8, finish_character=True)


def test_a_token_prompt_and_an_empty_suffix_take_the_same_shape(model, engine):
    prefix = words(engine, PREFIX)
    with Llama(model, kv_overrides=OVERRIDES, **SMALL) as llm:
        out = llm(prefix, suffix="", max_tokens=4, temperature=0.0, echo=True)
    assert out["choices"][0]["text"] == PREFIX + greedy_text(engine, fim(engine, prefix, []), 4, finish_character=True)


def test_a_suffix_streams_the_same_text(model, engine):
    expected = greedy_text(engine, fim(engine, words(engine, PREFIX), words(engine, SUFFIX)), 8, finish_character=True)
    with Llama(model, kv_overrides=OVERRIDES, **SMALL) as llm:
        chunks = llm.create_completion(PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0.0, stream=True)
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected


def test_a_model_without_fill_in_the_middle_tokens_is_refused_by_name(model):
    with Llama(model, **SMALL) as llm:
        with pytest.raises(InvalidOptionError, match="no fill-in-the-middle pre, suf, mid token"):
            llm.create_completion(PREFIX, suffix=SUFFIX)
        with pytest.raises(InvalidOptionError, match="suffix must be a string"):
            llm.create_completion(PREFIX, suffix=3)


@pytest.mark.parametrize("spm", [False, True])
def test_the_server_fills_the_middle_of_a_completions_suffix_and_of_infill(model, engine, tmp_path, spm):
    overrides = ",".join(f"{key}=int:{token}" for key, token in OVERRIDES.items())
    proc, url = start_server(tmp_path / "server.log", "-t", "1", "-c", "256", "--override-kv", overrides,
                             *(["--spm-infill"] if spm else []), model=model)
    try:
        status, body = request("POST", url + "/v1/completions", json.dumps({
            "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "temperature": 0}).encode(), key=None)
        expected = fim(engine, words(engine, PREFIX), words(engine, SUFFIX), spm)
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == len(expected)
        assert body["choices"][0]["text"] == greedy_text(engine, expected, 8)
        status, body = request("POST", url + "/infill", json.dumps({
            "input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8, "temperature": 0}).encode(), key=None)
        assert status == 200 and body["tokens_evaluated"] == len(expected), body
        assert body["prompt"] == engine.detokenize(expected, special=True)
        status, body = request("POST", url + "/v1/completions", json.dumps({
            "prompt": PREFIX, "suffix": 7}).encode(), key=None)
        assert status == 400 and body["error"]["param"] == "suffix", body
    finally:
        stop_server(proc)


def test_the_server_refuses_a_suffix_the_model_cannot_fill(model, tmp_path):
    proc, url = start_server(tmp_path / "server.log", "-t", "1", "-c", "256", model=model)
    try:
        status, body = request("POST", url + "/v1/completions", json.dumps({
            "prompt": PREFIX, "suffix": SUFFIX}).encode(), key=None)
        assert status == 400 and "no fill-in-the-middle pre, suf, mid token" in body["error"]["message"], body
        status, body = request("POST", url + "/v1/completions", json.dumps({
            "prompt": PREFIX, "suffix": None, "max_tokens": 2}).encode(), key=None)
        assert status == 200, body
    finally:
        stop_server(proc)
