"""Speculative decoding without a draft model: decode tokens per second and expert bytes read per
token with and without a drafter, ours and stock llama-cpp-python's, in alternating rounds.

    python scripts/bench_speculative.py [--models models/demo.gguf models/fine.gguf] [--out DIR]
    python scripts/bench_speculative.py --step-cost --models models/fine.gguf build/bench/olmoe-...gguf

For each model and expert cache (resident; 25 % lossless), one Engine; each round runs every
variant once on each prompt (greedy, --tokens tokens, end-of-generation ignored, the prompt
evaluated afresh): plain; llama-cpp-python's LlamaPromptLookupDecoding (its defaults); llama.cpp's
ngram-simple (its defaults, 12 and 48); and, to show what pacing the checks by what they earn
(speculative.DraftControl) is worth, prompt lookup checked always (the whole guess, every step, as
llama-cpp-python does). Stock llama-cpp-python (its own build, every expert resident) runs plain
and with its LlamaPromptLookupDecoding. Prompts: "copy", a text that the model goes on to repeat
(a file, then its first lines again); "free", the start of a file. Both run the HIGH experts of
each model as a standard GGUF (build/bench/NAME-std.gguf, exported when missing). Medians of
--rounds rounds; JSON and a markdown table into --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEXT = (REPO / "pyedgemoe" / "batch.py").read_text()[:1500]
PROMPTS = {"copy": TEXT + "\n\n" + TEXT[:200], "free": TEXT[:600]}


class AlwaysCheck:
    """DraftControl's interface, checking the whole guess at every step (no pacing)."""

    def __init__(self):
        self.window = 64

    def size(self) -> int:
        return self.window

    def record(self, checked: int, taken: int, seconds: float) -> None:
        """Nothing measured: it never pauses, and checks the whole guess."""


def ours(model: Path, cache: str, variants: dict, rounds: int, tokens: int, threads: int) -> dict:
    from pyedgemoe import Engine, generation
    from pyedgemoe.generation import SamplingParams
    from pyedgemoe.speculative import DraftControl
    resident = cache == "resident"
    out: dict = {}
    # flash attention off, as llama-cpp-python's default (llama.cpp's auto turns it on: on these tiny
    # models' CPU decode, measured 20 % slower)
    with Engine(model, n_ctx=2048, expert_cache=None if resident else cache, system=None if resident else "lossless",
                n_threads=threads, flash_attn=False) as eng:
        def bytes_read() -> int:
            e = eng.stats().get("experts")
            return e["total"]["bytes_read"] + e["prefetches"]["bytes_read"] if e else 0
        for _ in range(rounds):
            for pname, text in PROMPTS.items():
                prompt = eng.tokenize(text)
                for vname, (drafter, control) in variants.items():
                    generation.DraftControl = control or DraftControl
                    try:
                        before = bytes_read()
                        ids = list(eng.generate_tokens(prompt, tokens, SamplingParams(temperature=0, seed=1,
                                                                                      draft_model=drafter()),
                                                       ignore_eos=True))
                    finally:
                        generation.DraftControl = DraftControl
                    t = eng.last_timings
                    out.setdefault(f"{pname}/{vname}", []).append({
                        "tok_s": t.decode_tokens_per_second, "checked": t.n_draft_tokens, "taken": t.n_draft_accepted,
                        "bytes_per_token": (bytes_read() - before) / len(ids), "tokens": ids})
    return out


def step_cost(model: Path, cache: str, threads: int, repeats: int = 48) -> dict:
    """Seconds of one decode step of n tokens (random ones, after a 64-token prompt) over a step of
    one, medians: what checking a guess of n - 1 tokens costs."""
    import random
    from pyedgemoe import Engine
    resident = cache == "resident"
    rng = random.Random(0)
    with Engine(model, n_ctx=1024, expert_cache=None if resident else cache, system=None if resident else "lossless",
                n_threads=threads, flash_attn=False) as eng:
        ctx = eng._decoder.live()  # the native context: steps of chosen sizes, the sequence cut back after each
        ctx.decode([rng.randrange(100, 1000) for _ in range(64)], 0, False, 0)
        seconds: dict = {}
        for _ in range(repeats):
            for n in (1, 2, 3, 5, 9, 17):
                tokens = [rng.randrange(100, 1000) for _ in range(n)]
                start = time.perf_counter()
                ctx.decode_step(tokens, list(range(64, 64 + n)), [0] * n)
                seconds.setdefault(n, []).append(time.perf_counter() - start)
                ctx.truncate(64, 0)
    one = statistics.median(seconds[1])
    return {n: statistics.median(v) / one for n, v in seconds.items()} | {"one_ms": one * 1e3}


def stock(model: Path, rounds: int, tokens: int, threads: int) -> dict:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    out: dict = {}
    # n_batch 2048: with its default 512, llama-cpp-python 0.3.36's draft_model fails on the copy prompt
    # (ValueError: could not broadcast input array from shape (90112,) into shape (57344,), in eval)
    llms = {"plain": Llama(str(model), n_ctx=2048, n_batch=2048, n_threads=threads, verbose=False),
            "prompt lookup": Llama(str(model), n_ctx=2048, n_batch=2048, n_threads=threads, verbose=False,
                                   draft_model=LlamaPromptLookupDecoding())}
    for _ in range(rounds):
        for pname, text in PROMPTS.items():
            for vname, llm in llms.items():
                llm.reset()
                stamps = []
                for _ in llm.create_completion(text, max_tokens=tokens, temperature=0, stream=True):
                    stamps.append(time.perf_counter())
                n = len(stamps)
                out.setdefault(f"{pname}/{vname}", []).append({"tok_s": (n - 1) / (stamps[-1] - stamps[0])})
    for llm in llms.values():
        llm.close()
    return out


def main(argv: list[str] | None = None) -> int:
    from pyedgemoe import LlamaPromptLookupDecoding
    from pyedgemoe.speculative import NgramSimple
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, nargs="+", default=[REPO / "models" / "demo.gguf", REPO / "models" / "fine.gguf"])
    p.add_argument("--caches", nargs="+", default=["resident", "25%"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--step-cost", action="store_true", help="only what a step of n tokens costs against one of one")
    args = p.parse_args(argv)
    if args.step_cost:
        print("| model, cache | one token (ms) | " + " | ".join(f"{n} tokens" for n in (2, 3, 5, 9, 17)) + " |")
        print("|---|---:|" + "---:|" * 5)
        for model in args.models:
            for cache in args.caches:
                c = step_cost(model, cache, args.threads)
                print(f"| {model.name} {cache} | {c['one_ms']:.2f} | " + " | ".join(f"{c[n]:.2f}x" for n in (2, 3, 5, 9, 17))
                      + " |")
        return 0
    variants = {"plain": (lambda: None, None), "prompt lookup": (LlamaPromptLookupDecoding, None),
                "ngram-simple": (NgramSimple, None), "prompt lookup, always checked": (LlamaPromptLookupDecoding,
                                                                                      AlwaysCheck)}
    from pyedgemoe.convert.export import export
    results = {}
    for given in args.models:
        # the HIGH experts as a standard GGUF: the file stock llama-cpp-python loads, and ours runs too
        model = REPO / "build" / "bench" / f"{given.stem}-std.gguf"
        if not model.exists():
            model.parent.mkdir(parents=True, exist_ok=True)
            export(given, model, progress=False)
        for cache in args.caches:
            results[f"{model.name} {cache}"] = ours(model, cache, variants, args.rounds, args.tokens, args.threads)
        results[f"{model.name} stock llama-cpp-python"] = stock(model, args.rounds, args.tokens, args.threads)
    rows = ["| model, cache | prompt | variant | decode tok/s | vs plain | guesses checked / taken | KiB read per token |",
            "|---|---|---|---:|---:|---:|---:|"]
    for setting, runs in results.items():
        for key, samples in runs.items():
            pname, vname = key.split("/")
            med = statistics.median(s["tok_s"] for s in samples)
            plain = statistics.median(s["tok_s"] for s in runs[f"{pname}/plain"])
            last = samples[-1]
            guesses = f"{last['checked']} / {last['taken']}" if "checked" in last else ""
            read = f"{statistics.median(s['bytes_per_token'] for s in samples) / 1024:.1f}" if "bytes_per_token" in last \
                and "25%" in setting else ""
            rows.append(f"| {setting} | {pname} | {vname} | {med:.1f} | {med / plain:.2f}x | {guesses} | {read} |")
    table = "\n".join(rows)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results))
        (args.out / "table.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
