"""Split's share of a decode token's misses uploaded (native/src/link-balance.h): the share the
rates timed at load give is refined by each decode layer's times, so that the link and the CPU end
together as the machine's load and a request's threads change; a share given stays."""
from __future__ import annotations

import pytest

from pyedgemoe import _native


def layers(balance, n, uploaded, on_cpu, cpu_ms, wait_ms):
    """n decode layers, each dividing its misses so and taking those times"""
    for _ in range(n):
        balance.divided(uploaded, on_cpu)
        balance.arrived(cpu_ms, wait_ms)
    return balance.share


def test_a_share_given_stays_whatever_the_layers_take():
    balance = _native.LinkBalance(0.3, adapts=False)
    assert layers(balance, 20, 3, 3, 0.6, 0.5) == pytest.approx(0.3)
    assert layers(balance, 20, 3, 3, 0.1, 0.0) == pytest.approx(0.3)
    assert _native.LinkBalance(1.0, adapts=False).share == 1.0  # every miss uploaded, as asked


def test_layers_that_end_together_keep_the_share_the_rates_at_load_give():
    # a quarter uploaded: 1 of 4 misses; the CPU computes 3 in 0.3 ms (10 an ms), the link ends in time
    balance = _native.LinkBalance(0.25, adapts=True)
    assert layers(balance, 50, 1, 3, 0.3, 0.0) == pytest.approx(0.25)


def test_a_slower_cpu_sends_more_misses_to_the_link():
    # at load both did 10 experts an ms; now the CPU does 5 (fewer threads, other work beside it)
    balance = _native.LinkBalance(0.5, adapts=True)
    layers(balance, 5, 3, 3, 0.3, 0.0)
    share = layers(balance, 50, 3, 3, 0.6, 0.0)
    assert share == pytest.approx(10 / 15, abs=0.01)


def test_a_link_that_ends_late_gets_fewer_misses():
    # the CPU's 3 in 0.3 ms, then the device waited 0.3 ms more for the 3 uploads (a synchronization
    # of arrived ones costs 0.005 ms): 5 an ms
    balance = _native.LinkBalance(0.5, adapts=True)
    layers(balance, 5, 3, 3, 0.3, 0.005)
    share = layers(balance, 50, 3, 3, 0.3, 0.305)
    assert share == pytest.approx(5 / 15, abs=0.01)


def test_lateness_is_told_from_a_synchronizations_own_cost():
    # every wait 0.04 ms, the least seen: what synchronizing arrived uploads costs (a sandboxed
    # driver's calls), not the link's lateness
    balance = _native.LinkBalance(0.5, adapts=True)
    assert layers(balance, 50, 3, 3, 0.3, 0.04) == pytest.approx(0.5)
    # a link late from the first layer on (a bad timing at load) is not taken for one: a
    # synchronization is taken to cost 0.05 ms at most
    balance = _native.LinkBalance(0.9, adapts=True)
    share = layers(balance, 50, 9, 1, 0.1, 0.85)
    assert share == pytest.approx(10 / (10 + 10), abs=0.02)


def test_a_link_that_ends_early_by_more_than_its_share_says_gets_more():
    # 4 uploads done before the CPU's 2 (0.2 ms): the link did at least 20 an ms against the CPU's 10
    balance = _native.LinkBalance(0.5, adapts=True)
    share = layers(balance, 50, 4, 2, 0.2, 0.0)
    assert share == pytest.approx(20 / 30, abs=0.01)


def test_layers_with_one_side_idle_or_not_a_decode_change_nothing():
    balance = _native.LinkBalance(0.4, adapts=True)
    assert layers(balance, 10, 0, 6, 0.6, 0.0) == pytest.approx(0.4)  # nothing uploaded: the link unseen
    assert layers(balance, 10, 6, 0, 0.1, 0.5) == pytest.approx(0.4)  # nothing on the CPU: its rate unseen
    balance.arrived(0.3, 5.0)  # a prefill's wave (not divided as a decode's)
    assert balance.share == pytest.approx(0.4)


def test_both_sides_keep_a_share_so_that_both_stay_measured():
    assert _native.LinkBalance(1.0, adapts=True).share == pytest.approx(0.95)
    assert _native.LinkBalance(0.0, adapts=True).share == pytest.approx(0.05)
    balance = _native.LinkBalance(0.5, adapts=True)
    assert layers(balance, 100, 1, 5, 0.5, 20.0) == pytest.approx(0.05)  # a link that nearly stopped
