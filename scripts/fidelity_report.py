"""docs/fidelity.md: what LOW-precision experts and skipping cost on the trained demo model.

    python scripts/fidelity_report.py            # writes docs/fidelity.md (and calibrates if needed)

The demo model (models/demo.gguf, a Qwen3-MoE trained on the Python standard library, models/README.md)
runs in nine configurations:
- HIGH only: every expert resident in its HIGH type (the reference);
- HOBBIT mixed, calibrated: an expert cache of BUDGET with dynamic loading (HIGH/LOW/SKIP on misses)
  at the thresholds `pyedgemoe calibrate` chose (models/demo.gguf.calibration.json, made from the
  training split if absent);
- the same without Fate's prefill share (prefill_low_share 0: a prefill ubatch's precisions by the
  score rule alone; by default the least popular experts covering PREFILL_LOW_SHARE of its
  selections are LOW);
- HOBBIT mixed, HOBBIT's default thresholds (T1 0.6, T2 0.9);
- skip only: the same cache, misses either HIGH or skipped (no LOW copies) at the calibrated T2;
- LOW only: every expert in its LOW type (`pyedgemoe export --precision low`), resident;
- the calibrated HOBBIT configuration and LOW only again with Q2_K LOW copies (the benchmarks' LOW
  type, docs/benchmarks.md) in place of the shipped Q4_K ones.

For each: perplexity on the held-out split (llama.cpp's method, pyedgemoe.perplexity), and top-1
agreement with HIGH only over 128-token continuations of 16 held-out prompts (the HIGH-only greedy
tokens are fed to every configuration one token per step, as generation does, and the argmax at
each step is compared).
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from pyedgemoe import Engine  # noqa: E402
from pyedgemoe.calibration.run import calibrate  # noqa: E402
from pyedgemoe.calibration.sidecar import load_calibration, sidecar_path  # noqa: E402
from pyedgemoe.convert.export import export  # noqa: E402
from pyedgemoe.convert.from_gguf import convert_gguf  # noqa: E402
from pyedgemoe.expert_options import PREFILL_LOW_SHARE  # noqa: E402
from pyedgemoe.perplexity import perplexity  # noqa: E402

MODEL = REPO / "models" / "demo.gguf"
WORK = REPO / "build" / "fidelity"
BUDGET = "25%"  # the expert cache of `make demo`
SETTINGS = dict(n_ctx=1024, n_threads=2, flash_attn=False, kv_type="f32")
N_PROMPTS, PROMPT_TOKENS, CONTINUATION = 16, 64, 128  # 2048 agreement tokens: one token moves it 0.05 %


def corpus_texts() -> tuple[str, str]:
    """(held-out text, calibration text from the training split), as the training script splits."""
    import train_demo_moe
    corpus = train_demo_moe.read_corpus()
    return train_demo_moe.heldout_text(corpus), "\n".join(corpus.train[:40])


def configurations(model: Path, calibration: dict) -> dict[str, tuple[Path, dict]]:
    # always exported again: the model may have changed
    low_only = export(model, WORK / f"{model.stem}-low.gguf", precision="low", force=True, progress=False)
    # the Q2_K LOW copy of the benchmarks (docs/benchmarks.md): the HIGH copies as they are, LOW re-quantized
    high_only = export(model, WORK / f"{model.stem}-high.gguf", precision="high", force=True, progress=False)
    q2k = convert_gguf(high_only, WORK / f"{model.stem}-q2_K.mp.gguf", high="q8_0", low="q2_K", force=True,
                       progress=False)
    q2k_low_only = export(q2k, WORK / f"{model.stem}-q2_K-low.gguf", precision="low", force=True, progress=False)
    cache = dict(expert_cache=BUDGET, cache_policy="lru", prefetch="none")
    return {
        "HIGH only": (model, dict(expert_cache=None)),
        "HOBBIT mixed, calibrated": (model, dict(**cache, t1=calibration["t1"], t2=calibration["t2"])),
        "HOBBIT mixed, calibrated, no prefill share": (model, dict(**cache, t1=calibration["t1"], t2=calibration["t2"],
                                                                   prefill_low_share=0.0)),
        "HOBBIT mixed, T1 0.6 / T2 0.9": (model, dict(**cache, t1=0.6, t2=0.9)),
        "skip only": (model, dict(**cache, low_precision=False, skip=True, t1=calibration["t2"],
                                  t2=calibration["t2"])),
        "LOW only": (low_only, dict(expert_cache=None)),
        "HOBBIT mixed, calibrated, Q2_K LOW": (q2k, dict(**cache, t1=calibration["t1"], t2=calibration["t2"])),
        "HOBBIT mixed, calibrated, Q2_K LOW, no prefill share": (q2k, dict(**cache, t1=calibration["t1"],
                                                                           t2=calibration["t2"], prefill_low_share=0.0)),
        "LOW only, Q2_K": (q2k_low_only, dict(expert_cache=None)),
    }


def agreement(engine: Engine, prompts: list[list[int]], references: list[list[int]]) -> float:
    """Share of steps where the argmax equals the reference's greedy token (teacher-forced)."""
    same = total = 0
    for prompt, ref in zip(prompts, references):
        logits = engine.logits(prompt + ref[:-1], one_token_per_step=True)
        picks = logits[len(prompt) - 1:].argmax(axis=1)
        same += int((picks == np.array(ref)).sum())
        total += len(ref)
    return same / total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--ctx", type=int, default=256, help="perplexity chunk size")
    p.add_argument("--chunks", type=int, default=64, help="perplexity chunks (None: the whole held-out split)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "fidelity.md")
    args = p.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)

    heldout, calibration_text = corpus_texts()
    calibration = load_calibration(args.model)
    if calibration is None:
        print(f"calibrating {args.model.name} on the training split ({BUDGET} budget)", file=sys.stderr)
        calibrate(args.model, calibration_text, budget=BUDGET, max_tokens=4096, n_ctx=256,
                  trace=WORK / "demo.routing-trace.npz", text_name="training split", n_threads=1)
        calibration = load_calibration(args.model)

    with Engine(args.model, **SETTINGS) as eng:
        ids = eng.tokenize(heldout, add_bos=False)
        step = len(ids) // N_PROMPTS
        prompts = [ids[i * step:i * step + PROMPT_TOKENS] for i in range(N_PROMPTS)]
        references = [eng.time_generation(prompt, CONTINUATION)["tokens"] for prompt in prompts]

    rows = []
    for name, (path, options) in configurations(args.model, calibration).items():
        print(f"{name} ...", file=sys.stderr, flush=True)
        with Engine(path, **SETTINGS, **options) as eng:
            ppl = perplexity(eng, heldout, n_ctx=args.ctx, n_chunks=args.chunks)
            agree = agreement(eng, prompts, references)
            summary = (eng.stats().get("experts") or {}).get("summary")
        rows.append(dict(name=name, ppl=ppl.ppl, stderr=ppl.stderr, tokens=ppl.n_tokens_scored,
                         agreement=agree, summary=summary))
        print(f"  ppl {ppl.ppl:.3f} +/- {ppl.stderr:.3f}, top-1 agreement {agree:.1%}, {summary}",
              file=sys.stderr, flush=True)
    base = rows[0]["ppl"]

    lines = [
        "# Fidelity: what LOW precision and skipping cost (the demo model)",
        "",
        f"Generated by `python scripts/fidelity_report.py` on {datetime.date.today()}; model "
        f"`{args.model.relative_to(REPO) if args.model.is_relative_to(REPO) else args.model}` (models/README.md).",
        f"Perplexity: llama.cpp's method on the held-out split of the training corpus, chunks of "
        f"{args.ctx} tokens, {rows[0]['tokens']} tokens scored. Top-1 agreement: "
        f"{N_PROMPTS} held-out prompts of {PROMPT_TOKENS} tokens, {CONTINUATION} greedy HIGH-only tokens each, fed "
        "one token per step to every configuration; the share of steps whose argmax equals HIGH only's.",
        f"Mixed configurations use an expert cache of {BUDGET} of the expert bytes (LOW share "
        f"25%), LRU, no prefetch; calibrated thresholds T1 = {calibration['t1']:.4f}, "
        f"T2 = {calibration['t2']:.4f} (`{Path(sidecar_path(args.model)).name}`, target split "
        f"{'/'.join(f'{x:.0%}' for x in dict(calibration.get('target_split') or {}).values())} of "
        "HIGH/LOW/SKIP selections).",
        "",
        "| configuration | held-out ppl | vs HIGH only | top-1 agreement | selections HIGH / LOW / SKIP |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["summary"]
        split = (f"{s['high_fraction']:.1%} / {s['low_fraction']:.1%} / {s['skip_fraction']:.1%}" if s
                 else "all resident")
        lines.append(f"| {r['name']} | {r['ppl']:.3f} ± {r['stderr']:.3f} | {r['ppl'] / base - 1:+.2%} | "
                     f"{r['agreement']:.1%} | {split} |")
    lines += ["", "The selections are counted as served: a prefill ubatch (the perplexity chunks, the prompts) serves "
              "an expert in the highest precision any of its tokens asks for, except that by default the least "
              f"popular experts covering {PREFILL_LOW_SHARE:.0%} of its selections are LOW (Fate's prefill; the rows "
              "\"no prefill share\" turn it off). So the perplexity, computed in prefill ubatches, measures that "
              "share, and the top-1 agreement, one token per step, the decode's precisions.",
              "", "Targets (issue 5): HOBBIT mixed within +1.5% of HIGH-only perplexity, top-1 agreement >= 95%.", ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
