// HOBBIT's layer-level expert predictor (sec. 3.3): the gate inputs of consecutive layers are
// similar, so layer l's gate input times the routers of layers l+1..l+p predicts their experts.
// The p routers are stacked into one matrix per layer, so one matmul in the graph gives all p
// predictions (the "stacking computer").
#pragma once

#include "precision-policy.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <functional>
#include <map>
#include <vector>

struct llama_model;

class expert_predictor {
public:
    // The routers of the MoE layers `layers` (ascending) of model, depth p >= 1: with p = 1 the
    // model's own router tensors, else F32 copies stacked per layer. Throws std::runtime_error
    // when a router is missing or has another shape.
    expert_predictor(const llama_model * model, const std::vector<int> & layers, int depth, int n_expert);
    ~expert_predictor();
    expert_predictor(const expert_predictor &) = delete;
    expert_predictor & operator=(const expert_predictor &) = delete;

    int depth() const { return depth_; }
    // [n_embd, n_expert * n_ahead(il)]: the routers of the MoE layers after il; null for the last
    ggml_tensor * stacked(int il) const;
    // the MoE layers predicted at il, nearest first (at most depth)
    const std::vector<int> & ahead(int il) const;

private:
    int depth_;
    ggml_context * ctx_ = nullptr;
    ggml_backend_buffer_t buffer_ = nullptr;
    std::map<int, ggml_tensor *> stacked_;
    std::map<int, std::vector<int>> ahead_;
};

// The stacking computer's output in a layer's op: per token, a row of n_expert predicted router
// logits for each layer ahead (nearest first); tokens row_bytes apart. data null: no prediction.
struct predicted_logits {
    const char * data = nullptr;
    size_t row_bytes = 0;
    int n_expert = 0;

    explicit operator bool() const { return data != nullptr; }
    const float * row(int64_t t, size_t depth) const { return (const float *) (data + t * row_bytes) + depth * n_expert; }
};

// The top-k experts of one predicted router-logit row, best first, with their softmax weights.
void predicted_top_k(const float * logits, int n_expert, int k, std::vector<int> & ids, std::vector<float> & weights);

// One predicted expert of a layer ahead, in the precision the score rule gives its predicted weight.
struct predicted_expert {
    int layer;
    int expert;
    expert_precision precision;
};

// A layer's predicted experts from its predicted router logits: the top-k in the precision the
// score rule gives their softmax weights, SKIP left out; with fate_extra > 0 (Fate) also up to
// fate_extra more whose probability is above the fate_percentile quantile of the layer's, in the
// k-th's precision.
std::vector<predicted_expert> predict_layer(int layer, const float * logits, int n_expert, int k,
                                            const precision_params & precision, int fate_extra,
                                            double fate_percentile);

// HOBBIT's adaptive walk (sec. 3.3): the nearest layer's predictions; if every one of them is
// cached, the next layer's too, and so on (walk_further false: the nearest layer only, as Fate).
// Returns the predictions walked: the cached ones are to be pinned, the others prefetched.
std::vector<predicted_expert> walk_predictions(const std::vector<std::vector<predicted_expert>> & layers_ahead,
                                               bool walk_further,
                                               const std::function<bool(const predicted_expert &)> & cached);
