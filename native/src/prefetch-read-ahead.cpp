// Prefill's read-ahead. A layer run in pipelined waves (a prefill under a small cache: each wave
// takes half the slots) reads its next wave's planned experts, in their planned precisions, while
// the wave before computes. After a layer's last wave, a ubatch that needs nearly every expert of
// the next layer reads them all into the slots this one leaves; with LOW copies the next layer's
// precisions come from its predicted routing instead (prefetch-prefill-guess.cpp).
#include "prefetch-strategy.h"

#include "expert-layout.h"
#include "prefetch-coordinator.h"

namespace {

class read_ahead final : public prefetch_strategy {
public:
    explicit read_ahead(const prefetch_env & env) : env_(env) {}

    const char * name() const override { return "read-ahead"; }

    void after_wave(const served_wave & w) override {
        prefetch_coordinator & coordinator = env_.coordinator;
        const bool next_wave = w.next_wave_planned();
        if (next_wave || w.planned_waves.size() > 1) {
            if (!w.pipelined) return;  // the next wave needs every slot
            coordinator.settle(w.layer.il);  // the experts read ahead for this wave are pinned by it now
        }
        if (next_wave) {
            std::vector<predicted_expert> experts;
            for (const auto & d : w.planned_waves[w.wave + 1]) experts.push_back({ w.layer.il, d.first, d.second });
            coordinator.prefetch(experts);
            return;
        }
        const moe_layer_layout * next = w.next_layer_to_read(env_.layout);
        if (!next || env_.layout.has_low) return;
        std::vector<predicted_expert> all;
        for (int e = 0; e < env_.layout.n_expert; e++) all.push_back({ next->il, e, env_.rules.fixed_or(next->il, e, expert_precision::high) });
        coordinator.prefetch(all);
    }

private:
    prefetch_env env_;
};

}  // namespace

std::unique_ptr<prefetch_strategy> make_read_ahead(const prefetch_env & env) { return std::make_unique<read_ahead>(env); }
