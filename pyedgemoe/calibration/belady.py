"""Belady's MIN on a routing trace: the fewest expert loads any eviction policy could make with the
same slots (L. A. Belady, "A study of replacement algorithms for a virtual-storage computer", 1966).
The measuring stick for the cache's policies: their loads over MIN's on the same replay steps.

The steps are the runtime's place() calls (replay.replay_steps): each a layer's distinct experts,
all of which must be in a slot at once. At each step every needed expert not cached is loaded into
a free slot, else into the slot of the cached expert, not needed now, whose next use is farthest
away (never used again first). Choosing the victim by next use is optimal for demand loads of
sets too: any schedule can be exchanged, step by step, into this one without more loads. One group
of slots shared by the trace's layers, as the runtime's cache has for layers of one shape;
lossless (every demand a HIGH load; skips are not loads)."""
from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

NEVER = float("inf")


@dataclass
class MinResult:
    loads: int = 0
    requests: int = 0
    failures: int = 0  # steps needing more experts at once than there are slots
    loads_per_layer: dict[int, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return 1 - self.loads / self.requests if self.requests else 0.0


class _Future:
    """A trace's demands step by step (needs: each step's (layer, expert) keys, skips left out) and
    each expert's next use after the steps passed so far."""

    def __init__(self, steps):
        self.needs = [[(s.layer, e) for e, demand in s.wanted if demand != "skip"] for s in steps]
        self._uses: dict[tuple, list[int]] = defaultdict(list)  # each expert's steps, in order
        for i, keys in enumerate(self.needs):
            for key in keys:
                self._uses[key].append(i)
        self._seen: dict[tuple, int] = defaultdict(int)  # how many of its uses have passed

    def pass_step(self, keys) -> None:
        for key in keys:
            self._seen[key] += 1

    def next_use(self, key) -> float:
        k, uses = self._seen[key], self._uses[key]
        return uses[k] if k < len(uses) else NEVER


def min_loads(steps, slots: int) -> MinResult:
    """MIN's loads for replay steps (ReplayStep: .layer, .wanted [(expert, demand)]) and `slots`."""
    if slots < 1:
        raise ValueError(f"MIN needs at least one slot, got {slots}")
    future = _Future(steps)
    next_use = future.next_use
    result = MinResult()
    cached: set = set()
    farthest: list = []  # (-next use, key) of the cached, lazily corrected
    for keys in future.needs:
        result.requests += len(keys)
        if len(keys) > slots:
            result.failures += 1
        future.pass_step(keys)
        now = set(keys)
        for key in keys:
            if key in cached:
                continue
            result.loads += 1
            result.loads_per_layer[key[0]] = result.loads_per_layer.get(key[0], 0) + 1
            if len(cached) >= slots:
                cached.discard(_victim(farthest, cached, now, next_use))
            cached.add(key)
        for key in now:  # their next use has moved on
            heapq.heappush(farthest, (-next_use(key), key))
    return result


def _victim(farthest: list, cached: set, now: set, next_use):
    """The cached expert, not needed now, used again last (entries gone stale are dropped)."""
    kept = []
    victim = None
    while farthest:
        neg, key = heapq.heappop(farthest)
        if key not in cached or -neg != next_use(key):
            continue  # evicted already, or its next use has changed since
        if key in now:
            kept.append((neg, key))
            continue
        victim = key
        break
    for entry in kept:
        heapq.heappush(farthest, entry)
    if victim is None:  # more experts needed at once than slots: the oldest of this step goes
        victim = next(iter(cached - now), next(iter(cached)))
    return victim


def lookahead_loads(steps, slots: int, lookahead: int) -> int:
    """The loads of a policy that knows the routing `lookahead` steps ahead and nothing further: on
    a miss it evicts, among the cached experts not needed now, the least recently used of those
    with no use within the look-ahead, else the one whose next use is farthest. 0 steps is lru;
    the whole trace is MIN. How far an online policy would have to see to come near MIN: one
    token ahead is one step per MoE layer (docs/benchmarks.md, "What MIN knows")."""
    needs = [[(s.layer, e) for e, demand in s.wanted if demand != "skip"] for s in steps]
    index = {key: i for i, key in enumerate(sorted({key for keys in needs for key in keys}))}
    uses: list[list[int]] = [[] for _ in index]
    for i, keys in enumerate(needs):
        for key in keys:
            uses[index[key]].append(i)
    seen = np.zeros(len(index), dtype=np.int64)
    next_use = np.array([u[0] for u in uses], dtype=np.float64)
    last_use = np.full(len(index), -1.0)  # a clock of uses, in the order the cache sees them
    cached = np.zeros(len(index), dtype=bool)
    loads = clock = 0
    for i, keys in enumerate(needs):
        now = np.array([index[key] for key in keys], dtype=np.int64)
        seen[now] += 1
        for k in now:  # the use after this one
            next_use[k] = uses[k][seen[k]] if seen[k] < len(uses[k]) else NEVER
        for k in now:
            clock += 1
            last_use[k] = clock
            if cached[k]:
                continue
            loads += 1
            if cached.sum() >= slots:
                evictable = cached.copy()
                evictable[now] = False
                unseen = evictable & (next_use - i > lookahead)
                if unseen.any():
                    victim = np.flatnonzero(unseen)[np.argmin(last_use[unseen])]
                else:
                    victim = np.flatnonzero(evictable)[np.argmax(next_use[evictable])]
                cached[victim] = False
            cached[k] = True
    return loads


def bypass_loads(steps, slots: int) -> int:
    """The loads of MIN allowed to bypass: a miss whose next use is farther than every evictable
    cached expert's is computed from room outside the slots (free here) and not cached; else it
    evicts the farthest, as MIN. MIN must cache every miss (the runtime computes an expert from its
    slot), so this bounds what not caching some misses could gain on the same slots (docs/benchmarks.md,
    "Not caching a miss")."""
    future = _Future(steps)
    next_use = future.next_use
    cached: set = set()
    loads = 0
    for keys in future.needs:
        future.pass_step(keys)
        now = set(keys)
        for key in keys:
            if key in cached:
                continue
            loads += 1
            if len(cached) < slots:
                cached.add(key)
                continue
            evictable = [c for c in cached if c not in now]
            if evictable and next_use(key) < next_use(victim := max(evictable, key=next_use)):
                cached.discard(victim)
                cached.add(key)
    return loads


def trace_against_min(trace: dict, slots: int, loads: int) -> dict:
    """A lossless run's `loads` (HIGH loads on demand and prefetched, from its stats) next to MIN's on the routing it recorded
    (Engine.take_routing_trace) with its `slots`: {"loads", "min_loads", "requests", "x_min",
    "min_loads_per_layer"}. Both must start from an empty cache (no fill at load)."""
    from pyedgemoe.calibration.replay import per_layer_json, replay_steps

    best = min_loads(replay_steps(trace, 1.0, 1.0, use_low=False, use_skip=False), slots)
    return {"loads": loads, "min_loads": best.loads, "requests": best.requests,
            "x_min": loads / best.loads if best.loads else 1.0,
            "min_loads_per_layer": per_layer_json(best.loads_per_layer)}

