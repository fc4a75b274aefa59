"""Several generations decoding together: Engine(n_parallel=N), `pyedgemoe serve --parallel N`.

The context holds N sequences (llama.cpp's multi-sequence KV cache, n_ctx / N positions each).
One thread of the Batcher's own runs the model: it prefills each new generation into a free
sequence, then steps every running generation whose consumer asked for its next token with one
llama_decode of one token per sequence. The experts that several sequences route to in a step
are loaded once, which is what makes serving N clients cheaper per token than serving them in
turn. Each sequence's rows are the rows it gets alone up to rounding: a step's matrix products sum
its sequences' rows together, which llama.cpp's kernels may round otherwise (logits some 1e-5 to
1e-2 apart), so a generation's greedy tokens are its own alone but where two picks tie that closely
(tests/test_batch.py). A generation here is the Engine's one-sequence
Generation (generation.py), stepped with the others; every decode goes through the Decoder.

A consumer (the iterator Batcher.generate returns, on any thread) blocks until its next token;
closing it ends the generation and frees its sequence for the next one. An embedding
(Batcher.embed) queues for a free sequence as a generation does and frees it when evaluated.
"""
from __future__ import annotations

import gc
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from pyedgemoe.errors import EngineBusyError, ExpertLoadError
from pyedgemoe.generation import Generation, KVSequence, PromptProgress, shared_prefix
from pyedgemoe.native_exit import closed_error
from pyedgemoe.sequence_turn import COLLECT_AFTER_S, OWN_STREAM_WAIT_S, WAIT_STEP_S

# How long a step waits for the consumers of running generations to ask for their next token, so
# that their tokens share the step; a consumer that takes longer is stepped in a later one.
GATHER_SECONDS = 0.002
_END = object()


@dataclass
class _Request:
    generation: Generation | None  # None: a task's request
    out: queue.Queue = field(default_factory=queue.Queue)  # (PromptProgress and) tokens, then _END (or an exception)
    want: bool = True  # its consumer waits for its next token
    closed: bool = False  # its consumer has gone: its sequence is free
    done: bool = False  # it has ended (_END or an error sent)
    sequence: KVSequence | None = None
    task: Callable[[KVSequence], object] | None = None  # work of its own on a free sequence (embed)
    seq: int | None = None  # the sequence the task needs (a slot file's), else any free one
    thread: int = field(default_factory=threading.get_ident)  # the thread that took its last token (started it)

    @property
    def prompt(self) -> list[int]:
        return self.generation.prompt if self.generation else []


class Batcher:
    def __init__(self, decoder) -> None:
        self._decoder = decoder
        self._sequences = decoder.sequences
        self._pending: list[_Request] = []  # waiting for a free sequence, oldest first
        self._running: list[_Request] = []
        self._cond = threading.Condition()
        self._closing = False
        self._advances = 0  # tokens taken by the generations' consumers, counted to see them move
        self._thread = threading.Thread(target=self._run, name="pyedgemoe-batcher", daemon=True)
        self._thread.start()

    def generate(self, generation: Generation) -> Iterator[int]:
        """The generation's tokens (with its PromptProgress, where it asks for them); it queues for a sequence
        when the first is asked for."""
        r = self._queued(_Request(generation))
        try:
            while True:
                item = r.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, PromptProgress):  # the prompt's evaluation goes on
                    continue
                with self._cond:
                    r.want, r.thread = True, threading.get_ident()
                    self._advances += 1
                    self._cond.notify_all()
        finally:
            self._leave(r)

    def embed(self, tokens: list[int]) -> np.ndarray:
        """Decoder.embed of tokens on a free sequence, taken in turn with the generations waiting."""
        return self.on_sequence(lambda sequence: self._decoder.embed(tokens, sequence))

    def on_sequence(self, work: Callable[[KVSequence], object], seq: int | None = None):
        """work(a free sequence; the seq-th where given, once no generation holds it), taken in turn
        with the generations waiting."""
        r = self._queued(_Request(None, task=work, seq=seq))
        try:
            item = r.out.get()
            if isinstance(item, BaseException):
                raise item
            return item
        finally:
            self._leave(r)

    def _queued(self, r: _Request) -> _Request:
        """r, waiting for a free sequence; EngineBusyError from the model's thread (a generation's
        Python hook calling its Engine), which would wait on itself."""
        if threading.current_thread() is self._thread:
            raise EngineBusyError("a generation's logits_processor, stopping_criteria or draft_model called its own "
                                  "Engine, which runs that generation: it would wait on itself")
        with self._cond:
            # a sequence is freed by the thread reading its generation; one waiting here for a sequence frees
            # none, unless another thread goes on reading it (sequence_turn: next() on a pool's threads)
            seen, since = self._advances, time.monotonic()
            while not self._closing and (whose := self._only_waiters_hold_every_sequence(r)):
                if self._advances != seen:
                    seen, since = self._advances, time.monotonic()
                elif time.monotonic() - since > OWN_STREAM_WAIT_S:
                    raise EngineBusyError(f"every sequence ({len(self._sequences)}) holds a generation {whose} "
                                          "started and has not taken to its end: take one to its end or close() it "
                                          "before starting another")
                self._cond.wait(WAIT_STEP_S)
            if self._closing:
                raise closed_error("this Engine is closed")
            self._pending.append(r)
            self._cond.notify_all()
        return r

    def _only_waiters_hold_every_sequence(self, r: _Request) -> str:
        """Whose generations hold every sequence where all are the waiting threads' (r's among them), else ""."""
        held = [q for q in self._running if not (q.closed or q.done)]
        waiting = {q.thread for q in self._pending} | {r.thread}
        if len(held) < len(self._sequences) or not all(q.thread in waiting for q in held):
            return ""
        return "this thread" if all(q.thread == r.thread for q in held) else \
            "this thread or threads that wait for a sequence too"

    def _leave(self, r: _Request) -> None:
        """r's consumer is gone: its place in the queue, or its sequence, is free."""
        with self._cond:
            r.closed = True
            if r in self._pending:
                self._pending.remove(r)
            self._cond.notify_all()

    def close(self) -> None:
        """Ends the thread; generations still running or waiting raise RuntimeError."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:  # closed by a generation's hook: it ends after this step
            self._thread.join()

    # -- the model's thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._drop_closed()
                collected_at = None  # the advances when the collector last ran for the requests waiting
                while not self._closing and self._next_admitted() is None and not self._waiting():
                    if not self._cond.wait(COLLECT_AFTER_S) and self._pending and collected_at != self._advances:
                        # a stream dropped unclosed (a client gone, sequence_turn) holds its sequence until collected
                        collected_at = self._advances
                        gc.collect()
                    self._drop_closed()
                if self._closing:
                    for r in self._pending + self._running:
                        self._end(r, closed_error("this Engine is closed"))
                    return
                deadline = time.monotonic() + GATHER_SECONDS
                while any(not r.want and not r.closed and not r.done for r in self._running):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                stepping = self._waiting()
                admitted = []
                while (r := self._next_admitted()) is not None:
                    self._pending.remove(r)
                    r.sequence = self._free_sequence(r.prompt) if r.seq is None else self._sequences[r.seq]
                    r.sequence.busy = True
                    admitted.append(r)
                self._running += admitted
                for r in stepping + admitted:
                    r.want = False
            try:
                with self._decoder.lock:
                    for r in admitted:
                        if r.task:
                            self._run_task(r)
                        else:
                            self._emit_own(r, lambda: [self._prefilled(r)])
                    if stepping:
                        self._step(stepping)
            except ExpertLoadError as e:
                # the native side cleared the KV cache: every running generation lost its sequence
                with self._cond:
                    for r in self._running:
                        self._end(r, ExpertLoadError(str(e)))
            except BaseException as e:  # noqa: BLE001 - handed to the consumers, who raise it (a hook's exit too)
                with self._cond:
                    for r in admitted + stepping:
                        self._end(r, e)

    def _waiting(self) -> list[_Request]:
        """The running generations whose consumers wait for their next token."""
        return [r for r in self._running if r.want and not r.done and not r.closed]

    def _next_admitted(self) -> _Request | None:
        """The first waiting request a sequence is free for (the one it needs, or any)."""
        free = [i for i, s in enumerate(self._sequences) if not s.busy]
        return next((r for r in self._pending if free and (r.seq is None or r.seq in free)), None)

    def _free_sequence(self, prompt: list[int]) -> KVSequence:
        """The free sequence whose KV cache shares the longest prefix with prompt."""
        return max((s for s in self._sequences if not s.busy), key=lambda s: shared_prefix(s.tokens, prompt))

    def _drop_closed(self) -> None:
        for r in [r for r in self._running if r.closed]:
            self._running.remove(r)
            r.sequence.busy = False

    def _end(self, r: _Request, item=_END) -> None:
        if not r.done:
            r.done = True
            r.out.put(item)

    def _step(self, stepping: list[_Request]) -> None:
        """Each stepping generation's next input, and its drafter's guess, in one llama_decode; its
        picks to its consumer."""
        room = self._decoder.live().n_batch // len(stepping) - 1  # each generation's guess, at most
        inputs = [(r, own) for r in stepping if (own := self._own(r, lambda: r.generation.next_inputs(room)))]
        if not inputs:
            return
        start = time.perf_counter()
        self._decoder.decode_step([token for _, own in inputs for token, _ in own],
                                  [pos for _, own in inputs for _, pos in own],
                                  [r.sequence for r, own in inputs for _ in own])
        seconds, first = time.perf_counter() - start, 0
        for r, own in inputs:
            self._emit_own(r, lambda: r.generation.verified(first, seconds))
            first += len(own)

    @staticmethod
    def _prefilled(r: _Request) -> int | None:
        """r's prefill (Generation.prefill): its progress to r's consumer as it goes; the first pick."""
        steps = r.generation.prefill(r.sequence)
        while True:
            try:
                r.out.put(next(steps))
            except StopIteration as done:
                return done.value

    def _run_task(self, r: _Request) -> None:
        """r's task, its result (or its own error) to its consumer; its sequence is free after."""
        try:
            result = r.task(r.sequence)
        except ExpertLoadError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to r's consumer, who raises it
            result = e
        self._end(r, result)
        r.closed = True

    def _own(self, r: _Request, work):
        """work()'s result; an error of r's own (its sampler's Python hooks, its drafter) ends r
        alone: None."""
        try:
            return work()
        except ExpertLoadError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to r's consumer, who raises it (KeyboardInterrupt too)
            self._end(r, e)
            return None

    def _emit_own(self, r: _Request, picks) -> None:
        """_emit of picks()'s tokens, unless they are an error of r's own."""
        tokens = self._own(r, picks)
        if tokens is not None:
            self._emit(r, tokens)

    def _emit(self, r: _Request, tokens: list[int | None]) -> None:
        """Hands a step's picks to r's consumer; ends the generation after its last (None: it ended)."""
        for token in tokens:
            if token is not None:
                r.out.put(token)
        if None in tokens or not r.generation.more():
            self._end(r)
