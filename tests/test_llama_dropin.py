"""pyedgemoe.Llama: llama-cpp-python's high-level class over the Engine. The examples are
llama-cpp-python's README ("High-level API", JSON and JSON schema mode, embeddings) and calls
from its own tests (tests/test_llama.py's test_real_llama, test_utf8, tokenization); the expected
results are the Engine's own at temperature 0 and, where the file loads there, stock
llama-cpp-python's on the same file: the same text where it is deterministic (greedy, or seeded:
Llama takes llama-cpp-python's sequence of seeds), the same log-probabilities."""
from __future__ import annotations

import inspect
import json
import os
import random
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

import pyedgemoe
from conftest import rewrite_gguf, tiny_moe
from pyedgemoe import Engine, EngineBusyError, EngineClosedError, InvalidOptionError, Llama, LlamaGrammar
from pyedgemoe.devices import gpu_devices
from pyedgemoe.rope_scaling import LLAMA_CPP_PYTHON_DEFAULTS
from pyedgemoe.llama import (UNSUPPORTED_CHAT_ARGS, UNSUPPORTED_COMPLETION_ARGS, UNSUPPORTED_GENERATE_ARGS,
                             UNSUPPORTED_INIT_ARGS)

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"
PLANETS = "Q: Name the planets in the solar system? A: "
SOURCE = "def __init__(self, name):\n    self._name = name  # héllo wörld ✓\n"
SMALL = {"n_ctx": 512, "n_threads": 2, "verbose": False}  # what each test's Llama and Engine share


@pytest.fixture(scope="module")
def llm():
    with Llama(model_path=str(DEMO), **SMALL) as llm:
        yield llm


@pytest.fixture(scope="module")
def eng():
    with Engine(DEMO, **SMALL) as eng:
        yield eng


@pytest.fixture(scope="module")
def demo_chat(demo_high, tmp_path_factory) -> Path:
    """The demo model (HIGH) with a ChatML template, one that llama-cpp-python has no formatter of: its
    chats go through the Engine's formatting (the demo model has no template: llama-cpp-python's llama-2)."""
    return rewrite_gguf(demo_high, tmp_path_factory.mktemp("chat") / "demo-chat.gguf", chat_template=tiny_moe.CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def chat_llm(demo_chat):
    with Llama(model_path=str(demo_chat), **SMALL) as llm:
        yield llm


@pytest.fixture(scope="module")
def demo_high(tmp_path_factory) -> Path:
    """The demo model's HIGH precision as a standard GGUF: stock llama.cpp does not load the
    multi-precision file; pyedgemoe runs both the same way."""
    from pyedgemoe.convert.export import export

    return export(DEMO, tmp_path_factory.mktemp("stock") / "demo-high.gguf", precision="high", progress=False)


@pytest.fixture
def both(demo_high):
    """both(**kwargs): stock llama-cpp-python's Llama and ours, fresh, on the same file with the
    same arguments (each call to them moves llama-cpp-python's seed sequence alike)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    made = []

    def make(path=demo_high, **kwargs):
        kwargs = {"n_ctx": 512, "n_threads": 2, "verbose": False, **kwargs}
        made.append((llama_cpp.Llama(model_path=str(path), **kwargs), Llama(model_path=str(path), **kwargs)))
        return made[-1]
    yield make
    for theirs, ours in made:
        theirs.close()
        ours.close()


@pytest.fixture(scope="module")
def stock(demo_high):
    """Stock llama-cpp-python and ours on the demo's HIGH precision, shared by the module."""
    llama_cpp = pytest.importorskip("llama_cpp")
    theirs = llama_cpp.Llama(model_path=str(demo_high), n_ctx=512, n_threads=2, verbose=False)
    with Llama(model_path=str(demo_high), **SMALL) as ours:
        yield theirs, ours
    theirs.close()


def text_prompt(eng, text: str) -> list[int]:
    """The tokens llama-cpp-python's create_completion makes of a text prompt on the demo model: BOS,
    the text, then its separator token, <|endoftext|> (tokenizer.ggml.seperator_token_id), which the
    Engine, as llama.cpp's tools, does not add."""
    return eng.tokenize(text, special=True) + [int(eng.metadata["tokenizer.ggml.seperator_token_id"])]


def stock_usage(usage: dict) -> dict:
    """The Engine's usage as llama-cpp-python's Llama gives it: without OpenAI's details."""
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


# -- llama-cpp-python's README examples --------------------------------------------------------
def test_readme_completion_is_the_engines_at_temperature_0(llm, eng):
    output = llm(PLANETS, max_tokens=32, stop=["Q:", "\n"], echo=False, temperature=0)
    expected = eng.create_completion(text_prompt(eng, PLANETS), max_tokens=32, stop=["Q:", "\n"], temperature=0)
    assert output["object"] == "text_completion" and output["model"] == str(DEMO)
    assert output["choices"] == expected["choices"]
    assert output["usage"] == stock_usage(expected["usage"])


def test_echo_puts_the_prompt_before_the_completion(llm):
    plain = llm(PLANETS, max_tokens=8, stop=["Q:", "\n"], temperature=0)["choices"][0]["text"]
    echoed = llm(PLANETS, max_tokens=8, stop=["Q:", "\n"], echo=True, temperature=0)["choices"][0]["text"]
    assert echoed == PLANETS + plain


def test_call_is_create_completion_and_sampling_follows_llama_cpp_pythons_seed_sequence():
    # llama-cpp-python: a completion given no seed samples with random.Random(the last seed).randint(0, 2**32)
    seeds = [random.Random(7).randint(0, 2**32)]
    seeds.append(random.Random(seeds[0]).randint(0, 2**32))
    with Llama(model_path=str(DEMO), seed=7, **SMALL) as seeded, Engine(DEMO, flash_attn=False, **SMALL) as engine:
        prompt = text_prompt(engine, "def ")
        assert seeded("def ", max_tokens=12)["choices"] == \
            engine.create_completion(prompt, max_tokens=12, seed=seeds[0])["choices"]
        assert seeded.create_completion("def ", max_tokens=12)["choices"] == \
            engine.create_completion(prompt, max_tokens=12, seed=seeds[1])["choices"]


def test_completion_stream_chunks_join_to_the_completion(llm):
    whole = llm("def __init__(self", max_tokens=16, temperature=0)["choices"][0]
    chunks = list(llm("def __init__(self", max_tokens=16, temperature=0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [whole["finish_reason"]]
    assert {tuple(sorted(c)) for c in chunks} == {("choices", "created", "id", "model", "object")}  # as stock's


@pytest.mark.parametrize("arch, kwargs", [("qwen3_moe", {"prompt": "Hello world", "max_tokens": 4, "stop": "or x"}),
                                          ("gpt_oss", {"prompt": "hello world", "max_tokens": 8})])
def test_a_stream_is_a_generator_of_a_chunk_a_token_as_in_llama_cpp_python(both, tiny_model, arch, kwargs):
    # a token held back while it may begin a stop string is held whole; one ending inside a UTF-8
    # character is a chunk of its own, "" (these prompts make both: "' wor'" begins "or x"; GPT-OSS's bytes)
    theirs, ours = both(path=tiny_model(arch)[0], logits_all=True)
    chunks = []
    for llm in (theirs, ours):
        stream = llm(**kwargs, temperature=0, logprobs=1, stream=True)
        assert inspect.isgenerator(stream)
        chunks.append([(c["choices"][0]["text"], c["choices"][0]["logprobs"] and c["choices"][0]["logprobs"]["tokens"])
                       for c in stream])
    assert chunks[1] == chunks[0]
    assert all(tokens == [text] for text, tokens in chunks[1][:-1])
    assert "".join(text for text, _ in chunks[1]) == ours(**kwargs, temperature=0)["choices"][0]["text"]


def test_a_stream_leaves_echo_out_as_in_llama_cpp_python(both):
    # llama-cpp-python echoes the prompt in a whole completion alone (pyedgemoe serve's stream echoes it, as OpenAI's)
    theirs, ours = both()
    texts = ["".join(c["choices"][0]["text"] for c in llm(PLANETS, max_tokens=6, temperature=0, stream=True, echo=True))
             for llm in (theirs, ours)]
    assert texts[1] == texts[0] == ours(PLANETS, max_tokens=6, temperature=0)["choices"][0]["text"]


def test_model_names_the_result(llm):
    assert llm("def ", max_tokens=2, temperature=0, model="demo")["model"] == "demo"
    assert {c["model"] for c in llm("def ", max_tokens=2, temperature=0, model="demo", stream=True)} == {"demo"}


def test_chat_completion_is_the_engines_at_temperature_0(chat_llm, demo_chat):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "def fib(n):"}]
    out = chat_llm.create_chat_completion(messages=messages, max_tokens=12, temperature=0)
    with Engine(demo_chat, **SMALL) as eng:
        expected = eng.create_chat_completion(messages, max_tokens=12, temperature=0, jinja2_formatter=True)
        with_bos = eng.create_chat_completion(messages, max_tokens=12, temperature=0)
    assert out["object"] == "chat.completion"
    assert out["choices"] == expected["choices"]
    assert out["usage"] == stock_usage(expected["usage"])
    # the Engine's own, as llama.cpp's tools: a BOS ahead where the model uses one (the demo's does)
    assert with_bos["usage"]["prompt_tokens"] == out["usage"]["prompt_tokens"] + 1


def test_a_chat_with_the_models_template_is_stocks_token_for_token(both, demo_chat, tiny_model):
    # llama-cpp-python's Jinja2ChatFormatter: the template's text, no BOS added (the demo and the tiny
    # ERNIE-4.5 use one; neither template writes it), whatever llama.cpp's tools do
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]
    for path in (demo_chat, tiny_model("ernie4_5_moe")[0]):
        theirs, ours = both(path=path, n_ctx=256)
        assert ours.chat_format == theirs.chat_format == "chat_template.default"
        expected = theirs.create_chat_completion(messages, max_tokens=8, temperature=0)
        out = ours.create_chat_completion(messages, max_tokens=8, temperature=0)
        assert out["choices"] == expected["choices"] and out["usage"] == expected["usage"], path.name
        assert list(ours.input_ids[:ours.n_tokens]) == list(theirs.input_ids[:theirs.n_tokens]), path.name


def test_chat_completion_streams_the_role_then_the_content_then_the_finish_reason(llm):
    messages = [{"role": "user", "content": "def fib(n):"}]
    whole = llm.create_chat_completion(messages=messages, max_tokens=12, temperature=0)["choices"][0]
    chunks = list(llm.create_chat_completion(messages=messages, max_tokens=12, temperature=0, stream=True))
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1]) == whole["message"]["content"]
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    assert {tuple(sorted(c)) for c in chunks} == {("choices", "created", "id", "model", "object")}  # as stock's


# -- tokens -----------------------------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip_bytes(llm, eng):
    text = SOURCE.encode("utf-8")
    tokens = llm.tokenize(text)
    assert tokens == eng.tokenize(SOURCE) and tokens[0] == llm.token_bos()
    assert llm.tokenize(text, add_bos=False) == tokens[1:]
    assert llm.detokenize(tokens) == text
    # bytes, not text: one token at a time, a character's bytes may split between tokens
    assert b"".join(llm.detokenize(tokens[i:i + 1], prev_tokens=tokens[:i]) for i in range(len(tokens))) == text


def test_detokenize_leaves_prev_tokens_to_hugging_face_tokenizers_as_llama_cpp_python(both, tiny_model):
    theirs, ours = both(path=tiny_model("mixtral")[0], n_ctx=256)  # SentencePiece: a word's leading space
    tokens = ours.tokenize(b" hello world", add_bos=False)
    for prev in (None, [ours.token_bos()], tokens[:1]):
        assert ours.detokenize(tokens, prev_tokens=prev) == theirs.detokenize(tokens, prev_tokens=prev)


def test_special_token_text_is_parsed_only_with_special(llm):
    marker = llm.detokenize([llm.token_eos()], special=True)
    assert marker == b"<|endoftext|>" and llm.detokenize([llm.token_eos()]) == b""
    assert llm.tokenize(marker, add_bos=False, special=True) == [llm.token_eos()]
    assert llm.token_eos() not in llm.tokenize(marker, add_bos=False)


def test_model_facts(llm):
    assert llm.n_ctx() == 512 and llm.n_vocab() == 8192
    assert llm.metadata["general.architecture"] == "qwen3moe"


def test_tokens_are_stock_llama_cpp_pythons(stock):
    theirs, ours = stock
    text = SOURCE.encode("utf-8")
    for add_bos in (True, False):
        assert ours.tokenize(text, add_bos=add_bos) == theirs.tokenize(text, add_bos=add_bos)
    # bytes that are not UTF-8 as llama.cpp reads them: a surrogate's and an overlong form decoded (each byte was
    # a U+FFFD here before), a character cut short and a stray byte replaced
    for text in (b"a\xed\xa0\x80b", b"\xed\xbf\xbf", b"x\xc0\xafy", b"x\xc3", b"\xff\xfe", b"\xf0\x9f\x98 z"):
        assert ours.tokenize(text, add_bos=False) == theirs.tokenize(text, add_bos=False), text
    for fact in ("token_bos", "token_eos", "token_nl", "n_vocab"):
        assert getattr(ours, fact)() == getattr(theirs, fact)()
    # stock llama-cpp-python reads each piece into 32 bytes and returns b"" for the longer ones
    fits = [t for t in range(ours.n_vocab()) if len(ours.detokenize([t], special=True)) <= 32]
    assert len(fits) > ours.n_vocab() - 32
    for special in (False, True):
        assert [ours.detokenize([t], special=special) for t in fits] == \
               [theirs.detokenize([t], special=special) for t in fits]


def test_vocab_only_tokenizes_as_stock_llama_cpp_python_without_the_weights(demo_high, stock):
    llama_cpp = pytest.importorskip("llama_cpp")
    theirs = llama_cpp.Llama(model_path=str(demo_high), vocab_only=True, verbose=False)
    with Llama(model_path=str(demo_high), vocab_only=True, verbose=False) as ours:
        text = "def fib(n): <|im_start|> héllo ✓".encode()
        for add_bos, special in ((True, False), (False, True)):
            assert ours.tokenize(text, add_bos, special) == theirs.tokenize(text, add_bos, special)
        for not_utf8 in (b"caf\xe9 \xff", b"a\xe2\x82", b"\xf0\x9f\x98x"):  # latin-1, characters cut short
            assert ours.tokenize(not_utf8) == theirs.tokenize(not_utf8), not_utf8
        ids = ours.tokenize(text)
        assert ours.detokenize(ids) == theirs.detokenize(ids) and ours.n_vocab() == theirs.n_vocab()
        assert (ours.token_bos(), ours.token_eos(), ours.metadata) == (theirs.token_bos(), theirs.token_eos(),
                                                                       theirs.metadata)
        assert ours.tokenizer().encode("héllo") == stock[1].tokenizer().encode("héllo")  # the full Llama's
        for needs_weights in (lambda: ours("hi", max_tokens=2), lambda: ours.eval(ids), ours.n_ctx):
            with pytest.raises(InvalidOptionError, match="vocab_only=True"):
                needs_weights()
    theirs.close()


@pytest.mark.parametrize("prompt", [PLANETS, "def __init__(self", "import os\n"])
def test_a_token_prompt_completes_as_stock_llama_cpp_python(stock, prompt):
    # a token prompt is taken as it is: no BOS, no separator token added
    theirs, ours = stock
    tokens = ours.tokenize(prompt.encode("utf-8"))
    expected = theirs(tokens, max_tokens=32, stop=["Q:", "\n"], temperature=0)
    output = ours(tokens, max_tokens=32, stop=["Q:", "\n"], temperature=0)
    assert output["choices"] == expected["choices"] and output["usage"] == expected["usage"]


def test_a_text_prompt_ends_with_the_models_separator_token_as_in_stock_llama_cpp_python(both):
    # llama-cpp-python's _create_completion puts the model's SEP (its EOS where it has none but adds
    # one) after a text prompt's tokens: this file's separator token is <|endoftext|>, 0, its BOS too
    # (tokenizer.ggml.seperator_token_id), so "def foo" is [BOS, def, foo, SEP], 4 tokens there
    theirs, ours = both(seed=7, logits_all=True)
    sep = int(ours.metadata["tokenizer.ggml.seperator_token_id"])
    assert ours.tokenize(b"def foo") == theirs.tokenize(b"def foo") == [ours.token_bos(), 314, 7093]  # none there
    greedy = dict(max_tokens=4, temperature=0)
    out, expected = ours("def foo", **greedy), theirs("def foo", **greedy)
    assert out["choices"][0]["text"] == expected["choices"][0]["text"] == '(path):\n    """'
    assert out["usage"] == expected["usage"] and out["usage"]["prompt_tokens"] == 4
    assert list(ours.input_ids[:4]) == list(theirs.input_ids[:4]) == [ours.token_bos(), 314, 7093, sep]
    for kwargs in (dict(max_tokens=16), dict(max_tokens=16, seed=1337), dict(max_tokens=8, temperature=0, echo=True)):
        out = ours.create_completion("def fib(n):", **kwargs)  # seeds: each call takes the next, alike
        expected = theirs.create_completion("def fib(n):", **kwargs)
        assert out["choices"] == expected["choices"] and out["usage"] == expected["usage"], kwargs
    streamed = "".join(c["choices"][0]["text"] for c in ours("def foo", stream=True, **greedy))
    assert streamed == '(path):\n    """'
    # echoed logprobs: the prompt's tokens but BOS tokens, so without the SEP here, then the completion's
    out, expected = (llm("x = ", max_tokens=4, temperature=0, logprobs=2, echo=True) for llm in (ours, theirs))
    assert out["choices"][0]["text"] == expected["choices"][0]["text"]
    _assert_logprobs_equal(out["choices"][0]["logprobs"], expected["choices"][0]["logprobs"])
    # and the context holds the completion after the prompt, as there (it held the prompt alone: the echo's rows
    # evaluated after the completion)
    assert list(ours.input_ids[:ours.n_tokens]) == list(theirs.input_ids[:theirs.n_tokens])


@pytest.mark.parametrize("keys, end", [
    ({"tokenizer.ggml.seperator_token_id": None}, []),  # no SEP, no EOS added: nothing
    ({"tokenizer.ggml.seperator_token_id": None, "tokenizer.ggml.add_eos_token": True}, [0]),  # the EOS
    ({"tokenizer.ggml.seperator_token_id": 5, "tokenizer.ggml.add_eos_token": True}, [5]),  # the SEP, not the EOS
    ({"tokenizer.ggml.seperator_token_id": 5, "tokenizer.ggml.add_sep_token": False}, [5]),  # add_sep is not read
    ({"tokenizer.ggml.seperator_token_id": 99999}, []),  # outside the vocabulary: none
], ids=["none", "eos", "sep-over-eos", "sep-without-add-sep", "sep-out-of-range"])
def test_what_ends_a_text_prompt_is_stock_llama_cpp_pythons_rule(both, demo_high, tmp_path, keys, end):
    # its eos_tokens: [SEP if the model has one else EOS], kept where it has a SEP or adds EOS
    theirs, ours = both(path=rewrite_gguf(demo_high, tmp_path / "keys.gguf", keys=keys), n_ctx=128)
    out, expected = (llm("def foo", max_tokens=4, temperature=0) for llm in (ours, theirs))
    assert out["choices"] == expected["choices"] and out["usage"] == expected["usage"]
    n = out["usage"]["prompt_tokens"]
    assert list(ours.input_ids[:n]) == list(theirs.input_ids[:n]) == [ours.token_bos(), 314, 7093] + end


# -- arguments --------------------------------------------------------------------------------
def test_a_pickled_llama_loads_again_with_its_arguments_as_llama_cpp_pythons():
    import pickle
    with Llama(model_path=str(DEMO), expert_cache="50%", seed=3, **SMALL) as llm:
        text = llm("def fib(n):", max_tokens=8)["choices"][0]["text"]  # seeded: the sequence seed=3 starts
        copy = pickle.loads(pickle.dumps(llm))
    with copy:
        assert copy.engine.expert_residency is not None and copy.n_ctx() == SMALL["n_ctx"]
        assert copy("def fib(n):", max_tokens=8)["choices"][0]["text"] == text


def test_unsupported_constructor_arguments_are_refused_by_name():
    with pytest.raises(InvalidOptionError, match=r"main_gpu=1.*numa=True"):
        Llama(model_path=str(DEMO), main_gpu=1, numa=True, lora_path=None, verbose=False)
    with pytest.raises(InvalidOptionError, match="n_thread"):
        Llama(model_path=str(DEMO), n_thread=2, verbose=False)


def test_unsupported_arguments_at_their_defaults_are_accepted(llm):
    with Llama(model_path=str(DEMO), use_mmap=True, logits_all=False, main_gpu=0, lora_path=None, **SMALL) as same:
        out = same(PLANETS, max_tokens=4, temperature=0, typical_p=1.0, logit_bias=None, mirostat_mode=0)
        assert out["choices"] == llm(PLANETS, max_tokens=4, temperature=0)["choices"]


def test_earlier_llama_cpp_pythons_arguments_are_ignored_as_there():
    # LangChain's LlamaCpp passes these to Llama() (n_parts, f16_kv), tutorials n_gqa; llama-cpp-python
    # 0.3 ignores them (**kwargs), and so does this Llama, but for a misspelt name (above) and f16_kv=False
    langchain = dict(n_parts=-1, f16_kv=True, lora_base=None, seed=-1, logits_all=False, vocab_only=False,
                     use_mlock=False, n_threads=None, n_batch=8, use_mmap=True, last_n_tokens_size=64, verbose=False)
    with Llama(model_path=str(DEMO), n_ctx=128, n_gqa=8, low_vram=True, **langchain) as llm:
        assert llm("def ", max_tokens=2, temperature=0)["usage"]["completion_tokens"] == 2
    with pytest.raises(InvalidOptionError, match="f16_kv=False .* type_k=0, type_v=0"):
        Llama(model_path=str(DEMO), f16_kv=False, verbose=False)


def test_values_llama_cpp_python_passes_to_llama_cpp_are_taken_as_there(both):
    # llama.cpp's "off" and "default": n_threads 0 or -1, top_k below 0, top_p above 1; top_p 0 keeps the
    # most likely token; a whole float max_tokens; logprobs=True (the penalties' window -1: below)
    theirs, ours = both(n_threads=0, n_threads_batch=-1)
    assert ours.n_threads >= 1 and ours.n_threads_batch >= 1
    tokens = ours.tokenize(b"def fib(n):")  # a text prompt differs there (test_a_token_prompt_completes...)
    for sampling in (dict(top_k=-1, seed=1), dict(top_p=1.5, seed=2), dict(top_p=0, temperature=1.5, seed=3),
                     dict(max_tokens=6.0, temperature=0)):
        sampling = {"max_tokens": 6, **sampling}
        assert ours(tokens, **sampling)["choices"] == theirs(tokens, **sampling)["choices"], sampling
    assert ours(tokens, max_tokens=3, temperature=0, logprobs=True)["choices"][0]["logprobs"] == \
        ours(tokens, max_tokens=3, temperature=0, logprobs=1)["choices"][0]["logprobs"]  # stock: True == 1


def test_load_and_context_errors_are_value_errors_as_in_llama_cpp_python(llm, tmp_path):
    with pytest.raises(ValueError, match="not found"):
        Llama(model_path=str(tmp_path / "missing.gguf"), verbose=False)
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(ValueError, match="not a GGUF"):
        Llama(model_path=str(tmp_path / "text.gguf"), verbose=False)
    with pytest.raises(ValueError, match=r"^Requested tokens \(\d+\) exceed context window of \d+$"):  # stock's words
        llm(PLANETS * 200, max_tokens=2)


def test_a_call_goes_ahead_of_a_stream_left_open_as_in_llama_cpp_python(llm):
    # a loop left by break (or an exception in it), the stream still referenced: llama-cpp-python's
    # next call runs, and so does this Llama's; the stream then ends
    expected = llm(PLANETS, max_tokens=4, temperature=0)["choices"]
    stream = llm(PLANETS, max_tokens=16, temperature=0, stream=True)
    for _ in stream:
        break
    chat = llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, stream=True)
    next(chat)
    assert llm(PLANETS, max_tokens=4, temperature=0)["choices"] == expected
    with pytest.raises(EngineBusyError, match="ended by a later call"):
        next(stream)
    tokens = llm.generate(llm.tokenize(b"def "), temp=0)
    next(tokens)
    llm.reset()
    with pytest.raises(EngineBusyError, match="ended by a later call"):
        next(tokens)
    done = llm(PLANETS, max_tokens=4, temperature=0, stream=True)
    assert list(done) and llm(PLANETS, max_tokens=4, temperature=0)["choices"] == expected
    assert list(done) == []  # one read to its end is over, not ended by the call


def test_a_stream_left_open_on_one_thread_does_not_hold_up_the_others(llm):
    # a web worker's client went away mid-stream, its iterator still held: another thread's call runs
    import threading
    expected = llm("hi", max_tokens=3, temperature=0)["choices"]
    held, answers = [], []

    def client_gone():
        held.append(llm(PLANETS, max_tokens=16, temperature=0, stream=True))
        next(held[0])
    worker = threading.Thread(target=client_gone)
    worker.start()
    worker.join()
    other = threading.Thread(target=lambda: answers.append(llm("hi", max_tokens=3, temperature=0)["choices"]),
                             daemon=True)
    other.start()
    other.join(timeout=60)
    assert answers == [expected]
    # a stream still being read (a slow client's), on another thread: the call ends it between two
    # chunks, and its reader is told so
    ended = []

    def slow_client():
        try:
            for _ in llm(PLANETS, max_tokens=200, temperature=0, stream=True, stop=[]):
                time.sleep(0.01)
        except EngineBusyError:
            ended.append(True)
    reader = threading.Thread(target=slow_client)
    reader.start()
    time.sleep(0.1)
    assert llm("hi", max_tokens=3, temperature=0)["choices"] == expected
    reader.join(timeout=60)
    assert ended == [True]
    # a reader that takes each chunk at once (a tight loop, no pause between two): it ends its
    # stream before its next step, not at the stream's end
    read = {"n": 0}

    def fast_client():
        try:
            for _ in llm(PLANETS, max_tokens=200, temperature=0, stream=True, stop=[],
                         logit_bias={llm.token_eos(): float("-inf")}):
                read["n"] += 1
        except EngineBusyError:
            read["ended at"] = read["n"]
    reader = threading.Thread(target=fast_client)
    reader.start()
    while read["n"] < 5:
        time.sleep(0.001)
    assert llm("hi", max_tokens=3, temperature=0)["choices"] == expected
    reader.join(timeout=60)
    assert read["ended at"] < 100, read


@pytest.mark.parametrize("call", [lambda llm: llm("hi", max_tokens=2), lambda llm: llm.reset(),
                                  lambda llm: llm.eval([1]), lambda llm: llm.sample(), lambda llm: llm.save_state(),
                                  lambda llm: llm.n_ctx(), lambda llm: llm.n_tokens, lambda llm: llm.tokenize(b"hi")])
@pytest.mark.parametrize("vocab_only", [False, True])
def test_a_closed_llama_says_so_by_its_error_type(call, vocab_only):
    # EngineClosedError (a RuntimeError, as llama-cpp-python's) from every method, not RuntimeError alone
    llm = Llama(model_path=str(DEMO), vocab_only=vocab_only, **SMALL)
    llm.close()
    with pytest.raises(EngineClosedError, match="is closed"):
        call(llm)


def test_threads_that_leave_their_streams_open_go_ahead_of_each_others(llm):
    # two web workers whose clients go away mid-stream, a third answering whole: each call ends the
    # streams left open (their readers are told so), and the whole answers are the greedy text. Two
    # calls could both pass the check before either's stream started: the one left out held the turn
    # and both waited for ever.
    import threading
    expected = llm(PLANETS, max_tokens=6, temperature=0)["choices"][0]["text"]
    texts, busy = [], []

    def worker(streams: bool):
        for _ in range(40):
            if not streams:
                texts.append(llm(PLANETS, max_tokens=6, temperature=0)["choices"][0]["text"])
                continue
            stream = llm(PLANETS, max_tokens=6, temperature=0, stream=True)
            try:
                next(stream), next(stream)  # then left open, as a loop left by break
            except EngineBusyError:
                busy.append(True)
    threads = [threading.Thread(target=worker, args=(streams,), daemon=True) for streams in (True, True, False)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert busy and texts and set(texts) == {expected}


@pytest.mark.parametrize("call, fragment", [
    (lambda llm: llm("hi", max_tokens="8"), "max_tokens must be an integer"),
    (lambda llm: llm("hi", max_tokens=2, temperature="hot"), "temperature must be a number"),
    (lambda llm: llm("hi", max_tokens=2, temperature=[1]), "temperature must be a number"),
    (lambda llm: llm("hi", max_tokens=2, top_k=2**40), "top_k must be an integer within 32 bits"),
    (lambda llm: llm("hi", max_tokens=2, stop=1), "stop must be a string or a list of strings"),
    (lambda llm: llm("hi", max_tokens=2, stop=[1]), "stop must be a string or a list of strings"),
    (lambda llm: llm("hi", max_tokens=2, seed="x"), "seed must be an integer"),
    (lambda llm: llm(None, max_tokens=2), r"prompt must be text or token ids \(integers\)"),
    (lambda llm: llm(["a"], max_tokens=2), r"prompt must be text or token ids \(integers\)"),
    (lambda llm: llm([2**40], max_tokens=2), "a token id is beyond 32 bits"),
    (lambda llm: llm.create_chat_completion(None, max_tokens=2), "messages must be a list of messages"),
    (lambda llm: llm.tokenize(None), "text must be a string"),
    (lambda llm: llm.set_seed((1, 2)), "seed must be an integer"),  # it stayed, and broke the next call
])
def test_arguments_of_the_wrong_type_are_invalid_options_and_the_llama_goes_on(llm, call, fragment):
    # found by calling every argument with values of other types: TypeErrors from deep inside, one
    # naming the native signature, and a bad seed that stayed the Llama's and broke later calls
    with pytest.raises(InvalidOptionError, match=fragment):
        call(llm)
    assert llm("hi", max_tokens=2, temperature=0)["choices"][0]["text"] is not None


def test_unsupported_sampling_arguments_are_refused_by_name(llm):
    with pytest.raises(InvalidOptionError, match=r"tfs_z=0.5"):  # tail-free sampling left llama.cpp
        llm(PLANETS, tfs_z=0.5)
    with pytest.raises(InvalidOptionError, match=r"tfs_z=0.5"):
        llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], tfs_z=0.5)


def test_pyedgemoe_keywords_reach_the_engine():
    with Llama(model_path=str(DEMO), expert_cache="25%", prefetch="hobbit", **SMALL) as cached, \
            Engine(DEMO, expert_cache="25%", prefetch="hobbit", flash_attn=False, **SMALL) as engine:  # Llama's
        assert cached.engine.expert_residency is not None
        assert cached.engine.stats()["experts"]["prefetch"] == engine.stats()["experts"]["prefetch"]
        assert cached(PLANETS, max_tokens=8, temperature=0)["choices"] == \
               engine.create_completion(text_prompt(engine, PLANETS), max_tokens=8, temperature=0)["choices"]


def test_kv_cache_types_must_agree():
    with pytest.raises(InvalidOptionError, match="type_k=8 and type_v=1 differ"):
        Llama(model_path=str(DEMO), type_k=8, type_v=1, verbose=False)


def test_n_gpu_layers_0_runs_on_the_cpu(llm):
    assert llm.engine.mode == "cpu"


@pytest.mark.skipif(bool(gpu_devices()), reason="this build has a GPU")
@pytest.mark.parametrize("n_gpu_layers", [-1, 20])
def test_n_gpu_layers_on_a_cpu_only_build_runs_on_the_cpu_as_llama_cpp_python_does(n_gpu_layers):
    with Llama(model_path=str(DEMO), n_gpu_layers=n_gpu_layers, **SMALL) as llm:
        assert llm.engine.mode == "cpu"
        assert "this build has none: the CPU" in llm.engine.plan.reasons["mode"]


def test_chat_format_left_unset_is_llama_cpp_pythons_choice(both, tiny_model, tmp_path):
    # llama-2 without a template (the demo model has none), its formatter for a template it knows
    llama_cpp = pytest.importorskip("llama_cpp")
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a planet."}]
    theirs, ours = both()
    assert ours.chat_format == theirs.chat_format == "llama-2"
    assert ours.create_chat_completion(messages, max_tokens=6, temperature=0)["choices"] == \
        theirs.create_chat_completion(messages, max_tokens=6, temperature=0)["choices"]
    for template, name in ((llama_cpp.llama_chat_format.MIXTRAL_INSTRUCT_CHAT_TEMPLATE, "mistral-instruct"),
                           (llama_cpp.llama_chat_format.CHATML_CHAT_TEMPLATE, "chatml")):
        path = tmp_path / f"{name}.gguf"
        rewrite_gguf(tiny_model("mixtral")[0], path, chat_template=template)
        theirs, ours = both(path=path, n_ctx=256)
        assert ours.chat_format == theirs.chat_format == name
        user = messages[1:] if name == "mistral-instruct" else messages  # its formatter's roles
        assert ours.create_chat_completion(user, max_tokens=6, temperature=0)["choices"] == \
            theirs.create_chat_completion(user, max_tokens=6, temperature=0)["choices"]
    with pytest.raises(InvalidOptionError, match="chat_format 'chat_template.default' is not supported"):
        Llama(model_path=str(DEMO), chat_format="chat_template.default", verbose=False)
    with pytest.raises(InvalidOptionError, match="chat_format 'llama2' is not supported: .* llama-2, llama-3"):
        Llama(model_path=str(DEMO), chat_format="llama2", verbose=False)
    mixtral = str(tiny_model("mixtral")[0])  # its template renders ChatML, and is none that stock knows
    with Llama(model_path=mixtral, n_ctx=64, verbose=False) as templated:
        assert templated.chat_format == "chat_template.default"
    with Llama(model_path=mixtral, n_ctx=64, chat_format="chatml", verbose=False) as named:
        assert named.chat_format == "chatml"  # llama-cpp-python's formatter (tests/test_named_chat_formats.py)
    with Llama(model_path=str(DEMO), chat_handler=lambda **_: {}, verbose=False) as handled:
        assert handled.chat_format is None  # the handler answers, as there


def test_chat_format_set_later_answers_the_next_chats_as_in_llama_cpp_python(both, tiny_model):
    # llama-cpp-python reads chat_format at each chat; a chat_handler set goes first, as there
    theirs, ours = both(path=tiny_model("qwen3_moe")[0], n_ctx=256)
    messages = [{"role": "user", "content": "Hi there"}]
    assert ours.create_chat_completion(messages, max_tokens=2, temperature=0)["usage"]["prompt_tokens"] == 19
    for llm in (theirs, ours):
        llm.chat_format = "llama-2"
    out = [llm.create_chat_completion(messages, max_tokens=2, temperature=0) for llm in (theirs, ours)]
    assert out[1]["choices"] == out[0]["choices"] and out[1]["usage"] == out[0]["usage"]
    assert out[1]["usage"]["prompt_tokens"] == 23
    for llm in (theirs, ours):
        llm.chat_format = "no-such-format"
    with pytest.raises(pytest.importorskip("llama_cpp").llama_chat_format.LlamaChatCompletionHandlerNotFoundException):
        theirs.create_chat_completion(messages, max_tokens=2)
    with pytest.raises(InvalidOptionError, match="chat_format 'no-such-format' is not supported"):  # the constructor's
        ours.create_chat_completion(messages, max_tokens=2)
    for llm in (theirs, ours):
        llm.chat_handler = lambda llama, messages, **_: {"answered": messages}
        assert llm.create_chat_completion(messages) == {"answered": messages}


def test_the_arguments_attributes_are_llama_cpp_pythons(both):
    theirs, ours = both(kv_overrides={"general.name": "demo"}, lora_scale=0.5, n_threads_batch=1)
    for name in ("kv_overrides", "tensor_split", "numa", "lora_base", "lora_path", "lora_scale", "n_threads",
                 "n_threads_batch"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.tokenizer_.tokenize(b"hello") == theirs.tokenizer_.tokenize(b"hello")


def test_signatures_are_llama_cpp_pythons():
    llama_cpp = pytest.importorskip("llama_cpp")

    def params(f):
        return {n: p.default for n, p in inspect.signature(f).parameters.items()
                if n not in ("self", "kwargs")}

    theirs, ours = params(llama_cpp.Llama.__init__), params(Llama.__init__)
    assert set(theirs) == set(ours) | set(UNSUPPORTED_INIT_ARGS) | set(LLAMA_CPP_PYTHON_DEFAULTS)
    assert {n: theirs[n] for n in ours if n != "seed"} == {n: d for n, d in ours.items() if n != "seed"}
    assert {n: theirs[n] for n in UNSUPPORTED_INIT_ARGS} == UNSUPPORTED_INIT_ARGS
    assert {n: theirs[n] for n in LLAMA_CPP_PYTHON_DEFAULTS} == LLAMA_CPP_PYTHON_DEFAULTS  # RoPE's, taken in kwargs
    for method, unsupported in (("create_completion", UNSUPPORTED_COMPLETION_ARGS),
                                ("create_chat_completion", UNSUPPORTED_CHAT_ARGS)):
        theirs, ours = params(getattr(llama_cpp.Llama, method)), params(getattr(Llama, method))
        assert list(theirs) == list(ours)  # positional calls mean the same
        assert {n: theirs[n] for n in unsupported} == unsupported
        assert {n: d for n, d in theirs.items() if n != "stop"} == {n: d for n, d in ours.items() if n != "stop"}


def test_generate_and_sample_take_llama_cpp_pythons_arguments():
    llama_cpp = pytest.importorskip("llama_cpp")
    for method in ("generate", "sample"):
        theirs = inspect.signature(getattr(llama_cpp.Llama, method)).parameters
        ours = inspect.signature(getattr(Llama, method)).parameters
        assert list(theirs) == list(ours)  # positional calls mean the same
        assert {n: p.default for n, p in theirs.items()} == {n: p.default for n, p in ours.items()}
        assert all(theirs[n].default == d for n, d in UNSUPPORTED_GENERATE_ARGS.items() if n in theirs)


def test_closed_llama_refuses_to_generate():
    with Llama(model_path=str(DEMO), **SMALL) as closed:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        closed(PLANETS, max_tokens=2)


# -- llama-cpp-python's README and its own tests' calls, against stock llama-cpp-python ----------
def test_llama_and_its_grammar_are_in_all():
    assert {"Llama", "LlamaGrammar"} <= set(pyedgemoe.__all__)


def test_n_ctx_4096_n_batch_2048_runs_its_batches_in_ubatches_of_n_ubatch():
    with Llama(model_path=str(DEMO), n_ctx=4096, n_batch=2048, n_threads=2, verbose=False) as big, \
            Engine(DEMO, n_ctx=4096, n_batch=512, n_threads=2, flash_attn=False) as small:
        assert (big.n_batch, big.engine.plan.n_batch, big.engine.n_ubatch) == (2048, 2048, 512)
        prompt = big.tokenize(SOURCE.encode("utf-8") * 40)
        assert len(prompt) > 1024  # one llama_decode of it, which llama.cpp splits into ubatches of 512
        np.testing.assert_array_equal(big.engine.logits(prompt)[-4:], small.logits(prompt)[-4:])
    with Llama(model_path=str(DEMO), n_batch=256, n_ubatch=64, **SMALL) as split:
        assert (split.engine.plan.n_batch, split.engine.n_ubatch) == (256, 64)


def test_eval_reset_n_tokens_and_input_ids_are_llama_cpp_pythons(both):
    theirs, ours = both()
    tokens = ours.tokenize(SOURCE.encode("utf-8"))
    for llm in (theirs, ours):
        llm.eval(tokens[:5])
        llm.eval(tokens[5:])
    assert ours.n_tokens == theirs.n_tokens == len(tokens)
    assert ours.input_ids.shape == theirs.input_ids.shape == (512,)
    assert list(ours.input_ids[:ours.n_tokens]) == list(theirs.input_ids[:theirs.n_tokens]) == tokens
    ours(tokens + [ours.tokenize(b" x", add_bos=False)[0]], max_tokens=1, temperature=0)
    assert ours.engine.last_timings.n_cached_prompt_tokens == len(tokens)  # what eval evaluated is reused
    for llm in (theirs, ours):
        llm.reset()
    assert ours.n_tokens == theirs.n_tokens == 0


def test_setting_n_tokens_rewinds_the_context_as_in_llama_cpp_python(both, tiny_model):
    # llama-cpp-python's idiom: llm.n_tokens = k keeps the first k tokens, eval goes on after them
    theirs, ours = both(path=tiny_model("qwen3_moe")[0], n_ctx=256)
    tokens = ours.tokenize(b"Once upon a time there was a hobbit")
    more = ours.tokenize(b" who lived in a hole", add_bos=False)

    def greedy(llm, n: int) -> list[int]:
        picks = []
        for _ in range(n):
            picks.append(llm.sample(temp=0))
            llm.eval(picks[-1:])
        return picks
    for llm in (theirs, ours):
        llm.eval(tokens)
        llm.n_tokens = 3
        llm.eval(more)
    assert list(ours.input_ids[:ours.n_tokens]) == list(theirs.input_ids[:theirs.n_tokens]) == tokens[:3] + more
    rewound = greedy(ours, 6)
    assert rewound == greedy(theirs, 6)
    ours.reset()
    ours.eval(tokens[:3] + more)
    assert greedy(ours, 6) == rewound
    ours.n_tokens = ours.n_tokens  # no change
    ours.n_tokens = 0
    assert ours.n_tokens == 0
    for bad in (-1, 1, 2.0, True):
        with pytest.raises(InvalidOptionError, match="n_tokens"):
            ours.n_tokens = bad


def test_setting_n_tokens_of_a_recurrent_model_evaluates_the_kept_tokens_again(tiny_model):
    # a recurrent layer's state cannot drop its last tokens: the first k are evaluated afresh
    with Llama(model_path=str(tiny_model("qwen3_next")[0]), n_ctx=128, n_threads=2, verbose=False) as llm:
        tokens = llm.tokenize(b"Once upon a time there was a hobbit")
        llm.eval(tokens)
        llm.n_tokens = 3
        llm.eval(tokens[-2:])
        rewound = llm.sample(temp=0), llm.n_tokens
        llm.reset()
        llm.eval(tokens[:3] + tokens[-2:])
        assert (llm.sample(temp=0), llm.n_tokens) == rewound


@pytest.mark.parametrize("n_ctx", [512, 0])
def test_the_memory_of_scores_with_logits_all_is_counted_at_load(n_ctx):
    """scores' rows (a context's of logits) are in the load plan, as an expert cache's room is: a
    generation filled them beside an auto cache that had not left room for them (an OOM kill)."""
    with Llama(model_path=str(DEMO), **{**SMALL, "n_ctx": n_ctx}, logits_all=True) as scoring, \
            Llama(model_path=str(DEMO), **{**SMALL, "n_ctx": n_ctx}) as plain:
        rows = scoring.n_ctx()
        assert scoring.engine.n_logits == rows and rows in (512, 256)  # 0: the demo's training context
        assert scoring.engine.plan.context_bytes - plain.engine.plan.context_bytes >= rows * scoring.n_vocab() * 4


def test_scores_with_logits_all_are_stock_llama_cpp_pythons(both):
    # llama-cpp-python's scoring idiom: Llama(logits_all=True), eval(), then scores / eval_logits.
    # Rows not computed (of tokens since replaced) are NaN
    theirs, ours = both(logits_all=True)
    tokens = ours.tokenize(SOURCE.encode("utf-8"))
    for llm in (theirs, ours):
        llm.eval(tokens[:5])
        llm.eval(tokens[5:])
    ours.eval([])  # nothing to evaluate, nothing changes
    n = len(tokens)
    assert ours.scores.shape == theirs.scores.shape == (512, ours.n_vocab())
    np.testing.assert_allclose(ours.scores[:n], theirs.scores[:n], rtol=0, atol=1e-4)
    assert len(ours.eval_logits) == n and np.allclose(ours.eval_logits[-1], theirs.eval_logits[-1], rtol=0, atol=1e-4)
    kept = ours.scores[:4].copy()
    ours.reset()
    ours.eval(tokens[:4] + tokens[5:7])  # the first 4 tokens' rows still hold; the 5th's is recomputed for another token
    np.testing.assert_array_equal(ours.scores[:4], kept)
    assert not np.allclose(ours.scores[4], theirs.scores[4]) and np.isnan(ours.scores[6:n]).all()
    generation = ours.generate(ours.engine.tokens, temp=0)
    next(generation), next(generation)  # a generation's rows too: the first pick's, evaluated for the second
    assert not np.isnan(ours.scores[6]).any()
    np.testing.assert_array_equal(ours.scores[:4], kept)
    generation.close()
    saved, rows = ours.save_state(), ours.scores[:7].copy()
    ours.reset()
    ours.eval(tokens[:2] + tokens[3:9])  # rows from the third on are another text's now
    ours.load_state(saved)  # as in llama-cpp-python, the state brings its rows of scores back
    np.testing.assert_array_equal(ours.scores[:7], rows)
    with pytest.raises(InvalidOptionError, match="logits_all=True"):
        both()[1].scores


def test_completions_chats_and_generate_fill_scores_as_stock_llama_cpp_python(both, tiny_model):
    # there every token a generation evaluates is eval()'s: the prompt's rows, then each pick's
    theirs, ours = both(path=tiny_model("mixtral")[0], n_ctx=256, logits_all=True)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a planet."}]
    runs = (lambda llm: llm(llm.tokenize(b"def fib(n):"), max_tokens=8, temperature=0)["choices"][0]["text"],
            lambda llm: llm(llm.tokenize(b"def fib(n):"), max_tokens=8, temperature=0.8, seed=3)["choices"][0]["text"],
            lambda llm: llm.create_chat_completion(messages, max_tokens=6, temperature=0)["choices"][0]["message"],
            lambda llm: [t for t, _ in zip(llm.generate(llm.tokenize(b"hello"), temp=0), range(4))])
    for run in runs:
        assert run(ours) == run(theirs)
        n = theirs.n_tokens
        assert ours.n_tokens == n and not np.isnan(ours.scores[:n]).any()
        np.testing.assert_allclose(ours.scores[:n], theirs.scores[:n], rtol=0, atol=1e-4)


def test_eval_tokens_and_the_static_helpers_are_stock_llama_cpp_pythons(both):
    llama_cpp = pytest.importorskip("llama_cpp")
    theirs, ours = both()
    tokens = ours.tokenize(SOURCE.encode("utf-8"))
    for llm in (theirs, ours):
        llm.eval(tokens)
    assert ours.eval_tokens == theirs.eval_tokens and ours.eval_tokens.maxlen == theirs.eval_tokens.maxlen
    rows = np.random.default_rng(0).normal(0, 5, (3, 50)).astype(np.float32)
    rows[1, :] = -np.inf  # a row with nothing finite, as llama-cpp-python leaves it
    rows[2, 7] = np.inf
    for axis in (-1, 0):
        np.testing.assert_array_equal(Llama.logits_to_logprobs(rows, axis=axis),
                                      llama_cpp.Llama.logits_to_logprobs(rows, axis=axis))
    np.testing.assert_array_equal(Llama.logits_to_logprobs(list(rows[0])), llama_cpp.Llama.logits_to_logprobs(list(rows[0])))
    for a, b in (([1, 2, 3], [1, 2, 4]), ([], [1]), ([5, 6], [5, 6, 7]), ([1], [2])):
        assert Llama.longest_token_prefix(a, b) == llama_cpp.Llama.longest_token_prefix(a, b)


@pytest.mark.parametrize("make_cache", [lambda folder: pytest.importorskip("llama_cpp").LlamaRAMCache(),
                                        lambda folder: pyedgemoe.LlamaRAMCache(),
                                        lambda folder: pyedgemoe.LlamaDiskCache(str(folder))],
                         ids=["llama-cpp-python's", "pyedgemoe's", "pyedgemoe's on disk"])
def test_a_prompt_cache_of_llama_cpp_python_serves_completions_and_chats(llm, make_cache, tmp_path):
    # llama-cpp-python's own LlamaRAMCache, and pyedgemoe's as there: a prompt that continues a cached
    # completion starts from its state (its tokens are not evaluated again) and completes as without
    # the cache
    with Llama(model_path=str(DEMO), **SMALL) as cached:
        cached.set_cache(make_cache(tmp_path / "cache"))
        first = cached(PLANETS, max_tokens=8, temperature=0)["choices"][0]["text"]
        cached("Something else entirely", max_tokens=2, temperature=0)
        follow = PLANETS + first + " And the moons?"
        again = cached(follow, max_tokens=8, temperature=0)["choices"][0]["text"]
        # the cached state is the first prompt, its separator token, then the completion: the follow-up
        # shares the prompt's tokens up to the last, a space that the text after it tokenizes with
        shared = Llama.longest_token_prefix(cached.tokenize(PLANETS.encode()), cached.tokenize(follow.encode()))
        assert shared == len(cached.tokenize(PLANETS.encode())) - 1
        assert cached.engine.last_timings.n_cached_prompt_tokens >= shared
        assert again == llm(follow, max_tokens=8, temperature=0)["choices"][0]["text"]
        chat = [{"role": "user", "content": "Name a planet."}]
        reply = cached.create_chat_completion(chat, max_tokens=6, temperature=0, stream=True)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in reply)
        cached("Something else entirely", max_tokens=2, temperature=0)
        longer = chat + [{"role": "assistant", "content": text}, {"role": "user", "content": "Another?"}]
        out = cached.create_chat_completion(longer, max_tokens=6, temperature=0)["choices"][0]["message"]["content"]
        assert cached.engine.last_timings.n_cached_prompt_tokens > 5  # the streamed chat's state, saved at its end
        assert out == llm.create_chat_completion(longer, max_tokens=6, temperature=0)["choices"][0]["message"]["content"]
        cached.set_cache(None)
        cached("Something else entirely", max_tokens=2, temperature=0)
        cached(follow, max_tokens=2, temperature=0)
        assert cached.engine.last_timings.n_cached_prompt_tokens == 1  # the BOS the two prompts share


def test_generate_is_stock_llama_cpp_pythons(both):
    # llama-cpp-python's docstring example: a token after another, end-of-generation ones too, until
    # the caller stops; greedy, seeded (the Llama's seed, as there) and with penalties
    theirs, ours = both(seed=7)
    tokens = ours.tokenize(b"def fib(n):")
    for sampling in (dict(temp=0), dict(temp=0.8), dict(temp=1.0, top_k=50, top_p=0.9, repeat_penalty=1.3),
                     dict(temp=0.8, frequency_penalty=0.5, presence_penalty=0.5, typical_p=0.7)):
        expected = list(islice(theirs.generate(tokens, **sampling), 24))
        assert list(islice(ours.generate(tokens, **sampling), 24)) == expected, sampling
    assert ours.n_tokens == len(tokens) + 23  # the last token yielded is not evaluated, as there
    for llm in (theirs, ours):  # reset=False: after what the context holds
        llm.reset()
        llm.eval(tokens[:3])
    expected = list(islice(theirs.generate(tokens[3:], reset=False, temp=0), 8))
    assert list(islice(ours.generate(tokens[3:], reset=False, temp=0), 8)) == expected
    assert list(islice(ours.generate(tokens, temp=0), 8)) == expected


def test_generate_refuses_what_it_cannot_do_at_the_call(llm):
    tokens = llm.tokenize(b"def fib(n):")
    with pytest.raises(InvalidOptionError, match="tfs_z=0.5"):
        llm.generate(tokens, tfs_z=0.5)
    with pytest.raises(InvalidOptionError, match="stopping_criteria must be callable"):
        llm.generate(tokens, stopping_criteria=[lambda ids, logits: False])  # llama-cpp-python calls it too
    with pytest.raises(InvalidOptionError, match="logits_processor must be callable"):
        llm.generate(tokens, logits_processor=[np.zeros(3)])
    with pytest.raises(InvalidOptionError, match="mirostat_mode must be 0"):
        llm.generate(tokens, mirostat_mode=3)
    with pytest.raises(InvalidOptionError, match="top_p"):
        llm.generate(tokens, top_p=-0.5)
    tokens_out = llm.generate(tokens, temp=0)
    next(tokens_out)
    with pytest.raises(InvalidOptionError, match="sent into the generator"):
        tokens_out.send([1, 2])
    assert llm(tokens, max_tokens=2, temperature=0)["choices"]  # the generator let go of the context


def test_eval_then_sample_is_stock_llama_cpp_pythons(both):
    theirs, ours = both(seed=7)
    tokens = ours.tokenize(b"def fib(n):")
    picks = {}
    for name, llm in (("theirs", theirs), ("ours", ours)):
        llm.eval(tokens)
        picks[name] = [llm.sample(temp=0), llm.sample(temp=0.8, top_k=50), llm.sample(temp=1.0, top_k=0, top_p=1.0,
                                                                                      min_p=0.0),
                       llm.sample(temp=0.8, repeat_penalty=1.5, idx=len(tokens) - 1)]
        llm.eval(picks[name][:1])
        picks[name].append(llm.sample(temp=0))
    assert picks["ours"] == picks["theirs"]
    assert len(set(picks["ours"][:4])) > 1  # the settings took effect


def test_sample_picks_after_the_tokens_held_whatever_ran_since(llm):
    tokens = llm.tokenize(SOURCE.encode("utf-8"))
    greedy = list(islice(llm.generate(tokens, temp=0), 2))
    llm.reset()
    llm.eval(tokens)
    state = llm.save_state()
    llm(llm.tokenize(b"import os"), max_tokens=4, temperature=0)  # other logits, another context
    llm.load_state(state)
    assert llm.sample(temp=0) == greedy[0]
    llm.eval(greedy[:1])
    assert llm.sample(temp=0) == greedy[1]
    with pytest.raises(InvalidOptionError, match="only its logits are kept"):
        llm.sample(idx=0)
    with pytest.raises(InvalidOptionError, match="tfs_z=0.5"):
        llm.sample(tfs_z=0.5)
    llm.reset()
    with pytest.raises(InvalidOptionError, match="eval some first"):
        llm.sample()


def test_seeded_sampling_is_stock_llama_cpp_pythons(both):
    theirs, ours = both(seed=7)
    tokens = ours.tokenize(b"def fib(n):")
    for _ in range(3):  # each call takes the next seed of the sequence seed=7 starts
        assert ours(tokens, max_tokens=24)["choices"] == theirs(tokens, max_tokens=24)["choices"]
    assert ours(tokens, max_tokens=24, seed=1337)["choices"] == theirs(tokens, max_tokens=24, seed=1337)["choices"]
    typical = dict(max_tokens=24, seed=1337, top_k=0, top_p=1.0, min_p=0.0, temperature=1.0, typical_p=0.5)
    assert ours(tokens, **typical)["choices"] == theirs(tokens, **typical)["choices"]
    assert ours(tokens, **typical)["choices"] != ours(tokens, **{**typical, "typical_p": 1.0})["choices"]


def test_a_negative_temperature_samples_the_whole_distribution_as_in_llama_cpp_python(both, tiny_model):
    # llama-cpp-python's chain below 0: the penalties, the logit bias and the grammar, then a pick from
    # the whole distribution (no top-k, top-p, min-p, scaling); the Engine's is greedy
    llama_cpp = pytest.importorskip("llama_cpp")
    theirs, ours = both(path=tiny_model("qwen3_moe")[0], n_ctx=256, seed=1234)
    prompt = ours.tokenize(b"Once upon a time")
    picks = []
    for llm in (theirs, ours):  # first: stock's sample() reuses the sampler of a generate() left open
        llm.eval(prompt)
        picks.append([(llm.set_seed(seed), llm.sample(temp=-1.0))[1] for seed in range(8)])
    assert picks[1] == picks[0] and len(set(picks[1])) > 1
    out = [llm("Once upon a time", max_tokens=6, temperature=-1.0)["choices"] for llm in (theirs, ours)]
    assert out[1] == out[0]
    assert out[1] != ours("Once upon a time", max_tokens=6, temperature=0)["choices"]
    messages = [{"role": "user", "content": "Hi there"}]
    constrained = dict(logit_bias={202: 5.0}, repeat_penalty=1.3,
                       grammar=llama_cpp.LlamaGrammar.from_string("root ::= [a-z ]+", verbose=False))
    for kwargs in ({}, constrained):
        chats = [llm.create_chat_completion(messages, max_tokens=6, temperature=-1.0, seed=5, **kwargs)["choices"]
                 for llm in (theirs, ours)]
        assert chats[1] == chats[0]
    for llm in (theirs, ours):
        llm.set_seed(77)
    assert list(islice(ours.generate(prompt, temp=-1.0), 6)) == list(islice(theirs.generate(prompt, temp=-1.0), 6))


def test_penalties_are_stock_llama_cpp_pythons(both):
    # llama-cpp-python's penalties count the generated tokens only, not the prompt's (its "def" is
    # generated again after 32 tokens here, which a penalty on the prompt's tokens would change)
    theirs, ours = both()
    tokens = ours.tokenize(b"def fib(n):")
    plain = ours(tokens, max_tokens=48, temperature=0)["choices"][0]["text"]
    for penalties in (dict(repeat_penalty=1.3), dict(frequency_penalty=1.5), dict(presence_penalty=1.5),
                      dict(frequency_penalty=0.5, presence_penalty=0.5, repeat_penalty=1.1)):
        out = ours(tokens, max_tokens=48, temperature=0, **penalties)["choices"]
        assert out == theirs(tokens, max_tokens=48, temperature=0, **penalties)["choices"]
        assert out[0]["text"] != plain, penalties  # the penalty changed the greedy text


def test_the_penalties_window_is_last_n_tokens_size_as_in_llama_cpp_python(both):
    texts = []
    for size in (64, 4):
        theirs, ours = both(last_n_tokens_size=size)
        tokens = ours.tokenize(b"def fib(n):")
        out = ours(tokens, max_tokens=48, temperature=0, repeat_penalty=1.3)["choices"]
        assert out == theirs(tokens, max_tokens=48, temperature=0, repeat_penalty=1.3)["choices"]
        texts.append(out[0]["text"])
    assert texts[0] != texts[1]  # a window of 4 tokens penalizes less
    # -1: the whole context, as llama.cpp's --repeat-last-n -1 (llama-cpp-python hands -1 to a sampler
    # that takes it as 0, no penalty: not what the value means)
    with Llama(model_path=str(DEMO), last_n_tokens_size=-1, **SMALL) as whole, \
            Llama(model_path=str(DEMO), last_n_tokens_size=SMALL["n_ctx"], **SMALL) as n_ctx:
        assert whole.last_n_tokens_size == -1  # as stock keeps it
        assert whole(tokens, max_tokens=48, temperature=0, repeat_penalty=1.3)["choices"] == \
            n_ctx(tokens, max_tokens=48, temperature=0, repeat_penalty=1.3)["choices"]
    with pytest.raises(InvalidOptionError, match="penalty_last_n .* must be >= -1"):
        Llama(model_path=str(DEMO), last_n_tokens_size=-2, verbose=False)


def test_mirostat_is_stock_llama_cpp_pythons_at_temperature_1(both):
    # llama-cpp-python's chain leaves the temperature out of Mirostat's; llama.cpp's common sampler,
    # and so ours, applies it first: the same picks at temperature 1
    theirs, ours = both()
    tokens = ours.tokenize(b"def fib(n):")
    # the same calls to both: a later call re-evaluates the prompt's last token alone (both reuse the
    # rest), whose logits the CPU's kernels may round apart from the first call's batch
    plain = ours(tokens, max_tokens=32, temperature=1.0, seed=1337)["choices"]
    assert plain == theirs(tokens, max_tokens=32, temperature=1.0, seed=1337)["choices"]
    for mirostat in (dict(mirostat_mode=1), dict(mirostat_mode=2, mirostat_tau=3.0, mirostat_eta=0.2)):
        kwargs = dict(max_tokens=32, temperature=1.0, seed=1337, **mirostat)
        out = ours(tokens, **kwargs)["choices"]
        assert out == theirs(tokens, **kwargs)["choices"]
        assert out != plain, mirostat
        assert ours(tokens, **{**kwargs, "temperature": 0.3})["choices"] != out  # the temperature counts
    assert list(islice(ours.generate(tokens, temp=1.0, mirostat_mode=2), 16)) == \
        list(islice(theirs.generate(tokens, temp=1.0, mirostat_mode=2), 16))


def test_logit_bias_is_stock_llama_cpp_pythons(both):
    theirs, ours = both()
    tokens = ours.tokenize(b"def fib(n):")
    greedy = list(islice(ours.generate(tokens, temp=0), 2))
    plain = ours(tokens, max_tokens=24, temperature=0)["choices"]
    for bias in ({greedy[0]: -100.0}, {str(greedy[1]): -5.0, 13: 2.5}):  # ids as text too, as OpenAI's JSON keys
        out = ours(tokens, max_tokens=24, temperature=0, logit_bias=bias)["choices"]
        assert out == theirs(tokens, max_tokens=24, temperature=0, logit_bias=bias)["choices"]
        assert out != plain, bias
    forced = ours.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=6, temperature=0.8,
                                         logit_bias={greedy[0]: 100.0})
    assert forced["choices"][0]["message"]["content"] == ours.detokenize([greedy[0]] * 6).decode()
    with pytest.raises(InvalidOptionError, match="logit_bias: token id 99999 out of range"):
        ours(tokens, max_tokens=2, logit_bias={99999: 1.0})
    with pytest.raises(InvalidOptionError, match="logit_bias must map token ids to numbers"):
        ours(tokens, max_tokens=2, logit_bias={"the": 1.0})


def test_logits_processors_are_stock_llama_cpp_pythons(both):
    llama_cpp = pytest.importorskip("llama_cpp")
    theirs, ours = both()
    tokens = ours.tokenize(b"def fib(n):")
    first = next(ours.generate(tokens, temp=0))
    seen = []

    def ban_first(input_ids, scores):  # llama-cpp-python's LogitsProcessor
        seen.append(input_ids.tolist())
        scores[first] = -np.inf
        return scores
    for processors in (llama_cpp.LogitsProcessorList([ban_first]), pyedgemoe.LogitsProcessorList([ban_first]),
                       [ban_first]):  # a plain list too, as there
        seen.clear()
        out = ours(tokens, max_tokens=8, temperature=0, logits_processor=processors)
        assert seen[0] == tokens and len(seen) == 8  # the tokens evaluated before each pick
        assert seen[-1] == tokens + ours.tokenize(out["choices"][0]["text"].encode(), add_bos=False)[:7]
        assert out["choices"] == theirs(tokens, max_tokens=8, temperature=0, logits_processor=processors)["choices"]
        assert ours.tokenize(out["choices"][0]["text"].encode(), add_bos=False)[0] != first
    min_tokens = llama_cpp.MinTokensLogitsProcessor(12, ours.token_eos())
    kwargs = dict(temp=0.8, logits_processor=llama_cpp.LogitsProcessorList([min_tokens]))
    assert list(islice(ours.generate(tokens, **kwargs), 16)) == list(islice(theirs.generate(tokens, **kwargs), 16))
    ours.reset()
    ours.eval(tokens)
    banned = ours.engine.logits(tokens)[-1]
    banned[first] = -np.inf
    # (llama-cpp-python's own sample() leaves the processor out here: it picks `first`)
    assert ours.sample(temp=0, logits_processor=ban_first) == int(np.argmax(banned))
    with pytest.raises(InvalidOptionError, match="logits_processor returned logits of shape"):
        ours(tokens, max_tokens=2, logits_processor=lambda ids, scores: scores[:10])
    for left in (np.nan, -np.inf):
        with pytest.raises(InvalidOptionError, match="no token left"):
            ours(tokens, max_tokens=2, logits_processor=lambda ids, scores: np.full_like(scores, left))


def test_stopping_criteria_end_the_generation_as_in_llama_cpp_python(both):
    llama_cpp = pytest.importorskip("llama_cpp")
    theirs, ours = both()
    tokens = ours.tokenize(b"def fib(n):")
    argmax = []

    def after_five(input_ids, logits):  # asked after each pick: true drops that pick and ends the generation
        argmax.append(int(np.argmax(logits)))
        return len(input_ids) >= len(tokens) + 5
    for criteria in (llama_cpp.StoppingCriteriaList([after_five]), pyedgemoe.StoppingCriteriaList([after_five]),
                     after_five):
        argmax.clear()
        out = ours(tokens, max_tokens=24, temperature=0, stopping_criteria=criteria)
        assert out["choices"] == theirs(tokens, max_tokens=24, temperature=0, stopping_criteria=criteria)["choices"]
        assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 5
        # the logits each pick came from (llama-cpp-python hands a row of its scores that is not theirs)
        assert argmax[:5] == ours.tokenize(out["choices"][0]["text"].encode(), add_bos=False)[:5]
    streamed = list(ours(tokens, max_tokens=24, temperature=0, stopping_criteria=after_five, stream=True))
    assert "".join(c["choices"][0]["text"] for c in streamed) == out["choices"][0]["text"]
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"
    assert list(islice(ours.generate(tokens, temp=0, stopping_criteria=after_five), 24)) == \
        list(islice(theirs.generate(tokens, temp=0, stopping_criteria=after_five), 24))


def test_the_engine_counts_the_prompt_in_its_penalties_as_llama_cpp_does(eng):
    prompt = eng.tokenize("def fib(n):")
    counted = eng.generate(prompt, 48, temperature=0, repeat_penalty=1.3)
    assert counted != eng.generate(prompt, 48, temperature=0, repeat_penalty=1.3, penalize_prompt=False)


def test_grammar_constrains_as_in_llama_cpp_pythons_test_real_llama(both):
    llama_cpp = pytest.importorskip("llama_cpp")
    theirs, ours = both()
    tokens = ours.tokenize(b"The capital of france is paris, 'true' or 'false'?:\n")
    kwargs = dict(max_tokens=8, top_k=50, top_p=0.9, temperature=0.8, seed=1337)  # "false": 5 tokens here
    expected = theirs(tokens, grammar=llama_cpp.LlamaGrammar.from_string('root ::= "true" | "false"'), **kwargs)
    for grammar in (LlamaGrammar.from_string('root ::= "true" | "false"'),  # pyedgemoe's, llama-cpp-python's, text
                    llama_cpp.LlamaGrammar.from_string('root ::= "true" | "false"'), 'root ::= "true" | "false"'):
        out = ours(tokens, grammar=grammar, **kwargs)["choices"][0]
        assert out["text"] in ("true", "false") and out["text"] == expected["choices"][0]["text"]


def test_a_json_schema_grammar_takes_json_text_and_refuses_a_dict_as_llama_cpp_python():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert "root" in LlamaGrammar.from_json_schema(json.dumps(schema))._grammar
    with pytest.raises(TypeError, match=r"json_schema must be a JSON text \(json.dumps\(schema\)\), not dict"):
        LlamaGrammar.from_json_schema(schema)


def test_save_and_load_state_as_in_llama_cpp_pythons_test_real_llama(both):
    theirs, ours = both()
    numbers = 'root ::= "1" | "2" | "3" | "4" | "5" | "6" | "7" | "8" | "9" | "10"'
    tokens = ours.tokenize(b"Pick a number from 1 to 10?:\n")
    picked = {}
    stock_grammar = pytest.importorskip("llama_cpp").LlamaGrammar
    for name, llm, grammar in (("theirs", theirs, stock_grammar), ("ours", ours, LlamaGrammar)):
        llm.set_seed(1337)
        state = llm.save_state()
        pick = lambda: llm(tokens, max_tokens=4, top_k=50, top_p=0.9, temperature=0.8,  # noqa: E731
                           grammar=grammar.from_string(numbers))["choices"][0]["text"]
        first, second = pick(), pick()
        llm.load_state(state)
        picked[name] = (first, second, pick())
    assert picked["ours"] == picked["theirs"]
    first, second, after_load = picked["ours"]
    assert first != second and first == after_load


def test_state_restores_the_context_it_saved(llm):
    tokens = llm.tokenize(SOURCE.encode("utf-8"))
    llm.reset()
    llm.eval(tokens)
    state = llm.save_state()
    expected = llm(tokens, max_tokens=8, temperature=0)["choices"]
    llm.reset()
    llm.load_state(state)
    assert llm.n_tokens == state.n_tokens == len(tokens) and list(state.input_ids) == tokens
    assert llm(tokens, max_tokens=8, temperature=0)["choices"] == expected
    assert llm.engine.last_timings.n_cached_prompt_tokens == len(tokens) - 1
    with pytest.raises(InvalidOptionError, match="load_state takes what save_state gave"):
        llm.load_state(b"not a state")


def test_tokenizer_is_llama_cpp_pythons(stock):
    theirs, ours = stock
    assert ours.tokenizer().encode(SOURCE) == theirs.tokenizer().encode(SOURCE)
    tokens = ours.tokenize(SOURCE.encode("utf-8"))
    assert ours.tokenizer().decode(tokens) == theirs.tokenizer().decode(tokens) == SOURCE


def test_a_character_cut_by_max_tokens_is_finished_as_llama_cpp_python_finishes_it(both):
    # the grammar makes the model spell 😀 in its four byte tokens: llama-cpp-python's completions
    # take tokens past max_tokens while the text ends in a character's first bytes (its count of the
    # bytes it lacks); its test_utf8, on a mocked model, expects "" for max_tokens=1
    llama_cpp = pytest.importorskip("llama_cpp")
    theirs, ours = both()
    prompt = ours.tokenize(b"x = ")
    for n in (1, 2, 4):
        out = ours(prompt, max_tokens=n, temperature=0, grammar='root ::= "😀"')
        expected = theirs(prompt, max_tokens=n, temperature=0, grammar=llama_cpp.LlamaGrammar.from_string(
            'root ::= "😀"', verbose=False))
        assert out["choices"][0]["text"] == expected["choices"][0]["text"] == "😀"
        assert out["usage"] == expected["usage"] and out["usage"]["completion_tokens"] == 4


def test_readme_embeddings_are_stock_llama_cpp_pythons(both):
    theirs, ours = both(embedding=True)
    expected, out = theirs.create_embedding("Hello, world!"), ours.create_embedding("Hello, world!")
    assert out["object"] == "list" and out["usage"] == expected["usage"]
    vectors, expected_vectors = np.array(out["data"][0]["embedding"]), np.array(expected["data"][0]["embedding"])
    assert vectors.shape == expected_vectors.shape == (len(ours.tokenize(b"Hello, world!")), ours.n_embd())
    np.testing.assert_allclose(vectors, expected_vectors, atol=1e-4)  # a generative model: a vector per token
    assert ours.pooling_type() == theirs.pooling_type() == 0
    pair = ours.embed(["Hello, world!", "Goodbye, world!"], normalize=True)
    assert len(pair) == 2
    for text, vectors in zip(["Hello, world!", "Goodbye, world!"], pair):  # stock reads a list's second wrong
        np.testing.assert_allclose(vectors, theirs.embed(text, normalize=True), atol=1e-4)
        assert np.linalg.norm(vectors[-1]) == pytest.approx(1.0, abs=1e-5)


def test_embed_without_embedding_true_is_refused_as_in_llama_cpp_python(llm):
    with pytest.raises(InvalidOptionError, match="embedding=True"):
        llm.create_embedding("Hello, world!")
    with pytest.raises(RuntimeError, match="embedding=True"):  # what llama-cpp-python raises
        llm.embed("Hello, world!")


def _assert_logprobs_equal(out: dict, expected: dict) -> None:
    """Completion logprobs as llama-cpp-python returns them: the same tokens and offsets, the same
    values but for float32 summation order."""
    assert out["tokens"] == expected["tokens"] and out["text_offset"] == expected["text_offset"]
    assert [lp is None for lp in out["token_logprobs"]] == [lp is None for lp in expected["token_logprobs"]]
    np.testing.assert_allclose([lp for lp in out["token_logprobs"] if lp is not None],
                               [lp for lp in expected["token_logprobs"] if lp is not None], atol=1e-5)
    for top, expected_top in zip(out["top_logprobs"], expected["top_logprobs"]):
        assert (top is None) == (expected_top is None)
        if top is not None:
            assert list(top) == list(expected_top)
            np.testing.assert_allclose(list(top.values()), [float(v) for v in expected_top.values()], atol=1e-5)


@pytest.mark.parametrize("logits_all", [True, False])
def test_completion_logprobs_are_stock_llama_cpp_pythons(both, logits_all):
    # stock needs logits_all for logprobs; pyedgemoe needs none. With it, the first pick comes from
    # the prompt's batch as there (a prompt's last token evaluated again alone rounds apart)
    theirs, _ = both(logits_all=True)
    _, ours = both(logits_all=logits_all)
    for text in (b"x = ", b"def fib(n):"):
        prompt = ours.tokenize(text)
        expected = theirs(prompt, max_tokens=6, temperature=0, logprobs=3)["choices"][0]
        out = ours(prompt, max_tokens=6, temperature=0, logprobs=3)["choices"][0]
        assert out["text"] == expected["text"]
        _assert_logprobs_equal(out["logprobs"], expected["logprobs"])
        if logits_all:
            np.testing.assert_allclose(ours.scores[:ours.n_tokens], theirs.scores[:theirs.n_tokens], rtol=0, atol=1e-5)
    json.dumps(out)  # plain floats (stock's are numpy's)


def test_echoed_logprobs_put_the_prompts_before_the_completions(llm):
    # stock llama-cpp-python's echo fails on a token prompt: the prompt's log-probabilities here are
    # the model's own (Engine.logits); the separator token after it is the BOS, left out as there
    prompt = llm.tokenize(PLANETS.encode("utf-8"))
    llm.reset()  # each evaluates the whole prompt
    plain = llm(PLANETS, max_tokens=6, temperature=0, logprobs=2)["choices"][0]
    llm.reset()
    echoed = llm(PLANETS, max_tokens=6, temperature=0, logprobs=2, echo=True)["choices"][0]
    assert echoed["text"] == PLANETS + plain["text"]
    rows = llm.engine.logits(prompt).astype(np.float64)
    expected = [rows[k - 1, t] - np.log(np.exp(rows[k - 1] - rows[k - 1].max()).sum()) - rows[k - 1].max()
                for k, t in enumerate(prompt) if k >= 2]  # the BOS left out, the first without any
    logprobs = echoed["logprobs"]
    n = len(prompt) - 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    np.testing.assert_allclose(logprobs["token_logprobs"][1:n], expected, atol=1e-4)
    assert "".join(logprobs["tokens"][:n]) == PLANETS and logprobs["text_offset"][:n] == \
        [len("".join(logprobs["tokens"][:i])) for i in range(n)]
    for key in ("tokens", "text_offset"):
        assert logprobs[key][n:] == plain["logprobs"][key]
    # the prompt evaluated with every row's logits (as stock's logits_all): the completion's in the last bits alike
    for top, plain_top in zip(logprobs["top_logprobs"][n:], plain["logprobs"]["top_logprobs"], strict=True):
        assert list(top) == list(plain_top)
        np.testing.assert_allclose(list(top.values()), list(plain_top.values()), rtol=0, atol=1e-5)


def test_echoed_logprobs_without_a_bos_are_each_tokens_own_where_stock_reads_the_next_positions(both, tiny_model):
    # stock's echo pairs token i with the distribution after it (right only behind a BOS it skips) and
    # lists one token fewer on a model that adds none (Qwen3's): a bug of stock's, not followed here
    theirs, ours = both(path=tiny_model("qwen3_moe")[0], n_ctx=256, logits_all=True)
    expected, out = (llm("Once upon a time", max_tokens=2, temperature=0, logprobs=1, echo=True)["choices"][0]
                     for llm in (theirs, ours))
    assert out["text"] == expected["text"]
    tokens = list(theirs.input_ids[:theirs.n_tokens])  # the prompt's and the first generated: no BOS
    assert ours.metadata["tokenizer.ggml.add_bos_token"] == "false"
    assert len(tokens) == len(out["logprobs"]["tokens"]) - 1
    assert expected["logprobs"]["tokens"] == out["logprobs"]["tokens"][:-1]
    rows = ours.engine.logits(tokens).astype(np.float64)
    rows -= np.log(np.exp(rows - rows.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)) \
        + rows.max(axis=1, keepdims=True)  # log-probabilities; row i: the distribution of token i + 1
    own = [rows[i - 1, t] for i, t in enumerate(tokens) if i]
    np.testing.assert_allclose(out["logprobs"]["token_logprobs"][1:len(tokens)], own, atol=1e-4)
    next_positions = [rows[i, t] for i, t in enumerate(tokens) if i]
    np.testing.assert_allclose(expected["logprobs"]["token_logprobs"][1:], next_positions, atol=1e-4)


def test_streamed_logprobs_join_to_the_whole_ones(llm):
    llm.reset()  # each evaluates the whole prompt
    whole = llm(PLANETS, max_tokens=12, temperature=0, logprobs=2)["choices"][0]["logprobs"]
    llm.reset()
    chunks = [c["choices"][0]["logprobs"] for c in llm(PLANETS, max_tokens=12, temperature=0, logprobs=2, stream=True)]
    joined = {key: [item for c in chunks if c for item in c[key]] for key in whole}
    assert joined == whole and len(whole["tokens"]) == 12


def test_chat_logprobs_are_openai_shaped_with_stock_values(both, tiny_model):
    theirs, ours = both(path=tiny_model("mixtral")[0], n_ctx=256, logits_all=True)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a planet."}]
    expected = theirs.create_chat_completion(messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    out = ours.create_chat_completion(messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    assert out["choices"][0]["message"] == expected["choices"][0]["message"]
    content, expected_content = out["choices"][0]["logprobs"]["content"], expected["choices"][0]["logprobs"]["content"]
    assert len(content) == len(expected_content) == 8
    for entry, expected_entry in zip(content, expected_content):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["token"] == expected_entry["token"] and len(entry["top_logprobs"]) == 2
        assert entry["token"] == bytes(entry["bytes"]).decode("utf-8", errors="ignore")
        assert entry["logprob"] == pytest.approx(float(expected_entry["logprob"]), abs=1e-5)
        assert [t["token"] for t in entry["top_logprobs"]] == [t["token"] for t in expected_entry["top_logprobs"]][:2]
    # top_logprobs without logprobs: ignored, as stock ignores it (it was refused)
    without = ours.create_chat_completion(messages, max_tokens=8, temperature=0, top_logprobs=2)
    stock = theirs.create_chat_completion(messages, max_tokens=8, temperature=0, top_logprobs=2)
    assert without["choices"][0]["message"] == stock["choices"][0]["message"] == expected["choices"][0]["message"]
    assert without["choices"][0]["logprobs"] is None is stock["choices"][0]["logprobs"]


def test_readme_json_mode_is_stock_llama_cpp_pythons(both, tiny_model):
    theirs, ours = both(path=tiny_model("mixtral")[0], n_ctx=256)
    messages = [{"role": "system", "content": "You are a helpful assistant that outputs in JSON."},
                {"role": "user", "content": "Who won the world series in 2020"}]
    expected = theirs.create_chat_completion(messages=messages, response_format={"type": "json_object"},
                                             temperature=0.7, max_tokens=48)
    out = ours.create_chat_completion(messages=messages, response_format={"type": "json_object"},
                                      temperature=0.7, max_tokens=48)
    assert out["choices"][0]["message"]["content"].startswith("{")  # a random model: JSON, cut at max_tokens
    assert out["choices"][0] == expected["choices"][0]


def test_readme_json_schema_mode_gives_json_of_the_schema(llm):
    messages = [{"role": "system", "content": "You are a helpful assistant that outputs in JSON."},
                {"role": "user", "content": "Who won the world series in 2020"}]
    schema = {"type": "object", "properties": {"team_name": {"type": "string"}}, "required": ["team_name"]}
    out = llm.create_chat_completion(messages=messages, temperature=0, max_tokens=64,
                                     response_format={"type": "json_object", "schema": schema})["choices"][0]
    assert out["finish_reason"] == "stop" and isinstance(json.loads(out["message"]["content"])["team_name"], str)


# -- tools ------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather of a city <in a few days>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}
FORCED = {"type": "function", "function": {"name": "get_weather"}}
ASKED = [{"role": "user", "content": "What is the weather in Paris?"}]
# a Hermes-style template (Qwen's way): tools as JSON in the system turn, calls and answers in tags
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}"
    "</tool_response><|im_end|>\n{% elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    "<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments }}}</tool_call>"
    "{% break %}{% endfor %}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{% generation %}{{ m.content }}"
    "{% endgeneration %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{{ strftime_now('%Y') | length }}{% endif %}")


def keys(value):
    """value's shape: its dicts' keys, all the way down."""
    if isinstance(value, dict):
        return {k: keys(v) for k, v in value.items() if k not in ("logprobs", "usage")}
    return [keys(v) for v in value] if isinstance(value, list) else None


def test_tools_reach_the_models_template_as_in_llama_cpp_python():
    from pyedgemoe.chat_template import render_chat
    llama_chat_format = pytest.importorskip("llama_cpp.llama_chat_format")
    called = [*ASKED, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny <and warm>"}]
    for messages, tools in ((ASKED, [WEATHER]), (called, [WEATHER]), (ASKED, None)):
        expected = llama_chat_format.Jinja2ChatFormatter(TOOLS_TEMPLATE, "</s>", "<s>")(messages=messages, tools=tools)
        assert render_chat(TOOLS_TEMPLATE, messages, bos_token="<s>", eos_token="</s>", tools=tools) == expected.prompt
    assert "<in a few days>" in render_chat(TOOLS_TEMPLATE, ASKED, bos_token="", eos_token="", tools=[WEATHER])


def test_a_forced_tool_call_answers_in_llama_cpp_pythons_shape(both, demo_chat):
    theirs, ours = both(path=demo_chat)
    kwargs = dict(tools=[WEATHER], tool_choice=FORCED, max_tokens=96, temperature=0)
    out = ours.create_chat_completion(ASKED, **kwargs)
    assert keys(out) == keys(theirs.create_chat_completion(ASKED, **kwargs))
    choice, = out["choices"]
    message, call = choice["message"], choice["message"]["tool_calls"][0]
    assert choice["finish_reason"] == "tool_calls" and message["content"] is None
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])  # the function's parameters, by its schema
    assert isinstance(arguments["city"], str) and isinstance(arguments["days"], int)
    assert message["function_call"] == call["function"]  # llama-cpp-python's legacy field too
    chunks = list(ours.create_chat_completion(ASKED, stream=True, **kwargs))
    expected = list(theirs.create_chat_completion(ASKED, stream=True, **kwargs))
    assert [keys(c) for c in (chunks[0], chunks[1], chunks[-1])] == [keys(c) for c in (expected[0], expected[1],
                                                                                        expected[-1])]
    pieces = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks[1:-1]]
    assert "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]
    assert {p["id"] for p in pieces} == {pieces[0]["id"]} and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # "required" with one tool forces it; a call cut by max_tokens says so
    required = ours.create_chat_completion(ASKED, **{**kwargs, "tool_choice": "required"})["choices"][0]
    assert required["message"]["tool_calls"][0]["function"]["arguments"] == call["function"]["arguments"]
    cut = ours.create_chat_completion(ASKED, **{**kwargs, "max_tokens": 3})["choices"][0]
    assert cut["finish_reason"] == "length"


def test_tools_not_forced_leave_the_answer_text_and_a_conversation_goes_on_after_a_call(llm):
    auto = llm.create_chat_completion(ASKED, tools=[WEATHER], tool_choice="auto", max_tokens=8, temperature=0)
    assert auto["choices"][0]["message"]["content"] == \
        llm.create_chat_completion(ASKED, max_tokens=8, temperature=0)["choices"][0]["message"]["content"]
    called = [*ASKED, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert "sunny" in llm.engine.format_chat(called)  # ChatML: the tool's answer, the call's empty content
    assert llm.create_chat_completion(called, tools=[WEATHER], max_tokens=4, temperature=0)["choices"][0]["message"]


def test_openais_legacy_functions_are_the_tools_llama_cpp_python_makes_of_them(both):
    theirs, ours = both()
    legacy = dict(functions=[WEATHER["function"]], function_call={"name": "get_weather"}, max_tokens=96,
                  temperature=0)
    out = ours.create_chat_completion(ASKED, **legacy)
    assert keys(out) == keys(theirs.create_chat_completion(ASKED, **legacy))
    as_tools = ours.create_chat_completion(ASKED, tools=[WEATHER], tool_choice=FORCED, max_tokens=96, temperature=0)
    assert out["choices"][0]["message"]["function_call"] == as_tools["choices"][0]["message"]["function_call"]
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    auto = ours.create_chat_completion(ASKED, functions=[WEATHER["function"]], function_call="auto", max_tokens=8,
                                       temperature=0)
    assert auto["choices"][0]["message"]["content"] == ours.create_chat_completion(
        ASKED, tools=[WEATHER], tool_choice="auto", max_tokens=8, temperature=0)["choices"][0]["message"]["content"]


@pytest.mark.parametrize("legacy, fragment", [
    (dict(functions=[WEATHER["function"]], tools=[WEATHER]), "functions and function_call .* or its tools"),
    (dict(functions=[WEATHER["function"]], function_call="always"), 'function_call must be "none", "auto"'),
    (dict(functions=[{"description": "no name"}]), r"functions\[0\] must be"),
    (dict(functions=WEATHER["function"]), "functions must be a list"),
])
def test_bad_legacy_functions_are_refused_by_name(llm, legacy, fragment):
    with pytest.raises(InvalidOptionError, match=fragment):
        llm.create_chat_completion(ASKED, max_tokens=2, **legacy)


def test_openai_v1_chat_completions_are_the_openai_packages_types(llm):
    openai_chat = pytest.importorskip("openai.types.chat")
    out = llm.create_chat_completion_openai_v1(ASKED, tools=[WEATHER], tool_choice=FORCED, max_tokens=96,
                                               temperature=0)
    assert isinstance(out, openai_chat.ChatCompletion)
    assert out.choices[0].message.tool_calls[0].function.name == "get_weather"
    chunks = list(llm.create_chat_completion_openai_v1(messages=ASKED, max_tokens=4, temperature=0, stream=True))
    assert all(isinstance(c, openai_chat.ChatCompletionChunk) for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        llm.create_chat_completion(ASKED, max_tokens=4, temperature=0)["choices"][0]["message"]["content"]


@pytest.mark.parametrize("tools, tool_choice, fragment", [
    ([WEATHER, {**WEATHER, "function": {**WEATHER["function"], "name": "other"}}], "required",
     '"required" forces a call of the one tool'),
    ([WEATHER], {"type": "function", "function": {"name": "nowhere"}}, "'nowhere', which is not among the tools"),
    ([WEATHER], "sometimes", "tool_choice must be one of"),
    ({"get_weather": WEATHER}, None, "tools must be a list"),
    ([{"type": "function", "function": {"description": "no name"}}], None, r"tools\[0\] must be"),
])
def test_bad_tools_are_refused_by_name(chat_llm, tools, tool_choice, fragment):
    with pytest.raises(InvalidOptionError, match=fragment):
        chat_llm.create_chat_completion(ASKED, tools=tools, tool_choice=tool_choice, max_tokens=2)


def test_content_parts_a_template_cannot_take_are_its_refusal(chat_llm):
    # OpenAI's content parts, which the template concatenates: llama-cpp-python raises the template's
    # TypeError, ours an InvalidOptionError saying so (it named the native binding's signature)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with pytest.raises(InvalidOptionError, match="the chat template fails on these messages: TypeError: can only"):
        chat_llm.create_chat_completion(parts, max_tokens=2)
    assert chat_llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=2)["choices"]


def test_a_forced_tool_call_takes_no_other_constraint(chat_llm):
    with pytest.raises(InvalidOptionError, match="give no grammar, json_schema or response_format"):
        chat_llm.create_chat_completion(ASKED, tools=[WEATHER], tool_choice=FORCED, response_format={"type": "json_object"})


# -- from_pretrained --------------------------------------------------------------------------
def run_offline(code: str, hf_home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(hf_home)}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def run_unreachable(code: str, hf_home: Path) -> tuple[subprocess.CompletedProcess, float]:
    """code with the Hub out of reach (nothing listens at its endpoint) and HF_HUB_OFFLINE unset;
    its result and seconds taken."""
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(hf_home)}
    for name in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(name, None)
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    return r, time.monotonic() - start


def cache_demo_as_a_hub_repo(hf_home: Path) -> None:
    """The demo model as repo pyedgemoe-tests/demo in the Hub cache under hf_home (its layout:
    refs/main names the snapshot that holds the files)."""
    repo = hf_home / "hub" / "models--pyedgemoe-tests--demo"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "demo.gguf").symlink_to(DEMO)


def printing_its_load_error(call: str) -> str:
    """Python code that runs call (a Llama.from_pretrained) and prints the ModelLoadError it raises."""
    return f"from pyedgemoe import Llama, ModelLoadError\ntry:\n    {call}\nexcept ModelLoadError as e:\n" \
           "    print('ModelLoadError:', e)\n"


def test_from_pretrained_offline_of_an_uncached_repo_is_a_model_load_error(tmp_path):
    r = run_offline(printing_its_load_error("Llama.from_pretrained('pyedgemoe-tests/not-cached', "
                                            "filename='*q8_0.gguf')"), tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ModelLoadError: cannot get *q8_0.gguf from Hugging Face repo "
                               "'pyedgemoe-tests/not-cached' (offline, HF_HUB_OFFLINE=1 or --offline")
    assert "Traceback" not in r.stderr


def test_from_pretrained_offline_loads_a_cached_file_by_glob(tmp_path, eng):
    cache_demo_as_a_hub_repo(tmp_path)
    r = run_offline("from pyedgemoe import Llama\n"
                    "llm = Llama.from_pretrained('pyedgemoe-tests/demo', '*.gguf', n_ctx=64, verbose=False)\n"
                    "print(llm.model_path)\n"
                    "print(llm.tokenize(b'def f():'))\n", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    path, tokens = r.stdout.splitlines()
    assert Path(path).resolve() == DEMO.resolve()
    assert tokens == str(eng.tokenize("def f():"))


def test_from_pretrained_glob_must_match_one_file(tmp_path):
    cache_demo_as_a_hub_repo(tmp_path)
    r = run_offline(printing_its_load_error("Llama.from_pretrained('pyedgemoe-tests/demo', '*q4_K_M.gguf')"),
                    tmp_path)
    assert r.stdout.strip() == "ModelLoadError: no files of Hugging Face repo 'pyedgemoe-tests/demo' match " \
                               "'*q4_K_M.gguf'; its files: demo.gguf"


def test_from_pretrained_with_the_hub_out_of_reach_fails_at_once(tmp_path):
    # huggingface_hub itself retries an unreachable Hub for ~23 s before it gives up
    r, seconds = run_unreachable(printing_its_load_error("Llama.from_pretrained('pyedgemoe-tests/not-cached', "
                                                         "filename='demo.gguf')"), tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ModelLoadError: cannot get demo.gguf from Hugging Face repo "
                               "'pyedgemoe-tests/not-cached' (offline: cannot reach http://127.0.0.1:9")
    assert seconds < 10


def test_from_pretrained_with_the_hub_out_of_reach_loads_a_cached_file(tmp_path):
    cache_demo_as_a_hub_repo(tmp_path)
    r, _ = run_unreachable("from pyedgemoe import Llama\n"
                           "llm = Llama.from_pretrained('pyedgemoe-tests/demo', '*.gguf', n_ctx=64, verbose=False)\n"
                           "print(llm.model_path)\n", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert Path(r.stdout.strip()).resolve() == DEMO.resolve()
