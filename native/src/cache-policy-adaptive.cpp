// Adaptive: lru or decay, whichever would have hit more lately (set dueling, as in Qureshi et al.'s
// DIP, 2007, with every request sampled). Each candidate runs a shadow cache of the tier's size:
// keys only, filled by the requests alone (no prefetch, no fill), evicting by its own rule and
// never a key the running layer asked for already. Their hits are counted with a half-life of
// ADAPTIVE_HALF_LIFE tokens; the real cache evicts by the rule of the one with more, switching
// only when the other leads by ADAPTIVE_MARGIN. It starts as lru, the uncalibrated default.
// The lead is in hits, not misses: at the hit rates of 10-30 % of a tier beside LOW copies or of
// random routers, a fifth more hits is a few percent fewer misses, which a margin on misses never
// saw (it stayed lru where decay's replayed miss penalty was 4-7 % lower, docs/benchmarks.md).
//
// Why: decay reads 30-42 % fewer bytes than lru on trained models' routing, but where greedy text
// falls into a loop that fits the cache lru keeps the loop and decay reads 3-10 % more
// (docs/benchmarks.md); neither is the better everywhere, and the routing says which it is.
#include "cache-policy.h"

#include <array>
#include <cmath>

namespace {

constexpr double ADAPTIVE_HALF_LIFE = 16.0;  // tokens (64 followed decay's lead beside LOW copies less often)
constexpr double ADAPTIVE_MARGIN = 0.10;     // the other must hit 10 % more to take over (5 %: switching on random routers read 0.7 % more)

constexpr std::array<cache_policy_kind, 2> CANDIDATES = { cache_policy_kind::lru, cache_policy_kind::decay };

// One candidate's shadow cache: which keys it would hold, and its hits (decayed).
struct shadow {
    std::unique_ptr<cache_policy> rule;
    struct request_record { bool held = false; uint64_t token = 0; int layer = 0; };  // the last request's
    expert_table<request_record> requests;
    int n_held = 0;
    double hits = 0;

    void request(expert_key key, bool high, const cache_clock & now, int n_slots) {
        if (requests[key].held) hits += 1;
        if (!requests[key].held) {
            if (n_held >= n_slots) {
                expert_key out = 0;
                const bool found = rule->victim([&](expert_key k) {
                    const request_record & last = *requests.find(k);
                    return last.token != now.token || last.layer != now.layer;  // not asked for by this layer yet
                }, now, key, &out);
                if (!found) return;  // every key serves the running layer: this one is not kept
                rule->on_evict(out);
                requests[out].held = false;
                n_held--;
            }
            rule->on_insert(key);
            n_held++;
        }
        requests[key] = { true, now.token, now.layer };
        rule->on_use(key, high, now);
    }
};

struct adaptive_policy final : cache_policy {
    std::array<std::unique_ptr<cache_policy>, CANDIDATES.size()> real;  // each tracks the real cached set
    std::array<shadow, CANDIDATES.size()> shadows;
    int n_slots;
    size_t leader = 0;
    uint64_t last_token = 0;

    adaptive_policy(const hobbit_weights & weights, const cache_tier_shape & shape) : n_slots(shape.n_slots) {
        for (size_t i = 0; i < CANDIDATES.size(); i++) {
            real[i] = make_cache_policy(CANDIDATES[i], weights, shape);
            shadows[i].rule = make_cache_policy(CANDIDATES[i], weights, shape);
        }
    }

    const char * name() const override { return "adaptive"; }
    void on_insert(expert_key key) override { for (auto & p : real) p->on_insert(key); }
    void on_evict(expert_key key) override { for (auto & p : real) p->on_evict(key); }
    void on_use(expert_key key, bool high, const cache_clock & now) override {
        if (now.token > last_token) {
            const double keep = std::exp2(-(double) (now.token - last_token) / ADAPTIVE_HALF_LIFE);
            for (auto & s : shadows) s.hits *= keep;
        }
        last_token = now.token;  // a new sequence restarts the clock
        for (auto & p : real) p->on_use(key, high, now);
        for (auto & s : shadows) s.request(key, high, now, n_slots);
        for (size_t i = 0; i < shadows.size(); i++) {
            if (shadows[i].hits > shadows[leader].hits * (1.0 + ADAPTIVE_MARGIN)) leader = i;
        }
    }
    void reset_sequence() override {
        for (auto & p : real) p->reset_sequence();
        for (auto & s : shadows) s.rule->reset_sequence();
    }
    bool victim(const std::function<bool(expert_key)> & evictable, const cache_clock & now, expert_key incoming,
                expert_key * out) const override {
        return real[leader]->victim(evictable, now, incoming, out);
    }
};

}  // namespace

std::unique_ptr<cache_policy> make_adaptive_policy(const hobbit_weights & weights, const cache_tier_shape & shape) {
    return std::make_unique<adaptive_policy>(weights, shape);
}
