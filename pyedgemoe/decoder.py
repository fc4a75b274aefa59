"""The native context of an Engine and the sequences of its KV cache, behind one lock.

Every decode call goes through `governed` (Engine._governed: the thread counts the governor chose,
timed for it), from the Engine's own calls, its one sequence's generations and the batcher's alike.
With MoBiLE's big-little on (docs/systems.md), a one-token decode runs the little pass first and
redoes a low-confidence token with the whole top-k.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Callable, Generator

import numpy as np

from pyedgemoe import _native
from pyedgemoe.context_checkpoints import Checkpoints, cuts
from pyedgemoe.errors import ExpertLoadError, ForkedEngineError, InvalidOptionError, ModelLoadError, RemoteDeviceError
from pyedgemoe.generation import KVSequence, SequenceState, as_token_ids
from pyedgemoe.native_exit import closed_error


def top_probability(logits: np.ndarray) -> float:
    """The largest softmax probability of one row of logits (MoBiLE's confidence)."""
    row = np.asarray(logits, dtype=np.float64)
    return float(1.0 / np.exp(row - row.max()).sum())


class Decoder:
    def __init__(self, model, ctx, n_seq: int, governed: Callable, big_little: float = 0.0, no_drafts: str = "",
                 checkpoints: int = 0, checkpoint_bytes: int = 0, n_ubatch: int = 512,
                 loras: tuple[tuple[str, float], ...] = ()):
        self.model = model
        self._process = os.getpid()  # the one it works in (native_exit: a forked child)
        self._ctx = ctx
        self.lock = threading.RLock()  # held while the native context or the expert cache is in use
        # each with its context checkpoints (pyedgemoe.context_checkpoints), where the plan keeps some
        self.sequences = [KVSequence(s, checkpoints=Checkpoints(checkpoints, checkpoint_bytes) if checkpoints
                                     else None) for s in range(n_seq)]
        self.n_ubatch = n_ubatch
        self._governed = governed
        self.big_little = big_little  # MoBiLE's gamma; 0: off
        self.no_drafts = no_drafts  # why a batch of drafted tokens cannot be verified here ("": it can)
        self.big_little_counts = {"little_tokens": 0, "fallbacks": 0, "prefetched": 0}
        # (seq, n): the last decode's last output is the logits after sequence seq's first n tokens
        self.last_output: tuple[int, int] | None = None
        self._lost: str | None = None  # a remote device's error (_expert_errors)
        # the model, as a saved state names it: what its KV cache's layout and meaning depend on (not
        # the weights' types: llama.cpp checks the architecture alone), with the LoRA adapters that change it
        self.identity = (f"{model.metadata().get('general.architecture', '?')}, {model.n_layer} layers of "
                         f"{model.n_embd}, {model.n_vocab} tokens, {model.n_params} parameters"
                         + "".join(f", LoRA {os.path.basename(path)} at {scale:g}" for path, scale in loras))

    def live(self, forked_ok: bool = False):
        """The native context; RuntimeError once closed, RemoteDeviceError once a remote device was lost,
        ForkedEngineError in a forked child (unless forked_ok: the vocabulary's use)."""
        if self._ctx is None:
            raise closed_error("this Engine is closed")
        if self._process != os.getpid() and not forked_ok:
            raise ForkedEngineError(f"this Engine was made in process {self._process}, which forked this one: it "
                                    "computes there only (its threads, OpenMP's, an expert cache's, a batcher's, and a "
                                    "GPU's state stayed there); make an Engine in this process, or start processes "
                                    "with multiprocessing's 'spawn' (its vocabulary works here)")
        if self._lost is not None:
            raise RemoteDeviceError(f"{self._lost} earlier: this Engine can only be closed (its KV cache and "
                                    "weights were there)")
        return self._ctx

    def forked_child(self) -> None:
        """In a forked child: a lock of its own (another thread's call may have held the parent's at the fork),
        so that every call gets as far as live() to say it is the parent's."""
        self.lock = threading.RLock()

    def close(self) -> None:
        """Frees the context and, with it, this decoder's hold on the model (its memory and mapping)."""
        self._ctx = self.model = None

    def decode(self, ids: list[int], pos0: int, sequence: KVSequence | None = None,
               all_logits: bool = False) -> np.ndarray:
        """Evaluates ids at positions pos0.. of sequence (default the first); the logits of the last
        token, or of every token with all_logits."""
        seq = 0 if sequence is None else sequence.seq
        with self._expert_errors(), self.lock:
            ctx = self.live()
            self.last_output = None
            if self.big_little > 0 and len(ids) == 1:
                logits = self._governed(1, lambda: self._decode_big_little(ctx, ids, pos0, all_logits))
            else:
                logits = self._governed(1 if len(ids) == 1 else 0, lambda: ctx.decode(ids, pos0, all_logits, seq))
            self.last_output = (seq, pos0 + len(ids))
            return logits

    def prefill(self, ids: list[int], sequence: KVSequence,
                all_logits: bool = False) -> Generator[int, None, np.ndarray]:
        """decode of a prompt's ids after what sequence holds, a decode call per n_batch ids (as
        llama-cli and llama-cpp-python's eval make them; each computes its last row): yields the count
        of ids evaluated after each, so that Ctrl-C (KeyboardInterrupt) and a client gone stop a long
        prompt between two; returns decode's logits. With context checkpoints, paused to take one where
        llama-server does (context_checkpoints.cuts)."""
        held, end = len(sequence.tokens), len(sequence.tokens) + len(ids)
        n_batch = self.live().n_batch
        pauses = cuts(held, end, n_batch, self.n_ubatch) if sequence.checkpoints is not None else []
        rows, start = [], held
        for pause in pauses + [end]:
            for stop in [*range(start + n_batch, pause, n_batch), pause]:
                with self.lock:
                    rows.append(self.decode(ids[start - held:stop - held], start, sequence, all_logits))
                    if stop == pause < end:
                        sequence.checkpoints.take(self.live(), sequence.seq, sequence.tokens + ids[:stop - held])
                start = stop
                yield start - held
        return np.concatenate(rows) if all_logits else rows[-1]

    def decode_step(self, tokens: list[int], positions: list[int], sequences: list[KVSequence]) -> None:
        """One token for each of several sequences in one llama_decode (the i-th picked by sample(s, i))."""
        with self._expert_errors(), self.lock:
            ctx = self.live()
            self.last_output = None
            self._governed(len(tokens), lambda: ctx.decode_step(tokens, positions, [s.seq for s in sequences]))

    def keep(self, sequence: KVSequence, n: int) -> int:
        """Drops what sequence holds after its first n positions; the count kept (0 where the model's
        memory cannot drop a part)."""
        with self._expert_errors(), self.lock:  # clearing a remote device's KV cache is a call to it
            ctx = self.live()
            self.last_output = None
            if n > 0 and not ctx.truncate(n, sequence.seq):
                n = sequence.checkpoints.restore(ctx, sequence.seq, sequence.tokens, n) if sequence.checkpoints else 0
            if n == 0 and len(self.sequences) == 1:
                ctx.clear()  # the expert cache's per-sequence records restart too
            elif n == 0:
                ctx.truncate(0, sequence.seq)
        del sequence.tokens[n:]
        return n

    def rewind(self, sequence: KVSequence, n: int) -> None:
        """sequence holds its first n tokens (a memory that cannot drop a part evaluates them again)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(sequence.tokens):
            raise InvalidOptionError(f"the context can keep 0 to the {len(sequence.tokens)} tokens it holds, "
                                     f"got {n!r}"[:200])
        with self.lock:
            held = list(sequence.tokens)
            kept = self.keep(sequence, n)
            if kept < n:
                self.decode(held[kept:n], kept, sequence)
                sequence.tokens[:] = held[:n]

    def clear(self) -> None:
        """Forgets every sequence."""
        with self._expert_errors(), self.lock:
            self.live().clear()
            self.last_output = None
        for s in self.sequences:
            s.tokens.clear()

    def save_file(self, path: str, sequence: KVSequence, n: int) -> None:
        """The context's state holding sequence's first n positions (the context's one sequence), in
        llama.cpp's session file (llama_state_save_file): what follows them is dropped (a memory that
        cannot drop a part evaluates them again: rewind)."""
        with self._expert_errors(), self.lock:
            self.rewind(sequence, n)
            self.live().save_state_file(path, sequence.tokens)

    def load_file(self, path: str, sequence: KVSequence) -> None:
        """sequence (the context's one) holds what a session file holds; RuntimeError naming why not."""
        with self._expert_errors(), self.lock:
            self.last_output = None
            sequence.tokens.clear()
            sequence.tokens[:] = self.live().load_state_file(path)

    def save_sequence_file(self, path: str, sequence: KVSequence) -> int:
        """What sequence holds, in llama-server's slot file (llama_state_seq_save_file); the bytes
        written (RuntimeError naming why none)."""
        with self._expert_errors(), self.lock:
            return self.live().save_sequence_file(path, sequence.seq, sequence.tokens)

    def load_sequence_file(self, path: str, sequence: KVSequence) -> int:
        """sequence holds what a slot file holds; the bytes read (RuntimeError naming why not: then
        it holds nothing)."""
        with self._expert_errors(), self.lock:
            self.last_output = None
            sequence.tokens.clear()
            sequence.tokens[:], read = self.live().load_sequence_file(path, sequence.seq)
            return read

    def save(self, sequence: KVSequence) -> SequenceState:
        with self._expert_errors(), self.lock:
            return SequenceState(tuple(sequence.tokens), self.live().sequence_state(sequence.seq), self.identity)

    def restore(self, sequence: KVSequence, state: SequenceState) -> None:
        """sequence holds what state says it held."""
        if not isinstance(state, SequenceState):
            raise InvalidOptionError(f"load_state takes what save_state gave, got {type(state).__name__}")
        if state.model and state.model != self.identity:
            raise InvalidOptionError(f"load_state: the state is of another model ({state.model}); this one is "
                                     f"{self.identity}")
        tokens = as_token_ids(state.tokens, "load_state: the state's tokens")
        if not isinstance(state.kv, bytes):
            raise InvalidOptionError(f"load_state: the state's kv must be bytes (save_state's), got {type(state.kv).__name__}")
        with self._expert_errors(), self.lock:
            self.keep(sequence, 0)  # what it held goes: llama.cpp's load empties the sequence where it fails
            try:
                self.live().set_sequence_state(sequence.seq, state.kv)
            except ValueError as e:
                raise InvalidOptionError(f"load_state: {e}; the sequence holds nothing now") from None
            if not self.live().holds(sequence.seq, tokens):
                self.keep(sequence, 0)
                raise InvalidOptionError(f"load_state: the state's KV cache does not hold its {len(tokens)} tokens (of "
                                         "this vocabulary, at their positions): a state save_state did not give; the "
                                         "sequence holds nothing now")
            sequence.tokens[:] = tokens

    def sample(self, sampler, ids: list[int], i: int = -1) -> int:
        """sampler's (a TokenSampler's) pick after ids, the tokens evaluated, from output i of the
        last decode (-1: its last): the first read of its logits, where a remote device's loss shows."""
        with self._expert_errors(), self.lock:
            return sampler.pick(self.live(), i, ids)

    def sample_next(self, sequence: KVSequence, sampler) -> int:
        """sampler's pick of the token after what sequence holds: from the last decode's logits
        where they are those, else after its last token is evaluated again."""
        with self.lock:
            n = len(sequence.tokens)
            if n == 0:
                raise InvalidOptionError("sample picks the token after those evaluated: eval some first")
            if self.last_output != (sequence.seq, n):
                tokens = list(sequence.tokens)
                kept = self.keep(sequence, n - 1)
                self.decode(tokens[kept:], kept, sequence)
                sequence.tokens[:] = tokens
            return self.sample(sampler, sequence.tokens)

    def output_logits(self, i: int = -1) -> np.ndarray:
        """The logits of output i of the last decode (-1: its last)."""
        with self._expert_errors(), self.lock:
            return self.live().output_logits(i)

    def embed(self, tokens: list[int], sequence: KVSequence) -> np.ndarray:
        """The embeddings of tokens on sequence, which holds nothing before or after: a row per
        token, or one pooled row (the context's pooling type)."""
        with self._expert_errors(), self.lock:
            ctx = self.live()
            self.keep(sequence, 0)
            try:
                return self._governed(0, lambda: ctx.embed(tokens, sequence.seq))
            finally:
                self.keep(sequence, 0)

    def is_eog(self, token: int) -> bool:
        self.live()  # RuntimeError once closed (a generation's hook may close its Engine)
        return self.model.is_eog(token)

    @contextmanager
    def _expert_errors(self):
        """An expert read that failed: the native side cleared the KV cache, so every sequence lost
        what it held; raised as pyedgemoe's ExpertLoadError. A remote device (an RPC worker) lost:
        its part of the model with it, so every later call raises too (live)."""
        try:
            yield
        except _native.ExpertLoadError as e:
            for s in self.sequences:
                s.tokens.clear()
            raise ExpertLoadError(str(e)) from None
        except RemoteDeviceError as e:
            self._lost = self._lost or str(e)  # the first loss (live() raises it again, "earlier")
            raise

    def _decode_big_little(self, ctx, ids: list[int], pos: int, all_logits: bool) -> np.ndarray:
        """MoBiLE: the token through each layer's top-k/2 experts; when its top output probability is
        below big_little, its KV entry is removed and it runs again with the whole top-k, the experts
        the little pass's routers chose prefetched."""
        counts = self.big_little_counts
        self.model.set_expert_little(True)
        try:
            logits = ctx.decode(ids, pos, all_logits)
        finally:
            self.model.set_expert_little(False)
        counts["little_tokens"] += 1
        if top_probability(np.asarray(logits).reshape(-1, self.model.n_vocab)[-1]) >= self.big_little:
            return logits
        counts["fallbacks"] += 1
        if not ctx.truncate(pos):
            raise ModelLoadError("big_little: this model's memory cannot drop a token to redo it")
        counts["prefetched"] += self.model.prefetch_expert_big()
        return ctx.decode(ids, pos, all_logits)
