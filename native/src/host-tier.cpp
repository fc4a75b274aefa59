#include "host-tier.h"

#include "layer-planner.h"

#include <unordered_map>

ggml_backend_buffer_type_t pinned_or_host(ggml_backend_dev_t device) {
    ggml_backend_buffer_type_t buft = ggml_backend_dev_host_buffer_type(device);
    return buft ? buft : ggml_backend_cpu_buffer_type();
}

host_tier::host_tier(const expert_layout & layout, uint64_t budget_bytes, double low_share, ggml_backend_dev_t device,
                     bool cpu_computes, bool repack)
    : budget(layout, budget_bytes, low_share, "host cache"),
      // coop: plain host pools (buft null), repacked as the model's CPU weights are; gpu: pinned
      pools(layout, budget, std::vector<ggml_backend_buffer_type_t>(layout.groups.size(), cpu_computes ? nullptr : pinned_or_host(device)),
            cpu_computes && repack),
      cache({ budget.high_slots, budget.low_slots, cache_policy_kind::lru, kEqualHobbitWeights, /*low_serves_high*/ false,
              layout.n_layers }),
      pins(cache, /*hard*/ true) {}

std::vector<expert_cache::placement> host_tier::copies_for(int group, int il,
                                                           const std::vector<const expert_cache::placement *> & loads) {
    std::vector<expert_demand> wanted;
    for (const auto * p : loads) wanted.emplace_back(p->expert, p->precision);
    std::vector<expert_cache::placement> placed;
    try {
        placed = cache.place(group, il, wanted);
    } catch (const std::exception &) {
        // too few host slots for this wave's loads: they go straight to the device
        return std::vector<expert_cache::placement>(loads.size(), expert_cache::placement{ -1, expert_precision::skip, -1, false });
    }
    std::unordered_map<int, const expert_cache::placement *> by_expert;
    for (const auto & p : placed) by_expert[p.expert] = &p;
    std::vector<expert_cache::placement> out;
    for (const auto * d : loads) {
        expert_cache::placement h = *by_expert.at(d->expert);
        // a HIGH copy serving a LOW demand cannot fill a LOW device slot: read that one directly
        if (h.precision != d->precision) h = { d->expert, expert_precision::skip, -1, false };
        else pins.add({ make_expert_key(il, d->expert), h.precision });
        out.push_back(h);
    }
    return out;
}
