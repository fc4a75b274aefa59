"""A routing trace replayed through the runtime's own cache code (_native.ExpertCache), and the
search for HOBBIT's cache-policy weights (HOBBIT sec. 3.4).

The replay drives the cache as the runtime does: a new sequence restarts the policies' records,
the first MoE layer of a ubatch advances the token clock by the ubatch's tokens, and each layer
places its distinct experts (in order of first use) with the highest demand among its tokens. The
miss penalty counts 1 per HIGH load and LOW bytes / HIGH bytes (= B_low / B_high) per LOW load.
Deterministic: the same trace and settings give the same numbers.

search_policy_weights tries the priority weights (lru, lfu, lhu, fld) on a grid over the simplex
(step 0.1 by default: 286 points, including the single-term vertices, which are the lhu and fld
policies exactly), keeping the lowest penalty (ties: fewer loads, then grid order); the
stand-alone lru, lfu and decay (decayed frequency) policies are replayed for comparison, and the
seed systems' edgemoe (frequency x layer distance) and fate (shallow-favoring split, ARC per layer). They keep their
records across sequences (lfu counts frequency since insertion), so they are not grid points and may win.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from pyedgemoe import _native
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.expert_options import default

DEFAULT_GRID_STEP = 0.1
# the finest grid: 1771 replays at 1/20 (13 s on the demo), 176,851 at 1/100 (some 20 minutes)
MAX_GRID_DIVISIONS = 20
SINGLE_POLICIES = ("lru", "lfu", "lhu", "fld", "edgemoe", "fate", "decay", "adaptive")


@dataclass
class ReplayStep:
    """One place() call of the runtime: a layer of a ubatch and its distinct experts' demands."""
    new_sequence: bool
    advance_tokens: int  # > 0 at a ubatch's first MoE layer
    layer: int
    wanted: list  # [(expert, "high"|"low"|"skip")], in order of first use


def replay_steps(trace: dict, t1: float, t2: float, use_low: bool = True, use_skip: bool = True) -> list[ReplayStep]:
    """The runtime's place() calls for a trace (records of one (sequence, ubatch, layer) consecutive)
    under the thresholds t1/t2: per layer of a ubatch, the runtime's own plan of it
    (_native.plan_layer: the distinct experts in order of first use, each with the highest demand
    of its tokens)."""
    layer = np.asarray(trace["layer"])
    ubatch = np.asarray(trace["ubatch"])
    sequence = np.asarray(trace.get("sequence", np.zeros(len(layer), dtype=np.int64)))
    ids = np.ascontiguousarray(trace["ids"], dtype=np.int32)
    weights = np.ascontiguousarray(trace["weights"], dtype=np.float32)
    n = len(layer)
    if n == 0:
        return []
    n_expert = int(ids.max()) + 1  # a recorded routing: every id is in range
    key = np.stack([sequence, ubatch, layer], axis=1)
    starts = np.flatnonzero(np.r_[True, np.any(key[1:] != key[:-1], axis=1)])
    ends = np.r_[starts[1:], n]
    steps: list[ReplayStep] = []
    prev_sequence, prev_ubatch = None, None
    for s, e in zip(starts.tolist(), ends.tolist()):
        seq, ub = int(sequence[s]), int(ubatch[s])
        new_sequence = seq != prev_sequence
        new_ubatch = new_sequence or ub != prev_ubatch
        prev_sequence, prev_ubatch = seq, ub
        _, wanted = _native.plan_layer(ids[s:e], weights[s:e], n_expert, t1, t2, use_low, use_skip)
        steps.append(ReplayStep(new_sequence, e - s if new_ubatch else 0, int(layer[s]), wanted))
    return steps


@dataclass
class CacheSetup:
    """What the runtime's cache is for a budget: slots per tier, layers (FLD's L), LOW cost."""
    high_slots: int
    low_slots: int
    n_layers: int
    low_cost: float  # LOW expert bytes / HIGH expert bytes (= B_low / B_high)
    low_serves_high: bool = True
    layers: tuple = ()  # the MoE layers, experts per layer and per token (the fate policy's split); (): 0 .. n_layers - 1
    n_expert: int = 0
    n_expert_used: int = 0
    fate_shallow: int = default("fate_shallow")  # the fate policy's shallow layers (-1: its default)


@dataclass
class ReplayResult:
    policy: str
    weights: tuple | None
    penalty: float
    loads_high: int = 0
    loads_low: int = 0
    hits_high: int = 0
    hits_low: int = 0
    skipped: int = 0
    requests: int = 0
    failures: int = 0  # place() calls the runtime's cache could not serve (the decode would fail)
    loads_per_layer: dict = field(default_factory=dict)  # {layer: HIGH and LOW loads}

    @property
    def hit_rate(self) -> float:
        return (self.hits_high + self.hits_low) / self.requests if self.requests else 0.0

    def rank_key(self) -> tuple:
        """Lower is better: a policy under which the runtime fails loses to any that does not."""
        return (self.failures, self.penalty, self.loads_high + self.loads_low)

    def to_dict(self) -> dict:
        return {"policy": self.policy, "weights": list(self.weights) if self.weights else None,
                "penalty": self.penalty, "loads_high": self.loads_high, "loads_low": self.loads_low,
                "hits_high": self.hits_high, "hits_low": self.hits_low, "skipped": self.skipped,
                "requests": self.requests, "hit_rate": self.hit_rate, "failures": self.failures}


def replay(steps: list[ReplayStep], setup: CacheSetup, policy: str = "lru", weights=None) -> ReplayResult:
    """Replays the steps through _native.ExpertCache with `policy` (weights for "hobbit") and
    returns the miss penalty: 1 per HIGH load, setup.low_cost per LOW load (HOBBIT sec. 3.4).

    Where the runtime's cache cannot serve a layer (its tier has no evictable slot left: the
    runtime fails that decode and forgets the cache), the failure is counted and the replay goes on
    from an empty cache at the same token clock, as a retried decode would."""
    w = list(weights) if weights is not None else list(default("policy_weights"))

    def new_cache():
        return _native.ExpertCache(setup.high_slots, setup.low_slots, policy=policy, weights=w,
                                   low_serves_high=setup.low_serves_high, n_layers=setup.n_layers,
                                   layers=list(setup.layers), n_expert=setup.n_expert, n_expert_used=setup.n_expert_used,
                                   fate_shallow=setup.fate_shallow)

    cache = new_cache()
    result = ReplayResult(policy, tuple(w) if policy == "hobbit" else None, 0.0)
    counts = {("high", True): 0, ("low", True): 0, ("high", False): 0, ("low", False): 0, ("skip", False): 0}
    tokens_in_sequence = 0
    for step in steps:
        if step.new_sequence:
            cache.start_sequence()
            tokens_in_sequence = 0
        if step.advance_tokens:
            cache.advance_tokens(step.advance_tokens)
            tokens_in_sequence += step.advance_tokens
        try:
            placed = cache.place(step.layer, step.wanted)
        except RuntimeError:
            result.failures += 1
            cache = new_cache()
            cache.advance_tokens(tokens_in_sequence)
            placed = cache.place(step.layer, step.wanted)
        for _expert, precision, _slot, load in placed:
            counts[precision, load] += 1
            result.loads_per_layer[step.layer] = result.loads_per_layer.get(step.layer, 0) + int(load)
    result.loads_high, result.loads_low = counts["high", True], counts["low", True]
    result.hits_high, result.hits_low = counts["high", False], counts["low", False]
    result.skipped = counts["skip", False]
    result.requests = sum(counts.values())
    result.penalty = result.loads_high + setup.low_cost * result.loads_low
    return result


def weight_grid(step: float = DEFAULT_GRID_STEP) -> list[tuple[float, float, float, float]]:
    """Every (lru, lfu, lhu, fld) with components multiples of step and sum 1, in lexicographic order."""
    n = round(1 / step) if isinstance(step, (int, float)) and not isinstance(step, bool) and 0 < step <= 1 else 0
    if not 1 <= n <= MAX_GRID_DIVISIONS or abs(n * step - 1) > 1e-9:
        raise InvalidOptionError(f"the grid step must divide 1, at least 1/{MAX_GRID_DIVISIONS} (0.5, 0.25, 0.2, 0.1, "
                                 f"0.05), got {step!r}")
    return [(a / n, b / n, c / n, (n - a - b - c) / n)
            for a, b, c in itertools.product(range(n + 1), repeat=3) if a + b + c <= n]


def search_policy_weights(steps: list[ReplayStep], setup: CacheSetup,
                          step: float = DEFAULT_GRID_STEP) -> tuple[ReplayResult, dict[str, ReplayResult]]:
    """The hobbit weights of the grid with the lowest penalty (ties: fewer loads, then grid order;
    fewer failures first), and the replay of every single policy (SINGLE_POLICIES) to compare."""
    best = None
    for weights in weight_grid(step):
        r = replay(steps, setup, "hobbit", weights)
        if best is None or r.rank_key() < best.rank_key():
            best = r
    singles = {policy: replay(steps, setup, policy) for policy in SINGLE_POLICIES}
    return best, singles


def against_min(steps: list[ReplayStep], setup: CacheSetup, hobbit_weights=None) -> dict:
    """Lossless (steps of HIGH loads only): Belady's MIN on these steps and slots, and each single
    policy's and hobbit's (with hobbit_weights) loads over MIN's. {"slots", "min": {loads,
    requests, loads_per_layer}, "policies": {name: {loads, x_min, loads_per_layer}}}."""
    from pyedgemoe.calibration.belady import min_loads

    best = min_loads(steps, setup.high_slots)
    runs = {p: replay(steps, setup, p) for p in SINGLE_POLICIES}
    runs["hobbit"] = replay(steps, setup, "hobbit", hobbit_weights)
    return {"slots": setup.high_slots,
            "min": {"loads": best.loads, "requests": best.requests, "failures": best.failures,
                    "loads_per_layer": per_layer_json(best.loads_per_layer)},
            "policies": {p: {"loads": r.loads_high, "x_min": r.loads_high / best.loads if best.loads else 1.0,
                             "loads_per_layer": per_layer_json(r.loads_per_layer)}
                         for p, r in runs.items()}}


# adaptive (lru or decay by shadow caches of each) within this share of the fewest loads is chosen:
# on a replay it trails decay by its start as lru (0.6-1.6 % at 25-50 % caches on the trained
# models' held-out text, 3-5 % at 60 %, where it stays lru longer), and where greedy text loops
# inside the cache it reads what lru does, where decay reads up to 10 % more (docs/benchmarks.md)
ADAPTIVE_TOLERANCE = 0.01


def best_lossless_policy(policies: dict) -> str:
    """The policy for lossless runs from against_min's "policies": the fewest loads (the first in
    SINGLE_POLICIES' order on a tie, lru), or adaptive within ADAPTIVE_TOLERANCE of them."""
    fewest = min(policies, key=lambda p: policies[p]["loads"])
    if "adaptive" in policies and policies["adaptive"]["loads"] <= policies[fewest]["loads"] * (1 + ADAPTIVE_TOLERANCE):
        return "adaptive"
    return fewest


def per_layer_json(loads: dict) -> dict:
    """JSON's form of {layer: loads}: string keys, layers in order."""
    return {str(l): n for l, n in sorted(loads.items())}

