"""Cache-aware routing by calibrated stand-ins (`calibrate --stand-ins`, `--stand-in q`;
native/src/cache-standin.h): the rule on hand-computed examples, what calibration measures, q = 0
is the lossless run, q > 0 reads fewer expert bytes on the trained demo model and stays close to
its text, and what cannot run it is refused."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyedgemoe import Engine, _native
from pyedgemoe.calibration.run import calibrate
from pyedgemoe.calibration.stand_ins import taus
from pyedgemoe.errors import InvalidOptionError
from test_cache_routing import the_one_error_line
import tiny_moe

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "demo.gguf"
SETTINGS = dict(n_ctx=512, n_threads=2, flash_attn=False, kv_type="f32")
PROMPT = "import os\nimport sys\n\n\ndef main(argv=None):\n"

# 4 experts: cost[e][c], what c standing in for e costs (per unit of e's weight)
COST = np.array([[0.0, 1.0, 0.5, 0.2],
                 [1.0, 0.0, 0.1, 0.9],
                 [0.5, 0.1, 0.0, 1.0],
                 [0.2, 0.9, 1.0, 0.0]], dtype=np.float32)
DROP = [0.3, 0.2, 0.5, 0.4]  # what leaving e out costs (per unit of its weight)
TOP2 = np.array([[0, 1]], dtype=np.int32)
WEIGHTS = np.array([[0.6, 0.4]], dtype=np.float32)


def stand_in(cached, tau, ids=TOP2, weights=WEIGHTS, drop=()):
    """(ids after, changes) without drop costs; with them (ids after, dropped, changes)."""
    out, dropped, changed = _native.stand_in(ids, weights, COST, tau, cached, list(drop))
    return (out.tolist(), changed) if not drop else (out.tolist(), dropped.tolist(), changed)


def test_the_nearest_cached_expert_within_tau_takes_the_row():
    # expert 1 (weight 0.4) is missing: 2 costs 0.4 * 0.1 = 0.04, 3 costs 0.4 * 0.9 = 0.36
    assert stand_in([0, 2, 3], 0.05) == ([[0, 2]], 1)
    assert stand_in([0, 2, 3], 0.039) == ([[0, 1]], 0)  # above tau: the router's choice stays


def test_a_cached_selection_stays_and_the_weight_scales_the_cost():
    # 0 is cached: it keeps its row; 1 (weight 0.4) has only 3 at 0.36
    assert stand_in([0, 3], 0.3) == ([[0, 1]], 0)
    assert stand_in([0, 3], 0.36) == ([[0, 3]], 1)
    # the same costs at weight 0.1: 3 stands in at tau 0.09
    assert stand_in([0, 3], 0.09, weights=np.array([[0.9, 0.1]], dtype=np.float32)) == ([[0, 3]], 1)


def test_dropping_a_selection_is_taken_where_it_costs_less_than_any_stand_in_and_within_tau():
    # 1 (weight 0.4) is missing; dropping it costs 0.4 * 0.2 = 0.08
    assert stand_in([0, 2, 3], 1.0, drop=DROP) == ([[0, 2]], [[0, 0]], 1)  # 2 at 0.04 is cheaper
    assert stand_in([0, 3], 1.0, drop=DROP) == ([[0, 1]], [[0, 1]], 1)  # 3 at 0.36 is not: dropped
    assert stand_in([0, 3], 0.079, drop=DROP) == ([[0, 1]], [[0, 0]], 0)  # neither within tau
    # neither cached: 0 (0.6 * 0.3 = 0.18 to drop) takes 3 at 0.12; 1 then drops
    assert stand_in([3], 1.0, drop=DROP) == ([[3, 1]], [[0, 1]], 2)


def test_a_stand_in_is_never_an_expert_the_token_has():
    # neither 0 nor 1 cached; 1's nearest (2) is taken by 0 first (0.6 * 0.5 = 0.3), so 1 looks further
    ids = np.array([[0, 1]], dtype=np.int32)
    assert stand_in([2, 3], 1.0, ids=ids) == ([[3, 2]], 2)  # 0: 3 at 0.12 beats 2 at 0.3; 1: then 2
    ids = np.array([[0, 2]], dtype=np.int32)  # 2 is chosen and cached: 0 cannot take it
    assert stand_in([2, 1], 1.0, ids=ids) == ([[1, 2]], 1)


@pytest.fixture(scope="module")
def calibrated_demo(tmp_path_factory):
    """The demo model, calibrated with its stand-ins on a few hundred tokens of the repository's docs."""
    model = tmp_path_factory.mktemp("stand-ins") / "demo.gguf"
    shutil.copyfile(DEMO, model)
    text = "\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    result = calibrate(model, text, budget="25%", max_tokens=1024, n_ctx=256, n_threads=2, stand_ins=True)
    return model, result.data["stand_ins"]


def test_calibration_measures_every_pair_and_the_quantiles_of_its_swaps(calibrated_demo):
    _, stand_ins = calibrated_demo
    assert sorted(map(int, stand_ins["layers"])) == list(range(6)) and stand_ins["records"] > 5000
    for layer in stand_ins["layers"].values():
        cost = np.array(layer["cost"])
        assert cost.shape == (16, 16)
        np.testing.assert_allclose(np.diag(cost), 0, atol=1e-6)  # an expert stands in for itself at no cost
        assert (cost + np.eye(16) > 0).all()  # two experts of a trained model never compute the same
        drop = np.array(layer["drop_cost"])
        assert drop.shape == (16,) and (drop > 0).all()
        q = np.array(layer["swap_cost_quantiles"])
        assert len(q) == 101 and (np.diff(q) >= 0).all() and q[0] > 0
        # each selection's cheapest way out, the best stand-in or none: never above dropping the
        # heaviest possible selection (weight 1) of the expert that costs the most to drop
        assert q[-1] <= drop.max() + 1e-6
    # --stand-in q takes each layer's q-quantile
    layer = stand_ins["layers"]["2"]
    assert taus(stand_ins, 0.3)[2][2] == pytest.approx(layer["swap_cost_quantiles"][30])
    assert taus(stand_ins, 0.305)[2][2] == pytest.approx(np.mean(layer["swap_cost_quantiles"][30:32]))


def test_the_costs_are_the_experts_own_ffns_in_any_chunking(monkeypatch):
    # StandInCosts reads and dequantizes one expert at a time with ggml, a part of the trace and a
    # chunk of records at a time; here against gguf-py's dequantizer on whole tensors, the trace in
    # one part and one chunk, and in two parts of one record a chunk
    import gguf
    from gguf.quants import dequantize

    from pyedgemoe.calibration import stand_ins
    from pyedgemoe.calibration.trace import record_trace

    parts = []
    with Engine(DEMO, n_ctx=64, n_batch=1, n_logits=64, expert_cache="25%", trace_routing=True, n_threads=2) as eng:
        trace = record_trace(eng, eng.tokenize(PROMPT * 3)[:40], 64, on_inputs=parts.append)
    assert "inputs" not in trace and len(parts) == 1
    whole = stand_ins.StandInCosts(DEMO, "qwen3moe")
    whole.add(parts[0])
    costs = whole.result(trace)
    monkeypatch.setattr(stand_ins, "CHUNK_FLOATS", 1)
    halves = stand_ins.StandInCosts(DEMO, "qwen3moe")
    half = len(trace["layer"]) // 2
    for rows in (slice(0, half), slice(half, None)):
        halves.add({key: value[rows] for key, value in parts[0].items()})
    one_by_one = halves.result(trace)
    assert one_by_one["records"] == costs["records"]
    trace = parts[0]
    for il, layer in costs["layers"].items():  # BLAS rounds products of other shapes otherwise
        np.testing.assert_allclose(one_by_one["layers"][il]["cost"], layer["cost"], atol=2e-6)
        np.testing.assert_allclose(one_by_one["layers"][il]["swap_cost_quantiles"], layer["swap_cost_quantiles"], atol=2e-6)
    tensors = {t.name: t for t in gguf.GGUFReader(DEMO).tensors}
    gate, up, down = (dequantize(tensors[f"blk.3.{n}.weight"].data, tensors[f"blk.3.{n}.weight"].tensor_type)
                      for n in stand_ins.EXPERT_TENSORS)
    rows = np.flatnonzero(trace["layer"] == 3)
    h, ids = trace["inputs"][rows].astype(np.float64), trace["ids"][rows]

    def ffn(e, x):
        g = x @ gate[e].T
        return (g / (1 + np.exp(-g)) * (x @ up[e].T)) @ down[e].T

    e = int(np.bincount(ids.ravel()).argmax())  # the layer's most chosen expert, and a stand-in for it
    chose = (ids == e).any(axis=1)
    for c in (e, (e + 1) % 16):
        expected = np.mean(np.linalg.norm(ffn(c, h[chose]) - ffn(e, h[chose]), axis=1) / np.linalg.norm(h[chose], axis=1))
        assert costs["layers"]["3"]["cost"][e][c] == pytest.approx(expected, abs=2e-6)


def run(model, n_tokens, reference=None, **options):
    """Greedy tokens, or with a reference the teacher-forced top-1 agreement with it; and the expert
    cache's total counters."""
    with Engine(model, **SETTINGS, expert_cache="25%", system="lossless", cache_policy="decay", **options) as eng:
        prompt = eng.tokenize(PROMPT)
        if reference is None:
            out = eng.time_generation(prompt, n_tokens)["tokens"]
        else:
            picks = eng.logits(prompt + reference[:-1], one_token_per_step=True)[len(prompt) - 1:].argmax(axis=1)
            out = float((picks == np.array(reference)).mean())
        return out, eng.stats()["experts"]["total"]


def test_q_zero_is_the_lossless_run_and_q_above_reads_fewer_bytes_close_to_the_text(calibrated_demo):
    model, _ = calibrated_demo
    reference, lossless = run(model, 128)
    tokens, off = run(model, 128, stand_in=0.0)
    assert tokens == reference and off["stand_in_swaps"] == off["stand_in_drops"] == 0
    with Engine(model, **SETTINGS) as eng:  # everything resident
        assert eng.time_generation(eng.tokenize(PROMPT), 128)["tokens"] == reference
    agreement, on = run(model, 128, reference=reference, stand_in=0.2)
    # measured here: 37 % fewer bytes than the same cache without stand-ins, 96.9 % agreement (124
    # of 128); calibrated on the training split and over 2048 held-out tokens, docs/systems.md
    assert on["bytes_read"] < 0.75 * lossless["bytes_read"]
    assert agreement >= 0.95
    # on this model leaving a missed selection out is nearly always cheaper than a cached stand-in
    assert on["stand_in_drops"] > 10 * on["stand_in_swaps"]


def test_what_cannot_run_it_is_refused(calibrated_demo, tmp_path):
    model, _ = calibrated_demo
    uncalibrated = tmp_path / "demo.gguf"
    shutil.copyfile(DEMO, uncalibrated)
    with pytest.raises(InvalidOptionError, match=r"stand_in needs the stand-ins of `pyedgemoe calibrate --stand-ins`"):
        Engine(uncalibrated, n_ctx=64, expert_cache="25%", stand_in=0.3)
    with pytest.raises(InvalidOptionError, match="cache_routing and stand_in are two rules for the same choice"):
        Engine(model, n_ctx=64, expert_cache="25%", stand_in=0.3, cache_routing=0.1)
    with pytest.raises(InvalidOptionError, match="stand_in .*act on the expert cache"):
        Engine(model, n_ctx=64, stand_in=0.3)


@pytest.mark.parametrize("value", ["-0.1", "nan", "1.5"])
def test_a_quantile_out_of_range_is_one_error_line(value):
    assert the_one_error_line("--stand-in", value).startswith("error: stand_in must be a quantile between 0")


def test_calibrate_and_run_from_the_command_line(tmp_path):
    model, text = tmp_path / "demo.gguf", tmp_path / "text.txt"
    shutil.copyfile(DEMO, model)
    text.write_text((REPO / "docs" / "systems.md").read_text())
    cli = [sys.executable, "-m", "pyedgemoe"]
    r = subprocess.run([*cli, "calibrate", str(model), "-f", str(text), "--max-tokens", "256", "--stand-ins", "-t", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "stand-ins: each expert's output against every other's on 1530 layer inputs" in r.stdout
    r = subprocess.run([*cli, "run", str(model), "-p", PROMPT, "-n", "8", "--expert-cache", "25%", "--stand-in", "0.2",
                        "-t", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_experts_that_are_not_gated_silu_ffns_are_refused():
    from pyedgemoe.calibration.stand_ins import StandInCosts
    with pytest.raises(InvalidOptionError, match="gated SiLU FFNs, of the architectures checked to have "
                                                 "them .*: not gpt-oss"):
        StandInCosts(DEMO, "gpt-oss")


def test_a_calibration_replacing_the_sidecar_keeps_its_stand_ins(calibrated_demo):
    # as EdgeMoE's map and MoBiLE's gamma: another --force calibration does not drop them silently
    model, stand_ins = calibrated_demo
    text = (REPO / "docs" / "systems.md").read_text()
    result = calibrate(model, text, budget="25%", max_tokens=256, n_ctx=128, n_threads=2, force=True)
    assert result.data["stand_ins"] == stand_ins
    assert "kept the stand-ins of the sidecar replaced (--stand-ins computes them again)" in result.notes


def test_the_lossless_overrides_turn_every_lossy_option_off():
    # bench --against-min measures a lossless run against MIN whatever options it was given
    from pyedgemoe.systems import LOSSLESS_OVERRIDES
    lossy = dict(low_precision=True, skip=True, cache_routing=0.1, stand_in=0.3)
    for name, value in lossy.items():
        o = _native.ExpertOptions()
        setattr(o, name, value)
        assert o.lossy, name
        for key, off in LOSSLESS_OVERRIDES.items():
            setattr(o, key, off)
        assert not o.lossy, name


def test_the_presets_take_the_stand_ins_alone_and_with_hobbit(calibrated_demo, tmp_path):
    from pyedgemoe.systems import HOBBIT_STAND_IN, STAND_IN, SYSTEMS
    assert SYSTEMS["stand-ins"] == {**SYSTEMS["lossless"], "cache_policy": "decay", "stand_in": STAND_IN}
    assert SYSTEMS["hobbit-stand-ins"] == {**SYSTEMS["hobbit"], "stand_in": HOBBIT_STAND_IN}
    model, _ = calibrated_demo
    with Engine(model, n_ctx=64, expert_cache="25%", system="hobbit-stand-ins") as eng:
        experts = eng.stats()["experts"]
    assert experts["stand_in"] == pytest.approx(HOBBIT_STAND_IN) and experts["low_precision"]
    uncalibrated = tmp_path / "demo.gguf"
    shutil.copyfile(DEMO, uncalibrated)
    with pytest.raises(InvalidOptionError, match="stand_in needs the stand-ins of `pyedgemoe calibrate --stand-ins`"):
        Engine(uncalibrated, n_ctx=64, expert_cache="25%", system="stand-ins")


@pytest.mark.parametrize("damage, message", [
    (dict(cost="junk"), "has an invalid stand_ins"),
    (dict(cost=[[1.0, 2.0]]), "has an invalid stand_ins"),  # not square
    (dict(drop_cost=[0.5] * 15), "has an invalid stand_ins"),  # one drop cost short
    (dict(drop_cost=[-0.5] * 16), "has an invalid stand_ins"),
    (dict(cost=[[0.0, 1.0], [1.0, 0.0]], drop_cost=[1.0, 1.0]), "stand-ins: layer 0 has 4 costs, not 16 x 16"),  # another model's
])
def test_damaged_stand_ins_in_the_sidecar_are_one_clear_error(calibrated_demo, tmp_path, damage, message):
    import json
    model, _ = calibrated_demo
    copy = tmp_path / "demo.gguf"
    shutil.copyfile(model, copy)
    data = json.loads(Path(f"{model}.calibration.json").read_text())
    data["stand_ins"]["layers"]["0"].update(damage)
    Path(f"{copy}.calibration.json").write_text(json.dumps(data))
    with pytest.raises(InvalidOptionError, match=message):
        Engine(copy, n_ctx=64, expert_cache="25%", stand_in=0.2)


def test_stand_ins_from_before_the_drop_costs_still_run_and_drop_nothing(calibrated_demo, tmp_path):
    import json
    model, stand_ins = calibrated_demo
    copy = tmp_path / "demo.gguf"
    shutil.copyfile(model, copy)
    data = json.loads(Path(f"{model}.calibration.json").read_text())
    for layer in data["stand_ins"]["layers"].values():
        del layer["drop_cost"]
    Path(f"{copy}.calibration.json").write_text(json.dumps(data))
    assert all(drop == [] for _, drop, _ in taus(data["stand_ins"], 0.2).values())
    assert all(len(drop) == 16 for _, drop, _ in taus(stand_ins, 0.2).values())
    reference = run(copy, 32)[0]
    _, total = run(copy, 32, reference=reference, stand_in=0.2)
    assert total["stand_in_drops"] == 0 and total["stand_in_swaps"] > 0


@pytest.mark.parametrize("arch", tiny_moe.MOE_ARCHITECTURES)
def test_every_architecture_with_gated_silu_experts_calibrates_and_runs_them(tiny_model, tmp_path, arch):
    # shared experts (qwen2_moe), a dense first layer (deepseek_v2), the weights' own scale: the
    # routed experts' stand-ins all the same
    model = tmp_path / "model.gguf"
    shutil.copyfile(tiny_model(arch)[0], model)
    text = (REPO / "docs" / "systems.md").read_text()
    stand_ins = calibrate(model, text, budget="25%", max_tokens=128, n_ctx=64, n_threads=2, stand_ins=True).data["stand_ins"]
    for layer in stand_ins["layers"].values():
        np.testing.assert_allclose(np.diag(layer["cost"]), 0, atol=1e-6)
    misses = {}
    for q in (0.0, 1.0):
        with Engine(model, n_ctx=128, n_threads=2, expert_cache="25%", system="lossless", stand_in=q) as eng:
            tokens = eng.time_generation(eng.tokenize(PROMPT), 16)["tokens"]
            misses[q] = eng.stats()["experts"]["total"]["misses"]
        if q == 0.0:
            with Engine(model, n_ctx=128, n_threads=2) as eng:
                assert eng.time_generation(eng.tokenize(PROMPT), 16)["tokens"] == tokens
    assert misses[1.0] < misses[0.0]
