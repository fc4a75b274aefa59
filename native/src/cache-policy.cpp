#include "cache-policy.h"

#include <list>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

namespace {

// Least recently used: a recency list, most recent at the front.
struct lru_policy final : cache_policy {
    std::list<expert_key> order;
    std::unordered_map<expert_key, std::list<expert_key>::iterator> where;

    const char * name() const override { return "lru"; }
    void on_insert(expert_key key) override { where[key] = order.insert(order.begin(), key); }
    void on_use(expert_key key, bool, const cache_clock &) override {
        auto it = where.find(key);
        if (it != where.end()) order.splice(order.begin(), order, it->second);
    }
    void on_evict(expert_key key) override {
        auto it = where.find(key);
        if (it == where.end()) return;
        order.erase(it->second);
        where.erase(it);
    }
    bool victim(const std::function<bool(expert_key)> & evictable, const cache_clock &, expert_key, expert_key * out) const override {
        for (auto it = order.rbegin(); it != order.rend(); ++it) {
            if (evictable(*it)) { *out = *it; return true; }
        }
        return false;
    }
};

// Least frequently used: uses since insertion; ties go to the least recently used.
struct lfu_policy final : cache_policy {
    struct entry { uint64_t uses; uint64_t last_use; };
    std::unordered_map<expert_key, entry> entries;
    uint64_t clock = 0;

    const char * name() const override { return "lfu"; }
    void on_insert(expert_key key) override { entries[key] = {0, ++clock}; }
    void on_use(expert_key key, bool, const cache_clock &) override {
        auto it = entries.find(key);
        if (it != entries.end()) { it->second.uses++; it->second.last_use = ++clock; }
    }
    void on_evict(expert_key key) override { entries.erase(key); }
    bool victim(const std::function<bool(expert_key)> & evictable, const cache_clock &, expert_key, expert_key * out) const override {
        bool found = false;
        entry best{};
        for (const auto & [key, e] : entries) {
            if (!evictable(key)) continue;
            if (!found || e.uses < best.uses || (e.uses == best.uses && e.last_use < best.last_use)) {
                found = true; best = e; *out = key;
            }
        }
        return found;
    }
};

// HOBBIT's multidimensional priority (sec. 3.4, eq. 3); the lowest is evicted:
//   p_t = w_lru R_t/T + w_lfu F_t/T + w_lhu H_t/T + w_fld (1 - ((l_t - l_i + L) mod L) / L)
// R_t: token of the last use, F_t: uses, H_t: HIGH-precision uses, all in this sequence; T: tokens
// so far; l_t: the expert's layer, l_i: the layer running now, L: layers. "lhu" and "fld" are the
// single terms. Ties go to the least recently used.
struct weighted_policy final : cache_policy {
    struct record { uint64_t last_token = 0, uses = 0, high_uses = 0, last_use = 0; };
    std::string policy_name;
    hobbit_weights w;
    std::unordered_set<expert_key> cached;
    std::unordered_map<expert_key, record> records;  // per sequence, kept across evictions
    uint64_t use_clock = 0;

    weighted_policy(std::string n, const hobbit_weights & weights) : policy_name(std::move(n)), w(weights) {}

    const char * name() const override { return policy_name.c_str(); }
    void on_insert(expert_key key) override { cached.insert(key); }
    void on_use(expert_key key, bool high, const cache_clock & now) override {
        record & r = records[key];
        r.last_token = now.token;
        r.uses++;
        r.high_uses += high ? 1 : 0;
        r.last_use = ++use_clock;
    }
    void on_evict(expert_key key) override { cached.erase(key); }
    void reset_sequence() override { records.clear(); }

    double priority(expert_key key, const record & r, const cache_clock & now) const {
        const double T = (double) (now.token ? now.token : 1);
        const int L = now.n_layers > 0 ? now.n_layers : 1;
        const int distance = ((expert_key_layer(key) - now.layer) % L + L) % L;
        return w[0] * r.last_token / T + w[1] * r.uses / T + w[2] * r.high_uses / T + w[3] * (1.0 - (double) distance / L);
    }

    bool victim(const std::function<bool(expert_key)> & evictable, const cache_clock & now, expert_key, expert_key * out) const override {
        bool found = false;
        double best = 0;
        uint64_t best_use = 0;
        static const record none;
        for (expert_key key : cached) {
            if (!evictable(key)) continue;
            auto it = records.find(key);
            const record & r = it == records.end() ? none : it->second;
            const double p = priority(key, r, now);
            if (!found || p < best || (p == best && (r.last_use < best_use || (r.last_use == best_use && key < *out)))) {
                found = true; best = p; best_use = r.last_use; *out = key;
            }
        }
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
