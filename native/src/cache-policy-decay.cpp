// Decayed frequency: an expert is kept by how soon it is expected back: the tokens its decayed
// frequency says it is away (each use worth half as much DECAY_HALF_LIFE tokens later) plus how far
// its layer is from the layer running now. Between lfu (every use counts forever: experts that were
// hot early squat) and lru (only the last use counts: an expert used every other token goes as soon
// as a burst of others passes), it follows the drift of routing within a text. On the demo model's
// routing it needs 1.6x the loads of Belady's MIN at a 25 % cache where lru needs 1.8x
// (docs/benchmarks.md, "The cache against its limit").
//
// The score of an expert used at tokens t_i is s = sum 2^-((T - t_i) / H) at token T: a rate of
// s (1 - 2^(-1/H)) uses a token, so about 1 / that tokens until the next. Kept as
// level = log2(s at T) + T / H, which does not change while the expert goes unused, so levels
// order a layer's experts without decaying anything; records outlive evictions and sequences.
// The layer's distance: all of a layer's experts wait the same layers for their next chance, the
// layer just run's a whole token. Counting that (DECAY_LAYER_TOKENS for a whole token) took 2-4 %
// off decay's loads on both trained models (2 % on random routing); in a scan over the layers it
// evicts the expert used again last, as Belady's MIN does (docs/benchmarks.md, "What the next
// layer is worth"; tests/test_belady.py).
#include "cache-policy.h"
#include "policy-heap.h"

#include <cmath>
#include <tuple>

namespace {

constexpr double DECAY_HALF_LIFE = 16.0;  // tokens; 8 to 32 do about as well on the demo's routing
// a whole token of layer distance weighs as this many tokens of expected absence: 8 to 64 did about
// as well on both trained models' routing, 1 (the distance taken at its face value) half as well
constexpr double DECAY_LAYER_TOKENS = 16.0;

struct decay_policy final : cache_policy {
    struct record { double level = -INFINITY; uint64_t last_use = 0; };
    // each layer's cached keys, the lowest level first, ties to the least recently used, then the lower key
    layer_heaps<std::pair<double, uint64_t>> order;
    expert_table<record> records;
    uint64_t use_clock = 0;
    double sequence_start = 0;  // tokens of the sequences before this one: the clock never goes back
    double last_token = 0;

    const char * name() const override { return "decay"; }
    void on_insert(expert_key key) override {
        const record & r = records[key];
        order.of(key).insert(key, { r.level, r.last_use });
    }
    void on_use(expert_key key, bool, const cache_clock & now) override {
        last_token = sequence_start + (double) now.token;
        const double age = last_token / DECAY_HALF_LIFE;
        record & r = records[key];
        r.level = std::log2(std::exp2(r.level - age) + 1.0) + age;
        r.last_use = ++use_clock;
        order.of(key).update(key, { r.level, r.last_use });
    }
    void on_evict(expert_key key) override { order.of(key).erase(key); }
    void reset_sequence() override { sequence_start = last_token + 1; }

    // the evictable key expected back last: of each layer its lowest level, weighed across layers
    bool victim(const std::function<bool(expert_key)> & evictable, const cache_clock & now, expert_key,
                expert_key * out) const override {
        static const double per_token = 1.0 - std::exp2(-1.0 / DECAY_HALF_LIFE);  // a use's share of s's sum
        const double age = (sequence_start + (double) now.token) / DECAY_HALF_LIFE;
        const int L = now.n_layers > 0 ? now.n_layers : 1;
        bool found = false;
        std::tuple<double, uint64_t, expert_key> best;  // (-tokens away, last use, key)
        for (size_t layer = 0; layer < order.by_layer.size(); layer++) {
            const auto * first = order.by_layer[layer].first(evictable);
            if (!first) continue;
            const int distance = layers_ahead((int) layer, now);
            const double layers_away = (double) (distance ? distance : L) / L;
            const double away = std::exp2(age - first->priority.first) / per_token + DECAY_LAYER_TOKENS * layers_away;
            const std::tuple<double, uint64_t, expert_key> candidate = { -away, first->priority.second, first->key };
            if (!found || candidate < best) { found = true; best = candidate; }
        }
        if (found) *out = std::get<2>(best);
        return found;
    }
};

}  // namespace

std::unique_ptr<cache_policy> make_decay_policy() { return std::make_unique<decay_policy>(); }
