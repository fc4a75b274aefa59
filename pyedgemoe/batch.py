"""Several generations decoding together: Engine(n_parallel=N), `pyedgemoe serve --parallel N`.

The context holds N sequences (llama.cpp's multi-sequence KV cache, n_ctx / N positions each).
One thread of the Batcher's own runs the model: it prefills each new generation into a free
sequence, then steps every running generation whose consumer asked for its next token with one
llama_decode of one token per sequence. The experts that several sequences route to in a step
are loaded once, which is what makes serving N clients cheaper per token than serving them in
turn. Each sequence's rows are computed as when it decodes alone, so a generation's tokens do not
depend on the others (tests/test_batch.py).

A consumer (the iterator Batcher.generate returns, on any thread) blocks until its next token;
closing it ends the generation and frees its sequence for the next one.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from pyedgemoe import _native
from pyedgemoe.errors import ExpertLoadError

# How long a step waits for the consumers of running generations to ask for their next token, so
# that their tokens share the step; a consumer that takes longer is stepped in a later one.
GATHER_SECONDS = 0.002
_END = object()


def shared_prefix(held: list[int], prompt: list[int]) -> int:
    """How many of prompt's tokens a KV cache holding held can keep: their common prefix, short of
    prompt's last token (evaluated again, for its logits)."""
    n, limit = 0, min(len(held), len(prompt) - 1)
    while n < limit and held[n] == prompt[n]:
        n += 1
    return n


@dataclass
class _Sequence:
    seq: int
    tokens: list[int] = field(default_factory=list)  # what its KV cache holds, position by position
    busy: bool = False


@dataclass
class _Generation:
    prompt: list[int]
    budget: int  # tokens to generate at most
    sampler: object
    ignore_eos: bool
    timings: object  # the Engine's GenerationStats of this generation
    fresh: bool  # evaluate the whole prompt, reusing no prefix (a seeded generation: Engine._generation)
    out: queue.Queue = field(default_factory=queue.Queue)  # tokens, then _END (or an exception)
    want: bool = True  # its consumer waits for its next token
    closed: bool = False  # its consumer has gone: its sequence is free
    done: bool = False  # it has ended (_END or an error sent)
    sequence: _Sequence | None = None
    last: int = -1  # the token sampled last, decoded at the next step
    decode_start: float = 0.0


class Batcher:
    def __init__(self, engine, n_seq: int) -> None:
        self._engine = engine
        self._sequences = [_Sequence(s) for s in range(n_seq)]
        self._pending: list[_Generation] = []  # waiting for a free sequence, oldest first
        self._running: list[_Generation] = []
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="pyedgemoe-batcher", daemon=True)
        self._thread.start()

    def generate(self, prompt: list[int], budget: int, sampler, ignore_eos: bool, timings,
                 fresh: bool) -> Iterator[int]:
        """The generation's tokens; it queues for a sequence when the first is asked for."""
        g = _Generation(prompt, budget, sampler, ignore_eos, timings, fresh)
        with self._cond:
            if self._closing:
                raise RuntimeError("this Engine is closed")
            self._pending.append(g)
            self._cond.notify_all()
        try:
            while True:
                item = g.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                with self._cond:
                    g.want = True
                    self._cond.notify_all()
        finally:
            with self._cond:
                g.closed = True
                if g in self._pending:
                    self._pending.remove(g)
                self._cond.notify_all()

    def close(self) -> None:
        """Ends the thread; generations still running or waiting raise RuntimeError."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    # -- the model's thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._drop_closed()
                while not self._closing and not self._admissible() and not self._waiting():
                    self._cond.wait()
                    self._drop_closed()
                if self._closing:
                    for g in self._pending + self._running:
                        self._end(g, RuntimeError("this Engine is closed"))
                    return
                deadline = time.monotonic() + GATHER_SECONDS
                while any(not g.want and not g.closed and not g.done for g in self._running):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                stepping = self._waiting()
                admitted = []
                while self._admissible():
                    g = self._pending.pop(0)
                    g.sequence = self._free_sequence(g.prompt)
                    g.sequence.busy = True
                    admitted.append(g)
                self._running += admitted
                for g in stepping + admitted:
                    g.want = False
            try:
                with self._engine._lock:
                    for g in admitted:
                        self._prefill(g)
                    if stepping:
                        self._step(stepping)
            except _native.ExpertLoadError as e:
                # the native side cleared the KV cache: every running generation lost its sequence
                with self._cond:
                    for s in self._sequences:
                        s.tokens = []
                    for g in self._running:
                        self._end(g, ExpertLoadError(str(e)))
            except Exception as e:  # noqa: BLE001 - handed to the consumers, who raise it
                with self._cond:
                    for g in admitted + stepping:
                        self._end(g, e)

    def _waiting(self) -> list[_Generation]:
        """The running generations whose consumers wait for their next token."""
        return [g for g in self._running if g.want and not g.done and not g.closed]

    def _admissible(self) -> bool:
        return bool(self._pending) and any(not s.busy for s in self._sequences)

    def _free_sequence(self, prompt: list[int]) -> _Sequence:
        """The free sequence whose KV cache shares the longest prefix with prompt."""
        return max((s for s in self._sequences if not s.busy), key=lambda s: shared_prefix(s.tokens, prompt))

    def _drop_closed(self) -> None:
        for g in [g for g in self._running if g.closed]:
            self._running.remove(g)
            g.sequence.busy = False

    def _end(self, g: _Generation, item=_END) -> None:
        if not g.done:
            g.done = True
            g.out.put(item)

    def _prefill(self, g: _Generation) -> None:
        ctx = self._engine._live()
        s = g.sequence
        start = time.perf_counter()
        reuse = 0 if g.fresh else shared_prefix(s.tokens, g.prompt)
        ctx.truncate(reuse, s.seq)
        s.tokens = s.tokens[:reuse]
        self._engine._governed(0, lambda: ctx.decode(g.prompt[reuse:], reuse, False, s.seq))
        s.tokens = list(g.prompt)
        g.timings.n_cached_prompt_tokens = reuse
        g.timings.prefill_seconds = time.perf_counter() - start
        g.decode_start = time.perf_counter()
        self._emit(g, g.sampler.sample(ctx))

    def _step(self, stepping: list[_Generation]) -> None:
        ctx = self._engine._live()
        self._engine._governed(len(stepping), lambda: ctx.decode_step(
            [g.last for g in stepping], [len(g.sequence.tokens) for g in stepping], [g.sequence.seq for g in stepping]))
        for g in stepping:
            g.sequence.tokens.append(g.last)
        for i, g in enumerate(stepping):
            self._emit(g, g.sampler.sample(ctx, i))

    def _emit(self, g: _Generation, token: int) -> None:
        """Hands a sampled token to its consumer, or ends the generation (as Engine.generate_tokens)."""
        t = g.timings
        if g.budget == 0 or (not g.ignore_eos and self._engine._model.is_eog(token)):
            t.finish_reason = "stop" if g.budget else "length"
            self._end(g)
            return
        t.n_decoded += 1
        t.decode_seconds = time.perf_counter() - g.decode_start
        g.last = token
        g.out.put(token)
        if t.n_decoded == g.budget:
            self._end(g)
