"""The KL divergence of a run's token distributions from a base run's, as llama.cpp's
`llama-perplexity --kl-divergence-base FNAME` (write the base) and `--kl-divergence` (compare)
compute it: the measure of what a lossy setting (LOW copies, skipped experts, stand-ins, a
quantization) costs, beside the perplexity. The base file is llama.cpp's: "_logits_", n_ctx
(uint32), n_vocab and n_chunk (int32), the chunks' tokens (int32), then for each chunk the log
probabilities of its scored positions (perplexity.scored_logits), each row two floats (the scale
and the least log probability kept, 16 below the most likely) and n_vocab uint16 steps, padded to
an even count. So a base written by stock llama.cpp (a model every expert of which it holds, on
any machine) is compared here, and one written here is read by llama-perplexity.

The comparison evaluates the base's own tokens as the base run did and accumulates llama.cpp's
sums: the KL divergence of each position, its perplexity and the base's, the probability change of
the actual token (delta p) and whether the most likely token is the same (same top p).
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from typing import IO

import numpy as np

from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.perplexity import BLOCK_BYTES, check_chunks, scored_logits

MAGIC = b"_logits_"
LOG_PROB_RANGE = 16.0  # log probabilities more than this below the most likely are stored as the least kept


def _row_width(n_vocab: int) -> int:
    """uint16 values a row takes: two floats, then n_vocab steps padded to an even count."""
    return 2 * ((n_vocab + 1) // 2) + 4


def compress(logits: np.ndarray) -> np.ndarray:
    """Rows of logits as llama.cpp stores their log-softmax: [n, _row_width(n_vocab)] uint16."""
    n, n_vocab = logits.shape
    top, low = logits.max(axis=1), np.maximum(logits.min(axis=1), logits.max(axis=1) - LOG_PROB_RANGE)
    log_sum_exp = np.log(np.exp((logits - top[:, None]).astype(np.float64)).sum(axis=1)).astype(np.float32)
    scale = ((top - low) / np.float32(65535)).astype(np.float32)
    out = np.zeros((n, _row_width(n_vocab)), dtype=np.uint16)
    head = np.stack([scale, low - top - log_sum_exp], axis=1).astype(np.float32)
    out[:, :4] = head.view(np.uint16)
    with np.errstate(divide="ignore", invalid="ignore"):
        steps = np.where(logits > low[:, None], np.rint((logits - low[:, None]) / scale[:, None]), 0)
    out[:, 4:4 + n_vocab] = np.where(scale[:, None] > 0, steps, 0).astype(np.uint16)
    return out


def expand(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """Base rows (compress's) as float32 log probabilities [n, n_vocab]."""
    head = np.ascontiguousarray(rows[:, :4]).view(np.float32)
    return (head[:, :1] * rows[:, 4:4 + n_vocab] + head[:, 1:2]).astype(np.float32)


class BaseWriter:
    """A base for tokens cut into n_chunks chunks of n_ctx, written into file (binary; path: what it
    is to become, for messages): its header, then each chunk's rows as perplexity's on_logits gives
    them (the header with the first)."""

    def __init__(self, file: IO[bytes], path, tokens: list[int], n_ctx: int, n_chunks: int) -> None:
        self._file, self.path, self._head = file, path, (tokens[:n_ctx * n_chunks], n_ctx, n_chunks)

    def __call__(self, targets: np.ndarray, logits: np.ndarray) -> None:
        try:
            if self._head is not None:
                tokens, n_ctx, n_chunks = self._head
                self._file.write(MAGIC + struct.pack("<Iii", n_ctx, logits.shape[1], n_chunks))
                self._file.write(np.asarray(tokens, dtype="<i4").tobytes())
                self._head = None
            block = max(1, BLOCK_BYTES // (8 * logits.shape[1]))
            for start in range(0, len(logits), block):
                self._file.write(compress(logits[start:start + block]).astype("<u2").tobytes())
        except OSError as e:
            raise InvalidOptionError(f"cannot write the KL-divergence base {self.path}: {e.strerror or e}") from None


@dataclass
class Base:
    """A base file's header and its tokens; its rows are read chunk by chunk (rows())."""
    path: str
    n_ctx: int
    n_vocab: int
    n_chunks: int
    tokens: list[int]
    offset: int  # where the rows begin

    @classmethod
    def read(cls, path) -> "Base":
        """The base at path: InvalidOptionError where it is none, or damaged."""
        try:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC) + 12)
                if len(head) < len(MAGIC) + 12 or not head.startswith(MAGIC):
                    raise InvalidOptionError(f"{path} is not a KL-divergence base (llama-perplexity's "
                                             "--kl-divergence-base file)")
                n_ctx, n_vocab, n_chunks = struct.unpack("<Iii", head[len(MAGIC):])
                size = len(MAGIC) + 12 + 4 * n_ctx * n_chunks + \
                    2 * n_chunks * (n_ctx - 1 - n_ctx // 2) * _row_width(n_vocab)
                if n_chunks <= 0 or n_vocab <= 0 or n_ctx < 3 or size != os.fstat(f.fileno()).st_size:
                    raise InvalidOptionError(f"{path}: {n_chunks} chunks of {n_ctx} tokens of a vocabulary of "
                                             f"{n_vocab} are not its size: a damaged base (or one cut short)")
                raw = f.read(4 * n_ctx * n_chunks)
        except OSError as e:
            raise InvalidOptionError(f"cannot read the KL-divergence base {path}: {e.strerror}") from None
        tokens = np.frombuffer(raw, dtype="<i4")
        if len(tokens) != n_ctx * n_chunks or tokens.min() < 0 or tokens.max() >= n_vocab:
            raise InvalidOptionError(f"{path}: its tokens are cut short or not of its vocabulary: a damaged base")
        return cls(str(path), n_ctx, n_vocab, n_chunks, tokens.tolist(), len(MAGIC) + 12 + len(raw))

    def rows(self):
        """Each chunk's rows as stored (compress's): [n_ctx - 1 - n_ctx/2, _row_width(n_vocab)] uint16."""
        n_rows, width = self.n_ctx - 1 - self.n_ctx // 2, _row_width(self.n_vocab)
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            for i in range(self.n_chunks):
                raw = f.read(2 * n_rows * width)
                if len(raw) != 2 * n_rows * width:
                    raise InvalidOptionError(f"{self.path}: cut short at chunk {i + 1} of {self.n_chunks}")
                rows = np.frombuffer(raw, dtype="<u2").reshape(n_rows, width)
                head = np.ascontiguousarray(rows[:, :4]).view(np.float32)
                if not (np.isfinite(head).all() and (head[:, 0] >= 0).all()):  # NaN read as "no divergence"
                    raise InvalidOptionError(f"{self.path}: chunk {i + 1} holds a scale or a log probability that "
                                             "is no finite number: a damaged base")
                yield rows


@dataclass
class Divergence:
    """llama.cpp's sums over every scored position (its kl_divergence_result), and the values whose
    percentiles it prints."""
    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    n_same_top: int = 0
    count: int = 0
    kld: list[np.ndarray] = field(default_factory=list, repr=False)
    p_diff: list[np.ndarray] = field(default_factory=list, repr=False)

    def add(self, logits: np.ndarray, base_rows: np.ndarray, targets: np.ndarray) -> None:
        """One chunk: this run's logits, the base's rows (as stored), the tokens they predict; a block
        of rows at a time (float64 temporaries of a block within perplexity's bound)."""
        n_vocab = logits.shape[1]
        block = max(1, BLOCK_BYTES // (8 * n_vocab))
        for start in range(0, len(targets), block):
            end = start + block
            self._add(logits[start:end], expand(base_rows[start:end], n_vocab), targets[start:end])

    def _add(self, logits: np.ndarray, base: np.ndarray, targets: np.ndarray) -> None:
        rows = np.arange(len(targets))
        top = logits.max(axis=1)
        log_sum_exp = np.log(np.exp((logits - top[:, None]).astype(np.float64)).sum(axis=1))
        log_p = (logits - top[:, None]).astype(np.float64) - log_sum_exp[:, None]
        nll = -log_p[rows, targets]
        nll_base = -base[rows, targets].astype(np.float64)
        kept = base > -LOG_PROB_RANGE  # as llama.cpp sums: the base's probable tokens
        p_base = np.where(kept, np.exp(base.astype(np.float64)), 0.0)
        kld = (p_base * np.where(kept, base - log_p, 0.0)).sum(axis=1)
        p_diff = np.exp(-nll) - np.exp(-nll_base)
        self.sum_nll += nll.sum()
        self.sum_nll2 += (nll * nll).sum()
        self.sum_nll_base += nll_base.sum()
        self.sum_nll_base2 += (nll_base * nll_base).sum()
        self.sum_nll_nll_base += (nll * nll_base).sum()
        self.sum_kld += kld.sum()
        self.sum_kld2 += (kld * kld).sum()
        self.sum_p_diff += p_diff.sum()
        self.sum_p_diff2 += (p_diff ** 2).sum()
        self.sum_p_diff4 += (p_diff ** 4).sum()
        self.n_same_top += int((logits.argmax(axis=1) == base.argmax(axis=1)).sum())
        self.count += len(targets)
        self.kld.append(kld.astype(np.float32))
        self.p_diff.append(p_diff.astype(np.float32))


def compare(engine, base: Base, n_chunks: int | None = None, one_token_per_step: bool = False, on_chunk=None) -> Divergence:
    """The divergence of engine's run from the base, over its first n_chunks chunks (None: all);
    on_chunk(i, divergence) after each."""
    if base.n_vocab != engine.n_vocab:
        raise InvalidOptionError(f"{base.path} is of a vocabulary of {base.n_vocab} tokens, this model's has "
                                 f"{engine.n_vocab}: another model's base")
    check_chunks(engine, base.n_ctx, n_chunks)
    n = base.n_chunks if n_chunks is None else min(n_chunks, base.n_chunks)
    out = Divergence()
    chunks = scored_logits(engine, base.tokens, base.n_ctx, n, one_token_per_step)
    for i, ((targets, logits), base_rows) in enumerate(zip(chunks, base.rows())):
        out.add(logits, base_rows, targets)
        if on_chunk is not None:
            on_chunk(i, out)
    return out


def mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    """llama.cpp's mean and its uncertainty from running sums."""
    if count < 1:
        return 0.0, 0.0
    mean = total / count
    var = total2 / count - mean * mean
    return mean, math.sqrt(var / (count - 1)) if var > 0 and count > 10 else 0.0


def _covariance(total_a: float, total_b: float, total_ab: float, count: int) -> float:
    return 0.0 if count < 10 else (total_ab / count - (total_a / count) * (total_b / count)) / (count - 1)


HEADER = "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p"


def chunk_line(i: int, d: Divergence) -> str:
    """llama-perplexity's line after chunk i: PPL, ln(PPL(Q)/PPL(base)), KLD, RMS delta p, same top p."""
    log_ppl, log_ppl_base = mean_and_uncertainty(d.sum_nll, d.sum_nll2, d.count), \
        mean_and_uncertainty(d.sum_nll_base, d.sum_nll_base2, d.count)
    ppl = math.exp(log_ppl[0])
    cov = _covariance(d.sum_nll, d.sum_nll_base, d.sum_nll_nll_base, d.count)
    ratio_unc = math.sqrt(max(0.0, log_ppl[1] ** 2 + log_ppl_base[1] ** 2 - 2 * cov))
    kld = mean_and_uncertainty(d.sum_kld, d.sum_kld2, d.count)
    mse = mean_and_uncertainty(d.sum_p_diff2, d.sum_p_diff4, d.count)
    rms = math.sqrt(mse[0])
    top = d.n_same_top / d.count
    top_unc = math.sqrt(top * (1 - top) / (d.count - 1)) if d.count > 1 else 0.0
    return (f"{i + 1:4d}    {ppl:9.4f} ± {ppl * log_ppl[1]:9.4f}    {log_ppl[0] - log_ppl_base[0]:10.5f} ± "
            f"{ratio_unc:10.5f}    {kld[0]:10.5f} ± {kld[1]:10.5f}    {100 * rms:6.3f} ± "
            f"{100 * (0.5 / rms * mse[1] if rms else 0):6.3f} %    {100 * top:6.3f} ± {100 * top_unc:6.3f} %")


def _percentile(values: np.ndarray, fraction: float) -> float:
    """llama.cpp's: linear between the sorted values."""
    p = fraction * (len(values) - 1)
    i = int(p)
    return float((1 - (p - i)) * values[i] + (p - i) * values[min(i + 1, len(values) - 1)])


def summary(d: Divergence) -> list[str]:
    """llama-perplexity's statistics at the end (none for fewer than 100 positions, as there)."""
    if d.count < 100:
        return []
    log_ppl = mean_and_uncertainty(d.sum_nll, d.sum_nll2, d.count)
    log_base = mean_and_uncertainty(d.sum_nll_base, d.sum_nll_base2, d.count)
    ppl, ppl_base = math.exp(log_ppl[0]), math.exp(log_base[0])
    ppl_unc, base_unc = ppl * log_ppl[1], ppl_base * log_base[1]
    cov = _covariance(d.sum_nll, d.sum_nll_base, d.sum_nll_nll_base, d.count)
    ratio, ratio_unc = log_ppl[0] - log_base[0], math.sqrt(max(0.0, log_ppl[1] ** 2 + log_base[1] ** 2 - 2 * cov))
    cor = cov / (log_ppl[1] * log_base[1]) if log_ppl[1] * log_base[1] else 0.0
    diff_unc = math.sqrt(max(0.0, ppl_unc ** 2 + base_unc ** 2 - 2 * ppl * ppl_base * cov))
    kld, p_diff = np.sort(np.concatenate(d.kld)), np.sort(np.concatenate(d.p_diff))
    median = lambda v: float(np.median(v))  # noqa: E731 - the middle, or the mean of the two middle ones
    k = mean_and_uncertainty(d.sum_kld, d.sum_kld2, d.count)
    dp = mean_and_uncertainty(d.sum_p_diff, d.sum_p_diff2, d.count)
    mse = mean_and_uncertainty(d.sum_p_diff2, d.sum_p_diff4, d.count)
    rms = math.sqrt(mse[0])
    top = d.n_same_top / d.count
    lines = ["====== Perplexity statistics ======",
             f"Mean PPL(Q)                   : {ppl:10.6f} ± {ppl_unc:10.6f}",
             f"Mean PPL(base)                : {ppl_base:10.6f} ± {base_unc:10.6f}",
             f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * cor:6.2f}%",
             f"Mean ln(PPL(Q)/PPL(base))     : {ratio:10.6f} ± {ratio_unc:10.6f}",
             f"Mean PPL(Q)/PPL(base)         : {math.exp(ratio):10.6f} ± {math.exp(ratio) * ratio_unc:10.6f}",
             f"Mean PPL(Q)-PPL(base)         : {ppl - ppl_base:10.6f} ± {diff_unc:10.6f}", "",
             "====== KL divergence statistics ======",
             f"Mean    KLD: {k[0]:10.6f} ± {k[1]:10.6f}", f"Maximum KLD: {kld[-1]:10.6f}"]
    for label, fraction in (("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.90)):
        lines.append(f"{label}   KLD: {_percentile(kld, fraction):10.6f}")
    lines.append(f"Median  KLD: {median(kld):10.6f}")
    for label, fraction in (("10.0%", 0.10), (" 5.0%", 0.05), (" 1.0%", 0.01), (" 0.1%", 0.001)):
        lines.append(f"{label}   KLD: {_percentile(kld, fraction):10.6f}")
    lines += [f"Minimum KLD: {kld[0]:10.6f}", "", "====== Token probability statistics ======",
              f"Mean    Δp: {100 * dp[0]:6.3f} ± {100 * dp[1]:5.3f} %", f"Maximum Δp: {100 * p_diff[-1]:6.3f}%"]
    for label, fraction in (("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.90), ("75.0%", 0.75)):
        lines.append(f"{label}   Δp: {100 * _percentile(p_diff, fraction):6.3f}%")
    lines.append(f"Median  Δp: {100 * median(p_diff):6.3f}%")
    for label, fraction in (("25.0%", 0.25), ("10.0%", 0.10), (" 5.0%", 0.05), (" 1.0%", 0.01), (" 0.1%", 0.001)):
        lines.append(f"{label}   Δp: {100 * _percentile(p_diff, fraction):6.3f}%")
    lines += [f"Minimum Δp: {100 * p_diff[0]:6.3f}%",
              f"RMS Δp    : {100 * rms:6.3f} ± {100 * (0.5 / rms * mse[1] if rms else 0):5.3f} %",
              f"Same top p: {100 * top:6.3f} ± {100 * math.sqrt(top * (1 - top) / (d.count - 1)):5.3f} %"]
    return lines
