// What the routing did, for telemetry and calibration: how well the predictor guessed each layer's
// experts (per depth ahead) and, while tracing, every token's routing at every MoE layer.
#pragma once

#include "stats.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

struct predicted_logits;

class routing_recorder {
public:
    explicit routing_recorder(int depth) : prediction_stats_(depth) {}

    // The predictor's top-k guesses (ids [n_tokens][k]) for layer target_il, made depth + 1 layers
    // ahead of it (of n_depths), scored when that layer runs.
    void remember(int target_il, size_t depth, size_t n_depths, std::vector<int32_t> ids);
    // The same for the stacked routers' predictions of the layers `ahead` (nearest first): each
    // token's top-k of its predicted logits.
    void remember_predicted(const std::vector<int> & ahead, const predicted_logits & logits, int64_t n_tokens, int k);
    // Layer il routed ids / weights [n_tokens][k] in the ubatch-th ubatch: scores the guesses for
    // it, records the trace while tracing, forgets the guesses.
    void on_layer(int il, int32_t ubatch, const int32_t * ids, const float * weights, int64_t n_tokens, int k);
    // The same layer's input (F32 rows of width floats, row_stride bytes apart), recorded while tracing inputs.
    void on_inputs(const char * rows, int64_t width, size_t row_stride, int64_t n_tokens);

    std::vector<expert_prediction_stats> prediction_stats() const;  // per depth 1..p
    void reset_stats();
    void set_tracing(bool on, bool inputs = false) { tracing_ = on; tracing_inputs_ = on && inputs; }
    bool tracing() const { return tracing_; }
    routing_trace take_trace();

private:
    std::map<int, std::vector<std::vector<int32_t>>> guesses_;  // by target layer: [depth][token * k]; op thread only
    mutable std::mutex mutex_;                                  // what Python reads: the stats and the trace
    std::vector<expert_prediction_stats> prediction_stats_;
    routing_trace trace_;
    std::atomic<bool> tracing_{false}, tracing_inputs_{false};
};
