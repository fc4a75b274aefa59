"""The model's name (general.name, what `pyedgemoe inspect` shows) after `pyedgemoe convert`: the
checkpoint's model card or config.json names it as llama.cpp's converter reads them, else the
output file does; never the checkpoint's folder ("hf" became "Hf"); --name says it outright."""
from __future__ import annotations

import json
import shutil

import pytest

from pyedgemoe.model_info import read_model_info
from test_cli import cli


@pytest.fixture
def checkpoint(tiny_model, tmp_path):
    """The tiny Qwen3-MoE checkpoint in a folder named as a checkpoint's often is: "hf"."""
    hf = tmp_path / "hf"
    shutil.copytree(tiny_model("qwen3_moe")[1], hf)
    return hf


def convert(src, out, *args):
    r = cli("convert", src, "-o", out, "--high", "q8_0", "--low", "q4_0", *args)
    assert r.returncode == 0, r.stderr
    return read_model_info(out).name


def test_the_name_is_the_output_files_not_the_folders(checkpoint, tmp_path):
    assert convert(checkpoint, tmp_path / "tiny-moe.mp.gguf") == "tiny-moe"
    shown = cli("inspect", tmp_path / "tiny-moe.mp.gguf").stdout
    assert "qwen3moe (tiny-moe)" in shown and "Hf" not in shown


def test_the_name_comes_from_the_config_as_llama_cpp_reads_it(checkpoint, tmp_path):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "_name_or_path": "acme/Tiny-MoE-0.1B"}))
    assert convert(checkpoint, tmp_path / "out.gguf") == "Tiny MoE 0.1B"


def test_name_says_it_outright(checkpoint, tiny_model, tmp_path):
    assert convert(checkpoint, tmp_path / "a.gguf", "--name", "My Tiny MoE") == "My Tiny MoE"
    # a standard GGUF keeps its own name unless --name is given
    standard = tiny_model("qwen3_moe")[0]
    assert convert(standard, tmp_path / "b.gguf") == read_model_info(standard).name
    assert convert(standard, tmp_path / "c.gguf", "--name", "Renamed") == "Renamed"


def test_a_model_cards_values_of_other_types_are_taken_as_text_or_left_out(checkpoint, tmp_path):
    # YAML gives what it holds: gguf-py's writer raised on a license of 5 ("object of type 'int' has
    # no len()") and on a list of a name
    (checkpoint / "README.md").write_text("---\nlicense: 5\nmodel_name: [1, 2]\ntags: [moe, 3, [x]]\n---\n# Tiny\n")
    assert convert(checkpoint, tmp_path / "card.gguf") == "card"
    metadata = read_model_info(tmp_path / "card.gguf").metadata
    assert metadata["general.license"] == "5" and metadata["general.tags"] == {"array_length": 2}  # moe, 3
