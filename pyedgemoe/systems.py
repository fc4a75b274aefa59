"""The seed systems as presets (`--system NAME`, `Engine(system=NAME)`): each paper's combination of
the expert options, set consistently (docs/systems.md says why each knob is set as it is). A preset
only fills in options: every knob stays available alone, and one given explicitly wins.

- lossless: every expert in HIGH, nothing skipped, plain LRU (HOBBIT's priority when several
  sequences decode together), no prefetch: the same tokens as everything resident.
- hobbit (HOBBIT): misses in HIGH, LOW or skipped by their score (T1/T2 and the policy's weights
  calibrated), HOBBIT's multidimensional cache policy, stacked-router prefetch.
- edgemoe (EdgeMoE): each expert in the one precision `pyedgemoe calibrate --system edgemoe` chose
  for it, frequency x layer-distance eviction, path-statistics prefetch.
- fate (Fate): decode in HIGH only; prefill ubatches load their experts by popularity, the coldest
  covering 15 % of the selections in LOW; shallow-favoring cache with per-layer ARC; next-layer gate
  prefetch with Fate's extra experts.
- mobile (MoBiLE): lossless experts; decode with top-k/2 and redo a token with the whole top-k when
  its top probability is below gamma (`pyedgemoe calibrate --system mobile` chooses it for the
  model; else the paper's 0.7), prefetching what the little pass's routers chose.
- cache-routing (Cache-Prior, arXiv 2412.00099): lossless's experts with the decayed-frequency
  cache, and the router prefers a cached expert whose logit is within λ times the token's logit
  spread of an uncached one's (training-free, lossy: the tokens change a little).
- hobbit-cache-routing: HOBBIT's preset with the same cache-aware routing (a LOW copy in the
  cache counts as cached).
- stand-ins, hobbit-stand-ins: the same two with the stand-in chosen by what the experts computed
  on the calibration text (`pyedgemoe calibrate --stand-ins` first; `--stand-in q`).
"""
from __future__ import annotations

from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.expert_options import ExpertOptions
from pyedgemoe.model_info import ModelInfo

MOBILE_GAMMA = 0.7  # the paper's, where the model's calibration chose none
# cache-aware routing's λ alone and with HOBBIT: the largest of the sweep that keeps >= 97 % top-1
# agreement and <= +1 % perplexity on both trained models (docs/systems.md, "Cache-aware routing")
CACHE_ROUTING, HOBBIT_CACHE_ROUTING = 0.05, 0.05
# the stand-ins' quantile alone and with HOBBIT: the largest measured within both bounds on both
# trained models (alone the demo's perplexity is near its +1 % bound: docs/systems.md, "Cache-aware routing")
STAND_IN, HOBBIT_STAND_IN = 0.22, 0.2

# on top of any options, what makes their tokens the resident run's: every expert in HIGH and the
# router's own choice (bench --against-min's run, measured against MIN, the lossless optimum)
LOSSLESS_OVERRIDES = dict(low_precision=False, skip=False, static_precision=False, prefill_low_share=0.0,
                          big_little=0.0, cache_routing=0.0, stand_in=0.0)

SYSTEMS: dict[str, dict] = {
    "lossless": dict(low_precision=False, skip=False, cache_policy="lru", prefetch="none"),
    # HOBBIT's score rule alone decides a prefill's precisions too (no Fate prefill share)
    "hobbit": dict(low_precision=True, skip=True, prefill_low_share=0.0, cache_policy="hobbit", prefetch="hobbit"),
    "edgemoe": dict(low_precision=True, skip=False, static_precision=True, cache_policy="edgemoe", prefetch="edgemoe"),
    # the LOW tier serves prefill's cold experts only, and decode (kept in HIGH by reload) never: its
    # least, a token's top-k less one (1 % of the budget; 10 % read 5 % more per decode step on the demo).
    # Fate's ARC per layer with the slots split evenly: its shallow-favoring split (--fate-shallow -1)
    # loaded more than the even one at every cache size on both trained models (docs/systems.md)
    "fate": dict(low_precision=True, skip=False, t1=1.0, t2=1.0, low_hit="reload", low_cache=0.01,
                 prefill_low_share=0.15, cache_policy="fate", fate_shallow=0, prefetch="fate"),
    "mobile": dict(low_precision=False, skip=False, cache_policy="lru", prefetch="none", big_little=MOBILE_GAMMA),
}
# decay, not lru: at λ 0.05 routing over decay's cache read 24 % (demo) and 32 % (fine) fewer bytes
# than lossless, over lru's 11 % and 17 % (docs/systems.md, "Cache-aware routing")
SYSTEMS["cache-routing"] = dict(SYSTEMS["lossless"], cache_policy="decay", cache_routing=CACHE_ROUTING)
SYSTEMS["hobbit-cache-routing"] = dict(SYSTEMS["hobbit"], cache_routing=HOBBIT_CACHE_ROUTING)
SYSTEMS["stand-ins"] = dict(SYSTEMS["lossless"], cache_policy="decay", stand_in=STAND_IN)
SYSTEMS["hobbit-stand-ins"] = dict(SYSTEMS["hobbit"], stand_in=HOBBIT_STAND_IN)
# the presets that need LOW expert copies (a multi-precision GGUF, or low_from)
NEEDS_LOW = ("hobbit", "edgemoe", "fate", "hobbit-cache-routing", "hobbit-stand-ins")


def system_options(system: str, given: ExpertOptions, info: ModelInfo, n_parallel: int = 1,
                   calibration: dict | None = None) -> ExpertOptions:
    """The options of `system` with the explicitly given ones on top; InvalidOptionError for an
    unknown system, or one that needs LOW copies the model does not have. With n_parallel > 1 a
    preset's LRU is HOBBIT's priority instead: LRU thrashes when a step of several sequences needs
    more experts than the cache holds (ExpertOptions.resolve). MoBiLE's gamma is the model's
    calibration's (its sidecar, `calibration`) where it has one."""
    if system not in SYSTEMS:
        raise InvalidOptionError(f"unknown system {system!r} ({', '.join(SYSTEMS)})")
    if system in NEEDS_LOW and not info.multi_precision and "low_from" not in given.given:
        raise InvalidOptionError(f"--system {system} needs LOW expert copies: a multi-precision GGUF "
                                 "(pyedgemoe convert) or --low-from OTHER.gguf")
    preset = dict(SYSTEMS[system])
    if n_parallel > 1 and preset.get("cache_policy") == "lru":
        preset["cache_policy"] = "hobbit"
    if "big_little" in preset and calibration and calibration.get("big_little"):
        preset["big_little"] = calibration["big_little"]["gamma"]
    return ExpertOptions(**preset).merged(**given.given)
