// EdgeMoE's decode prefetch (EdgeMoE sec. 3.3.2): the next MoE layer's experts from the path
// statistics (path-predictor.h) of what each token of the ubatch activated at this layer and the
// one before; the k with the most summed probability are prefetched. Its guesses are scored like
// the stacked routers' (routing-recorder.h). Without statistics it does nothing.
#include "prefetch-strategy.h"

#include "expert-layout.h"
#include "path-predictor.h"
#include "prefetch-coordinator.h"
#include "routing-recorder.h"

#include <algorithm>
#include <map>

namespace {

class path_prefetch final : public prefetch_strategy {
public:
    explicit path_prefetch(const prefetch_env & env) : env_(env) {}

    const char * name() const override { return "edgemoe"; }

    void set_path_statistics(std::shared_ptr<const path_predictor> paths) override { paths_ = std::move(paths); }
    void on_ubatch() override { ubatch_ids_.clear(); }
    void on_routing(const moe_layer_layout & l, const std::vector<int32_t> & ids, bool) override {
        if (paths_) ubatch_ids_[l.il] = ids;
    }

    void after_wave(const served_wave & w) override {
        const expert_layout & layout = env_.layout;
        const moe_layer_layout * after = layout.after(w.layer);
        if (w.wave != 0 || !paths_ || !after) return;
        const int next = after->il, k = layout.n_expert_used;
        const std::vector<int32_t> & now = ubatch_ids_[w.layer.il];
        auto before = &w.layer == layout.layers.data() ? ubatch_ids_.end() : ubatch_ids_.find((&w.layer - 1)->il);
        // each token's top-k guess (scored when the next layer runs) and the summed probabilities
        std::vector<int32_t> guesses((size_t) w.n_tokens * k, -1);
        std::vector<float> total(layout.n_expert, 0.0f);
        for (int64_t t = 0; t < w.n_tokens; t++) {
            const std::vector<int> prev1(now.begin() + t * k, now.begin() + (t + 1) * k);
            const std::vector<int> prev2 = before == ubatch_ids_.end() ? std::vector<int>()
                : std::vector<int>(before->second.begin() + t * k, before->second.begin() + (t + 1) * k);
            const std::vector<float> * probs = paths_->lookup(next, prev2, prev1);
            if (!probs) continue;
            const std::vector<int> top = most_probable(*probs, k);
            std::copy(top.begin(), top.end(), guesses.begin() + t * k);
            for (int e = 0; e < layout.n_expert; e++) total[e] += (*probs)[e];
        }
        env_.recorder.remember(next, 0, 1, std::move(guesses));
        prefetch_coordinator & coordinator = env_.coordinator;
        if (!coordinator.prefetching() || w.n_tokens != 1 || coordinator.judged_useless()) return;  // prefetching serves decode
        std::vector<predicted_expert> predicted;
        for (int e : most_probable(total, k)) predicted.push_back({ next, e, env_.rules.fixed_or(next, e, expert_precision::high) });
        coordinator.prefetch(predicted, /*judged*/ true);
    }

private:
    prefetch_env env_;
    std::shared_ptr<const path_predictor> paths_;        // calibration's, once given
    std::map<int, std::vector<int32_t>> ubatch_ids_;     // the running ubatch's routing per il
};

}  // namespace

std::unique_ptr<prefetch_strategy> make_path_prefetch(const prefetch_env & env) { return std::make_unique<path_prefetch>(env); }
