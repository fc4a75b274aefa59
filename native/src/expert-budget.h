// How a byte budget becomes slots: the minimum a budget must reach, the LOW tier's share, and the
// slots each group of same-shaped layers gets in each tier.
#pragma once

#include "expert-layout.h"
#include "expert-options.h"

#include <cstdint>
#include <vector>

struct expert_budget {
    // Every selection of a token may be HIGH, all but the top-1 may be LOW: per group, top-k HIGH
    // slots and top-k - 1 LOW slots at least. The LOW tier gets low_share of the budget (but at
    // least its minimum and at most what the HIGH minimum leaves); each tier's rest is shared in
    // proportion to the groups' expert bytes, and no group gets more slots than it has experts.
    // Throws expert_budget_error (with the minimum) below the minimum.
    // what: the budget's name in the error ("expert cache", "host cache").
    expert_budget(const expert_layout & layout, uint64_t budget_bytes, double low_share, const char * what = "expert cache");

    uint64_t budget_bytes = 0, minimum_bytes = 0;
    std::vector<int> high_slots, low_slots;  // per group (low_slots empty without LOW copies)
    // With expert biases (added by expert id to every row, also to rows a wave skips) a ubatch's
    // experts must fit in one wave: the most tokens per ubatch for that; 0 = no limit.
    int max_ubatch_tokens = 0;
};
