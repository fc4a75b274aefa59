"""The one Engine behind the server, shared by every request.

The Engine holds engine.n_parallel sequences in its KV cache (`serve --parallel N`), so:
- every Engine call runs on the queue's threads, never on the event loop, which stays free to
  answer /health and /metrics and to notice clients that leave;
- a generation holds one of the n_parallel turns from its first token to its last, an embedding
  request for its inputs: the others queue, in arrival order (Turns). A queued one whose client leaves is dropped from the queue
  within CLIENT_CHECK_SECONDS. With n_parallel > 1 the Engine decodes the running generations
  together (pyedgemoe.batch);
- a generation runs as a task of its own that hands its chunks over a queue, checking between
  pieces whether its client is still there; when the client is gone it closes the Engine's
  generator and gives up its turn. Its clean-up never waits on the response, which the server
  may cancel when the client disconnects.
"""
from __future__ import annotations

import asyncio
from collections import deque
from contextlib import asynccontextmanager
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, Iterator

from pyedgemoe.server.openai_errors import APIError

_END = object()
CLIENT_CHECK_SECONDS = 0.25  # how often a queued generation looks whether its client is still there


class Turns:
    """n turns, handed to their waiters first come, first served; a waiter may give up waiting."""

    def __init__(self, n: int) -> None:
        self.free = n
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def take(self, gone: Callable[[], Awaitable[bool]]) -> bool:
        """Waits for a turn: True once it holds one, False when gone() said the waiter left first."""
        if self.free and not self._waiters:
            self.free -= 1
            return True
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            while not turn.done():
                await asyncio.wait([turn], timeout=CLIENT_CHECK_SECONDS)
                if not turn.done() and await gone():
                    if turn.done():  # handed over while it looked: to the next
                        self.give_back()
                    return False
            return True
        except BaseException:  # cancelled: a turn handed over meanwhile goes to the next
            if turn.done():
                self.give_back()
            raise
        finally:
            if not turn.done():
                self._waiters.remove(turn)
                turn.cancel()

    def give_back(self) -> None:
        """A turn ends: the longest waiter takes it."""
        if self._waiters:
            self._waiters.popleft().set_result(None)
        else:
            self.free += 1


class Generation:
    """The chunks of one generation as they are produced (a chunk: the Engine's streamed dict)."""

    def __init__(self) -> None:
        self._chunks: asyncio.Queue = asyncio.Queue()
        self.abandoned = False  # the response stopped reading: its client left
        self.finished = False  # the Engine gave its last chunk (not cut short: its client left)

    def _put(self, item) -> None:
        self._chunks.put_nowait(item)

    async def next(self) -> dict | None:
        """The next chunk; None at the end. Re-raises what the Engine raised."""
        item = await self._chunks.get()
        if item is _END:
            self._chunks.put_nowait(_END)  # the end stays the end
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def abandon(self) -> None:
        self.abandoned = True


class EngineQueue:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.parallel = engine.n_parallel
        # one Engine with one sequence runs on one thread; n_parallel ones each wait on a thread
        # of their own for their tokens, and one more serves the other calls
        self._thread = ThreadPoolExecutor(max_workers=1 if self.parallel == 1 else self.parallel + 1,
                                          thread_name_prefix="pyedgemoe-engine")
        self._turns = Turns(self.parallel)
        self.running = 0  # generations holding a turn (at most parallel)
        self.stopping = False
        self._tasks: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks

    @property
    def waiting(self) -> int:
        """Generations waiting for their turn (the queue depth)."""
        return self._turns.waiting

    async def call(self, fn: Callable, *args):
        """fn(*args) on the queue's threads (with one sequence: between the steps of a generation)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    @asynccontextmanager
    async def turn(self, client_gone: Callable[[], Awaitable[bool]]):
        """A turn of its own, queued with the generations, for Engine calls (call()) that evaluate on
        a sequence: embeddings. APIError 499 when the client left first, 503 when the server stops."""
        async def gone() -> bool:
            return self.stopping or await client_gone()

        if not await self._turns.take(gone):
            raise APIError(503, "the server is shutting down", "server_shutting_down") if self.stopping else \
                APIError(499, "the client closed the request")
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._turns.give_back()

    def generate(self, start: Callable[[], Iterator[dict]], client_gone: Callable[[], Awaitable[bool]]) -> Generation:
        """Queues start() (an Engine call with stream=True, run on the Engine's thread when this
        generation's turn comes) and returns its Generation at once."""
        generation = Generation()
        task = asyncio.create_task(self._produce(generation, start, client_gone))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return generation

    async def _produce(self, generation: Generation, start, client_gone) -> None:
        async def gone() -> bool:
            return generation.abandoned or self.stopping or await client_gone()

        try:
            if await self._turns.take(gone):
                self.running += 1
                try:
                    if not await gone():  # else it left just as its turn came
                        chunks = await self.call(start)
                        try:
                            while not await gone():
                                chunk = await self.call(next, chunks, _END)
                                if chunk is _END:
                                    generation.finished = True
                                    break
                                generation._put(chunk)
                        finally:
                            # closing the generator ends the Engine's generation (its finally blocks run)
                            await self.call(chunks.close)
                finally:
                    self.running -= 1
                    self._turns.give_back()
            if self.stopping and not generation.finished:
                generation._put(APIError(503, "the server is shutting down", "server_shutting_down"))
        except Exception as e:  # noqa: BLE001 - handed to the response, which shapes it
            generation._put(e)
        finally:
            generation._put(_END)

    def stop(self) -> None:
        """The server is stopping: running generations end at their next token and queued ones never
        start, each with an error (503), so that the server need not wait for them or cancel them."""
        self.stopping = True

    def close(self) -> None:
        """After the server stopped: waits for the Engine's thread to finish what it runs."""
        self._thread.shutdown(wait=True)
