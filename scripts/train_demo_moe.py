#!/usr/bin/env python3
"""Train the shipped demo MoE (models/demo.gguf) from scratch, on CPU, reproducibly.

    .venv/bin/python scripts/train_demo_moe.py            # everything; resumes after a crash
    .venv/bin/python scripts/train_demo_moe.py --shape fine   # the fine-grained one: models/fine.gguf

The corpus is the Python standard library's own source code (of the running interpreter, so it
is on every machine and needs no download; PSF License). The script:

1. selects the corpus files and splits them by file into train / held-out (a hash of the path);
2. trains a byte-level BPE tokenizer on the training split (Qwen2's split regex, which
   llama.cpp's "qwen2" pre-tokenizer reproduces);
3. trains a small Qwen3-MoE with transformers (top-2 of 16 experts, load-balancing loss),
   checkpointing so that a rerun resumes, and logs the curve to models/training_curve.csv;
4. evaluates on the held-out split: perplexity by llama.cpp's method (as `pyedgemoe
   perplexity`), a unigram baseline on the same tokens, expert usage and next-token expert
   reuse per layer (models/routing_stats.json);
5. converts the checkpoint with `pyedgemoe convert` to a multi-precision GGUF, checks that
   llama.cpp's tokenizer gives the Hugging Face ids on the held-out text, measures each
   precision's perplexity and writes a few greedy completions (models/demo_metrics.json).

Work files (the checkpoint to resume from, the HF model, heldout.txt, one standard GGUF per
precision) go to build/demo-train/. About an hour on 2 CPU cores (models/README.md).
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers

REPO = Path(__file__).resolve().parent.parent
SEED = 1234
EOT = "<|endoftext|>"  # BOS, EOS and document separator; id 0
HELDOUT_PERCENT = 5

# llama.cpp's "qwen2" pre-tokenizer runs exactly this regex (pyedgemoe/convert/tokenizer.py,
# KNOWN_SPLIT_REGEXES); it keeps `.attr`, `_name` and newline runs as units, which suits code.
QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")
VOCAB_SIZE = 8192


@dataclass(frozen=True)
class TrainSettings:
    seq_len: int = 256
    batch_size: int = 16  # sequences per step: 4096 tokens
    steps: int = 1200  # two passes over the training tokens; ~55 min at the 2.7 s a step measured here
    peak_lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 10
    eval_every: int = 50
    eval_windows: int = 32
    checkpoint_every: int = 50


MODEL_CONFIG = dict(
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=256,  # a multiple of 256, so q4_K blocks divide the expert rows
    intermediate_size=1024,  # unused (every layer is MoE) but written to the GGUF
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    output_router_logits=True,
    router_aux_loss_coef=0.01,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    initializer_range=0.02,
)

# A second model shaped like today's fine-grained MoEs (Qwen3-MoE, OLMoE, DeepSeek: many small experts, top-8),
# whose routing the expert cache's policies are judged on beside the demo's (docs/benchmarks.md, "The cache
# against its limit"). Rows of 64 weights: LOW copies in q4_0 (q4_K's blocks are 256 wide).
FINE_CONFIG = {**MODEL_CONFIG, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 32, "num_hidden_layers": 8, "num_experts": 64, "num_experts_per_tok": 8,
               "moe_intermediate_size": 64, "intermediate_size": 512}


@dataclass(frozen=True)
class Shape:
    """A model this script trains, and the files it writes in models/."""
    config: dict
    low: str  # the LOW copies' type
    steps: int
    gguf: str
    metrics: str
    routing_stats: str
    curve: str


SHAPES = {
    "demo": Shape(MODEL_CONFIG, "q4_K", TrainSettings.steps, "demo.gguf", "demo_metrics.json", "routing_stats.json",
                  "training_curve.csv"),
    "fine": Shape(FINE_CONFIG, "q4_0", 400, "fine.gguf", "fine_metrics.json", "fine_routing_stats.json",
                  "fine_training_curve.csv"),
}

COMPLETION_PROMPTS = (
    "def _is_valid_identifier(name):\n",
    "class Stack:\n    \"\"\"A last-in, first-out collection.\"\"\"\n\n    def __init__(self):\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
    "    def __repr__(self):\n        return ",
)


# ---------------------------------------------------------------------------------------------
# Corpus


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_library_source(rel: Path) -> bool:
    """Hand-written library code only. Left out, and why:
    - site-packages: third-party packages, other licences, different on every machine;
    - test suites (test/, tests/, idle_test/): two thirds of the bytes, much of it generated data
      literals and deliberately odd (even non-UTF-8) code; they would swamp the library code;
    - machine-specific build files (_sysconfigdata*, config-*): differ between builds of Python.
    """
    parts = rel.parts
    if parts[0] == "site-packages" or parts[0].startswith("config-") or rel.name.startswith("_sysconfigdata"):
        return False
    return not any(p in ("test", "tests", "idle_test", "__pycache__") for p in parts)


def is_generated(text: str) -> bool:
    """Generated data, not code: codec tables written by gencodec.py, pydoc's Sphinx topic dump."""
    head = text[:1000]
    return "gencodec.py" in head or "Autogenerated by Sphinx" in head


def is_heldout(rel: Path) -> bool:
    """A deterministic ~5% of files, by a hash of the relative path (the same on every machine)."""
    digest = hashlib.sha256(rel.as_posix().encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


@dataclass
class Corpus:
    train: list[str]
    heldout: list[str]
    train_files: list[str]
    heldout_files: list[str]

    def sha256(self) -> str:
        h = hashlib.sha256()
        for name, text in zip(self.train_files + self.heldout_files, self.train + self.heldout):
            h.update(name.encode() + b"\0" + text.encode() + b"\0")
        return h.hexdigest()


def read_corpus() -> Corpus:
    root = stdlib_root()
    corpus = Corpus([], [], [], [])
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if not is_library_source(rel):
            continue
        text = path.read_text(encoding="utf-8")
        if not text.strip() or is_generated(text):
            continue
        if is_heldout(rel):
            corpus.heldout.append(text)
            corpus.heldout_files.append(rel.as_posix())
        else:
            corpus.train.append(text)
            corpus.train_files.append(rel.as_posix())
    return corpus


def heldout_text(corpus: Corpus) -> str:
    """The held-out files as one plain text (no special tokens), for `pyedgemoe perplexity -f`."""
    return "\n".join(corpus.heldout)


# ---------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    # Split + regex-free ByteLevel, no normalizer: the layout the converter maps to llama.cpp's "qwen2"
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOT], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    # encode(text) starts with BOS, as llama.cpp does for a model with add_bos_token
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, tokenizer.token_to_id(EOT))])
    return tokenizer


def save_hf_tokenizer(tokenizer, hf_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOT, eos_token=EOT, pad_token=EOT,
                                   clean_up_tokenization_spaces=False, model_max_length=TrainSettings.seq_len)
    fast.save_pretrained(str(hf_dir))
    # explicit for llama.cpp (gguf-py's SpecialVocab reads them): BOS first, no EOS appended
    config_path = hf_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", add_bos_token=True, add_eos_token=False)
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(hf_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(hf_dir / "tokenizer.json"))


def token_stream(tokenizer, texts: list[str]) -> np.ndarray:
    """EOT doc EOT doc ...: every document preceded by the separator, as BOS starts a prompt."""
    eot = tokenizer.token_to_id(EOT)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.append(eot)
        ids.extend(enc.ids)
    return np.asarray(ids, dtype=np.int32)


# ---------------------------------------------------------------------------------------------
# Model and training


def make_model(vocab_size: int, seq_len: int, model_config: dict):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=vocab_size, max_position_embeddings=seq_len, bos_token_id=0,
                            eos_token_id=0, pad_token_id=0, **model_config)
    torch.manual_seed(SEED)
    # grouped_mm: the fastest transformers experts implementation on this CPU (measured: ~1.2x
    # eager's per-expert loop; batched_mm, which copies the weights per token, ~80x slower)
    return Qwen3MoeForCausalLM._from_config(config, attn_implementation="sdpa", experts_implementation="grouped_mm")


def learning_rate(step: int, s: TrainSettings) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * peak at the last step."""
    if step < s.warmup_steps:
        return s.peak_lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - 1 - s.warmup_steps)
    return s.peak_lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, s: TrainSettings) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]  # matrices, embeddings, expert stacks
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # norm weights
    return torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=s.peak_lr, betas=(0.9, 0.95), eps=1e-8)


class WindowSampler:
    """Batches of non-overlapping seq_len windows of the training stream, in a fresh seeded
    permutation every epoch; batch(step) depends on the step only, so a resumed run sees the
    same data as an uninterrupted one."""

    def __init__(self, ids: np.ndarray, s: TrainSettings):
        self.windows = torch.from_numpy(ids[:len(ids) // s.seq_len * s.seq_len].astype(np.int64)).view(-1, s.seq_len)
        self.batch_size = s.batch_size
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            self._perms[epoch] = torch.randperm(len(self.windows), generator=torch.Generator().manual_seed(SEED + epoch))
        return self._perms[epoch]

    def batch(self, step: int) -> torch.Tensor:
        n = len(self.windows)
        rows = [self._perm(g // n)[g % n] for g in range(step * self.batch_size, (step + 1) * self.batch_size)]
        return self.windows[torch.stack(rows)]


def eval_windows(heldout_ids: np.ndarray, s: TrainSettings) -> torch.Tensor:
    """eval_windows windows spread evenly over the held-out stream, for the training curve."""
    n = len(heldout_ids) // s.seq_len
    starts = np.linspace(0, n - 1, s.eval_windows).astype(np.int64) * s.seq_len
    return torch.from_numpy(np.stack([heldout_ids[i:i + s.seq_len] for i in starts]).astype(np.int64))


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (Fedus et al. 2022, eq. 4, counting all top-k
    selections as transformers does; 2.0 when balanced), per layer, averaged over the layers.
    transformers' load_balancing_loss_func pools the layers' counts first, which lets an expert
    die in one layer as long as it is busy in another (it did, in a first run: experts with 0%)."""
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        n_experts = probs.shape[-1]
        chosen = torch.nn.functional.one_hot(probs.topk(top_k, dim=-1).indices, n_experts).sum(1).float()
        losses.append(n_experts * (chosen.mean(0) * probs.mean(0)).sum())
    return torch.stack(losses).mean()


@torch.no_grad()
def mean_loss(model, windows: torch.Tensor, batch_size: int = 8) -> float:
    model.eval()
    losses = [next_token_loss(model(input_ids=w, output_router_logits=False).logits, w).item()
              for w in windows.split(batch_size)]
    model.train()
    return float(np.mean(losses))


CURVE_FIELDS = ("step", "tokens", "lr", "train_loss", "balance_loss", "heldout_loss", "elapsed_s")


def write_curve(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CURVE_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def save_checkpoint(path: Path, model, optimizer, step: int, curve: list[dict], elapsed_s: float) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "curve": curve, "elapsed_s": elapsed_s}, tmp)
    os.replace(tmp, path)  # a crash while saving leaves the previous checkpoint intact


def train(model, train_ids: np.ndarray, heldout_ids: np.ndarray, s: TrainSettings, work: Path,
          curve_path: Path) -> float:
    """Trains to s.steps (resuming from work/checkpoint.pt); returns the training wall time."""
    ckpt_path = work / "checkpoint.pt"
    optimizer = make_optimizer(model, s)
    step, curve, elapsed_s = 0, [], 0.0
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, curve, elapsed_s = state["step"], state["curve"], state["elapsed_s"]
        print(f"resuming at step {step}", flush=True)
    sampler = WindowSampler(train_ids, s)
    held = eval_windows(heldout_ids, s)
    coef, top_k = model.config.router_aux_loss_coef, model.config.num_experts_per_tok
    model.train()
    recent: list[tuple[float, float]] = []
    started = time.perf_counter() - elapsed_s
    while step < s.steps:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, s)
        x = sampler.batch(step)
        out = model(input_ids=x, output_router_logits=True)
        lm_loss, aux_loss = next_token_loss(out.logits, x), balance_loss(out.router_logits, top_k)
        (lm_loss + coef * aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recent.append((lm_loss.item(), aux_loss.item()))
        step += 1
        if step % s.log_every == 0 or step == s.steps:
            row = {"step": step, "tokens": step * s.batch_size * s.seq_len, "lr": f"{learning_rate(step - 1, s):.3e}",
                   "train_loss": f"{np.mean([r[0] for r in recent]):.4f}",
                   "balance_loss": f"{np.mean([r[1] for r in recent]):.4f}", "heldout_loss": "",
                   "elapsed_s": f"{time.perf_counter() - started:.0f}"}
            if step % s.eval_every == 0 or step == s.steps:
                row["heldout_loss"] = f"{mean_loss(model, held):.4f}"
            curve.append(row)
            recent = []
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            write_curve(curve, curve_path)
        if step % s.checkpoint_every == 0 or step == s.steps:
            elapsed_s = time.perf_counter() - started
            save_checkpoint(ckpt_path, model, optimizer, step, curve, elapsed_s)
    return elapsed_s  # as the checkpoint holds it, so a rerun reports the same time


# ---------------------------------------------------------------------------------------------
# Held-out evaluation (HF model)


def llama_cpp_chunks(ids: list[int], bos: int, n_ctx: int) -> list[list[int]]:
    """llama.cpp's perplexity chunks (docs/perplexity.md): ids already start with BOS; each
    chunk of n_ctx tokens has its first token replaced by BOS; the remainder is dropped."""
    return [[bos] + ids[i * n_ctx + 1:(i + 1) * n_ctx] for i in range(len(ids) // n_ctx)]


@dataclass
class HeldoutPass:
    nll: np.ndarray  # float64, the scored tokens (second half of each chunk), llama.cpp's method
    targets: np.ndarray  # their token ids
    selected: np.ndarray  # int64 [n_layers, n_chunks * n_ctx, top_k] routed experts of every position
    n_ctx: int


@torch.no_grad()
def heldout_pass(model, chunks: list[list[int]], targets_of: list[list[int]]) -> HeldoutPass:
    """One forward pass per chunk: the scored tokens' nll and every position's top-k experts."""
    model.eval()
    n_ctx = len(chunks[0])
    first = n_ctx // 2
    top_k = model.config.num_experts_per_tok
    nll, targets, selected = [], [], []
    for chunk, original in zip(chunks, targets_of):
        out = model(input_ids=torch.tensor([chunk]), output_router_logits=True)
        logp = torch.log_softmax(out.logits[0, first:n_ctx - 1].double(), dim=-1)
        t = torch.tensor(original[first + 1:])
        nll.append((-logp[torch.arange(len(t)), t]).numpy())
        targets.append(t.numpy())
        # the router's choice: top-k of the softmax of its logits (= top-k of the logits)
        selected.append(torch.stack([r.topk(top_k, dim=-1).indices for r in out.router_logits]))
    return HeldoutPass(np.concatenate(nll), np.concatenate(targets), torch.cat(selected, dim=1).numpy(), n_ctx)


def unigram_nll(train_ids: np.ndarray, targets: np.ndarray, vocab_size: int) -> np.ndarray:
    """-log p(t) of an add-one smoothed unigram model of the training stream."""
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    return -np.log(counts[targets] / counts.sum())


def routing_stats(selected: np.ndarray, n_ctx: int, n_experts: int) -> dict:
    """Per layer: each expert's share of the top-k selections, and how often a token's experts
    were also chosen by the previous token of the same chunk (HOBBIT sec. 3.4, Fig. 10(a)),
    with the values uniformly random routing would give."""
    n_layers, n_positions, k = selected.shape
    chunked = selected.reshape(n_layers, n_positions // n_ctx, n_ctx, k)
    prev, cur = chunked[:, :, :-1], chunked[:, :, 1:]
    # shared[l, c, t, i]: is the current token's i-th expert among the previous token's?
    shared = (cur[..., :, None] == prev[..., None, :]).any(-1)
    layers = []
    for layer in range(n_layers):
        usage = np.bincount(selected[layer].ravel(), minlength=n_experts) / selected[layer].size
        layers.append({
            "layer": layer,
            "expert_share": [round(float(u), 4) for u in usage],
            "reuse_fraction": round(float(shared[layer].mean()), 4),
            "top1_reused": round(float((cur[layer] == prev[layer][..., :1]).any(-1).mean()), 4),
            "any_reused": round(float(shared[layer].any(-1).mean()), 4),
            # what reuse_fraction would be if tokens chose independently with these shares
            "reuse_fraction_independent": round(float(k * np.sum(usage ** 2)), 4),
            "effective_experts": round(float(np.exp(-np.sum(usage * np.log(np.maximum(usage, 1e-12))))), 2),
        })
    uniform_any = 1 - math.comb(n_experts - k, k) / math.comb(n_experts, k)
    return {"n_experts": n_experts, "top_k": k, "n_positions": n_positions, "n_ctx": n_ctx,
            "uniform_random": {"expert_share": 1 / n_experts, "reuse_fraction": k / n_experts,
                               "top1_reused": k / n_experts, "any_reused": round(uniform_any, 4)},
            "layers": layers}


# ---------------------------------------------------------------------------------------------
# GGUF: conversion, tokenizer parity, per-precision perplexity, completions


def pyedgemoe_cli(*args: str) -> str:
    cmd = [str(Path(sys.executable).with_name("pyedgemoe")), *args]
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def check_tokenizer_parity(gguf: Path, tokenizer, text: str) -> int:
    """llama.cpp's tokenization of the held-out text must be Hugging Face's, id for id."""
    from pyedgemoe import Engine

    expected = tokenizer.encode(text, add_special_tokens=False).ids
    with Engine(gguf, n_ctx=TrainSettings.seq_len) as eng:
        got = eng.tokenize(text, add_bos=False)
    if got != expected:
        at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        raise SystemExit(f"llama.cpp tokenizes the held-out text differently from HF at token {at}: "
                         f"{got[at:at + 8]} vs {expected[at:at + 8]}")
    return len(expected)


def gguf_perplexity(gguf: Path, text: str, n_ctx: int) -> dict:
    from pyedgemoe import Engine
    from pyedgemoe.perplexity import perplexity

    with Engine(gguf, n_ctx=n_ctx) as eng:
        r = perplexity(eng, text, n_ctx=n_ctx)
    return {"ppl": round(r.ppl, 4), "stderr": round(r.stderr, 4), "n_chunks": r.n_chunks,
            "n_tokens_scored": r.n_tokens_scored}


def precision_perplexities(gguf: Path, text: str, n_ctx: int, work: Path) -> dict:
    """Each precision exported to a standard GGUF, then scored like the HF model."""
    out = {}
    for precision in ("high", "low"):
        standard = work / f"demo-{precision}.gguf"
        pyedgemoe_cli("export", str(gguf), "-o", str(standard), "--precision", precision, "--force")
        out[precision] = gguf_perplexity(standard, text, n_ctx)
        print(f"{precision}: {out[precision]}", flush=True)
    return out


def greedy_completions(gguf: Path) -> list[dict]:
    return [{"prompt": p, "completion": pyedgemoe_cli("run", str(gguf), "-p", p, "-n", "48", "--temp", "0")}
            for p in COMPLETION_PROMPTS]


# ---------------------------------------------------------------------------------------------


def write_json(path: Path, obj: dict) -> None:
    """Indented, with lists of numbers on one line (the per-expert shares stay readable)."""
    text = json.dumps(obj, indent=1)
    text = re.sub(r"\[\s+([-0-9.e,\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    path.write_text(text + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="demo",
                        help="demo (16 experts, top-2) or fine (64 experts, top-8: a fine-grained MoE)")
    parser.add_argument("--work", type=Path, help="work directory (default: build/SHAPE-train)")
    parser.add_argument("--models", type=Path, default=REPO / "models", help="where the shipped files go")
    parser.add_argument("--steps", type=int, help="training steps (a probe: fewer; default: the shape's)")
    parser.add_argument("--threads", type=int, default=2, help="torch's threads (1 beside other CPU-bound work: "
                        "its threads spin at every barrier while the other waits for a core)")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    settings = TrainSettings(steps=args.steps or shape.steps)
    args.work = args.work or REPO / "build" / f"{args.shape}-train"
    torch.set_num_threads(args.threads)
    work, models, hf_dir = args.work, args.models, args.work / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    models.mkdir(parents=True, exist_ok=True)

    corpus = read_corpus()
    held_text = heldout_text(corpus)
    (work / "heldout.txt").write_text(held_text, encoding="utf-8")
    print(f"corpus: {len(corpus.train_files)} train files, {len(corpus.heldout_files)} held-out files", flush=True)

    if not (hf_dir / "tokenizer.json").exists():
        save_hf_tokenizer(train_tokenizer(corpus.train), hf_dir)
    tokenizer = load_tokenizer(hf_dir)
    train_ids = token_stream(tokenizer, corpus.train)
    heldout_ids = token_stream(tokenizer, corpus.heldout)
    print(f"tokens: {len(train_ids)} train, {len(heldout_ids)} held-out", flush=True)

    model = make_model(tokenizer.get_vocab_size(), settings.seq_len, shape.config)
    if (hf_dir / "model.safetensors").exists() and not (work / "checkpoint.pt").exists():
        raise SystemExit(f"{hf_dir} holds a model but {work}/checkpoint.pt is gone; remove {work} to retrain")
    train_seconds = train(model, train_ids, heldout_ids, settings, work, models / shape.curve)
    model.save_pretrained(str(hf_dir))

    # held-out: the text as `pyedgemoe perplexity -f heldout.txt --ctx 256` sees it
    bos = tokenizer.token_to_id(EOT)
    held_tokens = tokenizer.encode(held_text).ids  # BOS first
    chunks = llama_cpp_chunks(held_tokens, bos, settings.seq_len)
    originals = [held_tokens[i * settings.seq_len:(i + 1) * settings.seq_len] for i in range(len(chunks))]
    result = heldout_pass(model, chunks, originals)
    hf_ppl = float(np.exp(result.nll.mean()))
    unigram_ppl = float(np.exp(unigram_nll(train_ids, result.targets, tokenizer.get_vocab_size()).mean()))
    print(f"held-out ppl: model {hf_ppl:.3f}, unigram {unigram_ppl:.3f}", flush=True)
    write_json(models / shape.routing_stats, routing_stats(result.selected, settings.seq_len, shape.config["num_experts"]))

    gguf = models / shape.gguf
    pyedgemoe_cli("convert", str(hf_dir), "-o", str(gguf), "--high", "q8_0", "--low", shape.low, "--force")
    n_parity = check_tokenizer_parity(gguf, tokenizer, held_text)
    metrics = {
        "python": platform.python_version(),
        "corpus": {"root": "sysconfig.get_paths()['stdlib']", "sha256": corpus.sha256(),
                   "train_files": len(corpus.train_files), "heldout_files": len(corpus.heldout_files),
                   "train_bytes": sum(len(t.encode()) for t in corpus.train),
                   "heldout_bytes": len(held_text.encode()), "heldout_file_list": corpus.heldout_files},
        "tokenizer": {"vocab_size": tokenizer.get_vocab_size(), "train_tokens": len(train_ids),
                      "heldout_tokens": len(held_tokens), "llama_cpp_parity_tokens": n_parity},
        "model": {"parameters": sum(p.numel() for p in model.parameters()),
                  "config": {**shape.config, "vocab_size": tokenizer.get_vocab_size(),
                             "max_position_embeddings": settings.seq_len}},
        "training": {**asdict(settings), "wall_seconds": round(train_seconds),
                     "tokens": settings.steps * settings.batch_size * settings.seq_len,
                     "torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "threads": torch.get_num_threads()},
        "heldout": {"n_ctx": settings.seq_len, "n_chunks": len(chunks), "n_tokens_scored": len(result.nll),
                    "hf_ppl": round(hf_ppl, 4), "unigram_ppl": round(unigram_ppl, 4),
                    "gguf": precision_perplexities(gguf, held_text, settings.seq_len, work)},
        "gguf_bytes": gguf.stat().st_size,
        "completions": greedy_completions(gguf),
    }
    write_json(models / shape.metrics, metrics)
    print(json.dumps({k: metrics[k] for k in ("training", "heldout", "gguf_bytes")}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
