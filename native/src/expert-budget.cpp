#include "expert-budget.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <string>

namespace {

std::string mib(uint64_t bytes) {
    char buf[64];
    snprintf(buf, sizeof(buf), "%.2f MiB", bytes / 1048576.0);
    return buf;
}

// Slots per group for one tier: each group gets its minimum, the rest of the budget is shared in
// proportion to the group's expert bytes, and no group gets more slots than it has experts.
std::vector<int> share_slots(uint64_t budget, int min_slots, const std::vector<uint64_t> & slot_bytes,
                             const std::vector<expert_group> & groups, int n_expert) {
    uint64_t minimum = 0, demand = 0;
    for (size_t g = 0; g < slot_bytes.size(); g++) {
        minimum += (uint64_t) min_slots * slot_bytes[g];
        demand += (uint64_t) groups[g].n_layers * n_expert * slot_bytes[g];
    }
    const uint64_t extra = budget > minimum ? budget - minimum : 0;
    std::vector<int> slots;
    for (size_t g = 0; g < slot_bytes.size(); g++) {
        const uint64_t group_demand = (uint64_t) groups[g].n_layers * n_expert;
        const double share = (double) (group_demand * slot_bytes[g]) / (double) demand;
        uint64_t n = min_slots + (uint64_t) (extra * share / slot_bytes[g]);
        slots.push_back((int) std::min(n, group_demand));
    }
    return slots;
}

}  // namespace

expert_budget::expert_budget(const expert_layout & layout, uint64_t budget, double low_share, const char * what)
    : budget_bytes(budget) {
    const int k = layout.n_expert_used;
    std::vector<uint64_t> high_bytes, low_bytes;
    uint64_t high_minimum = 0, low_minimum = 0;
    for (const expert_group & g : layout.groups) {
        high_bytes.push_back(expert_bytes_of(g.high));
        low_bytes.push_back(expert_bytes_of(g.low));
        high_minimum += (uint64_t) k * high_bytes.back();
        low_minimum += (uint64_t) (k - 1) * low_bytes.back();
    }
    const bool use_low = layout.has_low;
    minimum_bytes = high_minimum + (use_low ? low_minimum : 0);
    if (budget < minimum_bytes) {
        throw expert_budget_error(std::string(what) + " budget " + std::to_string(budget) + " bytes (" + mib(budget) +
            ") is below the minimum of " + std::to_string(minimum_bytes) + " bytes (" + mib(minimum_bytes) +
            "): one layer's top-" + std::to_string(k) + " experts must fit" +
            (layout.groups.size() > 1 ? " in each of the " + std::to_string(layout.groups.size()) +
                                        " pools of layers (one per device and expert shape)" : "") +
            (use_low ? " in HIGH, and all but one of them in LOW (" + std::to_string((int) (low_share * 100)) +
                       "% of the budget)" : ""));
    }
    uint64_t all_high = 0, all_low = 0;  // every copy
    for (size_t g = 0; g < layout.groups.size(); g++) {
        all_high += (uint64_t) layout.groups[g].n_layers * layout.n_expert * high_bytes[g];
        all_low += (uint64_t) layout.groups[g].n_layers * layout.n_expert * low_bytes[g];
    }
    // a budget that holds every copy holds both tiers whole (a host tier), whatever low_share says
    const uint64_t low_budget = !use_low ? 0 : budget >= all_high + all_low ? all_low :
        std::max(low_minimum, std::min((uint64_t) (budget * low_share), budget - high_minimum));
    high_slots = share_slots(budget - low_budget, k, high_bytes, layout.groups, layout.n_expert);
    if (use_low) low_slots = share_slots(low_budget, k - 1, low_bytes, layout.groups, layout.n_expert);
    if (layout.has_expert_bias) {
        for (int slots : high_slots) {
            if (slots >= layout.n_expert) continue;
            const int cap = slots / k;
            max_ubatch_tokens = max_ubatch_tokens == 0 ? cap : std::min(max_ubatch_tokens, cap);
        }
    }
}

tier_pools::tier_pools(const expert_layout & layout, const expert_budget & budget,
                       const std::vector<ggml_backend_buffer_type_t> & buft_of_group, bool repack) {
    for (size_t g = 0; g < layout.groups.size(); g++) {
        const ggml_backend_buffer_type_t buft = buft_of_group[g];
        high.push_back(std::make_unique<slot_pool>(layout.groups[g].high, budget.high_slots[g], buft, repack));
        if (layout.has_low) low.push_back(std::make_unique<slot_pool>(layout.groups[g].low, budget.low_slots[g], buft, repack));
    }
}

void tier_pools::lock_in_memory() {
    for (auto * pools : { &high, &low }) {
        for (auto & pool : *pools) pool->lock_in_memory();
    }
}

uint64_t tier_pools::group_bytes(int group) const {
    return high[group]->bytes() + (low.empty() ? 0 : low[group]->bytes());
}

uint64_t tier_pools::bytes(expert_precision p) const {
    uint64_t total = 0;
    for (const auto & pool : p == expert_precision::low ? low : high) total += pool->bytes();
    return total;
}

int tier_pools::slots(expert_precision p) const {
    int total = 0;
    for (const auto & pool : p == expert_precision::low ? low : high) total += pool->n_slots();
    return total;
}

int tier_pools::fewest_slots() const {
    int fewest = INT_MAX;
    for (const auto * pools : { &high, &low }) for (const auto & p : *pools) fewest = std::min(fewest, p->n_slots());
    return fewest;
}

std::vector<ggml_backend_buffer_type_t> pool_buffer_types(const expert_layout & layout,
                                                          const std::vector<ggml_backend_dev_t> & devices) {
    std::vector<ggml_backend_buffer_type_t> out;
    for (const expert_group & g : layout.groups) {
        out.push_back(devices.empty() ? nullptr : ggml_backend_dev_buffer_type(devices[g.home]));
    }
    return out;
}

std::vector<std::pair<std::string, uint64_t>> device_pool_bytes(const expert_layout & layout, const expert_budget & budget,
                                                                const std::vector<ggml_backend_dev_t> & devices) {
    std::vector<uint64_t> bytes(devices.size(), 0);
    for (size_t g = 0; g < layout.groups.size() && !devices.empty(); g++) {
        const expert_group & group = layout.groups[g];
        bytes[group.home] += (uint64_t) budget.high_slots[g] * expert_bytes_of(group.high) +
                             (layout.has_low ? (uint64_t) budget.low_slots[g] * expert_bytes_of(group.low) : 0);
    }
    std::vector<std::pair<std::string, uint64_t>> out;
    for (size_t d = 0; d < devices.size(); d++) {
        if (bytes[d] == 0) continue;
        const std::string name = ggml_backend_dev_name(devices[d]);
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(devices[d], &free, &total);
        if (bytes[d] > free) {
            throw expert_budget_error("the expert cache's pools on " + name + ", " + std::to_string(bytes[d]) + " bytes (" +
                                      mib(bytes[d]) + "), do not fit in its free memory: " + std::to_string(free) +
                                      " bytes (" + mib(free) + ") free of " + std::to_string(total));
        }
        out.emplace_back(name, bytes[d]);
    }
    return out;
}

expert_cache_config cache_config_of(const expert_layout & layout, const expert_budget & budget, const expert_options & o) {
    return { budget.high_slots, budget.low_slots, o.cache_policy, o.policy_weights, o.low_hit == low_hit_rule::accept,
             layout.n_layers, layout.layers_of_groups(), layout.n_expert, o.fate_shallow, layout.n_expert_used };
}
