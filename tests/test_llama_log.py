"""llama.cpp's logging flags (pyedgemoe.llama_log): its log silent by default, -v/--verbose every
message, -lv N / --log-file / --log-prefix / --log-timestamps / --log-colors through llama.cpp's own
common log (its loading messages are at verbosity 4, trace), --log-disable none; a bad value one
error line; their LLAMA_ARG_ variables."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

DEMO = REPO / "models" / "demo.gguf"
LOADER = "llama_model_loader: loaded meta data"


def run(*arguments: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", str(DEMO), "-p", "hi", "-n", "2", "-t", "1",
                           *arguments], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("flags, shown", [([], False), (["-v"], True), (["--log-verbose"], True), (["-lv", "3"], False),
                                          (["-lv", "4"], True), (["-v", "--log-disable"], False)])
def test_llama_cpps_log_is_shown_as_its_flags_say(flags, shown):
    r = run(*flags)
    assert r.returncode == 0 and (LOADER in r.stderr) == shown, r.stderr[-2000:]
    assert r.stdout.startswith("hi")  # the text alone on stdout


def test_the_log_holds_the_runs_own_context_only():
    # the load plan measures contexts of 2**17 and 2**18 cells (load_plan.MEASURED_CELLS) without
    # the run's log: their "possible training context overflow" warnings read as the run's
    r = run("-lv", "4")
    assert r.returncode == 0 and "n_ctx_seq (" not in r.stderr
    assert re.findall(r"llama_context: n_ctx += (\d+)", r.stderr) == ["256"]


def test_a_log_file_prefixes_and_timestamps(tmp_path):
    log = tmp_path / "llama.log"
    r = run("-lv", "4", "--log-file", str(log), "--log-prefix", "--log-timestamps")
    assert r.returncode == 0 and LOADER in log.read_text()
    line = next(line for line in r.stderr.splitlines() if LOADER in line)
    assert re.match(r"\d+\.\d\d\.\d{3}\.\d{3} I llama_model_loader", line), line
    quiet = tmp_path / "quiet.log"  # llama.cpp's default verbosity: its loading messages are not written
    r = run(env={"LLAMA_ARG_LOG_FILE": str(quiet)})
    assert r.returncode == 0 and quiet.exists() and LOADER not in quiet.read_text() + r.stderr


@pytest.mark.parametrize("flags, message", [
    (["--log-colors", "maybe"], "--log-colors takes on, off, auto"),
    (["--log-file", "/nonexistent/dir/x.log"], "--log-file: cannot write"),
    (["-lv", "-1"], "--log-verbosity must be >= 0"),
])
def test_a_bad_log_flag_is_one_error_line(flags, message):
    r = run(*flags)
    assert r.returncode != 0 and r.stderr.startswith("error: ") and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
