"""Benchmark pyedgemoe against stock llama.cpp (llama-cpp-python) on one GGUF file.

    pyedgemoe bench build/bench/olmoe-L4-q8_0.gguf --prompt-tokens 16 --prompt-tokens 128 \\
        --output-tokens 32 --repeats 3 --threads 2 [--mem-cap 50%]

Every measurement is its own worker process (pyedgemoe.bench.worker). Engines alternate within
each repeat (A B A B ...) so slow drifts of the machine hit both; the report gives medians and
the ratio ours / stock.

Page cache (docs/benchmarks.md, "What is measured"): without a cap the model file is read once
up front so every run starts warm; with a cap it is evicted before every run (posix_fadvise
DONTNEED), because pages an earlier run left behind stay charged to another cgroup and would be
free memory for this one. The cap is a cgroup v1 memory group holding only the worker process;
it is created under the caller's own memory cgroup, so the worker also stays inside any limit
the caller already runs under, and it is removed after each run.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from pyedgemoe import lora, rope_scaling
from pyedgemoe.bench.worker import DECODE_INPUTS, ENGINES, EXIT_ENGINE_UNAVAILABLE
from pyedgemoe.errors import PyEdgeMoEError
from pyedgemoe.kv_overrides import as_dict
from pyedgemoe.model_info import read_model_info
from pyedgemoe.output_files import check_output, terminate_cleanly, write_whole
from pyedgemoe.sysmem import CGROUP_V1_MEMORY, evict_from_page_cache, format_bytes, memory_stat, own_memory_cgroup_v1, parse_size
from pyedgemoe.threads import default_threads

OURS, STOCK = "pyedgemoe", "llama_cpp"
WORKER_SCRIPT = Path(__file__).resolve().with_name("worker.py")
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # so workers import this very copy


class BenchmarkError(PyEdgeMoEError):
    """A benchmark that cannot be run as asked (missing model, no cgroup v1, bad size...)."""


# ---------------------------------------------------------------------------------------------
# page cache and the memory cgroup


def model_files(path: Path) -> list[Path]:
    """The model's files: a split GGUF's shards too, as llama.cpp loads them."""
    try:
        return [Path(f) for f in read_model_info(path).files]
    except PyEdgeMoEError as e:
        raise BenchmarkError(str(e)) from None


def read_whole_file(path: Path) -> None:
    """Pull the file into the page cache (for uncapped runs: every engine starts warm)."""
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass


def check_cgroup_v1() -> None:
    if not (CGROUP_V1_MEMORY / "memory.limit_in_bytes").exists():
        raise BenchmarkError(
            f"--mem-cap needs the cgroup v1 memory controller at {CGROUP_V1_MEMORY}; "
            "this machine does not have it (cgroup v2 only, or not mounted)")
    if os.geteuid() != 0:
        raise BenchmarkError("--mem-cap creates a memory cgroup and needs root")


@contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[Path]:
    """A fresh cgroup v1 memory group with the given limit; removed on exit."""
    check_cgroup_v1()
    # under this process's own group: the worker also stays inside any limit the caller runs under
    group = (own_memory_cgroup_v1() or CGROUP_V1_MEMORY) / f"pyedgemoe-bench-{os.getpid()}"
    if group.exists():
        group.rmdir()  # left over from an interrupted run of this same pid
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        yield group
    finally:
        for _ in range(50):  # the dead worker can take a moment to leave the group
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _cgroup_counter(group: Path, name: str) -> int | None:
    try:
        return int((group / name).read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# running workers


def other_runnable_tasks(samples: int = 5, interval_s: float = 0.1) -> int:
    """Most tasks seen runnable at once besides this process (from /proc/loadavg), over a short
    window: a busy machine (a compile, another benchmark) shows here, where the 1-minute load
    average would mostly show the previous worker."""
    most = 0
    for i in range(samples):
        try:
            running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return -1
        most = max(most, running - 1)
        if i + 1 < samples:
            time.sleep(interval_s)
    return most


@contextmanager
def cpu_load(n: int) -> Iterator[None]:
    """n CPU-bound processes beside what runs within (a busy machine: one per core)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _run_worker(engine: str, model: Path, prompt_tokens: int, output_tokens: int, threads: int,
                flash_attn: bool, options: dict[str, Any], decode_input: str, cgroup: Path | None,
                timeout_s: float | None) -> dict[str, Any]:
    # By path, not -m: see the worker's docstring (the baseline never imports pyedgemoe).
    cmd = [sys.executable, str(WORKER_SCRIPT), "--engine", engine, "--model", str(model),
           "--prompt-tokens", str(prompt_tokens), "--output-tokens", str(output_tokens),
           "--threads", str(threads)]
    if flash_attn:
        cmd.append("--flash-attn")
    if decode_input != "greedy":
        cmd += ["--decode-input", decode_input]
    if options:  # as JSON: each value keeps its type (a given "none" is not None)
        cmd += ["--options", json.dumps(options)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_PARENT), env.get("PYTHONPATH")]))

    def enter_cgroup() -> None:  # runs in the child between fork and exec: only it is capped
        assert cgroup is not None
        with open(cgroup / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                              preexec_fn=enter_cgroup if cgroup is not None else None)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "error": f"timed out after {timeout_s:.0f} s"}

    result: dict[str, Any] | None = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                result = json.loads(line)
                break
            except json.JSONDecodeError:
                pass
    if result is None:
        if proc.returncode == -signal.SIGKILL:
            why = "killed (SIGKILL: out of memory under the cap?)" if cgroup else "killed (SIGKILL)"
        else:
            why = f"worker exited with status {proc.returncode}"
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        result = {"engine": engine, "error": why + (f": {tail}" if tail else "")}
    if proc.returncode == EXIT_ENGINE_UNAVAILABLE:
        result["unavailable"] = True
    if cgroup is not None:
        result["cgroup_max_usage_bytes"] = _cgroup_counter(cgroup, "memory.max_usage_in_bytes")
        result["cgroup_failcnt"] = _cgroup_counter(cgroup, "memory.failcnt")
        # pages read back in by faults (the process's own code or a mapped file, dropped under the cap)
        try:
            result["cgroup_major_faults"] = memory_stat(cgroup / "memory.stat").get("pgmajfault")
        except (OSError, ValueError):
            result["cgroup_major_faults"] = None
    return result


def run_benchmark(model_path: str | os.PathLike[str], *, engines: Sequence[str] = (OURS, STOCK),
                  prompt_tokens: int = 16, output_tokens: int = 32, repeats: int = 3,
                  threads: int = 2, mem_cap_bytes: int | None = None, flash_attn: bool = False,
                  ours_options: dict[str, Any] | None = None, stock_repack: bool = True,
                  decode_input: str = "greedy", warmup: int = 1, timeout_s: float | None = 1800,
                  load: int = 0, against_min: bool = False, log=None) -> list[dict[str, Any]]:
    """Measure each engine `repeats` times, alternating engines within each repeat and which goes
    first from one repeat to the next, after `warmup` runs of the first engine that are not kept
    (the first run after other work is slower, whichever engine it is).

    flash_attn applies to both engines (default off, as in llama-cpp-python); ours_options are
    keyword arguments for pyedgemoe.Engine only, e.g. {"expert_cache": "4GiB"}. stock_repack=False
    runs stock llama.cpp as with --no-repack (weights stay in their file layout). decode_input
    "fixed" feeds a fixed token sequence during decode instead of the greedy picks (keeps the
    routing varied where greedy decoding falls into a cycle of a few tokens, which flatters
    expert caches; see worker.fixed_decode_token_ids). load: CPU-bound processes running beside
    every measurement (cpu_load). against_min: one more run of ours, not timed (no fill at load,
    the routing recorded), whose HIGH loads are set beside Belady's MIN on the same routing and
    slots (calibration/belady.py); it is marked "against_min_run" and left out of the medians.

    Returns one dict per measurement: the worker's JSON (prefill_seconds, decode_seconds,
    decode_tokens_per_second, n_prompt_tokens, n_output_tokens, peak_rss_bytes, load_seconds,
    tokens, ...) or {"engine", "error"}, plus repeat, prompt_tokens, output_tokens, threads,
    mem_cap_bytes, model_bytes. An engine that is not importable is tried once, then dropped.
    """
    model = Path(model_path).resolve()
    if not model.is_file():
        raise BenchmarkError(f"model file not found: {model_path}")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise BenchmarkError(f"unknown engine(s) {unknown}; known: {', '.join(ENGINES)}")
    if decode_input not in DECODE_INPUTS:
        raise BenchmarkError(f"decode_input must be one of {', '.join(DECODE_INPUTS)}")
    # a cell times a prompt and a decode after it: llama-bench's -p 0 has no counterpart; the first output
    # token comes from the prefill's logits, so a decode speed needs two
    for name, value, least in (("repeats", repeats, 1), ("prompt_tokens", prompt_tokens, 1),
                               ("output_tokens", output_tokens, 2), ("threads", threads, 1), ("warmup", warmup, 0)):
        if value < least:
            raise BenchmarkError(f"{name} must be >= {least}, got {value}")
    if STOCK in engines and read_model_info(model).multi_precision:
        raise BenchmarkError(f"stock llama.cpp cannot load the multi-precision GGUF {model_path}: bench its standard "
                             "export (pyedgemoe export MODEL --precision high -o OUT), or ours alone (--ours-only)")
    if mem_cap_bytes is not None:
        check_cgroup_v1()
    files = model_files(model)
    model_bytes = sum(f.stat().st_size for f in files)

    if mem_cap_bytes is None:
        for f in files:
            read_whole_file(f)

    # stock runs with the same metadata overrides (the same experts a token), RoPE scaling and LoRA
    # adapter, as llama-cpp-python takes them
    ours = ours_options or {}
    overrides = as_dict(ours.get("override_kv"))
    # and, as llama-bench gives a setting to every run, the GPU layers, the locked memory and no repack
    same = {stock_name: ours[name] for name, stock_name in (("n_gpu_layers", "n_gpu_layers"), ("mlock", "use_mlock"))
            if name in ours}
    stock = ({} if stock_repack and ours.get("repack") is not False else {"repack": False}) | \
        ({"kv_overrides": overrides} if overrides else {}) | same | \
        rope_scaling.as_llama_cpp_python(ours) | lora.as_llama_cpp_python(ours)
    options = {e: dict(ours_options or {}) if e == OURS else stock for e in engines}

    def run(engine: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        engine_options = {**options[engine], **(extra or {})}
        if mem_cap_bytes is None:
            with cpu_load(load):
                r = _run_worker(engine, model, prompt_tokens, output_tokens, threads, flash_attn,
                                engine_options, decode_input, None, timeout_s)
        else:
            for f in files:
                evict_from_page_cache(f)
            with memory_cgroup(mem_cap_bytes) as group, cpu_load(load):
                r = _run_worker(engine, model, prompt_tokens, output_tokens, threads, flash_attn,
                                engine_options, decode_input, group, timeout_s)
        if r.get("refused"):  # every run would be: the others are not worth their minutes
            raise BenchmarkError(f"{engine} refused the settings: {r['error']}")
        return r

    active = list(engines)
    for _ in range(warmup):
        if log is not None:
            log(f"warm-up run of {active[0]} (not kept)")
        if run(active[0]).get("unavailable"):
            break  # the first repeat tries it again, reports it and drops it
    results: list[dict[str, Any]] = []
    for rep in range(repeats):
        for engine in (active if rep % 2 == 0 else active[::-1]):
            busy = other_runnable_tasks()  # other work on the machine skews everything: record it
            r = run(engine)
            r.update(repeat=rep, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                     threads=threads, mem_cap_bytes=mem_cap_bytes, model_bytes=model_bytes,
                     other_runnable_before=busy, load=load)
            r.setdefault("model", str(model))
            results.append(r)
            if log is not None:
                log(_one_line(r))
            if r.get("unavailable"):
                active = [e for e in active if e != engine]
    if against_min and OURS in active:
        r = run(OURS, {"against_min": True})
        r.update(repeat=None, prompt_tokens=prompt_tokens, output_tokens=output_tokens, threads=threads,
                 mem_cap_bytes=mem_cap_bytes, model_bytes=model_bytes, against_min_run=True)
        r.setdefault("model", str(model))
        results.append(r)
        if log is not None:
            log(_one_line(r))
    _add_roofline(model, results)
    return results


def _add_roofline(model: Path, results: list[dict[str, Any]]) -> None:
    """Adds roofline_tokens_per_second to each of our measurements that reports the expert bytes
    its decode steps read (bench/roofline.py: active weights at RAM bandwidth, measured now, plus
    the decode's reads at the bandwidth the run's own reads got)."""
    ours = [r for r in results if r.get("decode_expert_bytes_per_token") is not None
            and "experts" in (r.get("engine_stats") or {})]
    if not ours:
        return
    from pyedgemoe.bench import roofline

    ram = roofline.ram_bandwidth()
    active = roofline.active_bytes_per_token(read_model_info(model))
    for r in ours:
        disk = roofline.run_disk_bandwidth(r["engine_stats"]["experts"])
        r["ram_bytes_per_second"] = ram
        r["disk_bytes_per_second"] = disk
        if disk:
            r["roofline_tokens_per_second"] = roofline.roofline_tokens_per_second(
                active, r["decode_expert_bytes_per_token"], ram, disk)


def _one_line(r: dict[str, Any]) -> str:
    which = "the run against MIN" if r.get("against_min_run") else f"rep {r['repeat']}"
    head = f"[{r['engine']:>9} p{r['prompt_tokens']}/o{r['output_tokens']} {which}]"
    if "error" in r:
        return f"{head} error: {r['error']}"
    if r.get("against_min_run"):
        return f"{head} expert loads {r['against_min']['loads']}, MIN's {r['against_min']['min_loads']}"
    return (f"{head} prefill {r['prefill_seconds']:.3f} s, decode {r['decode_tokens_per_second']:.2f} tok/s, "
            f"peak RSS {format_bytes(r['peak_rss_bytes'])}")


# ---------------------------------------------------------------------------------------------
# report


def _median(rs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _serves(runs: list[dict[str, Any]]) -> str:
    """How our runs served the experts: all resident, mapped (the page cache), or a cache of a share."""
    stats = runs[0].get("engine_stats") or {} if runs else {}
    experts = stats.get("experts")
    if experts:
        return f"cache of {experts['pool_bytes'] / experts['expert_bytes']:.0%}"
    return "mapped" if stats.get("experts_mapped") else "resident" if stats else "-"


def format_report(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per (model, cap, prompt, output, engine) with medians, then ours/stock ratios."""
    groups: dict[tuple, dict[str, list[dict[str, Any]]]] = {}
    against: list[str] = []
    for r in results:
        key = (Path(r.get("model", "?")).name, r.get("mem_cap_bytes"), r["prompt_tokens"], r["output_tokens"])
        if r.get("against_min_run"):
            against.append(_against_min_row(key, r))
        else:
            groups.setdefault(key, {}).setdefault(r["engine"], []).append(r)

    lines = ["| model | mem cap | prompt | output | engine | runs | prefill s (median) | "
             "decode tok/s (median) | load s | peak RSS | cgroup peak | expert hits | MiB read / decode step | "
             "roofline tok/s | of roofline |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ratios = ["| model | mem cap | prompt | output | ours serves experts | prefill time ours/stock | "
              "decode tok/s ours/stock | first token (load + prefill) stock/ours | same tokens |",
              "|---|---|---:|---:|---|---:|---:|---:|---|"]
    notes: list[str] = []
    any_ratio = False
    for (model, cap, p, o), by_engine in groups.items():
        cap_s = "none" if cap is None else format_bytes(cap)
        medians: dict[str, dict[str, float | None]] = {}
        for engine in sorted(by_engine, key=lambda e: ENGINES.index(e) if e in ENGINES else 99):
            rs = by_engine[engine]
            ok = [r for r in rs if "error" not in r]
            for r in rs:
                if "error" in r:
                    notes.append(f"- {engine}, {model}, prompt {p}/output {o}, repeat {r['repeat']}: {r['error']}")
            m = {k: _median(ok, k) for k in ("prefill_seconds", "decode_tokens_per_second", "load_seconds",
                                             "peak_rss_bytes", "cgroup_max_usage_bytes", "expert_hit_rate",
                                             "decode_expert_bytes_per_token", "roofline_tokens_per_second")}
            m["first_token_seconds"] = _median([{"t": r["load_seconds"] + r["prefill_seconds"]} for r in ok], "t")
            hits = "-" if m["expert_hit_rate"] is None else f"{100 * m['expert_hit_rate']:.0f}%"
            read = m["decode_expert_bytes_per_token"]
            roof = m["roofline_tokens_per_second"]
            share = roof and m["decode_tokens_per_second"] and m["decode_tokens_per_second"] / roof
            medians[engine] = m
            lines.append(
                f"| {model} | {cap_s} | {p} | {o} | {engine} | {len(ok)}/{len(rs)} | "
                f"{_fmt(m['prefill_seconds'], '.3f')} | {_fmt(m['decode_tokens_per_second'], '.2f')} | "
                f"{_fmt(m['load_seconds'], '.2f')} | {format_bytes(m['peak_rss_bytes'])} | "
                f"{format_bytes(m['cgroup_max_usage_bytes'])} | {hits} | "
                f"{_fmt(read and read / 2**20, '.1f')} | {_fmt(roof, '.2f')} | {_fmt(share, '.0%')} |")
        ours, stock = medians.get(OURS), medians.get(STOCK)
        if ours and stock and ours["prefill_seconds"] and stock["prefill_seconds"]:
            any_ratio = True
            ok_ours = [r for r in by_engine[OURS] if "error" not in r]
            ok_stock = [r for r in by_engine[STOCK] if "error" not in r]
            same = "-"
            if ok_ours and ok_stock:
                same = "yes" if all(a["tokens"] == ok_stock[0]["tokens"] for a in ok_ours) else "NO"
            ratios.append(
                f"| {model} | {cap_s} | {p} | {o} | {_serves(ok_ours)} | "
                f"{ours['prefill_seconds'] / stock['prefill_seconds']:.2f} | "
                f"{ours['decode_tokens_per_second'] / stock['decode_tokens_per_second']:.2f} | "
                f"{stock['first_token_seconds'] / ours['first_token_seconds']:.2f} | {same} |")

    out = "\n".join(lines)
    versions = sorted({f"{r['engine']} {r['engine_version']}" for r in results if r.get("engine_version")})
    threads = sorted({r["threads"] for r in results if r.get("threads")})
    busy = [r["other_runnable_before"] for r in results if r.get("other_runnable_before") is not None]
    flash = sorted({"on" if r["flash_attn"] else "off" for r in results if "flash_attn" in r})
    ours_opts = sorted({json.dumps(r["options"], sort_keys=True) for r in results  # as given, not MIN's run's
                        if r["engine"] == OURS and r.get("options") and not r.get("against_min_run")})
    if versions:
        out += f"\n\nEngines: {', '.join(versions)}; threads: {', '.join(map(str, threads))}"
        out += f"; flash attention: {'/'.join(flash)}" if flash else ""
        feeds = sorted({r["decode_input"] for r in results if r.get("decode_input")})
        out += f"; decode input: {'/'.join(feeds)}" if feeds else ""
        out += f"; pyedgemoe options: {', '.join(ours_opts)}" if ours_opts else ""
        no_repack = any(r["engine"] == STOCK and (r.get("options") or {}).get("repack") is False for r in results)
        out += "; stock llama.cpp without repacking (--no-repack)" if no_repack else ""
        loads = sorted({r["load"] for r in results if r.get("load")})
        out += f"; beside every run: {'/'.join(map(str, loads))} CPU-bound processes (--load)" if loads else ""
        out += f"; other runnable tasks just before a run: max {max(busy)}." if busy else "."
    if any_ratio:
        out += "\n\n" + "\n".join(ratios)
    if against:
        out += ("\n\nAgainst Belady's MIN (one more run of ours, not timed: no fill at load, the routing "
                "recorded; MIN on the same routing and slots):\n\n| model | mem cap | prompt | output | expert "
                "requests | ours' loads (on demand + prefetched) | MIN's loads | x MIN |\n|---|---|---:|---:|---:|---:|---:|---:|\n"
                + "\n".join(against))
    if notes:
        out += "\n\nErrors:\n" + "\n".join(notes)
    return out + "\n"


def _against_min_row(key: tuple, r: dict[str, Any]) -> str:
    model, cap, p, o = key
    head = f"| {model} | {'none' if cap is None else format_bytes(cap)} | {p} | {o} |"
    if "error" in r:
        return f"{head} error: {r['error']} | | | |"
    m = r["against_min"]
    return f"{head} {m['requests']} | {m['loads']} | {m['min_loads']} | {m['x_min']:.2f} |"


# ---------------------------------------------------------------------------------------------
# what the `pyedgemoe bench` command runs (pyedgemoe/cli.py parses its options)


def cli_main(model: str | os.PathLike[str], *, prompt_tokens: int | Sequence[int] = 16,
             output_tokens: int | Sequence[int] = 32, repeats: int = 3, threads: int | None = None,
             vs_llama_cpp: bool = True, mem_cap: str | None = None, flash_attn: bool = False,
             ours_options: dict[str, Any] | None = None, json_path: Path | None = None,
             engines: Sequence[str] | None = None, decode_input: str = "greedy",
             stock_repack: bool = True, warmup: int = 1, load: int = 0,
             against_min: bool = False) -> list[dict[str, Any]]:
    """What `pyedgemoe bench` does: runs every (prompt, output) pair, logs each measurement to
    stderr, prints the markdown report to stdout, returns the measurements. Raises BenchmarkError,
    also after the report (and the JSON) where a run failed."""
    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    if engines is None:
        engines = (OURS, STOCK) if vs_llama_cpp else (OURS,)
    threads = threads or default_threads().n
    path = Path(model)
    if not path.is_file():
        raise BenchmarkError(f"model file not found: {model}")
    model_bytes = sum(f.stat().st_size for f in model_files(path))
    if json_path is not None:  # before the runs: a report that cannot be written is known at once
        try:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            check_output(json_path, "JSON report", model_files(path))
        except (OSError, PyEdgeMoEError) as e:
            raise BenchmarkError(str(e)) from None
    try:
        cap = None if mem_cap is None else parse_size(mem_cap, percent_of=model_bytes)
    except ValueError as e:
        raise BenchmarkError(str(e)) from None
    prompts = [prompt_tokens] if isinstance(prompt_tokens, int) else list(prompt_tokens)
    outputs = [output_tokens] if isinstance(output_tokens, int) else list(output_tokens)
    results: list[dict[str, Any]] = []
    with terminate_cleanly():  # SIGTERM too: the worker killed, its cgroup and the load's processes gone
        for pt in prompts:
            for ot in outputs:
                results += run_benchmark(path, engines=engines, prompt_tokens=pt, output_tokens=ot,
                                         repeats=repeats, threads=threads, mem_cap_bytes=cap,
                                         flash_attn=flash_attn, ours_options=ours_options,
                                         stock_repack=stock_repack, decode_input=decode_input, warmup=warmup,
                                         load=load, against_min=against_min, log=log)
    print(format_report(results), end="", flush=True)
    if json_path is not None:
        write_whole(json_path, lambda f: f.write((json.dumps(results, indent=1) + "\n").encode()))
    failed = [r for r in results if "error" in r]
    if failed:  # the report stands; the exit status says it is not whole
        raise BenchmarkError(f"{len(failed)} of {len(results)} runs failed, the first: {failed[0]['engine']}: "
                             f"{failed[0]['error']}")
    return results
