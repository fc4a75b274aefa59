"""What the expert cache's options and reports say is what happens: --expert-cache 100% holds every
expert in HIGH, a size beyond the experts is capped (and says so), --stats' numbers add up, a seed
system's note says what is lossy and what the fill does, values out of range name the range,
--low-from left unused says so; Engine's keyword arguments are checked; an Engine left open
leaves nothing behind at exit."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from pyedgemoe import Engine, ExpertOptions
from pyedgemoe.calibration.sidecar import read_sidecar, sidecar_path, write_sidecar
from pyedgemoe.convert.export import export
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.model_info import read_model_info
from pyedgemoe.sysmem import format_bytes
from test_cli import assert_one_line_error, cli
from test_io_faults import DEMO

PROMPT = "def add(a, b):"
INFO = read_model_info(DEMO)
N_EXPERTS = INFO.n_experts * len(INFO.expert_bytes_per_layer)  # 16 experts in each of 6 layers


def note(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("note: expert cache"))


def test_100_percent_holds_every_expert_in_high():
    with Engine(DEMO, expert_cache="100%", fill_background=False) as eng:
        eng.generate(PROMPT, 32, temperature=0)
        experts = eng.stats()["experts"]
        said = eng.expert_cache_note
    assert (experts["high_slots"], experts["low_slots"], experts["mixed_precision"]) == (N_EXPERTS, 0, False)
    assert experts["fill"]["experts"] == N_EXPERTS
    t = experts["total"]
    assert (t["misses"], t["selections_low"], t["skipped"]) == (0, 0, 0)
    assert said.startswith(f"expert cache 100%: {format_bytes(INFO.high_expert_bytes)}, every expert resident in HIGH")
    assert "mixed precision" not in said and "lossless" in said


def test_100_percent_with_low_precision_asked_for_keeps_a_low_tier():
    with Engine(DEMO, expert_cache="100%", low_precision=True) as eng:
        experts = eng.stats()["experts"]
    assert experts["mixed_precision"] and experts["low_slots"] > 0 and experts["high_slots"] < N_EXPERTS


@pytest.mark.parametrize("asked", ["1TiB~", "1GiB", "10TiB"])  # 10TiB: checked against memory as what it holds
def test_a_size_beyond_the_experts_is_capped_and_says_so(asked):
    r = cli("run", DEMO, "-p", PROMPT, "-n", "2", "--expert-cache", asked, "--json")
    assert r.returncode == 0, r.stderr
    experts = json.loads(r.stdout)["stats"]["experts"]
    assert experts["budget_bytes"] == experts["pool_bytes"] == INFO.high_expert_bytes
    said = note(r.stderr)
    assert "every expert resident in HIGH" in said and "capped at what they take" in said
    assert not re.search(r"\d{4,} ?%", r.stderr), r.stderr  # no "101599 %"
    # with LOW copies asked for: room for every copy of both precisions, no more
    with Engine(DEMO, expert_cache=asked, low_precision=True) as eng:
        experts = eng.stats()["experts"]
    assert (experts["high_slots"], experts["low_slots"]) == (N_EXPERTS, N_EXPERTS)
    assert experts["pool_bytes"] == INFO.high_expert_bytes + INFO.low_expert_bytes
    assert "room for every HIGH and LOW copy" in eng.expert_cache_note


def test_dry_run_refuses_a_cache_below_the_minimum_as_the_run_does_and_takes_one_above_it():
    """The smallest cache is one layer's top-k experts in HIGH, and with low precision on all but one in
    LOW too (expert-budget.cpp): --dry-run says what the run would, for either."""
    lossless, mixed = INFO.minimum_cache_bytes(low=False), INFO.minimum_cache_bytes(low=True)
    assert lossless < mixed
    for low, minimum in (("--no-low-precision", lossless), ("--low-precision", mixed)):
        for dry in (["--dry-run"], ["-p", PROMPT, "-n", "1"]):
            r = cli("run", DEMO, *dry, "--expert-cache", str(minimum - 1), low)
            assert r.returncode == 1 and r.stderr.count("error:") == 1, r.stderr
            assert f"below the minimum of {minimum} bytes" in r.stderr, r.stderr
    for dry in (["--dry-run"], ["-p", PROMPT, "-n", "1"]):  # lossless, below the minimum with LOW copies
        r = cli("run", DEMO, *dry, "--expert-cache", str(lossless), "--no-low-precision")
        assert r.returncode == 0, r.stderr


def test_dry_run_refuses_a_token_count_the_run_refuses():
    r = cli("run", DEMO, "-p", PROMPT, "-n", "-3", "--dry-run")
    assert r.returncode == 1 and "error: --n-predict must be >= -2" in r.stderr and not r.stdout, r


def layer_lines(stderr: str) -> dict[str, dict[str, int]]:
    """--stats' lines of layers and the total: requests = hits + misses + skipped, bytes read = on
    demand + prefetched."""
    pattern = re.compile(r"^\s*(layer \d+|total): +(\d+) requests = +(\d+) hits \( *[\d.]+%\) \+ +(\d+) misses "
                         r"\+ +(\d+) skipped; read +([\d.]+ \S+) = +([\d.]+ \S+) on demand in +[\d.]+ s \+ "
                         r"+([\d.]+ \S+) prefetched")
    out = {}
    for line in stderr.splitlines():
        m = pattern.match(line)
        if m:
            out[m.group(1)] = dict(zip(("requests", "hits", "misses", "skipped"), map(int, m.groups()[1:5])),
                                   read=m.group(6), on_demand=m.group(7), prefetched=m.group(8))
    return out


def test_stats_say_what_their_numbers_are_and_add_up():
    r = cli("run", DEMO, "-p", PROMPT, "-n", "48", "--temp", "0", "--expert-cache", "25%", "--system", "hobbit",
            "--stats", "-t", "1")
    assert r.returncode == 0, r.stderr
    lines = layer_lines(r.stderr)
    assert len(lines) == len(INFO.expert_bytes_per_layer) + 1, r.stderr
    for name, c in lines.items():
        assert c["requests"] == c["hits"] + c["misses"] + c["skipped"], (name, c)
    assert sum(c["skipped"] for c in lines.values()) > 0  # HOBBIT skips some: they are counted
    layers = [c for name, c in lines.items() if name != "total"]
    assert lines["total"]["requests"] == sum(c["requests"] for c in layers)
    # hobbit's prefetch reads count in the total, with those on demand
    total = r.stderr.split("   total: ")[1].split("\n")[0]
    assert lines["total"]["prefetched"] != "0 B" and lines["total"]["read"] != lines["total"]["on_demand"], total
    header = next(l for l in r.stderr.splitlines() if l.startswith("expert cache: "))
    # the slots (HIGH and LOW apart) against the experts of each precision: no "29 MiB of 19 MiB experts"
    m = re.match(r"expert cache: [\d.]+ \S+ of slots, HIGH [\d.]+ \S+ \((\d+) of (\d+) experts\) \+ "
                 r"LOW [\d.]+ \S+ \((\d+) of (\d+)\); the experts take ([\d.]+ \S+) in HIGH, ([\d.]+ \S+) in LOW", header)
    assert m, header
    high, n, low, n_low, high_bytes, low_bytes = m.groups()
    assert int(high) <= int(n) == int(n_low) == N_EXPERTS and int(low) <= N_EXPERTS
    assert (high_bytes, low_bytes) == (format_bytes(INFO.high_expert_bytes), format_bytes(INFO.low_expert_bytes))


def test_mobile_says_it_is_lossy():
    r = cli("run", DEMO, "-p", PROMPT, "-n", "2", "--expert-cache", "25%", "--system", "mobile")
    assert r.returncode == 0, r.stderr
    said = note(r.stderr)
    assert "lossy big-little decoding" in said and "lossless" not in said


@pytest.fixture
def demo_copy(tmp_path):
    """The demo model with its calibration (EdgeMoE's path statistics and precision map) beside it."""
    model = tmp_path / "demo.gguf"
    shutil.copyfile(DEMO, model)
    shutil.copyfile(sidecar_path(DEMO), sidecar_path(model))
    return model


@pytest.mark.parametrize("n_low", [N_EXPERTS, N_EXPERTS // 2])
def test_edgemoe_says_what_its_fill_does(demo_copy, n_low):
    # the fill reads HIGH copies: with every expert LOW in the map there is nothing to fill
    data = read_sidecar(sidecar_path(demo_copy))
    low = {str(l): list(range(INFO.n_experts)) if n_low == N_EXPERTS else list(range(INFO.n_experts // 2))
           for l in INFO.expert_bytes_per_layer}
    data["precision_map"] = {**data["precision_map"], "low": low, "n_low": n_low}
    write_sidecar(data, sidecar_path(demo_copy))
    r = cli("run", demo_copy, "-p", PROMPT, "-n", "2", "--expert-cache", "25%", "--system", "edgemoe", "--json")
    assert r.returncode == 0, r.stderr
    filled = json.loads(r.stdout)["stats"]["experts"]["fill"]["experts"]
    said = note(r.stderr)
    if n_low == N_EXPERTS:
        assert "no fill (EdgeMoE's map puts every expert in LOW" in said and filled == 0
    else:
        assert "fill at load" in said and filled > 0


@pytest.mark.parametrize("value", ["0", "0%", "150%", "-5", "0B", "0.0000001%"])
def test_expert_cache_out_of_range_names_the_range(value):
    r = cli("run", DEMO, "-p", PROMPT, f"--expert-cache={value}")
    assert_one_line_error(r, f"expert_cache {value!r} is out of range", "above 0% and at most 100%")
    with pytest.raises(InvalidOptionError, match="out of range"):
        Engine(DEMO, expert_cache=0)


@pytest.fixture(scope="module")
def standard_pair(tmp_path_factory):
    """The demo model as two standard GGUFs: its HIGH copies, and its LOW ones for --low-from."""
    d = tmp_path_factory.mktemp("pair")
    return (export(DEMO, d / "high.gguf", precision="high", progress=False),
            export(DEMO, d / "low.gguf", precision="low", progress=False))


@pytest.mark.parametrize("cache, why", [("100%", "every expert is resident in HIGH"),
                                        ("auto", "every expert is resident (no expert cache)"),
                                        ("mmap", "the experts stay in the mapped file")])
def test_low_from_left_unused_says_so(standard_pair, cache, why):
    high, low = standard_pair
    r = cli("run", high, "-p", PROMPT, "-n", "1", "--expert-cache", cache, "--low-from", low)
    assert r.returncode == 0, r.stderr
    assert f"note: --low-from {low} is unused: {why}" in r.stderr
    used = cli("run", high, "-p", PROMPT, "-n", "1", "--expert-cache", "50%", "--low-from", low)
    assert "unused" not in used.stderr and "mixed precision" in note(used.stderr)


def test_a_misspelt_engine_keyword_names_the_right_one():
    with pytest.raises(InvalidOptionError) as e:
        Engine(DEMO, expert_cahce="25%")
    message = str(e.value)
    assert "unknown keyword argument 'expert_cahce': did you mean 'expert_cache'?" in message
    assert all(name in message for name in ("n_ctx", "expert_options", "prefetch", "io_threads"))


def test_a_keyword_and_expert_options_that_disagree_are_an_error():
    with pytest.raises(InvalidOptionError, match="io is given twice"):
        Engine(DEMO, expert_cache="25%", io="buffered", expert_options=ExpertOptions(io="direct"))
    with Engine(DEMO, expert_cache="25%", io="direct", expert_options=ExpertOptions(io="direct")) as eng:
        assert eng.expert_residency["io"] == "direct"  # the same value twice is no conflict


def test_an_engine_left_open_leaves_nothing_at_exit():
    script = (f"from pyedgemoe import Engine\neng = Engine({str(DEMO)!r}, n_parallel=2)\n"
              f"print(eng.generate({PROMPT!r}, 4, temperature=0))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert r.stderr == ""  # no "nanobind: leaked 4 instances!"
