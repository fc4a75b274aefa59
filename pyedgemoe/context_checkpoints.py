"""Context checkpoints, llama-server's (--ctx-checkpoints): where the model's memory cannot drop its
last tokens (recurrent layers' states: Qwen3-Next's gated delta nets, LFM2's short convolutions; a
window-sized cache of sliding-window layers, --no-swa-full), a prompt that departs from what a
sequence holds before its end would be evaluated afresh: a chat's next turn, whose template writes
the last reply other than it was generated, all of the conversation again.

A checkpoint is that part of the memory (llama_state_seq_get_data_ext, partial) taken while a prompt
is evaluated, as llama-server takes them: 4 + n_ubatch and 4 tokens before the prompt's end. A later
prompt that shares a checkpoint's tokens restores it, the full-attention cache dropping what follows,
and evaluates only the rest. Each is kept with the tokens it was taken after, against which it is
checked; a sequence keeps its latest `limit` within limit x checkpoint_bytes, what load_plan counts
in the context's memory for them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_LIMIT = 4  # a chat's last two prompts (llama-server keeps 32; here each is counted in the memory plan)


def checkpoint_bytes(state_bytes: int) -> int:
    """What a checkpoint of a memory part of state_bytes takes at most: the part, and the records
    llama.cpp writes beside it (a header; a window's cells' positions, 12 bytes a cell against the
    hundreds of its keys and values): 1/64 more and 1 KiB."""
    return state_bytes + state_bytes // 64 + 1024 if state_bytes else 0


@dataclass(frozen=True)
class Checkpoint:
    tokens: np.ndarray  # int32: the tokens evaluated when it was taken
    data: bytes


def cuts(start: int, end: int, n_batch: int, n_ubatch: int) -> list[int]:
    """Where the evaluation of a prompt's positions start..end pauses for a checkpoint: llama-server's
    4 + n_ubatch and 4 tokens before the end (at most a batch before it), those after start."""
    return sorted({end - min(n_batch, offset) for offset in (4 + n_ubatch, 4)} & set(range(start + 1, end)))


class Checkpoints:
    """One sequence's checkpoints, the latest `limit` within limit x each_bytes."""

    def __init__(self, limit: int, each_bytes: int):
        self.limit = limit
        self.max_bytes = limit * each_bytes
        self._held: list[Checkpoint] = []

    @property
    def nbytes(self) -> int:
        return sum(len(c.data) for c in self._held)

    def take(self, ctx, seq: int, tokens: list[int]) -> None:
        """A checkpoint of sequence seq of ctx, which has evaluated tokens (superseding one taken after
        the same tokens)."""
        taken = Checkpoint(np.asarray(tokens, np.int32), ctx.sequence_state(seq, partial=True))
        self._held = [c for c in self._held if not np.array_equal(c.tokens, taken.tokens)] + [taken]
        while self._held and (len(self._held) > self.limit or self.nbytes > self.max_bytes):
            del self._held[0]

    def restore(self, ctx, seq: int, held: list[int], n: int) -> int:
        """Where ctx could not keep the first n of the tokens sequence seq holds (held): the checkpoint
        taken after the longest prefix of them restored and what follows it dropped; the tokens kept (0:
        no checkpoint serves)."""
        prefix = np.asarray(held[:n], np.int32)
        for c in sorted(self._held, key=lambda c: -len(c.tokens)):
            k = len(c.tokens)
            if 0 < k <= n and np.array_equal(prefix[:k], c.tokens):
                ctx.set_sequence_state(seq, c.data, partial=True)
                if ctx.truncate(k, seq):
                    return k
        return 0
