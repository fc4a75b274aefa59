#include "cache-policy.h"

#include <list>
#include <stdexcept>
#include <unordered_map>

namespace {

// Least recently used: a recency list, most recent at the front.
struct lru_policy final : cache_policy {
    std::list<expert_key> order;
    std::unordered_map<expert_key, std::list<expert_key>::iterator> where;

    const char * name() const override { return "lru"; }
    void on_insert(expert_key key) override { where[key] = order.insert(order.begin(), key); }
    void on_use(expert_key key) override {
        auto it = where.find(key);
        if (it != where.end()) order.splice(order.begin(), order, it->second);
    }
    void on_evict(expert_key key) override {
        auto it = where.find(key);
        if (it == where.end()) return;
        order.erase(it->second);
        where.erase(it);
    }
    bool victim(const std::function<bool(expert_key)> & evictable, expert_key * out) const override {
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
    void on_use(expert_key key) override {
        auto it = entries.find(key);
        if (it != entries.end()) { it->second.uses++; it->second.last_use = ++clock; }
    }
    void on_evict(expert_key key) override { entries.erase(key); }
    bool victim(const std::function<bool(expert_key)> & evictable, expert_key * out) const override {
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

}  // namespace

std::unique_ptr<cache_policy> make_cache_policy(const std::string & name) {
    if (name == "lru") return std::make_unique<lru_policy>();
    if (name == "lfu") return std::make_unique<lfu_policy>();
    throw std::invalid_argument("unknown cache policy '" + name + "' (lru, lfu)");
}
