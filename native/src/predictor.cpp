#include "predictor.h"

#include "llama.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>

namespace {

const ggml_tensor * router_of(const llama_model * model, int il, int n_expert) {
    const std::string name = "blk." + std::to_string(il) + ".ffn_gate_inp.weight";
    for (const auto & [n, t] : llama_internal_get_tensor_map(model)) {
        if (n == name && t->ne[1] == n_expert && ggml_n_dims(t) == 2) return t;
    }
    throw std::runtime_error("expert prediction: no router " + name + " of " + std::to_string(n_expert) + " experts");
}

// the router of layer il as F32 rows [n_expert][n_embd], from whatever type the model keeps it in
std::vector<float> router_as_f32(const llama_model * model, int il, int64_t * n_embd, int n_expert) {
    const ggml_tensor * t = router_of(model, il, n_expert);
    const std::string name = ggml_get_name(t);
    *n_embd = t->ne[0];
    std::vector<uint8_t> raw(ggml_nbytes(t));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    std::vector<float> out((size_t) t->ne[0] * t->ne[1]);
    const auto * traits = ggml_get_type_traits(t->type);
    if (t->type == GGML_TYPE_F32) {
        memcpy(out.data(), raw.data(), out.size() * sizeof(float));
    } else if (traits->to_float) {
        for (int64_t r = 0; r < t->ne[1]; r++) traits->to_float(raw.data() + r * t->nb[1], out.data() + r * t->ne[0], t->ne[0]);
    } else {
        throw std::runtime_error("expert prediction: cannot read router " + name + " of type " + ggml_type_name(t->type));
    }
    return out;
}

}  // namespace

expert_predictor::expert_predictor(const llama_model * model, const std::vector<int> & layers, int depth, int n_expert)
    : depth_(depth) {
    size_t n_tensors = 0;
    for (size_t i = 0; i + 1 < layers.size(); i++) {
        for (size_t j = i + 1; j < layers.size() && (int) (j - i) <= depth; j++) ahead_[layers[i]].push_back(layers[j]);
        n_tensors++;
    }
    if (ahead_.empty()) return;  // one MoE layer: none ahead to predict (and nothing to allocate)
    if (depth == 1) {
        // one layer ahead: the next layer's own router, nothing to stack
        for (const auto & [il, next] : ahead_) stacked_[il] = const_cast<ggml_tensor *>(router_of(model, next[0], n_expert));
        return;
    }
    std::map<int, std::vector<float>> routers;
    int64_t n_embd = 0;
    for (int il : layers) routers[il] = router_as_f32(model, il, &n_embd, n_expert);
    ggml_init_params params = { ggml_tensor_overhead() * (n_tensors + 1), nullptr, /*no_alloc*/ true };
    ctx_ = ggml_init(params);
    for (const auto & [il, next] : ahead_) {
        ggml_tensor * t = ggml_new_tensor_2d(ctx_, GGML_TYPE_F32, n_embd, (int64_t) n_expert * next.size());
        ggml_format_name(t, "edgemoe_predictor-%d", il);
        stacked_[il] = t;
    }
    buffer_ = ggml_backend_alloc_ctx_tensors_from_buft(ctx_, ggml_backend_cpu_buffer_type());
    if (!buffer_) {
        ggml_free(ctx_);
        throw std::runtime_error("expert prediction: cannot allocate the stacked routers");
    }
    ggml_backend_buffer_set_usage(buffer_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    for (const auto & [il, next] : ahead_) {
        for (size_t d = 0; d < next.size(); d++) {
            const std::vector<float> & r = routers[next[d]];
            ggml_backend_tensor_set(stacked_[il], r.data(), d * r.size() * sizeof(float), r.size() * sizeof(float));
        }
    }
}

expert_predictor::~expert_predictor() {
    if (buffer_) ggml_backend_buffer_free(buffer_);
    if (ctx_) ggml_free(ctx_);
}

ggml_tensor * expert_predictor::stacked(int il) const {
    auto it = stacked_.find(il);
    return it == stacked_.end() ? nullptr : it->second;
}

const std::vector<int> & expert_predictor::ahead(int il) const {
    static const std::vector<int> none;
    auto it = ahead_.find(il);
    return it == ahead_.end() ? none : it->second;
}

void predicted_top_k(const float * logits, int n_expert, int k, std::vector<int> & ids, std::vector<float> & weights) {
    ids.resize(n_expert);
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int a, int b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    ids.resize(k);
    const float top = logits[ids[0]];
    double total = 0;
    for (int e = 0; e < n_expert; e++) total += std::exp((double) logits[e] - top);
    weights.resize(k);
    for (int i = 0; i < k; i++) weights[i] = (float) (std::exp((double) logits[ids[i]] - top) / total);
}

std::vector<predicted_expert> predict_layer(int layer, const float * logits, int n_expert, int k,
                                            const precision_params & precision, int fate_extra, double fate_percentile) {
    std::vector<int> ids;
    std::vector<float> w;
    predicted_top_k(logits, n_expert, std::min(n_expert, k + fate_extra), ids, w);
    std::vector<expert_precision> demand(k);
    choose_precisions(w.data(), k, precision, demand.data());
    std::vector<predicted_expert> out;
    for (int i = 0; i < k; i++) {
        if (demand[i] != expert_precision::skip) out.push_back({ layer, ids[i], demand[i] });
    }
    if (fate_extra > 0 && demand[k - 1] != expert_precision::skip) {
        // the smallest probability among the top (1 - q) share of the experts
        std::vector<float> sorted;
        std::vector<int> all_ids;
        predicted_top_k(logits, n_expert, n_expert, all_ids, sorted);
        const size_t n_above = (size_t) std::ceil((1.0 - fate_percentile) * n_expert - 1e-9);
        const float threshold = sorted[std::min<size_t>(n_expert - 1, n_above > 0 ? n_above - 1 : 0)];
        for (size_t i = k; i < ids.size() && w[i] >= threshold; i++) out.push_back({ layer, ids[i], demand[k - 1] });
    }
    return out;
}

std::vector<predicted_expert> walk_predictions(const std::vector<std::vector<predicted_expert>> & layers_ahead,
                                               bool walk_further,
                                               const std::function<bool(const predicted_expert &)> & cached) {
    std::vector<predicted_expert> out;
    for (const auto & layer : layers_ahead) {
        bool all_cached = true;
        for (const auto & p : layer) {
            out.push_back(p);
            all_cached = all_cached && cached(p);
        }
        if (!all_cached || !walk_further) break;
    }
    return out;
}
