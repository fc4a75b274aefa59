"""Choosing where the math runs (pyedgemoe.devices) on a build without a GPU backend: --mode gpu,
coop, --device and --host-cache are clear errors naming the build flag; the default mode is cpu.
(The device tier itself is tested in tests/device on the Vulkan variant.)"""
from __future__ import annotations

import pytest

from pyedgemoe import Engine
from pyedgemoe.devices import gpu_devices
from pyedgemoe.errors import InvalidOptionError
from test_cli import assert_one_line_error, cli

pytestmark = pytest.mark.skipif(bool(gpu_devices()), reason="this build has a GPU backend")
SETTINGS = dict(n_ctx=128, n_threads=2)


@pytest.mark.parametrize("options", [dict(mode="gpu"), dict(mode="coop"), dict(mode="split"), dict(mode="auto"),
                                     dict(device="Vulkan0")])
def test_gpu_options_on_a_cpu_build_name_the_build_flag(mixtral_gguf, options):
    with pytest.raises(InvalidOptionError, match="GGML_VULKAN=1"):
        Engine(mixtral_gguf, **SETTINGS, **options)


def test_the_default_mode_of_a_cpu_build_is_cpu(mixtral_gguf):
    with Engine(mixtral_gguf, **SETTINGS, expert_cache="50%") as eng:
        eng.logits([1, 2, 3])
        stats = eng.stats()
    assert stats["mode"] == stats["experts"]["mode"] == "cpu" and stats["device"] is None
    assert stats["experts"]["total"]["uploads"] == stats["experts"]["total"]["cpu_experts"] == 0


def test_host_cache_needs_a_gpu_mode(mixtral_gguf):
    with pytest.raises(InvalidOptionError, match="host tier of --mode gpu"):
        Engine(mixtral_gguf, **SETTINGS, expert_cache="50%", host_cache="1GiB")


@pytest.mark.parametrize("args", [("--mode", "gpu"), ("--mode", "coop"), ("--mode", "split"), ("--device", "CUDA0")])
def test_cli_gpu_flags_on_a_cpu_build_are_one_error_line(mixtral_gguf, args):
    assert_one_line_error(cli("run", mixtral_gguf, "-p", "x", *args), "error:", "GGML_VULKAN=1")


def test_cli_link_share_without_split_is_one_error_line(mixtral_gguf):
    assert_one_line_error(cli("run", mixtral_gguf, "-p", "x", "--link-share", "0.5"), "error:",
                          "--link-share divides --mode split's misses; this run's mode is cpu")


def test_cli_unknown_mode_is_one_error_line(mixtral_gguf):
    assert_one_line_error(cli("run", mixtral_gguf, "-p", "x", "--mode", "tpu"), "error:", "mode")
