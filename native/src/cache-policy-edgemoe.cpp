// EdgeMoE's eviction policy (EdgeMoE sec. 3.3.3): an expert is kept by the product of how often it
// was used and how soon its layer runs again. For the expert of layer i, with the layer I running
// now and S layers, the eviction score is 1 / (f * ((S - i + I) mod S)); we keep the largest
//   f * ((S - i + I) mod S)
// f: its uses since the run began (kept across evictions). (S - i + I) mod S is S - d for an
// expert d layers ahead, so the next layer's experts score highest and the current layer's 0 (its
// next use is a whole pass away). It differs from fld (1 - d/S: distance alone, the current layer
// first) and lfu (frequency alone) by multiplying the two. Ties go to the least recently used.
#include "cache-policy.h"
#include "policy-heap.h"

#include <tuple>

namespace {

struct edgemoe_policy final : cache_policy {
    struct record { uint64_t uses = 0, last_use = 0; };
    using layer_order = policy_heap<std::pair<uint64_t, uint64_t>>;  // (uses, last use)
    // the cached experts of each layer, the fewest uses first: within a layer the distance factor
    // is the same for all
    layer_heaps<std::pair<uint64_t, uint64_t>> order;
    expert_table<record> records;
    uint64_t use_clock = 0;

    std::pair<uint64_t, uint64_t> priority_of(expert_key key) { const record & r = records[key]; return { r.uses, r.last_use }; }
    const char * name() const override { return "edgemoe"; }
    void on_insert(expert_key key) override { order.of(key).insert(key, priority_of(key)); }
    void on_use(expert_key key, bool, const cache_clock &) override {
        record & r = records[key];
        r.uses++;
        r.last_use = ++use_clock;
        order.of(key).update(key, priority_of(key));
    }
    void on_evict(expert_key key) override { order.of(key).erase(key); }

    bool victim(const std::function<bool(expert_key)> & evictable, const cache_clock & now, expert_key,
                expert_key * out) const override {
        const int S = now.n_layers > 0 ? now.n_layers : 1;
        bool found = false;
        std::tuple<uint64_t, uint64_t, expert_key> best;  // (keep, last use, key), the lowest evicted
        const auto consider = [&](uint64_t factor, const layer_order::node & n) {
            const std::tuple<uint64_t, uint64_t, expert_key> candidate = { n.priority.first * factor, n.priority.second, n.key };
            if (!found || candidate < best) { found = true; best = candidate; }
        };
        for (size_t layer = 0; layer < order.by_layer.size(); layer++) {
            const int ahead = layers_ahead((int) layer, now);
            const uint64_t factor = ahead ? (uint64_t) (S - ahead) : 0;  // (S - i + I) mod S
            const layer_order & experts = order.by_layer[layer];
            if (factor > 0) {
                if (const auto * first = experts.first(evictable)) consider(factor, *first);
                continue;
            }
            for (const auto & n : experts.nodes()) {  // every keep is 0: the least recently used of the layer
                if (evictable(n.key)) consider(factor, n);
            }
        }
        if (found) *out = std::get<2>(best);
        return found;
    }
};

}  // namespace

std::unique_ptr<cache_policy> make_edgemoe_policy() { return std::make_unique<edgemoe_policy>(); }
