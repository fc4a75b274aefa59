#include "routing-recorder.h"

#include "predictor.h"

#include <algorithm>

void routing_recorder::remember(int target_il, size_t depth, size_t n_depths, std::vector<int32_t> ids) {
    auto & guesses = guesses_[target_il];
    guesses.resize(n_depths);
    guesses[depth] = std::move(ids);
}

void routing_recorder::remember_predicted(const std::vector<int> & ahead, const predicted_logits & logits, int64_t n_tokens,
                                          int k) {
    std::vector<int> top;
    std::vector<float> w;
    for (size_t d = 0; d < ahead.size(); d++) {
        std::vector<int32_t> guesses(n_tokens * k);
        for (int64_t t = 0; t < n_tokens; t++) {
            predicted_top_k(logits.row(t, d), logits.n_expert, k, top, w);
            std::copy(top.begin(), top.end(), guesses.begin() + t * k);
        }
        remember(ahead[d], d, ahead.size(), std::move(guesses));
    }
}

void routing_recorder::on_layer(int il, int32_t ubatch, const int32_t * ids, const float * weights, int64_t n_tokens, int k) {
    auto it = guesses_.find(il);
    const size_t n = (size_t) n_tokens * k;
    std::lock_guard<std::mutex> lock(mutex_);
    if (it != guesses_.end()) {
        for (size_t d = 0; d < it->second.size(); d++) {
            const std::vector<int32_t> & guess = it->second[d];
            if (guess.size() != n) continue;  // made for another ubatch
            expert_prediction_stats & ps = prediction_stats_[d];
            for (int64_t t = 0; t < n_tokens; t++) {
                const int32_t * row = ids + t * k;
                ps.tokens++;
                ps.top1_correct += guess[t * k] == row[0];
                ps.predicted += k;
                ps.actual += k;
                for (int i = 0; i < k; i++) ps.overlap += std::find(row, row + k, guess[t * k + i]) != row + k;
            }
        }
    }
    if (tracing_) {
        const std::vector<int32_t> * guess = it != guesses_.end() && !it->second.empty() && it->second[0].size() == n
            ? &it->second[0] : nullptr;
        for (int64_t t = 0; t < n_tokens; t++) {
            trace_.ubatch.push_back(ubatch);
            trace_.layer.push_back(il);
        }
        trace_.ids.insert(trace_.ids.end(), ids, ids + n);
        trace_.weights.insert(trace_.weights.end(), weights, weights + n);
        if (guess) trace_.predicted.insert(trace_.predicted.end(), guess->begin(), guess->end());
        else trace_.predicted.insert(trace_.predicted.end(), n, -1);
    }
    if (it != guesses_.end()) guesses_.erase(it);
}

void routing_recorder::on_inputs(const char * rows, int64_t width, size_t row_stride, int64_t n_tokens) {
    if (!tracing_inputs_) return;
    std::lock_guard<std::mutex> lock(mutex_);
    trace_.input_width = width;
    for (int64_t t = 0; t < n_tokens; t++) {
        const float * row = (const float *) (rows + t * row_stride);
        trace_.inputs.insert(trace_.inputs.end(), row, row + width);
    }
}

std::vector<expert_prediction_stats> routing_recorder::prediction_stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return prediction_stats_;
}

void routing_recorder::reset_stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto & s : prediction_stats_) s = expert_prediction_stats();
}

routing_trace routing_recorder::take_trace() {
    std::lock_guard<std::mutex> lock(mutex_);
    routing_trace out = std::move(trace_);
    trace_ = routing_trace();
    return out;
}
