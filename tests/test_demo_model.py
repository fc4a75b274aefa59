"""The shipped demo model (models/demo.gguf, built by scripts/train_demo_moe.py; models/README.md)."""
from __future__ import annotations

from pathlib import Path

import pytest

from pyedgemoe import Engine
from pyedgemoe.engine import SamplingParams
from pyedgemoe.model_info import read_model_info

MODEL = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"
MAX_BYTES = 60_000_000  # it is committed to git
PROMPT = "def read_lines(path):\n    with open(path, encoding=\"utf-8\") as f:\n"
# Python of the kind the held-out split holds: indentation, a docstring, operators, a comprehension
SNIPPET = '''\
class Counter(dict):
    """Count hashable items."""

    def most_common(self, n=None):
        items = sorted(self.items(), key=lambda kv: -kv[1])
        return items if n is None else items[:n]  # the n most common, ties by insertion
'''


def greedy_tokens(n_tokens: int, **engine_options) -> tuple[list[int], dict]:
    with Engine(MODEL, n_ctx=256, **engine_options) as eng:
        ids = list(eng.generate_tokens(eng.tokenize(PROMPT), n_tokens, SamplingParams(temperature=0.0),
                                       ignore_eos=True))
        return ids, eng.stats()


def test_the_demo_model_is_shipped_and_small_enough_for_git():
    assert MODEL.is_file()
    assert MODEL.stat().st_size <= MAX_BYTES


def test_the_demo_model_is_a_multi_precision_moe():
    info = read_model_info(MODEL)
    assert info.architecture == "qwen3moe"
    assert (info.n_layers, info.n_experts, info.n_experts_used) == (6, 16, 2)
    assert info.multi_precision
    assert (info.high_type, info.low_type) == ("q8_0", "q4_K")
    # every expert weight in both: q8_0 stores 32 weights in 34 bytes, q4_K 256 in 144 (17/16 and 9/16 B)
    assert info.low_expert_bytes * 17 == info.high_expert_bytes * 9 > 0
    # its name, not its checkpoint folder's ("hf": what `inspect` showed before)
    assert info.metadata["general.name"] == "demo"


def test_a_small_expert_cache_generates_the_resident_greedy_tokens():
    resident, _ = greedy_tokens(24)
    offloaded, stats = greedy_tokens(24, expert_cache="25%", low_precision=False, skip=False)
    assert offloaded == resident
    assert stats["experts"]["total"]["misses"] > 0  # experts really were read on demand


@pytest.mark.parametrize("text", [SNIPPET, "x = {'a': 1, \"b\": [2.5, 3e-4]}\n\tif x != None:\n\t\tpass\n"])
def test_the_tokenizer_round_trips_python_source(text):
    with Engine(MODEL, n_ctx=256) as eng:
        assert eng.detokenize(eng.tokenize(text, add_bos=False)) == text


def test_the_tokenizer_learned_python_and_starts_with_the_document_separator():
    with Engine(MODEL, n_ctx=256) as eng:
        ids = eng.tokenize(SNIPPET)
        endoftext = eng.tokenize("<|endoftext|>", add_bos=False, special=True)
        assert endoftext == [0] and ids[0] == 0  # BOS, as every training document started
        assert len(ids) < len(SNIPPET) / 3  # merges learned from Python source (3.7 bytes a token here)
