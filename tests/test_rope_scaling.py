"""RoPE scaling (--rope-scaling, --rope-freq-base, --rope-freq-scale, --rope-scale, --yarn-*;
llama-cpp-python's rope_scaling_type, rope_freq_base, ...): llama.cpp's context parameters, checked
against stock llama-cpp-python with the same arguments on the same file, and through the expert cache."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pyedgemoe import Engine, InvalidOptionError, Llama

SMALL = dict(n_ctx=512, n_threads=2, verbose=False)
PROMPT = b"Positions far apart are rotated by angles that the scaling spreads over a longer context"
# llama-cpp-python's arguments (rope_scaling_type 1: linear, 2: yarn)
SCALINGS = [
    dict(rope_scaling_type=1, rope_freq_scale=0.5),
    dict(rope_scaling_type=2, rope_freq_scale=0.25, yarn_orig_ctx=128),
    dict(rope_freq_base=500.0),
    dict(rope_scaling_type=2, rope_freq_scale=0.5, yarn_ext_factor=0.5, yarn_attn_factor=0.9, yarn_beta_fast=16.0,
         yarn_beta_slow=2.0),
]


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return str(tiny_model("qwen3_moe")[0])


def greedy(llm, tokens: list[int]) -> str:
    return llm(tokens, max_tokens=16, temperature=0)["choices"][0]["text"]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_scaled_positions_decode_as_stock_llama_cpp_python_with_the_same_arguments(qwen3, scaling):
    llama_cpp = pytest.importorskip("llama_cpp")
    theirs = llama_cpp.Llama(model_path=qwen3, logits_all=True, **scaling, **SMALL)  # logprobs need it there
    tokens = theirs.tokenize(PROMPT)
    with Llama(model_path=qwen3, **scaling, **SMALL) as ours, Llama(model_path=qwen3, **SMALL) as plain:
        first, theirs_first, plain_first = (top_logprobs(llm, tokens) for llm in (ours, theirs, plain))
        assert first.keys() == theirs_first.keys() and first == pytest.approx(theirs_first, abs=1e-4)
        assert first != pytest.approx(plain_first, abs=1e-3)  # the scaling reached llama.cpp
        assert greedy(ours, tokens) == greedy(theirs, tokens)
    theirs.close()


def top_logprobs(llm, tokens: list[int]) -> dict[str, float]:
    """The first generated token's five likeliest tokens and their log-probabilities."""
    return llm(tokens, max_tokens=1, temperature=0, logprobs=5)["choices"][0]["logprobs"]["top_logprobs"][0]


def test_llama_cpp_pythons_defaults_are_the_models_rope(qwen3):
    defaults = dict(rope_scaling_type=-1, rope_freq_base=0.0, rope_freq_scale=0.0, yarn_ext_factor=-1.0,
                    yarn_attn_factor=1.0, yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_orig_ctx=0)
    with Llama(model_path=qwen3, **defaults, **SMALL) as given:
        assert "\nrope " not in "\n".join(given.engine.plan.describe())
        tokens = given.tokenize(PROMPT)
        with Llama(model_path=qwen3, **SMALL) as plain:
            assert greedy(given, tokens) == greedy(plain, tokens)


def test_the_expert_cache_serves_scaled_positions_losslessly(qwen3):
    scaling = dict(rope_scaling="yarn", rope_freq_scale=0.25)
    with Engine(qwen3, **scaling, **SMALL) as resident, Engine(qwen3, expert_cache="25%", **scaling, **SMALL) as cached:
        tokens = resident.tokenize(PROMPT.decode())
        expected = resident.create_completion(tokens, max_tokens=16, temperature=0)["choices"][0]["text"]
        assert cached.create_completion(tokens, max_tokens=16, temperature=0)["choices"][0]["text"] == expected
        assert "\nrope          --rope-scaling yarn --rope-freq-scale 0.25  (" in "\n".join(cached.plan.describe())


def test_the_context_note_counts_the_positions_the_scaling_covers(qwen3):
    with Engine(qwen3, n_ctx=0, n_threads=2) as trained:
        positions = trained.plan.n_ctx or trained.info.metadata[f"{trained.info.architecture}.context_length"]
    longer = dict(n_ctx=positions * 2, n_threads=2)
    with Engine(qwen3, **longer) as plain, Engine(qwen3, rope_freq_scale=0.5, rope_scaling="linear", **longer) as scaled:
        assert any(f"longer than the model was trained for ({positions})" in n for n in plain.plan.notes)
        assert not any("longer than the model" in n for n in scaled.plan.notes)


@pytest.mark.parametrize("arguments, message", [
    (dict(rope_scaling_type=7), "rope_scaling_type must be -1"),
    (dict(rope_scaling_type=True), "rope_scaling_type must be -1"),
    (dict(rope_freq_scale=-0.5), "rope_freq_scale must be positive"),
    (dict(rope_freq_base=float("inf")), "rope_freq_base must be finite"),
    (dict(yarn_orig_ctx=-1), "yarn_orig_ctx must be a context size"),
    (dict(yarn_orig_ctx=2**40), "yarn_orig_ctx must be a context size"),
    (dict(yarn_beta_fast="32"), "yarn_beta_fast must be a number"),
    (dict(yarn_attn_factor=True), "yarn_attn_factor must be a number"),
])
def test_a_bad_argument_is_a_typed_error(qwen3, arguments, message):
    with pytest.raises(InvalidOptionError, match=message):
        Llama(model_path=qwen3, **arguments, **SMALL)


def test_engine_takes_the_scaling_by_name(qwen3):
    with pytest.raises(InvalidOptionError, match="rope_scaling must be one of none, linear, yarn, longrope"):
        Engine(qwen3, rope_scaling="ntk", **SMALL)


def cli(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", *arguments], capture_output=True, text=True,
                          timeout=120)


def test_the_cli_takes_llama_cpps_flags(qwen3):
    common = [qwen3, "-p", PROMPT.decode(), "-n", "8", "--temp", "0", "-t", "2"]
    scaled, as_freq_scale, plain = (cli(*common, *flags) for flags in (
        ["--rope-scaling", "yarn", "--rope-scale", "4"], ["--rope-scaling", "yarn", "--rope-freq-scale", "0.25"], []))
    assert scaled.returncode == as_freq_scale.returncode == plain.returncode == 0, scaled.stderr
    assert scaled.stdout == as_freq_scale.stdout != plain.stdout
    plan = cli(qwen3, "--dry-run", "--rope-scale", "4", "--yarn-orig-ctx", "64")
    assert "rope          --rope-freq-scale 0.25 --yarn-orig-ctx 64" in plan.stdout


@pytest.mark.parametrize("flags, message", [
    (["--rope-scaling", "ntk"], "rope_scaling must be one of"),
    (["--rope-scale", "0"], "--rope-scale must be a positive number"),
    (["--rope-scale", "2", "--rope-freq-scale", "0.25"], "--rope-scale 2 is --rope-freq-scale 0.5, not 0.25"),
    (["--rope-freq-base", "nan"], "rope_freq_base must be finite"),
])
def test_a_bad_flag_is_one_error_line(qwen3, flags, message):
    r = cli(qwen3, "-p", "hi", "-n", "2", *flags)
    assert r.returncode != 0 and r.stderr.startswith("error: ") and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_the_benchmark_runs_stock_with_the_same_scaling(qwen3):
    pytest.importorskip("llama_cpp")
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "bench", qwen3, "--rope-scaling", "yarn",
                        "--rope-scale", "4", "--repeats", "1", "--warmup", "0", "--output-tokens", "8",
                        "--prompt-tokens", "16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1].endswith("| yes |")  # the same tokens: the same positions in both
