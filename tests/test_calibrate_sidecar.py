"""The calibration sidecar as a user finds it: `pyedgemoe calibrate` does not silently replace one
(--force does, keeping EdgeMoE's precision map it does not compute again), records where the LOW
copies came from as the model's directory sees it, and names no file it does not ship; the demo's
sidecar is one such file."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from pyedgemoe.calibration.sidecar import read_sidecar, sidecar_path, write_sidecar
from pyedgemoe.convert.export import export
from test_calibrate import CALIBRATE_ARGS, models  # noqa: F401 - the fixture
from test_cli import assert_one_line_error, cli
from test_io_faults import DEMO


@pytest.fixture
def model(models, tmp_path):  # noqa: F811
    path = tmp_path / "model.gguf"
    shutil.copyfile(models["q4"], path)
    return path


def calibrate(model, text, *args):
    return cli("calibrate", model, "-f", text, *CALIBRATE_ARGS, *args)


def test_calibrate_does_not_replace_a_sidecar_without_force(models, model):  # noqa: F811
    assert calibrate(model, models["text"]).returncode == 0
    before = open(sidecar_path(model)).read()
    r = calibrate(model, models["text"], "--budget", "75%")
    assert_one_line_error(r, f"{sidecar_path(model)} exists", "--force")
    assert open(sidecar_path(model)).read() == before
    r = calibrate(model, models["text"], "--budget", "75%", "--force")
    assert r.returncode == 0, r.stderr
    assert read_sidecar(sidecar_path(model))["budget"] == "75%"


def test_force_keeps_edgemoes_precision_map_that_it_does_not_compute(models, model):  # noqa: F811
    assert calibrate(model, models["text"]).returncode == 0
    data = read_sidecar(sidecar_path(model))
    layers = sorted(data["expert_usage"])
    precision_map = {"low": {layers[0]: [0, 1]}, "n_low": 2, "n_experts": 8 * len(layers)}
    write_sidecar({**data, "precision_map": precision_map}, sidecar_path(model))
    r = calibrate(model, models["text"], "--force")
    assert r.returncode == 0, r.stderr
    assert "note: kept EdgeMoE's precision map of the sidecar replaced (2 experts LOW" in r.stderr
    assert read_sidecar(sidecar_path(model))["precision_map"] == precision_map
    run = cli("run", model, "-p", "hello", "-n", "2", "--expert-cache", "50%", "--system", "edgemoe")
    assert run.returncode == 0, run.stderr


def test_the_sidecar_records_the_low_source_relative_to_the_model_and_names_no_trace(models, model, tmp_path):  # noqa: F811
    assert calibrate(model, models["text"], "--trace", tmp_path / "elsewhere.npz").returncode == 0
    data = read_sidecar(sidecar_path(model))
    assert data["low_source"] == "model.gguf" and "trace" not in data
    # a standard GGUF with --low-from in another directory: the path from the model's directory
    (tmp_path / "high").mkdir()
    (tmp_path / "low").mkdir()
    high = export(model, tmp_path / "high" / "m.gguf", precision="high", progress=False)
    low = export(model, tmp_path / "low" / "m-low.gguf", precision="low", progress=False)
    r = cli("calibrate", high, "-f", models["text"], *CALIBRATE_ARGS, "--low-from", low)
    assert r.returncode == 0, r.stderr
    assert read_sidecar(sidecar_path(high))["low_source"] == os.path.join("..", "low", "m-low.gguf")


def test_the_demo_sidecar_has_no_absolute_path_and_names_only_files_shipped():
    data = json.loads(open(sidecar_path(DEMO)).read())

    def strings(value):
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for k, v in value.items():
                yield k
                yield from strings(v)
        elif isinstance(value, list):
            for v in value:
                yield from strings(v)

    assert not [s for s in strings(data) if os.path.isabs(s) or "/build/" in s]
    assert (DEMO.parent / data["low_source"]).resolve() == DEMO.resolve()
    assert "trace" not in data
    # EdgeMoE's precision map and path statistics: --system edgemoe runs from it
    r = cli("run", DEMO, "-p", "def f(x):", "-n", "2", "--expert-cache", "25%", "--system", "edgemoe")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("old", ['{"version": 2, "t1": 0.5, "t2": 0.9}', '{"version": 1, "t1": 0.5,',
                                 '{"version": 1, "t1": 0.5, "t2": 0.9, "n_experts_used": 7}'])
def test_force_replaces_a_sidecar_that_cannot_be_used(models, model, old):  # noqa: F811
    # damaged, or another model's: every run refused the model, and calibrate --force, which the
    # refusal asks for, refused it too
    with open(sidecar_path(model), "w") as f:
        f.write(old)
    r = calibrate(model, models["text"], "--force")
    assert r.returncode == 0, r.stderr
    assert "note: removed the sidecar replaced, which could not be used: " in r.stderr
    assert read_sidecar(sidecar_path(model))["version"] == 1
    assert cli("run", model, "-p", "hello", "-n", "2", "--expert-cache", "50%").returncode == 0


def test_the_outputs_are_checked_before_the_model_runs(models, model, tmp_path):  # noqa: F811
    # --trace naming the model overwrote it with the trace (and exited 0)
    before = open(model, "rb").read()
    assert_one_line_error(calibrate(model, models["text"], "--trace", model),
                          "the trace (", "must be two files other than the model")
    assert open(model, "rb").read() == before
    assert_one_line_error(calibrate(model, models["text"], "--trace", sidecar_path(model)), "must be two files")
    assert_one_line_error(calibrate(model, models["text"], "--trace", tmp_path), "a directory is there")
    assert_one_line_error(calibrate(model, models["text"], "--trace", tmp_path / "no" / "t.npz"),
                          "is not a directory")
    assert not os.path.exists(sidecar_path(model))
    assert os.listdir(tmp_path) == ["model.gguf"]  # no temporary file left either


@pytest.mark.parametrize("option", [["--cache-routing", "0.1"], ["--big-little", "0.5"], ["--stand-in", "0.5"]])
def test_calibrate_refuses_what_changes_the_routing_it_records(models, model, option):  # noqa: F811
    assert_one_line_error(calibrate(model, models["text"], *option),
                          f"calibrate records the model's own routing: {option[0][2:].replace('-', '_')} would change")
