#include "cache-policy.h"
#include "policy-heap.h"

#include <stdexcept>
#include <tuple>

namespace {

// Least recently used: a recency list, most recent at the front, linked through the experts' records.
struct lru_policy final : cache_policy {
    struct link { expert_key newer = 0, older = 0; bool cached = false; };
    expert_table<link> links;
    expert_key newest = 0, oldest = 0;
    size_t n_cached = 0;

    void unlink(expert_key key) {
        link & l = links[key];
        if (l.newer != key) links[l.newer].older = l.older == key ? l.newer : l.older;
        if (l.older != key) links[l.older].newer = l.newer == key ? l.older : l.newer;
        if (newest == key) newest = l.older;
        if (oldest == key) oldest = l.newer;
        l.cached = false;
        n_cached--;
    }
    void push_front(expert_key key) {  // a list's ends link to themselves
        link & l = links[key];
        l = { key, n_cached ? newest : key, true };
        if (n_cached) links[newest].newer = key;
        else oldest = key;
        newest = key;
        n_cached++;
    }

    const char * name() const override { return "lru"; }
    void on_insert(expert_key key) override {
        if (links[key].cached) unlink(key);
        push_front(key);
    }
    void on_use(expert_key key, bool, const cache_clock &) override {
        if (!links[key].cached || newest == key) return;
        unlink(key);
        push_front(key);
    }
    void on_evict(expert_key key) override {
        if (links[key].cached) unlink(key);
    }
    bool victim(const std::function<bool(expert_key)> & evictable, const cache_clock &, expert_key, expert_key * out) const override {
        expert_key key = oldest;
        for (size_t i = 0; i < n_cached; i++, key = links.find(key)->newer) {
            if (evictable(key)) { *out = key; return true; }
        }
        return false;
    }
};

// Least frequently used: uses since insertion; ties go to the least recently used. The cached
// experts are kept in that order.
struct lfu_policy final : cache_policy {
    policy_heap<std::pair<uint64_t, uint64_t>> order;  // (uses, last use)
    uint64_t clock = 0;

    const char * name() const override { return "lfu"; }
    void on_insert(expert_key key) override {
        order.erase(key);
        order.insert(key, { 0, ++clock });
    }
    void on_use(expert_key key, bool, const cache_clock &) override {
        if (const auto * p = order.find(key)) order.update(key, { p->first + 1, ++clock });
    }
    void on_evict(expert_key key) override { order.erase(key); }
    bool victim(const std::function<bool(expert_key)> & evictable, const cache_clock &, expert_key, expert_key * out) const override {
        const auto * first = order.first(evictable);
        if (first) *out = first->key;
        return first != nullptr;
    }
};

// HOBBIT's multidimensional priority (sec. 3.4, eq. 3); the lowest is evicted:
//   p_t = w_lru R_t/T + w_lfu F_t/T + w_lhu H_t/T + w_fld (1 - ((l_t - l_i + L) mod L) / L)
// R_t: token of the last use, F_t: uses, H_t: HIGH-precision uses, all in this sequence; T: tokens
// so far; l_t: the expert's layer, l_i: the layer running now, L: layers. "lhu" and "fld" are the
// single terms. Ties go to the least recently used.
// Within a layer the last term is the same for every expert and the rest is a sum over T: each
// layer keeps its cached experts ordered by that sum, and the victim is the best of the layers'
// first evictable ones.
struct weighted_policy final : cache_policy {
    struct record { uint64_t last_token = 0, uses = 0, high_uses = 0, last_use = 0; };
    using layer_order = policy_heap<std::pair<double, uint64_t>>;  // (w_lru R + w_lfu F + w_lhu H, last use)
    std::string policy_name;
    hobbit_weights w;
    layer_heaps<std::pair<double, uint64_t>> order;  // the cached experts of each layer, the lowest first
    expert_table<record> records;  // per sequence, kept across evictions
    uint64_t use_clock = 0;

    weighted_policy(std::string n, const hobbit_weights & weights) : policy_name(std::move(n)), w(weights) {}

    std::pair<double, uint64_t> priority_of(expert_key key) const {
        const record * found = records.find(key);
        const record r = found ? *found : record{};
        return { w[0] * r.last_token + w[1] * r.uses + w[2] * r.high_uses, r.last_use };
    }
    const char * name() const override { return policy_name.c_str(); }
    void on_insert(expert_key key) override { order.of(key).insert(key, priority_of(key)); }
    void on_use(expert_key key, bool high, const cache_clock & now) override {
        record & r = records[key];
        r.last_token = now.token;
        r.uses++;
        r.high_uses += high ? 1 : 0;
        r.last_use = ++use_clock;
        order.of(key).update(key, priority_of(key));
    }
    void on_evict(expert_key key) override { order.of(key).erase(key); }
    void reset_sequence() override {
        records = {};
        for (layer_order & layer : order.by_layer) {
            layer_order fresh;
            for (const auto & n : layer.nodes()) fresh.insert(n.key, priority_of(n.key));
            layer = std::move(fresh);
        }
    }

    bool victim(const std::function<bool(expert_key)> & evictable, const cache_clock & now, expert_key, expert_key * out) const override {
        const double T = (double) (now.token ? now.token : 1);
        const int L = now.n_layers > 0 ? now.n_layers : 1;
        bool found = false;
        std::tuple<double, uint64_t, expert_key> best;  // (priority, last use, key)
        for (size_t layer = 0; layer < order.by_layer.size(); layer++) {
            const int distance = layers_ahead((int) layer, now);
            const auto * first = order.by_layer[layer].first(evictable);  // the layer's first evictable one is its best
            if (!first) continue;
            const std::tuple<double, uint64_t, expert_key> candidate = {
                first->priority.first / T + w[3] * (1.0 - (double) distance / L), first->priority.second, first->key };
            if (!found || candidate < best) { found = true; best = candidate; }
        }
        if (found) *out = std::get<2>(best);
        return found;
    }
};

}  // namespace

std::unique_ptr<cache_policy> make_cache_policy(cache_policy_kind kind, const hobbit_weights & weights,
                                                const cache_tier_shape & shape) {
    const std::string name = name_of(kind);
    switch (kind) {
        case cache_policy_kind::lru:    return std::make_unique<lru_policy>();
        case cache_policy_kind::lfu:    return std::make_unique<lfu_policy>();
        case cache_policy_kind::lhu:    return std::make_unique<weighted_policy>(name, hobbit_weights{0, 0, 1, 0});
        case cache_policy_kind::fld:    return std::make_unique<weighted_policy>(name, hobbit_weights{0, 0, 0, 1});
        case cache_policy_kind::hobbit: return std::make_unique<weighted_policy>(name, weights);
        case cache_policy_kind::edgemoe: return make_edgemoe_policy();
        case cache_policy_kind::fate:   return make_fate_policy(shape);
        case cache_policy_kind::decay:  return make_decay_policy();
        case cache_policy_kind::adaptive: return make_adaptive_policy(weights, shape);
    }
    throw std::invalid_argument("unknown cache policy");
}
