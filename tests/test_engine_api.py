"""The Python API a user relies on: tokens round-trip, OpenAI-shaped results, streaming,
stop strings, context reuse, typed errors."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny_moe
from pyedgemoe import ContextOverflowError, Engine, EngineClosedError, InvalidOptionError, Llama, ModelLoadError

# <|endoftext|>, <|im_start|>, <|im_end|>: the end-of-generation tokens are among them
SPECIAL_IDS = set(range(len(tiny_moe.SPECIAL_TOKENS)))


@pytest.fixture(scope="module")
def eng(mixtral_gguf):
    with Engine(mixtral_gguf, n_ctx=256, n_threads=2, seed=1) as e:
        yield e


def test_tokenize_gives_the_checkpoints_ids_and_detokenize_round_trips(eng, tiny_model):
    from tokenizers import Tokenizer

    text = "hello world, this is a test"
    ids = eng.tokenize(text, add_bos=False)
    assert ids == Tokenizer.from_file(str(tiny_model("mixtral")[1] / "tokenizer.json")).encode(text).ids
    assert eng.detokenize(ids) == text


@pytest.mark.parametrize("call", ["detokenize", "token_piece", "eval", "generate", "logits"])
def test_a_token_id_outside_the_vocabulary_is_an_invalid_option(eng, call):
    ids = [1, eng.n_vocab]
    args = {"token_piece": (ids[1],), "generate": (ids, 2)}.get(call, (ids,))
    with pytest.raises(InvalidOptionError, match=rf"token id {eng.n_vocab} out of range \[0, {eng.n_vocab}\)"):
        getattr(eng, call)(*args)
    assert eng.generate([1], 2, temperature=0)  # and the engine goes on


@pytest.mark.parametrize("call", [
    lambda eng: eng.tokenize("a\ud800b"),
    lambda eng: eng.generate("a\ud800b", 2),
    lambda eng: eng.create_chat_completion([{"role": "user", "content": "a\udfff"}], max_tokens=2),
    lambda eng: eng.create_completion("hi", max_tokens=2, grammar='root ::= "\ud800"'),
    lambda eng: eng.create_completion("hi", max_tokens=2, json_schema='{"const": "\ud800"}'),
    lambda eng: eng.generate("hi", 2, stop=["a", "\ud800"]),  # it was taken, and never matched
], ids=["tokenize", "prompt", "chat", "grammar", "json_schema", "stop"])
def test_text_utf8_cannot_encode_is_an_invalid_option(eng, call):
    # a lone surrogate, which Python's and JSON's escapes can write (before: UnicodeEncodeError, or
    # a TypeError naming the native signature)
    with pytest.raises(InvalidOptionError, match="cannot be UTF-8: surrogates not allowed"):
        call(eng)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(n_threads=2**40), "n_threads must be a positive integer"),
    (dict(n_batch=None), "n_batch must be a positive integer"),
    (dict(n_parallel=None), "n_parallel must be a positive integer"),
    (dict(system=[]), "system must be a system's name"),
    (dict(flash_attn="off"), "flash_attn must be True, False or None"),  # it was on: a string is true
    (dict(io_threads=2**40), "io_threads must be an integer within 32 bits"),
    (dict(io_threads=100_000, expert_cache="25%"), r"io_threads must be an integer in 1\.\.256"),  # it hung
    (dict(policy_weights=-1), "policy weights must be four numbers"),
    (dict(low_from=-1), "low_from must be a file's path"),
    (dict(trace_routing="yes"), "trace_routing must be True or False"),  # it was taken as true
])
def test_load_arguments_of_the_wrong_type_are_invalid_options(mixtral_gguf, kwargs, fragment):
    # found by calling each with values of other types: TypeErrors (two naming a native signature)
    with pytest.raises(InvalidOptionError, match=fragment):
        Engine(mixtral_gguf, **kwargs)


@pytest.mark.parametrize("call, fragment", [
    (lambda eng: eng.tokenize(None), "text must be a string"),
    (lambda eng: eng.token_piece(None), r"a token must be token ids \(integers\), got \[None\]"),
    (lambda eng: eng.format_chat(None), "messages must be a list of messages"),
    # an outside probe's: bare TypeErrors, from json, numpy and the native signatures
    (lambda eng: eng.generate("hi", 2, json_schema=b'{"type": "object"}'), "json_schema must be a JSON schema"),
    (lambda eng: eng.generate("hi", 2, json_schema={"enum": [b"x"]}), "json_schema: not JSON"),
    (lambda eng: eng.generate("hi", 2, logit_bias={2**40: 1.0}), "logit_bias must map token ids to numbers"),
    (lambda eng: eng.generate("hi", 2, logit_bias={1: 10**400}), "logit_bias must map token ids to numbers"),
    (lambda eng: eng.generate("hi", 2, presence_penalty=10**400), "presence_penalty must be a finite number"),
    (lambda eng: eng.generate("hi", 2, logits_processor=[None]), "logits_processor must be callable"),
    (lambda eng: eng.generate("hi", 2, generation_prompt=5), "generation_prompt must be text"),
])
def test_methods_given_the_wrong_type_are_invalid_options(eng, call, fragment):
    with pytest.raises(InvalidOptionError, match=fragment):
        call(eng)


def test_numbers_of_numpy_and_truths_of_any_type_are_taken_as_llama_cpp_python_takes_them(eng, mixtral_gguf):
    # each refused with a bare TypeError (or an InvalidOptionError) where llama-cpp-python takes it
    ids = eng.tokenize("hello world", add_bos=False)
    assert eng.tokenize("hello world", add_bos=np.bool_(False), special=0) == ids
    assert eng.detokenize(ids, special=np.bool_(True)) == eng.detokenize(ids)
    assert eng.generate("hi", 3, presence_penalty=2**70, temperature=0)  # a huge penalty is a number too
    with Engine(mixtral_gguf, n_ctx=np.int64(256), n_threads=np.int32(2), seed=np.int64(1)) as other:
        assert (other.n_ctx, other.seed) == (256, 1) and type(other.seed) is int
        assert other.generate("hi", 3, temperature=0) == eng.generate("hi", 3, temperature=0)


@pytest.mark.parametrize("load", [Engine, Llama, lambda path: Llama(path, vocab_only=True)],
                         ids=["Engine", "Llama", "vocab_only"])
def test_a_model_that_is_no_path_is_a_model_load_error(load):
    with pytest.raises(ModelLoadError, match="the model must be a file's path, got None"):
        load(None)


def test_generate_stream_pieces_join_to_the_full_text(eng):
    full = eng.generate("hello", max_tokens=12, temperature=0)
    pieces = list(eng.generate("hello", max_tokens=12, temperature=0, stream=True))
    assert "".join(pieces) == full
    assert len(pieces) >= 2


def greedy_without_end_tokens(eng, prompt: str, n_tokens: int) -> list[int]:
    """The first n_tokens greedy tokens after prompt (time_generation ignores end-of-generation
    tokens); asserts none of them is a special token, so a generation of n_tokens ends by length."""
    tokens = eng.time_generation(eng.tokenize(prompt), n_tokens)["tokens"]
    assert not set(tokens) & SPECIAL_IDS, tokens
    return tokens


def test_create_completion_is_shaped_like_llama_cpp_python(eng):
    expected = greedy_without_end_tokens(eng, "hello", 6)
    eng.reset()
    out = eng.create_completion("hello", max_tokens=6, temperature=0)
    assert out["object"] == "text_completion"
    assert out["choices"] == [{"text": eng.detokenize(expected), "index": 0, "logprobs": None,
                               "finish_reason": "length"}]
    n_prompt = len(eng.tokenize("hello"))
    assert out["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 6, "total_tokens": n_prompt + 6,
                            "prompt_tokens_details": {"cached_tokens": 0}}  # OpenAI's: none held before
    again = eng.create_completion("hello", max_tokens=6, temperature=0)
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": n_prompt - 1}  # the last evaluated again
    for result, cached in ((out, 0), (again, n_prompt - 1)):  # and llama-server's timings
        timings = result["timings"]
        assert (timings["cache_n"], timings["prompt_n"], timings["predicted_n"]) == (cached, n_prompt - cached, 6)
        assert timings["predicted_per_second"] > 0 and timings["prompt_ms"] > 0


def test_create_completion_stream_chunks(eng):
    chunks = list(eng.create_completion("hello", max_tokens=6, temperature=0, stream=True))
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == eng.create_completion("hello", max_tokens=6, temperature=0)["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


def test_completion_ends_at_the_models_end_token_with_finish_reason_stop(eng):
    # a prompt whose greedy continuation (time_generation ignores end tokens) reaches the model's
    # EOS, <|im_end|>, after a few ordinary tokens
    eos = tiny_moe.SPECIAL_TOKENS.index(tiny_moe.EOS_TOKEN)
    for first in range(len(tiny_moe.SPECIAL_TOKENS), eng.n_vocab):
        greedy = eng.time_generation([first], 8)["tokens"]
        if eos in greedy[1:] and not set(greedy[:greedy.index(eos)]) & SPECIAL_IDS:
            break
    else:
        pytest.fail("no one-token prompt leads to EOS within 8 greedy tokens")
    n = greedy.index(eos)
    out = eng.create_completion([first], max_tokens=8, temperature=0)
    assert out["choices"][0]["text"] == eng.detokenize(greedy[:n])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == n


@pytest.mark.parametrize("n_parallel", [1, 2])
def test_return_progress_streams_the_prompts_evaluation_before_the_text(mixtral_gguf, n_parallel):
    """llama-server's return_progress: chunks with prompt_progress as the prompt's evaluation begins and
    after each llama_decode (n_batch tokens), then the chunks a stream without them gives."""
    messages = [{"role": "user", "content": " ".join(f"word{i}" for i in range(40))}]
    settings = dict(n_ctx=1024, n_batch=32, n_ubatch=32, n_threads=2, n_parallel=n_parallel)

    def chat(e, **kwargs) -> list[dict]:
        return list(e.create_chat_completion(messages, 8, stream=True, temperature=0, **kwargs))
    with Engine(mixtral_gguf, **settings) as e:
        first, again = chat(e, return_progress=True), chat(e, return_progress=True)
    with Engine(mixtral_gguf, **settings) as e:
        plain = chat(e)
    progress = [c["prompt_progress"] for c in first if "prompt_progress" in c]
    assert [("prompt_progress" in c) for c in first[:len(progress) + 1]] == [False] + [True] * len(progress)
    total = progress[0]["total"]
    assert total > 100 and {(p["total"], p["cache"]) for p in progress} == {(total, 0)}
    assert [p["processed"] for p in progress] == [*range(0, total, 32), total]
    assert [p["time_ms"] for p in progress] == sorted(p["time_ms"] for p in progress)
    assert [c["choices"] for c in first if "prompt_progress" not in c] == [c["choices"] for c in plain]
    # the same prompt again: all but its last token held
    assert [(p["total"], p["cache"], p["processed"]) for p in (c["prompt_progress"] for c in again
                                                               if "prompt_progress" in c)] == \
        [(total, total - 1, total - 1), (total, total - 1, total)]


def test_chat_completion_shape_and_stream(eng):
    messages = [{"role": "user", "content": "hi"}]
    out = eng.create_chat_completion(messages, max_tokens=5, temperature=0)
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant"
    chunks = list(eng.create_chat_completion(messages, max_tokens=5, temperature=0, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == out["choices"][0]["message"]["content"]


def test_chat_prompt_uses_the_models_template(eng):
    # tiny_moe.CHAT_TEMPLATE, rendered by hand, with the assistant's turn opened
    text = eng.format_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_stop_string_ends_generation_before_it(eng):
    full = eng.detokenize(greedy_without_end_tokens(eng, "hello", 20))
    stop = full[2:4]
    assert len(stop) == 2
    assert eng.generate("hello", max_tokens=20, temperature=0, stop=stop) == full[: full.index(stop)]
    out = eng.create_completion("hello", max_tokens=20, temperature=0, stop=stop)
    assert out["choices"][0]["text"] == full[: full.index(stop)]
    assert out["choices"][0]["finish_reason"] == "stop"


def test_second_prompt_reuses_the_common_prefix_and_matches_a_fresh_run(eng, mixtral_gguf):
    ids = eng.tokenize("one two three four five six", add_bos=False)
    eng.generate(ids, max_tokens=4, temperature=0)
    longer = ids + eng.tokenize(" seven eight", add_bos=False)
    reused = eng.generate(longer, max_tokens=8, temperature=0)
    assert eng.last_timings.n_cached_prompt_tokens == len(ids)
    with Engine(mixtral_gguf, n_ctx=256, n_threads=2) as fresh:
        assert fresh.generate(longer, max_tokens=8, temperature=0) == reused


def test_a_seeded_generation_reuses_no_prefix_and_repeats_itself(eng):
    # a reused prefix leaves the last prompt token to a batch of one, which AVX-512's kernels round
    # differently from the whole prompt's batch: a sampled token can change
    kwargs = dict(max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    first = eng.generate("one two three", **kwargs)
    assert eng.generate("one two three", **kwargs) == first
    assert eng.last_timings.n_cached_prompt_tokens == 0


def test_eval_then_sample_picks_the_next_token_after_those_held(eng):
    prompt = eng.tokenize("hello world")
    first, second = eng.time_generation(prompt, 2)["tokens"]
    eng.reset()
    eng.eval(prompt)
    assert eng.sample(temperature=0) == first
    eng.eval([first])
    assert eng.sample(temperature=0) == second
    assert eng.sample(temperature=0.8, seed=3) == eng.sample(temperature=0.8, seed=3)  # seeded: the same pick
    with pytest.raises(InvalidOptionError, match="top_k"):
        eng.sample(top_k=2**40)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temp'"):
        eng.sample(temp=0)


def test_logits_shape_and_dtype(eng):
    out = eng.logits([1, 2, 3])
    assert out.shape == (3, eng.n_vocab) and out.dtype == np.float32
    assert np.isfinite(out).all()


def test_a_text_prompts_special_tokens_are_parsed_as_llama_completion_and_llama_server_parse_them(tiny_model):
    # a chat template rendered by the caller and sent as text: /v1/completions took <|im_start|> as text
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with Engine(tiny_model("qwen3_moe")[0], n_ctx=128, n_threads=2) as eng:
        parsed = eng.tokenize(text, add_bos=True, special=True)
        assert len(parsed) < len(eng.tokenize(text, add_bos=True))
        out = eng.create_completion(text, max_tokens=4, temperature=0)
        assert out["usage"]["prompt_tokens"] == len(parsed)
        assert out["choices"][0]["text"] == eng.create_completion(parsed, max_tokens=4, temperature=0)["choices"][0]["text"]


def test_errors_are_typed(eng, tmp_path, mixtral_gguf):
    with pytest.raises(ModelLoadError):
        Engine(tmp_path / "missing.gguf")
    with pytest.raises(ContextOverflowError):
        eng.logits([1] * 300)
    with pytest.raises(ContextOverflowError):
        eng.generate([1] * 256, max_tokens=4)
    with pytest.raises(InvalidOptionError):
        eng.generate("x", top_p=-0.1)
    with pytest.raises(InvalidOptionError):
        Engine(mixtral_gguf, n_threads=0)
    with pytest.raises(ValueError):
        eng.logits([eng.n_vocab + 5])


def test_generation_stops_at_the_end_of_the_context(mixtral_gguf):
    prompt = [1, 2, 3, 4]
    with Engine(mixtral_gguf, n_ctx=32, n_threads=2) as small:
        n_ctx = small.n_ctx  # llama.cpp pads the context (to 256)
        # no end-of-generation token within the context: only its end stops the generation
        assert not set(small.time_generation(prompt, n_ctx - len(prompt))["tokens"]) & SPECIAL_IDS
        out = small.create_completion(prompt, max_tokens=None, temperature=0)
    assert {k: out["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == \
        {"prompt_tokens": 4, "completion_tokens": n_ctx - 4, "total_tokens": n_ctx}
    assert out["choices"][0]["finish_reason"] == "length"


def test_closed_engine_refuses_work_and_holds_no_model(mixtral_gguf, tmp_path):
    import shutil

    from test_expert_residency import _mapping_rss_bytes

    path = shutil.copyfile(mixtral_gguf, tmp_path / "model.gguf")  # a file no other test's Engine maps
    e = Engine(path, n_ctx=64, n_threads=2)
    assert _mapping_rss_bytes(path)[0] >= 1
    e.close()
    # the model is freed with the context, not when the Engine object goes: no mapping of its file left
    assert _mapping_rss_bytes(path) == (0, 0)
    with pytest.raises(EngineClosedError):
        e.logits([1])
    for use in (lambda: e.tokenize("hi"), lambda: e.detokenize([1]), lambda: e.token_piece(1), lambda: e.n_vocab,
                lambda: e.metadata, e.take_routing_trace):  # (an AttributeError was the routing trace's)
        with pytest.raises(EngineClosedError, match="this Engine is closed"):
            use()


def test_logits_the_memory_cannot_hold_are_refused_before_decoding_unless_reserved(mixtral_gguf, monkeypatch):
    """Engine.logits checks the rows it is asked for (memory_budget.check_logits_fit) against the
    memory available when called, here made too small for 64 tokens' logits; n_logits=64 counted
    them at load instead, so the same call returns them."""
    from pyedgemoe import memory_budget

    with Engine(mixtral_gguf, n_ctx=256, n_threads=2) as e:
        ids = e.tokenize("hello world " * 20, add_bos=False)[:64]
        need = memory_budget.logits_bytes(e.info.metadata, 64)
        monkeypatch.setattr(memory_budget, "available_memory", lambda: (need - 1, "for this test"))
        with pytest.raises(InvalidOptionError, match="not enough memory for the logits of 64 tokens.*n_logits=64"):
            e.logits(ids)
        assert e.logits(ids[:32]).shape == (32, e.n_vocab)  # half of them fit
    monkeypatch.undo()
    with Engine(mixtral_gguf, n_ctx=256, n_threads=2, n_logits=64) as e:
        monkeypatch.setattr(memory_budget, "available_memory", lambda: (0, "for this test"))
        assert e.logits(ids).shape == (64, e.n_vocab)


def test_an_auto_cache_leaves_room_for_the_predictors_stacked_routers(mixtral_gguf, monkeypatch):
    """--prefetch hobbit two or more layers ahead keeps F32 copies of the routers it stacks: an
    auto expert cache is smaller by exactly them (memory_budget.predictor_bytes)."""
    from pyedgemoe import memory_budget
    from pyedgemoe.load_plan import LoadOptions, context_memory_bytes
    from pyedgemoe.model_info import read_model_info

    info = read_model_info(mixtral_gguf)
    context = memory_budget.context_bytes(info.metadata, context_memory_bytes(info, LoadOptions(n_ctx=256)), 256, 512, None)
    available = (info.non_expert_bytes - info.cold_embedding_bytes  # the embedding's rows stay mapped
                 + context + memory_budget.RUN_ALLOWANCE_BYTES + info.high_expert_bytes // 2)
    monkeypatch.setattr(memory_budget, "available_memory", lambda: (available, "for this test"))
    budgets = {}
    for depth in (1, 3):
        with Engine(mixtral_gguf, n_ctx=256, n_threads=2, expert_cache="auto", prefetch="hobbit",
                    prefetch_depth=depth) as e:
            budgets[depth] = e.expert_residency["budget_bytes"]
    assert budgets[1] == info.high_expert_bytes // 2
    assert budgets[1] - budgets[3] == memory_budget.predictor_bytes(info.metadata, 3) > 0



def test_a_saved_state_loads_into_its_model_and_not_into_another_of_the_same_shapes(eng, tiny_model):
    # the dense llama and mixtral share the KV cache's shapes: llama.cpp's sequence state loaded, and
    # the other model went on from a cache it never wrote (garbage)
    eng.generate("hello world, this", 2, temperature=0)
    state = eng.save_state()
    expected = eng.generate("hello world, this", 4, temperature=0)
    with Engine(tiny_model("llama")[0], n_ctx=256, n_threads=2) as other:
        with pytest.raises(InvalidOptionError, match=r"load_state: the state is of another model \(llama, "):
            other.load_state(state)
    eng.load_state(state)
    assert eng.generate("hello world, this", 4, temperature=0) == expected


def test_a_state_whose_tokens_are_not_those_of_its_kv_cache_is_refused(eng):
    """A SequenceState made by hand: tokens the KV cache does not hold loaded, and the next decode failed
    on llama.cpp's internal check (a bare RuntimeError) or went on from garbage; out of the vocabulary too."""
    import dataclasses

    eng.generate("hello world, this", 2, temperature=0)
    state = eng.save_state()
    for bad, fragment in [(dict(tokens=None), "the state's tokens must be token ids"),
                          (dict(kv="x"), "the state's kv must be bytes")]:
        with pytest.raises(InvalidOptionError, match=fragment):
            eng.load_state(dataclasses.replace(state, **bad))
        assert eng.tokens == list(state.tokens)  # refused before its sequence let go of what it held
    for tokens in [state.tokens[:-1], state.tokens[:-1] + (eng.n_vocab,), state.tokens + (1,)]:
        with pytest.raises(InvalidOptionError, match=f"does not hold its {len(tokens)} tokens.*holds nothing now"):
            eng.load_state(dataclasses.replace(state, tokens=tokens))
        assert eng.tokens == []
    eng.load_state(state)
    assert eng.tokens == list(state.tokens)


def test_an_engine_is_not_pickled_and_says_so(eng):
    import pickle

    with pytest.raises(TypeError, match="an Engine cannot be pickled"):
        pickle.dumps(eng)
