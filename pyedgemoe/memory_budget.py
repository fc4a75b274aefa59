"""Sizes of the expert cache: parsing `--expert-cache`, choosing one for "auto", and refusing
one that cannot fit.

What a run needs beside the memory it already uses: the expert cache (its budget; nothing when
every expert is resident, as the file is mapped and the page cache can drop experts), the
non-expert weights, the context (llama.cpp's KV cache and compute buffer, ggml-cpu's work buffer,
the vocabulary tables and the logits asked for at once, computed from the model's shape and the
context settings: context_bytes) and a small allowance for what else the process grows by (RUN_ALLOWANCE_BYTES),
each calibrated by measurement. The memory available: MemAvailable, or what is left under a
cgroup memory limit if one is set. "auto" keeps every expert resident when they fit with the
rest; near fit, for experts the CPU repacks, it leaves them in the mapped file (MAPPED); otherwise
it gives the experts what is left. An explicit size fits, or is refused with the numbers; with a
trailing `~` ("up to": `60%~`, `4GiB~`) it is reduced to what "auto" would leave.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.sysmem import format_bytes, memory_stat, own_memory_cgroups, parse_size

# What a run grows by beside the weights, the expert cache and context_bytes(): Python's objects,
# the sampler, thread stacks, direct reads' bounce buffers and the residency's bookkeeping.
# Measured as peak RSS minus RSS before Engine() minus the buffers llama.cpp reports
# (llama_get_memory_breakdown), the expert pools, the logits asked for, and context_bytes()'s
# estimates of the work buffer and the vocabulary, on a 500-token prompt with all logits and then
# 16 generated tokens (docs/expert-residency.md, "Budget: what a run needs"): -5 to 6 MiB on the
# tiny test models, the demo model, the test_memory_* models and the 7-9 GB OLMoE and Qwen3
# geometries.
RUN_ALLOWANCE_BYTES = 16 * 1024**2
# What measuring a context takes (context_memory: llama.cpp builds the model's graph and reserves
# its scheduler without the weights), 24 MiB on the demo model: the room checked before it
MEASURING_BYTES = 32 * 1024**2
# auto rounds the expert cache it gives down to a multiple of this: the room it measures moves by
# a few hundred KiB from run to run (the process's own pages, the page cache), and with LOW copies
# a cache of another size decodes other tokens (docs/benchmarks.md, "Prefetching with LOW copies").
AUTO_CACHE_STEP_BYTES = 16 * 1024**2
# llama.cpp's vocabulary tables per token (text, score, the text-to-id map, BPE merge ranks) and
# the sampler's candidates: the growth at load went from 20 to 55 MiB between the 50,432-token
# and the 151,936-token vocabularies of the OLMoE and Qwen3 geometries, 350 bytes a token.
VOCABULARY_TOKEN_BYTES = 384
# The host tier's margin beside a GPU runtime's own host memory (devices.host_cache_bytes; not
# measured with a GPU yet). The CPU budget uses context_bytes() and RUN_ALLOWANCE_BYTES instead.
RESERVE_SLACK_BYTES = 384 * 1024**2
ACTIVATION_BYTES = 4  # llama.cpp computes its intermediates in f32
KV_CELL_MULTIPLE = 256  # llama.cpp pads n_ctx (and each sequence's share of it) to a multiple of this
UP_TO = "~"  # a trailing "~" on a size: that much, or what fits if less
# expert_cache "mmap": no expert cache; the experts are computed from the mapped file, as llama.cpp
# does, without repacked copies (--no-repack), so the page cache holds what memory allows; the
# other weights are read into memory (Engine._load_model).
MAPPED = "mmap"
MAPPED_NOTE = "the experts stay in the mapped file, the other weights in memory, and the page cache holds what fits"
# "auto" near fit: when the page cache could hold the experts (of types the CPU repacks) beside the
# non-expert weights it reads, MAPPED. The page cache gets the memory an expert cache would get
# (which has the input embedding's rows no token reads, ModelInfo.cold_embedding_bytes: they stay
# mapped beside either), plus the context's reserve (llama.cpp's KV cache and compute buffer take
# pages as they are written, so until the context fills the page cache has those too). Measured on
# the Qwen3-30B-A3B geometry (Q4_K experts), a cache against the mapped file under the same cgroup
# cap (docs/benchmarks.md, "Near fit again", "Near fit, the embedding's share" and "The embedding's
# rows beside a cache"): with the page cache's share so counted at 96-97.5 % a cache decoded 2.6x
# and 1.9x the mapped file; at 103 %, 0.6-0.8x. A page cache even a little short of the experts a
# token sweeps through evicts each just before its next use. Experts of types not repacked (the
# OLMoE geometry's Q8_0) cache faster: no mapping for them.
NEAR_FIT_MAPPED_SHARE = 1.0


# The memory a run may use, as the functions below take it: bytes (a GPU's free memory), what
# available_memory() returned (bytes, where they come from), or None: available_memory() now.
Available = int | tuple[int, str] | None


def available_memory() -> tuple[int, str]:
    """(what this process can still use, where that number comes from): MemAvailable, capped by
    the room under each memory cgroup limit on it (its own group's, and those of the groups above
    it): the limit minus what is in use there, less the clean page cache charged to it, which the
    kernel drops when the group needs room (as MemAvailable counts it; a previous run's cached file
    would otherwise look like memory in use)."""
    available = None
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        raise OSError("no MemAvailable in /proc/meminfo")
    where = "according to MemAvailable"
    files = {"cgroup v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_"),  # prefix: the group's
             "cgroup v2": ("memory.max", "memory.current", "")}                         # and its descendants'
    for name, group in own_memory_cgroups():  # its own group's limit, or one set above it (a parent's)
        limit_file, usage_file, prefix = files[name]
        try:
            limit_text = (group / limit_file).read_text().strip()
            if limit_text == "max":
                continue
            limit, usage = int(limit_text), int((group / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        droppable = min(usage, _clean_page_cache(group / "memory.stat", prefix))
        if 0 < limit - usage + droppable < available:
            available = limit - usage + droppable
            where = f"under the {name} memory limit of {format_bytes(limit)} with {format_bytes(usage - droppable)} in use"
            if droppable:
                where += f" (and {format_bytes(droppable)} of page cache it can drop)"
    return available, where


def _clean_page_cache(stat_file: Path, prefix: str) -> int:
    """The file pages a cgroup's memory.stat counts, less those dirty or under writeback and those
    mapped (0 when it cannot be read). Mapped pages are in use (the interpreter's and its
    libraries' code, when charged to this group): dropped, they are read back at once. v1 names them
    total_active_file ... total_dirty, total_mapped_file; v2 active_file ... file_dirty, file_mapped."""
    try:
        stat = memory_stat(stat_file)
        value = (lambda key: stat.get(prefix + key, 0))
        if prefix:
            in_use = value("dirty") + value("writeback") + value("mapped_file")
        else:
            in_use = value("file_dirty") + value("file_writeback") + value("file_mapped")
        return max(0, value("active_file") + value("inactive_file") - in_use)
    except (OSError, ValueError):
        return 0


# the machine's own account, whatever a plan is given as available (tests give plans other numbers)
_room_now = available_memory


def available_memory_bytes() -> int:
    """What this process can still use (available_memory's bytes)."""
    return available_memory()[0]


def _shape(metadata: dict):
    """value(key, default): the model's `{architecture}.key` as an int (the largest of per-layer values)."""
    arch = str(metadata.get("general.architecture", ""))

    def value(key: str, default: int = 0) -> int:
        v = metadata.get(f"{arch}.{key}", default)
        if isinstance(v, (list, tuple)):  # per-layer values
            v = max(v, default=default)
        return int(v) if isinstance(v, (int, float)) else default
    return value


def _n_vocab(metadata: dict) -> int:
    """The vocabulary's size: `{architecture}.vocab_size`, else the length of tokenizer.ggml.tokens."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    listed = tokens.get("array_length", 0) if isinstance(tokens, dict) else len(tokens or ())
    return _shape(metadata)("vocab_size") or listed


def _kv_widths(metadata: dict) -> tuple[int, int]:
    """(K width, V width) of one layer's cache per position: KV heads x the key / value head size."""
    value = _shape(metadata)
    n_head = value("attention.head_count", 1) or 1
    n_head_kv = value("attention.head_count_kv", n_head) or n_head
    head_dim = value("embedding_length") // n_head
    return (n_head_kv * value("attention.key_length", head_dim), n_head_kv * value("attention.value_length", head_dim))


def training_context(metadata: dict) -> int:
    """The context the model was trained with (`{architecture}.context_length`; 0: not stated)."""
    return _shape(metadata)("context_length")


def context_positions(metadata: dict, n_ctx: int, n_seq_max: int = 1) -> int:
    """The positions each of n_seq_max sequences gets of a context of n_ctx tokens (0: the training
    context), as llama.cpp pads them (_seq_positions)."""
    return _seq_positions(metadata, n_ctx, n_seq_max)


def _seq_positions(metadata: dict, n_ctx: int, n_seq_max: int) -> int:
    """What one sequence attends to: its stream of the padded context, itself padded, as llama.cpp
    splits the context between n_seq_max sequences."""
    return _padded(_cells(metadata, n_ctx) // max(1, n_seq_max))


def _padded(n: int) -> int:
    """n rounded up to a multiple of KV_CELL_MULTIPLE, as llama.cpp pads a context."""
    return -(-n // KV_CELL_MULTIPLE) * KV_CELL_MULTIPLE


def _context(metadata: dict, n_ctx: int) -> int:
    """n_ctx, or for 0 the training context."""
    return n_ctx or _shape(metadata)("context_length", 4096)


def _cells(metadata: dict, n_ctx: int) -> int:
    """The context llama.cpp allocates: n_ctx (0: the training context), padded."""
    return _padded(_context(metadata, n_ctx))


def ubatch_tokens(metadata: dict, n_ctx: int, n_ubatch: int) -> int:
    """The tokens of llama.cpp's largest ubatch: n_ubatch, no more than n_ctx (0: the training
    context), as a causal model's batch is limited by the context."""
    return min(n_ubatch, _context(metadata, n_ctx))


class _Graph(NamedTuple):
    """The sizes of one layer's graph that its buffers scale with."""
    positions: int  # what one token attends to
    n_embd: int
    n_head: int
    width: int  # the widest hidden row: n_embd, Q (heads x key size) or the attention output
    kv_width: int  # one layer's K + V per position
    n_vocab: int
    n_ff: int  # a dense layer's FFN
    n_ff_exp: int
    n_ff_shexp: int  # the shared experts' FFN (0: none)
    n_expert: int
    n_expert_used: int


def _graph(metadata: dict, n_ctx: int, n_seq_max: int) -> _Graph:
    value = _shape(metadata)
    n_embd = value("embedding_length")
    n_head = value("attention.head_count", 1) or 1
    head_dim = n_embd // n_head
    n_ff = value("feed_forward_length")
    n_ff_exp = value("expert_feed_forward_length") or n_ff
    return _Graph(
        positions=_seq_positions(metadata, n_ctx, n_seq_max), n_embd=n_embd, n_head=n_head,
        width=max(n_embd, n_head * value("attention.key_length", head_dim),
                  n_head * value("attention.value_length", head_dim)),
        kv_width=sum(_kv_widths(metadata)), n_vocab=_n_vocab(metadata), n_ff=n_ff, n_ff_exp=n_ff_exp,
        n_ff_shexp=value("expert_shared_feed_forward_length") or value("expert_shared_count") * n_ff_exp,
        n_expert=value("expert_count"), n_expert_used=value("expert_used_count"))


def compute_buffer_bytes(metadata: dict, n_ctx: int, n_ubatch: int, flash_attn: bool | None,
                         n_seq_max: int = 1, n_outputs: int | None = None) -> int:
    """An upper bound on llama.cpp's compute buffer: the graph's f32 intermediates for the worst case
    it reserves, one ubatch of n_ubatch tokens against every position a sequence can attend to
    (n_ctx, or n_ctx / n_seq_max: with several sequences each has its own stream of the cache), all
    of them outputs. ggml-alloc reuses a tensor's memory after its last consumer, so what counts is
    the largest stage plus what lives through all of them:
      the KQ mask, an input (positions x n_ubatch; f32, or f16 with flash attention);
      a few rows of hidden state (the residual stream, its norm, Q, K, V, the attention output:
        8 x n_ubatch x the widest of n_embd and the Q and V widths);
      the largest of the attention scores without flash attention (positions x n_ubatch x heads;
        the softmax runs in place) with a copy of one layer's K and V (MLA's V is copied), the FFN
        (a dense layer's gate, up and product, 3 x n_ff; a MoE layer's router logits, probabilities
        and order, 3 x n_expert, then per selected expert gate, up, product and down,
        k x (3 x n_ff_exp + n_embd), and shared experts, 3 x their n_ff) and the output logits
        (n_vocab per output).
    n_outputs: the outputs a ubatch computes, at most (None: every token, the worst case llama.cpp
    allocates). Host memory is taken page by page as it is first written, and a run that outputs
    fewer rows never writes the rest of the logits stage: generating, llama.cpp's 304 MiB buffer
    of the Qwen3 geometry (n_ctx 4096) had 86 MiB resident after a 500-token prompt.
    flash_attn None: llama.cpp's auto, which turns it on where the device has it, as the CPU does.
    Calibrated against llama_get_memory_breakdown (docs/expert-residency.md, "Budget: what a run
    needs"): at or above it on every model and setting measured, by at most 1.65x on the demo model,
    1.41x on the 7-9 GB geometries and 2.2 MiB on the tiny test models."""
    g = _graph(metadata, n_ctx, n_seq_max)
    n_ubatch = ubatch_tokens(metadata, n_ctx, n_ubatch)
    outputs = n_ubatch if n_outputs is None else min(n_outputs, n_ubatch)
    moe = g.n_expert_used * (3 * g.n_ff_exp + g.n_embd) + 3 * g.n_expert + 3 * g.n_ff_shexp if g.n_expert else 0
    if flash_attn is not False:
        mask, scores, kv_copy = 2 * g.positions, 0, 0
    else:
        mask, scores, kv_copy = ACTIVATION_BYTES * g.positions, g.positions * g.n_head, g.positions * g.kv_width
    largest_stage = ACTIVATION_BYTES * max(n_ubatch * scores + kv_copy, n_ubatch * max(3 * g.n_ff, moe),
                                           outputs * g.n_vocab)
    return int(n_ubatch * (mask + ACTIVATION_BYTES * 8 * g.width) + largest_stage)


def cpu_work_bytes(metadata: dict, n_ctx: int, n_ubatch: int, flash_attn: bool | None, n_seq_max: int = 1) -> int:
    """ggml-cpu's work buffer, which llama_get_memory_breakdown leaves out: a matrix product's f32
    input converted to the type the weights' dot product takes (at most 2 bytes a value, f16's;
    none for f32 weights). Its largest: the MoE down projection's input (k x n_ff_exp a token), a
    dense layer's (n_ff), or without flash attention the scores times the f16 V cache (positions x
    heads). Measured as RSS beyond the breakdown (docs/expert-residency.md, "Budget: what a run
    needs"): 12 MiB on f16 experts of n_ff 1536, top-8, and 12 MiB more without flash attention at
    2048 positions x 8 heads, where this says 12 and 16."""
    g = _graph(metadata, n_ctx, n_seq_max)
    n_ubatch = ubatch_tokens(metadata, n_ctx, n_ubatch)
    scores = 0 if flash_attn is not False else g.positions * g.n_head
    return 2 * n_ubatch * max(g.n_expert_used * g.n_ff_exp, g.n_ff, g.width, scores)


def vocabulary_bytes(metadata: dict) -> int:
    """The model's vocabulary tables in memory: its tokens x VOCABULARY_TOKEN_BYTES."""
    return _n_vocab(metadata) * VOCABULARY_TOKEN_BYTES


def logits_bytes(metadata: dict, n_tokens: int) -> int:
    """What the logits of n_tokens tokens asked for at once (Engine.logits, perplexity) hold at their
    peak: two f32 rows of n_vocab per token, the result and either llama.cpp's output buffer (a
    ubatch's rows; it keeps its largest size) or, one token per step, the rows gathered before
    they are stacked. 0 tokens: nothing beyond what generation holds."""
    return 2 * n_tokens * _n_vocab(metadata) * ACTIVATION_BYTES


def repack_staging_bytes(largest_projection: int, io_threads: int) -> int:
    """The staging buffers of reads into repacked expert cache slots (native/src/expert-store.cpp):
    ggml converts a repacked tensor whole, so each thread that reads one (io_threads loaders and as
    many prefetch threads) keeps a buffer of the largest projection's bytes for the run: 252 MiB at
    Mixtral's Q4_0 projections of 31.5 MiB and the default 4 reads in flight."""
    return 2 * io_threads * largest_projection


def predictor_bytes(metadata: dict, depth: int) -> int:
    """HOBBIT's predictor looking `depth` MoE layers ahead (--prefetch hobbit): from 2 on, each layer
    keeps F32 copies of the routers of the layers after it, stacked, made at load from every router
    read as F32 (one layer ahead uses the model's own router: nothing). Counts every block as a MoE
    layer (an upper bound)."""
    if depth < 2:
        return 0
    value = _shape(metadata)
    n_layers = value("block_count")
    ahead = sum(min(depth, n_layers - 1 - i) for i in range(n_layers))
    return (ahead + n_layers) * value("embedding_length") * value("expert_count") * ACTIVATION_BYTES


def context_bytes(metadata: dict, kv_bytes: int, n_ctx: int, n_ubatch: int, flash_attn: bool | None,
                  n_seq_max: int = 1, n_logits: int = 0, predictor_depth: int = 0,
                  every_output: bool = False) -> int:
    """What running the model needs beside its weights and the expert cache, from its shape and the
    context settings: llama.cpp's KV cache and recurrent states (kv_bytes, as llama.cpp measures them:
    load_plan.context_memory_bytes), its compute buffer, ggml-cpu's work buffer, the
    vocabulary tables, the logits of n_logits tokens at once and the predictor's router copies
    (compute_buffer_bytes, cpu_work_bytes, vocabulary_bytes, logits_bytes,
    predictor_bytes). metadata: the GGUF key-values; n_ctx 0 = the training context; n_ubatch:
    tokens per llama_decode (an Engine's n_batch: its ubatch is no larger); n_seq_max: sequences
    decoded together (an Engine's n_parallel); predictor_depth: --prefetch hobbit's depth (else 0).
    The compute buffer counts a ubatch's outputs of one token per sequence or n_logits, what host
    memory a run writes; every_output: all of its tokens, what llama.cpp allocates (a GPU's memory
    is taken whole)."""
    n_outputs = None if every_output else max(n_seq_max, n_logits)
    return (kv_bytes
            + compute_buffer_bytes(metadata, n_ctx, n_ubatch, flash_attn, n_seq_max, n_outputs)
            + cpu_work_bytes(metadata, n_ctx, n_ubatch, flash_attn, n_seq_max) + vocabulary_bytes(metadata)
            + logits_bytes(metadata, n_logits) + predictor_bytes(metadata, predictor_depth))


def check_logits_fit(metadata: dict, n_tokens: int, reserved: int, spare: int, n_ubatch: int) -> None:
    """Refuses (InvalidOptionError, with the numbers) logits of n_tokens tokens at once that the
    memory cannot hold: logits_bytes, and the compute buffer's logits rows of a ubatch of n_ubatch
    tokens (ubatch_tokens), which generation leaves unwritten; those of up to `reserved` tokens
    were counted at load (context_bytes' n_logits). spare: what the run's budget left beside the
    expert cache at load (spare_bytes);
    the memory available now can be less (other processes), never more for this run: an expert
    cache takes its memory as it fills, so the room it has not filled yet is not there to take."""
    if n_tokens <= reserved:
        return
    need = logits_bytes(metadata, n_tokens) + ACTIVATION_BYTES * _n_vocab(metadata) * min(n_tokens, n_ubatch)
    available, where = available_memory()
    if need <= min(spare, available):
        return
    raise InvalidOptionError(
        f"not enough memory for the logits of {n_tokens} tokens: they take {format_bytes(need)} (the result, "
        f"llama.cpp's output buffer and its compute buffer's rows, {_n_vocab(metadata)} f32 each a token), "
        f"and the run left "
        f"{format_bytes(max(0, spare))} beside the expert cache at load ({_available_text(available, where)} now): "
        f"load the model with n_logits={n_tokens} (room kept for them beside the expert cache), or ask for fewer tokens")


def spare_bytes(cache_bytes: int, non_expert_bytes: int, context: int, available: Available = None) -> int:
    """What a run leaves unused of the memory available (available_memory() when None) beside the
    non-expert weights, the context, the allowance and an expert cache of cache_bytes (0: none, or
    every expert resident in the mapped file, which the page cache can drop)."""
    return room_for_experts_bytes(non_expert_bytes, context, _measured(available)[0]) - cache_bytes


def repack_fits(expert_bytes: int, repacked_expert_bytes: int, non_expert_bytes: int, context: int,
                available: int) -> bool:
    """Whether every expert resident with repacked copies loads without thrashing: the load reads
    the experts from the mapped file through the page cache while their repacked copies fill
    anonymous memory, so the room for experts (room_for_experts_bytes) must hold both. Measured on
    the Qwen3-30B-A3B geometry (Q4_K) under a cgroup cap of 110 % of the file: with repacked copies
    ours loaded in 10.6-10.7 s, stock llama.cpp --no-repack in 3.7 s, both with repacked copies and
    no cap in 7 s (docs/benchmarks.md, "The whole range again")."""
    room = room_for_experts_bytes(non_expert_bytes, context, available)
    return repacked_expert_bytes == 0 or room >= expert_bytes + repacked_expert_bytes


def room_for_experts_bytes(non_expert_bytes: int, context: int, available: int) -> int:
    """What an expert cache may take: the available memory less the non-expert weights, the context
    (context_bytes()) and RUN_ALLOWANCE_BYTES. Not positive: those alone do not fit."""
    return available - non_expert_bytes - context - RUN_ALLOWANCE_BYTES


def _measured(available: Available) -> tuple[int, str]:
    """(bytes, where they come from): available_memory() measured now for None, as given for its
    tuple, and bytes as given (e.g. a GPU's free memory) with nothing to say where from."""
    if available is None:
        return available_memory()
    return available if isinstance(available, tuple) else (available, "")


def _available_text(available: int, where: str) -> str:
    return f"{format_bytes(available)} available" + (f" {where}" if where else "")


def check_room_to_measure() -> None:
    """InvalidOptionError where there is less room than measuring the context takes: a cgroup's cap
    that small would end the process (the OOM killer) before a load's own check could refuse."""
    available, where = _room_now()
    if available < MEASURING_BYTES:
        raise InvalidOptionError(f"not enough memory: measuring the model's context takes about "
                                 f"{format_bytes(MEASURING_BYTES)}, and {_available_text(available, where)}")


def _beside_the_cache(non_expert_bytes: int, context: int) -> str:
    """What the run needs beside the expert cache, as the messages list it."""
    return (f"{format_bytes(non_expert_bytes)} of non-expert weights, {format_bytes(context)} for the context "
            f"(KV cache, compute buffers, vocabulary, logits) and {format_bytes(RUN_ALLOWANCE_BYTES)} of allowance")


def _no_room_error(non_expert_bytes: int, context: int, available: int, where: str) -> InvalidOptionError:
    """The refusal when the non-expert weights, the context and the allowance alone do not fit."""
    need = non_expert_bytes + context + RUN_ALLOWANCE_BYTES
    context_room = available - non_expert_bytes - RUN_ALLOWANCE_BYTES
    hint = (f"the context must take less than {format_bytes(context_room)} (a shorter --ctx)" if context_room > 0
            else "the non-expert weights and the allowance alone do not fit")
    return InvalidOptionError(
        f"not enough memory: {_beside_the_cache(non_expert_bytes, context)} need {format_bytes(need)}, and "
        f"{_available_text(available, where)}: {hint}")


def auto_expert_cache(expert_bytes: int, non_expert_bytes: int, context: int, available: Available = None,
                      repacked_expert_bytes: int = 0, cold_bytes: int = 0,
                      minimum_bytes: int = 0) -> tuple[int | str | None, str]:
    """(budget bytes, None for every expert resident, or MAPPED; a sentence saying which and why).
    context: context_bytes() of the context the model will run in. available (Available): the memory the
    model runs in (a GPU's free memory), else available_memory(). repacked_expert_bytes: of the
    experts, those the CPU would repack (ModelInfo.repacked_expert_bytes; 0 on a GPU). cold_bytes: of
    the non-expert weights, those a run mostly never reads, which stay in the mapped file beside an
    expert cache or mapped experts (ModelInfo.cold_embedding_bytes; 0 where they are read into memory).
    minimum_bytes: the smallest cache the runtime takes (ModelInfo.minimum_cache_bytes; 0 on a GPU,
    whose budget is checked there): below it the experts stay in the mapped file, as llama.cpp's."""
    available, where = _measured(available)
    reserve = context + RUN_ALLOWANCE_BYTES
    gib = 1024**3
    # every expert resident is llama.cpp's own mapped file, which it reads whole at load: the cold
    # rows count there
    if expert_bytes <= room_for_experts_bytes(non_expert_bytes, context, available):
        return None, (f"expert cache auto: all experts resident ({expert_bytes / gib:.2f} GiB of experts fit "
                      f"in {available / gib:.2f} GiB available)")
    held = non_expert_bytes - cold_bytes  # the cold rows stay mapped
    room = room_for_experts_bytes(held, context, available)
    if room <= 0:
        raise _no_room_error(held, context, available, where)
    mapped_share = (room + context) / expert_bytes  # the page cache's, until the context fills
    if mapped_share >= NEAR_FIT_MAPPED_SHARE and 2 * repacked_expert_bytes >= expert_bytes:
        return MAPPED, (f"expert cache auto: {MAPPED}, {MAPPED_NOTE}, without repacked copies: it can hold "
                        f"{min(mapped_share, 1):.0%} of {expert_bytes / gib:.2f} GiB of experts of a type this CPU "
                        f"repacks until the context fills, a cache {room / expert_bytes:.0%} "
                        f"({available / gib:.2f} GiB available), and this near to a fit the page cache is faster")
    budget = room - room % AUTO_CACHE_STEP_BYTES if room >= AUTO_CACHE_STEP_BYTES else room  # tiny models: all of it
    if budget < minimum_bytes:
        return MAPPED, (f"expert cache auto: {MAPPED}, {MAPPED_NOTE}, as in llama.cpp: the room for a cache, "
                        f"{format_bytes(room)} ({available / gib:.2f} GiB available), is below its minimum of "
                        f"{format_bytes(minimum_bytes)} (one layer's top-k experts)")
    return budget, (f"expert cache auto: {budget / gib:.2f} GiB for {expert_bytes / gib:.2f} GiB of experts "
                    f"({available / gib:.2f} GiB available, {reserve / gib:.2f} GiB reserved for the context "
                    f"and allowance)")


def fit_expert_cache(budget: int, shown: str, up_to: bool, expert_bytes: int, non_expert_bytes: int, context: int,
                     available: Available = None, refuse: bool = True, minimum_bytes: int = 0,
                     most_bytes: int | None = None) -> tuple[int, str | None]:
    """(the budget, or with up_to what fits if less; None, or a sentence saying it was reduced).
    An explicit budget that does not fit beside the non-expert weights, the context and the
    allowance is refused with the numbers (InvalidOptionError); refuse=False leaves that to the
    caller (a GPU's budget: devices.check_fits_device). shown: the value as the user gave it,
    without the "~". Where what fits is below minimum_bytes (the smallest cache that runs), no cache
    is offered but MAPPED. most_bytes: the most the cache's copies take (a budget above it is capped
    there, and checked as that much). A model without experts caches none: only its context is checked."""
    available, where = _measured(available)
    room = room_for_experts_bytes(non_expert_bytes, context, available)
    cache = min(budget, most_bytes or budget) if expert_bytes else 0
    if cache <= room or not (refuse or up_to):
        return budget, None
    if room <= 0:
        raise _no_room_error(non_expert_bytes, context, available, where)
    if room < minimum_bytes:
        raise InvalidOptionError(
            f"expert cache {shown}{UP_TO if up_to else ''} does not fit: {_available_text(available, where)}, less "
            f"{_beside_the_cache(non_expert_bytes, context)}, leaves {format_bytes(room)}, below the smallest cache "
            f"that runs ({format_bytes(minimum_bytes)}); --expert-cache {MAPPED}: {MAPPED_NOTE}")
    if up_to:
        return room, (f"expert cache {shown}{UP_TO} reduced to what fits: {format_bytes(room)} instead of "
                      f"{format_bytes(budget)}, for {format_bytes(expert_bytes)} of experts "
                      f"({_available_text(available, where)}, less {_beside_the_cache(non_expert_bytes, context)})")
    mib = 1024**2
    largest = f"{room // mib}MiB" if room >= mib else str(room)
    raise InvalidOptionError(
        f"expert cache {shown} ({format_bytes(cache)}{', what its copies take' if cache < budget else ''}) does not "
        f"fit: it needs {format_bytes(cache)} + {_beside_the_cache(non_expert_bytes, context)} = "
        f"{format_bytes(cache + non_expert_bytes + context + RUN_ALLOWANCE_BYTES)}, and "
        f"{_available_text(available, where)}; the largest expert cache that fits is {format_bytes(room)} "
        f"(--expert-cache {largest}, or {shown}{UP_TO} for what fits)")


def is_share(value) -> bool:
    """Whether value is an expert cache's share of the experts in range ("25%", "60%~")."""
    amount = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*%", value.strip().removesuffix(UP_TO).strip()) \
        if isinstance(value, str) else None
    return amount is not None and 0 < float(amount.group(1)) <= 100


def _out_of_range(value, expert_bytes: int) -> InvalidOptionError:
    return InvalidOptionError(
        f"expert_cache {value!r} is out of range: give a share above 0% and at most 100% of the experts "
        f"({format_bytes(expert_bytes)}), or a size above 0 (the experts' size or more holds every one)")


def parse_expert_cache(value: str | int | None, expert_bytes: int, non_expert_bytes: int,
                       context: int, available: Available = None, refuse: bool = True,
                       repacked_expert_bytes: int = 0, cold_bytes: int = 0,
                       minimum_bytes: int = 0, most_bytes: int | None = None) -> tuple[int | str | None, str]:
    """(bytes of the expert cache, None = every expert resident, or MAPPED; a sentence for the user).
    value: None / "auto", "mmap" (MAPPED), bytes (int), "300MiB", "4GiB", "1.5GB", or "50%" of the
    expert bytes; a size with a trailing "~" is that much or what fits, if less. context:
    context_bytes(). available, repacked_expert_bytes, cold_bytes, minimum_bytes: as for
    auto_expert_cache. A size that does not fit is refused (fit_expert_cache, with most_bytes;
    refuse=False: the caller checks it); so is MAPPED when the non-expert weights and the context do
    not fit."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return auto_expert_cache(expert_bytes, non_expert_bytes, context, available, repacked_expert_bytes, cold_bytes,
                                 minimum_bytes)
    held = non_expert_bytes - cold_bytes  # beside a cache or mapped experts (the cold rows stay mapped)
    if isinstance(value, str) and value.strip().lower() == MAPPED:
        fit_expert_cache(0, MAPPED, False, expert_bytes, held, context, available)
        return MAPPED, f"expert cache {MAPPED}: {MAPPED_NOTE} (no repacked copies)"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidOptionError(f"expert_cache must be bytes, a size like '4GiB', a percentage, 'auto' or '{MAPPED}', "
                                 f"got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise _out_of_range(value, expert_bytes)
        budget, note = fit_expert_cache(value, str(value), False, expert_bytes, held, context, available, refuse,
                                        minimum_bytes, most_bytes)
        return budget, note or f"expert cache: {value} bytes"
    shown = value.strip()
    up_to = shown.endswith(UP_TO)
    shown = shown.removesuffix(UP_TO).strip()
    amount = re.fullmatch(r"(-?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*|%)", shown)
    if amount and (float(amount.group(1)) <= 0 or (amount.group(2) == "%" and float(amount.group(1)) > 100)):
        raise _out_of_range(value, expert_bytes)
    try:
        budget = parse_size(shown, percent_of=expert_bytes)
    except ValueError:
        if amount:  # a share too small to be a byte
            raise _out_of_range(value, expert_bytes) from None
        raise InvalidOptionError(
            f"invalid expert_cache {value!r}: use bytes, a size like '300MiB' or '4GiB', a percentage like '50%', "
            f"'auto', '{MAPPED}', or a size with a trailing '{UP_TO}' for up to that much ('60%{UP_TO}': what fits if less)"
        ) from None
    budget, note = fit_expert_cache(budget, shown, up_to, expert_bytes, held, context, available, refuse,
                                    minimum_bytes, most_bytes)
    return budget, note or f"expert cache: {budget / 1024**2:.1f} MiB for {expert_bytes / 1024**2:.1f} MiB of experts"
