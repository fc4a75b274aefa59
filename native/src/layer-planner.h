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
    std::vector<uint8_t> dropped;                  // per selection: left out by plan_rules::keep
    std::vector<std::vector<expert_demand>> waves;  // n_waves lists (later ones may be empty)
    std::string error;                              // an expert id out of range ("" if none)
};

// Waves a ubatch of n_tokens needs at most: its distinct experts (at most min(n_expert, n_tokens * k))
// over the HIGH tier's slots. With expert biases one wave (the ubatch is capped instead).
int waves_needed(int n_expert, int k, int64_t n_tokens, int high_slots, bool has_expert_bias);

// What decides the demands, besides the routing: HOBBIT's score rule (precision), and the seed
// systems' rules on top of it.
struct plan_rules {
    precision_params precision;
    // EdgeMoE's static map: per expert of the layer its only precision (null: the score rule)
    const expert_precision * fixed = nullptr;
    // Fate's prefill (ubatches of more than one token): experts in order of popularity (selections,
    // ties: first use), and the least popular ones covering at most this share of the selections LOW
    double prefill_low_share = 0;
    // MoBiLE's little pass: each token computes only its `keep` heaviest selections (0: all); the
    // others are dropped (demand skip, not wanted, never computed)
    int keep = 0;
};

// ids, weights: [n_tokens][k] expert ids and routing weights. served(expert, demand): a cached
// copy serves that demand; with several waves the served experts go first, so the loads of the
// first wave do not evict them before their use.
layer_plan plan_layer(const int32_t * ids, const float * weights, int64_t n_tokens, int k, int n_expert,
                      const plan_rules & rules, int n_waves, int high_slots,
                      const std::function<bool(int, expert_precision)> & served);
