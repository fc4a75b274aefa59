"""`pyedgemoe perplexity --kl-divergence-base FNAME [--kl-divergence]`, llama-perplexity's: a base
of a run's token probabilities in llama.cpp's file format, and the KL divergence, the probability
change and the top-token agreement of another run from it. Checked against a numpy reference of the
same formulas, on the demo model: the same run gives no divergence, mixed precision a measured one."""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyedgemoe import Engine, InvalidOptionError
from pyedgemoe.kl_divergence import Base, BaseWriter, compare, compress, expand, summary
from pyedgemoe.output_files import whole_file
from pyedgemoe.perplexity import perplexity

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo.gguf"
N_CTX, N_CHUNKS = 64, 4  # 124 scored positions: llama.cpp prints statistics from 100


@pytest.fixture(scope="module")
def text() -> str:
    return (ROOT / "README.md").read_text() + (ROOT / "docs" / "perplexity.md").read_text()


@pytest.fixture(scope="module")
def demo_high(tmp_path_factory) -> Path:
    from pyedgemoe.convert.export import export

    return export(DEMO, tmp_path_factory.mktemp("kld") / "demo-high.gguf", precision="high", progress=False)


@pytest.fixture(scope="module")
def base(demo_high, text, tmp_path_factory) -> tuple[Path, float]:
    """The base of the demo's HIGH precision, every expert resident, and its perplexity."""
    path = tmp_path_factory.mktemp("kld") / "base.kld"
    with Engine(demo_high, n_ctx=N_CTX, n_logits=N_CTX, n_threads=1) as eng:
        tokens = eng.tokenize(text, add_bos=True)
        with whole_file(path) as f:
            result = perplexity(eng, tokens, n_ctx=N_CTX, n_chunks=N_CHUNKS,
                                on_logits=BaseWriter(f, path, tokens, N_CTX, N_CHUNKS))
    return path, result.ppl


def test_compressed_rows_are_log_probabilities_within_a_step():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((5, 1001)) * 4).astype(np.float32)
    log_p = logits - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    rows = compress(logits)
    assert rows.shape == (5, 2 * 501 + 4) and rows.dtype == np.uint16
    back = expand(rows, 1001)
    step = (logits.max(axis=1) - np.maximum(logits.min(axis=1), logits.max(axis=1) - 16)) / 65535
    kept = log_p > log_p.max(axis=1, keepdims=True) - 16
    assert np.all(np.abs(back - log_p)[kept] <= (step[:, None] / 2 + 1e-5).repeat(1001, axis=1)[kept])


def test_a_base_is_llama_cpps_file(base, demo_high):
    path, _ = base
    data = path.read_bytes()
    with Engine(demo_high, n_ctx=N_CTX, n_threads=1) as eng:
        n_vocab = eng.n_vocab
    assert data[:8] == b"_logits_" and struct.unpack("<Iii", data[8:20]) == (N_CTX, n_vocab, N_CHUNKS)
    rows = N_CTX - 1 - N_CTX // 2
    assert len(data) == 20 + 4 * N_CTX * N_CHUNKS + 2 * N_CHUNKS * rows * (2 * ((n_vocab + 1) // 2) + 4)


def test_the_same_run_does_not_diverge_and_mixed_precision_does(base, demo_high):
    path, ppl = base
    with Engine(demo_high, n_ctx=N_CTX, n_logits=N_CTX, n_threads=1) as eng:
        same = compare(eng, Base.read(path))
    assert same.count == N_CHUNKS * (N_CTX - 1 - N_CTX // 2) and same.n_same_top == same.count
    assert same.sum_kld / same.count < 1e-6 and abs(np.exp(same.sum_nll / same.count) - ppl) < 1e-3 * ppl
    with Engine(DEMO, n_ctx=N_CTX, n_logits=N_CTX, n_threads=1, expert_cache="25%") as eng:  # LOW copies, skips
        mixed = compare(eng, Base.read(path), one_token_per_step=True)
    assert mixed.sum_kld / mixed.count > 1e-5 and mixed.n_same_top < mixed.count
    # one expert a token instead of two (deterministic): the first chunk's divergence as a numpy
    # reference computes it from the same two distributions
    with Engine(demo_high, n_ctx=N_CTX, n_logits=N_CTX, n_threads=1,
                override_kv="qwen3moe.expert_used_count=int:1") as eng:
        fewer = compare(eng, Base.read(path))
        chunk = Base.read(path).tokens[:N_CTX]
        logits = eng.logits([eng.token_bos()] + chunk[1:])
    first = N_CTX // 2
    log_q = logits[first:N_CTX - 1].astype(np.float64)
    log_q -= log_q.max(axis=1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(axis=1, keepdims=True))
    log_p = expand(next(Base.read(path).rows()), Base.read(path).n_vocab).astype(np.float64)
    kept = log_p > -16
    reference = (np.where(kept, np.exp(log_p), 0) * np.where(kept, log_p - log_q, 0)).sum(axis=1)
    np.testing.assert_allclose(fewer.kld[0], reference, rtol=1e-3, atol=1e-6)
    assert fewer.sum_kld / fewer.count > mixed.sum_kld / mixed.count  # half the experts cost more than LOW copies
    lines = summary(mixed)
    assert lines[0] == "====== Perplexity statistics ======" and lines[-1].startswith("Same top p:")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyedgemoe", "perplexity", *args, "-t", "1"], capture_output=True,
                          text=True, timeout=300)


def test_the_command_writes_a_base_and_compares_with_it(demo_high, text, tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text(text)
    path = tmp_path / "base.kld"
    written = run(str(demo_high), "-f", str(corpus), "-c", str(N_CTX), "--chunks", str(N_CHUNKS),
                  "--kl-divergence-base", str(path))
    assert written.returncode == 0 and "ppl = " in written.stdout and path.stat().st_size > 0
    out = run(str(DEMO), "--expert-cache", "25%", "--kl-divergence-base", str(path), "--kl-divergence")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("chunk             PPL") and lines[1].startswith("   1 ") and lines[2].startswith("   2 ")
    assert "====== KL divergence statistics ======" in lines and lines[-1].startswith("Same top p:")


def test_what_cannot_be_compared_is_one_error_line(demo_high, tiny_model, text, tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text(text)
    other = tmp_path / "other.kld"
    assert run(str(tiny_model("qwen3_moe")[0]), "-f", str(corpus), "-c", "32", "--chunks", "1",
               "--kl-divergence-base", str(other)).returncode == 0
    notes = tmp_path / "notes.kld"
    notes.write_text("_logits_ is not enough")
    plain = tmp_path / "plain.kld"
    plain.write_text("hello")
    cut = tmp_path / "cut.kld"
    run(str(demo_high), "-f", str(corpus), "-c", str(N_CTX), "--chunks", "2", "--kl-divergence-base", str(cut))
    cut.write_bytes(cut.read_bytes()[:-1000])
    cases = [(["--kl-divergence"], "--kl-divergence-base"), (["--kl-divergence-base", str(other), "--kl-divergence"],
                                                              "vocabulary"),
             (["--kl-divergence-base", str(notes), "--kl-divergence"], "a damaged base"),
             (["--kl-divergence-base", str(plain), "--kl-divergence"], "not a KL-divergence base"),
             (["--kl-divergence-base", str(cut), "--kl-divergence"], "cut short"),
             (["--kl-divergence-base", str(tmp_path / "none.kld"), "--kl-divergence"], "cannot read")]
    for args, message in cases:
        out = run(str(demo_high), *args)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 1 and lines[-1].startswith("error:") and message in lines[-1], (args, lines)
        assert "Traceback" not in out.stderr


def test_a_base_of_another_vocabulary_is_refused_by_the_api(base, tiny_model):
    with Engine(tiny_model("qwen3_moe")[0], n_ctx=N_CTX, n_logits=N_CTX, n_threads=1) as eng:
        with pytest.raises(InvalidOptionError, match="another model's base"):
            compare(eng, Base.read(base[0]))


def test_a_base_path_that_is_an_input_is_refused_and_a_failed_run_leaves_no_base(demo_high, text, tmp_path):
    """A typo'd --kl-divergence-base naming the model or the text overwrote it (the model was then no GGUF)."""
    corpus = tmp_path / "text.txt"
    corpus.write_text(text)
    model = tmp_path / "model.gguf"
    model.symlink_to(demo_high)
    before = demo_high.stat().st_size, corpus.read_text()
    for target in (model, demo_high, corpus):
        out = run(str(model), "-f", str(corpus), "-c", str(N_CTX), "--chunks", "1", "--kl-divergence-base",
                  str(target))
        assert out.returncode == 1 and out.stderr.splitlines()[-1] == \
            f"error: the KL-divergence base {target} is one of the command's inputs: give another file"
    assert (demo_high.stat().st_size, corpus.read_text()) == before
    # a run that fails once the base is begun (its text too short for the context) leaves none
    corpus.write_text("a few words")
    out = run(str(model), "-f", str(corpus), "-c", str(N_CTX), "--kl-divergence-base", str(tmp_path / "b.kld"))
    assert out.returncode == 1 and "tokens" in out.stderr.splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "text.txt"]


def test_a_base_of_no_finite_scale_is_damaged_not_without_divergence(base, demo_high, tmp_path):
    """NaN scales gave "KL Divergence 0.00000" on every line, exit 0."""
    damaged = tmp_path / "nan.kld"
    raw = bytearray(base[0].read_bytes())
    offset = Base.read(base[0]).offset
    raw[offset:offset + 4] = struct.pack("<f", float("nan"))
    damaged.write_bytes(bytes(raw))
    out = run(str(demo_high), "--kl-divergence-base", str(damaged), "--kl-divergence")
    assert out.returncode == 1 and out.stderr.splitlines()[-1] == (
        f"error: {damaged}: chunk 1 holds a scale or a log probability that is no finite number: a damaged base")
    assert out.stdout == ""  # llama-perplexity's header only with a line under it


def test_the_text_and_context_beside_kl_divergence_are_noted_as_unused(base, demo_high, tmp_path):
    out = run(str(demo_high), "--kl-divergence-base", str(base[0]), "--kl-divergence", "-c", "64", "-f", "x.txt",
              "--chunks", "1")
    assert out.returncode == 0, out.stderr
    for flag in ("-f", "-c"):
        assert f"note: {flag} is unused: --kl-divergence evaluates the base's tokens in its chunks" in out.stderr
    assert out.stdout.splitlines()[1].startswith("   1 ")
