"""Embeddings with a pooling type (llama.cpp's --pooling, llama-cpp-python's pooling_type), on the
tiny Qwen3-MoE: the same vectors as stock llama-cpp-python's with the same arguments, the same
through an expert cache and beside another sequence's generation (n_parallel), llama.cpp's
normalizations, and `pyedgemoe embed` printing what llama-embedding prints."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest

from pyedgemoe import Engine, InvalidOptionError, Llama
from pyedgemoe.cli_embed import cosine
from pyedgemoe.embeddings import normalized
from pyedgemoe.generation import SamplingParams

TEXT = "Building a website can be done in ten simple steps"
SMALL = {"n_ctx": 256, "n_threads": 1, "verbose": False}


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen3_moe")[0])


@pytest.mark.parametrize("pooling_type", [1, 2, 3])  # mean, cls, last
def test_a_pooled_vector_is_stock_llama_cpp_pythons(model, pooling_type):
    llama_cpp = pytest.importorskip("llama_cpp")
    theirs = llama_cpp.Llama(model_path=model, embedding=True, pooling_type=pooling_type, **SMALL)
    try:
        with Llama(model_path=model, embedding=True, pooling_type=pooling_type, **SMALL) as ours:
            assert ours.pooling_type() == theirs.pooling_type() == pooling_type
            for normalize in (False, True):
                vector, expected = ours.embed(TEXT, normalize=normalize), theirs.embed(TEXT, normalize=normalize)
                assert np.asarray(vector).shape == (ours.n_embd(),)
                np.testing.assert_allclose(vector, expected, rtol=0, atol=1e-6)
            out = ours.create_embedding([TEXT, "x"])
            assert [len(d["embedding"]) for d in out["data"]] == [ours.n_embd()] * 2
            assert out["usage"]["prompt_tokens"] == len(ours.tokenize(TEXT.encode())) + len(ours.tokenize(b"x"))
    finally:
        theirs.close()


def test_the_poolings_differ_and_none_is_a_row_per_token(model):
    vectors = {}
    for pooling in ("none", "mean", "cls", "last"):
        with Engine(model, pooling=pooling, **SMALL) as eng:
            vectors[pooling] = eng.embed(TEXT)
            n_tokens = len(eng.tokenize(TEXT, add_bos=True))
    rows = vectors["none"]
    assert rows.shape == (n_tokens, vectors["mean"].shape[0])  # a row per token
    np.testing.assert_allclose(vectors["mean"], rows.mean(axis=0), atol=1e-5)
    np.testing.assert_array_equal(vectors["cls"], rows[0])
    np.testing.assert_array_equal(vectors["last"], rows[-1])


def test_pooled_embeddings_are_lossless_through_an_expert_cache_and_beside_a_generation(model):
    with Engine(model, pooling="mean", **SMALL) as eng:
        expected = eng.embed(TEXT)
    with Engine(model, pooling="mean", expert_cache="25%", **SMALL) as eng:
        np.testing.assert_array_equal(eng.embed(TEXT), expected)
    with Engine(model, pooling="mean", n_parallel=2, **{**SMALL, "n_ctx": 512}) as eng:
        greedy, prompt = SamplingParams(temperature=0.0), eng.tokenize("Once upon a time", add_bos=True)
        alone = list(eng.generate_tokens(prompt, 160, greedy))
        tokens, started = [], threading.Event()

        def generate():
            for t in eng.generate_tokens(prompt, 160, greedy):
                tokens.append(t)
                started.set()
        thread = threading.Thread(target=generate)
        thread.start()
        started.wait(30)
        vectors = [eng.embed(TEXT) for _ in range(3)]  # on the free sequence, while the other generates
        thread.join(60)
        assert tokens == alone
        for v in vectors:
            np.testing.assert_array_equal(v, expected)


def test_a_pooled_text_is_one_pass_of_the_model(model):
    with Engine(model, pooling="last", n_batch=64, n_ubatch=16, **SMALL) as eng:
        ids = eng.tokenize(TEXT * 3, add_bos=True)
        assert len(ids) > 16
        with pytest.raises(InvalidOptionError, match="n_ubatch 16"):
            eng.embed(ids, truncate=False)
        np.testing.assert_array_equal(eng.embed(ids), eng.embed(ids[:16]))
    with Engine(model, n_batch=64, n_ubatch=16, **SMALL) as eng:  # a row per token: a batch's worth
        assert eng.embed(ids[:64]).shape[0] == 64
    # a context smaller than the pass: its bound, named (llama-cpp-python truncates to min(n_ctx, n_batch))
    with Engine(model, pooling="mean", **{**SMALL, "n_ctx": 32}) as eng:
        long = eng.tokenize(TEXT * 20, add_bos=True)
        assert len(long) > 32
        with pytest.raises(InvalidOptionError, match=rf"{len(long)} tokens exceed the batch of 32 tokens \(n_batch, at "
                           r"most the n_ctx asked\): .* or raise n_ctx\)"):
            eng.embed(long, truncate=False)
        np.testing.assert_array_equal(eng.embed(long), eng.embed(long[:32]))


def test_a_pass_capped_by_the_expert_cache_names_it(tiny_model):
    """A model with expert biases (GPT-OSS) runs ubatches whose experts the cache holds at once: a
    pooled text is bounded by that, and -ub cannot raise it."""
    with Engine(tiny_model("gpt_oss")[0], pooling="mean", expert_cache="25%", n_ubatch=512, **SMALL) as eng:
        cap = eng.stats()["experts"]["max_ubatch_tokens"]
        assert 0 < cap == eng.n_ubatch < 16
        assert f"ubatches of {cap} tokens (with expert biases" in eng.expert_cache_note
        with pytest.raises(InvalidOptionError, match=rf"exceed the {cap} tokens whose experts the expert cache holds at "
                           r"once \(expert_cache; .*or raise expert_cache\)"):
            eng.embed(TEXT, truncate=False)


def test_pooling_values_that_are_refused(model):
    with pytest.raises(InvalidOptionError, match="reranking"):
        Engine(model, pooling="rank", **SMALL)
    with pytest.raises(InvalidOptionError, match="none, mean, cls, last"):
        Engine(model, pooling="average", **SMALL)
    with pytest.raises(InvalidOptionError, match="reranking"):
        Llama(model_path=model, embedding=True, pooling_type=4, **SMALL)
    with pytest.raises(InvalidOptionError, match="pooling_type"):
        Llama(model_path=model, embedding=True, pooling_type=9, **SMALL)


def test_normalizations_are_llama_cpps():
    rows = np.array([[3.0, -4.0, 0.0], [0.0, 0.0, 0.0], [1.0, 2.0, -2.0]], dtype=np.float32)
    np.testing.assert_array_equal(normalized(rows, -1), rows)
    np.testing.assert_allclose(normalized(rows, 2)[0], [0.6, -0.8, 0.0])
    np.testing.assert_allclose(normalized(rows, 1)[2], [0.2, 0.4, -0.4])
    np.testing.assert_allclose(normalized(rows, 0)[0], [3 * 32760 / 4, -32760, 0])  # int16's range
    np.testing.assert_allclose(normalized(rows, 3)[2], rows[2] / 17 ** (1 / 3), rtol=1e-6)
    np.testing.assert_array_equal(normalized(rows, 2)[1], [0, 0, 0])  # a zero vector stays zero
    assert normalized(rows, 2).dtype == np.float32
    with pytest.raises(InvalidOptionError):
        normalized(rows, -2)


def _embed_cli(model, *args, check=True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "pyedgemoe", "embed", model, "-t", "1", *args],
                         capture_output=True, timeout=300)
    assert not check or out.returncode == 0, out.stderr.decode()
    return out


def test_the_embed_command_prints_llama_embeddings_json_and_table(model):
    texts = ["hello world", "x", "another line é"]
    with Engine(model, pooling="mean", **SMALL) as eng:
        expected = normalized(np.stack([eng.embed(eng.tokenize(t, add_bos=True, special=True)) for t in texts]), 2)
    out = json.loads(_embed_cli(model, "-p", r"hello world\nx\nanother line é", "--pooling", "mean",
                                "--embd-output-format", "json+").stdout)
    assert out["object"] == "list" and [d["index"] for d in out["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["embedding"] for d in out["data"]], expected, atol=1e-7)  # printed as %1.7f
    assert out["cosineSimilarity"][0][1] == round(cosine(expected[0], expected[1]), 2)
    assert [row[i] for i, row in enumerate(out["cosineSimilarity"])] == [1.0] * 3
    table = _embed_cli(model, "-p", r"hello world\nx\nanother line é", "--pooling", "mean").stdout.decode()
    lines = table.splitlines()
    assert lines[1] == "embedding 0: " + "".join(f"{v:9.6f} " for v in expected[0][:16])
    assert "cosine similarity matrix:" in lines and lines[-2].endswith("another li")  # a text's first 10 bytes
    unpooled = _embed_cli(model, "-p", "hello", "--embd-output-format", "array", "--embd-normalize", "-1").stdout
    with Engine(model, **SMALL) as eng:
        rows = eng.embed(eng.tokenize("hello", add_bos=True, special=True))
    np.testing.assert_allclose(json.loads(unpooled), rows, atol=1e-7)  # a row per token, as given


def test_a_blank_line_is_a_vector_of_zeros_as_llama_embedding_gives(model, tmp_path):
    """A blank line in -f refused all of the texts ("embed needs at least one token"). (Qwen3 puts no
    BOS first: its empty text has no token.)"""
    file = tmp_path / "texts.txt"
    file.write_text("line one\n\nline three")
    out = json.loads(_embed_cli(model, "-f", str(file), "--pooling", "mean", "--embd-output-format", "json+").stdout)
    vectors = [d["embedding"] for d in out["data"]]
    assert len(vectors) == 3 and not any(vectors[1]) and all(any(v) for v in (vectors[0], vectors[2]))
    assert [row[1] for row in out["cosineSimilarity"]] == [0.0, 1.0, 0.0]  # llama-embedding's 1.00 with itself


@pytest.mark.parametrize("args, message", [
    ([], "-p or -f"),
    (["-p", "x", "--embd-output-format", "yaml"], "--embd-output-format"),
    (["-p", "x", "--pooling", "rank"], "reranking"),
    (["-p", "word " * 80, "--pooling", "mean", "-ub", "32"], "exceed -ub 32: embed evaluates a text in one pass "
                                                             "(raise -ub)"),
    (["-p", "x", "--embd-normalize", "-3"], "--embd-normalize"),
])
def test_the_embed_command_refuses_in_one_line(model, args, message):
    out = _embed_cli(model, *args, check=False)
    err = out.stderr.decode().strip().splitlines()
    assert out.returncode != 0 and out.stdout == b""
    assert err[-1].startswith("error:") and message in err[-1], err
    assert "Traceback" not in out.stderr.decode()
