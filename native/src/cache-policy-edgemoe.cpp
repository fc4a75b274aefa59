// EdgeMoE's eviction policy (EdgeMoE sec. 3.3.3): an expert is kept by the product of how often it
// was used and how soon its layer runs again. For the expert of layer i, with the layer I running
// now and S layers, the eviction score is 1 / (f * ((S - i + I) mod S)); we keep the largest
//   f * ((S - i + I) mod S)
// f: its uses since the run began (kept across evictions). (S - i + I) mod S is S - d for an
// expert d layers ahead, so the next layer's experts score highest and the current layer's 0 (its
// next use is a whole pass away). It differs from fld (1 - d/S: distance alone, the current layer
// first) and lfu (frequency alone) by multiplying the two. Ties go to the least recently used.
#include "cache-policy.h"

#include <unordered_map>
#include <unordered_set>

namespace {

struct edgemoe_policy final : cache_policy {
    struct record { uint64_t uses = 0, last_use = 0; };
    std::unordered_set<expert_key> cached;
    std::unordered_map<expert_key, record> records;
    uint64_t use_clock = 0;

    const char * name() const override { return "edgemoe"; }
    void on_insert(expert_key key) override { cached.insert(key); }
    void on_use(expert_key key, bool, const cache_clock &) override {
        record & r = records[key];
        r.uses++;
        r.last_use = ++use_clock;
    }
    void on_evict(expert_key key) override { cached.erase(key); }

    bool victim(const std::function<bool(expert_key)> & evictable, const cache_clock & now, expert_key,
                expert_key * out) const override {
        const int S = now.n_layers > 0 ? now.n_layers : 1;
        bool found = false;
        uint64_t best = 0, best_use = 0;
        static const record none;
        for (expert_key key : cached) {
            if (!evictable(key)) continue;
            auto it = records.find(key);
            const record & r = it == records.end() ? none : it->second;
            const uint64_t keep = r.uses * (uint64_t) (((S - expert_key_layer(key) + now.layer) % S + S) % S);
            if (!found || keep < best || (keep == best && (r.last_use < best_use || (r.last_use == best_use && key < *out)))) {
                found = true; best = keep; best_use = r.last_use; *out = key;
            }
        }
        return found;
    }
};

}  // namespace

std::unique_ptr<cache_policy> make_edgemoe_policy() { return std::make_unique<edgemoe_policy>(); }
