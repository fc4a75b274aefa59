"""The benchmark's accounting (decode-only expert bytes per token, the roofline arithmetic) and its
run order."""
from __future__ import annotations

from pathlib import Path

import pytest

from pyedgemoe.bench import roofline
from pyedgemoe.bench.runner import OURS, STOCK, run_benchmark
from pyedgemoe.bench.worker import measure, parse_option
from pyedgemoe.model_info import read_model_info

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"


def test_roofline_is_active_bytes_at_ram_speed_plus_reads_at_disk_speed():
    # 1 GB of weights at 10 GB/s (0.1 s) + 0.4 GB of reads at 1 GB/s (0.4 s) = 0.5 s: 2 tok/s
    assert roofline.roofline_tokens_per_second(1e9, 0.4e9, 10e9, 1e9) == pytest.approx(2.0)
    assert roofline.roofline_tokens_per_second(1e9, 0, 10e9, 1e9) == pytest.approx(10.0)


def test_the_disk_bandwidth_is_the_runs_own_reads_on_demand_and_prefetched():
    stats = {"total": {"bytes_read": 3_000_000, "load_ms": 2.0}, "prefetches": {"bytes_read": 1_000_000, "load_ms": 2.0}}
    assert roofline.run_disk_bandwidth(stats) == pytest.approx(1e9)
    assert roofline.run_disk_bandwidth({"total": {"bytes_read": 0, "load_ms": 0.0}}) is None
    # several prefetch reads at once: their summed ms overstate the time; the busy wall time counts
    stats["prefetches"].update(load_ms=6.0, busy_ms=2.0)
    assert roofline.run_disk_bandwidth(stats) == pytest.approx(1e9)


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
    assert resident["decode_expert_bytes_per_token"] == 0  # every expert resident: nothing read


def test_engine_options_from_the_command_line_are_typed():
    assert parse_option("t1=0.6") == ("t1", 0.6)
    assert parse_option("io_threads=2") == ("io_threads", 2)
    assert parse_option("skip=false") == ("skip", False)
    assert parse_option("expert_cache=25%") == ("expert_cache", "25%")


def test_fed_decode_picks_the_teacher_forced_argmax(tiny_model):
    """--decode-input fixed for ours: feed_tokens go in instead of the picks; each pick is then the
    argmax of the logits after the prompt and the tokens fed so far."""
    from pyedgemoe import Engine
    from pyedgemoe.errors import InvalidOptionError
    path, _ = tiny_model("qwen3_moe")
    prompt, feed = [5, 17, 42, 99], [7, 150, 33, 12, 201, 88, 3]
    with Engine(path, n_ctx=64, n_threads=1, flash_attn=False, kv_type="f32", expert_cache="50%") as eng:
        picks = eng.time_generation(prompt, 8, feed_tokens=feed)["tokens"]
        forced = eng.logits(prompt + feed, one_token_per_step=True)[len(prompt) - 1:].argmax(axis=1)
        assert picks == forced.tolist()
        assert picks != eng.time_generation(prompt, 8)["tokens"]  # the picks were not fed back
        with pytest.raises(InvalidOptionError, match="feed_tokens"):
            eng.time_generation(prompt, 8, feed_tokens=feed[:5])


def test_a_warm_up_run_is_not_kept_and_the_engine_that_runs_first_alternates(tiny_model):
    path, _ = tiny_model("mixtral")
    logged: list[str] = []
    runs = run_benchmark(path, engines=(OURS, STOCK), prompt_tokens=4, output_tokens=2, repeats=3, threads=1,
                         log=logged.append)
    assert logged[0] == f"warm-up run of {OURS} (not kept)" and len(logged) == 1 + len(runs)
    assert [(r["repeat"], r["engine"]) for r in runs] == [
        (0, OURS), (0, STOCK), (1, STOCK), (1, OURS), (2, OURS), (2, STOCK)]
    assert all("error" not in r for r in runs)
    assert len({tuple(r["tokens"]) for r in runs}) == 1  # both engines, every repeat: the same tokens


def test_against_min_sets_our_loads_beside_belady_on_the_same_routing(tiny_model):
    from pyedgemoe.bench.runner import format_report
    path, _ = tiny_model("qwen3_moe")
    runs = run_benchmark(path, engines=(OURS,), prompt_tokens=4, output_tokens=24, repeats=1, threads=1,
                         warmup=0, ours_options={"expert_cache": "30%"}, against_min=True)
    timed, extra = runs[:-1], runs[-1]
    assert [r.get("against_min_run") for r in timed] == [None] and extra["against_min_run"]
    m = extra["against_min"]
    stats = extra["engine_stats"]["experts"]
    assert stats["fill_cache"] is False  # MIN starts empty: so did the run
    # the run's requests are the routing MIN replays; no policy loads fewer than MIN, none more than asked
    assert m["requests"] == stats["total"]["requests"]
    prefetched = (stats.get("prefetches") or {}).get("issued", 0)
    assert m["min_loads"] <= m["loads"] == stats["total"]["loads_high"] + prefetched
    assert stats["total"]["loads_high"] <= m["requests"]
    assert sum(m["min_loads_per_layer"].values()) == m["min_loads"]
    report = format_report(runs)
    assert "Against Belady's MIN" in report and f"| {m['loads']} | {m['min_loads']} | {m['x_min']:.2f} |" in report
    assert 'pyedgemoe options: {"expert_cache": "30%"};' in report  # as given: MIN's run's own are not


def test_against_min_refuses_a_run_without_an_expert_cache(tiny_model):
    path, _ = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="needs an expert cache"):
        measure("pyedgemoe", str(path), 4, 4, threads=1, options={"against_min": True})


def test_a_failed_run_is_in_the_report_and_fails_the_command(tiny_model, capsys):
    from pyedgemoe.bench.runner import BenchmarkError, cli_main
    path, _ = tiny_model("qwen3_moe")
    with pytest.raises(BenchmarkError, match="1 of 2 runs failed, the first: pyedgemoe: .*needs an expert cache"):
        cli_main(path, prompt_tokens=4, output_tokens=4, repeats=1, threads=1, vs_llama_cpp=False, warmup=0,
                 against_min=True)
    out, err = capsys.readouterr()
    assert "| 4 | 4 | pyedgemoe | 1/1 |" in out and "needs an expert cache" in out  # the report, both runs
    assert "the run against MIN] error:" in err


@pytest.mark.parametrize("system", [None, "hobbit", "cache-routing", "mobile"])
def test_against_min_runs_lossless_whatever_the_options(system):
    # the demo has LOW copies, which a default run uses: MIN's run computes what is resident instead
    options = {"expert_cache": "25%", **({"system": system} if system else {})}
    resident = measure("pyedgemoe", str(DEMO), 8, 24, threads=1, options={})
    r = measure("pyedgemoe", str(DEMO), 8, 24, threads=1, options={"against_min": True, **options})
    experts = r["engine_stats"]["experts"]
    assert not experts["low_precision"] and experts["cache_routing"] == 0
    assert r["tokens"] == resident["tokens"]
    assert r["against_min"]["min_loads"] <= r["against_min"]["loads"]


def test_fixed_decode_input_stays_within_a_small_vocabulary(tiny_model):
    from pyedgemoe.bench.worker import fixed_decode_token_ids, vocabulary_size
    path, _ = tiny_model("qwen3_moe")
    n_vocab = vocabulary_size(str(path))
    assert n_vocab < 30100 and max(fixed_decode_token_ids(500, n_vocab)) < n_vocab
    # a real vocabulary gets the same walk as ever: runs of record stay comparable
    assert fixed_decode_token_ids(64, 151936) == fixed_decode_token_ids(64)
    r = measure("pyedgemoe", str(path), 4, 12, threads=1, decode_input="fixed")
    assert "error" not in r and r["n_output_tokens"] == 12


def test_the_prompt_stays_within_a_small_vocabulary(tiny_model):
    from pyedgemoe.bench.worker import prompt_token_ids, vocabulary_size
    path, _ = tiny_model("qwen3_moe")
    n_vocab = vocabulary_size(str(path))
    assert n_vocab < 1100 and max(prompt_token_ids(128, n_vocab)) < n_vocab
    assert prompt_token_ids(128, 151936) == prompt_token_ids(128)  # a real vocabulary's as ever
    r = measure("pyedgemoe", str(path), 128, 4, threads=1)  # ids up to 1099 before: out of this vocabulary
    assert "error" not in r and r["n_prompt_tokens"] == 128


def test_our_options_reach_the_worker_with_their_types(tiny_model):
    """A given prefetch "none" is "none" in the worker, not None (which would leave it to the
    automatic choice); numbers stay numbers."""
    path, _ = tiny_model("qwen3_moe")
    options = {"prefetch": "none", "expert_cache": "50%", "io_threads": 2, "fill_cache": False}
    (run,) = run_benchmark(path, engines=(OURS,), prompt_tokens=4, output_tokens=2, repeats=1, threads=1,
                           warmup=0, ours_options=options)
    assert run["options"] == options
    assert run["engine_stats"]["experts"]["prefetch"] == "none" and run["engine_stats"]["experts"]["io_threads"] == 2
