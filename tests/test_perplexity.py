"""Perplexity is llama.cpp's llama-perplexity method: the same number as a plain numpy
implementation of that method over stock llama-cpp-python's logits, unchanged by expert
offloading, and clear errors for a text too short or a bad context size.

The method (tools/perplexity/perplexity.cpp, perplexity()): tokenize with BOS if the model adds
one; chunks of n_ctx tokens, the first token of each replaced by BOS when the model adds BOS;
score the tokens at n_ctx/2 + 1 .. n_ctx-1 of each chunk; ppl = exp(mean nll).
"""
from __future__ import annotations

import json
import math
import shutil

import gguf
import llama_cpp
import numpy as np
import pytest

from conftest import tiny_moe
from pyedgemoe import ContextOverflowError, Engine, InvalidOptionError
from pyedgemoe.errors import TextTooShortError
from pyedgemoe.perplexity import perplexity, text_tokens
from test_cli import assert_one_line_error, cli
from test_expert_residency import minimum_budget

TEXT = " ".join(tiny_moe.training_text(seed=7, n_sentences=120))  # 3565 tokens with the tiny tokenizer
N_CTX = 64
N_CHUNKS = 3
# as in test_logits_match_references: both engines without flash attention and with an F32 KV cache
SAME_SETTINGS = dict(n_ctx=256, n_threads=2, flash_attn=False, kv_type="f32")


def with_bos_added(path, tmp_path):
    """A copy of the GGUF whose tokenizer adds BOS (tokenizer.ggml.add_bos_token = true)."""
    copy = tmp_path / f"bos-{path.name}"
    shutil.copyfile(path, copy)
    field = gguf.GGUFReader(copy, "r+").fields["tokenizer.ggml.add_bos_token"]
    field.parts[field.data[0]][0] = True
    return copy


def reference_perplexity(path, text: str, n_ctx: int, n_chunks: int) -> tuple[float, float, int]:
    """(ppl, stderr, tokens in the text) of llama.cpp's method, in numpy over stock
    llama-cpp-python's logits."""
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, n_threads=2, n_threads_batch=2,
                          flash_attn=False, type_k=f32, type_v=f32, verbose=False)
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    first = n_ctx // 2
    nll = []
    for i in range(n_chunks):
        chunk = tokens[i * n_ctx:(i + 1) * n_ctx]
        if llm._model.add_bos_token():
            chunk = [llm.token_bos()] + chunk[1:]
        llm.reset()
        llm.eval(chunk)
        logits = np.array(llm.scores[:n_ctx], dtype=np.float64)
        for pos in range(first, n_ctx - 1):
            row = logits[pos]
            log_sum_exp = row.max() + np.log(np.exp(row - row.max()).sum())
            nll.append(log_sum_exp - row[chunk[pos + 1]])
    llm.close()
    nll = np.array(nll)
    ppl = math.exp(nll.mean())
    return ppl, ppl * math.sqrt(nll.var() / (len(nll) - 1)), len(tokens)


@pytest.fixture(scope="module")
def olmoe(tiny_model):
    return tiny_model("olmoe")[0]


@pytest.mark.parametrize("arch", ["mixtral", "olmoe", "qwen2_moe"])
def test_ppl_equals_a_numpy_reference_on_stock_llama_cpp_logits(tiny_model, arch):
    path, _ = tiny_model(arch)
    with Engine(path, **SAME_SETTINGS) as eng:
        ours = perplexity(eng, TEXT, n_ctx=N_CTX, n_chunks=N_CHUNKS)
    ppl, stderr, n_tokens = reference_perplexity(path, TEXT, N_CTX, N_CHUNKS)
    assert ours.n_tokens == n_tokens
    assert ours.n_chunks == N_CHUNKS
    assert ours.n_tokens_scored == N_CHUNKS * (N_CTX - 1 - N_CTX // 2) == len(ours.nll)
    assert ours.ppl == pytest.approx(ppl, rel=1e-5)
    assert ours.stderr == pytest.approx(stderr, rel=1e-5)


def test_ppl_with_bos_added_equals_the_reference(tiny_model, tmp_path):
    path = with_bos_added(tiny_model("mixtral")[0], tmp_path)
    with Engine(path, **SAME_SETTINGS) as eng:
        ours = perplexity(eng, TEXT, n_ctx=N_CTX, n_chunks=N_CHUNKS)
    ppl, _, n_tokens = reference_perplexity(path, TEXT, N_CTX, N_CHUNKS)
    assert ours.n_tokens == n_tokens
    assert ours.ppl == pytest.approx(ppl, rel=1e-5)


def test_each_chunk_starts_with_bos_when_the_model_adds_one(tiny_model, tmp_path, monkeypatch):
    path = with_bos_added(tiny_model("mixtral")[0], tmp_path)
    with Engine(path, **SAME_SETTINGS) as eng:
        tokens = eng.tokenize(TEXT)
        bos = tokens[0]
        evaluated = []
        logits = eng.logits
        monkeypatch.setattr(eng, "logits", lambda ids, **kw: evaluated.append(list(ids)) or logits(ids, **kw))
        perplexity(eng, tokens, n_ctx=N_CTX, n_chunks=N_CHUNKS)
    assert evaluated == [[bos] + tokens[i * N_CTX + 1:(i + 1) * N_CTX] for i in range(N_CHUNKS)]


def test_chunks_are_all_whole_chunks_of_the_text_by_default(olmoe):
    with Engine(olmoe, n_ctx=256, n_threads=2) as eng:
        tokens = eng.tokenize(TEXT)[:5 * N_CTX + N_CTX // 3]
        result = perplexity(eng, tokens, n_ctx=N_CTX)
    assert result.n_chunks == 5
    assert len(result.running_ppl) == len(result.chunk_nll) == 5
    assert result.running_ppl[-1] == result.ppl == pytest.approx(math.exp(result.nll.mean()), rel=1e-12)
    assert result.chunk_nll[0] == pytest.approx(result.nll[:N_CTX - 1 - N_CTX // 2].mean(), rel=1e-12)


@pytest.mark.parametrize("budget", ["50%", "minimum"])
def test_offloaded_experts_give_exactly_the_resident_ppl(olmoe, budget):
    cache = minimum_budget(olmoe) if budget == "minimum" else budget
    with Engine(olmoe, **SAME_SETTINGS, expert_cache=cache) as eng:
        offloaded = perplexity(eng, TEXT, n_ctx=N_CTX, n_chunks=N_CHUNKS)
        misses = eng.stats()["experts"]["total"]["misses"]
        n_ubatch = eng.n_ubatch
    # the resident run with the same ubatch size runs exactly the same kernels
    with Engine(olmoe, **SAME_SETTINGS, n_batch=n_ubatch) as eng:
        resident = perplexity(eng, TEXT, n_ctx=N_CTX, n_chunks=N_CHUNKS)
    assert misses > 0
    assert np.array_equal(offloaded.nll, resident.nll)
    assert offloaded.ppl == resident.ppl


def test_text_shorter_than_two_chunks_is_refused_with_the_counts(olmoe):
    with Engine(olmoe, n_ctx=256, n_threads=2) as eng:
        tokens = eng.tokenize(TEXT)
        assert perplexity(eng, tokens[:2 * N_CTX], n_ctx=N_CTX).n_chunks == 2
        with pytest.raises(TextTooShortError, match=f"at least {2 * N_CTX} tokens.* only {2 * N_CTX - 1}"):
            perplexity(eng, tokens[:2 * N_CTX - 1], n_ctx=N_CTX)


def test_n_ctx_beyond_the_engines_context_is_refused(olmoe):
    with Engine(olmoe, n_ctx=256, n_threads=2) as eng:
        with pytest.raises(ContextOverflowError, match="512.*256"):
            perplexity(eng, TEXT, n_ctx=512)


@pytest.mark.parametrize("n_ctx, n_chunks", [(2, None), (0, None), (64, 0), (64, -1)])
def test_bad_n_ctx_or_n_chunks_is_refused(olmoe, n_ctx, n_chunks):
    with Engine(olmoe, n_ctx=256, n_threads=2) as eng:
        with pytest.raises(InvalidOptionError):
            perplexity(eng, TEXT, n_ctx=n_ctx, n_chunks=n_chunks)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "text.txt"
    path.write_text(TEXT)
    return path


def test_cli_prints_running_ppl_then_the_estimate(olmoe, text_file):
    r = cli("perplexity", olmoe, "-f", text_file, "--ctx", N_CTX, "--chunks", N_CHUNKS, "-t", 2)
    assert r.returncode == 0, r.stderr
    with Engine(olmoe, n_ctx=N_CTX, n_threads=2) as eng:
        api = perplexity(eng, TEXT, n_ctx=N_CTX, n_chunks=N_CHUNKS)
    # llama-perplexity's layout: "[1]ppl,[2]ppl,..." as the chunks finish, then the estimate
    running = "".join(f"[{i + 1}]{ppl:.4f}," for i, ppl in enumerate(api.running_ppl))
    assert r.stdout == f"{running}\nppl = {api.ppl:.4f} +/- {api.stderr:.5f}\n"


def test_cli_json_matches_the_api(olmoe, text_file):
    r = cli("perplexity", olmoe, "-f", text_file, "--ctx", N_CTX, "--chunks", N_CHUNKS, "-t", 2,
            "--expert-cache", "50%", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    with Engine(olmoe, n_ctx=N_CTX, n_threads=2, expert_cache="50%") as eng:
        api = perplexity(eng, TEXT, n_ctx=N_CTX, n_chunks=N_CHUNKS)
    assert out["ppl"] == pytest.approx(api.ppl, rel=1e-12)
    assert out["stderr"] == pytest.approx(api.stderr, rel=1e-9)
    assert (out["n_ctx"], out["n_chunks"], out["n_tokens_scored"]) == (N_CTX, N_CHUNKS, api.n_tokens_scored)
    assert len(out["running_ppl"]) == N_CHUNKS and out["seconds"] > 0
    assert out["stats"]["experts"]["total"]["misses"] > 0


def test_cli_text_too_short_is_one_error_line(olmoe, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("only a few words")
    r = cli("perplexity", olmoe, "-f", short, "--ctx", N_CTX)
    assert r.returncode == 1
    assert_one_line_error(r, f"at least {2 * N_CTX} tokens", "only")


@pytest.mark.parametrize("args, fragment", [
    (("--ctx", "2"), "--ctx"),
    (("--ctx", "-5"), "--ctx"),
    (("--chunks", "0"), "--chunks"),
    (("--io", "magic"), "io"),
])
def test_cli_bad_values_are_one_error_line(olmoe, text_file, args, fragment):
    r = cli("perplexity", olmoe, "-f", text_file, *args)
    assert r.returncode == 1
    assert_one_line_error(r, fragment)


def test_cli_missing_text_file_is_one_error_line(olmoe, tmp_path):
    r = cli("perplexity", olmoe, "-f", tmp_path / "nope.txt")
    assert r.returncode == 1
    assert_one_line_error(r, "cannot read")


@pytest.mark.parametrize("args, fragment", [
    (("--ctx", "abc"), "--ctx"),
    (("--bogus",), "--bogus"),
])
def test_cli_usage_errors_exit_2(olmoe, text_file, args, fragment):
    r = cli("perplexity", olmoe, "-f", text_file, *args)
    assert r.returncode == 2
    assert_one_line_error(r, fragment)


def test_cli_reads_its_file_as_llama_perplexity(olmoe, tmp_path):
    """llama-perplexity's -f: one trailing line break dropped, escapes kept (it turns llama.cpp's -e
    off; they were processed by default, a number stock's differs from on any text with a backslash)."""
    words = TEXT.split(" ")
    escaped = " ".join(w + (r"\n" if i % 7 == 0 else "") for i, w in enumerate(words))
    path = tmp_path / "escaped.txt"
    path.write_text(escaped + "\n")
    with Engine(olmoe, n_ctx=N_CTX, n_threads=2) as eng:
        as_read = perplexity(eng, escaped.replace(r"\n", "\n"), n_ctx=N_CTX, n_chunks=N_CHUNKS)
        verbatim = perplexity(eng, escaped, n_ctx=N_CTX, n_chunks=N_CHUNKS)
    kept, out = (json.loads(cli("perplexity", olmoe, "-f", path, "--ctx", N_CTX, "--chunks", N_CHUNKS, "-t", 2,
                                "--json", *flags).stdout) for flags in ([], ["-e"]))
    assert kept["ppl"] == pytest.approx(verbatim.ppl, rel=1e-12)
    assert out["ppl"] == pytest.approx(as_read.ppl, rel=1e-12) != verbatim.ppl


def test_only_the_text_the_chunks_need_is_tokenized(olmoe):
    """The CLI's --chunks N of a corpus of 50 MB tokenized it whole first (3 GB, 40 s)."""
    with Engine(olmoe, n_ctx=N_CTX, n_threads=2) as eng:
        whole = eng.tokenize(TEXT)
        assert text_tokens(eng, TEXT, N_CTX, 1) == whole[:2 * N_CTX]  # two chunks at least: llama.cpp's rule
        assert text_tokens(eng, TEXT, N_CTX, 5) == whole[:5 * N_CTX] and text_tokens(eng, TEXT) == whole


@pytest.mark.parametrize("how", ["file", "override"])
def test_a_model_that_appends_eos_is_refused_as_llama_perplexity_asserts(olmoe, tmp_path, how):
    """--override-kv tokenizer.ggml.add_eos_token=bool:true got round the refusal (the file's header was read)."""
    from conftest import rewrite_gguf
    model = rewrite_gguf(olmoe, tmp_path / "eos.gguf", keys={"tokenizer.ggml.add_eos_token": True}) \
        if how == "file" else olmoe
    options = ["--override-kv", "tokenizer.ggml.add_eos_token=bool:true"] if how == "override" else []
    (tmp_path / "text.txt").write_text(TEXT)
    r = cli("perplexity", model, "-f", tmp_path / "text.txt", "--ctx", N_CTX, *options)
    assert r.returncode == 1
    assert_one_line_error(r, "this model appends EOS to tokenized text")
