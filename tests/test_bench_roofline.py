"""The benchmark's accounting: decode-only expert bytes per token, and the roofline arithmetic."""
from __future__ import annotations

import pytest

from pyedgemoe.bench import roofline
from pyedgemoe.bench.worker import measure, parse_option
from pyedgemoe.model_info import read_model_info


def test_roofline_is_active_bytes_at_ram_speed_plus_reads_at_disk_speed():
    bw = roofline.Bandwidths(ram_bytes_per_second=10e9, disk_bytes_per_second=1e9, disk_read_bytes=4096)
    # 1 GB of weights at 10 GB/s (0.1 s) + 0.4 GB of reads at 1 GB/s (0.4 s) = 0.5 s: 2 tok/s
    assert roofline.roofline_tokens_per_second(1e9, 0.4e9, bw) == pytest.approx(2.0)
    assert roofline.roofline_tokens_per_second(1e9, 0, bw) == pytest.approx(10.0)


def test_active_bytes_are_the_non_expert_weights_and_k_experts_per_layer(tiny_model):
    path, _ = tiny_model("mixtral")
    info = read_model_info(path)
    per_expert = sum(info.expert_bytes_per_layer.values()) / info.n_experts
    assert roofline.active_bytes_per_token(info) == int(info.non_expert_bytes + info.n_experts_used * per_expert)


def test_worker_reports_the_expert_bytes_of_decode_steps_only(tiny_model):
    path, _ = tiny_model("mixtral")
    offloaded = measure("pyedgemoe", str(path), 8, 9, threads=1, options={"expert_cache": "50%"})
    resident = measure("pyedgemoe", str(path), 8, 9, threads=1)
    assert offloaded["decode_expert_bytes_per_token"] > 0
    total = offloaded["engine_stats"]["experts"]["total"]["bytes_read"]
    assert offloaded["decode_expert_bytes_per_token"] * 8 < total  # the prefill's reads are not in it
    assert "decode_expert_bytes_per_token" not in resident or resident["decode_expert_bytes_per_token"] == 0


def test_engine_options_from_the_command_line_are_typed():
    assert parse_option("t1=0.6") == ("t1", 0.6)
    assert parse_option("io_threads=2") == ("io_threads", 2)
    assert parse_option("skip=false") == ("skip", False)
    assert parse_option("expert_cache=25%") == ("expert_cache", "25%")
