"""`pyedgemoe bench`: what it refuses before its first run (a benchmark takes minutes: a setting it
cannot finish with is one `error:` line at once, not a report of failed rows at the end), and the
peak RSS it reports, the worker's own."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"


def bench(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyedgemoe", "bench", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    # every stock row failed to load the file, and the exit came after all of ours
    (["-r", "1"], "stock llama.cpp cannot load the multi-precision GGUF"),
    # the first token comes from the prefill: 25481 tok/s for no decode at all
    (["--ours-only", "-n", "1"], "output_tokens must be >= 2, got 1"),
])
def test_a_cell_that_cannot_be_measured_is_refused_before_the_runs(args, message):
    r = bench(DEMO, *args)
    assert r.returncode == 1 and r.stdout == "" and r.stderr.strip().splitlines() == [
        next(line for line in r.stderr.splitlines() if line.startswith("error:"))]
    assert message in r.stderr


def test_a_report_that_cannot_be_written_is_refused_before_the_runs(tmp_path):
    """--json naming a directory failed after every run, and the report (printed after it) was lost."""
    r = bench(DEMO, "--ours-only", "--json", tmp_path)
    assert r.returncode == 1 and r.stderr.strip() == f"error: cannot write the JSON report {tmp_path}: a directory " \
                                                      "is there"
    r = bench(DEMO, "--ours-only", "--json", DEMO)
    assert r.returncode == 1 and "is one of the command's inputs" in r.stderr and DEMO.stat().st_size > 0


def test_a_missing_model_is_named_so_whatever_the_cap():
    r = bench("/nonexistent.gguf", "--mem-cap", "50%")  # was "a percentage needs a reference size"
    assert r.returncode == 1 and "model file not found" in r.stderr


def test_a_workers_peak_rss_is_its_own_not_the_runners():
    """ru_maxrss keeps the peak of the process a worker was forked from: every row said 82 MiB, the
    runner's, also a tiny model's under a cap of 60 MiB."""
    child = ("import subprocess, sys; ballast = bytearray(300 << 20); ballast[::4096] = b'x' * len(ballast[::4096]); "
             "print(subprocess.run([sys.executable, '-c', 'from pyedgemoe.bench.worker import peak_rss_bytes; "
             "print(peak_rss_bytes())'], capture_output=True, text=True).stdout)")
    peak = int(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60).stdout)
    assert 0 < peak < 100 << 20


def test_settings_ours_refuses_end_the_benchmark_at_its_first_run():
    """Ours failed at every repeat, while stock ran all of its, and the exit said so only at the end."""
    r = bench(DEMO, "--ours-only", "-r", "3", "--expert-cache", "1")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("run of pyedgemoe") + r.stderr.count("pyedgemoe: ") <= 1, r.stderr  # the warm-up alone
    assert r.stderr.strip().splitlines()[-1].startswith("error: pyedgemoe refused the settings: ")


@pytest.mark.slow
def test_sigterm_ends_the_benchmark_with_its_worker_and_cgroup(tmp_path):
    """The worker went on measuring, reparented to init, and its memory cgroup was left behind."""
    import os
    import signal
    import time

    from pyedgemoe.bench.runner import BenchmarkError, check_cgroup_v1
    from pyedgemoe.sysmem import CGROUP_V1_MEMORY
    try:
        check_cgroup_v1()
    except BenchmarkError as e:
        pytest.skip(str(e))
    log = tmp_path / "stderr"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "pyedgemoe", "bench", str(DEMO), "--ours-only", "-r", "50",
                                 "-n", "64", "--mem-cap", "200MiB"], stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 60
    while "rep 1]" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    groups = list(CGROUP_V1_MEMORY.rglob(f"pyedgemoe-bench-{proc.pid}"))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert not any(g.exists() for g in groups) and not list(CGROUP_V1_MEMORY.rglob(f"pyedgemoe-bench-{proc.pid}"))
    workers = subprocess.run(["pgrep", "-f", f"bench/worker.py --engine pyedgemoe --model {DEMO}"],
                             capture_output=True, text=True).stdout.split()
    assert not [w for w in workers if int(w) != os.getpid()]


def test_a_grid_value_given_twice_is_one_cell():
    """-p 8,8 ran the cell twice and merged its rows into one, its repeats numbered 0, 0, 1, 1."""
    from pyedgemoe.cli import _int_list
    assert _int_list(["8,8", "16", "8"], "--prompt-tokens") == [8, 16]
