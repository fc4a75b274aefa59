#include "residency-info.h"

void describe_residency(expert_residency_info & info, const expert_layout & layout, const expert_budget & budget,
                        const tier_pools & pools, const host_tier * host, expert_io io, int predictor_depth) {
    info.budget_bytes = budget.budget_bytes;
    info.minimum_bytes = budget.minimum_bytes;
    info.high_pool_bytes = pools.bytes(expert_precision::high);
    info.low_pool_bytes = pools.bytes(expert_precision::low);
    info.high_slots = pools.slots(expert_precision::high);
    info.low_slots = pools.slots(expert_precision::low);
    if (host) {
        info.host_pool_bytes = host->bytes();
        info.host_high_slots = host->pools.slots(expert_precision::high);
        info.host_low_slots = host->pools.slots(expert_precision::low);
    }
    info.expert_bytes = layout.high_bytes, info.low_expert_bytes = layout.low_bytes;
    info.n_expert = layout.n_expert, info.n_expert_used = layout.n_expert_used, info.n_layers = layout.n_layers;
    info.max_ubatch_tokens = budget.max_ubatch_tokens;
    info.io = io;
    info.mixed_precision = layout.has_low;
    info.low_source = layout.low_source;
    info.predictor_depth = predictor_depth;
}
