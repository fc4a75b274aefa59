"""/metrics: the server's and the Engine's counters in Prometheus' text format (version 0.0.4),
written here from Engine.stats() at each scrape, so the counters have one owner, the Engine.

Counters end in _total; rates (tokens per second, hit rates) are Prometheus' to take from them,
except the gauges of the average and last decode and prefill speeds, which a dashboard wants as is.
"""
from __future__ import annotations

from collections import Counter

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RequestCounts:
    """HTTP requests answered, by path (the server's own paths; anything else is "other") and status."""

    def __init__(self, paths: set[str]) -> None:
        self.paths = paths
        self.counts: Counter = Counter()

    def add(self, path: str, status: int) -> None:
        if path.startswith("/v1/models/"):
            path = "/v1/models/{model}"
        self.counts[(path if path in self.paths else "other", str(status))] += 1


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Text:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help: str, samples) -> None:
        """samples: a number, or [(labels dict, number), ...]."""
        if not isinstance(samples, list):
            samples = [({}, samples)]
        self.lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
        for labels, value in samples:
            text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{text}}} {float(value)!r}" if text else f"{name} {float(value)!r}")


def bytes_read_by_precision(counts: dict) -> dict:
    """The bytes read of HIGH and of LOW copies, of the Engine's demand or prefetch counters."""
    return {"high": counts["bytes_read"] - counts["bytes_read_low"], "low": counts["bytes_read_low"]}


def render(stats: dict, requests: RequestCounts, waiting: int, running: int) -> str:
    """The exposition text of Engine.stats() and the server's own counters."""
    out = _Text()
    out.family("pyedgemoe_requests_total", "counter", "HTTP requests answered, by path and status code.",
               [({"path": p, "code": c}, n) for (p, c), n in sorted(requests.counts.items())])
    out.family("pyedgemoe_queue_depth", "gauge",
               "Generations waiting for a free sequence (--parallel of them run at once).", waiting)
    out.family("pyedgemoe_requests_running", "gauge", "Generations running on the engine (at most --parallel).",
               running)

    totals, last = stats["totals"], stats["last"]
    out.family("pyedgemoe_prompt_tokens_total", "counter", "Prompt tokens of every generation.",
               totals["n_prompt_tokens"])
    out.family("pyedgemoe_prompt_tokens_cached_total", "counter",
               "Prompt tokens reused from the KV cache (a prefix shared with the previous request).",
               totals["n_cached_prompt_tokens"])
    out.family("pyedgemoe_generated_tokens_total", "counter", "Tokens generated.", totals["n_decoded"])
    out.family("pyedgemoe_draft_tokens_total", "counter", "Guessed tokens checked (speculative decoding).",
               totals["n_draft_tokens"])
    out.family("pyedgemoe_draft_tokens_accepted_total", "counter", "Guessed tokens taken (speculative decoding).",
               totals["n_draft_accepted"])
    out.family("pyedgemoe_prefill_seconds_total", "counter", "Time spent evaluating prompts.",
               totals["prefill_seconds"])
    out.family("pyedgemoe_decode_seconds_total", "counter", "Time spent generating tokens.", totals["decode_seconds"])
    out.family("pyedgemoe_prefill_tokens_per_second", "gauge", "Prompt tokens evaluated per second since start.",
               totals["prefill_tokens_per_second"])
    out.family("pyedgemoe_decode_tokens_per_second", "gauge", "Tokens generated per second since start.",
               totals["decode_tokens_per_second"])
    out.family("pyedgemoe_last_prefill_tokens_per_second", "gauge", "Prefill speed of the last generation.",
               last["prefill_tokens_per_second"])
    out.family("pyedgemoe_last_decode_tokens_per_second", "gauge", "Decode speed of the last generation.",
               last["decode_tokens_per_second"])
    if "experts" in stats:
        _expert_families(out, stats["experts"])
    return "\n".join(out.lines) + "\n"


def _expert_families(out: _Text, experts: dict) -> None:
    """The expert cache's counters (Engine.stats()["experts"]): in total, over every layer."""
    t, p = experts["total"], experts["prefetches"]
    by_precision = (lambda high, low: [({"precision": "high"}, t[high]), ({"precision": "low"}, t[low])])
    out.family("pyedgemoe_expert_cache_budget_bytes", "gauge", "Memory allowed for cached experts.",
               experts["budget_bytes"])
    out.family("pyedgemoe_expert_cache_bytes", "gauge", "Memory of the expert cache's slots, by precision.",
               [({"precision": "high"}, experts["high_pool_bytes"]), ({"precision": "low"}, experts["low_pool_bytes"])])
    out.family("pyedgemoe_expert_resident", "gauge", "Experts in the cache now.", experts["resident_experts"])
    out.family("pyedgemoe_expert_requests_total", "counter", "Routed experts looked up in the cache.",
               t["requests"])
    out.family("pyedgemoe_expert_hits_total", "counter", "Lookups served from the cache, by the precision found.",
               by_precision("hits_high", "hits_low"))
    out.family("pyedgemoe_expert_misses_total", "counter", "Lookups that read the expert from storage, by the "
               "precision read.", by_precision("loads_high", "loads_low"))
    out.family("pyedgemoe_expert_skipped_total", "counter", "Lookups skipped (the expert not computed).",
               t["skipped"])
    out.family("pyedgemoe_expert_selections_total", "counter", "Routed experts, by the precision they were "
               "computed in (skip: not computed).",
               by_precision("selections_high", "selections_low") + [({"precision": "skip"}, t["selections_skip"])])
    out.family("pyedgemoe_expert_read_bytes_total", "counter", "Bytes of experts read from storage, on a miss "
               "(demand) or ahead of need (prefetch), by the precision read.",
               [({"source": source, "precision": precision}, bytes_read)
                for source, c in (("demand", t), ("prefetch", p))
                for precision, bytes_read in bytes_read_by_precision(c).items()])
    out.family("pyedgemoe_expert_load_seconds_total", "counter", "Time spent reading missed experts.",
               t["load_ms"] / 1000)
    out.family("pyedgemoe_expert_stall_seconds_total", "counter", "Time the computation waited for experts.",
               t["stall_ms"] / 1000)
    out.family("pyedgemoe_expert_prefetches_total", "counter", "Experts read ahead of need, by outcome.",
               [({"outcome": o}, p[o]) for o in ("issued", "used", "wasted")])
    out.family("pyedgemoe_expert_uploaded_bytes_total", "counter", "Bytes of experts uploaded to the GPU.",
               t["bytes_uploaded"] + p["bytes_uploaded"])
    out.family("pyedgemoe_expert_host_hits_total", "counter", "GPU misses served from the host tier.",
               t["host_hits"])
