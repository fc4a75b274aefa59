"""One benchmark measurement in a fresh process: load, prefill a fixed prompt, greedy-decode N tokens.

    python -m pyedgemoe.bench.worker --engine llama_cpp --model M.gguf \\
        --prompt-tokens 16 --output-tokens 32 --threads 2

prints exactly one JSON line on stdout (see `measure`). The runner starts one worker per
measurement, so every engine starts from the same state (no warm allocator, no shared mmap) and,
under a memory cap, only the worker sits in the cgroup (docs/benchmarks.md, "What is measured").

The runner starts this file by its path, not with -m: then a stock llama.cpp measurement never
imports the pyedgemoe package, so our native module (and its copy of ggml) is not even loaded in
the baseline process, and the baseline still runs where ours is not built. This file therefore
imports nothing from pyedgemoe at module level.

Both engines get the same prompt (`prompt_token_ids`, no BOS added), decode greedily and ignore
EOS, so they do the same work; their token ids are reported so the runner can check they agree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Any

ENGINES = ("pyedgemoe", "llama_cpp")

# Exit status for "this engine cannot run here" (not importable): the runner stops asking for it.
EXIT_ENGINE_UNAVAILABLE = 3


class EngineUnavailable(Exception):
    """The requested engine cannot be imported in this environment."""


class SettingsRefused(Exception):
    """Ours refused the run's settings at load (a PyEdgeMoEError): every other run would too."""


def prompt_token_ids(n: int, n_vocab: int | None = None) -> list[int]:
    """A fixed prompt of n token ids, identical for every engine and run.

    Ids stay below 1100 so they are valid in any real vocabulary (and above 99 of a smaller
    vocabulary of n_vocab); the stride spreads them over ordinary BPE tokens instead of the
    special tokens at the start of most vocabularies.
    """
    span = 1000 if n_vocab is None else min(1000, n_vocab - 100)
    return [100 + (i * 37) % span for i in range(n)]


DECODE_INPUTS = ("greedy", "fixed")


def fixed_decode_token_ids(n: int, n_vocab: int | None = None) -> list[int]:
    """The tokens fed back during decode with decode_input="fixed": a fixed pseudo-random walk
    over ids 100..30099 (valid in every real vocabulary; Mixtral's has 32000), or over the ids
    above 99 of a smaller vocabulary of n_vocab.

    Why: a model whose greedy output falls into a cycle of a few tokens (random weights drawn
    naively do, within a few steps) repeats its routing, and an expert cache looks far better
    than on real text. Feeding a fixed non-repeating sequence (the greedy pick is still computed,
    and reported) keeps the work per token the same and the routing varied."""
    span = 30000 if n_vocab is None else min(30000, n_vocab - 100)
    return [100 + (i * 7919 + 4271) % span for i in range(n)]


def vocabulary_size(model: str) -> int:
    """The number of tokens of a GGUF's vocabulary, from its header."""
    import gguf
    return len(gguf.GGUFReader(model).fields["tokenizer.ggml.tokens"].data)


def n_ctx_for(prompt_tokens: int, output_tokens: int) -> int:
    return prompt_tokens + output_tokens + 16


@contextmanager
def stock_without_repack():
    """Within it, stock llama-cpp-python's Llama loads as with llama.cpp's --no-repack, which it does
    not expose: on x86 the CPU backend copies Q4_0/Q4_K/IQ4 weights into a repacked layout in
    anonymous memory, which a memory cap cannot page out (the mmap'd file pages it can)."""
    import llama_cpp
    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def no_repack():
        params = default_params()
        params.use_extra_bufts = False
        return params
    llama_cpp.llama_cpp.llama_model_default_params = no_repack
    try:
        yield
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = default_params

def _run_llama_cpp(model: str, prompt: list[int], n_out: int, threads: int, flash_attn: bool,
                   options: dict[str, Any], feed: list[int] | None) -> dict[str, Any]:
    """Stock llama-cpp-python: Llama.eval for the prompt, then one eval per generated token."""
    try:
        import llama_cpp
        import numpy as np
    except ImportError as e:
        raise EngineUnavailable(f"llama_cpp (llama-cpp-python) is not importable: {e}") from e

    arguments = {name: value for name, value in options.items() if name != "repack"}  # Llama's (the runner's)
    t0 = time.perf_counter()
    with stock_without_repack() if options.get("repack") is False else nullcontext():
        llm = llama_cpp.Llama(model, n_ctx=n_ctx_for(len(prompt), n_out), n_threads=threads,
                              n_threads_batch=threads, n_batch=512, flash_attn=flash_attn, verbose=False,
                              **arguments)
    load_seconds = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def greedy_token() -> int:
        # Logits of the last evaluated position; argmax is greedy decoding without a sampler chain.
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        if not np.isfinite(logits).all():
            raise FloatingPointError("non-finite logits")
        return int(np.argmax(logits))

    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill_seconds = time.perf_counter() - t0

    # Same work as Engine.time_generation: n_out greedy picks and n_out - 1 single-token
    # forward passes (the last picked token is never fed back).
    tokens: list[int] = []
    t0 = time.perf_counter()
    for i in range(n_out):
        tok = greedy_token()
        tokens.append(tok)
        if i + 1 < n_out:
            llm.eval([tok if feed is None else feed[i]])
    decode_seconds = time.perf_counter() - t0

    return dict(engine_version=llama_cpp.__version__, load_seconds=load_seconds,
                prefill_seconds=prefill_seconds, decode_seconds=decode_seconds,
                n_prompt_tokens=len(prompt), n_output_tokens=len(tokens), tokens=tokens)


def _run_pyedgemoe(model: str, prompt: list[int], n_out: int, threads: int, flash_attn: bool,
                   options: dict[str, Any], feed: list[int] | None) -> dict[str, Any]:
    """Ours, through Engine.time_generation (greedy, ignores EOS, times prefill and decode itself).
    On as many cores as threads (measure), ours decides its threads as by default, unless options
    name n_threads."""
    try:
        from pyedgemoe import Engine
    except ImportError as e:
        raise EngineUnavailable(
            f"pyedgemoe.Engine is not importable ({e}); build it first (make setup)") from e
    try:
        from importlib.metadata import version as dist_version
        version = dist_version("pyedgemoe")
    except Exception:  # running from a source tree that is not pip-installed
        version = "source"

    options = dict(options)
    against_min = options.pop("against_min", False)
    if against_min:  # MIN starts from an empty cache and computes what is resident: so does this run
        from pyedgemoe.systems import LOSSLESS_OVERRIDES
        options.update(LOSSLESS_OVERRIDES, fill_cache=False)
    t0 = time.perf_counter()
    cores = len(os.sched_getaffinity(0))
    # options win over the run's settings (flash_attn=None: ours as llama.cpp decides, its default)
    from pyedgemoe.errors import PyEdgeMoEError
    try:
        eng = Engine(model, **{"n_ctx": n_ctx_for(len(prompt), n_out), "n_batch": 512, "flash_attn": flash_attn,
                               "n_threads": None if threads == cores else threads, **options})
    except PyEdgeMoEError as e:
        raise SettingsRefused(str(e)) from None
    load_seconds = time.perf_counter() - t0
    if against_min:
        eng.record_routing(True)
    t = eng.time_generation(prompt, n_out, feed_tokens=feed)
    result = dict(engine_version=version, load_seconds=load_seconds,
                  prefill_seconds=float(t["prefill_seconds"]),
                  decode_seconds=float(t["decode_seconds"]),
                  n_prompt_tokens=int(t["n_prompt_tokens"]),
                  n_output_tokens=int(t["n_decoded"]), tokens=[int(x) for x in t["tokens"]],
                  decode_threads=eng.n_threads)
    if "decode_expert_bytes_read" in t and int(t["n_decoded"]) > 1:
        # the first token comes from the prefill's logits: n - 1 decode steps read experts
        result["decode_expert_bytes_per_token"] = int(t["decode_expert_bytes_read"]) / (int(t["n_decoded"]) - 1)
    stats = getattr(eng, "stats", None)
    if callable(stats):
        try:
            result["engine_stats"] = json.loads(json.dumps(stats(), default=str))
            total = (result["engine_stats"].get("experts") or {}).get("total") or {}
            if total.get("requests"):  # offloading on: cache behaviour over prefill + decode
                result["expert_hit_rate"] = total["hits"] / total["requests"]
                result["expert_bytes_read"] = total.get("bytes_read")
                prediction = result["engine_stats"]["experts"].get("prediction") or []
                if prediction and prediction[0].get("tokens"):
                    result["next_layer_top1_accuracy"] = prediction[0]["top1_accuracy"]
        except Exception as e:  # stats are a bonus; never fail a measurement over them
            result["engine_stats"] = {"error": repr(e)}
    if against_min:
        from pyedgemoe.calibration.belady import trace_against_min
        experts = eng.stats().get("experts")
        if not experts:
            raise ValueError("against_min: needs an expert cache (expert_cache=...)")
        loads = experts["total"]["loads_high"] + (experts.get("prefetches") or {}).get("issued", 0)
        result["against_min"] = trace_against_min(eng.take_routing_trace(), experts["high_slots"], loads)
    return result


def parse_option(text: str) -> tuple[str, Any]:
    """'expert_cache=4GiB' -> ('expert_cache', '4GiB'); integers, floats, true/false and none are typed."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise ValueError(f"engine option {text!r} is not KEY=VALUE")
    low = value.lower()
    if low in ("true", "false"):
        return key, low == "true"
    if low == "none":
        return key, None
    for number in (int, float):
        try:
            return key, number(value)
        except ValueError:
            pass
    return key, value


def peak_rss_bytes() -> int:
    """This process's peak RSS since its exec: /proc's VmHWM (with mmap it counts the model pages it
    touched). Not ru_maxrss: that keeps the peak of the process it was forked from (the runner's,
    82 MiB, under every row)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def measure(engine: str, model: str, prompt_tokens: int, output_tokens: int, threads: int,
            flash_attn: bool = False, options: dict[str, Any] | None = None,
            decode_input: str = "greedy") -> dict[str, Any]:
    """One measurement. Keys: engine, model, prefill_seconds, decode_seconds,
    decode_tokens_per_second, n_prompt_tokens, n_output_tokens, peak_rss_bytes, load_seconds,
    engine_version, tokens (the decoded ids).

    flash_attn applies to both engines and defaults to off, llama-cpp-python's default: the two
    must run the same attention kernels, or near-tied greedy picks differ. options are keyword
    arguments for pyedgemoe.Engine (expert_cache, io, ...). decode_input "greedy" feeds each
    picked token back; "fixed" feeds fixed_decode_token_ids instead (see there). With fewer threads
    than the cores this process may use, it runs on the first `threads` of them: stock llama.cpp
    with `threads` threads, ours with its default threads on those cores (one of them may go to
    its expert reads, Engine's n_threads)."""
    if decode_input not in DECODE_INPUTS:
        raise ValueError(f"decode_input must be one of {DECODE_INPUTS}, got {decode_input!r}")
    n_vocab = vocabulary_size(model)
    feed = fixed_decode_token_ids(output_tokens, n_vocab) if decode_input == "fixed" else None
    run = {"llama_cpp": _run_llama_cpp, "pyedgemoe": _run_pyedgemoe}[engine]
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[:threads])
    try:
        r = run(model, prompt_token_ids(prompt_tokens, n_vocab), output_tokens, threads, flash_attn, options or {}, feed)
    finally:
        os.sched_setaffinity(0, cores)  # as it was, when measured in a process that goes on
    r["decode_tokens_per_second"] = (r["n_output_tokens"] / r["decode_seconds"]
                                     if r["decode_seconds"] > 0 else float("nan"))
    r["peak_rss_bytes"] = peak_rss_bytes()
    return {"engine": engine, "model": model, "threads": threads, "flash_attn": flash_attn,
            "options": options or {}, "decode_input": decode_input, **r}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one pyedgemoe benchmark measurement (prints one JSON line)")
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--flash-attn", action="store_true", help="flash attention on (both engines; default off)")
    p.add_argument("--decode-input", choices=DECODE_INPUTS, default="greedy",
                   help="token fed back at each decode step: the greedy pick, or a fixed sequence")
    p.add_argument("--options", type=json.loads, default={}, metavar="JSON",
                   help='keyword arguments for pyedgemoe.Engine as a JSON object, e.g. {"expert_cache": "4GiB"}')
    args = p.parse_args(argv)

    try:
        result = measure(args.engine, args.model, args.prompt_tokens, args.output_tokens, args.threads,
                         args.flash_attn, args.options, args.decode_input)
        status = 0
    except EngineUnavailable as e:
        result, status = {"engine": args.engine, "error": str(e), "unavailable": True}, EXIT_ENGINE_UNAVAILABLE
    except SettingsRefused as e:
        result, status = {"engine": args.engine, "error": str(e), "refused": True}, 1
    except Exception as e:
        result, status = {"engine": args.engine, "error": f"{type(e).__name__}: {e}"}, 1
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
