"""A fuzzing campaign: random recipes (generate.py) through the command line (runner.py) until the
time is up, counted per parser, with each distinct finding kept as a replayable recipe.

Writes under its output directory: stats.json (the counts, rewritten as it goes) and
findings/<n>.json, one per distinct signature (runner.signature): the first recipe that produced it,
how often it came back, and the command's last lines of stderr. A finding's recipe goes into
tests/fuzz_corpus/ once fixed (or, for the native module, as an expected failure).
"""
from __future__ import annotations

import json
import random
import time
from collections import Counter, defaultdict
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from fuzz.generate import PARSERS, recipe
from fuzz.runner import FINDINGS, Result, run_input
from fuzz.seeds import Seed


class Tally:
    """Counts per parser: inputs, commands and outcomes, damaged files, distinct findings."""

    def __init__(self):
        self.inputs: Counter = Counter()
        self.commands: Counter = Counter()
        self.outcomes: dict[str, Counter] = defaultdict(Counter)
        self.damaged: Counter = Counter()
        self.findings: dict[str, dict] = {}  # signature -> the finding

    def add(self, r: dict, results: list[Result]) -> list[dict]:
        """Counts one input's results; returns the findings seen for the first time."""
        parser = r["parser"]
        self.inputs[parser] += 1
        new = []
        for res in results:
            self.commands[parser] += 1
            self.outcomes[parser][res.outcome] += 1
            self.damaged[parser] += res.damage is not None
            if res.outcome not in FINDINGS:
                continue
            seen = self.findings.get(res.signature)
            if seen:
                seen["count"] += 1
                continue
            finding = {"signature": res.signature, "parser": parser, "outcome": res.outcome, "count": 1,
                       "recipe": r, "result": res.to_dict()}
            self.findings[res.signature] = finding
            new.append(finding)
        return new

    def to_dict(self, seconds: float) -> dict:
        parsers = {p: {"inputs": self.inputs[p], "commands": self.commands[p], "outcomes": dict(self.outcomes[p]),
                       "files_damaged": self.damaged[p],
                       "findings": sorted(f["signature"] for f in self.findings.values() if f["parser"] == p)}
                   for p in PARSERS if self.inputs[p]}
        return {"seconds": round(seconds, 1), "inputs": sum(self.inputs.values()),
                "commands": sum(self.commands.values()), "parsers": parsers,
                "findings": [{k: f[k] for k in ("signature", "parser", "outcome", "count")}
                             for f in self.findings.values()]}


def run_campaign(seeds: dict[str, Seed], out: Path, *, minutes: float, seed: int = 0, jobs: int = 1,
                 workdir: Path | None = None, log=print) -> dict:
    out = Path(out)
    (out / "findings").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    tally = Tally()
    start = time.monotonic()
    deadline = start + minutes * 60
    last_write = 0.0

    paths: dict[str, Path] = {}

    def record(r: dict, results: list[Result]) -> None:
        for finding in tally.add(r, results):
            path = paths[finding["signature"]] = out / "findings" / f"{len(paths) + 1:03d}.json"
            path.write_text(json.dumps(finding, indent=1) + "\n")
            log(f"[{time.monotonic() - start:7.0f} s] new {finding['outcome']}: {finding['signature']} -> {path}")

    with ThreadPoolExecutor(jobs) as pool:
        pending = {}
        while True:
            while time.monotonic() < deadline and len(pending) < 2 * jobs:
                r = recipe(rng, seeds)
                pending[pool.submit(run_input, seeds[r["seed"]], r["mutations"], r["run_options"],
                                    workdir=workdir)] = r
            if not pending:
                break
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                record(pending.pop(future), future.result())
            if time.monotonic() - last_write > 30:
                last_write = time.monotonic()
                _write_stats(out, tally, last_write - start)
    for signature, path in paths.items():  # with their final counts
        path.write_text(json.dumps(tally.findings[signature], indent=1) + "\n")
    return _write_stats(out, tally, time.monotonic() - start)


def _write_stats(out: Path, tally: Tally, seconds: float) -> dict:
    stats = tally.to_dict(seconds)
    (out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    return stats


def table(stats: dict) -> str:
    """The campaign's counts as a markdown table, one row per parser."""
    rows = ["| parser | inputs | commands | ok | clean error | tracebacks | crashes | hangs | unclean | files lost |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for parser, p in stats["parsers"].items():
        o = p["outcomes"]
        rows.append(f"| {parser} | {p['inputs']} | {p['commands']} | {o.get('ok', 0)} | {o.get('clean', 0)} | "
                    f"{o.get('traceback', 0)} | {o.get('crash', 0)} | {o.get('hang', 0)} | {o.get('unclean', 0)} | "
                    f"{p['files_damaged']} |")
    return "\n".join(rows)
