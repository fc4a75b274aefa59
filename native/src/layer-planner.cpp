#include "layer-planner.h"

#include <algorithm>
#include <unordered_map>

int waves_needed(int n_expert, int k, int64_t n_tokens, int high_slots, bool has_expert_bias) {
    if (has_expert_bias) return 1;
    const int64_t most = std::min<int64_t>(n_expert, n_tokens * k);
    return (int) ((most + high_slots - 1) / high_slots);
}

layer_plan plan_layer(const int32_t * ids, const float * weights, int64_t n_tokens, int k, int n_expert,
                      const precision_params & precision, int n_waves, int high_slots,
                      const std::function<bool(int, expert_precision)> & served) {
    layer_plan plan;
    const bool all_high = !precision.use_low && !precision.use_skip;
    plan.demand.assign((size_t) n_tokens * k, expert_precision::high);
    std::vector<expert_demand> wanted;
    std::unordered_map<int, size_t> index_of;
    for (int64_t t = 0; t < n_tokens; t++) {
        expert_precision * demand = &plan.demand[t * k];
        if (!all_high) choose_precisions(weights + t * k, k, precision, demand);
        for (int i = 0; i < k; i++) {
            const int e = ids[t * k + i];
            if (e < 0 || e >= n_expert) {
                plan.error = "router chose expert " + std::to_string(e) + " out of " + std::to_string(n_expert);
                return plan;
            }
            auto [it, inserted] = index_of.emplace(e, wanted.size());
            if (inserted) wanted.emplace_back(e, demand[i]);
            else wanted[it->second].second = std::max(wanted[it->second].second, demand[i]);
        }
    }
    if (n_waves > 1) {
        std::stable_partition(wanted.begin(), wanted.end(), [&](const expert_demand & e) { return served(e.first, e.second); });
    }
    plan.waves.assign(std::max(1, n_waves), {});
    const size_t per_wave = n_waves <= 1 ? wanted.size() : (size_t) high_slots;
    for (size_t i = 0; i < wanted.size(); i++) plan.waves[i / per_wave].push_back(wanted[i]);
    return plan;
}
