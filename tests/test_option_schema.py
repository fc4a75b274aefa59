"""The option recipe (docs/architecture.md, "How to add ... an option"): one line in the native
schema (EDGEMOE_EXPERT_OPTIONS) makes the binding's field, the CLI flag with its help and
default, the Engine keyword and the entry in stats()["experts"]. Checked for every option the
schema has, so an option added by that one line is checked too."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from pyedgemoe import Engine
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.expert_options import NATIVE_NAMES, default, help_text


@pytest.fixture(scope="module")
def run_help() -> str:
    out = subprocess.run([sys.executable, "-m", "pyedgemoe", "run", "--help"], capture_output=True, text=True,
                         env={"COLUMNS": "400", "PATH": ""}, timeout=60)
    assert out.returncode == 0, out.stderr
    return re.sub(r"\s+", " ", out.stdout)


@pytest.mark.parametrize("name", NATIVE_NAMES)
def test_every_native_option_is_a_cli_flag_with_the_schemas_help(name, run_help):
    flag = "--" + name.replace("_", "-")
    assert flag in run_help
    # the help's first words, as the schema's line says them (typer may wrap or append the default)
    assert " ".join(help_text(name).split()[:4]) in run_help


def test_every_native_option_is_an_engine_keyword_and_a_stat(mixtral_gguf):
    with Engine(mixtral_gguf, n_ctx=64, expert_cache="50%", fill_cache=False, io_threads=3) as eng:
        experts = eng.stats()["experts"]
    assert set(NATIVE_NAMES) <= set(experts)
    assert experts["io_threads"] == 3 and experts["fill_cache"] is False
    assert experts["prefetch_depth"] == default("prefetch_depth")


def test_an_option_the_schema_lacks_is_refused_by_name(mixtral_gguf):
    with pytest.raises(InvalidOptionError, match="prefetch_budget"):
        Engine(mixtral_gguf, n_ctx=64, expert_cache="50%", prefetch_budget=8)
