"""How the expert cache is sized: what a run needs beside it (the context's buffers, estimated from
the model's shape, and a measured allowance), what "auto" leaves the experts, and when an explicit
size is refused or, with a trailing "~", reduced."""
import pytest

from conftest import MOE_ARCHITECTURES
from pyedgemoe import memory_budget
from pyedgemoe.errors import InvalidOptionError

GIB = 1024**3
MIB = 1024**2
ALLOWANCE = memory_budget.RUN_ALLOWANCE_BYTES

# OLMoE-1B-7B's shape
OLMOE = {"general.architecture": "olmoe", "olmoe.block_count": 16, "olmoe.attention.head_count": 16,
         "olmoe.attention.head_count_kv": 16, "olmoe.embedding_length": 2048, "olmoe.context_length": 4096,
         "olmoe.feed_forward_length": 1024, "olmoe.expert_count": 64, "olmoe.expert_used_count": 8,
         "tokenizer.ggml.tokens": {"array_length": 50304}}
# Qwen3-30B-A3B's: 4 KV heads of 128, Q 32 x 128 wider than n_embd
QWEN3 = {"general.architecture": "qwen3moe", "qwen3moe.block_count": 48, "qwen3moe.attention.head_count": 32,
         "qwen3moe.attention.head_count_kv": 4, "qwen3moe.attention.key_length": 128,
         "qwen3moe.attention.value_length": 128, "qwen3moe.embedding_length": 2048,
         "qwen3moe.feed_forward_length": 6144, "qwen3moe.expert_feed_forward_length": 768,
         "qwen3moe.expert_count": 128, "qwen3moe.expert_used_count": 8,
         "tokenizer.ggml.tokens": {"array_length": 151936}}
KV = 384 * MIB  # a KV cache's bytes (llama.cpp measures them: tests/test_load_plan.py checks that measure)


def test_the_compute_buffer_is_the_mask_a_few_hidden_rows_and_the_largest_stage():
    # per token, flash attention on: the f16 mask over 4096 positions, 8 rows of n_embd f32, and the
    # largest stage: the logits (50304) over the MoE (8 x (3 x 1024 + 2048) + 3 x 64 = 41152)
    per_token = 4096 * 2 + 8 * 2048 * 4 + 50304 * 4
    assert memory_budget.compute_buffer_bytes(OLMOE, 4096, 512, flash_attn=True) == 512 * per_token  # 134.25 MiB
    assert memory_budget.compute_buffer_bytes(OLMOE, 4096, 512, flash_attn=None) == 512 * per_token  # auto: on
    assert memory_budget.compute_buffer_bytes(OLMOE, 0, 512, flash_attn=True) == 512 * per_token
    # Qwen3: the hidden rows are as wide as Q (32 x 128); the logits dominate
    assert memory_budget.compute_buffer_bytes(QWEN3, 4096, 512, flash_attn=True) == 512 * (
        4096 * 2 + 8 * 4096 * 4 + 151936 * 4)


def test_a_run_that_outputs_fewer_tokens_counts_only_their_logits_rows():
    # one output: the MoE stage, 8 x (3 x 768 + 2048) + 3 x 128 a token, is the largest
    hidden = 4096 * 2 + 8 * 4096 * 4
    assert (memory_budget.compute_buffer_bytes(QWEN3, 4096, 512, flash_attn=True, n_outputs=1)
            == 512 * hidden + 4 * 512 * (8 * (3 * 768 + 2048) + 3 * 128))
    assert (memory_budget.compute_buffer_bytes(QWEN3, 4096, 512, flash_attn=True, n_outputs=400)
            == 512 * hidden + 4 * 400 * 151936)
    # the context: one output a sequence, or the n_logits asked for at once; every token on a GPU,
    # whose memory llama.cpp takes whole
    for n_parallel, n_logits, outputs in ((1, 0, 1), (4, 0, 4), (1, 100, 100)):
        assert (memory_budget.context_bytes(QWEN3, KV, 4096, 512, True, n_parallel, n_logits)
                - memory_budget.compute_buffer_bytes(QWEN3, 4096, 512, True, n_parallel, outputs)
                == memory_budget.context_bytes(QWEN3, KV, 4096, 512, True, n_parallel, n_logits, every_output=True)
                - memory_budget.compute_buffer_bytes(QWEN3, 4096, 512, True, n_parallel))


def test_without_flash_attention_the_scores_an_f32_mask_and_a_copy_of_one_layers_kv_count():
    # scores 4096 x 16 heads per token (128 MiB) outweigh the logits; one layer's K and V over 4096 positions
    expected = 512 * (4096 * 4 + 8 * 2048 * 4) + 4 * (512 * 4096 * 16 + 4096 * (2048 + 2048))
    assert memory_budget.compute_buffer_bytes(OLMOE, 4096, 512, flash_attn=False) == expected  # 232 MiB


def test_with_several_sequences_each_attends_to_its_own_part_of_the_context():
    assert (memory_budget.compute_buffer_bytes(OLMOE, 4096, 512, flash_attn=False, n_seq_max=4)
            == memory_budget.compute_buffer_bytes(OLMOE, 1024, 512, flash_attn=False))


def test_a_ubatch_of_fewer_tokens_needs_a_smaller_buffer():
    assert (memory_budget.compute_buffer_bytes(OLMOE, 4096, 64, flash_attn=True)
            == memory_budget.compute_buffer_bytes(OLMOE, 4096, 512, flash_attn=True) // 8)


def test_a_context_shorter_than_the_batch_caps_the_ubatch_and_is_padded_as_llama_cpp_pads_it():
    # llama.cpp: n_batch = min(n_ctx, n_batch) for a causal model, then n_ctx up to a multiple of 256
    for estimate in (memory_budget.compute_buffer_bytes, memory_budget.cpu_work_bytes):
        assert estimate(QWEN3, 145, 512, None) == estimate(QWEN3, 256, 145, None)
    # a 512-token ubatch's logits alone would take 297 MiB; the whole 145-token context takes less
    assert memory_budget.context_bytes(QWEN3, 256 * 48 * 1024 * 2, 145, 512, None) < 512 * 151936 * 4


def test_the_cpu_work_buffer_holds_the_largest_matrix_input_converted_to_f16():
    # the MoE down projection's input, 8 experts x 1024 a token, at 2 bytes
    assert memory_budget.cpu_work_bytes(OLMOE, 4096, 512, flash_attn=True) == 512 * 8 * 1024 * 2  # 8 MiB
    # without flash attention the scores (4096 positions x 16 heads a token) times the f16 V cache
    assert memory_budget.cpu_work_bytes(OLMOE, 4096, 512, flash_attn=False) == 512 * 4096 * 16 * 2  # 64 MiB


def test_the_context_is_the_kv_cache_the_compute_and_work_buffers_and_the_vocabulary():
    assert memory_budget.vocabulary_bytes(OLMOE) == 50304 * memory_budget.VOCABULARY_TOKEN_BYTES
    with_vocab_size = {**OLMOE, "olmoe.vocab_size": 1000}  # the key wins over the token list
    assert memory_budget.vocabulary_bytes(with_vocab_size) == 1000 * memory_budget.VOCABULARY_TOKEN_BYTES
    assert memory_budget.context_bytes(OLMOE, KV, 4096, 512, flash_attn=None) == (
        KV + memory_budget.compute_buffer_bytes(OLMOE, 4096, 512, None, n_outputs=1)
        + memory_budget.cpu_work_bytes(OLMOE, 4096, 512, None) + memory_budget.vocabulary_bytes(OLMOE))


@pytest.mark.parametrize("arch", ["llama", *MOE_ARCHITECTURES])
@pytest.mark.parametrize("n_ctx, n_batch, flash_attn, n_parallel",
                         [(512, 512, None, 1), (4096, 512, False, 1), (2048, 64, None, 1), (4096, 256, False, 4),
                          (100, 512, False, 1), (256, 64, None, 3)])
def test_the_compute_estimate_covers_what_llama_cpp_allocates(tiny_model, arch, n_ctx, n_batch, flash_attn,
                                                               n_parallel):
    """llama.cpp's own account (llama_get_memory_breakdown) is the reference: the estimate is at or
    above it, and not far above (docs/expert-residency.md has the table for the large models)."""
    from pyedgemoe import Engine

    path = tiny_model(arch)[0]
    with Engine(path, n_ctx=n_ctx, n_batch=n_batch, flash_attn=flash_attn, n_parallel=n_parallel) as engine:
        real = sum(buffer["compute"] for buffer in engine.stats()["memory"])
        kv = sum(buffer["context"] for buffer in engine.stats()["memory"])
    metadata = engine.info.metadata
    estimate = memory_budget.compute_buffer_bytes(metadata, n_ctx, n_batch, flash_attn, n_parallel)
    assert real <= estimate <= 2 * real + 32 * MIB
    assert kv == engine.plan.context_bytes - memory_budget.context_bytes(
        metadata, 0, n_ctx, engine.plan.n_ubatch, flash_attn, n_parallel)  # the plan's KV cache: llama.cpp's


@pytest.mark.parametrize("arch, options", [
    ("gpt_oss", dict(swa_full=False)), ("gpt_oss", dict(swa_full=False, n_parallel=3)), ("gpt_oss", {}),
    ("deepseek_v2", {}), ("deepseek_v3", dict(kv_type="f32")), ("qwen3_next", {}), ("qwen3_next", dict(n_parallel=4)),
    ("lfm2_moe", {}), ("lfm2_moe", dict(n_parallel=2)), ("glm4_moe", dict(n_ctx=100)), ("granitemoehybrid", {}),
    ("granitemoehybrid", dict(n_parallel=3)), ("qwen3_5_moe", dict(n_parallel=2)), ("minimax_m2", {}),
    ("nemotron_h", dict(n_parallel=2)), ("afmoe", dict(swa_full=False)), ("jamba", dict(n_parallel=2)),
    ("ernie4_5_moe", {}), ("gemma4", dict(swa_full=False)), ("glm4_moe_lite", {})])
def test_the_plan_s_kv_cache_is_what_llama_cpp_allocates_in_every_layout(tiny_model, arch, options):
    """Sliding-window layers (GPT-OSS without --swa-full), MLA's keys without values (DeepSeek), a
    hybrid model's recurrent layers (the gated delta nets of Qwen3-Next and Qwen3.5, LFM2's short
    convolutions, Granite-4.0-H's and Nemotron-H's Mamba-2, Jamba's Mamba), AFMoE's and Gemma 4's
    sliding windows (Gemma 4's global layers of wider heads), each
    sequence's recurrent state: the plan counts the KV cache and recurrent states llama.cpp
    allocates, byte for byte (it asks llama.cpp), where a formula over the header's widths took 1.8-4x
    the memory, or too little for a hybrid model's states at several sequences."""
    from pyedgemoe import Engine
    from pyedgemoe.load_plan import LoadOptions, context_memory_bytes

    options = {"n_ctx": 1024, **options}
    with Engine(tiny_model(arch)[0], **options) as engine:
        allocated = sum(buffer["context"] for buffer in engine.stats()["memory"])
        load = {k: v for k, v in options.items() if k != "swa_full"}
        measured = context_memory_bytes(engine.info, LoadOptions(**load, expert_options=engine.plan.expert_options))
    assert allocated > 0 and measured == allocated


@pytest.mark.parametrize("arch, options", [("gpt_oss", dict(swa_full=False)), ("qwen3_next", dict(n_parallel=2)),
                                           ("deepseek_v2", {})])
def test_a_context_too_large_to_measure_is_extrapolated_exactly(tiny_model, monkeypatch, arch, options):
    """Beyond MEASURED_CELLS the KV cache grows linearly (past the sliding windows' knee): the
    extrapolation from the largest measured context and its half is llama.cpp's own measure."""
    from pyedgemoe import load_plan
    from pyedgemoe.expert_options import ExpertOptions
    from pyedgemoe.model_info import read_model_info

    info = read_model_info(tiny_model(arch)[0])
    load = load_plan.LoadOptions(n_ctx=8192, n_batch=256, n_ubatch=256, n_parallel=options.get("n_parallel", 1),
                                 expert_options=ExpertOptions(swa_full=options.get("swa_full")))
    exact = load_plan.context_memory_bytes(info, load)
    monkeypatch.setattr(load_plan, "MEASURED_CELLS", 2048)
    assert load_plan.context_memory_bytes(info, load) == exact


def test_auto_keeps_every_expert_resident_when_the_model_and_context_fit():
    budget, note = memory_budget.parse_expert_cache("auto", 12 * GIB, 1 * GIB, context=1 * GIB, available=20 * GIB)
    assert budget is None and "all experts resident" in note


def test_auto_gives_the_experts_what_the_weights_context_and_allowance_leave():
    budget, note = memory_budget.parse_expert_cache(None, 12 * GIB, 1 * GIB, context=2 * GIB, available=10 * GIB)
    assert budget == 10 * GIB - 1 * GIB - 2 * GIB - ALLOWANCE
    assert "expert cache auto" in note and "reserved for the context and allowance" in note
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
    # needs 4 + 1 + 1 GiB + 16 MiB of 4 GiB; what fits: 4 - 1 - 1 GiB - 16 MiB = 2032 MiB
    with pytest.raises(InvalidOptionError) as refused:
        memory_budget.parse_expert_cache("4GiB", 12 * GIB, 1 * GIB, context=1 * GIB, available=4 * GIB)
    assert str(refused.value) == (
        "expert cache 4GiB (4.00 GiB) does not fit: it needs 4.00 GiB + 1.00 GiB of non-expert weights, 1.00 GiB "
        "for the context (KV cache, compute buffers, vocabulary, logits) and 16.00 MiB of allowance = 6.02 GiB, and 4.00 GiB "
        "available; the largest expert cache that fits is 1.98 GiB (--expert-cache 2032MiB, or 4GiB~ for what fits)")


def test_an_int_budget_that_cannot_fit_is_refused_too():
    with pytest.raises(InvalidOptionError, match=r"expert cache 4294967296 \(4.00 GiB\) does not fit"):
        memory_budget.parse_expert_cache(4 * GIB, 12 * GIB, 1 * GIB, context=1 * GIB, available=4 * GIB)


def test_auto_gives_the_same_cache_when_the_room_it_measures_moves_a_little():
    # a few hundred KiB more or less room from run to run must not change the cache: with LOW
    # copies, another cache size decodes other tokens
    step = memory_budget.AUTO_CACHE_STEP_BYTES
    budgets = {memory_budget.parse_expert_cache("auto", 12 * GIB, 1 * GIB, context=1 * GIB,
                                                available=4 * GIB + 5 * step // 2 + extra)[0]
               for extra in (0, 170 * 1024, 300 * 1024, -300 * 1024)}
    assert budgets == {4 * GIB - 1 * GIB - 1 * GIB - ALLOWANCE + 2 * step}
    # a tiny model's cache, below one step, keeps every byte
    tiny, _ = memory_budget.parse_expert_cache("auto", 12 * GIB, 1 * GIB, context=1 * GIB,
                                               available=2 * GIB + ALLOWANCE + 5000)
    assert tiny == 5000


def test_a_trailing_tilde_reduces_the_budget_to_what_fits_and_says_so():
    budget, note = memory_budget.parse_expert_cache("50%~", 12 * GIB, 1 * GIB, context=1 * GIB, available=4 * GIB)
    assert budget == 4 * GIB - 1 * GIB - 1 * GIB - ALLOWANCE
    assert note == ("expert cache 50%~ reduced to what fits: 1.98 GiB instead of 6.00 GiB, for 12.00 GiB of experts "
                    "(4.00 GiB available, less 1.00 GiB of non-expert weights, 1.00 GiB for the context (KV cache, "
                    "compute buffers, vocabulary, logits) and 16.00 MiB of allowance)")


def test_a_budget_that_fits_with_the_allowance_is_kept_without_a_word():
    available = 4 * GIB + 1 * GIB + 1 * GIB + ALLOWANCE
    kept, note = memory_budget.parse_expert_cache("4GiB", 12 * GIB, 1 * GIB, context=1 * GIB, available=available)
    assert kept == 4 * GIB and note == "expert cache: 4096.0 MiB for 12288.0 MiB of experts"


def test_one_byte_more_than_fits_is_refused_or_with_a_tilde_reduced_by_that_byte():
    # no zone between: the allowance is what the process was measured to need, not a margin to eat into
    available = 4 * GIB + 1 * GIB + 1 * GIB + ALLOWANCE - 1
    with pytest.raises(InvalidOptionError, match="does not fit"):
        memory_budget.parse_expert_cache("4GiB", 12 * GIB, 1 * GIB, context=1 * GIB, available=available)
    reduced, note = memory_budget.parse_expert_cache("4GiB~", 12 * GIB, 1 * GIB, context=1 * GIB, available=available)
    assert reduced == 4 * GIB - 1 and "reduced to what fits" in note


@pytest.mark.parametrize("value", ["auto", "10%", "10%~", 1 * GIB])
def test_a_context_that_cannot_fit_beside_the_non_expert_weights_is_refused(value):
    # 1 GiB of weights + 8 GiB of context + 16 MiB in 4 GiB: no expert cache can help,
    # the context must take less than 4 GiB - 1 GiB - 16 MiB = 2.98 GiB
    with pytest.raises(InvalidOptionError) as refused:
        memory_budget.parse_expert_cache(value, 12 * GIB, 1 * GIB, context=8 * GIB, available=4 * GIB)
    assert str(refused.value) == (
        "not enough memory: 1.00 GiB of non-expert weights, 8.00 GiB for the context (KV cache, compute buffers, "
        "vocabulary, logits) and 16.00 MiB of allowance need 9.02 GiB, and 4.00 GiB available: the context must take less "
        "than 2.98 GiB (a shorter --ctx)")


def test_non_expert_weights_that_cannot_fit_are_refused():
    with pytest.raises(InvalidOptionError, match="the non-expert weights and the allowance alone do not fit"):
        memory_budget.parse_expert_cache("10%", 12 * GIB, 5 * GIB, context=0, available=4 * GIB)


def test_a_model_without_experts_checks_only_its_context():
    # a dense model caches nothing: the budget does not count, the context does
    assert memory_budget.parse_expert_cache("4GiB", 0, 1 * GIB, context=GIB // 4, available=2 * GIB)[0] == 4 * GIB
    with pytest.raises(InvalidOptionError, match="not enough memory"):
        memory_budget.parse_expert_cache("4GiB", 0, 1 * GIB, context=1 * GIB, available=2 * GIB)


def test_every_expert_resident_is_not_refused_on_the_experts_bytes():
    # auto offloads (the mapped experts could be evicted anyway) instead of refusing a model larger
    # than memory; only what must stay (weights, context, allowance) has to fit
    budget, _ = memory_budget.parse_expert_cache("auto", 12 * GIB, 1 * GIB, context=1 * GIB, available=4 * GIB)
    assert budget == 4 * GIB - 1 * GIB - 1 * GIB - ALLOWANCE


@pytest.fixture
def cgroup_v1_limit(tmp_path, monkeypatch):
    """This process in a cgroup v1 memory group with 1 MiB in use of a 2 MiB limit (no cgroup v2 limit)."""
    (tmp_path / "memory.limit_in_bytes").write_text(str(2 * MIB))
    (tmp_path / "memory.usage_in_bytes").write_text(str(1 * MIB))
    monkeypatch.setattr(memory_budget, "own_memory_cgroups", lambda: [("cgroup v1", tmp_path)])


def test_available_memory_is_the_room_under_a_cgroup_limit_and_names_it(cgroup_v1_limit):
    assert memory_budget.available_memory() == (
        1 * MIB, "under the cgroup v1 memory limit of 2.00 MiB with 1.00 MiB in use")
    assert memory_budget.available_memory_bytes() == 1 * MIB


def test_clean_page_cache_in_the_cgroup_counts_as_available(cgroup_v1_limit, tmp_path):
    # a previous run's cached file is charged to the group, but the kernel drops it for room;
    # dirty pages and pages under writeback it cannot drop at once, and mapped ones (code) are in use
    (tmp_path / "memory.stat").write_text(f"cache {MIB}\ntotal_active_file {MIB // 4}\n"
                                          f"total_inactive_file {MIB // 2}\ntotal_dirty {MIB // 16}\n"
                                          f"total_writeback {MIB // 8}\ntotal_mapped_file {MIB // 16}\n")
    available, where = memory_budget.available_memory()
    assert available == 2 * MIB - MIB + MIB // 2
    assert where.endswith("with 512.00 KiB in use (and 512.00 KiB of page cache it can drop)"), where


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
    assert reduced == 4 * GIB - 1 * GIB - 1 * GIB - ALLOWANCE and "reduced" in note


def test_the_engine_refuses_a_context_that_cannot_fit_before_loading(tiny_model):
    from pyedgemoe import Engine

    # 2**31 - 1 tokens of KV cache: petabytes, on any machine
    with pytest.raises(InvalidOptionError, match=r"not enough memory: .* non-expert weights, .* for the context \(KV"):
        Engine(tiny_model("olmoe")[0], n_ctx=2**31 - 1, expert_cache="auto")


def test_the_engine_refuses_an_expert_cache_that_cannot_fit_before_loading(tiny_model, monkeypatch):
    from pyedgemoe import Engine
    from pyedgemoe.model_info import read_model_info

    path = tiny_model("olmoe")[0]
    half = read_model_info(path).high_expert_bytes // 2  # the room beside the rest, as this test has it
    monkeypatch.setattr(memory_budget, "room_for_experts_bytes", lambda *_: half)
    with pytest.raises(InvalidOptionError, match=r"expert cache 99% \(.*\) does not fit: .*largest expert cache"):
        Engine(path, expert_cache="99%")
    # a size beyond the experts is checked as what their copies take, which does not fit here either
    with pytest.raises(InvalidOptionError, match=r"expert cache 1000TiB \(.* KiB, what its copies take\) does not fit: "
                                                 r"it needs .* KiB \+ .*largest expert cache"):
        Engine(path, expert_cache="1000TiB")


VOCAB = {"general.architecture": "x", "x.vocab_size": 1000}  # 8,000 bytes of logits a token


def test_logits_asked_for_at_once_are_in_the_context_when_reserved():
    assert memory_budget.logits_bytes(VOCAB, 100) == 2 * 100 * 1000 * 4  # the result and llama.cpp's buffer
    grown = memory_budget.context_bytes(VOCAB, KV, 64, 32, None, n_logits=100) - memory_budget.context_bytes(VOCAB, KV, 64, 32, None)
    assert grown == 800_000 + (32 - 1) * 1000 * 4  # and the compute buffer's rows: a 32-token ubatch's, not one


def test_logits_beyond_the_reservation_are_refused_with_the_numbers_when_memory_cannot_hold_them(cgroup_v1_limit):
    # 800,000 bytes and a 32-token ubatch's rows in the compute buffer, 128,000: within the 1 MiB left
    memory_budget.check_logits_fit(VOCAB, 100, reserved=0, spare=10 * MIB, n_ubatch=32)
    with pytest.raises(InvalidOptionError) as refused:
        memory_budget.check_logits_fit(VOCAB, 200, reserved=0, spare=10 * MIB, n_ubatch=32)  # 1.728 MB
    assert str(refused.value) == (
        "not enough memory for the logits of 200 tokens: they take 1.65 MiB (the result, llama.cpp's output "
        "buffer and its compute buffer's rows, 1000 f32 each a token), and the run left 10.00 MiB beside the "
        "expert cache at load (1.00 MiB available under the cgroup v1 memory limit of 2.00 MiB with 1.00 MiB in use now): load the model with "
        "n_logits=200 (room kept for them beside the expert cache), or ask for fewer tokens")
    memory_budget.check_logits_fit(VOCAB, 200, reserved=200, spare=0, n_ubatch=32)  # counted at load


def test_logits_are_refused_when_the_expert_cache_took_the_room_even_before_it_filled(cgroup_v1_limit):
    # the memory available now still holds the part of an auto cache not filled yet; the budget
    # gave it to the cache, and it takes it as it fills (a child killed by the kernel showed it)
    with pytest.raises(InvalidOptionError, match="the run left 0 B beside the expert cache at load"):
        memory_budget.check_logits_fit(VOCAB, 100, reserved=0, spare=0, n_ubatch=32)


def test_the_spare_memory_is_the_room_less_the_expert_cache():
    room = 8 * GIB - 1 * GIB - 1 * GIB - ALLOWANCE
    assert memory_budget.spare_bytes(2 * GIB, 1 * GIB, 1 * GIB, available=8 * GIB) == room - 2 * GIB
    assert memory_budget.spare_bytes(0, 1 * GIB, 1 * GIB, available=8 * GIB) == room


def test_the_predictors_stacked_routers_are_in_the_context_from_two_layers_ahead():
    # Qwen3-30B-A3B, 48 layers, two ahead: 46 x 2 + 1 stacked copies, and the 48 routers read as
    # F32 to make them, of 2048 x 128 f32 (1 MiB) each
    assert memory_budget.predictor_bytes(QWEN3, 2) == (93 + 48) * MIB
    assert memory_budget.predictor_bytes(QWEN3, 1) == 0  # the next layer's own router
    grown = (memory_budget.context_bytes(QWEN3, KV, 4096, 512, None, predictor_depth=2)
             - memory_budget.context_bytes(QWEN3, KV, 4096, 512, None))
    assert grown == 141 * MIB



def test_a_limit_set_on_a_parent_cgroup_bounds_the_run_as_its_own_would(tmp_path):
    """A limit on the group above the process's (a container's, a systemd slice's) was not read: the
    run sized its experts by the machine's memory and the kernel killed it, without a word."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from pyedgemoe.bench.runner import BenchmarkError, check_cgroup_v1, memory_cgroup
    try:
        check_cgroup_v1()
    except BenchmarkError as e:
        pytest.skip(str(e))
    demo = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"
    with memory_cgroup(64 * MIB) as parent:
        child = parent / "run"
        child.mkdir()
        try:
            run = subprocess.run([sys.executable, "-m", "pyedgemoe", "run", str(demo), "-p", "Once upon a time",
                                  "-n", "4", "--expert-cache", "100%"], capture_output=True, text=True, timeout=120,
                                 preexec_fn=lambda: (child / "cgroup.procs").write_text(str(os.getpid())))
        finally:
            child.rmdir()
    assert run.returncode == 1, (run.returncode, run.stderr)
    assert run.stderr.strip().splitlines()[-1].startswith("error: not enough memory"), run.stderr
    assert "under the cgroup v1 memory limit of 64.00 MiB" in run.stderr
