// The plan of one MoE layer for one ubatch, as a pure function of its routing and the cache's
// state: each selection's demand (HOBBIT's precision rule), the distinct experts the layer needs
// (each with the highest demand of its tokens, in order of first use) and how they split into
// waves of at most one HIGH tier's worth of slots. No model, memory or I/O: calibration replays
// routing traces through it and tests call it directly.
#pragma once

#include "precision-policy.h"

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

using expert_demand = std::pair<int, expert_precision>;  // (expert id, demand)

struct layer_plan {
    std::vector<expert_precision> demand;          // per selection, [n_tokens][k]
    std::vector<std::vector<expert_demand>> waves;  // n_waves lists (later ones may be empty)
    std::string error;                              // an expert id out of range ("" if none)
};

// Waves a ubatch of n_tokens needs at most: its distinct experts (at most min(n_expert, n_tokens * k))
// over the HIGH tier's slots. With expert biases one wave (the ubatch is capped instead).
int waves_needed(int n_expert, int k, int64_t n_tokens, int high_slots, bool has_expert_bias);

// ids, weights: [n_tokens][k] expert ids and routing weights. served(expert, demand): a cached
// copy serves that demand; with several waves the served experts go first, so the loads of the
// first wave do not evict them before their use.
layer_plan plan_layer(const int32_t * ids, const float * weights, int64_t n_tokens, int k, int n_expert,
                      const precision_params & precision, int n_waves, int high_slots,
                      const std::function<bool(int, expert_precision)> & served);
