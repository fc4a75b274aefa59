"""llama-cpp-python's prompt caches for Llama.set_cache, as its llama_cache module has them: a
mapping from token sequences to Llama.save_state()'s states that, asked for a prompt, gives the
state whose tokens share the longest start with it (KeyError where none shares any). A completion
whose prompt shares more with a cached state than with what the context holds starts from it.

- LlamaRAMCache (LlamaCache): in memory; the least recently used states leave once their KV bytes
  pass capacity_bytes.
- LlamaDiskCache: in a folder, through diskcache (as llama-cpp-python's); the oldest states leave
  once the folder passes capacity_bytes. (llama-cpp-python's takes a state out of the folder when it
  is looked up, used or not: a prompt sharing only its BOS with it loses it.)
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from pyedgemoe.generation import longest_token_prefix

DEFAULT_CAPACITY_BYTES = 2 << 30  # llama-cpp-python's


def _longest_prefix_key(keys, tokens: tuple[int, ...]) -> tuple[int, ...] | None:
    """The key sharing the longest start with tokens (the first of equals), None where none shares any."""
    best, best_length = None, 0
    for key in keys:
        length = longest_token_prefix(key, tokens)
        if length > best_length:
            best, best_length = key, length
    return best


class LlamaRAMCache:
    """States in memory, the least recently used out first past capacity_bytes of KV."""

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        self.capacity_bytes = capacity_bytes
        self.cache_state: OrderedDict[tuple[int, ...], object] = OrderedDict()

    @property
    def cache_size(self) -> int:
        return sum(state.llama_state_size for state in self.cache_state.values())

    def __getitem__(self, key: Sequence[int]):
        found = _longest_prefix_key(self.cache_state, tuple(key))
        if found is None:
            raise KeyError("no cached state shares a start with these tokens")
        self.cache_state.move_to_end(found)
        return self.cache_state[found]

    def __contains__(self, key: Sequence[int]) -> bool:
        return _longest_prefix_key(self.cache_state, tuple(key)) is not None

    def __setitem__(self, key: Sequence[int], state) -> None:
        key = tuple(key)
        self.cache_state.pop(key, None)
        self.cache_state[key] = state
        while self.cache_size > self.capacity_bytes and self.cache_state:
            self.cache_state.popitem(last=False)


LlamaCache = LlamaRAMCache  # llama-cpp-python's older name


class LlamaDiskCache:
    """States in cache_dir (diskcache's), the oldest out first past capacity_bytes of the folder."""

    def __init__(self, cache_dir: str = ".cache/llama_cache", capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        import diskcache  # llama-cpp-python's choice; imported where it is used

        self.capacity_bytes = capacity_bytes
        self.cache = diskcache.Cache(cache_dir)

    @property
    def cache_size(self) -> int:
        return int(self.cache.volume())

    def __getitem__(self, key: Sequence[int]):
        found = _longest_prefix_key(self.cache.iterkeys(), tuple(key))
        if found is None:
            raise KeyError("no cached state shares a start with these tokens")
        return self.cache[found]

    def __contains__(self, key: Sequence[int]) -> bool:
        return _longest_prefix_key(self.cache.iterkeys(), tuple(key)) is not None

    def __setitem__(self, key: Sequence[int], state) -> None:
        key = tuple(key)
        self.cache.pop(key, None)
        self.cache[key] = state
        while self.cache_size > self.capacity_bytes and len(self.cache) > 0:
            del self.cache[next(iter(self.cache))]
