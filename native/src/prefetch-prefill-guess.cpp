// Fate's prefill guess (Fate sec. 4.3, prefill stage; sec. 4.5, quantization for I/O): with LOW
// copies, a prefill ubatch that needs nearly every expert of the next MoE layer plans that layer
// from its predicted routing (the stacked routers' top-k of each token, weighted by their softmax)
// with the layer's rules (the score rule, prefill_low_share's least popular LOW), and reads the planned
// experts in their planned precisions into the slots this layer leaves after its last wave.
#include "prefetch-strategy.h"

#include "expert-layout.h"
#include "prefetch-coordinator.h"

#include <algorithm>

namespace {

class prefill_guess final : public prefetch_strategy {
public:
    explicit prefill_guess(const prefetch_env & env) : env_(env) {}

    const char * name() const override { return "prefill-guess"; }

    void after_wave(const served_wave & w) override {
        if (w.predicted) plan(env_.predictor->ahead(w.layer.il)[0], w.predicted, w.n_tokens);
        const moe_layer_layout * next = w.next_layer_to_read(env_.layout);
        if (next && !guess_.empty() && guess_[0].layer == next->il) env_.coordinator.prefetch(guess_);
    }

private:
    // the plan of layer `next` for a ubatch of n_tokens from its predicted logits (row depth 0)
    void plan(int next, const predicted_logits & logits, int64_t n_tokens) {
        const expert_layout & layout = env_.layout;
        guess_.clear();
        if (!layout.has_low || !needs_most_experts(n_tokens, layout.n_expert_used, layout.n_expert)) return;
        const int k = layout.n_expert_used;
        std::vector<int32_t> ids((size_t) n_tokens * k);
        std::vector<float> w((size_t) n_tokens * k);
        std::vector<int> top;
        std::vector<float> top_w;
        for (int64_t t = 0; t < n_tokens; t++) {
            predicted_top_k(logits.row(t, 0), layout.n_expert, k, top, top_w);
            std::copy(top.begin(), top.end(), ids.begin() + t * k);
            std::copy(top_w.begin(), top_w.end(), w.begin() + t * k);
        }
        const layer_plan plan = plan_layer(ids.data(), w.data(), n_tokens, k, layout.n_expert, env_.rules.of(next), 1, 0,
                                           [](int, expert_precision) { return false; });
        for (const auto & [e, demand] : plan.waves[0]) {
            if (demand != expert_precision::skip) guess_.push_back({ next, e, demand });
        }
    }

    prefetch_env env_;
    std::vector<predicted_expert> guess_;  // the next layer's planned experts (empty: none)
};

}  // namespace

std::unique_ptr<prefetch_strategy> make_prefill_guess(const prefetch_env & env) { return std::make_unique<prefill_guess>(env); }
