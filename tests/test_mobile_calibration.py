"""MoBiLE's gamma chosen for the model (pyedgemoe/calibration/mobile.py): the smallest threshold that
keeps the whole model's top-1 token on at least --min-agreement of the calibration tokens, written
to the sidecar by `pyedgemoe calibrate --system mobile` and run by the mobile preset."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

import tiny_moe
from pyedgemoe import Engine
from pyedgemoe.calibration.mobile import choose_gamma
from pyedgemoe.calibration.run import calibrate
from pyedgemoe.errors import InvalidOptionError
from test_cli import assert_one_line_error, cli

TEXT = " ".join(tiny_moe.training_text(seed=11, n_sentences=40))


def test_gamma_is_the_smallest_that_keeps_the_agreement():
    # ten tokens, most confident first; the little pass disagrees with the big one at 0.9 and 0.5
    confidence = np.array([0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1])
    agrees = np.array([True, False, True, True, True, False, True, True, True, True])
    # 90 %: one disagreement allowed -> every token down to 0.6 kept little (0.5 would be the second)
    assert choose_gamma(confidence, agrees, 0.9) == {"gamma": 0.6, "agreement": 0.9, "fallback_rate": 0.5}
    # 80 %: two allowed -> all kept little, gamma the least confidence
    assert choose_gamma(confidence, agrees, 0.8) == {"gamma": 0.1, "agreement": 0.8, "fallback_rate": 0.0}
    # 100 %: none allowed -> only the token above the first disagreement
    assert choose_gamma(confidence, agrees, 1.0) == {"gamma": 0.95, "agreement": 1.0, "fallback_rate": 0.9}
    # the most confident disagrees: every token redone big
    assert choose_gamma(np.array([0.9, 0.5]), np.array([False, True]), 1.0) == \
        {"gamma": 1.0, "agreement": 1.0, "fallback_rate": 1.0}
    with pytest.raises(InvalidOptionError, match="agreement bound"):
        choose_gamma(confidence, agrees, 1.2)


def test_gamma_also_keeps_the_perplexity_within_the_loss_budget():
    # four tokens that all agree, most confident first; the big pass scores each next token at nll
    # 1.0 (the last has none); kept little, the first two cost 1.0 and 1.05, the third 1.6: with
    # the first three kept the mean is (1.0 + 1.05 + 1.6) / 3 = 1.217 > 1 + log(1.1) = 1.095, with
    # two (1.0 + 1.05 + 1.0) / 3 = 1.017 <= 1.095: gamma 0.8, a budget of +10 %
    confidence = np.array([0.9, 0.8, 0.7, 0.6])
    agrees = np.ones(4, dtype=bool)
    little, big = np.array([1.0, 1.05, 1.6, np.nan]), np.array([1.0, 1.0, 1.0, np.nan])
    assert choose_gamma(confidence, agrees, 0.97, (little, big), loss_budget=0.1) == \
        {"gamma": 0.8, "agreement": 1.0, "fallback_rate": 0.5}
    # without the perplexity, agreement alone keeps them all
    assert choose_gamma(confidence, agrees, 0.97)["gamma"] == 0.6


def test_calibrated_gamma_is_what_the_mobile_preset_runs(tiny_model, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copy(tiny_model("qwen3_moe")[0], path)
    data = calibrate(path, TEXT, budget="50%", max_tokens=256, system="mobile", n_threads=2).data
    g = data["big_little"]
    assert 0 < g["gamma"] <= 1 and g["agreement"] >= g["min_agreement"] == 0.97 and g["loss_budget"] == 0.01
    assert g["little_agreement"] <= g["agreement"] and 0 <= g["fallback_rate"] <= 1
    with Engine(path, n_ctx=256, expert_cache="50%", system="mobile") as eng:
        assert eng.big_little == g["gamma"]
    with Engine(path, n_ctx=256, expert_cache="50%", system="mobile", big_little=0.5) as eng:
        assert eng.big_little == 0.5  # given explicitly, it wins
    # calibrating again for HOBBIT keeps the gamma
    again = calibrate(path, TEXT, budget="50%", max_tokens=256, force=True, n_threads=2)
    assert again.data["big_little"] == g and any("kept MoBiLE's gamma" in n for n in again.notes)


def test_calibrate_mobile_from_the_cli(tiny_model, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    path = tmp_path / "m.gguf"
    shutil.copy(tiny_model("qwen3_moe")[0], path)
    r = cli("calibrate", path, "-f", text, "--budget", "50%", "--system", "mobile", "--min-agreement", "90%")
    assert r.returncode == 0, r.stderr
    assert "MoBiLE gamma " in r.stdout and "(loss budget +1.0%, top-1 agreement 90% at least)" in r.stdout
    bad = cli("calibrate", path, "-f", text, "--budget", "50%", "--system", "mobile", "--min-agreement", "120%",
              "--force")
    assert_one_line_error(bad)
