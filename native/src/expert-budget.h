// How a byte budget becomes slots: the minimum a budget must reach, the LOW tier's share, and the
// slots each group of same-shaped layers gets in each tier.
#pragma once

#include "expert-cache.h"
#include "expert-layout.h"
#include "expert-options.h"
#include "slot-pool.h"

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

struct expert_budget {
    // Every selection of a token may be HIGH, all but the top-1 may be LOW: per group, top-k HIGH
    // slots and top-k - 1 LOW slots at least. The LOW tier gets low_share of the budget (but at
    // least its minimum and at most what the HIGH minimum leaves; all its copies where the budget
    // holds every copy of both); each tier's rest is shared in proportion to the groups' expert
    // bytes, and no group gets more slots than it has experts.
    // Throws expert_budget_error (with the minimum) below the minimum.
    // what: the budget's name in the error ("expert cache", "host cache").
    expert_budget(const expert_layout & layout, uint64_t budget_bytes, double low_share, const char * what = "expert cache");

    uint64_t budget_bytes = 0, minimum_bytes = 0;
    std::vector<int> high_slots, low_slots;  // per group (low_slots empty without LOW copies)
    // With expert biases (added by expert id to every row, also to rows a wave skips) a ubatch's
    // experts must fit in one wave: the most tokens per ubatch for that; 0 = no limit.
    int max_ubatch_tokens = 0;
};

// One tier's memory as a budget sizes it: per group a HIGH pool and, with LOW copies, a LOW pool.
struct tier_pools {
    // each group's in its buffer type, buft_of_group[group] (null: page-aligned host memory,
    // repacked where the model's weights are, if repack)
    tier_pools(const expert_layout & layout, const expert_budget & budget,
               const std::vector<ggml_backend_buffer_type_t> & buft_of_group, bool repack);

    const slot_pool & pool(int group, expert_precision p) const { return p == expert_precision::low ? *low[group] : *high[group]; }
    uint64_t bytes(expert_precision p) const;  // summed over the groups
    int slots(expert_precision p) const;       // summed over the groups
    int fewest_slots() const;                  // of any one pool
    uint64_t group_bytes(int group) const;     // a group's pools, both tiers
    void lock_in_memory();                     // every pool's host memory (slot_pool::lock_in_memory)

    std::vector<std::unique_ptr<slot_pool>> high, low;  // per group (low: empty without LOW copies)
};

// Each group's buffer type for its pools: its home device's (devices none: null, host memory).
std::vector<ggml_backend_buffer_type_t> pool_buffer_types(const expert_layout & layout,
                                                          const std::vector<ggml_backend_dev_t> & devices);
// Per device that homes a group: its name and the bytes of the pools this budget puts there. Throws
// expert_budget_error for a device whose free memory they exceed.
std::vector<std::pair<std::string, uint64_t>> device_pool_bytes(const expert_layout & layout, const expert_budget & budget,
                                                                const std::vector<ggml_backend_dev_t> & devices);

// The device cache of this budget: its slots per group and tier, and the options' eviction policy.
expert_cache_config cache_config_of(const expert_layout & layout, const expert_budget & budget, const expert_options & o);
