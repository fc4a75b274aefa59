// Decayed frequency: an expert is kept by how often it was used lately, each use worth half as much
// DECAY_HALF_LIFE tokens later; the least is evicted, ties to the least recently used. Between lfu
// (every use counts forever: experts that were hot early squat) and lru (only the last use counts:
// an expert used every other token goes as soon as a burst of others passes), it follows the drift
// of routing within a text. On the demo model's routing it needs 1.6x the loads of Belady's MIN at
// a 25 % cache where lru needs 1.9x (docs/benchmarks.md, "The cache against its limit").
//
// The score of an expert used at tokens t_i is sum 2^-((T - t_i) / H) at token T. Kept as
// level = log2(score at T) + T / H, which does not change while the expert goes unused, so levels
// compare across experts without decaying anything; records outlive evictions and sequences.
#include "cache-policy.h"
#include "policy-heap.h"

#include <cmath>

namespace {

constexpr double DECAY_HALF_LIFE = 16.0;  // tokens; 8 to 32 do about as well on the demo's routing

struct decay_policy final : cache_policy {
    struct record { double level = -INFINITY; uint64_t last_use = 0; };
    // the cached keys in eviction order: the lowest level first, ties to the least recently used,
    // then the lower key (a scan of every cached key per miss cost 6 ms a token at 1536 slots)
    policy_heap<std::pair<double, uint64_t>> order;
    expert_table<record> records;
    uint64_t use_clock = 0;
    double sequence_start = 0;  // tokens of the sequences before this one: the clock never goes back
    double last_token = 0;

    const char * name() const override { return "decay"; }
    void on_insert(expert_key key) override {
        const record & r = records[key];
        order.insert(key, { r.level, r.last_use });
    }
    void on_use(expert_key key, bool, const cache_clock & now) override {
        last_token = sequence_start + (double) now.token;
        const double age = last_token / DECAY_HALF_LIFE;
        record & r = records[key];
        r.level = std::log2(std::exp2(r.level - age) + 1.0) + age;
        r.last_use = ++use_clock;
        order.update(key, { r.level, r.last_use });
    }
    void on_evict(expert_key key) override { order.erase(key); }
    void reset_sequence() override { sequence_start = last_token + 1; }

    bool victim(const std::function<bool(expert_key)> & evictable, const cache_clock &, expert_key,
                expert_key * out) const override {
        const auto * first = order.first(evictable);
        if (first) *out = first->key;
        return first != nullptr;
    }
};

}  // namespace

std::unique_ptr<cache_policy> make_decay_policy() { return std::make_unique<decay_policy>(); }
