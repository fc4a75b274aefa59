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


def test_auto_keeps_every_expert_resident_when_the_model_and_context_fit():
    budget, note = memory_budget.parse_expert_cache("auto", 12 * GIB, 1 * GIB, context=1 * GIB, available=20 * GIB)
    assert budget is None and "all experts resident" in note


def test_auto_gives_the_experts_what_the_weights_context_and_slack_leave():
    budget, note = memory_budget.parse_expert_cache(None, 12 * GIB, 1 * GIB, context=2 * GIB, available=10 * GIB)
    assert budget == 10 * GIB - 1 * GIB - 2 * GIB - memory_budget.RESERVE_SLACK_BYTES
    assert "expert cache auto" in note and "reserved for the context" in note
    # a longer context leaves less for the experts
    longer, _ = memory_budget.parse_expert_cache(None, 12 * GIB, 1 * GIB, context=4 * GIB, available=10 * GIB)
    assert longer == budget - 2 * GIB


def test_auto_refuses_when_the_non_expert_weights_and_context_do_not_fit():
    with pytest.raises(InvalidOptionError, match="not enough memory"):
        memory_budget.parse_expert_cache("auto", 12 * GIB, 1 * GIB, context=1 * GIB, available=2 * GIB)


@pytest.mark.parametrize("value, expected", [("300MiB", 300 * MIB), ("4GiB", 4 * GIB), ("1.5GB", 1_500_000_000),
                                             ("50%", 6 * GIB), (123456789, 123456789), ("4GiB~", 4 * GIB),
                                             ("50%~", 6 * GIB), (" 300 MiB ~ ", 300 * MIB)])
def test_explicit_budgets_that_fit_are_kept(value, expected):
    budget, note = memory_budget.parse_expert_cache(value, 12 * GIB, 1 * GIB, context=0, available=20 * GIB)
    assert budget == expected and "reduced" not in note


@pytest.mark.parametrize("value", ["lots", "0%", "150%", "-3GiB", 0, -1, 1.5, True, "~", "auto~", "4GiB~~", "~4GiB"])
def test_invalid_budgets_are_refused_with_a_clear_error(value):
    with pytest.raises(InvalidOptionError, match="expert_cache"):
        memory_budget.parse_expert_cache(value, 12 * GIB, 1 * GIB, context=0, available=20 * GIB)


def test_an_explicit_budget_that_cannot_fit_is_refused_with_the_numbers():
    # needs 4 + 1 + 1 = 6 GiB of 4 GiB; what fits with the slack: 4 - 1 - 1 - 0.375 = 1.625 GiB = 1664 MiB
    with pytest.raises(InvalidOptionError) as refused:
        memory_budget.parse_expert_cache("4GiB", 12 * GIB, 1 * GIB, context=1 * GIB, available=4 * GIB)
    assert str(refused.value) == (
        "expert cache 4GiB (4.00 GiB) does not fit: it needs 4.00 GiB + 1.00 GiB of non-expert weights + 1.00 GiB "
        "for the context = 6.00 GiB, and 4.00 GiB available; the largest expert cache that fits with 384.00 MiB of "
        "slack for llama.cpp's other buffers and the OS is 1.62 GiB (--expert-cache 1664MiB, or 4GiB~ for what fits)")


def test_an_int_budget_that_cannot_fit_is_refused_too():
    with pytest.raises(InvalidOptionError, match=r"expert cache 4294967296 \(4.00 GiB\) does not fit"):
        memory_budget.parse_expert_cache(4 * GIB, 12 * GIB, 1 * GIB, context=1 * GIB, available=4 * GIB)


def test_a_trailing_tilde_reduces_the_budget_to_what_fits_and_says_so():
    budget, note = memory_budget.parse_expert_cache("50%~", 12 * GIB, 1 * GIB, context=1 * GIB, available=4 * GIB)
    assert budget == 4 * GIB - 1 * GIB - 1 * GIB - memory_budget.RESERVE_SLACK_BYTES
    assert note == ("expert cache 50%~ reduced to what fits: 1.62 GiB instead of 6.00 GiB, for 12.00 GiB of experts "
                    "(4.00 GiB available, less 1.00 GiB of non-expert weights, 1.00 GiB for the context and "
                    "384.00 MiB of slack)")


def test_a_budget_that_fits_with_the_slack_is_kept_without_a_word():
    available = 4 * GIB + 1 * GIB + 1 * GIB + memory_budget.RESERVE_SLACK_BYTES
    kept, note = memory_budget.parse_expert_cache("4GiB", 12 * GIB, 1 * GIB, context=1 * GIB, available=available)
    assert kept == 4 * GIB and note == "expert cache: 4096.0 MiB for 12288.0 MiB of experts"


def test_a_budget_that_fits_only_in_the_slack_is_kept_with_a_warning():
    # the slack is auto's margin, not a need: small models run in far less (tests/test_memory_honesty.py)
    available = 4 * GIB + 1 * GIB + 1 * GIB + 100 * MIB
    for value in ("4GiB", "4GiB~"):
        kept, note = memory_budget.parse_expert_cache(value, 12 * GIB, 1 * GIB, context=1 * GIB, available=available)
        assert kept == 4 * GIB
        assert note == ("expert cache 4GiB (4.00 GiB) fits, but leaves only 100.00 MiB of the 384.00 MiB of slack auto "
                        "keeps for llama.cpp's other buffers and the OS (6.10 GiB available, less 1.00 GiB of "
                        "non-expert weights and 1.00 GiB for the context): the run is killed if they need more")


def test_one_byte_more_than_fits_at_all_is_refused():
    available = 4 * GIB + 1 * GIB + 1 * GIB
    kept, _ = memory_budget.parse_expert_cache("4GiB", 12 * GIB, 1 * GIB, context=1 * GIB, available=available)
    assert kept == 4 * GIB
    with pytest.raises(InvalidOptionError, match="does not fit"):
        memory_budget.parse_expert_cache("4GiB", 12 * GIB, 1 * GIB, context=1 * GIB, available=available - 1)


@pytest.mark.parametrize("value", ["auto", "10%", "10%~", 1 * GIB])
def test_a_context_that_cannot_fit_beside_the_non_expert_weights_is_refused(value):
    # 1 GiB of weights + 8 GiB of context + 0.375 GiB slack in 4 GiB: no expert cache can help,
    # the context must take less than 4 - 1 - 0.375 = 2.625 GiB
    with pytest.raises(InvalidOptionError) as refused:
        memory_budget.parse_expert_cache(value, 12 * GIB, 1 * GIB, context=8 * GIB, available=4 * GIB)
    assert str(refused.value) == (
        "not enough memory: the non-expert weights (1.00 GiB), the context's KV cache and attention scores "
        "(8.00 GiB) and 384.00 MiB of slack need 9.38 GiB, and 4.00 GiB available: the context must take less "
        "than 2.62 GiB (a shorter --ctx)")


def test_non_expert_weights_that_cannot_fit_are_refused():
    with pytest.raises(InvalidOptionError, match="the non-expert weights and the slack alone do not fit"):
        memory_budget.parse_expert_cache("10%", 12 * GIB, 5 * GIB, context=0, available=4 * GIB)


def test_a_model_without_experts_checks_only_its_context():
    # a dense model caches nothing: the budget does not count, the context does
    assert memory_budget.parse_expert_cache("4GiB", 0, 1 * GIB, context=GIB // 4, available=2 * GIB)[0] == 4 * GIB
    with pytest.raises(InvalidOptionError, match="not enough memory"):
        memory_budget.parse_expert_cache("4GiB", 0, 1 * GIB, context=2 * GIB, available=2 * GIB)


def test_every_expert_resident_is_not_refused_on_the_experts_bytes():
    # auto offloads (the mapped experts could be evicted anyway) instead of refusing a model larger
    # than memory; only what must stay (weights, context, slack) has to fit
    budget, _ = memory_budget.parse_expert_cache("auto", 12 * GIB, 1 * GIB, context=1 * GIB, available=4 * GIB)
    assert budget == 4 * GIB - 1 * GIB - 1 * GIB - memory_budget.RESERVE_SLACK_BYTES


@pytest.fixture
def cgroup_v1_limit(tmp_path, monkeypatch):
    """This process in a cgroup v1 memory group with 1 MiB in use of a 2 MiB limit (no cgroup v2 limit)."""
    (tmp_path / "memory.limit_in_bytes").write_text(str(2 * MIB))
    (tmp_path / "memory.usage_in_bytes").write_text(str(1 * MIB))
    monkeypatch.setattr(memory_budget, "own_memory_cgroup_v1", lambda: tmp_path)
    monkeypatch.setattr(memory_budget, "CGROUP_V2", tmp_path / "no-cgroup-v2")


def test_available_memory_is_the_room_under_a_cgroup_limit_and_names_it(cgroup_v1_limit):
    assert memory_budget.available_memory() == (
        1 * MIB, "under the cgroup v1 memory limit of 2.00 MiB with 1.00 MiB in use")
    assert memory_budget.available_memory_bytes() == 1 * MIB


def test_a_refusal_under_a_cgroup_limit_names_the_limit(cgroup_v1_limit):
    with pytest.raises(InvalidOptionError, match=r"1.00 MiB available under the cgroup v1 memory limit of 2.00 MiB "
                                                 r"with 1.00 MiB in use"):
        memory_budget.parse_expert_cache("1GiB", 12 * GIB, 0, context=0)


def test_a_gpu_budget_is_left_to_the_devices_check_but_a_tilde_still_reduces_it():
    # refuse=False: the caller checks (devices.check_fits_device, with the GPU's name in its message)
    kept, _ = memory_budget.parse_expert_cache("4GiB", 12 * GIB, 1 * GIB, context=1 * GIB, available=4 * GIB,
                                               refuse=False)
    assert kept == 4 * GIB
    reduced, note = memory_budget.parse_expert_cache("4GiB~", 12 * GIB, 1 * GIB, context=1 * GIB, available=4 * GIB,
                                                     refuse=False)
    assert reduced == 4 * GIB - 1 * GIB - 1 * GIB - memory_budget.RESERVE_SLACK_BYTES and "reduced" in note


def test_the_engine_refuses_a_context_that_cannot_fit_before_loading(tiny_model):
    from pyedgemoe import Engine

    # 2**31 - 1 tokens of KV cache: petabytes, on any machine
    with pytest.raises(InvalidOptionError, match="not enough memory: the non-expert weights .* the context's KV cache"):
        Engine(tiny_model("olmoe")[0], n_ctx=2**31 - 1, expert_cache="auto")


def test_the_engine_refuses_an_expert_cache_that_cannot_fit_before_loading(tiny_model):
    from pyedgemoe import Engine

    with pytest.raises(InvalidOptionError, match=r"expert cache 1000TiB \(.*\) does not fit: .*largest expert cache"):
        Engine(tiny_model("olmoe")[0], expert_cache="1000TiB")
