"""The second trained model (models/README.md): shipped, shaped like a fine-grained MoE, and lossless
under an expert cache with the policies the cache benchmarks judge on it."""
from __future__ import annotations

from pathlib import Path

import pytest

from pyedgemoe import Engine
from pyedgemoe.engine import SamplingParams
from pyedgemoe.model_info import read_model_info

MODEL = Path(__file__).resolve().parents[1] / "models" / "fine.gguf"
PROMPT = "import os\nimport sys\n\n\ndef main(argv=None):\n"


def greedy(n_tokens: int, **options) -> list[int]:
    with Engine(MODEL, n_ctx=256, **options) as eng:
        return list(eng.generate_tokens(eng.tokenize(PROMPT), n_tokens, SamplingParams(temperature=0.0),
                                        ignore_eos=True))


def test_the_fine_model_is_a_multi_precision_fine_grained_moe():
    info = read_model_info(MODEL)
    assert info.architecture == "qwen3moe" and info.metadata["general.name"] == "fine"
    assert (info.n_layers, info.n_experts, info.n_experts_used) == (8, 64, 8)
    assert info.multi_precision and (info.high_type, info.low_type) == ("q8_0", "q4_0")
    assert MODEL.stat().st_size < 30_000_000


@pytest.mark.parametrize("policy", ["lru", "decay", "hobbit"])
def test_a_quarter_of_its_experts_cached_gives_the_resident_tokens(policy):
    resident = greedy(48, low_precision=False)
    assert greedy(48, expert_cache="25%", low_precision=False, cache_policy=policy) == resident
