"""llama.cpp's environment variables (LLAMA_ARG_*, LLAMA_API_KEY, HF_TOKEN) on the commands that
are llama.cpp's tools (pyedgemoe/llama_env.py): their names as the vendored common/arg.cpp sets
them, none of a command's flags left out, the command line over the environment, and a variable a
command will not read said in a note."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from pyedgemoe import llama_env
from pyedgemoe.cli import app

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "demo.gguf"
ARG_CPP = REPO / "native" / "vendor" / "llama.cpp" / "common" / "arg.cpp"


def llama_cpp_variables() -> dict[str, str]:
    """Every flag of llama.cpp's common arguments -> the variable it reads (set_env), both senses of
    a boolean one (`{"--repack"}, {"-nr", "--no-repack"}`) the same variable."""
    variables = {}
    for option in ARG_CPP.read_text().split("add_opt(common_arg(")[1:]:
        lists = re.match(r'\s*\{([^}]*)\}(?:\s*,\s*\{([^}]*)\})?', option)
        found = re.findall(r'set_env\("([A-Z_]+)"\)', option.split("add_opt(")[0])
        if lists and found:
            for flag in re.findall(r'"(-[^"]+)"', (lists.group(1) or "") + (lists.group(2) or "")):
                variables[flag] = found[0]
    return variables


def test_the_variables_are_llama_cpp_s_and_every_flag_that_has_one_reads_it():
    theirs = llama_cpp_variables()
    assert theirs["-m"] == "LLAMA_ARG_MODEL" and theirs["--no-repack"] == "LLAMA_ARG_REPACK"  # the parse works
    for flag, variable in llama_env.VARIABLES.items():
        assert theirs.get(flag) == variable, flag
    command = typer.main.get_command(app)
    for name in llama_env.COMMANDS:
        for param in command.commands[name].params:
            flags = [*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ())]
            wanted = {theirs[f] for f in flags if f in theirs}
            mine = {llama_env.VARIABLES[f] for f in flags if f in llama_env.VARIABLES}
            assert wanted <= mine, f"{name} {flags}: {wanted - mine} left out"


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_") and k != "HF_TOKEN"}
    return subprocess.run([sys.executable, "-m", "pyedgemoe", *args], capture_output=True, text=True, timeout=300,
                          env={**clean, **env})


def test_run_takes_the_model_and_settings_from_llama_cpp_s_variables():
    r = cli("run", "-p", "def add(a, b):", "--temp", "0", "--json", LLAMA_ARG_MODEL=str(DEMO),
            LLAMA_ARG_N_PREDICT="5", LLAMA_ARG_CTX_SIZE="512", LLAMA_ARG_THREADS="1")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 5
    plan = cli("run", "-p", "x", "--dry-run", LLAMA_ARG_MODEL=str(DEMO), LLAMA_ARG_CTX_SIZE="512").stdout
    assert re.search(r"context\s+512 positions", plan)


def test_the_command_line_wins_over_the_environment(tmp_path):
    r = cli("run", str(DEMO), "-p", "def add(a, b):", "--temp", "0", "--json", "-n", "3",
            LLAMA_ARG_MODEL=str(tmp_path / "missing.gguf"), LLAMA_ARG_N_PREDICT="9", HF_TOKEN="hf_x",
            LLAMA_ARG_HF_FILE="other.gguf")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 3


def test_a_boolean_variable_takes_llama_cpp_s_positive_sense():
    def repack(value: str) -> str:
        plan = cli("run", str(DEMO), "-p", "x", "--dry-run", LLAMA_ARG_REPACK=value).stdout
        return re.search(r"repack\s+(\w+)", plan)[1]
    assert (repack("1"), repack("on"), repack("0"), repack("false")) == ("on", "on", "off", "off")
    # llama.cpp's LLAMA_ARG_NO_ variable of a flag with a negative: set (to anything) is off, over the other
    plan = cli("run", str(DEMO), "-p", "x", "--dry-run", LLAMA_ARG_NO_REPACK="", LLAMA_ARG_REPACK="1")
    assert re.search(r"repack\s+(\w+)", plan.stdout)[1] == "off" and "note:" not in plan.stderr, plan.stderr


def test_a_variable_the_command_does_not_read_is_noted():
    r = cli("run", str(DEMO), "-p", "x", "-n", "1", LLAMA_ARG_CONT_BATCHING="1", LLAMA_ARG_N_PARALLEL="2")
    assert r.returncode == 0
    assert "note: LLAMA_ARG_CONT_BATCHING, LLAMA_ARG_N_PARALLEL set, but `pyedgemoe run` has no such option" in r.stderr


def test_a_bad_value_in_a_variable_is_one_error_line():
    r = cli("run", str(DEMO), "-p", "x", LLAMA_ARG_N_PREDICT="many")
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "'LLAMA_ARG_N_PREDICT'" in errors[0]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("key_variable", ["LLAMA_API_KEY", "PYEDGEMOE_API_KEY"])
def test_serve_reads_llama_server_s_variables(tmp_path, key_variable):
    from test_server import request, stop_server
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}
    env = {**clean, "LLAMA_ARG_MODEL": str(DEMO), "LLAMA_ARG_HOST": "127.0.0.1", "LLAMA_ARG_PORT": str(port),
           key_variable: "sekrit", "LLAMA_ARG_ALIAS": "my-moe", "LLAMA_ARG_CTX_SIZE": "1024"}
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pyedgemoe", "serve"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        import time
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if request("GET", url + "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        assert request("GET", url + "/v1/models", key=None)[0] == 401
        status, models = request("GET", url + "/v1/models", key="sekrit")
        assert status == 200 and models["data"][0]["id"] == "my-moe"
    finally:
        stop_server(proc)
        log.close()
