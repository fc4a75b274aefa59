#include "expert-cache.h"

#include <algorithm>
#include <stdexcept>

slot_table::slot_table(int n_slots) : key_of_slot_(n_slots, 0) { release_all(); }

int slot_table::find(expert_key key) const {
    const slot_ref * s = slot_of_.find(key);
    return s ? s->slot : -1;
}

int slot_table::take_free_slot() {
    if (free_slots_.empty()) return -1;
    int s = free_slots_.back();
    free_slots_.pop_back();
    return s;
}

void slot_table::assign(int slot, expert_key key) {
    key_of_slot_[slot] = key;
    int & s = slot_of_[key].slot;
    n_used_ += s < 0;
    s = slot;
}

expert_key slot_table::release(int slot) {
    expert_key key = key_of_slot_[slot];
    int & s = slot_of_[key].slot;
    n_used_ -= s >= 0;
    s = -1;
    free_slots_.push_back(slot);
    return key;
}

void slot_table::release_all() {
    slot_of_ = {};
    n_used_ = 0;
    free_slots_.clear();
    for (int s = n_slots() - 1; s >= 0; s--) free_slots_.push_back(s);
}

expert_cache::expert_cache(const expert_cache_config & config) : config_(config) {
    clock_.n_layers = config.n_layers;
    for (size_t g = 0; g < config.high_slots.size(); g++) {
        const int low = g < config.low_slots.size() ? config.low_slots[g] : 0;
        has_low_ = has_low_ || low > 0;
        const std::vector<int> layers = g < config.group_layers.size() ? config.group_layers[g] : std::vector<int>();
        for (int slots : { config.high_slots[g], low }) {
            const cache_tier_shape shape = { slots, layers, config.n_expert, config.fate_shallow, config.n_expert_used };
            tiers_.push_back({ slot_table(slots), shape, make_cache_policy(config.policy, config.weights, shape) });
        }
    }
}

namespace {
int tier_of(expert_precision p) { return p == expert_precision::low ? 1 : 0; }
}  // namespace

bool expert_cache::pinned(expert_key key, expert_precision p, bool hard_only) const {
    const int t = tier_of(p);
    const auto held = [&](const expert_table<int> & pins) { const int * n = pins.find(key); return n && *n > 0; };
    return held(hard_pins_[t]) || (!hard_only && held(soft_pins_[t]));
}

void expert_cache::pin(expert_key key, expert_precision p, bool hard) {
    (hard ? hard_pins_ : soft_pins_)[tier_of(p)][key]++;
}

void expert_cache::unpin(expert_key key, expert_precision p, bool hard) {
    int & n = (hard ? hard_pins_ : soft_pins_)[tier_of(p)][key];
    if (n > 0) n--;
}

expert_precision expert_cache::serving_tier(int group, expert_key key, expert_precision demand) const {
    if (tier(group, expert_precision::high).find(key) >= 0) return expert_precision::high;
    if (tier(group, expert_precision::low).find(key) >= 0 && (demand != expert_precision::high || config_.low_serves_high)) {
        return expert_precision::low;
    }
    return expert_precision::skip;
}

void expert_cache::discard(int group, expert_key key, expert_precision precision) {
    tier_state & t = tiers_[index(group, precision)];
    const int slot = t.slots.find(key);
    if (slot < 0) return;
    t.policy->on_evict(key);
    t.slots.release(slot);
}

int expert_cache::free_or_evict(tier_state & t, expert_precision p, expert_key incoming,
                                const std::function<bool(expert_key)> & evictable, bool soft_pins_give_way, placement & out) {
    int slot = t.slots.take_free_slot();
    if (slot >= 0) return slot;
    expert_key victim = 0;
    bool found = false;
    if (clock_.sweep) {
        // a sweep needs the layers it has passed only in the next ubatch, and each layer ahead in
        // this one: theirs go first (else a cache filled before the prompt would lose every layer's
        // experts just before that layer runs, oldest first)
        found = t.policy->victim([&](expert_key k) {
            return expert_key_layer(k) < clock_.layer && evictable(k) && !pinned(k, p, false);
        }, clock_, incoming, &victim);
    }
    if (!found) found = t.policy->victim([&](expert_key k) { return evictable(k) && !pinned(k, p, false); }, clock_, incoming, &victim);
    if (!found && soft_pins_give_way) {
        found = t.policy->victim([&](expert_key k) { return evictable(k) && !pinned(k, p, true); }, clock_, incoming, &victim);
    }
    if (!found) return -1;
    slot = t.slots.find(victim);
    t.policy->on_evict(victim);
    t.slots.release(slot);
    out.has_evicted = true;
    out.evicted = victim;
    return t.slots.take_free_slot();
}

std::vector<expert_cache::placement> expert_cache::place(int group, int il,
                                                         const std::vector<std::pair<int, expert_precision>> & wanted) {
    clock_.layer = il;
    tier_state & high = tiers_[index(group, expert_precision::high)];
    tier_state & low = tiers_[index(group, expert_precision::low)];
    std::vector<expert_key> needed;
    for (const auto & [e, p] : wanted) check_expert_key(needed.emplace_back(make_expert_key(il, e)));  // before any change
    std::sort(needed.begin(), needed.end());
    auto evictable = [&](expert_key k) { return !std::binary_search(needed.begin(), needed.end(), k); };

    std::vector<placement> out;
    out.reserve(wanted.size());
    for (const auto & [e, demand] : wanted) {
        const expert_key key = make_expert_key(il, e);
        const expert_precision cached = serving_tier(group, key, demand);
        if (cached != expert_precision::skip) {
            tier_state & t = cached == expert_precision::high ? high : low;
            t.policy->on_use(key, cached == expert_precision::high, clock_);
            out.push_back({ e, cached, t.slots.find(key), false });
            continue;
        }
        if (demand == expert_precision::skip) {
            out.push_back({ e, expert_precision::skip, -1, false });
            continue;
        }
        placement p = { e, demand, -1, true };
        p.slot = free_or_evict(demand == expert_precision::high ? high : low, demand, key, evictable, true, p);
        if (p.slot < 0 && demand == expert_precision::low) {
            // the LOW tier is full of experts in use: a HIGH copy serves the LOW demand
            p = { e, expert_precision::high, -1, true };
            p.slot = free_or_evict(high, expert_precision::high, key, evictable, true, p);
        }
        tier_state & t = p.precision == expert_precision::high ? high : low;
        if (p.slot < 0) {
            // nothing was read yet: give back the slots this call took, so the caller may retry
            for (const placement & taken : out) {
                if (taken.load) discard(group, make_expert_key(il, taken.expert), taken.precision);
            }
            throw std::runtime_error("layer " + std::to_string(il) + ": the " + expert_precision_name(demand) +
                                     " expert cache has no slot left for this ubatch");
        }
        t.slots.assign(p.slot, key);
        t.policy->on_insert(key);
        t.policy->on_use(key, p.precision == expert_precision::high, clock_);
        out.push_back(p);
    }
    return out;
}

expert_cache::placement expert_cache::reserve(int group, int il, int e, expert_precision precision, bool evict) {
    const expert_key key = make_expert_key(il, e);
    check_expert_key(key);
    placement p = { e, precision, -1, false };
    if (precision == expert_precision::skip || serving_tier(group, key, precision) != expert_precision::skip) return p;
    tier_state & t = tiers_[index(group, precision)];
    if (t.slots.n_slots() == 0) return p;
    p.slot = free_or_evict(t, precision, key, [evict](expert_key) { return evict; }, false, p);
    if (p.slot < 0) return p;
    t.slots.assign(p.slot, key);
    t.policy->on_insert(key);
    p.load = true;
    return p;
}

void expert_cache::start_sequence() {
    clock_.token = 0;
    sequences_++;
    for (auto & t : tiers_) t.policy->reset_sequence();
}

void expert_cache::forget_all() {
    for (int t = 0; t < 2; t++) { hard_pins_[t] = {}; soft_pins_[t] = {}; }
    for (auto & t : tiers_) {
        t.slots.release_all();
        t.policy = make_cache_policy(config_.policy, config_.weights, t.shape);
    }
}

size_t expert_cache::n_slots() const {
    size_t n = 0;
    for (const tier_state & t : tiers_) n += t.slots.n_slots();
    return n;
}

uint64_t expert_cache::resident_experts() const {
    uint64_t n = 0;
    for (const auto & t : tiers_) n += t.slots.n_used();
    return n;
}
