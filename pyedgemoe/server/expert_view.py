"""/metrics/experts: the expert cache as the web page /experts draws it (static/experts.html), in
JSON, from the same Engine.stats() as /metrics: per layer its lookups and hit rate, the precision
the routed experts were computed in, the bytes read by source and precision, where misses were
served from (the tiers), and what the prefetches were worth."""
from __future__ import annotations

from pyedgemoe.server.metrics import bytes_read_by_precision


def _rate(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def expert_view(stats: dict, model_id: str) -> dict:
    """The page's data; "cache": None when every expert is resident (no expert cache)."""
    totals = stats["totals"]
    out = {"model": model_id, "mode": stats["mode"],
           "tokens": {"prompt": totals["n_prompt_tokens"], "generated": totals["n_decoded"],
                      "decode_tokens_per_second": totals["decode_tokens_per_second"]},
           "cache": None}
    experts = stats.get("experts")
    if experts is None:
        return out
    t, p = experts["total"], experts["prefetches"]
    out["cache"] = {
        "policy": experts["cache_policy"], "budget_bytes": experts["budget_bytes"],
        "slot_bytes": {"high": experts["high_pool_bytes"], "low": experts["low_pool_bytes"]},
        "resident": experts["resident_experts"], "experts": experts["n_expert"] * experts["n_layers"],
        "hit_rate": _rate(t["hits"], t["requests"]),
        "layers": [{"layer": int(layer), "requests": c["requests"], "hits": c["hits"],
                    "hit_rate": _rate(c["hits"], c["requests"]),
                    "hits_by_precision": {"high": c["hits_high"], "low": c["hits_low"]},
                    "misses_by_precision": {"high": c["loads_high"], "low": c["loads_low"]},
                    "stall_ms": c["stall_ms"]}
                   for layer, c in sorted(experts["layers"].items(), key=lambda kv: int(kv[0]))],
        "precision": {"high": t["selections_high"], "low": t["selections_low"], "skip": t["selections_skip"]},
        "read_bytes": {"demand": bytes_read_by_precision(t), "prefetch": bytes_read_by_precision(p),
                       "fill": experts.get("fill", {}).get("bytes_read", 0)},
        # a miss is served from the host tier (RAM, with a GPU) or read from storage; the
        # device tier is the cache itself, filled by uploads
        "tiers": {"storage_read_bytes": t["bytes_read"] + p["bytes_read"], "host_hits": t["host_hits"],
                  "uploaded_bytes": t["bytes_uploaded"] + p["bytes_uploaded"]},
        "prefetch": {"issued": p["issued"], "used": p["used"], "wasted": p["wasted"],
                     "use_rate": _rate(p["used"], p["issued"])},
        "stall_seconds": t["stall_ms"] / 1000,
    }
    return out
