// The plan of one MoE layer for one ubatch, as a pure function of its routing and the cache's
// state: each selection's demand (HOBBIT's precision rule), the distinct experts the layer needs
// (each with the highest demand of its tokens, in order of first use) and how they split into
// waves of at most one HIGH tier's worth of slots. No model, memory or I/O: calibration replays
// routing traces through it and tests call it directly.
#pragma once

#include "cache-standin.h"
#include "precision-policy.h"

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

using expert_demand = std::pair<int, expert_precision>;  // (expert id, demand)

struct layer_plan {
    std::vector<int32_t> ids;                      // per selection, [n_tokens][k]: its expert (cache routing may change it)
    std::vector<expert_precision> demand;          // per selection, [n_tokens][k]
    std::vector<uint8_t> dropped;                  // per selection: left out by plan_rules::keep or a stand-in table
    std::vector<float> scale;                      // per selection: its output's scale over the graph's weight
    std::vector<std::vector<expert_demand>> waves;  // n_waves lists (later ones may be empty)
    std::string error;                              // an expert id out of range ("" if none)
    int stand_in_swaps = 0, stand_in_drops = 0;     // selections a stand-in table gave another expert, or dropped
};

// Waves a ubatch of n_tokens needs at most: its distinct experts (at most min(n_expert, n_tokens * k))
// over the HIGH tier's slots. With expert biases one wave (the ubatch is capped instead).
int waves_needed(int n_expert, int k, int64_t n_tokens, int high_slots, bool has_expert_bias);

// How a layer of one pool group splits a ubatch into waves.
struct wave_shape {
    int n_expert = 0, k = 0;
    bool has_expert_bias = false, has_low = false;
    bool coop = false;
    int slots = 0;      // a wave's distinct experts may take: the device's HIGH slots (coop: and the host tier's)
    int low_slots = 0;  // the device's LOW slots

    // Whether a ubatch of n_tokens runs in pipelined waves: it needs several waves (a prefill under
    // a small cache) on one tier, so each wave takes half the slots and the next wave's reads (its
    // planned experts, in their planned precisions) run in the other half while it computes.
    // With LOW copies, so does a ubatch that needs most experts where both tiers hold them once but
    // not twice: no slots would be left to read the next layer ahead, so the layer reads its own
    // second half while its first computes.
    bool pipelined(int64_t n_tokens) const;
    int wave_size(int64_t n_tokens) const { return slots / (pipelined(n_tokens) ? 2 : 1); }  // most distinct experts per wave
    int waves(int64_t n_tokens) const { return waves_needed(n_expert, k, n_tokens, wave_size(n_tokens), has_expert_bias); }
};

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
    // the model normalizes its top-k weights: with keep, a token routed to fewer experts normalizes
    // over those (its output scaled by all its weights over the kept ones); else 1
    bool weights_normalized = false;
    // cache-aware routing (cache-routing.h): λ (0: off) and per token the router's n_expert
    // probabilities; a cached expert is one that `served` says serves a HIGH demand. The demands
    // and the other rules apply to the routing it leaves, with that routing's weights.
    double cache_routing = 0;
    const float * probs = nullptr;
    // cache-aware routing by calibrated stand-ins (cache-standin.h; null: off), after Cache-Prior
    const stand_in_table * stand_ins = nullptr;
};

// ids, weights: [n_tokens][k] expert ids and routing weights. served(expert, demand): a cached
// copy serves that demand; with several waves the served experts go first, so the loads of the
// first wave do not evict them before their use; cache routing prefers them.
layer_plan plan_layer(const int32_t * ids, const float * weights, int64_t n_tokens, int k, int n_expert,
                      const plan_rules & rules, int n_waves, int high_slots,
                      const std::function<bool(int, expert_precision)> & served);

// Per demand of a wave (one of plan.waves), its expert's selections in the plan that are not dropped:
// the tokens computing it.
std::vector<int> tokens_of(const layer_plan & plan, const std::vector<expert_demand> & wave);

// What decides each layer's demands besides its routing, in a running residency: the options' rules,
// EdgeMoE's static map and which layers' models normalize their top-k weights (read off the graph).
struct layer_rules {
    precision_params precision;
    double prefill_low_share = 0;
    bool decode_batch = false;  // the batches computed now are decode steps: prefill_low_share is not theirs
    double cache_routing = 0;
    std::vector<std::vector<expert_precision>> fixed;  // per il: EdgeMoE's static map (empty: none)
    std::vector<uint8_t> weights_normalized;           // per il: llama.cpp normalizes its top-k weights
    std::vector<stand_in_table> stand_ins;             // per il: the calibrated stand-ins (empty: none)

    // layer il's rules; keep: MoBiLE's little pass's (0: every selection is computed); probs: the
    // router's probabilities, [n_tokens][n_expert] (cache routing)
    plan_rules of(int il, int keep = 0, const float * probs = nullptr) const;
    // the precision of expert e of layer il: the static map's, else `otherwise`
    expert_precision fixed_or(int il, int e, expert_precision otherwise) const {
        return fixed.empty() || fixed[il].empty() ? otherwise : fixed[il][e];
    }
};

// EdgeMoE's static precision map over n_layers (MoE layers `layers`, n_expert each): the experts
// listed per il LOW, the others HIGH. Throws std::invalid_argument for a layer without experts or
// an expert that does not exist.
std::vector<std::vector<expert_precision>> static_precision_map(const std::map<int, std::vector<int>> & low,
                                                                const std::vector<int> & layers, int n_layers, int n_expert);
