#!/usr/bin/env python3
"""The GPU check's measurements (docs/gpu.md); scripts/gpu_check.sh prepares the machine and runs it.

    gpu_check.py --kit KIT --out OUTDIR [--rehearse] [--deadline SECONDS]

1. correctness (one child process, about a minute): on each tiny architecture of the kit, `gpu`,
   `coop` and `split` (half the misses each way) at device budgets of 25 % and 50 % against the run with every expert resident on the
   device (greedy tokens; `gpu` also bit-identical logits), on the newer families (GPT-OSS, DeepSeek-V3,
   Qwen3-Next, LFM2-MoE, GLM-4.5) `gpu` at 25 %, and mixed precision on a tiny one;
2. the benchmark files (synthetic Qwen3-30B-A3B and OLMoE-1B-7B geometry, random weights);
3. the benchmark, cell by cell, most important first: ours (`gpu`, `coop`, `split`, `auto`, a child process
   each) at device budgets of 25 % and 50 % of the expert bytes, the host tier holding every expert,
   against stock llama.cpp's llama-bench (`-ngl 99 -ot exps=CPU`, and `--n-cpu-moe N` with the
   experts of the same share of layers on the GPU), and last stock's with every expert on the GPU
   (`-ngl 99`: a token's cost besides its misses) and ours `gpu` with every expert in its device
   cache (no misses: what our layer's hook costs a token beyond that); with --link-shares, `split` also at
   those fixed shares of uploads (is the share its rates give the best?), with --split-threads at those
   CPU thread counts (does a core left to the thread that queues the uploads pay?), with --prefetch each
   mode also with that prefetcher (do the next layer's experts, uploaded while this layer computes, pay?), with
   --omp-wait each mode and stock's two also with that OMP_WAIT_POLICY (how ggml's OpenMP threads wait
   between a layer's splits), with --low each mode also with HOBBIT's mixed precision (LOW copies from a
   second file of the same weights in a lower type; lossy: its top-1 agreement with the mode's lossless
   picks, and its ratio to stock's apart). Time to first token (a 16-token prompt),
   decode tok/s, prefill tok/s at 512 tokens: medians of 3 (ours after a first round kept apart). Ours in the
   first model's cells at the first budget and with every expert cached then decode 16 tokens more under
   PyTorch's profiler (CUPTI): the device's side of a token (pyedgemoe.bench.device_profile). With
   --load N, N CPU-bound processes run beside each cell (a busy machine), each engine on its own
   default threads (ours governed by the load), and a cell is stopped after LOADED_CELL_SECONDS.
   A cell that would end past the deadline is not started; every result is written to OUTDIR as
   it comes.

Writes OUTDIR/gpu-check.json (every result, with the device) and OUTDIR/gpu-check.md (the tables), and
OUTDIR/profile-*.json.gz (the profiled decodes' traces, for chrome://tracing or Perfetto).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from pyedgemoe.bench.device_profile import describe  # noqa: E402
from pyedgemoe.bench.runner import cpu_load  # noqa: E402
from pyedgemoe.bench.worker import fixed_decode_token_ids, prompt_token_ids  # noqa: E402
from pyedgemoe.expert_options import choices  # noqa: E402

BUDGETS = ("25%", "50%")
RESIDENT = "100%"  # the cells with every expert on the GPU: stock's, and ours with every expert in its cache
MODES = ("gpu", "coop", "split", "auto")
PREFETCHERS = tuple(p for p in choices("prefetch") if p != "none")
# the correctness check's modes and their options: split with half the misses each way (the rates it
# measures at load send a tiny model's all to the link)
CHECKED_MODES = {"gpu": {}, "coop": {}, "split": dict(link_share=0.5)}
TTFT_PROMPT = 16
PROFILE_TOKENS = 16  # decode tokens under the profiler: about 4000 device and driver events each (split, Qwen3)
# --load: a cell that has not ended by then is stopped (a run that collapses under load, as ggml's
# OpenMP team can: docs/benchmarks.md, "A busy machine") and reported so
LOADED_CELL_SECONDS = 120
# a profiled cell of ours (15-40 s on the H200 before the profile) is stopped by then: a profiler
# that hangs costs no more, and the cell's numbers, printed before it, stay
PROFILED_CELL_SECONDS = 150
# What the device runs, and the rehearsal's tiny sizes (lavapipe computes on 2 CPU cores).
# the benchmark's sizes, and flash attention (ours and stock's alike): off in a rehearsal, as ggml-vulkan's
# ends the process on lavapipe (pyedgemoe refuses it there, devices.flash_attention_fails)
SIZES = {
    False: dict(qwen3_layers=48, olmoe_layers=16, prefill=512, decode=64, repeats=3, flash_attn=True),
    True: dict(qwen3_layers=1, olmoe_layers=1, prefill=32, decode=8, repeats=2, flash_attn=False),
}
CORRECTNESS_TOKENS = 32
CORRECTNESS_IDS = [1, 17, 42, 99, 5, 230, 64, 7]
ROW_POOL = 4096  # random rows written at disk speed (scripts/make_synthetic_gguf.py)
LOW_TYPES = ("q2_k", "q3_k")  # --low: below the benchmark files' Q4_K and Q8_0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# children: what runs in a process of its own (a crash or a leak stays there)


def correctness(models: Path) -> dict:
    """Greedy tokens of every mode and budget against the all-resident device run."""
    from pyedgemoe import Engine

    def greedy(path: Path, **options) -> tuple[list[int], object, dict]:
        with Engine(path, n_ctx=256, flash_attn=False, kv_type="f32", **options) as eng:
            logits = eng.logits(CORRECTNESS_IDS)
            tokens = eng.time_generation(CORRECTNESS_IDS, CORRECTNESS_TOKENS)["tokens"]
            return tokens, logits, eng.stats()

    rows = []
    # the newer families in one mode and budget alone: the whole step stays within a minute
    runs = [(path, CHECKED_MODES, BUDGETS) for path in sorted(models.glob("tiny-*.gguf"))] + \
        [(path, {"gpu": {}}, BUDGETS[:1]) for path in sorted(models.glob("more-*.gguf"))]
    for path, modes, budgets in runs:
        resident_tokens, resident_logits, _ = greedy(path, mode="gpu")
        for mode, options in modes.items():
            for budget in budgets:
                tokens, logits, stats = greedy(path, mode=mode, expert_cache=budget, **options)
                same = next((i for i, (a, b) in enumerate(zip(tokens, resident_tokens)) if a != b), None)
                total = stats["experts"]["total"]
                rows.append(dict(model=path.stem, mode=mode, budget=budget, tokens_as_resident=same is None,
                                 first_different_token=same, misses=total["misses"], uploads=total["uploads"],
                                 cpu_experts=total["cpu_experts"],
                                 logits_bit_identical=bool((logits == resident_logits).all()),
                                 max_abs_logit_difference=float(abs(logits - resident_logits).max())))
    mixed = models / "mp-qwen3_moe.gguf"  # with a LOW copy of every expert
    resident_tokens = greedy(mixed, mode="gpu", low_precision=False)[0]
    for mode in ("gpu", "coop"):
        tokens, _, stats = greedy(mixed, mode=mode, expert_cache="25%", low_precision=True)
        total = stats["experts"]["total"]
        rows.append(dict(model=mixed.stem, mode=mode, budget="25%", low_precision=True,
                         top1_agreement=agreement(tokens, resident_tokens),
                         misses=total["misses"], low_loads=total.get("low_loads"), uploads=total["uploads"],
                         cpu_experts=total["cpu_experts"]))
    # split's host tier in both layouts (Q4_K experts, which the CPU repacks): with nothing uploaded
    # it computes what coop computes from its repacked host tier, bit for bit (decode steps)
    repacking = models / "q4k-qwen3_moe.gguf"

    def decode(**options) -> tuple[object, dict]:
        with Engine(repacking, n_ctx=256, flash_attn=False, kv_type="f32", expert_cache="25%", **options) as eng:
            return eng.logits(CORRECTNESS_IDS, one_token_per_step=True), eng.stats()["experts"]
    coop_logits, _ = decode(mode="coop")
    for share in (0.0, 0.5):
        logits, experts = decode(mode="split", link_share=share)
        rows.append(dict(model=repacking.stem, mode="split", budget="25%", link_share=share,
                         host_layouts="both" if experts["host_pool_bytes"] > experts["expert_bytes"] else "pinned",
                         logits_as_coop=bool((logits == coop_logits).all()),
                         max_abs_logit_difference=float(abs(logits - coop_logits).max()),
                         misses=experts["total"]["misses"], uploads=experts["total"]["uploads"],
                         cpu_experts=experts["total"]["cpu_experts"]))
    return {"rows": rows}


def failed(row: dict) -> bool:
    """A correctness row that shows a fault: tokens not the resident run's, or split over both host
    layouts with nothing uploaded not giving coop's logits."""
    return row.get("tokens_as_resident") is False or (row.get("link_share") == 0 and row.get("logits_as_coop") is False)


# the expert counters whose change per decode token gpu-check.json records (decode_per_token)
PER_TOKEN_COUNTERS = ("hits", "misses", "uploads", "bytes_uploaded", "upload_ms", "bytes_read", "load_ms", "stall_ms",
                      "op_ms", "host_hits", "host_loads", "cpu_experts", "upload_wait_ms", "queue_ms", "cpu_pass_ms",
                      "selections_low", "skipped")


def measure(model: Path, mode: str, budget: str, sizes: dict, threads: int | None, link_share: float | None = None,
            prefetch: str | None = None, low_from: Path | None = None, profile_trace: Path | None = None) -> dict:
    """Ours in one configuration: prefill of `prefill` tokens (first, so that every expert has been
    read once, as llama-bench's warm-up reads the file), then TTFT and decode, each `repeats` times
    after a first round of the three that the medians leave out (as llama-bench warms up): ours
    decoded its first round 1.4-3.5x slower than the rounds after on an H200, where stock's first
    measured round was as fast as its others (docs/gpu.md). The first round is kept apart.
    Reads are buffered: the file is in the page cache, as for stock llama.cpp's mmap.
    With low_from, LOW copies from that file and mixed precision on (its defaults: lossy). The last
    round's picks over the fixed walk are kept: cells of one model compare them (top-1 agreement).
    With profile_trace, a last decode of PROFILE_TOKENS under CUPTI's profiler says where a token's
    time goes on the device (pyedgemoe.bench.device_profile; its trace to profile_trace)."""
    from pyedgemoe import Engine

    n_decode = sizes["decode"]
    t0 = time.perf_counter()
    # every expert in the device's cache: no miss, so no host tier
    host_cache = 0 if budget == RESIDENT else "auto"
    options = {} if link_share is None else dict(link_share=link_share)  # split: else the share the rates at load give
    if prefetch is not None:  # else the default: none where the threads are given, as here
        options.update(prefetch=prefetch)
    if low_from is not None:
        options.update(low_from=str(low_from))
    with Engine(model, n_ctx=sizes["prefill"] + n_decode + 16, n_batch=512, n_threads=threads,
                flash_attn=sizes["flash_attn"], mode=mode, expert_cache=budget, host_cache=host_cache, io="buffered", **options) as eng:
        load_seconds = time.perf_counter() - t0
        rounds = []
        for r in range(sizes["repeats"] + 1):
            t = eng.time_generation(prompt_token_ids(sizes["prefill"]), 1)
            prefill_tps = sizes["prefill"] / t["prefill_seconds"]
            # a prompt of its own each time: no prefix of an earlier one is reused
            prompt = [100 + (i * 37 + 11 * r) % 1000 for i in range(TTFT_PROMPT)]
            ttft_s = eng.time_generation(prompt, 1)["prefill_seconds"]
            # n_decode + 1 picks are n_decode forward passes, llama-bench's tg<n_decode>
            t = eng.time_generation(prompt[::-1], n_decode + 1, feed_tokens=fixed_decode_token_ids(n_decode + 1))
            # where the decode's time went, per token: the counters its steps moved (not the prompt's)
            moved = t["decode_experts"]
            per_token = {k: moved[k] / n_decode for k in PER_TOKEN_COUNTERS if k in moved}
            per_token["ms"] = t["decode_seconds"] * 1e3 / n_decode
            rounds.append(dict(prefill_tps=prefill_tps, ttft_s=ttft_s, decode_tps=n_decode / t["decode_seconds"],
                               decode_per_token=per_token, picks=t["tokens"]))
        first, rounds = rounds[0], rounds[1:]
        picks = rounds[-1]["picks"]  # the last round's, as its counters
        for r in (first, *rounds):
            del r["picks"]
        prefill, ttft, decode = ([r[k] for r in rounds] for k in ("prefill_tps", "ttft_s", "decode_tps"))
        stats = eng.stats()
        experts = stats["experts"]
        device_bytes = sum(m.get("model", 0) + m.get("context", 0) + m.get("compute", 0)
                           for m in stats["memory"] if m["buffer_type"] == stats["device"])
        result = dict(mode=mode, chosen_mode=experts["mode"], budget=budget, threads=threads, lossy=low_from is not None,
                      load_seconds=load_seconds, prefill_tps=statistics.median(prefill), ttft_s=statistics.median(ttft),
                      decode_tps=statistics.median(decode), samples=dict(prefill_tps=prefill, ttft_s=ttft, decode_tps=decode),
                      pool_bytes=experts["pool_bytes"], host_pool_bytes=experts["host_pool_bytes"],
                      device_bytes=device_bytes + experts["pool_bytes"],
                      hit_rate=experts["total"]["hits"] / max(1, experts["total"]["requests"]),
                      uploads=experts["total"]["uploads"], cpu_experts=experts["total"]["cpu_experts"],
                      # the last round's; the first round's is kept with it
                      decode_per_token=rounds[-1]["decode_per_token"], picks=picks, first_round=first,
                      mode_reason=experts.get("mode_reason") or None,
                      final_link_share=experts["link_share"] if experts["mode"] == "split" else None,  # refined by the layers
                      # the whole run's (every round's) prefetches: how many, used, given back to their layer
                      # (coop, split), and whether its trial stopped it
                      prefetches={k: experts["prefetches"][k] for k in ("issued", "used", "given_back", "stopped")}
                      if prefetch else None)
        if profile_trace is not None:
            # the numbers first: a profiler that takes the process down costs the profile alone (Check.child)
            print(json.dumps(result), flush=True)
            result["profile"] = device_profile(eng, profile_trace)
    return result


def device_profile(eng, trace: Path) -> dict:
    """A decode under PyTorch's profiler (CUPTI): its summary, or why there is none (no PyTorch, or
    the profiler failed: a diagnosis, whose failure must not cost the cell)."""
    try:
        from pyedgemoe.bench.device_profile import profile_decode
        prompt = [100 + (i * 53) % 1000 for i in range(TTFT_PROMPT)]
        return profile_decode(eng, prompt, fixed_decode_token_ids(PROFILE_TOKENS), trace)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


# ---------------------------------------------------------------------------------------------
# the parent


class VramSampler:
    """The most GPU memory in use (MiB) while a cell runs, from one `nvidia-smi -lms 250` beside it (a
    new nvidia-smi every 0.25 s took a core's share from the runs it measured); None without it."""

    def __init__(self):
        self.peak: int | None = None
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        for line in self._proc.stdout:
            if line.strip().isdigit():
                self.peak = max(self.peak or 0, int(line))

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                           "-lms", "250"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._proc:
            self._proc.terminate()
            self._proc.wait()
            self._thread.join()


def numa_nodes() -> dict[str, str]:
    """The machine's NUMA nodes and their CPUs: where a host tier's pages land against the threads
    that compute from them may be why one configuration decodes at levels up to 17 % apart from one
    process to the next (docs/gpu.md, the third session)."""
    return {d.name: (d / "cpulist").read_text().strip() for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))}


class Check:
    def __init__(self, args):
        self.args = args
        self.sizes = SIZES[args.rehearse]
        # under --load each engine keeps its own default (ours: governed by the machine's load), as users run them
        self.threads = args.threads or (None if args.load else len(os.sched_getaffinity(0)))
        self.t_end = time.monotonic() + args.deadline
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.result = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), rehearsal=args.rehearse, sizes=self.sizes,
                           threads=self.threads, load=args.load, host=platform.node(), kernel=platform.release(),
                           numa=numa_nodes(), device=None, correctness=None,
                           models={}, cells=[], skipped=[])

    def remaining(self) -> float:
        return self.t_end - time.monotonic()

    def save(self) -> None:
        (self.out / "gpu-check.json").write_text(json.dumps(self.result, indent=1))
        (self.out / "gpu-check.md").write_text(report(self.result))

    def child(self, args: list[str], timeout: float, env: dict | None = None) -> dict:
        """Runs this script as a child (env: its environment, None: this one's); its one JSON line,
        or {"error": ...}."""
        try:
            p = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired as e:
            lines = (e.stdout or b"").decode(errors="replace").strip().splitlines()  # bytes, whatever text= says
            if lines:  # a measurement's numbers came out before its profile
                return dict(json.loads(lines[-1]), profile={"error": f"timed out after {timeout:.0f} s"})
            return {"error": f"timed out after {timeout:.0f} s"}
        lines = p.stdout.strip().splitlines()
        if p.returncode != 0 or not lines:
            # the last lines: a CUDA error is printed (what, where) before the abort that reports it
            tail = " | ".join(p.stderr.strip().splitlines()[-4:]) or "(no output)"
            if lines:  # a measurement's numbers came out before its profile took the process down
                return dict(json.loads(lines[-1]), profile={"error": f"exit {p.returncode}: {tail}"})
            return {"error": f"exit {p.returncode}: {tail}"}
        return json.loads(lines[-1])

    def run(self) -> int:
        from pyedgemoe.devices import gpu_devices
        self.result["device"] = gpu_devices()[0]
        log(f"device: {self.result['device']['description']} ({self.result['device']['name']})")
        writers = self.start_models()  # written while the correctness runs
        if self.args.correctness:
            self.correctness()
        self.finish_models(writers)
        self.bench()
        self.save()
        log(f"done, {self.args.deadline - self.remaining():.0f} s; {self.out}/gpu-check.md:")
        print(report(self.result))
        c = self.result["correctness"] or {}
        return 1 if "error" in c or any(failed(r) for r in c.get("rows", [])) else 0

    def correctness(self) -> None:
        log("correctness: tiny architectures, gpu, coop and split at 25 % and 50 % against all-resident")
        t0 = time.monotonic()
        c = self.child(["--child", "correctness", "--kit", self.args.kit], timeout=min(240, self.remaining()))
        c["seconds"] = time.monotonic() - t0
        self.result["correctness"] = c
        self.save()
        if "error" in c:
            log(f"correctness: error: {c['error']}")
            return
        bad = [r for r in c["rows"] if failed(r)]
        log(f"correctness: {len(c['rows'])} runs in {c['seconds']:.0f} s, "
            f"{len(bad)} failed: {[(r['model'], r['mode'], r['budget']) for r in bad]}")

    def start_models(self) -> list[tuple[str, dict, list[tuple[Path, subprocess.Popen | None]]]]:
        bench_dir = Path(self.args.bench_dir)
        bench_dir.mkdir(parents=True, exist_ok=True)
        vocab = Path(self.args.kit) / "vocab"
        writers = []
        for name, geometry, layers, qtype, vocab_file in (
                ("qwen3", "qwen3-30b-a3b", self.sizes["qwen3_layers"], "q4_k", "ggml-vocab-qwen2.gguf"),
                ("olmoe", "olmoe-1b-7b", self.sizes["olmoe_layers"], "q8_0", "ggml-vocab-gpt-neox.gguf")):
            if name not in self.args.models:
                continue
            model = dict(geometry=geometry, layers=layers, type=qtype, started=time.monotonic())
            files = []
            # with --low, a second file of the same seed and row pool in the LOW type: the same weights
            for type_name in (qtype, *([self.args.low] if self.args.low else [])):
                path = bench_dir / f"{geometry}-L{layers}-{type_name}.gguf"
                files.append((path, None if path.exists() else subprocess.Popen(
                    [sys.executable, str(REPO / "scripts" / "make_synthetic_gguf.py"), "--geometry", geometry,
                     "--layers", str(layers), "--type", type_name, "--row-pool", str(ROW_POOL),
                     "--vocab", str(vocab / vocab_file), "-o", f"{path}.part"], stdout=subprocess.DEVNULL)))
            writers.append((name, model, files))
        return writers

    def finish_models(self, writers: list[tuple[str, dict, list[tuple[Path, subprocess.Popen | None]]]]) -> None:
        for name, model, files in writers:
            for path, writer in files:
                if writer is not None:
                    if writer.wait(timeout=max(1, self.remaining())) != 0:
                        raise SystemExit(f"error: scripts/make_synthetic_gguf.py failed for {path}")
                    os.replace(f"{path}.part", path)
            (path, _), low = files[0], files[1:]
            model.update(path=str(path), bytes=path.stat().st_size, seconds=time.monotonic() - model.pop("started"))
            if low:
                model.update(low_path=str(low[0][0]), low_type=self.args.low, low_bytes=low[0][0].stat().st_size)
            self.result["models"][name] = model
            log(f"model {name}: {path} ({model['bytes'] / 1e9:.1f} GB"
                + (f", its {model['low_type']} copy {model['low_bytes'] / 1e9:.1f} GB" if low else "")
                + f", ready after {model['seconds']:.0f} s)")
        self.save()

    def ours(self, name: str, mode: str, budget: str, extra: list[str] = (), variant: bool = False) -> list[str]:
        """A measure child's arguments; the first model's cells at the first budget and with every
        expert cached (the ones a token's time is placed for) also profile a decode (--profile),
        but for the variants (extra arguments, or another environment)."""
        args = ["--child", "measure", "--model", self.result["models"][name]["path"], "--mode", mode, "--budget", budget,
                *(["--threads", str(self.threads)] if self.threads else []), *extra]
        if self.args.profile and name == self.args.models[0] and budget in (self.args.budgets[0], RESIDENT) \
                and not (extra or variant):
            args += ["--profile-trace", str(self.out / f"profile-{name}-{budget.rstrip('%')}-{mode}.json.gz")]
        return args

    def bench(self) -> None:
        for name in self.args.models:
            model = self.result["models"][name]
            for budget in self.args.budgets:
                share = int(budget.rstrip("%")) / 100
                n_cpu_moe = round(model["layers"] * (1 - share))
                stock = [(f"-ot exps=CPU", ["-ot", "exps=CPU"]), (f"--n-cpu-moe {n_cpu_moe}", ["-ncmoe", str(n_cpu_moe)])]
                for mode in self.args.modes:
                    self.cell(name, budget, mode, self.ours(name, mode, budget))
                # stock's before the variations of ours below: a ratio needs them, and a deadline cuts the last
                for label, flags in stock:
                    if label.startswith("-ot") and budget != self.args.budgets[0]:
                        continue  # no experts on the GPU: the same run at every budget
                    self.cell(name, budget, label, flags, stock=True)
                for p in self.args.prefetch:  # the next layer's experts uploaded while this one computes
                    for mode in self.args.modes:
                        self.cell(name, budget, f"{mode}, prefetch {p}", self.ours(name, mode, budget, ["--prefetch", p]))
                for s in self.args.link_shares:  # split at fixed shares: is the share its rates give the best?
                    self.cell(name, budget, f"split {s:g}", self.ours(name, "split", budget, ["--link-share", str(s)]))
                for n in self.args.split_threads:  # fewer CPU threads: a core for the thread that queues the uploads
                    self.cell(name, budget, f"split, {n} threads", self.ours(name, "split", budget, ["--threads", str(n)]))
                if self.args.low:  # HOBBIT's mixed precision: LOW copies for unimportant misses (lossy)
                    for mode in self.args.modes:
                        self.cell(name, budget, f"{mode}, low {self.args.low}",
                                  self.ours(name, mode, budget, ["--low-from", model["low_path"]]))
                for policy in self.args.omp_wait:  # how ggml's OpenMP threads wait between two splits of a layer
                    env = {**os.environ, "OMP_WAIT_POLICY": policy}
                    for mode in self.args.modes:
                        self.cell(name, budget, f"{mode}, OMP {policy}", self.ours(name, mode, budget, variant=True), env=env)
                    for label, flags in stock:
                        self.cell(name, budget, f"{label}, OMP {policy}", flags, stock=True, env=env)
            # every expert on the GPU: what a token costs besides its misses, at best; and ours with no
            # miss: what the hook costs a token beyond that (the op, a CPU split and a wait a layer)
            self.cell(name, RESIDENT, "-ngl 99", [], stock=True)
            if "gpu" in self.args.modes:
                self.cell(name, RESIDENT, "gpu", self.ours(name, "gpu", RESIDENT))

    def cell(self, name: str, budget: str, label: str, args: list[str], stock: bool = False, env: dict | None = None) -> None:
        # a cell takes about as long as the slowest one so far; one that would not end in time is not begun
        longest = max([c["seconds"] for c in self.result["cells"]] or [30])
        if self.remaining() < longest * 1.2:
            self.result["skipped"].append(dict(model=name, budget=budget, engine=label))
            log(f"skip {name} {budget} {label}: {self.remaining():.0f} s left")
            return
        t0 = time.monotonic()
        timeout = min(self.remaining(), LOADED_CELL_SECONDS) if self.args.load else self.remaining()
        if "--profile-trace" in args:
            timeout = min(timeout, PROFILED_CELL_SECONDS)
        with VramSampler() as vram, cpu_load(self.args.load):
            r = self.stock(name, args, timeout, env) if stock else self.child(args, timeout=timeout, env=env)
        r.update(model=name, budget=budget, label=label, engine="llama.cpp" if stock else "pyedgemoe",
                 seconds=time.monotonic() - t0, vram_peak_mib=vram.peak)
        self.result["cells"].append(r)
        self.save()
        log(f"{name} {budget} {label}: " + (r["error"] if "error" in r else
            f"TTFT {r['ttft_s'] * 1e3:.0f} ms, decode {r['decode_tps']:.1f} tok/s, prefill {r['prefill_tps']:.0f} tok/s"
            f" ({r['seconds']:.0f} s)"))

    def stock(self, name: str, flags: list[str], timeout: float, env: dict | None = None) -> dict:
        s = self.sizes
        cmd = [str(Path(self.args.kit) / "bin" / "llama-bench"), "-m", self.result["models"][name]["path"],
               "-ngl", "99", *(["-t", str(self.threads)] if self.threads else []), "-fa", str(int(s["flash_attn"])),
               "-b", "512", "-ub", "512",
               "-p", f"{TTFT_PROMPT},{s['prefill']}", "-n", str(s["decode"]), "-r", str(s["repeats"]), "-o", "json", *flags]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if p.returncode != 0:
            return {"error": f"llama-bench exit {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1]}"}
        tests = json.loads(p.stdout)

        def samples(n_prompt: int, n_gen: int) -> list[float]:
            return next(t["samples_ts"] for t in tests if t["n_prompt"] == n_prompt and t["n_gen"] == n_gen)
        ttft = [TTFT_PROMPT / ts for ts in samples(TTFT_PROMPT, 0)]
        return dict(flags=" ".join(flags), threads=self.threads,
                    build=tests[0].get("build_commit"), ttft_s=statistics.median(ttft),
                    prefill_tps=statistics.median(samples(s["prefill"], 0)),
                    decode_tps=statistics.median(samples(0, s["decode"])),
                    samples=dict(ttft_s=ttft, prefill_tps=samples(s["prefill"], 0), decode_tps=samples(0, s["decode"])))


def agreement(picks: list[int], reference: list[int]) -> float:
    """Top-1 agreement: the share of greedy picks, step by step over the same input, that two runs share."""
    return sum(a == b for a, b in zip(picks, reference)) / len(picks)


def report(result: dict) -> str:
    dev = result.get("device") or {}
    s = result["sizes"]
    lines = [f"GPU check{' (rehearsal)' if result['rehearsal'] else ''}, {result['date']}: "
             f"{dev.get('description', '?')} ({dev.get('name', '?')}), "
             + (f"{result['threads']} CPU threads" if result["threads"] else "each engine's default CPU threads")
             + (f", {result['load']} CPU-bound process{'es' if result['load'] > 1 else ''} beside each cell"
                if result.get("load") else "")
             + (f", kernel {result['kernel']}" if result.get("kernel") else "")
             + (f", NUMA nodes {result['numa']}" if result.get("numa") else ""), ""]
    c = result.get("correctness") or {}
    if "error" in c:
        lines += [f"correctness: error: {c['error']}", ""]
    elif c.get("rows"):
        lines += ["| model | mode | budget | tokens as all-resident | logits bit-identical | misses | uploads | CPU experts |",
                  "|---|---|---|---|---|---:|---:|---:|"]
        for r in c["rows"]:
            if r.get("low_precision"):
                same = f"low precision: top-1 agreement {r['top1_agreement']:.0%}"
                bits = "-"
            elif "logits_as_coop" in r:  # split over both host layouts, against coop (with nothing uploaded)
                same = f"host tier {r['host_layouts']}, link share {r['link_share']:.1f}"
                bits = (("as coop's" if r["logits_as_coop"] else f"not coop's ({r['max_abs_logit_difference']:.1e})")
                        if r["link_share"] == 0 else "- (uploads computed on the device)")
            else:
                same = "yes" if r["tokens_as_resident"] else f"up to token {r['first_different_token']}"
                bits = "yes" if r["logits_bit_identical"] else f"no ({r['max_abs_logit_difference']:.1e})"
            lines.append(f"| {r['model']} | {r['mode']} | {r['budget']} | {same} | {bits} | {r['misses']} | "
                         f"{r['uploads']} | {r['cpu_experts']} |")
        lines.append("")
    for name, m in result.get("models", {}).items():
        cells = [r for r in result["cells"] if r["model"] == name]
        if not cells:
            continue
        lines += [f"{m['geometry']}, {m['layers']} layers, {m['type']} ({m['bytes'] / 1e9:.1f} GB): "
                  f"TTFT of a {TTFT_PROMPT}-token prompt, decode {s['decode']} tokens, prefill {s['prefill']} tokens, "
                  f"medians of {s['repeats']}", "",
                  "| budget | engine | TTFT ms | decode tok/s | prefill tok/s | VRAM peak MiB | notes |",
                  "|---|---|---:|---:|---:|---:|---|"]
        for r in cells:
            engine = f"ours `{r['label']}`" if r["engine"] == "pyedgemoe" else f"llama.cpp `{r['label']}`"
            if "error" in r:
                lines.append(f"| {r['budget']} | {engine} | error: {r['error']} | | | | |")
                continue
            notes = (f"→ {r['chosen_mode']}, " if r["label"] == "auto" else "") + (
                f"hit rate {r['hit_rate']:.0%}" if r["engine"] == "pyedgemoe" else "")
            if r.get("first_round"):
                f = r["first_round"]
                notes += f"; first round: TTFT {f['ttft_s'] * 1e3:.0f} ms, decode {f['decode_tps']:.1f} tok/s"
                if f.get("decode_per_token"):  # what the first round did that the later ones did not
                    ft = f["decode_per_token"]
                    notes += (f" ({ft.get('bytes_read', 0) / 2**20:.0f} MiB read, {ft.get('host_loads', 0):.0f} host loads, "
                              f"loads {ft.get('load_ms', 0):.1f} ms a token)")
            t = r.get("decode_per_token")
            if t:  # a decode token's time: what went to loads (storage, host tier, uploads), stalls and our op
                notes += (f"; a token {t['ms']:.1f} ms: {t['bytes_uploaded'] / 2**20:.0f} MiB uploaded in "
                          f"{t['upload_ms']:.1f} ms, loads {t['load_ms']:.1f} ms, stalls {t['stall_ms']:.1f} ms, "
                          f"our op {t['op_ms']:.1f} ms")
                if r.get("chosen_mode") == "coop":  # the CPU's passes, the part of a token the device waits for them
                    notes += f"; {t['cpu_experts']:.0f} on the CPU in {t.get('cpu_pass_ms', 0):.1f} ms"
                if r.get("chosen_mode") == "split":  # the share each way, and how long the device waited for the link
                    notes += (f"; {t['uploads']:.0f} uploaded (queued in {t.get('queue_ms', 0):.1f} ms beside the CPU's passes), "
                              f"{t['cpu_experts']:.0f} on the CPU in "
                              f"{t.get('cpu_pass_ms', 0):.1f} ms, then waited {t.get('upload_wait_ms', 0):.1f} ms for uploads"
                              + (f"; share at the end {r['final_link_share']:.0%}" if r.get("final_link_share") is not None else ""))
            if r.get("lossy"):  # mixed precision: how much went LOW, and what it changed of the picks
                same = next((c for c in cells if c["label"] == r["mode"] and c["budget"] == r["budget"] and c.get("picks")), None)
                notes += (f"; a token {t.get('selections_low', 0):.0f} selections LOW, {t.get('skipped', 0):.0f} skipped"
                          + (f"; top-1 agreement with `{same['label']}` {agreement(r['picks'], same['picks']):.0%}" if same else ""))
            if r.get("prefetches"):
                p = r["prefetches"]
                notes += (f"; prefetch: {p['issued']} read ahead, {p['used']} used, {p['given_back']} not begun by their layer"
                          + (", stopped" if p["stopped"] else ""))
            lines.append(f"| {r['budget']} | {engine} | {r['ttft_s'] * 1e3:.1f} | {r['decode_tps']:.1f} | "
                         f"{r['prefill_tps']:.0f} | {r.get('vram_peak_mib') or '-'} | {notes} |")
        lines.append("")
        reasons = [f"- `{r['label']}` at {r['budget']}: {r['mode_reason']}" for r in cells if r.get("mode_reason")]
        lines += reasons + ([""] if reasons else [])  # the rates auto and split measured at load
    for budget in BUDGETS:
        for name in result.get("models", {}):
            measured = [r for r in result["cells"] if r["model"] == name and r["budget"] == budget
                        and r.get("engine") == "pyedgemoe" and "error" not in r]
            ours = [r for r in measured if not r.get("lossy")]
            stock = [r for r in result["cells"] if r["model"] == name and r.get("engine") == "llama.cpp"
                     and "error" not in r and (r["budget"] == budget or r["label"].startswith("-ot"))]
            if not stock:
                continue
            base = max(stock, key=lambda r: r["decode_tps"])
            if ours:
                best = max(ours, key=lambda r: r["decode_tps"])
                auto = next((r for r in ours if r["label"] == "auto"), None)
                lines.append(f"- {name} at {budget}: our best decode (`{best['label']}`) / stock's best (`{base['label']}`)"
                             f" = {best['decode_tps'] / base['decode_tps']:.2f}x"
                             + (f"; `auto` / our best = {auto['decode_tps'] / best['decode_tps']:.2f}" if auto else ""))
            lossy = [r for r in measured if r.get("lossy")]
            if lossy:
                best = max(lossy, key=lambda r: r["decode_tps"])
                lines.append(f"- {name} at {budget}, mixed precision (lossy): `{best['label']}` / stock's best = "
                             f"{best['decode_tps'] / base['decode_tps']:.2f}x")
    for name in result.get("models", {}):
        resident = next((r for r in result["cells"] if r["model"] == name and r["budget"] == RESIDENT
                         and r.get("engine") == "llama.cpp" and "error" not in r), None)
        if resident:
            lines.append(f"- {name}, every expert on the GPU (llama.cpp `-ngl 99`): {resident['decode_tps']:.1f} tok/s, "
                         f"{1e3 / resident['decode_tps']:.1f} ms a token: what a token costs besides its misses, at best")
        cached = next((r for r in result["cells"] if r["model"] == name and r["budget"] == RESIDENT
                       and r.get("engine") == "pyedgemoe" and "error" not in r), None)
        if cached and resident:
            ms, stock_ms = 1e3 / cached["decode_tps"], 1e3 / resident["decode_tps"]
            lines.append(f"- {name}, every expert in our `gpu` cache (no miss): {cached['decode_tps']:.1f} tok/s, {ms:.1f} ms "
                         f"a token, {ms - stock_ms:+.1f} ms beside `-ngl 99`: what our hook costs a token "
                         f"(our op {cached['decode_per_token'].get('op_ms', 0):.1f} ms of it)")
    profiled = [r for r in result["cells"] if r.get("profile")]
    if profiled:  # the device's side of a decode token (CUPTI), after the medians' rounds
        lines += ["", f"Where a decode token goes on the device ({PROFILE_TOKENS} tokens under PyTorch's profiler, "
                      "after the rounds above):", ""]
        for r in profiled:
            p = r["profile"]
            lines.append(f"- {r['model']} `{r['label']}` at {r['budget']}: "
                         + (f"not profiled ({p['error']})" if "error" in p else describe(p)))
    if result.get("skipped"):
        lines += ["", "not run (deadline): " + ", ".join(f"{r['model']} {r['budget']} {r['engine']}"
                                                          for r in result["skipped"])]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kit", help="the unpacked GPU kit (scripts/gpu_check.sh unpacks it)")
    p.add_argument("--out", help="output folder")
    p.add_argument("--rehearse", action="store_true", help="tiny sizes, for a rehearsal on lavapipe")
    p.add_argument("--deadline", type=float, default=450, help="seconds for all of it (default 450)")
    p.add_argument("--models", nargs="+", choices=("qwen3", "olmoe"), default=["qwen3", "olmoe"],
                   help="the benchmark's models (default both), for a short rerun")
    p.add_argument("--budgets", nargs="+", choices=BUDGETS, default=list(BUDGETS), help="its device budgets (default all)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="our modes measured (default all)")
    p.add_argument("--threads", type=int, help="CPU threads, ours and stock's (default as many as the machine has "
                                               "cores; with --load each engine's own default)")
    p.add_argument("--correctness", action=argparse.BooleanOptionalAction, default=True,
                   help="the correctness runs first (default; --no-correctness: a rerun on the same kit, a minute saved)")
    p.add_argument("--load", type=int, default=0, metavar="N",
                   help="N CPU-bound processes beside each benchmark cell, ours and stock's: a busy machine")
    p.add_argument("--link-shares", nargs="+", type=float, default=[], metavar="S",
                   help="also `split` uploading these shares of the misses (0-1), beside the share its rates give")
    p.add_argument("--split-threads", nargs="+", type=int, default=[], metavar="N",
                   help="also `split` with N CPU threads (the other cells' count stays): whether a core left to the "
                        "thread that queues its uploads beside the CPU's passes pays")
    p.add_argument("--prefetch", nargs="+", choices=PREFETCHERS, default=[], metavar="P",
                   help=f"also each of --modes with prefetcher P ({', '.join(PREFETCHERS)}; the other cells: none, "
                        "the default where the threads are given)")
    p.add_argument("--omp-wait", nargs="+", choices=("PASSIVE", "ACTIVE"), default=[], metavar="POLICY",
                   help="also each of --modes and stock's two with OMP_WAIT_POLICY=POLICY: how ggml's OpenMP threads "
                        "wait between a layer's CPU and device splits (PASSIVE: asleep at once; ACTIVE: spinning; "
                        "the other cells: libgomp's default, a spin then sleep)")
    p.add_argument("--low", choices=LOW_TYPES, metavar="TYPE",
                   help=f"also each of --modes with HOBBIT's mixed precision ({', '.join(LOW_TYPES)}): LOW copies in TYPE "
                        "from a second benchmark file of the same random weights (--low-from), lossy, its top-1 "
                        "agreement with the same mode's lossless picks over the decode's walk")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="profile a decode of ours (CUPTI, through PyTorch) in the first model's cells at the first "
                        "budget and with every expert cached: the device's time in a token (default on)")
    p.add_argument("--bench-dir", default="/tmp/pyedgemoe-gpu-bench", help="where the benchmark files go")
    p.add_argument("--child", choices=("correctness", "measure"), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--budget", help=argparse.SUPPRESS)
    p.add_argument("--link-share", type=float, help=argparse.SUPPRESS)
    p.add_argument("--low-from", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--profile-trace", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if any(not 0 <= s <= 1 for s in args.link_shares):
        p.error("--link-shares: each a share of the misses, from 0 to 1")
    if any(n < 1 for n in args.split_threads):
        p.error("--split-threads: each a count of CPU threads, at least 1")
    if args.child == "correctness":
        print(json.dumps(correctness(Path(args.kit) / "models")))
        return 0
    if args.child == "measure":
        sizes = SIZES[bool(os.environ.get("PYEDGEMOE_GPU_REHEARSE"))]
        print(json.dumps(measure(Path(args.model), args.mode, args.budget, sizes, args.threads, args.link_share,
                                 (args.prefetch or [None])[0], args.low_from, args.profile_trace)))
        return 0
    if not args.kit or not args.out:
        p.error("--kit and --out are required")
    if args.rehearse:
        os.environ["PYEDGEMOE_GPU_REHEARSE"] = "1"  # the children's sizes
    return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
