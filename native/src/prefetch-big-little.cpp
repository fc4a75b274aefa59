// MoBiLE's fallback prefetch (MoBiLE sec. III-B): a decode token computed little (its top-k/2)
// whose top output probability is too low is redone with its whole top-k. The little pass's
// routers already chose that top-k in every layer, so the big pass's experts are prefetched from
// those choices before it runs.
#include "prefetch-strategy.h"

#include "expert-layout.h"
#include "prefetch-coordinator.h"

#include <algorithm>
#include <map>

namespace {

class big_little_prefetch final : public prefetch_strategy {
public:
    explicit big_little_prefetch(const prefetch_env & env) : env_(env) {}

    const char * name() const override { return "big-little"; }

    void on_routing(const moe_layer_layout & l, const std::vector<int32_t> & ids, bool little) override {
        if (little) choices_[l.il] = ids;
    }

    int before_redo() override {
        std::vector<predicted_expert> predicted;
        for (const auto & [il, ids] : choices_) {
            std::vector<int> distinct(ids.begin(), ids.end());
            std::sort(distinct.begin(), distinct.end());
            distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
            for (int e : distinct) predicted.push_back({ il, e, env_.rules.fixed_or(il, e, expert_precision::high) });
        }
        choices_.clear();
        if (!env_.coordinator.prefetching()) return 0;
        env_.coordinator.prefetch(predicted);
        return (int) predicted.size();
    }

private:
    prefetch_env env_;
    std::map<int, std::vector<int32_t>> choices_;  // per il, the last little token's whole top-k
};

}  // namespace

std::unique_ptr<prefetch_strategy> make_big_little_prefetch(const prefetch_env & env) {
    return std::make_unique<big_little_prefetch>(env);
}
