#include "expert-cache.h"

#include <stdexcept>

slot_table::slot_table(int n_slots) : key_of_slot_(n_slots, 0) { release_all(); }

int slot_table::find(expert_key key) const {
    auto it = slot_of_.find(key);
    return it == slot_of_.end() ? -1 : it->second;
}

int slot_table::take_free_slot() {
    if (free_slots_.empty()) return -1;
    int s = free_slots_.back();
    free_slots_.pop_back();
    return s;
}

void slot_table::assign(int slot, expert_key key) {
    key_of_slot_[slot] = key;
    slot_of_[key] = slot;
}

expert_key slot_table::release(int slot) {
    expert_key key = key_of_slot_[slot];
    slot_of_.erase(key);
    free_slots_.push_back(slot);
    return key;
}

void slot_table::release_all() {
    slot_of_.clear();
    free_slots_.clear();
    for (int s = n_slots() - 1; s >= 0; s--) free_slots_.push_back(s);
}

expert_cache::expert_cache(const expert_cache_config & config) : config_(config) {
    clock_.n_layers = config.n_layers;
    for (size_t g = 0; g < config.high_slots.size(); g++) {
        const int low = g < config.low_slots.size() ? config.low_slots[g] : 0;
        has_low_ = has_low_ || low > 0;
        tiers_.push_back({ slot_table(config.high_slots[g]), make_cache_policy(config.policy, config.weights) });
        tiers_.push_back({ slot_table(low), make_cache_policy(config.policy, config.weights) });
    }
}

std::vector<expert_cache::placement> expert_cache::place(int group, int il,
                                                         const std::vector<std::pair<int, expert_precision>> & wanted) {
    clock_.layer = il;
    tier_state & high = tiers_[index(group, expert_precision::high)];
    tier_state & low = tiers_[index(group, expert_precision::low)];
    std::unordered_set<expert_key> needed;
    for (const auto & [e, p] : wanted) needed.insert(make_expert_key(il, e));
    auto evictable = [&](expert_key k) { return needed.count(k) == 0; };

    std::vector<placement> out;
    out.reserve(wanted.size());
    for (const auto & [e, demand] : wanted) {
        const expert_key key = make_expert_key(il, e);
        int slot = high.slots.find(key);
        if (slot >= 0) {
            high.policy->on_use(key, true, clock_);
            out.push_back({ e, expert_precision::high, slot, false });
            continue;
        }
        slot = low.slots.find(key);
        if (slot >= 0 && (demand != expert_precision::high || config_.low_serves_high)) {
            low.policy->on_use(key, false, clock_);
            out.push_back({ e, expert_precision::low, slot, false });
            continue;
        }
        if (demand == expert_precision::skip) {
            out.push_back({ e, expert_precision::skip, -1, false });
            continue;
        }
        tier_state & t = demand == expert_precision::high ? high : low;
        slot = t.slots.take_free_slot();
        if (slot < 0) {
            expert_key victim = 0;
            if (!t.policy->victim(evictable, clock_, &victim)) {
                throw std::runtime_error("layer " + std::to_string(il) + ": the " + expert_precision_name(demand) +
                                         " expert cache has no slot left for this ubatch");
            }
            slot = t.slots.find(victim);
            t.policy->on_evict(victim);
            t.slots.release(slot);
            slot = t.slots.take_free_slot();
        }
        t.slots.assign(slot, key);
        t.policy->on_insert(key);
        t.policy->on_use(key, demand == expert_precision::high, clock_);
        out.push_back({ e, demand, slot, true });
    }
    return out;
}

void expert_cache::start_sequence() {
    clock_.token = 0;
    for (auto & t : tiers_) t.policy->reset_sequence();
}

void expert_cache::forget_group(int group) {
    for (expert_precision p : { expert_precision::high, expert_precision::low }) {
        tier_state & t = tiers_[index(group, p)];
        t.slots.release_all();
        t.policy = make_cache_policy(config_.policy, config_.weights);
    }
}

uint64_t expert_cache::resident_experts() const {
    uint64_t n = 0;
    for (const auto & t : tiers_) n += t.slots.n_used();
    return n;
}
