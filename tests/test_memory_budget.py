"""How "auto" sizes the expert cache: what it keeps free for the context, and when it offloads."""
import pytest

from pyedgemoe import memory_budget
from pyedgemoe.errors import InvalidOptionError

GIB = 1024**3
MIB = 1024**2

# OLMoE-1B-7B's attention shape
OLMOE = {"general.architecture": "olmoe", "olmoe.block_count": 16, "olmoe.attention.head_count": 16,
         "olmoe.attention.head_count_kv": 16, "olmoe.embedding_length": 2048, "olmoe.context_length": 4096}


def test_context_bytes_are_the_kv_cache_plus_one_layers_attention_scores():
    kv = 4096 * 16 * (2048 + 2048) * 2  # n_ctx x layers x (K + V widths) x f16: 512 MiB
    scores = 2 * 4096 * 512 * 16 * 4  # scores and softmax, f32: 512 MiB
    assert memory_budget.context_bytes(OLMOE, 4096, 512, 2, flash_attn=False) == kv + scores
    assert memory_budget.context_bytes(OLMOE, 4096, 512, 2, flash_attn=True) == kv
    assert memory_budget.context_bytes(OLMOE, 4096, 512, 2, flash_attn=None) == kv  # llama.cpp's auto: on
    # n_ctx 0: the training context
    assert memory_budget.context_bytes(OLMOE, 0, 512, 2, flash_attn=True) == kv
    # grouped-query attention and explicit head sizes (Qwen3-30B-A3B: 4 KV heads of 128)
    qwen3 = {"general.architecture": "qwen3moe", "qwen3moe.block_count": 48, "qwen3moe.attention.head_count": 32,
             "qwen3moe.attention.head_count_kv": 4, "qwen3moe.attention.key_length": 128,
             "qwen3moe.attention.value_length": 128, "qwen3moe.embedding_length": 2048}
    assert memory_budget.context_bytes(qwen3, 40960, 512, 2, flash_attn=True) == 40960 * 48 * (512 + 512) * 2


def test_auto_keeps_every_expert_resident_when_the_model_and_context_fit(monkeypatch):
    monkeypatch.setattr(memory_budget, "available_memory_bytes", lambda: 20 * GIB)
    budget, note = memory_budget.parse_expert_cache("auto", 12 * GIB, 1 * GIB, context=1 * GIB)
    assert budget is None and "all experts resident" in note


def test_auto_gives_the_experts_what_the_weights_context_and_slack_leave(monkeypatch):
    monkeypatch.setattr(memory_budget, "available_memory_bytes", lambda: 10 * GIB)
    budget, note = memory_budget.parse_expert_cache(None, 12 * GIB, 1 * GIB, context=2 * GIB)
    assert budget == 10 * GIB - 1 * GIB - 2 * GIB - memory_budget.RESERVE_SLACK_BYTES
    assert "expert cache auto" in note and "reserved for the context" in note
    # a longer context leaves less for the experts
    longer, _ = memory_budget.parse_expert_cache(None, 12 * GIB, 1 * GIB, context=4 * GIB)
    assert longer == budget - 2 * GIB


def test_auto_refuses_when_the_non_expert_weights_and_context_do_not_fit(monkeypatch):
    monkeypatch.setattr(memory_budget, "available_memory_bytes", lambda: 2 * GIB)
    with pytest.raises(InvalidOptionError, match="not enough memory"):
        memory_budget.parse_expert_cache("auto", 12 * GIB, 1 * GIB, context=1 * GIB)


@pytest.mark.parametrize("value, expected", [("300MiB", 300 * MIB), ("4GiB", 4 * GIB), ("1.5GB", 1_500_000_000),
                                             ("50%", 6 * GIB), (123456789, 123456789)])
def test_explicit_budgets(value, expected):
    assert memory_budget.parse_expert_cache(value, 12 * GIB, 1 * GIB, context=0)[0] == expected


@pytest.mark.parametrize("value", ["lots", "0%", "150%", "-3GiB", 0, -1, 1.5, True])
def test_invalid_budgets_are_refused_with_a_clear_error(value):
    with pytest.raises(InvalidOptionError, match="expert_cache"):
        memory_budget.parse_expert_cache(value, 12 * GIB, 1 * GIB, context=0)
