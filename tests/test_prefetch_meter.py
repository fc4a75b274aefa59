"""Prefetch that never costs (native/src/prefetch-meter.h, prefetch-ledger.h, prefetch-trial.cpp): a
rank of guesses is read while it takes more reads off the critical path than it adds (guesses
evicted unused, cached experts it evicted that were then missed), and decode prefetching stops for
good when not even the likeliest guesses pay or, where read times may not judge (LOW copies), once
it has read more than the same run without it; counted in the stats the CLI prints."""
from __future__ import annotations

import random
import re

import pytest

from pyedgemoe import Engine, _native
from test_cli import cli
from test_io_faults import DEMO

JUDGED_AFTER = 32  # PREFETCH_RANK_JUDGED_AFTER


def test_random_guesses_stop_after_the_judgement_and_good_ones_go_on():
    """Guessing 2 of 8 experts at random (top-2 routing): a guess is used 1 time in 4; after 32
    settled the rank costs more reads than it saves and stops; a rank right 3 times in 4 goes on."""
    rng = random.Random(0)
    meter = _native.PrefetchMeter(ghost_slots=16)
    for i in range(JUDGED_AFTER - 1):
        meter.issued(0)
        meter.used(0, ahead=True) if rng.random() < 0.25 else meter.wasted(0)
        meter.issued(1)
        meter.used(1, ahead=True) if i % 4 else meter.wasted(1)
    assert meter.worth(0) and meter.worth(1) and not meter.useless()  # not judged yet
    meter.issued(0)
    meter.wasted(0)
    meter.issued(1)
    meter.wasted(1)
    assert not meter.worth(0) and meter.useless()
    assert meter.worth(1)
    assert meter.worth(7)  # a rank never tried is tried


def settle(meter, used: int, wasted: int, ahead: bool = True) -> None:
    """`used` prefetches of rank 0 used (read ahead or not), then `wasted` evicted unused."""
    for _ in range(used):
        meter.issued(0)
        meter.used(0, ahead=ahead)
    for _ in range(wasted):
        meter.issued(0)
        meter.wasted(0)


def test_used_too_late_to_start_saves_nothing():
    """A guess used before its read started was read by its layer on demand: 40 such and 24 wasted
    do not pay, the same 40 read ahead do."""
    late, ahead = _native.PrefetchMeter(16), _native.PrefetchMeter(16)
    settle(late, 40, 24, ahead=False)
    settle(ahead, 40, 24)
    assert not late.worth(0) and ahead.worth(0)


def test_a_displaced_expert_missed_soon_counts_against_the_rank_that_evicted_it():
    """Hand-computed: 40 used ahead, 20 wasted, and each of 4 more prefetches evicted a cached
    expert that was missed on demand while its ghost was young (fewer evictions since than the
    cache's 8 slots); a ghost older than 8 evictions, or an expert found cached, counts nothing."""
    meter = _native.PrefetchMeter(ghost_slots=8)
    settle(meter, 40, 20)
    assert meter.worth(0)  # 40 > 20
    for e in range(4):  # evicts (5, e), which is missed right away: 40 > 24 still
        meter.issued(0, displaced=(5, e))
        meter.used(0, ahead=True)
        meter.evicted()
        assert meter.demanded(5, e, missed=True)
    assert meter.worth(0)
    # 20 more displaced and missed: 44 saved against 20 wasted + 24 displaced
    for e in range(4, 24):
        meter.issued(0, displaced=(5, e))
        meter.evicted()
        assert meter.demanded(5, e, missed=True)
    assert not meter.worth(0)  # 44 saved <= 20 wasted + 24 displaced

    old = _native.PrefetchMeter(ghost_slots=8)
    old.issued(0, displaced=(3, 1))
    for _ in range(8):
        old.evicted()
    assert not old.demanded(3, 1, missed=True)  # aged out: LRU would have evicted it too
    hit = _native.PrefetchMeter(ghost_slots=8)
    hit.issued(0, displaced=(3, 1))
    assert not hit.demanded(3, 1, missed=False)
    assert not hit.demanded(3, 1, missed=True)  # the ghost went with the hit


LEDGER_JUDGED_AFTER = 8  # PREFETCH_LEDGER_JUDGED_AFTER


def ledger_beside_lru(slots: int = 2):
    run = _native.ExpertCache(high_slots=slots, policy="lru")
    return run, _native.PrefetchLedger(run, low_cost=0.5)


def test_the_ledger_weighs_the_run_against_its_shadow_without_prefetch():
    """One layer, two slots, lru; token t uses expert t % 4, so without prefetching every token
    misses. Each right guess is one read ahead for one miss of the shadow's: 8 tokens, 8 reads each
    side, no cost. At token 8 (expert 0) the run holds {2, 3}; a wrong guess (1) is read and 0 is
    missed too: 10 reads against the shadow's 9, judged as the layer is placed."""
    run, ledger = ledger_beside_lru()
    for token in range(LEDGER_JUDGED_AFTER):
        run.advance_tokens(1)
        assert ledger.guess(0, token % 4)
        assert not ledger.costs  # a guess's read waits for its layer
        assert ledger.place(0, [(token % 4, "high")]) == [(token % 4, "high", token % 2, False)]  # a hit
        assert not ledger.costs  # 8 = 8
    run.advance_tokens(1)
    assert ledger.guess(0, 1)
    assert not ledger.costs
    assert ledger.place(0, [(0, "high")])[0][3]  # missed all the same
    assert ledger.costs  # 10 > 9


def test_a_guess_for_a_layer_yet_to_run_is_not_judged():
    """Guesses for layer 1 read while layer 0 places: they count only once layer 1 has run."""
    run = _native.ExpertCache(high_slots=4, policy="lru", n_layers=2)
    ledger = _native.PrefetchLedger(run, low_cost=0.5)
    for token in range(LEDGER_JUDGED_AFTER):
        run.advance_tokens(1)
        ledger.place(0, [(token % 3, "high")])
        assert ledger.guess(1, token % 3 + 4)  # right, and never cached before
        ledger.place(0, [(token % 3, "high")])  # layer 0 again: layer 1's guess still pending
        assert not ledger.costs
        ledger.place(1, [(token % 3 + 4, "high")])
        assert not ledger.costs


def test_the_ledger_judges_after_enough_guesses_and_counts_a_read_ahead_on_both_sides():
    """A wrong first guess (run 2 reads: the guess and the miss; shadow 1) is not judged alone; a
    prefill's read-ahead is read by the shadow as well, so it costs prefetching nothing."""
    run, ledger = ledger_beside_lru()
    run.advance_tokens(1)
    assert ledger.guess(0, 3)
    ledger.place(0, [(0, "high")])
    assert not ledger.costs  # 1 guess < 8
    run.advance_tokens(2)
    assert ledger.read_ahead(0, 1) and ledger.read_ahead(0, 2)
    ledger.place(0, [(1, "high")])
    ledger.place(0, [(2, "high")])
    # both hold {1, 2}: 4 reads against 3; then 7 tokens cycling on, each guessed right
    for token in range(3, 3 + LEDGER_JUDGED_AFTER - 1):
        run.advance_tokens(1)
        assert ledger.guess(0, token % 4)
        assert not ledger.place(0, [(token % 4, "high")])[0][3]
    assert ledger.costs  # 11 > 10 with the 8th guess: the first guess's extra read is still there


def test_with_low_copies_the_fate_preset_stops_prefetching_what_reads_more_than_it_saves():
    """Fate's guesses with LOW copies (no timing judges them) read 37 % more than its run without
    prefetch on the demo before the ledger; now they stop within a few tokens of costing."""
    runs = {}
    for prefetch in ("fate", "none"):
        with Engine(DEMO, n_ctx=512, expert_cache="25%", system="fate", prefetch=prefetch) as eng:
            tokens = eng.time_generation(eng.tokenize("def parse(self, text):"), 160)["tokens"]
            experts = eng.stats()["experts"]
        read = experts["total"]["bytes_read"] + experts["prefetches"]["bytes_read"]  # on demand and ahead
        runs[prefetch] = (tokens, read, experts["prefetches"])
    assert runs["fate"][0] == runs["none"][0]  # decode in HIGH only
    p = runs["fate"][2]
    assert p["issued"] > 0 and p["stopped"], p
    assert runs["fate"][1] <= 1.05 * runs["none"][1], runs


@pytest.mark.parametrize("preset", ["hobbit"])
def test_a_lossy_run_judges_by_counts_alone_and_repeats_itself(preset):
    """With LOW copies a measured time must not decide what is cached: the judgement counts reads
    only (no trial), so two runs give the same counters and tokens."""
    runs = []
    for _ in range(2):
        with Engine(DEMO, n_ctx=512, expert_cache="25%", system=preset) as eng:
            tokens = eng.time_generation(eng.tokenize("def parse(self, text):"), 96)["tokens"]
            p = eng.stats()["experts"]["prefetches"]
            runs.append((tokens, {k: p[k] for k in ("issued", "used", "wasted", "displaced", "declined", "stopped")}))
    assert runs[0] == runs[1]
    assert runs[0][1]["issued"] > 0


def test_stats_print_what_prefetching_cost():
    r = cli("run", DEMO, "-p", "def f(x):", "-n", "24", "--expert-cache", "25%", "--prefetch", "fate", "--stats")
    assert r.returncode == 0, r.stderr
    m = re.search(r"prefetch \(fate\): (\d+) experts read ahead, (\d+) used \((\d+) too late to start\), (\d+) evicted "
                  r"unused, (\d+) misses of experts they evicted, (\d+) not read", r.stderr)
    assert m, r.stderr
    issued, used, late, wasted, displaced, declined = map(int, m.groups())
    assert issued > 0 and used + wasted <= issued and late <= used
