"""What `pyedgemoe run` prints on stderr about a run: llama.cpp-style timings, whether the context
ran out, and the expert cache's counters (--stats). Each number says what it counts: a layer's
requests are its hits, misses and skips; the bytes read are those read on demand plus those
prefetched."""
from __future__ import annotations

import typer

from pyedgemoe.sysmem import format_bytes


def print_timings(t: dict) -> None:
    """llama.cpp-style timings, on stderr so they never mix with the generated text."""
    prefill_tokens = t["n_prompt_tokens"] - t["n_cached_prompt_tokens"]
    typer.echo("", err=True)
    typer.echo(f"prompt eval: {t['n_prompt_tokens']:5d} tokens ({prefill_tokens} evaluated) in "
               f"{t['prefill_seconds']:8.3f} s ({t['prefill_tokens_per_second']:8.2f} tok/s)", err=True)
    typer.echo(f"       eval: {t['n_decoded']:5d} tokens in {t['decode_seconds']:8.3f} s "
               f"({t['decode_tokens_per_second']:8.2f} tok/s)", err=True)
    if t["n_draft_tokens"]:  # as llama.cpp's speculative examples report it
        typer.echo(f"      draft: {t['n_draft_tokens']:5d} tokens checked, {t['n_draft_accepted']} accepted "
                   f"({t['n_draft_accepted'] / t['n_draft_tokens']:.1%})", err=True)


def context_full(finish_reason: str, n_decoded: int, max_tokens: int | None) -> bool:
    """Whether a generation of n_decoded tokens, asked for max_tokens (None: until the context is
    full), stopped because the context was full: "length" before max_tokens."""
    return finish_reason == "length" and (max_tokens is None or n_decoded < max_tokens)


def print_context_full(t, n_ctx: int, max_tokens: int | None) -> None:
    """A note on stderr where a generation (its GenerationStats t) stopped because the context of
    n_ctx positions was full (context_full)."""
    if context_full(t.finish_reason, t.n_decoded, max_tokens):
        typer.echo(f"note: stopped after {t.n_decoded} generated tokens: the context of {n_ctx} positions is full"
                   + ("" if max_tokens is None else f" (-n {max_tokens} asked for more: raise --ctx)"), err=True)


def _layer_line(name: str, c: dict, prefetched: dict | None) -> str:
    """requests = hits + misses + skipped; bytes read = on demand + prefetched."""
    hit_rate = c["hits"] / c["requests"] if c["requests"] else 0.0
    ahead = prefetched["bytes_read"] if prefetched else 0
    return (f"{name:>8}: {c['requests']:6d} requests = {c['hits']:6d} hits ({hit_rate:6.1%}) + {c['misses']:6d} misses "
            f"+ {c['skipped']:5d} skipped; read {format_bytes(c['bytes_read'] + ahead):>10} = "
            f"{format_bytes(c['bytes_read']):>10} on demand in {c['load_ms'] / 1000:6.3f} s + {format_bytes(ahead):>10} "
            f"prefetched; compute waited {c['stall_ms'] / 1000:6.3f} s")


def _cache_line(experts: dict) -> str:
    """The cache's slots against the experts there are, HIGH and LOW apart."""
    n_experts = experts["n_expert"] * len(experts["layers"])
    slots = f"HIGH {format_bytes(experts['high_pool_bytes'])} ({experts['high_slots']} of {n_experts} experts)"
    there = f"{format_bytes(experts['expert_bytes'])} in HIGH"
    if experts["mixed_precision"]:
        slots += f" + LOW {format_bytes(experts['low_pool_bytes'])} ({experts['low_slots']} of {n_experts})"
        there += f", {format_bytes(experts['low_expert_bytes'])} in LOW"
    return (f"expert cache: {format_bytes(experts['pool_bytes'])} of slots, {slots}; the experts take {there}; "
            f"minimum {format_bytes(experts['minimum_bytes'])}, io {experts['io']}, policy {experts['cache_policy']}")


def print_stats(stats: dict) -> None:
    """The expert cache's counters, a line per layer and the total (JSON with --json)."""
    experts = stats.get("experts")
    if not experts:
        typer.echo("experts: in the mapped file, the page cache holds them (no expert cache)" if stats["experts_mapped"]
                   else "experts: all resident (no expert cache)", err=True)
        return
    typer.echo(_cache_line(experts), err=True)
    fill = experts["fill"]
    if fill["experts"]:
        typer.echo(f"filled {'in the background' if experts['fill_background'] else 'at load'}: {fill['experts']} "
                   f"experts, {format_bytes(fill['bytes_read'])} read in {fill['ms'] / 1000:.3f} s", err=True)
    host_fill = experts.get("host_fill")
    if host_fill and host_fill["experts"]:
        typer.echo(f"host tier filled at load: {host_fill['experts']} expert copies, "
                   f"{format_bytes(host_fill['bytes_read'])} read in {host_fill['ms'] / 1000:.3f} s", err=True)
    prefetched = experts["prefetches"]["layers"]
    for layer, counters in sorted(experts["layers"].items(), key=lambda kv: int(kv[0])):
        typer.echo(_layer_line(f"layer {layer}", counters, prefetched.get(layer)), err=True)
    typer.echo(_layer_line("total", experts["total"], experts["prefetches"]), err=True)
    if experts["mixed_precision"] or experts["skip"]:
        t, summary = experts["total"], experts["summary"]
        rule = ("EdgeMoE's static map" if experts["static_precision"]
                else f"t1 {experts['t1']:.3g}, t2 {experts['t2']:.3g}")
        typer.echo(f"precision: {rule}; selections "
                   f"{summary['high_fraction']:.1%} HIGH, {summary['low_fraction']:.1%} LOW, "
                   f"{summary['skip_fraction']:.1%} skipped; loads {t['loads_high']} HIGH + {t['loads_low']} LOW; "
                   f"miss penalty {summary['miss_penalty']:.1f}", err=True)
    if experts["stand_in"] > 0:
        t = experts["total"]
        typer.echo(f"stand-ins: q {experts['stand_in']:g}; {t['stand_in_swaps']} missed selections served by a cached "
                   f"stand-in, {t['stand_in_drops']} dropped", err=True)
    if experts["device"]:
        t = experts["total"]
        pools = ", ".join(f"{format_bytes(n)} on {name}" for name, n in experts["device_pool_bytes"].items())
        # split queues its uploads while the CPU computes: what they cost is the device's wait for them
        uploaded = (f", queued in {t['queue_ms'] / 1000:.3f} s; the device waited {t['upload_wait_ms'] / 1000:.3f} s "
                    f"for them after {t['cpu_pass_ms'] / 1000:.3f} s of the CPU's passes; a decode token's share "
                    f"uploaded now {experts['link_share']:.0%}" if experts["mode"] == "split"
                    else f" in {t['upload_ms'] / 1000:.3f} s")
        typer.echo(f"device {experts['device']} ({experts['mode']}): expert pools {pools}; "
                   f"host tier {format_bytes(experts['host_pool_bytes'])}, "
                   f"{t['host_hits']} host hits, {t['host_loads']} read into it; {t['uploads']} experts uploaded "
                   f"({format_bytes(t['bytes_uploaded'])}{uploaded}); "
                   f"{t['cpu_experts']} computed on the CPU"
                   + (f" (its passes {t['cpu_pass_ms'] / 1000:.3f} s)" if experts["mode"] in ("coop", "split") else ""),
                   err=True)
    prediction = ", ".join(f"{p['depth']} ahead {p['top1_accuracy']:.0%} top-1 / {p['recall']:.0%} of top-k"
                           for p in experts["prediction"] if p["tokens"])
    if prediction:
        typer.echo(f"prediction: {prediction}", err=True)
    if experts["prefetch"] != "none" or stats.get("big_little"):
        p = experts["prefetches"]
        why = experts["prefetch"] if experts["prefetch"] != "none" else "for big-little's fallbacks"
        typer.echo(f"prefetch ({why}): {p['issued']} experts read ahead, {p['used']} used ({p['late']} too late to start), "
                   f"{p['wasted']} evicted unused, {p['displaced']} misses of experts they evicted, "
                   f"{p['declined']} not read (their rank cost more reads than it saved), "
                   + (f"{p['given_back']} not begun by their layer (misses there, for the CPU or the link), "
                      if p["given_back"] else "") + format_bytes(p["bytes_read"])
                   + (" (stopped: it cost more than it saved)" if p["stopped"] else ""),
                   err=True)
    if stats.get("big_little"):
        b = stats["big_little"]
        typer.echo(f"big-little (gamma {b['gamma']:g}): {b['little_tokens']} tokens decoded little, {b['fallbacks']} "
                   f"redone big ({b['fallback_rate']:.1%}), {b['prefetched']} experts prefetched for them", err=True)
