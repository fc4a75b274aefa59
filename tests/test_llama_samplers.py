"""llama.cpp's samplers beyond llama-cpp-python's high-level ones: DRY, XTC, top-n-sigma and dynamic
temperature (--dry-*, --xtc-*, --top-nsigma, --dynatemp-*; llama-server's request fields). Checked
against the same samplers of stock llama.cpp (llama-cpp-python's low-level API) over stock
llama-cpp-python's logits, the prompt's tokens seen by the chain first, as llama-server has them."""
from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from pyedgemoe import Engine, InvalidOptionError
from pyedgemoe.generation import SamplingParams

llama_cpp = pytest.importorskip("llama_cpp")
DEMO = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"
PROMPT = "def add(a, b):\n    "
SETTINGS = dict(n_ctx=256, n_threads=2)


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen3_moe")[0])


def stock_tokens(model: str, n: int, add_samplers) -> list[int]:
    """n tokens of stock llama.cpp's sampler chain (add_samplers(chain, vocab) fills it) over stock
    llama-cpp-python's logits of model after PROMPT, the prompt's tokens accepted by the chain first."""
    llm = llama_cpp.Llama(model_path=model, verbose=False, **SETTINGS)
    tokens = llm.tokenize(PROMPT.encode(), add_bos=True)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add_samplers(chain, vocab)
    for t in tokens:
        llama_cpp.llama_sampler_accept(chain, t)
    llm.eval(tokens)
    out = []
    while len(out) < n:
        token = llama_cpp.llama_sampler_sample(chain, llm.ctx, -1)
        if llama_cpp.llama_vocab_is_eog(vocab, token):
            break
        out.append(token)
        llm.eval([token])
    llama_cpp.llama_sampler_free(chain)
    llm.close()
    return out


def ours(model: str, n: int, **sampling) -> list[int]:
    with Engine(model, flash_attn=False, **SETTINGS) as eng:  # llama-cpp-python's default
        return list(eng.generate_tokens(eng.tokenize(PROMPT), n, SamplingParams(**sampling)))


def test_dry_is_stock_llama_cpps_and_breaks_a_repetition(model):
    breakers = (ctypes.c_char_p * 2)(b"\n", b":")

    def dry_greedy(chain, vocab):
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dry(vocab, 0.8, 1.5, 1, 64, breakers, 2))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    with_dry = ours(model, 48, temperature=0.0, dry_multiplier=0.8, dry_base=1.5, dry_allowed_length=1,
                    dry_sequence_breakers=["\n", ":"])
    assert with_dry == stock_tokens(model, 48, dry_greedy)
    assert with_dry != ours(model, 48, temperature=0.0)


def test_xtc_top_n_sigma_and_dynamic_temperature_are_stock_llama_cpps_seeded(model):
    def chain_of(chain, vocab):
        for sampler in (llama_cpp.llama_sampler_init_top_n_sigma(2.0), llama_cpp.llama_sampler_init_xtc(0.6, 0.02, 1, 7),
                        llama_cpp.llama_sampler_init_temp_ext(1.2, 0.6, 1.4), llama_cpp.llama_sampler_init_dist(7)):
            llama_cpp.llama_sampler_chain_add(chain, sampler)
    sampled = ours(model, 40, temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, seed=7, top_n_sigma=2.0, xtc_probability=0.6,
                   xtc_threshold=0.02, dynatemp_range=0.6, dynatemp_exponent=1.4)
    assert sampled == stock_tokens(model, 40, chain_of)
    assert sampled != ours(model, 40, temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, seed=7)


@pytest.mark.parametrize("sampling, message", [
    (dict(dry_multiplier=-1.0), "dry_multiplier must be a number >= 0"),
    (dict(dry_penalty_last_n=-2), r"dry_penalty_last_n \(the window of recent tokens\) must be >= -1"),
    (dict(penalty_last_n=-2), r"penalty_last_n \(the window of recent tokens\) must be >= -1"),
    (dict(xtc_probability=float("nan")), "xtc_probability must be a number >= 0"),
    (dict(top_n_sigma=float("inf")), "top_n_sigma must be a finite number"),
    (dict(dry_sequence_breakers=["\n", ""]), "dry_sequence_breakers must be a list of non-empty strings"),
    (dict(samplers=[["top_k"], 1]), "samplers must be llama.cpp's samplers"),  # found by fuzzing: a TypeError
    (dict(samplers="top_k;top_k"), "samplers must be llama.cpp's samplers, each once"),
])
def test_a_bad_setting_is_a_typed_error(sampling, message):
    with Engine(DEMO, **SETTINGS) as eng, pytest.raises(InvalidOptionError, match=message):
        eng.generate("x", 2, **sampling)


def test_a_window_of_minus_one_is_the_whole_context():
    """llama.cpp's -1 for the penalties' and DRY's windows (--repeat-last-n, --dry-penalty-last-n)."""
    with Engine(DEMO, **SETTINGS) as eng:
        for name, penalty in (("penalty_last_n", dict(repeat_penalty=1.5)), ("dry_penalty_last_n", dict(dry_multiplier=2))):
            whole = eng.generate(PROMPT, 48, temperature=0.0, **penalty, **{name: -1})
            assert whole == eng.generate(PROMPT, 48, temperature=0.0, **penalty, **{name: eng.n_ctx})
            assert whole != eng.generate(PROMPT, 48, temperature=0.0, **penalty, **{name: 2}), name


def test_the_cli_takes_llama_cpps_flags():
    flags = ["--dry-multiplier", "0.8", "--dry-base", "1.5", "--dry-allowed-length", "1", "--temp", "0"]
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", str(DEMO), "-p", PROMPT, "-n", "32", "-t", "2",
                        "--no-display-prompt", "--no-escape", *flags], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    with Engine(DEMO, **SETTINGS) as eng:
        assert r.stdout == eng.generate(PROMPT, 32, temperature=0.0, dry_multiplier=0.8, dry_base=1.5,
                                        dry_allowed_length=1) + "\n"


def test_a_samplers_names_are_llama_cpps_in_any_case():
    # common_sampler_types_from_names: canonical, kebab-case and no-dash names, any case, and a few others
    from pyedgemoe.generation import sampler_order
    assert sampler_order("topk;Min-P;TEMP;topnsigma;nucleus") == "top_k;min_p;temperature;top_n_sigma;top_p"
    assert sampler_order(["TOP_K", "typp", "XTC"]) == "top_k;typ_p;xtc"
    assert sampler_order("kpt") == "top_k;top_p;temperature"  # llama-server's letters


def test_samplers_in_an_order_are_stock_llama_cpps_common_sampler(model):
    """An order given: llama.cpp's common sampler, those samplers in that order, then the distribution
    (no temperature where the order has none; penalties only where it names them)."""
    def chain_of(chain, vocab):
        for sampler in (llama_cpp.llama_sampler_init_top_k(5), llama_cpp.llama_sampler_init_typical(0.9, 1),
                        llama_cpp.llama_sampler_init_infill(vocab), llama_cpp.llama_sampler_init_dist(9)):
            llama_cpp.llama_sampler_chain_add(chain, sampler)
    ordered = ours(model, 40, top_k=5, typical_p=0.9, seed=9, repeat_penalty=1.5, temperature=0.2,
                   samplers="top_k;typical;infill")
    assert ordered == stock_tokens(model, 40, chain_of)
    assert ordered != ours(model, 40, top_k=5, typical_p=0.9, seed=9, repeat_penalty=1.5, temperature=0.2)
