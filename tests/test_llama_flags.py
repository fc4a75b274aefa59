"""llama.cpp's flags a command does not take (pyedgemoe.llama_flags): the table is the vendored
common/arg.cpp's (scripts/llama_cpp_flags.py), a NOTED one is taken with a note (its value too), any
other refused in one line naming it, another of llama.cpp's names of a flag the command has taken as
that flag, the command's own flags and their values untouched."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import typer

from conftest import REPO
from pyedgemoe import llama_flags
from pyedgemoe.cli import app

COMMAND = typer.main.get_command(app)
DEMO = REPO / "models" / "demo.gguf"


def test_the_table_is_llama_cpps():
    spec = importlib.util.spec_from_file_location("flags_script", REPO / "scripts" / "llama_cpp_flags.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    written = json.loads((REPO / "pyedgemoe" / "llama_cpp_flags.json").read_text())
    assert written == script.flags(script.ARG_CPP.read_text()), "run scripts/llama_cpp_flags.py"
    assert len(written) > 300
    flags = llama_flags.FLAGS
    assert flags["-sm"]["value"] and flags["-p"]["value"] and not flags["-nkvo"]["value"] and not flags["--jinja"]["value"]
    assert set(llama_flags.NOTED) <= set(flags)


def test_noted_flags_go_with_their_values_and_ours_stay(capsys):
    args = ["run", "m.gguf", "-nkvo", "--numa", "distribute", "-p", "-sm", "-C=0x3", "-fit", "off", "-n", "2"]
    assert llama_flags.screened(COMMAND, args) == ["run", "m.gguf", "-p", "-sm", "-n", "2"]
    notes = capsys.readouterr().err.splitlines()
    assert notes == ["note: -nkvo: llama.cpp's; the KV cache is where the load plan puts it (--mode): not used",
                     f"note: --numa distribute: llama.cpp's; {llama_flags._THREADS}: not used",
                     f"note: -C=0x3: llama.cpp's; {llama_flags._THREADS}: not used",
                     f"note: -fit off: llama.cpp's; {llama_flags._FIT}: not used"]
    assert llama_flags.screened(COMMAND, ["run", "m.gguf", "--", "-sm"]) == ["run", "m.gguf", "--", "-sm"]
    assert llama_flags.screened(COMMAND, ["run", "model", "-p", "x"]) == ["run", "model", "-p", "x"]  # a file "model"
    for help_flag in ("-h", "--help"):  # the command's help, which llama.cpp's tools have too
        assert llama_flags.screened(COMMAND, ["run", help_flag]) == ["run", help_flag]
    assert llama_flags.screened(COMMAND, ["serve", "m.gguf", "-np", "2"]) == ["serve", "m.gguf", "-np", "2"]
    # another of llama.cpp's names of a flag the command has
    assert llama_flags.screened(COMMAND, ["run", "m.gguf", "--temperature", "0.5", "--frequency-penalty=1"]) == \
        ["run", "m.gguf", "--temp", "0.5", "--frequency-penalty=1"]


@pytest.mark.parametrize("args, message", [
    (["-sm", "none"], "-sm is llama.cpp's --split-mode, which `pyedgemoe run` does not take"),
    (["-md", "draft.gguf"], "-md is llama.cpp's --spec-draft-model, which `pyedgemoe run` does not take"),
    (["-np", "2"], "-np is llama.cpp's --parallel, which `pyedgemoe run` does not take"),
    (["--no-jinja"], "--no-jinja is llama.cpp's, which `pyedgemoe run` does not take"),  # not --jinja's other name
])
def test_other_flags_are_one_error_line(args, message):
    r = subprocess.run([sys.executable, "-m", "pyedgemoe", "run", str(DEMO), "-p", "x", *args], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == f"error: {message} (`pyedgemoe run --help` lists its flags)\n", r.stderr


def test_a_guides_command_line_runs_with_notes():
    r = subprocess.run([sys.executable, "-m", "pyedgemoe", "run", str(DEMO), "-p", "def", "-n", "4", "--temp", "0",
                        "-t", "1", "--no-display-prompt", "-nkvo", "--numa", "distribute", "-fit", "off"],
                       capture_output=True, text=True, timeout=120)
    plain = subprocess.run([sys.executable, "-m", "pyedgemoe", "run", str(DEMO), "-p", "def", "-n", "4", "--temp", "0",
                            "-t", "1", "--no-display-prompt"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == plain.stdout and r.stderr.count("llama.cpp's;") == 3


def test_the_bench_table_is_llama_benchs():
    source = (REPO / "native" / "vendor" / "llama.cpp" / "tools" / "llama-bench" / "llama-bench.cpp").read_text()
    parsed = [tuple(re.findall(r'arg == "([^"]+)"', line)) for line in source.splitlines()
              if re.search(r'if \((llama_supports_rpc\(\) && \()?arg == "', line)]
    assert tuple(parsed) == llama_flags.BENCH_FLAGS


def test_bench_takes_llama_benchs_flags_with_their_values(capsys):
    args = ["bench", "m.gguf", "-fa", "1", "--repack", "0", "-nkvo", "1", "-p", "8", "-r", "1", "--no-warmup"]
    assert llama_flags.screened(COMMAND, args) == ["bench", "m.gguf", "--flash-attn", "--no-repack", "-p", "8", "-r",
                                                   "1", "--no-warmup"]
    assert capsys.readouterr().err == "note: -nkvo 1: llama-bench's; the KV cache is where the load plan puts it " \
                                      "(--mode): not used\n"
    assert llama_flags.screened(COMMAND, ["bench", "m.gguf", "-fa", "auto", "--flash-attn=off"]) == ["bench", "m.gguf"]
    for args, message in ((["-o", "json"], "-o is llama-bench's --output, which `pyedgemoe bench` does not take"),
                          (["-pg", "8,4"], "-pg is llama-bench's, which `pyedgemoe bench` does not take"),
                          (["-fa", "0,1"], "-fa takes one of on, off, auto (1, 0): `pyedgemoe bench` measures one")):
        with pytest.raises(typer._click.exceptions.UsageError, match=re.escape(message)):
            llama_flags.screened(COMMAND, ["bench", "m.gguf", *args])
