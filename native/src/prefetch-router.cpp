// HOBBIT's and Fate's decode prefetch from the stacked routers' predictions (HOBBIT sec. 3.3, Fate
// sec. 4.3). HOBBIT walks: the nearest layer's predicted experts, and while all of them are cached
// the next layer's, up to prefetch_depth. Fate predicts the next layer only, with extra experts
// above a percentile of its predicted probabilities, as many as the compute between two layers
// hides (overlap-meter.h). The predictions walked are pinned until their layer runs; those not
// cached are prefetched into reserved slots.
#include "prefetch-strategy.h"

#include "expert-cache.h"
#include "expert-layout.h"
#include "overlap-meter.h"
#include "prefetch-coordinator.h"

#include <algorithm>

namespace {

class router_prefetch final : public prefetch_strategy {
public:
    router_prefetch(const prefetch_env & env, bool fate) : env_(env), fate_(fate) {}

    const char * name() const override { return fate_ ? "fate" : "hobbit"; }

    void on_layer_began(clock::time_point t0, int32_t ubatch) override { overlap_.layer_began(t0, ubatch); }
    void on_experts_read(int n, double ms) override { overlap_.experts_read(n, ms); }
    void on_wave_ended(clock::time_point now, int32_t ubatch) override { overlap_.layer_ended(now, ubatch); }

    void after_wave(const served_wave & w) override {
        prefetch_coordinator & coordinator = env_.coordinator;
        // prefetching serves decode
        if (!w.predicted || !coordinator.prefetching() || w.n_tokens != 1 || coordinator.judged_useless()) return;
        const expert_options & o = env_.options;
        const std::vector<int> & ahead = env_.predictor->ahead(w.layer.il);
        const int k = env_.layout.n_expert_used;
        // Fate's extra experts: as many as the compute between layers hides (its N_max beyond the
        // top-k, measured as the run goes), at most fate_extra (-1: k). With LOW copies or skips a
        // measured time must not decide what is cached: fate_extra, -1 none (measured faster than k)
        const int extra = !fate_ ? 0 : o.lossy() ? std::max(0, o.fate_extra)
            : std::min(o.fate_extra < 0 ? k : o.fate_extra, std::max(0, overlap_.hidden_experts() - k));
        std::vector<std::vector<predicted_expert>> predicted_layers;
        for (size_t d = 0; d < ahead.size(); d++) {
            predicted_layers.push_back(predict_layer(ahead[d], w.predicted.row(0, d), env_.layout.n_expert, k, o.precision(),
                                                     extra, o.fate_percentile));
            for (auto & p : predicted_layers.back()) p.precision = env_.rules.fixed_or(p.layer, p.expert, p.precision);
        }
        coordinator.prefetch(walk_predictions(predicted_layers, !fate_, [&](const predicted_expert & p) {
            const int group = env_.layout.layer_at(p.layer)->group;
            return env_.cache.serving_tier(group, make_expert_key(p.layer, p.expert), p.precision) != expert_precision::skip;
        }), /*judged*/ true);
    }

private:
    prefetch_env env_;
    bool fate_;
    overlap_meter overlap_;  // Fate's bound on its extra prefetches
};

}  // namespace

std::unique_ptr<prefetch_strategy> make_router_prefetch(const prefetch_env & env, bool fate) {
    return std::make_unique<router_prefetch>(env, fate);
}
