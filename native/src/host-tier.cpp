#include "host-tier.h"

host_tier::host_tier(const expert_layout & layout, uint64_t budget_bytes, double low_share, ggml_backend_dev_t device)
    : budget(layout, budget_bytes, low_share, "host cache"),
      cache({ budget.high_slots, budget.low_slots, cache_policy_kind::lru, kEqualHobbitWeights, /*low_serves_high*/ false,
              layout.n_layers }),
      pins(cache, /*hard*/ true) {
    // pinned memory where the device has it: uploads from it are direct
    ggml_backend_buffer_type_t buft = ggml_backend_dev_host_buffer_type(device);
    if (!buft) buft = ggml_backend_cpu_buffer_type();
    for (size_t g = 0; g < layout.groups.size(); g++) {
        high_pools.push_back(std::make_unique<slot_pool>(layout.groups[g].high, budget.high_slots[g], buft, false));
        if (layout.has_low) low_pools.push_back(std::make_unique<slot_pool>(layout.groups[g].low, budget.low_slots[g], buft, false));
    }
}

uint64_t host_tier::bytes() const {
    uint64_t total = 0;
    for (const auto & p : high_pools) total += p->bytes();
    for (const auto & p : low_pools) total += p->bytes();
    return total;
}
