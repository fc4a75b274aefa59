"""The summary of the expert counters that stats() gives beside them (HOBBIT's telemetry)."""
from __future__ import annotations


def expert_summary(experts: dict) -> dict:
    """HOBBIT's telemetry from the native counters: the share of token selections served in HIGH,
    in LOW or skipped, and the miss penalty (a HIGH load costs 1, a LOW load LOW bytes / HIGH bytes)."""
    t = experts["total"]
    selections = t["selections_high"] + t["selections_low"] + t["selections_skip"]
    low_cost = experts["low_expert_bytes"] / experts["expert_bytes"] if experts["expert_bytes"] else 0.0
    share = (lambda n: n / selections if selections else 0.0)
    return {
        "high_fraction": share(t["selections_high"]),
        "low_fraction": share(t["selections_low"]),
        "skip_fraction": share(t["selections_skip"]),
        "hit_rate": t["hits"] / t["requests"] if t["requests"] else 0.0,
        "low_load_cost": low_cost,
        "miss_penalty": t["loads_high"] + low_cost * t["loads_low"],
    }
