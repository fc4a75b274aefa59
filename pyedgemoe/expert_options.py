"""How offloaded experts are served: the options, checked and resolved in one place.

Defaults (docs/mixed-precision.md): with an expert cache and LOW copies available (a multi-precision
GGUF, or low_from=OTHER.gguf), HOBBIT's dynamic loading is on: on a miss, a selection is loaded in
HIGH precision if its score s_i <= t1, in LOW if s_i <= t2, and skipped above (the top-1 always
HIGH). Without LOW copies everything is HIGH and nothing is skipped: offloading is lossless.
A calibration sidecar next to the model (pyedgemoe calibrate) supplies t1, t2 and the cache
policy's weights where the caller gave none.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.model_info import ModelInfo, read_model_info

IO_MODES = ("direct", "buffered", "mmap")
CACHE_POLICIES = ("lru", "lfu", "lhu", "fld", "hobbit")
LOW_HIT_MODES = ("accept", "reload")
PREFETCH_MODES = ("none", "hobbit", "fate")
DEFAULT_T1, DEFAULT_T2 = 0.6, 0.9  # HOBBIT's values for Mixtral (top-2), sec. 3.2
DEFAULT_POLICY_WEIGHTS = (0.25, 0.25, 0.25, 0.25)  # lru, lfu, lhu, fld until calibrated


def parse_policy_weights(value) -> tuple[float, float, float, float] | None:
    """"a,b,c,d" or four numbers (lru, lfu, lhu, fld), non-negative, normalized to sum 1."""
    if value is None:
        return None
    parts = value.split(",") if isinstance(value, str) else list(value)
    try:
        weights = [float(p) for p in parts]
    except (TypeError, ValueError):
        raise InvalidOptionError(f"policy weights must be four numbers a,b,c,d, got {value!r}") from None
    if len(weights) != 4 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise InvalidOptionError(f"policy weights must be four non-negative numbers (lru,lfu,lhu,fld) "
                                 f"with a positive sum, got {value!r}")
    total = sum(weights)
    return tuple(w / total for w in weights)


@dataclass
class ExpertOptions:
    io: str = "direct"
    io_threads: int = 4
    cache_policy: str | None = None   # None: "hobbit" when calibrated, else "lru"
    policy_weights: object = None     # "a,b,c,d" or 4 numbers; None: calibrated or equal weights
    low_precision: bool | None = None  # None: on when LOW copies exist
    skip: bool | None = None           # None: with low precision
    t1: float | None = None
    t2: float | None = None
    low_cache: float = 0.25            # share of the expert cache for LOW copies
    low_hit: str = "accept"            # a cached LOW copy for a HIGH demand: accept it or reload HIGH
    low_from: str | os.PathLike | None = None
    prefetch: str = "none"             # none, hobbit (walk p layers ahead) or fate (over-prefetch next layer)
    prefetch_depth: int = 2
    fill_cache: bool = True            # read experts into the cache at load (most routed first when calibrated)

    def __post_init__(self) -> None:
        if self.prefetch is None:  # "none" on a command line of KEY=VALUE options parses to None
            self.prefetch = "none"

    def validate(self) -> None:
        if self.io not in IO_MODES:
            raise InvalidOptionError(f"unknown io {self.io!r} ({', '.join(IO_MODES)})")
        if not isinstance(self.io_threads, int) or self.io_threads < 1:
            raise InvalidOptionError(f"io_threads must be a positive integer, got {self.io_threads!r}")
        if self.cache_policy is not None and self.cache_policy not in CACHE_POLICIES:
            raise InvalidOptionError(f"unknown cache_policy {self.cache_policy!r} ({', '.join(CACHE_POLICIES)})")
        parse_policy_weights(self.policy_weights)
        if self.prefetch not in PREFETCH_MODES:
            raise InvalidOptionError(f"unknown prefetch {self.prefetch!r} ({', '.join(PREFETCH_MODES)})")
        if not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 1:
            raise InvalidOptionError(f"prefetch_depth must be a positive integer, got {self.prefetch_depth!r}")
        if not isinstance(self.fill_cache, bool):
            raise InvalidOptionError(f"fill_cache must be True or False, got {self.fill_cache!r}")
        if self.low_hit not in LOW_HIT_MODES:
            raise InvalidOptionError(f"unknown low_hit {self.low_hit!r} ({', '.join(LOW_HIT_MODES)})")
        if not 0 < self.low_cache < 1:
            raise InvalidOptionError(f"low_cache must be a fraction between 0 and 1, got {self.low_cache!r}")
        for name in ("t1", "t2"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise InvalidOptionError(f"{name} must be between 0 and 1, got {value!r}")
        if self.t1 is not None and self.t2 is not None and self.t1 > self.t2:
            raise InvalidOptionError(f"t1 ({self.t1}) must not exceed t2 ({self.t2})")
        if self.low_from is not None and not os.path.isfile(self.low_from):
            raise InvalidOptionError(f"--low-from file not found: {os.fspath(self.low_from)}")

    def native_kwargs(self, info: ModelInfo, calibration: dict | None) -> dict:
        """Keyword arguments of _native.Model.enable_expert_residency (besides the budget)."""
        calibration = calibration or {}
        has_low_source = info.multi_precision or self.low_from is not None
        if self.low_precision and not has_low_source:
            raise InvalidOptionError("low precision needs LOW expert copies: a multi-precision GGUF "
                                     "(pyedgemoe convert) or --low-from OTHER.gguf")
        if self.low_from is not None:
            _check_low_from(info, os.fspath(self.low_from))
        use_low = has_low_source if self.low_precision is None else self.low_precision
        use_skip = use_low if self.skip is None else self.skip
        policy = self.cache_policy or calibration.get("best_policy") or (
            "hobbit" if "policy_weights" in calibration else "lru")
        weights = (parse_policy_weights(self.policy_weights) or calibration.get("policy_weights")
                   or DEFAULT_POLICY_WEIGHTS)
        t1 = self.t1 if self.t1 is not None else calibration.get("t1", DEFAULT_T1)
        t2 = self.t2 if self.t2 is not None else calibration.get("t2", max(DEFAULT_T2, t1))
        if t1 > t2:
            raise InvalidOptionError(f"t1 ({t1}) must not exceed t2 ({t2})")
        return dict(io=self.io, io_threads=self.io_threads, cache_policy=policy, policy_weights=list(weights),
                    use_low=use_low, use_skip=use_skip, t1=t1, t2=t2, low_fraction=self.low_cache,
                    low_serves_high=self.low_hit == "accept",
                    low_from=os.fspath(self.low_from) if self.low_from is not None else "",
                    prefetch=self.prefetch, prefetch_depth=self.prefetch_depth)


def fill_ranking(calibration: dict | None, n_experts: int) -> dict[int, list[int]]:
    """Per MoE layer, its experts most routed first, from the calibration's expert usage (the
    counts of calibrate.expert_usage); layers it does not cover fill by expert id."""
    usage = (calibration or {}).get("expert_usage") or {}
    return {int(layer): sorted(range(n_experts), key=lambda e: -counts[e])
            for layer, counts in usage.items() if len(counts) == n_experts}


def _check_low_from(info: ModelInfo, path: str) -> None:
    """A --low-from file must be a standard GGUF of the same model (same architecture and experts)."""
    low = read_model_info(path)
    if low.multi_precision:
        raise InvalidOptionError(f"--low-from {path} is a multi-precision GGUF: give a standard one")
    if (low.architecture, low.n_experts, sorted(low.expert_bytes_per_layer)) != \
            (info.architecture, info.n_experts, sorted(info.expert_bytes_per_layer)):
        raise InvalidOptionError(f"--low-from {path} is not a GGUF of the same model "
                                 f"({low.architecture}, {low.n_experts} experts vs {info.architecture}, "
                                 f"{info.n_experts} experts)")
