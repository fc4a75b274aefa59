"""The expert cache's bookkeeping (native/src/expert-cache.cpp, policy-heap.h, cache-policy.cpp):
placements, slots and victims of lru and lfu against a plain model of each rule written here; and a
key no model has."""
import random

import pytest

from pyedgemoe import _native

POLICIES = ("lru", "lfu", "decay", "adaptive", "hobbit", "edgemoe", "fate")


def _key(layer: int, expert: int) -> int:
    return layer << 32 | expert


def _reference(policy: str, steps: list[list[list[int]]], slots: int) -> list[tuple[int, int, bool]]:
    """What lru or lfu places, step by step: (expert, slot, load) per request. lru evicts the least
    recently used; lfu the fewest uses since insertion, ties to the least recently used, then the lower
    key. Never an expert the running layer asked for. A freed slot is the next one taken; the first
    slots are taken in order."""
    free = list(range(slots - 1, -1, -1))
    slot_of, order, clock, out = {}, {}, 0, []
    for token in steps:
        for layer, experts in enumerate(token):
            needed = {_key(layer, e) for e in experts}
            for e in experts:
                key = _key(layer, e)
                clock += 1
                if key in slot_of:
                    uses = order[key][0] + 1 if policy == "lfu" else 0
                    order[key] = (uses, clock, key)
                    out.append((e, slot_of[key], False))
                    continue
                if not free:
                    victim = min(v for k, v in order.items() if k not in needed)[2]
                    free.append(slot_of.pop(victim))
                    del order[victim]
                slot_of[key] = free.pop()
                clock += 1  # lfu: inserted with 0 uses, then used once
                order[key] = (1 if policy == "lfu" else 0, clock, key)
                out.append((e, slot_of[key], True))
    return out


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_placements_follow_the_rule_on_random_routing(policy):
    rng = random.Random(7)
    n_layers, n_expert, k, slots = 4, 16, 3, 20
    steps = [[rng.sample(range(n_expert), k) for _ in range(n_layers)] for _ in range(300)]
    cache = _native.ExpertCache(high_slots=slots, policy=policy, n_layers=n_layers, n_expert=n_expert, n_expert_used=k)
    placed = []
    for token in steps:
        cache.advance_tokens(1)
        for layer, experts in enumerate(token):
            placed += [(e, slot, load) for e, _, slot, load in cache.place(layer, [(e, "high") for e in experts])]
    assert placed == _reference(policy, steps, slots)
    assert sum(load for _, _, load in placed) < len(placed)  # some hits: the rule was exercised both ways


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("layer, expert", [(-1, 0), (0, -5), (1 << 20, 0), (0, 2**31 - 1)])
def test_a_key_no_model_has_is_an_error_and_costs_no_slot(policy, layer, expert):
    cache = _native.ExpertCache(high_slots=4, policy=policy, n_layers=2, n_expert=8, n_expert_used=2)
    with pytest.raises(IndexError, match="no layer"):
        cache.place(layer, [(1, "high"), (expert, "high")])
    # every slot is still free: four experts take slots 0-3 and are cached
    placed = cache.place(0, [(e, "high") for e in range(4)])
    assert sorted(slot for _, _, slot, _ in placed) == [0, 1, 2, 3]
    assert all(load for *_, load in placed)
    assert all(cache.cached(0, e, "high") for e in range(4))
