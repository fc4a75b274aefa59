"""The Python API a user relies on: tokens round-trip, OpenAI-shaped results, streaming,
stop strings, context reuse, typed errors."""
from __future__ import annotations

import numpy as np
import pytest

from pyedgemoe import ContextOverflowError, Engine, InvalidOptionError, ModelLoadError


@pytest.fixture(scope="module")
def eng(mixtral_gguf):
    with Engine(mixtral_gguf, n_ctx=256, n_threads=2, seed=1) as e:
        yield e


def test_tokenize_detokenize_round_trip(eng):
    text = "hello world, this is a test"
    ids = eng.tokenize(text, add_bos=False)
    assert ids and all(0 <= t < eng.n_vocab for t in ids)
    assert eng.detokenize(ids) == text


def test_generate_stream_pieces_join_to_the_full_text(eng):
    full = eng.generate("hello", max_tokens=12, temperature=0)
    pieces = list(eng.generate("hello", max_tokens=12, temperature=0, stream=True))
    assert "".join(pieces) == full
    assert len(pieces) >= 2


def test_create_completion_is_shaped_like_llama_cpp_python(eng):
    out = eng.create_completion("hello", max_tokens=6, temperature=0)
    assert out["object"] == "text_completion"
    choice = out["choices"][0]
    assert set(choice) == {"text", "index", "logprobs", "finish_reason"}
    assert choice["finish_reason"] in ("stop", "length")
    usage = out["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] <= 6


def test_create_completion_stream_chunks(eng):
    chunks = list(eng.create_completion("hello", max_tokens=6, temperature=0, stream=True))
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == eng.create_completion("hello", max_tokens=6, temperature=0)["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


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
    text = eng.format_chat([{"role": "user", "content": "hi"}])
    assert "hi" in text and "<|im_start|>" in text


def test_stop_string_ends_generation_before_it(eng):
    full = eng.generate("hello", max_tokens=20, temperature=0)
    if len(full) < 4:
        pytest.skip("generation too short to pick a stop string")
    stop = full[2:4]
    cut = eng.generate("hello", max_tokens=20, temperature=0, stop=stop)
    assert cut == full[: full.index(stop)]


def test_second_prompt_reuses_the_common_prefix_and_matches_a_fresh_run(eng, mixtral_gguf):
    ids = eng.tokenize("one two three four five six", add_bos=False)
    eng.generate(ids, max_tokens=4, temperature=0)
    longer = ids + eng.tokenize(" seven eight", add_bos=False)
    reused = eng.generate(longer, max_tokens=8, temperature=0)
    assert eng.last_timings.n_cached_prompt_tokens == len(ids)
    with Engine(mixtral_gguf, n_ctx=256, n_threads=2) as fresh:
        assert fresh.generate(longer, max_tokens=8, temperature=0) == reused


def test_logits_shape_and_dtype(eng):
    out = eng.logits([1, 2, 3])
    assert out.shape == (3, eng.n_vocab) and out.dtype == np.float32
    assert np.isfinite(out).all()


def test_errors_are_typed(eng, tmp_path, mixtral_gguf):
    with pytest.raises(ModelLoadError):
        Engine(tmp_path / "missing.gguf")
    with pytest.raises(ContextOverflowError):
        eng.logits([1] * 300)
    with pytest.raises(ContextOverflowError):
        eng.generate([1] * 256, max_tokens=4)
    with pytest.raises(InvalidOptionError):
        eng.generate("x", top_p=0.0)
    with pytest.raises(InvalidOptionError):
        Engine(mixtral_gguf, n_threads=0)
    with pytest.raises(ValueError):
        eng.logits([eng.n_vocab + 5])


def test_generation_stops_at_the_end_of_the_context(mixtral_gguf):
    with Engine(mixtral_gguf, n_ctx=32, n_threads=2) as small:
        out = small.create_completion([1, 2, 3, 4], max_tokens=None, temperature=0)
        n_ctx = small.n_ctx
    assert out["usage"]["total_tokens"] <= n_ctx
    assert out["choices"][0]["finish_reason"] in ("stop", "length")


def test_closed_engine_refuses_work(mixtral_gguf):
    e = Engine(mixtral_gguf, n_ctx=64, n_threads=2)
    e.close()
    with pytest.raises(RuntimeError):
        e.logits([1])
