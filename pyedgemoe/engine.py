"""Engine: the friendly, documented face of pyedgemoe (as llama_cpp.Llama is for llama.cpp).

    from pyedgemoe import Engine
    with Engine("model.gguf", n_ctx=4096) as eng:
        for piece in eng.generate("def fib(n):", max_tokens=64, stream=True):
            print(piece, end="")
"""
from __future__ import annotations

import functools
import numbers
import os
import sys
import time
import weakref
from typing import Callable, Iterator

import numpy as np

from pyedgemoe import _native, completions, embeddings, kv_overrides, rope_scaling
from pyedgemoe.batch import Batcher
from pyedgemoe.calibration.sidecar import is_low_experts
from pyedgemoe.chat_template import render_chat
from pyedgemoe.decoder import Decoder, top_probability  # noqa: F401 - top_probability: imported from here too
from pyedgemoe.errors import ContextOverflowError, InvalidOptionError, ModelLoadError, RemoteDeviceError
from pyedgemoe.expert_options import ExpertOptions
from pyedgemoe.expert_summary import expert_summary
from pyedgemoe.completions import TextRun, stop_list
from pyedgemoe.generation import Generation, GenerationStats, SamplingParams, SequenceState, as_token_ids
from pyedgemoe.load_plan import LoadOptions, LoadPlan, capped_ubatch, check_drafts, context_error, plan_for, \
    serving_text
from pyedgemoe.memory_budget import check_logits_fit
from pyedgemoe.native_exit import close_at_exit
from pyedgemoe.sequence_turn import SequenceTurn
from pyedgemoe.threads import ThreadGovernor, cpu_load
from pyedgemoe.vocabulary import Vocabulary

__all__ = ["Engine", "GenerationStats", "SamplingParams"]


def _close_parts(batcher: Batcher | None, decoder: Decoder) -> None:
    if batcher is not None:
        batcher.close()
    decoder.close()


class Engine(Vocabulary):
    """A GGUF model loaded into pyedgemoe's build of llama.cpp, with one context; its vocabulary's
    methods (tokenize, detokenize, token_bos, metadata, ...) are pyedgemoe.vocabulary's.

    n_ctx: context window in tokens (0 = the model's training context).
    n_threads / n_threads_batch: threads for decode / prefill (default: the physical cores this
        process may run on, within its cgroup's CPU quota, pyedgemoe.threads; the decode leaves one of them to the expert reads when prefetch, left unset, is on:
        expert_options.auto_prefetch; the core goes back to the decode if prefetching stops itself).
    n_batch: tokens per llama_decode call during prefill; n_ubatch: tokens llama.cpp computes at
        once, splitting each call's batch (llama.cpp's micro-batch; at most n_batch, 0 for n_batch, and
        fewer where the expert cache needs it: a ubatch's experts of one layer all in slots at once).
    seed: default sampling seed (None or -1, as in llama.cpp: random).
    flash_attn: True/False, or None to let llama.cpp decide (its default).
    kv_type: KV cache element type, "f16" (llama.cpp's default), "f32", "q8_0", ...
    expert_cache: bytes of memory for routed experts: an int, "300MiB", "4GiB", "50%" (of the expert
        bytes), or None / "auto" (every expert resident when the model fits in the memory available,
        else a cache of what is left after the non-expert weights, the context's buffers and a small
        allowance; near fit, experts the CPU repacks stay in the mapped file instead). A size that
        cannot fit is refused (InvalidOptionError); a trailing "~" ("60%~", "4GiB~") takes what fits
        if less. With a budget the experts stay in the file and are read into a cache when routed to
        (docs/expert-residency.md); one with room for every expert ("100%") holds every expert in
        HIGH unless LOW copies are asked for (low_precision, skip, a lossy system), and a larger one
        is capped (expert_cache_note says so). A share outside (0%, 100%] is refused. "mmap": no
        expert cache, the experts are computed from the mapped file as llama.cpp does, without
        repacked copies, and the page cache holds what fits; the other weights are read into
        memory (but the input embedding's rows, where it is not also the output).
    expert_options: how the cache serves experts, one ExpertOptions; its options can also be
        keyword arguments of their own (`io="buffered", prefetch="hobbit"`), which go on top. The
        options (pyedgemoe.expert_options.OPTION_NAMES; `pyedgemoe run --help` lists them with
        their defaults): io, io_threads (reads in flight), fill_cache (read experts at load, most
        routed first when calibrated; with fill_background, the default, while the prompt and the
        first tokens run; with a GPU, a host tier that holds every expert copy is read whole at
        load first), cache_policy and policy_weights (HOBBIT's priority), mixed
        precision (low_precision, skip, t1, t2, low_cache, low_hit, low_from; docs/mixed-precision.md),
        prefetch ("none", "hobbit": HOBBIT's walk prefetch_depth layers ahead, "fate"),
        fate_percentile, fate_extra. Left unset, the calibration sidecar and the model decide
        (expert_options.AUTOMATIC), else their defaults (expert_options.default).
    trace_routing: record every MoE layer's routing for calibration (record_routing): the expert
        predictor then runs even without prefetch.
    Where the model runs, options of the same schema (keyword arguments, or in expert_options):
    mode: "cpu", "gpu", "coop", "split" or "auto" (the default where the build has a GPU; docs/gpu.md). With
        a GPU, expert_cache is the GPU's expert budget (auto: from its free memory), non-expert
        weights and the KV cache live there too.
    n_gpu_layers: llama.cpp's habit for the mode: 0 is "cpu"; -1 or a layer count, "auto" where the
        build has a GPU (every layer goes there), else the CPU, as llama.cpp runs.
    repack: repacked copies of the weights where llama.cpp's CPU backend makes them (its default;
        False is llama.cpp's --no-repack). None (auto): off where the experts stream through an
        expert cache in host memory or stay in the mapped file (each read would be converted again:
        measured slower in load, prefill and decode, docs/benchmarks.md), or where the copies would
        not fit beside the mapped experts they are read from (memory_budget.repack_fits), on otherwise.
    device: the GPU by ggml's name ("Vulkan0", "CUDA0"); default the first.
    host_cache: the host tier (RAM between the file and the GPU, both precisions; pinned in modes gpu and split): bytes,
        a size, "auto" (every expert copy, or what RAM has free) or 0 (none; coop and split need one).
    n_parallel: sequences that decode together (pyedgemoe.batch; the server's --parallel): up to
        n_parallel generations, from as many threads, run at once, each in n_ctx / n_parallel
        positions, one llama_decode per step for all of them, so experts they share load once.
        With n_parallel=1, threads take turns: a generation holds the sequence from its first token
        to its end, another call waits; a generation this thread left open (streamed, neither
        finished nor closed) that no other thread reads on makes its next one raise EngineBusyError
        (pyedgemoe.sequence_turn).
    system: a seed system's preset of the expert options ("lossless", "hobbit", "edgemoe", "fate",
        "mobile"; pyedgemoe.systems, docs/systems.md); options given explicitly win over it.
        static_precision and prefetch="edgemoe" read the calibration sidecar (`pyedgemoe calibrate
        --system edgemoe`); big_little (MoBiLE) decodes with top-k/2 and redoes low-confidence tokens.
    n_logits: tokens whose logits one call of logits() (perplexity: a chunk) returns: their memory
        is counted at load beside the expert cache (auto leaves room for them; an explicit size must
        fit beside them). logits() of more tokens is refused (InvalidOptionError) when they exceed
        what the budget left beside the expert cache at load or the memory available then.
    draft_model: speculative decoding's drafter for every generation that names none of its own
        (pyedgemoe.speculative; `--spec-type`); refused with MoBiLE's big-little (one token a step).
    verbose: forward llama.cpp's log to stderr. Every decision of the load is made by a pure plan
    (pyedgemoe.load_plan, `plan`, each with its reason; `run --dry-run` prints it); __init__ executes it.
    """

    def __init__(self, model_path: str | os.PathLike, *, n_ctx: int = LoadOptions.n_ctx, n_threads: int | None = None,
                 n_threads_batch: int | None = None, n_batch: int = LoadOptions.n_batch,
                 n_ubatch: int = LoadOptions.n_ubatch, seed: int | None = None,
                 flash_attn: bool | None = None, kv_type: str = LoadOptions.kv_type,
                 expert_cache: str | int | None = None, expert_options: ExpertOptions | None = None,
                 trace_routing: bool = False, system: str | None = None, n_parallel: int = LoadOptions.n_parallel,
                 n_logits: int = LoadOptions.n_logits, draft_model=None, verbose: bool = False, **options):
        load = LoadOptions(n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads_batch, n_batch=n_batch,
                           n_ubatch=n_ubatch, n_parallel=n_parallel, n_logits=n_logits, seed=seed, flash_attn=flash_attn,
                           kv_type=kv_type, expert_cache=expert_cache, system=system, trace_routing=trace_routing,
                           expert_options=(expert_options or ExpertOptions()).with_keywords(options, Engine.__init__))
        self.info, self.plan = plan_for(model_path, load)  # ModelInfo, LoadPlan
        check_drafts(self.plan, draft_model)
        self.draft_model = SamplingParams.of({"draft_model": draft_model}).draft_model  # checked
        self.model_path = self.info.path
        _native.set_verbose(bool(verbose))
        plan = self.plan
        self.system, self.seed, self.n_logits, self.n_parallel = system, plan.seed, plan.n_logits, plan.n_parallel
        self.device, self.repack, self.experts_mapped, self.big_little = plan.device, plan.repack, plan.experts_mapped, \
            plan.big_little
        self._load_model(plan)
        # --mode auto as the residency layer chose it; every expert resident on the GPU is the GPU-centric mode
        self.mode = plan.mode if plan.mode != "auto" else self.expert_residency["mode"] if self.expert_residency else "gpu"
        # a ubatch's experts of one layer must all be in slots at once (docs/expert-residency.md)
        self.n_ubatch = capped_ubatch(plan, self.expert_residency)
        self.threads_note = plan.reasons["threads"]
        if verbose:
            print(f"pyedgemoe: {self.threads_note}", file=sys.stderr)
        # counts left to us follow the machine's load (threads.ThreadGovernor); given ones stay
        self.n_threads, self._n_threads_batch = plan.n_threads, plan.n_threads_batch
        self._reads_core = plan.reads_core  # a core the decode left to the expert reads
        self._governor = ThreadGovernor(plan.n_threads, load=cpu_load()) if plan.governed else None
        try:
            ctx = _native.Context(self._model, n_ctx=plan.n_ctx, n_batch=plan.n_batch, n_ubatch=self.n_ubatch,
                                  n_threads=plan.n_threads, n_threads_batch=plan.n_threads_batch,
                                  flash_attn=plan.flash_attn, kv_type=plan.kv_type, n_seq_max=plan.n_parallel,
                                  loras=list(plan.loras), swa_full=plan.swa_full,
                                  **rope_scaling.context_keywords(plan.expert_options),
                                  **embeddings.context_keywords(plan.expert_options))
        except RuntimeError as e:
            raise context_error(plan.n_ctx, e) from None
        governed = weakref.WeakMethod(self._governed)  # the batcher's thread must not keep the Engine alive
        self._decoder = Decoder(self._model, ctx, plan.n_parallel, lambda *a: governed()(*a), plan.big_little,
                                plan.no_drafts, plan.ctx_checkpoints, plan.checkpoint_bytes, plan.n_ubatch, plan.loras)
        self._turn = SequenceTurn()  # n_parallel=1: the one sequence, for one generation at a time
        self.while_waiting: Callable[[], object] = lambda: None  # run every 10 ms by a thread waiting for it (llama.py)
        self._batcher = Batcher(self._decoder) if plan.n_parallel > 1 else None
        # closed when collected or at exit: else the batcher's thread holds the native objects past teardown (leaks)
        self._closer = close_at_exit(self, _close_parts, self._batcher, self._decoder,
                                     in_forked_child=self._decoder.forked_child)
        self.last_timings = GenerationStats()
        self._totals = GenerationStats()

    def _load_model(self, plan: LoadPlan) -> None:
        """The model, as the plan has it: its experts resident, mapped, or read on demand into an
        expert cache (with the calibration's tables and its fill)."""
        try:
            # the input embedding's rows stay mapped on the CPU beside an expert cache (plan.embedding_mapped)
            self._model = _native.Model(self.model_path, use_mmap=plan.use_mmap, mlock=plan.expert_options["mlock"],
                                        experts_on_demand=plan.offload, device=",".join(plan.layer_devices),
                                        repack=plan.repack, tensor_split=list(plan.tensor_split),
                                        experts_mapped=plan.experts_mapped, embedding_mapped=plan.embedding_mapped,
                                        kv_overrides=kv_overrides.items(plan.expert_options["override_kv"]),
                                        chat_template=plan.expert_options["chat_template"] or "")
            if plan.offload:
                self._model.enable_expert_residency(plan.expert_cache, plan.native_options, plan.trace_routing,
                                                    plan.host_cache_bytes, plan.auto_mode_threads)
                if plan.precision_map is not None:
                    self._model.set_expert_precision_map(dict(plan.precision_map))
                if plan.path_statistics is not None:
                    self._model.set_expert_path_statistics(plan.path_statistics)
                if plan.stand_ins is not None:
                    self._model.set_expert_stand_ins(dict(plan.stand_ins))
                # the host tier first (where it holds every expert): the device's fill uploads from it
                host_fill = self._model.fill_host_tier() if plan.fill != "none" else None
                if plan.fill == "in the background":
                    self._model.fill_expert_cache_in_background(dict(plan.fill_ranking))
                elif plan.fill == "at load":
                    self._model.fill_expert_cache(dict(plan.fill_ranking))
        except (_native.ExpertBudgetError, ValueError) as e:
            raise InvalidOptionError(str(e)) from None
        except RemoteDeviceError:  # a worker lost during the load, by name
            raise
        except RuntimeError as e:
            raise ModelLoadError(str(e)) from None
        self.expert_residency: dict | None = self._model.expert_residency_info() if plan.offload else None
        self.expert_cache_note = plan.expert_cache_note
        if self.expert_residency:
            self.expert_residency["fill_background"] = plan.fill == "in the background"  # as done
            self.expert_residency["host_fill"] = host_fill
            self.expert_cache_note += f"; {serving_text(self.expert_residency, plan)}"
            if self.expert_residency["mode_reason"]:
                print(f"pyedgemoe: {self.expert_residency['mode_reason']}", file=sys.stderr)

    # -- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        """Frees the context and the model; the Engine is unusable afterwards."""
        if getattr(self, "_closer", None) is not None:
            self._closer()
        self._batcher = self._model = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _live(self):
        return self._decoder.live()

    def _live_model(self):
        """The native Model; its vocabulary's methods work in a forked child too (pyedgemoe.native_exit)."""
        self._decoder.live(forked_ok=True)
        return self._model

    def _sequence_turn(self):
        """The one sequence (n_parallel=1), for one call at a time (pyedgemoe.sequence_turn)."""
        return self._turn.held(self.while_waiting)

    def on_sequence(self, seq: int, work):
        """work(the seq-th sequence of the KV cache) once no generation holds it (pyedgemoe.slot_files)."""
        if isinstance(seq, bool) or not isinstance(seq, numbers.Integral) or not 0 <= seq < self.n_parallel:
            raise InvalidOptionError(f"sequence {seq!r} out of range [0, {self.n_parallel})")
        self._live()
        if self._batcher is not None:
            return self._batcher.on_sequence(work, int(seq))
        with self._sequence_turn():
            return work(self._decoder.sequences[0])

    def __reduce__(self):
        raise TypeError("an Engine cannot be pickled (its model and context are native): pickle what save_state "
                        "gives, or the model's path")

    # -- properties (the vocabulary's: Vocabulary) -------------------------------------------------
    @property
    def n_ctx(self) -> int:
        """The positions one generation has: the context's, divided among n_parallel sequences."""
        return self._live().n_ctx_seq

    # -- evaluation --------------------------------------------------------------------------
    def logits(self, token_ids: list[int], *, one_token_per_step: bool = False) -> np.ndarray:
        """float32 [len(token_ids), n_vocab]: the logits after each token, on a fresh sequence.
        one_token_per_step: evaluate the tokens one llama_decode at a time, as generation does
        (with an expert cache, each step then routes, loads and prefetches like a decode step)."""
        self._single_sequence("logits")
        ids = as_token_ids(token_ids)
        if not ids:
            raise InvalidOptionError("logits needs at least one token")
        self._check_fits(len(ids), 0)
        check_logits_fit(self.info.metadata, len(ids), self.n_logits, self.plan.spare_bytes, self.plan.ubatch_tokens)
        decoder = self._decoder
        with self._sequence_turn():
            decoder.clear()
            if one_token_per_step:
                out = np.stack([decoder.decode([t], pos, all_logits=True)[0] for pos, t in enumerate(ids)])
            else:
                out = decoder.decode(ids, 0, all_logits=True)
            decoder.sequences[0].tokens[:] = ids
        return out

    @property
    def tokens(self) -> list[int]:
        """What the one sequence holds (its KV cache), token by token: a generation whose prompt
        starts with them evaluates only the rest."""
        self._single_sequence("tokens")
        self._live()
        return list(self._decoder.sequences[0].tokens)

    def eval(self, tokens: list[int], all_logits: bool = False) -> np.ndarray | None:
        """Evaluates tokens after what the one sequence holds (tokens), as llama-cpp-python's Llama.eval;
        with all_logits, returns their logits (float32 [len(tokens), n_vocab]; their memory as logits()'s)."""
        self._single_sequence("eval")
        ids = as_token_ids(tokens)
        with self._sequence_turn():
            sequence = self._decoder.sequences[0]
            self._check_fits(len(sequence.tokens) + len(ids), 0)
            if all_logits:
                check_logits_fit(self.info.metadata, len(ids), self.n_logits, self.plan.spare_bytes, self.plan.ubatch_tokens)
            if not ids:
                return np.zeros((0, self.n_vocab), np.float32) if all_logits else None
            logits = self._decoder.decode(ids, len(sequence.tokens), sequence, all_logits)
            sequence.tokens += ids
        return logits if all_logits else None

    def sample(self, **sampling) -> int:
        """The token sampled after what the one sequence holds (eval's), as llama-cpp-python's
        Llama.sample; sampling: as for generate (the seed: its own, else the Engine's)."""
        self._single_sequence("sample")
        sampling = SamplingParams.of(sampling)
        with self._sequence_turn():
            sequence = self._decoder.sequences[0]
            return self._decoder.sample_next(sequence, sampling.sampler(self._live_model(), self.n_ctx, self.seed,
                                                                        sequence.tokens))

    def reset(self, keep: int = 0) -> None:
        """Forgets what the one sequence holds (its KV cache) after its first keep tokens (0: all)."""
        self._single_sequence("reset")
        with self._sequence_turn():
            self._decoder.rewind(self._decoder.sequences[0], keep) if keep else self._decoder.clear()

    def save_state(self) -> SequenceState:
        """What the one sequence holds (its tokens and KV cache), for load_state."""
        self._single_sequence("save_state")
        with self._sequence_turn():
            return self._decoder.save(self._decoder.sequences[0])

    def load_state(self, state: SequenceState) -> None:
        """The one sequence holds what save_state gave, of an Engine of the same model and context
        settings (else InvalidOptionError)."""
        self._single_sequence("load_state")
        with self._sequence_turn():
            self._decoder.restore(self._decoder.sequences[0], state)

    def embed(self, text: str | list[int], *, normalize: bool = False, truncate: bool = True) -> np.ndarray:
        """The model's embeddings of text (or token ids), float32 (pyedgemoe.embeddings.embed)."""
        return embeddings.embed(self, text, normalize, truncate)

    def _governed(self, n_decoded: int, decode):
        """decode() on the thread counts the governor chose, timed for it: n_decoded tokens, one per
        sequence of a decode step (0 for a prompt's batch, which it does not time). Every decode
        call goes through here (Decoder)."""
        g = self._governor
        if g is None:
            out = decode()
        else:
            if g.n != self.n_threads:
                self.n_threads = g.n
                full = not self.plan.batch_governed or g.n == g.n_max
                self._live().set_n_threads(g.n, self._n_threads_batch if full else min(g.n, self._n_threads_batch))
            t0 = time.perf_counter()
            out = decode()
            g.record(n_decoded, time.perf_counter() - t0)
        if self._reads_core:  # the reads' core is the decode's while prefetching is held (its trial) or stopped
            phase = self._model.expert_prefetch_phase()
            n = self.plan.n_threads if phase == "reading" else self.plan.cores
            self._reads_core = phase != "stopped"
            if g and g.n_max != n:
                g.set_max(n)
            if self.n_threads != n and (g is None or g.n == n):
                self.n_threads = n
                self._live().set_n_threads(n, self._n_threads_batch)
        return out

    def _single_sequence(self, what: str) -> None:
        if self._batcher is not None:
            raise InvalidOptionError(f"{what} is of an Engine's one sequence: it needs n_parallel=1 (this one has "
                                     f"{self.n_parallel})")

    def _check_fits(self, n_prompt: int, n_more: int) -> None:
        if n_prompt + n_more > self.n_ctx:
            raise ContextOverflowError.of_prompt(n_prompt, n_more, self.n_ctx, self.n_parallel, self._live().n_ctx)

    def generate_tokens(self, prompt_tokens: list[int], max_tokens: int | None,
                        sampling: SamplingParams, *, ignore_eos: bool = False,
                        feed_tokens: list[int] | None = None) -> Iterator[int]:
        """Yields generated token ids. Stops at end-of-generation tokens (unless ignore_eos),
        after max_tokens (None = until the context is full), or when the context is full.
        feed_tokens (benchmarks): after the i-th pick, feed feed_tokens[i] to the model instead of
        the pick (teacher forcing; needs max_tokens - 1 of them). Bad arguments raise here, the
        model runs as the tokens are taken. Timings of the run land in last_timings."""
        return self._generation(prompt_tokens, max_tokens, sampling, ignore_eos, feed_tokens)[1]

    def _generation(self, prompt_tokens: list[int], max_tokens: int | None, sampling: SamplingParams,
                    ignore_eos: bool = False, feed_tokens: list[int] | None = None, fresh: bool = False,
                    n_probs: int | None = None, progress: bool = False) -> tuple[Generation, Iterator[int]]:
        """generate_tokens, with the Generation (its own timings: last_timings is the latest generation's,
        whichever thread started it; its logprobs, with n_probs). fresh: forget the KV cache first (no prefix
        reused; the expert cache's per-sequence records restart). A seeded generation is fresh: reusing a prefix
        evaluates the prompt's last tokens in a smaller batch, whose sums the CPU kernels may round otherwise, and
        a seeded call gives the same tokens (a drafter's batches vary: docs/speculative.md). progress: a
        PromptProgress among the tokens as the prompt's evaluation begins and after each of its llama_decode calls."""
        sampling.validate()
        prompt = as_token_ids(prompt_tokens, "prompt")
        if not prompt:
            raise InvalidOptionError("the prompt is empty (no tokens)")
        completions.check_count("max_tokens", max_tokens)
        if feed_tokens is not None:
            if self._batcher is not None:
                raise InvalidOptionError("feed_tokens needs n_parallel=1")
            feed_tokens = as_token_ids(feed_tokens, "feed_tokens")
            if max_tokens is None or len(feed_tokens) < max_tokens - 1:
                raise InvalidOptionError(f"feed_tokens needs max_tokens - 1 tokens, got {len(feed_tokens)} "
                                         f"for max_tokens {max_tokens}")
        self._check_fits(len(prompt), 0 if max_tokens == 0 else 1)  # room for a token, unless none is asked for
        if sampling.prompt_logits is not None:
            check_logits_fit(self.info.metadata, len(prompt), self.n_logits, self.plan.spare_bytes, self.plan.ubatch_tokens)
        timings = GenerationStats(n_prompt_tokens=len(prompt))
        self.last_timings = timings
        budget = self.n_ctx - len(prompt) if max_tokens is None else min(max_tokens, self.n_ctx - len(prompt))
        sampler = sampling.sampler(self._live_model(), self.n_ctx, self.seed, prompt)
        generation = Generation(self._decoder, prompt, budget, sampler, ignore_eos, timings,
                                fresh or sampling.seed is not None, feed_tokens, n_probs,
                                self.draft_model if sampling.draft_model is None else sampling.draft_model,
                                sampling.prompt_logits, progress)
        tokens = self._batcher.generate(generation) if self._batcher is not None else self._one_sequence(generation)
        return generation, self._counted(tokens, timings)

    def _counted(self, tokens: Iterator[int], timings: GenerationStats) -> Iterator[int]:
        try:
            yield from tokens
        finally:
            with self._decoder.lock:
                self._totals.add(timings)

    def _one_sequence(self, generation: Generation) -> Iterator[int]:
        """An Engine's one sequence: the generation on the thread taking its tokens, holding it to its end."""
        def steps():
            token = yield from generation.prefill(self._decoder.sequences[0])
            while token is not None:
                yield token
                token = generation.step()
        return self._turn.holding(steps(), self.while_waiting)

    def time_generation(self, prompt_ids: list[int], n_tokens: int, feed_tokens: list[int] | None = None) -> dict:
        """Benchmark helper: greedy-decodes exactly n_tokens (ignoring EOS) from a fresh sequence;
        with feed_tokens, those are fed back instead of the picks (generate_tokens). With an expert
        cache, decode_experts is what the decode steps moved of the expert counters (stats()'s
        ["experts"]["total"], and prefetched_bytes_read), without the prefill's; decode_expert_bytes_read
        their bytes read on demand and prefetched."""
        self._single_sequence("time_generation")
        tokens, after_prefill = [], {}
        run, generation = self._generation(prompt_ids, n_tokens, SamplingParams(temperature=0.0), True, feed_tokens,
                                           fresh=True)
        t = run.timings
        for token in generation:
            if not tokens:
                after_prefill = self._expert_counters()
            tokens.append(token)
        moved = {k: v - after_prefill.get(k, v) for k, v in self._expert_counters().items()}
        return {"prefill_seconds": t.prefill_seconds, "decode_seconds": t.decode_seconds,
                "n_prompt_tokens": t.n_prompt_tokens, "n_decoded": t.n_decoded, "tokens": tokens, "decode_experts": moved,
                "decode_expert_bytes_read": moved.get("bytes_read", 0) + moved.get("prefetched_bytes_read", 0)}

    def _expert_counters(self) -> dict:
        if self.expert_residency is None:
            return {}
        stats = self._model.expert_stats()
        return {**{k: v for k, v in stats["total"].items() if isinstance(v, (int, float))},
                "prefetched_bytes_read": stats["prefetches"]["bytes_read"]}

    # -- text generation ------------------------------------------------------------------------
    def prompt_tokens(self, prompt: str | list[int]) -> list[int]:
        """A prompt's tokens: a text's special-token text parsed, as llama-completion, llama-server and
        llama-cpp-python parse it (a chat template rendered by the caller)."""
        return self.tokenize(prompt, add_bos=True, special=True) if isinstance(prompt, str) else as_token_ids(prompt, "prompt")

    def generate(self, prompt: str | list[int], max_tokens: int | None = 128, *, stop: str | list[str] | None = None,
                 stream: bool = False, ignore_eos: bool = False, special: bool = False, **sampling) -> str | Iterator[str]:
        """Continues prompt (text, or token ids). Returns the text, or with stream=True an iterator of its pieces as
        they are produced, one a token (text_stream.TextStream). ignore_eos: go on past end-of-generation tokens (to
        max_tokens); special: special tokens' text too, the end-of-generation token's that ended it among them
        (llama.cpp's -sp). sampling: SamplingParams's settings by name (temperature, top_k, top_p, min_p,
        repeat_penalty, seed, grammar, json_schema, draft_model; or OpenAI's response_format)."""
        pieces = TextRun(self, self.prompt_tokens(prompt), max_tokens, SamplingParams.of(sampling), stop_list(stop),
                         ignore_eos, special_tokens=range(self.n_vocab) if special else frozenset(),
                         end_shown=special).pieces()
        return pieces if stream else "".join(pieces)

    def create_completion(self, prompt: str | list[int], max_tokens: int | None = 16, *, suffix: str | None = None,
                          spm_infill: bool = False, stop: str | list[str] | None = None, stream: bool = False,
                          logprobs: int | None = None, timings_per_token: bool = False, return_progress: bool = False,
                          **sampling):
        """OpenAI-style text completion, shaped like llama_cpp.Llama.create_completion's; logprobs: each token's and the
        logprobs likeliest tokens'; suffix: fill in the middle (spm_infill: suffix first); timings_per_token: each
        streamed chunk with llama-server's timings so far (else the last only); return_progress: chunks of how far
        the prompt's evaluation is (their prompt_progress, llama-server's) streamed before the text. sampling: as
        for generate."""
        return completions.create_completion(self, prompt, max_tokens, stop, stream, logprobs, sampling,
                                             suffix=suffix, spm_infill=spm_infill, timings_per_token=timings_per_token,
                                             return_progress=return_progress)

    def format_chat(self, messages: list[dict], tools: list[dict] | None = None, tool_choice=None,
                    template_kwargs: dict | None = None) -> str:
        """The prompt text for messages (and OpenAI's tools, for the template), using the model's chat
        template (template_kwargs: more of its variables)."""
        completions.check_messages(messages)
        bos, eos = (self.token_piece(t, special=True).decode("utf-8", "replace") if t is not None else ""
                    for t in (self.token_bos(), self.token_eos()))
        return render_chat(self._model.chat_template, messages, bos_token=bos, eos_token=eos, tools=tools,
                           native_fallback=lambda msgs: self._model.apply_chat_template(msgs, True),
                           tool_choice=tool_choice, template_kwargs=template_kwargs)

    @functools.cached_property
    def chat_format(self) -> "_native.ChatFormat":
        """llama.cpp's chat formats over the model's template (pyedgemoe.chat_formats)."""
        return _native.ChatFormat(self._live_model())

    def create_chat_completion(self, messages: list[dict], max_tokens: int | None = None, *,
                               stop: str | list[str] | None = None, stream: bool = False,
                               logprobs: bool | None = None, top_logprobs: int | None = None,
                               tools: list[dict] | None = None, tool_choice=None, parallel_tool_calls: bool | None = None,
                               parse_tool_calls: bool = True, chat_template_kwargs: dict | None = None,
                               reasoning_format: str | None = None, continue_final_message=None,
                               add_generation_prompt: bool | None = None, timings_per_token: bool = False,
                               return_progress: bool = False, jinja2_formatter: bool = False,
                               finish_character: bool = False, **sampling):
        """OpenAI-style chat completion, shaped like llama_cpp.Llama.create_chat_completion's result.
        logprobs=True: each token's log-probability, with the top_logprobs most likely tokens'.
        tools, tool_choice, parallel_tool_calls (default: where the template shows several calls):
        the calls the model writes parsed as llama-server parses them (pyedgemoe.chat_formats), or
        with parse_tool_calls=False left text, as llama-cpp-python; reasoning_format "auto": its
        thoughts as reasoning_content. chat_template_kwargs: more of the template's variables
        ({"enable_thinking": False}). continue_final_message (True, "content", "reasoning_content"): the
        last message, the assistant's, is continued, the answer what follows it; add_generation_prompt
        False: none (llama-server's). timings_per_token, return_progress: as for create_completion.
        jinja2_formatter: the template rendered and tokenized as llama-cpp-python's Jinja2ChatFormatter
        does (no variable but the messages' and tools', no BOS but the template's); else as llama.cpp's
        tools do. finish_character: a character max_tokens cuts finished first, as llama-cpp-python does
        (completions.TextRun). sampling: as for generate (temperature: CHAT_TEMPERATURE)."""
        return completions.create_chat_completion(self, messages, max_tokens, stop, stream, logprobs, top_logprobs,
                                                  sampling, tools, tool_choice, parallel_tool_calls, parse_tool_calls,
                                                  chat_template_kwargs, reasoning_format, continue_final_message,
                                                  add_generation_prompt, timings_per_token, return_progress,
                                                  jinja2_formatter, finish_character)

    # -- routing trace (calibration) ---------------------------------------------------------------
    def record_routing(self, on: bool = True, inputs: bool = False) -> None:
        """Start (or stop) recording every MoE layer's routing (an expert cache's): with the predictor's guesses
        for an Engine made with trace_routing=True (else -1), and with inputs (such an Engine's) each layer input."""
        model = self._live_model()
        if self.expert_residency is None:
            raise InvalidOptionError("recording the routing needs an expert cache (expert_cache=...)")
        if inputs and not self.plan.trace_routing:
            raise InvalidOptionError("recording the layers' inputs needs an Engine made with trace_routing=True")
        with self._decoder.lock:
            model.set_expert_tracing(on, inputs)

    def take_routing_trace(self) -> dict:
        """The routing recorded since the last call, as numpy arrays: "ubatch" and "layer" [n] (one
        record per token and MoE layer, in compute order), "ids" and "weights" [n, n_experts_used],
        "inputs" [n, n_embd] where recorded."""
        model = self._live_model()
        if self.expert_residency is None:
            raise InvalidOptionError("recording the routing needs an expert cache (expert_cache=...)")
        with self._decoder.lock:
            return dict(model.take_expert_trace())

    # -- telemetry ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters since the Engine was created: tokens and time spent in prefill and decode.
        With an expert cache, "experts" holds its settings and per-layer and total counters;
        "experts_mapped": the experts are in the page cache (expert_cache "mmap"); "repack": the
        weights the CPU computes have repacked copies."""
        out = {
            "mode": self.mode, "device": self.device["name"] if self.device else None,
            "experts_mapped": self.experts_mapped, "repack": self.repack,
            "model": {"architecture": self.info.architecture, "is_moe": self.info.is_moe,
                      "n_experts": self.info.n_experts, "n_experts_used": self.info.n_experts_used,
                      "expert_bytes": self.info.expert_bytes, "non_expert_bytes": self.info.non_expert_bytes},
            "totals": self._totals.to_dict(), "last": self.last_timings.to_dict()}
        with self._decoder.lock:  # between two decodes
            out["memory"] = self._live().memory_breakdown()
            native_experts = self._model.expert_stats() if self.expert_residency is not None else None
        out["system"] = self.system
        if self.expert_residency is not None:
            experts = {**self.expert_residency, **native_experts}
            out["experts"] = {**experts, "summary": expert_summary(experts)}
        if self.big_little > 0:
            c = self._decoder.big_little_counts
            out["big_little"] = {"gamma": self.big_little, **c,
                                 "fallback_rate": c["fallbacks"] / c["little_tokens"] if c["little_tokens"] else 0.0}
        return out

    def set_precision_map(self, low: dict[int, list[int]]) -> None:
        """EdgeMoE's static precision map (with static_precision): the experts listed ({layer: [expert,
        ...]}) only ever in LOW, every other one only in HIGH. Empties the expert cache."""
        if self.expert_residency is None:
            raise InvalidOptionError("a precision map needs an expert cache (expert_cache=...)")
        if not is_low_experts(low):
            raise InvalidOptionError(f"a precision map is {{layer: [expert, ...]}} of integers, got {low!r}"[:200])
        try:
            with self._decoder.lock:
                self._model.set_expert_precision_map({int(l): [int(e) for e in es] for l, es in low.items()})
        except ValueError as e:
            raise InvalidOptionError(str(e)) from None
